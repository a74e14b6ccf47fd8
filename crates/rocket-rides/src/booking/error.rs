//! Why a booking's step stopped short of its next point, and what the step driver is told: a
//! transient failure of a kind the handler answers apart (its problem type), or a store error
//! the driver classifies itself (a lost lease, an unconfirmed commit or renewal).

use std::time::Duration;

use idempotency::Halt;

use crate::problem::{types, GATEWAY_RETRY_AFTER, PENDING_RETRY_AFTER};

/// Why a booking stopped without a final response.
#[derive(Debug, thiserror::Error)]
pub enum BookingError {
    /// The key store refused or lost something (the lease, a commit): the driver decides.
    #[error(transparent)]
    Store(#[from] idempotency::Error),
    /// The gateway did not answer or is unavailable. The charge may exist; resume later.
    #[error("payment gateway unavailable: {0}")]
    GatewayUnavailable(String),
    /// The gateway refused our credentials or its certificate is not trusted: ours to fix.
    #[error("payment gateway misconfigured: {0}")]
    GatewayMisconfigured(String),
    /// The charge exists but is still `pending` at the gateway; resume later.
    #[error("charge {0} is pending at the gateway")]
    PaymentPending(String),
    /// Whether the gateway charged cannot be known yet: a call under the key may still be
    /// running there. The list that tells is made in `retry_after`.
    #[error("the charge's outcome is unconfirmed; reconciling in {retry_after:?}")]
    Unconfirmed {
        /// When the list can be made.
        retry_after: Duration,
    },
    /// Anything else: a database failure, a broken invariant.
    #[error("{0}")]
    Internal(String),
    /// The process is shutting down and gave the request up before it finished.
    #[error("given up at shutdown")]
    GivenUp,
}

/// The kind of a booking's transient failure ([`Halt::kind`]) is the problem type its answer
/// carries; [`crate::handlers::rides`] turns each back into its answer.
impl From<BookingError> for Halt {
    fn from(e: BookingError) -> Self {
        let e = match e {
            BookingError::Store(e) => return Halt::from(e),
            other => other,
        };
        let (kind, after) = match &e {
            BookingError::Store(_) => unreachable!("handed to the driver just above"),
            BookingError::GatewayUnavailable(_) => {
                (types::GATEWAY_UNAVAILABLE, GATEWAY_RETRY_AFTER)
            }
            BookingError::GatewayMisconfigured(why) => {
                // Ours to fix, not the client's: loud in the log, counted in
                // gateway_charges_total (outcome "misconfigured"), and a plain 503 to the
                // client, who may retry.
                tracing::error!(error = %why, "payment gateway misconfigured");
                (types::GATEWAY_UNAVAILABLE, GATEWAY_RETRY_AFTER)
            }
            BookingError::PaymentPending(_) => (types::PAYMENT_PENDING, PENDING_RETRY_AFTER),
            BookingError::Unconfirmed { retry_after } => (types::PAYMENT_UNCONFIRMED, *retry_after),
            BookingError::GivenUp => (types::SHUTTING_DOWN, GATEWAY_RETRY_AFTER),
            // Retried by the completer at once; answered 500.
            BookingError::Internal(_) => (types::INTERNAL, Duration::ZERO),
        };
        Halt::retry(e).kind(kind).after(after)
    }
}

impl From<sqlx::Error> for BookingError {
    fn from(e: sqlx::Error) -> Self {
        Self::Internal(e.to_string())
    }
}

/// A statement's error, with what it was for.
pub(crate) fn db(context: &'static str) -> impl FnOnce(sqlx::Error) -> BookingError {
    move |e| BookingError::Internal(format!("{context}: {e}"))
}
