//! Authentication: the secret key names the account.
//!
//! Stripe takes the key as `Authorization: Bearer sk_test_…` or as the user name of HTTP Basic
//! (`curl -u sk_test_…:`); both are accepted. Any key of the right shape is valid: its account
//! is created on first use, so a test needs no setup beyond choosing a key. Different keys are
//! different accounts and never see each other's customers, charges or idempotency keys.
//! Accounts are never deleted, so a key's account id is cached after its first request.

use axum::extract::FromRequestParts;
use base64::Engine;
use http::header::AUTHORIZATION;
use http::request::Parts;
use http::HeaderMap;

use crate::api_error::ApiError;
use crate::state::AppState;
use crate::{db, messages};

/// The prefix of every accepted key: the fake has test mode only.
pub(crate) const KEY_PREFIX: &str = "sk_test_";

/// The longest accepted key, as bounded by the `accounts.secret_key` column.
pub(crate) const MAX_KEY_LEN: usize = 255;

/// The authenticated account of a request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Account {
    /// `accounts.id`: also the `user_id` of the account's idempotency keys.
    pub(crate) id: i64,
}

impl FromRequestParts<AppState> for Account {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let key = secret_key(&parts.headers)?;
        if let Some(id) = state.cached_account(&key) {
            return Ok(Self { id });
        }
        let id = db::account_for_key(state.pool(), &key).await?;
        state.cache_account(key, id);
        Ok(Self { id })
    }
}

/// The key of a request's `Authorization` header, checked for shape.
pub(crate) fn secret_key(headers: &HeaderMap) -> Result<String, ApiError> {
    let invalid = || ApiError::unauthorized(messages::INVALID_API_KEY);
    let Some(value) = headers.get(AUTHORIZATION) else {
        return Err(ApiError::unauthorized(messages::NO_API_KEY));
    };
    let value = value.to_str().map_err(|_| invalid())?.trim();
    let (scheme, credentials) = value.split_once(' ').unwrap_or((value, ""));
    let credentials = credentials.trim();
    let key = if scheme.eq_ignore_ascii_case("bearer") {
        credentials.to_owned()
    } else if scheme.eq_ignore_ascii_case("basic") {
        // `user:password`, where the user is the key and the password is empty.
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(credentials)
            .map_err(|_| invalid())?;
        let decoded = String::from_utf8(decoded).map_err(|_| invalid())?;
        let user = decoded
            .split_once(':')
            .map_or(decoded.as_str(), |(user, _)| user);
        user.to_owned()
    } else {
        return Err(invalid());
    };
    if key.is_empty() {
        return Err(ApiError::unauthorized(messages::NO_API_KEY));
    }
    if !is_valid_key(&key) {
        return Err(invalid());
    }
    Ok(key)
}

/// `sk_test_` followed by 1 or more letters, digits or underscores, at most 255 in all.
fn is_valid_key(key: &str) -> bool {
    key.len() <= MAX_KEY_LEN
        && key.strip_prefix(KEY_PREFIX).is_some_and(|rest| {
            !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn key_of(authorization: Option<&str>) -> Result<String, serde_json::Value> {
        let mut headers = HeaderMap::new();
        if let Some(value) = authorization {
            headers.insert(AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        }
        secret_key(&headers).map_err(|e| e.body())
    }

    #[test]
    fn bearer_and_basic_credentials_give_the_key() {
        assert_eq!(
            key_of(Some("Bearer sk_test_abc_123")).unwrap(),
            "sk_test_abc_123"
        );
        assert_eq!(key_of(Some("bearer   sk_test_x ")).unwrap(), "sk_test_x");
        // base64("sk_test_abc:")
        assert_eq!(
            key_of(Some("Basic c2tfdGVzdF9hYmM6")).unwrap(),
            "sk_test_abc"
        );
    }

    #[test]
    fn missing_and_malformed_keys_are_refused_with_stripe_messages() {
        assert_eq!(
            key_of(None).unwrap_err()["error"]["message"],
            messages::NO_API_KEY
        );
        assert_eq!(
            key_of(Some("Bearer ")).unwrap_err()["error"]["message"],
            messages::NO_API_KEY
        );
        for bad in [
            "Bearer sk_live_abc",
            "Bearer sk_test_",
            "Bearer pk_test_abc",
            "Bearer sk_test_a-b",
            "Token sk_test_abc",
            "Basic !!!",
        ] {
            let error = key_of(Some(bad)).unwrap_err();
            assert_eq!(error["error"]["type"], "invalid_request_error", "{bad}");
            assert_eq!(
                error["error"]["message"],
                messages::INVALID_API_KEY,
                "{bad}"
            );
        }
        let long = format!("Bearer sk_test_{}", "a".repeat(MAX_KEY_LEN));
        assert!(key_of(Some(&long)).is_err());
    }
}
