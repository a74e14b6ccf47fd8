//! The PostgreSQL store: every statement on `idempotency_keys` lives in this folder, one file
//! per concern.
//!
//! | file | statements |
//! |---|---|
//! | `claim.rs` | the claim: the read, the insert or the takeover; merged with the first phase |
//! | `phase.rs` | phases and the final phase (fenced), lease renewal, release, abandon |
//! | `maintenance.rs` | the completer's claim and backoff, the reaper, inspection (`find`, `list`) |
//! | `retire.rs` | retirement: a final answer for abandoned keys that no completer can finish |
//! | `wait.rs` | a key's state read without a claim, and the wait for its holder's answer |
//! | `statements.rs` | prepared statements, or unnamed ones in explicit transactions behind a transaction pooler |
//! | `executor.rs` | the same mode for the application's own queries: an executor that wraps each query it sends |
//!
//! # Statements and why they are shaped so
//!
//! - **The claim reads first.** One plain `SELECT` of the key tells replay, payload mismatch or
//!   held lease, and those write nothing: a replay takes no row lock and waits for no WAL flush.
//!   Only an absent key is inserted (`INSERT … ON CONFLICT DO NOTHING`, token 1) and only an
//!   unfinished one of the same payload with its lease free or over is taken over (`UPDATE …
//!   WHERE` those conditions, token + 1). Both writes re-check under the row's lock, so two
//!   claimers never both win; the loser reads again.
//! - **The claim can merge with the first phase** ([`Store::begin`]): a new key is inserted at
//!   the application's first recovery point inside a transaction that the application continues
//!   with that phase's rows. Until it commits, a concurrent request with the same key waits on
//!   the insert and then finds the key held. [`Store::begin_optimistic`] inserts before it reads,
//!   for requests that rarely repeat (one transaction in every case).
//! - **A phase** is a READ COMMITTED transaction whose first statement is the fenced update
//!   `… WHERE id = $1 AND lease_token = $2`. Zero rows: the lease was taken over, the phase
//!   returns [`Error::LeaseLost`](crate::Error::LeaseLost) and the transaction rolls back. One row: the key row is now
//!   locked by this transaction until commit, so a takeover cannot lock it (`NOWAIT`) and
//!   answers in flight without waiting (a claimer's read does not wait either: it sees the
//!   lease the phase extends); the business writes that follow cannot interleave with a
//!   takeover.
//! - **The final phase** fences with `SELECT … FOR UPDATE` and writes the key row once, when it
//!   stores the response.
//! - **Updates are HOT.** No index covers a column that an update sets, and rows are inserted
//!   into pages 80% full, so a key's finished version lands on its own page with no new
//!   index entries, vacuum or not. The unfinished keys are listed in a table of their own
//!   (`idempotency_keys_unfinished`, written by the same statements that insert and finish a
//!   key): the completer scans it, and the reaper scans keys by `created_at`.
//! - **Every commit is confirmed.** A commit (or a claim's autocommit write) whose wait for a
//!   synchronous standby the server reports cancelled is an [`Error::CommitUnconfirmed`](crate::Error::CommitUnconfirmed), never a
//!   success ([`crate::commit_watch`]).
//! - **Release** after a transient failure is fenced the same way, so a stale holder cannot free
//!   a lease that is no longer its own.
//! - **The completer's claim** takes abandoned keys in batches with `FOR UPDATE SKIP LOCKED` and
//!   increments their tokens like any claim; **the reaper** deletes finished keys past retention
//!   in short batches, never unfinished ones.
//!
//! Every statement carries the key's `owner`, so the table can be distributed by owner (on Citus:
//! `idempotency_keys` by `owner`, `idempotency_keys_unfinished` colocated with it). Every
//! `UPDATE` and `DELETE` compares `owner` with a parameter, so that it goes to one shard, and
//! names the current time `$now` ([`Store::timed`]), never inside `COALESCE` or `CASE`. Every
//! `INSERT` is a statement of its own (a claim's key and its unfinished row are two, in one
//! transaction): Citus pulls a second `INSERT` CTE of one statement through the coordinator and
//! on to every worker.
//!
//! **An application's own tables**, to share a node with its keys (so that a phase's transaction
//! commits on one node, without two-phase commit), need:
//!
//! - a text column holding the key's owner ([`crate::Owner::as_str`]; for an integer user id,
//!   `user_id::text`, kept so by a check), written by every insert: Citus needs the value before
//!   it routes the row, so neither a generated column nor a trigger will do;
//! - the table distributed by it, colocated with the keys:
//!   `create_distributed_table('t', 'col', colocate_with => 'idempotency_keys')`;
//! - that column in every primary key, unique constraint and foreign key, and no
//!   `ON DELETE SET NULL`/`SET DEFAULT` on a foreign key that includes it (so no such reference
//!   to `idempotency_keys`: the reaper deletes finished keys);
//! - every statement in a phase comparing it with a parameter (`col = $1`, not only through a
//!   join), one `INSERT` per statement, and the time through [`Store::timed`].
//!
//! Rocket Rides' `rocket-rides distribute` and its docs/scaling.md show one such layout.

mod builder;
mod claim;
mod executor;
mod maintenance;
mod model;
mod phase;
mod retire;
mod statements;
mod step;
pub mod wait;

// Every commit of the store's is watched for a cancelled wait for the synchronous standby
// ([`crate::commit_watch`]).
pub(crate) use crate::commit_watch::{commit, unless_cancelled};

pub(crate) use builder::check_heartbeat;
pub use builder::{StoreBuilder, DEFAULT_RETENTION};
pub use claim::{Begun, FirstPhase};
pub use executor::StatementsOn;
pub use maintenance::{KeyFilter, KeyRecord};
pub use model::{Claim, Lease, NewRequest, OneStep, RecoveryPoint, Store, DEFAULT_LEASE_TTL};
pub use phase::{Abandoned, FinalPhase, OwnedFinalPhase, Phase};
pub use statements::{Autocommit, Statements};
pub(crate) use step::{roll_back_step, savepoint, OpenStep};
