//! The PostgreSQL store: every statement on `idempotency_keys` lives in this file.
//!
//! # Statements and why they are shaped so
//!
//! - **Claim** is one `INSERT … ON CONFLICT … DO UPDATE … WHERE … RETURNING`. A new key is
//!   inserted with token 1; an existing one is taken over (token + 1) only when it is unfinished,
//!   has the same fingerprint and its lease is free or expired. `ON CONFLICT DO UPDATE` locks the
//!   conflicting row and re-checks the `WHERE` against its newest committed version, so two
//!   claimers can never both get a row back. No row back means the claim was refused, and one
//!   plain read tells why (replay, payload mismatch, lease held).
//! - **A phase** is a READ COMMITTED transaction whose first statement is the fenced update
//!   `… WHERE id = $1 AND lease_token = $2`. Zero rows: the lease was taken over, the phase
//!   returns [`Error::LeaseLost`] and the transaction rolls back. One row: the key row is now
//!   locked by this transaction until commit, so a claimer waits for the phase to end and then
//!   sees its result; the business writes that follow cannot interleave with a takeover.
//! - **Release** after a transient failure is fenced the same way, so a stale holder cannot free
//!   a lease that is no longer its own.
//! - **The completer's claim** takes abandoned keys in batches with `FOR UPDATE SKIP LOCKED` and
//!   increments their tokens like any claim; **the reaper** deletes finished keys past retention
//!   in short batches, never unfinished ones.
//!
//! Every statement carries `user_id`, so the table can be distributed by user.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use sqlx::postgres::{PgPool, PgRow};
use sqlx::types::Json;
use sqlx::{PgConnection, Postgres, Row, Transaction};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::{Clock, Error, Fingerprint, IdempotencyKey, StoredResponse};

/// The lease time-to-live when none is configured.
///
/// A holder that dies keeps its key locked this long, so retries get 409 until then; a holder that
/// lives must finish each phase (or renew) within it. It must stay larger than the longest foreign
/// call made between two phases (the gateway timeout) plus the time of one phase.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(30);

/// How often a refused claim is re-read when the row changed between the claim and the read
/// (for instance, its lease was released in between). More than a few rounds means heavy
/// contention, and the caller is told to retry later.
const CLAIM_ROUNDS: usize = 3;

/// A named stage of an application's request, stored as text in `recovery_point`.
///
/// Implement it for an enum whose variants are the application's recovery points. `STARTED` is
/// written when a key is first claimed, `FINISHED` when its response is stored.
pub trait RecoveryPoint: Copy + Eq + std::fmt::Debug + Send + Sync + 'static {
    /// The point of a key that has just been inserted.
    const STARTED: Self;
    /// The point of a key whose response is stored.
    const FINISHED: Self;
    /// The stored name (at most 64 characters).
    fn name(self) -> &'static str;
    /// Parses a stored name.
    fn from_name(name: &str) -> Option<Self>;
}

/// The recovery points of a request with a single phase: just claimed, or finished. A key found
/// `Started` by a later claim is one whose phase never committed; it runs again from the start.
/// (A request with several effects defines its own points, one per committed step.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OneStep {
    /// Claimed; nothing committed yet.
    Started,
    /// The response is stored.
    Finished,
}

impl RecoveryPoint for OneStep {
    const STARTED: Self = Self::Started;
    const FINISHED: Self = Self::Finished;

    fn name(self) -> &'static str {
        match self {
            Self::Started => "started",
            Self::Finished => "finished",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        [Self::Started, Self::Finished]
            .into_iter()
            .find(|p| p.name() == name)
    }
}

/// What a claim attempt is about.
#[derive(Debug, Clone, Copy)]
pub struct NewRequest<'a> {
    /// The owner of the key: keys of different users never meet.
    pub user_id: i64,
    /// The HTTP method, `POST`.
    pub method: &'a str,
    /// The route template, `/rides`.
    pub route: &'a str,
    /// The client's key.
    pub key: &'a IdempotencyKey,
    /// The fingerprint of method, route and body.
    pub fingerprint: Fingerprint,
    /// The parameters a completer needs to finish the request alone.
    pub params: &'a Value,
}

/// The outcome of a claim.
#[derive(Debug)]
pub enum Claim<P> {
    /// The caller holds the lease and must run the request from `lease.recovery_point()`.
    Acquired(Lease<P>),
    /// The key finished earlier with the same payload: answer with this response.
    Replay(StoredResponse),
    /// The key was used with another payload.
    Mismatch,
    /// Another holder has the lease for `retry_after` more.
    InFlight {
        /// Time left on the other holder's lease, rounded up to whole seconds (at least one).
        retry_after: Duration,
    },
}

/// A held lease on one key row: the right to run its next phases, fenced by `token`.
///
/// Dropping it without finishing or releasing leaves the key locked until the lease expires.
#[derive(Debug)]
#[must_use = "a dropped lease blocks its key until the lease expires: finish or release it"]
pub struct Lease<P> {
    key_id: i64,
    request_uuid: Uuid,
    user_id: i64,
    token: i64,
    attempts: i32,
    completer_attempts: i32,
    recovery_point: P,
    params: Value,
    locked_until: OffsetDateTime,
}

impl<P: RecoveryPoint> Lease<P> {
    /// The key row's id, stable for the key's life. It comes from a sequence of this database:
    /// use it for the application's own rows (a foreign key to the key row), and
    /// [`Lease::request_uuid`] for anything another system sees.
    pub fn key_id(&self) -> i64 {
        self.key_id
    }

    /// A random identifier made when the key row was inserted, stable for the key's life and
    /// unique across databases: derive foreign idempotency keys from it, and name the request
    /// with it in foreign systems, so that two databases on one gateway account never share a
    /// foreign key.
    pub fn request_uuid(&self) -> Uuid {
        self.request_uuid
    }

    /// The owner of the key.
    pub fn user_id(&self) -> i64 {
        self.user_id
    }

    /// The fencing token this holder acquired.
    pub fn token(&self) -> i64 {
        self.token
    }

    /// How many times the key's lease has been acquired, this time included.
    pub fn attempts(&self) -> i32 {
        self.attempts
    }

    /// How many of those acquisitions were a completer's (its backoff doubles with them).
    pub fn completer_attempts(&self) -> i32 {
        self.completer_attempts
    }

    /// The last committed phase: where to resume.
    pub fn recovery_point(&self) -> P {
        self.recovery_point
    }

    /// The parameters stored with the first claim.
    pub fn params(&self) -> &Value {
        &self.params
    }

    /// When the lease ends unless a phase or a renewal extends it.
    pub fn locked_until(&self) -> OffsetDateTime {
        self.locked_until
    }
}

/// The key store. Cheap to clone; clones share the pool and the clock.
#[derive(Clone)]
pub struct Store {
    pool: PgPool,
    clock: Arc<dyn Clock>,
    lease_ttl: Duration,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("lease_ttl", &self.lease_ttl)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// A store over `pool`, with `clock` for lease arithmetic and leases of `lease_ttl`.
    pub fn new(pool: PgPool, clock: Arc<dyn Clock>, lease_ttl: Duration) -> Result<Self, Error> {
        if lease_ttl < Duration::from_secs(1) || lease_ttl > Duration::from_secs(3600) {
            return Err(Error::InvalidConfig(format!(
                "lease TTL must be between 1 s and 1 h, got {lease_ttl:?}"
            )));
        }
        Ok(Self {
            pool,
            clock,
            lease_ttl,
        })
    }

    /// The pool the store writes through; the application's phase writes share its transactions.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The configured lease TTL.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// The injected time, for the application's own statements that compare against "now"
    /// (`coalesce($n::timestamptz, now())`): `None` in production, where the database decides.
    pub fn now(&self) -> Option<OffsetDateTime> {
        self.clock.now()
    }

    fn ttl_millis(&self) -> i64 {
        // Bounded to one hour by `new`, so it fits.
        self.lease_ttl.as_millis() as i64
    }

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

    /// Opens a phase that moves the key to recovery point `to` when it commits.
    ///
    /// The fenced update runs first; on [`Error::LeaseLost`] nothing was written. Write the
    /// phase's business rows through [`Phase::conn`], then [`Phase::commit`].
    pub async fn phase<'l, P: RecoveryPoint>(
        &self,
        lease: &'l mut Lease<P>,
        to: P,
    ) -> Result<Phase<'l, P>, Error> {
        if to == P::FINISHED || to == P::STARTED {
            return Err(Error::InvalidTransition {
                key_id: lease.key_id,
                to: to.name(),
            });
        }
        let (tx, locked_until) = self.fence(lease, to.name()).await?;
        Ok(Phase {
            tx,
            lease,
            to,
            locked_until,
        })
    }

    /// Opens the phase that stores the final response and releases the lease.
    pub async fn final_phase<'l, P: RecoveryPoint>(
        &self,
        lease: &'l mut Lease<P>,
    ) -> Result<FinalPhase<'l, P>, Error> {
        let current = lease.recovery_point.name();
        let (tx, _) = self.fence(lease, current).await?;
        Ok(FinalPhase {
            tx,
            lease,
            now: self.now(),
        })
    }

    /// Begins a transaction and runs the fenced update that must open every phase.
    async fn fence<P: RecoveryPoint>(
        &self,
        lease: &Lease<P>,
        point: &str,
    ) -> Result<(Transaction<'static, Postgres>, OffsetDateTime), Error> {
        let context = || format!("open phase {point} of key {}", lease.key_id);
        let mut tx = self.pool.begin().await.map_err(Error::db(context()))?;
        // The lease is extended too: making progress is a sign of life.
        let locked_until: Option<OffsetDateTime> = sqlx::query_scalar(
            r#"
            UPDATE idempotency_keys
            SET recovery_point = $4,
                locked_until   = coalesce($5::timestamptz, now()) + $6 * interval '1 millisecond',
                last_run_at    = coalesce($5::timestamptz, now())
            WHERE id = $1 AND user_id = $2 AND lease_token = $3 AND finished_at IS NULL
            RETURNING locked_until
            "#,
        )
        .bind(lease.key_id)
        .bind(lease.user_id)
        .bind(lease.token)
        .bind(point)
        .bind(self.now())
        .bind(self.ttl_millis())
        .fetch_optional(&mut *tx)
        .await
        .map_err(Error::db(context()))?;
        match locked_until {
            Some(until) => Ok((tx, until)),
            // Dropping `tx` rolls it back; nothing was written.
            None => Err(Error::LeaseLost {
                key_id: lease.key_id,
                token: lease.token,
            }),
        }
    }

    /// Extends a held lease by one TTL from now (a heartbeat during a long foreign call).
    pub async fn renew<P: RecoveryPoint>(&self, lease: &mut Lease<P>) -> Result<(), Error> {
        let locked_until: Option<OffsetDateTime> = sqlx::query_scalar(
            r#"
            UPDATE idempotency_keys
            SET locked_until = coalesce($4::timestamptz, now()) + $5 * interval '1 millisecond'
            WHERE id = $1 AND user_id = $2 AND lease_token = $3 AND finished_at IS NULL
            RETURNING locked_until
            "#,
        )
        .bind(lease.key_id)
        .bind(lease.user_id)
        .bind(lease.token)
        .bind(self.now())
        .bind(self.ttl_millis())
        .fetch_optional(&self.pool)
        .await
        .map_err(Error::db(format!("renew lease of key {}", lease.key_id)))?;
        match locked_until {
            Some(until) => {
                lease.locked_until = until;
                Ok(())
            }
            None => Err(Error::LeaseLost {
                key_id: lease.key_id,
                token: lease.token,
            }),
        }
    }

    /// Gives the lease up after a transient failure, keeping the recovery point, so that a retry
    /// or the completer can resume at once instead of waiting for the lease to expire.
    pub async fn release<P: RecoveryPoint>(&self, lease: Lease<P>) -> Result<(), Error> {
        let released = sqlx::query(
            r#"
            UPDATE idempotency_keys
            SET locked_until = NULL
            WHERE id = $1 AND user_id = $2 AND lease_token = $3 AND finished_at IS NULL
            "#,
        )
        .bind(lease.key_id)
        .bind(lease.user_id)
        .bind(lease.token)
        .execute(&self.pool)
        .await
        .map_err(Error::db(format!("release lease of key {}", lease.key_id)))?;
        if released.rows_affected() == 0 {
            return Err(Error::LeaseLost {
                key_id: lease.key_id,
                token: lease.token,
            });
        }
        Ok(())
    }

    /// Deletes the key of a request that turned out to be one the application refuses without
    /// an outcome to keep (a 400 found only after the claim, say), so that the key is as if it
    /// had never been sent: a later request may use it again, with any payload. Fenced like a
    /// release; a finished key is never deleted.
    ///
    /// Delete only a key that has written nothing: rows referencing it keep it alive (their
    /// foreign keys refuse the delete) and the store's error says so.
    pub async fn abandon<P: RecoveryPoint>(&self, lease: Lease<P>) -> Result<(), Error> {
        let deleted = sqlx::query(
            r#"
            DELETE FROM idempotency_keys
            WHERE id = $1 AND user_id = $2 AND lease_token = $3 AND finished_at IS NULL
            "#,
        )
        .bind(lease.key_id)
        .bind(lease.user_id)
        .bind(lease.token)
        .execute(&self.pool)
        .await
        .map_err(Error::db(format!("abandon key {}", lease.key_id)))?;
        if deleted.rows_affected() == 0 {
            return Err(Error::LeaseLost {
                key_id: lease.key_id,
                token: lease.token,
            });
        }
        Ok(())
    }

    /// Acquires up to `limit` keys of one route (`method`, `route`) that their requests
    /// abandoned: unfinished, lease free or expired, last attempted more than `grace` ago (or
    /// already worked by a completer), and past their backoff. This is how a completer claims; each returned lease has a fresh
    /// fencing token, exactly as a request's claim would. A row whose recovery point the
    /// application does not know comes back as an error in its place (its lease expires on its
    /// own), so one bad row cannot stop the others.
    ///
    /// `FOR UPDATE SKIP LOCKED` lets several completers run at once without waiting on each
    /// other or taking the same key: a row locked by one is skipped by the others, and a row
    /// whose lease a request takes meanwhile no longer matches when re-checked under the lock.
    pub async fn claim_abandoned<P: RecoveryPoint>(
        &self,
        method: &str,
        route: &str,
        grace: Duration,
        limit: i64,
    ) -> Result<Vec<Result<Lease<P>, Error>>, Error> {
        let rows = sqlx::query(
            r#"
            WITH abandoned AS (
                SELECT id FROM idempotency_keys
                WHERE finished_at IS NULL
                  AND request_method = $5 AND request_path = $6
                  AND (locked_until IS NULL OR locked_until <= coalesce($1::timestamptz, now()))
                  -- The grace, from the last attempt, protects a client still retrying its own
                  -- key; once a completer has worked the key, only its backoff applies.
                  AND (completer_attempts > 0
                       OR last_run_at <= coalesce($1::timestamptz, now()) - $2 * interval '1 millisecond')
                  AND (next_attempt_at IS NULL OR next_attempt_at <= coalesce($1::timestamptz, now()))
                ORDER BY last_run_at
                LIMIT $3
                FOR UPDATE SKIP LOCKED
            )
            UPDATE idempotency_keys k
            SET lease_token        = k.lease_token + 1,
                attempts           = k.attempts + 1,
                completer_attempts = k.completer_attempts + 1,
                locked_until       = coalesce($1::timestamptz, now()) + $4 * interval '1 millisecond',
                last_run_at        = coalesce($1::timestamptz, now())
            FROM abandoned
            WHERE k.id = abandoned.id
            RETURNING k.id, k.request_uuid, k.user_id, k.lease_token, k.attempts,
                      k.completer_attempts, k.recovery_point, k.request_params, k.locked_until
            "#,
        )
        .bind(self.now())
        .bind(grace.as_millis().min(i64::MAX as u128) as i64)
        .bind(limit.clamp(1, 10_000))
        .bind(self.ttl_millis())
        .bind(method)
        .bind(route)
        .fetch_all(&self.pool)
        .await
        .map_err(Error::db(format!("claim abandoned keys of {method} {route}")))?;
        Ok(rows
            .iter()
            .map(|row| lease_from_row(row, row.get("user_id")))
            .collect())
    }

    /// Gives the lease up after a failed completer attempt and keeps completers away from the
    /// key for `backoff`. A client's own retry may still claim it at any time.
    pub async fn release_with_backoff<P: RecoveryPoint>(
        &self,
        lease: Lease<P>,
        backoff: Duration,
    ) -> Result<(), Error> {
        let released = sqlx::query(
            r#"
            UPDATE idempotency_keys
            SET locked_until = NULL,
                next_attempt_at = coalesce($4::timestamptz, now()) + $5 * interval '1 millisecond'
            WHERE id = $1 AND user_id = $2 AND lease_token = $3 AND finished_at IS NULL
            "#,
        )
        .bind(lease.key_id)
        .bind(lease.user_id)
        .bind(lease.token)
        .bind(self.now())
        .bind(backoff.as_millis().min(i64::MAX as u128) as i64)
        .execute(&self.pool)
        .await
        .map_err(Error::db(format!(
            "release lease of key {} with backoff",
            lease.key_id
        )))?;
        if released.rows_affected() == 0 {
            return Err(Error::LeaseLost {
                key_id: lease.key_id,
                token: lease.token,
            });
        }
        Ok(())
    }

    /// Deletes up to `limit` keys that finished more than `retention` ago; returns how many.
    ///
    /// Unfinished keys are never touched, whatever their age: they still owe a result. Each call
    /// is one short statement, so a reaper that loops over batches holds no long locks; rows that
    /// another transaction has locked are skipped until the next pass.
    pub async fn reap_finished(&self, retention: Duration, limit: i64) -> Result<u64, Error> {
        let deleted = sqlx::query(
            r#"
            DELETE FROM idempotency_keys
            WHERE id IN (
                SELECT id FROM idempotency_keys
                WHERE finished_at IS NOT NULL
                  AND finished_at < coalesce($1::timestamptz, now()) - $2 * interval '1 millisecond'
                ORDER BY finished_at
                LIMIT $3
                FOR UPDATE SKIP LOCKED
            )
            "#,
        )
        .bind(self.now())
        .bind(retention.as_millis().min(i64::MAX as u128) as i64)
        .bind(limit.clamp(1, 100_000))
        .execute(&self.pool)
        .await
        .map_err(Error::db("reap finished keys"))?;
        Ok(deleted.rows_affected())
    }

    /// Reads one key by id, for an operator's inspection (`keys show`) and tests. Unlike the
    /// request path, this look-up crosses users.
    pub async fn find(&self, key_id: i64) -> Result<Option<KeyRecord>, Error> {
        let row = sqlx::query(&format!(
            "SELECT {KEY_RECORD_COLUMNS} FROM idempotency_keys WHERE id = $1"
        ))
        .bind(key_id)
        .fetch_optional(&self.pool)
        .await
        .map_err(Error::db(format!("read key {key_id}")))?;
        row.map(|row| KeyRecord::from_row(&row)).transpose()
    }

    /// Lists keys, newest first: all of them, the unfinished ones, or those finished with one
    /// status (a 502 the gateway's refusal left, say).
    pub async fn list(&self, filter: KeyFilter, limit: i64) -> Result<Vec<KeyRecord>, Error> {
        // One statement per filter rather than `… OR NOT $1` clauses, which no index serves.
        let (clause, status) = match filter {
            KeyFilter::All => ("", None),
            KeyFilter::Unfinished => ("WHERE finished_at IS NULL", None),
            KeyFilter::FinishedWith(status) => ("WHERE response_status = $2", Some(status)),
        };
        let rows = sqlx::query(&format!(
            "SELECT {KEY_RECORD_COLUMNS} FROM idempotency_keys {clause} ORDER BY id DESC LIMIT $1"
        ))
        .bind(limit.clamp(1, 10_000))
        .bind(status.map(|s| s as i16))
        .fetch_all(&self.pool)
        .await
        .map_err(Error::db("list keys"))?;
        rows.iter().map(KeyRecord::from_row).collect()
    }
}

/// An open phase: a transaction whose first statement won the fence.
///
/// Dropping it without [`Phase::commit`] rolls back everything written through it.
#[derive(Debug)]
pub struct Phase<'l, P: RecoveryPoint> {
    tx: Transaction<'static, Postgres>,
    lease: &'l mut Lease<P>,
    to: P,
    locked_until: OffsetDateTime,
}

impl<P: RecoveryPoint> Phase<'_, P> {
    /// The transaction's connection, for the phase's business writes.
    pub fn conn(&mut self) -> &mut PgConnection {
        &mut self.tx
    }

    /// The key row being worked.
    pub fn key_id(&self) -> i64 {
        self.lease.key_id
    }

    /// Commits the phase: its writes and the new recovery point become visible together.
    pub async fn commit(self) -> Result<(), Error> {
        let key_id = self.lease.key_id;
        self.tx.commit().await.map_err(Error::db(format!(
            "commit phase {} of key {key_id}",
            self.to.name()
        )))?;
        self.lease.recovery_point = self.to;
        self.lease.locked_until = self.locked_until;
        Ok(())
    }
}

/// The last phase of a request: its writes, the stored response and the lease release commit
/// together.
#[derive(Debug)]
pub struct FinalPhase<'l, P: RecoveryPoint> {
    tx: Transaction<'static, Postgres>,
    lease: &'l mut Lease<P>,
    now: Option<OffsetDateTime>,
}

impl<P: RecoveryPoint> FinalPhase<'_, P> {
    /// The transaction's connection, for the phase's business writes.
    pub fn conn(&mut self) -> &mut PgConnection {
        &mut self.tx
    }

    /// The key row being worked.
    pub fn key_id(&self) -> i64 {
        self.lease.key_id
    }

    /// Stores `response`, marks the key finished, releases the lease and commits.
    pub async fn finish(mut self, response: &StoredResponse) -> Result<(), Error> {
        let key_id = self.lease.key_id;
        let context = || format!("finish key {key_id}");
        // The row is locked by this transaction's fenced update, so no token check is needed
        // again; it is kept anyway so that this statement is safe on its own.
        let finished = sqlx::query(
            r#"
            UPDATE idempotency_keys
            SET recovery_point   = $4,
                response_status  = $5,
                response_headers = $6,
                response_body    = $7,
                locked_until     = NULL,
                finished_at      = coalesce($8::timestamptz, now())
            WHERE id = $1 AND user_id = $2 AND lease_token = $3
            "#,
        )
        .bind(key_id)
        .bind(self.lease.user_id)
        .bind(self.lease.token)
        .bind(P::FINISHED.name())
        .bind(response.status as i16)
        .bind(Json(&response.headers))
        .bind(&response.body)
        .bind(self.now)
        .execute(&mut *self.tx)
        .await
        .map_err(Error::db(context()))?;
        if finished.rows_affected() == 0 {
            return Err(Error::LeaseLost {
                key_id,
                token: self.lease.token,
            });
        }
        self.tx.commit().await.map_err(Error::db(context()))?;
        self.lease.recovery_point = P::FINISHED;
        Ok(())
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
    pub user_id: i64,
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
    "id, request_uuid, user_id, request_method, request_path, idempotency_key, \
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
            user_id: row.try_get("user_id").map_err(get)?,
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

fn lease_from_row<P: RecoveryPoint>(row: &PgRow, user_id: i64) -> Result<Lease<P>, Error> {
    let key_id: i64 = row.get("id");
    let point: String = row.get("recovery_point");
    let recovery_point =
        P::from_name(&point).ok_or(Error::UnknownRecoveryPoint { key_id, point })?;
    Ok(Lease {
        key_id,
        request_uuid: row.get("request_uuid"),
        user_id,
        token: row.get("lease_token"),
        attempts: row.get("attempts"),
        completer_attempts: row.get("completer_attempts"),
        recovery_point,
        params: row.get::<Json<Value>, _>("request_params").0,
        locked_until: row.get("locked_until"),
    })
}

fn stored_response(row: &PgRow, key_id: i64) -> Result<StoredResponse, Error> {
    let status: Option<i16> = row.get("response_status");
    let headers: Option<Json<Vec<(String, String)>>> =
        row.try_get("response_headers")
            .map_err(|_| Error::Corrupt {
                key_id,
                what: "response_headers",
            })?;
    let body: Option<Vec<u8>> = row.get("response_body");
    match (status, headers, body) {
        (Some(status), Some(Json(headers)), Some(body)) => {
            let status = u16::try_from(status).map_err(|_| Error::Corrupt {
                key_id,
                what: "response_status",
            })?;
            Ok(StoredResponse {
                status,
                headers,
                body,
            })
        }
        _ => Err(Error::Corrupt {
            key_id,
            what: "stored response",
        }),
    }
}
