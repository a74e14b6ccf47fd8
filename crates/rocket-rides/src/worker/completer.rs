//! The completer: finishes requests whose clients gave up or whose processes died.
//!
//! It claims abandoned keys exactly as a request would (a new fencing token each) and runs the
//! request's own phase machine, [`booking::run`], from the stored parameters. A key whose attempt
//! fails transiently is released with an exponential backoff and tried again later, for as long
//! as it takes: the completer never drops a key and never invents an outcome for it.

use std::sync::Arc;
use std::time::Duration;

use idempotency::Lease;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::app::AppState;
use crate::booking::{self, BookingError, RidePoint};
use crate::config::WorkerArgs;

/// What one pass did, for logs and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// Keys claimed.
    pub claimed: usize,
    /// Keys driven to a final state (a stored 201 or 402).
    pub finished: usize,
    /// Keys released with a backoff after a failed attempt.
    pub retried: usize,
    /// Keys whose lease another holder took during the attempt.
    pub lost: usize,
}

/// The backoff after the `attempts`-th acquisition of a key failed: `base`, doubled per attempt
/// after the first completer attempt, capped at `max`.
pub fn backoff(attempts: i32, base: Duration, max: Duration) -> Duration {
    let doublings = attempts.saturating_sub(2).clamp(0, 30) as u32;
    base.saturating_mul(1 << doublings).min(max)
}

/// One pass: claim a batch of abandoned keys and work them, a few at a time.
pub async fn run_once(
    state: &AppState,
    settings: &WorkerArgs,
) -> Result<Report, idempotency::Error> {
    let leases: Vec<Lease<RidePoint>> = state
        .store
        .claim_abandoned(settings.completer_grace, settings.completer_batch)
        .await?;
    let mut report = Report {
        claimed: leases.len(),
        ..Report::default()
    };
    let permits = Arc::new(Semaphore::new(settings.completer_concurrency as usize));
    let mut tasks = JoinSet::new();
    for lease in leases {
        let (state, settings, permits) = (state.clone(), settings.clone(), permits.clone());
        tasks.spawn(async move {
            // The semaphore lives as long as this pass and is never closed.
            let _permit = permits.acquire_owned().await.expect("semaphore is open");
            complete(&state, &settings, lease).await
        });
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
    if report.claimed > 0 {
        tracing::info!(?report, "completer pass");
    }
    Ok(report)
}

enum Outcome {
    Finished,
    Retried,
    Lost,
}

async fn complete(state: &AppState, settings: &WorkerArgs, mut lease: Lease<RidePoint>) -> Outcome {
    let key_id = lease.key_id();
    let attempts = lease.attempts();
    let mut giving_up = state.giving_up.clone();
    let outcome = tokio::select! {
        outcome = booking::run(state, &mut lease) => outcome,
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
        Err(e) => e,
    };
    let wait = backoff(
        attempts,
        settings.completer_backoff,
        settings.completer_backoff_max,
    );
    // Loud: a key that keeps failing is visible here and in `rocket-rides keys list --unfinished`.
    tracing::warn!(key_id, attempts, error = %error, retry_in = ?wait, "completer attempt failed");
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
    fn backoff_doubles_from_the_first_completer_attempt_and_is_capped() {
        let (base, max) = (Duration::from_secs(5), Duration::from_secs(60));
        // Acquisition 1 was the client's request; 2 is the completer's first attempt.
        assert_eq!(backoff(1, base, max), Duration::from_secs(5));
        assert_eq!(backoff(2, base, max), Duration::from_secs(5));
        assert_eq!(backoff(3, base, max), Duration::from_secs(10));
        assert_eq!(backoff(4, base, max), Duration::from_secs(20));
        assert_eq!(backoff(6, base, max), Duration::from_secs(60));
        assert_eq!(backoff(i32::MAX, base, max), Duration::from_secs(60));
    }
}
