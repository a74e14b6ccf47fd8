//! `POST /rides` and `GET /rides/{id}`: parse and validate at the edge, claim the key, run the
//! booking detached from the connection, answer.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use idempotency::{Claim, Fingerprint, Lease, NewRequest};
use idempotency_axum::{acquired_or_respond, stored_response, RequiredKey};
use serde_json::{json, Value};

use crate::auth::AuthUser;
use crate::booking::{self, BookingError, RidePoint};
use crate::metrics::ClaimOutcome;
use crate::problem::ApiError;
use crate::ride::{RideRequest, RideView, RIDES_ROUTE};
use crate::state::AppState;

/// `POST /rides`.
pub async fn create(
    State(state): State<AppState>,
    user: AuthUser,
    RequiredKey(key): RequiredKey,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    // Everything is validated before the key is claimed: bad input writes no row.
    let body = body.map_err(|e| match e.status() {
        http::StatusCode::PAYLOAD_TOO_LARGE => ApiError::BodyTooLarge,
        _ => ApiError::BadJson(e.body_text()),
    })?;
    let json: Value =
        serde_json::from_slice(&body).map_err(|e| ApiError::BadJson(e.to_string()))?;
    let request = RideRequest::validate(&json).map_err(ApiError::Validation)?;
    let params = serde_json::to_value(&request).map_err(|e| ApiError::Internal(e.to_string()))?;

    // From the claim on, the request runs in a task of its own. If the client hangs up, hyper
    // drops the handler's future; were the claim, a phase or the release dropped with it, the key
    // would stay locked until its lease expired. The task finishes what it started.
    let task = tokio::spawn(async move {
        let fingerprint = Fingerprint::of_json("POST", RIDES_ROUTE, &json);
        let claim = state
            .store
            .claim::<RidePoint>(NewRequest {
                user_id: user.id,
                method: "POST",
                route: RIDES_ROUTE,
                key: &key,
                fingerprint,
                params: &params,
            })
            .await?;
        state.metrics.claim(match &claim {
            Claim::Acquired(_) => ClaimOutcome::Acquired,
            Claim::Replay(_) => ClaimOutcome::Replayed,
            Claim::Mismatch => ClaimOutcome::Mismatch,
            Claim::InFlight { .. } => ClaimOutcome::InFlight,
        });
        match acquired_or_respond(claim) {
            Ok(lease) => book(&state, lease).await,
            Err(refusal) => Ok(refusal),
        }
    });
    task.await
        .map_err(|e| ApiError::Internal(format!("booking task failed: {e}")))?
}

/// Runs the booking with the lease and turns its outcome into the answer, releasing the lease
/// on every failure a retry can resume from.
async fn book(state: &AppState, mut lease: Lease<RidePoint>) -> Result<Response, ApiError> {
    let mut giving_up = state.giving_up.clone();
    let outcome = tokio::select! {
        outcome = booking::run(state, &mut lease) => outcome,
        // Shutdown deadline: stop between two statements of the machine (an open phase rolls
        // back), hand the key back, and let the client's retry resume it elsewhere.
        _ = giving_up.wait() => Err(BookingError::GivenUp),
    };
    let key_id = lease.key_id();
    // Every failure but a crash and a lost lease hands the key back: the retry resumes from its
    // recovery point at once instead of waiting for the lease to expire.
    let answer = match outcome {
        Ok(stored) => return Ok(stored_response(&stored)),
        Err(BookingError::Crashed(point)) => {
            // A simulated crash: the lease is kept until it expires, as a dead process keeps it.
            tracing::warn!(key_id, point, "crash point hit");
            return Err(ApiError::Internal(format!("crashed at {point}")));
        }
        Err(BookingError::LeaseLost(e)) => {
            // The lease is someone else's now; there is nothing of ours to release.
            state.metrics.lease_lost();
            tracing::warn!(key_id, error = %e, "lease taken over mid-request");
            return Err(ApiError::LeaseLost);
        }
        Err(BookingError::GatewayUnavailable(why)) => ApiError::GatewayUnavailable(why),
        Err(BookingError::GatewayMisconfigured(why)) => {
            // Ours to fix, not the client's: loud in the log, counted in gateway_charges_total
            // (outcome "misconfigured"), and a plain 503 to the client, who may retry.
            tracing::error!(key_id, error = %why, "payment gateway misconfigured");
            ApiError::GatewayUnavailable(why)
        }
        Err(BookingError::PaymentPending(charge)) => ApiError::PaymentPending(charge),
        Err(BookingError::GivenUp) => ApiError::ShuttingDown,
        Err(BookingError::Internal(why)) => ApiError::Internal(why),
    };
    if let Err(release) = state.store.release(lease).await {
        tracing::warn!(key_id, error = %release, "could not release lease");
    }
    Err(answer)
}

/// `GET /rides/{id}`: the owner's ride; 404 for everyone else, so ids reveal nothing.
pub async fn show(
    State(state): State<AppState>,
    user: AuthUser,
    Path(ride_id): Path<String>,
) -> Result<Response, ApiError> {
    let Ok(ride_id) = ride_id.parse::<i64>() else {
        return Err(ApiError::NotFound);
    };
    let ride = RideView::by_id(&state.pool, user.id, ride_id)
        .await
        .map_err(|e| ApiError::Internal(format!("load ride {ride_id}: {e}")))?
        .ok_or(ApiError::NotFound)?;
    Ok(axum::Json(json!(ride)).into_response())
}
