//! The completer: finishes requests whose clients gave up or whose processes died.
//!
//! It claims abandoned keys exactly as a request would (a new fencing token each) and runs the
//! request's own phase machine, [`booking::run`], from the stored parameters. A key whose attempt
//! fails transiently is released with an exponential backoff and tried again later, for as long
//! as it takes: the completer never drops a key and never invents an outcome for it.

use std::time::Duration;

use idempotency::Lease;
use tokio::task::JoinSet;

use crate::booking::{self, BookingError, RidePoint};
use crate::config::WorkerArgs;
use crate::metrics::CompleterOutcome;
use crate::ride::RIDES_ROUTE;
use crate::state::AppState;

/// What one pass did, for logs and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// Keys claimed.
    pub claimed: usize,
    /// Keys driven to a final state (a stored 201, 402 or 502).
    pub finished: usize,
    /// Keys released with a backoff after a failed attempt.
    pub retried: usize,
    /// Keys whose lease another holder took during the attempt.
    pub lost: usize,
    /// Keys claimed whose recovery point this build does not know.
    pub undecodable: usize,
}

/// The backoff after a completer's `completer_attempts`-th attempt at a key failed: `base`,
/// doubled with every further completer attempt, capped at `max`. The client's own retries do
/// not count: they are not the completer's failures.
pub fn backoff(completer_attempts: i32, base: Duration, max: Duration) -> Duration {
    let doublings = completer_attempts.saturating_sub(1).clamp(0, 30) as u32;
    base.saturating_mul(1 << doublings).min(max)
}

/// One pass: claims abandoned keys of `POST /rides` a few at a time (as many as it works at
/// once, so that no claimed key waits with a live lease nobody works) and runs each, until a
/// round comes back short or the batch is done.
pub async fn run_once(
    state: &AppState,
    settings: &WorkerArgs,
) -> Result<Report, idempotency::Error> {
    let mut report = Report::default();
    let round = i64::from(settings.completer_concurrency);
    while (report.claimed as i64) < settings.completer_batch {
        let want = round.min(settings.completer_batch - report.claimed as i64);
        let claimed = state
            .store
            .claim_abandoned::<RidePoint>("POST", RIDES_ROUTE, settings.completer_grace, want)
            .await?;
        let got = claimed.len() as i64;
        report.claimed += claimed.len();
        let mut tasks = JoinSet::new();
        for lease in claimed {
            match lease {
                Ok(lease) => {
                    let (state, settings) = (state.clone(), settings.clone());
                    tasks.spawn(async move { complete(&state, &settings, lease).await });
                }
                Err(e) => {
                    // Code and data disagree (a recovery point this build does not know). The
                    // key's lease expires on its own; say so loudly.
                    tracing::error!(error = %e, "completer cannot resume a key");
                    report.undecodable += 1;
                }
            }
        }
        while let Some(outcome) = tasks.join_next().await {
            match outcome {
                Ok(Outcome::Finished) => report.finished += 1,
                Ok(Outcome::Retried) => report.retried += 1,
                Ok(Outcome::Lost) => report.lost += 1,
                // A panicking task leaves its lease to expire; the key is retried after it.
                Err(e) => tracing::error!(error = %e, "completer task panicked"),
            }
        }
        if got < want {
            break;
        }
    }
    if report.claimed > 0 {
        tracing::info!(?report, "completer pass");
    }
    state.metrics.completer_pass([
        (CompleterOutcome::Claimed, report.claimed),
        (CompleterOutcome::Finished, report.finished),
        (CompleterOutcome::Retried, report.retried),
        (CompleterOutcome::Lost, report.lost),
        (CompleterOutcome::Undecodable, report.undecodable),
    ]);
    Ok(report)
}

enum Outcome {
    Finished,
    Retried,
    Lost,
}

async fn complete(state: &AppState, settings: &WorkerArgs, mut lease: Lease<RidePoint>) -> Outcome {
    let key_id = lease.key_id();
    let attempts = lease.completer_attempts();
    let mut giving_up = state.giving_up.clone();
    let outcome = tokio::select! {
        outcome = booking::run(state, &mut lease, None) => outcome,
        _ = giving_up.wait() => Err(BookingError::GivenUp),
    };
    let error = match outcome {
        Ok(response) => {
            tracing::info!(key_id, status = response.status, "completer finished a key");
            return Outcome::Finished;
        }
        Err(BookingError::LeaseLost(e)) => {
            state.metrics.lease_lost();
            tracing::info!(key_id, error = %e, "another holder took the key over");
            return Outcome::Lost;
        }
        Err(
            e @ (BookingError::GatewayUnavailable(_)
            | BookingError::GatewayMisconfigured(_)
            | BookingError::PaymentPending(_)
            | BookingError::Unconfirmed { .. }
            | BookingError::Internal(_)
            | BookingError::GivenUp
            | BookingError::Crashed(_)),
        ) => e,
    };
    if let BookingError::GatewayMisconfigured(why) = &error {
        // Ours to fix, as on the API's path: an error, whatever the key.
        tracing::error!(key_id, error = %why, "payment gateway misconfigured");
    }
    let mut wait = backoff(
        attempts,
        settings.completer_backoff,
        settings.completer_backoff_max,
    );
    if let BookingError::Unconfirmed { retry_after } = &error {
        // Nothing can be decided before then: come back no sooner.
        wait = wait.max(*retry_after);
    }
    // Loud: a key that keeps failing is visible here and in `rocket-rides keys list --unfinished`.
    tracing::warn!(
        key_id,
        completer_attempts = attempts,
        error = %error,
        retry_in = ?wait,
        "completer attempt failed"
    );
    match state.store.release_with_backoff(lease, wait).await {
        Ok(()) => Outcome::Retried,
        Err(e) => {
            tracing::warn!(key_id, error = %e, "could not release the key; it expires instead");
            Outcome::Retried
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_with_the_completers_attempts_and_is_capped() {
        let (base, max) = (Duration::from_secs(5), Duration::from_secs(60));
        assert_eq!(backoff(1, base, max), Duration::from_secs(5));
        assert_eq!(backoff(2, base, max), Duration::from_secs(10));
        assert_eq!(backoff(3, base, max), Duration::from_secs(20));
        assert_eq!(backoff(5, base, max), Duration::from_secs(60));
        assert_eq!(backoff(i32::MAX, base, max), Duration::from_secs(60));
    }
}
