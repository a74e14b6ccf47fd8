//! Running the checker and printing what it found: the state counts, the time, and each
//! counterexample as a path of actions.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use stateright::{Checker, HasDiscoveries, Model, Path};

use crate::model::{Action, ProtocolModel, Step};
use crate::properties::{Example, Name};
use crate::state::{At, State, Who};

/// How far a check goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Until {
    /// Every reachable state.
    Exhausted,
    /// The first counterexample to this property (breadth-first: one of the shortest).
    Broken(Name),
    /// The first state that shows this example.
    Reached(Example),
}

/// What a check found.
pub struct Checked {
    /// The model checked.
    pub model: ProtocolModel,
    /// Distinct states reached.
    pub unique_states: usize,
    /// States generated, repeats included.
    pub states: usize,
    /// The deepest path explored, in actions.
    pub max_depth: usize,
    /// How long the check took.
    pub elapsed: Duration,
    discoveries: BTreeMap<&'static str, Path<State, Action>>,
}

/// Checks `model` breadth-first on `threads` threads, up to `until`.
pub fn check(model: ProtocolModel, until: Until, threads: usize) -> Checked {
    let started = Instant::now();
    let builder = model.checker().threads(threads.max(1));
    let builder = match until {
        Until::Exhausted => builder,
        Until::Broken(name) => {
            builder.finish_when(HasDiscoveries::AnyOf(BTreeSet::from([name.as_str()])))
        }
        Until::Reached(example) => {
            builder.finish_when(HasDiscoveries::AnyOf(BTreeSet::from([example.as_str()])))
        }
    };
    let checker = builder.spawn_bfs().join();
    Checked {
        model,
        unique_states: checker.unique_state_count(),
        states: checker.state_count(),
        max_depth: checker.max_depth(),
        elapsed: started.elapsed(),
        discoveries: checker.discoveries().into_iter().collect(),
    }
}

impl Checked {
    /// The counterexample found to `name`, if any.
    pub fn counterexample(&self, name: Name) -> Option<&Path<State, Action>> {
        self.discoveries.get(name.as_str())
    }

    /// A path to the example, if the check reached it.
    pub fn example(&self, example: Example) -> Option<&Path<State, Action>> {
        self.discoveries.get(example.as_str())
    }

    /// The properties broken, in [`Name::ALL`]'s order.
    pub fn broken(&self) -> Vec<Name> {
        Name::ALL
            .into_iter()
            .filter(|n| self.discoveries.contains_key(n.as_str()))
            .collect()
    }

    /// The examples not reached, in [`Example::ALL`]'s order.
    pub fn unreached(&self) -> Vec<Example> {
        Example::ALL
            .into_iter()
            .filter(|e| !self.discoveries.contains_key(e.as_str()))
            .collect()
    }

    /// One line: what was checked, the state counts, the depth and the time.
    pub fn summary(&self) -> String {
        let variant = match self.model.protections.left_out() {
            None => "the protocol".to_owned(),
            Some(p) => format!("without {p:?}"),
        };
        format!(
            "{variant}: {} distinct states ({} generated), depth {}, {:.2?}",
            self.unique_states, self.states, self.max_depth, self.elapsed
        )
    }

    /// The counterexample to `name` as a path of actions, one per line, each with the tick
    /// it was taken at; `None` if there is none.
    pub fn trace(&self, name: Name) -> Option<String> {
        let path = self.counterexample(name)?;
        let mut out = format!("counterexample to \"{}\":\n", name.as_str());
        let mut now = 0;
        for (state, action) in path.clone().into_vec() {
            let Some(action) = action else {
                continue;
            };
            if action == Action::Tick {
                now += 1;
                continue;
            }
            let _ = writeln!(
                out,
                "  t={now:>2}  {}",
                describe(&self.model, &state, action)
            );
        }
        Some(out)
    }
}

fn who(who: Who) -> String {
    match who {
        Who::Client(i) => format!("client {i}"),
        Who::Completer => "completer".to_owned(),
    }
}

/// An action in words, from the state it was taken in.
pub fn describe(model: &ProtocolModel, s: &State, action: Action) -> String {
    match action {
        Action::Tick => "time passes".to_owned(),
        Action::FaultsStop => "the faults stop".to_owned(),
        Action::Step(actor, step) => {
            format!("{}: {}", who(actor), step_words(model, s, actor, step))
        }
        Action::Crash(actor) => format!("{} crashes", who(actor)),
        Action::RenewalFails(actor) => format!("{}: its lease renewal fails", who(actor)),
        Action::Process {
            request,
            result,
            answer_lost,
        } => {
            let r = s.gateway.requests[request];
            let lost = if answer_lost {
                "; the answer is lost"
            } else {
                ""
            };
            format!(
                "gateway works on {}'s request {} (sent {} ago): {result:?}{lost}",
                who(r.from),
                key_name(r.key),
                r.sent_ago
            )
        }
        Action::Drop(request) => {
            let r = s.gateway.requests[request];
            format!(
                "{}'s request {} is lost on the way",
                who(r.from),
                key_name(r.key)
            )
        }
        Action::Page {
            request,
            client_error,
        } => {
            let r = s.gateway.requests[request];
            let status = if client_error { "4xx" } else { "5xx" };
            format!(
                "an intermediary answers {}'s request {} with a {status} page of its own",
                who(r.from),
                key_name(r.key)
            )
        }
        Action::Forget(key) => format!("gateway forgets key {}", key_name(key)),
        Action::Reap => "the reaper deletes the key's row".to_owned(),
    }
}

fn key_name(key: crate::state::GatewayKey) -> String {
    format!("r{}:charge:{}", key.request, key.generation)
}

fn step_words(model: &ProtocolModel, s: &State, actor: Who, step: Step) -> String {
    let mut after = s.clone();
    model.step(&mut after, actor, step);
    let run_after = after.holders[actor.index()].run.as_ref();
    let row = after.key.as_ref();
    let token = run_after.map(|r| r.token).unwrap_or_default();
    let ended = run_after.is_none();
    match step {
        Step::Claim | Step::ClaimAbandoned => match (s.key.as_ref(), run_after) {
            (_, Some(r)) if after.next_request != s.next_request => {
                format!(
                    "claims a new key (request r{}, token {})",
                    r.request, r.token
                )
            }
            (_, Some(r)) => format!("takes the key over (token {})", r.token),
            (Some(row), None) if row.finished.is_some() => "gets the stored answer (replay)".into(),
            _ => "gets 409 key-in-flight".into(),
        },
        Step::ClaimAnswered if ended => "the claim's answer arrives; no ride: stops".into(),
        Step::ClaimAnswered => {
            let r = run_after.expect("a run");
            format!(
                "the claim's answer arrives (lease clock {} old); generation {}{}",
                r.lease_age,
                r.target.generation,
                if r.target.past_window {
                    ", past the window"
                } else {
                    ""
                }
            )
        }
        Step::Reconcile => match run_after.map(|r| r.at) {
            Some(crate::state::At::Listed { found, doubt }) => format!(
                "reconciles ({doubt:?}): the list finds {}",
                found.map(key_name).unwrap_or_else(|| "no charge".into())
            ),
            _ => "reconciles: a call may still be running: 503, releases".into(),
        },
        Step::RecordAttempt if ended => "record_attempt: lease lost, stops".into(),
        Step::RecordAttempt | Step::CreateCharge
            if run_after.is_some_and(|r| r.at == At::Charging) =>
        {
            "record_attempt: the generation is past the window, no call; reconciles".into()
        }
        Step::RecordAttempt if model.run(s, actor).at != At::Charging => {
            "stood still a heartbeat since its record: record_attempt anew".into()
        }
        Step::RecordAttempt => "record_attempt".into(),
        Step::CreateCharge if ended => "create charge: lease lost, stops".into(),
        Step::CreateCharge => {
            let before = model.run(s, actor);
            let recorded = before.at == At::Charging && model.needs_record(s, before);
            let r = after.gateway.requests.last().expect("a request left");
            format!(
                "{}create charge: request {} leaves (token {token})",
                if recorded {
                    "record_attempt, then "
                } else {
                    ""
                },
                key_name(r.key)
            )
        }
        Step::TimeOut => "times out waiting for the gateway: releases the lease (503)".into(),
        Step::Conclude => {
            let before = model.run(s, actor).at;
            let what = match (run_after, row) {
                (Some(r), _) => format!("continues at generation {}", r.target.generation),
                (None, Some(row))
                    if row.finished.is_some()
                        && s.key.as_ref().is_some_and(|k| k.finished.is_none()) =>
                {
                    format!("stores {:?}", row.finished.expect("finished").0)
                }
                (None, _) if after.key == s.key => {
                    "stops: its fenced write found the lease lost".into()
                }
                _ => "releases the lease (503), the recovery point kept".into(),
            };
            format!("after {}: {what}", at_words(before))
        }
    }
}

fn at_words(at: crate::state::At) -> String {
    match at {
        crate::state::At::Answered { answer, .. } => format!("answer {answer:?}"),
        crate::state::At::Listed { found, .. } => format!(
            "the list ({})",
            found.map(key_name).unwrap_or_else(|| "no charge".into())
        ),
        other => format!("{other:?}"),
    }
}
