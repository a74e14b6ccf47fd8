//! The ride: what a booking request must hold (validation), and the ride as the API shows it.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sqlx::PgExecutor;
use time::OffsetDateTime;

/// The route template of `POST /rides`, part of every key's scope and fingerprint.
pub const RIDES_ROUTE: &str = "/rides";

/// Cheapest ride, in cents (Stripe's minimum charge in USD).
pub const MIN_AMOUNT_CENTS: i64 = 50;
/// Dearest ride, in cents.
pub const MAX_AMOUNT_CENTS: i64 = 1_000_000;

/// A validated `POST /rides` body; also the parameters stored with the key for the completer.
///
/// Its OpenAPI schema is generated from this type; the bounds in its attributes are checked
/// against the constants below by a test.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RideRequest {
    /// Pick-up latitude, degrees.
    #[schema(minimum = -90, maximum = 90)]
    pub origin_lat: f64,
    /// Pick-up longitude, degrees.
    #[schema(minimum = -180, maximum = 180)]
    pub origin_lon: f64,
    /// Drop-off latitude, degrees.
    #[schema(minimum = -90, maximum = 90)]
    pub target_lat: f64,
    /// Drop-off longitude, degrees.
    #[schema(minimum = -180, maximum = 180)]
    pub target_lon: f64,
    /// Price, in cents.
    #[schema(minimum = 50, maximum = 1000000)]
    pub amount_cents: i32,
}

/// One failing field of a request body.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
#[schema(as = Ride)]
pub struct RideView {
    /// The ride's id.
    #[sqlx(rename = "id")]
    pub ride_id: i64,
    /// Price, in cents.
    pub amount_cents: i32,
    /// The gateway charge, once paid.
    pub charge_id: Option<String>,
    /// `pending` (not charged yet), `payment_pending` (charged, not settled), `paid`,
    /// `declined`, or `failed` (refused by the gateway for good).
    #[schema(pattern = "^(pending|payment_pending|paid|declined|failed)$")]
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
    #[schema(value_type = String, format = DateTime)]
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
