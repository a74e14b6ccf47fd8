//! The service's one error type and its problem+json answers.
//!
//! Turning an error into a response has no side effects; internal detail is logged here, once,
//! and never reaches the client's body.

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use idempotency_axum::Problem;
use serde_json::json;

use crate::contract;
use crate::ride::FieldError;

pub use crate::contract::{types, GATEWAY_RETRY_AFTER, PENDING_RETRY_AFTER};

/// The body of every error answer: RFC 9457 problem details.
//
// Answers are built with `idempotency_axum::Problem`; this type only describes them in the
// OpenAPI document.
#[derive(Debug, utoipa::ToSchema)]
#[schema(as = Problem)]
pub struct ProblemDocument {
    /// A stable URN per situation; clients switch on it.
    #[schema(rename = "type", example = "urn:problem:rocket-rides:validation")]
    pub kind: String,
    /// A short human summary of the situation.
    pub title: String,
    /// The HTTP status.
    pub status: u16,
    /// This occurrence, in words; never internal detail.
    pub detail: Option<String>,
    /// With `validation`: every failing field.
    pub errors: Option<Vec<FieldError>>,
    /// With `payment-declined`: the gateway's code.
    pub decline_code: Option<String>,
    /// With `payment-refused`: what the gateway said (`status`, `type`, `code`, `param`).
    pub gateway_error: Option<serde_json::Value>,
}

/// Detail of the 401.
pub const UNAUTHORIZED_DETAIL: &str = "send a valid API key as `Authorization: Bearer <key>`";
/// Detail of the 401 for a request with several `Authorization` headers.
pub const ONE_AUTHORIZATION_DETAIL: &str = "send exactly one Authorization header";
/// Detail of the 415 for a body without `Content-Type: application/json`.
pub const JSON_ONLY_DETAIL: &str = "send the body as `Content-Type: application/json`";
/// Detail of the 415 for an encoded body.
pub const IDENTITY_ONLY_DETAIL: &str =
    "send the body unencoded: no Content-Encoding other than identity";
/// Detail of the 500: deliberately says nothing.
pub const INTERNAL_DETAIL: &str = "an internal error occurred; the request can be retried";

/// Everything a handler can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON (or has a member twice, or a NUL in a string).
    #[error("body is not JSON: {0}")]
    BadJson(String),
    /// The body could not be read: cut off, or too slow to arrive.
    #[error("body could not be read: {0}")]
    BadBody(String),
    /// The body is larger than the route accepts.
    #[error("body too large")]
    BodyTooLarge,
    /// The body's media type or encoding is not the route's; the detail says which.
    #[error("unsupported media type: {0}")]
    UnsupportedMediaType(&'static str),
    /// The body fails validation.
    #[error("invalid request body")]
    Validation(Vec<FieldError>),
    /// No or unknown API key; the detail says what to send.
    #[error("unauthorized: {0}")]
    Unauthorized(&'static str),
    /// Not found, or not the caller's.
    #[error("not found")]
    NotFound,
    /// No route has this path.
    #[error("no route")]
    NoRoute,
    /// The route does not take this method (axum adds `Allow`).
    #[error("method not allowed")]
    MethodNotAllowed,
    /// The gateway gave no usable answer.
    #[error("payment gateway unavailable: {0}")]
    GatewayUnavailable(String),
    /// The charge exists at the gateway but is still pending.
    #[error("payment pending: {0}")]
    PaymentPending(String),
    /// An earlier attempt's charge may still be in the making at the gateway; the outcome is
    /// looked up after the given time.
    #[error("payment unconfirmed; retry in {0:?}")]
    PaymentUnconfirmed(Duration),
    /// Another worker took the key over while this request ran.
    #[error("lease lost")]
    LeaseLost,
    /// The server is shutting down and gave the request up; its key is free to retry.
    #[error("shutting down")]
    ShuttingDown,
    /// The request ran past the server's deadline.
    #[error("request timed out")]
    RequestTimeout,
    /// The server sheds the request or the connection: it answers as many as it takes.
    #[error("over capacity")]
    OverCapacity,
    /// A write of the request committed, but its wait for the synchronous standby was
    /// cancelled: a failover may lose it, so it is not acknowledged.
    #[error("commit unconfirmed: {0}")]
    CommitUnconfirmed(String),
    /// Anything else.
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<idempotency::Error> for ApiError {
    fn from(e: idempotency::Error) -> Self {
        match e {
            idempotency::Error::CommitUnconfirmed { .. } => Self::CommitUnconfirmed(e.to_string()),
            other => Self::Internal(other.to_string()),
        }
    }
}

impl ApiError {
    /// The problem this error answers with. Pure: the logging is [`IntoResponse`]'s.
    pub fn problem(&self) -> Problem {
        match self {
            Self::BadJson(why) => {
                contract::problem(types::BAD_JSON)
                    .with_detail(why.clone())
            }
            Self::BadBody(why) => contract::problem(types::BAD_BODY)
            .with_detail(why.clone()),
            Self::BodyTooLarge => contract::problem(types::BODY_TOO_LARGE)
            .with_detail(format!(
                "the request body is larger than {} bytes",
                crate::config::MAX_BODY_BYTES
            )),
            Self::UnsupportedMediaType(detail) => contract::problem(types::UNSUPPORTED_MEDIA_TYPE)
            .with_detail(*detail),
            Self::Validation(errors) => {
                let names: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
                contract::problem(types::VALIDATION)
                .with_detail(format!("invalid fields: {}", names.join(", ")))
                .with_extension("errors", json!(errors))
            }
            Self::Unauthorized(detail) => contract::problem(types::UNAUTHORIZED)
            .with_detail(*detail),
            Self::NotFound => contract::problem(types::NOT_FOUND),
            Self::NoRoute => contract::problem(types::NO_ROUTE)
                .with_detail("no route has this path; GET /openapi.json lists them"),
            Self::MethodNotAllowed => contract::problem(types::METHOD_NOT_ALLOWED)
            .with_detail("the route does not take this method; `Allow` lists those it does"),
            Self::GatewayUnavailable(_) => contract::problem(types::GATEWAY_UNAVAILABLE)
            .with_detail(
                "the payment could not be confirmed yet; retry with the same Idempotency-Key",
            ),
            Self::PaymentPending(_) => contract::problem(types::PAYMENT_PENDING)
            .with_detail(
                "the payment gateway is still processing the charge; retry with the same \
                 Idempotency-Key",
            ),
            Self::PaymentUnconfirmed(retry_after) => contract::problem(types::PAYMENT_UNCONFIRMED)
            .with_detail(
                "the payment gateway may still be working on an earlier attempt; its outcome is \
                 looked up after Retry-After: retry then with the same Idempotency-Key",
            )
            .with_retry_after(*retry_after),
            Self::LeaseLost => contract::problem(types::LEASE_LOST)
            .with_detail("another attempt with this Idempotency-Key is completing the request"),
            Self::ShuttingDown => contract::problem(types::SHUTTING_DOWN)
            .with_detail("the server stopped before finishing; retry with the same Idempotency-Key"),
            Self::RequestTimeout => contract::problem(types::REQUEST_TIMEOUT)
            .with_detail(
                "the request took longer than the server allows; retry with the same \
                 Idempotency-Key, which finds the outcome",
            ),
            Self::OverCapacity => contract::problem(types::OVER_CAPACITY)
            .with_detail("the server is answering as many requests as it takes; retry shortly"),
            Self::CommitUnconfirmed(_) => contract::problem(types::COMMIT_UNCONFIRMED)
            .with_detail(
                "the database did not confirm that the request's write is safe from a failover; \
                 retry with the same Idempotency-Key, which finds the outcome",
            ),
            Self::Internal(_) => contract::problem(types::INTERNAL)
            .with_detail(INTERNAL_DETAIL),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // Internal detail goes to the log, once, never into the body.
        match &self {
            Self::GatewayUnavailable(why) => {
                tracing::warn!(error = %why, "payment gateway unavailable")
            }
            Self::PaymentPending(charge) => {
                tracing::info!(charge = %charge, "payment pending at the gateway")
            }
            Self::CommitUnconfirmed(why) => {
                tracing::warn!(error = %why, "commit not confirmed by the synchronous standby")
            }
            Self::Internal(why) => tracing::error!(error = %why, "internal error"),
            _ => {}
        }
        self.problem().into_response()
    }
}
