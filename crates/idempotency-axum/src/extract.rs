//! The `Idempotency-Key` extractor.

use axum::extract::FromRequestParts;
use http::request::Parts;
use http::StatusCode;
use idempotency::IdempotencyKey;

use crate::problem::{types, Problem};

/// The header's name.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The client's idempotency key, required. A missing or malformed header is refused with
/// 400 problem+json before the handler runs, so nothing is written.
#[derive(Debug, Clone)]
pub struct RequiredKey(pub IdempotencyKey);

/// Message of the 400 for a request without the header.
pub const KEY_MISSING_DETAIL: &str = "this request requires an Idempotency-Key header";

impl<S: Send + Sync> FromRequestParts<S> for RequiredKey {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let mut values = parts.headers.get_all(IDEMPOTENCY_KEY).iter();
        let (Some(value), None) = (values.next(), values.next()) else {
            let problem = if parts.headers.contains_key(IDEMPOTENCY_KEY) {
                Problem::new(
                    StatusCode::BAD_REQUEST,
                    types::KEY_INVALID,
                    "Invalid Idempotency-Key",
                )
                .with_detail("send exactly one Idempotency-Key header")
            } else {
                Problem::new(
                    StatusCode::BAD_REQUEST,
                    types::KEY_MISSING,
                    "Missing Idempotency-Key",
                )
                .with_detail(KEY_MISSING_DETAIL)
            };
            return Err(problem);
        };
        IdempotencyKey::parse(value.as_bytes())
            .map(RequiredKey)
            .map_err(|e| {
                Problem::new(
                    StatusCode::BAD_REQUEST,
                    types::KEY_INVALID,
                    "Invalid Idempotency-Key",
                )
                .with_detail(e.to_string())
            })
    }
}
