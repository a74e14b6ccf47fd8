#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

pub mod canonical;
pub mod clock;
pub mod commit_watch;
mod error;
mod fingerprint;
pub mod guide;
pub mod key;
pub mod lease;
pub mod migrate;
pub mod observe;
pub mod owner;
mod points;
mod response;
pub mod runner;
pub mod store;
pub mod workflow;

#[doc(hidden)]
pub mod __private {
    //! What [`recovery_points!`](crate::recovery_points) expands to; not an API.
    pub use crate::points::names_are_valid;
}

// The root: the one path (a workflow run by the store, its answer, the completer and the reaper)
// in 21 names, `recovery_points!` included. Experts' tools are in the modules: `store` (the
// claim, phases, leases, statements, the builder), `runner` (the closure-based completer),
// `migrate`, `observe`, `lease`, `commit_watch`, `key`, `owner`, `canonical`.
pub use clock::{Clock, DatabaseClock, ManualClock};
pub use error::Error;
pub use fingerprint::Fingerprint;
pub use key::IdempotencyKey;
pub use migrate::migrate;
pub use owner::Owner;
pub use response::StoredResponse;
pub use runner::Reaper;
pub use store::{RecoveryPoint, Store};
/// The time type of [`ManualClock::new`], [`Clock::now`] and the store's timestamps.
pub use time::OffsetDateTime;
pub use uuid::Uuid;
pub use workflow::{Advance, Halt, Outcome, Request, Step, Workflow};

// The paths of earlier versions, kept (hidden) so that code written against them compiles while
// it moves to the modules above; new code names the module.
#[doc(hidden)]
pub use canonical::canonicalize;
#[doc(hidden)]
pub use clock::{BindTime, Timed};
#[doc(hidden)]
pub use key::{KeyError, KEY_PATTERN, MAX_KEY_LEN};
#[doc(hidden)]
pub use lease::LEASE_LOG;
#[doc(hidden)]
pub use migrate::{
    migrate_online, migrate_with, migrate_with_files, OnlinePlan, BACKFILL_BATCH,
    LOCK_TIMEOUT_MESSAGE, MIGRATIONS_TABLE, MIGRATION_LOCK_TIMEOUT, STEP_LOCK_TIMEOUT,
};
#[doc(hidden)]
pub use observe::{ClaimOutcome, Observer};
#[doc(hidden)]
pub use owner::{OwnerError, MAX_OWNER_LEN};
#[doc(hidden)]
pub use runner::{Completer, Pass, Resumed};
#[doc(hidden)]
pub use store::wait;
#[doc(hidden)]
pub use store::{
    Abandoned, Autocommit, Begun, Claim, FinalPhase, FirstPhase, KeyFilter, KeyRecord, Lease,
    NewRequest, OneStep, OwnedFinalPhase, Phase, Statements, DEFAULT_LEASE_TTL,
};

#[cfg(test)]
mod tests {
    use testdb::doc_values::{duration, number};

    /// Every default and bound a user sets against states its value where rustdoc shows it.
    #[test]
    fn every_default_states_its_value_in_its_doc() {
        use crate::runner::*;
        let runner = include_str!("runner.rs");
        duration(runner, "DEFAULT_GRACE", DEFAULT_GRACE);
        number(runner, "DEFAULT_BATCH", DEFAULT_BATCH as u64);
        number(runner, "DEFAULT_CONCURRENCY", DEFAULT_CONCURRENCY as u64);
        duration(runner, "DEFAULT_BACKOFF", DEFAULT_BACKOFF);
        duration(runner, "DEFAULT_BACKOFF_MAX", DEFAULT_BACKOFF_MAX);
        number(runner, "DEFAULT_REAP_BATCH", DEFAULT_REAP_BATCH as u64);
        let model = include_str!("store/model.rs");
        duration(model, "DEFAULT_LEASE_TTL", crate::DEFAULT_LEASE_TTL);
        duration(model, "MIN_RETENTION", crate::Store::MIN_RETENTION);
        let migrate = include_str!("migrate.rs");
        duration(
            migrate,
            "MIGRATION_LOCK_TIMEOUT",
            crate::MIGRATION_LOCK_TIMEOUT,
        );
        let online = include_str!("migrate/online.rs");
        duration(online, "STEP_LOCK_TIMEOUT", crate::STEP_LOCK_TIMEOUT);
        number(online, "BACKFILL_BATCH", crate::BACKFILL_BATCH as u64);
        number(
            include_str!("key.rs"),
            "MAX_KEY_LEN",
            crate::MAX_KEY_LEN as u64,
        );
        let owner = include_str!("owner.rs");
        number(owner, "MAX_OWNER_LEN", crate::MAX_OWNER_LEN as u64);
    }
}
