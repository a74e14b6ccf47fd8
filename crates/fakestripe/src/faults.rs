//! Fault injection for `POST /v1/charges`: the failures a payment client must survive.
//!
//! Each charge request that passes validation draws a [`Plan`] from the current [`Faults`] and
//! the seeded random generator; a scripted action for its customer, if one waits, replaces what
//! was drawn ([`crate::scripted`]). The request then goes through these points:
//!
//! ```text
//!  validate ─► plan ─► intermediary_before? ─► conflict_in_flight? ─► fail_before_charge? ─► claim key
//!  (+ script)          a proxy's 400/404/50x,   409, no write          500, no write              │
//!                      no write                                                                   │
//!            ┌─────────────────────────── the key holds a result ◄────────────────────────────────┤
//!            ▼                                                                     the key is new ▼
//!  idempotency_error_on_replay? 400 if a charge is stored,          latency+jitter, or a slow,
//!                               else the replay                     stalled or scripted hold
//!                                                                                                 │
//!                                        sticky_500_before_charge? (500 stored, no charge)        │
//!                                        sticky_500_after_charge?  (charge + 500 stored)          │
//!                                        pending_charges?          (charge stays `pending`)       │
//!                                                                                                 ▼
//!  respond ◄── intermediary_after? ◄── fail_after_charge? (500) ◄── drop_after_charge? ◄────── commit
//!              (a proxy's answer)                                   (no response)
//! ```
//!
//! Whether a fault's answer is **stored** under the idempotency key decides what a retry with the
//! same key sees, as with Stripe, which keeps the result of every request that began executing,
//! a 500 included, and replays it for as long as it keeps the key:
//!
//! | fault | charge | stored under the key | a retry with the key gets |
//! |---|---|---|---|
//! | `intermediary_before` | no | nothing (the request never reached the gateway) | a fresh run |
//! | `conflict_in_flight` | no | nothing | a fresh run |
//! | `fail_before_charge` | no | nothing (the request never began executing) | a fresh run |
//! | `sticky_500_before_charge` | no | the 500 | the same 500, until the key is forgotten |
//! | `sticky_500_after_charge` | yes | the 500, in place of the charge | the same 500; only a list finds the charge |
//! | `fail_after_charge` | yes | the charge | the charge (the 500 was a lost answer) |
//! | `drop_after_charge` | yes | the charge | the charge (the connection dropped the answer) |
//! | `intermediary_after` | yes | the charge | the charge (a proxy replaced the answer) |
//! | `pending_charges` | yes, `pending` | the pending charge | the pending charge; `GET /v1/charges/{id}` tells when it settled |
//! | `idempotency_error_on_replay` | no new one | nothing more: the first result stays | 400 `idempotency_error` while the fault lasts, then the charge |
//! | scripted `FailBefore` | no | nothing, as `fail_before_charge` | a fresh run |
//! | scripted `Hold` | yes, after the hold | the charge | 409 while it is held, then the charge |
//!
//! - `latency_ms` plus up to `jitter_ms` is spent while the request holds its idempotency key,
//!   as a slow gateway would: a duplicate sent meanwhile gets 409, and a client that times out
//!   leaves a charge that still commits (the work runs in its own task, whatever the client does).
//! - `fail_after_charge`, `drop_after_charge` and `intermediary_after` strike only a request that
//!   has just committed a charge and stored it; when several are drawn, the drop wins, then the
//!   500, then the intermediary. Replays and declines are never struck, so a client that retries
//!   with its key converges even with a probability of 1. The sticky 500s, by design, never
//!   converge under their key: the client must find out what happened by listing charges.
//! - An intermediary's answer ([`IntermediaryAnswer`]) is what a load balancer or proxy in front
//!   of Stripe sends on its own: 400, 404, 502, 503 or 504, with a small HTML page or no body at
//!   all. It never carries Stripe's error object, `Idempotent-Replayed` or `Request-Id`, so a
//!   client that reads every non-2xx as Stripe's verdict is caught out: before the gateway
//!   (`intermediary_before`) nothing happened, after it (`intermediary_after`) the charge was made,
//!   and the answer looks the same. Only a retry with the key tells.
//! - `idempotency_error_on_replay` answers a retry whose key holds a stored charge (succeeded,
//!   pending or failed since) with Stripe's 400 for a key reused with other parameters, as when a
//!   deploy changed what a retry sends (a charge's description) while its keys were unfinished.
//!   Stored 500s and declines are replayed as usual.
//!
//! The draws of one request happen together under the lock, in a fixed order, so a given `seed`
//! and a given order of requests always yield the same faults. The draws of the later fault
//! kinds (the intermediaries, `idempotency_error_on_replay`) come from a second generator
//! seeded from the same seed, so that adding them left unchanged the faults an existing seed
//! gives for the earlier kinds.

use std::time::Duration;

use http::StatusCode;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::bounds::{INTERMEDIARY_STATUSES, MAX_LATENCY_MS};
use crate::scripted::{InvalidScript, Scripted, Scripts};

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
    /// Answer as an intermediary in front of the gateway would on its own: 400, 404, 502, 503
    /// or 504, with a small HTML page or no body, never Stripe's error object. The request never
    /// reaches the gateway, so nothing is charged, written or stored under the key.
    pub intermediary_before: f64,
    /// Commit the charge and its idempotent response, then deliver an intermediary's answer in
    /// place of the response, as a proxy that lost the gateway's answer would.
    pub intermediary_after: f64,
    /// Answer a request whose key holds a stored charge with 400 `idempotency_error` (the key
    /// reused with other parameters) instead of the replay; nothing is written.
    pub idempotency_error_on_replay: f64,
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
            ("intermediary_before", self.intermediary_before),
            ("intermediary_after", self.intermediary_after),
            (
                "idempotency_error_on_replay",
                self.idempotency_error_on_replay,
            ),
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
    /// Intermediary answers given in place of the gateway, before any write.
    pub intermediary_before: u64,
    /// Intermediary answers delivered in place of a committed charge.
    pub intermediary_after: u64,
    /// 400 `idempotency_error`s answered in place of the replay of a stored charge.
    pub idempotency_error_on_replay: u64,
    /// 500s answered before writing because a scripted `FailBefore` said so.
    pub scripted_fail_before: u64,
    /// Scripted holds, counted when they start.
    pub scripted_holds: u64,
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
    IntermediaryBefore,
    IntermediaryAfter,
    IdempotencyErrorOnReplay,
    ScriptedFailBefore,
    ScriptedHold,
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
    /// Deliver an intermediary's answer instead.
    Intermediary(IntermediaryAnswer),
}

/// What answers a charge request before it claims its key, instead of the gateway's run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BeforeCharge {
    /// An intermediary in front of the gateway (`intermediary_before`).
    Intermediary(IntermediaryAnswer),
    /// 409 as if the key were in flight (`conflict_in_flight`).
    ConflictInFlight,
    /// 500 before anything is written (`fail_before_charge`).
    FailBefore,
    /// 500 before anything is written, as a script said ([`Scripted::FailBefore`]).
    ScriptedFailBefore,
}

/// An answer an intermediary in front of the gateway gives on its own: one of
/// [`INTERMEDIARY_STATUSES`] and one of two body forms, never Stripe's error object.
/// `crate::charges` turns it into a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IntermediaryAnswer {
    pub(crate) status: StatusCode,
    pub(crate) body: IntermediaryBody,
}

/// The body of an [`IntermediaryAnswer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IntermediaryBody {
    /// A small `text/html` page naming the status, as nginx sends.
    Html,
    /// No body at all (`content-length: 0`, no `content-type`).
    Empty,
}

impl IntermediaryAnswer {
    /// Draws a status and a body form: two draws, whatever they give.
    fn draw(rng: &mut StdRng) -> Self {
        let status = INTERMEDIARY_STATUSES[rng.random_range(0..INTERMEDIARY_STATUSES.len())];
        let body = if rng.random::<bool>() {
            IntermediaryBody::Html
        } else {
            IntermediaryBody::Empty
        };
        Self { status, body }
    }
}

/// The faults drawn for one charge request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    /// The answer given before the key is claimed, if any.
    pub(crate) before: Option<BeforeCharge>,
    /// The latency, and the hold of a slow, stalled or scripted charge.
    pub(crate) delay: Duration,
    /// The fault the delay is counted as (`Latency`, or the kind of hold); `None` when nothing
    /// is to be counted. A scripted hold is counted even when it is 0 ms: it was asked for.
    pub(crate) delay_fault: Option<FaultKind>,
    pub(crate) stored: Stored,
    pub(crate) pending: bool,
    pub(crate) after_charge: AfterCharge,
    /// A replay of a stored charge is answered 400 `idempotency_error` instead.
    pub(crate) idempotency_error_on_replay: bool,
}

impl Plan {
    /// The plan a scripted action makes: the action alone, whatever was drawn.
    fn scripted(action: Scripted) -> Self {
        let quiet = Self {
            before: None,
            delay: Duration::ZERO,
            delay_fault: None,
            stored: Stored::Outcome,
            pending: false,
            after_charge: AfterCharge::Respond,
            idempotency_error_on_replay: false,
        };
        match action {
            Scripted::FailBefore => Self {
                before: Some(BeforeCharge::ScriptedFailBefore),
                ..quiet
            },
            Scripted::Hold { ms } => Self {
                delay: Duration::from_millis(ms),
                delay_fault: Some(FaultKind::ScriptedHold),
                ..quiet
            },
            Scripted::Intermediary {
                status,
                empty,
                after_charge,
            } => {
                let answer = IntermediaryAnswer {
                    // Validated against INTERMEDIARY_STATUSES when it was scripted.
                    status: StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
                    body: if empty {
                        IntermediaryBody::Empty
                    } else {
                        IntermediaryBody::Html
                    },
                };
                if after_charge {
                    Self {
                        after_charge: AfterCharge::Intermediary(answer),
                        ..quiet
                    }
                } else {
                    Self {
                        before: Some(BeforeCharge::Intermediary(answer)),
                        ..quiet
                    }
                }
            }
        }
    }
}

/// The faults, their generators, the scripts and the counters, kept together behind one lock.
#[derive(Debug)]
pub(crate) struct FaultState {
    faults: Faults,
    /// The generator of the first fault kinds' draws.
    rng: StdRng,
    /// The generator of the draws of the kinds added later, so that adding them did not shift
    /// the sequence `rng` gives for a seed.
    later_rng: StdRng,
    scripts: Scripts,
    counters: FaultCounters,
}

impl FaultState {
    /// A state for already validated faults.
    pub(crate) fn new(faults: Faults) -> Self {
        let (rng, later_rng) = rngs_for(&faults);
        Self {
            faults,
            rng,
            later_rng,
            scripts: Scripts::default(),
            counters: FaultCounters::default(),
        }
    }

    /// Replaces the faults and reseeds the generators; the counters keep counting, and the
    /// scripts keep waiting.
    pub(crate) fn set(&mut self, faults: Faults) {
        (self.rng, self.later_rng) = rngs_for(&faults);
        self.faults = faults;
    }

    /// Appends actions to a customer's script; returns how many wait for it now.
    pub(crate) fn script(
        &mut self,
        customer: &str,
        actions: Vec<Scripted>,
    ) -> Result<usize, InvalidScript> {
        self.scripts.append(customer, actions)
    }

    /// Drops the actions waiting for a customer; returns how many there were.
    pub(crate) fn clear_script(&mut self, customer: &str) -> usize {
        self.scripts.clear(customer)
    }

    /// How many scripted actions wait for a customer.
    pub(crate) fn scripted_left(&self, customer: &str) -> usize {
        self.scripts.left(customer)
    }

    pub(crate) fn faults(&self) -> &Faults {
        &self.faults
    }

    pub(crate) fn counters(&self) -> FaultCounters {
        self.counters
    }

    /// The plan of one charge request of `customer`: the faults drawn, or in their place the
    /// first action of the customer's script, if one waits. The draws are made either way, so
    /// that a script does not shift the seeded sequence of the other requests.
    pub(crate) fn plan_for(&mut self, customer: &str) -> Plan {
        let drawn = self.plan();
        match self.scripts.pop(customer) {
            Some(action) => Plan::scripted(action),
            None => drawn,
        }
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
        // The later kinds, from their own generator, in a fixed order; the intermediary's answer
        // is drawn whether or not an intermediary strikes.
        let later = &mut self.later_rng;
        let intermediary_before = later.random::<f64>() < f.intermediary_before;
        let intermediary_after = later.random::<f64>() < f.intermediary_after;
        let idempotency_error_on_replay = later.random::<f64>() < f.idempotency_error_on_replay;
        let intermediary = IntermediaryAnswer::draw(later);

        let before = if intermediary_before {
            // The intermediary stands in front of the gateway: its answer comes first.
            Some(BeforeCharge::Intermediary(intermediary))
        } else if conflict_in_flight {
            Some(BeforeCharge::ConflictInFlight)
        } else if fail_before_charge {
            Some(BeforeCharge::FailBefore)
        } else {
            None
        };
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
        } else if intermediary_after {
            AfterCharge::Intermediary(intermediary)
        } else {
            AfterCharge::Respond
        };
        let delay = Duration::from_millis(f.latency_ms + jitter + hold_ms);
        Plan {
            before,
            delay,
            // A delay of zero is not counted, not even a slow charge's of `slow_ms: 0`.
            delay_fault: (!delay.is_zero()).then(|| held.unwrap_or(FaultKind::Latency)),
            stored,
            pending,
            after_charge,
            idempotency_error_on_replay,
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
            FaultKind::IntermediaryBefore => &mut c.intermediary_before,
            FaultKind::IntermediaryAfter => &mut c.intermediary_after,
            FaultKind::IdempotencyErrorOnReplay => &mut c.idempotency_error_on_replay,
            FaultKind::ScriptedFailBefore => &mut c.scripted_fail_before,
            FaultKind::ScriptedHold => &mut c.scripted_holds,
            FaultKind::Refused => &mut c.refused,
        };
        *counter += 1;
    }
}

/// Mixed into the seed of the later kinds' generator, so that its stream is not the first
/// generator's. Any fixed constant would do; this one is the 64-bit golden ratio.
const LATER_SEED_MIX: u64 = 0x9E37_79B9_7F4A_7C15;

/// The two generators of a setting: the first kinds' and the later kinds'.
fn rngs_for(faults: &Faults) -> (StdRng, StdRng) {
    match faults.seed {
        Some(seed) => (
            StdRng::seed_from_u64(seed),
            StdRng::seed_from_u64(seed ^ LATER_SEED_MIX),
        ),
        None => (StdRng::from_os_rng(), StdRng::from_os_rng()),
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
        assert!(first
            .iter()
            .any(|p| p.before == Some(BeforeCharge::FailBefore)));
        assert!(first.iter().any(|p| p.before.is_none()));
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
            assert_eq!(plan.before, None);
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
        assert_eq!(plan.delay_fault, Some(FaultKind::StalledCharge));
        assert_eq!(plan.delay, Duration::from_millis(305));
        let mut slow = FaultState::new(Faults {
            slow_charges: 1.0,
            slow_ms: 100,
            stalled_ms: 300,
            ..Faults::none()
        });
        let plan = slow.plan();
        assert_eq!(plan.delay_fault, Some(FaultKind::SlowCharge));
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
    fn later_probabilities_are_validated_by_name() {
        let faults = |field: &str, p: f64| match field {
            "intermediary_before" => Faults {
                intermediary_before: p,
                ..Faults::none()
            },
            "intermediary_after" => Faults {
                intermediary_after: p,
                ..Faults::none()
            },
            "idempotency_error_on_replay" => Faults {
                idempotency_error_on_replay: p,
                ..Faults::none()
            },
            other => unreachable!("no such field in this test: {other}"),
        };
        for field in [
            "intermediary_before",
            "intermediary_after",
            "idempotency_error_on_replay",
        ] {
            assert_eq!(faults(field, 1.0).validate(), Ok(()));
            for bad in [1.01, -1.0, f64::NAN] {
                assert!(
                    matches!(
                        faults(field, bad).validate(),
                        Err(InvalidFaults::Probability { name, .. }) if name == field
                    ),
                    "{field} = {bad} should be refused"
                );
            }
        }
    }

    /// The plans the earlier kinds gave for seed 7 before the later kinds were added, recorded
    /// then: (conflict_in_flight, fail_before_charge, delay ms, after-charge, pending).
    const SEED_7_BEFORE_THE_LATER_KINDS: [(bool, bool, u64, AfterCharge, bool); 12] = [
        (true, false, 27, AfterCharge::Drop, true),
        (false, true, 63, AfterCharge::Drop, false),
        (false, false, 23, AfterCharge::Respond, false),
        (false, false, 56, AfterCharge::Respond, false),
        (false, false, 46, AfterCharge::Drop, true),
        (false, true, 16, AfterCharge::Respond, false),
        (false, false, 3, AfterCharge::Respond, false),
        (false, false, 40, AfterCharge::Respond, true),
        (false, false, 42, AfterCharge::Drop, true),
        (true, true, 99, AfterCharge::Respond, true),
        (false, false, 0, AfterCharge::Respond, false),
        (true, false, 92, AfterCharge::Fail, true),
    ];

    #[test]
    fn the_later_kinds_leave_the_earlier_kinds_seeded_sequence_unchanged() {
        let mut state = FaultState::new(Faults {
            jitter_ms: 100,
            conflict_in_flight: 0.2,
            fail_before_charge: 0.3,
            drop_after_charge: 0.3,
            fail_after_charge: 0.3,
            pending_charges: 0.5,
            // Drawn on every request, but from the later generator.
            idempotency_error_on_replay: 0.5,
            seed: Some(7),
            ..Faults::none()
        });
        for (i, (conflict, fail_before, delay_ms, after_charge, pending)) in
            SEED_7_BEFORE_THE_LATER_KINDS.into_iter().enumerate()
        {
            let plan = state.plan();
            let before = if conflict {
                Some(BeforeCharge::ConflictInFlight)
            } else if fail_before {
                Some(BeforeCharge::FailBefore)
            } else {
                None
            };
            assert_eq!(
                (plan.before, plan.delay, plan.after_charge, plan.pending),
                (
                    before,
                    Duration::from_millis(delay_ms),
                    after_charge,
                    pending
                ),
                "request {i}"
            );
        }
    }

    #[test]
    fn intermediary_answers_draw_every_status_and_both_bodies() {
        let mut state = FaultState::new(Faults {
            intermediary_before: 1.0,
            seed: Some(11),
            ..Faults::none()
        });
        let mut statuses = std::collections::BTreeSet::new();
        let mut bodies = Vec::new();
        for _ in 0..200 {
            match state.plan().before {
                Some(BeforeCharge::Intermediary(answer)) => {
                    assert!(INTERMEDIARY_STATUSES.contains(&answer.status));
                    statuses.insert(answer.status);
                    if !bodies.contains(&answer.body) {
                        bodies.push(answer.body);
                    }
                }
                other => panic!("expected an intermediary, got {other:?}"),
            }
        }
        assert_eq!(statuses.len(), INTERMEDIARY_STATUSES.len());
        assert_eq!(bodies.len(), 2, "both an HTML page and an empty body");
    }

    #[test]
    fn the_intermediary_before_comes_first_and_after_the_charge_comes_last() {
        let mut everything = FaultState::new(Faults {
            intermediary_before: 1.0,
            conflict_in_flight: 1.0,
            fail_before_charge: 1.0,
            intermediary_after: 1.0,
            fail_after_charge: 1.0,
            drop_after_charge: 1.0,
            ..Faults::none()
        });
        let plan = everything.plan();
        assert!(matches!(plan.before, Some(BeforeCharge::Intermediary(_))));
        assert_eq!(plan.after_charge, AfterCharge::Drop);

        let mut fail_and_intermediary = FaultState::new(Faults {
            fail_after_charge: 1.0,
            intermediary_after: 1.0,
            ..Faults::none()
        });
        assert_eq!(fail_and_intermediary.plan().after_charge, AfterCharge::Fail);

        let mut intermediary_only = FaultState::new(Faults {
            intermediary_after: 1.0,
            ..Faults::none()
        });
        let plan = intermediary_only.plan();
        assert_eq!(plan.before, None);
        assert!(matches!(plan.after_charge, AfterCharge::Intermediary(_)));
    }

    #[test]
    fn a_scripted_action_replaces_the_draws_without_shifting_the_sequence() {
        let faults = Faults {
            jitter_ms: 100,
            fail_before_charge: 0.5,
            intermediary_after: 0.5,
            seed: Some(3),
            ..Faults::none()
        };
        let mut reference = FaultState::new(faults.clone());
        let expected: Vec<Plan> = (0..4).map(|_| reference.plan()).collect();

        let mut state = FaultState::new(faults);
        state
            .script(
                "cus_a",
                vec![Scripted::FailBefore, Scripted::Hold { ms: 7 }],
            )
            .unwrap();
        // Another customer's request draws as usual, and leaves the script alone.
        assert_eq!(state.plan_for("cus_b"), expected[0]);
        assert_eq!(state.scripted_left("cus_a"), 2);
        assert_eq!(
            state.plan_for("cus_a"),
            Plan::scripted(Scripted::FailBefore)
        );
        let hold = state.plan_for("cus_a");
        assert_eq!(
            (hold.before, hold.delay, hold.delay_fault, hold.after_charge),
            (
                None,
                Duration::from_millis(7),
                Some(FaultKind::ScriptedHold),
                AfterCharge::Respond
            )
        );
        assert_eq!(state.scripted_left("cus_a"), 0);
        // The scripted requests drew too: the next request gets the fourth plan.
        assert_eq!(state.plan_for("cus_a"), expected[3]);
        // A scripted hold of 0 ms is still counted as a hold.
        assert_eq!(
            Plan::scripted(Scripted::Hold { ms: 0 }).delay_fault,
            Some(FaultKind::ScriptedHold)
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
        let later: Faults = serde_json::from_str(
            r#"{"intermediary_before": 0.25, "intermediary_after": 0.5,
                "idempotency_error_on_replay": 1}"#,
        )
        .unwrap();
        assert_eq!(
            later,
            Faults {
                intermediary_before: 0.25,
                intermediary_after: 0.5,
                idempotency_error_on_replay: 1.0,
                ..Faults::none()
            }
        );
    }
}
