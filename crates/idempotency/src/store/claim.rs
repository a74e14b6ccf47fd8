//! The claim: insert the key or take its lease over, in one statement; and the read that tells
//! why a claim was refused.

use std::time::Duration;

use sqlx::types::Json;
use sqlx::Row;

use super::model::{lease_from_row, stored_response, Claim, NewRequest, RecoveryPoint, Store};
use crate::Error;

/// How often a refused claim is re-read when the row changed between the claim and the read
/// (for instance, its lease was released in between). More than a few rounds means heavy
/// contention, and the caller is told to retry later.
const CLAIM_ROUNDS: usize = 3;

impl Store {
    /// Tries to acquire the lease of the request's key, inserting the key if it is new.
    pub async fn claim<P: RecoveryPoint>(&self, req: NewRequest<'_>) -> Result<Claim<P>, Error> {
        let context = || format!("claim key {:?} for user {}", req.key.as_str(), req.user_id);
        for _ in 0..CLAIM_ROUNDS {
            let row = sqlx::query(
                r#"
                INSERT INTO idempotency_keys AS k
                    (user_id, request_method, request_path, idempotency_key, fingerprint,
                     request_params, recovery_point, locked_until, created_at, last_run_at)
                VALUES ($1, $2, $3, $4, $5, $6, $7,
                        coalesce($8::timestamptz, now()) + $9 * interval '1 millisecond',
                        coalesce($8::timestamptz, now()), coalesce($8::timestamptz, now()))
                ON CONFLICT (user_id, request_method, request_path, idempotency_key) DO UPDATE
                SET lease_token  = k.lease_token + 1,
                    attempts     = k.attempts + 1,
                    locked_until = excluded.locked_until,
                    last_run_at  = excluded.last_run_at
                -- Take over only an unfinished key of the same payload whose lease is free or
                -- over. Any other conflict returns no row and is classified by the read below.
                WHERE k.finished_at IS NULL
                  AND k.fingerprint = excluded.fingerprint
                  AND (k.locked_until IS NULL OR k.locked_until <= excluded.last_run_at)
                RETURNING k.id, k.request_uuid, k.lease_token, k.attempts, k.completer_attempts,
                          k.recovery_point, k.request_params, k.locked_until
                "#,
            )
            .bind(req.user_id)
            .bind(req.method)
            .bind(req.route)
            .bind(req.key.as_str())
            .bind(req.fingerprint.as_bytes().as_slice())
            .bind(Json(req.params))
            .bind(P::STARTED.name())
            .bind(self.now())
            .bind(self.ttl_millis())
            .fetch_optional(&self.pool)
            .await
            .map_err(Error::db(context()))?;

            if let Some(row) = row {
                return lease_from_row(&row, req.user_id).map(Claim::Acquired);
            }
            if let Some(refusal) = self.classify_refusal(&req).await? {
                return Ok(refusal);
            }
            // The row changed between the two statements (lease released, key reaped): claim again.
        }
        Ok(Claim::InFlight {
            retry_after: Duration::from_secs(1),
        })
    }

    /// Tells why a claim returned no row; `None` when the row no longer refuses a claim.
    async fn classify_refusal<P: RecoveryPoint>(
        &self,
        req: &NewRequest<'_>,
    ) -> Result<Option<Claim<P>>, Error> {
        let row = sqlx::query(
            r#"
            SELECT id, fingerprint, finished_at IS NOT NULL AS finished,
                   response_status, response_headers, response_body,
                   ceil(extract(epoch FROM locked_until - coalesce($5::timestamptz, now())) * 1000)
                       ::bigint AS lease_millis_left
            FROM idempotency_keys
            WHERE user_id = $1 AND request_method = $2 AND request_path = $3
              AND idempotency_key = $4
            "#,
        )
        .bind(req.user_id)
        .bind(req.method)
        .bind(req.route)
        .bind(req.key.as_str())
        .bind(self.now())
        .fetch_optional(&self.pool)
        .await
        .map_err(Error::db(format!(
            "read refused key {:?} of user {}",
            req.key.as_str(),
            req.user_id
        )))?;

        let Some(row) = row else { return Ok(None) };
        let key_id: i64 = row.get("id");
        let fingerprint: Vec<u8> = row.get("fingerprint");
        if fingerprint.as_slice() != req.fingerprint.as_bytes() {
            return Ok(Some(Claim::Mismatch));
        }
        if row.get::<bool, _>("finished") {
            return stored_response(&row, key_id).map(|r| Some(Claim::Replay(r)));
        }
        match row.get::<Option<i64>, _>("lease_millis_left") {
            Some(left) if left > 0 => {
                // Round up: a client that waits the advertised time must find the lease free.
                let secs = (left as u64).div_ceil(1000).max(1);
                Ok(Some(Claim::InFlight {
                    retry_after: Duration::from_secs(secs),
                }))
            }
            _ => Ok(None),
        }
    }
}
