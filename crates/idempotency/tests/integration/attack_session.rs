//! An adversary's tries at the step driver (`Store::run`): a transient halt after the lease was
//! taken over, a foreign call after the step's first write, a panic in a step, a workflow that
//! never finishes. Each asks the same questions: is a foreign call made twice or made by a holder
//! that lost its lease, is a false answer stored, is another holder's lease let go, is the key
//! left for ever.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::{
    Advance, Claim, Fingerprint, Halt, IdempotencyKey, ManualClock, NewRequest, Outcome, Owner,
    Request, Step, Store, Workflow,
};
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio::sync::Notify;

idempotency::recovery_points! {
    /// Two points a step may move between.
    enum Point {
        A = "a",
        B = "b",
    }
}

const TTL: Duration = Duration::from_secs(30);
const ROUTE: &str = "/probes";

/// What the probe's step at `A` does; the step at `Started` writes a row and moves to `A`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Waits for the test (which takes the lease over meanwhile), then `Halt::retry`.
    RetryAfterPause,
    /// Writes, then asks for a foreign call (refused), propagating the refusal.
    WriteThenCall,
    /// Panics, once; then finishes.
    PanicOnce,
    /// Moves to `B`, whose step moves back to `A`: never an answer.
    Cycle,
    /// The first step calls the gateway (the key committed at `Started` for it), then halts
    /// with `Halt::retry`: a gateway that answered too late.
    CallFirstThenRetry,
}

#[derive(Default)]
struct Knobs {
    paused: Notify,
    resume: Notify,
    /// Foreign calls that ran.
    calls: AtomicUsize,
    panicked: AtomicUsize,
}

struct Probe(Mode, Arc<Knobs>);

impl Workflow for Probe {
    type Point = Point;

    fn route(&self) -> &str {
        ROUTE
    }

    async fn step(&self, point: Point, step: &mut Step<'_, Point>) -> Result<Advance<Point>, Halt> {
        let knobs = &self.1;
        match (point, self.0) {
            (Point::Started, Mode::CallFirstThenRetry) => {
                step.call(async { knobs.calls.fetch_add(1, Ordering::SeqCst) })
                    .await?;
                Err(Halt::retry("the gateway's answer came too late"))
            }
            (Point::Started, _) => {
                write(step, "started").await?;
                Ok(Advance::To(Point::A))
            }
            (Point::A, Mode::RetryAfterPause) => {
                knobs.paused.notify_one();
                knobs.resume.notified().await;
                Err(Halt::retry("the gateway is away"))
            }
            (Point::A, Mode::WriteThenCall) => {
                write(step, "before the call").await?;
                step.call(async { knobs.calls.fetch_add(1, Ordering::SeqCst) })
                    .await?;
                Ok(Advance::Finish(idempotency::StoredResponse::json(
                    201,
                    &json!({"ok": true}),
                    vec![],
                )))
            }
            (Point::A, Mode::PanicOnce) => {
                step.call(async { knobs.calls.fetch_add(1, Ordering::SeqCst) })
                    .await?;
                if knobs.panicked.fetch_add(1, Ordering::SeqCst) == 0 {
                    panic!("the step's code is broken");
                }
                Ok(Advance::Finish(idempotency::StoredResponse::json(
                    201,
                    &json!({"ok": true}),
                    vec![],
                )))
            }
            (Point::A, Mode::Cycle) => {
                write(step, "a").await?;
                Ok(Advance::To(Point::B))
            }
            (Point::B, _) => {
                write(step, "b").await?;
                Ok(Advance::To(Point::A))
            }
            (Point::A, Mode::CallFirstThenRetry) => unreachable!("halts at Started"),
            (Point::Finished, _) => unreachable!("the driver never steps a finished key"),
        }
    }
}

async fn write(step: &mut Step<'_, Point>, what: &str) -> Result<(), Halt> {
    let key_id = step.key_id();
    sqlx::query("INSERT INTO probe_writes (key_id, what) VALUES ($1, $2)")
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
    pool: PgPool,
}

async fn fixture(pool: PgPool) -> Fixture {
    sqlx::query("CREATE TABLE probe_writes (key_id BIGINT, what TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let clock = ManualClock::starting_now();
    let store = Store::builder(pool.clone())
        .clock(Arc::new(clock.clone()))
        .lease_ttl(TTL)
        .build()
        .unwrap();
    Fixture {
        store,
        clock,
        knobs: Arc::new(Knobs::default()),
        pool,
    }
}

fn params() -> Value {
    json!({"amount": 5})
}

fn request(key: &str) -> Request {
    let owner = Owner::new("alice").unwrap();
    Request::new(
        owner,
        IdempotencyKey::parse(key.as_bytes()).unwrap(),
        params(),
    )
}

/// The key's recovery point, whether it is finished, whether its lease is held, and its token.
type Row = (String, bool, bool, i64);

impl Fixture {
    fn probe(&self, mode: Mode) -> Arc<Probe> {
        Arc::new(Probe(mode, self.knobs.clone()))
    }

    async fn row(&self, key: &str) -> Option<Row> {
        sqlx::query_as(
            "SELECT recovery_point, finished_at IS NOT NULL, locked_until IS NOT NULL, \
             lease_token FROM idempotency_keys WHERE idempotency_key = $1",
        )
        .bind(key)
        .fetch_optional(&self.pool)
        .await
        .unwrap()
    }

    async fn finished(&self, key: &str) -> bool {
        self.row(key).await.expect("the key exists").1
    }

    async fn writes(&self) -> Vec<String> {
        sqlx::query_scalar("SELECT what FROM probe_writes ORDER BY what")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    /// Another holder takes the key over once its lease ran out by the clock.
    async fn steal(&self, key: &str) -> idempotency::Lease<Point> {
        self.clock.advance(TTL + Duration::from_secs(1));
        let (owner, key, params) = (
            Owner::new("alice").unwrap(),
            IdempotencyKey::parse(key.as_bytes()).unwrap(),
            params(),
        );
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

#[testdb::test(template = crate::migrated)]
async fn a_transient_halt_after_a_takeover_does_not_release_the_thiefs_lease(pool: PgPool) {
    let f = fixture(pool).await;
    let run = {
        let (store, probe) = (f.store.clone(), f.probe(Mode::RetryAfterPause));
        tokio::spawn(async move { store.run(&probe, request("k1")).await })
    };
    f.knobs.paused.notified().await;
    let thief = f.steal("k1").await;
    f.knobs.resume.notify_one();
    assert_eq!(run.await.unwrap(), Outcome::Lost);
    let (point, finished, leased, token) = f.row("k1").await.unwrap();
    assert_eq!(
        (point.as_str(), finished, token),
        ("a", false, thief.token())
    );
    assert!(leased, "the thief's lease is still held");
    // The thief's lease is intact: it can still release it (fenced by its token).
    f.store.release(thief).await.unwrap();
}

#[testdb::test(template = crate::migrated)]
async fn a_call_after_the_steps_first_write_is_refused_and_the_write_rolled_back(pool: PgPool) {
    let f = fixture(pool).await;
    let outcome = f
        .store
        .run(&f.probe(Mode::WriteThenCall), request("k1"))
        .await;
    let Outcome::Failed { cause } = &outcome else {
        panic!("expected Failed, got {outcome:?}");
    };
    assert!(cause.contains("after the step's first write"), "{cause}");
    assert_eq!(
        f.knobs.calls.load(Ordering::SeqCst),
        0,
        "the call never ran"
    );
    // The first step committed; the refused step's write did not. No answer is stored, and
    // the key is free for a retry at once.
    assert_eq!(f.writes().await, ["started"]);
    let (point, finished, leased, _) = f.row("k1").await.unwrap();
    assert_eq!((point.as_str(), finished, leased), ("a", false, false));
}

#[testdb::test(template = crate::migrated)]
async fn a_panic_in_a_step_stores_no_answer_and_the_key_resumes_after_its_lease(pool: PgPool) {
    let f = fixture(pool).await;
    let probe = f.probe(Mode::PanicOnce);
    let outcome = f.store.run(&probe, request("k1")).await;
    assert!(
        matches!(&outcome, Outcome::Failed { cause } if cause.contains("panicked")),
        "{outcome:?}"
    );
    // No answer stored (the call's effect may have happened: nothing false is claimed), the
    // lease left to expire, so a retry meanwhile is in flight rather than a second call.
    let (point, finished, leased, _) = f.row("k1").await.unwrap();
    assert_eq!((point.as_str(), finished, leased), ("a", false, true));
    let early = f.store.run(&probe, request("k1")).await;
    assert!(matches!(early, Outcome::InFlight { .. }), "{early:?}");
    assert_eq!(f.knobs.calls.load(Ordering::SeqCst), 1);
    // Once the lease is over, a retry resumes at the point and finishes.
    f.clock.advance(TTL + Duration::from_secs(1));
    let retry = f.store.run(&probe, request("k1")).await;
    assert!(
        matches!(&retry, Outcome::Answered(r) if r.status == 201),
        "{retry:?}"
    );
    assert_eq!(f.writes().await, ["started"]);
}

#[testdb::test(template = crate::migrated)]
async fn a_panic_in_the_first_step_leaves_no_key(pool: PgPool) {
    struct Broken;
    impl Workflow for Broken {
        type Point = Point;
        fn route(&self) -> &str {
            ROUTE
        }
        async fn step(&self, _: Point, step: &mut Step<'_, Point>) -> Result<Advance<Point>, Halt> {
            write(step, "started").await?;
            panic!("broken after its write");
        }
    }
    let f = fixture(pool).await;
    let outcome = f.store.run(&Arc::new(Broken), request("k1")).await;
    assert!(matches!(outcome, Outcome::Failed { .. }), "{outcome:?}");
    assert_eq!(
        f.row("k1").await,
        None,
        "the claim rolled back with the step"
    );
    assert!(f.writes().await.is_empty());
}

#[testdb::test(template = crate::migrated)]
async fn a_workflow_that_never_finishes_stops_at_max_steps_and_stores_no_answer(pool: PgPool) {
    let f = fixture(pool).await;
    let outcome = f.store.run(&f.probe(Mode::Cycle), request("k1")).await;
    assert!(
        matches!(&outcome, Outcome::Failed { cause } if cause.contains("steps without an answer")),
        "{outcome:?}"
    );
    let (_, finished, leased, _) = f.row("k1").await.unwrap();
    assert_eq!((finished, leased), (false, false), "released, unanswered");
    // The first step, then MAX_STEPS - 1 more, each committed with its point.
    assert_eq!(f.writes().await.len(), idempotency::workflow::MAX_STEPS);
}

/// The retirement of abandoned keys (what `idempotency_axum::Retirer` runs) on a route it shares
/// with a workflow whose completer works its keys (a route moved from the HTTP layer to a
/// workflow keeps the layer's old unfinished keys beside the workflow's). It must finish only
/// keys left alone for `after`, and only those its writer marked: a workflow key whose gateway
/// call was made is the completer's to finish, however old, not to be answered "abandoned,
/// outcome unknown"; and a marked key a completer tried seconds ago is not abandoned.
#[testdb::test(template = crate::migrated)]
async fn retirement_leaves_alone_a_key_it_did_not_mark_and_a_key_tried_recently(pool: PgPool) {
    const TAG: &str = "idempotency_layer";
    const DAY: Duration = Duration::from_secs(24 * 3600);
    let f = fixture(pool).await;
    // Two workflow keys: each first step's gateway call was made, and the step halted.
    for key in ["recent", "old"] {
        let outcome = f
            .store
            .run(&f.probe(Mode::CallFirstThenRetry), request(key))
            .await;
        assert!(matches!(outcome, Outcome::RetryLater { .. }), "{outcome:?}");
    }
    // A layer key whose holder died.
    let _dead = claim_marked(&f, "layer-tried").await;
    // A minute later a completer of the route tries all three and backs off for 5 s.
    f.clock.advance(Duration::from_secs(61));
    let leases = f
        .store
        .claim_abandoned::<Point>("POST", ROUTE, Duration::from_secs(60), 10)
        .await
        .unwrap();
    assert_eq!(
        leases.len(),
        3,
        "the completer takes every key of its route"
    );
    for lease in leases {
        f.store
            .release_with_backoff(lease.unwrap(), Duration::from_secs(5))
            .await
            .unwrap();
    }
    f.clock.advance(Duration::from_secs(10));
    // A layer key whose holder died two days ago, and a workflow key left as long (its
    // completer was not running). Claimed now and aged by hand: a lease cannot outlast an hour,
    // and the completer above must not have tried the layer key.
    let _dead = claim_marked(&f, "layer-old").await;
    sqlx::query(
        "UPDATE idempotency_keys SET last_run_at = last_run_at - interval '2 days', \
         locked_until = locked_until - interval '2 days' \
         WHERE idempotency_key IN ('layer-old', 'old')",
    )
    .execute(&f.pool)
    .await
    .unwrap();
    let answer = idempotency::StoredResponse::json(500, &json!({"retired": true}), vec![]);
    let retired = f
        .store
        .retire_abandoned(TAG, DAY, &answer, 100)
        .await
        .unwrap();
    assert!(
        f.finished("layer-old").await,
        "the old marked key is retired"
    );
    assert!(
        !f.finished("old").await,
        "a workflow's key is its completer's, however old"
    );
    assert!(
        !f.finished("recent").await,
        "a workflow's key tried seconds ago is its completer's"
    );
    assert!(
        !f.finished("layer-tried").await,
        "a marked key tried seconds ago is not abandoned"
    );
    assert_eq!(retired, 1);
    assert_eq!(f.knobs.calls.load(Ordering::SeqCst), 2);
}

/// Claims a new key as the HTTP layer does (its mark in the stored parameters) and leaves it.
async fn claim_marked(f: &Fixture, key: &str) -> idempotency::Lease<idempotency::store::OneStep> {
    let (owner, key) = (
        Owner::new("alice").unwrap(),
        IdempotencyKey::parse(key.as_bytes()).unwrap(),
    );
    let marked = json!({"idempotency_layer": 1, "method": "POST", "target": ROUTE, "body": {}});
    let claim = NewRequest {
        owner: &owner,
        method: "POST",
        route: ROUTE,
        key: &key,
        fingerprint: Fingerprint::of_json("POST", ROUTE, &marked),
        params: &marked,
    };
    match f.store.claim(claim).await.unwrap() {
        Claim::Acquired(lease) => lease,
        other => panic!("a new key is acquired, got {other:?}"),
    }
}
