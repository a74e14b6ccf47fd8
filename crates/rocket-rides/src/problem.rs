//! The service's one error type and its problem+json answers.
//!
//! Turning an error into a response has no side effects; internal detail is logged here, once,
//! and never reaches the client's body.

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use idempotency_axum::Problem;
use serde_json::json;

use crate::config::OVERLOAD_RETRY_AFTER;
use crate::ride::FieldError;

/// The stable `type` of each problem the service answers with (the idempotency ones come from
/// [`idempotency_axum::problem::types`]).
pub mod types {
    /// The body is not JSON (400).
    pub const BAD_JSON: &str = "urn:problem:rocket-rides:bad-json";
    /// The body is larger than accepted (413).
    pub const BODY_TOO_LARGE: &str = "urn:problem:rocket-rides:body-too-large";
    /// The body fails validation (400); `errors` lists the fields.
    pub const VALIDATION: &str = "urn:problem:rocket-rides:validation";
    /// No or unknown API key (401).
    pub const UNAUTHORIZED: &str = "urn:problem:rocket-rides:unauthorized";
    /// The card was declined (402).
    pub const PAYMENT_DECLINED: &str = "urn:problem:rocket-rides:payment-declined";
    /// No such resource for this user (404).
    pub const NOT_FOUND: &str = "urn:problem:rocket-rides:not-found";
    /// The gateway refused the charge for good; the request is finished (502, stored).
    pub const PAYMENT_REFUSED: &str = "urn:problem:rocket-rides:payment-refused";
    /// The charge is pending at the gateway; retry later (503).
    pub const PAYMENT_PENDING: &str = "urn:problem:rocket-rides:payment-pending";
    /// Whether an earlier attempt charged cannot be known yet: the gateway may still be working
    /// on it. Retry after `Retry-After` (503).
    pub const PAYMENT_UNCONFIRMED: &str = "urn:problem:rocket-rides:payment-unconfirmed";
    /// The payment gateway is unavailable; retry (503).
    pub const GATEWAY_UNAVAILABLE: &str = "urn:problem:rocket-rides:gateway-unavailable";
    /// The server is shutting down; retry, another instance resumes the request (503).
    pub const SHUTTING_DOWN: &str = "urn:problem:rocket-rides:shutting-down";
    /// The request lost its lease to another worker, which carries on (409).
    pub const LEASE_LOST: &str = "urn:problem:rocket-rides:lease-lost";
    /// Something broke on our side (500).
    pub const INTERNAL: &str = "urn:problem:rocket-rides:internal";
    /// The body could not be read: cut off, or too slow to arrive (400).
    pub const BAD_BODY: &str = "urn:problem:rocket-rides:bad-body";
    /// The body's media type or encoding is not one the route takes (415).
    pub const UNSUPPORTED_MEDIA_TYPE: &str = "urn:problem:rocket-rides:unsupported-media-type";
    /// No route for this path (404).
    pub const NO_ROUTE: &str = "urn:problem:rocket-rides:no-route";
    /// The route does not take this method; `Allow` lists those it does (405).
    pub const METHOD_NOT_ALLOWED: &str = "urn:problem:rocket-rides:method-not-allowed";
    /// The request took longer than the server's deadline (503).
    pub const REQUEST_TIMEOUT: &str = "urn:problem:rocket-rides:request-timeout";
    /// The server is answering as many requests or connections as it takes (503).
    pub const OVER_CAPACITY: &str = "urn:problem:rocket-rides:over-capacity";
    /// The database committed the request's write but did not confirm that its synchronous
    /// standby has it (the wait was cancelled): the outcome is not acknowledged; retry (503).
    pub const COMMIT_UNCONFIRMED: &str = "urn:problem:rocket-rides:commit-unconfirmed";

    use idempotency_axum::problem::types as key;

    /// Every type the service answers with, the idempotency face's included: the OpenAPI
    /// document's closed list.
    pub const ALL: [&str; 26] = [
        BAD_JSON,
        BAD_BODY,
        BODY_TOO_LARGE,
        UNSUPPORTED_MEDIA_TYPE,
        VALIDATION,
        UNAUTHORIZED,
        PAYMENT_DECLINED,
        PAYMENT_REFUSED,
        PAYMENT_PENDING,
        PAYMENT_UNCONFIRMED,
        NOT_FOUND,
        NO_ROUTE,
        METHOD_NOT_ALLOWED,
        GATEWAY_UNAVAILABLE,
        SHUTTING_DOWN,
        LEASE_LOST,
        INTERNAL,
        REQUEST_TIMEOUT,
        OVER_CAPACITY,
        COMMIT_UNCONFIRMED,
        key::KEY_MISSING,
        key::KEY_INVALID,
        key::KEY_REUSED,
        key::KEY_IN_FLIGHT,
        key::BODY_TOO_LARGE,
        key::STORE_FAILED,
    ];
}

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

/// How long a client should wait before retrying after the gateway failed.
///
/// Short: the lease is released at once, so the retry is not refused; the wait only spares a
/// gateway that is struggling.
pub const GATEWAY_RETRY_AFTER: Duration = Duration::from_secs(1);

/// How long a client should wait before asking again about a pending charge: a gateway
/// settles a pending card charge in seconds, a bank debit in days; the completer keeps asking.
pub const PENDING_RETRY_AFTER: Duration = Duration::from_secs(5);

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
                Problem::new(StatusCode::BAD_REQUEST, types::BAD_JSON, "Body is not JSON")
                    .with_detail(why.clone())
            }
            Self::BadBody(why) => Problem::new(
                StatusCode::BAD_REQUEST,
                types::BAD_BODY,
                "Body could not be read",
            )
            .with_detail(why.clone()),
            Self::BodyTooLarge => Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                types::BODY_TOO_LARGE,
                "Body too large",
            )
            .with_detail(format!(
                "the request body is larger than {} bytes",
                crate::config::MAX_BODY_BYTES
            )),
            Self::UnsupportedMediaType(detail) => Problem::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                types::UNSUPPORTED_MEDIA_TYPE,
                "Unsupported media type",
            )
            .with_detail(*detail),
            Self::Validation(errors) => {
                let names: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
                Problem::new(
                    StatusCode::BAD_REQUEST,
                    types::VALIDATION,
                    "Invalid request body",
                )
                .with_detail(format!("invalid fields: {}", names.join(", ")))
                .with_extension("errors", json!(errors))
            }
            Self::Unauthorized(detail) => Problem::new(
                StatusCode::UNAUTHORIZED,
                types::UNAUTHORIZED,
                "Unauthorized",
            )
            .with_detail(*detail),
            Self::NotFound => Problem::new(StatusCode::NOT_FOUND, types::NOT_FOUND, "Not found"),
            Self::NoRoute => Problem::new(StatusCode::NOT_FOUND, types::NO_ROUTE, "No such route")
                .with_detail("no route has this path; GET /openapi.json lists them"),
            Self::MethodNotAllowed => Problem::new(
                StatusCode::METHOD_NOT_ALLOWED,
                types::METHOD_NOT_ALLOWED,
                "Method not allowed",
            )
            .with_detail("the route does not take this method; `Allow` lists those it does"),
            Self::GatewayUnavailable(_) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                types::GATEWAY_UNAVAILABLE,
                "Payment gateway unavailable",
            )
            .with_detail(
                "the payment could not be confirmed yet; retry with the same Idempotency-Key",
            )
            .with_retry_after(GATEWAY_RETRY_AFTER),
            Self::PaymentPending(_) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                types::PAYMENT_PENDING,
                "Payment pending",
            )
            .with_detail(
                "the payment gateway is still processing the charge; retry with the same \
                 Idempotency-Key",
            )
            .with_retry_after(PENDING_RETRY_AFTER),
            Self::PaymentUnconfirmed(retry_after) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                types::PAYMENT_UNCONFIRMED,
                "Payment not confirmed yet",
            )
            .with_detail(
                "the payment gateway may still be working on an earlier attempt; its outcome is \
                 looked up after Retry-After: retry then with the same Idempotency-Key",
            )
            .with_retry_after(*retry_after),
            Self::LeaseLost => Problem::new(
                StatusCode::CONFLICT,
                types::LEASE_LOST,
                "Request taken over",
            )
            .with_detail("another attempt with this Idempotency-Key is completing the request")
            .with_retry_after(GATEWAY_RETRY_AFTER),
            Self::ShuttingDown => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                types::SHUTTING_DOWN,
                "Shutting down",
            )
            .with_detail("the server stopped before finishing; retry with the same Idempotency-Key")
            .with_retry_after(GATEWAY_RETRY_AFTER),
            Self::RequestTimeout => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                types::REQUEST_TIMEOUT,
                "Request timed out",
            )
            .with_detail(
                "the request took longer than the server allows; retry with the same \
                 Idempotency-Key, which finds the outcome",
            )
            .with_retry_after(GATEWAY_RETRY_AFTER),
            Self::OverCapacity => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                types::OVER_CAPACITY,
                "Over capacity",
            )
            .with_detail("the server is answering as many requests as it takes; retry shortly")
            .with_retry_after(OVERLOAD_RETRY_AFTER),
            Self::CommitUnconfirmed(_) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                types::COMMIT_UNCONFIRMED,
                "Outcome not confirmed",
            )
            .with_detail(
                "the database did not confirm that the request's write is safe from a failover; \
                 retry with the same Idempotency-Key, which finds the outcome",
            )
            .with_retry_after(GATEWAY_RETRY_AFTER),
            Self::Internal(_) => Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                types::INTERNAL,
                "Internal error",
            )
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
