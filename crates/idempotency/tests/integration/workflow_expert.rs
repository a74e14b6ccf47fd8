//! The step driver's expert tools against a real PostgreSQL: a step's own fenced write before its
//! call (`Step::lease`), whether the holder arrived at the point itself (`Step::arrived`), the kind
//! of a transient halt (`Halt::kind`), what a step hands on to the next (`Step::hand_on`), an unconfirmed renewal (released, `RetryLater`), and a run
//! resumed from a lease the caller holds (`Store::resume`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::workflow::kind;
use idempotency::{
    Advance, Claim, Fingerprint, Halt, IdempotencyKey, ManualClock, NewRequest, Outcome, Owner,
    Request, Step, Store, StoredResponse, Workflow,
};
use serde_json::json;
use sqlx::PgPool;

idempotency::recovery_points! {
    /// The row is written; the call and the answer are next.
    enum Point {
        Written = "written",
    }
}

const TTL: Duration = Duration::from_secs(30);
const ROUTE: &str = "/notes";

/// What the `Written` step does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// A fenced write of its own (`Step::lease`), then the call, then the step's write.
    RecordThenCall,
    /// The step's write, then asks for the lease: refused.
    LeaseAfterWrite,
    /// Halts with a named kind the first time, then answers.
    HaltOnce,
    /// The call goes on while the key row is locked by another transaction and the lease nears
    /// its end by the clock: its renewal cannot be confirmed in time.
    RenewalHeldUp,
}

struct Notes {
    mode: Mode,
    /// The store the steps run under, for the record's own transaction (`Store::phase`).
    store: Store,
    store_pool: PgPool,
    clock: ManualClock,
    /// `Step::arrived` at `Written`, each time the step ran.
    arrived: Mutex<Vec<bool>>,
    /// `Step::handed` at `Written`, each time the step ran.
    handed: Mutex<Vec<Option<String>>>,
    halted: AtomicBool,
    calls: AtomicUsize,
}

impl Workflow for Notes {
    type Point = Point;

    fn route(&self) -> &str {
        ROUTE
    }

    async fn step(&self, point: Point, step: &mut Step<'_, Point>) -> Result<Advance<Point>, Halt> {
        match point {
            Point::Started => {
                let key_id = step.key_id();
                write(step.tx().await?, key_id, "first").await?;
                step.hand_on(format!("written by key {key_id}"));
                Ok(Advance::To(Point::Written))
            }
            Point::Written => self.written(step).await,
            Point::Finished => unreachable!("the driver never steps a finished key"),
        }
    }
}

impl Notes {
    async fn written(&self, step: &mut Step<'_, Point>) -> Result<Advance<Point>, Halt> {
        self.arrived.lock().unwrap().push(step.arrived());
        self.handed.lock().unwrap().push(step.handed::<String>());
        let key_id = step.key_id();
        match self.mode {
            Mode::RecordThenCall => {
                // Stands for a foreign call's record, committed before the call leaves.
                let lease = step.lease().await?;
                let mut record = self.store.phase(lease, Point::Written).await?;
                write(record.conn(), key_id, "record").await?;
                record.commit().await?;
                step.call(async { self.calls.fetch_add(1, Ordering::SeqCst) })
                    .await?;
                write(step.tx().await?, key_id, "answer").await?;
            }
            Mode::LeaseAfterWrite => {
                write(step.tx().await?, key_id, "answer").await?;
                step.lease().await?;
            }
            Mode::HaltOnce => {
                if !self.halted.swap(true, Ordering::SeqCst) {
                    return Err(Halt::retry("the notary is away").kind("notary-away"));
                }
            }
            Mode::RenewalHeldUp => {
                let (clock, pool) = (self.clock.clone(), self.store_pool.clone());
                step.call(async move {
                    // Holds the key row: the renewal's fenced update waits behind it.
                    let mut blocker = pool.begin().await.unwrap();
                    sqlx::query("SELECT 1 FROM idempotency_keys WHERE id = $1 FOR UPDATE")
                        .bind(key_id)
                        .execute(&mut *blocker)
                        .await
                        .unwrap();
                    // A fifth of a second of the lease left by the holder's clock.
                    clock.advance(TTL - Duration::from_millis(200));
                    // Never ends of itself: only the renewal's stop ends it (and drops the
                    // blocker with it). The bound is for a stop that never comes: the test then
                    // fails after a minute instead of hanging.
                    let _ =
                        tokio::time::timeout(Duration::from_secs(60), std::future::pending::<()>())
                            .await;
                    drop(blocker);
                })
                .await?;
            }
        }
        Ok(Advance::Finish(StoredResponse::json(
            201,
            &json!({"ok": true}),
            vec![],
        )))
    }
}

async fn write(conn: &mut sqlx::PgConnection, key_id: i64, what: &str) -> Result<(), Halt> {
    sqlx::query("INSERT INTO notes (key_id, what) VALUES ($1, $2)")
        .bind(key_id)
        .bind(what)
        .execute(conn)
        .await?;
    Ok(())
}

struct Fixture {
    store: Store,
    notes: Arc<Notes>,
    pool: PgPool,
}

async fn fixture(pool: PgPool, mode: Mode) -> Fixture {
    sqlx::query("CREATE TABLE notes (key_id BIGINT, what TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let clock = ManualClock::starting_now();
    let store = Store::builder(pool.clone())
        .clock(Arc::new(clock.clone()))
        .lease_ttl(TTL)
        .heartbeat(Duration::from_millis(50))
        .build()
        .unwrap();
    let notes = Arc::new(Notes {
        mode,
        store: store.clone(),
        store_pool: pool.clone(),
        clock,
        arrived: Mutex::default(),
        handed: Mutex::default(),
        halted: AtomicBool::new(false),
        calls: AtomicUsize::new(0),
    });
    Fixture { store, notes, pool }
}

impl Fixture {
    async fn run(&self) -> Outcome {
        let key = IdempotencyKey::parse(b"k1").unwrap();
        let request = Request::new(Owner::new("alice").unwrap(), key, json!({"n": 1}));
        self.store.run(&self.notes, request).await
    }

    async fn notes(&self) -> Vec<String> {
        sqlx::query_scalar("SELECT what FROM notes ORDER BY what")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    /// The key's recovery point and whether its lease is released.
    async fn key_row(&self) -> (String, bool) {
        sqlx::query_as(
            "SELECT recovery_point, locked_until IS NULL FROM idempotency_keys \
             WHERE idempotency_key = 'k1'",
        )
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    async fn claim(&self) -> Claim<Point> {
        let (owner, key, params) = (
            Owner::new("alice").unwrap(),
            IdempotencyKey::parse(b"k1").unwrap(),
            json!({"n": 1}),
        );
        let claim = NewRequest {
            owner: &owner,
            method: "POST",
            route: ROUTE,
            key: &key,
            fingerprint: Fingerprint::of_json("POST", ROUTE, &params),
            params: &params,
        };
        self.store.claim::<Point>(claim).await.unwrap()
    }
}

#[testdb::test(template = crate::migrated)]
async fn a_step_commits_a_fenced_record_of_its_own_before_its_call(pool: PgPool) {
    let f = fixture(pool, Mode::RecordThenCall).await;
    let outcome = f.run().await;
    assert!(
        matches!(outcome, Outcome::Answered(ref a) if a.status == 201),
        "{outcome:?}"
    );
    assert_eq!(f.notes().await, ["answer", "first", "record"]);
    assert_eq!(f.notes.calls.load(Ordering::SeqCst), 1);
    assert_eq!(f.key_row().await.0, "finished");
    // The step after the claim's own arrived at its point.
    assert_eq!(*f.notes.arrived.lock().unwrap(), [true]);
}

#[testdb::test(template = crate::migrated)]
async fn the_lease_is_refused_after_the_steps_first_write(pool: PgPool) {
    let f = fixture(pool, Mode::LeaseAfterWrite).await;
    let outcome = f.run().await;
    assert!(matches!(outcome, Outcome::Failed { .. }), "{outcome:?}");
    // The step's write rolled back; the first step's stayed; the key released at its point.
    assert_eq!(f.notes().await, ["first"]);
    assert_eq!(f.key_row().await, ("written".to_owned(), true));
}

#[testdb::test(template = crate::migrated)]
async fn a_halts_kind_comes_back_and_a_key_claimed_again_has_not_arrived(pool: PgPool) {
    let f = fixture(pool, Mode::HaltOnce).await;
    let first = f.run().await;
    let Outcome::RetryLater { kind, .. } = first else {
        panic!("expected RetryLater, got {first:?}");
    };
    assert_eq!(kind, "notary-away");
    assert_eq!(f.key_row().await, ("written".to_owned(), true));
    let second = f.run().await;
    assert!(matches!(second, Outcome::Answered(_)), "{second:?}");
    // The run that moved the key there arrived; the retry that claimed it again did not.
    assert_eq!(*f.notes.arrived.lock().unwrap(), [true, false]);
}

#[testdb::test(template = crate::migrated)]
async fn what_a_step_hands_on_reaches_the_next_step_of_its_run_only(pool: PgPool) {
    let f = fixture(pool, Mode::HaltOnce).await;
    assert!(matches!(f.run().await, Outcome::RetryLater { .. }));
    assert!(matches!(f.run().await, Outcome::Answered(_)));
    let key_id: i64 = sqlx::query_scalar("SELECT id FROM idempotency_keys")
        .fetch_one(&f.pool)
        .await
        .unwrap();
    // The run that wrote it passed it on; the retry, which claimed the key at `Written`,
    // starts with nothing and must read what it needs.
    assert_eq!(
        *f.notes.handed.lock().unwrap(),
        [Some(format!("written by key {key_id}")), None]
    );
}

#[testdb::test(template = crate::migrated)]
async fn an_unconfirmed_renewal_releases_the_key_for_a_retry(pool: PgPool) {
    let f = fixture(pool, Mode::RenewalHeldUp).await;
    let outcome = f.run().await;
    let Outcome::RetryLater { kind, .. } = outcome else {
        panic!("expected RetryLater, got {outcome:?}");
    };
    assert_eq!(kind, kind::LEASE_UNCONFIRMED);
    // No other holder took the key: the release (fenced) went through, at the point reached.
    assert_eq!(f.key_row().await, ("written".to_owned(), true));
}

#[testdb::test(template = crate::migrated)]
async fn a_resumed_stale_lease_is_lost_and_writes_nothing(pool: PgPool) {
    let f = fixture(pool, Mode::HaltOnce).await;
    assert!(matches!(f.run().await, Outcome::RetryLater { .. }));
    let Claim::Acquired(stale) = f.claim().await else {
        panic!("the released key is claimable");
    };
    f.notes.clock.advance(TTL + Duration::from_secs(1));
    let Claim::Acquired(_taker) = f.claim().await else {
        panic!("the expired lease is taken over");
    };
    let outcome = f.store.resume(&f.notes, stale).await;
    assert_eq!(outcome, Outcome::Lost);
    assert_eq!(f.notes().await, ["first"]);
    assert_eq!(f.key_row().await.0, "written");
}
