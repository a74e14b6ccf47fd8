#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod canonical;
mod clock;
pub mod commit_watch;
mod error;
mod fingerprint;
pub mod guide;
mod key;
pub mod lease;
pub mod migrate;
pub mod observe;
mod owner;
mod response;
pub mod runner;
mod store;

pub use canonical::canonicalize;
pub use clock::{Clock, DatabaseClock, ManualClock};
pub use error::Error;
pub use fingerprint::Fingerprint;
pub use key::{IdempotencyKey, KeyError, KEY_PATTERN, MAX_KEY_LEN};
pub use lease::LEASE_LOG;
pub use migrate::{
    migrate, migrate_online, migrate_with, migrate_with_files, OnlinePlan, BACKFILL_BATCH,
    LOCK_TIMEOUT_MESSAGE, MIGRATIONS_TABLE, MIGRATION_LOCK_TIMEOUT, STEP_LOCK_TIMEOUT,
};
pub use observe::{ClaimOutcome, Observer};
pub use owner::{Owner, OwnerError, MAX_OWNER_LEN};
pub use response::StoredResponse;
pub use runner::{Completer, Pass, Reaper, Resumed};
pub use store::wait;
pub use store::{
    Abandoned, Autocommit, Begun, Claim, FinalPhase, FirstPhase, KeyFilter, KeyRecord, Lease,
    NewRequest, OneStep, OwnedFinalPhase, Phase, RecoveryPoint, Statements, Store,
    DEFAULT_LEASE_TTL,
};
/// The time type of [`ManualClock::new`], [`Clock::now`] and the store's timestamps.
pub use time::OffsetDateTime;
pub use uuid::Uuid;

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
