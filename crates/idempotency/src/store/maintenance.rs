//! Maintenance: the completer's claim of abandoned keys and its backoff, the reaper, and the
//! operator's inspection.

use std::time::Duration;

use serde_json::Value;
use sqlx::postgres::PgRow;
use sqlx::types::Json;
use sqlx::Row;
use time::OffsetDateTime;
use uuid::Uuid;

use super::model::{is_referenced, lease_from_row, Lease, RecoveryPoint, Store};
use crate::commit_watch::watched;
use crate::{BindTime, Error, Owner, Timed};

/// How many candidates the completer reads per key it wants: the read takes no locks, so some
/// candidates are being claimed by other completers (and are skipped); reading more keeps them
/// from ending a pass early.
const CANDIDATES_PER_CLAIM: i64 = 4;

impl Store {
    /// Acquires up to `limit` keys of one route (`method`, `route`) that their requests
    /// abandoned: unfinished, lease free or expired, last attempted more than `grace` ago (or
    /// already worked by a completer), and past their backoff. This is how a completer claims;
    /// each returned lease has a fresh fencing token, exactly as a request's claim would. A row
    /// whose recovery point the application does not know comes back as an error in its place
    /// (its lease expires on its own), so one bad row cannot stop the others.
    ///
    /// Two steps, so that every write is addressed to one user (one shard, once the table is
    /// distributed by user): a read of candidates across users, without locks; then, per
    /// candidate, a claim under `FOR UPDATE SKIP LOCKED` that checks the conditions again. Several
    /// completers never wait on each other nor take the same key: a row locked by one is skipped
    /// by the others, and a row that a request took meanwhile no longer matches.
    pub async fn claim_abandoned<P: RecoveryPoint>(
        &self,
        method: &str,
        route: &str,
        grace: Duration,
        limit: i64,
    ) -> Result<Vec<Result<Lease<P>, Error>>, Error> {
        self.claim_abandoned_marked(method, route, grace, limit, None)
            .await
    }

    /// [`Store::claim_abandoned`], or with `marked`, the retirement's claim: only the keys whose
    /// stored parameters carry the top-level member `marked`, and only those last attempted
    /// more than `grace` ago, even if a completer worked them (a key another writer left on the
    /// route, or one its completer tried a minute ago, is not abandoned).
    pub(crate) async fn claim_abandoned_marked<P: RecoveryPoint>(
        &self,
        method: &str,
        route: &str,
        grace: Duration,
        limit: i64,
        marked: Option<&str>,
    ) -> Result<Vec<Result<Lease<P>, Error>>, Error> {
        let context = || format!("claim abandoned keys of {method} {route}");
        let now = self.now();
        let grace = grace.as_millis().min(i64::MAX as u128) as i64;
        let mut db = self.autocommit().await.map_err(Error::db(context()))?;
        let timed = Timed::new(
            r#"
            -- all users: a read of candidates, without locks; each is claimed below by user.
            -- The unfinished keys of the route, from their own small table, least recently
            -- attempted first, so that keys that keep failing take turns with the others.
            SELECT k.owner, k.id
            FROM idempotency_keys_unfinished u
            JOIN idempotency_keys k ON k.owner = u.owner AND k.id = u.key_id
            WHERE u.request_method = $3 AND u.request_path = $4
              AND k.finished_at IS NULL
              AND (k.locked_until IS NULL OR k.locked_until <= $now)
              -- The grace, from the last attempt, protects a client still retrying its own key;
              -- once a completer has worked the key, only its backoff applies. The retirement
              -- ($5, its mark) takes only its marked keys, and only past the grace.
              AND ($5::text IS NULL OR k.request_params ? $5)
              AND ((k.completer_attempts > 0 AND $5::text IS NULL)
                   OR k.last_run_at <= $now - $1 * interval '1 millisecond')
              AND (k.next_attempt_at IS NULL
                   OR k.next_attempt_at <= $now)
            ORDER BY k.last_run_at
            LIMIT $2
            "#,
            now,
        );
        let candidates: Vec<(String, i64)> = sqlx::query_as(timed.sql())
            .bind(grace)
            .bind(limit.clamp(1, 10_000) * CANDIDATES_PER_CLAIM)
            .bind(method)
            .bind(route)
            .bind(marked)
            .bind_now(&timed)
            .persistent(self.persistent())
            .fetch_all(db.conn())
            .await
            .map_err(Error::db(context()))?;
        db.done().await.map_err(Error::db(context()))?;
        let limit = usize::try_from(limit.clamp(1, 10_000)).unwrap_or(1);
        let mut leases = Vec::with_capacity(limit);
        for (owner, key_id) in candidates {
            if leases.len() == limit {
                break;
            }
            // Before BEGIN, if there is one: the update's `now()` is then the transaction's start.
            let asked_at = self.lease_clock();
            let mut db = self.autocommit().await.map_err(Error::db(context()))?;
            let timed = Timed::new(
                r#"
                WITH abandoned AS (
                    SELECT id FROM idempotency_keys
                    WHERE owner = $3 AND id = $4
                      AND finished_at IS NULL
                      AND (locked_until IS NULL OR locked_until <= $now)
                      AND ($5::text IS NULL OR request_params ? $5)
                      AND ((completer_attempts > 0 AND $5::text IS NULL)
                           OR last_run_at <= $now - $1 * interval '1 millisecond')
                      AND (next_attempt_at IS NULL OR next_attempt_at <= $now)
                    FOR UPDATE SKIP LOCKED
                )
                UPDATE idempotency_keys k
                SET lease_token        = k.lease_token + 1,
                    attempts           = k.attempts + 1,
                    completer_attempts = k.completer_attempts + 1,
                    locked_until       = $now + $2 * interval '1 millisecond',
                    last_run_at        = $now
                FROM abandoned
                WHERE k.owner = $3 AND k.id = abandoned.id
                RETURNING k.id, k.request_uuid, k.owner, k.lease_token, k.attempts,
                          k.completer_attempts, k.recovery_point, k.request_params, k.locked_until
                "#,
                now,
            );
            let row = sqlx::query(timed.sql())
                .bind(grace)
                .bind(self.ttl_millis())
                .bind(&owner)
                .bind(key_id)
                .bind(marked)
                .bind_now(&timed)
                .persistent(self.persistent())
                .fetch_optional(db.conn());
            // Outside a transaction the takeover commits by itself, and with Statements::Unnamed
            // its transaction's commit: either one whose wait for the synchronous standby was
            // cancelled is not a lease to run the application's closure under. The key is left
            // to its lease's end, and the next pass.
            let (row, cancelled) = watched(row).await;
            let row = row.map_err(Error::db(context()))?;
            let confirmed = match db.confirmed(context()).await {
                Ok(()) => !cancelled,
                Err(Error::CommitUnconfirmed { .. }) => false,
                Err(e) => return Err(e),
            };
            if let Some(row) = row {
                if confirmed {
                    leases.push(lease_from_row(&row, Owner::stored(owner), asked_at));
                } else {
                    tracing::warn!(
                        key_id,
                        "the completer's claim committed, but its wait for the synchronous \
                         standby was cancelled: the key is left to its lease's end"
                    );
                }
            }
        }
        Ok(leases)
    }

    /// Gives the lease up after a failed completer attempt and keeps completers away from the
    /// key for `backoff`. A client's own retry may still claim it at any time.
    pub async fn release_with_backoff<P: RecoveryPoint>(
        &self,
        lease: Lease<P>,
        backoff: Duration,
    ) -> Result<(), Error> {
        crate::lease::writing(&lease, "release");
        let context = || format!("release lease of key {} with backoff", lease.key_id);
        let mut db = self.autocommit().await.map_err(Error::db(context()))?;
        let timed = self.timed(
            r#"
            UPDATE idempotency_keys
            SET locked_until = NULL,
                next_attempt_at = $now + $4 * interval '1 millisecond'
            WHERE id = $1 AND owner = $2 AND lease_token = $3 AND finished_at IS NULL
            "#,
        );
        let released = sqlx::query(timed.sql())
            .bind(lease.key_id)
            .bind(lease.owner.as_str())
            .bind(lease.token)
            .bind(backoff.as_millis().min(i64::MAX as u128) as i64)
            .bind_now(&timed)
            .persistent(self.persistent())
            .execute(db.conn())
            .await
            .map_err(Error::db(context()))?;
        db.done().await.map_err(Error::db(context()))?;
        if released.rows_affected() == 0 {
            return Err(Error::LeaseLost {
                key_id: lease.key_id,
                token: lease.token,
            });
        }
        Ok(())
    }

    /// Deletes up to `limit` keys that finished more than the store's retention ago
    /// ([`Store::with_retention`]); returns how many. With the same clock, these are exactly the
    /// keys a claim answers as new requests (the same age test, `finished_at < now -
    /// retention`), so reaping changes no answer: it only keeps the table small. A store without
    /// a retention refuses ([`Error::InvalidConfig`]): its keys are kept for good.
    pub async fn reap_expired(&self, limit: i64) -> Result<u64, Error> {
        let Some(retention) = self.retention else {
            return Err(Error::InvalidConfig(
                "reap_expired needs the store's retention (Store::with_retention): without one, \
                 finished keys are kept for good"
                    .into(),
            ));
        };
        self.reap_finished(retention, limit).await
    }

    /// Deletes up to `limit` keys that finished more than `retention` ago; returns how many.
    ///
    /// Unfinished keys are never touched, whatever their age: they still owe a result. A read
    /// of candidates across users comes first, then one short `DELETE` per user (one shard once
    /// the table is distributed by user) that checks the age again; no statement holds many
    /// locks for long.
    ///
    /// The age test is the one a claim applies at read when the store has a retention: pass
    /// that retention (or call [`Store::reap_expired`]), or keys shorter-lived than it vanish
    /// before their claims would expire them, and a late retry's fate depends again on when
    /// the reaper ran.
    pub async fn reap_finished(&self, retention: Duration, limit: i64) -> Result<u64, Error> {
        let now = self.now();
        let retention = retention.as_millis().min(i64::MAX as u128) as i64;
        let context = "find finished keys to reap";
        let mut db = self.autocommit().await.map_err(Error::db(context))?;
        let timed = Timed::new(
            r#"
            -- all users: a read of candidates, without locks; each user's are deleted below.
            -- By creation, whose index no update touches: a key finished before the cutoff was
            -- created before it. Unfinished old keys are passed over (they are few).
            SELECT owner, id FROM idempotency_keys
            WHERE created_at < $now - $1 * interval '1 millisecond'
              AND finished_at < $now - $1 * interval '1 millisecond'
            ORDER BY created_at
            LIMIT $2
            "#,
            now,
        );
        let candidates: Vec<(String, i64)> = sqlx::query_as(timed.sql())
            .bind(retention)
            .bind(limit.clamp(1, 100_000))
            .bind_now(&timed)
            .persistent(self.persistent())
            .fetch_all(db.conn())
            .await
            .map_err(Error::db(context))?;
        db.done().await.map_err(Error::db(context))?;
        let mut by_owner: std::collections::BTreeMap<String, Vec<i64>> = Default::default();
        for (owner, key_id) in candidates {
            by_owner.entry(owner).or_default().push(key_id);
        }
        let mut reaped = 0;
        for (owner, key_ids) in by_owner {
            reaped += match self.reap_of(&owner, &key_ids, now, retention).await {
                Ok(n) => n,
                // A key still referenced under a foreign key that refuses the delete (RESTRICT,
                // NO ACTION) fails its whole batch; one by one, the others go and it stays,
                // said loudly, instead of failing every pass that finds it first.
                Err(e) if is_referenced(&e) => {
                    let mut n = 0;
                    for key_id in &key_ids {
                        match self.reap_of(&owner, &[*key_id], now, retention).await {
                            Ok(one) => n += one,
                            Err(e) if is_referenced(&e) => tracing::warn!(
                                key_id,
                                owner = owner.as_str(),
                                "a finished key past the retention is kept: a row still \
                                 references it under a foreign key that refuses the delete \
                                 (make it ON DELETE SET NULL)"
                            ),
                            Err(e) => {
                                return Err(Error::db(format!(
                                    "reap key {key_id} of owner {owner}"
                                ))(e))
                            }
                        }
                    }
                    n
                }
                Err(e) => return Err(Error::db(format!("reap finished keys of owner {owner}"))(e)),
            };
        }
        Ok(reaped)
    }

    /// Deletes those of one owner's `key_ids` that finished more than `retention` ago.
    async fn reap_of(
        &self,
        owner: &str,
        key_ids: &[i64],
        now: Option<OffsetDateTime>,
        retention: i64,
    ) -> Result<u64, sqlx::Error> {
        let mut db = self.autocommit().await?;
        let timed = Timed::new(
            r#"
            DELETE FROM idempotency_keys
            WHERE owner = $1 AND id = ANY($2)
              AND finished_at IS NOT NULL
              AND finished_at < $now - $3 * interval '1 millisecond'
            "#,
            now,
        );
        let deleted = sqlx::query(timed.sql())
            .bind(owner)
            .bind(key_ids)
            .bind(retention)
            .bind_now(&timed)
            .persistent(self.persistent())
            .execute(db.conn())
            .await?;
        db.done().await?;
        Ok(deleted.rows_affected())
    }

    /// How many keys are unfinished, across every user: the gauge an operator alerts on.
    pub async fn count_unfinished(&self) -> Result<i64, Error> {
        let context = "count unfinished keys";
        let mut db = self.autocommit().await.map_err(Error::db(context))?;
        let count = sqlx::query_scalar(
            "-- all users: an operator's gauge.
             SELECT count(*) FROM idempotency_keys_unfinished",
        )
        .persistent(self.persistent())
        .fetch_one(db.conn())
        .await
        .map_err(Error::db(context))?;
        db.done().await.map_err(Error::db(context))?;
        Ok(count)
    }

    /// Reads one key by id, for an operator's inspection (`keys show`) and tests. Unlike the
    /// request path, this look-up crosses users.
    pub async fn find(&self, key_id: i64) -> Result<Option<KeyRecord>, Error> {
        let context = || format!("read key {key_id}");
        let mut db = self.autocommit().await.map_err(Error::db(context()))?;
        let row = sqlx::query(&format!(
            "-- all users: an operator's look-up by id.
             SELECT {KEY_RECORD_COLUMNS} FROM idempotency_keys WHERE id = $1"
        ))
        .bind(key_id)
        .persistent(self.persistent())
        .fetch_optional(db.conn())
        .await
        .map_err(Error::db(context()))?;
        db.done().await.map_err(Error::db(context()))?;
        row.map(|row| KeyRecord::from_row(&row)).transpose()
    }

    /// Lists keys, newest first: all of them, the unfinished ones, or those finished with one
    /// status (a 502 the gateway's refusal left, say).
    pub async fn list(&self, filter: KeyFilter, limit: i64) -> Result<Vec<KeyRecord>, Error> {
        // One statement per filter rather than `… OR NOT $1` clauses, which no index serves.
        let (clause, status) = match filter {
            KeyFilter::All => ("", None),
            KeyFilter::Unfinished => (
                "-- all users: the keys listed as unfinished.
                 WHERE (owner, id) IN (SELECT owner, key_id FROM idempotency_keys_unfinished)",
                None,
            ),
            KeyFilter::FinishedWith(status) => ("WHERE response_status = $2", Some(status)),
        };
        let mut db = self.autocommit().await.map_err(Error::db("list keys"))?;
        let rows = sqlx::query(&format!(
            "-- all users: an operator's listing.
             SELECT {KEY_RECORD_COLUMNS} FROM idempotency_keys {clause} ORDER BY id DESC LIMIT $1"
        ))
        .bind(limit.clamp(1, 10_000))
        .bind(status.map(|s| s as i16))
        .persistent(self.persistent())
        .fetch_all(db.conn())
        .await
        .map_err(Error::db("list keys"))?;
        db.done().await.map_err(Error::db("list keys"))?;
        rows.iter().map(KeyRecord::from_row).collect()
    }
}

/// Which keys [`Store::list`] shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyFilter {
    /// Every key.
    All,
    /// Keys that have not finished: in flight, or waiting for a retry or the completer.
    Unfinished,
    /// Keys finished with this stored status.
    FinishedWith(u16),
}

/// A key row as inspection tools show it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KeyRecord {
    /// Row id.
    pub id: i64,
    /// The request's random identifier, from which foreign keys are derived.
    pub request_uuid: Uuid,
    /// Owner.
    pub owner: String,
    /// HTTP method.
    pub request_method: String,
    /// Route template.
    pub request_path: String,
    /// The client's key.
    pub idempotency_key: String,
    /// Last committed phase.
    pub recovery_point: String,
    /// End of the current lease, if any.
    #[serde(with = "time::serde::rfc3339::option")]
    pub locked_until: Option<OffsetDateTime>,
    /// Current fencing token.
    pub lease_token: i64,
    /// Acquisitions so far.
    pub attempts: i32,
    /// Acquisitions by a completer.
    pub completer_attempts: i32,
    /// The completer leaves the key alone until then.
    #[serde(with = "time::serde::rfc3339::option")]
    pub next_attempt_at: Option<OffsetDateTime>,
    /// Stored status, once finished.
    pub response_status: Option<i16>,
    /// The stored request parameters.
    pub request_params: Value,
    /// First claim.
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    /// Completion.
    #[serde(with = "time::serde::rfc3339::option")]
    pub finished_at: Option<OffsetDateTime>,
}

const KEY_RECORD_COLUMNS: &str =
    "id, request_uuid, owner, request_method, request_path, idempotency_key, \
    recovery_point, locked_until, lease_token, attempts, completer_attempts, next_attempt_at, \
    response_status, \
    request_params, created_at, finished_at";

impl KeyRecord {
    fn from_row(row: &PgRow) -> Result<Self, Error> {
        let id: i64 = row.get("id");
        let get = |e: sqlx::Error| Error::Database {
            context: format!("decode key {id}"),
            source: e,
        };
        Ok(Self {
            id,
            request_uuid: row.try_get("request_uuid").map_err(get)?,
            owner: row.try_get("owner").map_err(get)?,
            request_method: row.try_get("request_method").map_err(get)?,
            request_path: row.try_get("request_path").map_err(get)?,
            idempotency_key: row.try_get("idempotency_key").map_err(get)?,
            recovery_point: row.try_get("recovery_point").map_err(get)?,
            locked_until: row.try_get("locked_until").map_err(get)?,
            lease_token: row.try_get("lease_token").map_err(get)?,
            attempts: row.try_get("attempts").map_err(get)?,
            completer_attempts: row.try_get("completer_attempts").map_err(get)?,
            next_attempt_at: row.try_get("next_attempt_at").map_err(get)?,
            response_status: row.try_get("response_status").map_err(get)?,
            request_params: row
                .try_get::<Json<Value>, _>("request_params")
                .map_err(get)?
                .0,
            created_at: row.try_get("created_at").map_err(get)?,
            finished_at: row.try_get("finished_at").map_err(get)?,
        })
    }
}
