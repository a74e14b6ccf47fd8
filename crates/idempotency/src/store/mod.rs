//! The PostgreSQL store: every statement on `idempotency_keys` lives in this folder, one file
//! per concern.
//!
//! | file | statements |
//! |---|---|
//! | `claim.rs` | the claim, and the read that tells a refused claim's reason |
//! | `phase.rs` | phases and the final phase (fenced), lease renewal, release, abandon |
//! | `maintenance.rs` | the completer's claim and backoff, the reaper, inspection (`find`, `list`) |
//!
//! # Statements and why they are shaped so
//!
//! - **Claim** is one `INSERT … ON CONFLICT … DO UPDATE … WHERE … RETURNING`. A new key is
//!   inserted with token 1; an existing one is taken over (token + 1) only when it is unfinished,
//!   has the same fingerprint and its lease is free or expired. `ON CONFLICT DO UPDATE` locks the
//!   conflicting row and re-checks the `WHERE` against its newest committed version, so two
//!   claimers can never both get a row back. No row back means the claim was refused, and one
//!   plain read tells why (replay, payload mismatch, lease held).
//! - **A phase** is a READ COMMITTED transaction whose first statement is the fenced update
//!   `… WHERE id = $1 AND lease_token = $2`. Zero rows: the lease was taken over, the phase
//!   returns [`Error::LeaseLost`] and the transaction rolls back. One row: the key row is now
//!   locked by this transaction until commit, so a claimer waits for the phase to end and then
//!   sees its result; the business writes that follow cannot interleave with a takeover.
//! - **Release** after a transient failure is fenced the same way, so a stale holder cannot free
//!   a lease that is no longer its own.
//! - **The completer's claim** takes abandoned keys in batches with `FOR UPDATE SKIP LOCKED` and
//!   increments their tokens like any claim; **the reaper** deletes finished keys past retention
//!   in short batches, never unfinished ones.
//!
//! Every statement carries `user_id`, so the table can be distributed by user.

mod claim;
mod maintenance;
mod model;
mod phase;

pub use maintenance::{KeyFilter, KeyRecord};
pub use model::{Claim, Lease, NewRequest, OneStep, RecoveryPoint, Store, DEFAULT_LEASE_TTL};
pub use phase::{FinalPhase, Phase};
