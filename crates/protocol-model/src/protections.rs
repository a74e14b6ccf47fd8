//! The protections the protocol is made of, each of which the model can leave out.
//!
//! The real protocol is [`Protections::default`]: every protection on. A negative variant turns
//! exactly one off ([`Protections::without`]); the model, the properties and the checker stay
//! the same code, so a counterexample against a variant shows what that one protection is for.
//!
//! Not every relation the service checks at start is a protection of a property here: the key
//! window's floor ([`Relation::KeyWindowFloor`]) keeps reconciliations for keys really left
//! behind, rare. One charge per request does not rest on it, since every call leaves within a
//! heartbeat of its record ([`Protection::SendWithinAHeartbeatOfItsRecord`]) and the list
//! waits the processing bound past the last record ([`Protection::InFlightGuard`]);
//! `tests/model.rs` checks the protocol with a window of one lease.

use crate::properties::Name;
use crate::settings::{Relation, Settings, GATEWAY_KEY_MEMORY};

/// One protection of the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protection {
    /// Every write under a lease is fenced by its token (`… AND lease_token = $3`): a phase, the
    /// final phase, a renewal, a release (`store/phase.rs`, `store/maintenance.rs`).
    Fence,
    /// A reconciling list waits until the last recorded call under the key is older than the
    /// processing bound (`wait_for_calls` in `booking/reconcile.rs`).
    InFlightGuard,
    /// Only an answer with the gateway's own error object is a refusal; any other (a proxy's
    /// page) is an unknown outcome (`ChargeError::UnknownAnswer` in `stripe.rs`).
    OnlyTheGatewaysWordIsFinal,
    /// The lease clock starts before the claim is sent, not when its answer arrives
    /// (`lease_from_row(…, asked_at)` in `store/claim.rs` and `store/maintenance.rs`).
    LeaseClockFromTheSend,
    /// `--gateway-processing-bound` > `--gateway-timeout` (`config.rs`).
    ProcessingBoundAboveTheTimeout,
    /// `--gateway-key-window` + the processing bound stays within the gateway's key memory
    /// (`config.rs`).
    KeyWindowWithinTheGatewaysMemory,
    /// The reaper deletes finished keys only (`finished_at < cutoff` in `reap_finished`).
    ReaperSparesUnfinishedKeys,
    /// A refusal of a resumed call (an earlier call's outcome unknown) reconciles before a 502
    /// is stored (`Doubt::RefusedAfterUnknown` in `booking/reconcile.rs`).
    RefusalAfterAnUnknownOutcomeReconciles,
    /// Only a 5xx the gateway replays is a stored error that reconciles at once; any other 5xx
    /// is transient (`ChargeError::StoredServerError` in `stripe.rs`).
    OnlyAReplayed5xxIsStored,
    /// Every call leaves within one heartbeat of its record by the holder's own clock: a
    /// holder that stood still longer since (a resumed call after its `record_attempt`, a
    /// generation's first call after the phase that began it) records the call anew instead
    /// of renewing its lease and sending late (`since_record` in `booking/charge.rs`). Without
    /// it, a first call needs no record while a heartbeat of the lease is left, and a recorded
    /// call that stood still renews its lease and goes.
    SendWithinAHeartbeatOfItsRecord,
    /// Whether the generation is past the key window is decided again by the statement that
    /// records the call, against the database's clock (`record_attempt` in
    /// `booking/charge.rs`); past it, nothing is sent and the key is reconciled. Without it,
    /// the window is decided once, when the ride is read (`ChargeTarget::load`).
    WindowDecidedAtTheRecord,
}

impl Protection {
    /// Every protection, in the order the docs list them.
    pub const ALL: [Protection; 11] = [
        Protection::Fence,
        Protection::InFlightGuard,
        Protection::OnlyTheGatewaysWordIsFinal,
        Protection::LeaseClockFromTheSend,
        Protection::ProcessingBoundAboveTheTimeout,
        Protection::KeyWindowWithinTheGatewaysMemory,
        Protection::ReaperSparesUnfinishedKeys,
        Protection::RefusalAfterAnUnknownOutcomeReconciles,
        Protection::OnlyAReplayed5xxIsStored,
        Protection::SendWithinAHeartbeatOfItsRecord,
        Protection::WindowDecidedAtTheRecord,
    ];

    /// The property that a model without this protection must break.
    pub fn guards(self) -> Name {
        match self {
            Protection::Fence => Name::NoWriteUnderAStaleToken,
            Protection::OnlyTheGatewaysWordIsFinal
            | Protection::RefusalAfterAnUnknownOutcomeReconciles => Name::No502ForAChargedRequest,
            Protection::ReaperSparesUnfinishedKeys => Name::EveryKeyFinishes,
            Protection::InFlightGuard
            | Protection::LeaseClockFromTheSend
            | Protection::ProcessingBoundAboveTheTimeout
            | Protection::KeyWindowWithinTheGatewaysMemory
            | Protection::OnlyAReplayed5xxIsStored
            | Protection::SendWithinAHeartbeatOfItsRecord
            | Protection::WindowDecidedAtTheRecord => Name::OneChargePerRequest,
        }
    }

    /// The settings' relation this protection is, if it is one.
    pub fn relation(self) -> Option<Relation> {
        match self {
            Protection::ProcessingBoundAboveTheTimeout => {
                Some(Relation::ProcessingBoundAboveTheTimeout)
            }
            Protection::KeyWindowWithinTheGatewaysMemory => {
                Some(Relation::KeyWindowWithinTheGatewaysMemory)
            }
            Protection::Fence
            | Protection::InFlightGuard
            | Protection::OnlyTheGatewaysWordIsFinal
            | Protection::LeaseClockFromTheSend
            | Protection::ReaperSparesUnfinishedKeys
            | Protection::RefusalAfterAnUnknownOutcomeReconciles
            | Protection::OnlyAReplayed5xxIsStored
            | Protection::SendWithinAHeartbeatOfItsRecord
            | Protection::WindowDecidedAtTheRecord => None,
        }
    }
}

/// Which protections the modelled protocol has: all of them by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Protections {
    off: Option<Protection>,
}

impl Protections {
    /// The protocol without one protection: a negative variant.
    pub fn without(protection: Protection) -> Self {
        Self {
            off: Some(protection),
        }
    }

    /// Whether `protection` is on.
    pub fn has(&self, protection: Protection) -> bool {
        self.off != Some(protection)
    }

    /// The protection left out, if any.
    pub fn left_out(&self) -> Option<Protection> {
        self.off
    }

    /// The settings the model runs with: [`Settings::MODEL`], or, when the protection left out
    /// is a relation between settings, settings that break that relation alone.
    pub fn settings(&self) -> Settings {
        let model = Settings::MODEL;
        match self.off {
            // The processing bound no longer than our own timeout.
            Some(Protection::ProcessingBoundAboveTheTimeout) => Settings {
                gateway_processing_bound: model.gateway_timeout,
                ..model
            },
            // A window longer than the gateway keeps its keys.
            Some(Protection::KeyWindowWithinTheGatewaysMemory) => Settings {
                gateway_key_window: GATEWAY_KEY_MEMORY + 1,
                ..model
            },
            _ => model,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_variant_breaks_exactly_the_relation_it_leaves_out() {
        assert!(Protections::default().settings().broken().is_empty());
        for protection in Protection::ALL {
            let broken = Protections::without(protection).settings().broken();
            assert_eq!(
                broken,
                protection.relation().into_iter().collect::<Vec<_>>(),
                "{protection:?}"
            );
        }
    }
}
