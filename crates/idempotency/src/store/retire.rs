//! Retirement: a final answer for keys that nothing will ever finish.
//!
//! A request that runs its work once, with no recovery points a completer could resume from (a
//! one-step handler behind the HTTP layer), leaves its key unfinished when its process dies
//! after the claim and its client never returns. Its client's retry would run it again; without
//! one, nothing does. [`Store::retire_abandoned`] gives such keys, once they have been left
//! alone long enough, a stored final answer that the application chose (typically a 500 that
//! says the outcome is unknown): the key finishes, leaves the unfinished keys' gauge, and a late
//! retry gets that answer instead of a second run.

use std::time::Duration;

use super::model::{OneStep, Store};
use crate::{Error, StoredResponse};

impl Store {
    /// Finishes with `answer` the keys whose stored parameters carry the top-level member `tag`
    /// (the mark their writer put on them) that are unfinished, whose lease is free or over,
    /// and that were last attempted more than `after` ago; returns how many.
    ///
    /// Each is claimed like a completer claims ([`Store::claim_abandoned`], a fresh fencing token,
    /// `SKIP LOCKED`), at most `limit` per route, and then finished in a final phase: a holder
    /// still alive, or a client's retry that took the key meanwhile, is never overwritten, and a
    /// stale holder's later write is fenced out. Only marked keys are retired, and only those
    /// last attempted more than `after` ago, by anyone: a key another writer left on the same
    /// route (a workflow's, which its completer finishes) is never touched, nor a key a
    /// completer tried within `after`. Mark only keys whose requests cannot be resumed.
    pub async fn retire_abandoned(
        &self,
        tag: &str,
        after: Duration,
        answer: &StoredResponse,
        limit: i64,
    ) -> Result<u64, Error> {
        let context = || format!("find abandoned keys marked {tag:?} to retire");
        let after_millis = after.as_millis().min(i64::MAX as u128) as i64;
        let mut db = self.autocommit().await.map_err(Error::db(context()))?;
        let routes: Vec<(String, String)> = sqlx::query_as(
            r#"
            -- all users: the routes of the marked keys to retire, from the small table of
            -- unfinished keys; each route's keys are then claimed by user, as a completer does.
            SELECT DISTINCT k.request_method, k.request_path
            FROM idempotency_keys_unfinished u
            JOIN idempotency_keys k ON k.owner = u.owner AND k.id = u.key_id
            WHERE k.finished_at IS NULL
              AND k.request_params ? $1
              AND (k.locked_until IS NULL OR k.locked_until <= coalesce($2::timestamptz, now()))
              AND k.last_run_at <= coalesce($2::timestamptz, now()) - $3 * interval '1 millisecond'
            LIMIT 1000
            "#,
        )
        .bind(tag)
        .bind(self.now())
        .bind(after_millis)
        .persistent(self.persistent())
        .fetch_all(db.conn())
        .await
        .map_err(Error::db(context()))?;
        db.done().await.map_err(Error::db(context()))?;
        let mut retired = 0;
        for (method, route) in routes {
            for lease in self
                .claim_abandoned_marked::<OneStep>(&method, &route, after, limit, Some(tag))
                .await?
            {
                let mut lease = match lease {
                    Ok(lease) => lease,
                    Err(e) => {
                        tracing::warn!(error = %e, method, route, "a key to retire is unreadable");
                        continue;
                    }
                };
                let key_id = lease.key_id();
                self.final_phase(&mut lease).await?.finish(answer).await?;
                tracing::warn!(
                    key_id,
                    method,
                    route,
                    status = answer.status,
                    "retired an abandoned key: its request was never finished and no retry came"
                );
                retired += 1;
            }
        }
        Ok(retired)
    }
}
