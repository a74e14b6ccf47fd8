//! Stripe-style idempotency keys on PostgreSQL.
//!
//! A client sends a request with an `Idempotency-Key`; the network fails; the client sends it
//! again. This crate makes the second send harmless: it continues the first one where it stopped,
//! or replays its stored answer, or refuses it when the payload changed. It knows no web
//! framework; `idempotency-axum` is its HTTP face.
//!
//! # The life of a key
//!
//! ```text
//!  claim (read, write) ────► STARTED ──phase──► (app points…) ──phase──► … ──final phase──► FINISHED
//!     │                        │                     │                                   response stored,
//!     │                        └──── any failure: nothing of the failing phase is kept;  lease released
//!     │                              the lease is released (or expires), the recovery
//!     │                              point stays, and the next claim resumes from it
//!     └─ refused: Replay (finished, same payload) · Mismatch (other payload) · InFlight (lease held)
//! ```
//!
//! - [`Store::claim`] reads the key, then inserts it or takes over its lease, and returns a
//!   [`Lease`] with a fresh **fencing token**, or tells why not ([`Claim`]). A replay writes
//!   nothing. [`Store::begin`] merges the claim of a new key with the request's first phase.
//! - [`Store::phase`] opens an **atomic phase**: one transaction whose first statement is the
//!   update of the key row fenced by that token. If another holder took the lease over since,
//!   the update matches nothing, the phase fails with [`Error::LeaseLost`] and nothing it would
//!   have written exists. The business rows written in the phase commit with the new recovery
//!   point, or not at all.
//! - Calls to foreign systems (a payment gateway) happen *between* phases, never inside one, with
//!   a foreign idempotency key derived from [`Lease::request_uuid`], so a resumed request gets the same
//!   foreign result instead of a second one. Run them with [`Store::call_under_lease`] (the
//!   [lease kit](lease)): it renews the lease while the call runs and stops the call, or never
//!   starts it, once the lease may be someone else's.
//! - [`Store::final_phase`] stores the response and releases the lease in the same transaction;
//!   later claims of the key get [`Claim::Replay`].
//! - [`Store::release`] frees the lease after a transient failure, keeping the recovery point.
//! - The [`Completer`] finishes keys that their requests abandoned, with the application's own
//!   code as a closure; the [`Reaper`] deletes finished keys past the retention ([runner]).
//! - A store with a retention ([`Store::with_retention`]) answers a key that finished longer ago
//!   as a new request would be, whatever the reaper did: its fate never depends on when the
//!   reaper last ran.
//!
//! `examples/transfer.rs` is a whole service of this kind: a money transfer with a notification,
//! crashed and finished by the completer in its tests.
//!
//! Time comes from a [`Clock`], so that tests expire leases by moving time rather than sleeping.

#![warn(missing_docs)]

mod canonical;
mod clock;
pub mod commit_watch;
mod error;
mod fingerprint;
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
