//! API keys: random, shown once, stored only as a SHA-256 hash.

use axum::extract::FromRequestParts;
use http::request::Parts;
use rand::TryRngCore;
use sha2::{Digest, Sha256};

use crate::problem::ApiError;
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
#[derive(Debug, Clone, Copy)]
pub struct AuthUser {
    /// `users.id`.
    pub id: i64,
}

impl FromRequestParts<AppState> for AuthUser {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let key = parts
            .headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|k| !k.is_empty() && k.len() <= 128)
            .ok_or(ApiError::Unauthorized)?;
        let id: Option<i64> = sqlx::query_scalar("SELECT id FROM users WHERE api_key_hash = $1")
            .bind(hash_api_key(key).as_slice())
            .fetch_optional(&state.pool)
            .await
            .map_err(|e| ApiError::Internal(format!("authenticate: {e}")))?;
        id.map(|id| Self { id }).ok_or(ApiError::Unauthorized)
    }
}
