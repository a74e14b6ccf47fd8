//! The outbox drain: delivers jobs that phases staged in their own transactions.
//!
//! A job row exists only if the phase that staged it committed, so nothing is sent for a request
//! that rolled back. The drain claims jobs with `FOR UPDATE SKIP LOCKED` (two drains split the
//! work instead of sharing it), performs each job's effect and deletes the job in one transaction.
//! A crash before the commit leaves the job for the next drain; the effect is idempotent (a
//! receipt is unique per ride), so a delivery that is repeated changes nothing.

use serde::Deserialize;

use crate::state::AppState;

/// The job a finished ride stages.
pub const SEND_RIDE_RECEIPT: &str = "send_ride_receipt";

/// Every job this build can run.
pub const KNOWN_JOBS: [&str; 1] = [SEND_RIDE_RECEIPT];

/// Why a drain failed. Its transaction rolled back; the jobs stay for the next drain.
#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    /// The database failed.
    #[error("drain staged jobs: {0}")]
    Database(#[from] sqlx::Error),
    /// A job whose arguments do not parse: its drain rolls back and says so, loudly, at every
    /// pass, until someone looks (jobs of unknown names are not selected at all).
    #[error("staged job {id} ({name}) cannot be run: {why}")]
    BadJob {
        /// The job row.
        id: i64,
        /// Its name.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// A failpoint stopped the drain between the effect and the delete.
    #[error("crashed at failpoint {0}")]
    Crashed(&'static str),
}

#[derive(Deserialize)]
struct ReceiptArgs {
    ride_id: i64,
}

/// Delivers up to `batch` jobs in one transaction; returns how many.
pub async fn run_once(state: &AppState, batch: i64) -> Result<usize, DrainError> {
    let mut tx = state.pool.begin().await?;
    let jobs: Vec<(i64, String, serde_json::Value)> = sqlx::query_as(
        // Only the jobs this build knows: a job of a newer build waits for it without blocking
        // the others.
        "SELECT id, job_name, job_args FROM staged_jobs
         WHERE job_name = ANY($2)
         ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
    )
    .bind(batch)
    .bind(&KNOWN_JOBS[..])
    .fetch_all(&mut *tx)
    .await?;
    for (id, name, args) in &jobs {
        match name.as_str() {
            SEND_RIDE_RECEIPT => {
                let args: ReceiptArgs =
                    serde_json::from_value(args.clone()).map_err(|e| DrainError::BadJob {
                        id: *id,
                        name: name.clone(),
                        why: e.to_string(),
                    })?;
                // The effect. ON CONFLICT: a receipt already sent for this ride is not sent again.
                sqlx::query(
                    "INSERT INTO ride_receipts (ride_id, user_id, amount_cents, charge_id)
                     SELECT id, user_id, amount_cents, charge_id FROM rides
                     WHERE id = $1 AND status = 'paid'
                     ON CONFLICT (ride_id) DO NOTHING",
                )
                .bind(args.ride_id)
                .execute(&mut *tx)
                .await?;
            }
            _ => {
                return Err(DrainError::BadJob {
                    id: *id,
                    name: name.clone(),
                    why: "unknown job name".into(),
                })
            }
        }
        crash_point(state)?;
        sqlx::query("DELETE FROM staged_jobs WHERE id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    state.metrics.receipts_delivered(jobs.len() as u64);
    Ok(jobs.len())
}

fn crash_point(state: &AppState) -> Result<(), DrainError> {
    let point = crate::failpoints::AFTER_RECEIPT_EFFECT;
    if crate::failpoints::hit(&state.failpoints, point) {
        return Err(DrainError::Crashed(point));
    }
    Ok(())
}
