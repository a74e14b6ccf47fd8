//! The key a request claimed, for its handler to see.

use axum::extract::FromRequestParts;
use http::request::Parts;
use http::StatusCode;
use idempotency::{IdempotencyKey, Lease, OneStep, Owner, Uuid};

use crate::problem::{types, Problem};

/// Detail of the 500 of a handler that asks for its [`ClaimedKey`] without an
/// [`IdempotencyLayer`](super::IdempotencyLayer) in front of it.
pub const NOT_CLAIMED_DETAIL: &str = "the request failed";

/// The key the layer claimed for this request: put in the request's extensions before the
/// handler runs, so that the handler can name its work after it.
///
/// It is an extractor (a handler without the layer in front of it answers 500, and the cause
/// goes to the log); `Extension<ClaimedKey>` reads it too.
///
/// ```
/// use idempotency_axum::ClaimedKey;
///
/// async fn create_transfer(claimed: ClaimedKey) -> String {
///     // The same on every retry of this request, and unique across databases: a foreign
///     // system called under it does its work once.
///     let foreign_key = format!("notify-{}", claimed.request_uuid());
///     tracing::info!(key = %claimed.key(), attempt = claimed.attempt(), "transfer");
///     foreign_key
/// }
/// ```
#[derive(Debug, Clone)]
pub struct ClaimedKey {
    key_id: i64,
    request_uuid: Uuid,
    owner: Owner,
    key: IdempotencyKey,
    attempt: i32,
}

impl ClaimedKey {
    pub(super) fn new(lease: &Lease<OneStep>, key: IdempotencyKey) -> Self {
        Self {
            key_id: lease.key_id(),
            request_uuid: lease.request_uuid(),
            owner: lease.owner().clone(),
            key,
            attempt: lease.attempts(),
        }
    }

    /// The key row's id ([`Lease::key_id`]), stable while the key lives: for the application's
    /// own rows (a foreign key to the key row). Use [`ClaimedKey::request_uuid`] for anything
    /// another system sees.
    pub fn key_id(&self) -> i64 {
        self.key_id
    }

    /// The request's random identifier ([`Lease::request_uuid`]), stable while the key lives,
    /// so the same on every retry that reruns the handler, and unique across databases: derive
    /// foreign idempotency keys from it.
    pub fn request_uuid(&self) -> Uuid {
        self.request_uuid
    }

    /// Whose key it is: what the layer's scope gave.
    pub fn owner(&self) -> &Owner {
        &self.owner
    }

    /// The client's key, as it sent it (unquoted).
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// Which run of the handler under this key this is: 1 at first, and one more each time a
    /// retry takes the key again after a released or expired lease ([`Lease::attempts`]).
    pub fn attempt(&self) -> i32 {
        self.attempt
    }
}

impl<S: Send + Sync> FromRequestParts<S> for ClaimedKey {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Self>().cloned().ok_or_else(|| {
            tracing::error!(
                path = parts.uri.path(),
                "a handler asks for its ClaimedKey, but no IdempotencyLayer is in front of it"
            );
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                types::HANDLER_FAILED,
                "Internal error",
            )
            .with_detail(NOT_CLAIMED_DETAIL)
        })
    }
}
