//! `POST /rides` as a machine of atomic phases.
//!
//! ```text
//!  (new key) ──claim + phase 1──► ride_created ──gateway──final phase──► finished
//!             key, ride row,          │        charge under key     charge on the ride,
//!             audit record:           │        derived from the     audit, receipt job,
//!             one transaction         │        request's UUID       stored 201
//!                                     ├─ declined ─────────────final phase──► finished (stored 402)
//!                                     ├─ refused for good ─────final phase──► finished (stored 502)
//!                                     ├─ pending ──phase──► charge_pending ──retrieve──► (as above)
//!                                     └─ no answer / 5xx / 401 ──► lease released, 503; resume here
//! ```
//!
//! A new key is claimed in the same transaction as the ride it books ([`idempotency::Store::begin`]),
//! and the charge is recorded in the same transaction as the stored response: two transactions
//! around the gateway call. Two points exist only to resume keys written by earlier versions,
//! which committed the claim and the recorded charge separately: `started` (claimed, nothing
//! written) and `charge_created` (the charge recorded, the response not stored).
//!
//! Each step reads the key's recovery point and does one phase. A request that dies anywhere
//! leaves the key at its last committed point, and whoever claims the key next — the client's
//! retry or the completer — resumes from there with the stored parameters. The gateway is called
//! between phases, never inside one.
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
//! | file | what it holds |
//! |---|---|
//! | `mod.rs` | [`RidePoint`], [`BookingError`], the entry points and step loop, [`gateway_key`] |
//! | `charge.rs` | [`ChargeTarget`], the charge loop, the gateway call, each call's record |
//! | `reconcile.rs` | the doubts, the wait for calls in flight, the list, the next key generation |
//! | `outcomes.rs` | the final phases (paid, pending, declined, refused), their responses |
//! | `rows.rs` | the ride, charge, receipt and audit statements, shared with `POST /bench/rides` |

use std::time::Duration;

use idempotency::{FirstPhase, Lease, RecoveryPoint, StoredResponse};

use crate::ride::RideRequest;
use crate::state::AppState;

mod charge;
mod outcomes;
mod reconcile;
mod rows;

pub use charge::ChargeTarget;
pub use outcomes::redact_secrets;
pub use reconcile::RECONCILE_CLOCK_SKEW;
pub(crate) use rows::insert_ride;
// The rest of what `POST /bench/rides` shares with the phases.
#[cfg(feature = "bench")]
pub(crate) use {outcomes::created, rows::charge_paid};

use charge::{charge, Kept};
use outcomes::{finish_recorded, resolve_pending};

/// The recovery points of a ride booking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RidePoint {
    /// Claimed; nothing written yet. Written only by earlier versions, which claimed a key
    /// before the phase that creates its ride.
    Started,
    /// The ride row exists, unpaid.
    RideCreated,
    /// The gateway created the charge `pending`: recorded on the ride, not paid yet.
    ChargePending,
    /// The charge is recorded on the ride, paid, and the response not stored yet. Written only
    /// by earlier versions, which recorded the charge in a phase of its own.
    ChargeCreated,
    /// The response is stored.
    Finished,
}

impl RecoveryPoint for RidePoint {
    const STARTED: Self = Self::Started;
    const FINISHED: Self = Self::Finished;

    fn name(self) -> &'static str {
        match self {
            Self::Started => "started",
            Self::RideCreated => "ride_created",
            Self::ChargePending => "charge_pending",
            Self::ChargeCreated => "charge_created",
            Self::Finished => "finished",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        [
            Self::Started,
            Self::RideCreated,
            Self::ChargePending,
            Self::ChargeCreated,
            Self::Finished,
        ]
        .into_iter()
        .find(|p| p.name() == name)
    }
}

/// Why a booking stopped without a final response.
#[derive(Debug, thiserror::Error)]
pub enum BookingError {
    /// Another holder took the key over, or may have (a renewal did not answer before the lease
    /// ran out); this one must stop.
    #[error("lease lost: {0}")]
    LeaseLost(idempotency::Error),
    /// The gateway did not answer or is unavailable. The charge may exist; resume later.
    #[error("payment gateway unavailable: {0}")]
    GatewayUnavailable(String),
    /// The gateway refused our credentials or its certificate is not trusted: ours to fix.
    #[error("payment gateway misconfigured: {0}")]
    GatewayMisconfigured(String),
    /// The charge exists but is still `pending` at the gateway; resume later.
    #[error("charge {0} is pending at the gateway")]
    PaymentPending(String),
    /// Whether the gateway charged cannot be known yet: a call under the key may still be
    /// running there. The list that tells is made in `retry_after`.
    #[error("the charge's outcome is unconfirmed; reconciling in {retry_after:?}")]
    Unconfirmed {
        /// When the list can be made.
        retry_after: Duration,
    },
    /// A phase committed, but the database warned that its wait for the synchronous standby
    /// was cancelled: a failover may lose it. Not acknowledged; the key resumes.
    #[error("{0}")]
    CommitUnconfirmed(String),
    /// Anything else: a database failure, a broken invariant.
    #[error("{0}")]
    Internal(String),
    /// The process is shutting down and gave the request up before it finished.
    #[error("given up at shutdown")]
    GivenUp,
    /// A failpoint stopped the request as a crash would.
    #[error("crashed at failpoint {0}")]
    Crashed(&'static str),
}

/// The rider a key belongs to. Rocket Rides names a key's owner by its user's id
/// (`Owner::from(user.id)`), so every key of its routes holds one; anything else is a key this
/// service did not write.
pub(crate) fn rider<P: RecoveryPoint>(lease: &Lease<P>) -> Result<i64, BookingError> {
    let owner = lease.owner().as_str();
    // Its one decimal spelling only: "07" or "+7" is not user 7's key.
    owner
        .parse::<i64>()
        .ok()
        .filter(|id| id.to_string() == owner)
        .ok_or_else(|| {
            BookingError::Internal(format!(
                "key {} is owned by {:?}, which is not a user id",
                lease.key_id(),
                lease.owner().as_str()
            ))
        })
}

impl From<idempotency::Error> for BookingError {
    fn from(e: idempotency::Error) -> Self {
        match e {
            // A lease that could not be renewed before it ran out may be someone else's by now:
            // the holder stops as if it were, and writes nothing more.
            idempotency::Error::LeaseLost { .. } | idempotency::Error::LeaseUnconfirmed { .. } => {
                Self::LeaseLost(e)
            }
            idempotency::Error::CommitUnconfirmed { .. } => Self::CommitUnconfirmed(e.to_string()),
            other => Self::Internal(other.to_string()),
        }
    }
}

fn db(context: &'static str) -> impl FnOnce(sqlx::Error) -> BookingError {
    move |e| BookingError::Internal(format!("{context}: {e}"))
}

/// Stops here if a test armed this crash point.
fn crash_point(state: &AppState, point: &'static str) -> Result<(), BookingError> {
    if crate::failpoints::hit(&state.failpoints, point) {
        return Err(BookingError::Crashed(point));
    }
    Ok(())
}

/// What one step did.
enum Step {
    /// A phase committed; run the next one.
    Advanced,
    /// The final phase stored this response.
    Respond(StoredResponse),
}

/// The idempotency key under which the gateway is asked to charge for a request: derived from
/// the request's random UUID and the charge's generation, never from the attempt, so that every
/// resumption of one generation asks for the same charge.
pub fn gateway_key(request: idempotency::Uuid, generation: i32) -> String {
    format!("rocket-rides:{request}:charge:{generation}")
}

/// The first phase of a new key, merged with its claim: the ride and its audit record, in the
/// transaction that inserted the key. Returns the lease, at `ride_created`, and what the charge
/// step needs to know, so that it reads nothing again.
///
/// The gateway is asked right after the commit, so the ride's creation time stands for the
/// first attempt (a crash in between only makes it earlier, which is the safe side for both of
/// its uses).
pub async fn create_ride(
    state: &AppState,
    mut first: FirstPhase<RidePoint>,
    request: &RideRequest,
    customer: &str,
) -> Result<(Lease<RidePoint>, ChargeTarget), BookingError> {
    let (user_id, key_id) = (rider(first.lease())?, first.lease().key_id());
    let (lease, (ride_id, first_attempt_at)) = if state.failpoints.split_first_phase() {
        // The chaos harness's negative control: the key's recovery point and its ride in two
        // transactions, so that a failure between them leaves a key naming no ride.
        let lease = first.commit().await?;
        let mut conn = state.store.autocommit().await.map_err(db("acquire"))?;
        let ride = insert_ride(conn.conn(), state, user_id, Some(key_id), request).await?;
        conn.done().await.map_err(db("insert ride"))?;
        (lease, ride)
    } else {
        let ride = insert_ride(first.conn(), state, user_id, Some(key_id), request).await?;
        (first.commit().await?, ride)
    };
    crash_point(state, crate::failpoints::AFTER_RIDE_CREATED)?;
    let target = ChargeTarget {
        ride_id,
        amount_cents: request.amount_cents,
        charge_id: None,
        customer: customer.to_owned(),
        generation: 1,
        first_attempt_at,
        past_window: false,
        // The ride's creation stands for the first call, which follows at once.
        attempted_at: first_attempt_at,
        attempts_unknown: false,
        doubt: Kept(None),
        refusal: None,
        fresh: true,
    };
    Ok((lease, target))
}

/// Runs the booking from the lease's recovery point to a stored response. `known` is what the
/// first phase learnt about the ride, when this process ran it; otherwise it is read.
pub async fn run(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    known: Option<ChargeTarget>,
) -> Result<StoredResponse, BookingError> {
    let mut known = known;
    loop {
        let step = match lease.recovery_point() {
            RidePoint::Started => resume_started(state, lease).await?,
            RidePoint::RideCreated => {
                let target = match known.take() {
                    Some(target) => target,
                    None => {
                        let target = ChargeTarget::load(state, lease).await?;
                        state
                            .failpoints
                            .stand_still(crate::failpoints::AFTER_RIDE_LOADED)
                            .await;
                        target
                    }
                };
                charge(state, lease, target).await?
            }
            RidePoint::ChargePending => resolve_pending(state, lease).await?,
            RidePoint::ChargeCreated => finish_recorded(state, lease).await?,
            RidePoint::Finished => {
                return Err(BookingError::Internal(format!(
                    "key {} was acquired although finished",
                    lease.key_id()
                )))
            }
        };
        match step {
            Step::Advanced => continue,
            Step::Respond(response) => {
                crash_point(state, crate::failpoints::AFTER_FINISHED)?;
                return Ok(response);
            }
        }
    }
}

/// A key an earlier version claimed and left before its first phase: that phase now, on its own.
async fn resume_started(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
) -> Result<Step, BookingError> {
    let request: RideRequest = serde_json::from_value(lease.params().clone()).map_err(|e| {
        BookingError::Internal(format!("key {} has unreadable params: {e}", lease.key_id()))
    })?;
    let user_id = rider(lease)?;
    let mut phase = state.store.phase(lease, RidePoint::RideCreated).await?;
    let key_id = phase.key_id();
    insert_ride(phase.conn(), state, user_id, Some(key_id), &request).await?;
    phase.commit().await?;
    crash_point(state, crate::failpoints::AFTER_RIDE_CREATED)?;
    Ok(Step::Advanced)
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
