//! `IdempotencyLayer` around a real handler, over a fresh PostgreSQL database per test.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idempotency::{DatabaseClock, Store};
use idempotency_axum::problem::types;
use idempotency_axum::{ClaimedKey, Disposition, IdempotencyLayer};
use serde_json::{json, Value};
use sqlx::PgPool;
use tower::ServiceExt;

#[derive(Clone, Default)]
struct Orders {
    calls: Arc<AtomicUsize>,
    failing: Arc<AtomicBool>,
}

/// A one-step handler: counts its calls, answers 201 with a per-delivery header that must not be
/// replayed, or 503 while `failing` is set.
async fn create_order(State(orders): State<Orders>, Json(body): Json<Value>) -> Response {
    if orders.failing.load(Ordering::SeqCst) {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    let n = orders.calls.fetch_add(1, Ordering::SeqCst) + 1;
    let location = format!("/orders/{n}");
    (
        StatusCode::CREATED,
        [("location", location.as_str()), ("x-delivery", "first")],
        Json(json!({ "order": n, "item": body["item"] })),
    )
        .into_response()
}

async fn app(pool: PgPool) -> (Router, Orders) {
    app_with(pool, |layer| layer).await
}

/// The orders app, with its layer changed by `configure`.
async fn app_with(
    pool: PgPool,
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> (Router, Orders) {
    idempotency::migrate(&pool).await.unwrap();
    let store = Store::new(pool, Arc::new(DatabaseClock), Duration::from_secs(30)).unwrap();
    let orders = Orders::default();
    // The user comes from a header here; a real service reads what its auth middleware set.
    let layer = IdempotencyLayer::new(store, |parts| {
        parts
            .headers
            .get("x-user")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .ok_or(StatusCode::UNAUTHORIZED)
    })
    .max_body(1024);
    let layer = configure(layer);
    let router = Router::new()
        .route("/orders", post(create_order))
        .route_layer(layer)
        .with_state(orders.clone());
    (router, orders)
}

async fn send(
    app: &Router,
    key: Option<&str>,
    user: Option<&str>,
    body: &str,
) -> (StatusCode, http::HeaderMap, Vec<u8>) {
    let mut request = Request::post("/orders").header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    if let Some(user) = user {
        request = request.header("x-user", user);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::from(body.to_owned())).unwrap())
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes().to_vec(),
    )
}

async fn keys(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[testdb::test(template = crate::migrated)]
async fn a_replay_repeats_the_stored_answer_without_calling_the_handler(pool: PgPool) {
    let (app, orders) = app(pool).await;
    let (status, headers, body) = send(&app, Some("k1"), Some("1"), r#"{"item": "tea"}"#).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get("idempotent-replayed").is_none());
    assert!(
        headers.get("x-delivery").is_none(),
        "only outcome headers are kept, on every delivery"
    );
    let (again, again_headers, again_body) =
        send(&app, Some("k1"), Some("1"), "{ \"item\" : \"tea\" }").await;
    assert_eq!(again, StatusCode::CREATED);
    assert_eq!(again_headers["idempotent-replayed"], "true");
    assert_eq!(again_headers["location"], headers["location"]);
    assert_eq!(again_body, body);
    assert_eq!(orders.calls.load(Ordering::SeqCst), 1);
}

#[testdb::test(template = crate::migrated)]
async fn another_body_under_the_key_is_422_and_the_handler_is_not_called(pool: PgPool) {
    let (app, orders) = app(pool).await;
    send(&app, Some("k1"), Some("1"), r#"{"item": "tea"}"#).await;
    let (status, _, body) = send(&app, Some("k1"), Some("1"), r#"{"item": "coffee"}"#).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let problem: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], types::KEY_REUSED);
    assert_eq!(orders.calls.load(Ordering::SeqCst), 1);
}

#[testdb::test(template = crate::migrated)]
async fn a_5xx_answer_is_not_stored_and_the_retry_calls_the_handler_again(pool: PgPool) {
    let (app, orders) = app(pool).await;
    orders.failing.store(true, Ordering::SeqCst);
    let (status, _, _) = send(&app, Some("k1"), Some("1"), r#"{"item": "tea"}"#).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    orders.failing.store(false, Ordering::SeqCst);
    // The lease was released, so the retry does not wait for it to expire.
    let (status, headers, _) = send(&app, Some("k1"), Some("1"), r#"{"item": "tea"}"#).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(orders.calls.load(Ordering::SeqCst), 1);
}

#[testdb::test(template = crate::migrated)]
async fn concurrent_requests_with_one_key_call_the_handler_once(pool: PgPool) {
    let (app, orders) = app(pool).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (app, barrier) = (app.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            send(&app, Some("same"), Some("1"), r#"{"item": "tea"}"#).await
        }));
    }
    let mut first = 0;
    for task in tasks {
        let (status, headers, _) = task.await.unwrap();
        match status {
            StatusCode::CREATED if headers.get("idempotent-replayed").is_none() => first += 1,
            StatusCode::CREATED => {}
            StatusCode::CONFLICT => assert!(headers.get("retry-after").is_some()),
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(first, 1);
    assert_eq!(orders.calls.load(Ordering::SeqCst), 1);
}

#[testdb::test(template = crate::migrated)]
async fn refusals_before_the_claim_write_nothing_and_call_nothing(pool: PgPool) {
    let (app, orders) = app(pool.clone()).await;
    let (missing, _, _) = send(&app, None, Some("1"), r#"{"item": "tea"}"#).await;
    assert_eq!(missing, StatusCode::BAD_REQUEST);
    let (anonymous, _, _) = send(&app, Some("k1"), None, r#"{"item": "tea"}"#).await;
    assert_eq!(anonymous, StatusCode::UNAUTHORIZED);
    let big = format!(r#"{{"item": "{}"}}"#, "t".repeat(2000));
    let (too_large, _, body) = send(&app, Some("k1"), Some("1"), &big).await;
    assert_eq!(too_large, StatusCode::PAYLOAD_TOO_LARGE);
    let problem: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], types::BODY_TOO_LARGE);
    assert_eq!(keys(&pool).await, 0);
    assert_eq!(orders.calls.load(Ordering::SeqCst), 0);
}

#[testdb::test(template = crate::migrated)]
async fn keys_of_different_users_do_not_meet(pool: PgPool) {
    let (app, orders) = app(pool).await;
    let (a, _, _) = send(&app, Some("k1"), Some("1"), r#"{"item": "tea"}"#).await;
    let (b, headers, _) = send(&app, Some("k1"), Some("2"), r#"{"item": "tea"}"#).await;
    assert_eq!((a, b), (StatusCode::CREATED, StatusCode::CREATED));
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(orders.calls.load(Ordering::SeqCst), 2);
}

/// A layer whose user is `1`, over `router`.
fn layer_for(pool: &PgPool) -> IdempotencyLayer {
    let store = Store::new(
        pool.clone(),
        Arc::new(DatabaseClock),
        Duration::from_secs(30),
    )
    .unwrap();
    IdempotencyLayer::new(store, |_| Ok(idempotency::Owner::from(1)))
}

async fn post_with(app: &Router, path: &str, key: &str, body: Body) -> Response {
    let request = Request::post(path)
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(body)
        .unwrap();
    app.clone().oneshot(request).await.unwrap()
}

async fn read(response: Response) -> (StatusCode, bool, Vec<u8>) {
    let replayed = response.headers().get("idempotent-replayed").is_some();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, replayed, body.to_vec())
}

/// A handler that counts its calls and answers with its call number.
fn counting() -> (
    Arc<AtomicUsize>,
    impl Fn() -> Response + Clone + Send + Sync + 'static,
) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let handler = move || {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        (StatusCode::CREATED, format!("call {n}")).into_response()
    };
    (calls, handler)
}

/// The router of `/accounts/{id}/transfers`, with a counting handler.
fn transfers(pool: &PgPool) -> (Router, Arc<AtomicUsize>) {
    let (calls, handler) = counting();
    let app = Router::new()
        .route(
            "/accounts/{id}/transfers",
            post(move || std::future::ready(handler())),
        )
        .route_layer(layer_for(pool));
    (app, calls)
}

async fn scopes(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT request_path FROM idempotency_keys ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[testdb::test(template = crate::migrated)]
async fn keys_are_scoped_by_the_route_template_and_the_concrete_path_is_the_payload(pool: PgPool) {
    let (app, calls) = transfers(&pool);
    let body = || Body::from(r#"{"amount": 5}"#);
    let (status, replayed, _) =
        read(post_with(&app, "/accounts/A/transfers", "k1", body()).await).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(scopes(&pool).await, ["/accounts/{id}/transfers"]);
    // The same key on another resource, or with a query, is the same key with another payload.
    for path in ["/accounts/B/transfers", "/accounts/A/transfers?note=x"] {
        let (status, _, _) = read(post_with(&app, path, "k1", body()).await).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{path}");
    }
    // Another key on another resource is another request; the first still replays.
    let (status, replayed, _) =
        read(post_with(&app, "/accounts/B/transfers", "k2", body()).await).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let (_, replayed, answer) =
        read(post_with(&app, "/accounts/A/transfers", "k1", body()).await).await;
    assert!(replayed);
    assert_eq!(answer, b"call 1");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    // A path longer than the scope column is only in the fingerprint now.
    let long = format!("/accounts/{}/transfers", "L".repeat(400));
    let (status, replayed, _) = read(post_with(&app, &long, "k3", body()).await).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let (_, replayed, _) = read(post_with(&app, &long, "k3", body()).await).await;
    assert!(replayed);
}

#[testdb::test(template = crate::migrated)]
async fn a_key_stored_under_its_concrete_path_by_an_earlier_version_still_replays(pool: PgPool) {
    let (app, calls) = transfers(&pool);
    // What an earlier version stored: the concrete path as the scope and the fingerprint's
    // route, the JSON fingerprint untagged.
    let params = json!({"amount": 5});
    let path = "/accounts/A/transfers";
    let store = Store::new(
        pool.clone(),
        Arc::new(DatabaseClock),
        Duration::from_secs(30),
    )
    .unwrap();
    let key = idempotency::IdempotencyKey::parse(b"k1").unwrap();
    let claim = store
        .claim::<idempotency::OneStep>(idempotency::NewRequest {
            owner: &idempotency::Owner::from(1),
            method: "POST",
            route: path,
            key: &key,
            fingerprint: idempotency::Fingerprint::of_json("POST", path, &params),
            params: &params,
        })
        .await
        .unwrap();
    let idempotency::Claim::Acquired(mut lease) = claim else {
        panic!("a new key is acquired");
    };
    let stored = idempotency::StoredResponse {
        status: 201,
        headers: vec![],
        body: b"stored before the upgrade".to_vec(),
    };
    store
        .final_phase(&mut lease)
        .await
        .unwrap()
        .finish(&stored)
        .await
        .unwrap();
    let (status, replayed, answer) =
        read(post_with(&app, path, "k1", Body::from(r#"{"amount": 5}"#)).await).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(answer, b"stored before the upgrade");
    let (status, _, _) =
        read(post_with(&app, path, "k1", Body::from(r#"{"amount": 6}"#)).await).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    // The new key the template claim made on the way was let go.
    assert_eq!(scopes(&pool).await, [path]);
}

#[testdb::test(template = crate::migrated)]
async fn a_client_that_hangs_up_does_not_cancel_the_claimed_work(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let gate = Arc::new(tokio::sync::Notify::new());
    let entered = Arc::new(tokio::sync::Notify::new());
    let (calls, handler) = counting();
    let (g, e) = (gate.clone(), entered.clone());
    let app = Router::new()
        .route(
            "/orders",
            post(move || {
                let (gate, entered, handler) = (g.clone(), e.clone(), handler.clone());
                async move {
                    entered.notify_one();
                    gate.notified().await;
                    handler()
                }
            }),
        )
        .route_layer(layer_for(&pool));
    // The client waits until the handler runs, then hangs up (its future is dropped).
    let client = post_with(&app, "/orders", "k1", Body::from("{}"));
    tokio::select! {
        _ = client => panic!("the handler waits at the gate"),
        () = entered.notified() => {}
    }
    gate.notify_one();
    // The work goes on without its client and stores the answer (bounded wait).
    testdb::until(
        "the answer was stored after the client left",
        Duration::from_secs(5),
        || async {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM idempotency_keys WHERE finished_at IS NOT NULL",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            (n == 1).then_some(())
        },
    )
    .await;
    let (status, replayed, body) =
        read(post_with(&app, "/orders", "k1", Body::from("{}")).await).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(body, b"call 1");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[testdb::test(template = crate::migrated)]
async fn a_handler_that_panics_releases_the_key_and_answers_500(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let panicking = Arc::new(AtomicBool::new(true));
    let (calls, handler) = counting();
    let p = panicking.clone();
    let app = Router::new()
        .route(
            "/orders",
            post(move || {
                let (panicking, handler) = (p.clone(), handler.clone());
                async move {
                    assert!(!panicking.load(Ordering::SeqCst), "the handler's own bug");
                    handler()
                }
            }),
        )
        .route_layer(layer_for(&pool));
    let (status, _, body) = read(post_with(&app, "/orders", "k1", Body::from("{}")).await).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let problem: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], types::HANDLER_FAILED);
    let locked: bool = sqlx::query_scalar("SELECT locked_until IS NOT NULL FROM idempotency_keys")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        !locked,
        "the key was released, not left locked until its lease expires"
    );
    panicking.store(false, Ordering::SeqCst);
    let (status, replayed, _) =
        read(post_with(&app, "/orders", "k1", Body::from("{}")).await).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[testdb::test(template = crate::migrated)]
async fn an_answer_too_large_to_store_is_delivered_whole_and_its_key_released(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let app = Router::new()
        .route(
            "/reports",
            post(move || {
                c.fetch_add(1, Ordering::SeqCst);
                std::future::ready((StatusCode::OK, "r".repeat(100)).into_response())
            }),
        )
        .route_layer(layer_for(&pool).max_stored_body(64));
    for attempt in 1..=2 {
        let (status, replayed, body) =
            read(post_with(&app, "/reports", "k1", Body::from("{}")).await).await;
        assert_eq!(
            (status, replayed),
            (StatusCode::OK, false),
            "attempt {attempt}"
        );
        assert_eq!(
            body,
            "r".repeat(100).into_bytes(),
            "the whole answer, every time"
        );
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "not stored: the retry runs the handler again"
    );
    let unfinished: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_keys WHERE finished_at IS NULL AND locked_until IS NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(unfinished, 1, "released, not finished");
}

/// A request body that gives one piece and then fails, as a connection cut mid-body does.
struct Failing(bool);

impl http_body::Body for Failing {
    type Data = bytes::Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>> {
        if self.0 {
            return std::task::Poll::Ready(Some(Err(std::io::Error::other("connection reset"))));
        }
        self.0 = true;
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(bytes::Bytes::from(
            "{\"a\"",
        )))))
    }
}

#[testdb::test(template = crate::migrated)]
async fn a_body_that_cannot_be_read_is_400_and_claims_nothing(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let (calls, handler) = counting();
    let app = Router::new()
        .route("/orders", post(move || std::future::ready(handler())))
        .route_layer(layer_for(&pool));
    let (status, _, body) =
        read(post_with(&app, "/orders", "k1", Body::new(Failing(false))).await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let problem: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], types::BAD_BODY);
    assert_eq!(keys(&pool).await, 0);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[testdb::test(template = crate::migrated)]
async fn a_json_body_with_a_nul_is_kept_by_its_bytes_and_replays(pool: PgPool) {
    let (app, orders) = app(pool).await;
    let body = r#"{"item": "t\u0000a"}"#;
    let (status, _, first) = send(&app, Some("k1"), Some("1"), body).await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&first)
    );
    let (again, headers, replay) = send(&app, Some("k1"), Some("1"), body).await;
    assert_eq!(again, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(replay, first);
    assert_eq!(orders.calls.load(Ordering::SeqCst), 1);
}

/// A router whose handler counts its calls and, on its first call only, signals `entered` and
/// waits at `gate`; `dropped` is set when that first call's future is dropped unfinished. The
/// layer's store runs on `clock`, and renews every 20 ms.
fn slow_handler_app(
    pool: &PgPool,
    clock: &idempotency::ManualClock,
) -> (
    Router,
    Arc<AtomicUsize>,
    Arc<tokio::sync::Notify>,
    Arc<tokio::sync::Notify>,
    Arc<AtomicBool>,
) {
    struct SetOnDrop(Arc<AtomicBool>);
    impl Drop for SetOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let store = Store::new(
        pool.clone(),
        Arc::new(clock.clone()),
        Duration::from_secs(30),
    )
    .unwrap();
    let layer = IdempotencyLayer::new(store, |_| Ok(idempotency::Owner::from(1)))
        .with_heartbeat(Duration::from_millis(20));
    let (calls, gate, entered) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let dropped = Arc::new(AtomicBool::new(false));
    let (c, g, e, d) = (
        calls.clone(),
        gate.clone(),
        entered.clone(),
        dropped.clone(),
    );
    let app = Router::new()
        .route(
            "/orders",
            post(move || {
                let (calls, gate, entered, dropped) = (c.clone(), g.clone(), e.clone(), d.clone());
                async move {
                    let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                    if n == 1 {
                        let unfinished = SetOnDrop(dropped);
                        entered.notify_one();
                        gate.notified().await;
                        std::mem::forget(unfinished);
                    }
                    (StatusCode::CREATED, format!("call {n}")).into_response()
                }
            }),
        )
        .route_layer(layer);
    (app, calls, gate, entered, dropped)
}

/// The key's lease end, as the database has it.
async fn locked_until(pool: &PgPool) -> Option<sqlx::types::time::OffsetDateTime> {
    sqlx::query_scalar("SELECT locked_until FROM idempotency_keys")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[testdb::test(template = crate::migrated)]
async fn a_handler_slower_than_the_lease_keeps_its_key_and_runs_once(pool: PgPool) {
    use idempotency::Clock;
    idempotency::migrate(&pool).await.unwrap();
    let clock = idempotency::ManualClock::starting_now();
    let (app, calls, gate, entered, _) = slow_handler_app(&pool, &clock);
    let first = tokio::spawn({
        let app = app.clone();
        async move { read(post_with(&app, "/orders", "k1", Body::from("{}")).await).await }
    });
    entered.notified().await;
    // Two thirds of the lease pass while the handler is at work.
    clock.advance(Duration::from_secs(20));
    let now = clock.now().unwrap();
    // The heartbeat renews it from the moved time, past its first end (bounded wait for the
    // next beat).
    testdb::until(
        "the lease was renewed while the handler ran",
        Duration::from_secs(5),
        || async {
            locked_until(&pool)
                .await
                .is_some_and(|until| until > now + Duration::from_secs(11))
                .then_some(())
        },
    )
    .await;
    // The handler is still at work when its first lease would have ended.
    clock.advance(Duration::from_secs(11));
    // A retry meanwhile is told the request is in flight, and runs nothing.
    let (status, _, _) = read(post_with(&app, "/orders", "k1", Body::from("{}")).await).await;
    assert_eq!(status, StatusCode::CONFLICT);
    gate.notify_one();
    let (status, replayed, body) = first.await.unwrap();
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(body, b"call 1");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[testdb::test(template = crate::migrated)]
async fn a_handler_whose_lease_is_taken_over_is_stopped_and_answers_409(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let clock = idempotency::ManualClock::starting_now();
    let (app, calls, _gate, entered, dropped) = slow_handler_app(&pool, &clock);
    let first = tokio::spawn({
        let app = app.clone();
        async move { post_with(&app, "/orders", "k1", Body::from("{}")).await }
    });
    entered.notified().await;
    // Another holder takes the key over (a new fencing token), as a retry would after a pause.
    sqlx::query("UPDATE idempotency_keys SET lease_token = lease_token + 1")
        .execute(&pool)
        .await
        .unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("the next renewal stops the handler")
        .unwrap();
    assert_eq!(answer.status(), StatusCode::CONFLICT);
    let body: Value = serde_json::from_slice(&read(answer).await.2).unwrap();
    assert_eq!(body["type"], types::LEASE_LOST);
    // Its work was dropped at its await, not run to its end, and nothing was stored.
    testdb::until(
        "the handler was stopped",
        Duration::from_secs(5),
        || async { dropped.load(Ordering::SeqCst).then_some(()) },
    )
    .await;
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let finished: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE finished_at IS NOT NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(finished, 0);
}

#[testdb::test(template = crate::migrated)]
async fn a_raw_body_equal_to_the_hex_of_another_is_refused_not_replayed(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let (calls, handler) = counting();
    let app = Router::new()
        .route("/orders", post(move || std::future::ready(handler())))
        .route_layer(layer_for(&pool));
    let raw: &[u8] = b"\xff\xfe not json";
    let (status, _, _) = read(post_with(&app, "/orders", "k1", Body::from(raw)).await).await;
    assert_eq!(status, StatusCode::CREATED);
    // The same key with the JSON string that the first body's bytes are stored as.
    let as_hex = serde_json::to_string(&hex_of(raw)).unwrap();
    let (status, replayed, _) =
        read(post_with(&app, "/orders", "k1", Body::from(as_hex)).await).await;
    assert_eq!(
        (status, replayed),
        (StatusCode::UNPROCESSABLE_ENTITY, false)
    );
    // The raw body itself still replays.
    let (status, replayed, _) = read(post_with(&app, "/orders", "k1", Body::from(raw)).await).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[testdb::test(template = crate::migrated)]
async fn a_raw_body_stored_under_the_old_fingerprint_still_replays(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let (calls, handler) = counting();
    let app = Router::new()
        .route("/orders", post(move || std::future::ready(handler())))
        .route_layer(layer_for(&pool));
    // A key an earlier version stored for a raw body: fingerprinted as the JSON string of the
    // body's hex, and finished.
    let raw: &[u8] = b"\xff\xfe not json";
    let params = Value::String(hex_of(raw));
    let store = Store::new(
        pool.clone(),
        Arc::new(DatabaseClock),
        Duration::from_secs(30),
    )
    .unwrap();
    let key = idempotency::IdempotencyKey::parse(b"k1").unwrap();
    let claim = store
        .claim::<idempotency::OneStep>(idempotency::NewRequest {
            owner: &idempotency::Owner::from(1),
            method: "POST",
            route: "/orders",
            key: &key,
            fingerprint: idempotency::Fingerprint::of_json("POST", "/orders", &params),
            params: &params,
        })
        .await
        .unwrap();
    let idempotency::Claim::Acquired(mut lease) = claim else {
        panic!("a new key is acquired");
    };
    let stored = idempotency::StoredResponse {
        status: 201,
        headers: vec![],
        body: b"call 0".to_vec(),
    };
    store
        .final_phase(&mut lease)
        .await
        .unwrap()
        .finish(&stored)
        .await
        .unwrap();
    // The same body after the upgrade replays it, and runs nothing.
    let (status, replayed, body) =
        read(post_with(&app, "/orders", "k1", Body::from(raw)).await).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(body, b"call 0");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

/// Runs a handler that refuses an order without an item with `refusal` (its own validation) and
/// creates the others, and checks that the refusal forgets the key.
async fn a_validation_refusal_forgets_the_key(pool: PgPool, refusal: StatusCode) {
    idempotency::migrate(&pool).await.unwrap();
    let (refused, created) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (r, c) = (refused.clone(), created.clone());
    let app = Router::new()
        .route(
            "/orders",
            post(move |Json(body): Json<Value>| {
                let (refused, created) = (r.clone(), c.clone());
                async move {
                    if body["item"].as_str().is_none_or(str::is_empty) {
                        refused.fetch_add(1, Ordering::SeqCst);
                        return (refusal, "an order needs an item").into_response();
                    }
                    let n = created.fetch_add(1, Ordering::SeqCst) + 1;
                    (StatusCode::CREATED, format!("order {n}")).into_response()
                }
            }),
        )
        .route_layer(layer_for(&pool));
    let bad = || Body::from(r#"{"item": ""}"#);
    let good = || Body::from(r#"{"item": "tea"}"#);
    for attempt in 1..=2 {
        let (status, replayed, _) = read(post_with(&app, "/orders", "k1", bad()).await).await;
        assert_eq!((status, replayed), (refusal, false), "attempt {attempt}");
        assert_eq!(keys(&pool).await, 0, "the refusal left no key behind");
    }
    assert_eq!(
        refused.load(Ordering::SeqCst),
        2,
        "not replayed: the handler refused each time"
    );
    // The corrected payload under the same key runs, and its answer is the key's.
    let (status, replayed, body) = read(post_with(&app, "/orders", "k1", good()).await).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let (status, replayed, again) = read(post_with(&app, "/orders", "k1", good()).await).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(again, body);
    assert_eq!(created.load(Ordering::SeqCst), 1);
    // The key now holds the corrected payload: the bad one is refused as a reuse.
    let (status, _, _) = read(post_with(&app, "/orders", "k1", bad()).await).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(refused.load(Ordering::SeqCst), 2);
}

#[testdb::test(template = crate::migrated)]
async fn a_handler_400_forgets_the_key_and_a_corrected_body_then_runs_and_is_stored(pool: PgPool) {
    a_validation_refusal_forgets_the_key(pool, StatusCode::BAD_REQUEST).await;
}

#[testdb::test(template = crate::migrated)]
async fn a_handler_422_forgets_the_key_and_a_corrected_body_then_runs_and_is_stored(pool: PgPool) {
    a_validation_refusal_forgets_the_key(pool, StatusCode::UNPROCESSABLE_ENTITY).await;
}

#[testdb::test(template = crate::migrated)]
async fn a_predicate_that_stores_a_503_replays_it(pool: PgPool) {
    let (app, orders) = app_with(pool, |layer| {
        layer.with_disposition(|answer| match answer.status {
            StatusCode::SERVICE_UNAVAILABLE => Disposition::Store,
            status => Disposition::for_status(status),
        })
    })
    .await;
    orders.failing.store(true, Ordering::SeqCst);
    let (status, headers, _) = send(&app, Some("k1"), Some("1"), r#"{"item": "tea"}"#).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(headers.get("idempotent-replayed").is_none());
    // The handler would now create the order, but the key's answer is the stored 503.
    orders.failing.store(false, Ordering::SeqCst);
    let (status, headers, _) = send(&app, Some("k1"), Some("1"), r#"{"item": "tea"}"#).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(orders.calls.load(Ordering::SeqCst), 0);
}

#[testdb::test(template = crate::migrated)]
async fn a_handler_409_releases_the_key_and_the_retry_runs_the_handler_again(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let app = Router::new()
        .route(
            "/orders",
            post(move || {
                // The first call meets a conflict of the application's own; the next succeeds.
                let n = c.fetch_add(1, Ordering::SeqCst) + 1;
                let status = if n == 1 {
                    StatusCode::CONFLICT
                } else {
                    StatusCode::CREATED
                };
                std::future::ready((status, format!("call {n}")).into_response())
            }),
        )
        .route_layer(layer_for(&pool));
    let (status, replayed, _) =
        read(post_with(&app, "/orders", "k1", Body::from("{}")).await).await;
    assert_eq!((status, replayed), (StatusCode::CONFLICT, false));
    let released: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_keys WHERE finished_at IS NULL AND locked_until IS NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(released, 1, "the key kept its row, released");
    let (status, replayed, body) =
        read(post_with(&app, "/orders", "k1", Body::from("{}")).await).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(body, b"call 2");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[testdb::test(template = crate::migrated)]
async fn a_refusal_whose_key_is_referenced_releases_it_with_its_payload(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    sqlx::query("CREATE TABLE audit (key_id BIGINT NOT NULL REFERENCES idempotency_keys (id))")
        .execute(&pool)
        .await
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let (c, db) = (calls.clone(), pool.clone());
    let app = Router::new()
        .route(
            "/orders",
            post(move || {
                let (calls, db) = (c.clone(), db.clone());
                async move {
                    // A handler that writes under its key and then refuses: against Forget's
                    // contract, so the delete of its key is refused.
                    calls.fetch_add(1, Ordering::SeqCst);
                    sqlx::query("INSERT INTO audit SELECT id FROM idempotency_keys")
                        .execute(&db)
                        .await
                        .unwrap();
                    StatusCode::BAD_REQUEST.into_response()
                }
            }),
        )
        .route_layer(layer_for(&pool));
    let (status, _, _) = read(post_with(&app, "/orders", "k1", Body::from("{}")).await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "the answer is delivered");
    assert_eq!(keys(&pool).await, 1, "the referenced key was not deleted");
    assert!(
        locked_until(&pool).await.is_none(),
        "the key was released, not left locked until its lease ends"
    );
    // The same payload runs the handler again at once, and is refused again.
    let (status, replayed, _) =
        read(post_with(&app, "/orders", "k1", Body::from("{}")).await).await;
    assert_eq!((status, replayed), (StatusCode::BAD_REQUEST, false));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert!(locked_until(&pool).await.is_none(), "released again");
    // The key kept its payload: another one under it is a reuse.
    let (status, _, body) =
        read(post_with(&app, "/orders", "k1", Body::from(r#"{"item": "tea"}"#)).await).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let problem: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], types::KEY_REUSED);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A handler that answers 201 with a transfer id, a location and a header of its own.
async fn create_transfer() -> Response {
    (
        StatusCode::CREATED,
        [
            ("x-transfer-id", "tr_1"),
            ("location", "/transfers/tr_1"),
            ("x-trace", "first-delivery"),
        ],
        "created",
    )
        .into_response()
}

#[testdb::test(template = crate::migrated)]
async fn configured_headers_are_stored_and_replayed_and_the_others_are_not(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let layer = layer_for(&pool)
        .store_headers(["Content-Type", "X-Transfer-Id"])
        .unwrap();
    let app = Router::new()
        .route("/transfers", post(create_transfer))
        .route_layer(layer);
    for replayed in [false, true] {
        let answer = post_with(&app, "/transfers", "k1", Body::from("{}")).await;
        let headers = answer.headers();
        assert_eq!(
            headers.get("idempotent-replayed").is_some(),
            replayed,
            "{headers:?}"
        );
        assert_eq!(headers["x-transfer-id"], "tr_1", "replayed: {replayed}");
        assert_eq!(headers["content-type"], "text/plain; charset=utf-8");
        assert!(
            headers.get("x-trace").is_none(),
            "not named: not stored, on any delivery"
        );
        assert!(
            headers.get("location").is_none(),
            "the list replaces the default"
        );
    }
}

#[sqlx::test(migrations = false)]
async fn header_names_and_per_delivery_headers_are_refused_as_stored_headers(pool: PgPool) {
    use idempotency_axum::layer::StoredHeaderError;
    assert!(layer_for(&pool)
        .store_headers([http::header::LOCATION, http::header::ETAG])
        .is_ok());
    assert!(matches!(
        layer_for(&pool).store_headers(["x transfer id"]),
        Err(StoredHeaderError::InvalidName(name)) if name == "x transfer id"
    ));
    for name in ["Set-Cookie", "date"] {
        assert!(matches!(
            layer_for(&pool).store_headers([name]),
            Err(StoredHeaderError::Unstorable(_))
        ));
    }
}

/// What a handler saw of its claimed key.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    key_id: i64,
    request_uuid: idempotency::Uuid,
    owner: String,
    key: String,
    attempt: i32,
}

#[testdb::test(template = crate::migrated)]
async fn the_handler_sees_its_claimed_key_and_its_uuid_survives_a_retry(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::<Seen>::new()));
    let failing = Arc::new(AtomicBool::new(true));
    let (s, f) = (seen.clone(), failing.clone());
    let app = Router::new()
        .route(
            "/transfers",
            post(move |claimed: ClaimedKey| {
                let (seen, failing) = (s.clone(), f.clone());
                async move {
                    seen.lock().unwrap().push(Seen {
                        key_id: claimed.key_id(),
                        request_uuid: claimed.request_uuid(),
                        owner: claimed.owner().to_string(),
                        key: claimed.key().as_str().to_owned(),
                        attempt: claimed.attempt(),
                    });
                    if failing.load(Ordering::SeqCst) {
                        return StatusCode::SERVICE_UNAVAILABLE.into_response();
                    }
                    let foreign = format!("notify-{}", claimed.request_uuid());
                    (StatusCode::CREATED, foreign).into_response()
                }
            }),
        )
        .route_layer(layer_for(&pool));
    let (status, _, _) = read(post_with(&app, "/transfers", "k1", Body::from("{}")).await).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    failing.store(false, Ordering::SeqCst);
    let (status, _, body) = read(post_with(&app, "/transfers", "k1", Body::from("{}")).await).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, _, _) = read(post_with(&app, "/transfers", "k2", Body::from("{}")).await).await;
    assert_eq!(status, StatusCode::CREATED);

    let seen = seen.lock().unwrap().clone();
    let [first, retry, other] = seen.as_slice() else {
        panic!("three runs of the handler: {seen:?}");
    };
    let stored: (i64, idempotency::Uuid) = sqlx::query_as(
        "SELECT id, request_uuid FROM idempotency_keys WHERE idempotency_key = 'k1'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (first.key_id, first.request_uuid),
        stored,
        "the key row's own"
    );
    assert_eq!(
        (first.owner.as_str(), first.key.as_str(), first.attempt),
        ("1", "k1", 1)
    );
    assert_eq!(
        (retry.key_id, retry.request_uuid, retry.attempt),
        (first.key_id, first.request_uuid, 2),
        "the retry runs under the same key row, one attempt later"
    );
    assert_eq!(body, format!("notify-{}", first.request_uuid).into_bytes());
    assert_eq!((other.key.as_str(), other.attempt), ("k2", 1));
    assert_ne!(other.request_uuid, first.request_uuid);
    assert_ne!(other.key_id, first.key_id);
}

#[tokio::test]
async fn a_claimed_key_asked_for_without_the_layer_is_a_500_problem() {
    let app = Router::new().route("/transfers", post(|_: ClaimedKey| async { "unreachable" }));
    let (status, _, body) = read(post_with(&app, "/transfers", "k1", Body::from("{}")).await).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let problem: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], types::HANDLER_FAILED);
    assert_eq!(
        problem["detail"],
        idempotency_axum::layer::NOT_CLAIMED_DETAIL
    );
}

/// A handler that answers 503 while `failing` is set, and otherwise 201 with the body it got,
/// byte for byte: whose payload ran shows in the answer.
fn echoing(pool: &PgPool) -> (Router, Arc<AtomicBool>, Arc<AtomicUsize>) {
    let failing = Arc::new(AtomicBool::new(true));
    let calls = Arc::new(AtomicUsize::new(0));
    let (f, c) = (failing.clone(), calls.clone());
    let app = Router::new()
        .route(
            "/orders",
            post(move |body: axum::body::Bytes| {
                let (failing, calls) = (f.clone(), c.clone());
                async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    if failing.load(Ordering::SeqCst) {
                        return StatusCode::SERVICE_UNAVAILABLE.into_response();
                    }
                    (StatusCode::CREATED, body).into_response()
                }
            }),
        )
        .route_layer(layer_for(pool));
    (app, failing, calls)
}

#[testdb::test(template = crate::migrated)]
async fn a_raw_body_cannot_take_over_a_key_a_json_body_of_its_hex_left(pool: PgPool) {
    let (app, failing, calls) = echoing(&pool);
    // The JSON string of the hex of `hello`; the handler fails, the key is released.
    let as_json = r#""68656c6c6f""#;
    let (status, _, _) = read(post_with(&app, "/orders", "k1", Body::from(as_json)).await).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    failing.store(false, Ordering::SeqCst);
    // The raw body `hello` under the key is another payload.
    let (status, replayed, body) =
        read(post_with(&app, "/orders", "k1", Body::from("hello")).await).await;
    assert_eq!(
        (status, replayed),
        (StatusCode::UNPROCESSABLE_ENTITY, false),
        "{}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the raw body ran nothing");
    // The first payload, sent again, runs as itself and gets its own answer.
    let (status, replayed, body) =
        read(post_with(&app, "/orders", "k1", Body::from(as_json)).await).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(body, as_json.as_bytes());
    let (status, replayed, body) =
        read(post_with(&app, "/orders", "k1", Body::from(as_json)).await).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(body, as_json.as_bytes());
    let (status, _, _) = read(post_with(&app, "/orders", "k1", Body::from("hello")).await).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
}

#[testdb::test(template = crate::migrated)]
async fn a_json_body_cannot_take_over_a_key_the_raw_body_of_its_hex_left(pool: PgPool) {
    let (app, failing, calls) = echoing(&pool);
    let as_json = r#""68656c6c6f""#;
    let (status, _, _) = read(post_with(&app, "/orders", "k1", Body::from("hello")).await).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    failing.store(false, Ordering::SeqCst);
    let (status, _, _) = read(post_with(&app, "/orders", "k1", Body::from(as_json)).await).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the JSON body ran nothing");
    let (status, replayed, body) =
        read(post_with(&app, "/orders", "k1", Body::from("hello")).await).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(body, b"hello");
}

#[testdb::test(template = crate::migrated)]
async fn a_json_body_stored_under_the_untagged_fingerprint_still_replays(pool: PgPool) {
    let (app, _, calls) = echoing(&pool);
    // A key an earlier version stored for a JSON body: its fingerprint over the bare target.
    let params = json!({"item": "tea"});
    let store = Store::new(
        pool.clone(),
        Arc::new(DatabaseClock),
        Duration::from_secs(30),
    )
    .unwrap();
    let key = idempotency::IdempotencyKey::parse(b"k1").unwrap();
    let claim = store
        .claim::<idempotency::OneStep>(idempotency::NewRequest {
            owner: &idempotency::Owner::from(1),
            method: "POST",
            route: "/orders",
            key: &key,
            fingerprint: idempotency::Fingerprint::of_json("POST", "/orders", &params),
            params: &params,
        })
        .await
        .unwrap();
    let idempotency::Claim::Acquired(mut lease) = claim else {
        panic!("a new key is acquired");
    };
    let stored = idempotency::StoredResponse {
        status: 201,
        headers: vec![],
        body: b"stored before the upgrade".to_vec(),
    };
    store
        .final_phase(&mut lease)
        .await
        .unwrap()
        .finish(&stored)
        .await
        .unwrap();
    let body = r#"{ "item" : "tea" }"#;
    let (status, replayed, answer) =
        read(post_with(&app, "/orders", "k1", Body::from(body)).await).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(answer, b"stored before the upgrade");
    let (status, _, _) =
        read(post_with(&app, "/orders", "k1", Body::from(r#"{"item": "coffee"}"#)).await).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}
