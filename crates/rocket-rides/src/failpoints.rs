//! Crash points inside the booking's steps, and sabotage switches for the chaos harness's negative
//! control. Both exist only in builds with the `failpoints` feature (tests, `chaos` (crates/proving-ground));
//! a production build has neither, and nothing on the request surface can reach them.
//!
//! Three ways to make a point fire:
//! - a test **arms** it on the service's state: the next request that passes it stops right there
//!   as if the process had died (no further phase, no lease release), and disarms it;
//! - a test **arms a stand-still** at one of the points where a holder may be paused (a stopped
//!   process, a frozen virtual machine): the next request that passes it stops there until the
//!   test lets it go on (`Failpoints::stand_still_at`, in `failpoints` builds), so that the
//!   test can move the clock or the gateway meanwhile;
//! - a chaos run sets `ROCKET_RIDES_FAILPOINTS=after_ride_created=0.02,…` (with
//!   `ROCKET_RIDES_FAILPOINT_SEED`) for the processes it spawns: a request passing a point exits
//!   the whole process with that probability, with the point's exit code ([`exit_code`]), so the
//!   harness can tell which crash it caused.
//!
//! The points are passed at three seams, the only places outside this module where one is passed
//! (each a function below), so that the booking reads as the pattern with one line per boundary:
//!
//! | seam | where it is called | its points, in the order a request passes them |
//! |---|---|---|
//! | `charge_step_begins` | `Charging::begin` (`booking/charge.rs`), once the charge step has its ride | crash `after_ride_created` (the step that created the ride just committed), stand-still `after_ride_loaded` |
//! | `gateway` | `Charging::run` before a create call leaves; `Charging::settle` when a succeeded charge comes back | crash `after_new_generation` (the new generation's phase just committed), stand-still `after_call_recorded` (the call's record just committed), crash `after_gateway_charge` (the charge shown, not yet recorded) |
//! | `before_acknowledging` | `handlers::rides` once the driver stored the answer; `worker::outbox` once a receipt is written | crash `after_finished` (before the answer leaves), crash `after_receipt_effect` (before the job is deleted) |
//!
//! The sabotage switches below are asked where their bug would sit (`state.failpoints.…()`), not
//! at the seams.
//!
//! `ROCKET_RIDES_SABOTAGE` names bugs the harness must catch, comma-separated:
//! - `fresh-gateway-key`: the service calls the gateway under a new key on every attempt instead
//!   of the key derived from the key row;
//! - `unknown-is-declined`: a charge whose outcome is unknown (no answer in time, a connection
//!   cut before the answer was whole, a 5xx) is taken as a decline, though the gateway may have
//!   charged;
//! - `carry-on-after-lost-lease`: a renewal that finds the lease taken over mid-call is logged and
//!   ignored, and the holder goes on with its call and its next write;
//! - `split-first-phase`: a new key is committed at `ride_created` before its ride is inserted, in
//!   a transaction of its own;
//! - `list-while-in-flight`: a reconciling list is made at once, though the last call under the
//!   current gateway key may still be running at the gateway;
//! - `unknown-answer-is-refusal`: a 4xx answer without the gateway's error object (an
//!   intermediary's page, no body) is taken for the gateway's refusal;
//! - `no-commit-watch`: the process runs without the library's commit watch, so that a commit
//!   whose wait for the synchronous standby was cancelled is taken for a success.

/// After the phase that claims the key and creates the ride has committed.
pub const AFTER_RIDE_CREATED: &str = "after_ride_created";
/// After the phase that starts a new generation of the gateway key committed, before the charge
/// under it (only on a reconciliation that found no charge).
pub const AFTER_NEW_GENERATION: &str = "after_new_generation";
/// After the gateway charged the card, before the charge is recorded.
pub const AFTER_GATEWAY_CHARGE: &str = "after_gateway_charge";
/// After the final phase has committed, before the response leaves.
pub const AFTER_FINISHED: &str = "after_finished";
/// In the outbox drain, after a receipt was written and before its job is deleted.
pub const AFTER_RECEIPT_EFFECT: &str = "after_receipt_effect";

/// Where a booking stands still, if a test armed it (`Failpoints::stand_still_at`): once the
/// charge step has its ride (a new key's as the step that created it handed it on, a taken-over
/// key's read by `ChargeTarget::load`), before it uses it.
pub const AFTER_RIDE_LOADED: &str = "after_ride_loaded";
/// Where a booking stands still, if a test armed it: after a gateway call's record was
/// written (`record_attempt`), before the call leaves.
pub const AFTER_CALL_RECORDED: &str = "after_call_recorded";

/// Every crash point, in the order of a request's life.
pub const ALL: [&str; 5] = [
    AFTER_RIDE_CREATED,
    AFTER_NEW_GENERATION,
    AFTER_GATEWAY_CHARGE,
    AFTER_FINISHED,
    AFTER_RECEIPT_EFFECT,
];

/// The environment variable with crash probabilities per point.
pub const FAILPOINTS_ENV: &str = "ROCKET_RIDES_FAILPOINTS";
/// The environment variable with the seed of the crash draws.
pub const FAILPOINT_SEED_ENV: &str = "ROCKET_RIDES_FAILPOINT_SEED";
/// The environment variable with sabotage switches.
pub const SABOTAGE_ENV: &str = "ROCKET_RIDES_SABOTAGE";
/// The sabotage that derives a fresh gateway key per attempt.
pub const SABOTAGE_FRESH_GATEWAY_KEY: &str = "fresh-gateway-key";
/// The sabotage that takes a charge of unknown outcome for a decline.
pub const SABOTAGE_UNKNOWN_IS_DECLINED: &str = "unknown-is-declined";
/// The sabotage that lets a holder go on after a renewal lost its lease.
pub const SABOTAGE_CARRY_ON_AFTER_LOST_LEASE: &str = "carry-on-after-lost-lease";
/// The sabotage that splits the first phase in two transactions.
pub const SABOTAGE_SPLIT_FIRST_PHASE: &str = "split-first-phase";
/// The sabotage that reconciles without waiting for the calls that may still be running.
pub const SABOTAGE_LIST_WHILE_IN_FLIGHT: &str = "list-while-in-flight";
/// The sabotage that takes an answer without the gateway's error object for a refusal.
pub const SABOTAGE_UNKNOWN_ANSWER_IS_REFUSAL: &str = "unknown-answer-is-refusal";
/// The sabotage that runs the process without the commit watch.
pub const SABOTAGE_NO_COMMIT_WATCH: &str = "no-commit-watch";

/// The exit code of a process that crashed at `point` (81 and up, in the order of [`ALL`]).
pub fn exit_code(point: &str) -> Option<i32> {
    ALL.iter().position(|p| *p == point).map(|i| 81 + i as i32)
}

/// The point whose crash exits with `code`.
pub fn point_of_exit_code(code: i32) -> Option<&'static str> {
    usize::try_from(code - 81)
        .ok()
        .and_then(|i| ALL.get(i).copied())
}

#[cfg(feature = "failpoints")]
pub use armed::{Failpoints, StandingStill};

#[cfg(feature = "failpoints")]
mod armed {
    use std::collections::{HashMap, HashSet};
    use std::sync::{Arc, Mutex};

    use tokio::sync::oneshot;

    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// The armed points, the crash probabilities and the sabotage switches of one process.
    #[derive(Debug, Clone)]
    pub struct Failpoints {
        armed: Arc<Mutex<HashSet<&'static str>>>,
        still: Arc<Mutex<HashMap<&'static str, Still>>>,
        crash: Arc<HashMap<&'static str, f64>>,
        rng: Arc<Mutex<StdRng>>,
        fresh_gateway_key: bool,
        unknown_is_declined: bool,
        carry_on_after_lost_lease: bool,
        split_first_phase: bool,
        list_while_in_flight: bool,
        unknown_answer_is_refusal: bool,
        no_commit_watch: bool,
    }

    impl Default for Failpoints {
        fn default() -> Self {
            Self {
                armed: Default::default(),
                still: Default::default(),
                crash: Default::default(),
                rng: Arc::new(Mutex::new(StdRng::seed_from_u64(0))),
                fresh_gateway_key: false,
                unknown_is_declined: false,
                carry_on_after_lost_lease: false,
                split_first_phase: false,
                list_while_in_flight: false,
                unknown_answer_is_refusal: false,
                no_commit_watch: false,
            }
        }
    }

    impl Failpoints {
        /// Reads [`FAILPOINTS_ENV`], [`FAILPOINT_SEED_ENV`] and [`SABOTAGE_ENV`]; none set means
        /// no crashes and no sabotage.
        pub fn from_env() -> Result<Self, String> {
            let mut points = Self::default();
            if let Ok(spec) = std::env::var(FAILPOINTS_ENV) {
                points.crash = Arc::new(parse_crashes(&spec)?);
            }
            if let Ok(seed) = std::env::var(FAILPOINT_SEED_ENV) {
                let seed = seed
                    .parse()
                    .map_err(|_| format!("{FAILPOINT_SEED_ENV}={seed:?} is not an integer"))?;
                points.rng = Arc::new(Mutex::new(StdRng::seed_from_u64(seed)));
            }
            if let Ok(sabotage) = std::env::var(SABOTAGE_ENV) {
                for name in sabotage.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                    match name {
                        SABOTAGE_FRESH_GATEWAY_KEY => points.fresh_gateway_key = true,
                        SABOTAGE_UNKNOWN_IS_DECLINED => points.unknown_is_declined = true,
                        SABOTAGE_CARRY_ON_AFTER_LOST_LEASE => {
                            points.carry_on_after_lost_lease = true
                        }
                        SABOTAGE_SPLIT_FIRST_PHASE => points.split_first_phase = true,
                        SABOTAGE_LIST_WHILE_IN_FLIGHT => points.list_while_in_flight = true,
                        SABOTAGE_UNKNOWN_ANSWER_IS_REFUSAL => {
                            points.unknown_answer_is_refusal = true
                        }
                        SABOTAGE_NO_COMMIT_WATCH => points.no_commit_watch = true,
                        other => return Err(format!("{SABOTAGE_ENV}: unknown sabotage {other:?}")),
                    }
                }
            }
            Ok(points)
        }

        /// Arms `point` for the next request that passes it.
        pub fn arm(&self, point: &'static str) {
            self.armed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(point);
        }

        /// Arms a stand-still at `point` ([`AFTER_RIDE_LOADED`], [`AFTER_CALL_RECORDED`]) for
        /// the next request that passes it; the handle tells when it got there and lets it go
        /// on.
        pub fn stand_still_at(&self, point: &'static str) -> StandingStill {
            let (reached_tx, reached) = oneshot::channel();
            let (go_on, go_on_rx) = oneshot::channel();
            let still = Still {
                reached: reached_tx,
                go_on: go_on_rx,
            };
            self.still
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(point, still);
            StandingStill { reached, go_on }
        }

        /// Stands still at `point` if a test armed it, until the test lets it go on (or drops
        /// its handle); disarms it.
        pub async fn stand_still(&self, point: &'static str) {
            let still = self
                .still
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(point);
            if let Some(still) = still {
                let _ = still.reached.send(());
                let _ = still.go_on.await;
            }
        }

        /// Whether `point` is armed; disarms it.
        pub fn fire(&self, point: &'static str) -> bool {
            self.armed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(point)
        }

        /// Exits the process at `point` with its configured probability.
        pub fn maybe_crash(&self, point: &'static str) {
            let Some(&probability) = self.crash.get(point) else {
                return;
            };
            let draw: f64 = self.rng.lock().unwrap_or_else(|e| e.into_inner()).random();
            if draw < probability {
                // A crash, not a shutdown: no destructor, no lease release, no response.
                std::process::exit(exit_code(point).unwrap_or(80));
            }
        }

        /// Whether the gateway key must be fresh per attempt (the negative control's bug).
        pub fn fresh_gateway_key(&self) -> bool {
            self.fresh_gateway_key
        }

        /// Whether a charge of unknown outcome is taken for a decline (a negative control's bug).
        pub fn unknown_is_declined(&self) -> bool {
            self.unknown_is_declined
        }

        /// Whether a holder goes on after a renewal lost its lease (a negative control's bug).
        pub fn carry_on_after_lost_lease(&self) -> bool {
            self.carry_on_after_lost_lease
        }

        /// Whether the first phase is split in two transactions (a negative control's bug).
        pub fn split_first_phase(&self) -> bool {
            self.split_first_phase
        }

        /// Whether a reconciling list is made while a call may still be running (a negative
        /// control's bug).
        pub fn list_while_in_flight(&self) -> bool {
            self.list_while_in_flight
        }

        /// Whether a 4xx without the gateway's error object is taken for a refusal (a negative
        /// control's bug).
        pub fn unknown_answer_is_refusal(&self) -> bool {
            self.unknown_answer_is_refusal
        }

        /// Whether the process runs without the commit watch.
        pub fn no_commit_watch(&self) -> bool {
            self.no_commit_watch
        }
    }

    /// The service's side of an armed stand-still.
    #[derive(Debug)]
    struct Still {
        reached: oneshot::Sender<()>,
        go_on: oneshot::Receiver<()>,
    }

    /// A test's handle on a stand-still it armed.
    #[derive(Debug)]
    pub struct StandingStill {
        reached: oneshot::Receiver<()>,
        go_on: oneshot::Sender<()>,
    }

    impl StandingStill {
        /// Resolves once a request stands still at the point. Panics if the point was armed
        /// again, or the process's failpoints dropped, before any request got there.
        pub async fn reached(&mut self) {
            (&mut self.reached)
                .await
                .expect("a request stands still at the armed point");
        }

        /// Lets the request go on.
        pub fn go_on(self) {
            let _ = self.go_on.send(());
        }
    }

    fn parse_crashes(spec: &str) -> Result<HashMap<&'static str, f64>, String> {
        let mut crashes = HashMap::new();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, probability) = item
                .split_once('=')
                .ok_or_else(|| format!("{FAILPOINTS_ENV}: {item:?} is not point=probability"))?;
            let point = ALL
                .iter()
                .find(|p| **p == name.trim())
                .ok_or_else(|| format!("{FAILPOINTS_ENV}: unknown point {name:?}"))?;
            let probability: f64 = probability
                .trim()
                .parse()
                .ok()
                .filter(|p| (0.0..=1.0).contains(p))
                .ok_or_else(|| {
                    format!("{FAILPOINTS_ENV}: probability of {name} must be in [0, 1]")
                })?;
            crashes.insert(*point, probability);
        }
        Ok(crashes)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn crash_specs_parse_and_bad_ones_are_refused() {
            let ok = parse_crashes("after_ride_created=0.5, after_finished=1").unwrap();
            assert_eq!(ok[AFTER_RIDE_CREATED], 0.5);
            assert_eq!(ok[AFTER_FINISHED], 1.0);
            assert!(parse_crashes("nowhere=0.1").is_err());
            assert!(parse_crashes("after_finished=2").is_err());
            assert!(parse_crashes("after_finished").is_err());
        }

        #[test]
        fn exit_codes_name_their_point() {
            for point in ALL {
                assert_eq!(point_of_exit_code(exit_code(point).unwrap()), Some(point));
            }
            assert_eq!(point_of_exit_code(0), None);
            assert_eq!(point_of_exit_code(137), None);
        }
    }
}

#[cfg(not(feature = "failpoints"))]
pub use disarmed::Failpoints;

/// A build without the `failpoints` feature: nothing can be armed, nothing is read from the
/// environment, and every question answers "no".
#[cfg(not(feature = "failpoints"))]
mod disarmed {
    /// No crash points and no sabotage.
    #[derive(Debug, Clone, Default)]
    pub struct Failpoints;

    impl Failpoints {
        /// Nothing to read: the environment cannot switch anything on in this build.
        pub fn from_env() -> Result<Self, String> {
            Ok(Self)
        }

        /// Never crashes.
        pub fn maybe_crash(&self, _point: &'static str) {}

        /// Never armed.
        pub fn fire(&self, _point: &'static str) -> bool {
            false
        }

        /// Never armed: goes on at once.
        pub async fn stand_still(&self, _point: &'static str) {}

        /// Never sabotaged.
        pub fn fresh_gateway_key(&self) -> bool {
            false
        }

        /// Never sabotaged.
        pub fn unknown_is_declined(&self) -> bool {
            false
        }

        /// Never sabotaged.
        pub fn carry_on_after_lost_lease(&self) -> bool {
            false
        }

        /// Never sabotaged.
        pub fn split_first_phase(&self) -> bool {
            false
        }

        /// Never sabotaged.
        pub fn list_while_in_flight(&self) -> bool {
            false
        }

        /// Never sabotaged.
        pub fn unknown_answer_is_refusal(&self) -> bool {
            false
        }

        /// Never sabotaged.
        pub fn no_commit_watch(&self) -> bool {
            false
        }
    }
}

// The seams: the only places the booking, the handler and the worker pass a point. Each is named
// for the boundary it sits on, so that the booking's flow reads as the pattern and one line per
// boundary says "a test may stop here".

/// Seam 1, **the charge step begins** (`Charging::begin` in `booking/charge.rs`, once the step
/// has its ride): a crash at [`AFTER_RIDE_CREATED`] when this holder's previous step just
/// committed the ride (the step that created it handed the ride on: nothing was read or written
/// since its commit), then the stand-still at [`AFTER_RIDE_LOADED`].
pub(crate) async fn charge_step_begins(failpoints: &Failpoints, ride_just_created: bool) {
    if ride_just_created {
        crash(failpoints, AFTER_RIDE_CREATED);
    }
    failpoints.stand_still(AFTER_RIDE_LOADED).await;
}

/// Where a booking crosses the gateway's boundary ([`gateway`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gateway {
    /// Before a create call leaves, with nothing of the seam's to do: the call's record is
    /// still fresh, or was just written and passed already.
    Leaving,
    /// Before a create call leaves, right after the phase that started the key's next
    /// generation committed.
    NewGeneration,
    /// Before a create call leaves, right after its record committed (`record_attempt`); the
    /// booking checks again afterwards whether the record is still fresh.
    Recorded,
    /// The gateway showed a succeeded charge (its answer to the call, a reconciling list, or a
    /// retrieve), before the charge is recorded.
    Charged,
}

/// Seam 2, **the gateway**: before a create call leaves (`Charging::run`, each pass of its
/// record check) and when a succeeded charge comes back (`Charging::settle`). A crash at
/// [`AFTER_NEW_GENERATION`] or [`AFTER_GATEWAY_CHARGE`], a stand-still at
/// [`AFTER_CALL_RECORDED`].
pub(crate) async fn gateway(failpoints: &Failpoints, crossing: Gateway) {
    match crossing {
        Gateway::Leaving => {}
        Gateway::NewGeneration => crash(failpoints, AFTER_NEW_GENERATION),
        Gateway::Recorded => failpoints.stand_still(AFTER_CALL_RECORDED).await,
        Gateway::Charged => crash(failpoints, AFTER_GATEWAY_CHARGE),
    }
}

/// Seam 3, **before acknowledging** an effect: the stored answer, committed, before it leaves
/// ([`AFTER_FINISHED`], `handlers::rides`); a receipt, written in the drain's transaction, before
/// its job is deleted in the same transaction ([`AFTER_RECEIPT_EFFECT`], `worker::outbox`: a
/// crash there rolls the receipt back with the job's deletion). Whether the caller must stop
/// here as if the process died (a test armed the point); a configured crash exits the process
/// instead of returning. Always false in builds without the `failpoints` feature.
pub(crate) fn before_acknowledging(failpoints: &Failpoints, point: &'static str) -> bool {
    failpoints.maybe_crash(point);
    failpoints.fire(point)
}

/// Stops a booking's step here as if the process died, if a test armed `point`: the task
/// panics, and the driver leaves the lease to expire, as a dead process leaves it (the
/// completer releases it with a backoff). A configured crash exits the process instead.
fn crash(failpoints: &Failpoints, point: &'static str) {
    failpoints.maybe_crash(point);
    if failpoints.fire(point) {
        panic!("crashed at failpoint {point}");
    }
}
