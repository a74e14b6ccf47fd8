//! An adversary's tries at `Prefer: wait=N` and the route-template scope: a waiter must only
//! ever get the answer of its own owner's key with its own payload. A waiter of another owner
//! with the same key string, or of the same owner with another payload (another body, another
//! concrete path under the same template), is answered at once for what it is, never with the
//! holder's answer.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idempotency::{DatabaseClock, Owner, Store};
use idempotency_axum::IdempotencyLayer;
use sqlx::PgPool;
use tokio::sync::Notify;
use tower::ServiceExt;

struct Gated {
    app: Router,
    entered: Arc<Notify>,
    gate: Arc<Notify>,
    calls: Arc<AtomicUsize>,
}

/// `/accounts/{id}/transfers` holds its first call at a gate, then answers `call N: <body>`;
/// later calls answer at once. The owner is the `x-user` header (401 without it).
fn gated(pool: &PgPool) -> Gated {
    let store = Store::new(
        pool.clone(),
        Arc::new(DatabaseClock),
        std::time::Duration::from_secs(30),
    )
    .unwrap();
    let (entered, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let calls = Arc::new(AtomicUsize::new(0));
    let (e, g, c) = (entered.clone(), gate.clone(), calls.clone());
    let app = Router::new()
        .route(
            "/accounts/{id}/transfers",
            post(move |body: Bytes| {
                let (entered, gate, calls) = (e.clone(), g.clone(), c.clone());
                async move {
                    let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                    if n == 1 {
                        entered.notify_one();
                        gate.notified().await;
                    }
                    let body = String::from_utf8_lossy(&body).into_owned();
                    (StatusCode::CREATED, format!("call {n}: {body}")).into_response()
                }
            }),
        )
        .route_layer(IdempotencyLayer::new(store, |parts| {
            let user = parts
                .headers
                .get("x-user")
                .and_then(|v| v.to_str().ok())
                .ok_or(StatusCode::UNAUTHORIZED)?;
            Owner::new(user).map_err(|_| StatusCode::UNAUTHORIZED)
        }));
    Gated {
        app,
        entered,
        gate,
        calls,
    }
}

async fn send(app: &Router, user: &str, path: &str, body: &str, wait: bool) -> Response {
    let mut request = Request::post(path)
        .header("content-type", "application/json")
        .header("idempotency-key", "k1")
        .header("x-user", user);
    if wait {
        request = request.header("prefer", "wait=10");
    }
    let request = request.body(Body::from(body.to_owned())).unwrap();
    app.clone().oneshot(request).await.unwrap()
}

async fn read(response: Response) -> (StatusCode, bool, String) {
    let replayed = response.headers().get("idempotent-replayed").is_some();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        replayed,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

/// Alice's request with key `k1` is held at the gate; returns its task.
async fn alice_holds(g: &Gated) -> tokio::task::JoinHandle<(StatusCode, bool, String)> {
    let app = g.app.clone();
    let holder = tokio::spawn(async move {
        read(
            send(
                &app,
                "alice",
                "/accounts/A/transfers",
                r#"{"amount":5}"#,
                false,
            )
            .await,
        )
        .await
    });
    g.entered.notified().await;
    holder
}

#[testdb::test(template = crate::migrated)]
async fn a_waiter_of_another_owner_with_the_same_key_runs_its_own_request(pool: PgPool) {
    let g = gated(&pool);
    let holder = alice_holds(&g).await;
    // Bob, same key string, same path and body, asks to wait: his key is his own. He is
    // answered while Alice's request is still held, by his own run of the handler.
    let bob = read(
        send(
            &g.app,
            "bob",
            "/accounts/A/transfers",
            r#"{"amount":5}"#,
            true,
        )
        .await,
    )
    .await;
    assert_eq!(
        bob,
        (
            StatusCode::CREATED,
            false,
            r#"call 2: {"amount":5}"#.to_owned()
        )
    );
    g.gate.notify_one();
    assert_eq!(
        holder.await.unwrap(),
        (
            StatusCode::CREATED,
            false,
            r#"call 1: {"amount":5}"#.to_owned()
        )
    );
    // Each replays his own answer.
    let bob = read(
        send(
            &g.app,
            "bob",
            "/accounts/A/transfers",
            r#"{"amount":5}"#,
            true,
        )
        .await,
    )
    .await;
    assert_eq!((bob.1, bob.2.as_str()), (true, r#"call 2: {"amount":5}"#));
    let alice = read(
        send(
            &g.app,
            "alice",
            "/accounts/A/transfers",
            r#"{"amount":5}"#,
            true,
        )
        .await,
    )
    .await;
    assert_eq!(
        (alice.1, alice.2.as_str()),
        (true, r#"call 1: {"amount":5}"#)
    );
    assert_eq!(g.calls.load(Ordering::SeqCst), 2);
}

#[testdb::test(template = crate::migrated)]
async fn a_waiter_with_another_payload_is_refused_at_once_not_given_the_holders_answer(
    pool: PgPool,
) {
    let g = gated(&pool);
    let holder = alice_holds(&g).await;
    // While Alice's request is held (its gate opens only after these answers, so a waiter that
    // waited would get 409 after its whole wait, and one given the holder's answer a replay):
    // another body, and another account under the same route template, are another payload.
    for (path, body) in [
        ("/accounts/A/transfers", r#"{"amount":6}"#),
        ("/accounts/B/transfers", r#"{"amount":5}"#),
        ("/accounts/A/transfers?x=1", r#"{"amount":5}"#),
    ] {
        let (status, replayed, answer) = read(send(&g.app, "alice", path, body, true).await).await;
        assert_eq!(
            (status, replayed),
            (StatusCode::UNPROCESSABLE_ENTITY, false),
            "{path} {body}: {answer}"
        );
    }
    g.gate.notify_one();
    assert_eq!(holder.await.unwrap().0, StatusCode::CREATED);
    // Once Alice's answer is stored, they are refused the same way, not replayed it.
    let (status, replayed, _) = read(
        send(
            &g.app,
            "alice",
            "/accounts/B/transfers",
            r#"{"amount":5}"#,
            true,
        )
        .await,
    )
    .await;
    assert_eq!(
        (status, replayed),
        (StatusCode::UNPROCESSABLE_ENTITY, false)
    );
    assert_eq!(g.calls.load(Ordering::SeqCst), 1);
}

#[testdb::test(template = crate::migrated)]
async fn a_waiter_with_the_same_payload_gets_the_holders_answer_once_stored(pool: PgPool) {
    let g = gated(&pool);
    let holder = alice_holds(&g).await;
    let waiter = {
        let app = g.app.clone();
        tokio::spawn(async move {
            read(
                send(
                    &app,
                    "alice",
                    "/accounts/A/transfers",
                    r#"{"amount":5}"#,
                    true,
                )
                .await,
            )
            .await
        })
    };
    g.gate.notify_one();
    assert_eq!(holder.await.unwrap().0, StatusCode::CREATED);
    // Whether the waiter claimed before or after the answer was stored, it gets that answer.
    assert_eq!(
        waiter.await.unwrap(),
        (
            StatusCode::CREATED,
            true,
            r#"call 1: {"amount":5}"#.to_owned()
        )
    );
    assert_eq!(g.calls.load(Ordering::SeqCst), 1);
}

/// Counts the claims that found their key held.
#[derive(Default)]
struct InFlightClaims(AtomicUsize);

impl idempotency::Observer for InFlightClaims {
    fn claimed(
        &self,
        _route: &str,
        outcome: idempotency::ClaimOutcome,
        _took: std::time::Duration,
    ) {
        if outcome == idempotency::ClaimOutcome::InFlight {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// A waiter reads "a few times a second" at most (`WAIT_POLL_MAX`), the layer's docs say. A
/// transactional holder does not renew its lease: past its TTL its row reads as claimable while
/// its transaction still holds the row's lock, so every re-claim finds it in flight, and the
/// waiter's reads start over from `WAIT_POLL_FIRST` (20 ms) each time: a claim and a read every
/// 20 ms for the whole wait (44 claims in a one-second wait before the fix). Counted over a wait of one second, with an upper bound that a slow
/// machine only makes easier to meet (pauses only get longer).
#[testdb::test(template = crate::migrated)]
async fn a_waiter_on_a_transactional_holder_past_its_lease_backs_off(pool: PgPool) {
    let clock = idempotency::ManualClock::starting_now();
    let claims = Arc::new(InFlightClaims::default());
    let store = Store::new(
        pool.clone(),
        Arc::new(clock.clone()),
        std::time::Duration::from_secs(30),
    )
    .unwrap()
    .with_observer(claims.clone());
    let (entered, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (e, g) = (entered.clone(), gate.clone());
    let app = Router::new()
        .route(
            "/orders",
            post(move || {
                let (entered, gate) = (e.clone(), g.clone());
                async move {
                    entered.notify_one();
                    gate.notified().await;
                    StatusCode::CREATED
                }
            }),
        )
        .route_layer(IdempotencyLayer::new(store, |_| Ok(Owner::from(1))).transactional());
    let holder = {
        let app = app.clone();
        tokio::spawn(async move { read(send(&app, "u", "/orders", "{}", false).await).await })
    };
    entered.notified().await;
    clock.advance(std::time::Duration::from_secs(31));
    let request = Request::post("/orders")
        .header("content-type", "application/json")
        .header("idempotency-key", "k1")
        .header("prefer", "wait=1")
        .body(Body::from("{}"))
        .unwrap();
    let (status, _, _) = read(app.clone().oneshot(request).await.unwrap()).await;
    assert_eq!(status, StatusCode::CONFLICT);
    let in_flight = claims.0.load(Ordering::SeqCst);
    gate.notify_one();
    assert_eq!(holder.await.unwrap().0, StatusCode::CREATED);
    // Backing off to 250 ms, a one-second wait claims a handful of times; 12 leaves room.
    assert!(
        in_flight <= 12,
        "{in_flight} claims in a wait of one second"
    );
}
