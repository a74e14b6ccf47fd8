//! The properties, checked on every reachable state, and the examples the checker must reach
//! (so that a model that never gets anywhere cannot pass).

use crate::settings::Tick;
use crate::state::{Outcome, State, REQUESTS};

/// A property that must hold in every reachable state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Name {
    /// At most one charge per request, across every generation of its gateway key.
    OneChargePerRequest,
    /// No stored 502 for a request that a charge names.
    No502ForAChargedRequest,
    /// No write lands under a fencing token that is no longer the key's.
    NoWriteUnderAStaleToken,
    /// A stored answer never changes, and every answer given is the stored one.
    AStoredAnswerNeverChanges,
    /// Every charge's request is still there to record it, or finished.
    NoChargeWithoutItsRide,
    /// Every key reaches a final state within
    /// [`ProtocolModel::liveness_bound`](crate::ProtocolModel::liveness_bound) ticks of the last
    /// fault, and no unfinished key is deleted (it could never finish).
    EveryKeyFinishes,
}

impl Name {
    /// Every property.
    pub const ALL: [Name; 6] = [
        Name::OneChargePerRequest,
        Name::No502ForAChargedRequest,
        Name::NoWriteUnderAStaleToken,
        Name::AStoredAnswerNeverChanges,
        Name::NoChargeWithoutItsRide,
        Name::EveryKeyFinishes,
    ];

    /// The property's name, as the checker reports it.
    pub fn as_str(self) -> &'static str {
        match self {
            Name::OneChargePerRequest => "at most one charge per request",
            Name::No502ForAChargedRequest => "no stored 502 for a request that a charge names",
            Name::NoWriteUnderAStaleToken => "no write under a stale fencing token",
            Name::AStoredAnswerNeverChanges => "a stored answer never changes",
            Name::NoChargeWithoutItsRide => "no charge without its ride",
            Name::EveryKeyFinishes => "every key finishes once the faults stop",
        }
    }

    /// Whether the property holds in `s`, for a model whose keys must finish within
    /// `liveness_bound` ticks of the last fault.
    pub(crate) fn holds(self, liveness_bound: Tick, s: &State) -> bool {
        match self {
            Name::OneChargePerRequest => (0..REQUESTS as u8).all(|r| {
                s.gateway
                    .charges
                    .iter()
                    .filter(|c| c.key.request == r)
                    .count()
                    <= 1
            }),
            Name::No502ForAChargedRequest => (0..REQUESTS).all(|r| {
                s.ghost.stored[r] != Some(Outcome::Refused)
                    || !s
                        .gateway
                        .charges
                        .iter()
                        .any(|c| usize::from(c.key.request) == r)
            }),
            Name::NoWriteUnderAStaleToken => !s.ghost.stale_write,
            Name::AStoredAnswerNeverChanges => {
                !s.ghost.answer_changed
                    && s.key.as_ref().is_none_or(|row| {
                        row.finished.is_none_or(|(outcome, _)| {
                            s.ghost.stored[usize::from(row.request)] == Some(outcome)
                        })
                    })
            }
            Name::NoChargeWithoutItsRide => s.gateway.charges.iter().all(|c| {
                s.key
                    .as_ref()
                    .is_some_and(|row| row.request == c.key.request)
                    || s.ghost.stored[usize::from(c.key.request)].is_some()
            }),
            Name::EveryKeyFinishes => {
                let overdue = s.calm_for.is_some_and(|calm| calm >= liveness_bound);
                let unfinished = s.key.as_ref().is_some_and(|row| row.finished.is_none());
                // A deleted unfinished key can never finish; an unfinished one past the bound
                // has not.
                let stuck = overdue && unfinished;
                !(s.ghost.deleted_unfinished || stuck)
            }
        }
    }
}

/// Something the checker must be able to reach in the real model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Example {
    /// A reconciling list finds the request's charge and the 201 adopts it.
    AListAdoptsTheCharge,
    /// A charge is made under a later generation of the gateway key.
    ANewGenerationCharges,
    /// The gateway's refusal is stored as a 502.
    ARefusalIsStored,
    /// A fenced write finds the lease taken over and writes nothing.
    AStaleHolderIsFencedOut,
    /// The completer stores a key's final answer.
    TheCompleterFinishesAKey,
    /// A charge is made for a call whose caller stopped waiting.
    AChargeLandsAfterItsCallerGaveUp,
    /// A key past the retention is booked anew.
    AnExpiredKeyIsBookedAnew,
    /// A finished key is reaped.
    AFinishedKeyIsReaped,
}

impl Example {
    /// Every example.
    pub const ALL: [Example; 8] = [
        Example::AListAdoptsTheCharge,
        Example::ANewGenerationCharges,
        Example::ARefusalIsStored,
        Example::AStaleHolderIsFencedOut,
        Example::TheCompleterFinishesAKey,
        Example::AChargeLandsAfterItsCallerGaveUp,
        Example::AnExpiredKeyIsBookedAnew,
        Example::AFinishedKeyIsReaped,
    ];

    /// The example's name, as the checker reports it.
    pub fn as_str(self) -> &'static str {
        match self {
            Example::AListAdoptsTheCharge => "a list adopts the charge",
            Example::ANewGenerationCharges => "a new generation charges",
            Example::ARefusalIsStored => "a refusal is stored as a 502",
            Example::AStaleHolderIsFencedOut => "a stale holder is fenced out",
            Example::TheCompleterFinishesAKey => "the completer finishes a key",
            Example::AChargeLandsAfterItsCallerGaveUp => "a charge lands after its caller gave up",
            Example::AnExpiredKeyIsBookedAnew => "an expired key is booked anew",
            Example::AFinishedKeyIsReaped => "a finished key is reaped",
        }
    }

    /// Whether `s` reaches the example.
    pub(crate) fn reached(self, s: &State) -> bool {
        match self {
            Example::AListAdoptsTheCharge => s
                .ghost
                .stored
                .iter()
                .any(|o| matches!(o, Some(Outcome::Paid { adopted: true, .. }))),
            Example::ANewGenerationCharges => {
                s.gateway.charges.iter().any(|c| c.key.generation > 1)
            }
            Example::ARefusalIsStored => s.ghost.stored.contains(&Some(Outcome::Refused)),
            Example::AStaleHolderIsFencedOut => s.ghost.fenced_out,
            Example::TheCompleterFinishesAKey => s.ghost.completer_finished,
            Example::AChargeLandsAfterItsCallerGaveUp => s.ghost.late_charge,
            Example::AnExpiredKeyIsBookedAnew => usize::from(s.next_request) == REQUESTS,
            Example::AFinishedKeyIsReaped => s.key.is_none() && s.next_request > 0,
        }
    }
}
