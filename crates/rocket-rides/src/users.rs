//! Creating users: a gateway customer with their card, an API key, a row.

use serde::Serialize;
use sha2::{Digest, Sha256};
use sqlx::PgPool;

use crate::auth::{generate_api_key, hash_api_key};
use crate::stripe::StripeClient;

/// A created user, with the only copy of their API key.
#[derive(Debug, Clone, Serialize)]
pub struct CreatedUser {
    /// `users.id`.
    pub id: i64,
    /// The email.
    pub email: String,
    /// The gateway customer.
    pub stripe_customer_id: String,
    /// The API key: shown now, never again.
    pub api_key: String,
}

/// Why a user could not be created.
#[derive(Debug, thiserror::Error)]
pub enum CreateUserError {
    /// The email is malformed.
    #[error(
        "invalid email {0:?}: expected something like name@example.com, at most 254 characters"
    )]
    InvalidEmail(String),
    /// A user with this email exists.
    #[error("a user with email {0:?} already exists")]
    Duplicate(String),
    /// The gateway refused the customer or did not answer.
    #[error("create the customer at the payment gateway: {0}")]
    Gateway(#[from] crate::stripe::ChargeError),
    /// The database failed.
    #[error("store the user: {0}")]
    Database(#[from] sqlx::Error),
}

/// Creates the gateway customer with card `source`, then the user.
///
/// The customer is created under an idempotency key derived from the email, so running the
/// command again after a failure reuses the same customer instead of making a second one.
pub async fn create_user(
    pool: &PgPool,
    stripe: &StripeClient,
    email: &str,
    source: &str,
) -> Result<CreatedUser, CreateUserError> {
    let valid = (3..=254).contains(&email.len())
        && email
            .split_once('@')
            .is_some_and(|(a, b)| !a.is_empty() && !b.is_empty())
        && !email.chars().any(char::is_whitespace);
    if !valid {
        return Err(CreateUserError::InvalidEmail(email.to_owned()));
    }
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM users WHERE email = $1)")
        .bind(email)
        .fetch_one(pool)
        .await?;
    if exists {
        return Err(CreateUserError::Duplicate(email.to_owned()));
    }
    let gateway_key = format!(
        "rocket-rides:customer:{}:{source}",
        hex::encode(Sha256::digest(email))
    );
    let customer = stripe.create_customer(email, source, &gateway_key).await?;
    let api_key = generate_api_key();
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO users (email, api_key_hash, stripe_customer_id) VALUES ($1, $2, $3)
         RETURNING id",
    )
    .bind(email)
    .bind(hash_api_key(&api_key).as_slice())
    .bind(&customer.id)
    .fetch_one(pool)
    .await
    .map_err(|e| match &e {
        sqlx::Error::Database(db) if db.constraint() == Some("users_email_key") => {
            CreateUserError::Duplicate(email.to_owned())
        }
        _ => CreateUserError::Database(e),
    })?;
    Ok(CreatedUser {
        id,
        email: email.to_owned(),
        stripe_customer_id: customer.id,
        api_key,
    })
}
