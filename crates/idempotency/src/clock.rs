//! Where "now" comes from.
//!
//! Every statement that compares against the current time takes it as an optional parameter,
//! `coalesce($n::timestamptz, now())`. In production the clock yields `None` and PostgreSQL's own
//! `now()` decides: one clock for every API process, whatever their hosts' clocks say. Tests use a
//! [`ManualClock`] and move time forward to expire a lease, instead of sleeping.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use time::OffsetDateTime;

/// A source of the current time for lease arithmetic.
pub trait Clock: Send + Sync + 'static {
    /// The current time, or `None` to use the database server's `now()`.
    fn now(&self) -> Option<OffsetDateTime>;
}

/// The production clock: the database server's `now()`.
#[derive(Debug, Clone, Copy, Default)]
pub struct DatabaseClock;

impl Clock for DatabaseClock {
    fn now(&self) -> Option<OffsetDateTime> {
        None
    }
}

/// A clock that stands still until a test moves it. Clones share the same time.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<Mutex<OffsetDateTime>>);

impl ManualClock {
    /// A clock set to `start`.
    pub fn new(start: OffsetDateTime) -> Self {
        Self(Arc::new(Mutex::new(start)))
    }

    /// A clock set to the current wall-clock time, so that rows it writes look recent.
    pub fn starting_now() -> Self {
        Self::new(OffsetDateTime::now_utc())
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        // A poisoned lock only means another test thread panicked; the time value is still valid.
        let mut now = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *now += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Option<OffsetDateTime> {
        Some(*self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}
