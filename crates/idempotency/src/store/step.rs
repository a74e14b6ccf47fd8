//! The statements of a workflow's step ([`crate::workflow`]): a transaction fenced when it
//! opens, before the step's first write, and a recovery point chosen only when the step ends.
//!
//! [`Store::phase`] must know its destination when it opens (its fence writes it); a step learns
//! it by running. So a step's transaction opens with a fence that only locks the key row
//! (`SELECT … FOR UPDATE`, fenced by the token, as the final phase's does), and the one write of
//! the key row comes at the end, in the same transaction: the new recovery point and a lease
//! extended from the transaction's start, or the stored response. The row lock taken at the
//! fence serialises the step against any claimer, exactly as a phase's fenced update does.

use std::time::{Duration, Instant};

use sqlx::{PgConnection, Postgres, Transaction};
use time::OffsetDateTime;

use super::claim::FirstPhase;
use super::model::{Lease, RecoveryPoint, Store};
use super::phase::finish_key;
use crate::lease::writing;
use crate::{Error, StoredResponse};

/// The savepoint every step's transaction takes once fenced, before the step's first write: a
/// final refusal ([`crate::workflow::Halt::fail`]) rolls back to it, so that the refusal is
/// stored without the step's writes.
const STEP_SAVEPOINT: &str = "SAVEPOINT idempotency_step";
const ROLLBACK_STEP: &str = "ROLLBACK TO SAVEPOINT idempotency_step";

/// A step's transaction, fenced: the key row is locked and the lease was this holder's when it
/// was locked.
#[derive(Debug)]
pub(crate) struct OpenStep {
    tx: Transaction<'static, Postgres>,
    /// When the fence was asked for, on the lease clock: the lease the step's commit sets runs
    /// from the transaction's start, which is no earlier.
    fenced_at: Duration,
    opened: Instant,
}

impl OpenStep {
    pub(crate) fn conn(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}

impl Store {
    /// Opens a step's transaction and fences it: the key row is locked if, and only if, the
    /// lease is still `lease`'s ([`Error::LeaseLost`] otherwise, and nothing is written). Takes
    /// the step's savepoint.
    pub(crate) async fn open_step<P: RecoveryPoint>(
        &self,
        lease: &Lease<P>,
    ) -> Result<OpenStep, Error> {
        writing(lease, "phase");
        let context = format!("open a step of key {}", lease.key_id);
        // Before BEGIN: the lease the commit sets runs from the transaction's start.
        let fenced_at = self.lease_clock();
        let opened = Instant::now();
        let mut tx = self
            .pool
            .begin()
            .await
            .map_err(Error::db(context.clone()))?;
        let held: Option<i32> = sqlx::query_scalar(
            r#"
            -- The fence: a lock, not an update, so that the key row is written once, when the
            -- step ends (its new point, or its response). The lock keeps claimers out until then.
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
        .map_err(Error::db(context))?;
        if held.is_none() {
            return Err(Error::LeaseLost {
                key_id: lease.key_id,
                token: lease.token,
            });
        }
        savepoint(&mut tx, lease.key_id).await?;
        Ok(OpenStep {
            tx,
            fenced_at,
            opened,
        })
    }

    /// Moves the key to `to` in `conn`'s transaction, fenced, and extends the lease by a TTL
    /// from the transaction's start. The caller commits.
    pub(crate) async fn move_point<P: RecoveryPoint>(
        &self,
        conn: &mut PgConnection,
        lease: &Lease<P>,
        to: P,
    ) -> Result<OffsetDateTime, Error> {
        if to == P::STARTED || to == P::FINISHED {
            return Err(Error::InvalidTransition {
                key_id: lease.key_id,
                to: to.name(),
            });
        }
        let locked_until = self
            .move_fenced(conn, lease, to.name())
            .await
            .map_err(Error::db(format!(
                "move key {} to {}",
                lease.key_id,
                to.name()
            )))?;
        locked_until.ok_or(Error::LeaseLost {
            key_id: lease.key_id,
            token: lease.token,
        })
    }

    /// Ends a step at recovery point `to`: the step's writes and the new point commit together.
    pub(crate) async fn commit_step<P: RecoveryPoint>(
        &self,
        mut step: OpenStep,
        lease: &mut Lease<P>,
        to: P,
    ) -> Result<(), Error> {
        let locked_until = self.move_point(&mut step.tx, lease, to).await?;
        let context = format!("commit step {} of key {}", to.name(), lease.key_id);
        super::commit(step.tx, context).await?;
        lease.recovery_point = to;
        lease.locked_until = locked_until;
        lease.confirmed_at = step.fenced_at;
        self.observer
            .phase_committed(to.name(), step.opened.elapsed());
        Ok(())
    }

    /// Ends a request with `response`: the step's writes (none if `roll_back`: a refusal), the
    /// stored response and the release of the lease commit together.
    pub(crate) async fn finish_step<P: RecoveryPoint>(
        &self,
        mut step: OpenStep,
        lease: &mut Lease<P>,
        response: &StoredResponse,
        roll_back: bool,
    ) -> Result<(), Error> {
        if roll_back {
            roll_back_step(&mut step.tx, lease.key_id).await?;
        }
        finish_key(&mut step.tx, lease, response, self.now(), self.persistent()).await?;
        super::commit(step.tx, format!("finish key {}", lease.key_id)).await?;
        lease.recovery_point = P::FINISHED;
        self.observer
            .phase_committed(P::FINISHED.name(), step.opened.elapsed());
        Ok(())
    }
}

impl Store {
    /// Ends the first step of a new key, whose claim is `first`'s transaction, at `to`: the key,
    /// the step's writes and the point commit together.
    pub(crate) async fn commit_first_step<P: RecoveryPoint>(
        &self,
        mut first: FirstPhase<P>,
        to: P,
    ) -> Result<Lease<P>, Error> {
        let locked_until = {
            let lease = first.lease().fence();
            self.move_point(first.conn(), &lease, to).await?
        };
        let mut lease = first.commit().await?;
        lease.recovery_point = to;
        lease.locked_until = locked_until;
        Ok(lease)
    }
}

/// Takes the step's savepoint in `conn`'s transaction.
pub(crate) async fn savepoint(conn: &mut PgConnection, key_id: i64) -> Result<(), Error> {
    // Unnamed: nothing to prepare or cache for a statement without parameters. (Not `raw_sql`,
    // whose future the compiler cannot prove `Send` inside a generic one.)
    sqlx::query(STEP_SAVEPOINT)
        .persistent(false)
        .execute(conn)
        .await
        .map_err(Error::db(format!("open a step of key {key_id}")))?;
    Ok(())
}

/// Undoes the step's writes, back to its savepoint.
pub(crate) async fn roll_back_step(conn: &mut PgConnection, key_id: i64) -> Result<(), Error> {
    sqlx::query(ROLLBACK_STEP)
        .persistent(false)
        .execute(conn)
        .await
        .map_err(Error::db(format!("roll back a step of key {key_id}")))?;
    Ok(())
}
