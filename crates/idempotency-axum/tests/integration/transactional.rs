//! `IdempotencyLayer::transactional`: the handler's writes commit with the stored answer or not at
//! all, over a fresh PostgreSQL database per test.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idempotency::{Clock, DatabaseClock, ManualClock, Store};
use idempotency_axum::layer::NO_TRANSACTION_DETAIL;
use idempotency_axum::problem::types;
use idempotency_axum::{ClaimedKey, IdempotencyLayer, KeyTransaction};
use serde_json::Value;
use sqlx::{PgConnection, PgPool};
use tower::ServiceExt;

/// What the deposit handler does once its deposit is written.
#[derive(Debug, Clone, Copy)]
enum Then {
    /// Panics (its own bug, or a crash before the answer is stored).
    Panic,
    /// Answers with this status.
    Answer(StatusCode),
    /// Hands a clone of its transaction to the test, and answers 201.
    Keep,
    /// Leaves a task behind that holds the transaction's connection until the gate opens, and
    /// answers 201.
    Hold,
    /// Asks for the connection again while it holds it, and answers what that gives.
    AskTwice,
}

/// The bank behind the deposit handler: what it does after each write (201 once the script is
/// over), how often it ran, and the transaction a handler kept.
#[derive(Clone)]
struct Bank {
    pool: PgPool,
    script: Arc<Mutex<VecDeque<Then>>>,
    runs: Arc<AtomicUsize>,
    kept: Arc<Mutex<Option<KeyTransaction>>>,
    gate: Arc<tokio::sync::Notify>,
}

impl Bank {
    fn new(pool: &PgPool) -> Self {
        Self {
            pool: pool.clone(),
            script: Arc::default(),
            runs: Arc::default(),
            kept: Arc::default(),
            gate: Arc::default(),
        }
    }

    fn then(&self, script: &[Then]) {
        self.script.lock().unwrap().extend(script);
    }

    fn next(&self) -> Then {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let next = self.script.lock().unwrap().pop_front();
        next.unwrap_or(Then::Answer(StatusCode::CREATED))
    }
}

/// The deposit itself: one row, naming the key it was made under.
async fn deposit_in(conn: &mut PgConnection, key_id: i64) -> i64 {
    sqlx::query_scalar("INSERT INTO deposits (key_id, amount_cents) VALUES ($1, 500) RETURNING id")
        .bind(key_id)
        .fetch_one(conn)
        .await
        .unwrap()
}

fn answer(then: Then, deposit: i64) -> Response {
    match then {
        Then::Panic => panic!("the deposit handler dies after its write"),
        Then::Answer(status) => (status, format!("deposit {deposit}")).into_response(),
        Then::Keep | Then::Hold | Then::AskTwice => unreachable!("handled by the handler"),
    }
}

/// The handler of the transactional mode: it writes through the key's transaction, and holds
/// its connection to the end (through a panic too).
async fn deposit(State(bank): State<Bank>, claimed: ClaimedKey, tx: KeyTransaction) -> Response {
    let mut conn = tx.conn().await.unwrap();
    let deposit = deposit_in(&mut conn, claimed.key_id()).await;
    match bank.next() {
        Then::Keep => {
            drop(conn);
            *bank.kept.lock().unwrap() = Some(tx.clone());
            (StatusCode::CREATED, format!("deposit {deposit}")).into_response()
        }
        Then::Hold => {
            drop(conn);
            let (held, holding) = tokio::sync::oneshot::channel();
            let (tx, gate) = (tx.clone(), bank.gate.clone());
            tokio::spawn(async move {
                let conn = tx.conn().await;
                let _ = held.send(());
                gate.notified().await;
                drop(conn);
            });
            holding.await.unwrap();
            (StatusCode::CREATED, format!("deposit {deposit}")).into_response()
        }
        Then::AskTwice => match tx.conn().await {
            Ok(_) => (StatusCode::CREATED, format!("deposit {deposit}")).into_response(),
            Err(problem) => problem.into_response(),
        },
        then => answer(then, deposit),
    }
}

/// The same handler for the default mode: it writes through a connection of its own, which
/// commits at once.
async fn deposit_alone(State(bank): State<Bank>, claimed: ClaimedKey) -> Response {
    let mut conn = bank.pool.acquire().await.unwrap();
    let deposit = deposit_in(&mut conn, claimed.key_id()).await;
    answer(bank.next(), deposit)
}

async fn schema(pool: &PgPool) {
    idempotency::migrate(pool).await.unwrap();
    sqlx::query(
        "CREATE TABLE deposits (
             id BIGSERIAL PRIMARY KEY,
             key_id BIGINT REFERENCES idempotency_keys (id),
             amount_cents BIGINT NOT NULL
         )",
    )
    .execute(pool)
    .await
    .unwrap();
}

fn layer(pool: &PgPool, clock: Arc<dyn Clock>) -> IdempotencyLayer {
    let store = Store::new(pool.clone(), clock, Duration::from_secs(30)).unwrap();
    IdempotencyLayer::new(store, |_| Ok(idempotency::Owner::from(1)))
}

/// The deposit route in the transactional mode, over a fresh schema.
async fn bank(pool: &PgPool) -> (Router, Bank) {
    bank_with(pool, Arc::new(DatabaseClock)).await
}

async fn bank_with(pool: &PgPool, clock: Arc<dyn Clock>) -> (Router, Bank) {
    schema(pool).await;
    let bank = Bank::new(pool);
    let app = Router::new()
        .route("/deposits", post(deposit))
        .route_layer(layer(pool, clock).transactional())
        .with_state(bank.clone());
    (app, bank)
}

async fn send(app: &Router, key: &str) -> (StatusCode, bool, Vec<u8>) {
    let request = Request::post("/deposits")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Body::from(r#"{"amount_cents": 500}"#))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let replayed = response.headers().get("idempotent-replayed").is_some();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, replayed, body.to_vec())
}

fn problem_type(body: &[u8]) -> String {
    let problem: Value = serde_json::from_slice(body).unwrap();
    problem["type"].as_str().unwrap().to_owned()
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

async fn deposits(pool: &PgPool) -> i64 {
    count(pool, "SELECT count(*) FROM deposits").await
}

/// Keys with a row, unfinished, whose lease is free.
async fn released(pool: &PgPool) -> i64 {
    count(
        pool,
        "SELECT count(*) FROM idempotency_keys WHERE finished_at IS NULL AND locked_until IS NULL",
    )
    .await
}

#[testdb::test(template = crate::migrated)]
async fn a_deposit_that_panics_after_its_write_is_undone_and_the_retry_deposits_once(pool: PgPool) {
    let (app, bank) = bank(&pool).await;
    bank.then(&[Then::Panic]);
    let (status, _, body) = send(&app, "k1").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(problem_type(&body), types::HANDLER_FAILED);
    assert_eq!(
        deposits(&pool).await,
        0,
        "the panic rolled the deposit back"
    );
    assert_eq!(released(&pool).await, 1, "and released the key at once");

    let (status, replayed, body) = send(&app, "k1").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let (status, replayed, again) = send(&app, "k1").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(again, body);
    assert_eq!(deposits(&pool).await, 1, "one deposit for the key");
    assert_eq!(bank.runs.load(Ordering::SeqCst), 2);
}

#[testdb::test(template = crate::migrated)]
async fn without_the_transactional_mode_a_panic_after_the_write_deposits_twice(pool: PgPool) {
    schema(&pool).await;
    let bank = Bank::new(&pool);
    let app = Router::new()
        .route("/deposits", post(deposit_alone))
        .route_layer(layer(&pool, Arc::new(DatabaseClock)))
        .with_state(bank.clone());
    bank.then(&[Then::Panic]);
    let (status, _, _) = send(&app, "k1").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(deposits(&pool).await, 1, "the deposit committed on its own");
    let (status, replayed, _) = send(&app, "k1").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(
        deposits(&pool).await,
        2,
        "the retry deposits again: why the transactional mode exists"
    );
}

#[testdb::test(template = crate::migrated)]
async fn a_503_after_the_write_undoes_it_and_releases_the_key(pool: PgPool) {
    let (app, bank) = bank(&pool).await;
    bank.then(&[Then::Answer(StatusCode::SERVICE_UNAVAILABLE)]);
    let (status, _, body) = send(&app, "k1").await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "the answer is delivered"
    );
    assert!(String::from_utf8(body).unwrap().starts_with("deposit "));
    assert_eq!(deposits(&pool).await, 0, "nothing of it was kept");
    assert_eq!(released(&pool).await, 1, "the key kept its row, released");
    let (status, replayed, _) = send(&app, "k1").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(deposits(&pool).await, 1);
    assert_eq!(bank.runs.load(Ordering::SeqCst), 2);
}

#[testdb::test(template = crate::migrated)]
async fn a_400_after_the_write_undoes_it_and_forgets_the_key(pool: PgPool) {
    let (app, bank) = bank(&pool).await;
    bank.then(&[Then::Answer(StatusCode::BAD_REQUEST)]);
    let (status, _, _) = send(&app, "k1").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(deposits(&pool).await, 0, "the write was undone");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        0,
        "the key was forgotten: its deposit, which referenced it, was rolled back first"
    );
    let (status, replayed, _) = send(&app, "k1").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(deposits(&pool).await, 1);
}

#[testdb::test(template = crate::migrated)]
async fn concurrent_duplicates_in_the_transactional_mode_deposit_once(pool: PgPool) {
    let (app, _) = bank(&pool).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (app, barrier) = (app.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            send(&app, "same").await
        }));
    }
    let mut first = 0;
    for task in tasks {
        match task.await.unwrap() {
            (StatusCode::CREATED, false, _) => first += 1,
            (StatusCode::CREATED, true, _) => {}
            (StatusCode::CONFLICT, _, body) => {
                assert_eq!(problem_type(&body), types::KEY_IN_FLIGHT);
            }
            (other, _, body) => panic!("unexpected {other}: {}", String::from_utf8_lossy(&body)),
        }
    }
    assert_eq!(first, 1);
    assert_eq!(deposits(&pool).await, 1);
}

#[testdb::test(template = crate::migrated)]
async fn a_key_transaction_without_the_transactional_mode_is_a_500_problem(pool: PgPool) {
    schema(&pool).await;
    let wants_tx = |_: KeyTransaction| async { StatusCode::CREATED };
    let layered = Router::new()
        .route("/deposits", post(wants_tx))
        .route_layer(layer(&pool, Arc::new(DatabaseClock)));
    let bare = Router::new().route("/deposits", post(wants_tx));
    for app in [layered, bare] {
        let (status, _, body) = send(&app, "k1").await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        let problem: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(problem["type"], types::HANDLER_FAILED);
        assert_eq!(problem["detail"], NO_TRANSACTION_DETAIL);
    }
    assert_eq!(released(&pool).await, 1, "the layer's key was released");
}

#[testdb::test(template = crate::migrated)]
async fn a_commit_that_fails_answers_500_and_keeps_nothing(pool: PgPool) {
    let clock = ManualClock::starting_now();
    let (app, _) = bank_with(&pool, Arc::new(clock.clone())).await;
    // A constraint checked only at commit, and a row the deposit will clash with.
    sqlx::query(
        "ALTER TABLE deposits ADD CONSTRAINT one_per_amount UNIQUE (amount_cents)
             DEFERRABLE INITIALLY DEFERRED",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("INSERT INTO deposits (amount_cents) VALUES (500)")
        .execute(&pool)
        .await
        .unwrap();
    let (status, _, body) = send(&app, "k1").await;
    assert_eq!(
        status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "not the handler's 201"
    );
    assert_eq!(problem_type(&body), types::STORE_FAILED);
    assert_eq!(deposits(&pool).await, 1, "only the row from before");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE finished_at IS NULL"
        )
        .await,
        1,
        "the key is unfinished"
    );
    // The failed commit released the key: the retry runs at once (no 409), and fails the same
    // way while the clash stands; once it is gone, the deposit is made, once.
    let (status, _, _) = send(&app, "k1").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    sqlx::query("DELETE FROM deposits")
        .execute(&pool)
        .await
        .unwrap();
    let (status, replayed, _) = send(&app, "k1").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(deposits(&pool).await, 1);
}

#[testdb::test(template = crate::migrated)]
async fn a_handler_that_keeps_its_transaction_past_its_return_is_rolled_back_with_500(
    pool: PgPool,
) {
    let (app, bank) = bank(&pool).await;
    bank.then(&[Then::Keep]);
    let (status, _, body) = send(&app, "k1").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "not its 201");
    assert_eq!(problem_type(&body), types::HANDLER_FAILED);
    assert_eq!(deposits(&pool).await, 0);
    assert_eq!(released(&pool).await, 1);
    // The clone it kept holds nothing any more.
    let kept = bank.kept.lock().unwrap().take().unwrap();
    let refused = kept.conn().await.unwrap_err();
    assert_eq!(refused.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let (status, replayed, _) = send(&app, "k1").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(deposits(&pool).await, 1);
}

#[testdb::test(template = crate::migrated)]
async fn a_handler_whose_task_still_writes_after_its_return_answers_500_and_commits_nothing(
    pool: PgPool,
) {
    let (app, bank) = bank(&pool).await;
    bank.then(&[Then::Hold]);
    let (status, _, body) = send(&app, "k1").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "not its 201");
    assert_eq!(problem_type(&body), types::HANDLER_FAILED);
    assert_eq!(deposits(&pool).await, 0, "nothing committed");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE finished_at IS NULL"
        )
        .await,
        1
    );
    // The layer could not take the transaction back: the key waits for its lease.
    let (status, _, _) = send(&app, "k1").await;
    assert_eq!(status, StatusCode::CONFLICT);
    bank.gate.notify_one();
}

#[testdb::test(template = crate::migrated)]
async fn a_handler_that_asks_for_its_connection_twice_is_refused_instead_of_hanging(pool: PgPool) {
    let (app, bank) = bank(&pool).await;
    bank.then(&[Then::AskTwice]);
    let asked = tokio::time::timeout(Duration::from_secs(10), send(&app, "k1"))
        .await
        .expect("the handler hung on its own guard");
    assert_eq!(asked.0, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(deposits(&pool).await, 0, "the 500 rolled the deposit back");
    let (status, replayed, _) = send(&app, "k1").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert_eq!(deposits(&pool).await, 1);
}
