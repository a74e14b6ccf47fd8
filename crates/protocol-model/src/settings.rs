//! Time in the model, and the settings' relations.
//!
//! Time is counted in whole ticks. The settings keep the relations that Rocket Rides checks at
//! start (`crates/rocket-rides/src/config.rs`) and the library checks for the heartbeat
//! (`Store::with_heartbeat`), on the smallest numbers that satisfy all of them, so that the
//! checker covers as long a stretch of the key's life as it can.

use std::fmt;

/// A point or a span of model time, in ticks.
pub type Tick = u8;

/// How much longer than the gateway timeout the lease must be (`LEASE_MARGIN`, 5 s, in
/// `config.rs`): one tick.
pub const LEASE_MARGIN: Tick = 1;

/// How long the gateway keeps a key (Stripe: 24 hours): it may forget a key once its first use
/// is this old. A fact about the gateway, not a setting.
pub const GATEWAY_KEY_MEMORY: Tick = 14;

/// How long the gateway really goes on with a request: it has answered (or dropped) every
/// request before this many ticks after it was sent. A fact about the gateway, which
/// `--gateway-processing-bound` promises to cover.
pub const GATEWAY_PROCESSING: Tick = 2;

/// The settings, in ticks, named as Rocket Rides names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Settings {
    /// `--gateway-timeout`: a caller gives up on the gateway's answer this long after it sent
    /// the request.
    pub gateway_timeout: Tick,
    /// `--lease-ttl`.
    pub lease_ttl: Tick,
    /// `--lease-heartbeat`: a holder with less than this left of its lease by its own clock
    /// renews it before a call to the gateway.
    pub lease_heartbeat: Tick,
    /// `--gateway-processing-bound`: a reconciling list waits until the last recorded call is
    /// this old, and its range reaches this far past that call.
    pub gateway_processing_bound: Tick,
    /// `--gateway-key-window`: a generation whose first use is this old is past the window.
    pub gateway_key_window: Tick,
    /// `--key-retention`: a key finished longer ago than this expires at read and is reaped.
    pub key_retention: Tick,
    /// `--completer-grace`.
    pub completer_grace: Tick,
    /// `RECONCILE_CLOCK_SKEW` (10 minutes in `booking/reconcile.rs`): how far the reconciling
    /// list's range reaches past the last record plus the processing bound, for a gateway whose
    /// clock is not ours. The model's gateway keeps our clock, so the model's value is zero:
    /// every call leaves within a heartbeat of its record
    /// ([`crate::Protection::SendWithinAHeartbeatOfItsRecord`]), in the record's tick, and the
    /// skew covers nothing else.
    pub reconcile_clock_skew: Tick,
}

impl Settings {
    /// The smallest settings that keep every relation: a gateway timeout of one tick, the lease
    /// one margin above it but three heartbeats long, the processing bound one tick above the
    /// timeout, the window at its floor, the gateway's memory just covering the window and the
    /// bound, the retention at that memory (as `--key-retention` is at least Stripe's 24 hours),
    /// the grace one tick above the lease, no clock skew.
    pub const MODEL: Settings = Settings {
        gateway_timeout: 1,
        lease_ttl: 3,
        lease_heartbeat: 1,
        gateway_processing_bound: 2,
        gateway_key_window: 12,
        key_retention: GATEWAY_KEY_MEMORY,
        completer_grace: 4,
        reconcile_clock_skew: 0,
    };

    /// The shortest key window these settings allow: twice the life of one attempt
    /// (`key_window_floor` in `config.rs`).
    pub fn key_window_floor(&self) -> u16 {
        2 * (u16::from(self.gateway_timeout)
            + u16::from(self.lease_ttl)
            + u16::from(self.gateway_processing_bound))
    }

    /// The relations these settings break, in the order [`Relation::ALL`] lists them.
    pub fn broken(&self) -> Vec<Relation> {
        Relation::ALL
            .into_iter()
            .filter(|r| !r.holds(self))
            .collect()
    }

    /// Checks every relation, as `rocket-rides serve` does at start.
    pub fn validate(&self) -> Result<(), SettingsError> {
        match self.broken().first() {
            None => Ok(()),
            Some(&relation) => Err(SettingsError {
                relation,
                settings: *self,
            }),
        }
    }
}

/// A relation between the settings that the service refuses to start without.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Relation {
    /// `--lease-ttl` ≥ `--gateway-timeout` + the margin.
    LeaseOutlastsTheGatewayTimeout,
    /// 0 < `--lease-heartbeat` < half of `--lease-ttl`.
    HeartbeatBelowHalfTheLease,
    /// `--gateway-processing-bound` > `--gateway-timeout`.
    ProcessingBoundAboveTheTimeout,
    /// `--gateway-key-window` ≥ 2 × (timeout + lease TTL + processing bound).
    KeyWindowFloor,
    /// `--gateway-key-window` + `--gateway-processing-bound` ≤ the gateway's key memory.
    KeyWindowWithinTheGatewaysMemory,
    /// `--key-retention` ≥ the gateway's key memory.
    RetentionAtLeastTheGatewaysMemory,
    /// `--completer-grace` > `--lease-ttl`.
    GraceAboveTheLease,
}

impl Relation {
    /// Every relation.
    pub const ALL: [Relation; 7] = [
        Relation::LeaseOutlastsTheGatewayTimeout,
        Relation::HeartbeatBelowHalfTheLease,
        Relation::ProcessingBoundAboveTheTimeout,
        Relation::KeyWindowFloor,
        Relation::KeyWindowWithinTheGatewaysMemory,
        Relation::RetentionAtLeastTheGatewaysMemory,
        Relation::GraceAboveTheLease,
    ];

    /// Whether `settings` keep this relation.
    pub fn holds(self, s: &Settings) -> bool {
        match self {
            Relation::LeaseOutlastsTheGatewayTimeout => {
                u16::from(s.lease_ttl) >= u16::from(s.gateway_timeout) + u16::from(LEASE_MARGIN)
            }
            Relation::HeartbeatBelowHalfTheLease => {
                s.lease_heartbeat > 0 && 2 * u16::from(s.lease_heartbeat) < u16::from(s.lease_ttl)
            }
            Relation::ProcessingBoundAboveTheTimeout => {
                s.gateway_processing_bound > s.gateway_timeout
            }
            Relation::KeyWindowFloor => u16::from(s.gateway_key_window) >= s.key_window_floor(),
            Relation::KeyWindowWithinTheGatewaysMemory => {
                u16::from(s.gateway_key_window) + u16::from(s.gateway_processing_bound)
                    <= u16::from(GATEWAY_KEY_MEMORY)
            }
            Relation::RetentionAtLeastTheGatewaysMemory => s.key_retention >= GATEWAY_KEY_MEMORY,
            Relation::GraceAboveTheLease => s.completer_grace > s.lease_ttl,
        }
    }

    /// What the relation says, in the settings' own names.
    pub fn describe(self) -> &'static str {
        match self {
            Relation::LeaseOutlastsTheGatewayTimeout => {
                "--lease-ttl must be at least --gateway-timeout plus the lease margin"
            }
            Relation::HeartbeatBelowHalfTheLease => {
                "--lease-heartbeat must be above zero and below half of --lease-ttl"
            }
            Relation::ProcessingBoundAboveTheTimeout => {
                "--gateway-processing-bound must exceed --gateway-timeout"
            }
            Relation::KeyWindowFloor => {
                "--gateway-key-window must be at least twice (--gateway-timeout + --lease-ttl + \
                 --gateway-processing-bound)"
            }
            Relation::KeyWindowWithinTheGatewaysMemory => {
                "--gateway-key-window with --gateway-processing-bound must stay within the \
                 gateway's key retention"
            }
            Relation::RetentionAtLeastTheGatewaysMemory => {
                "--key-retention must be at least as long as the gateway keeps its keys"
            }
            Relation::GraceAboveTheLease => "--completer-grace must exceed --lease-ttl",
        }
    }
}

/// Settings that break a relation: the service would refuse to start with them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingsError {
    /// The first relation broken.
    pub relation: Relation,
    /// The settings refused.
    pub settings: Settings,
}

impl fmt::Display for SettingsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (settings {:?})",
            self.relation.describe(),
            self.settings
        )
    }
}

impl std::error::Error for SettingsError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_settings_keep_every_relation() {
        assert_eq!(Settings::MODEL.validate(), Ok(()));
        assert_eq!(
            u16::from(Settings::MODEL.gateway_key_window),
            Settings::MODEL.key_window_floor(),
            "the window sits at its floor"
        );
        const { assert!(GATEWAY_PROCESSING <= Settings::MODEL.gateway_processing_bound) };
    }

    #[test]
    fn each_relation_is_refused_by_name() {
        let cases = [
            (
                Settings {
                    lease_ttl: 1,
                    ..Settings::MODEL
                },
                Relation::LeaseOutlastsTheGatewayTimeout,
            ),
            (
                Settings {
                    lease_heartbeat: 0,
                    ..Settings::MODEL
                },
                Relation::HeartbeatBelowHalfTheLease,
            ),
            (
                Settings {
                    gateway_processing_bound: 1,
                    ..Settings::MODEL
                },
                Relation::ProcessingBoundAboveTheTimeout,
            ),
            (
                Settings {
                    gateway_key_window: 11,
                    ..Settings::MODEL
                },
                Relation::KeyWindowFloor,
            ),
            (
                Settings {
                    gateway_key_window: 13,
                    ..Settings::MODEL
                },
                Relation::KeyWindowWithinTheGatewaysMemory,
            ),
            (
                Settings {
                    key_retention: GATEWAY_KEY_MEMORY - 1,
                    ..Settings::MODEL
                },
                Relation::RetentionAtLeastTheGatewaysMemory,
            ),
            (
                Settings {
                    completer_grace: 3,
                    ..Settings::MODEL
                },
                Relation::GraceAboveTheLease,
            ),
        ];
        for (settings, relation) in cases {
            // A lease of one tick is also too short for a heartbeat: the first broken is named.
            assert_eq!(settings.broken().first(), Some(&relation), "{settings:?}");
            let err = settings.validate().unwrap_err();
            assert_eq!(err.relation, relation);
            assert!(err.to_string().starts_with(relation.describe()), "{err}");
        }
    }
}
