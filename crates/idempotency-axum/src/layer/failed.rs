//! The layer's 500s, for a handler, an answer's body or the store that failed: the client is
//! told only to retry with its key; the cause goes to the log. The service and the settling of
//! an answer both give them, so they live below both.

use axum::response::{IntoResponse, Response};
use http::StatusCode;

use crate::problem::{types, Problem};

/// A 500 that says nothing of its cause; the cause goes to the log.
pub(super) fn internal_response(cause: &str) -> Response {
    tracing::error!(error = %cause, "idempotent request failed");
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        types::HANDLER_FAILED,
        "Internal error",
    )
    .with_detail("the request failed; retry with the same Idempotency-Key")
    .into_response()
}

pub(super) fn store_failed(e: idempotency::Error) -> Response {
    tracing::error!(error = %e, "idempotency store failed");
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        types::STORE_FAILED,
        "Internal error",
    )
    .with_detail("the request could not be recorded; retry with the same Idempotency-Key")
    .into_response()
}
