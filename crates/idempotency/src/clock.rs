//! Where "now" comes from.
//!
//! Every statement that compares against the current time takes it as an optional parameter,
//! `coalesce($n::timestamptz, now())`. In production the clock yields `None` and PostgreSQL's own
//! `now()` decides: one clock for every API process, whatever their hosts' clocks say. Tests use a
//! [`ManualClock`] and move time forward to expire a lease, instead of sleeping.
//!
//! A holder also times its own lease, on a second clock: [`Clock::monotonic`], this process's
//! steady time, which no other host's clock and no wall-clock step can move. It is what
//! [`crate::Store::lease_left`] measures, from before the statement that set the lease was sent.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use time::OffsetDateTime;

/// A source of the current time for lease arithmetic.
pub trait Clock: Send + Sync + 'static {
    /// The current time, or `None` to use the database server's `now()`.
    fn now(&self) -> Option<OffsetDateTime>;

    /// This process's steady time, as a duration since a fixed point of the process's own: only
    /// differences between two readings mean anything. By default the operating system's
    /// monotonic clock.
    fn monotonic(&self) -> Duration {
        static START: OnceLock<Instant> = OnceLock::new();
        START.get_or_init(Instant::now).elapsed()
    }
}

/// The production clock: the database server's `now()`.
#[derive(Debug, Clone, Copy, Default)]
pub struct DatabaseClock;

impl Clock for DatabaseClock {
    fn now(&self) -> Option<OffsetDateTime> {
        None
    }
}

/// A clock that stands still until a test moves it. Clones share the same time. Its
/// [`Clock::monotonic`] time starts at zero and moves with it, so that a test that moves the
/// clock past a lease also moves the holder's own measure of that lease.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<Mutex<(OffsetDateTime, Duration)>>);

impl ManualClock {
    /// A clock set to `start`.
    pub fn new(start: OffsetDateTime) -> Self {
        Self(Arc::new(Mutex::new((start, Duration::ZERO))))
    }

    /// A clock set to the current wall-clock time, so that rows it writes look recent.
    pub fn starting_now() -> Self {
        Self::new(OffsetDateTime::now_utc())
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        // A poisoned lock only means another test thread panicked; the time value is still valid.
        let mut now = self.0.lock().unwrap_or_else(|e| e.into_inner());
        now.0 += by;
        now.1 += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Option<OffsetDateTime> {
        Some(self.0.lock().unwrap_or_else(|e| e.into_inner()).0)
    }

    fn monotonic(&self) -> Duration {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).1
    }
}
