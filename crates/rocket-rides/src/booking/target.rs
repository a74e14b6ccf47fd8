//! What every step of a booking works with: its recovery points, the rider it belongs to (the
//! key's owner, parsed once per step), and, for the charge, what the step knows about its ride
//! and the [`Charging`] whose methods `charge.rs`, `reconcile.rs` and `outcomes.rs` hold.

use sqlx::types::Json;
use time::OffsetDateTime;

use super::error::BookingError;
use crate::admission::Admitted;
use crate::state::AppState;
use crate::stripe::Refusal;

idempotency::recovery_points! {
    /// The recovery points of a ride booking, stored under these names (keys of earlier
    /// versions resume from them).
    pub enum RidePoint {
        /// The ride row exists, unpaid.
        RideCreated = "ride_created",
        /// The gateway created the charge `pending`: recorded on the ride, not paid yet.
        ChargePending = "charge_pending",
        /// The charge is recorded on the ride, paid, and the response not stored yet. Written
        /// only by earlier versions, which recorded the charge in a phase of its own
        /// (`legacy.rs`).
        ChargeCreated = "charge_created",
    }
}

/// The key's facts a step needs, read once when the step starts.
#[derive(Clone, Copy)]
pub(crate) struct Rider<'a> {
    pub(crate) state: &'a AppState,
    /// The rider: the key's owner, a user id.
    pub(crate) user_id: i64,
    pub(crate) key_id: i64,
    /// The request's random identifier, from which the gateway key is derived.
    pub(crate) request: idempotency::Uuid,
}

impl<'a> Rider<'a> {
    /// The rider of `step`'s key. Rocket Rides names a key's owner by its user's id
    /// (`Owner::from(user.id)`), so every key of its route holds one; anything else is a key
    /// this service did not write.
    pub(crate) fn of(
        state: &'a AppState,
        step: &idempotency::Step<'_, RidePoint>,
    ) -> Result<Self, BookingError> {
        let owner = step.owner().as_str();
        // Its one decimal spelling only: "07" or "+7" is not user 7's key.
        let user_id = owner
            .parse::<i64>()
            .ok()
            .filter(|id| id.to_string() == owner)
            .ok_or_else(|| {
                BookingError::Internal(format!(
                    "key {} is owned by {owner:?}, which is not a user id",
                    step.key_id()
                ))
            })?;
        Ok(Self {
            state,
            user_id,
            key_id: step.key_id(),
            request: step.request_uuid(),
        })
    }
}

/// The idempotency key under which the gateway is asked to charge for a request: derived from
/// the request's random UUID and the charge's generation, never from the attempt, so that every
/// resumption of one generation asks for the same charge.
pub fn gateway_key(request: idempotency::Uuid, generation: i32) -> String {
    format!("rocket-rides:{request}:charge:{generation}")
}

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

impl ChargeTarget {
    /// The doubt to clear before the key is asked again, if any: one kept by an earlier attempt
    /// first, then the window.
    pub(super) fn doubt(&self) -> Option<Doubt> {
        self.doubt
            .0
            .or(self.past_window.then_some(Doubt::PastWindow))
    }
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

/// Why the current gateway key cannot simply be asked again: its outcome is found by listing
/// the customer's charges first (`reconcile.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Doubt {
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
    pub(super) fn kept_name(self) -> Option<&'static str> {
        match self {
            Self::PastWindow | Self::StoredServerError => None,
            Self::IdempotencyError => Some("idempotency_error"),
            Self::RefusedAfterUnknown => Some("refused"),
        }
    }
}

/// How the charge being settled was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Found {
    /// The gateway answered the create call.
    Created,
    /// A reconciling list found it by its metadata.
    Adopted,
    /// Retrieved again, after it was recorded pending.
    Retrieved,
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

/// The charge of one ride, in one step: its gateway calls (`charge.rs`), its reconciliation
/// (`reconcile.rs`) and its outcomes (`outcomes.rs`) are this type's methods, each file
/// importing this one and none of the others.
pub(super) struct Charging<'a> {
    pub(super) rider: Rider<'a>,
    pub(super) target: ChargeTarget,
    /// The request's admission slot, given back while a gateway call is out (`under_lease`).
    pub(super) slot: Option<&'a Admitted>,
}
