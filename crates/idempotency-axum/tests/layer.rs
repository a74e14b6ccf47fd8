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
use idempotency_axum::IdempotencyLayer;
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

#[sqlx::test(migrations = false)]
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

#[sqlx::test(migrations = false)]
async fn another_body_under_the_key_is_422_and_the_handler_is_not_called(pool: PgPool) {
    let (app, orders) = app(pool).await;
    send(&app, Some("k1"), Some("1"), r#"{"item": "tea"}"#).await;
    let (status, _, body) = send(&app, Some("k1"), Some("1"), r#"{"item": "coffee"}"#).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let problem: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], types::KEY_REUSED);
    assert_eq!(orders.calls.load(Ordering::SeqCst), 1);
}

#[sqlx::test(migrations = false)]
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

#[sqlx::test(migrations = false)]
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

#[sqlx::test(migrations = false)]
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

#[sqlx::test(migrations = false)]
async fn keys_of_different_users_do_not_meet(pool: PgPool) {
    let (app, orders) = app(pool).await;
    let (a, _, _) = send(&app, Some("k1"), Some("1"), r#"{"item": "tea"}"#).await;
    let (b, headers, _) = send(&app, Some("k1"), Some("2"), r#"{"item": "tea"}"#).await;
    assert_eq!((a, b), (StatusCode::CREATED, StatusCode::CREATED));
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(orders.calls.load(Ordering::SeqCst), 2);
}
