//! A final phase that owns its lease (handed to another task, as a transactional handler is),
//! and the abandon that falls back to a release when the application's rows hold the key.

use std::sync::Arc;
use std::time::Duration;

use idempotency::{
    Abandoned, Claim, DatabaseClock, Error, Fingerprint, IdempotencyKey, Lease, NewRequest,
    OneStep, Owner, Store, StoredResponse,
};
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::pooled;

async fn store(pool: &PgPool) -> Store {
    idempotency::migrate(pool).await.unwrap();
    sqlx::query(
        "CREATE TABLE deposits (key_id BIGINT REFERENCES idempotency_keys (id), cents BIGINT)",
    )
    .execute(pool)
    .await
    .unwrap();
    pooled::store(pool, Arc::new(DatabaseClock), Duration::from_secs(30))
}

/// A string owner, as a tenant's name or an account id would be.
static OWNER: std::sync::LazyLock<Owner> =
    std::sync::LazyLock::new(|| Owner::new("tenant-3").unwrap());

fn request<'a>(key: &'a IdempotencyKey, body: &'a Value) -> NewRequest<'a> {
    NewRequest {
        owner: &OWNER,
        method: "POST",
        route: "/deposits",
        key,
        fingerprint: Fingerprint::of_json("POST", "/deposits", body),
        params: body,
    }
}

async fn claim(store: &Store, key: &str) -> Claim<OneStep> {
    let key = IdempotencyKey::parse(key.as_bytes()).unwrap();
    store
        .claim::<OneStep>(request(&key, &json!({"cents": 500})))
        .await
        .unwrap()
}

async fn acquire(store: &Store, key: &str) -> Lease<OneStep> {
    match claim(store, key).await {
        Claim::Acquired(lease) => lease,
        other => panic!("expected an acquired lease, got {other:?}"),
    }
}

async fn deposits(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM deposits")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[testdb::test(template = crate::migrated)]
async fn an_owned_final_phase_commits_its_writes_with_the_answer_from_another_task(pool: PgPool) {
    let store = store(&pool).await;
    let lease = acquire(&store, "deposit").await;
    let mut phase = store.final_phase_owned(lease).await.unwrap();
    let key_id = phase.lease().key_id();
    // Another task writes through the phase's transaction and hands it back.
    let phase = tokio::spawn(async move {
        sqlx::query("INSERT INTO deposits VALUES ($1, 500)")
            .bind(key_id)
            .persistent(false)
            .execute(&mut *phase.conn())
            .await
            .unwrap();
        phase
    })
    .await
    .unwrap();
    assert_eq!(
        deposits(&pool).await,
        0,
        "nothing is visible before the commit"
    );
    let answer = StoredResponse::json(201, &json!({"deposited": 500}), vec![]);
    phase.finish(&answer).await.map_err(|(e, _)| e).unwrap();
    assert_eq!(deposits(&pool).await, 1);
    assert!(matches!(claim(&store, "deposit").await, Claim::Replay(r) if r == answer));
}

#[testdb::test(template = crate::migrated)]
async fn a_rolled_back_final_phase_leaves_no_write_and_its_lease_can_be_released(pool: PgPool) {
    let store = store(&pool).await;
    let lease = acquire(&store, "undone").await;
    let mut phase = store.final_phase_owned(lease).await.unwrap();
    let key_id = phase.lease().key_id();
    sqlx::query("INSERT INTO deposits VALUES ($1, 500)")
        .bind(key_id)
        .persistent(false)
        .execute(&mut *phase.conn())
        .await
        .unwrap();
    let lease = phase.roll_back().await;
    store.release(lease).await.unwrap();
    assert_eq!(deposits(&pool).await, 0);
    // The key is free at once, at its recovery point, for the retry.
    assert!(matches!(claim(&store, "undone").await, Claim::Acquired(_)));
}

#[testdb::test(template = crate::migrated)]
async fn a_dropped_final_phase_rolls_back_as_a_crash_would(pool: PgPool) {
    let store = store(&pool).await;
    let lease = acquire(&store, "crashed").await;
    let mut phase = store.final_phase_owned(lease).await.unwrap();
    let key_id = phase.lease().key_id();
    sqlx::query("INSERT INTO deposits VALUES ($1, 500)")
        .bind(key_id)
        .persistent(false)
        .execute(&mut *phase.conn())
        .await
        .unwrap();
    drop(phase);
    assert_eq!(deposits(&pool).await, 0);
    // The lease is still held (until it expires): a retry is told to wait, not run twice.
    assert!(matches!(
        claim(&store, "crashed").await,
        Claim::InFlight { .. }
    ));
}

#[testdb::test(template = crate::migrated)]
async fn an_owned_final_phase_of_a_lost_lease_gives_the_lease_back(pool: PgPool) {
    let store = store(&pool).await;
    let lease = acquire(&store, "lost").await;
    // Another holder took the key over meanwhile.
    sqlx::query("UPDATE idempotency_keys SET lease_token = lease_token + 1")
        .execute(&pool)
        .await
        .unwrap();
    let (error, lease) = store.final_phase_owned(lease).await.unwrap_err();
    assert!(matches!(error, Error::LeaseLost { .. }), "{error}");
    assert!(matches!(
        store.release(lease).await,
        Err(Error::LeaseLost { .. })
    ));
}

#[testdb::test(template = crate::migrated)]
async fn abandon_or_release_deletes_a_free_key_and_releases_a_referenced_one(pool: PgPool) {
    let store = store(&pool).await;
    let lease = acquire(&store, "free").await;
    assert_eq!(
        store.abandon_or_release(lease).await.unwrap(),
        Abandoned::Deleted
    );
    let keys: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(keys, 0);

    let lease = acquire(&store, "held").await;
    sqlx::query("INSERT INTO deposits VALUES ($1, 500)")
        .bind(lease.key_id())
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        store.abandon_or_release(lease).await.unwrap(),
        Abandoned::Released
    );
    // Released: the next claim acquires it at once instead of waiting out the lease.
    assert!(matches!(claim(&store, "held").await, Claim::Acquired(_)));
}
