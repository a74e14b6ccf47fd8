//! Stripe's error object: the one error body every refusal of the gateway uses.
//!
//! ```json
//! {"error": {"type": "invalid_request_error", "code": "parameter_missing",
//!            "message": "Missing required param: amount.", "param": "amount"}}
//! ```
//!
//! Building an [`ApiError`] has no side effects; whoever turns a library [`Error`] into one logs
//! it first ([`ApiError::internal`]), and the client gets only the generic message.

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use idempotency::StoredResponse;
use serde::Serialize;

use crate::messages;
use crate::Error;

/// Stripe's `error.type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) enum ErrorType {
    /// Something went wrong on the gateway's side (500).
    #[serde(rename = "api_error")]
    Api,
    /// The card was declined (402).
    #[serde(rename = "card_error")]
    Card,
    /// An idempotency key was misused (400) or is in use (409).
    #[serde(rename = "idempotency_error")]
    Idempotency,
    /// Bad parameters, bad credentials, unknown ids or routes (400, 401, 404).
    #[serde(rename = "invalid_request_error")]
    InvalidRequest,
}

/// A Stripe-shaped error response.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    status: StatusCode,
    body: ErrorBody,
}

#[derive(Debug, Clone, Serialize)]
struct ErrorBody {
    #[serde(rename = "type")]
    kind: ErrorType,
    #[serde(skip_serializing_if = "Option::is_none")]
    code: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    decline_code: Option<&'static str>,
    message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    param: Option<String>,
}

impl ApiError {
    fn new(status: StatusCode, kind: ErrorType, message: impl Into<String>) -> Self {
        Self {
            status,
            body: ErrorBody {
                kind,
                code: None,
                decline_code: None,
                message: message.into(),
                param: None,
            },
        }
    }

    fn code(mut self, code: &'static str) -> Self {
        self.body.code = Some(code);
        self
    }

    /// Names the request parameter at fault.
    pub(crate) fn param(mut self, param: impl Into<String>) -> Self {
        self.body.param = Some(param.into());
        self
    }

    /// 400 `invalid_request_error` with a message and the parameter at fault.
    pub(crate) fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, ErrorType::InvalidRequest, message).param(param)
    }

    /// 400 `invalid_request_error` with a Stripe error code.
    pub(crate) fn invalid_code(
        param: impl Into<String>,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self::invalid(param, message).code(code)
    }

    /// 400 `invalid_request_error` about the request as a whole.
    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, ErrorType::InvalidRequest, message)
    }

    /// 413 for a body above the limit.
    pub(crate) fn body_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorType::InvalidRequest,
            format!("The request body is larger than {limit} bytes."),
        )
    }

    /// 400 `parameter_missing`.
    pub(crate) fn missing(param: &str) -> Self {
        Self::invalid_code(param, "parameter_missing", messages::missing_param(param))
    }

    /// 400 `parameter_unknown`.
    pub(crate) fn unknown_param(param: &str) -> Self {
        Self::invalid_code(param, "parameter_unknown", messages::unknown_param(param))
    }

    /// 400 `resource_missing` for an id given as a parameter (`customer`, `starting_after`).
    pub(crate) fn no_such_param(object: &str, id: &str, param: &str) -> Self {
        Self::invalid_code(param, "resource_missing", messages::no_such(object, id))
    }

    /// 404 `resource_missing` for an id in the path.
    pub(crate) fn not_found(object: &str, id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            ErrorType::InvalidRequest,
            messages::no_such(object, id),
        )
        .code("resource_missing")
        .param("id")
    }

    /// 404 for a route the gateway does not serve.
    pub(crate) fn unrecognized_url(method: &str, path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            ErrorType::InvalidRequest,
            messages::unrecognized_url(method, path),
        )
    }

    /// 401 for missing or malformed credentials. Stripe sends no `code` here.
    pub(crate) fn unauthorized(message: &'static str) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, ErrorType::InvalidRequest, message)
    }

    /// 402 `card_declined` / `generic_decline`.
    pub(crate) fn card_declined() -> Self {
        let mut error = Self::new(
            StatusCode::PAYMENT_REQUIRED,
            ErrorType::Card,
            messages::CARD_DECLINED,
        )
        .code("card_declined");
        error.body.decline_code = Some("generic_decline");
        error
    }

    /// 402 `missing`: the customer has no payment source.
    pub(crate) fn no_active_card() -> Self {
        Self::new(
            StatusCode::PAYMENT_REQUIRED,
            ErrorType::Card,
            messages::NO_ACTIVE_CARD,
        )
        .code("missing")
        .param("card")
    }

    /// 400 `idempotency_error`: the key was first used with other parameters.
    pub(crate) fn idempotency_mismatch(key: &str) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            ErrorType::Idempotency,
            messages::idempotency_mismatch(key),
        )
    }

    /// 409 `idempotency_key_in_use`: another request holds the key.
    pub(crate) fn idempotency_key_in_use() -> Self {
        Self::new(
            StatusCode::CONFLICT,
            ErrorType::Idempotency,
            messages::IDEMPOTENCY_KEY_IN_USE,
        )
        .code("idempotency_key_in_use")
    }

    /// 500 `api_error`, injected or real; nothing about the cause is shown.
    pub(crate) fn server_error() -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorType::Api,
            messages::API_ERROR,
        )
    }

    /// Logs an internal failure and turns it into a bare 500.
    pub(crate) fn internal(error: &Error) -> Self {
        tracing::error!(error = %error, "request failed");
        Self::server_error()
    }

    /// The JSON body, `{"error": {…}}`.
    pub(crate) fn body(&self) -> serde_json::Value {
        serde_json::json!({ "error": self.body })
    }

    /// The response to keep with an idempotency key, for errors that are final outcomes (402).
    pub(crate) fn to_stored(&self) -> StoredResponse {
        StoredResponse::json(self.status.as_u16(), &self.body(), Vec::new())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

impl From<Error> for ApiError {
    fn from(error: Error) -> Self {
        Self::internal(&error)
    }
}
