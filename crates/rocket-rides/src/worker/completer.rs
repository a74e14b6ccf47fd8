//! The completer: finishes requests whose clients gave up or whose processes died.
//!
//! It is the library's workflow [`Completer`] over the request's own [`Booking`]: each abandoned
//! key is claimed exactly as a request would claim it (a new fencing token each) and resumed
//! from the stored parameters by the same steps. A key whose attempt fails transiently is
//! released with an exponential backoff (no sooner than the step asked: a payment unconfirmed
//! comes back once its list can be made) and tried again later, for as long as it takes: the
//! completer never drops a key and never invents an outcome for it.

use std::sync::Arc;

use idempotency::workflow::Completer;

use crate::booking::Booking;
use crate::config::WorkerArgs;
use crate::metrics::CompleterOutcome;
use crate::state::AppState;

/// What one pass did, for logs and tests.
pub type Report = idempotency::Pass;

/// One pass: claims abandoned keys of `POST /rides` a few at a time and resumes each.
pub async fn run_once(
    state: &AppState,
    settings: &WorkerArgs,
) -> Result<Report, idempotency::Error> {
    let booking = Arc::new(Booking::new(state.clone()));
    let report = Completer::new(state.store.clone(), booking)
        // `crate::config` refuses a grace at or below the lease TTL first; a state built by hand
        // meets the completer's own check.
        .grace(settings.completer_grace)?
        .batch(settings.completer_batch as usize)
        .concurrency(settings.completer_concurrency as usize)
        .backoff(settings.completer_backoff, settings.completer_backoff_max)
        .run_once()
        .await?;
    state.metrics.completer_pass([
        (CompleterOutcome::Claimed, report.claimed),
        (CompleterOutcome::Finished, report.finished),
        (CompleterOutcome::Retried, report.retried),
        (CompleterOutcome::Lost, report.lost),
        (CompleterOutcome::Undecodable, report.undecodable),
        (CompleterOutcome::Panicked, report.panicked),
    ]);
    for _ in 0..report.lost {
        state.metrics.lease_lost();
    }
    Ok(report)
}
