//! `POST /rides` as a machine of atomic phases.
//!
//! ```text
//!  (new key) ──claim + phase 1──► ride_created ──gateway──final phase──► finished
//!             key, ride row,          │        charge under key     charge on the ride,
//!             audit record:           │        derived from the     audit, receipt job,
//!             one transaction         │        request's UUID       stored 201
//!                                     ├─ declined ─────────────final phase──► finished (stored 402)
//!                                     ├─ refused for good ─────final phase──► finished (stored 502)
//!                                     ├─ pending ──phase──► charge_pending ──retrieve──► (as above)
//!                                     └─ no answer / 5xx / 401 ──► lease released, 503; resume here
//! ```
//!
//! A new key is claimed in the same transaction as the ride it books ([`idempotency::Store::begin`]),
//! and the charge is recorded in the same transaction as the stored response: two transactions
//! around the gateway call. Two points exist only to resume keys written by earlier versions,
//! which committed the claim and the recorded charge separately: `started` (claimed, nothing
//! written) and `charge_created` (the charge recorded, the response not stored).
//!
//! Each step reads the key's recovery point and does one phase. A request that dies anywhere
//! leaves the key at its last committed point, and whoever claims the key next — the client's
//! retry or the completer — resumes from there with the stored parameters. The gateway is called
//! between phases, never inside one.
//!
//! # The gateway key, and when it can no longer be trusted
//!
//! The charge is asked for under `rocket-rides:{request uuid}:charge:{generation}`: derived from
//! the key row's random UUID (never its sequence number, which another database repeats), so
//! every resumption asks for the same charge and the gateway answers with the one it made. That
//! holds only while the gateway keeps the key with its true result. Stripe forgets keys after
//! 24 hours, and keeps a 500 under a key for as long as it keeps the key. So the charge step
//! first **reconciles** when either
//!
//! - the current generation's key was first used longer ago than `--gateway-key-window` (23 h):
//!   the gateway may have forgotten it, and asking again could charge twice; or
//! - the gateway just *replayed* a 5xx under the key: it stored a failure there for good (a replay
//!   also proves that no request under the key is still running at the gateway).
//!
//! It also reconciles after an `idempotency_error`, and after a refusal that follows an attempt of
//! unknown outcome: the gateway may hold a charge either way. Those doubts are kept on the ride
//! (`charge_doubt`) so that the next attempt lists instead of asking again. An answer without the
//! gateway's own error object (an intermediary's page) is never a refusal: an unknown outcome,
//! asked again under the same key.
//!
//! Reconciling lists the customer's charges from the first attempt to the last call (plus the
//! processing bound) and adopts the one whose metadata names this request. It never lists while a
//! call may still be running at the gateway: every call's time is recorded before it leaves, and
//! the list waits until the last one is older than `--gateway-processing-bound` (503
//! `payment-unconfirmed` meanwhile). Only when there is none does it start the next generation of
//! the key — recorded on the ride in a phase of its own before the call, so that a crash anywhere
//! resumes under that generation — and charge again (or, for a kept refusal, store the 502). The
//! normal path makes no list call. The full story: `docs/protocol.md`.

use std::time::{Duration, Instant};

use idempotency::{FirstPhase, Lease, RecoveryPoint, StoredResponse};
use idempotency_axum::Problem;
use serde_json::json;
use sqlx::types::Json;
use sqlx::PgConnection;
use time::OffsetDateTime;

use crate::metrics::{ChargeOutcome, GatewayCall, Reconciliation};
use crate::problem::types;
use crate::ride::{RideRequest, RideView, RIDE_COLUMNS};
use crate::state::AppState;
use crate::stripe::{Charge, ChargeError, NewCharge, Refusal, REQUEST_METADATA};

/// How far a reconciling list reaches before the recorded first attempt and after the last call's
/// processing bound: the gateway stamps `created` with its own clock, which may be behind or
/// ahead of ours. Charges of other requests that the wider range brings in are told apart by
/// their metadata.
pub const RECONCILE_CLOCK_SKEW: time::Duration = time::Duration::minutes(10);

/// The recovery points of a ride booking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RidePoint {
    /// Claimed; nothing written yet. Written only by earlier versions, which claimed a key
    /// before the phase that creates its ride.
    Started,
    /// The ride row exists, unpaid.
    RideCreated,
    /// The gateway created the charge `pending`: recorded on the ride, not paid yet.
    ChargePending,
    /// The charge is recorded on the ride, paid, and the response not stored yet. Written only
    /// by earlier versions, which recorded the charge in a phase of its own.
    ChargeCreated,
    /// The response is stored.
    Finished,
}

impl RecoveryPoint for RidePoint {
    const STARTED: Self = Self::Started;
    const FINISHED: Self = Self::Finished;

    fn name(self) -> &'static str {
        match self {
            Self::Started => "started",
            Self::RideCreated => "ride_created",
            Self::ChargePending => "charge_pending",
            Self::ChargeCreated => "charge_created",
            Self::Finished => "finished",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        [
            Self::Started,
            Self::RideCreated,
            Self::ChargePending,
            Self::ChargeCreated,
            Self::Finished,
        ]
        .into_iter()
        .find(|p| p.name() == name)
    }
}

/// Why a booking stopped without a final response.
#[derive(Debug, thiserror::Error)]
pub enum BookingError {
    /// Another holder took the key over; this one must stop.
    #[error("lease lost: {0}")]
    LeaseLost(idempotency::Error),
    /// The gateway did not answer or is unavailable. The charge may exist; resume later.
    #[error("payment gateway unavailable: {0}")]
    GatewayUnavailable(String),
    /// The gateway refused our credentials or its certificate is not trusted: ours to fix.
    #[error("payment gateway misconfigured: {0}")]
    GatewayMisconfigured(String),
    /// The charge exists but is still `pending` at the gateway; resume later.
    #[error("charge {0} is pending at the gateway")]
    PaymentPending(String),
    /// Whether the gateway charged cannot be known yet: a call under the key may still be
    /// running there. The list that tells is made in `retry_after`.
    #[error("the charge's outcome is unconfirmed; reconciling in {retry_after:?}")]
    Unconfirmed {
        /// When the list can be made.
        retry_after: Duration,
    },
    /// Anything else: a database failure, a broken invariant.
    #[error("{0}")]
    Internal(String),
    /// The process is shutting down and gave the request up before it finished.
    #[error("given up at shutdown")]
    GivenUp,
    /// A failpoint stopped the request as a crash would.
    #[error("crashed at failpoint {0}")]
    Crashed(&'static str),
}

impl From<idempotency::Error> for BookingError {
    fn from(e: idempotency::Error) -> Self {
        match e {
            idempotency::Error::LeaseLost { .. } => Self::LeaseLost(e),
            other => Self::Internal(other.to_string()),
        }
    }
}

fn db(context: &'static str) -> impl FnOnce(sqlx::Error) -> BookingError {
    move |e| BookingError::Internal(format!("{context}: {e}"))
}

/// Stops here if a test armed this crash point.
fn crash_point(state: &AppState, point: &'static str) -> Result<(), BookingError> {
    if crate::failpoints::hit(&state.failpoints, point) {
        return Err(BookingError::Crashed(point));
    }
    Ok(())
}

/// What one step did.
enum Step {
    /// A phase committed; run the next one.
    Advanced,
    /// The final phase stored this response.
    Respond(StoredResponse),
}

/// The idempotency key under which the gateway is asked to charge for a request: derived from
/// the request's random UUID and the charge's generation, never from the attempt, so that every
/// resumption of one generation asks for the same charge.
pub fn gateway_key(request: idempotency::Uuid, generation: i32) -> String {
    format!("rocket-rides:{request}:charge:{generation}")
}

/// The first phase of a new key, merged with its claim: the ride and its audit record, in the
/// transaction that inserted the key. Returns the lease, at `ride_created`, and what the charge
/// step needs to know, so that it reads nothing again.
///
/// The gateway is asked right after the commit, so the ride's creation time stands for the
/// first attempt (a crash in between only makes it earlier, which is the safe side for both of
/// its uses).
pub async fn create_ride(
    state: &AppState,
    mut first: FirstPhase<RidePoint>,
    request: &RideRequest,
    customer: &str,
) -> Result<(Lease<RidePoint>, ChargeTarget), BookingError> {
    let (user_id, key_id) = (first.lease().user_id(), first.lease().key_id());
    let started = Instant::now();
    let (lease, (ride_id, first_attempt_at)) = if state.failpoints.split_first_phase() {
        // The chaos harness's negative control: the key's recovery point and its ride in two
        // transactions, so that a failure between them leaves a key naming no ride.
        let lease = first.commit().await?;
        let mut conn = state.pool.acquire().await.map_err(db("acquire"))?;
        let ride = insert_ride(&mut conn, state, user_id, Some(key_id), request).await?;
        (lease, ride)
    } else {
        let ride = insert_ride(first.conn(), state, user_id, Some(key_id), request).await?;
        (first.commit().await?, ride)
    };
    state.metrics.phase("ride_created", started.elapsed());
    crash_point(state, crate::failpoints::AFTER_RIDE_CREATED)?;
    let target = ChargeTarget {
        ride_id,
        amount_cents: request.amount_cents,
        charge_id: None,
        customer: customer.to_owned(),
        generation: 1,
        first_attempt_at,
        past_window: false,
        // The ride's creation stands for the first call, which follows at once.
        attempted_at: first_attempt_at,
        attempts_unknown: false,
        doubt: Kept(None),
        refusal: None,
        fresh: true,
    };
    Ok((lease, target))
}

/// Runs the booking from the lease's recovery point to a stored response. `known` is what the
/// first phase learnt about the ride, when this process ran it; otherwise it is read.
pub async fn run(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    known: Option<ChargeTarget>,
) -> Result<StoredResponse, BookingError> {
    let mut known = known;
    loop {
        let step = match lease.recovery_point() {
            RidePoint::Started => resume_started(state, lease).await?,
            RidePoint::RideCreated => {
                let target = match known.take() {
                    Some(target) => target,
                    None => ChargeTarget::load(state, lease).await?,
                };
                charge(state, lease, target).await?
            }
            RidePoint::ChargePending => resolve_pending(state, lease).await?,
            RidePoint::ChargeCreated => finish_recorded(state, lease).await?,
            RidePoint::Finished => {
                return Err(BookingError::Internal(format!(
                    "key {} was acquired although finished",
                    lease.key_id()
                )))
            }
        };
        match step {
            Step::Advanced => continue,
            Step::Respond(response) => {
                crash_point(state, crate::failpoints::AFTER_FINISHED)?;
                return Ok(response);
            }
        }
    }
}

/// A key an earlier version claimed and left before its first phase: that phase now, on its own.
async fn resume_started(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
) -> Result<Step, BookingError> {
    let request: RideRequest = serde_json::from_value(lease.params().clone()).map_err(|e| {
        BookingError::Internal(format!("key {} has unreadable params: {e}", lease.key_id()))
    })?;
    let user_id = lease.user_id();
    let started = Instant::now();
    let mut phase = state.store.phase(lease, RidePoint::RideCreated).await?;
    let key_id = phase.key_id();
    insert_ride(phase.conn(), state, user_id, Some(key_id), &request).await?;
    phase.commit().await?;
    state.metrics.phase("ride_created", started.elapsed());
    crash_point(state, crate::failpoints::AFTER_RIDE_CREATED)?;
    Ok(Step::Advanced)
}

/// The ride row, unpaid, and its audit record, in one statement; returns the ride's id and
/// creation time.
pub(crate) async fn insert_ride(
    conn: &mut PgConnection,
    state: &AppState,
    user_id: i64,
    key_id: Option<i64>,
    request: &RideRequest,
) -> Result<(i64, OffsetDateTime), BookingError> {
    sqlx::query_as(
        r#"
        WITH ride AS (
            INSERT INTO rides (user_id, idempotency_key_id, origin_lat, origin_lon, target_lat,
                               target_lon, amount_cents, charge_first_attempt_at,
                               charge_generation_at, charge_attempted_at)
            VALUES ($1, $2, $3, $4, $5, $6, $7, coalesce($8::timestamptz, now()),
                    coalesce($8::timestamptz, now()), coalesce($8::timestamptz, now()))
            RETURNING id, charge_first_attempt_at
        ), audited AS (
            INSERT INTO audit_records (user_id, action, resource_type, resource_id, data)
            SELECT $1, 'ride.created', 'ride', id, jsonb_build_object('idempotency_key_id', $2)
            FROM ride
        )
        SELECT id, charge_first_attempt_at FROM ride
        "#,
    )
    .bind(user_id)
    .bind(key_id)
    .bind(request.origin_lat)
    .bind(request.origin_lon)
    .bind(request.target_lat)
    .bind(request.target_lon)
    .bind(request.amount_cents)
    .bind(state.store.now())
    .fetch_one(conn)
    .await
    .map_err(db("insert ride"))
}

/// What the charge step knows about its ride.
#[derive(Debug, sqlx::FromRow)]
pub struct ChargeTarget {
    ride_id: i64,
    amount_cents: i32,
    charge_id: Option<String>,
    customer: String,
    generation: i32,
    first_attempt_at: OffsetDateTime,
    /// The current generation's key was first used longer ago than the key window.
    past_window: bool,
    /// When the gateway was last asked under the current generation's key: a list waits until
    /// this is older than the processing bound. For a ride of an earlier version, which recorded
    /// no call, the database's now (see `attempts_unknown`).
    attempted_at: OffsetDateTime,
    /// The ride was left by an earlier version, which did not record its calls: when it was last
    /// asked is unknown, and before a list the wait starts from now.
    attempts_unknown: bool,
    /// Why the key's outcome must be listed for, kept by an earlier attempt.
    #[sqlx(try_from = "Option<String>")]
    doubt: Kept,
    /// The refusal to store if the list finds no charge.
    refusal: Option<Json<Refusal>>,
    /// `attempted_at` was written by this holder, and no call was made since: the next call
    /// needs no record of its own, and nobody else can have called in between.
    fresh: bool,
}

/// A doubt an earlier attempt kept on the ride (`rides.charge_doubt`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Kept(Option<Doubt>);

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

/// Why the current gateway key cannot simply be asked again: its outcome is found by listing
/// the customer's charges first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Doubt {
    /// The key's first use is older than the key window: the gateway may have forgotten it.
    PastWindow,
    /// The gateway replayed a 5xx it stored under the key: the key holds a failure for good.
    StoredServerError,
    /// The gateway answered `idempotency_error`: it holds a result under the key, possibly a
    /// charge made for other parameters than ours.
    IdempotencyError,
    /// The gateway refused for good, but an earlier attempt under the key had an unknown
    /// outcome and may have charged.
    RefusedAfterUnknown,
}

impl Doubt {
    /// The name kept in `rides.charge_doubt`; `None` for doubts that are found again on every
    /// attempt and need not be kept.
    fn kept_name(self) -> Option<&'static str> {
        match self {
            Self::PastWindow | Self::StoredServerError => None,
            Self::IdempotencyError => Some("idempotency_error"),
            Self::RefusedAfterUnknown => Some("refused"),
        }
    }

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

impl ChargeTarget {
    async fn load(state: &AppState, lease: &Lease<RidePoint>) -> Result<Self, BookingError> {
        let window = state.gateway_key_window.as_millis().min(i64::MAX as u128) as i64;
        sqlx::query_as(
            r#"
            SELECT r.id AS ride_id, r.amount_cents, r.charge_id,
                   u.stripe_customer_id AS customer,
                   r.charge_generation AS generation,
                   r.charge_first_attempt_at AS first_attempt_at,
                   r.charge_generation_at
                       <= coalesce($3::timestamptz, now()) - $4 * interval '1 millisecond'
                       AS past_window,
                   coalesce(r.charge_attempted_at, coalesce($3::timestamptz, now()))
                       AS attempted_at,
                   r.charge_attempted_at IS NULL AS attempts_unknown,
                   r.charge_doubt AS doubt, r.charge_refusal AS refusal,
                   -- Loaded, so another holder may have called since the last record.
                   false AS fresh
            FROM rides r JOIN users u ON u.id = r.user_id
            WHERE r.user_id = $1 AND r.idempotency_key_id = $2
            "#,
        )
        .bind(lease.user_id())
        .bind(lease.key_id())
        .bind(state.store.now())
        .bind(window)
        .fetch_optional(&state.pool)
        .await
        .map_err(db("load ride"))?
        .ok_or_else(|| BookingError::Internal(format!("no ride for key {}", lease.key_id())))
    }

    /// The doubt to clear before the key is asked again, if any: one kept by an earlier attempt
    /// first, then the window.
    fn doubt(&self) -> Option<Doubt> {
        self.doubt
            .0
            .or(self.past_window.then_some(Doubt::PastWindow))
    }
}

/// How the charge being settled was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    /// The gateway answered the create call.
    Created,
    /// A reconciling list found it by its metadata.
    Adopted,
    /// Retrieved again, after it was recorded pending.
    Retrieved,
}

/// What a reconciliation decided.
enum Reconciled {
    /// The list found the request's charge.
    Adopted(Charge),
    /// None exists; the next generation of the key charges (the target is moved to it).
    NewGeneration,
    /// None exists, and the gateway's refusal is the request's outcome.
    Refused(Refusal),
}

/// Between phases: the gateway call (after a reconciliation when the key cannot be trusted).
/// Then the final phase: the charge recorded with the 201, or a decline, or a refusal.
async fn charge(
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
        // Every call's time is recorded before it leaves: a list waits for it to be over. The
        // phase before a generation's first call stands for its record, unless the holder stood
        // still since (its lease is running out by its own clock): then the call is recorded
        // anew, as a resumed one is, and the fenced phase finds out whether the lease is still
        // this holder's.
        let resumed = !target.fresh;
        if resumed || state.store.lease_left(lease) < state.store.heartbeat() {
            record_attempt(state, lease, &mut target).await?;
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

/// Clears a doubt: waits (503) while a call under the key may still be running, then lists the
/// customer's charges for the request's own, and without one moves on as the doubt says.
async fn reconcile(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    target: &mut ChargeTarget,
    doubt: Doubt,
) -> Result<Reconciled, BookingError> {
    if doubt.waits_for_calls() {
        if target.attempts_unknown {
            // An earlier version's ride: its last call is unknown, and may have been just now.
            // The wait runs from this record.
            record_attempt(state, lease, target).await?;
            target.attempts_unknown = false;
        }
        wait_for_calls(state, lease, target).await?;
    }
    if let Some(charge) = find_own_charge(state, lease, target).await? {
        state.metrics.reconciliation(Reconciliation::Adopted);
        return Ok(Reconciled::Adopted(charge));
    }
    state.metrics.reconciliation(Reconciliation::NoneFound);
    if !doubt.charges_again() {
        let refusal = target.refusal.take().ok_or_else(|| {
            BookingError::Internal(format!(
                "ride {} is in doubt ({doubt:?}) without the gateway's refusal",
                target.ride_id
            ))
        })?;
        return Ok(Reconciled::Refused(refusal.0));
    }
    next_generation(state, lease, target).await?;
    crash_point(state, crate::failpoints::AFTER_NEW_GENERATION)?;
    Ok(Reconciled::NewGeneration)
}

/// Never list while a call may still be running: a charge still being made inside the gateway
/// is in no list yet, and a new generation would charge a second time. The list waits until the
/// last call under the current key is older than `--gateway-processing-bound`; until then the
/// request answers 503 with the time left as `Retry-After`, and the completer waits as long.
async fn wait_for_calls(
    state: &AppState,
    lease: &Lease<RidePoint>,
    target: &ChargeTarget,
) -> Result<(), BookingError> {
    if state.failpoints.list_while_in_flight() {
        // The chaos harness's negative control: the list is made at once.
        return Ok(());
    }
    let bound = millis(state.gateway_processing_bound);
    let left: i64 = sqlx::query_scalar(
        r#"
        SELECT ceil(extract(epoch FROM coalesce(charge_attempted_at, coalesce($4::timestamptz, now()))
                                       + $3 * interval '1 millisecond'
                                       - coalesce($4::timestamptz, now())) * 1000)::bigint
        FROM rides WHERE user_id = $1 AND id = $2
        "#,
    )
    .bind(lease.user_id())
    .bind(target.ride_id)
    .bind(bound)
    .bind(state.store.now())
    .fetch_one(&state.pool)
    .await
    .map_err(db("read the ride's last gateway call"))?;
    if left > 0 {
        state.metrics.reconciliation(Reconciliation::Deferred);
        // Never more than the bound itself, whatever a step of the database's clock says.
        let retry_after = Duration::from_millis(left as u64).min(state.gateway_processing_bound);
        tracing::info!(
            key_id = lease.key_id(),
            ride_id = target.ride_id,
            ?retry_after,
            "a call under the gateway key may still be running; reconciling later"
        );
        return Err(BookingError::Unconfirmed { retry_after });
    }
    Ok(())
}

fn millis(duration: Duration) -> i64 {
    duration.as_millis().min(i64::MAX as u128) as i64
}

/// Records, before a resumed call leaves, that the current generation's key is being used now.
/// A phase of its own (fenced), so that the time is on the ride before the gateway can act.
async fn record_attempt(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    target: &mut ChargeTarget,
) -> Result<(), BookingError> {
    let user_id = lease.user_id();
    let point = lease.recovery_point();
    let started = Instant::now();
    let mut phase = state.store.phase(lease, point).await?;
    target.attempted_at = sqlx::query_scalar(
        "UPDATE rides SET charge_attempted_at = coalesce($3::timestamptz, now()),
                          updated_at = now()
         WHERE id = $1 AND user_id = $2
         RETURNING charge_attempted_at",
    )
    .bind(target.ride_id)
    .bind(user_id)
    .bind(state.store.now())
    .fetch_one(phase.conn())
    .await
    .map_err(db("record the gateway call"))?;
    phase.commit().await?;
    state.metrics.phase("charge_attempt", started.elapsed());
    Ok(())
}

/// Keeps on the ride why its charge is in doubt, and the refusal to store if no charge turns up,
/// so that the next attempt lists instead of asking the key again (which would only move the
/// time the list has to wait for).
async fn keep_doubt(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    target: &mut ChargeTarget,
    doubt: Doubt,
    refusal: Refusal,
) -> Result<(), BookingError> {
    let name = doubt.kept_name().ok_or_else(|| {
        BookingError::Internal(format!("doubt {doubt:?} is not kept on the ride"))
    })?;
    tracing::warn!(
        key_id = lease.key_id(),
        ride_id = target.ride_id,
        doubt = name,
        status = refusal.status,
        kind = %refusal.kind,
        "the gateway refused, but may hold a charge for the request; reconciling first"
    );
    let user_id = lease.user_id();
    let point = lease.recovery_point();
    let started = Instant::now();
    let mut phase = state.store.phase(lease, point).await?;
    sqlx::query(
        "UPDATE rides SET charge_doubt = $3, charge_refusal = $4, updated_at = now()
         WHERE id = $1 AND user_id = $2",
    )
    .bind(target.ride_id)
    .bind(user_id)
    .bind(name)
    .bind(Json(&refusal))
    .execute(phase.conn())
    .await
    .map_err(db("keep the charge's doubt"))?;
    audit(
        phase.conn(),
        user_id,
        "ride.charge_in_doubt",
        target.ride_id,
        json!({ "doubt": name, "gateway_error": gateway_error(&refusal) }),
    )
    .await?;
    phase.commit().await?;
    state.metrics.phase("charge_doubt", started.elapsed());
    target.doubt = Kept(Some(doubt));
    target.refusal = Some(Json(refusal));
    Ok(())
}

/// Lists the customer's charges from the first attempt to the last call's bound, and returns the
/// one made for this request, if any. More than one means an invariant broke somewhere: the
/// oldest paid one is taken and the rest are reported, for an operator to refund.
///
/// The range is bounded at both ends, each widened by the clock skew allowed between us and the
/// gateway: no charge of the request can be older than its first attempt, nor younger than the
/// last call plus the gateway's processing bound. A key stuck for months lists months of nothing.
async fn find_own_charge(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    target: &ChargeTarget,
) -> Result<Option<Charge>, BookingError> {
    let since = (target.first_attempt_at - RECONCILE_CLOCK_SKEW).unix_timestamp();
    let until = (target.attempted_at + state.gateway_processing_bound + RECONCILE_CLOCK_SKEW)
        .unix_timestamp();
    let mut listed = list(state, lease, Some(&target.customer), since, until).await?;
    if let Err(ChargeError::Refused(refusal)) = &listed {
        if refusal.param.as_deref() == Some("customer") {
            // The customer is gone (deleted, say) and the gateway will not list by it: the same
            // range over the whole account, told apart by metadata below.
            tracing::warn!(
                key_id = lease.key_id(),
                customer = %target.customer,
                "the gateway refuses to list the customer's charges; listing the account's"
            );
            listed = list(state, lease, None, since, until).await?;
        }
    }
    let listed = listed.map_err(|e| match e {
        ChargeError::Misconfigured(why) => BookingError::GatewayMisconfigured(why),
        // No list, no knowledge: never charge blind. A list refused for good leaves the key for
        // an operator.
        other => BookingError::GatewayUnavailable(format!("reconcile: {other}")),
    })?;
    let request = lease.request_uuid().to_string();
    let mut own: Vec<Charge> = listed
        .into_iter()
        .filter(|c| c.request() == Some(request.as_str()))
        .collect();
    // Paid before pending before failed; the oldest of each.
    own.sort_by_key(|c| (status_rank(&c.status), c.created));
    if own.len() > 1 {
        let ids: Vec<&str> = own.iter().map(|c| c.id.as_str()).collect();
        tracing::error!(
            key_id = lease.key_id(),
            charges = ?ids,
            "more than one gateway charge names this request; adopting the first, refund the rest"
        );
    }
    Ok(own.into_iter().next())
}

/// One reconciling list, under the lease, timed.
async fn list(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    customer: Option<&str>,
    since: i64,
    until: i64,
) -> Result<Result<Vec<Charge>, ChargeError>, BookingError> {
    let started = Instant::now();
    let listed = under_lease(
        state,
        lease,
        state.stripe.list_charges(customer, since, until),
    )
    .await;
    state
        .metrics
        .gateway_call(GatewayCall::ListCharges, started.elapsed());
    listed
}

fn status_rank(status: &str) -> u8 {
    match status {
        "succeeded" => 0,
        "pending" => 1,
        _ => 2,
    }
}

/// Starts the next generation of the gateway key, in a phase of its own before the call; the
/// doubt that led here is cleared with it. Moves `target` to the new generation.
async fn next_generation(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    target: &mut ChargeTarget,
) -> Result<(), BookingError> {
    let user_id = lease.user_id();
    let now = state.store.now();
    let point = lease.recovery_point();
    let started = Instant::now();
    let mut phase = state.store.phase(lease, point).await?;
    let (generation, generation_at): (i32, OffsetDateTime) = sqlx::query_as(
        "UPDATE rides SET charge_generation = charge_generation + 1,
                          charge_generation_at = coalesce($3::timestamptz, now()),
                          charge_attempted_at = coalesce($3::timestamptz, now()),
                          charge_doubt = NULL, charge_refusal = NULL,
                          updated_at = now()
         WHERE id = $1 AND user_id = $2
         RETURNING charge_generation, charge_generation_at",
    )
    .bind(target.ride_id)
    .bind(user_id)
    .bind(now)
    .fetch_one(phase.conn())
    .await
    .map_err(db("start a new charge generation"))?;
    audit(
        phase.conn(),
        user_id,
        "ride.charge_generation_started",
        target.ride_id,
        json!({ "generation": generation, "after": target.generation }),
    )
    .await?;
    phase.commit().await?;
    state.metrics.phase("charge_generation", started.elapsed());
    tracing::warn!(
        ride_id = target.ride_id,
        generation,
        "no charge found for the request; charging under a new key generation"
    );
    target.generation = generation;
    target.attempted_at = generation_at;
    target.past_window = false;
    target.doubt = Kept(None);
    target.refusal = None;
    target.fresh = true;
    Ok(())
}

/// A charge the gateway showed for this ride: paid, pending or failed by its status.
async fn settle(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    target: &ChargeTarget,
    charge: Charge,
    found: Found,
) -> Result<Step, BookingError> {
    // Never record a charge that is not this ride's: a wrong amount or customer (or none: every
    // charge we ask for names its customer) means a bug or tampering, and an operator must look
    // before anything is stored.
    if charge.amount != i64::from(target.amount_cents)
        || charge.customer.as_deref() != Some(target.customer.as_str())
    {
        return Err(BookingError::Internal(format!(
            "gateway charge {} ({} cents, customer {:?}) does not match ride {} ({} cents, {})",
            charge.id,
            charge.amount,
            charge.customer,
            target.ride_id,
            target.amount_cents,
            target.customer
        )));
    }
    match charge.status.as_str() {
        "succeeded" => {
            crash_point(state, crate::failpoints::AFTER_GATEWAY_CHARGE)?;
            paid(state, lease, target.ride_id, &charge, found).await
        }
        "pending" => {
            if lease.recovery_point() == RidePoint::RideCreated {
                record_pending(state, lease, target.ride_id, &charge).await?;
            }
            Err(BookingError::PaymentPending(charge.id))
        }
        "failed" => {
            let code = charge.failure_code.as_deref().unwrap_or("card_declined");
            let message = charge
                .failure_message
                .as_deref()
                .unwrap_or("the card was declined");
            declined(state, lease, target.ride_id, code, message).await
        }
        other => Err(BookingError::GatewayUnavailable(format!(
            "charge {} is in a status this build does not know: {other:?}",
            charge.id
        ))),
    }
}

/// The final phase of a paid charge: the charge on the ride, its audit record, the receipt job
/// and the stored 201, in one transaction.
async fn paid(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    ride_id: i64,
    charge: &Charge,
    found: Found,
) -> Result<Step, BookingError> {
    let user_id = lease.user_id();
    let started = Instant::now();
    let mut phase = state.store.final_phase(lease).await?;
    let adopted = found == Found::Adopted;
    let ride = charge_paid(phase.conn(), user_id, ride_id, &charge.id, adopted).await?;
    let response = created(&ride)?;
    phase.finish(&response).await?;
    state.metrics.phase("finished", started.elapsed());
    Ok(Step::Respond(response))
}

/// The charge exists but is pending: recorded, so that the resumption retrieves it instead of
/// asking for it again.
async fn record_pending(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    ride_id: i64,
    charge: &Charge,
) -> Result<(), BookingError> {
    let user_id = lease.user_id();
    let started = Instant::now();
    let mut phase = state.store.phase(lease, RidePoint::ChargePending).await?;
    sqlx::query(
        "UPDATE rides SET charge_id = $3, status = 'payment_pending', updated_at = now()
         WHERE id = $1 AND user_id = $2",
    )
    .bind(ride_id)
    .bind(user_id)
    .bind(&charge.id)
    .execute(phase.conn())
    .await
    .map_err(db("record pending charge"))?;
    audit(
        phase.conn(),
        user_id,
        "ride.charge_pending",
        ride_id,
        json!({ "charge_id": charge.id }),
    )
    .await?;
    phase.commit().await?;
    state.metrics.phase("charge_pending", started.elapsed());
    Ok(())
}

/// From `charge_pending`: asks the gateway how the charge stands now.
async fn resolve_pending(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
) -> Result<Step, BookingError> {
    let target = ChargeTarget::load(state, lease).await?;
    let charge_id = target.charge_id.clone().ok_or_else(|| {
        BookingError::Internal(format!(
            "ride {} is pending without a charge",
            target.ride_id
        ))
    })?;
    let started = Instant::now();
    let result = under_lease(state, lease, state.stripe.retrieve_charge(&charge_id)).await;
    state
        .metrics
        .gateway_call(GatewayCall::RetrieveCharge, started.elapsed());
    let result = result?;
    match result {
        Ok(charge) if charge.id == charge_id => {
            settle(state, lease, &target, charge, Found::Retrieved).await
        }
        Ok(other) => Err(BookingError::Internal(format!(
            "asked for charge {charge_id}, the gateway answered with {}",
            other.id
        ))),
        // The recorded charge is unknown to the gateway: nothing the request can decide alone.
        Err(ChargeError::Refused(refusal)) => Err(BookingError::Internal(format!(
            "the gateway does not know pending charge {charge_id}: {}",
            refusal.message
        ))),
        Err(ChargeError::Misconfigured(why)) => Err(BookingError::GatewayMisconfigured(why)),
        Err(
            e @ (ChargeError::Declined { .. }
            | ChargeError::StoredServerError { .. }
            | ChargeError::Transient(_)
            | ChargeError::UnknownAnswer { .. }),
        ) => Err(BookingError::GatewayUnavailable(e.to_string())),
    }
}

/// A gateway error: a decline or a refusal finishes the request; anything else hands it back.
async fn refusal_or_error(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    ride_id: i64,
    error: ChargeError,
) -> Result<Step, BookingError> {
    match error {
        ChargeError::Declined { code, message } => {
            declined(state, lease, ride_id, &code, &message).await
        }
        ChargeError::Refused(refusal) => refused(state, lease, ride_id, &refusal).await,
        ChargeError::Misconfigured(why) => Err(BookingError::GatewayMisconfigured(why)),
        e @ (ChargeError::StoredServerError { .. }
        | ChargeError::Transient(_)
        | ChargeError::UnknownAnswer { .. }) => {
            Err(BookingError::GatewayUnavailable(e.to_string()))
        }
    }
}

/// Awaits a foreign call under the lease, with the library's lease kit
/// ([`idempotency::Store::call_under_lease`]): confirmed before the call (a holder that stood
/// still past its lease may have lost the key, and its new holder may have moved on to another
/// generation of the gateway key: charging this one now would charge twice), renewed during it,
/// and abandoned at once when a renewal finds the lease taken over; the new holder carries on
/// under the same gateway key.
async fn under_lease<T>(
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

/// The final phase of a declined card: the ride is marked, the 402 is stored.
async fn declined(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    ride_id: i64,
    code: &str,
    message: &str,
) -> Result<Step, BookingError> {
    let user_id = lease.user_id();
    let started = Instant::now();
    let mut phase = state.store.final_phase(lease).await?;
    // A charge recorded pending that then failed is not the ride's charge: it moved no money.
    sqlx::query(
        "UPDATE rides SET status = 'declined', charge_id = NULL,
                          charge_doubt = NULL, charge_refusal = NULL, updated_at = now()
         WHERE id = $1 AND user_id = $2",
    )
    .bind(ride_id)
    .bind(user_id)
    .execute(phase.conn())
    .await
    .map_err(db("mark ride declined"))?;
    audit(
        phase.conn(),
        user_id,
        "ride.payment_declined",
        ride_id,
        json!({ "code": code }),
    )
    .await?;
    let problem = Problem::new(
        http::StatusCode::PAYMENT_REQUIRED,
        types::PAYMENT_DECLINED,
        "Payment declined",
    )
    .with_detail(format!("the card was declined: {message}"))
    .with_extension("decline_code", code.into());
    let response = problem_response(&problem);
    phase.finish(&response).await?;
    state.metrics.phase("finished", started.elapsed());
    Ok(Step::Respond(response))
}

/// A refusal made up from an answer without the gateway's error object: only the negative
/// control `--without unknown-answers` takes one.
fn made_up_refusal(status: u16) -> Refusal {
    Refusal {
        status,
        kind: "unknown".to_owned(),
        code: None,
        param: None,
        message: format!("HTTP {status}"),
    }
}

/// A refusal as the 502's `gateway_error` and the audit record show it.
fn gateway_error(refusal: &Refusal) -> serde_json::Value {
    json!({
        "status": refusal.status,
        "type": refusal.kind,
        "code": refusal.code,
        "param": refusal.param,
    })
}

/// The final phase of a charge the gateway refused for good: the ride failed, the 502 is stored.
/// Retrying cannot change the gateway's answer, and a key that never finishes would be retried
/// by the completer forever.
async fn refused(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    ride_id: i64,
    refusal: &Refusal,
) -> Result<Step, BookingError> {
    tracing::error!(
        key_id = lease.key_id(),
        ride_id,
        status = refusal.status,
        kind = %refusal.kind,
        code = ?refusal.code,
        message = %redact_secrets(&refusal.message),
        "the gateway refused the charge for good"
    );
    let user_id = lease.user_id();
    let started = Instant::now();
    let mut phase = state.store.final_phase(lease).await?;
    sqlx::query(
        "UPDATE rides SET status = 'failed', charge_doubt = NULL, charge_refusal = NULL,
                          updated_at = now()
         WHERE id = $1 AND user_id = $2",
    )
    .bind(ride_id)
    .bind(user_id)
    .execute(phase.conn())
    .await
    .map_err(db("mark ride failed"))?;
    let gateway_error = gateway_error(refusal);
    audit(
        phase.conn(),
        user_id,
        "ride.payment_refused",
        ride_id,
        gateway_error.clone(),
    )
    .await?;
    let problem = Problem::new(
        http::StatusCode::BAD_GATEWAY,
        types::PAYMENT_REFUSED,
        "Payment refused by the gateway",
    )
    .with_detail(format!(
        "the payment gateway refused the charge: {}",
        redact_secrets(&refusal.message)
    ))
    .with_extension("gateway_error", gateway_error);
    let response = problem_response(&problem);
    phase.finish(&response).await?;
    state.metrics.phase("finished", started.elapsed());
    state.metrics.payment_refused();
    Ok(Step::Respond(response))
}

/// The final phase of a key an earlier version left at `charge_created`: its charge is on the
/// ride already; the receipt job and the stored 201.
async fn finish_recorded(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
) -> Result<Step, BookingError> {
    let user_id = lease.user_id();
    let key_id = lease.key_id();
    let started = Instant::now();
    let mut phase = state.store.final_phase(lease).await?;
    let ride = RideView::by_key(&mut *phase.conn(), user_id, key_id)
        .await
        .map_err(db("load ride"))?
        .ok_or_else(|| BookingError::Internal(format!("no ride for key {key_id}")))?;
    stage_receipt(phase.conn(), user_id, ride.ride_id).await?;
    let response = created(&ride)?;
    phase.finish(&response).await?;
    state.metrics.phase("finished", started.elapsed());
    Ok(Step::Respond(response))
}

/// A paid charge on its ride, its audit record and the ride's receipt job, in one statement;
/// returns the ride as it is now.
pub(crate) async fn charge_paid(
    conn: &mut PgConnection,
    user_id: i64,
    ride_id: i64,
    charge_id: &str,
    adopted: bool,
) -> Result<RideView, BookingError> {
    sqlx::query_as(&format!(
        r#"
        WITH ride AS (
            UPDATE rides SET charge_id = $3, status = 'paid',
                             charge_doubt = NULL, charge_refusal = NULL, updated_at = now()
            WHERE user_id = $1 AND id = $2
            RETURNING {RIDE_COLUMNS}
        ), audited AS (
            INSERT INTO audit_records (user_id, action, resource_type, resource_id, data)
            SELECT $1, 'ride.charged', 'ride', id,
                   jsonb_build_object('charge_id', $3::text, 'adopted', $4::boolean)
            FROM ride
        ), receipt AS (
            INSERT INTO staged_jobs (user_id, job_name, job_args)
            SELECT $1, 'send_ride_receipt', jsonb_build_object('ride_id', id) FROM ride
        )
        SELECT {RIDE_COLUMNS} FROM ride
        "#
    ))
    .bind(user_id)
    .bind(ride_id)
    .bind(charge_id)
    .bind(adopted)
    .fetch_optional(conn)
    .await
    .map_err(db("record charge"))?
    .ok_or_else(|| BookingError::Internal(format!("no ride {ride_id} to record a charge on")))
}

/// The receipt job of a ride whose charge an earlier version recorded.
async fn stage_receipt(
    conn: &mut PgConnection,
    user_id: i64,
    ride_id: i64,
) -> Result<(), BookingError> {
    sqlx::query(
        "INSERT INTO staged_jobs (user_id, job_name, job_args)
         VALUES ($1, 'send_ride_receipt', jsonb_build_object('ride_id', $2::bigint))",
    )
    .bind(user_id)
    .bind(ride_id)
    .execute(conn)
    .await
    .map_err(db("stage receipt job"))?;
    Ok(())
}

/// The 201 of a paid ride.
pub(crate) fn created(ride: &RideView) -> Result<StoredResponse, BookingError> {
    Ok(StoredResponse::json(
        201,
        &serde_json::to_value(ride).map_err(|e| BookingError::Internal(e.to_string()))?,
        vec![("location".to_owned(), format!("/rides/{}", ride.ride_id))],
    ))
}

fn problem_response(problem: &Problem) -> StoredResponse {
    StoredResponse {
        status: problem.status().as_u16(),
        headers: vec![(
            "content-type".to_owned(),
            idempotency_axum::PROBLEM_JSON.to_owned(),
        )],
        body: problem.body().to_string().into_bytes(),
    }
}

/// Replaces anything shaped like a secret API key (`sk_…`, `rk_…`) in a gateway's message, so
/// that what a gateway echoes never reaches a client's body or a log in clear.
pub fn redact_secrets(message: &str) -> String {
    message
        .split(' ')
        .map(|word| {
            let bare = word.trim_start_matches(|c: char| !c.is_ascii_alphanumeric());
            if bare.starts_with("sk_") || bare.starts_with("rk_") {
                "[redacted]"
            } else {
                word
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

async fn audit(
    conn: &mut PgConnection,
    user_id: i64,
    action: &str,
    ride_id: i64,
    data: serde_json::Value,
) -> Result<(), BookingError> {
    sqlx::query(
        "INSERT INTO audit_records (user_id, action, resource_type, resource_id, data)
         VALUES ($1, $2, 'ride', $3, $4)",
    )
    .bind(user_id)
    .bind(action)
    .bind(ride_id)
    .bind(data)
    .execute(conn)
    .await
    .map_err(db("write audit record"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_keys_are_redacted_from_gateway_messages() {
        assert_eq!(
            redact_secrets("Invalid API Key provided: sk_live_abc123 (check it)"),
            "Invalid API Key provided: [redacted] (check it)"
        );
        assert_eq!(
            redact_secrets("No such customer: 'cus_1'"),
            "No such customer: 'cus_1'"
        );
        assert_eq!(redact_secrets("key 'rk_test_x'"), "key [redacted]");
    }

    #[test]
    fn gateway_keys_differ_by_request_and_generation() {
        let a = idempotency::Uuid::from_u128(1);
        let b = idempotency::Uuid::from_u128(2);
        assert_ne!(gateway_key(a, 1), gateway_key(b, 1));
        assert_ne!(gateway_key(a, 1), gateway_key(a, 2));
        assert!(gateway_key(a, 1).len() <= 255, "Stripe's limit");
    }
}
