//! The charge step: what it knows about its ride, and its loop of gateway calls under the lease,
//! each call's time recorded before it leaves. What an answer leads to is in `outcomes.rs`; what
//! happens when the key is in doubt, in `reconcile.rs`.

use std::time::Instant;

use idempotency::{BindTime, Lease};
use sqlx::types::Json;
use time::OffsetDateTime;

use super::outcomes::{declined, made_up_refusal, refusal_or_error, refused, settle, Found};
use super::reconcile::{keep_doubt, reconcile, Doubt, Reconciled};
use super::{db, gateway_key, rider, BookingError, RidePoint, Step};
use crate::metrics::{ChargeOutcome, GatewayCall};
use crate::state::AppState;
use crate::stripe::{Charge, ChargeError, NewCharge, Refusal, REQUEST_METADATA};

/// What the charge step knows about its ride.
#[derive(Debug, sqlx::FromRow)]
pub struct ChargeTarget {
    pub(super) ride_id: i64,
    pub(super) amount_cents: i32,
    pub(super) charge_id: Option<String>,
    pub(super) customer: String,
    pub(super) generation: i32,
    pub(super) first_attempt_at: OffsetDateTime,
    /// The current generation's key was first used longer ago than the key window.
    pub(super) past_window: bool,
    /// When the gateway was last asked under the current generation's key: a list waits until
    /// this is older than the processing bound. For a ride of an earlier version, which recorded
    /// no call, the database's now (see `attempts_unknown`).
    pub(super) attempted_at: OffsetDateTime,
    /// The ride was left by an earlier version, which did not record its calls: when it was last
    /// asked is unknown, and before a list the wait starts from now.
    pub(super) attempts_unknown: bool,
    /// Why the key's outcome must be listed for, kept by an earlier attempt.
    #[sqlx(try_from = "Option<String>")]
    pub(super) doubt: Kept,
    /// The refusal to store if the list finds no charge.
    pub(super) refusal: Option<Json<Refusal>>,
    /// `attempted_at` was written by this holder, and no call was made since: the next call
    /// needs no record of its own, and nobody else can have called in between.
    pub(super) fresh: bool,
}

/// A doubt an earlier attempt kept on the ride (`rides.charge_doubt`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Kept(pub(super) Option<Doubt>);

impl TryFrom<Option<String>> for Kept {
    type Error = String;

    fn try_from(name: Option<String>) -> Result<Self, Self::Error> {
        match name.as_deref() {
            None => Ok(Self(None)),
            Some(name) => [Doubt::IdempotencyError, Doubt::RefusedAfterUnknown]
                .into_iter()
                .find(|d| d.kept_name() == Some(name))
                .map(|d| Self(Some(d)))
                .ok_or_else(|| format!("unknown charge doubt {name:?}")),
        }
    }
}

impl ChargeTarget {
    pub(super) async fn load(
        state: &AppState,
        lease: &Lease<RidePoint>,
    ) -> Result<Self, BookingError> {
        let window = state.gateway_key_window.as_millis().min(i64::MAX as u128) as i64;
        let mut conn = state.store.autocommit().await.map_err(db("load ride"))?;
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
                   -- Loaded, so another holder may have called since the last record.
                   false AS fresh
            FROM rides r JOIN users u ON u.id = r.user_id
            WHERE r.user_id = $1 AND r.idempotency_key_id = $2
            "#,
        );
        let target = sqlx::query_as(timed.sql())
            .bind(rider(lease)?)
            .bind(lease.key_id())
            .bind(window)
            .bind_now(&timed)
            .persistent(state.store.persistent())
            .fetch_optional(conn.conn())
            .await
            .map_err(db("load ride"))?
            .ok_or_else(|| BookingError::Internal(format!("no ride for key {}", lease.key_id())))?;
        conn.done().await.map_err(db("load ride"))?;
        Ok(target)
    }

    /// The doubt to clear before the key is asked again, if any: one kept by an earlier attempt
    /// first, then the window.
    fn doubt(&self) -> Option<Doubt> {
        self.doubt
            .0
            .or(self.past_window.then_some(Doubt::PastWindow))
    }
}

/// Between phases: the gateway call (after a reconciliation when the key cannot be trusted).
/// Then the final phase: the charge recorded with the 201, or a decline, or a refusal.
pub(super) async fn charge(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    mut target: ChargeTarget,
) -> Result<Step, BookingError> {
    let mut reconciled = false;
    loop {
        if let Some(doubt) = target.doubt() {
            reconciled = true;
            match reconcile(state, lease, &mut target, doubt).await? {
                Reconciled::Adopted(charge) => {
                    return settle(state, lease, &target, charge, Found::Adopted).await
                }
                Reconciled::Refused(refusal) => {
                    return refused(state, lease, target.ride_id, &refusal).await
                }
                Reconciled::NewGeneration => {}
            }
        }
        // Every call's time is recorded before it leaves, and the call leaves within one
        // heartbeat of its record by the holder's own clock: a list waits for the calls to be
        // over, and its range reaches the charges they make, counting from the record. The
        // phase before a generation's first call stands for its record. A holder that stood
        // still longer since its record (a paused process, even one whose lease nobody took
        // meanwhile) records the call anew rather than send it late, and the fenced phase
        // finds out whether the lease is still this holder's.
        // The statement that records the call also decides, against the database's clock,
        // whether the generation is past the key window: a holder that stood still since it
        // read its ride must not call under a key the gateway may have forgotten.
        let resumed = !target.fresh;
        while !target.fresh || since_record(state, lease) >= state.store.heartbeat() {
            if record_attempt(state, lease, &mut target).await? == Window::Past {
                break;
            }
            target.fresh = true;
            state
                .failpoints
                .stand_still(crate::failpoints::AFTER_CALL_RECORDED)
                .await;
        }
        if target.past_window {
            // Nothing was sent: reconcile first.
            continue;
        }
        target.fresh = false;
        let result = call_gateway(state, lease, &target).await?;
        state.metrics.charge(ChargeOutcome::of(&result));
        let error = match result {
            Ok(charge) => return settle(state, lease, &target, charge, Found::Created).await,
            Err(error) => error,
        };
        match error {
            // The key holds a failure for good: find out what happened, once.
            ChargeError::StoredServerError { status, message } if !reconciled => {
                tracing::warn!(
                    key_id = lease.key_id(),
                    status,
                    message,
                    "the gateway replays a stored error under this key; reconciling"
                );
                target.doubt = Kept(Some(Doubt::StoredServerError));
            }
            // The chaos harness's negative control: an unknown outcome is not a decline.
            ChargeError::Transient(why) if state.failpoints.unknown_is_declined() => {
                return declined(state, lease, target.ride_id, "processing_error", &why).await
            }
            // The chaos harness's negative control: a page that is not the gateway's, refusing.
            ChargeError::UnknownAnswer { status }
                if state.failpoints.unknown_answer_is_refusal() && (400..500).contains(&status) =>
            {
                let refusal = made_up_refusal(status);
                return refused(state, lease, target.ride_id, &refusal).await;
            }
            ChargeError::Refused(refusal) => {
                // Final only when the gateway holds no charge of ours for certain: it answered
                // this key's first use, and not with an idempotency error.
                let doubt = if refusal.is_idempotency_error() {
                    Doubt::IdempotencyError
                } else if resumed {
                    Doubt::RefusedAfterUnknown
                } else {
                    return refused(state, lease, target.ride_id, &refusal).await;
                };
                keep_doubt(state, lease, &mut target, doubt, refusal).await?;
            }
            other => return refusal_or_error(state, lease, target.ride_id, other).await,
        }
    }
}

/// How long ago the call's record was written, by the holder's own clock. The lease's clock was
/// last set by the phase that wrote it (`record_attempt`, `next_generation`, or the claim with
/// the first phase): nothing renews the lease between that phase and the send.
fn since_record(state: &AppState, lease: &Lease<RidePoint>) -> std::time::Duration {
    state
        .store
        .lease_ttl()
        .saturating_sub(state.store.lease_left(lease))
}

/// Asks the gateway for the ride's charge under the current generation's key.
async fn call_gateway(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    target: &ChargeTarget,
) -> Result<Result<Charge, ChargeError>, BookingError> {
    let key = if state.failpoints.fresh_gateway_key() {
        // The chaos harness's negative control: the bug this whole design exists to prevent.
        format!(
            "{}:attempt-{}",
            gateway_key(lease.request_uuid(), target.generation),
            lease.token()
        )
    } else {
        gateway_key(lease.request_uuid(), target.generation)
    };
    let (ride_id, request) = (target.ride_id.to_string(), lease.request_uuid().to_string());
    let description = format!("Rocket Rides ride {}", target.ride_id);
    let metadata = [("ride_id", ride_id), (REQUEST_METADATA, request)];
    let new_charge = NewCharge {
        amount_cents: i64::from(target.amount_cents),
        customer: &target.customer,
        description: &description,
        metadata: &metadata,
    };
    let started = Instant::now();
    let result = under_lease(state, lease, state.stripe.create_charge(&key, &new_charge)).await;
    state
        .metrics
        .gateway_call(GatewayCall::CreateCharge, started.elapsed());
    result
}

/// Awaits a foreign call under the lease, with the library's lease kit
/// ([`idempotency::Store::call_under_lease`]): confirmed before the call (a holder that stood
/// still past its lease may have lost the key, and its new holder may have moved on to another
/// generation of the gateway key: charging this one now would charge twice), renewed during it,
/// and abandoned at once when a renewal finds the lease taken over; the new holder carries on
/// under the same gateway key.
pub(super) async fn under_lease<T>(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    call: impl std::future::Future<Output = T>,
) -> Result<T, BookingError> {
    let mut call = std::pin::pin!(call);
    match state.store.watch_under_lease(lease, &mut call).await {
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

/// Whether the current generation of the gateway key is past the key window, as the call's
/// record found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Window {
    /// Within the window: the call is recorded and may leave.
    Within,
    /// Past it: no call may leave under this generation's key before a reconciliation. The
    /// last call's record is kept (a ride of an earlier version, which had none, gets one now,
    /// for the list to wait from); `target.past_window` is set.
    Past,
}

/// Records, before a call leaves, that the current generation's key is being used now. A phase
/// of its own (fenced), so that the time is on the ride before the gateway can act; the same
/// statement decides, against the database's clock, whether the generation is past the key
/// window, so that a holder that stood still since it read its ride does not call under a key
/// the gateway may have forgotten.
pub(super) async fn record_attempt(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    target: &mut ChargeTarget,
) -> Result<Window, BookingError> {
    let user_id = rider(lease)?;
    let window = state.gateway_key_window.as_millis().min(i64::MAX as u128) as i64;
    let point = lease.recovery_point();
    let mut phase = state.store.phase(lease, point).await?;
    // Past the window, no call leaves: the last call's time stays what it was, unless none
    // was recorded (a ride of an earlier version). The time is bound, not `now()` inside the
    // CASE (Citus refuses a non-immutable function there): the database's clock is read in the
    // phase's own transaction first, and `now()` is the transaction's time, so it is the same
    // instant the statement would have seen.
    let now: OffsetDateTime = match state.store.now() {
        Some(now) => now,
        None => sqlx::query_scalar("SELECT now()")
            .persistent(state.store.persistent())
            .fetch_one(phase.conn())
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
        WHERE id = $1 AND user_id = $2
        RETURNING charge_attempted_at,
                  charge_generation_at <= $4::timestamptz
        "#,
    )
    .bind(target.ride_id)
    .bind(user_id)
    .bind(now)
    // The window's edge computed here, not in SQL: `timestamptz - interval` is a stable
    // function, which Citus refuses inside a CASE of an UPDATE.
    .bind(now - time::Duration::milliseconds(window))
    .persistent(state.store.persistent())
    .fetch_one(phase.conn())
    .await
    .map_err(db("record the gateway call"))?;
    phase.commit().await?;
    target.attempted_at = attempted_at;
    if past_window {
        target.past_window = true;
        return Ok(Window::Past);
    }
    Ok(Window::Within)
}
