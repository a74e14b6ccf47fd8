//! The reaper: the library's [`Reaper`], deleting finished keys older than the retention in
//! batches.
//!
//! The reaper only keeps the table small; it decides no answer. A key that finished longer ago
//! than the retention is a new request at its next claim, reaped or not (`serve`'s store takes
//! the same `--key-retention` and checks the age when it reads the key), so a client that retries
//! later than that gets a second ride. Stripe documents the same for its 24-hour window; keep the
//! retention longer than any client retries.

use idempotency::Reaper;

use crate::config::WorkerArgs;
use crate::state::AppState;

/// Deletes batches until one comes back short; returns how many keys were deleted.
pub async fn run_once(state: &AppState, settings: &WorkerArgs) -> Result<u64, idempotency::Error> {
    // The worker's store has this retention already; a test's state may not.
    let store = state.store.clone().with_retention(settings.key_retention)?;
    let total = Reaper::new(store)?
        .batch(settings.reaper_batch)
        .run_once()
        .await?;
    state.metrics.keys_reaped(total);
    Ok(total)
}
