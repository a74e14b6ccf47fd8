//! `POST /bench/rides`, compiled only with the `bench` feature: the benchmark's baseline.
//!
//! The same booking as `POST /rides`, with the same rows: the ride and its audit record in one
//! transaction, the gateway charge, then the charge on the ride, its audit record and the
//! receipt job in a second transaction, and the same 201. What it leaves out is everything that
//! makes the booking safe to retry: no key is claimed, no recovery point, no stored response,
//! and the gateway is called without an idempotency key. A retry books and charges again; a
//! crash between the two transactions leaves an unpaid ride that nothing resumes. It exists so
//! that the benchmark can say what the protection costs.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;

use crate::auth::AuthUser;
use crate::booking::{self, BookingError};
use crate::problem::ApiError;
use crate::ride::{BodyError, RideRequest};
use crate::state::AppState;
use crate::stripe::NewCharge;

/// `POST /bench/rides`.
pub async fn create(
    State(state): State<AppState>,
    user: AuthUser,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (request, _) = RideRequest::parse(&body).map_err(|e| match e {
        BodyError::NotJson(why) => ApiError::BadJson(why),
        BodyError::Invalid(errors) => ApiError::Validation(errors),
    })?;
    let internal = |e: BookingError| ApiError::Internal(e.to_string());
    let database = |e: sqlx::Error| ApiError::Internal(e.to_string());

    let mut tx = state.pool.begin().await.map_err(database)?;
    let mut pg = state.store.statements_on(&mut *tx);
    let (ride_id, _) = booking::insert_ride(&mut pg, &state, user.id, None, &request)
        .await
        .map_err(internal)?;
    tx.commit().await.map_err(database)?;

    let description = format!("Rocket Rides ride {ride_id}");
    let metadata = [("ride_id", ride_id.to_string())];
    let charge = state
        .stripe
        .create_charge_without_key(&NewCharge {
            amount_cents: i64::from(request.amount_cents),
            customer: &user.customer,
            description: &description,
            metadata: &metadata,
        })
        .await
        .map_err(|e| ApiError::GatewayUnavailable(e.to_string()))?;

    let mut tx = state.pool.begin().await.map_err(database)?;
    let mut pg = state.store.statements_on(&mut *tx);
    let ride = booking::charge_paid(&mut pg, user.id, ride_id, &charge.id, false)
        .await
        .map_err(internal)?;
    tx.commit().await.map_err(database)?;
    let response = booking::created(&ride).map_err(internal)?;
    Ok(idempotency_axum::stored_response(&response))
}
