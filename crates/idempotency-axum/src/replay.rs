//! Stored responses onto the wire, and refused claims into responses.

use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderName, HeaderValue, StatusCode};
use idempotency::{Claim, Lease, RecoveryPoint, StoredResponse};

use crate::problem::{types, Problem};

/// The header Stripe sets on a replayed response.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// Detail of the 422 for a key reused with another payload.
pub const KEY_REUSED_DETAIL: &str =
    "this Idempotency-Key was already used with a different request payload";

/// Detail of the 409 for a key whose request is still being processed.
pub const KEY_IN_FLIGHT_DETAIL: &str =
    "a request with this Idempotency-Key is being processed; retry after the indicated time";

/// The longest `Retry-After` of a 409 for a key in flight: 2 s. A live holder finishes in
/// milliseconds, so the client is told to come back soon; a dead holder's lease lasts its whole
/// TTL, and the client then asks every two seconds until it is taken over.
pub const MAX_IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(2);

/// The first delivery of a stored response: exactly what later replays will repeat.
pub fn stored_response(stored: &StoredResponse) -> Response {
    build(stored, false)
}

/// A replay: the stored status, headers and body bytes, plus `Idempotent-Replayed: true`.
pub fn replayed_response(stored: &StoredResponse) -> Response {
    build(stored, true)
}

fn build(stored: &StoredResponse, replayed: bool) -> Response {
    let mut response = Response::new(Body::from(stored.body.clone()));
    *response.status_mut() =
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    for (name, value) in &stored.headers {
        // The application chose these headers and they were valid when first sent; a stored
        // value that no longer parses is skipped rather than failing the replay.
        match (
            HeaderName::try_from(name.as_str()),
            HeaderValue::try_from(value.as_str()),
        ) {
            (Ok(name), Ok(value)) => {
                headers.append(name, value);
            }
            _ => tracing::warn!(header = %name, "skipping a stored header that does not parse"),
        }
    }
    if replayed {
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    response
}

/// Turns a claim into a lease to run, or into the response that answers a refused claim.
// The error is the HTTP response itself, built once per request and returned straight to axum,
// as axum's own extractors do; boxing it would only add an allocation.
#[allow(clippy::result_large_err)]
pub fn acquired_or_respond<P: RecoveryPoint>(claim: Claim<P>) -> Result<Lease<P>, Response> {
    match claim {
        Claim::Acquired(lease) => Ok(lease),
        Claim::Replay(stored) => Err(replayed_response(&stored)),
        Claim::Mismatch => Err(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            types::KEY_REUSED,
            "Idempotency-Key reused",
        )
        .with_detail(KEY_REUSED_DETAIL)
        .into_response()),
        Claim::InFlight { retry_after } => Err(Problem::new(
            StatusCode::CONFLICT,
            types::KEY_IN_FLIGHT,
            "Request in progress",
        )
        .with_detail(KEY_IN_FLIGHT_DETAIL)
        .with_retry_after(retry_after.min(MAX_IN_FLIGHT_RETRY_AFTER))
        .into_response()),
    }
}
