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
pub use clock::{BindTime, Clock, DatabaseClock, ManualClock, Timed};
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
pub use store::{
    Abandoned, Autocommit, Begun, Claim, FinalPhase, FirstPhase, KeyFilter, KeyRecord, Lease,
    NewRequest, OneStep, OwnedFinalPhase, Phase, RecoveryPoint, Statements, Store,
    DEFAULT_LEASE_TTL,
};
/// The time type of [`ManualClock::new`], [`Clock::now`] and the store's timestamps.
pub use time::OffsetDateTime;
pub use uuid::Uuid;
