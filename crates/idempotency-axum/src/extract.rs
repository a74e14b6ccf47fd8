//! The `Idempotency-Key` extractor.

use axum::extract::FromRequestParts;
use http::request::Parts;
use http::{HeaderMap, StatusCode};
use idempotency::IdempotencyKey;

use crate::problem::{types, Problem};

/// The header's name.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The client's idempotency key, required. A missing or malformed header is refused with
/// 400 problem+json before the handler runs, so nothing is written.
#[derive(Debug, Clone)]
pub struct RequiredKey(pub IdempotencyKey);

/// Message of the 400 for a request with several key headers.
pub const ONE_KEY_DETAIL: &str = "send exactly one Idempotency-Key header";

/// Message of the 400 for a request without the header.
pub const KEY_MISSING_DETAIL: &str = "this request requires an Idempotency-Key header";

impl<S: Send + Sync> FromRequestParts<S> for RequiredKey {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        key_from_headers(&parts.headers).map(RequiredKey)
    }
}

/// Reads exactly one valid `Idempotency-Key` header, or says what is wrong as a 400 problem.
pub(crate) fn key_from_headers(headers: &HeaderMap) -> Result<IdempotencyKey, Problem> {
    let invalid = || {
        Problem::new(
            StatusCode::BAD_REQUEST,
            types::KEY_INVALID,
            "Invalid Idempotency-Key",
        )
    };
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    match (values.next(), values.next()) {
        (Some(value), None) => IdempotencyKey::parse(value.as_bytes())
            .map_err(|e| invalid().with_detail(e.to_string())),
        (Some(_), Some(_)) => Err(invalid().with_detail(ONE_KEY_DETAIL)),
        (None, _) => Err(Problem::new(
            StatusCode::BAD_REQUEST,
            types::KEY_MISSING,
            "Missing Idempotency-Key",
        )
        .with_detail(KEY_MISSING_DETAIL)),
    }
}
