//! A tower layer that makes a one-step handler idempotent.
//!
//! ```text
//!  request ─► key? ─► scope ─► body (bounded) ─► claim ──acquired──► handler ──final──► store + answer
//!                                                  │                    └─ 5xx/409/429 ─► release, answer
//!                                                  └─ replay / 422 / 409 ─► answer without calling the handler
//! ```
//!
//! The layer claims the key, calls the handler once, and stores its answer when the answer is
//! final (2xx and 4xx other than 408, 409, 425 and 429). Later requests with the key get the
//! stored answer byte for byte, with `Idempotent-Replayed: true`.
//!
//! What it cannot do: the handler's writes and the stored answer are not one transaction. If the
//! process dies after the handler's effect and before the answer is stored, the retry runs the
//! handler again once the lease expires. Use it for handlers whose effect is idempotent by itself
//! (an upsert, a call with a derived foreign key) or when one repetition after a crash is
//! acceptable; write handlers with several effects as phases ([`idempotency::Store::phase`],
//! as Rocket Rides does), where every step commits with its recovery point.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::MatchedPath;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idempotency::{Fingerprint, NewRequest, OneStep, Store, StoredResponse};

use crate::extract::key_from_headers;
use crate::problem::{types, Problem};
use crate::replay::{acquired_or_respond, stored_response};

/// The default largest request body the layer buffers to fingerprint it.
pub const DEFAULT_MAX_BODY: usize = 64 * 1024;

/// The largest response body the layer stores; a larger answer is passed through, not stored,
/// and the key is released.
pub const MAX_STORED_BODY: usize = 1024 * 1024;

/// The only headers of a handler's answer that are stored and replayed: those that describe the
/// outcome. Per-delivery headers (`Date`, request ids) are not.
pub const STORED_HEADERS: [&str; 2] = ["content-type", "location"];

/// Who owns a request's keys: a user id from the request, or the status to refuse it with
/// (typically 401), answered as an `about:blank` problem.
pub type ScopeFn = dyn Fn(&Parts) -> Result<i64, StatusCode> + Send + Sync;

/// Wraps a service so that every request through it needs an `Idempotency-Key`.
#[derive(Clone)]
pub struct IdempotencyLayer {
    store: Store,
    scope: Arc<ScopeFn>,
    max_body: usize,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("max_body", &self.max_body)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer over `store`; `scope` tells whose request it is (typically from an extension your
    /// authentication middleware set), or answers instead.
    pub fn new(
        store: Store,
        scope: impl Fn(&Parts) -> Result<i64, StatusCode> + Send + Sync + 'static,
    ) -> Self {
        Self {
            store,
            scope: Arc::new(scope),
            max_body: DEFAULT_MAX_BODY,
        }
    }

    /// Changes the largest request body accepted (413 above it).
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }
}

impl<S> tower::Layer<S> for IdempotencyLayer {
    type Service = Idempotent<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotent {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service the layer makes.
#[derive(Debug, Clone)]
pub struct Idempotent<S> {
    inner: S,
    layer: IdempotencyLayer,
}

impl<S> tower::Service<Request<Body>> for Idempotent<S>
where
    S: tower::Service<Request<Body>, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The clone that was polled ready serves this call; the fresh clone waits for the next.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let layer = self.layer.clone();
        Box::pin(async move { Ok(handle(layer, inner, request).await.unwrap_or_else(|r| r)) })
    }
}

/// Detail of the 413.
pub const BODY_TOO_LARGE_DETAIL: &str = "the request body is larger than this endpoint accepts";

async fn handle<S>(
    layer: IdempotencyLayer,
    mut inner: S,
    request: Request<Body>,
) -> Result<Response, Response>
where
    S: tower::Service<Request<Body>, Response = Response> + Send,
{
    let (parts, body) = request.into_parts();
    let key = key_from_headers(&parts.headers).map_err(IntoResponse::into_response)?;
    let user_id = (layer.scope)(&parts).map_err(|status| {
        let title = status.canonical_reason().unwrap_or("Refused");
        Problem::new(status, "about:blank", title).into_response()
    })?;
    let bytes = axum::body::to_bytes(body, layer.max_body)
        .await
        .map_err(|_| {
            Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                types::BODY_TOO_LARGE,
                "Body too large",
            )
            .with_detail(BODY_TOO_LARGE_DETAIL)
            .into_response()
        })?;
    let route = parts
        .extensions
        .get::<MatchedPath>()
        .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned());
    // A JSON body is fingerprinted canonically (key order and whitespace do not matter); any
    // other body by its exact bytes, as a JSON string of their hex.
    let params = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| serde_json::Value::String(hex::encode(&bytes)));
    let method = parts.method.as_str().to_owned();
    let claim = layer
        .store
        .claim::<OneStep>(NewRequest {
            user_id,
            method: &method,
            route: &route,
            key: &key,
            fingerprint: Fingerprint::of_json(&method, &route, &params),
            params: &params,
        })
        .await
        .map_err(internal)?;
    let mut lease = acquired_or_respond(claim)?;

    let Ok(answer) = inner
        .call(Request::from_parts(parts, Body::from(bytes)))
        .await
    else {
        // The handler's service failed without an answer (axum handlers never do).
        let _ = layer.store.release(lease).await;
        return Err(StatusCode::INTERNAL_SERVER_ERROR.into_response());
    };
    if !is_final(answer.status()) {
        release(&layer.store, lease).await;
        return Ok(answer);
    }
    let (answer_parts, answer_body) = answer.into_parts();
    let Ok(collected) = http_body_util::Limited::new(answer_body, MAX_STORED_BODY)
        .collect()
        .await
    else {
        // Too large to store or broken mid-way: nothing to replay, so the key goes back.
        release(&layer.store, lease).await;
        return Err(StatusCode::INTERNAL_SERVER_ERROR.into_response());
    };
    let stored = StoredResponse {
        status: answer_parts.status.as_u16(),
        headers: STORED_HEADERS
            .iter()
            .filter_map(|name| {
                let value = answer_parts.headers.get(*name)?.to_str().ok()?;
                Some(((*name).to_owned(), value.to_owned()))
            })
            .collect(),
        body: collected.to_bytes().to_vec(),
    };
    let phase = layer
        .store
        .final_phase(&mut lease)
        .await
        .map_err(internal)?;
    phase.finish(&stored).await.map_err(internal)?;
    // The first delivery is built from what was stored, so replays repeat exactly this.
    Ok(stored_response(&stored))
}

/// Final answers are stored; 5xx and the statuses that invite a retry (408, 409, 425, 429) are not.
fn is_final(status: StatusCode) -> bool {
    !(status.is_server_error() || matches!(status.as_u16(), 408 | 409 | 425 | 429))
}

async fn release(store: &Store, lease: idempotency::Lease<OneStep>) {
    let key_id = lease.key_id();
    if let Err(e) = store.release(lease).await {
        tracing::warn!(key_id, error = %e, "could not release the idempotency lease");
    }
}

fn internal(e: idempotency::Error) -> Response {
    tracing::error!(error = %e, "idempotency store failed");
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        types::STORE_FAILED,
        "Internal error",
    )
    .with_detail("the request could not be recorded; retry with the same Idempotency-Key")
    .into_response()
}
