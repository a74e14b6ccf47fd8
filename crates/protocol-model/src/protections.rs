//! The protections the protocol is made of, each of which the model can leave out.
//!
//! The real protocol is [`Protections::default`]: every protection on. A negative variant turns
//! exactly one off ([`Protections::without`]); the model, the properties and the checker stay
//! the same code, so a counterexample against a variant shows what that one protection is for.

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
    /// `--gateway-key-window` is at least its floor (`key_window_floor` in `config.rs`).
    KeyWindowFloor,
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
}

impl Protection {
    /// Every protection, in the order the docs list them.
    pub const ALL: [Protection; 10] = [
        Protection::Fence,
        Protection::InFlightGuard,
        Protection::OnlyTheGatewaysWordIsFinal,
        Protection::LeaseClockFromTheSend,
        Protection::ProcessingBoundAboveTheTimeout,
        Protection::KeyWindowFloor,
        Protection::KeyWindowWithinTheGatewaysMemory,
        Protection::ReaperSparesUnfinishedKeys,
        Protection::RefusalAfterAnUnknownOutcomeReconciles,
        Protection::OnlyAReplayed5xxIsStored,
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
            | Protection::KeyWindowFloor
            | Protection::KeyWindowWithinTheGatewaysMemory
            | Protection::OnlyAReplayed5xxIsStored => Name::OneChargePerRequest,
        }
    }

    /// The settings' relation this protection is, if it is one.
    pub fn relation(self) -> Option<Relation> {
        match self {
            Protection::ProcessingBoundAboveTheTimeout => {
                Some(Relation::ProcessingBoundAboveTheTimeout)
            }
            Protection::KeyWindowFloor => Some(Relation::KeyWindowFloor),
            Protection::KeyWindowWithinTheGatewaysMemory => {
                Some(Relation::KeyWindowWithinTheGatewaysMemory)
            }
            Protection::Fence
            | Protection::InFlightGuard
            | Protection::OnlyTheGatewaysWordIsFinal
            | Protection::LeaseClockFromTheSend
            | Protection::ReaperSparesUnfinishedKeys
            | Protection::RefusalAfterAnUnknownOutcomeReconciles
            | Protection::OnlyAReplayed5xxIsStored => None,
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
            // A window as short as one lease.
            Some(Protection::KeyWindowFloor) => Settings {
                gateway_key_window: model.lease_ttl,
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
