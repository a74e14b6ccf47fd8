//! Adversarial tests of `IdempotencyLayer`, black-box, through its public API over a real
//! PostgreSQL: the transactional mode against slow handlers, aborted transactions, a killed
//! backend and a client that hangs up; the default mode against a renewal stuck on an
//! exhausted pool.
//!
//! Each test names the interleaving it forces and the safe outcome it expects. Some found real
//! bugs when they were written (a renewal stuck on an exhausted pool ran
//! a slow handler twice at once), fixed since; they stay as regression tests.

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
use idempotency_axum::{ClaimedKey, IdempotencyLayer, KeyTransaction};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tower::ServiceExt;

async fn schema(pool: &PgPool) {
    idempotency::migrate(pool).await.unwrap();
    sqlx::query(
        "CREATE TABLE deposits (
             id BIGSERIAL PRIMARY KEY,
             key_id BIGINT REFERENCES idempotency_keys (id) ON DELETE SET NULL,
             amount_cents BIGINT NOT NULL
         )",
    )
    .execute(pool)
    .await
    .unwrap();
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

async fn deposits(pool: &PgPool) -> i64 {
    count(pool, "SELECT count(*) FROM deposits").await
}

fn deposit_request(key: &str) -> Request<Body> {
    Request::post("/deposits")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Body::from(r#"{"amount_cents": 500}"#))
        .unwrap()
}

async fn send(app: &Router, key: &str) -> (StatusCode, bool, Vec<u8>) {
    let response = app.clone().oneshot(deposit_request(key)).await.unwrap();
    let replayed = response.headers().get("idempotent-replayed").is_some();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, replayed, body.to_vec())
}

/// What the transactional deposit handler does between its write and its answer.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// Nothing: answers 201.
    Plain,
    /// Waits for the gate (a slow handler), then answers 201.
    Wait,
    /// Runs a statement that fails (aborting the transaction), ignores the error, answers 201.
    FailThenCreated,
    /// Hands its backend's pid to the test, waits for the gate, answers 201.
    ShowPid,
}

#[derive(Clone)]
struct Bank {
    steps: Arc<Mutex<Vec<Step>>>,
    runs: Arc<AtomicUsize>,
    started: Arc<Notify>,
    gate: Arc<Notify>,
    pid: Arc<Mutex<Option<oneshot::Sender<i32>>>>,
}

impl Bank {
    fn new(steps: &[Step]) -> Self {
        let mut steps = steps.to_vec();
        steps.reverse();
        Self {
            steps: Arc::new(Mutex::new(steps)),
            runs: Arc::default(),
            started: Arc::default(),
            gate: Arc::default(),
            pid: Arc::default(),
        }
    }

    fn next(&self) -> Step {
        self.runs.fetch_add(1, Ordering::SeqCst);
        self.steps.lock().unwrap().pop().unwrap_or(Step::Plain)
    }
}

async fn deposit(State(bank): State<Bank>, claimed: ClaimedKey, tx: KeyTransaction) -> Response {
    let step = bank.next();
    let mut conn = match tx.conn().await {
        Ok(conn) => conn,
        Err(problem) => return problem.into_response(),
    };
    let id: Result<i64, _> = sqlx::query_scalar(
        "INSERT INTO deposits (key_id, amount_cents) VALUES ($1, 500) RETURNING id",
    )
    .bind(claimed.key_id())
    .fetch_one(&mut *conn)
    .await;
    let Ok(id) = id else {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    bank.started.notify_one();
    match step {
        Step::Plain => {}
        Step::Wait => bank.gate.notified().await,
        Step::FailThenCreated => {
            let failed = sqlx::query("SELECT 1 / 0").execute(&mut *conn).await;
            assert!(failed.is_err());
        }
        Step::ShowPid => {
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *conn)
                .await
                .unwrap();
            let sender = bank.pid.lock().unwrap().take().unwrap();
            sender.send(pid).unwrap();
            bank.gate.notified().await;
        }
    }
    (StatusCode::CREATED, format!("deposit {id}")).into_response()
}

async fn transactional_bank(
    pool: &PgPool,
    clock: Arc<dyn Clock>,
    steps: &[Step],
) -> (Router, Bank) {
    schema(pool).await;
    let bank = Bank::new(steps);
    let store = Store::new(pool.clone(), clock, Duration::from_secs(5)).unwrap();
    let app = Router::new()
        .route("/deposits", post(deposit))
        .route_layer(
            IdempotencyLayer::new(store, |_| Ok(idempotency::Owner::from(1))).transactional(),
        )
        .with_state(bank.clone());
    (app, bank)
}

// ---------------------------------------------------------------------------------------------
// The transactional mode
// ---------------------------------------------------------------------------------------------

/// Interleaving: the handler has written its deposit and is still running when its lease runs
/// out (the clock moves past the TTL: the mode renews nothing). A retry with the key comes.
/// Then the handler answers 201.
///
/// Safe outcome: the retry cannot take the key over while the key's transaction holds the row:
/// it is answered 409 at once (the takeover locks `NOWAIT`; a retry that waited would hold a
/// connection for as long); once the handler has answered, a retry replays its 201
/// (`Idempotent-Replayed`). One deposit, one run.
///
/// Mutation that fails it: an owned final phase that fences without `FOR UPDATE` (the retry
/// takes the key over and deposits a second time), or a layer that renews nothing *and* does
/// not hold the row.
#[testdb::test(template = crate::migrated)]
async fn a_retry_after_the_lease_of_a_slow_transactional_handler_is_in_flight_then_replays(
    pool: PgPool,
) {
    let clock = ManualClock::starting_now();
    let (app, bank) = transactional_bank(&pool, Arc::new(clock.clone()), &[Step::Wait]).await;
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, "slow").await }
    });
    bank.started.notified().await;
    clock.advance(Duration::from_secs(6));
    let during = tokio::time::timeout(Duration::from_secs(5), send(&app, "slow"))
        .await
        .expect("the retry waited on the key's transaction");
    assert_eq!(during.0, StatusCode::CONFLICT);
    bank.gate.notify_one();
    let (status, replayed, body) = first.await.unwrap();
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let (again, replayed_again, again_body) = send(&app, "slow").await;
    assert_eq!((again, replayed_again), (StatusCode::CREATED, true));
    assert_eq!(again_body, body);
    assert_eq!(deposits(&pool).await, 1);
    assert_eq!(bank.runs.load(Ordering::SeqCst), 1);
}

/// Interleaving: the handler writes its deposit, then runs a statement that fails (the
/// transaction is aborted), ignores the error and answers 201.
///
/// Safe outcome: the 201 is not delivered (it would be a lie: nothing can commit), nothing is
/// stored, the deposit is gone, the key is released; the retry deposits once and its answer
/// replays.
///
/// Mutation that fails it: a layer that delivers the handler's answer when storing it failed,
/// or a finish that commits what it can (there is nothing it can: PostgreSQL turns the COMMIT
/// of an aborted transaction into a ROLLBACK, which sqlx reports as success unless checked).
#[testdb::test(template = crate::migrated)]
async fn a_handler_that_answers_201_over_an_aborted_transaction_gets_500_and_keeps_nothing(
    pool: PgPool,
) {
    let (app, bank) =
        transactional_bank(&pool, Arc::new(DatabaseClock), &[Step::FailThenCreated]).await;
    let (status, _, _) = send(&app, "aborted").await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(deposits(&pool).await, 0);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE finished_at IS NOT NULL"
        )
        .await,
        0,
        "no answer stored"
    );
    let (status, replayed, body) = send(&app, "aborted").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    let (status, replayed, again) = send(&app, "aborted").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(again, body);
    assert_eq!(deposits(&pool).await, 1);
    assert_eq!(bank.runs.load(Ordering::SeqCst), 2);
}

/// Interleaving: the handler has written its deposit when its database backend is terminated
/// (`pg_terminate_backend`: the server side of a process death, or a failover); the handler
/// answers 201 after.
///
/// Safe outcome: the deposit died with the transaction; the client gets 500, not the 201; the
/// retry deposits once and replays.
///
/// Mutation that fails it: a layer that delivers the handler's answer when its commit failed.
#[testdb::test(template = crate::migrated)]
async fn a_backend_killed_mid_handler_keeps_nothing_and_the_retry_deposits_once(pool: PgPool) {
    let (app, bank) = transactional_bank(&pool, Arc::new(DatabaseClock), &[Step::ShowPid]).await;
    let (pid_tx, pid_rx) = oneshot::channel();
    *bank.pid.lock().unwrap() = Some(pid_tx);
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, "killed").await }
    });
    let pid = pid_rx.await.unwrap();
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(killed);
    bank.gate.notify_one();
    let (status, _, _) = first.await.unwrap();
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(deposits(&pool).await, 0);
    // The retry: at once (the key was released) or after the lease; with a 5 s lease, wait it
    // out if need be (a retry every half second, as a client's backoff would).
    let outcome = testdb::until_every(
        "the retry is answered other than 409",
        Duration::from_millis(500),
        Duration::from_secs(10),
        || async {
            let outcome = send(&app, "killed").await;
            (outcome.0 != StatusCode::CONFLICT).then_some(outcome)
        },
    )
    .await;
    assert_eq!((outcome.0, outcome.1), (StatusCode::CREATED, false));
    let (status, replayed, again) = send(&app, "killed").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true));
    assert_eq!(again, outcome.2);
    assert_eq!(deposits(&pool).await, 1);
}

/// Interleaving: the client hangs up (its request future is dropped) while the handler is
/// between its write and its answer; the client retries at once, and again later.
///
/// Safe outcome: the handler's work is not cancelled with the connection: it commits its
/// deposit with its answer; the retry during the handler gets 409 (or waits), the later retry
/// replays the 201. One deposit, one run.
///
/// Mutation that fails it: running the claimed work in the connection's future instead of a
/// task of its own (the drop would cancel the handler mid-transaction, and a retry would run
/// it again; or leave the key locked until the lease ends).
#[testdb::test(template = crate::migrated)]
async fn a_client_that_hangs_up_mid_handler_finds_its_deposit_made_once(pool: PgPool) {
    let (app, bank) = transactional_bank(&pool, Arc::new(DatabaseClock), &[Step::Wait]).await;
    let hung_up = tokio::time::timeout(
        Duration::from_millis(300),
        app.clone().oneshot(deposit_request("hang-up")),
    )
    .await;
    assert!(hung_up.is_err(), "the handler was to be still running");
    let (status, _, _) = send(&app, "hang-up").await;
    assert_eq!(status, StatusCode::CONFLICT);
    bank.gate.notify_one();
    let outcome = testdb::until(
        "the retry after the handler is answered other than 409",
        Duration::from_secs(5),
        || async {
            let outcome = send(&app, "hang-up").await;
            (outcome.0 != StatusCode::CONFLICT).then_some(outcome)
        },
    )
    .await;
    assert_eq!((outcome.0, outcome.1), (StatusCode::CREATED, true));
    assert_eq!(deposits(&pool).await, 1);
    assert_eq!(bank.runs.load(Ordering::SeqCst), 1);
}

// ---------------------------------------------------------------------------------------------
// The default mode under the lease kit
// ---------------------------------------------------------------------------------------------

/// What [`notify`] shares with its test.
#[derive(Clone)]
struct Notifier {
    effects: Arc<AtomicUsize>,
    /// A message each time a handler starts its work.
    entered: mpsc::UnboundedSender<()>,
    /// Its work ends when the test opens this (`true`): later than any lease of the test,
    /// however slow the machine.
    work_done: watch::Receiver<bool>,
}

/// A handler of the default mode whose effect is outside the key's database (a notification, a
/// charge): it works until the test says its work is done, then makes its effect.
async fn notify(State(n): State<Notifier>, _claimed: ClaimedKey) -> StatusCode {
    let _ = n.entered.send(());
    let mut work_done = n.work_done.clone();
    let _ = work_done.wait_for(|done| *done).await;
    n.effects.fetch_add(1, Ordering::SeqCst);
    StatusCode::CREATED
}

/// Interleaving: two API processes, each with its own pool, serve the same route in the default
/// mode, with a 2 s lease renewed every 400 ms. Process one's handler (work that outlasts the
/// lease) starts; its store's pool is then exhausted by other requests (its `acquire_timeout`
/// is 8 s), so the renewal waits for a connection. Once the lease has ended in the database, the
/// client, having given up on process one, retries through process two; then both handlers'
/// work is done, and the pool is freed.
///
/// Safe outcome (the layer's own promise: "a handler slower than the lease TTL is not taken
/// over by a retry and run twice at once"): process one stops vouching for its lease before it
/// ends and aborts its handler at its next await, so one effect is made.
///
/// What happens: process one's renewal waits for the pool past the lease's end, its handler
/// keeps running, process two takes the key over and runs the handler too: two effects, at
/// once. The library's `watch_under_lease` does not bound a renewal by the lease left (see the
/// idempotency crate's `tests/integration/adversary.rs` for the kit alone).
#[testdb::test(template = crate::migrated)]

async fn a_renewal_stuck_on_an_exhausted_pool_runs_the_handler_twice_at_once(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    const TTL: Duration = Duration::from_secs(2);
    let small = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(8))
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    let effects = Arc::new(AtomicUsize::new(0));
    let (entered, mut handler_started) = mpsc::unbounded_channel();
    let (open, work_done) = watch::channel(false);
    let notifier = Notifier {
        effects: effects.clone(),
        entered,
        work_done,
    };
    let process = |pool: PgPool| {
        let store = Store::new(pool, Arc::new(DatabaseClock), TTL)
            .unwrap()
            .with_heartbeat(Duration::from_millis(400))
            .unwrap();
        Router::new()
            .route("/deposits", post(notify))
            .route_layer(IdempotencyLayer::new(store, |_| {
                Ok(idempotency::Owner::from(1))
            }))
            .with_state(notifier.clone())
    };
    let (one, two) = (process(small.clone()), process(pool.clone()));
    let first = tokio::spawn(async move { send(&one, "twice").await });
    // Once the claim is done (the handler runs), the pool's one connection goes to other work.
    handler_started.recv().await.unwrap();
    let hog = small.acquire().await.unwrap();
    testdb::until(
        "the first lease ended in the database",
        Duration::from_secs(10),
        || async {
            sqlx::query_scalar::<_, bool>("SELECT locked_until < now() FROM idempotency_keys")
                .fetch_one(&pool)
                .await
                .unwrap()
                .then_some(())
        },
    )
    .await;
    let second = tokio::spawn(async move { send(&two, "twice").await });
    tokio::time::timeout(Duration::from_secs(10), handler_started.recv())
        .await
        .expect("process two took the key over and ran the handler");
    // Both handlers' work is done: a first handler still running makes its effect too.
    open.send(true).unwrap();
    let (retried, _, _) = second.await.unwrap();
    drop(hog);
    let (first_status, _, _) = first.await.unwrap();
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "two effects for one key: process one answered {first_status}, process two {retried}"
    );
}
