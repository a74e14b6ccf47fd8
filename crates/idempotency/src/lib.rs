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

pub mod canonical;
mod clock;
pub mod commit_watch;
mod error;
mod fingerprint;
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
pub use store::{
    Abandoned, Autocommit, Begun, Claim, FinalPhase, FirstPhase, KeyFilter, KeyRecord, Lease,
    NewRequest, OneStep, OwnedFinalPhase, Phase, Statements, DEFAULT_LEASE_TTL,
};
