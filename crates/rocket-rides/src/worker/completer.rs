//! The completer: finishes requests whose clients gave up or whose processes died.
//!
//! It is the library's [`Completer`] over `POST /rides`, with the request's own phase machine,
//! [`booking::run`], as the closure: each abandoned key is claimed exactly as a request would
//! claim it (a new fencing token each) and resumed from the stored parameters. A key whose
//! attempt fails transiently is released with an exponential backoff and tried again later, for
//! as long as it takes: the completer never drops a key and never invents an outcome for it.

use std::time::Duration;

use idempotency::{Completer, Lease, Resumed};

use crate::booking::{self, BookingError, RidePoint};
use crate::config::WorkerArgs;
use crate::metrics::CompleterOutcome;
use crate::ride::RIDES_ROUTE;
use crate::state::AppState;

/// What one pass did, for logs and tests.
pub type Report = idempotency::Pass;

/// One pass: claims abandoned keys of `POST /rides` a few at a time and resumes each.
pub async fn run_once(
    state: &AppState,
    settings: &WorkerArgs,
) -> Result<Report, idempotency::Error> {
    let completer = Completer::new(state.store.clone(), "POST", RIDES_ROUTE)
        .try_grace(settings.completer_grace)?
        .batch(usize::try_from(settings.completer_batch).unwrap_or(1))
        .concurrency(settings.completer_concurrency as usize)
        .backoff(settings.completer_backoff, settings.completer_backoff_max);
    let shared = state.clone();
    let report = completer
        .run_once(move |lease| {
            let state = shared.clone();
            async move { resume(&state, lease).await }
        })
        .await?;
    state.metrics.completer_pass([
        (CompleterOutcome::Claimed, report.claimed),
        (CompleterOutcome::Finished, report.finished),
        (CompleterOutcome::Retried, report.retried),
        (CompleterOutcome::Lost, report.lost),
        (CompleterOutcome::Undecodable, report.undecodable),
        (CompleterOutcome::Panicked, report.panicked),
    ]);
    Ok(report)
}

/// Runs the booking from the key's recovery point, until it ends or the process gives up.
async fn resume(state: &AppState, mut lease: Lease<RidePoint>) -> Resumed<RidePoint> {
    let key_id = lease.key_id();
    let mut giving_up = state.giving_up.clone();
    let outcome = tokio::select! {
        outcome = booking::run(state, &mut lease, None) => outcome,
        _ = giving_up.wait() => Err(BookingError::GivenUp),
    };
    let error = match outcome {
        Ok(response) => {
            tracing::info!(key_id, status = response.status, "completer finished a key");
            return Resumed::Finished;
        }
        Err(BookingError::LeaseLost(_)) => {
            state.metrics.lease_lost();
            return Resumed::Lost;
        }
        Err(
            e @ (BookingError::GatewayUnavailable(_)
            | BookingError::GatewayMisconfigured(_)
            | BookingError::PaymentPending(_)
            | BookingError::Unconfirmed { .. }
            | BookingError::CommitUnconfirmed(_)
            | BookingError::Internal(_)
            | BookingError::GivenUp
            | BookingError::Crashed(_)),
        ) => e,
    };
    if let BookingError::GatewayMisconfigured(why) = &error {
        // Ours to fix, as on the API's path: an error, whatever the key.
        tracing::error!(key_id, error = %why, "payment gateway misconfigured");
    }
    // Nothing can be decided before then: come back no sooner.
    let not_before = match &error {
        BookingError::Unconfirmed { retry_after } => *retry_after,
        _ => Duration::ZERO,
    };
    Resumed::Failed {
        lease,
        error: error.to_string(),
        not_before,
    }
}
