//! The outbox drain: delivers jobs that phases staged in their own transactions.
//!
//! A job row exists only if the phase that staged it committed, so nothing is sent for a request
//! that rolled back. A drain reads a batch of candidate jobs across users (no locks), then works
//! one user's jobs per transaction: it takes them with `FOR UPDATE SKIP LOCKED` (two drains split
//! the work instead of sharing it), performs each job's effect and deletes the job, and commits.
//! A crash before the commit leaves the jobs for the next drain; the effect is idempotent (a
//! receipt is unique per ride), so a delivery that is repeated changes nothing.
//!
//! A job that cannot be run (arguments that do not parse, a job name this build does not know
//! of a batch it took) is moved to `failed_jobs` with its error, in the same transaction, and the
//! others are delivered: one bad job never holds the rest back. `rocket-rides jobs list` shows
//! the failed ones.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::db::Pg;
use crate::state::AppState;

/// The job a finished ride stages.
pub const SEND_RIDE_RECEIPT: &str = "send_ride_receipt";

/// Every job this build can run.
pub const KNOWN_JOBS: [&str; 1] = [SEND_RIDE_RECEIPT];

/// Why a drain failed. Its current transaction rolled back; its jobs stay for the next drain.
#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    /// The database failed.
    #[error("drain staged jobs: {0}")]
    Database(#[from] sqlx::Error),
    /// A failpoint stopped the drain between the effect and the delete.
    #[error("crashed at failpoint {0}")]
    Crashed(&'static str),
}

/// What one drain did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    /// Jobs delivered (their effect done and the job deleted).
    pub delivered: usize,
    /// Jobs moved to `failed_jobs`.
    pub failed: usize,
}

#[derive(Deserialize)]
struct ReceiptArgs {
    ride_id: i64,
}

/// A job moved aside, as `rocket-rides jobs list` shows it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct FailedJob {
    /// The job's id.
    pub id: i64,
    /// Its owner, when known.
    pub user_id: Option<i64>,
    /// Its name.
    pub job_name: String,
    /// Its arguments, as staged.
    pub job_args: serde_json::Value,
    /// Why it cannot be run.
    pub error: String,
    /// When it was moved aside.
    #[serde(with = "time::serde::rfc3339")]
    pub failed_at: time::OffsetDateTime,
}

/// Delivers up to `batch` jobs, one user's at a time; returns what it did.
pub async fn run_once(state: &AppState, batch: i64) -> Result<Drained, DrainError> {
    let mut db = state.store.autocommit().await?;
    let mut pg = state.store.statements_on(db.conn());
    let candidates: Vec<(i64, i64, bool)> = sqlx::query_as(
        // Only the jobs this build knows: a job of a newer build waits for it without blocking
        // the others.
        "-- all users: a read of candidates, without locks; each user's are taken below.
         SELECT user_id, id, key_owner IS NULL FROM staged_jobs
         WHERE job_name = ANY($2)
         ORDER BY id LIMIT $1",
    )
    .bind(batch)
    .bind(&KNOWN_JOBS[..])
    .fetch_all(&mut pg)
    .await?;
    db.done().await?;
    // A job staged before migration 20261206100001 whose `key_owner` a `migrate` cut short did
    // not fill: each user's statements below address it by owner and would pass it over, at the
    // head of the queue, for good. Filled here, as `migrate` would have.
    if candidates.iter().any(|&(_, _, unfilled)| unfilled) {
        tracing::warn!(
            "staged jobs without key_owner (a rocket-rides migrate cut short after migration \
             20261206100001): filling every table's, as migrate does"
        );
        crate::db::fill_key_owners(&state.pool).await?;
    }
    let mut by_user: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    for (user_id, id, _) in candidates {
        by_user.entry(user_id).or_default().push(id);
    }
    let mut drained = Drained::default();
    for (user_id, ids) in by_user {
        let done = drain_user(state, user_id, &ids).await?;
        drained.delivered += done.delivered;
        drained.failed += done.failed;
    }
    state.metrics.receipts_delivered(drained.delivered as u64);
    state.metrics.jobs_failed(drained.failed as u64);
    Ok(drained)
}

/// One user's jobs, in one transaction.
async fn drain_user(state: &AppState, user_id: i64, ids: &[i64]) -> Result<Drained, DrainError> {
    let mut tx = state.pool.begin().await?;
    let mut pg = state.store.statements_on(&mut *tx);
    let jobs: Vec<(i64, String, serde_json::Value)> = sqlx::query_as(
        "SELECT id, job_name, job_args FROM staged_jobs
         WHERE user_id = $1 AND key_owner = $1::text AND id = ANY($2)
         ORDER BY id FOR UPDATE SKIP LOCKED",
    )
    .bind(user_id)
    .bind(ids)
    .fetch_all(&mut pg)
    .await?;
    let mut drained = Drained::default();
    for (id, name, args) in &jobs {
        match run_job(&mut pg, user_id, name, args).await? {
            Ok(()) => {
                let point = crate::failpoints::AFTER_RECEIPT_EFFECT;
                if crate::failpoints::before_acknowledging(&state.failpoints, point) {
                    return Err(DrainError::Crashed(point));
                }
                drained.delivered += 1;
            }
            Err(why) => {
                tracing::error!(job = id, user_id, name, error = %why, "staged job moved aside");
                sqlx::query(
                    "INSERT INTO failed_jobs (id, user_id, job_name, job_args, error, created_at)
                     SELECT id, user_id, job_name, job_args, $3, created_at FROM staged_jobs
                     WHERE user_id = $1 AND key_owner = $1::text AND id = $2",
                )
                .bind(user_id)
                .bind(id)
                .bind(truncate(&why, 1000))
                .execute(&mut pg)
                .await?;
                drained.failed += 1;
            }
        }
        sqlx::query(
            "DELETE FROM staged_jobs WHERE user_id = $1 AND key_owner = $1::text AND id = $2",
        )
        .bind(user_id)
        .bind(id)
        .execute(&mut pg)
        .await?;
    }
    tx.commit().await?;
    Ok(drained)
}

/// A job's effect; `Ok(Err(why))` for a job that can never run.
async fn run_job(
    pg: &mut Pg<'_>,
    user_id: i64,
    name: &str,
    args: &serde_json::Value,
) -> Result<Result<(), String>, DrainError> {
    match name {
        SEND_RIDE_RECEIPT => {
            let args: ReceiptArgs = match serde_json::from_value(args.clone()) {
                Ok(args) => args,
                Err(e) => return Ok(Err(format!("unreadable arguments: {e}"))),
            };
            // The effect. ON CONFLICT: a receipt already sent for this ride is not sent again (the
            // primary key, the only unique index: (user_id, ride_id) here, (key_owner, ride_id)
            // once distributed, so no conflict target is named).
            sqlx::query(
                "INSERT INTO ride_receipts (ride_id, user_id, key_owner, amount_cents, charge_id)
                 SELECT id, user_id, key_owner, amount_cents, charge_id FROM rides
                 WHERE user_id = $1 AND key_owner = $1::text AND id = $2 AND status = 'paid'
                 ON CONFLICT DO NOTHING",
            )
            .bind(user_id)
            .bind(args.ride_id)
            .execute(pg)
            .await?;
            Ok(Ok(()))
        }
        other => Ok(Err(format!("unknown job name {other:?}"))),
    }
}

/// The jobs moved aside, newest first.
pub async fn failed_jobs(pg: &mut Pg<'_>, limit: i64) -> Result<Vec<FailedJob>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, user_id, job_name, job_args, error, failed_at FROM failed_jobs
         ORDER BY failed_at DESC, id DESC LIMIT $1",
    )
    .bind(limit.clamp(1, 10_000))
    .fetch_all(pg)
    .await
}

fn truncate(text: &str, max_chars: usize) -> String {
    text.chars().take(max_chars).collect()
}
