//! The key's own transaction, handed to the handler in the layer's transactional mode.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use axum::extract::FromRequestParts;
use http::request::Parts;
use http::StatusCode;
use idempotency::{OneStep, OwnedFinalPhase};
use sqlx::PgConnection;
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};

use crate::problem::{types, Problem};

/// Detail of the 500 of a handler that asks for a [`KeyTransaction`] without a transactional
/// [`IdempotencyLayer`](super::IdempotencyLayer) in front of it, or uses one after it returned.
pub const NO_TRANSACTION_DETAIL: &str = "the request failed";

/// The transaction that holds the request's key, for the handler to write through, in the
/// layer's transactional mode ([`IdempotencyLayer::transactional`]).
///
/// Every write made through [`KeyTransaction::conn`] commits together with the answer the layer
/// stores for the key, or not at all: a retry finds the answer and the writes, or neither. The
/// layer commits or rolls back once the handler has returned; the handler never does (no
/// `COMMIT`, no `ROLLBACK`; a savepoint, `sqlx::Connection::begin` on the connection, is fine).
///
/// It is an extractor: without a transactional layer in front of the handler, it answers 500
/// (the cause goes to the log).
///
/// ```
/// use axum::extract::Path;
/// use http::StatusCode;
/// use idempotency_axum::{ClaimedKey, KeyTransaction, Problem};
///
/// async fn deposit(
///     Path(account): Path<i64>,
///     claimed: ClaimedKey,
///     tx: KeyTransaction,
/// ) -> Result<StatusCode, Problem> {
///     sqlx::query("INSERT INTO deposits (account_id, key_id, amount_cents) VALUES ($1, $2, 500)")
///         .bind(account)
///         .bind(claimed.key_id())
///         .execute(&mut *tx.conn().await?)
///         .await
///         .map_err(|e| {
///             tracing::error!(error = %e, "deposit failed");
///             Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "about:blank", "Internal error")
///         })?;
///     Ok(StatusCode::CREATED)
/// }
/// ```
///
/// Keep no clone of it past the handler's return (in a spawned task, say): the layer then
/// cannot tell what the handler still writes, rolls everything back and answers 500.
///
/// [`IdempotencyLayer::transactional`]: super::IdempotencyLayer::transactional
#[derive(Debug, Clone)]
pub struct KeyTransaction {
    /// `None` once the layer took the phase back.
    phase: Arc<Mutex<Option<OwnedFinalPhase<OneStep>>>>,
}

/// The connection of a [`KeyTransaction`], locked for the holder of this guard: write with
/// `&mut *conn`. Other users of the transaction (other clones) wait until it is dropped.
#[derive(Debug)]
pub struct KeyConnection<'t>(MappedMutexGuard<'t, PgConnection>);

impl Deref for KeyConnection<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.0
    }
}

impl DerefMut for KeyConnection<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.0
    }
}

/// What the layer gets back of the transaction once the handler has returned.
pub(super) enum Returned {
    /// The handler kept nothing of it: the phase, to finish or roll back.
    Alone(OwnedFinalPhase<OneStep>),
    /// The handler kept a clone, idle: the phase was taken from it, to roll back.
    Kept(OwnedFinalPhase<OneStep>),
    /// A clone the handler kept holds the connection right now: the transaction ends (rolled
    /// back) when its last clone is dropped, and the key waits for its lease to expire.
    Busy,
}

impl KeyTransaction {
    pub(super) fn new(phase: OwnedFinalPhase<OneStep>) -> Self {
        Self {
            phase: Arc::new(Mutex::new(Some(phase))),
        }
    }

    /// Locks the transaction's connection for the caller. Fails (500) when the handler has
    /// returned already (the layer took the transaction back), and when a guard is held
    /// already: one connection runs one statement at a time, and a handler that asked again
    /// while holding one would otherwise wait for ever, with the key row locked. Keep one guard
    /// for the handler's statements, or drop each before the next.
    pub async fn conn(&self) -> Result<KeyConnection<'_>, Problem> {
        let Ok(phase) = self.phase.try_lock() else {
            tracing::error!(
                "a KeyTransaction's connection is asked for while a guard of it is held; \
                 drop the guard first"
            );
            return Err(internal());
        };
        MutexGuard::try_map(phase, |phase| phase.as_mut().map(OwnedFinalPhase::conn))
            .map(KeyConnection)
            .map_err(|_| {
                tracing::error!(
                    "a KeyTransaction is used after its handler returned; the layer has \
                     settled its key"
                );
                internal()
            })
    }

    /// Takes the phase back from the handler, which has returned: its future, and every clone
    /// it held, has been dropped, unless it handed one on.
    pub(super) fn take_back(self) -> Returned {
        match Arc::try_unwrap(self.phase) {
            Ok(phase) => phase.into_inner().map_or(Returned::Busy, Returned::Alone),
            Err(shared) => match shared.try_lock() {
                Ok(mut phase) => phase.take().map_or(Returned::Busy, Returned::Kept),
                Err(_) => Returned::Busy,
            },
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for KeyTransaction {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Self>().cloned().ok_or_else(|| {
            tracing::error!(
                path = parts.uri.path(),
                "a handler asks for its KeyTransaction, but no IdempotencyLayer in transactional \
                 mode (IdempotencyLayer::transactional) is in front of it"
            );
            internal()
        })
    }
}

fn internal() -> Problem {
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        types::HANDLER_FAILED,
        "Internal error",
    )
    .with_detail(NO_TRANSACTION_DETAIL)
}
