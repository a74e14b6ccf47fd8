//! `POST /rides` as one [`Workflow`]: the [`Booking`]. The library's step driver runs it for the
//! request ([`idempotency::Store::run`], from the handler) and, unchanged, for a key its request
//! left behind ([`idempotency::workflow::Completer`], from the worker); it owns the claim, the
//! detach, the lease's renewal and release, and the outcomes.
//!
//! ```text
//!  (new key) ──claim + step──► ride_created ──gateway──step──► finished
//!   started:  key, ride row,        │        charge under key     charge on the ride,
//!             audit record:         │        derived from the     audit, receipt job,
//!             one transaction       │        request's UUID       stored 201
//!                                   ├─ declined ───────────────────► finished (stored 402)
//!                                   ├─ refused for good ───────────► finished (stored 502)
//!                                   ├─ pending ──► charge_pending ──retrieve──► (as above)
//!                                   └─ no answer / 5xx / 401 ──► lease released, 503; resume here
//! ```
//!
//! A new key is claimed in the same transaction as the ride it books (the driver merges the
//! claim with the first step), and the charge is recorded in the same transaction as the stored
//! response: two transactions around the gateway call. The charge step also commits, each in a
//! fenced transaction of its own before a call leaves, the call's time (and, when the key is in
//! doubt, the doubt, or the key's next generation): [`idempotency::Step::lease`].
//!
//! A request that dies anywhere leaves the key at its last committed point, and whoever claims
//! the key next — the client's retry or the completer — resumes from there with the stored
//! parameters. The gateway is called between transactions, never inside one.
//!
//! # The gateway key, and when it can no longer be trusted
//!
//! The charge is asked for under `rocket-rides:{request uuid}:charge:{generation}` ([`gateway_key`]),
//! so every resumption asks for the same charge and the gateway answers with the one it made.
//! When that key can no longer be trusted (past the gateway's window, after a replayed 5xx, an
//! `idempotency_error`, or a refusal after an attempt of unknown outcome), the charge step
//! reconciles first (`reconcile.rs`): why, when, and how it never lists while a call may still be
//! running are told in `docs/rocket-rides.md`, "The window, stored 5xx, and reconciliation".
//!
//! # Files
//!
//! Each file imports only those below it in this table (none imports `mod.rs`):
//!
//! | file | what it holds |
//! |---|---|
//! | `mod.rs` | [`Booking`]: the step of each recovery point, the shutdown |
//! | `legacy.rs` | the point only earlier versions wrote (`charge_created`) |
//! | `charge.rs` | the charge step's start (its ride, handed on or read), the charge loop, the gateway call, each call's record (`Charging`'s methods) |
//! | `reconcile.rs` | the doubts, the wait for calls in flight, the list, the next key generation |
//! | `outcomes.rs` | how a charge ends: paid, pending, declined, refused; their answers |
//! | `target.rs` | [`RidePoint`], the rider (the key's owner, parsed once per step), [`ChargeTarget`], `Charging` |
//! | `rows.rs` | the ride, charge, receipt and audit statements, shared with `POST /bench/rides` |
//! | `error.rs` | [`BookingError`] and the driver's view of it |

use idempotency::{Advance, Halt, Step, Workflow};

use crate::admission::Admitted;
use crate::ride::{RideRequest, RIDES_ROUTE};
use crate::state::AppState;

mod charge;
mod error;
mod legacy;
mod outcomes;
mod reconcile;
mod rows;
mod target;

pub use error::BookingError;
pub use outcomes::redact_secrets;
pub use reconcile::RECONCILE_CLOCK_SKEW;
pub(crate) use rows::insert_ride;
pub use target::{gateway_key, ChargeTarget, RidePoint};
// The rest of what `POST /bench/rides` shares with the steps.
#[cfg(feature = "bench")]
pub(crate) use {outcomes::created, rows::charge_paid};

use error::db;
use target::{Charging, Rider};

/// A ride booking: `POST /rides`'s workflow, for the request and the completer alike.
#[derive(Clone)]
pub struct Booking {
    state: AppState,
    /// The request's slot of the admission gate, given back across each gateway call; none for
    /// the completer, which the gate does not count.
    slot: Option<Admitted>,
}

impl Booking {
    /// The booking of the service whose state is `state`.
    pub fn new(state: AppState) -> Self {
        Self { state, slot: None }
    }

    /// The booking of a request the admission gate admitted with `slot`.
    pub fn admitted(state: AppState, slot: Option<Admitted>) -> Self {
        Self { state, slot }
    }
}

impl Workflow for Booking {
    type Point = RidePoint;

    fn route(&self) -> &str {
        RIDES_ROUTE
    }

    /// Read first, as shipped; a build with the `bench` feature claims insert first when
    /// `BENCH_CLAIM=insert-first`, for docs/performance.md's comparison of the two.
    fn claims_insert_first(&self) -> bool {
        #[cfg(feature = "bench")]
        return crate::config::claim_inserts_first();
        #[cfg(not(feature = "bench"))]
        false
    }

    /// Runs the step that leaves `point`, until it ends or the process gives up (the shutdown
    /// deadline passed): then the step stops between two statements (an open transaction rolls
    /// back), the driver hands the key back, and the client's retry resumes it elsewhere.
    async fn step(
        &self,
        point: RidePoint,
        step: &mut Step<'_, RidePoint>,
    ) -> Result<Advance<RidePoint>, Halt> {
        let mut giving_up = self.state.giving_up.clone();
        tokio::select! {
            advanced = self.leave(point, step) => advanced,
            _ = giving_up.wait() => Err(BookingError::GivenUp.into()),
        }
    }
}

impl Booking {
    async fn leave(
        &self,
        point: RidePoint,
        step: &mut Step<'_, RidePoint>,
    ) -> Result<Advance<RidePoint>, Halt> {
        let rider = Rider::of(&self.state, step)?;
        match point {
            RidePoint::Started => create_ride(&rider, step).await,
            RidePoint::RideCreated => {
                Charging::begin(rider, self.slot.as_ref(), step)
                    .await?
                    .run(step)
                    .await
            }
            RidePoint::ChargePending => {
                Charging::begin(rider, self.slot.as_ref(), step)
                    .await?
                    .resolve_pending(step)
                    .await
            }
            RidePoint::ChargeCreated => legacy::finish_recorded(&rider, step).await,
            RidePoint::Finished => Err(BookingError::Internal(format!(
                "key {} was stepped although finished",
                rider.key_id
            ))
            .into()),
        }
    }
}

/// The step that leaves `started`: the ride and its audit record, in the transaction that
/// inserts a new key (or, for a key an earlier version claimed and left, in a step of its own).
async fn create_ride(
    rider: &Rider<'_>,
    step: &mut Step<'_, RidePoint>,
) -> Result<Advance<RidePoint>, Halt> {
    let state = rider.state;
    let request: RideRequest = serde_json::from_value(step.params().clone()).map_err(|e| {
        BookingError::Internal(format!("key {} has unreadable params: {e}", rider.key_id))
    })?;
    // The customer is read with the ride's insert, for the charge step that follows in this run.
    let ((ride_id, first_attempt_at), customer) = if state.failpoints.split_first_phase() {
        // The chaos harness's negative control: the key's recovery point and its ride in two
        // transactions, so that a failure between them leaves a key naming no ride.
        let lease = step.lease().await?;
        state
            .store
            .phase(lease, RidePoint::RideCreated)
            .await?
            .commit()
            .await?;
        let mut conn = state.store.autocommit().await.map_err(db("acquire"))?;
        let mut pg = state.store.statements_on(conn.conn());
        let key_id = Some(rider.key_id);
        let ride = insert_ride(&mut pg, state, rider.user_id, key_id, &request).await?;
        let customer = rows::customer(&mut pg, rider.user_id).await?;
        conn.done().await.map_err(db("insert ride"))?;
        (ride, customer)
    } else {
        let mut pg = state.store.statements_on(step.tx().await?);
        let key_id = Some(rider.key_id);
        let ride = insert_ride(&mut pg, state, rider.user_id, key_id, &request).await?;
        (ride, rows::customer(&mut pg, rider.user_id).await?)
    };
    // The charge step that follows in this run starts from what was just written, without
    // reading the ride again (a transaction less per booking); a retry or the completer reads it.
    step.hand_on(ChargeTarget {
        ride_id,
        amount_cents: request.amount_cents,
        charge_id: None,
        customer,
        generation: 1,
        first_attempt_at,
        past_window: false,
        // The ride's creation stands for the first call, which follows at once.
        attempted_at: first_attempt_at,
        attempts_unknown: false,
        doubt: target::Kept(None),
        refusal: None,
        fresh: true,
    });
    Ok(Advance::To(RidePoint::RideCreated))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gateway_keys_differ_by_request_and_generation() {
        let a = idempotency::Uuid::from_u128(1);
        let b = idempotency::Uuid::from_u128(2);
        assert_ne!(gateway_key(a, 1), gateway_key(b, 1));
        assert_ne!(gateway_key(a, 1), gateway_key(a, 2));
        assert!(gateway_key(a, 1).len() <= 255, "Stripe's limit");
    }
}
