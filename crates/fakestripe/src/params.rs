//! Request parameters: the form body and the query string as decoded objects, and the checks
//! every endpoint shares (unknown names, strings, integers, metadata).
//!
//! Each check returns the Stripe error for the first problem, naming the parameter in `param`,
//! before anything is written.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use http::request::Parts;
use serde_json::{Map, Value};
use time::OffsetDateTime;

use crate::api_error::ApiError;
use crate::db::CreatedRange;
use crate::form::{self, FormError};
use crate::messages;

/// The largest request body read, in bytes. The biggest valid charge (every field at its
/// bound, 50 metadata pairs) is far below it.
pub(crate) const MAX_BODY_BYTES: usize = 64 * 1024;

/// The most metadata keys on one object, as Stripe allows.
pub(crate) const MAX_METADATA_KEYS: usize = 50;

/// The longest metadata key, in characters, as Stripe allows.
pub(crate) const MAX_METADATA_KEY_LEN: usize = 40;

/// The longest metadata value, in characters, as Stripe allows.
pub(crate) const MAX_METADATA_VALUE_LEN: usize = 500;

/// Decoded parameters of a request.
pub(crate) type Params = Map<String, Value>;

/// The form-encoded body of a `POST`, decoded.
#[derive(Debug)]
pub(crate) struct FormBody(pub(crate) Params);

impl<S: Send + Sync> FromRequest<S> for FormBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        let bytes: Bytes = axum::body::to_bytes(req.into_body(), MAX_BODY_BYTES)
            .await
            .map_err(|_| ApiError::body_too_large(MAX_BODY_BYTES))?;
        form::decode(&bytes).map(FormBody).map_err(form_error)
    }
}

/// The query string of a `GET`, decoded the same way as a body.
#[derive(Debug)]
pub(crate) struct QueryParams(pub(crate) Params);

impl<S: Send + Sync> FromRequestParts<S> for QueryParams {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let query = parts.uri.query().unwrap_or("");
        form::decode(query.as_bytes())
            .map(QueryParams)
            .map_err(form_error)
    }
}

fn form_error(error: FormError) -> ApiError {
    let message = error.to_string();
    match error.param() {
        Some(param) => ApiError::invalid(param, message),
        None => ApiError::bad_request(message),
    }
}

/// Refuses any parameter not in `known`.
pub(crate) fn reject_unknown(params: &Params, known: &[&str]) -> Result<(), ApiError> {
    match params.keys().find(|name| !known.contains(&name.as_str())) {
        Some(name) => Err(ApiError::unknown_param(name)),
        None => Ok(()),
    }
}

/// A plain value (not an object or list) or nothing.
fn plain<'p>(params: &'p Params, name: &str) -> Result<Option<&'p str>, ApiError> {
    match params.get(name) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ApiError::invalid(
            name,
            format!("Invalid {name}: expected a single value, not an object or a list."),
        )),
    }
}

/// An optional string of at most `max_chars`; an empty value counts as absent, as in Stripe,
/// where it unsets the field.
pub(crate) fn optional_string(
    params: &Params,
    name: &str,
    max_chars: usize,
) -> Result<Option<String>, ApiError> {
    match plain(params, name)? {
        None | Some("") => Ok(None),
        Some(s) if s.chars().count() > max_chars => Err(ApiError::invalid(
            name,
            format!("Invalid {name}: must be at most {max_chars} characters long"),
        )),
        Some(s) => Ok(Some(s.to_owned())),
    }
}

/// A required, non-empty string of at most `max_chars`.
pub(crate) fn required_string(
    params: &Params,
    name: &str,
    max_chars: usize,
) -> Result<String, ApiError> {
    match plain(params, name)? {
        None => Err(ApiError::missing(name)),
        Some("") => Err(ApiError::invalid_code(
            name,
            "parameter_invalid_empty",
            messages::empty_param(name),
        )),
        Some(_) => Ok(optional_string(params, name, max_chars)?.unwrap_or_default()),
    }
}

/// An optional whole number.
pub(crate) fn optional_integer(params: &Params, name: &str) -> Result<Option<i64>, ApiError> {
    match plain(params, name)? {
        None => Ok(None),
        Some(s) => s.parse::<i64>().map(Some).map_err(|_| {
            ApiError::invalid_code(
                name,
                "parameter_invalid_integer",
                messages::invalid_integer(s),
            )
        }),
    }
}

/// The `created` filter of a list, as Stripe takes it: `created=<unix seconds>` for one second,
/// or any of `created[gt]`, `created[gte]`, `created[lt]`, `created[lte]`. Stripe's `created` is
/// a whole second, so each bound becomes an instant that keeps or drops that whole second.
pub(crate) fn created_range(params: &Params) -> Result<CreatedRange, ApiError> {
    let seconds = |param: &str, text: &str| -> Result<OffsetDateTime, ApiError> {
        text.parse::<i64>()
            .ok()
            .and_then(|s| OffsetDateTime::from_unix_timestamp(s).ok())
            .ok_or_else(|| {
                ApiError::invalid_code(
                    param,
                    "parameter_invalid_integer",
                    messages::invalid_integer(text),
                )
            })
    };
    let next = |t: OffsetDateTime| t + time::Duration::SECOND;
    match params.get("created") {
        None => Ok(CreatedRange::default()),
        Some(Value::String(text)) => {
            let at = seconds("created", text)?;
            Ok(CreatedRange {
                from: Some(at),
                until: Some(next(at)),
            })
        }
        Some(Value::Object(bounds)) => {
            let mut range = CreatedRange::default();
            for (op, value) in bounds {
                let param = format!("created[{op}]");
                let Value::String(text) = value else {
                    return Err(ApiError::invalid(
                        param,
                        "Invalid created: expected a unix timestamp",
                    ));
                };
                let at = seconds(&param, text)?;
                // Several bounds narrow the range; the tightest of each side wins.
                let (from, until) = match op.as_str() {
                    "gt" => (Some(next(at)), None),
                    "gte" => (Some(at), None),
                    "lt" => (None, Some(at)),
                    "lte" => (None, Some(next(at))),
                    _ => return Err(ApiError::unknown_param(&param)),
                };
                range.from = range.from.max(from);
                range.until = match (range.until, until) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
            Ok(range)
        }
        Some(_) => Err(ApiError::invalid(
            "created",
            "Invalid created: expected a unix timestamp or a hash of gt, gte, lt, lte",
        )),
    }
}

/// The `metadata` object: string values under short keys. Empty values are dropped (in Stripe
/// they unset the key), and an empty `metadata=` means no metadata.
pub(crate) fn metadata(params: &Params) -> Result<Value, ApiError> {
    let entries = match params.get("metadata") {
        None => return Ok(Value::Object(Map::new())),
        Some(Value::String(s)) if s.is_empty() => return Ok(Value::Object(Map::new())),
        Some(Value::Object(entries)) => entries,
        Some(_) => {
            return Err(ApiError::invalid(
                "metadata",
                "Invalid metadata: must be a set of key-value pairs, as metadata[key]=value",
            ))
        }
    };
    if entries.len() > MAX_METADATA_KEYS {
        return Err(ApiError::invalid(
            "metadata",
            format!("Invalid metadata: at most {MAX_METADATA_KEYS} keys are allowed"),
        ));
    }
    let mut kept = Map::new();
    for (key, value) in entries {
        let param = format!("metadata[{key}]");
        let Value::String(value) = value else {
            return Err(ApiError::invalid(
                param,
                "Invalid metadata: values must be strings",
            ));
        };
        if key.chars().count() > MAX_METADATA_KEY_LEN {
            return Err(ApiError::invalid(
                param,
                format!("Invalid metadata: keys must be at most {MAX_METADATA_KEY_LEN} characters"),
            ));
        }
        if value.chars().count() > MAX_METADATA_VALUE_LEN {
            return Err(ApiError::invalid(
                param,
                format!(
                    "Invalid metadata: values must be at most {MAX_METADATA_VALUE_LEN} characters"
                ),
            ));
        }
        if !value.is_empty() {
            kept.insert(key.clone(), Value::String(value.clone()));
        }
    }
    Ok(Value::Object(kept))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn params(v: Value) -> Params {
        match v {
            Value::Object(m) => m,
            _ => unreachable!("tests pass objects"),
        }
    }

    #[test]
    fn metadata_keeps_strings_and_drops_empty_values() {
        let p = params(json!({"metadata": {"ride_id": "42", "gone": ""}}));
        assert_eq!(metadata(&p).unwrap(), json!({"ride_id": "42"}));
        assert_eq!(
            metadata(&params(json!({"metadata": ""}))).unwrap(),
            json!({})
        );
        assert_eq!(metadata(&params(json!({}))).unwrap(), json!({}));
    }

    #[test]
    fn metadata_refuses_nesting_and_long_keys() {
        let nested = params(json!({"metadata": {"a": {"b": "1"}}}));
        assert_eq!(
            metadata(&nested).unwrap_err().body()["error"]["param"],
            "metadata[a]"
        );
        let long = params(json!({"metadata": {"k".repeat(41): "v"}}));
        assert!(metadata(&long).is_err());
        assert!(metadata(&params(json!({"metadata": "x"}))).is_err());
    }

    #[test]
    fn created_bounds_keep_or_drop_whole_seconds() {
        let at = |s: i64| Some(OffsetDateTime::from_unix_timestamp(s).unwrap());
        let range = |v: Value| created_range(&params(v));
        assert_eq!(
            range(json!({"created": {"gte": "100", "lte": "200"}})).unwrap(),
            CreatedRange {
                from: at(100),
                until: at(201)
            }
        );
        assert_eq!(
            range(json!({"created": {"gt": "100", "lt": "200"}})).unwrap(),
            CreatedRange {
                from: at(101),
                until: at(200)
            }
        );
        assert_eq!(
            range(json!({"created": "100"})).unwrap(),
            CreatedRange {
                from: at(100),
                until: at(101)
            }
        );
        assert_eq!(range(json!({})).unwrap(), CreatedRange::default());
        let bad = range(json!({"created": {"after": "1"}}))
            .unwrap_err()
            .body();
        assert_eq!(bad["error"]["param"], "created[after]");
        let bad = range(json!({"created": {"gte": "soon"}}))
            .unwrap_err()
            .body();
        assert_eq!(bad["error"]["code"], "parameter_invalid_integer");
    }

    #[test]
    fn integers_and_strings_are_checked() {
        let p = params(json!({"amount": "12x", "currency": "", "limit": "3"}));
        let err = optional_integer(&p, "amount").unwrap_err().body();
        assert_eq!(err["error"]["code"], "parameter_invalid_integer");
        assert_eq!(optional_integer(&p, "limit").unwrap(), Some(3));
        let err = required_string(&p, "currency", 3).unwrap_err().body();
        assert_eq!(err["error"]["code"], "parameter_invalid_empty");
        let err = required_string(&p, "customer", 3).unwrap_err().body();
        assert_eq!(err["error"]["code"], "parameter_missing");
        assert_eq!(err["error"]["param"], "customer");
    }
}
