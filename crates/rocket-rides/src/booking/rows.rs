//! The statements the phases share: the ride with its audit record, a paid charge with its
//! audit record and receipt job, a receipt job alone, an audit record. Each statement writes one
//! table: on Citus, a statement with two inserts is pulled through the coordinator and reaches
//! every worker (docs/scaling.md). `POST /bench/rides`
//! writes the same rows with the first two.
//!
//! Each statement is sent through the caller's [`Pg`], unnamed when the key store's are: behind
//! a pooler in transaction mode, a named prepared statement would be missing, or another
//! client's, on the server connection the next transaction gets.

use idempotency::BindTime;
use time::OffsetDateTime;

use super::error::{db, BookingError};
use crate::db::Pg;
use crate::ride::{RideRequest, RideView, RIDE_COLUMNS};
use crate::state::AppState;

/// The ride row, unpaid, and its audit record, two statements in the caller's transaction
/// (one each: on Citus, two inserts in one statement go through the coordinator to every
/// worker; docs/scaling.md); returns the ride's id and creation time.
pub(crate) async fn insert_ride(
    pg: &mut Pg<'_>,
    state: &AppState,
    user_id: i64,
    key_id: Option<i64>,
    request: &RideRequest,
) -> Result<(i64, OffsetDateTime), BookingError> {
    let timed = state.store.timed(
        r#"
        INSERT INTO rides (user_id, key_owner, idempotency_key_id, origin_lat, origin_lon,
                           target_lat, target_lon, amount_cents, charge_first_attempt_at,
                           charge_generation_at, charge_attempted_at)
        VALUES ($1, $1::text, $2, $3, $4, $5, $6, $7, $now,
                $now, $now)
        RETURNING id, charge_first_attempt_at
        "#,
    );
    let (ride_id, created_at): (i64, OffsetDateTime) = sqlx::query_as(timed.sql())
        .bind(user_id)
        .bind(key_id)
        .bind(request.origin_lat)
        .bind(request.origin_lon)
        .bind(request.target_lat)
        .bind(request.target_lon)
        .bind(request.amount_cents)
        .bind_now(&timed)
        .fetch_one(&mut *pg)
        .await
        .map_err(db("insert ride"))?;
    let data = serde_json::json!({ "idempotency_key_id": key_id });
    audit(pg, user_id, "ride.created", ride_id, data).await?;
    Ok((ride_id, created_at))
}

/// The gateway's customer of `user_id`, read in the transaction that creates the ride: what the
/// charge that follows in the same run asks the gateway to charge.
pub(crate) async fn customer(pg: &mut Pg<'_>, user_id: i64) -> Result<String, BookingError> {
    sqlx::query_scalar("SELECT stripe_customer_id FROM users WHERE id = $1")
        .bind(user_id)
        .fetch_one(pg)
        .await
        .map_err(db("read the rider's customer"))
}

/// A paid charge on its ride, its audit record and the ride's receipt job, one statement each
/// in the caller's transaction (see [`insert_ride`]); returns the ride as it is now.
pub(crate) async fn charge_paid(
    pg: &mut Pg<'_>,
    user_id: i64,
    ride_id: i64,
    charge_id: &str,
    adopted: bool,
) -> Result<RideView, BookingError> {
    let ride: RideView = sqlx::query_as(&format!(
        "UPDATE rides SET charge_id = $3, status = 'paid',
                          charge_doubt = NULL, charge_refusal = NULL, updated_at = now()
         WHERE user_id = $1 AND key_owner = $1::text AND id = $2
         RETURNING {RIDE_COLUMNS}"
    ))
    .bind(user_id)
    .bind(ride_id)
    .bind(charge_id)
    .fetch_optional(&mut *pg)
    .await
    .map_err(db("record charge"))?
    .ok_or_else(|| BookingError::Internal(format!("no ride {ride_id} to record a charge on")))?;
    let data = serde_json::json!({ "charge_id": charge_id, "adopted": adopted });
    audit(pg, user_id, "ride.charged", ride_id, data).await?;
    stage_receipt(pg, user_id, ride_id).await?;
    Ok(ride)
}

/// The receipt job of a ride whose charge an earlier version recorded.
pub(crate) async fn stage_receipt(
    pg: &mut Pg<'_>,
    user_id: i64,
    ride_id: i64,
) -> Result<(), BookingError> {
    sqlx::query(
        "INSERT INTO staged_jobs (user_id, key_owner, job_name, job_args)
         VALUES ($1, $1::text, 'send_ride_receipt', jsonb_build_object('ride_id', $2::bigint))",
    )
    .bind(user_id)
    .bind(ride_id)
    .execute(pg)
    .await
    .map_err(db("stage receipt job"))?;
    Ok(())
}

/// An audit record of the ride `ride_id`.
pub(crate) async fn audit(
    pg: &mut Pg<'_>,
    user_id: i64,
    action: &str,
    ride_id: i64,
    data: serde_json::Value,
) -> Result<(), BookingError> {
    sqlx::query(
        "INSERT INTO audit_records (user_id, key_owner, action, resource_type, resource_id, data)
         VALUES ($1, $1::text, $2, 'ride', $3, $4)",
    )
    .bind(user_id)
    .bind(action)
    .bind(ride_id)
    .bind(data)
    .execute(pg)
    .await
    .map_err(db("write audit record"))?;
    Ok(())
}
