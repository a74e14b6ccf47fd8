//! The service the layer makes: read and scope the request, claim, run the handler detached,
//! store or release.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::MatchedPath;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::{Request, StatusCode};
use idempotency::wait::KeyState;
use idempotency::{Claim, Fingerprint, IdempotencyKey, Lease, NewRequest, OneStep, Owner};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tower::ServiceExt;

use super::claimed::ClaimedKey;
use super::failed::{internal_response, store_failed};
use super::prefer::wait_preference;
use super::retire::LAYER_TAG;
use super::settle::{release, settle, Held};
use super::transaction::{KeyTransaction, Returned};
use super::{IdempotencyLayer, BAD_BODY_DETAIL, BODY_TOO_LARGE_DETAIL, LEASE_LOST_DETAIL};
use crate::extract::key_from_headers;
use crate::problem::{types, Problem};
use crate::replay::{acquired_or_respond, replayed_response};

/// The longest request target (path and query) kept as such in a key's scope; a longer one is
/// kept as its SHA-256, within the key table's bound.
const MAX_SCOPE_TARGET: usize = 255;

/// The service the layer makes.
#[derive(Debug, Clone)]
pub struct Idempotent<S> {
    inner: S,
    layer: IdempotencyLayer,
}

impl<S> Idempotent<S> {
    pub(super) fn new(inner: S, layer: IdempotencyLayer) -> Self {
        Self { inner, layer }
    }
}

impl<S> tower::Service<Request<Body>> for Idempotent<S>
where
    S: tower::Service<Request<Body>, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: std::fmt::Display + Send + 'static,
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

/// A request, read and scoped, ready to be claimed.
struct Scoped {
    parts: Parts,
    bytes: Bytes,
    key: IdempotencyKey,
    owner: Owner,
    /// The route the key is scoped by: the matched route template (`/accounts/{id}/transfers`),
    /// or, outside an axum router, the path and query as earlier versions scoped every key.
    route: String,
    /// The scope of earlier versions (the path and query), where it differs from `route`: a key
    /// stored there before the upgrade must still replay.
    legacy_route: Option<String>,
    /// The path and query as sent: what the fingerprint covers.
    target: String,
    params: Value,
    /// What the key stores as its parameters: `params`, the target and the layer's mark.
    stored: Value,
    /// The body is JSON and `params` is its value; otherwise `params` holds the hex of its
    /// bytes, and the fingerprint is taken of the bytes themselves.
    json: bool,
    /// How long the client waits for a holder of its key to finish (`Prefer: wait=N`).
    wait: Option<Duration>,
}

async fn handle<S>(
    layer: IdempotencyLayer,
    inner: S,
    request: Request<Body>,
) -> Result<Response, Response>
where
    S: tower::Service<Request<Body>, Response = Response> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: std::fmt::Display + Send + 'static,
{
    let (parts, body) = request.into_parts();
    let key = key_from_headers(&parts.headers).map_err(IntoResponse::into_response)?;
    let owner = (layer.scope)(&parts).map_err(|status| {
        let title = status.canonical_reason().unwrap_or("Refused");
        Problem::new(status, "about:blank", title).into_response()
    })?;
    let bytes = read_body(body, layer.max_body).await?;
    let target = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), |pq| pq.as_str().to_owned());
    let concrete = scope_of(&target);
    let (route, legacy_route) = match parts.extensions.get::<MatchedPath>() {
        Some(template) if scope_of(template.as_str()) != concrete => {
            (scope_of(template.as_str()), Some(concrete))
        }
        _ => (concrete, None),
    };
    let (params, json) = body_params(&bytes);
    let wait = wait_preference(&parts.headers, layer.max_wait);
    let stored = Value::Object(serde_json::Map::from_iter([
        (LAYER_TAG.to_owned(), Value::from(1)),
        ("method".to_owned(), Value::from(parts.method.as_str())),
        ("target".to_owned(), Value::from(target.as_str())),
        ("body".to_owned(), params.clone()),
    ]));
    let scoped = Scoped {
        parts,
        bytes,
        key,
        owner,
        route,
        legacy_route,
        target,
        params,
        stored,
        json,
        wait,
    };
    // From the claim on, the work runs in a task of its own: hyper drops this future when the
    // client hangs up, and a claim, a handler or a store dropped half-way would leave the key
    // locked until its lease expired, and the retry would run the handler a second time.
    match tokio::spawn(claimed(layer, inner, scoped)).await {
        Ok(answer) => answer,
        Err(e) => Err(internal_response(&format!("the claimed work failed: {e}"))),
    }
}

/// A route as a key's scope holds it: itself, or its SHA-256 when too long for the column.
fn scope_of(route: &str) -> String {
    if route.len() <= MAX_SCOPE_TARGET {
        route.to_owned()
    } else {
        format!("sha256:{}", hex::encode(Sha256::digest(route.as_bytes())))
    }
}

/// Reads the body up to `limit`: over it, 413; cut off or failing, 400. Nothing is claimed yet.
async fn read_body(body: Body, limit: usize) -> Result<Bytes, Response> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let too_large = e
            .into_inner()
            .downcast::<http_body_util::LengthLimitError>()
            .is_ok();
        if too_large {
            Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                types::BODY_TOO_LARGE,
                "Body too large",
            )
            .with_detail(BODY_TOO_LARGE_DETAIL)
            .into_response()
        } else {
            Problem::new(
                StatusCode::BAD_REQUEST,
                types::BAD_BODY,
                "Body could not be read",
            )
            .with_detail(BAD_BODY_DETAIL)
            .into_response()
        }
    })
}

/// What the key stores of the body, and whether it is JSON: its JSON value, or, for a body that
/// is not JSON or holds a NUL character (PostgreSQL's `jsonb` cannot store one), the hex of its
/// bytes.
fn body_params(bytes: &[u8]) -> (Value, bool) {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(value) if !holds_nul(&value) => (value, true),
        _ => (Value::String(hex::encode(bytes)), false),
    }
}

fn holds_nul(value: &Value) -> bool {
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(holds_nul),
        Value::Object(members) => members
            .iter()
            .any(|(name, value)| name.contains('\0') || holds_nul(value)),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

/// The tag that opens the target in a JSON body's fingerprint. No fingerprint of an earlier
/// version has it (their targets start with `/`), so none of them can equal a current one.
const JSON_FINGERPRINT_TAG: &str = "json ";

/// The fingerprints the request may have been stored under, the current one first.
///
/// - **A JSON body** is fingerprinted canonically under a tagged target
///   ([`JSON_FINGERPRINT_TAG`]); then as earlier versions did, untagged.
/// - **Any other body** by its exact bytes ([`Fingerprint::of_bytes`]); then as the oldest
///   versions did, as the JSON string of its hex.
///
/// That last fallback is the JSON fingerprint of a JSON string body holding that hex, and it
/// once let a raw body take over a key a JSON body had left (or the reverse). It meets only
/// untagged JSON fingerprints now, which no current version writes: a raw body and a JSON body
/// whose keys were stored by this version never meet, whichever came first. Between two keys
/// both stored before the tag, the old ambiguity stays (their rows are the same).
fn fingerprints(method: &str, scoped: &Scoped) -> [Fingerprint; 2] {
    let target = scoped.target.as_str();
    if scoped.json {
        let tagged = format!("{JSON_FINGERPRINT_TAG}{target}");
        [
            Fingerprint::of_json(method, &tagged, &scoped.params),
            Fingerprint::of_json(method, target, &scoped.params),
        ]
    } else {
        [
            Fingerprint::of_bytes(method, target, &scoped.bytes),
            Fingerprint::of_json(method, target, &scoped.params),
        ]
    }
}

/// Claims the key under each of its fingerprints in turn, the current one first, until one is
/// not a mismatch: a key stored before an upgrade (a rolling deploy, a retry across it) still
/// replays or resumes rather than being refused. Returns the claim and the fingerprint it was
/// made under (the one a wait for its holder reads).
async fn claim_any<'a>(
    layer: &IdempotencyLayer,
    fingerprints: &[Fingerprint; 2],
    request: &impl Fn(Fingerprint) -> NewRequest<'a>,
) -> Result<(Claim<OneStep>, Fingerprint), Response> {
    let mut claimed = (Claim::Mismatch, fingerprints[0]);
    for fingerprint in fingerprints {
        let claim = layer
            .store
            .claim::<OneStep>(request(*fingerprint))
            .await
            .map_err(store_failed)?;
        claimed = (claim, *fingerprint);
        if !matches!(claimed.0, Claim::Mismatch) {
            break;
        }
    }
    Ok(claimed)
}

/// Claims the key and, when acquired, runs the handler once and stores its final answer.
async fn claimed<S>(layer: IdempotencyLayer, inner: S, scoped: Scoped) -> Result<Response, Response>
where
    S: tower::Service<Request<Body>, Response = Response> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: std::fmt::Display + Send + 'static,
{
    let method = scoped.parts.method.as_str().to_owned();
    let fingerprints = fingerprints(&method, &scoped);
    let request = |fingerprint| NewRequest {
        owner: &scoped.owner,
        method: &method,
        route: &scoped.route,
        key: &scoped.key,
        fingerprint,
        params: &scoped.stored,
    };
    let deadline = scoped.wait.map(|wait| Instant::now() + wait);
    let (mut claim, mut held) = claim_any(&layer, &fingerprints, &request).await?;
    // Kept across the claims between waits, so that a holder whose row reads claimable but
    // whose claim still answers in flight (a transactional holder past its lease) is not read
    // and claimed again every first pause.
    let mut pause = idempotency::wait::WAIT_POLL_FIRST;
    // A duplicate whose client asked to wait: until the holder answers, lets the key go (the
    // claim is then made again, and may acquire it), or the deadline comes.
    while let (Claim::InFlight { .. }, Some(deadline)) = (&claim, deadline) {
        if Instant::now() >= deadline {
            break;
        }
        match layer
            .store
            .wait_for_answer_paced(&request(held), deadline, &mut pause)
            .await
            .map_err(store_failed)?
        {
            KeyState::Finished(stored) => return Err(replayed_response(&stored)),
            KeyState::Held { lease_left } => {
                claim = Claim::InFlight {
                    retry_after: lease_left,
                };
                break;
            }
            KeyState::Absent | KeyState::Mismatch | KeyState::Claimable => {
                (claim, held) = claim_any(&layer, &fingerprints, &request).await?;
            }
        }
    }
    if let (Claim::Acquired(lease), Some(legacy_route)) = (&claim, &scoped.legacy_route) {
        // A new key under the template: an earlier version may have stored it under the
        // concrete path. That key answers instead, and the new one is let go.
        if lease.attempts() == 1 {
            let legacy = |fingerprint| NewRequest {
                route: legacy_route,
                ..request(fingerprint)
            };
            let state = layer
                .store
                .key_state(&legacy(fingerprints[0]))
                .await
                .map_err(store_failed)?;
            if state != KeyState::Absent {
                let Claim::Acquired(lease) = claim else {
                    unreachable!("matched as acquired above")
                };
                layer
                    .store
                    .abandon_or_release(lease)
                    .await
                    .map_err(store_failed)?;
                claim = claim_any(&layer, &fingerprints, &legacy).await?.0;
            }
        }
    }
    let mut lease = acquired_or_respond(claim)?;

    // A claim whose answer came late (a lock wait, a pause) may hold a lease that is already
    // over: renew before the handler runs, and stop if it was taken over meanwhile.
    match layer.store.confirm_lease(&mut lease).await {
        Ok(()) => {}
        Err(idempotency::Error::LeaseLost { .. }) => return Err(lease_lost_response(&lease)),
        Err(e) => {
            release(&layer.store, lease).await;
            return Err(store_failed(e));
        }
    }
    let mut parts = scoped.parts;
    parts.extensions.insert(ClaimedKey::new(&lease, scoped.key));
    let request = Request::from_parts(parts, Body::from(scoped.bytes));
    if layer.transactional {
        in_transaction(&layer, inner, request, lease).await
    } else {
        under_lease(&layer, inner, request, lease).await
    }
}

/// Runs the handler under the lease kit, and settles the key by its answer.
///
/// The handler runs in a task of its own, so that its panic reaches this task as an error
/// instead of unwinding through it with the lease held. The lease kit renews the lease while it
/// runs; if a renewal finds the lease taken over, or cannot vouch for it any more, the handler's
/// task is aborted and awaited, so that nothing of it still runs when the key is released or
/// answered by its new holder. Its answer, if any, is not delivered.
async fn under_lease<S>(
    layer: &IdempotencyLayer,
    inner: S,
    request: Request<Body>,
    mut lease: Lease<OneStep>,
) -> Result<Response, Response>
where
    S: tower::Service<Request<Body>, Response = Response> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: std::fmt::Display + Send + 'static,
{
    let mut handler = tokio::spawn(inner.oneshot(request));
    let watched = layer
        .store
        .watch_under_lease(&mut lease, &mut handler)
        .await;
    if watched.is_err() {
        handler.abort();
        let _ = handler.await;
    }
    match watched {
        Ok(ran) => settle(layer, Held::Lease(lease), ran).await,
        Err(idempotency::Error::LeaseLost { .. }) => Err(lease_lost_response(&lease)),
        Err(e) => {
            release(&layer.store, lease).await;
            Err(store_failed(e))
        }
    }
}

/// Runs the handler inside the key's own transaction (the transactional mode), and settles the
/// key by its answer: the answer is stored in that transaction, with the handler's writes, or
/// they are rolled back.
///
/// The transaction locks the key row from before the handler runs until it ends, so the lease
/// is not renewed: a takeover cannot lock the row (it tries `NOWAIT`, and answers in flight),
/// and a renewal, from another connection, would wait for this transaction's own lock. The handler still runs in a task of
/// its own, so that its panic is seen here, with the transaction in hand to roll back.
async fn in_transaction<S>(
    layer: &IdempotencyLayer,
    inner: S,
    mut request: Request<Body>,
    lease: Lease<OneStep>,
) -> Result<Response, Response>
where
    S: tower::Service<Request<Body>, Response = Response> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: std::fmt::Display + Send + 'static,
{
    let phase = match layer.store.final_phase_owned(lease).await {
        Ok(phase) => phase,
        Err((idempotency::Error::LeaseLost { .. }, lease)) => {
            return Err(lease_lost_response(&lease))
        }
        Err((e, lease)) => {
            release(&layer.store, lease).await;
            return Err(store_failed(e));
        }
    };
    let key_id = phase.lease().key_id();
    let transaction = KeyTransaction::new(phase);
    request.extensions_mut().insert(transaction.clone());
    // Joined, the task has dropped the handler's future, and the clones it held with it.
    let ran = tokio::spawn(inner.oneshot(request)).await;
    match transaction.take_back() {
        Returned::Alone(phase) => settle(layer, Held::Transaction(phase), ran).await,
        Returned::Kept(phase) => {
            Held::Transaction(phase).release(&layer.store).await;
            Err(internal_response(&format!(
                "the handler of key {key_id} kept its KeyTransaction past its return; its \
                 writes were rolled back"
            )))
        }
        Returned::Busy => Err(internal_response(&format!(
            "the handler of key {key_id} still uses its KeyTransaction after its return; its \
             writes roll back when it lets go, and the key waits for its lease to expire"
        ))),
    }
}

/// The 409 of a request whose lease another request with the key took over: that one answers.
fn lease_lost_response(lease: &Lease<OneStep>) -> Response {
    tracing::warn!(
        key_id = lease.key_id(),
        token = lease.token(),
        "lease taken over while the handler ran; the handler was stopped"
    );
    Problem::new(
        StatusCode::CONFLICT,
        types::LEASE_LOST,
        "Request taken over",
    )
    .with_detail(LEASE_LOST_DETAIL)
    .with_retry_after(std::time::Duration::from_secs(1))
    .into_response()
}
