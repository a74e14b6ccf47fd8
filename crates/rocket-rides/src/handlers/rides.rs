//! `POST /rides` and `GET /rides/{id}`: parse and validate at the edge, claim the key, run the
//! booking detached from the connection, answer.

use axum::body::Bytes;
use axum::extract::{FromRequest, State};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use http::{HeaderMap, Uri};
use std::sync::Arc;

use idempotency::wait::KeyState;
use idempotency::workflow::kind;
use idempotency::{Fingerprint, IdempotencyKey, NewRequest, Outcome, Owner, Request};
use idempotency_axum::layer::DEFAULT_MAX_WAIT;
use idempotency_axum::{stored_response, wait_preference, RequiredKey};
use serde_json::json;
use tokio::time::Instant;
use tracing::Instrument;

use crate::admission::Admitted;
use crate::auth::AuthUser;
use crate::booking::Booking;
use crate::problem::{types, ApiError};
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
    // The failures are the HTTP contract's rows (`crate::contract`), added by `crate::openapi`.
    responses(
        (status = 201, description = "Booked and paid. A replay repeats the first answer byte for byte and adds `Idempotent-Replayed: true`.", body = Ride,
         headers(("Location" = String, description = "`/rides/{id}`"), ("Idempotent-Replayed" = String, description = "`true` on a replay"))),
    ),
    security(("api_key" = []))
)]
pub async fn create(
    State(state): State<AppState>,
    user: AuthUser,
    RequiredKey(key): RequiredKey,
    headers: HeaderMap,
    admitted: Option<Extension<Admitted>>,
    body: axum::extract::Request,
) -> Result<Response, ApiError> {
    // Everything is validated before the key is claimed: bad input writes no row.
    json_body_headers(&headers)?;
    let slot = admitted.map(|Extension(slot)| slot);
    // The body is read last, once the API key, the idempotency key and the headers are known
    // good, and, when it is slow to arrive, with the request's admission slot given back: a
    // client sending its body slowly holds no slot of the database's meanwhile.
    let read = Bytes::from_request(body, &state);
    let body = match &slot {
        Some(slot) => slot.give_back_during(read).await,
        None => read.await,
    };
    let body = body.map_err(|e| match e.status() {
        http::StatusCode::PAYLOAD_TOO_LARGE => ApiError::BodyTooLarge,
        // Cut off, or too slow to arrive (the body-read timeout).
        _ => ApiError::BadBody(e.body_text()),
    })?;
    let (request, _) = RideRequest::parse(&body).map_err(|e| match e {
        BodyError::NotJson(why) => ApiError::BadJson(why),
        BodyError::Invalid(errors) => ApiError::Validation(errors),
    })?;
    let params = serde_json::to_value(&request).map_err(|e| ApiError::Internal(e.to_string()))?;
    // A valid booking whose slot was given back while its body came asks for one again, as a
    // new request does: it has written nothing, and may be shed.
    if let Some(slot) = &slot {
        if !slot.admit_again().await {
            return Err(ApiError::OverCapacity);
        }
    }
    let deadline = wait_preference(&headers, DEFAULT_MAX_WAIT).map(|wait| Instant::now() + wait);
    let owner = Owner::from(user.id);
    // The library runs the booking detached from this connection; the task here is the
    // service's own bookkeeping: shutdown waits for it, and it holds the request's slot of the
    // admission gate until the booking is done with the database (given back while the
    // gateway or another holder is awaited: `crate::admission`).
    let task = state.clone().tasks.spawn(
        async move {
            let booking = Arc::new(Booking::admitted(state.clone(), slot.clone()));
            let request = Request::new(owner.clone(), key.clone(), params.clone());
            let mut outcome = state.store.run(&booking, request).await;
            if let Some(deadline) = deadline {
                let waiting = Waiting {
                    owner: &owner,
                    key: &key,
                    params: &params,
                    deadline,
                    slot: slot.as_ref(),
                };
                outcome = waiting.for_holder(&state, &booking, outcome).await?;
            }
            answer(&state, outcome)
        }
        .instrument(tracing::Span::current()),
    );
    task.await
        .map_err(|e| ApiError::Internal(format!("booking task failed: {e}")))?
}

/// A duplicate whose client asked to wait (`Prefer: wait=N`).
struct Waiting<'a> {
    owner: &'a Owner,
    key: &'a IdempotencyKey,
    params: &'a serde_json::Value,
    deadline: Instant,
    /// The request's admission slot: given back while it waits, taken again (at once, never
    /// shed) before it runs the booking again.
    slot: Option<&'a Admitted>,
}

impl Waiting<'_> {
    /// While another request holds the key: until the holder answers (its answer, replayed),
    /// lets the key go (run again: this request may resume it), or the deadline comes (the
    /// usual 409). Between reads it holds no pooled connection, and while it waits no slot of
    /// the admission gate: its reads are one statement each, a poll at a time.
    async fn for_holder(
        &self,
        state: &AppState,
        booking: &Arc<Booking>,
        mut outcome: Outcome,
    ) -> Result<Outcome, ApiError> {
        let waiting = NewRequest {
            owner: self.owner,
            method: "POST",
            route: RIDES_ROUTE,
            key: self.key,
            // The fingerprint `Store::run` computes: of the method, the route and the params.
            fingerprint: Fingerprint::of_json("POST", RIDES_ROUTE, self.params),
            params: self.params,
        };
        // Kept across the runs between waits (see `Store::wait_for_answer_paced`).
        let mut pause = idempotency::wait::WAIT_POLL_FIRST;
        while let Outcome::InFlight { .. } = outcome {
            if Instant::now() >= self.deadline {
                break;
            }
            if let Some(slot) = self.slot {
                slot.give_back();
            }
            outcome = match state
                .store
                .wait_for_answer_paced(&waiting, self.deadline, &mut pause)
                .await?
            {
                KeyState::Finished(stored) => Outcome::Replayed(stored),
                // Still held at the deadline: the usual 409.
                KeyState::Held { lease_left } => {
                    return Ok(Outcome::InFlight {
                        retry_after: lease_left,
                    })
                }
                KeyState::Absent | KeyState::Mismatch | KeyState::Claimable => {
                    if let Some(slot) = self.slot {
                        slot.take_again();
                    }
                    let request =
                        Request::new(self.owner.clone(), self.key.clone(), self.params.clone());
                    state.store.run(booking, request).await
                }
            };
        }
        Ok(outcome)
    }
}

/// The answer to a booking's outcome: the library's for what it decides alone (a replay, a
/// reused key, a key in flight), the service's problem for each transient failure by its kind
/// (the booking names each by its problem type, [`idempotency::Halt::kind`]; the library's own
/// kinds answer as the closest of them).
fn answer(state: &AppState, outcome: Outcome) -> Result<Response, ApiError> {
    match outcome {
        Outcome::Answered(stored) => {
            let point = crate::failpoints::AFTER_FINISHED;
            if crate::failpoints::before_acknowledging(&state.failpoints, point) {
                // A simulated crash after the answer was stored, before it leaves.
                tracing::warn!(point, "crash point hit");
                return Err(ApiError::Internal("crashed after finishing".into()));
            }
            Ok(stored_response(&stored))
        }
        outcome @ (Outcome::Replayed(_) | Outcome::Mismatch | Outcome::InFlight { .. }) => {
            Ok(idempotency_axum::respond(outcome))
        }
        Outcome::RetryLater {
            retry_after,
            cause,
            kind,
        } => Err(match kind {
            types::GATEWAY_UNAVAILABLE => ApiError::GatewayUnavailable(cause),
            types::PAYMENT_PENDING => ApiError::PaymentPending(cause),
            types::PAYMENT_UNCONFIRMED => ApiError::PaymentUnconfirmed(retry_after),
            types::SHUTTING_DOWN => ApiError::ShuttingDown,
            kind::COMMIT_UNCONFIRMED => ApiError::CommitUnconfirmed(cause),
            // The call was stopped and the key released: as a gateway that did not answer.
            kind::LEASE_UNCONFIRMED => ApiError::GatewayUnavailable(cause),
            // `types::INTERNAL`, and any kind the booking does not name.
            _ => ApiError::Internal(cause),
        }),
        Outcome::Lost => {
            // The lease is someone else's now; there is nothing of ours to release.
            state.metrics.lease_lost();
            Err(ApiError::LeaseLost)
        }
        Outcome::Failed { cause } => Err(ApiError::Internal(cause)),
    }
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

/// `GET /rides/{id}`: the owner's ride; 404 for everyone else, so ids reveal nothing.
#[utoipa::path(
    get,
    path = "/rides/{id}",
    tag = "rides",
    params(("id" = i64, Path, description = "The ride's id")),
    // The failures are the HTTP contract's rows (`crate::contract`), added by `crate::openapi`.
    responses(
        (status = 200, description = "The ride.", body = Ride),
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
    let mut pg = state.store.statements_on(db.conn());
    let ride = RideView::by_id(&mut pg, user.id, ride_id)
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
