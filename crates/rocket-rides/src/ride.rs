//! The ride: what a booking request must hold (validation), and the ride as the API shows it.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::db::Pg;
use crate::json::Members;
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

/// Why a body is not a ride request.
#[derive(Debug, Clone, PartialEq)]
pub enum BodyError {
    /// Not strict JSON (see [`crate::json`]): the message says where.
    NotJson(String),
    /// JSON, but these fields fail.
    Invalid(Vec<FieldError>),
}

impl RideRequest {
    /// Parses and validates a body: strict JSON, then every field on the exact text the client
    /// wrote, reporting every failing field at once. Returns the request and the JSON value (the
    /// fingerprint is taken over the value's canonical form).
    pub fn parse(body: &[u8]) -> Result<(Self, Value), BodyError> {
        let (value, members) =
            crate::json::parse(body).map_err(|e| BodyError::NotJson(e.to_string()))?;
        let Some(members) = members else {
            return Err(BodyError::Invalid(vec![FieldError {
                field: String::new(),
                message: "the body must be a JSON object".into(),
            }]));
        };
        Self::from_members(&members)
            .map(|request| (request, value))
            .map_err(BodyError::Invalid)
    }

    /// Validates an object's members, as written.
    fn from_members(members: &Members) -> Result<Self, Vec<FieldError>> {
        let member = |name: &str| {
            members
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, raw)| raw.get())
        };
        let mut errors = Vec::new();
        let mut coordinate = |name: &'static str, bound: u64| {
            let (value, failure) = coordinate(member(name), bound);
            if let Some(message) = failure {
                errors.push(FieldError {
                    field: name.to_owned(),
                    message,
                });
            }
            value
        };
        let origin_lat = coordinate("origin_lat", 90);
        let origin_lon = coordinate("origin_lon", 180);
        let target_lat = coordinate("target_lat", 90);
        let target_lon = coordinate("target_lon", 180);
        let amount_cents = match amount(member("amount_cents")) {
            Ok(amount) => Some(amount),
            Err(message) => {
                errors.push(FieldError {
                    field: "amount_cents".into(),
                    message,
                });
                None
            }
        };
        for (name, _) in members {
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

/// A coordinate within `[-bound, bound]`, checked on its exact text: the value, or why not.
fn coordinate(text: Option<&str>, bound: u64) -> (Option<f64>, Option<String>) {
    let Some(text) = text else {
        return (None, Some("is required".into()));
    };
    match crate::json::abs_cmp(text, bound) {
        None => (None, Some("must be a number".into())),
        Some(std::cmp::Ordering::Greater) => {
            (None, Some(format!("must be between -{bound} and {bound}")))
        }
        // Within the bound exactly: the nearest double cannot leave it, since the bound is one.
        Some(_) => (text.parse().ok(), None),
    }
}

/// An amount: an integer token (no fraction, no exponent) within the accepted range.
fn amount(text: Option<&str>) -> Result<i32, String> {
    let range = || format!("must be an integer between {MIN_AMOUNT_CENTS} and {MAX_AMOUNT_CENTS}");
    let text = text.ok_or_else(|| "is required".to_owned())?;
    let digits = text.strip_prefix('-').unwrap_or(text);
    let integer_token = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'));
    if !integer_token {
        return Err(range());
    }
    // A token longer than any i64 is out of range as well.
    match text.parse::<i64>() {
        Ok(v) if (MIN_AMOUNT_CENTS..=MAX_AMOUNT_CENTS).contains(&v) => Ok(v as i32),
        _ => Err(range()),
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

/// The columns of a [`RideView`], for the statements that return one.
pub(crate) const RIDE_COLUMNS: &str =
    "id, amount_cents, charge_id, status, origin_lat, origin_lon, \
                            target_lat, target_lon, created_at";

impl RideView {
    /// The ride a key created.
    pub async fn by_key(
        pg: &mut Pg<'_>,
        user_id: i64,
        key_id: i64,
    ) -> Result<Option<Self>, sqlx::Error> {
        sqlx::query_as(&format!(
            "SELECT {RIDE_COLUMNS} FROM rides WHERE user_id = $1 AND key_owner = $1::text AND idempotency_key_id = $2"
        ))
        .bind(user_id)
        .bind(key_id)
        .fetch_optional(pg)
        .await
    }

    /// A ride of its owner.
    pub async fn by_id(
        pg: &mut Pg<'_>,
        user_id: i64,
        ride_id: i64,
    ) -> Result<Option<Self>, sqlx::Error> {
        sqlx::query_as(&format!(
            "SELECT {RIDE_COLUMNS} FROM rides WHERE user_id = $1 AND key_owner = $1::text AND id = $2"
        ))
        .bind(user_id)
        .bind(ride_id)
        .fetch_optional(pg)
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(body: &str) -> Vec<String> {
        match RideRequest::parse(body.as_bytes()).unwrap_err() {
            BodyError::Invalid(errors) => errors.into_iter().map(|e| e.field).collect(),
            BodyError::NotJson(why) => panic!("not JSON: {why}"),
        }
    }

    fn with_amount(amount: &str) -> Result<i32, Vec<String>> {
        let body = format!(
            r#"{{"origin_lat": 0, "origin_lon": 0, "target_lat": 0, "target_lon": 0, "amount_cents": {amount}}}"#
        );
        RideRequest::parse(body.as_bytes())
            .map(|(r, _)| r.amount_cents)
            .map_err(|e| match e {
                BodyError::Invalid(errors) => errors.into_iter().map(|e| e.field).collect(),
                BodyError::NotJson(why) => vec![why],
            })
    }

    #[test]
    fn a_valid_body_is_accepted() {
        let body = r#"{"origin_lat": 37.77, "origin_lon": -122.42, "target_lat": 37.80,
                       "target_lon": -122.27, "amount_cents": 2000}"#;
        let (ride, value) = RideRequest::parse(body.as_bytes()).unwrap();
        assert_eq!(ride.amount_cents, 2000);
        assert_eq!(ride.origin_lon, -122.42);
        assert_eq!(value["target_lat"], 37.80);
    }

    #[test]
    fn every_failing_field_is_named() {
        let body = r#"{"origin_lat": 91, "origin_lon": "x", "target_lat": -90,
                       "amount_cents": 49, "tip": 1}"#;
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
    fn amount_must_be_an_integer_token_in_range() {
        assert_eq!(with_amount("50"), Ok(50));
        assert_eq!(with_amount("1000000"), Ok(1_000_000));
        for bad in [
            "49",
            "1000001",
            "20.5",
            "2000.0",
            "2e3",
            "49.999999999999999",
            "\"2000\"",
            "-0",
            "99999999999999999999999",
        ] {
            assert_eq!(
                with_amount(bad),
                Err(vec!["amount_cents".to_owned()]),
                "{bad}"
            );
        }
    }

    #[test]
    fn coordinates_are_checked_on_their_exact_text() {
        let body = |lat: &str| {
            format!(
                r#"{{"origin_lat": {lat}, "origin_lon": 0, "target_lat": 0, "target_lon": 0, "amount_cents": 100}}"#
            )
        };
        for good in ["90", "-90", "90.000", "9e1", "89.99999999999999999"] {
            assert!(RideRequest::parse(body(good).as_bytes()).is_ok(), "{good}");
        }
        for bad in ["90.0000000000000001", "-90.0000000000000001", "1e2", "91"] {
            assert_eq!(fields(&body(bad)), ["origin_lat"], "{bad}");
        }
    }

    #[test]
    fn duplicates_and_nul_are_not_json_and_a_non_object_is_invalid() {
        let dup = r#"{"amount_cents": 100, "amount_cents": 200, "origin_lat": 0,
                      "origin_lon": 0, "target_lat": 0, "target_lon": 0}"#;
        assert!(matches!(
            RideRequest::parse(dup.as_bytes()),
            Err(BodyError::NotJson(_))
        ));
        assert!(matches!(
            RideRequest::parse(br#"{"tip": "a\u0000b"}"#),
            Err(BodyError::NotJson(_))
        ));
        assert_eq!(fields("[1, 2]"), [""]);
    }
}
