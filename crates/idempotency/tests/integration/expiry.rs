//! Expiry at read: a key that finished longer ago than the store's retention is answered as a new
//! request by every claim, and the reaper deletes exactly those keys. Against a real PostgreSQL,
//! one fresh database per test; time moves on a `ManualClock`, never by sleeping.

use std::sync::Arc;
use std::time::Duration;

use idempotency::{
    Begun, Claim, Error, Fingerprint, IdempotencyKey, Lease, ManualClock, NewRequest,
    OffsetDateTime, OneStep, Owner, Store, StoredResponse,
};
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::pooled;

const TTL: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(24 * 3600);
const HOUR: Duration = Duration::from_secs(3600);

/// A clock on a whole second, so that times computed in Rust and in SQL meet exactly.
fn clock() -> ManualClock {
    let second = OffsetDateTime::now_utc().unix_timestamp();
    ManualClock::new(OffsetDateTime::from_unix_timestamp(second).unwrap())
}

async fn setup(pool: &PgPool) -> (Store, ManualClock) {
    idempotency::migrate(pool).await.unwrap();
    let clock = clock();
    let store = pooled::store(pool, Arc::new(clock.clone()), TTL)
        .with_retention(RETENTION)
        .unwrap();
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

fn response(body: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        body: body.as_bytes().to_vec(),
    }
}

fn acquired(claim: Claim<OneStep>) -> Lease<OneStep> {
    match claim {
        Claim::Acquired(lease) => lease,
        other => panic!("expected an acquired lease, got {other:?}"),
    }
}

fn replayed(claim: Claim<OneStep>) -> StoredResponse {
    match claim {
        Claim::Replay(stored) => stored,
        other => panic!("expected a replay, got {other:?}"),
    }
}

async fn finish(store: &Store, mut lease: Lease<OneStep>, body: &str) {
    let phase = store.final_phase(&mut lease).await.unwrap();
    phase.finish(&response(body)).await.unwrap();
}

/// Claims and finishes a new key now; returns its row's id.
async fn finished_key(store: &Store, owner: i64, name: &str, body: &Value) -> i64 {
    let k = key(name);
    let lease = acquired(
        store
            .claim(request(&Owner::from(owner), &k, body))
            .await
            .unwrap(),
    );
    let key_id = lease.key_id();
    finish(store, lease, "first").await;
    key_id
}

/// How many rows the key has (its scope is unique: 0 or 1).
async fn rows_of(pool: &PgPool, owner: i64, name: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_keys WHERE owner = $1 AND idempotency_key = $2",
    )
    .bind(owner.to_string())
    .bind(name)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[testdb::test(template = crate::migrated)]
async fn a_key_finished_past_the_retention_is_a_new_request_with_a_new_row(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let first = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    let (old_id, old_uuid) = (first.key_id(), first.request_uuid());
    finish(&store, first, "first").await;

    clock.advance(RETENTION - Duration::from_secs(1));
    let stored = replayed(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    assert_eq!(stored.body, b"first");

    clock.advance(Duration::from_secs(2));
    let second = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    assert_ne!(second.key_id(), old_id);
    assert_ne!(second.request_uuid(), old_uuid);
    assert_eq!(second.token(), 1);
    assert_eq!(second.attempts(), 1);
    assert_eq!(second.recovery_point(), OneStep::Started);
    assert!(
        store.find(old_id).await.unwrap().is_none(),
        "the old row is deleted"
    );
    assert_eq!(rows_of(&pool, 1, "k1").await, 1);
    assert_eq!(store.count_unfinished().await.unwrap(), 1);

    // The new request runs its course and replays in turn.
    finish(&store, second, "second").await;
    let stored = replayed(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    assert_eq!(stored.body, b"second");
}

#[testdb::test(template = crate::migrated)]
async fn another_payload_after_expiry_is_a_new_request_not_a_mismatch(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let k = key("k1");
    let (body, other) = (json!({"a": 1}), json!({"a": 2}));
    finished_key(&store, 1, "k1", &body).await;
    assert!(matches!(
        store
            .claim::<OneStep>(request(&Owner::from(1), &k, &other))
            .await
            .unwrap(),
        Claim::Mismatch
    ));
    clock.advance(RETENTION + Duration::from_secs(1));
    let lease = acquired(
        store
            .claim(request(&Owner::from(1), &k, &other))
            .await
            .unwrap(),
    );
    assert_eq!(lease.params(), &other);
    // The first payload is now the other one.
    assert!(matches!(
        store
            .claim::<OneStep>(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
        Claim::Mismatch
    ));
    finish(&store, lease, "other").await;
    assert_eq!(
        replayed(
            store
                .claim(request(&Owner::from(1), &k, &other))
                .await
                .unwrap()
        )
        .body,
        b"other"
    );
}

#[testdb::test(template = crate::migrated)]
async fn an_unfinished_key_never_expires_at_read(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let first = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    let key_id = first.key_id();
    store.release(first).await.unwrap();
    clock.advance(RETENTION * 3);
    assert_eq!(store.reap_expired(100).await.unwrap(), 0);
    // Taken over, not replaced: the same row with the next token.
    let again = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    assert_eq!(again.key_id(), key_id);
    assert_eq!(again.token(), 2);
    clock.advance(RETENTION * 3);
    match store
        .claim::<OneStep>(request(&Owner::from(1), &k, &body))
        .await
        .unwrap()
    {
        // The lease ran out long ago: taken over once more, still the same row.
        Claim::Acquired(lease) => assert_eq!((lease.key_id(), lease.token()), (key_id, 3)),
        other => panic!("expected a takeover, got {other:?}"),
    }
}

#[testdb::test(template = crate::migrated)]
async fn without_a_retention_a_finished_key_replays_for_good(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let clock = clock();
    let store = pooled::store(&pool, Arc::new(clock.clone()), TTL);
    assert_eq!(store.retention(), None);
    let (k, body) = (key("k1"), json!({"a": 1}));
    finished_key(&store, 1, "k1", &body).await;
    clock.advance(Store::MAX_RETENTION * 2);
    replayed(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    assert!(matches!(
        store
            .claim::<OneStep>(request(&Owner::from(1), &k, &json!({"a": 2})))
            .await
            .unwrap(),
        Claim::Mismatch
    ));
    match store.reap_expired(100).await {
        Err(Error::InvalidConfig(why)) => assert!(why.contains("with_retention"), "{why}"),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[sqlx::test(migrations = false)]
async fn the_retention_is_between_an_hour_and_ten_years(pool: PgPool) {
    let store = Store::new(pool, Arc::new(clock()), TTL).unwrap();
    for refused in [
        Duration::ZERO,
        Store::MIN_RETENTION - Duration::from_millis(1),
        Store::MAX_RETENTION + Duration::from_secs(1),
    ] {
        match store.clone().with_retention(refused) {
            Err(Error::InvalidConfig(why)) => assert!(why.contains("retention"), "{why}"),
            other => panic!("{refused:?}: expected InvalidConfig, got {other:?}"),
        }
    }
    for accepted in [Store::MIN_RETENTION, RETENTION, Store::MAX_RETENTION] {
        let store = store.clone().with_retention(accepted).unwrap();
        assert_eq!(store.retention(), Some(accepted));
    }
}

#[testdb::test(template = crate::migrated)]
async fn begin_and_begin_optimistic_answer_an_expired_key_as_new(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let body = json!({"a": 1});
    let old_begin = finished_key(&store, 1, "by-begin", &body).await;
    let old_optimistic = finished_key(&store, 1, "by-optimistic", &body).await;
    clock.advance(RETENTION + Duration::from_secs(1));

    let k = key("by-begin");
    let first = match store
        .begin(request(&Owner::from(1), &k, &body), OneStep::Started)
        .await
    {
        Ok(Begun::New(first)) => first,
        other => panic!("expected a new key, got {other:?}"),
    };
    assert_ne!(first.lease().key_id(), old_begin);
    let lease = first.commit().await.unwrap();
    finish(&store, lease, "begun").await;
    assert_eq!(
        replayed(
            store
                .claim(request(&Owner::from(1), &k, &body))
                .await
                .unwrap()
        )
        .body,
        b"begun"
    );

    let k = key("by-optimistic");
    let first = match store
        .begin_optimistic(request(&Owner::from(1), &k, &body), OneStep::Started)
        .await
    {
        Ok(Begun::New(first)) => first,
        other => panic!("expected a new key, got {other:?}"),
    };
    assert_ne!(first.lease().key_id(), old_optimistic);
    first.finish(&response("optimistic")).await.unwrap();
    assert_eq!(
        replayed(
            store
                .claim(request(&Owner::from(1), &k, &body))
                .await
                .unwrap()
        )
        .body,
        b"optimistic"
    );
    for old in [old_begin, old_optimistic] {
        assert!(store.find(old).await.unwrap().is_none());
    }
    assert_eq!(store.count_unfinished().await.unwrap(), 0);
}

#[testdb::test(template = crate::migrated)]
async fn a_dropped_first_phase_of_an_expired_key_brings_the_old_row_back(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    let old = finished_key(&store, 1, "k1", &body).await;
    clock.advance(RETENTION + Duration::from_secs(1));
    for optimistic in [false, true] {
        let begun = if optimistic {
            store
                .begin_optimistic(request(&Owner::from(1), &k, &body), OneStep::Started)
                .await
        } else {
            store
                .begin(request(&Owner::from(1), &k, &body), OneStep::Started)
                .await
        };
        match begun {
            Ok(Begun::New(first)) => drop(first),
            other => panic!("expected a new key, got {other:?}"),
        }
        // As if the request had never come: the old row is back, expired still.
        let record = store.find(old).await.unwrap().expect("the old row");
        assert_eq!(record.response_status, Some(201));
        assert_eq!(rows_of(&pool, 1, "k1").await, 1);
    }
    assert_ne!(
        acquired(
            store
                .claim(request(&Owner::from(1), &k, &body))
                .await
                .unwrap()
        )
        .key_id(),
        old
    );
}

/// The boundary and the reaper: keys finished an hour apart, the clock then set so that one is
/// exactly as old as the retention. User 1's keys are reaped, user 2's (finished at the same
/// times) are claimed: the reaper deletes exactly the keys that the claims answer as new.
#[testdb::test(template = crate::migrated)]
async fn a_reaper_pass_with_the_store_retention_deletes_exactly_what_claims_expire(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let body = json!({"a": 1});
    let names = ["k0", "k1", "k2", "k3"];
    for (i, name) in names.iter().enumerate() {
        if i > 0 {
            clock.advance(HOUR);
        }
        finished_key(&store, 1, name, &body).await;
        finished_key(&store, 2, name, &body).await;
    }
    // k0 is the retention and 2 h old, k1 1 h past it, k2 exactly the retention, k3 an hour short.
    clock.advance(RETENTION - HOUR);

    let mut expired_at_read = Vec::new();
    for name in names {
        let k = key(name);
        match store
            .claim::<OneStep>(request(&Owner::from(2), &k, &body))
            .await
            .unwrap()
        {
            Claim::Acquired(lease) => {
                expired_at_read.push(name);
                finish(&store, lease, "again").await;
            }
            Claim::Replay(_) => {}
            other => panic!("{name}: unexpected {other:?}"),
        }
    }
    assert_eq!(expired_at_read, ["k0", "k1"]);

    // User 2's new keys finished just now: the reaper takes only user 1's expired ones.
    assert_eq!(store.reap_expired(100).await.unwrap(), 2);
    let mut reaped = Vec::new();
    for name in names {
        if rows_of(&pool, 1, name).await == 0 {
            reaped.push(name);
        }
    }
    assert_eq!(reaped, expired_at_read);
    assert_eq!(store.reap_expired(100).await.unwrap(), 0);
    // An hour on, k2 of both users is past the retention; the older form, given the same
    // retention, takes exactly those.
    clock.advance(HOUR);
    assert_eq!(store.reap_finished(RETENTION, 100).await.unwrap(), 2);
    assert_eq!(
        rows_of(&pool, 1, "k2").await + rows_of(&pool, 2, "k2").await,
        0
    );
    assert_eq!(
        rows_of(&pool, 1, "k3").await + rows_of(&pool, 2, "k3").await,
        2
    );
}

/// Nine claimers of one expired key at once, by `claim`, `begin` and `begin_optimistic` in turn,
/// five rounds: each round exactly one gets the new row and the others find it in flight.
#[testdb::test(template = crate::migrated)]
async fn concurrent_claims_of_an_expired_key_replace_it_exactly_once(pool: PgPool) {
    const CLAIMERS: usize = 9;
    let (store, clock) = setup(&pool).await;
    let body = json!({"a": 1});
    let mut previous = finished_key(&store, 1, "same", &body).await;
    for round in 0..5 {
        clock.advance(RETENTION + Duration::from_secs(1));
        let barrier = Arc::new(tokio::sync::Barrier::new(CLAIMERS));
        let mut tasks = Vec::new();
        for i in 0..CLAIMERS {
            let (store, barrier, body) = (store.clone(), barrier.clone(), body.clone());
            tasks.push(tokio::spawn(async move {
                let (k, owner) = (key("same"), Owner::from(1));
                barrier.wait().await;
                let req = request(&owner, &k, &body);
                let begun = match i % 3 {
                    0 => return store.claim::<OneStep>(req).await.unwrap(),
                    1 => store.begin(req, OneStep::Started).await.unwrap(),
                    _ => store.begin_optimistic(req, OneStep::Started).await.unwrap(),
                };
                match begun {
                    Begun::New(first) => Claim::Acquired(first.commit().await.unwrap()),
                    Begun::Existing(claim) => claim,
                }
            }));
        }
        let mut winners = Vec::new();
        for task in tasks {
            match task.await.unwrap() {
                Claim::Acquired(lease) => winners.push(lease),
                Claim::InFlight { .. } => {}
                other => panic!("round {round}: unexpected {other:?}"),
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: one winner");
        let winner = winners.pop().unwrap();
        assert_ne!(winner.key_id(), previous, "round {round}: a new row");
        assert_eq!(winner.token(), 1);
        assert_eq!(rows_of(&pool, 1, "same").await, 1);
        assert!(store.find(previous).await.unwrap().is_none());
        previous = winner.key_id();
        finish(&store, winner, "done").await;
    }
    assert_eq!(store.count_unfinished().await.unwrap(), 0);
}

#[testdb::test(template = crate::migrated)]
async fn a_claim_during_an_expiry_in_progress_waits_and_then_finds_the_new_key(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    let (k, body) = (key("k1"), json!({"a": 1}));
    finished_key(&store, 1, "k1", &body).await;
    clock.advance(RETENTION + Duration::from_secs(1));
    let first = match store
        .begin(request(&Owner::from(1), &k, &body), OneStep::Started)
        .await
    {
        Ok(Begun::New(first)) => first,
        other => panic!("expected a new key, got {other:?}"),
    };

    // A claimer that waits at most 100 ms for a row lock: in flight, uncommitted.
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
    let impatient = Store::new(impatient_pool, Arc::new(clock.clone()), TTL)
        .unwrap()
        .with_retention(RETENTION)
        .unwrap();
    match impatient
        .claim::<OneStep>(request(&Owner::from(1), &k, &body))
        .await
        .unwrap()
    {
        Claim::InFlight { retry_after } => assert_eq!(retry_after, Duration::from_secs(1)),
        other => panic!("expected InFlight, got {other:?}"),
    }

    // A patient one waits on the old row's delete, then reads the new row, held.
    let waiting = tokio::spawn({
        let (store, body) = (store.clone(), body.clone());
        async move {
            let k = key("k1");
            store
                .claim::<OneStep>(request(&Owner::from(1), &k, &body))
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
    let lease = first.commit().await.unwrap();
    match waiting.await.unwrap() {
        Claim::InFlight { retry_after } => assert_eq!(retry_after, TTL),
        other => panic!("expected InFlight, got {other:?}"),
    }
    finish(&store, lease, "new").await;
    assert_eq!(
        replayed(
            store
                .claim(request(&Owner::from(1), &k, &body))
                .await
                .unwrap()
        )
        .body,
        b"new"
    );
}

/// A key the reaper may not delete (a row references it under RESTRICT) is kept and named, and
/// the others of its owner's batch are reaped all the same: the pass does not fail, and the
/// next pass is not stuck behind it.
#[testdb::test(template = crate::migrated)]
async fn the_reaper_keeps_a_key_referenced_under_restrict_and_reaps_the_rest(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    sqlx::query(
        "CREATE TABLE receipts (
             owner  TEXT   NOT NULL,
             key_id BIGINT NOT NULL,
             FOREIGN KEY (owner, key_id) REFERENCES idempotency_keys (owner, id)
                 ON DELETE RESTRICT
         )",
    )
    .execute(&pool)
    .await
    .unwrap();
    let body = json!({"a": 1});
    let mut ids = Vec::new();
    for name in ["kept", "a", "b"] {
        ids.push(finished_key(&store, 1, name, &body).await);
    }
    sqlx::query("INSERT INTO receipts (owner, key_id) VALUES ('1', $1)")
        .bind(ids[0])
        .execute(&pool)
        .await
        .unwrap();
    clock.advance(RETENTION + Duration::from_secs(1));
    assert_eq!(store.reap_finished(RETENTION, 100).await.unwrap(), 2);
    assert_eq!(rows_of(&pool, 1, "kept").await, 1);
    assert_eq!(
        rows_of(&pool, 1, "a").await + rows_of(&pool, 1, "b").await,
        0
    );
    // Again: only the kept key is left, and the pass still succeeds.
    assert_eq!(store.reap_finished(RETENTION, 100).await.unwrap(), 0);
}

#[testdb::test(template = crate::migrated)]
async fn an_expired_key_still_referenced_under_restrict_is_refused_and_kept(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    sqlx::query(
        "CREATE TABLE receipts (
             owner  TEXT   NOT NULL,
             key_id BIGINT NOT NULL,
             FOREIGN KEY (owner, key_id) REFERENCES idempotency_keys (owner, id)
                 ON DELETE RESTRICT
         )",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (k, body) = (key("k1"), json!({"a": 1}));
    let mut lease = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    let old = lease.key_id();
    let mut phase = store.final_phase(&mut lease).await.unwrap();
    sqlx::query("INSERT INTO receipts (owner, key_id) VALUES ($1, $2)")
        .bind("1")
        .bind(old)
        .persistent(false)
        .execute(phase.conn())
        .await
        .unwrap();
    phase.finish(&response("first")).await.unwrap();
    clock.advance(RETENTION + Duration::from_secs(1));

    let refused = |result: Result<Claim<OneStep>, Error>, how: &str| match result {
        Err(Error::Database { context, source }) => {
            assert!(context.contains("ON DELETE SET NULL"), "{how}: {context}");
            assert!(context.contains("\"k1\""), "{how} names the key: {context}");
            match source {
                sqlx::Error::Database(e) => assert_eq!(e.code().as_deref(), Some("23503")),
                other => panic!("{how}: expected a database error, got {other:?}"),
            }
        }
        other => panic!("{how}: expected the expiry refused, got {other:?}"),
    };
    refused(
        store.claim(request(&Owner::from(1), &k, &body)).await,
        "claim",
    );
    let begun = |b: Result<Begun<OneStep>, Error>| match b {
        Ok(Begun::New(_)) => panic!("a new key despite the reference"),
        Ok(Begun::Existing(claim)) => Ok(claim),
        Err(e) => Err(e),
    };
    refused(
        begun(
            store
                .begin(request(&Owner::from(1), &k, &body), OneStep::Started)
                .await,
        ),
        "begin",
    );
    refused(
        begun(
            store
                .begin_optimistic(request(&Owner::from(1), &k, &body), OneStep::Started)
                .await,
        ),
        "begin_optimistic",
    );
    // Nothing changed.
    assert!(store.find(old).await.unwrap().is_some());
    assert_eq!(rows_of(&pool, 1, "k1").await, 1);
    assert_eq!(store.count_unfinished().await.unwrap(), 0);

    // Once the reference is gone, the key expires.
    sqlx::query("DELETE FROM receipts")
        .execute(&pool)
        .await
        .unwrap();
    assert_ne!(
        acquired(
            store
                .claim(request(&Owner::from(1), &k, &body))
                .await
                .unwrap()
        )
        .key_id(),
        old
    );
}

#[testdb::test(template = crate::migrated)]
async fn an_expired_key_referenced_under_set_null_expires_and_its_rows_stay(pool: PgPool) {
    let (store, clock) = setup(&pool).await;
    sqlx::query(
        "CREATE TABLE rides (
             id     BIGSERIAL PRIMARY KEY,
             owner  TEXT   NOT NULL,
             key_id BIGINT UNIQUE,
             FOREIGN KEY (owner, key_id) REFERENCES idempotency_keys (owner, id)
                 ON DELETE SET NULL (key_id)
         )",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (k, body) = (key("k1"), json!({"a": 1}));
    let mut lease = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    let mut phase = store.final_phase(&mut lease).await.unwrap();
    sqlx::query("INSERT INTO rides (owner, key_id) VALUES ($1, $2)")
        .bind("1")
        .bind(phase.key_id())
        .persistent(false)
        .execute(phase.conn())
        .await
        .unwrap();
    phase.finish(&response("first")).await.unwrap();
    clock.advance(RETENTION + Duration::from_secs(1));

    let second = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    let key_ids: Vec<Option<i64>> = sqlx::query_scalar("SELECT key_id FROM rides ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(key_ids, [None], "the ride stays, its reference cleared");
    // The new request may book its own ride under its own key id.
    sqlx::query("INSERT INTO rides (owner, key_id) VALUES ($1, $2)")
        .bind("1")
        .bind(second.key_id())
        .execute(&pool)
        .await
        .unwrap();
}
