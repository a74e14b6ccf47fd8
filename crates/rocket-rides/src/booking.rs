//! `POST /rides` as a machine of atomic phases.
//!
//! ```text
//!  started ──phase 1──► ride_created ──gateway──phase 2──► charge_created ──final phase──► finished
//!   (claim)   ride row +             charge under key      charge id on      receipt job +
//!             audit record           rocket-rides:{key}    the ride          stored 201
//!                                           │
//!                                           ├─ declined ──final phase──► finished (stored 402)
//!                                           └─ no answer / 5xx ──► lease released, 503; resume here
//! ```
//!
//! Each step reads the key's recovery point and does one phase. A request that dies anywhere
//! leaves the key at its last committed point, and whoever claims the key next — the client's
//! retry or the completer — resumes from there with the stored parameters. The gateway is called
//! between phases, never inside one, under a key derived from the key row, so a resumed charge
//! finds the one already made.

use idempotency::{Lease, RecoveryPoint, StoredResponse};
use idempotency_axum::Problem;
use serde_json::json;
use sqlx::PgConnection;

use crate::app::AppState;
use crate::metrics::ChargeOutcome;
use crate::problem::types;
use crate::rides::{RideRequest, RideView};
use crate::stripe::ChargeError;

/// The recovery points of a ride booking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RidePoint {
    /// Claimed; nothing written yet.
    Started,
    /// The ride row exists, unpaid.
    RideCreated,
    /// The charge is recorded on the ride.
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
            Self::ChargeCreated => "charge_created",
            Self::Finished => "finished",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        [
            Self::Started,
            Self::RideCreated,
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
    /// Another holder took the key over; this one must stop.
    #[error("lease lost: {0}")]
    LeaseLost(idempotency::Error),
    /// The gateway did not answer or is unavailable. The charge may exist; resume later.
    #[error("payment gateway unavailable: {0}")]
    GatewayUnavailable(String),
    /// Anything else: a database failure, a gateway that refused our request, a broken invariant.
    #[error("{0}")]
    Internal(String),
    /// The process is shutting down and gave the request up before it finished.
    #[error("given up at shutdown")]
    GivenUp,
    /// A failpoint stopped the request as a crash would.
    #[error("crashed at failpoint {0}")]
    Crashed(&'static str),
}

impl From<idempotency::Error> for BookingError {
    fn from(e: idempotency::Error) -> Self {
        match e {
            idempotency::Error::LeaseLost { .. } => Self::LeaseLost(e),
            other => Self::Internal(other.to_string()),
        }
    }
}

fn db(context: &'static str) -> impl FnOnce(sqlx::Error) -> BookingError {
    move |e| BookingError::Internal(format!("{context}: {e}"))
}

/// Stops here if a test armed this crash point.
fn crash_point(state: &AppState, point: &'static str) -> Result<(), BookingError> {
    if crate::failpoints::hit(state, point) {
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

/// The idempotency key under which the gateway is asked to charge for this key row. Derived from
/// the row, never from the attempt: every resumption asks for the same charge.
pub fn gateway_key(key_id: i64) -> String {
    format!("rocket-rides:{key_id}:charge")
}

/// Runs the booking from the lease's recovery point to a stored response.
pub async fn run(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
) -> Result<StoredResponse, BookingError> {
    let request: RideRequest = serde_json::from_value(lease.params().clone()).map_err(|e| {
        BookingError::Internal(format!("key {} has unreadable params: {e}", lease.key_id()))
    })?;
    loop {
        let step = match lease.recovery_point() {
            RidePoint::Started => create_ride(state, lease, &request).await?,
            RidePoint::RideCreated => charge(state, lease).await?,
            RidePoint::ChargeCreated => finish(state, lease).await?,
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

/// Phase 1: the ride and its audit record.
async fn create_ride(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    request: &RideRequest,
) -> Result<Step, BookingError> {
    let user_id = lease.user_id();
    let mut phase = state.store.phase(lease, RidePoint::RideCreated).await?;
    let key_id = phase.key_id();
    let ride_id: i64 = sqlx::query_scalar(
        r#"
        INSERT INTO rides (user_id, idempotency_key_id, origin_lat, origin_lon, target_lat,
                           target_lon, amount_cents)
        VALUES ($1, $2, $3, $4, $5, $6, $7)
        RETURNING id
        "#,
    )
    .bind(user_id)
    .bind(key_id)
    .bind(request.origin_lat)
    .bind(request.origin_lon)
    .bind(request.target_lat)
    .bind(request.target_lon)
    .bind(request.amount_cents)
    .fetch_one(phase.conn())
    .await
    .map_err(db("insert ride"))?;
    audit(
        phase.conn(),
        user_id,
        "ride.created",
        ride_id,
        json!({ "idempotency_key_id": key_id }),
    )
    .await?;
    phase.commit().await?;
    crash_point(state, crate::failpoints::AFTER_RIDE_CREATED)?;
    Ok(Step::Advanced)
}

/// Between phases: the gateway call. Then phase 2 (charge recorded) or the final phase of a
/// decline.
async fn charge(state: &AppState, lease: &mut Lease<RidePoint>) -> Result<Step, BookingError> {
    let ride = RideView::by_key(&state.pool, lease.user_id(), lease.key_id())
        .await
        .map_err(db("load ride"))?
        .ok_or_else(|| BookingError::Internal(format!("no ride for key {}", lease.key_id())))?;
    let customer: String = sqlx::query_scalar("SELECT stripe_customer_id FROM users WHERE id = $1")
        .bind(lease.user_id())
        .fetch_one(&state.pool)
        .await
        .map_err(db("load customer"))?;

    let gateway_key = if crate::failpoints::fresh_gateway_key(state) {
        // The chaos harness's negative control: the bug this whole design exists to prevent.
        format!("{}:attempt-{}", gateway_key(lease.key_id()), lease.token())
    } else {
        gateway_key(lease.key_id())
    };
    let description = format!("Rocket Rides ride {}", ride.ride_id);
    let call = state.stripe.create_charge(
        &gateway_key,
        i64::from(ride.amount_cents),
        &customer,
        &description,
        ride.ride_id,
    );
    let result = with_heartbeat(state, lease, call).await?;
    state.metrics.charge(match &result {
        Ok(_) => ChargeOutcome::Charged,
        Err(ChargeError::Declined { .. }) => ChargeOutcome::Declined,
        Err(ChargeError::Transient(_)) => ChargeOutcome::Unavailable,
        Err(ChargeError::Rejected { .. }) => ChargeOutcome::Rejected,
    });
    let charge = match result {
        Ok(charge) => charge,
        Err(ChargeError::Declined { code, message }) => {
            return declined(state, lease, ride.ride_id, &code, &message).await
        }
        Err(ChargeError::Transient(why)) => return Err(BookingError::GatewayUnavailable(why)),
        Err(e @ ChargeError::Rejected { .. }) => return Err(BookingError::Internal(e.to_string())),
    };
    if charge.amount != i64::from(ride.amount_cents) {
        return Err(BookingError::Internal(format!(
            "gateway charge {} is for {} cents, ride {} for {}",
            charge.id, charge.amount, ride.ride_id, ride.amount_cents
        )));
    }
    crash_point(state, crate::failpoints::AFTER_GATEWAY_CHARGE)?;

    let user_id = lease.user_id();
    let mut phase = state.store.phase(lease, RidePoint::ChargeCreated).await?;
    sqlx::query(
        "UPDATE rides SET charge_id = $3, status = 'paid', updated_at = now()
         WHERE id = $1 AND user_id = $2",
    )
    .bind(ride.ride_id)
    .bind(user_id)
    .bind(&charge.id)
    .execute(phase.conn())
    .await
    .map_err(db("record charge"))?;
    audit(
        phase.conn(),
        user_id,
        "ride.charged",
        ride.ride_id,
        json!({ "charge_id": charge.id }),
    )
    .await?;
    phase.commit().await?;
    crash_point(state, crate::failpoints::AFTER_CHARGE_CREATED)?;
    Ok(Step::Advanced)
}

/// Awaits a foreign call while renewing the lease every heartbeat period.
///
/// A call that outlives the lease TTL would otherwise let another attempt take the key over and
/// call again (harmless for the charge, whose key is the same, but wasteful). If a renewal finds
/// the lease taken over, the call is abandoned at once and nothing more is written: the new
/// holder carries on under the same gateway key.
async fn with_heartbeat<T>(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    call: impl std::future::Future<Output = T>,
) -> Result<T, BookingError> {
    tokio::pin!(call);
    let start = tokio::time::Instant::now() + state.heartbeat;
    let mut ticker = tokio::time::interval_at(start, state.heartbeat);
    loop {
        tokio::select! {
            outcome = &mut call => return Ok(outcome),
            _ = ticker.tick() => {
                state.store.renew(lease).await?;
                tracing::debug!(key_id = lease.key_id(), "lease renewed during the gateway call");
            }
        }
    }
}

/// The final phase of a declined card: the ride is marked, the 402 is stored.
async fn declined(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    ride_id: i64,
    code: &str,
    message: &str,
) -> Result<Step, BookingError> {
    let user_id = lease.user_id();
    let mut phase = state.store.final_phase(lease).await?;
    sqlx::query(
        "UPDATE rides SET status = 'declined', updated_at = now() WHERE id = $1 AND user_id = $2",
    )
    .bind(ride_id)
    .bind(user_id)
    .execute(phase.conn())
    .await
    .map_err(db("mark ride declined"))?;
    audit(
        phase.conn(),
        user_id,
        "ride.payment_declined",
        ride_id,
        json!({ "code": code }),
    )
    .await?;
    let problem = Problem::new(
        http::StatusCode::PAYMENT_REQUIRED,
        types::PAYMENT_DECLINED,
        "Payment declined",
    )
    .with_detail(format!("the card was declined: {message}"))
    .with_extension("decline_code", code.into());
    let response = StoredResponse {
        status: 402,
        headers: vec![(
            "content-type".to_owned(),
            idempotency_axum::PROBLEM_JSON.to_owned(),
        )],
        body: problem.body().to_string().into_bytes(),
    };
    phase.finish(&response).await?;
    Ok(Step::Respond(response))
}

/// The final phase: the receipt job and the stored 201.
async fn finish(state: &AppState, lease: &mut Lease<RidePoint>) -> Result<Step, BookingError> {
    let user_id = lease.user_id();
    let key_id = lease.key_id();
    let mut phase = state.store.final_phase(lease).await?;
    let ride = RideView::by_key(&mut *phase.conn(), user_id, key_id)
        .await
        .map_err(db("load ride"))?
        .ok_or_else(|| BookingError::Internal(format!("no ride for key {key_id}")))?;
    sqlx::query("INSERT INTO staged_jobs (job_name, job_args) VALUES ('send_ride_receipt', $1)")
        .bind(json!({ "ride_id": ride.ride_id }))
        .execute(phase.conn())
        .await
        .map_err(db("stage receipt job"))?;
    let response = StoredResponse::json(
        201,
        &serde_json::to_value(&ride).map_err(|e| BookingError::Internal(e.to_string()))?,
        vec![("location".to_owned(), format!("/rides/{}", ride.ride_id))],
    );
    phase.finish(&response).await?;
    Ok(Step::Respond(response))
}

async fn audit(
    conn: &mut PgConnection,
    user_id: i64,
    action: &str,
    ride_id: i64,
    data: serde_json::Value,
) -> Result<(), BookingError> {
    sqlx::query(
        "INSERT INTO audit_records (user_id, action, resource_type, resource_id, data)
         VALUES ($1, $2, 'ride', $3, $4)",
    )
    .bind(user_id)
    .bind(action)
    .bind(ride_id)
    .bind(data)
    .execute(conn)
    .await
    .map_err(db("write audit record"))?;
    Ok(())
}
