//! The statements the phases share: the ride with its audit record, a paid charge with its
//! audit record and receipt job, a receipt job alone, an audit record. `POST /bench/rides`
//! writes the same rows with the first two.
//!
//! Each statement is unnamed when the key store's are (`persistent`, [`idempotency::Store::persistent`]):
//! behind a pooler in transaction mode, a named prepared statement would be missing, or another
//! client's, on the server connection the next transaction gets.

use idempotency::BindTime;
use sqlx::PgConnection;
use time::OffsetDateTime;

use super::error::{db, BookingError};
use crate::ride::{RideRequest, RideView, RIDE_COLUMNS};
use crate::state::AppState;

/// The ride row, unpaid, and its audit record, in one statement; returns the ride's id and
/// creation time.
pub(crate) async fn insert_ride(
    conn: &mut PgConnection,
    state: &AppState,
    user_id: i64,
    key_id: Option<i64>,
    request: &RideRequest,
) -> Result<(i64, OffsetDateTime), BookingError> {
    let timed = state.store.timed(
        r#"
        WITH ride AS (
            INSERT INTO rides (user_id, key_owner, idempotency_key_id, origin_lat, origin_lon,
                               target_lat, target_lon, amount_cents, charge_first_attempt_at,
                               charge_generation_at, charge_attempted_at)
            VALUES ($1, $1::text, $2, $3, $4, $5, $6, $7, $now,
                    $now, $now)
            RETURNING id, charge_first_attempt_at
        ), audited AS (
            INSERT INTO audit_records (user_id, action, resource_type, resource_id, data)
            SELECT $1, 'ride.created', 'ride', id, jsonb_build_object('idempotency_key_id', $2)
            FROM ride
        )
        SELECT id, charge_first_attempt_at FROM ride
        "#,
    );
    sqlx::query_as(timed.sql())
        .bind(user_id)
        .bind(key_id)
        .bind(request.origin_lat)
        .bind(request.origin_lon)
        .bind(request.target_lat)
        .bind(request.target_lon)
        .bind(request.amount_cents)
        .bind_now(&timed)
        .persistent(state.store.persistent())
        .fetch_one(conn)
        .await
        .map_err(db("insert ride"))
}

/// The gateway's customer of `user_id`, read in the transaction that creates the ride: what the
/// charge that follows in the same run asks the gateway to charge.
pub(crate) async fn customer(
    conn: &mut PgConnection,
    state: &AppState,
    user_id: i64,
) -> Result<String, BookingError> {
    sqlx::query_scalar("SELECT stripe_customer_id FROM users WHERE id = $1")
        .bind(user_id)
        .persistent(state.store.persistent())
        .fetch_one(conn)
        .await
        .map_err(db("read the rider's customer"))
}

/// A paid charge on its ride, its audit record and the ride's receipt job, in one statement;
/// returns the ride as it is now.
pub(crate) async fn charge_paid(
    conn: &mut PgConnection,
    persistent: bool,
    user_id: i64,
    ride_id: i64,
    charge_id: &str,
    adopted: bool,
) -> Result<RideView, BookingError> {
    sqlx::query_as(&format!(
        r#"
        WITH ride AS (
            UPDATE rides SET charge_id = $3, status = 'paid',
                             charge_doubt = NULL, charge_refusal = NULL, updated_at = now()
            WHERE user_id = $1 AND id = $2
            RETURNING {RIDE_COLUMNS}
        ), audited AS (
            INSERT INTO audit_records (user_id, action, resource_type, resource_id, data)
            SELECT $1, 'ride.charged', 'ride', id,
                   jsonb_build_object('charge_id', $3::text, 'adopted', $4::boolean)
            FROM ride
        ), receipt AS (
            INSERT INTO staged_jobs (user_id, job_name, job_args)
            SELECT $1, 'send_ride_receipt', jsonb_build_object('ride_id', id) FROM ride
        )
        SELECT {RIDE_COLUMNS} FROM ride
        "#
    ))
    .bind(user_id)
    .bind(ride_id)
    .bind(charge_id)
    .bind(adopted)
    .persistent(persistent)
    .fetch_optional(conn)
    .await
    .map_err(db("record charge"))?
    .ok_or_else(|| BookingError::Internal(format!("no ride {ride_id} to record a charge on")))
}

/// The receipt job of a ride whose charge an earlier version recorded.
pub(super) async fn stage_receipt(
    conn: &mut PgConnection,
    persistent: bool,
    user_id: i64,
    ride_id: i64,
) -> Result<(), BookingError> {
    sqlx::query(
        "INSERT INTO staged_jobs (user_id, job_name, job_args)
         VALUES ($1, 'send_ride_receipt', jsonb_build_object('ride_id', $2::bigint))",
    )
    .bind(user_id)
    .bind(ride_id)
    .persistent(persistent)
    .execute(conn)
    .await
    .map_err(db("stage receipt job"))?;
    Ok(())
}

pub(super) async fn audit(
    conn: &mut PgConnection,
    persistent: bool,
    user_id: i64,
    action: &str,
    ride_id: i64,
    data: serde_json::Value,
) -> Result<(), BookingError> {
    sqlx::query(
        "INSERT INTO audit_records (user_id, action, resource_type, resource_id, data)
         VALUES ($1, $2, 'ride', $3, $4)",
    )
    .bind(user_id)
    .bind(action)
    .bind(ride_id)
    .bind(data)
    .persistent(persistent)
    .execute(conn)
    .await
    .map_err(db("write audit record"))?;
    Ok(())
}
