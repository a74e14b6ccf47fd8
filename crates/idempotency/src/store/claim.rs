//! The claim: read the key first, and write only for a key that is absent, can be taken over, or
//! finished longer ago than the store's retention (expired: replaced by a new row); alone, or
//! merged with the request's first phase.

use std::time::{Duration, Instant};

use sqlx::postgres::PgRow;
use sqlx::types::Json;
use sqlx::{PgConnection, Postgres, Row, Transaction};
use time::OffsetDateTime;
use uuid::Uuid;

use super::model::{
    is_referenced, lease_from_row, stored_response, Claim, Lease, NewRequest, RecoveryPoint, Store,
};
use super::phase::finish_key;
use super::unless_cancelled;
use crate::commit_watch::watched;
use crate::observe::{ClaimOutcome, Observed};
use crate::{BindTime, Error, StoredResponse};

/// How often the claim starts over when the row changed under it (inserted by a concurrent
/// request, released, reaped). More than a few rounds means heavy contention, and the caller is
/// told to retry later.
const CLAIM_ROUNDS: usize = 3;

/// PostgreSQL's `lock_not_available`: a `lock_timeout` ran out. During an insert it means
/// another transaction holds the same key, uncommitted: the request is in flight.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// Why an expired key is refused when a row still references it: the claim's error says this,
/// after the key, and changes nothing.
const EXPIRY_REFERENCED: &str =
    "a row of another table still references it under a foreign key that refuses the delete; a \
     key that expires at read is deleted, so foreign keys to idempotency_keys must be ON DELETE \
     SET NULL";

/// The answer to a refused claim when the other holder's lease cannot be read: its transaction
/// has not committed yet.
const IN_FLIGHT_UNCOMMITTED: Duration = Duration::from_secs(1);

/// What the key's row says before anything is written.
enum Found<P> {
    /// No row: the key is new.
    Absent,
    /// An unfinished row of the same payload whose lease is free or over.
    Claimable,
    /// A finished row whose finish is older than the store's retention, whatever its payload: the
    /// request is a new one. The row is deleted and the key inserted again.
    Expired(Expired),
    /// A finished row, another payload, or a held lease.
    Refused(Claim<P>),
}

/// The row of an expired key as the claim read it: its delete is fenced on both.
#[derive(Debug, Clone, Copy)]
struct Expired {
    key_id: i64,
    finished_at: OffsetDateTime,
}

/// The outcome of [`Store::begin`] and [`Store::begin_optimistic`].
#[derive(Debug)]
pub enum Begun<P: RecoveryPoint> {
    /// The key was new, or its earlier use finished longer ago than the store's retention
    /// ([`Store::with_retention`]). It is inserted, at the first point, inside an open
    /// transaction (which also deleted the expired row): write the first phase's rows through
    /// [`FirstPhase::conn`] and commit; until then no other request sees the key, and a
    /// concurrent one with the same key waits for this one's end.
    New(FirstPhase<P>),
    /// The key existed: its lease was taken over ([`Claim::Acquired`]; resume from its recovery
    /// point), or the claim was refused.
    Existing(Claim<P>),
}

impl Store {
    /// Acquires the lease of the request's key, inserting the key at `STARTED` if it is new.
    ///
    /// The key is read first, without locks: a replay, a payload mismatch or a held lease is
    /// answered from that read and writes nothing. Only a key that is absent (an insert),
    /// unfinished with its lease free or over (a takeover, with the next fencing token), or
    /// expired (below) is written. To merge the claim with the first phase, see
    /// [`Store::begin`].
    ///
    /// A key that finished longer ago than the store's retention ([`Store::with_retention`];
    /// by default none) is expired: whatever its payload, the claim deletes its row and inserts
    /// the key again, in one transaction, and the caller gets a new lease (a new key id and
    /// request UUID, token 1) as for a key never seen. A row that references the old one under
    /// a foreign key that refuses the delete makes the claim fail ([`Error::Database`]) and
    /// changes nothing. Unfinished keys never expire.
    #[tracing::instrument(
        name = "idempotency.claim",
        level = "debug",
        skip_all,
        fields(owner = req.owner.as_str(), method = req.method, route = req.route)
    )]
    pub async fn claim<P: RecoveryPoint>(&self, req: NewRequest<'_>) -> Result<Claim<P>, Error> {
        let started = Instant::now();
        let claimed = self.claim_unobserved(req).await;
        if let Ok(claim) = &claimed {
            let outcome = ClaimOutcome::of_claim(claim);
            self.observer.claimed(req.route, outcome, started.elapsed());
        }
        claimed
    }

    async fn claim_unobserved<P: RecoveryPoint>(
        &self,
        req: NewRequest<'_>,
    ) -> Result<Claim<P>, Error> {
        for _ in 0..CLAIM_ROUNDS {
            match self.lookup_alone(&req).await? {
                Found::Refused(refusal) => return Ok(refusal),
                Found::Claimable => match self.take_over_alone(&req).await? {
                    Taken::Lease(lease) => return Ok(Claim::Acquired(lease)),
                    Taken::Locked => return Ok(in_flight_uncommitted()),
                    Taken::NotClaimable => {}
                },
                Found::Expired(expired) => {
                    // Before BEGIN: the insert's `now()` is the transaction's start.
                    let asked_at = self.lease_clock();
                    let mut tx = self.begin_tx(&req).await?;
                    match self
                        .replace_expired(&req, P::STARTED, true, &mut tx, expired, asked_at)
                        .await?
                    {
                        Inserted::Row(lease) => {
                            let (committed, cancelled) = watched(tx.commit()).await;
                            committed.map_err(|e| expiry_error(&req, expired, e))?;
                            unless_cancelled(cancelled, claim_context(&req))?;
                            return Ok(Claim::Acquired(lease));
                        }
                        // Dropping the transaction rolls it back.
                        Inserted::Conflict => {}
                        Inserted::Locked => return Ok(in_flight_uncommitted()),
                    }
                }
                Found::Absent => {
                    // The key and its row of idempotency_keys_unfinished: two statements, one
                    // transaction. Before BEGIN: the insert's `now()` is the transaction's
                    // start.
                    let asked_at = self.lease_clock();
                    let mut tx = self.begin_tx(&req).await?;
                    match self
                        .insert(&req, P::STARTED, true, &mut tx, asked_at)
                        .await?
                    {
                        Inserted::Row(lease) => {
                            super::commit(tx, claim_context(&req)).await?;
                            return Ok(Claim::Acquired(lease));
                        }
                        Inserted::Conflict => {}
                        Inserted::Locked => return Ok(in_flight_uncommitted()),
                    }
                }
            }
            // The row changed between the read and the write: read again.
        }
        Ok(in_flight_uncommitted())
    }

    /// The claim merged with the request's first phase, for a request that expects replays:
    /// the key is read first, as in [`Store::claim`], so a replay writes nothing. A new key is
    /// inserted directly at `first` inside a transaction that the caller continues with the
    /// phase's own rows ([`Begun::New`]): one transaction instead of two.
    ///
    /// `first` may be `STARTED` (the row then says only that the request began), not `FINISHED`
    /// ([`FirstPhase::finish`] stores a response).
    ///
    /// An expired key (see [`Store::claim`]) is [`Begun::New`] too: the transaction deletes its
    /// old row before it inserts the new one, and a concurrent claimer waits on that delete.
    #[tracing::instrument(
        name = "idempotency.claim",
        level = "debug",
        skip_all,
        fields(owner = req.owner.as_str(), method = req.method, route = req.route)
    )]
    pub async fn begin<P: RecoveryPoint>(
        &self,
        req: NewRequest<'_>,
        first: P,
    ) -> Result<Begun<P>, Error> {
        let started = Instant::now();
        let begun = self.begin_unobserved(req, first).await;
        if let Ok(begun) = &begun {
            let outcome = ClaimOutcome::of_begun(begun);
            self.observer.claimed(req.route, outcome, started.elapsed());
        }
        begun
    }

    async fn begin_unobserved<P: RecoveryPoint>(
        &self,
        req: NewRequest<'_>,
        first: P,
    ) -> Result<Begun<P>, Error> {
        check_first(first)?;
        for _ in 0..CLAIM_ROUNDS {
            match self.lookup_alone(&req).await? {
                Found::Refused(refusal) => return Ok(Begun::Existing(refusal)),
                Found::Claimable => match self.take_over_alone(&req).await? {
                    Taken::Lease(lease) => return Ok(Begun::Existing(Claim::Acquired(lease))),
                    Taken::Locked => return Ok(Begun::Existing(in_flight_uncommitted())),
                    Taken::NotClaimable => {}
                },
                Found::Expired(expired) => {
                    let asked_at = self.lease_clock();
                    let mut tx = self.begin_tx(&req).await?;
                    match self
                        .replace_expired(&req, first, true, &mut tx, expired, asked_at)
                        .await?
                    {
                        Inserted::Row(lease) => {
                            return Ok(Begun::New(FirstPhase::new(self, tx, lease, true)))
                        }
                        Inserted::Conflict => {}
                        Inserted::Locked => return Ok(Begun::Existing(in_flight_uncommitted())),
                    }
                }
                Found::Absent => {
                    // Before BEGIN: the insert's `now()` is the transaction's start.
                    let asked_at = self.lease_clock();
                    let mut tx = self.begin_tx(&req).await?;
                    match self.insert(&req, first, true, &mut tx, asked_at).await? {
                        Inserted::Row(lease) => {
                            return Ok(Begun::New(FirstPhase::new(self, tx, lease, true)))
                        }
                        // Dropping the transaction rolls it back.
                        Inserted::Conflict => {}
                        Inserted::Locked => return Ok(Begun::Existing(in_flight_uncommitted())),
                    }
                }
            }
        }
        Ok(Begun::Existing(in_flight_uncommitted()))
    }

    /// The claim merged with the request's first phase, for a request that rarely repeats: one
    /// transaction, whose first statement inserts the key at `first`. When the key exists, the
    /// same transaction reads it and takes it over or tells why not, so a new request and a
    /// retry each cost one transaction; a replay costs one too, which inserts no row and locks
    /// nothing (the insert's attempt does draw a value of the key table's id sequence).
    ///
    /// A concurrent request with the same key waits for this transaction to end; set a
    /// `lock_timeout` on the connections to bound that wait: when it runs out, the claim
    /// answers [`Claim::InFlight`]. An expired key (see [`Store::claim`]) is deleted and
    /// inserted again in the same transaction, and answered [`Begun::New`].
    #[tracing::instrument(
        name = "idempotency.claim",
        level = "debug",
        skip_all,
        fields(owner = req.owner.as_str(), method = req.method, route = req.route)
    )]
    pub async fn begin_optimistic<P: RecoveryPoint>(
        &self,
        req: NewRequest<'_>,
        first: P,
    ) -> Result<Begun<P>, Error> {
        let started = Instant::now();
        let begun = self.begin_optimistic_unobserved(req, first).await;
        if let Ok(begun) = &begun {
            let outcome = ClaimOutcome::of_begun(begun);
            self.observer.claimed(req.route, outcome, started.elapsed());
        }
        begun
    }

    async fn begin_optimistic_unobserved<P: RecoveryPoint>(
        &self,
        req: NewRequest<'_>,
        first: P,
    ) -> Result<Begun<P>, Error> {
        check_first(first)?;
        for _ in 0..CLAIM_ROUNDS {
            // Before BEGIN: the insert's and the takeover's `now()` is the transaction's start.
            let asked_at = self.lease_clock();
            let mut tx = self.begin_tx(&req).await?;
            match self.insert(&req, first, false, &mut tx, asked_at).await? {
                Inserted::Row(lease) => {
                    return Ok(Begun::New(FirstPhase::new(self, tx, lease, false)))
                }
                Inserted::Locked => {
                    drop(tx);
                    return self.locked_out(&req).await.map(Begun::Existing);
                }
                Inserted::Conflict => {}
            }
            let claim = match self.lookup(&req, &mut *tx).await? {
                Found::Refused(refusal) => Some(refusal),
                Found::Claimable => match self.take_over(&req, &mut *tx, asked_at).await? {
                    Taken::Lease(lease) => Some(Claim::Acquired(lease)),
                    Taken::Locked => {
                        drop(tx);
                        return self.locked_out(&req).await.map(Begun::Existing);
                    }
                    Taken::NotClaimable => None,
                },
                Found::Expired(expired) => {
                    match self
                        .replace_expired(&req, first, false, &mut tx, expired, asked_at)
                        .await?
                    {
                        Inserted::Row(lease) => {
                            return Ok(Begun::New(FirstPhase::new(self, tx, lease, false)))
                        }
                        Inserted::Locked => {
                            drop(tx);
                            return self.locked_out(&req).await.map(Begun::Existing);
                        }
                        Inserted::Conflict => None,
                    }
                }
                Found::Absent => None,
            };
            match claim {
                Some(Claim::Acquired(lease)) => {
                    super::commit(tx, claim_context(&req)).await?;
                    return Ok(Begun::Existing(Claim::Acquired(lease)));
                }
                // A refusal wrote nothing: the transaction ends without a commit.
                Some(refusal) => return Ok(Begun::Existing(refusal)),
                None => {}
            }
        }
        Ok(Begun::Existing(in_flight_uncommitted()))
    }

    /// The answer when the lock timeout ran out on the key's row: another transaction is
    /// inserting it (in flight), or is updating or deleting a row that may well be finished
    /// (a finish, the reaper, a claim that expires it). One plain read tells a replay or a
    /// mismatch from a key in flight.
    async fn locked_out<P: RecoveryPoint>(&self, req: &NewRequest<'_>) -> Result<Claim<P>, Error> {
        Ok(match self.lookup_alone(req).await? {
            Found::Refused(refusal @ (Claim::Replay(_) | Claim::Mismatch)) => refusal,
            _ => in_flight_uncommitted(),
        })
    }

    async fn begin_tx(
        &self,
        req: &NewRequest<'_>,
    ) -> Result<Transaction<'static, Postgres>, Error> {
        self.pool
            .begin()
            .await
            .map_err(Error::db(claim_context(req)))
    }

    /// [`Store::lookup`] as a statement of its own.
    async fn lookup_alone<P: RecoveryPoint>(
        &self,
        req: &NewRequest<'_>,
    ) -> Result<Found<P>, Error> {
        let mut db = self
            .autocommit()
            .await
            .map_err(Error::db(claim_context(req)))?;
        let found = self.lookup(req, db.conn()).await?;
        db.done().await.map_err(Error::db(claim_context(req)))?;
        Ok(found)
    }

    /// [`Store::take_over`] as a statement of its own; its lease runs from before its `BEGIN`,
    /// if it has one.
    async fn take_over_alone<P: RecoveryPoint>(
        &self,
        req: &NewRequest<'_>,
    ) -> Result<Taken<P>, Error> {
        let asked_at = self.lease_clock();
        let mut db = self
            .autocommit()
            .await
            .map_err(Error::db(claim_context(req)))?;
        let taken = self.take_over(req, db.conn(), asked_at).await?;
        if matches!(taken, Taken::Lease(_)) {
            db.confirmed(claim_context(req)).await?;
        } else {
            db.done().await.map_err(Error::db(claim_context(req)))?;
        }
        Ok(taken)
    }

    /// Reads the key's row, without locks, and tells what a claim may do with it.
    async fn lookup<'c, P: RecoveryPoint>(
        &self,
        req: &NewRequest<'_>,
        db: impl sqlx::PgExecutor<'c>,
    ) -> Result<Found<P>, Error> {
        let timed = self.timed(
            r#"
            SELECT id, fingerprint, finished_at IS NOT NULL AS finished, finished_at,
                   response_status, response_headers, response_body,
                   ceil(extract(epoch FROM locked_until - $now) * 1000)
                       ::bigint AS lease_millis_left,
                   -- The reaper's own age test (maintenance.rs), so that a read and a reaper
                   -- pass with the same retention agree on every key. NULL, not expired, for
                   -- an unfinished key or a store without a retention ($5 NULL).
                   finished_at < $now - $5 * interval '1 millisecond'
                       AS expired
            FROM idempotency_keys
            WHERE owner = $1 AND request_method = $2 AND request_path = $3
              AND idempotency_key = $4
            "#,
        );
        let row = sqlx::query(timed.sql())
            .bind(req.owner.as_str())
            .bind(req.method)
            .bind(req.route)
            .bind(req.key.as_str())
            .bind(self.retention_millis())
            .bind_now(&timed)
            .persistent(self.persistent())
            .fetch_optional(db)
            .await
            .map_err(Error::db(format!(
                "read key {:?} of owner {}",
                req.key.as_str(),
                req.owner
            )))?;
        let Some(row) = row else {
            return Ok(Found::Absent);
        };
        classify(&row, req)
    }

    /// Takes over the lease of an unfinished key of the same payload whose lease is free or
    /// over, with the next fencing token; `None` when the row no longer qualifies (another
    /// claimer was first, or it finished). The row is locked `NOWAIT` and checked again under
    /// the lock, so two claimers never both get it; a row another transaction holds (a phase
    /// under way) is [`Taken::Locked`], in flight, and no claimer waits on it.
    async fn take_over<'c, P: RecoveryPoint>(
        &self,
        req: &NewRequest<'_>,
        db: impl sqlx::PgExecutor<'c>,
        asked_at: Duration,
    ) -> Result<Taken<P>, Error> {
        let timed = self.timed(
            r#"
            -- NOWAIT: a row locked by a phase in progress (or a transactional handler holding the
            -- key's final phase open) is in flight, answered at once; a claimer that waited on
            -- it would hold its connection for as long, and retries would pile up on the pool.
            WITH free AS (
                SELECT id FROM idempotency_keys
                WHERE owner = $1 AND request_method = $2 AND request_path = $3
                  AND idempotency_key = $4
                  AND finished_at IS NULL
                  AND fingerprint = $5
                  AND (locked_until IS NULL OR locked_until <= $now)
                FOR UPDATE NOWAIT
            )
            UPDATE idempotency_keys k
            SET lease_token  = k.lease_token + 1,
                attempts     = k.attempts + 1,
                locked_until = $now + $6 * interval '1 millisecond',
                last_run_at  = $now
            FROM free
            WHERE k.owner = $1 AND k.id = free.id
            RETURNING k.id, k.request_uuid, k.lease_token, k.attempts, k.completer_attempts,
                      k.recovery_point, k.request_params, k.locked_until
            "#,
        );
        let row = sqlx::query(timed.sql())
            .bind(req.owner.as_str())
            .bind(req.method)
            .bind(req.route)
            .bind(req.key.as_str())
            .bind(req.fingerprint.as_bytes().as_slice())
            .bind(self.ttl_millis())
            .bind_now(&timed)
            .persistent(self.persistent())
            .fetch_optional(db);
        // Outside a transaction the statement commits by itself: a takeover whose commit the
        // standby may not have is not a lease to act on.
        let (row, cancelled) = watched(row).await;
        match row {
            Ok(Some(row)) => {
                unless_cancelled(cancelled, claim_context(req))?;
                lease_from_row(&row, req.owner.clone(), asked_at).map(Taken::Lease)
            }
            Ok(None) => Ok(Taken::NotClaimable),
            Err(e) if is_lock_timeout(&e) => Ok(Taken::Locked),
            Err(e) => Err(Error::db(claim_context(req))(e)),
        }
    }

    /// Inserts the key at `point` with token 1, unless it exists. `track` also inserts its row
    /// of `idempotency_keys_unfinished`, by a second statement: `conn` must then be in a
    /// transaction, so that both commit or neither. Without it, whoever commits the key
    /// unfinished must add that row first ([`FirstPhase::commit`] does).
    async fn insert<P: RecoveryPoint>(
        &self,
        req: &NewRequest<'_>,
        point: P,
        track: bool,
        conn: &mut PgConnection,
        asked_at: Duration,
    ) -> Result<Inserted<P>, Error> {
        let timed = self.timed(
            r#"
            INSERT INTO idempotency_keys
                (owner, request_method, request_path, idempotency_key, fingerprint,
                 request_params, recovery_point, locked_until, created_at, last_run_at)
            VALUES ($1, $2, $3, $4, $5, $6, $7,
                    $now + $8 * interval '1 millisecond',
                    $now, $now)
            ON CONFLICT (owner, request_method, request_path, idempotency_key) DO NOTHING
            RETURNING id, request_uuid, locked_until, created_at
            "#,
        );
        let row = sqlx::query(timed.sql())
            .bind(req.owner.as_str())
            .bind(req.method)
            .bind(req.route)
            .bind(req.key.as_str())
            .bind(req.fingerprint.as_bytes().as_slice())
            .bind(Json(req.params))
            .bind(point.name())
            .bind(self.ttl_millis())
            .bind_now(&timed)
            .persistent(self.persistent())
            .fetch_optional(&mut *conn);
        // Every caller runs it in a transaction, whose commit it watches; a cancelled wait here
        // (none is expected before the commit) is refused all the same: a key whose commit the
        // standby may not have must not name a foreign request (its UUID) yet.
        let (row, cancelled) = watched(row).await;
        let row = match row {
            Ok(row) => {
                if row.is_some() {
                    unless_cancelled(cancelled, claim_context(req))?;
                }
                row
            }
            Err(e) if is_lock_timeout(&e) => return Ok(Inserted::Locked),
            Err(e) => return Err(Error::db(claim_context(req))(e)),
        };
        let Some(row) = row else {
            return Ok(Inserted::Conflict);
        };
        if track {
            // A statement of its own, in the caller's transaction: on Citus, two inserts in one
            // statement (CTEs) go through the coordinator to every worker.
            sqlx::query(
                "INSERT INTO idempotency_keys_unfinished
                     (owner, key_id, request_method, request_path, created_at)
                 VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(req.owner.as_str())
            .bind(row.get::<i64, _>("id"))
            .bind(req.method)
            .bind(req.route)
            .bind(row.get::<OffsetDateTime, _>("created_at"))
            .persistent(self.persistent())
            .execute(&mut *conn)
            .await
            .map_err(Error::db(claim_context(req)))?;
        }
        Ok(Inserted::Row(Lease {
            key_id: row.get("id"),
            request_uuid: row.get::<Uuid, _>("request_uuid"),
            owner: req.owner.clone(),
            token: 1,
            attempts: 1,
            completer_attempts: 0,
            recovery_point: point,
            params: req.params.clone(),
            locked_until: row.get::<OffsetDateTime, _>("locked_until"),
            confirmed_at: asked_at,
        }))
    }

    /// Deletes the expired row the claim read and inserts the key anew at `point`, in the
    /// caller's transaction, which must commit both or neither. The delete is fenced on the row's
    /// id and `finished_at` (finished rows are never updated, so this is the row that was read)
    /// and tests the age again; it locks the old row until the transaction ends, so a
    /// concurrent claimer's delete waits, then matches nothing and reads again. Zero rows (the
    /// reaper or another claimer was first) is [`Inserted::Conflict`]: read again.
    async fn replace_expired<P: RecoveryPoint>(
        &self,
        req: &NewRequest<'_>,
        point: P,
        track: bool,
        conn: &mut PgConnection,
        expired: Expired,
        asked_at: Duration,
    ) -> Result<Inserted<P>, Error> {
        let timed = self.timed(
            r#"
            DELETE FROM idempotency_keys
            WHERE owner = $1 AND id = $2
              AND finished_at = $3
              AND finished_at < $now - $4 * interval '1 millisecond'
            "#,
        );
        let deleted = sqlx::query(timed.sql())
            .bind(req.owner.as_str())
            .bind(expired.key_id)
            .bind(expired.finished_at)
            .bind(self.retention_millis())
            .bind_now(&timed)
            .persistent(self.persistent())
            .execute(&mut *conn)
            .await;
        match deleted {
            Ok(done) if done.rows_affected() == 0 => return Ok(Inserted::Conflict),
            Ok(_) => {}
            Err(e) if is_lock_timeout(&e) => return Ok(Inserted::Locked),
            Err(e) => return Err(expiry_error(req, expired, e)),
        }
        tracing::info!(
            owner = req.owner.as_str(),
            expired_key_id = expired.key_id,
            finished_at = %expired.finished_at,
            "idempotency key past its retention: answered as a new request"
        );
        self.insert(req, point, track, conn, asked_at).await
    }
}

/// The error of a claim that could not replace an expired key: the delete, or the commit of a
/// transaction whose deferred foreign keys refuse it.
fn expiry_error(req: &NewRequest<'_>, expired: Expired, e: sqlx::Error) -> Error {
    let referenced = is_referenced(&e);
    let context = format!(
        "expire key {:?} of owner {} (row {}, finished at {} and past the retention)",
        req.key.as_str(),
        req.owner,
        expired.key_id,
        expired.finished_at
    );
    Error::Database {
        context: if referenced {
            format!("{context}: {EXPIRY_REFERENCED}")
        } else {
            context
        },
        source: e,
    }
}

/// What a takeover did.
enum Taken<P> {
    Lease(Lease<P>),
    /// The row no longer qualifies: another claimer was first, or it finished.
    NotClaimable,
    /// Another transaction holds the row, and the connection's `lock_timeout` ran out.
    Locked,
}

fn is_lock_timeout(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(e) if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE))
}

/// What an insert did.
enum Inserted<P> {
    Row(Lease<P>),
    /// The key exists (for an expired key: its row changed or went since it was read): read
    /// again.
    Conflict,
    /// Another transaction holds the key (inserting it, or updating or deleting its row) and
    /// the connection's `lock_timeout` ran out waiting for it.
    Locked,
}

fn check_first<P: RecoveryPoint>(first: P) -> Result<(), Error> {
    if first == P::FINISHED {
        return Err(Error::InvalidTransition {
            key_id: 0,
            to: first.name(),
        });
    }
    Ok(())
}

fn claim_context(req: &NewRequest<'_>) -> String {
    format!("claim key {:?} for owner {}", req.key.as_str(), req.owner)
}

fn in_flight_uncommitted<P>() -> Claim<P> {
    Claim::InFlight {
        retry_after: IN_FLIGHT_UNCOMMITTED,
    }
}

/// Tells what a claim may do with an existing row.
fn classify<P: RecoveryPoint>(row: &PgRow, req: &NewRequest<'_>) -> Result<Found<P>, Error> {
    let key_id: i64 = row.get("id");
    // Before the payload: after expiry the key is a new request, whatever it carries.
    if row.get::<Option<bool>, _>("expired") == Some(true) {
        return Ok(Found::Expired(Expired {
            key_id,
            finished_at: row.get("finished_at"),
        }));
    }
    let fingerprint: Vec<u8> = row.get("fingerprint");
    if fingerprint.as_slice() != req.fingerprint.as_bytes() {
        return Ok(Found::Refused(Claim::Mismatch));
    }
    if row.get::<bool, _>("finished") {
        return stored_response(row, key_id).map(|r| Found::Refused(Claim::Replay(r)));
    }
    match row.get::<Option<i64>, _>("lease_millis_left") {
        Some(left) if left > 0 => {
            // Round up: a client that waits the advertised time must find the lease free.
            let secs = (left as u64).div_ceil(1000).max(1);
            Ok(Found::Refused(Claim::InFlight {
                retry_after: Duration::from_secs(secs),
            }))
        }
        _ => Ok(Found::Claimable),
    }
}

/// A new key's first phase: the transaction that inserted the key, left open for the phase's
/// own rows. Dropping it without [`FirstPhase::commit`] or [`FirstPhase::finish`] rolls back
/// the key with them, as if the request had never come.
#[derive(Debug)]
#[must_use = "a dropped first phase rolls back its key and its rows: commit or finish it"]
pub struct FirstPhase<P: RecoveryPoint> {
    tx: Transaction<'static, Postgres>,
    lease: Lease<P>,
    tracked: bool,
    now: Option<OffsetDateTime>,
    persistent: bool,
    opened: Instant,
    observer: Observed,
}

impl<P: RecoveryPoint> FirstPhase<P> {
    fn new(
        store: &Store,
        tx: Transaction<'static, Postgres>,
        lease: Lease<P>,
        tracked: bool,
    ) -> Self {
        Self {
            tx,
            lease,
            tracked,
            now: store.now(),
            persistent: store.persistent(),
            opened: Instant::now(),
            observer: store.observer.clone(),
        }
    }

    /// The transaction's connection, for the phase's business writes.
    pub fn conn(&mut self) -> &mut PgConnection {
        &mut self.tx
    }

    /// The lease the request will hold once the phase commits (its key id and request UUID are
    /// known already).
    pub fn lease(&self) -> &Lease<P> {
        &self.lease
    }

    /// Commits the key at the first point with the phase's rows, and hands the lease over for
    /// the next phases.
    pub async fn commit(mut self) -> Result<Lease<P>, Error> {
        let key_id = self.lease.key_id;
        let context = || format!("commit the first phase of key {key_id}");
        if !self.tracked {
            sqlx::query(
                r#"
                INSERT INTO idempotency_keys_unfinished
                    (owner, key_id, request_method, request_path, created_at)
                SELECT owner, id, request_method, request_path, created_at
                FROM idempotency_keys WHERE owner = $1 AND id = $2
                "#,
            )
            .bind(self.lease.owner.as_str())
            .bind(key_id)
            .persistent(self.persistent)
            .execute(&mut *self.tx)
            .await
            .map_err(Error::db(context()))?;
        }
        super::commit(self.tx, context()).await?;
        let point = self.lease.recovery_point.name();
        self.observer.phase_committed(point, self.opened.elapsed());
        Ok(self.lease)
    }

    /// Stores `response`, marks the key finished and commits: a request done in one
    /// transaction, claim included.
    pub async fn finish(mut self, response: &StoredResponse) -> Result<(), Error> {
        finish_key(
            &mut self.tx,
            &self.lease,
            response,
            self.now,
            self.persistent,
        )
        .await?;
        let key_id = self.lease.key_id;
        super::commit(self.tx, format!("finish key {key_id}")).await?;
        self.observer
            .phase_committed(P::FINISHED.name(), self.opened.elapsed());
        Ok(())
    }
}
