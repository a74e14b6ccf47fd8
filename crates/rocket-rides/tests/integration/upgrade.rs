//! A database of the service as it stood before the key's owner became text, with a paid ride
//! on a finished key, upgraded in place by `rocket-rides migrate`.

use sqlx::PgPool;

use crate::common;

/// The last version of each side before the change: the crate's migration that turned the owner
/// into text, and the service's that released the ride's reference for it.
const CRATE_OWNER_TEXT: i64 = 20261202000001;
const SERVICE_RELEASE: i64 = 20261201900001;

#[sqlx::test(migrations = false)]
async fn a_database_from_before_the_text_owner_upgrades_in_place_with_its_rides(pool: PgPool) {
    common::earlier_database_with_a_paid_ride(&pool, CRATE_OWNER_TEXT, SERVICE_RELEASE).await;

    rocket_rides::db::migrate(&pool).await.unwrap();

    let (owner, key_owner): (String, String) = sqlx::query_as(
        "SELECT k.owner, r.key_owner FROM rides r
         JOIN idempotency_keys k ON k.owner = r.key_owner AND k.id = r.idempotency_key_id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((owner.as_str(), key_owner.as_str()), ("7", "7"));
    // The reference is back and checks the owner: a ride cannot name a key of another user.
    sqlx::query("INSERT INTO users (id, email, api_key_hash, stripe_customer_id) VALUES (8, 'b@example.com', decode(repeat('08', 32), 'hex'), 'cus_8')")
        .execute(&pool)
        .await
        .unwrap();
    let refused = sqlx::query(
        "INSERT INTO rides (user_id, key_owner, idempotency_key_id, origin_lat, origin_lon,
                            target_lat, target_lon, amount_cents)
         VALUES (8, '8', 70, 0, 0, 0, 0, 100)",
    )
    .execute(&pool)
    .await
    .unwrap_err();
    assert_eq!(
        refused.as_database_error().and_then(|e| e.constraint()),
        Some("rides_idempotency_key_fkey"),
        "{refused}"
    );
    // Reaping the key keeps the ride and its owner, and clears only the reference.
    sqlx::query("DELETE FROM idempotency_keys WHERE id = 70")
        .execute(&pool)
        .await
        .unwrap();
    let left: (Option<i64>, String) =
        sqlx::query_as("SELECT idempotency_key_id, key_owner FROM rides WHERE user_id = 7")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(left, (None, "7".to_owned()));
    // And again: nothing to do.
    rocket_rides::db::migrate(&pool).await.unwrap();
}

/// The first version of the service that references its keys by their text owner: its plan
/// (`src/db/online.rs`, `key_owner_text`) adds `rides.key_owner` and the reference by it.
const SERVICE_KEY_OWNER: i64 = 20261202100001;

/// A reaper of the running version deleted a finished key while the rides' reference to their key
/// was down (released by 20261201900001, added again by the plan of 20261202100001): its ride still
/// names it. The plan finishes, the first time and again, and the ride keeps everything but the
/// id of a key that no longer exists.
///
/// Without the fix (the backfill filled `key_owner` alone and the reaped keys were forgotten
/// only after it) both runs failed at the backfill, "step 2 of 9: … violates foreign key
/// constraint \"rides_idempotency_key_fkey\"".
#[sqlx::test(migrations = false)]
async fn the_key_owner_plan_finishes_over_a_ride_whose_key_was_reaped_while_unreferenced(
    pool: PgPool,
) {
    common::earlier_database_with_a_paid_ride(&pool, CRATE_OWNER_TEXT, SERVICE_RELEASE).await;
    // The schema just before the plan: the service's release of the reference, then the crate's
    // text owner.
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for side in ["rocket-rides", "idempotency"] {
        let migrations = crates.join(side).join("migrations");
        common::run_below(&pool, &migrations, SERVICE_KEY_OWNER).await;
    }
    let applied: Vec<i64> = sqlx::query_scalar(
        "SELECT version FROM _sqlx_migrations WHERE version >= 20261201900001 ORDER BY version",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        applied,
        [20261201900001, CRATE_OWNER_TEXT],
        "just before the plan"
    );
    sqlx::query("DELETE FROM idempotency_keys WHERE id = 70")
        .execute(&pool)
        .await
        .unwrap();

    migrate_twice_and_find_the_ride_without_its_key(&pool).await;
}

/// The same for the plan of 20261130100002, which adds the reference by user again: the crate's
/// 20261130000002 dropped the reference by id (its primary key's `CASCADE`), and a key reaped
/// before the plan leaves its ride naming it. The plan forgets such keys before it validates
/// the reference, and nothing between its re-adding the reference and that step updates the
/// rides' key columns: it finishes.
#[sqlx::test(migrations = false)]
async fn the_user_in_every_key_plan_finishes_over_a_ride_whose_key_was_reaped_while_unreferenced(
    pool: PgPool,
) {
    const USER_IN_EVERY_KEY: i64 = 20261130100002;
    const FIRST_RELEASE: i64 = 20261130000000;
    common::earlier_database_with_a_paid_ride(&pool, FIRST_RELEASE, FIRST_RELEASE).await;
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for side in ["idempotency", "rocket-rides"] {
        let migrations = crates.join(side).join("migrations");
        common::run_below(&pool, &migrations, USER_IN_EVERY_KEY).await;
    }
    let references: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_constraint
         WHERE contype = 'f' AND confrelid = 'idempotency_keys'::regclass",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(references, 0, "the reference is down just before the plan");
    sqlx::query("DELETE FROM idempotency_keys WHERE id = 70")
        .execute(&pool)
        .await
        .unwrap();
    migrate_twice_and_find_the_ride_without_its_key(&pool).await;
}

/// `rocket-rides migrate` twice, each to succeed; then user 7's paid ride, which names no key,
/// and the rides' reference to their key, validated.
async fn migrate_twice_and_find_the_ride_without_its_key(pool: &PgPool) {
    for run in ["first", "second"] {
        if let Err(e) = rocket_rides::db::migrate(pool).await {
            panic!("the {run} migration failed: {e:#}");
        }
    }
    let ride: (String, Option<i64>, String, String) = sqlx::query_as(
        "SELECT key_owner, idempotency_key_id, status, charge_id FROM rides WHERE user_id = 7",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(ride, ("7".into(), None, "paid".into(), "ch_1".into()));
    let validated: bool = sqlx::query_scalar(
        "SELECT convalidated FROM pg_constraint WHERE conname = 'rides_idempotency_key_fkey'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert!(validated, "the reference by owner is validated");
}
