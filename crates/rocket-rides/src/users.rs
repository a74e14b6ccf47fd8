//! Creating users: a gateway customer with their card, an API key, a row.

use std::sync::Arc;

use idempotency::{DatabaseClock, Store};
use serde::Serialize;
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

/// Creates the user and its gateway customer with card `source`.
///
/// The user row comes first, incomplete (no customer, no API key), with a random
/// `customer_key`; the customer is created under a gateway key derived from it, then the row is
/// completed. Running the command again after a failure finds the incomplete row and asks the
/// gateway again under the same key, so it gets the same customer instead of a second one; and
/// two databases on one gateway account never share a customer key, as they would if it were
/// derived from the email.
pub async fn create_user(
    pool: &PgPool,
    stripe: &StripeClient,
    email: &str,
    source: &str,
) -> Result<CreatedUser, CreateUserError> {
    // The default lease TTL is one the store accepts; the store here sends two statements and
    // holds no lease.
    let store = Store::new(
        pool.clone(),
        Arc::new(DatabaseClock),
        idempotency::DEFAULT_LEASE_TTL,
    )
    .expect("the default lease TTL is valid");
    create_user_on(&store, stripe, email, source).await
}

/// [`create_user`] with the statements of `store` (unnamed, each in a transaction of its own,
/// behind a transaction pooler: `--database-pooler transaction`), on its pool.
pub async fn create_user_on(
    store: &Store,
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
    // A complete user with this email refuses; an incomplete one (an earlier run that failed)
    // is taken up again. `ON CONFLICT … WHERE` returns no row for a complete user.
    let mut db = store.autocommit().await?;
    let mut pg = store.statements_on(db.conn());
    let row: Option<(i64, idempotency::Uuid)> = sqlx::query_as(
        "INSERT INTO users (email) VALUES ($1)
         ON CONFLICT (email) DO UPDATE SET email = excluded.email
         WHERE users.stripe_customer_id IS NULL
         RETURNING id, customer_key",
    )
    .bind(email)
    .fetch_optional(&mut pg)
    .await?;
    db.done().await?;
    let Some((id, customer_key)) = row else {
        return Err(CreateUserError::Duplicate(email.to_owned()));
    };
    let gateway_key = format!("rocket-rides:customer:{customer_key}:{source}");
    let customer = stripe.create_customer(email, source, &gateway_key).await?;
    let api_key = generate_api_key();
    let mut db = store.autocommit().await?;
    let mut pg = store.statements_on(db.conn());
    let completed = sqlx::query(
        "UPDATE users SET stripe_customer_id = $2, api_key_hash = $3
         WHERE id = $1 AND stripe_customer_id IS NULL",
    )
    .bind(id)
    .bind(&customer.id)
    .bind(hash_api_key(&api_key).as_slice())
    .execute(&mut pg)
    .await?;
    db.done().await?;
    if completed.rows_affected() == 0 {
        // A concurrent run with the same email completed the user first.
        return Err(CreateUserError::Duplicate(email.to_owned()));
    }
    Ok(CreatedUser {
        id,
        email: email.to_owned(),
        stripe_customer_id: customer.id,
        api_key,
    })
}

/// A user's new API key, after `users rotate-key`.
#[derive(Debug, Clone, Serialize)]
pub struct RotatedKey {
    /// `users.id`.
    pub id: i64,
    /// The email.
    pub email: String,
    /// The new API key: shown now, never again.
    pub api_key: String,
}

/// Why a key could not be rotated.
#[derive(Debug, thiserror::Error)]
pub enum RotateKeyError {
    /// No complete user has this email.
    #[error("no user with email {0:?} has an API key (see `users create`)")]
    NoSuchUser(String),
    /// The database failed.
    #[error("store the new API key: {0}")]
    Database(#[from] sqlx::Error),
    /// The commit's wait for the synchronous standby was cancelled, or it failed: the new key
    /// may be stored or not, and a failover may bring the old one back.
    #[error(
        "the rotation may or may not have been stored ({0}); the new key is not shown: run \
         rotate-key again, and use the key it prints"
    )]
    Unconfirmed(idempotency::Error),
}

/// Replaces the API key of the user with this email by a new one: the old key is refused as soon
/// as every serving process's cached look-up of it has expired (`--api-key-cache-ttl`, 5 s by
/// default). A user that `users create` did not complete has no key to rotate, and is left alone.
pub async fn rotate_api_key(store: &Store, email: &str) -> Result<RotatedKey, RotateKeyError> {
    let api_key = generate_api_key();
    // A transaction of its own, committed under the commit watch: a revocation that a failover
    // may lose must not be reported done, or the old key would come back with it.
    let mut tx = store.pool().begin().await?;
    let mut pg = store.statements_on(&mut *tx);
    let id: Option<i64> = sqlx::query_scalar(
        "UPDATE users SET api_key_hash = $2
         WHERE email = $1 AND stripe_customer_id IS NOT NULL
         RETURNING id",
    )
    .bind(email)
    .bind(hash_api_key(&api_key).as_slice())
    .fetch_optional(&mut pg)
    .await?;
    let Some(id) = id else {
        return Err(RotateKeyError::NoSuchUser(email.to_owned()));
    };
    idempotency::commit_watch::commit(tx, "rotate the API key")
        .await
        .map_err(RotateKeyError::Unconfirmed)?;
    Ok(RotatedKey {
        id,
        email: email.to_owned(),
        api_key,
    })
}
