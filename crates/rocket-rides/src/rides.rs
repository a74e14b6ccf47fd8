//! The ride resource: request validation, the stored view, and the HTTP handlers.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use idempotency::{Claim, Fingerprint, Lease, NewRequest};
use idempotency_axum::{acquired_or_respond, stored_response, RequiredKey};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use sqlx::PgExecutor;
use time::OffsetDateTime;

use crate::app::AppState;
use crate::auth::AuthUser;
use crate::booking::{self, BookingError, RidePoint};
use crate::metrics::ClaimOutcome;
use crate::problem::ApiError;

/// The route template of `POST /rides`, part of every key's scope and fingerprint.
pub const RIDES_ROUTE: &str = "/rides";

/// Cheapest ride, in cents (Stripe's minimum charge in USD).
pub const MIN_AMOUNT_CENTS: i64 = 50;
/// Dearest ride, in cents.
pub const MAX_AMOUNT_CENTS: i64 = 1_000_000;

/// A validated `POST /rides` body; also the parameters stored with the key for the completer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RideRequest {
    /// Pick-up latitude, degrees.
    pub origin_lat: f64,
    /// Pick-up longitude, degrees.
    pub origin_lon: f64,
    /// Drop-off latitude, degrees.
    pub target_lat: f64,
    /// Drop-off longitude, degrees.
    pub target_lon: f64,
    /// Price, in cents.
    pub amount_cents: i32,
}

/// One failing field of a request body.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FieldError {
    /// The member name.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

impl RideRequest {
    /// Validates a parsed JSON body, reporting every failing field at once.
    pub fn validate(body: &Value) -> Result<Self, Vec<FieldError>> {
        let Some(object) = body.as_object() else {
            return Err(vec![FieldError {
                field: String::new(),
                message: "the body must be a JSON object".into(),
            }]);
        };
        let mut errors = Vec::new();
        let origin_lat = coordinate(object, "origin_lat", 90.0, &mut errors);
        let origin_lon = coordinate(object, "origin_lon", 180.0, &mut errors);
        let target_lat = coordinate(object, "target_lat", 90.0, &mut errors);
        let target_lon = coordinate(object, "target_lon", 180.0, &mut errors);
        let amount_cents = amount(object, &mut errors);
        for name in object.keys() {
            if !KNOWN_FIELDS.contains(&name.as_str()) {
                errors.push(FieldError {
                    field: name.clone(),
                    message: "unknown field".into(),
                });
            }
        }
        match (origin_lat, origin_lon, target_lat, target_lon, amount_cents) {
            (
                Some(origin_lat),
                Some(origin_lon),
                Some(target_lat),
                Some(target_lon),
                Some(amount),
            ) if errors.is_empty() => Ok(Self {
                origin_lat,
                origin_lon,
                target_lat,
                target_lon,
                amount_cents: amount,
            }),
            _ => Err(errors),
        }
    }
}

const KNOWN_FIELDS: [&str; 5] = [
    "origin_lat",
    "origin_lon",
    "target_lat",
    "target_lon",
    "amount_cents",
];

fn coordinate(
    object: &Map<String, Value>,
    name: &str,
    bound: f64,
    errors: &mut Vec<FieldError>,
) -> Option<f64> {
    let fail = |errors: &mut Vec<FieldError>, message: String| {
        errors.push(FieldError {
            field: name.to_owned(),
            message,
        });
        None
    };
    match object.get(name) {
        None => fail(errors, "is required".into()),
        Some(value) => match value.as_f64() {
            Some(v) if (-bound..=bound).contains(&v) => Some(v),
            Some(_) => fail(errors, format!("must be between -{bound} and {bound}")),
            None => fail(errors, "must be a number".into()),
        },
    }
}

fn amount(object: &Map<String, Value>, errors: &mut Vec<FieldError>) -> Option<i32> {
    let fail = |errors: &mut Vec<FieldError>, message: String| {
        errors.push(FieldError {
            field: "amount_cents".into(),
            message,
        });
        None
    };
    let range = format!("must be an integer between {MIN_AMOUNT_CENTS} and {MAX_AMOUNT_CENTS}");
    match object.get("amount_cents") {
        None => fail(errors, "is required".into()),
        // `2000.0` is the same JSON number as `2000` (and has the same fingerprint).
        Some(value) => match value.as_f64() {
            Some(v)
                if v.fract() == 0.0
                    && (MIN_AMOUNT_CENTS as f64..=MAX_AMOUNT_CENTS as f64).contains(&v) =>
            {
                Some(v as i32)
            }
            _ => fail(errors, range),
        },
    }
}

/// A ride as the API shows it: the 201 body of `POST /rides` and the body of `GET /rides/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, sqlx::FromRow)]
pub struct RideView {
    /// The ride's id.
    #[sqlx(rename = "id")]
    pub ride_id: i64,
    /// Price, in cents.
    pub amount_cents: i32,
    /// The gateway charge, once paid.
    pub charge_id: Option<String>,
    /// `pending`, `paid` or `declined`.
    pub status: String,
    /// Pick-up latitude.
    pub origin_lat: f64,
    /// Pick-up longitude.
    pub origin_lon: f64,
    /// Drop-off latitude.
    pub target_lat: f64,
    /// Drop-off longitude.
    pub target_lon: f64,
    /// Creation time, RFC 3339.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
}

const RIDE_COLUMNS: &str = "id, amount_cents, charge_id, status, origin_lat, origin_lon, \
                            target_lat, target_lon, created_at";

impl RideView {
    /// The ride a key created.
    pub async fn by_key(
        db: impl PgExecutor<'_>,
        user_id: i64,
        key_id: i64,
    ) -> Result<Option<Self>, sqlx::Error> {
        sqlx::query_as(&format!(
            "SELECT {RIDE_COLUMNS} FROM rides WHERE user_id = $1 AND idempotency_key_id = $2"
        ))
        .bind(user_id)
        .bind(key_id)
        .fetch_optional(db)
        .await
    }

    /// A ride of its owner.
    pub async fn by_id(
        db: impl PgExecutor<'_>,
        user_id: i64,
        ride_id: i64,
    ) -> Result<Option<Self>, sqlx::Error> {
        sqlx::query_as(&format!(
            "SELECT {RIDE_COLUMNS} FROM rides WHERE user_id = $1 AND id = $2"
        ))
        .bind(user_id)
        .bind(ride_id)
        .fetch_optional(db)
        .await
    }
}

/// `POST /rides`.
pub async fn create(
    State(state): State<AppState>,
    user: AuthUser,
    RequiredKey(key): RequiredKey,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    // Everything is validated before the key is claimed: bad input writes no row.
    let body = body.map_err(|e| match e.status() {
        http::StatusCode::PAYLOAD_TOO_LARGE => ApiError::BodyTooLarge,
        _ => ApiError::BadJson(e.body_text()),
    })?;
    let json: Value =
        serde_json::from_slice(&body).map_err(|e| ApiError::BadJson(e.to_string()))?;
    let request = RideRequest::validate(&json).map_err(ApiError::Validation)?;
    let params = serde_json::to_value(&request).map_err(|e| ApiError::Internal(e.to_string()))?;

    // From the claim on, the request runs in a task of its own. If the client hangs up, hyper
    // drops the handler's future; were the claim, a phase or the release dropped with it, the key
    // would stay locked until its lease expired. The task finishes what it started.
    let task = tokio::spawn(async move {
        let fingerprint = Fingerprint::of_json("POST", RIDES_ROUTE, &json);
        let claim = state
            .store
            .claim::<RidePoint>(NewRequest {
                user_id: user.id,
                method: "POST",
                route: RIDES_ROUTE,
                key: &key,
                fingerprint,
                params: &params,
            })
            .await?;
        state.metrics.claim(match &claim {
            Claim::Acquired(_) => ClaimOutcome::Acquired,
            Claim::Replay(_) => ClaimOutcome::Replayed,
            Claim::Mismatch => ClaimOutcome::Mismatch,
            Claim::InFlight { .. } => ClaimOutcome::InFlight,
        });
        match acquired_or_respond(claim) {
            Ok(lease) => book(&state, lease).await,
            Err(refusal) => Ok(refusal),
        }
    });
    task.await
        .map_err(|e| ApiError::Internal(format!("booking task failed: {e}")))?
}

/// Runs the booking with the lease and turns its outcome into the answer, releasing the lease
/// on every failure a retry can resume from.
async fn book(state: &AppState, mut lease: Lease<RidePoint>) -> Result<Response, ApiError> {
    let mut giving_up = state.giving_up.clone();
    let outcome = tokio::select! {
        outcome = booking::run(state, &mut lease) => outcome,
        // Shutdown deadline: stop between two statements of the machine (an open phase rolls
        // back), hand the key back, and let the client's retry resume it elsewhere.
        _ = giving_up.wait() => Err(BookingError::GivenUp),
    };
    let key_id = lease.key_id();
    // Every failure but a crash and a lost lease hands the key back: the retry resumes from its
    // recovery point at once instead of waiting for the lease to expire.
    let answer = match outcome {
        Ok(stored) => return Ok(stored_response(&stored)),
        Err(BookingError::Crashed(point)) => {
            // A simulated crash: the lease is kept until it expires, as a dead process keeps it.
            tracing::warn!(key_id, point, "crash point hit");
            return Err(ApiError::Internal(format!("crashed at {point}")));
        }
        Err(BookingError::LeaseLost(e)) => {
            // The lease is someone else's now; there is nothing of ours to release.
            state.metrics.lease_lost();
            tracing::warn!(key_id, error = %e, "lease taken over mid-request");
            return Err(ApiError::LeaseLost);
        }
        Err(BookingError::GatewayUnavailable(why)) => ApiError::GatewayUnavailable(why),
        Err(BookingError::GatewayMisconfigured(why)) => {
            // Ours to fix, not the client's: loud in the log, counted in gateway_charges_total
            // (outcome "misconfigured"), and a plain 503 to the client, who may retry.
            tracing::error!(key_id, error = %why, "payment gateway misconfigured");
            ApiError::GatewayUnavailable(why)
        }
        Err(BookingError::PaymentPending(charge)) => ApiError::PaymentPending(charge),
        Err(BookingError::GivenUp) => ApiError::ShuttingDown,
        Err(BookingError::Internal(why)) => ApiError::Internal(why),
    };
    if let Err(release) = state.store.release(lease).await {
        tracing::warn!(key_id, error = %release, "could not release lease");
    }
    Err(answer)
}

/// `GET /rides/{id}`: the owner's ride; 404 for everyone else, so ids reveal nothing.
pub async fn show(
    State(state): State<AppState>,
    user: AuthUser,
    Path(ride_id): Path<String>,
) -> Result<Response, ApiError> {
    let Ok(ride_id) = ride_id.parse::<i64>() else {
        return Err(ApiError::NotFound);
    };
    let ride = RideView::by_id(&state.pool, user.id, ride_id)
        .await
        .map_err(|e| ApiError::Internal(format!("load ride {ride_id}: {e}")))?
        .ok_or(ApiError::NotFound)?;
    Ok(axum::Json(json!(ride)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(body: Value) -> Vec<String> {
        RideRequest::validate(&body)
            .unwrap_err()
            .into_iter()
            .map(|e| e.field)
            .collect()
    }

    #[test]
    fn a_valid_body_is_accepted() {
        let body = json!({"origin_lat": 37.77, "origin_lon": -122.42, "target_lat": 37.80,
                          "target_lon": -122.27, "amount_cents": 2000});
        let ride = RideRequest::validate(&body).unwrap();
        assert_eq!(ride.amount_cents, 2000);
        assert_eq!(ride.origin_lon, -122.42);
    }

    #[test]
    fn every_failing_field_is_named() {
        let body = json!({"origin_lat": 91, "origin_lon": "x", "target_lat": -90,
                          "amount_cents": 49, "tip": 1});
        assert_eq!(
            fields(body),
            [
                "origin_lat",
                "origin_lon",
                "target_lon",
                "amount_cents",
                "tip"
            ]
        );
    }

    #[test]
    fn amount_must_be_an_integer_in_range() {
        let base = json!({"origin_lat": 0, "origin_lon": 0, "target_lat": 0, "target_lon": 0});
        let with = |amount: Value| {
            let mut b = base.clone();
            b["amount_cents"] = amount;
            RideRequest::validate(&b)
        };
        assert!(with(json!(50)).is_ok());
        assert!(with(json!(1_000_000)).is_ok());
        assert!(with(json!(2000.0)).is_ok());
        assert!(with(json!(49)).is_err());
        assert!(with(json!(1_000_001)).is_err());
        assert!(with(json!(20.5)).is_err());
        assert!(with(json!("2000")).is_err());
    }

    #[test]
    fn a_non_object_body_is_refused() {
        assert_eq!(fields(json!([1, 2])), [""]);
    }
}
