//! `POST /rides` and `GET /rides/{id}`: parse and validate at the edge, claim the key, run the
//! booking detached from the connection, answer.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use http::{HeaderMap, Uri};
use idempotency::wait::KeyState;
use idempotency::{Begun, Claim, Error, Fingerprint, Lease, NewRequest, Owner, Store};
use idempotency_axum::layer::DEFAULT_MAX_WAIT;
use idempotency_axum::{
    acquired_or_respond, replayed_response, stored_response, wait_preference, RequiredKey,
};
use serde_json::json;
use tokio::time::Instant;
use tracing::Instrument;

use crate::admission::Admitted;
use crate::auth::AuthUser;
use crate::booking::{self, BookingError, RidePoint};
use crate::problem::ApiError;
use crate::problem::ProblemDocument as Problem;
use crate::problem::{IDENTITY_ONLY_DETAIL, JSON_ONLY_DETAIL};
use crate::ride::{BodyError, RideRequest, RideView, RideView as Ride, RIDES_ROUTE};
use crate::state::AppState;

/// `POST /rides`: books a ride and charges the user's card, once per `Idempotency-Key`.
#[utoipa::path(
    post,
    path = "/rides",
    tag = "rides",
    params(
        ("Idempotency-Key" = String, Header, description = "The request's key: 1 to 255 visible ASCII characters, as a Structured Field string (`\"…\"`) or bare. The same key with the same body finishes the first request or replays its answer."),
        ("Prefer" = Option<String>, Header, description = "`wait=N` (RFC 7240, seconds, at most 10): when another request holds the key, wait up to N seconds for its answer (then replayed, with `Idempotent-Replayed: true`) instead of a 409; past N, the 409. `wait=0` or a malformed value: no wait."),
    ),
    request_body(content = RideRequest, content_type = "application/json"),
    responses(
        (status = 201, description = "Booked and paid. A replay repeats the first answer byte for byte and adds `Idempotent-Replayed: true`.", body = Ride,
         headers(("Location" = String, description = "`/rides/{id}`"), ("Idempotent-Replayed" = String, description = "`true` on a replay"))),
        (status = 400, description = "`urn:problem:idempotency:key-missing` or `…:key-invalid` (the header), `urn:problem:rocket-rides:bad-json` or `…:validation` with `errors` (the body). Nothing is written.", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "`urn:problem:rocket-rides:unauthorized`: no valid `Authorization: Bearer <api key>`.", body = Problem, content_type = "application/problem+json"),
        (status = 402, description = "`urn:problem:rocket-rides:payment-declined`: the card was declined. Stored and replayed.", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`urn:problem:idempotency:key-in-flight` (another request holds the key; with `Prefer: wait=N`, still after N seconds) or `urn:problem:rocket-rides:lease-lost`. Retry with the same key after `Retry-After`.", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = u64, description = "Seconds to wait"))),
        (status = 413, description = "`urn:problem:rocket-rides:body-too-large`. Nothing is written.", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "`urn:problem:idempotency:key-reused`: the key was used with another body. Nothing changes.", body = Problem, content_type = "application/problem+json"),
        (status = 500, description = "`urn:problem:rocket-rides:internal`: retry with the same key.", body = Problem, content_type = "application/problem+json"),
        (status = 502, description = "`urn:problem:rocket-rides:payment-refused`: the gateway refused the charge for good; `gateway_error` says what it said. Stored and replayed.", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "`urn:problem:rocket-rides:gateway-unavailable`, `…:payment-pending`, `…:payment-unconfirmed`, `…:commit-unconfirmed` or `…:shutting-down`: retry with the same key after `Retry-After`.", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ),
    security(("api_key" = []))
)]
pub async fn create(
    State(state): State<AppState>,
    user: AuthUser,
    RequiredKey(key): RequiredKey,
    headers: HeaderMap,
    admitted: Option<Extension<Admitted>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    // Everything is validated before the key is claimed: bad input writes no row.
    json_body_headers(&headers)?;
    let body = body.map_err(|e| match e.status() {
        http::StatusCode::PAYLOAD_TOO_LARGE => ApiError::BodyTooLarge,
        // Cut off, or too slow to arrive (the body-read timeout).
        _ => ApiError::BadBody(e.body_text()),
    })?;
    let (request, json) = RideRequest::parse(&body).map_err(|e| match e {
        BodyError::NotJson(why) => ApiError::BadJson(why),
        BodyError::Invalid(errors) => ApiError::Validation(errors),
    })?;
    let params = serde_json::to_value(&request).map_err(|e| ApiError::Internal(e.to_string()))?;
    let deadline = wait_preference(&headers, DEFAULT_MAX_WAIT).map(|wait| Instant::now() + wait);

    // From the claim on, the request runs in a task of its own. If the client hangs up, hyper
    // drops the handler's future; were the claim, a phase or the release dropped with it, the key
    // would stay locked until its lease expired. The task finishes what it started.
    // The task logs in the request's span, so its lines carry the request id. It holds the
    // request's slot of the admission gate until it ends, since it uses the database until then.
    let task = state.clone().tasks.spawn(
        async move {
            let _admitted = admitted;
            let fingerprint = Fingerprint::of_json("POST", RIDES_ROUTE, &json);
            let owner = Owner::from(user.id);
            // A replay, a mismatch or a key in flight is answered from one read. A new key is
            // inserted in the transaction that creates its ride.
            let request_key = NewRequest {
                owner: &owner,
                method: "POST",
                route: RIDES_ROUTE,
                key: &key,
                fingerprint,
                params: &params,
            };
            let mut begun = begin(&state.store, request_key).await?;
            // Kept across the claims between waits (see `Store::wait_for_answer_paced`).
            let mut pause = idempotency::wait::WAIT_POLL_FIRST;
            // A duplicate whose client asked to wait (`Prefer: wait=N`): until the holder
            // answers (its answer, replayed), lets the key go (claimed again: this request may
            // resume it), or the deadline comes (the usual 409). Between reads it holds no
            // pooled connection.
            while let (Begun::Existing(Claim::InFlight { .. }), Some(deadline)) = (&begun, deadline)
            {
                if Instant::now() >= deadline {
                    break;
                }
                match state
                    .store
                    .wait_for_answer_paced(&request_key, deadline, &mut pause)
                    .await?
                {
                    KeyState::Finished(stored) => return Ok(replayed_response(&stored)),
                    KeyState::Held { lease_left } => {
                        let retry_after = lease_left;
                        begun = Begun::Existing(Claim::InFlight { retry_after });
                        break;
                    }
                    KeyState::Absent | KeyState::Mismatch | KeyState::Claimable => {
                        begun = begin(&state.store, request_key).await?;
                    }
                }
            }
            match begun {
                Begun::New(first) => {
                    let (lease, target) =
                        booking::create_ride(&state, first, &request, &user.customer)
                            .await
                            .map_err(unfinished_first_phase)?;
                    book(&state, lease, Some(target)).await
                }
                Begun::Existing(claim) => match acquired_or_respond(claim) {
                    Ok(lease) => book(&state, lease, None).await,
                    Err(refusal) => Ok(refusal),
                },
            }
        }
        .instrument(tracing::Span::current()),
    );
    task.await
        .map_err(|e| ApiError::Internal(format!("booking task failed: {e}")))?
}

/// Claims the booking's key, inserting a new one at `RideCreated` in the transaction that creates
/// its ride: read first, so that a replay is one plain read. A build with the `bench` feature
/// run with `BENCH_CLAIM=insert-first` inserts first instead ([`Store::begin_optimistic`]: the
/// read only on a conflict, inside the claim's transaction), for the benchmark to compare the two
/// (docs/performance.md).
async fn begin(store: &Store, request: NewRequest<'_>) -> Result<Begun<RidePoint>, Error> {
    #[cfg(feature = "bench")]
    if super::bench::claim_inserts_first() {
        return store
            .begin_optimistic(request, RidePoint::RideCreated)
            .await;
    }
    store.begin(request, RidePoint::RideCreated).await
}

/// A positive id in its one canonical decimal form: `30`, never `030`, `+30`, `%33%30` or `3e1`.
pub fn canonical_id(raw: &str) -> Option<i64> {
    let canonical =
        !raw.is_empty() && !raw.starts_with('0') && raw.bytes().all(|b| b.is_ascii_digit());
    canonical.then(|| raw.parse().ok()).flatten()
}

/// A body is JSON, said so (`Content-Type: application/json`, parameters such as `charset`
/// allowed), and not encoded: anything else would be read as something it is not.
fn json_body_headers(headers: &HeaderMap) -> Result<(), ApiError> {
    let content_type = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or("").trim());
    if !content_type.is_some_and(|t| t.eq_ignore_ascii_case("application/json")) {
        return Err(ApiError::UnsupportedMediaType(JSON_ONLY_DETAIL));
    }
    let encoded = headers
        .get_all(http::header::CONTENT_ENCODING)
        .iter()
        .any(|v| {
            !v.to_str()
                .is_ok_and(|v| v.trim().eq_ignore_ascii_case("identity"))
        });
    if encoded {
        return Err(ApiError::UnsupportedMediaType(IDENTITY_ONLY_DETAIL));
    }
    Ok(())
}

/// The answer when the first phase did not finish: it rolled back with its key (a retry starts
/// afresh), or it committed and a crash point stopped the request (the key waits for its lease
/// to expire, as a dead process leaves it).
fn unfinished_first_phase(error: BookingError) -> ApiError {
    match error {
        BookingError::Crashed(point) => {
            tracing::warn!(point, "crash point hit");
            ApiError::Internal(format!("crashed at {point}"))
        }
        BookingError::CommitUnconfirmed(why) => ApiError::CommitUnconfirmed(why),
        other => ApiError::Internal(other.to_string()),
    }
}

/// Runs the booking with the lease and turns its outcome into the answer, releasing the lease
/// on every failure a retry can resume from.
async fn book(
    state: &AppState,
    mut lease: Lease<RidePoint>,
    known: Option<booking::ChargeTarget>,
) -> Result<Response, ApiError> {
    let mut giving_up = state.giving_up.clone();
    let outcome = tokio::select! {
        outcome = booking::run(state, &mut lease, known) => outcome,
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
        Err(BookingError::Unconfirmed { retry_after }) => ApiError::PaymentUnconfirmed(retry_after),
        Err(BookingError::GivenUp) => ApiError::ShuttingDown,
        Err(BookingError::CommitUnconfirmed(why)) => ApiError::CommitUnconfirmed(why),
        Err(BookingError::Internal(why)) => ApiError::Internal(why),
    };
    if let Err(release) = state.store.release(lease).await {
        tracing::warn!(key_id, error = %release, "could not release lease");
    }
    Err(answer)
}

/// `GET /rides/{id}`: the owner's ride; 404 for everyone else, so ids reveal nothing.
#[utoipa::path(
    get,
    path = "/rides/{id}",
    tag = "rides",
    params(("id" = i64, Path, description = "The ride's id")),
    responses(
        (status = 200, description = "The ride.", body = Ride),
        (status = 401, description = "`urn:problem:rocket-rides:unauthorized`.", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "`urn:problem:rocket-rides:not-found`: no such ride of this user.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("api_key" = []))
)]
pub async fn show(
    State(state): State<AppState>,
    user: AuthUser,
    uri: Uri,
) -> Result<Response, ApiError> {
    // The id as the client wrote it, before any percent-decoding: one ride, one spelling.
    let raw = uri.path().rsplit('/').next().unwrap_or("");
    let ride_id = canonical_id(raw).ok_or(ApiError::NotFound)?;
    let internal = |e: sqlx::Error| ApiError::Internal(format!("load ride {ride_id}: {e}"));
    let mut db = state.store.autocommit().await.map_err(internal)?;
    let ride = RideView::by_id(db.conn(), state.store.persistent(), user.id, ride_id)
        .await
        .map_err(internal)?;
    db.done().await.map_err(internal)?;
    let ride = ride.ok_or(ApiError::NotFound)?;
    Ok(axum::Json(json!(ride)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_have_one_spelling() {
        assert_eq!(canonical_id("30"), Some(30));
        assert_eq!(canonical_id("9223372036854775807"), Some(i64::MAX));
        for other in [
            "030",
            "+30",
            "%33%30",
            "3e1",
            "",
            "0",
            "-1",
            "30 ",
            "9223372036854775808",
        ] {
            assert_eq!(canonical_id(other), None, "{other:?}");
        }
    }
}
