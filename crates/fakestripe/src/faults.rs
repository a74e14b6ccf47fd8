//! Fault injection for `POST /v1/charges`: the failures a payment client must survive.
//!
//! Each charge request that passes validation draws a [`Plan`] from the current [`Faults`] and
//! the seeded random generator, then goes through these points:
//!
//! ```text
//!  validate ─► plan ─► conflict_in_flight? ─► fail_before_charge? ─► claim key ─► latency+jitter
//!                          409, no write        500, no write                         │
//!                                                                                     ▼
//!                                          sticky_500_before_charge? (500 stored, no charge)
//!                                          sticky_500_after_charge?  (charge + 500 stored)
//!                                          pending_charges?          (charge stays `pending`)
//!                                                                                     │
//!   respond ◄── fail_after_charge? (500) ◄── drop_after_charge? (no response) ◄── commit
//! ```
//!
//! Whether a fault's answer is **stored** under the idempotency key decides what a retry with the
//! same key sees, as with Stripe, which keeps the result of every request that began executing,
//! a 500 included, and replays it for as long as it keeps the key:
//!
//! | fault | charge | stored under the key | a retry with the key gets |
//! |---|---|---|---|
//! | `conflict_in_flight` | no | nothing | a fresh run |
//! | `fail_before_charge` | no | nothing (the request never began executing) | a fresh run |
//! | `sticky_500_before_charge` | no | the 500 | the same 500, until the key is forgotten |
//! | `sticky_500_after_charge` | yes | the 500, in place of the charge | the same 500; only a list finds the charge |
//! | `fail_after_charge` | yes | the charge | the charge (the 500 was a lost answer) |
//! | `drop_after_charge` | yes | the charge | the charge (the connection dropped the answer) |
//! | `pending_charges` | yes, `pending` | the pending charge | the pending charge; `GET /v1/charges/{id}` tells when it settled |
//!
//! - `latency_ms` plus up to `jitter_ms` is spent while the request holds its idempotency key,
//!   as a slow gateway would: a duplicate sent meanwhile gets 409, and a client that times out
//!   leaves a charge that still commits (the work runs in its own task, whatever the client does).
//! - `fail_after_charge` and `drop_after_charge` strike only a request that has just committed a
//!   charge and stored it. Replays and declines are never struck, so a client that retries with
//!   its key converges even with a probability of 1. The sticky 500s, by design, never converge
//!   under their key: the client must find out what happened by listing charges.
//!
//! The draws of one request happen together under the lock, in a fixed order, so a given `seed`
//! and a given order of requests always yield the same faults.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// The largest `latency_ms + jitter_ms` accepted.
///
/// Latency is spent while the request holds its idempotency key's lease, so it must stay well
/// below [`crate::LEASE_TTL`]: otherwise a slow request would lose its lease to a retry and
/// fail at commit.
pub const MAX_LATENCY_MS: u64 = 20_000;

/// The faults to inject, settable at start and at run time (`PUT /faults`).
///
/// Probabilities are in `[0, 1]`. In JSON every field is optional (missing means no fault) and
/// unknown fields are refused, so a typo cannot silently disable a fault.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Added to every charge that runs, in milliseconds.
    pub latency_ms: u64,
    /// Up to this many more milliseconds, drawn uniformly per charge.
    pub jitter_ms: u64,
    /// Answer 500 `api_error` before anything is written.
    pub fail_before_charge: f64,
    /// Commit the charge and its idempotent response, then answer 500 `api_error`.
    pub fail_after_charge: f64,
    /// Commit the charge and its idempotent response, then abort the connection without a
    /// valid HTTP response.
    pub drop_after_charge: f64,
    /// Answer 409 `idempotency_key_in_use` as if the key were in flight; nothing is written.
    pub conflict_in_flight: f64,
    /// Store a 500 `api_error` under the key without charging: every retry with the key gets the
    /// same 500 until the gateway forgets the key.
    pub sticky_500_before_charge: f64,
    /// Commit the charge but store (and answer) a 500 `api_error` in place of it: a retry with
    /// the key gets the 500 again, and only listing the customer's charges finds the charge.
    pub sticky_500_after_charge: f64,
    /// Hold a charge for `slow_ms` more, inside its transaction (its key in use meanwhile): a
    /// gateway slower than its caller's heartbeat but within its timeout.
    pub slow_charges: f64,
    /// The extra time of a slow charge, in milliseconds.
    pub slow_ms: u64,
    /// Hold a charge for `stalled_ms` more, then charge: a gateway slower than its caller's
    /// timeout, which charges after the caller gave up (and answers 409 to its retries
    /// meanwhile, the key being in use).
    pub stalled_charges: f64,
    /// The extra time of a stalled charge, in milliseconds.
    pub stalled_ms: u64,
    /// Create the charge with status `pending` (not paid). It stays pending until it is settled
    /// ([`crate::AppState::settle_pending_charges`], `POST /charges/settle` on the admin API).
    pub pending_charges: f64,
    /// Seeds the generator for reproducible runs; `None` seeds it from the operating system.
    /// Setting faults reseeds, so the same faults and seed replay the same sequence.
    pub seed: Option<u64>,
}

/// Why a [`Faults`] value was refused. The message is shown to the admin client.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidFaults {
    /// A probability outside `[0, 1]`, or not a number.
    #[error("{name} must be a probability between 0 and 1, got {value}")]
    Probability {
        /// The field.
        name: &'static str,
        /// The value given.
        value: f64,
    },
    /// `latency_ms + jitter_ms` plus the longer of `slow_ms` and `stalled_ms` above
    /// [`MAX_LATENCY_MS`].
    #[error(
        "latency_ms + jitter_ms + max(slow_ms, stalled_ms) must be at most {MAX_LATENCY_MS}, got {0}"
    )]
    Latency(u64),
}

impl Faults {
    /// No faults at all.
    pub fn none() -> Self {
        Self::default()
    }

    /// Checks every field's range.
    pub fn validate(&self) -> Result<(), InvalidFaults> {
        for (name, value) in [
            ("fail_before_charge", self.fail_before_charge),
            ("fail_after_charge", self.fail_after_charge),
            ("drop_after_charge", self.drop_after_charge),
            ("conflict_in_flight", self.conflict_in_flight),
            ("sticky_500_before_charge", self.sticky_500_before_charge),
            ("sticky_500_after_charge", self.sticky_500_after_charge),
            ("pending_charges", self.pending_charges),
            ("slow_charges", self.slow_charges),
            ("stalled_charges", self.stalled_charges),
        ] {
            // `contains` is false for NaN, which is refused with the rest.
            if !(0.0..=1.0).contains(&value) {
                return Err(InvalidFaults::Probability { name, value });
            }
        }
        // The longest a charge can be held: its latency and the longer of the two holds.
        let latency = self
            .latency_ms
            .saturating_add(self.jitter_ms)
            .saturating_add(self.slow_ms.max(self.stalled_ms));
        if latency > MAX_LATENCY_MS {
            return Err(InvalidFaults::Latency(latency));
        }
        Ok(())
    }
}

/// How many faults were injected, by kind, since the gateway started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultCounters {
    /// Charges that were delayed by `latency_ms`/`jitter_ms` (a delay of zero is not counted).
    pub latency: u64,
    /// 500s answered before writing.
    pub fail_before_charge: u64,
    /// 500s answered after committing a charge.
    pub fail_after_charge: u64,
    /// Connections aborted after committing a charge.
    pub drop_after_charge: u64,
    /// 409s answered as if the key were in flight.
    pub conflict_in_flight: u64,
    /// 500s stored under their key without a charge.
    pub sticky_500_before_charge: u64,
    /// 500s stored under their key in place of a committed charge.
    pub sticky_500_after_charge: u64,
    /// Charges created `pending`.
    pub pending_charges: u64,
    /// Charges held `slow_ms` more.
    pub slow_charges: u64,
    /// Charges held `stalled_ms` more.
    pub stalled_charges: u64,
    /// Charges refused because their customer was deleted (a permanent refusal).
    pub refused: u64,
    /// Idempotency keys the gateway forgot (their window passed, or it was told to).
    pub keys_forgotten: u64,
}

/// One kind of injected fault, for [`FaultState::record`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FaultKind {
    Latency,
    FailBeforeCharge,
    FailAfterCharge,
    DropAfterCharge,
    ConflictInFlight,
    Sticky500BeforeCharge,
    Sticky500AfterCharge,
    PendingCharge,
    SlowCharge,
    StalledCharge,
    Refused,
}

/// What a charge request that runs keeps under its idempotency key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stored {
    /// The charge (or decline) it made.
    Outcome,
    /// A 500 in place of the charge it made.
    ServerErrorAfterCharge,
    /// A 500, and no charge is made.
    ServerErrorInstead,
}

/// What happens to a request that has just committed a charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterCharge {
    /// Deliver the response.
    Respond,
    /// Answer 500 instead.
    Fail,
    /// Abort the connection.
    Drop,
}

/// The faults drawn for one charge request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) conflict_in_flight: bool,
    pub(crate) fail_before_charge: bool,
    /// The latency, and the hold of a slow or stalled charge.
    pub(crate) delay: Duration,
    /// The charge is held as slow or stalled (part of `delay`).
    pub(crate) held: Option<FaultKind>,
    pub(crate) stored: Stored,
    pub(crate) pending: bool,
    pub(crate) after_charge: AfterCharge,
}

/// The faults, their generator and their counters, kept together behind one lock.
#[derive(Debug)]
pub(crate) struct FaultState {
    faults: Faults,
    rng: StdRng,
    counters: FaultCounters,
}

impl FaultState {
    /// A state for already validated faults.
    pub(crate) fn new(faults: Faults) -> Self {
        let rng = rng_for(&faults);
        Self {
            faults,
            rng,
            counters: FaultCounters::default(),
        }
    }

    /// Replaces the faults and reseeds the generator; the counters keep counting.
    pub(crate) fn set(&mut self, faults: Faults) {
        self.rng = rng_for(&faults);
        self.faults = faults;
    }

    pub(crate) fn faults(&self) -> &Faults {
        &self.faults
    }

    pub(crate) fn counters(&self) -> FaultCounters {
        self.counters
    }

    /// Draws the faults of one request. Every draw is made whatever the earlier ones gave, so
    /// the sequence consumed per request is fixed and a seed replays exactly.
    pub(crate) fn plan(&mut self) -> Plan {
        let f = &self.faults;
        let rng = &mut self.rng;
        // `random::<f64>()` is in [0, 1): a probability of 0 never fires and 1 always does.
        let conflict_in_flight = rng.random::<f64>() < f.conflict_in_flight;
        let fail_before_charge = rng.random::<f64>() < f.fail_before_charge;
        let drop_after_charge = rng.random::<f64>() < f.drop_after_charge;
        let fail_after_charge = rng.random::<f64>() < f.fail_after_charge;
        let jitter = rng.random_range(0..=f.jitter_ms);
        let sticky_before = rng.random::<f64>() < f.sticky_500_before_charge;
        let sticky_after = rng.random::<f64>() < f.sticky_500_after_charge;
        let pending = rng.random::<f64>() < f.pending_charges;
        let slow = rng.random::<f64>() < f.slow_charges;
        let stalled = rng.random::<f64>() < f.stalled_charges;
        let (held, hold_ms) = if stalled {
            (Some(FaultKind::StalledCharge), f.stalled_ms)
        } else if slow {
            (Some(FaultKind::SlowCharge), f.slow_ms)
        } else {
            (None, 0)
        };
        let stored = if sticky_before {
            Stored::ServerErrorInstead
        } else if sticky_after {
            Stored::ServerErrorAfterCharge
        } else {
            Stored::Outcome
        };
        let after_charge = if drop_after_charge {
            AfterCharge::Drop
        } else if fail_after_charge {
            AfterCharge::Fail
        } else {
            AfterCharge::Respond
        };
        Plan {
            conflict_in_flight,
            fail_before_charge,
            delay: Duration::from_millis(f.latency_ms + jitter + hold_ms),
            held,
            stored,
            pending,
            after_charge,
        }
    }

    /// Counts keys the gateway forgot.
    pub(crate) fn record_forgotten(&mut self, keys: u64) {
        self.counters.keys_forgotten += keys;
    }

    /// Counts one injected fault.
    pub(crate) fn record(&mut self, kind: FaultKind) {
        let c = &mut self.counters;
        let counter = match kind {
            FaultKind::Latency => &mut c.latency,
            FaultKind::FailBeforeCharge => &mut c.fail_before_charge,
            FaultKind::FailAfterCharge => &mut c.fail_after_charge,
            FaultKind::DropAfterCharge => &mut c.drop_after_charge,
            FaultKind::ConflictInFlight => &mut c.conflict_in_flight,
            FaultKind::Sticky500BeforeCharge => &mut c.sticky_500_before_charge,
            FaultKind::Sticky500AfterCharge => &mut c.sticky_500_after_charge,
            FaultKind::PendingCharge => &mut c.pending_charges,
            FaultKind::SlowCharge => &mut c.slow_charges,
            FaultKind::StalledCharge => &mut c.stalled_charges,
            FaultKind::Refused => &mut c.refused,
        };
        *counter += 1;
    }
}

fn rng_for(faults: &Faults) -> StdRng {
    match faults.seed {
        Some(seed) => StdRng::seed_from_u64(seed),
        None => StdRng::from_os_rng(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probabilities_outside_zero_to_one_are_refused() {
        for bad in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
            let faults = Faults {
                fail_after_charge: bad,
                ..Faults::none()
            };
            assert!(
                matches!(
                    faults.validate(),
                    Err(InvalidFaults::Probability {
                        name: "fail_after_charge",
                        ..
                    })
                ),
                "{bad} should be refused"
            );
        }
        let edges = Faults {
            conflict_in_flight: 0.0,
            drop_after_charge: 1.0,
            ..Faults::none()
        };
        assert_eq!(edges.validate(), Ok(()));
    }

    #[test]
    fn latency_is_bounded() {
        let faults = Faults {
            latency_ms: MAX_LATENCY_MS,
            jitter_ms: 1,
            ..Faults::none()
        };
        assert_eq!(
            faults.validate(),
            Err(InvalidFaults::Latency(MAX_LATENCY_MS + 1))
        );
        let faults = Faults {
            latency_ms: u64::MAX,
            jitter_ms: u64::MAX,
            ..Faults::none()
        };
        assert!(faults.validate().is_err());
    }

    #[test]
    fn the_same_seed_draws_the_same_plans() {
        let faults = Faults {
            jitter_ms: 100,
            fail_before_charge: 0.5,
            drop_after_charge: 0.5,
            seed: Some(7),
            ..Faults::none()
        };
        let draw = |state: &mut FaultState| (0..50).map(|_| state.plan()).collect::<Vec<_>>();
        let mut a = FaultState::new(faults.clone());
        let first = draw(&mut a);
        assert_eq!(first, draw(&mut FaultState::new(faults.clone())));
        // Setting the faults again reseeds: the sequence starts over.
        a.set(faults);
        assert_eq!(first, draw(&mut a));
        // And the draws are not all alike, so the comparison above means something.
        assert!(first.iter().any(|p| p.fail_before_charge));
        assert!(first.iter().any(|p| !p.fail_before_charge));
    }

    #[test]
    fn probabilities_of_zero_and_one_never_and_always_fire() {
        let mut state = FaultState::new(Faults {
            fail_after_charge: 1.0,
            latency_ms: 5,
            ..Faults::none()
        });
        for _ in 0..100 {
            let plan = state.plan();
            assert!(!plan.conflict_in_flight && !plan.fail_before_charge);
            assert_eq!(plan.after_charge, AfterCharge::Fail);
            assert_eq!(plan.delay, Duration::from_millis(5));
        }
    }

    #[test]
    fn slow_and_stalled_charges_are_held_their_own_time_and_told_apart() {
        let mut stalled = FaultState::new(Faults {
            latency_ms: 5,
            slow_charges: 1.0,
            slow_ms: 100,
            stalled_charges: 1.0,
            stalled_ms: 300,
            ..Faults::none()
        });
        // Both drawn: the stall wins, and its time is added to the latency.
        let plan = stalled.plan();
        assert_eq!(plan.held, Some(FaultKind::StalledCharge));
        assert_eq!(plan.delay, Duration::from_millis(305));
        let mut slow = FaultState::new(Faults {
            slow_charges: 1.0,
            slow_ms: 100,
            stalled_ms: 300,
            ..Faults::none()
        });
        let plan = slow.plan();
        assert_eq!(plan.held, Some(FaultKind::SlowCharge));
        assert_eq!(plan.delay, Duration::from_millis(100));
        slow.record(FaultKind::SlowCharge);
        assert_eq!(
            (
                slow.counters().slow_charges,
                slow.counters().stalled_charges
            ),
            (1, 0)
        );
        let too_long = Faults {
            latency_ms: MAX_LATENCY_MS - 10,
            stalled_ms: 11,
            ..Faults::none()
        };
        assert_eq!(
            too_long.validate(),
            Err(InvalidFaults::Latency(MAX_LATENCY_MS + 1))
        );
    }

    #[test]
    fn json_fields_are_optional_and_unknown_ones_refused() {
        let faults: Faults = serde_json::from_str(r#"{"drop_after_charge": 1}"#).unwrap();
        assert_eq!(
            faults,
            Faults {
                drop_after_charge: 1.0,
                ..Faults::none()
            }
        );
        assert!(serde_json::from_str::<Faults>(r#"{"drop_after_charg": 1}"#).is_err());
    }
}
