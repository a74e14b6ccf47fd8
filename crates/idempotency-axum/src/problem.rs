//! RFC 9457 problem details: the one error body every refusal uses.

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, StatusCode};
use serde_json::{Map, Value};

/// The media type of a problem body.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The stable `type` of each refusal this crate makes. Clients switch on these, not on titles.
pub mod types {
    /// No `Idempotency-Key` header on a request that requires one (400).
    pub const KEY_MISSING: &str = "urn:problem:idempotency:key-missing";
    /// The header is present but not a valid key (400).
    pub const KEY_INVALID: &str = "urn:problem:idempotency:key-invalid";
    /// The key was used before with another payload (422).
    pub const KEY_REUSED: &str = "urn:problem:idempotency:key-reused";
    /// Another request with this key is being processed (409).
    pub const KEY_IN_FLIGHT: &str = "urn:problem:idempotency:key-in-flight";
    /// The body is larger than the layer buffers (413).
    pub const BODY_TOO_LARGE: &str = "urn:problem:idempotency:body-too-large";
    /// The key store failed; nothing was decided (500).
    pub const STORE_FAILED: &str = "urn:problem:idempotency:store-failed";
    /// The body could not be read (400).
    pub const BAD_BODY: &str = "urn:problem:idempotency:bad-body";
    /// The handler failed or panicked, and the key it ran under was released; or it could not
    /// run, as a handler that asks for its [`ClaimedKey`](crate::ClaimedKey) without the layer
    /// in front of it (500).
    pub const HANDLER_FAILED: &str = "urn:problem:idempotency:handler-failed";
    /// Another request with the key took its lease over while the handler ran; this one was
    /// stopped, and that one answers (409).
    pub const LEASE_LOST: &str = "urn:problem:idempotency:lease-lost";
    /// A transient failure (a foreign system away, an unconfirmed commit): the key was released
    /// at the point reached, and a retry resumes there (503, with `Retry-After`).
    pub const RETRY_LATER: &str = "urn:problem:idempotency:retry-later";
    /// A workflow's run failed for a reason that is not transient; the key was released (500).
    pub const REQUEST_FAILED: &str = "urn:problem:idempotency:request-failed";
}

/// A problem+json response. Building one has no side effects: log before you return it.
#[derive(Debug, Clone)]
pub struct Problem {
    status: StatusCode,
    kind: &'static str,
    title: &'static str,
    detail: Option<String>,
    retry_after: Option<Duration>,
    extensions: Map<String, Value>,
}

impl Problem {
    /// A problem of type `kind` (a stable URI) with a short human title.
    pub fn new(status: StatusCode, kind: &'static str, title: &'static str) -> Self {
        Self {
            status,
            kind,
            title,
            detail: None,
            retry_after: None,
            extensions: Map::new(),
        }
    }

    /// Explains this occurrence. Never put internal detail (SQL, stack traces) here.
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Adds a `Retry-After` header, in whole seconds rounded up (at least 1).
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// Adds an extension member, such as `errors` listing the failing fields.
    pub fn with_extension(mut self, name: &str, value: Value) -> Self {
        self.extensions.insert(name.to_owned(), value);
        self
    }

    /// The status code.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The stable type URI.
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// The body as JSON.
    pub fn body(&self) -> Value {
        let mut body = Map::new();
        body.insert("type".into(), self.kind.into());
        body.insert("title".into(), self.title.into());
        body.insert("status".into(), self.status.as_u16().into());
        if let Some(detail) = &self.detail {
            body.insert("detail".into(), detail.clone().into());
        }
        for (name, value) in &self.extensions {
            body.insert(name.clone(), value.clone());
        }
        Value::Object(body)
    }
}

/// Whole seconds for `Retry-After`, rounded up so that a client that waits that long is not early.
pub fn retry_after_seconds(after: Duration) -> u64 {
    let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    secs.max(1)
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut response = (self.status, self.body().to_string()).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(after) = self.retry_after {
            headers.insert(
                header::RETRY_AFTER,
                HeaderValue::from(retry_after_seconds(after)),
            );
        }
        response
    }
}
