//! API keys: random, shown once, stored only as a SHA-256 hash; looked up once per
//! `--api-key-cache-ttl` per process ([`cache`]).

pub mod cache;

use axum::extract::FromRequestParts;
use http::request::Parts;
use rand::TryRngCore;
use sha2::{Digest, Sha256};

use crate::problem::{ApiError, ONE_AUTHORIZATION_DETAIL, UNAUTHORIZED_DETAIL};
use crate::state::AppState;

/// Prefix of every API key, so a leaked key is recognisable in logs and scanners.
pub const API_KEY_PREFIX: &str = "rr_test_";

/// A new random API key: the prefix and 32 random bytes in hex.
pub fn generate_api_key() -> String {
    let mut bytes = [0u8; 32];
    // The operating system's generator failing means the machine cannot make secrets at all.
    rand::rngs::OsRng
        .try_fill_bytes(&mut bytes)
        .expect("the OS random generator works");
    format!("{API_KEY_PREFIX}{}", hex::encode(bytes))
}

/// What is stored: the SHA-256 of the key. A key has 256 random bits, so no salt or slow hash is
/// needed to make the stored hash useless to whoever reads the table.
pub fn hash_api_key(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// The caller, authenticated by `Authorization: Bearer <api key>`.
#[derive(Debug, Clone)]
pub struct AuthUser {
    /// `users.id`.
    pub id: i64,
    /// The user's customer at the payment gateway, read with the key so that a booking need not
    /// read it again. (A user without one has no API key yet: see `users create`.)
    pub customer: String,
}

impl FromRequestParts<AppState> for AuthUser {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let key = bearer_token(&parts.headers)?;
        let hash = hash_api_key(key);
        if let Some(user) = state.api_keys.get(&hash) {
            return Ok(user);
        }
        // Stamped before the look-up is sent: see `cache` for why the bound needs it.
        let looked_up_at = state.api_keys.now();
        let user = look_up(state, &hash)
            .await
            .map_err(|e| ApiError::Internal(format!("authenticate: {e}")))?
            .ok_or(ApiError::Unauthorized(UNAUTHORIZED_DETAIL))?;
        state.api_keys.put(hash, user.clone(), looked_up_at);
        Ok(user)
    }
}

/// The user whose API key has this hash, if it has a gateway customer (a user without one has no
/// key yet).
async fn look_up(state: &AppState, hash: &[u8; 32]) -> Result<Option<AuthUser>, sqlx::Error> {
    let mut db = state.store.autocommit().await?;
    let mut pg = state.store.statements_on(db.conn());
    let user: Option<(i64, String)> = sqlx::query_as(
        "SELECT id, stripe_customer_id FROM users
         WHERE api_key_hash = $1 AND stripe_customer_id IS NOT NULL",
    )
    .bind(hash.as_slice())
    .fetch_optional(&mut pg)
    .await?;
    db.done().await?;
    Ok(user.map(|(id, customer)| AuthUser { id, customer }))
}

/// The longest API key looked up; ours are 72 characters.
const MAX_API_KEY_LEN: usize = 128;

/// The token of exactly one `Authorization: Bearer <token>` header. The scheme is
/// case-insensitive (RFC 9110 §11.1); several `Authorization` headers are refused rather than
/// one of them picked, since a proxy and the client may disagree on which one counts.
pub fn bearer_token(headers: &http::HeaderMap) -> Result<&str, ApiError> {
    let mut values = headers.get_all(http::header::AUTHORIZATION).iter();
    let value = match (values.next(), values.next()) {
        (Some(value), None) => value,
        (Some(_), Some(_)) => return Err(ApiError::Unauthorized(ONE_AUTHORIZATION_DETAIL)),
        (None, _) => return Err(ApiError::Unauthorized(UNAUTHORIZED_DETAIL)),
    };
    let unauthorized = || ApiError::Unauthorized(UNAUTHORIZED_DETAIL);
    let value = value.to_str().map_err(|_| unauthorized())?;
    let (scheme, token) = value.trim().split_once(' ').ok_or_else(unauthorized)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() || token.len() > MAX_API_KEY_LEN {
        return Err(unauthorized());
    }
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(values: &[&str]) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        for value in values {
            headers.append(http::header::AUTHORIZATION, value.parse().unwrap());
        }
        headers
    }

    #[test]
    fn the_scheme_is_case_insensitive_and_one_header_is_required() {
        for scheme in ["Bearer", "bearer", "BEARER", "bEaReR"] {
            let headers = headers(&[&format!("{scheme} rr_test_1")]);
            assert_eq!(bearer_token(&headers).unwrap(), "rr_test_1", "{scheme}");
        }
        for bad in [
            &["Basic abc"][..],
            &["Bearer "],
            &["Bearer"],
            &["rr_test_1"],
            &[],
        ] {
            assert!(matches!(
                bearer_token(&headers(bad)),
                Err(ApiError::Unauthorized(UNAUTHORIZED_DETAIL))
            ));
        }
        let two = headers(&["Bearer rr_test_1", "Bearer rr_test_2"]);
        assert!(matches!(
            bearer_token(&two),
            Err(ApiError::Unauthorized(ONE_AUTHORIZATION_DETAIL))
        ));
    }
}
