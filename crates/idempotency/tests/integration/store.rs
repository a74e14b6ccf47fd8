//! The store against a real PostgreSQL, one fresh database per test.

use std::sync::Arc;
use std::time::Duration;

use idempotency::{
    Begun, Claim, Error, Fingerprint, FirstPhase, IdempotencyKey, ManualClock, NewRequest, Owner,
    RecoveryPoint, Store, StoredResponse,
};
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::pooled;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Point {
    Started,
    Halfway,
    Finished,
}

impl RecoveryPoint for Point {
    const STARTED: Self = Self::Started;
    const FINISHED: Self = Self::Finished;

    fn name(self) -> &'static str {
        match self {
            Self::Started => "started",
            Self::Halfway => "halfway",
            Self::Finished => "finished",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        [Self::Started, Self::Halfway, Self::Finished]
            .into_iter()
            .find(|p| p.name() == name)
    }
}

const TTL: Duration = Duration::from_secs(30);

async fn setup(pool: &PgPool) -> (Store, ManualClock) {
    idempotency::migrate(pool).await.unwrap();
    // A business table for the phases to write to.
    sqlx::query("CREATE TABLE effects (key_id BIGINT NOT NULL, note TEXT NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    let clock = ManualClock::starting_now();
    let (store_pool, statements) = pooled::store_pool(pool);
    let store = Store::new(store_pool, Arc::new(clock.clone()), TTL)
        .unwrap()
        .with_statements(statements);
    (store, clock)
}

fn key(s: &str) -> IdempotencyKey {
    IdempotencyKey::parse(s.as_bytes()).unwrap()
}

fn request<'a>(owner: &'a Owner, key: &'a IdempotencyKey, body: &'a Value) -> NewRequest<'a> {
    NewRequest {
        owner,
        method: "POST",
        route: "/things",
        key,
        fingerprint: Fingerprint::of_json("POST", "/things", body),
        params: body,
    }
}

async fn effects(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(pool)
        .await
        .unwrap()
}

fn acquired(claim: Claim<Point>) -> idempotency::Lease<Point> {
    match claim {
        Claim::Acquired(lease) => lease,
        other => panic!("expected an acquired lease, got {other:?}"),
    }
}

#[testdb::test(template = crate::migrated)]
async fn first_claim_inserts_with_token_one_at_started(pool: PgPool) {
    let (store, _) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let lease = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    assert_eq!(lease.token(), 1);
    assert_eq!(lease.attempts(), 1);
    assert_eq!(lease.recovery_point(), Point::Started);
    assert_eq!(lease.params(), &body);
}

#[testdb::test(template = crate::migrated)]
async fn a_held_lease_refuses_a_second_claim_with_the_time_left(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let _lease = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    clock.advance(Duration::from_millis(10_500));
    match store
        .claim::<Point>(request(&Owner::from(1), &k, &body))
        .await
        .unwrap()
    {
        // 19.5 s left, rounded up.
        Claim::InFlight { retry_after } => assert_eq!(retry_after, Duration::from_secs(20)),
        other => panic!("expected InFlight, got {other:?}"),
    }
}

#[testdb::test(template = crate::migrated)]
async fn an_expired_lease_is_taken_over_with_a_new_token(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let first = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    clock.advance(TTL);
    let second = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    assert_eq!(second.key_id(), first.key_id());
    assert_eq!(second.token(), first.token() + 1);
    assert_eq!(second.attempts(), 2);
}

#[testdb::test(template = crate::migrated)]
async fn a_released_lease_is_claimable_at_once_and_keeps_its_recovery_point(pool: PgPool) {
    let (store, _) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let mut lease = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    store
        .phase(&mut lease, Point::Halfway)
        .await
        .unwrap()
        .commit()
        .await
        .unwrap();
    store.release(lease).await.unwrap();
    let again = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    assert_eq!(again.recovery_point(), Point::Halfway);
    assert_eq!(again.token(), 2);
}

#[testdb::test(template = crate::migrated)]
async fn an_abandoned_key_is_gone_and_only_its_holder_can_abandon_it(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let stale = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    clock.advance(TTL);
    let holder = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    assert!(matches!(
        store.abandon(stale).await,
        Err(idempotency::Error::LeaseLost { .. })
    ));
    store.abandon(holder).await.unwrap();
    // The key is as if it had never been sent: another payload may use it now.
    let other = json!({"a": 2});
    let fresh = acquired(
        store
            .claim(request(&Owner::from(1), &k, &other))
            .await
            .unwrap(),
    );
    assert_eq!(fresh.token(), 1);
}

#[testdb::test(template = crate::migrated)]
async fn another_payload_under_the_same_key_is_a_mismatch(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let k = key("k1");
    let (a, b) = (json!({"amount": 1}), json!({"amount": 2}));
    let _lease = acquired(store.claim(request(&Owner::from(1), &k, &a)).await.unwrap());
    assert!(matches!(
        store
            .claim::<Point>(request(&Owner::from(1), &k, &b))
            .await
            .unwrap(),
        Claim::Mismatch
    ));
    // Also once the lease is over: a mismatch never takes a key over.
    clock.advance(TTL * 2);
    assert!(matches!(
        store
            .claim::<Point>(request(&Owner::from(1), &k, &b))
            .await
            .unwrap(),
        Claim::Mismatch
    ));
}

#[testdb::test(template = crate::migrated)]
async fn a_finished_key_replays_its_stored_response_exactly(pool: PgPool) {
    let (store, _) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let mut lease = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    let response = StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), "/things/7".into()),
        ],
        body: b"{ \"id\" : 7 }\n".to_vec(),
    };
    store
        .final_phase(&mut lease)
        .await
        .unwrap()
        .finish(&response)
        .await
        .unwrap();
    assert_eq!(lease.recovery_point(), Point::Finished);
    match store
        .claim::<Point>(request(&Owner::from(1), &k, &body))
        .await
        .unwrap()
    {
        Claim::Replay(stored) => assert_eq!(stored, response),
        other => panic!("expected Replay, got {other:?}"),
    }
    let record = store.find(lease.key_id()).await.unwrap().unwrap();
    assert_eq!(record.locked_until, None);
    assert!(record.finished_at.is_some());
}

#[testdb::test(template = crate::migrated)]
async fn a_stale_holder_is_fenced_out_and_its_phase_writes_nothing(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let mut stale = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    clock.advance(TTL + Duration::from_secs(1));
    let mut current = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );

    let err = store.phase(&mut stale, Point::Halfway).await.unwrap_err();
    assert!(matches!(err, Error::LeaseLost { token: 1, .. }), "{err}");
    assert!(matches!(
        store.release(stale).await,
        Err(Error::LeaseLost { .. })
    ));

    let mut phase = store.phase(&mut current, Point::Halfway).await.unwrap();
    sqlx::query("INSERT INTO effects VALUES ($1, 'current')")
        .bind(phase.key_id())
        .execute(store.statements_on(phase.conn()))
        .await
        .unwrap();
    phase.commit().await.unwrap();
    assert_eq!(effects(&pool).await, 1);
}

#[testdb::test(template = crate::migrated)]
async fn a_phase_that_is_not_committed_leaves_neither_rows_nor_progress(pool: PgPool) {
    let (store, _) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let mut lease = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    {
        let mut phase = store.phase(&mut lease, Point::Halfway).await.unwrap();
        sqlx::query("INSERT INTO effects VALUES ($1, 'dropped')")
            .bind(phase.key_id())
            .execute(store.statements_on(phase.conn()))
            .await
            .unwrap();
        // Dropped here, as when the process dies mid-phase.
    }
    assert_eq!(effects(&pool).await, 0);
    assert_eq!(lease.recovery_point(), Point::Started);
    let record = store.find(lease.key_id()).await.unwrap().unwrap();
    assert_eq!(record.recovery_point, "started");
}

#[testdb::test(template = crate::migrated)]
async fn a_claim_during_an_open_phase_is_in_flight_at_once_and_then_sees_the_extended_lease(
    pool: PgPool,
) {
    let (store, clock) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let mut lease = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    // The lease is over, but its holder is alive and opens a phase: the fenced update wins the
    // row lock and extends the lease. A claimer arriving now cannot lock the row (NOWAIT): it is
    // in flight at once, and holds no connection waiting for the phase.
    clock.advance(TTL + Duration::from_secs(1));
    let phase = store.phase(&mut lease, Point::Halfway).await.unwrap();
    let during = tokio::time::timeout(
        Duration::from_secs(5),
        store.claim::<Point>(request(&Owner::from(1), &k, &body)),
    )
    .await
    .expect("the claim waited on the phase's row lock")
    .unwrap();
    assert!(matches!(during, Claim::InFlight { .. }), "{during:?}");
    phase.commit().await.unwrap();
    // After the commit the extended lease refuses it as well.
    match store
        .claim::<Point>(request(&Owner::from(1), &k, &body))
        .await
        .unwrap()
    {
        Claim::InFlight { .. } => {}
        other => panic!("expected InFlight, got {other:?}"),
    }
    assert_eq!(lease.recovery_point(), Point::Halfway);
}

#[testdb::test(template = crate::migrated)]
async fn concurrent_claims_of_one_key_acquire_exactly_once(pool: PgPool) {
    let (store, _) = setup(&pool).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (store, barrier) = (store.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let (k, body) = (key("same"), json!({"a": 1}));
            barrier.wait().await;
            store
                .claim::<Point>(request(&Owner::from(1), &k, &body))
                .await
                .unwrap()
        }));
    }
    let mut acquired = 0;
    for task in tasks {
        match task.await.unwrap() {
            Claim::Acquired(_) => acquired += 1,
            Claim::InFlight { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(acquired, 1);
}

#[testdb::test(template = crate::migrated)]
async fn keys_are_scoped_by_owner_and_route(pool: PgPool) {
    let (store, _) = setup(&pool).await;
    let (k, body) = (key("shared"), json!({"a": 1}));
    let a = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    let b = acquired(
        store
            .claim(request(&Owner::from(2), &k, &body))
            .await
            .unwrap(),
    );
    assert_ne!(a.key_id(), b.key_id());
    let first = Owner::from(1);
    let other_route = NewRequest {
        route: "/others",
        ..request(&first, &k, &body)
    };
    let c = acquired(store.claim(other_route).await.unwrap());
    assert_ne!(a.key_id(), c.key_id());
    // Owners are compared byte for byte: "01" is not "1", and case counts.
    let padded = Owner::new("01").unwrap();
    let d = acquired(store.claim(request(&padded, &k, &body)).await.unwrap());
    assert_ne!(a.key_id(), d.key_id());
    let (lower, upper) = (Owner::new("acct_a").unwrap(), Owner::new("ACCT_A").unwrap());
    let e = acquired(store.claim(request(&lower, &k, &body)).await.unwrap());
    let f = acquired(store.claim(request(&upper, &k, &body)).await.unwrap());
    assert_ne!(e.key_id(), f.key_id());
    assert_eq!((e.owner(), f.owner()), (&lower, &upper));
}

#[testdb::test(template = crate::migrated)]
async fn renewing_extends_a_held_lease_and_fails_for_a_stale_one(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let mut lease = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    let before = lease.locked_until();
    clock.advance(Duration::from_secs(20));
    store.renew(&mut lease).await.unwrap();
    assert_eq!(lease.locked_until() - before, time::Duration::seconds(20));
    // 20 s later the original lease would be over, the renewed one is not.
    clock.advance(Duration::from_secs(20));
    assert!(matches!(
        store
            .claim::<Point>(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
        Claim::InFlight { .. }
    ));
    clock.advance(TTL);
    let _taken = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    assert!(matches!(
        store.renew(&mut lease).await,
        Err(Error::LeaseLost { .. })
    ));
}

#[testdb::test(template = crate::migrated)]
async fn concurrent_claims_of_an_expired_lease_take_it_over_exactly_once(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let (k, body) = (key("same"), json!({"a": 1}));
    let _dead = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    clock.advance(TTL + Duration::from_secs(1));
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (store, barrier, k, body) = (store.clone(), barrier.clone(), k.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            store
                .claim::<Point>(request(&Owner::from(1), &k, &body))
                .await
                .unwrap()
        }));
    }
    let mut tokens = Vec::new();
    for task in tasks {
        match task.await.unwrap() {
            Claim::Acquired(lease) => tokens.push(lease.token()),
            Claim::InFlight { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(tokens, [2], "one takeover, with the next token");
}

#[testdb::test(template = crate::migrated)]
async fn the_completer_claims_only_its_route_and_only_after_the_grace(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let body = json!({"a": 1});
    let (mine, other) = (key("mine"), key("other"));
    let _a = acquired(
        store
            .claim(request(&Owner::from(1), &mine, &body))
            .await
            .unwrap(),
    );
    let _b = acquired(
        store
            .claim(NewRequest {
                route: "/others",
                ..request(&Owner::from(1), &other, &body)
            })
            .await
            .unwrap(),
    );
    let grace = Duration::from_secs(60);
    clock.advance(TTL + Duration::from_secs(1));
    // Expired, but attempted less than the grace ago.
    assert!(store
        .claim_abandoned::<Point>("POST", "/things", grace, 10)
        .await
        .unwrap()
        .is_empty());
    clock.advance(grace);
    let claimed = store
        .claim_abandoned::<Point>("POST", "/things", grace, 10)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let lease = claimed.into_iter().next().unwrap().unwrap();
    assert_eq!((lease.token(), lease.completer_attempts()), (2, 1));
    let record = store.find(lease.key_id()).await.unwrap().unwrap();
    assert_eq!(record.idempotency_key, "mine");
}

#[testdb::test(template = crate::migrated)]
async fn a_key_at_an_unknown_recovery_point_does_not_stop_the_others(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let body = json!({"a": 1});
    for name in ["a", "b", "c"] {
        let _ = acquired(
            store
                .claim(request(&Owner::from(1), &key(name), &body))
                .await
                .unwrap(),
        );
    }
    sqlx::query(
        "UPDATE idempotency_keys SET recovery_point = 'renamed' WHERE idempotency_key = 'b'",
    )
    .execute(&pool)
    .await
    .unwrap();
    clock.advance(Duration::from_secs(3600));
    let claimed = store
        .claim_abandoned::<Point>("POST", "/things", Duration::from_secs(60), 10)
        .await
        .unwrap();
    let (ok, bad): (Vec<_>, Vec<_>) = claimed.into_iter().partition(Result::is_ok);
    assert_eq!((ok.len(), bad.len()), (2, 1));
    assert!(matches!(bad[0], Err(Error::UnknownRecoveryPoint { .. })));
}

#[testdb::test(template = crate::migrated)]
async fn a_phase_cannot_skip_to_finished_or_back_to_started(pool: PgPool) {
    let (store, _) = setup(&pool).await;
    let mut lease = acquired(
        store
            .claim(request(&Owner::from(1), &key("k"), &json!({})))
            .await
            .unwrap(),
    );
    for to in [Point::Finished, Point::Started] {
        let err = store.phase(&mut lease, to).await.unwrap_err();
        assert!(matches!(err, Error::InvalidTransition { .. }), "{err}");
    }
}

/// The row's physical position and its locker: a write or a row lock changes one of them.
async fn row_version(pool: &PgPool) -> (String, String) {
    sqlx::query_as("SELECT ctid::text, xmax::text FROM idempotency_keys")
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn unfinished_rows(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotency_keys_unfinished")
        .fetch_one(pool)
        .await
        .unwrap()
}

fn response(body: &str) -> StoredResponse {
    StoredResponse::json(201, &json!({ "body": body }), vec![])
}

fn new_phase(begun: Begun<Point>) -> FirstPhase<Point> {
    match begun {
        Begun::New(phase) => phase,
        Begun::Existing(claim) => panic!("expected a new key, got {claim:?}"),
    }
}

fn existing(begun: Begun<Point>) -> Claim<Point> {
    match begun {
        Begun::Existing(claim) => claim,
        Begun::New(phase) => panic!(
            "expected an existing key, got new key {}",
            phase.lease().key_id()
        ),
    }
}

#[testdb::test(template = crate::migrated)]
async fn refused_claims_neither_write_nor_lock_the_row(pool: PgPool) {
    let (store, _) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let mut lease = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    // Held: a second claim is refused by a read.
    let held = row_version(&pool).await;
    assert!(matches!(
        store
            .claim::<Point>(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
        Claim::InFlight { .. }
    ));
    assert_eq!(
        row_version(&pool).await,
        held,
        "an in-flight refusal wrote or locked"
    );

    let mut phase = store.final_phase(&mut lease).await.unwrap();
    phase.conn();
    phase.finish(&response("done")).await.unwrap();
    // A fresh row lock would set xmax; a write would move the row.
    sqlx::query("SELECT 1 FROM idempotency_keys FOR UPDATE")
        .execute(&pool)
        .await
        .unwrap();
    let finished = row_version(&pool).await;
    for _ in 0..3 {
        assert!(matches!(
            store
                .claim::<Point>(request(&Owner::from(1), &k, &body))
                .await
                .unwrap(),
            Claim::Replay(_)
        ));
        assert!(matches!(
            store
                .claim::<Point>(request(&Owner::from(1), &k, &json!({"a": 2})))
                .await
                .unwrap(),
            Claim::Mismatch
        ));
        assert!(matches!(
            existing(
                store
                    .begin(request(&Owner::from(1), &k, &body), Point::Halfway)
                    .await
                    .unwrap()
            ),
            Claim::Replay(_)
        ));
    }
    assert_eq!(
        row_version(&pool).await,
        finished,
        "a replay or a mismatch wrote or locked the finished row"
    );
}

#[testdb::test(template = crate::migrated)]
async fn begin_inserts_a_new_key_at_the_first_point_with_the_phase_rows(pool: PgPool) {
    let (store, _) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let mut first = new_phase(
        store
            .begin(request(&Owner::from(1), &k, &body), Point::Halfway)
            .await
            .unwrap(),
    );
    sqlx::query("INSERT INTO effects VALUES ($1, 'first')")
        .bind(first.lease().key_id())
        .execute(store.statements_on(first.conn()))
        .await
        .unwrap();
    // Nothing is visible before the commit: neither the key nor the phase's rows.
    assert_eq!(effects(&pool).await, 0);
    assert_eq!(store.count_unfinished().await.unwrap(), 0);
    let mut lease = first.commit().await.unwrap();
    assert_eq!(
        (lease.recovery_point(), lease.token(), lease.attempts()),
        (Point::Halfway, 1, 1)
    );
    assert_eq!(lease.params(), &body);
    assert_eq!(effects(&pool).await, 1);
    assert_eq!(store.count_unfinished().await.unwrap(), 1);
    assert_eq!(
        store
            .find(lease.key_id())
            .await
            .unwrap()
            .unwrap()
            .recovery_point,
        "halfway"
    );
    // Held by the first request now.
    assert!(matches!(
        existing(
            store
                .begin(request(&Owner::from(1), &k, &body), Point::Halfway)
                .await
                .unwrap()
        ),
        Claim::InFlight { .. }
    ));
    store
        .final_phase(&mut lease)
        .await
        .unwrap()
        .finish(&response("done"))
        .await
        .unwrap();
    assert_eq!(unfinished_rows(&pool).await, 0);
    assert!(matches!(
        existing(
            store
                .begin(request(&Owner::from(1), &k, &body), Point::Halfway)
                .await
                .unwrap()
        ),
        Claim::Replay(_)
    ));
}

#[testdb::test(template = crate::migrated)]
async fn a_first_phase_dropped_uncommitted_leaves_no_key(pool: PgPool) {
    let (store, _) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    {
        let mut first = new_phase(
            store
                .begin(request(&Owner::from(1), &k, &body), Point::Halfway)
                .await
                .unwrap(),
        );
        sqlx::query("INSERT INTO effects VALUES ($1, 'dropped')")
            .bind(first.lease().key_id())
            .execute(store.statements_on(first.conn()))
            .await
            .unwrap();
        // Dropped here, as when the process dies mid-phase.
    }
    assert_eq!(effects(&pool).await, 0);
    assert_eq!(unfinished_rows(&pool).await, 0);
    // As if never sent: another payload may use the key.
    let other = json!({"a": 2});
    let _first = new_phase(
        store
            .begin(request(&Owner::from(1), &k, &other), Point::Halfway)
            .await
            .unwrap(),
    );
}

#[testdb::test(template = crate::migrated)]
async fn a_key_taken_over_resumes_from_its_point_instead_of_starting_again(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let first = new_phase(
        store
            .begin(request(&Owner::from(1), &k, &body), Point::Halfway)
            .await
            .unwrap(),
    );
    let dead = first.commit().await.unwrap();
    // Its holder died; its lease runs out.
    clock.advance(TTL);
    let resumed = match existing(
        store
            .begin(request(&Owner::from(1), &k, &body), Point::Halfway)
            .await
            .unwrap(),
    ) {
        Claim::Acquired(lease) => lease,
        other => panic!("expected a takeover, got {other:?}"),
    };
    assert_eq!(resumed.key_id(), dead.key_id());
    assert_eq!(resumed.token(), 2);
    assert_eq!(resumed.recovery_point(), Point::Halfway);
}

#[testdb::test(template = crate::migrated)]
async fn concurrent_begins_of_one_new_key_insert_it_once(pool: PgPool) {
    let (store, _) = setup(&pool).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    // A connection of its own to watch the others wait: the test's pool is theirs.
    let watcher = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (store, barrier, watcher) = (store.clone(), barrier.clone(), watcher.clone());
        tasks.push(tokio::spawn(async move {
            let (k, body) = (key("same"), json!({"a": 1}));
            barrier.wait().await;
            match store
                .begin::<Point>(request(&Owner::from(1), &k, &body), Point::Halfway)
                .await
                .unwrap()
            {
                Begun::New(mut first) => {
                    sqlx::query("INSERT INTO effects VALUES ($1, 'once')")
                        .bind(first.lease().key_id())
                        .execute(store.statements_on(first.conn()))
                        .await
                        .unwrap();
                    // Held open until another begin waits on the insert.
                    testdb::until_a_lock_wait(
                        &watcher,
                        "a statement came to wait on the lock",
                        Duration::from_secs(5),
                    )
                    .await;
                    let _lease = first.commit().await.unwrap();
                    true
                }
                Begun::Existing(Claim::InFlight { .. }) => false,
                Begun::Existing(other) => panic!("unexpected {other:?}"),
            }
        }));
    }
    let mut new = 0;
    for task in tasks {
        new += usize::from(task.await.unwrap());
    }
    assert_eq!(new, 1);
    assert_eq!(effects(&pool).await, 1);
}

#[testdb::test(template = crate::migrated)]
async fn begin_optimistic_runs_a_request_in_one_transaction(pool: PgPool) {
    let (store, _) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let mut first = new_phase(
        store
            .begin_optimistic(request(&Owner::from(1), &k, &body), Point::Started)
            .await
            .unwrap(),
    );
    sqlx::query("INSERT INTO effects VALUES ($1, 'one transaction')")
        .bind(first.lease().key_id())
        .execute(store.statements_on(first.conn()))
        .await
        .unwrap();
    first.finish(&response("done")).await.unwrap();
    assert_eq!(effects(&pool).await, 1);
    assert_eq!(unfinished_rows(&pool).await, 0);
    match existing(
        store
            .begin_optimistic(request(&Owner::from(1), &k, &body), Point::Started)
            .await
            .unwrap(),
    ) {
        Claim::Replay(stored) => assert_eq!(stored, response("done")),
        other => panic!("expected Replay, got {other:?}"),
    }
    assert!(matches!(
        existing(
            store
                .begin_optimistic(
                    request(&Owner::from(1), &k, &json!({"a": 2})),
                    Point::Started
                )
                .await
                .unwrap()
        ),
        Claim::Mismatch
    ));
    // Committed unfinished instead, the key is listed for the completer.
    let other = key("k2");
    let first = new_phase(
        store
            .begin_optimistic(request(&Owner::from(1), &other, &body), Point::Halfway)
            .await
            .unwrap(),
    );
    let _lease = first.commit().await.unwrap();
    assert_eq!(unfinished_rows(&pool).await, 1);
    assert_eq!(store.count_unfinished().await.unwrap(), 1);
}

/// A store whose connections wait at most 100 ms for a row lock.
async fn impatient_store(pool: &PgPool) -> Store {
    let options = pool
        .connect_options()
        .as_ref()
        .clone()
        .options([("lock_timeout", "100ms")]);
    let impatient_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .unwrap();
    Store::new(impatient_pool, Arc::new(idempotency::DatabaseClock), TTL).unwrap()
}

#[testdb::test(template = crate::migrated)]
async fn a_key_being_inserted_is_in_flight_once_the_lock_timeout_runs_out(pool: PgPool) {
    let (store, _) = setup(&pool).await;
    let impatient = impatient_store(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let first = new_phase(
        store
            .begin_optimistic(request(&Owner::from(1), &k, &body), Point::Started)
            .await
            .unwrap(),
    );
    match existing(
        impatient
            .begin_optimistic(request(&Owner::from(1), &k, &body), Point::Started)
            .await
            .unwrap(),
    ) {
        Claim::InFlight { retry_after } => assert_eq!(retry_after, Duration::from_secs(1)),
        other => panic!("expected InFlight, got {other:?}"),
    }
    first.finish(&response("done")).await.unwrap();
    assert!(matches!(
        existing(
            impatient
                .begin_optimistic(request(&Owner::from(1), &k, &body), Point::Started)
                .await
                .unwrap()
        ),
        Claim::Replay(_)
    ));
}

#[testdb::test(template = crate::migrated)]
async fn a_finished_key_whose_row_is_being_written_still_replays_after_the_lock_timeout(
    pool: PgPool,
) {
    let (store, _) = setup(&pool).await;
    let impatient = impatient_store(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let first = new_phase(
        store
            .begin_optimistic(request(&Owner::from(1), &k, &body), Point::Started)
            .await
            .unwrap(),
    );
    first.finish(&response("done")).await.unwrap();
    // Another transaction writes the finished row (as the reaper's delete would) and holds it.
    let mut writer = pool.begin().await.unwrap();
    sqlx::query("UPDATE idempotency_keys SET attempts = attempts")
        .execute(&mut *writer)
        .await
        .unwrap();
    match existing(
        impatient
            .begin_optimistic(request(&Owner::from(1), &k, &body), Point::Started)
            .await
            .unwrap(),
    ) {
        Claim::Replay(stored) => assert_eq!(stored, response("done")),
        other => panic!("expected Replay, got {other:?}"),
    }
    assert!(matches!(
        existing(
            impatient
                .begin_optimistic(
                    request(&Owner::from(1), &k, &json!({"a": 2})),
                    Point::Started
                )
                .await
                .unwrap()
        ),
        Claim::Mismatch
    ));
    writer.rollback().await.unwrap();
}

#[testdb::test(template = crate::migrated)]
async fn begin_refuses_finished_as_the_first_point(pool: PgPool) {
    let (store, _) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    for begun in [
        store
            .begin::<Point>(request(&Owner::from(1), &k, &body), Point::Finished)
            .await,
        store
            .begin_optimistic::<Point>(request(&Owner::from(1), &k, &body), Point::Finished)
            .await,
    ] {
        assert!(matches!(begun, Err(Error::InvalidTransition { .. })));
    }
    assert_eq!(unfinished_rows(&pool).await, 0);
}

/// The columns the store's updates set: no index may cover one (predicates of partial indexes
/// included), or those updates cannot be HOT.
const UPDATED_COLUMNS: [&str; 11] = [
    "recovery_point",
    "locked_until",
    "lease_token",
    "attempts",
    "completer_attempts",
    "next_attempt_at",
    "last_run_at",
    "response_status",
    "response_headers",
    "response_body",
    "finished_at",
];

#[testdb::test(template = crate::migrated)]
async fn no_index_covers_a_column_that_updates_set(pool: PgPool) {
    setup(&pool).await;
    // Every column an index uses, as a key, in an expression or in its predicate.
    let indexed: Vec<(String, String)> = sqlx::query_as(
        "SELECT i.relname::text, a.attname::text
         FROM pg_index x
         JOIN pg_class i ON i.oid = x.indexrelid
         JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum > 0
         WHERE x.indrelid = 'idempotency_keys'::regclass
           AND (a.attnum = ANY (x.indkey)
                OR pg_get_expr(x.indexprs, x.indrelid) LIKE '%' || a.attname || '%'
                OR pg_get_expr(x.indpred, x.indrelid) LIKE '%' || a.attname || '%')",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(!indexed.is_empty());
    let blocking: Vec<_> = indexed
        .iter()
        .filter(|(_, column)| UPDATED_COLUMNS.contains(&column.as_str()))
        .collect();
    assert!(
        blocking.is_empty(),
        "indexes that make updates non-HOT: {blocking:?}"
    );
}

#[testdb::test(template = crate::migrated)]
async fn key_row_updates_are_hot_without_vacuum(pool: PgPool) {
    let (store, _) = setup(&pool).await;
    let body_text = "x".repeat(600);
    for i in 0..300 {
        let (k, body) = (key(&format!("k{i}")), json!({"a": i, "note": "a ride"}));
        let first = new_phase(
            store
                .begin(request(&Owner::from(1), &k, &body), Point::Halfway)
                .await
                .unwrap(),
        );
        let mut lease = first.commit().await.unwrap();
        store.renew(&mut lease).await.unwrap();
        store
            .final_phase(&mut lease)
            .await
            .unwrap()
            .finish(&response(&body_text))
            .await
            .unwrap();
    }
    // Backends report their statistics when they end: close every connection first.
    let options = pool.connect_options().as_ref().clone();
    pool.close().await;
    let conn = sqlx::ConnectOptions::connect(&options).await.unwrap();
    let conn = tokio::sync::Mutex::new(conn);
    // Bounded at 30 s: a loaded machine delivers the ended backends' statistics late (558 of
    // 600 after 5 s once, with six builds running); the wait ends as soon as all have arrived.
    let (updates, hot): (i64, i64) = testdb::until(
        "the statistics of 600 updates arrived",
        Duration::from_secs(30),
        || async {
            let mut conn = conn.lock().await;
            sqlx::query("SELECT pg_stat_clear_snapshot()")
                .execute(&mut *conn)
                .await
                .unwrap();
            let counts: (i64, i64) = sqlx::query_as(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
                 WHERE relname = 'idempotency_keys'",
            )
            .fetch_one(&mut *conn)
            .await
            .unwrap();
            (counts.0 >= 600).then_some(counts)
        },
    )
    .await;
    assert_eq!(updates, 600, "a renewal and a finish per key");
    assert!(
        hot * 100 >= updates * 95,
        "{hot} of {updates} key-row updates were HOT"
    );
}

#[testdb::test(template = crate::migrated)]
async fn a_holder_knows_by_its_own_clock_when_its_lease_may_be_gone(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let mut lease = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    assert_eq!(store.lease_left(&lease), TTL);

    // The holder stands still past its lease: it knows, without asking the database.
    clock.advance(TTL + Duration::from_millis(50));
    assert_eq!(store.lease_left(&lease), Duration::ZERO);
    // A renewal while nobody took the key over extends it again,
    store.renew(&mut lease).await.unwrap();
    assert_eq!(store.lease_left(&lease), TTL);
    // and so does a phase.
    clock.advance(TTL + Duration::from_millis(50));
    store
        .phase(&mut lease, Point::Halfway)
        .await
        .unwrap()
        .commit()
        .await
        .unwrap();
    assert_eq!(store.lease_left(&lease), TTL);

    // Taken over meanwhile (the clock moved past the lease): the renewal says so.
    clock.advance(TTL + Duration::from_millis(50));
    let _taken = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    assert_eq!(store.lease_left(&lease), Duration::ZERO);
    assert!(matches!(
        store.renew(&mut lease).await,
        Err(Error::LeaseLost { .. })
    ));
}

#[testdb::test(template = crate::migrated)]
async fn a_claim_whose_answer_is_held_past_the_lease_knows_the_lease_is_gone(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let _abandoned = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    clock.advance(TTL + Duration::from_secs(1));
    // The takeover's statement is held between its sending and its answer: here by a table
    // lock that lets the claim's read through and holds its write (a row lock would not: the
    // takeover locks its row NOWAIT), as a slow network or a paused process would hold it.
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE idempotency_keys IN SHARE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let held = tokio::spawn({
        let (store, body) = (store.clone(), body.clone());
        async move {
            let k = key("k1");
            store
                .claim::<Point>(request(&Owner::from(1), &k, &body))
                .await
                .unwrap()
        }
    });
    testdb::until_a_lock_wait(
        &pool,
        "a statement came to wait on the lock",
        Duration::from_secs(5),
    )
    .await;
    // Longer than a lease passes before the answer arrives.
    clock.advance(TTL + Duration::from_secs(1));
    holder.commit().await.unwrap();
    let mut late = acquired(held.await.unwrap());
    assert_eq!(late.token(), 2);
    // The lease it got was timed from before its statement: it is over, and the holder knows.
    assert_eq!(store.lease_left(&late), Duration::ZERO);
    // Another attempt takes the key over; the late holder learns it before any foreign call.
    let taker = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    assert_eq!(taker.token(), 3);
    assert!(matches!(
        store.renew(&mut late).await,
        Err(Error::LeaseLost { .. })
    ));
}
