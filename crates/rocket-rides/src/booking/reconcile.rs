//! Reconciliation: when the gateway key can no longer be trusted, the customer's charges are
//! listed for the request's own (never while a call may still be running at the gateway), and
//! without one the key moves to its next generation or the kept refusal becomes the outcome.

use std::time::{Duration, Instant};

use idempotency::{Advance, BindTime, Halt, Step, Timed};
use serde_json::json;
use sqlx::types::Json;
use time::OffsetDateTime;

use super::error::{db, BookingError};
use super::outcomes::gateway_error;
use super::rows::audit;
use super::target::{Charging, Doubt, Found, Kept, RidePoint};
use crate::metrics::{GatewayCall, Reconciliation};
use crate::stripe::{Charge, ChargeError, ChargeStatus, Refusal};

/// How far a reconciling list reaches before the recorded first attempt and after the last call's
/// processing bound: the gateway stamps `created` with its own clock, which may be behind or
/// ahead of ours. Clocks only: how late a call may leave after its record is the heartbeat's
/// part of the range, not the skew's. Charges of other requests that the wider range brings in
/// are told apart by their metadata.
pub const RECONCILE_CLOCK_SKEW: time::Duration = time::Duration::minutes(10);

impl Doubt {
    /// Whether the list must wait for every call under the key to be over. A replayed 5xx proves
    /// that the key's request finished at the gateway (a request still running under the key
    /// would have been answered 409), and the calls of earlier generations were over before
    /// this one began; any other doubt comes with no such proof.
    fn waits_for_calls(self) -> bool {
        match self {
            Self::StoredServerError => false,
            Self::PastWindow | Self::IdempotencyError | Self::RefusedAfterUnknown => true,
        }
    }

    /// What follows a list that found no charge for the request: the next generation of the key
    /// charges, or the gateway's refusal is the request's outcome.
    fn charges_again(self) -> bool {
        match self {
            Self::PastWindow | Self::StoredServerError => true,
            Self::IdempotencyError | Self::RefusedAfterUnknown => false,
        }
    }
}

impl Charging<'_> {
    /// Clears a doubt: waits (503) while a call under the key may still be running, then lists
    /// the customer's charges for the request's own, and without one moves on as the doubt
    /// says. `None`: the target moved to the key's next generation, which charges.
    pub(super) async fn reconcile(
        &mut self,
        step: &mut Step<'_, RidePoint>,
        doubt: Doubt,
    ) -> Result<Option<Advance<RidePoint>>, Halt> {
        let state = self.rider.state;
        if doubt.waits_for_calls() {
            if self.target.attempts_unknown {
                // An earlier version's ride: its last call is unknown, and may have been just
                // now. The wait runs from this record.
                self.record_attempt(step).await?;
                self.target.attempts_unknown = false;
            }
            self.wait_for_calls().await?;
        }
        if let Some(charge) = self.find_own_charge(step).await? {
            state.metrics.reconciliation(Reconciliation::Adopted);
            return self.settle(step, charge, Found::Adopted).await.map(Some);
        }
        state.metrics.reconciliation(Reconciliation::NoneFound);
        if !doubt.charges_again() {
            let refusal = self.target.refusal.take().ok_or_else(|| {
                BookingError::Internal(format!(
                    "ride {} is in doubt ({doubt:?}) without the gateway's refusal",
                    self.target.ride_id
                ))
            })?;
            return self.refused(step, &refusal.0).await.map(Some);
        }
        self.next_generation(step).await?;
        Ok(None)
    }

    /// Never list while a call may still be running: a charge still being made inside the
    /// gateway is in no list yet, and a new generation would charge a second time. A call
    /// leaves at most one `--lease-heartbeat` after its record (`charge.rs`), so the list waits
    /// until the last call's record is older than the heartbeat plus
    /// `--gateway-processing-bound`; until then the request answers 503 with the time left as
    /// `Retry-After`, and the completer waits as long.
    async fn wait_for_calls(&self) -> Result<(), BookingError> {
        let state = self.rider.state;
        if state.failpoints.list_while_in_flight() {
            // The chaos harness's negative control: the list is made at once.
            return Ok(());
        }
        let bound = state.gateway_processing_bound + state.store.heartbeat();
        let mut conn = state
            .store
            .autocommit()
            .await
            .map_err(db("read the ride's last gateway call"))?;
        let mut pg = state.store.statements_on(conn.conn());
        let timed = state.store.timed(
            r#"
            SELECT ceil(extract(epoch FROM coalesce(charge_attempted_at, $now)
                                           + $3 * interval '1 millisecond'
                                           - $now) * 1000)::bigint
            FROM rides WHERE user_id = $1 AND key_owner = $1::text AND id = $2
            "#,
        );
        let left: i64 = sqlx::query_scalar(timed.sql())
            .bind(self.rider.user_id)
            .bind(self.target.ride_id)
            .bind(millis(bound))
            .bind_now(&timed)
            .fetch_one(&mut pg)
            .await
            .map_err(db("read the ride's last gateway call"))?;
        conn.done()
            .await
            .map_err(db("read the ride's last gateway call"))?;
        if left > 0 {
            state.metrics.reconciliation(Reconciliation::Deferred);
            // Never more than the bound itself, whatever a step of the database's clock says.
            let retry_after = Duration::from_millis(left as u64).min(bound);
            tracing::info!(
                key_id = self.rider.key_id,
                ride_id = self.target.ride_id,
                ?retry_after,
                "a call under the gateway key may still be running; reconciling later"
            );
            return Err(BookingError::Unconfirmed { retry_after });
        }
        Ok(())
    }

    /// Keeps on the ride why its charge is in doubt, and the refusal to store if no charge turns
    /// up, so that the next attempt lists instead of asking the key again (which would only
    /// move the time the list has to wait for).
    pub(super) async fn keep_doubt(
        &mut self,
        step: &mut Step<'_, RidePoint>,
        doubt: Doubt,
        refusal: Refusal,
    ) -> Result<(), Halt> {
        let (state, user_id, ride_id) = (self.rider.state, self.rider.user_id, self.target.ride_id);
        let name = doubt.kept_name().ok_or_else(|| {
            BookingError::Internal(format!("doubt {doubt:?} is not kept on the ride"))
        })?;
        tracing::warn!(
            key_id = self.rider.key_id,
            ride_id,
            doubt = name,
            status = refusal.status,
            kind = %refusal.kind,
            "the gateway refused, but may hold a charge for the request; reconciling first"
        );
        let lease = step.lease().await?;
        let point = lease.recovery_point();
        let mut phase = state.store.phase(lease, point).await?;
        let mut pg = state.store.statements_on(phase.conn());
        sqlx::query(
            "UPDATE rides SET charge_doubt = $3, charge_refusal = $4, updated_at = now()
             WHERE id = $1 AND user_id = $2 AND key_owner = $2::text",
        )
        .bind(ride_id)
        .bind(user_id)
        .bind(name)
        .bind(Json(&refusal))
        .execute(&mut pg)
        .await
        .map_err(db("keep the charge's doubt"))?;
        audit(
            &mut pg,
            user_id,
            "ride.charge_in_doubt",
            ride_id,
            json!({ "doubt": name, "gateway_error": gateway_error(&refusal) }),
        )
        .await?;
        phase.commit().await?;
        self.target.doubt = Kept(Some(doubt));
        self.target.refusal = Some(Json(refusal));
        Ok(())
    }

    /// Lists the customer's charges from the first attempt to the last call's bound, and returns
    /// the one made for this request, if any. More than one means an invariant broke somewhere:
    /// the oldest paid one is taken and the rest are reported, for an operator to refund.
    ///
    /// The range is bounded at both ends, each widened by the clock skew allowed between us and
    /// the gateway: no charge of the request can be older than its first attempt, nor younger
    /// than the last call's record plus one heartbeat (a call leaves within one of its record,
    /// by the holder's own clock: `since_record` in `charge.rs`) plus the gateway's processing
    /// bound. The heartbeat comes from `--lease-heartbeat`, up to half an hour, so the skew need
    /// not cover it. A key stuck for months lists months of nothing.
    async fn find_own_charge(
        &self,
        step: &mut Step<'_, RidePoint>,
    ) -> Result<Option<Charge>, Halt> {
        let (state, target) = (self.rider.state, &self.target);
        let since = (target.first_attempt_at - RECONCILE_CLOCK_SKEW).unix_timestamp();
        let until = (target.attempted_at
            + state.store.heartbeat()
            + state.gateway_processing_bound
            + RECONCILE_CLOCK_SKEW)
            .unix_timestamp();
        let mut listed = self
            .list(step, Some(&target.customer), since, until)
            .await?;
        if let Err(ChargeError::Refused(refusal)) = &listed {
            if refusal.param.as_deref() == Some("customer") {
                // The customer is gone (deleted, say) and the gateway will not list by it: the
                // same range over the whole account, told apart by metadata below.
                tracing::warn!(
                    key_id = self.rider.key_id,
                    customer = %target.customer,
                    "the gateway refuses to list the customer's charges; listing the account's"
                );
                listed = self.list(step, None, since, until).await?;
            }
        }
        let listed = listed.map_err(|e| match e {
            ChargeError::Misconfigured(why) => BookingError::GatewayMisconfigured(why),
            // No list, no knowledge: never charge blind. A list refused for good leaves the key
            // for an operator.
            other => BookingError::GatewayUnavailable(format!("reconcile: {other}")),
        })?;
        let request = self.rider.request.to_string();
        let mut own: Vec<Charge> = listed
            .into_iter()
            .filter(|c| c.request() == Some(request.as_str()))
            .collect();
        // Paid before pending before failed; the oldest of each.
        own.sort_by_key(|c| (status_rank(&c.status), c.created));
        if own.len() > 1 {
            let ids: Vec<&str> = own.iter().map(|c| c.id.as_str()).collect();
            tracing::error!(
                key_id = self.rider.key_id,
                charges = ?ids,
                "more than one gateway charge names this request; adopting the first, refund the rest"
            );
        }
        Ok(own.into_iter().next())
    }

    /// One reconciling list, under the lease, timed.
    async fn list(
        &self,
        step: &mut Step<'_, RidePoint>,
        customer: Option<&str>,
        since: i64,
        until: i64,
    ) -> Result<Result<Vec<Charge>, ChargeError>, Halt> {
        let state = self.rider.state;
        let started = Instant::now();
        let listed = self
            .under_lease(step, state.stripe.list_charges(customer, since, until))
            .await;
        state
            .metrics
            .gateway_call(GatewayCall::ListCharges, started.elapsed());
        listed
    }

    /// Starts the next generation of the gateway key, in a fenced transaction of its own before
    /// the call; the doubt that led here is cleared with it. Moves the target to the new
    /// generation.
    async fn next_generation(&mut self, step: &mut Step<'_, RidePoint>) -> Result<(), Halt> {
        let (state, user_id, ride_id) = (self.rider.state, self.rider.user_id, self.target.ride_id);
        let now = state.store.now();
        let lease = step.lease().await?;
        let point = lease.recovery_point();
        let mut phase = state.store.phase(lease, point).await?;
        let mut pg = state.store.statements_on(phase.conn());
        let timed = Timed::new(
            "UPDATE rides SET charge_generation = charge_generation + 1,
                              charge_generation_at = $now,
                              charge_attempted_at = $now,
                              charge_doubt = NULL, charge_refusal = NULL,
                              updated_at = now()
             WHERE id = $1 AND user_id = $2 AND key_owner = $2::text
             RETURNING charge_generation, charge_generation_at",
            now,
        );
        let (generation, generation_at): (i32, OffsetDateTime) = sqlx::query_as(timed.sql())
            .bind(ride_id)
            .bind(user_id)
            .bind_now(&timed)
            .fetch_one(&mut pg)
            .await
            .map_err(db("start a new charge generation"))?;
        audit(
            &mut pg,
            user_id,
            "ride.charge_generation_started",
            ride_id,
            json!({ "generation": generation, "after": self.target.generation }),
        )
        .await?;
        phase.commit().await?;
        tracing::warn!(
            ride_id,
            generation,
            "no charge found for the request; charging under a new key generation"
        );
        let target = &mut self.target;
        target.generation = generation;
        target.attempted_at = generation_at;
        target.past_window = false;
        target.doubt = Kept(None);
        target.refusal = None;
        target.fresh = true;
        Ok(())
    }
}

fn millis(duration: Duration) -> i64 {
    duration.as_millis().min(i64::MAX as u128) as i64
}

/// The order in which charges naming the request are adopted: paid first, then pending.
fn status_rank(status: &ChargeStatus) -> u8 {
    match status {
        ChargeStatus::Succeeded => 0,
        ChargeStatus::Pending => 1,
        ChargeStatus::Failed | ChargeStatus::Unknown => 2,
    }
}
