//! Every layer key finishes: a key whose server died mid-handler and whose client never came
//! back is retired after the bound, by the injected clock.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idempotency::{ManualClock, Owner, Store};
use idempotency_axum::layer::{DEFAULT_RETIRE_AFTER, RETIRED_TYPE};
use idempotency_axum::IdempotencyLayer;
use serde_json::Value;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio::sync::Notify;
use tower::ServiceExt;

const TTL: Duration = Duration::from_secs(30);

fn router(store: Store, entered: Arc<Notify>) -> Router {
    Router::new()
        .route(
            "/accounts/{id}/deposits",
            post(move || {
                let entered = entered.clone();
                async move {
                    entered.notify_one();
                    // The effect may be under way when the process dies.
                    std::future::pending::<StatusCode>().await
                }
            }),
        )
        .route_layer(IdempotencyLayer::new(store, |_| Ok(Owner::from(1))))
}

fn deposit() -> Request<Body> {
    Request::post("/accounts/bob-1/deposits")
        .header("content-type", "application/json")
        .header("idempotency-key", "k1")
        .body(Body::from(r#"{"amount": 5}"#))
        .unwrap()
}

#[testdb::test(template = crate::migrated)]
async fn a_key_whose_server_died_mid_handler_is_retired_after_the_bound(pool: PgPool) {
    let clock = ManualClock::starting_now();
    let store = Store::new(pool.clone(), Arc::new(clock.clone()), TTL).unwrap();
    // The server runs on a runtime of its own, with a pool of its own, and dies with it: every
    // task (the claimed work, the handler, the lease's renewal) is dropped mid-handler.
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let entered = Arc::new(Notify::new());
    let options = (*pool.connect_options()).clone();
    let (c, e) = (clock.clone(), entered.clone());
    server.spawn(async move {
        let pool = PgPoolOptions::new().connect_with(options).await.unwrap();
        let store = Store::new(pool, Arc::new(c), TTL).unwrap();
        let _ = router(store, e).oneshot(deposit()).await;
    });
    entered.notified().await;
    server.shutdown_background();
    assert_eq!(store.count_unfinished().await.unwrap(), 1);

    let layer = IdempotencyLayer::new(store.clone(), |_| Ok(Owner::from(1)));
    let retirer = layer.retirer();
    // Before the bound, nothing is retired: a retry would still run the handler.
    clock.advance(DEFAULT_RETIRE_AFTER - Duration::from_secs(60));
    assert_eq!(retirer.run_once().await.unwrap(), 0);
    assert_eq!(store.count_unfinished().await.unwrap(), 1);
    clock.advance(Duration::from_secs(120));
    assert_eq!(retirer.run_once().await.unwrap(), 1);
    assert_eq!(store.count_unfinished().await.unwrap(), 0);

    // A late retry gets the documented answer, replayed, and runs nothing.
    let entered = Arc::new(Notify::new());
    let response = router(store, entered.clone())
        .oneshot(deposit())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(response.headers()["idempotent-replayed"], "true");
    let types: Vec<_> = response.headers().get_all("content-type").iter().collect();
    assert_eq!(types, ["application/problem+json"]);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let problem: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], RETIRED_TYPE);
}

#[testdb::test(template = crate::migrated)]
async fn a_retirement_bound_under_an_hour_is_refused(pool: PgPool) {
    let store = Store::new(pool, Arc::new(ManualClock::starting_now()), TTL).unwrap();
    let layer = IdempotencyLayer::new(store, |_| Ok(Owner::from(1)));
    let refused = layer
        .retirer()
        .after(Duration::from_secs(59 * 60))
        .unwrap_err();
    assert!(refused.to_string().contains("an hour"), "{refused}");
    assert!(layer.retirer().after(Duration::from_secs(3600)).is_ok());
}
