//! The step driver against a real PostgreSQL: `Store::run` and the workflow `Completer` run one
//! description of a transfer (a debit, a notification under the lease, a credit and the answer),
//! and each protection of the driver is tried here: detach, release after a transient halt and
//! never after a lost lease, fenced step commits, refusals without the step's writes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::workflow::Completer;
use idempotency::{
    Advance, Claim, Fingerprint, Halt, IdempotencyKey, ManualClock, NewRequest, Outcome, Owner,
    Request, Step, Store, StoredResponse, Workflow,
};
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio::sync::Notify;

idempotency::recovery_points! {
    /// The debit committed; the notification and the credit are next.
    enum Point {
        Moved = "moved",
    }
}

const TTL: Duration = Duration::from_secs(30);
const GRACE: Duration = Duration::from_secs(60);
const ROUTE: &str = "/accounts/{id}/transfers";

/// Where the test holds a run, once, until it says go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pause {
    /// In the first step, after its write (the key's claim still uncommitted with it).
    FirstStep,
    /// At `Moved`, before the notification.
    BeforeCall,
    /// At `Moved`, after the notification, before the credit.
    BeforeWrite,
}

/// The knobs and the signals of the test transfer, and its fake notification service.
#[derive(Default)]
struct Knobs {
    pause: Mutex<Option<Pause>>,
    paused: Notify,
    resume: Notify,
    /// A pause guard dropped before its step went on: the run was cancelled at the pause.
    cancelled: Notify,
    finished: Notify,
    /// How many times `Moved` halts with `Halt::retry` before it goes on.
    retries: AtomicUsize,
    /// The next notification never answers (the process "dies" there).
    hang: Mutex<bool>,
    /// Notifications by foreign key: a repeated key is answered, not sent again.
    notices: Mutex<HashMap<String, usize>>,
    sent: AtomicUsize,
}

struct Transfer(Arc<Knobs>);

/// Tells the test when a paused step was dropped instead of going on.
struct PauseGuard<'a>(&'a Knobs, bool);

impl Drop for PauseGuard<'_> {
    fn drop(&mut self) {
        if !self.1 {
            self.0.cancelled.notify_one();
        }
    }
}

impl Knobs {
    async fn maybe_pause(&self, here: Pause) {
        let hit = {
            let mut pause = self.pause.lock().unwrap();
            if *pause == Some(here) {
                *pause = None;
                true
            } else {
                false
            }
        };
        if hit {
            let mut guard = PauseGuard(self, false);
            self.paused.notify_one();
            self.resume.notified().await;
            guard.1 = true;
        }
    }

    async fn notify(&self, key: String) -> String {
        let hang = std::mem::take(&mut *self.hang.lock().unwrap());
        if hang {
            self.paused.notify_one();
            std::future::pending::<()>().await;
        }
        let mut notices = self.notices.lock().unwrap();
        let next = notices.len() + 1;
        let id = *notices.entry(key).or_insert_with(|| {
            self.sent.fetch_add(1, Ordering::SeqCst);
            next
        });
        format!("notice-{id}")
    }
}

impl Workflow for Transfer {
    type Point = Point;

    fn route(&self) -> &str {
        ROUTE
    }

    async fn step(&self, point: Point, step: &mut Step<'_, Point>) -> Result<Advance<Point>, Halt> {
        let knobs = &*self.0;
        match point {
            Point::Started => {
                let amount = step.params()["amount"].as_i64().unwrap_or(0);
                let key_id = step.key_id();
                effect(step, key_id, "debit").await?;
                if amount > 1000 {
                    let refusal = json!({"error": "insufficient funds"});
                    return Err(Halt::fail(StoredResponse::json(402, &refusal, vec![])));
                }
                knobs.maybe_pause(Pause::FirstStep).await;
                Ok(Advance::To(Point::Moved))
            }
            Point::Moved => {
                knobs.maybe_pause(Pause::BeforeCall).await;
                if knobs
                    .retries
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok()
                {
                    return Err(Halt::retry("the notifier is away").after(Duration::from_secs(7)));
                }
                let notice = step.call(knobs.notify(step.foreign_key("notify"))).await?;
                knobs.maybe_pause(Pause::BeforeWrite).await;
                let key_id = step.key_id();
                effect(step, key_id, "credit").await?;
                knobs.finished.notify_one();
                let body = json!({"notice": notice});
                Ok(Advance::Finish(StoredResponse::json(201, &body, vec![])))
            }
            Point::Finished => unreachable!("the driver never steps a finished key"),
        }
    }
}

async fn effect(step: &mut Step<'_, Point>, key_id: i64, what: &str) -> Result<(), Halt> {
    sqlx::query("INSERT INTO effects (key_id, what) VALUES ($1, $2)")
        .bind(key_id)
        .bind(what)
        .execute(step.tx().await?)
        .await?;
    Ok(())
}

struct Fixture {
    store: Store,
    clock: ManualClock,
    knobs: Arc<Knobs>,
    transfer: Arc<Transfer>,
    pool: PgPool,
}

async fn fixture(pool: PgPool) -> Fixture {
    sqlx::query("CREATE TABLE effects (key_id BIGINT, what TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let clock = ManualClock::starting_now();
    let store = Store::builder(pool.clone())
        .clock(Arc::new(clock.clone()))
        .lease_ttl(TTL)
        .build()
        .unwrap();
    let knobs = Arc::new(Knobs::default());
    let transfer = Arc::new(Transfer(knobs.clone()));
    Fixture {
        store,
        clock,
        knobs,
        transfer,
        pool,
    }
}

fn alice() -> Owner {
    Owner::new("alice").unwrap()
}

fn request(key: &str, amount: i64) -> Request {
    let key = IdempotencyKey::parse(key.as_bytes()).unwrap();
    Request::new(alice(), key, json!({"account": 1, "amount": amount}))
}

impl Fixture {
    async fn run(&self, key: &str, amount: i64) -> Outcome {
        self.store.run(&self.transfer, request(key, amount)).await
    }

    async fn effects(&self) -> Vec<String> {
        sqlx::query_scalar("SELECT what FROM effects ORDER BY what")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    /// The key's recovery point, lease end and token.
    async fn key_row(&self, key: &str) -> Option<(String, Option<time::OffsetDateTime>, i64)> {
        sqlx::query_as(
            "SELECT recovery_point, locked_until, lease_token FROM idempotency_keys \
             WHERE idempotency_key = $1",
        )
        .bind(key)
        .fetch_optional(&self.pool)
        .await
        .unwrap()
    }

    /// Another holder takes the key over: its lease ran out by the clock, and a claim of the
    /// same request gets the next token.
    async fn steal(&self, key: &str, amount: i64) -> idempotency::Lease<Point> {
        self.clock.advance(TTL + Duration::from_secs(1));
        let (key, params) = (
            IdempotencyKey::parse(key.as_bytes()).unwrap(),
            json!({"account": 1, "amount": amount}),
        );
        let owner = alice();
        let claim = NewRequest {
            owner: &owner,
            method: "POST",
            route: ROUTE,
            key: &key,
            fingerprint: Fingerprint::of_json("POST", ROUTE, &params),
            params: &params,
        };
        match self.store.claim::<Point>(claim).await.unwrap() {
            Claim::Acquired(lease) => lease,
            other => panic!("the thief must get the key, got {other:?}"),
        }
    }
}

fn body(outcome: &Outcome) -> Value {
    match outcome {
        Outcome::Answered(r) | Outcome::Replayed(r) => serde_json::from_slice(&r.body).unwrap(),
        other => panic!("expected an answer, got {other:?}"),
    }
}

#[testdb::test(template = crate::migrated)]
async fn a_run_takes_every_step_once_and_replays_its_answer(pool: PgPool) {
    let f = fixture(pool).await;
    let first = f.run("k1", 100).await;
    assert!(
        matches!(&first, Outcome::Answered(r) if r.status == 201),
        "{first:?}"
    );
    assert_eq!(body(&first), json!({"notice": "notice-1"}));
    let again = f.run("k1", 100).await;
    let (Outcome::Answered(a), Outcome::Replayed(b)) = (&first, &again) else {
        panic!("expected a replay, got {again:?}");
    };
    assert_eq!(a, b, "the replay is the stored answer, byte for byte");
    assert_eq!(f.run("k1", 200).await, Outcome::Mismatch);
    assert_eq!(f.effects().await, ["credit", "debit"]);
    assert_eq!(f.knobs.sent.load(Ordering::SeqCst), 1);
    assert_eq!(f.key_row("k1").await.unwrap().0, "finished");
}

#[testdb::test(template = crate::migrated)]
async fn a_caller_that_hangs_up_mid_step_does_not_stop_the_run(pool: PgPool) {
    let f = fixture(pool).await;
    *f.knobs.pause.lock().unwrap() = Some(Pause::FirstStep);
    let caller = {
        let (store, transfer) = (f.store.clone(), f.transfer.clone());
        tokio::spawn(async move { store.run(&transfer, request("hangup", 100)).await })
    };
    // The first step wrote its debit, uncommitted with the key's claim; the client hangs up.
    f.knobs.paused.notified().await;
    caller.abort();
    assert!(caller.await.unwrap_err().is_cancelled());
    f.knobs.resume.notify_one();
    // Either the run goes on to its last step, or it was dropped at the pause.
    tokio::select! {
        () = f.knobs.finished.notified() => {}
        () = f.knobs.cancelled.notified() => panic!("the run was cancelled with its caller"),
    }
    // The client's retry gets the stored answer (or finds the run about to store it).
    let retry = loop {
        match f.run("hangup", 100).await {
            Outcome::InFlight { .. } => tokio::task::yield_now().await,
            other => break other,
        }
    };
    assert!(
        matches!(&retry, Outcome::Replayed(r) if r.status == 201),
        "{retry:?}"
    );
    assert_eq!(f.effects().await, ["credit", "debit"]);
}

#[testdb::test(template = crate::migrated)]
async fn a_transient_halt_releases_the_lease_and_keeps_the_point(pool: PgPool) {
    let f = fixture(pool).await;
    f.knobs.retries.store(1, Ordering::SeqCst);
    let first = f.run("flaky", 100).await;
    let Outcome::RetryLater { retry_after, .. } = first else {
        panic!("expected RetryLater, got {first:?}");
    };
    assert_eq!(retry_after, Duration::from_secs(7));
    let (point, locked_until, _) = f.key_row("flaky").await.unwrap();
    assert_eq!(
        (point.as_str(), locked_until),
        ("moved", None),
        "released at the point reached"
    );
    // The retry resumes at once, from the point: one debit, one notification.
    let retry = f.run("flaky", 100).await;
    assert!(
        matches!(&retry, Outcome::Answered(r) if r.status == 201),
        "{retry:?}"
    );
    assert_eq!(f.effects().await, ["credit", "debit"]);
    assert_eq!(f.knobs.sent.load(Ordering::SeqCst), 1);
}

#[testdb::test(template = crate::migrated)]
async fn a_lease_lost_before_a_call_stops_the_run_without_the_call_or_a_release(pool: PgPool) {
    let f = fixture(pool).await;
    *f.knobs.pause.lock().unwrap() = Some(Pause::BeforeCall);
    let run = {
        let (store, transfer) = (f.store.clone(), f.transfer.clone());
        tokio::spawn(async move { store.run(&transfer, request("stolen", 100)).await })
    };
    f.knobs.paused.notified().await;
    let thief = f.steal("stolen", 100).await;
    f.knobs.resume.notify_one();
    assert_eq!(run.await.unwrap(), Outcome::Lost);
    assert_eq!(f.knobs.sent.load(Ordering::SeqCst), 0, "no call once lost");
    let (point, locked_until, token) = f.key_row("stolen").await.unwrap();
    assert_eq!((point.as_str(), token), ("moved", thief.token()));
    assert!(locked_until.is_some(), "the thief's lease was not released");
    f.store.release(thief).await.unwrap();
}

#[testdb::test(template = crate::migrated)]
async fn a_lease_lost_before_a_write_commits_nothing_of_the_step(pool: PgPool) {
    let f = fixture(pool).await;
    *f.knobs.pause.lock().unwrap() = Some(Pause::BeforeWrite);
    let run = {
        let (store, transfer) = (f.store.clone(), f.transfer.clone());
        tokio::spawn(async move { store.run(&transfer, request("fenced", 100)).await })
    };
    f.knobs.paused.notified().await;
    let thief = f.steal("fenced", 100).await;
    f.knobs.resume.notify_one();
    assert_eq!(run.await.unwrap(), Outcome::Lost);
    assert_eq!(
        f.effects().await,
        ["debit"],
        "the stale step's credit is not kept"
    );
    let (point, locked_until, token) = f.key_row("fenced").await.unwrap();
    assert_eq!((point.as_str(), token), ("moved", thief.token()));
    assert!(locked_until.is_some(), "the thief's lease was not released");
    f.store.release(thief).await.unwrap();
}

#[testdb::test(template = crate::migrated)]
async fn a_final_refusal_is_stored_without_the_steps_writes(pool: PgPool) {
    let f = fixture(pool).await;
    let refused = f.run("much", 5000).await;
    assert!(
        matches!(&refused, Outcome::Answered(r) if r.status == 402),
        "{refused:?}"
    );
    assert_eq!(
        f.effects().await,
        Vec::<String>::new(),
        "the debit rolled back"
    );
    let replay = f.run("much", 5000).await;
    assert!(
        matches!(&replay, Outcome::Replayed(r) if r.status == 402),
        "{replay:?}"
    );
    assert_eq!(f.key_row("much").await.unwrap().0, "finished");
}

#[testdb::test(template = crate::migrated)]
async fn a_request_for_another_route_is_refused_and_writes_nothing(pool: PgPool) {
    let f = fixture(pool).await;
    for request in [
        request("elsewhere", 100).route("/accounts/1/transfers"),
        request("elsewhere", 100).method("PUT"),
    ] {
        let outcome = f.store.run(&f.transfer, request).await;
        assert!(matches!(outcome, Outcome::Failed { .. }), "{outcome:?}");
    }
    assert_eq!(f.key_row("elsewhere").await, None);
    assert_eq!(f.effects().await, Vec::<String>::new());
}

#[testdb::test(template = crate::migrated)]
async fn the_completer_finishes_a_crashed_run_with_the_same_workflow(pool: PgPool) {
    let f = fixture(pool).await;
    // The notification never answers: the process "dies" with the key held at `moved`.
    *f.knobs.hang.lock().unwrap() = true;
    let caller = {
        let (store, transfer) = (f.store.clone(), f.transfer.clone());
        tokio::spawn(async move { store.run(&transfer, request("crash", 100)).await })
    };
    f.knobs.paused.notified().await;
    caller.abort();
    let completer = Completer::new(f.store.clone(), f.transfer.clone())
        .grace(GRACE)
        .unwrap();
    assert_eq!(
        completer.run_once().await.unwrap().claimed,
        0,
        "the lease is live"
    );
    f.clock.advance(GRACE + TTL);
    let pass = completer.run_once().await.unwrap();
    assert_eq!((pass.claimed, pass.finished), (1, 1), "{pass:?}");
    assert_eq!(f.knobs.sent.load(Ordering::SeqCst), 1, "one notification");
    assert_eq!(f.effects().await, ["credit", "debit"]);
    let replay = f.run("crash", 100).await;
    assert!(
        matches!(&replay, Outcome::Replayed(r) if r.status == 201),
        "{replay:?}"
    );
}

#[testdb::test(template = crate::migrated)]
async fn the_completer_backs_off_a_transient_halt_and_finishes_later(pool: PgPool) {
    let f = fixture(pool).await;
    f.knobs.retries.store(2, Ordering::SeqCst);
    assert!(matches!(
        f.run("later", 100).await,
        Outcome::RetryLater { .. }
    ));
    let completer = Completer::new(f.store.clone(), f.transfer.clone())
        .grace(GRACE)
        .unwrap()
        .backoff(Duration::from_secs(5), Duration::from_secs(60));
    f.clock.advance(GRACE + Duration::from_secs(1));
    let pass = completer.run_once().await.unwrap();
    assert_eq!((pass.claimed, pass.retried), (1, 1), "{pass:?}");
    // Within the halt's 7 s (above the 5 s backoff), the key is left alone.
    f.clock.advance(Duration::from_secs(6));
    assert_eq!(completer.run_once().await.unwrap().claimed, 0);
    f.clock.advance(Duration::from_secs(2));
    let pass = completer.run_once().await.unwrap();
    assert_eq!((pass.claimed, pass.finished), (1, 1), "{pass:?}");
    assert_eq!(f.effects().await, ["credit", "debit"]);
}
