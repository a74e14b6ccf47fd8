//! The charge step's own part: what it reads about its ride, and its loop of gateway calls under
//! the lease, each call's time recorded before it leaves. What an answer leads to is in
//! `outcomes.rs`; what happens when the key is in doubt, in `reconcile.rs`. All three are
//! methods of [`Charging`].

use std::time::Instant;

use idempotency::{Advance, BindTime, Halt, Lease, Step};
use time::OffsetDateTime;

use super::error::{db, BookingError};
use super::target::{
    gateway_key, ChargeTarget, Charging, Doubt, Found, Kept, RidePoint, Rider, Window,
};
use crate::admission::Admitted;
use crate::failpoints::{self, Gateway};
use crate::metrics::{ChargeOutcome, GatewayCall};
use crate::stripe::{Charge, ChargeError, NewCharge};

impl ChargeTarget {
    /// Reads the ride of `rider`'s key. `fresh`: the ride was created, or its call recorded, by
    /// this holder, with no call since ([`Step::arrived`]).
    pub(super) async fn load(rider: &Rider<'_>, fresh: bool) -> Result<Self, BookingError> {
        let state = rider.state;
        let window = state.gateway_key_window.as_millis().min(i64::MAX as u128) as i64;
        let mut conn = state.store.autocommit().await.map_err(db("load ride"))?;
        let mut pg = state.store.statements_on(conn.conn());
        let timed = state.store.timed(
            r#"
            SELECT r.id AS ride_id, r.amount_cents, r.charge_id,
                   u.stripe_customer_id AS customer,
                   r.charge_generation AS generation,
                   r.charge_first_attempt_at AS first_attempt_at,
                   r.charge_generation_at
                       <= $now - $3 * interval '1 millisecond'
                       AS past_window,
                   coalesce(r.charge_attempted_at, $now)
                       AS attempted_at,
                   r.charge_attempted_at IS NULL AS attempts_unknown,
                   r.charge_doubt AS doubt, r.charge_refusal AS refusal,
                   $4::boolean AS fresh
            FROM rides r JOIN users u ON u.id = r.user_id
            WHERE r.user_id = $1 AND r.key_owner = $1::text AND r.idempotency_key_id = $2
            "#,
        );
        let target = sqlx::query_as(timed.sql())
            .bind(rider.user_id)
            .bind(rider.key_id)
            .bind(window)
            .bind(fresh)
            .bind_now(&timed)
            .fetch_optional(&mut pg)
            .await
            .map_err(db("load ride"))?
            .ok_or_else(|| BookingError::Internal(format!("no ride for key {}", rider.key_id)))?;
        conn.done().await.map_err(db("load ride"))?;
        Ok(target)
    }
}

impl<'a> Charging<'a> {
    /// What the charge step works with: its ride, as the step before handed it on in this run,
    /// or read. The ride's creation, or the last call's record, stands for the next call's
    /// record when this holder wrote it ([`Step::arrived`]).
    pub(super) async fn begin(
        rider: Rider<'a>,
        slot: Option<&'a Admitted>,
        step: &mut Step<'_, RidePoint>,
    ) -> Result<Self, Halt> {
        let target = match step.handed::<ChargeTarget>() {
            Some(target) => target,
            None => ChargeTarget::load(&rider, step.arrived()).await?,
        };
        // Only the step that created the ride moves a key to a charge step's point
        // (`charge_pending` is reached inside the charge step), and it hands the ride on:
        // arrived here, nothing was read or written since its commit.
        failpoints::charge_step_begins(&rider.state.failpoints, step.arrived()).await;
        Ok(Charging {
            rider,
            target,
            slot,
        })
    }
}

impl Charging<'_> {
    /// The gateway call (after a reconciliation when the key cannot be trusted), then the
    /// outcome: the charge recorded with the 201, or a decline, or a refusal.
    pub(super) async fn run(
        mut self,
        step: &mut Step<'_, RidePoint>,
    ) -> Result<Advance<RidePoint>, Halt> {
        let state = self.rider.state;
        let mut reconciled = false;
        loop {
            // What the call's seam passes first (`failpoints::gateway`): a new generation's
            // commit, or nothing of its own.
            let mut passing = Gateway::Leaving;
            if let Some(doubt) = self.target.doubt() {
                reconciled = true;
                match self.reconcile(step, doubt).await? {
                    Some(end) => return Ok(end),
                    // No charge of the request's: the key's next generation committed, and its
                    // call follows.
                    None => passing = Gateway::NewGeneration,
                }
            }
            // Every call's time is recorded before it leaves, and the call leaves within one
            // heartbeat of its record by the holder's own clock: a list waits for the calls to
            // be over, and its range reaches the charges they make, counting from the record.
            // The step that created the ride stands for a generation's first record. A holder
            // that stood still longer since its record (a paused process, even one whose lease
            // nobody took meanwhile) records the call anew rather than send it late, and the
            // fenced record finds out whether the lease is still this holder's.
            // The statement that records the call also decides, against the database's clock,
            // whether the generation is past the key window: a holder that stood still since it
            // read its ride must not call under a key the gateway may have forgotten.
            let resumed = !self.target.fresh;
            loop {
                failpoints::gateway(&state.failpoints, passing).await;
                if self.target.fresh
                    && since_record(state, step.lease().await?) < state.store.heartbeat()
                {
                    break;
                }
                if self.record_attempt(step).await? == Window::Past {
                    break;
                }
                self.target.fresh = true;
                passing = Gateway::Recorded;
            }
            if self.target.past_window {
                // Nothing was sent: reconcile first.
                continue;
            }
            self.target.fresh = false;
            let result = self.call_gateway(step).await?;
            state.metrics.charge(ChargeOutcome::of(&result));
            let error = match result {
                Ok(charge) => return self.settle(step, charge, Found::Created).await,
                Err(error) => error,
            };
            match error {
                // The key holds a failure for good: find out what happened, once.
                ChargeError::StoredServerError { status, message } if !reconciled => {
                    tracing::warn!(
                        key_id = self.rider.key_id,
                        status,
                        message,
                        "the gateway replays a stored error under this key; reconciling"
                    );
                    self.target.doubt = Kept(Some(Doubt::StoredServerError));
                }
                // The chaos harness's negative control: an unknown outcome is not a decline.
                ChargeError::Transient(why) if state.failpoints.unknown_is_declined() => {
                    return self.declined(step, "processing_error", &why).await
                }
                // The chaos harness's negative control: a page that is not the gateway's,
                // refusing.
                ChargeError::UnknownAnswer { status }
                    if state.failpoints.unknown_answer_is_refusal()
                        && (400..500).contains(&status) =>
                {
                    return self
                        .refused(step, &super::outcomes::made_up_refusal(status))
                        .await;
                }
                ChargeError::Refused(refusal) => {
                    // Final only when the gateway holds no charge of ours for certain: it
                    // answered this key's first use, and not with an idempotency error.
                    let doubt = if refusal.is_idempotency_error() {
                        Doubt::IdempotencyError
                    } else if resumed {
                        Doubt::RefusedAfterUnknown
                    } else {
                        return self.refused(step, &refusal).await;
                    };
                    self.keep_doubt(step, doubt, refusal).await?;
                }
                other => return self.refusal_or_error(step, other).await,
            }
        }
    }

    /// Asks the gateway for the ride's charge under the current generation's key.
    async fn call_gateway(
        &self,
        step: &mut Step<'_, RidePoint>,
    ) -> Result<Result<Charge, ChargeError>, Halt> {
        let (state, target) = (self.rider.state, &self.target);
        let key = gateway_key(self.rider.request, target.generation);
        let key = if state.failpoints.fresh_gateway_key() {
            // The chaos harness's negative control: the bug this whole design exists to prevent.
            format!("{key}:attempt-{}", step.lease().await?.token())
        } else {
            key
        };
        let (ride_id, request) = (target.ride_id.to_string(), self.rider.request.to_string());
        let description = format!("Rocket Rides ride {}", target.ride_id);
        let metadata = [
            ("ride_id", ride_id),
            (crate::stripe::REQUEST_METADATA, request),
        ];
        let new_charge = NewCharge {
            amount_cents: i64::from(target.amount_cents),
            customer: &target.customer,
            description: &description,
            metadata: &metadata,
        };
        let started = Instant::now();
        let result = self
            .under_lease(step, state.stripe.create_charge(&key, &new_charge))
            .await;
        state
            .metrics
            .gateway_call(GatewayCall::CreateCharge, started.elapsed());
        result
    }

    /// Awaits a foreign call under the lease, with the library's lease kit
    /// ([`idempotency::Store::watch_under_lease`]): confirmed before the call (a holder that
    /// stood still past its lease may have lost the key, and its new holder may have moved on to
    /// another generation of the gateway key: charging this one now would charge twice), renewed
    /// during it, and abandoned at once when a renewal finds the lease taken over (the new
    /// holder carries on under the same gateway key) or goes unanswered while the lease lasts.
    /// While the call is out, the request's admission slot is given back, and taken again
    /// (never shed) once it answers ([`crate::admission::Admitted::away`]): the call holds no pooled connection.
    pub(super) async fn under_lease<T>(
        &self,
        step: &mut Step<'_, RidePoint>,
        call: impl std::future::Future<Output = T>,
    ) -> Result<T, Halt> {
        let state = self.rider.state;
        let mut call = std::pin::pin!(async {
            match self.slot {
                Some(slot) => slot.away(call).await,
                None => call.await,
            }
        });
        match state
            .store
            .watch_under_lease(step.lease().await?, &mut call)
            .await
        {
            Ok(outcome) => Ok(outcome),
            // The chaos harness's negative control: the holder goes on regardless.
            Err(idempotency::Error::LeaseLost { .. })
                if state.failpoints.carry_on_after_lost_lease() =>
            {
                Ok(call.await)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Records, before a call leaves, that the current generation's key is being used now. A
    /// fenced transaction of its own, committed before the call, so that the time is on the ride
    /// before the gateway can act; the same statement decides, against the database's clock,
    /// whether the generation is past the key window, so that a holder that stood still since
    /// it read its ride does not call under a key the gateway may have forgotten.
    pub(super) async fn record_attempt(
        &mut self,
        step: &mut Step<'_, RidePoint>,
    ) -> Result<Window, Halt> {
        let state = self.rider.state;
        let window = state.gateway_key_window.as_millis().min(i64::MAX as u128) as i64;
        let lease = step.lease().await?;
        let point = lease.recovery_point();
        let mut phase = state.store.phase(lease, point).await?;
        let mut pg = state.store.statements_on(phase.conn());
        // Past the window, no call leaves: the last call's time stays what it was, unless none
        // was recorded (a ride of an earlier version). The time is bound, not `now()` inside
        // the CASE (Citus refuses a non-immutable function there): the database's clock is read
        // in the phase's own transaction first, and `now()` is the transaction's time, so it is
        // the same instant the statement would have seen.
        let now: OffsetDateTime = match state.store.now() {
            Some(now) => now,
            None => sqlx::query_scalar("SELECT now()")
                .fetch_one(&mut pg)
                .await
                .map_err(db("read the database's clock"))?,
        };
        let (attempted_at, past_window): (OffsetDateTime, bool) = sqlx::query_as(
            r#"
            UPDATE rides SET charge_attempted_at = CASE
                                 WHEN charge_attempted_at IS NOT NULL
                                  AND charge_generation_at
                                      <= $4::timestamptz
                                 THEN charge_attempted_at
                                 ELSE $3::timestamptz END,
                             updated_at = $3::timestamptz
            WHERE id = $1 AND user_id = $2 AND key_owner = $2::text
            RETURNING charge_attempted_at,
                      charge_generation_at <= $4::timestamptz
            "#,
        )
        .bind(self.target.ride_id)
        .bind(self.rider.user_id)
        .bind(now)
        // The window's edge computed here, not in SQL: `timestamptz - interval` is a stable
        // function, which Citus refuses inside a CASE of an UPDATE.
        .bind(now - time::Duration::milliseconds(window))
        .fetch_one(&mut pg)
        .await
        .map_err(db("record the gateway call"))?;
        phase.commit().await?;
        self.target.attempted_at = attempted_at;
        if past_window {
            self.target.past_window = true;
            return Ok(Window::Past);
        }
        Ok(Window::Within)
    }
}

/// How long ago the call's record was written, by the holder's own clock. The lease's clock was
/// last set by the transaction that wrote it (`record_attempt`, `next_generation`, or the step
/// that created the ride): nothing renews the lease between that commit and the send.
fn since_record(state: &crate::state::AppState, lease: &Lease<RidePoint>) -> std::time::Duration {
    state
        .store
        .lease_ttl()
        .saturating_sub(state.store.lease_left(lease))
}
