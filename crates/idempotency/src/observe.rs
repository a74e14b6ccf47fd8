//! What the store tells an application's metrics: every claim with its outcome and time, every
//! committed phase with the recovery point it reached and its time. Logs and traces need no
//! hook: the store's statements run in `tracing` spans (`idempotency.claim`, `idempotency.phase`,
//! `idempotency.final_phase`, `idempotency.call`) carrying the key, the fencing token and the
//! recovery point, and the lease's life is logged on [`crate::LEASE_LOG`].
//!
//! ```
//! use std::time::Duration;
//! use idempotency::{ClaimOutcome, Observer};
//!
//! /// Counts claims by outcome (a stand-in for a Prometheus counter).
//! #[derive(Default)]
//! struct Counts(std::sync::Mutex<std::collections::HashMap<&'static str, u64>>);
//!
//! impl Observer for Counts {
//!     fn claimed(&self, _route: &str, outcome: ClaimOutcome, _took: Duration) {
//!         *self.0.lock().unwrap().entry(outcome.name()).or_default() += 1;
//!     }
//! }
//! // Store::new(pool, clock, ttl)?.with_observer(Arc::new(Counts::default()))
//! ```

use std::sync::Arc;
use std::time::Duration;

use crate::store::{Begun, Claim, RecoveryPoint};

/// Hooks the store calls as keys move. Every method does nothing by default: implement those
/// you measure. They are called on the request's task, after the statement: keep them quick
/// (increment a counter, record a histogram).
pub trait Observer: Send + Sync + 'static {
    /// A claim ([`crate::Store::claim`], [`crate::Store::begin`],
    /// [`crate::Store::begin_optimistic`]) of a key of `route` answered `outcome`, after `took`
    /// (the read and, for a new or abandoned key, the write that claims it). Claims that failed
    /// with an error are not reported.
    fn claimed(&self, route: &str, outcome: ClaimOutcome, took: Duration) {
        let _ = (route, outcome, took);
    }

    /// A phase committed, leaving its key at recovery point `point` (`finished` for the final
    /// phase), `took` from its opening to its commit, the application's writes included.
    fn phase_committed(&self, point: &'static str, took: Duration) {
        let _ = (point, took);
    }
}

/// The observer of a store that was given none.
#[derive(Debug, Clone, Copy, Default)]
struct Unobserved;

impl Observer for Unobserved {}

/// A store's observer, shared by the phases it opens.
#[derive(Clone)]
pub(crate) struct Observed(Arc<dyn Observer>);

impl Observed {
    pub(crate) fn new(observer: Arc<dyn Observer>) -> Self {
        Self(observer)
    }

    pub(crate) fn none() -> Self {
        Self(Arc::new(Unobserved))
    }
}

impl std::ops::Deref for Observed {
    type Target = dyn Observer;

    fn deref(&self) -> &Self::Target {
        &*self.0
    }
}

impl std::fmt::Debug for Observed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Observed")
    }
}

/// How a claim ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClaimOutcome {
    /// The caller holds the lease: a new key, or an unfinished one taken over.
    Acquired,
    /// The key finished earlier with the same payload: its answer is replayed.
    Replayed,
    /// The key was used with another payload.
    Mismatch,
    /// Another holder has the lease.
    InFlight,
}

impl ClaimOutcome {
    /// A name for a metric's label: `acquired`, `replayed`, `mismatch`, `in_flight`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Acquired => "acquired",
            Self::Replayed => "replayed",
            Self::Mismatch => "mismatch",
            Self::InFlight => "in_flight",
        }
    }

    pub(crate) fn of_claim<P>(claim: &Claim<P>) -> Self {
        match claim {
            Claim::Acquired(_) => Self::Acquired,
            Claim::Replay(_) => Self::Replayed,
            Claim::Mismatch => Self::Mismatch,
            Claim::InFlight { .. } => Self::InFlight,
        }
    }

    pub(crate) fn of_begun<P: RecoveryPoint>(begun: &Begun<P>) -> Self {
        match begun {
            Begun::New(_) => Self::Acquired,
            Begun::Existing(claim) => Self::of_claim(claim),
        }
    }
}
