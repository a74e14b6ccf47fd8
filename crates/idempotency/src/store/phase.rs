//! Phases and the lease: the fenced update that opens every phase, the final phase that stores
//! the response, renewal, release, and abandoning a key that must leave no trace.

use std::time::Instant;

use sqlx::types::Json;
use sqlx::{PgConnection, Postgres, Row, Transaction};
use time::OffsetDateTime;

use super::model::{is_referenced, Lease, RecoveryPoint, Store};
use crate::lease::{writing, LEASE_LOG};
use crate::observe::Observed;
use crate::{BindTime, Error, StoredResponse, Timed};

impl Store {
    /// Opens a phase that moves the key to recovery point `to` when it commits.
    ///
    /// The fenced update runs first; on [`Error::LeaseLost`] nothing was written. Write the
    /// phase's business rows through [`Phase::conn`], then [`Phase::commit`].
    #[tracing::instrument(
        name = "idempotency.phase",
        level = "debug",
        skip_all,
        fields(key_id = lease.key_id, token = lease.token, to = to.name())
    )]
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
        writing(lease, "phase");
        let opened = Instant::now();
        let fenced_at = self.lease_clock();
        let (tx, locked_until) = self.fence(lease, to.name()).await?;
        Ok(Phase {
            tx,
            lease,
            to,
            locked_until,
            fenced_at,
            opened,
            observer: self.observer.clone(),
        })
    }

    /// Opens the phase that stores the final response and releases the lease.
    ///
    /// Its fence locks the key row (`SELECT … FOR UPDATE`) instead of updating it: the row is
    /// then written once, by [`FinalPhase::finish`], and that one update is HOT.
    #[tracing::instrument(
        name = "idempotency.final_phase",
        level = "debug",
        skip_all,
        fields(key_id = lease.key_id, token = lease.token, from = lease.recovery_point.name())
    )]
    pub async fn final_phase<'l, P: RecoveryPoint>(
        &self,
        lease: &'l mut Lease<P>,
    ) -> Result<FinalPhase<'l, P>, Error> {
        writing(lease, "final_phase");
        let opened = Instant::now();
        let context = || format!("open the final phase of key {}", lease.key_id);
        let mut tx = self.pool.begin().await.map_err(Error::db(context()))?;
        let held: Option<i32> = sqlx::query_scalar(
            r#"
            SELECT 1 FROM idempotency_keys
            WHERE id = $1 AND owner = $2 AND lease_token = $3 AND finished_at IS NULL
            FOR UPDATE
            "#,
        )
        .bind(lease.key_id)
        .bind(lease.owner.as_str())
        .bind(lease.token)
        .persistent(self.persistent())
        .fetch_optional(&mut *tx)
        .await
        .map_err(Error::db(context()))?;
        if held.is_none() {
            return Err(Error::LeaseLost {
                key_id: lease.key_id,
                token: lease.token,
            });
        }
        Ok(FinalPhase {
            tx,
            lease,
            now: self.now(),
            persistent: self.persistent(),
            opened,
            observer: self.observer.clone(),
        })
    }

    /// Opens the final phase of a lease it takes, so that the phase can be handed to another
    /// task (a handler that writes through its transaction, as `idempotency-axum`'s transactional
    /// mode does): its writes and the stored response then commit together, or not at all.
    ///
    /// On an error the lease comes back with it, to release (or, after
    /// [`Error::LeaseLost`], to drop).
    pub async fn final_phase_owned<P: RecoveryPoint>(
        &self,
        mut lease: Lease<P>,
    ) -> Result<OwnedFinalPhase<P>, (Error, Lease<P>)> {
        match self.final_phase(&mut lease).await {
            Ok(phase) => {
                let FinalPhase {
                    tx,
                    now,
                    persistent,
                    opened,
                    observer,
                    ..
                } = phase;
                Ok(OwnedFinalPhase {
                    tx,
                    lease,
                    now,
                    persistent,
                    opened,
                    observer,
                })
            }
            Err(e) => Err((e, lease)),
        }
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
        let locked_until = self
            .move_fenced(&mut tx, lease, point)
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

    /// The fenced move of a key to recovery point `point`, its lease extended by one TTL from
    /// now: the statement that opens a phase and that ends a workflow's step. `None`: the fence
    /// matched nothing (the lease is lost, or the key finished).
    pub(crate) async fn move_fenced<P: RecoveryPoint>(
        &self,
        conn: &mut PgConnection,
        lease: &Lease<P>,
        point: &str,
    ) -> Result<Option<OffsetDateTime>, sqlx::Error> {
        let timed = self.timed(
            r#"
            UPDATE idempotency_keys
            SET recovery_point = $4,
                locked_until   = $now + $5 * interval '1 millisecond',
                last_run_at    = $now
            WHERE id = $1 AND owner = $2 AND lease_token = $3 AND finished_at IS NULL
            RETURNING locked_until
            "#,
        );
        sqlx::query_scalar(timed.sql())
            .bind(lease.key_id)
            .bind(lease.owner.as_str())
            .bind(lease.token)
            .bind(point)
            .bind(self.ttl_millis())
            .bind_now(&timed)
            .persistent(self.persistent())
            .fetch_optional(conn)
            .await
    }

    /// Extends a held lease by one TTL from now (a heartbeat during a long foreign call).
    pub async fn renew<P: RecoveryPoint>(&self, lease: &mut Lease<P>) -> Result<(), Error> {
        let context = || format!("renew lease of key {}", lease.key_id);
        // Before BEGIN, if there is one: the update's `now()` is then the transaction's start.
        let asked_at = self.lease_clock();
        let mut db = self.autocommit().await.map_err(Error::db(context()))?;
        let timed = self.timed(
            r#"
            UPDATE idempotency_keys
            SET locked_until = $now + $4 * interval '1 millisecond'
            WHERE id = $1 AND owner = $2 AND lease_token = $3 AND finished_at IS NULL
              -- Only a lease still held: a renewal reaching the row after its holder released
              -- it (its answer given up on) must not lock the key again for a TTL.
              AND locked_until IS NOT NULL
            RETURNING locked_until
            "#,
        );
        let locked_until: Option<OffsetDateTime> = sqlx::query_scalar(timed.sql())
            .bind(lease.key_id)
            .bind(lease.owner.as_str())
            .bind(lease.token)
            .bind(self.ttl_millis())
            .bind_now(&timed)
            .persistent(self.persistent())
            .fetch_optional(db.conn())
            .await
            .map_err(Error::db(context()))?;
        db.done().await.map_err(Error::db(context()))?;
        match locked_until {
            Some(until) => {
                lease.locked_until = until;
                lease.confirmed_at = asked_at;
                Ok(())
            }
            None => {
                tracing::warn!(
                    target: LEASE_LOG,
                    key_id = lease.key_id,
                    token = lease.token,
                    lost_on_renewal = true,
                    "lease lost on renewal: nothing more may be written under it"
                );
                Err(Error::LeaseLost {
                    key_id: lease.key_id,
                    token: lease.token,
                })
            }
        }
    }

    /// Gives the lease up after a transient failure, keeping the recovery point, so that a retry
    /// or the completer can resume at once instead of waiting for the lease to expire.
    pub async fn release<P: RecoveryPoint>(&self, lease: Lease<P>) -> Result<(), Error> {
        writing(&lease, "release");
        let context = || format!("release lease of key {}", lease.key_id);
        let mut db = self.autocommit().await.map_err(Error::db(context()))?;
        let released = sqlx::query(
            r#"
            UPDATE idempotency_keys
            SET locked_until = NULL
            WHERE id = $1 AND owner = $2 AND lease_token = $3 AND finished_at IS NULL
            "#,
        )
        .bind(lease.key_id)
        .bind(lease.owner.as_str())
        .bind(lease.token)
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

    /// Deletes the key like [`Store::abandon`], or, if rows of the application still reference
    /// it (their foreign keys refuse the delete), releases it instead, keeping the row and its
    /// recovery point. Either way the lease is given up at once.
    pub async fn abandon_or_release<P: RecoveryPoint>(
        &self,
        lease: Lease<P>,
    ) -> Result<Abandoned, Error> {
        writing(&lease, "abandon");
        match self.delete_unfinished(&lease).await {
            Ok(()) => Ok(Abandoned::Deleted),
            Err(Error::Database { source, .. }) if is_referenced(&source) => {
                self.release(lease).await?;
                Ok(Abandoned::Released)
            }
            Err(e) => Err(e),
        }
    }

    /// Deletes the key of a request that turned out to be one the application refuses without
    /// an outcome to keep (a 400 found only after the claim, say), so that the key is as if it
    /// had never been sent: a later request may use it again, with any payload. Fenced like a
    /// release; a finished key is never deleted.
    ///
    /// Delete only a key that has written nothing. Rows referencing it under a foreign key that
    /// refuses the delete (`RESTRICT`, `NO ACTION`) keep it, and the store's error says so
    /// ([`Store::abandon_or_release`] releases it instead); under `ON DELETE SET NULL`, which
    /// expiry at read needs, the delete goes through and the rows lose their reference.
    pub async fn abandon<P: RecoveryPoint>(&self, lease: Lease<P>) -> Result<(), Error> {
        writing(&lease, "abandon");
        self.delete_unfinished(&lease).await
    }

    /// The fenced delete of an unfinished key and its row of `idempotency_keys_unfinished`.
    async fn delete_unfinished<P: RecoveryPoint>(&self, lease: &Lease<P>) -> Result<(), Error> {
        let context = || format!("abandon key {}", lease.key_id);
        let mut db = self.autocommit().await.map_err(Error::db(context()))?;
        let deleted = sqlx::query(
            r#"
            WITH deleted AS (
                DELETE FROM idempotency_keys
                WHERE id = $1 AND owner = $2 AND lease_token = $3 AND finished_at IS NULL
                RETURNING owner, id
            ), untracked AS (
                -- The owner as a parameter too: one shard on Citus (see finish_key).
                DELETE FROM idempotency_keys_unfinished u USING deleted d
                WHERE u.owner = $2 AND u.owner = d.owner AND u.key_id = d.id
            )
            SELECT count(*) FROM deleted
            "#,
        )
        .bind(lease.key_id)
        .bind(lease.owner.as_str())
        .bind(lease.token)
        .persistent(self.persistent())
        .fetch_one(db.conn())
        .await
        .map_err(Error::db(context()))?;
        // A foreign key that refuses the delete fails here too when it is deferred.
        db.done().await.map_err(Error::db(context()))?;
        if deleted.get::<i64, _>(0) == 0 {
            return Err(Error::LeaseLost {
                key_id: lease.key_id,
                token: lease.token,
            });
        }
        Ok(())
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
    opened: Instant,
    observer: Observed,
    /// When the fence was asked for: the lease it extended runs from no later than this.
    fenced_at: std::time::Duration,
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
        let context = format!("commit phase {} of key {key_id}", self.to.name());
        super::commit(self.tx, context).await?;
        self.lease.recovery_point = self.to;
        self.lease.locked_until = self.locked_until;
        self.lease.confirmed_at = self.fenced_at;
        self.observer
            .phase_committed(self.to.name(), self.opened.elapsed());
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
    persistent: bool,
    opened: Instant,
    observer: Observed,
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
        finish_key(
            &mut self.tx,
            self.lease,
            response,
            self.now,
            self.persistent,
        )
        .await?;
        let key_id = self.lease.key_id;
        super::commit(self.tx, format!("finish key {key_id}")).await?;
        self.lease.recovery_point = P::FINISHED;
        self.observer
            .phase_committed(P::FINISHED.name(), self.opened.elapsed());
        Ok(())
    }
}

/// The last phase of a request, owning its lease: see [`Store::final_phase_owned`].
///
/// Dropping it rolls back everything written through it and leaves the lease to expire; call
/// [`OwnedFinalPhase::roll_back`] to get the lease back and release it at once.
#[derive(Debug)]
pub struct OwnedFinalPhase<P: RecoveryPoint> {
    tx: Transaction<'static, Postgres>,
    lease: Lease<P>,
    now: Option<OffsetDateTime>,
    persistent: bool,
    opened: Instant,
    observer: Observed,
}

impl<P: RecoveryPoint> OwnedFinalPhase<P> {
    /// The transaction's connection, for the phase's business writes.
    pub fn conn(&mut self) -> &mut PgConnection {
        &mut self.tx
    }

    /// The lease the phase holds.
    pub fn lease(&self) -> &Lease<P> {
        &self.lease
    }

    /// Stores `response`, marks the key finished, releases the lease and commits, with every
    /// write made through [`OwnedFinalPhase::conn`].
    ///
    /// On an error the lease comes back with it: nothing of the phase was kept (or, after a
    /// commit whose answer was lost, everything was, and the key is finished), so release it
    /// for the retry; a release of a key that did finish is refused as [`Error::LeaseLost`].
    pub async fn finish(mut self, response: &StoredResponse) -> Result<(), (Error, Lease<P>)> {
        if let Err(e) = finish_key(
            &mut self.tx,
            &self.lease,
            response,
            self.now,
            self.persistent,
        )
        .await
        {
            return Err((e, self.roll_back().await));
        }
        let Self {
            tx,
            lease,
            opened,
            observer,
            ..
        } = self;
        let key_id = lease.key_id;
        match super::commit(tx, format!("finish key {key_id}")).await {
            Ok(()) => {
                observer.phase_committed(P::FINISHED.name(), opened.elapsed());
                Ok(())
            }
            Err(e) => Err((e, lease)),
        }
    }

    /// Undoes every write made through the phase and gives the lease back, unfinished, to
    /// release (the answer was not final) or to drop.
    pub async fn roll_back(self) -> Lease<P> {
        let key_id = self.lease.key_id;
        if let Err(e) = self.tx.rollback().await {
            // The connection is gone: the server rolled the transaction back with it.
            tracing::warn!(key_id, error = %e, "could not roll the final phase back");
        }
        self.lease
    }
}

/// What [`Store::abandon_or_release`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Abandoned {
    /// The key row is gone: the key may be used again, with any payload.
    Deleted,
    /// Rows of the application reference the key: it was released, and keeps its payload.
    Released,
}

/// The statement that finishes a key: the response stored, the lease released, and the key's
/// row of `idempotency_keys_unfinished` deleted. Fenced by the token, so that it is safe on its
/// own; in a final phase the row is locked already.
pub(super) async fn finish_key<P: RecoveryPoint>(
    conn: &mut PgConnection,
    lease: &Lease<P>,
    response: &StoredResponse,
    now: Option<OffsetDateTime>,
    persistent: bool,
) -> Result<(), Error> {
    let key_id = lease.key_id;
    let timed = Timed::new(
        r#"
        WITH finished AS (
            UPDATE idempotency_keys
            SET recovery_point   = $4,
                response_status  = $5,
                response_headers = $6,
                response_body    = $7,
                locked_until     = NULL,
                finished_at      = $now
            WHERE id = $1 AND owner = $2 AND lease_token = $3 AND finished_at IS NULL
            RETURNING owner, id
        ), untracked AS (
            -- The owner as a parameter too, so that Citus addresses this delete to the key's
            -- shard (through the CTE alone it would send it to every shard).
            DELETE FROM idempotency_keys_unfinished u USING finished f
            WHERE u.owner = $2 AND u.owner = f.owner AND u.key_id = f.id
        )
        SELECT count(*) FROM finished
        "#,
        now,
    );
    let finished: i64 = sqlx::query_scalar(timed.sql())
        .bind(key_id)
        .bind(lease.owner.as_str())
        .bind(lease.token)
        .bind(P::FINISHED.name())
        .bind(response.status as i16)
        .bind(Json(&response.headers))
        .bind(&response.body)
        .bind_now(&timed)
        .persistent(persistent)
        .fetch_one(conn)
        .await
        .map_err(Error::db(format!("finish key {key_id}")))?;
    if finished == 0 {
        return Err(Error::LeaseLost {
            key_id,
            token: lease.token,
        });
    }
    Ok(())
}
