//! The reaper: deletes finished keys older than the retention, in batches.
//!
//! After a key is reaped, the same key string starts a new request: a client that retries later
//! than the retention gets a second ride. Stripe documents the same for its 24-hour window; keep
//! the retention longer than any client retries.

use crate::config::WorkerArgs;
use crate::state::AppState;

/// Deletes batches until one comes back short; returns how many keys were deleted.
pub async fn run_once(state: &AppState, settings: &WorkerArgs) -> Result<u64, idempotency::Error> {
    let mut total = 0;
    loop {
        let deleted = state
            .store
            .reap_finished(settings.key_retention, settings.reaper_batch)
            .await?;
        total += deleted;
        if deleted < settings.reaper_batch as u64 {
            state.metrics.keys_reaped(total);
            return Ok(total);
        }
    }
}
