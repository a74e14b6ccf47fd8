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
