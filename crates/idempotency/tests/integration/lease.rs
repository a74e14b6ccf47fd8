//! The lease kit against a real PostgreSQL: a foreign call under a lease keeps the lease while it
//! runs, and is stopped, or never started, once the lease is someone else's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::{
    Claim, Clock, DatabaseClock, Error, Fingerprint, IdempotencyKey, Lease, ManualClock,
    NewRequest, OffsetDateTime, OneStep, Owner, Store,
};
use serde_json::{json, Value};
use sqlx::PgPool;

const TTL: Duration = Duration::from_secs(3);

static OWNER: std::sync::LazyLock<Owner> =
    std::sync::LazyLock::new(|| Owner::new("acct_7").unwrap());

fn request<'a>(key: &'a IdempotencyKey, body: &'a Value) -> NewRequest<'a> {
    NewRequest {
        owner: &OWNER,
        method: "POST",
        route: "/transfers",
        key,
        fingerprint: Fingerprint::of_json("POST", "/transfers", body),
        params: body,
    }
}

async fn acquire(store: &Store, key: &IdempotencyKey, body: &Value) -> Lease<OneStep> {
    match store.claim::<OneStep>(request(key, body)).await.unwrap() {
        Claim::Acquired(lease) => lease,
        other => panic!("expected an acquired lease, got {other:?}"),
    }
}

#[testdb::test(template = crate::migrated)]
async fn a_call_slower_than_the_lease_keeps_it_to_the_end(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let clock = ManualClock::starting_now();
    let store = Store::new(pool.clone(), Arc::new(clock.clone()), TTL)
        .unwrap()
        .with_heartbeat(Duration::from_millis(300))
        .unwrap();
    let (key, body) = (
        IdempotencyKey::parse(b"slow").unwrap(),
        json!({"amount": 5}),
    );
    let mut lease = acquire(&store, &key, &body).await;
    let retry = store.clone();
    let (retry_key, retry_body) = (key.clone(), body.clone());
    let answer = store
        .call_under_lease(&mut lease, async move {
            // Twice the TTL, half a TTL at a time, each step once a beat has renewed the lease
            // from the moved clock: without renewals, the retry below would take the key over
            // (and the first step would wait in vain).
            for _ in 0..4 {
                clock.advance(TTL / 2);
                let now = clock.now().unwrap();
                testdb::until(
                    "a beat renewed the lease from the moved clock",
                    Duration::from_secs(10),
                    || async {
                        let until: OffsetDateTime =
                            sqlx::query_scalar("SELECT locked_until FROM idempotency_keys")
                                .fetch_one(&pool)
                                .await
                                .unwrap();
                        (until > now + TTL / 2).then_some(())
                    },
                )
                .await;
            }
            retry
                .claim::<OneStep>(request(&retry_key, &retry_body))
                .await
        })
        .await
        .unwrap();
    assert!(
        matches!(answer, Ok(Claim::InFlight { .. })),
        "a retry during the call must find the key held, got {answer:?}"
    );
    // The holder still holds it, and can finish.
    store.release(lease).await.unwrap();
}

#[testdb::test(template = crate::migrated)]
async fn a_takeover_during_the_call_stops_it_at_the_next_beat(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let clock = ManualClock::starting_now();
    let store = Store::new(pool, Arc::new(clock.clone()), TTL)
        .unwrap()
        .with_heartbeat(Duration::from_millis(100))
        .unwrap();
    let (key, body) = (
        IdempotencyKey::parse(b"taken").unwrap(),
        json!({"amount": 5}),
    );
    let mut lease = acquire(&store, &key, &body).await;
    let finished = Arc::new(AtomicBool::new(false));
    let (other, done) = (store.clone(), finished.clone());
    let (other_key, other_body) = (key.clone(), body.clone());
    let stopped = store
        .call_under_lease(&mut lease, async move {
            // The lease runs out (the clock moves past it) and another request takes it over:
            // the next beat finds it lost, or, by the holder's clock, already over.
            clock.advance(TTL + Duration::from_secs(1));
            let taken = acquire(&other, &other_key, &other_body).await;
            // The call never ends of itself: only the kit's next renewal can stop it (the bound
            // turns a kit that never does into a failure, not a hang).
            let _ =
                tokio::time::timeout(Duration::from_secs(30), std::future::pending::<()>()).await;
            done.store(true, Ordering::SeqCst);
            taken
        })
        .await;
    assert!(
        matches!(
            stopped,
            Err(Error::LeaseLost { .. } | Error::LeaseUnconfirmed { .. })
        ),
        "the call must stop on the lost renewal, got {stopped:?}"
    );
    assert!(!finished.load(Ordering::SeqCst), "the call ran to its end");
    // Nothing more can be written under the old lease.
    assert!(matches!(
        store.release(lease).await,
        Err(Error::LeaseLost { .. })
    ));
}

#[testdb::test(template = crate::migrated)]
async fn a_holder_that_stood_still_past_its_lease_does_not_start_the_call(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let clock = ManualClock::starting_now();
    let store = Store::new(pool, Arc::new(clock.clone()), TTL).unwrap();
    let (key, body) = (
        IdempotencyKey::parse(b"paused").unwrap(),
        json!({"amount": 5}),
    );
    let mut lease = acquire(&store, &key, &body).await;
    // The holder's process is paused past its lease; another request takes the key over.
    clock.advance(TTL + Duration::from_secs(1));
    let _taken = acquire(&store, &key, &body).await;
    let started = Arc::new(AtomicBool::new(false));
    let flag = started.clone();
    let outcome = store
        .call_under_lease(
            &mut lease,
            async move { flag.store(true, Ordering::SeqCst) },
        )
        .await;
    assert!(
        matches!(outcome, Err(Error::LeaseLost { .. })),
        "{outcome:?}"
    );
    assert!(!started.load(Ordering::SeqCst), "the call was started");
}

#[testdb::test(template = crate::migrated)]
async fn a_watched_call_stays_the_callers_when_the_lease_is_lost(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let clock = ManualClock::starting_now();
    let store = Store::new(pool, Arc::new(clock.clone()), TTL)
        .unwrap()
        .with_heartbeat(Duration::from_millis(100))
        .unwrap();
    let (key, body) = (
        IdempotencyKey::parse(b"watched").unwrap(),
        json!({"amount": 5}),
    );
    let mut lease = acquire(&store, &key, &body).await;
    let (other, other_key, other_body) = (store.clone(), key.clone(), body.clone());
    let mut task = tokio::spawn(async move {
        clock.advance(TTL + Duration::from_secs(1));
        let _taken = acquire(&other, &other_key, &other_body).await;
        // Never ends of itself (the bound turns a kit that never stops into a failure).
        let _ = tokio::time::timeout(Duration::from_secs(30), std::future::pending::<()>()).await;
    });
    let outcome = store.watch_under_lease(&mut lease, &mut task).await;
    assert!(
        matches!(
            outcome,
            Err(Error::LeaseLost { .. } | Error::LeaseUnconfirmed { .. })
        ),
        "{outcome:?}"
    );
    // The task was handed back untouched: the caller stops it and waits for its end.
    assert!(!task.is_finished());
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
}

#[sqlx::test(migrations = false)]
async fn the_heartbeat_must_leave_room_for_a_second_renewal(pool: PgPool) {
    let store = Store::new(pool, Arc::new(DatabaseClock), TTL).unwrap();
    assert_eq!(
        store.heartbeat(),
        TTL / 3,
        "the default is a third of the TTL"
    );
    for period in [Duration::ZERO, TTL / 2, TTL] {
        let refused = store.clone().with_heartbeat(period).unwrap_err();
        assert!(
            matches!(&refused, Error::InvalidConfig(why) if why.contains("heartbeat")),
            "{period:?}: {refused}"
        );
    }
}

/// A renewal whose statement reaches the key row only after its holder released the key (sent
/// before the release, its answer given up on, the release committed first) must not lock the
/// key again: retries would be turned away for a whole TTL with no holder at all.
#[testdb::test(template = crate::migrated)]
async fn a_renewal_that_lands_after_the_release_does_not_lock_the_key_again(pool: PgPool) {
    let store = Store::new(pool.clone(), Arc::new(DatabaseClock), TTL).unwrap();
    let (key, body) = (
        IdempotencyKey::parse(b"late-renewal").unwrap(),
        json!({"amount": 5}),
    );
    let mut lease = acquire(&store, &key, &body).await;
    // The release, as `Store::release` writes it, holds the row while the renewal comes to wait
    // on it, and commits first.
    let mut release = pool.begin().await.unwrap();
    sqlx::query(
        "UPDATE idempotency_keys SET locked_until = NULL
         WHERE idempotency_key = 'late-renewal' AND finished_at IS NULL",
    )
    .execute(&mut *release)
    .await
    .unwrap();
    let renewer = store.clone();
    let renewal = tokio::spawn(async move { renewer.renew(&mut lease).await });
    testdb::until_a_lock_wait(
        &pool,
        "the renewal came to wait on the released row",
        Duration::from_secs(5),
    )
    .await;
    release.commit().await.unwrap();
    let renewed = renewal.await.unwrap();
    assert!(
        matches!(renewed, Err(Error::LeaseLost { .. })),
        "a renewal after the release must find the lease gone: {renewed:?}"
    );
    let locked_until: Option<OffsetDateTime> =
        sqlx::query_scalar("SELECT locked_until FROM idempotency_keys")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(locked_until, None, "the key stays released");
    // A retry claims it at once.
    match store.claim::<OneStep>(request(&key, &body)).await.unwrap() {
        Claim::Acquired(lease) => store.release(lease).await.unwrap(),
        other => panic!("a retry after the release should take the key over, got {other:?}"),
    }
}
