//! `rocket-rides worker`: the loops that finish what requests left behind.
//!
//! - [`completer`]: drives abandoned keys (client gone, process dead) to a final state with the
//!   request's own [`Booking`](crate::booking::Booking), from the stored parameters.
//! - [`reaper`]: deletes finished keys past retention; never unfinished ones.
//! - [`outbox`]: delivers the jobs that final phases staged, once in effect.
//!
//! Each loop has a `run_once` that tests and `worker --once` call directly.

pub mod completer;
pub mod outbox;
pub mod reaper;

use std::future::Future;
use std::time::Duration;

use crate::config::WorkerArgs;
use crate::shutdown::Signal;
use crate::state::AppState;

/// Why a worker pass failed.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The completer could not claim.
    #[error("completer: {0}")]
    Completer(idempotency::Error),
    /// The outbox drain failed.
    #[error(transparent)]
    Drain(#[from] outbox::DrainError),
    /// The reaper could not delete.
    #[error("reaper: {0}")]
    Reaper(idempotency::Error),
}

/// Runs every loop once, in order: completer, drain (so that receipts of the keys just finished
/// go out too), reaper.
pub async fn run_once(state: &AppState, settings: &WorkerArgs) -> Result<(), WorkerError> {
    let completed = completer::run_once(state, settings)
        .await
        .map_err(WorkerError::Completer)?;
    let delivered = outbox::run_once(state, settings.drain_batch).await?;
    let reaped = reaper::run_once(state, settings)
        .await
        .map_err(WorkerError::Reaper)?;
    tracing::info!(?completed, ?delivered, reaped, "worker pass done");
    Ok(())
}

/// Runs every loop until `stopping` fires; in-flight completer work then runs until `giving_up`
/// (passed to it through `state.giving_up`) and releases its leases.
pub async fn run(state: &AppState, settings: &WorkerArgs, stopping: Signal) {
    tokio::join!(
        every(settings.completer_interval, stopping.clone(), || {
            completer::run_once(state, settings)
        }),
        every(settings.drain_interval, stopping.clone(), || {
            outbox::run_once(state, settings.drain_batch)
        }),
        every(settings.reaper_interval, stopping, || reaper::run_once(
            state, settings
        )),
    );
}

/// Calls `pass` every `interval` until `stopping` fires. A failing pass is logged and retried at
/// the next tick: a database that is briefly away must not end the worker.
async fn every<F, Fut, T, E>(interval: Duration, mut stopping: Signal, mut pass: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    while !stopping.is_set() {
        if let Err(e) = pass().await {
            tracing::error!(error = %e, "worker pass failed");
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = stopping.wait() => {}
        }
    }
}
