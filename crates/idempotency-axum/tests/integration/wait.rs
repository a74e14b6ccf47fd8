//! `Prefer: wait=N`: a duplicate waits for its key's holder instead of answering 409, holding
//! no pooled connection while it waits.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idempotency::{ClaimOutcome, DatabaseClock, Observer, Store};
use idempotency_axum::IdempotencyLayer;
use serde_json::Value;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio::sync::Notify;
use tower::ServiceExt;

/// Counts the claims that found their key held, and signals each.
#[derive(Default)]
struct InFlightClaims {
    count: AtomicUsize,
    changed: Notify,
}

impl Observer for InFlightClaims {
    fn claimed(&self, _route: &str, outcome: ClaimOutcome, _took: Duration) {
        if outcome == ClaimOutcome::InFlight {
            self.count.fetch_add(1, Ordering::SeqCst);
            self.changed.notify_waiters();
        }
    }
}

impl InFlightClaims {
    async fn reach(&self, n: usize) {
        loop {
            let changed = self.changed.notified();
            if self.count.load(Ordering::SeqCst) >= n {
                return;
            }
            changed.await;
        }
    }
}

struct Gated {
    app: Router,
    entered: Arc<Notify>,
    gate: Arc<Notify>,
    calls: Arc<AtomicUsize>,
    in_flight: Arc<InFlightClaims>,
}

/// `/orders` waits at a gate on its first call, then answers `call N`; `/other` answers at once.
/// The layer's store runs on a pool of `connections`, whose acquire gives up after 5 s (a
/// starved pool shows as a 500, not as a hang).
async fn gated(pool: &PgPool, connections: u32) -> Gated {
    let small = PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let in_flight = Arc::new(InFlightClaims::default());
    let store = Store::new(small, Arc::new(DatabaseClock), Duration::from_secs(30))
        .unwrap()
        .with_observer(in_flight.clone());
    let (entered, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let calls = Arc::new(AtomicUsize::new(0));
    let (e, g, c) = (entered.clone(), gate.clone(), calls.clone());
    let app = Router::new()
        .route(
            "/orders",
            post(move || {
                let (entered, gate, calls) = (e.clone(), g.clone(), c.clone());
                async move {
                    let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                    if n == 1 {
                        entered.notify_one();
                        gate.notified().await;
                    }
                    (StatusCode::CREATED, format!("call {n}")).into_response()
                }
            }),
        )
        .route("/other", post(|| async { StatusCode::CREATED }))
        .route_layer(IdempotencyLayer::new(store, |_| {
            Ok(idempotency::Owner::from(1))
        }));
    Gated {
        app,
        entered,
        gate,
        calls,
        in_flight,
    }
}

async fn send(app: &Router, path: &str, key: &str, prefer: Option<&str>) -> Response {
    let mut request = Request::post(path)
        .header("content-type", "application/json")
        .header("idempotency-key", key);
    if let Some(prefer) = prefer {
        request = request.header("prefer", prefer);
    }
    let request = request.body(Body::from("{}")).unwrap();
    app.clone().oneshot(request).await.unwrap()
}

async fn read(response: Response) -> (StatusCode, bool, Vec<u8>) {
    let replayed = response.headers().get("idempotent-replayed").is_some();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, replayed, body.to_vec())
}

#[testdb::test(template = crate::migrated)]
async fn waiters_get_the_holders_answer_and_leave_the_pool_to_others(pool: PgPool) {
    let g = gated(&pool, 4).await;
    let holder = tokio::spawn({
        let app = g.app.clone();
        async move { read(send(&app, "/orders", "k1", None).await).await }
    });
    g.entered.notified().await;
    // 32 duplicates that ask to wait, on a pool of 4.
    let waiters: Vec<_> = (0..32)
        .map(|_| {
            let app = g.app.clone();
            tokio::spawn(
                async move { read(send(&app, "/orders", "k1", Some("wait=10")).await).await },
            )
        })
        .collect();
    g.in_flight.reach(32).await;
    // While they wait, another request gets a connection and is served.
    let (status, _, body) = read(send(&g.app, "/other", "k2", None).await).await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&body)
    );
    g.gate.notify_one();
    assert_eq!(
        holder.await.unwrap(),
        (StatusCode::CREATED, false, b"call 1".to_vec())
    );
    for waiter in waiters {
        let (status, replayed, body) = waiter.await.unwrap();
        assert_eq!(
            (status, replayed),
            (StatusCode::CREATED, true),
            "{}",
            String::from_utf8_lossy(&body)
        );
        assert_eq!(body, b"call 1");
    }
    assert_eq!(g.calls.load(Ordering::SeqCst), 1);
}

#[testdb::test(template = crate::migrated)]
async fn a_waiter_past_its_wait_gets_409_with_retry_after(pool: PgPool) {
    let g = gated(&pool, 4).await;
    let holder = tokio::spawn({
        let app = g.app.clone();
        async move { read(send(&app, "/orders", "k1", None).await).await }
    });
    g.entered.notified().await;
    let response = send(&g.app, "/orders", "k1", Some("wait=1")).await;
    assert!(response.headers().get("retry-after").is_some());
    let (status, replayed, body) = read(response).await;
    assert_eq!((status, replayed), (StatusCode::CONFLICT, false));
    let problem: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        problem["type"],
        idempotency_axum::problem::types::KEY_IN_FLIGHT
    );
    g.gate.notify_one();
    assert_eq!(holder.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(g.calls.load(Ordering::SeqCst), 1);
}

#[testdb::test(template = crate::migrated)]
async fn without_a_wait_or_with_a_malformed_one_a_duplicate_is_409(pool: PgPool) {
    let g = gated(&pool, 4).await;
    let holder = tokio::spawn({
        let app = g.app.clone();
        async move { read(send(&app, "/orders", "k1", None).await).await }
    });
    g.entered.notified().await;
    // The holder waits at its gate until every duplicate has had its answer: a duplicate that
    // waited would wait its whole 10 s and then be 409 too, so only a replay could tell, and
    // none can come. What these show is that they are answered while the holder is held.
    for prefer in [None, Some("wait=0"), Some("wait=abc"), Some("wait=1.5")] {
        let (status, replayed, _) = read(send(&g.app, "/orders", "k1", prefer).await).await;
        assert_eq!(
            (status, replayed),
            (StatusCode::CONFLICT, false),
            "{prefer:?}"
        );
    }
    g.gate.notify_one();
    assert_eq!(holder.await.unwrap().0, StatusCode::CREATED);
}
