//! The model: its scope, its actions, and the [`stateright::Model`] that ties the holders'
//! steps ([`crate::steps`]) and the gateway ([`crate::gateway`]) together, and hands the checker
//! the properties and examples ([`crate::Name`], [`crate::Example`]).

use stateright::{Model, Property};

use crate::properties::{Example, Name};
use crate::protections::{Protection, Protections};
use crate::settings::{Settings, Tick, GATEWAY_KEY_MEMORY, GATEWAY_PROCESSING};
use crate::state::{At, Gateway, GatewayKey, Ghost, Holder, State, Who};

/// How much of the world the checker explores. Time itself is unbounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Scope {
    /// How many faults may strike in one run (crashes, lost requests and answers, an
    /// intermediary's pages, the gateway's 500s, refusals and `idempotency_error`s, failed
    /// renewals).
    pub faults: u8,
    /// How many requests each client sends (a retry is a request).
    pub client_attempts: u8,
    /// The highest generation of the gateway key explored. Two in the biggest check: a double
    /// charge across the window is a first and a second generation's. A third, reached when a
    /// holder that stood still past the window reconciles at its record, grows the biggest check
    /// from 8,885,205 states to 38,319,618, past CI's two minutes.
    pub generations: u8,
    /// Whether a holder may stand still between the phase that records its call
    /// (`record_attempt`) and the call's departure. Off, the record, the lease check and the
    /// send are one step. On, a holder that stood still a heartbeat records its call anew
    /// ([`Protection::SendWithinAHeartbeatOfItsRecord`]); without that, the model finds a
    /// double charge.
    pub pause_between_record_and_send: bool,
    /// Whether a holder that took a key over may stand still between reading its ride
    /// (`ChargeTarget::load`, which decides whether the generation is past the window) and its
    /// next step. Off, it moves on at once. On, the window is decided again by the call's
    /// record ([`Protection::WindowDecidedAtTheRecord`]); without that, the model finds a
    /// double charge.
    pub pause_after_reading_the_ride: bool,
    /// Whether the two clients are counted as one when they merely swapped places (a state and
    /// its mirror behave alike). Halves the states; a trace's "client 0" and "client 1" may
    /// then swap names between two steps, so the negative variants, whose traces are read,
    /// keep it off.
    pub symmetry: bool,
    /// Whether the ghost record keeps what only the [`crate::Example`]s read (a fenced-out
    /// holder, a late charge, a completer's finish): each splits the states in two.
    pub examples: bool,
}

impl Default for Scope {
    /// The biggest check.
    fn default() -> Self {
        Self {
            faults: 1,
            client_attempts: 1,
            generations: 2,
            pause_between_record_and_send: false,
            pause_after_reading_the_ride: false,
            symmetry: true,
            examples: false,
        }
    }
}

/// The protocol of `POST /rides` over the library's key row, as a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProtocolModel {
    /// The settings, in ticks.
    pub settings: Settings,
    /// Which protections the protocol has.
    pub protections: Protections,
    /// How much of the world is explored.
    pub scope: Scope,
}

impl ProtocolModel {
    /// The protocol with `protections`, on the settings they imply, in `scope`.
    pub fn new(protections: Protections, scope: Scope) -> Self {
        Self {
            settings: protections.settings(),
            protections,
            scope,
        }
    }

    /// Within how many ticks of the last fault every key must be finished: a dead holder's
    /// lease runs out, the completer's grace passes, a call still at the gateway is waited for
    /// (the processing bound), and the completer's attempt after it finishes (one timeout).
    pub fn liveness_bound(&self) -> Tick {
        let s = &self.settings;
        s.lease_ttl + s.completer_grace + s.gateway_processing_bound + s.gateway_timeout
    }

    /// A holder's lease left by its own clock (`Store::lease_left`), in ticks; negative once
    /// it believes the lease over.
    pub(crate) fn lease_left(&self, lease_age: Tick) -> i16 {
        i16::from(self.settings.lease_ttl) - i16::from(lease_age)
    }
}

/// What can happen next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Time passes by one tick.
    Tick,
    /// The faults stop for good.
    FaultsStop,
    /// An actor takes its next step.
    Step(Who, Step),
    /// An actor's process dies: its memory is lost, its lease runs out on its own.
    Crash(Who),
    /// The renewal an actor needs before its gateway call fails (the database did not answer):
    /// the attempt stops, its lease runs out on its own.
    RenewalFails(Who),
    /// The gateway works on the request at this index of [`Gateway::requests`].
    Process {
        /// The request's index.
        request: usize,
        /// What the gateway does with it.
        result: Processing,
        /// The answer is lost on its way back.
        answer_lost: bool,
    },
    /// The request at this index is lost before the gateway sees it.
    Drop(usize),
    /// An intermediary answers the request at this index with a page of its own (no gateway
    /// error object), while the request itself goes on.
    Page {
        /// The request's index.
        request: usize,
        /// A 4xx page (else a 5xx).
        client_error: bool,
    },
    /// The gateway forgets a key older than its memory.
    Forget(GatewayKey),
    /// The reaper deletes the key's row.
    Reap,
}

/// An actor's step, named after the library's and Rocket Rides' functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// A client sends `POST /rides`: `Store::begin` claims the key (inserted with its ride when
    /// new, taken over when its lease is free, replayed when finished, refused when held).
    Claim,
    /// The completer's `claim_abandoned`.
    ClaimAbandoned,
    /// The claim's answer reaches the holder, which loads its ride (`ChargeTarget::load`).
    ClaimAnswered,
    /// `reconcile`: `wait_for_calls`, then `find_own_charge` under the lease.
    Reconcile,
    /// `record_attempt` on its own (only when the scope lets a holder pause before the send).
    RecordAttempt,
    /// `record_attempt` when needed, then `call_gateway` under the lease: the request leaves.
    CreateCharge,
    /// The caller's `--gateway-timeout` runs out.
    TimeOut,
    /// What an answer or a list leads to: the final phase, a kept doubt, the next generation,
    /// or a release.
    Conclude,
}

/// What the gateway does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Processing {
    /// What its key says: a charge for a key it does not know, the stored result otherwise.
    AsKeyed,
    /// Fails with a 500 it stores under the key (a key it does not know).
    FailsWith500,
    /// Refuses with its own error object, storing nothing (a key it does not know).
    Refuses,
    /// Answers `idempotency_error` (a key it knows: the parameters changed).
    IdempotencyError,
}

impl Processing {
    fn faults(self) -> u8 {
        match self {
            Processing::AsKeyed => 0,
            Processing::FailsWith500 | Processing::Refuses | Processing::IdempotencyError => 1,
        }
    }
}

impl Model for ProtocolModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let client = Holder {
            attempts_left: self.scope.client_attempts,
            run: None,
        };
        vec![State {
            faults_left: self.scope.faults,
            calm_for: None,
            key: None,
            next_request: 0,
            gateway: Gateway::default(),
            holders: [
                client.clone(),
                client,
                Holder {
                    attempts_left: 0,
                    run: None,
                },
            ],
            ghost: Ghost::default(),
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let mut urgent = false;
        let mut at_once = false;
        for who in Who::ALL {
            if let Some(step) = self.step_of(s, who) {
                // A client's new request is its own choice; everything else moves before time
                // does once the faults have stopped.
                urgent |= step != Step::Claim;
                at_once |= self.moves_at_once(s, who);
                actions.push(Action::Step(who, step));
            }
        }
        for (request, _) in s.gateway.requests.iter().enumerate() {
            urgent = true;
            for result in self.gateway_results(s, request) {
                for answer_lost in [false, true] {
                    if result.faults() + u8::from(answer_lost) <= s.faults_left {
                        actions.push(Action::Process {
                            request,
                            result,
                            answer_lost,
                        });
                    }
                }
            }
        }
        for remembered in &s.gateway.memory {
            if remembered.first_used_ago >= GATEWAY_KEY_MEMORY {
                actions.push(Action::Forget(remembered.key));
            }
        }
        if self.reapable(s) {
            actions.push(Action::Reap);
        }
        if s.faults_left > 0 {
            self.fault_actions(s, actions);
        }
        if s.calm_for.is_none() && std::env::var("NOCALM").is_err() {
            actions.push(Action::FaultsStop);
        }
        if self.time_may_pass(s) && !at_once && !(s.calm_for.is_some() && urgent) {
            actions.push(Action::Tick);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Tick => self.tick(&mut s),
            Action::FaultsStop => {
                s.calm_for = Some(0);
                s.faults_left = 0;
            }
            Action::Step(who, step) => self.step(&mut s, who, step),
            Action::Crash(who) | Action::RenewalFails(who) => {
                s.faults_left -= 1;
                s.holders[who.index()].run = None;
            }
            Action::Process {
                request,
                result,
                answer_lost,
            } => {
                s.faults_left -= result.faults() + u8::from(answer_lost);
                self.process(&mut s, request, result, answer_lost);
            }
            Action::Drop(request) => {
                s.faults_left -= 1;
                s.gateway.requests.remove(request);
            }
            Action::Page {
                request,
                client_error,
            } => {
                s.faults_left -= 1;
                self.page(&mut s, request, client_error);
            }
            Action::Forget(key) => s.gateway.memory.retain(|m| m.key != key),
            Action::Reap => {
                if s.key.as_ref().is_some_and(|row| row.finished.is_none()) {
                    s.ghost.deleted_unfinished = true;
                }
                s.key = None;
            }
        }
        self.renumber_tokens(&mut s);
        if self.scope.symmetry && s.holders[1] < s.holders[0] {
            s.holders.swap(0, 1);
            for r in &mut s.gateway.requests {
                r.from = match r.from {
                    Who::Client(i) => Who::Client(1 - i),
                    Who::Completer => Who::Completer,
                };
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        properties_and_examples()
    }

    fn within_boundary(&self, s: &State) -> bool {
        s.key
            .as_ref()
            .is_none_or(|row| row.ride.generation <= self.scope.generations)
    }
}

impl ProtocolModel {
    /// One tick passes: every age grows and every time left shrinks, each only up to the
    /// threshold it is compared with (past it, every value behaves alike, now and later).
    fn tick(&self, s: &mut State) {
        let st = &self.settings;
        let age = |t: &mut Tick, cap: Tick| *t = (*t + 1).min(cap);
        if let Some(row) = s.key.as_mut() {
            row.locked_for = row
                .locked_for
                .and_then(|left| left.checked_sub(1))
                .filter(|l| *l > 0);
            row.backoff_left = row.backoff_left.saturating_sub(1);
            if row.worked_by_completer {
                row.last_run_ago = st.completer_grace;
            } else {
                age(&mut row.last_run_ago, st.completer_grace);
            }
            // Compared as `retention < ago`, and only by a reaper that deletes unfinished keys
            // (the real one needs the key finished, later than created).
            if self.protections.has(Protection::ReaperSparesUnfinishedKeys) {
                row.created_ago = st.key_retention + 1;
            } else {
                age(&mut row.created_ago, st.key_retention + 1);
            }
            if let Some((_, ago)) = row.finished.as_mut() {
                age(ago, st.key_retention + 1);
            }
            age(&mut row.ride.generation_ago, st.gateway_key_window);
            // Compared with the processing bound (the guard) and, at a charge, with the bound
            // plus the skew (the list's range).
            age(
                &mut row.ride.attempted_ago,
                st.gateway_processing_bound + st.reconcile_clock_skew + 1,
            );
        }
        for m in &mut s.gateway.memory {
            age(&mut m.first_used_ago, GATEWAY_KEY_MEMORY);
        }
        for r in &mut s.gateway.requests {
            r.sent_ago += 1;
        }
        if let Some(calm) = s.calm_for.as_mut() {
            age(calm, self.liveness_bound());
        }
        // Compared as `ttl - age < heartbeat`.
        let short = st.lease_ttl - st.lease_heartbeat + 1;
        for holder in &mut s.holders {
            if let Some(run) = holder.run.as_mut() {
                age(&mut run.lease_age, short);
                age(&mut run.claimed_ago, short);
                if let At::Calling { sent_ago, .. } = &mut run.at {
                    age(sent_ago, st.gateway_timeout);
                }
            }
        }
    }

    fn renumber_tokens(&self, s: &mut State) {
        let mut tokens: Vec<u8> = s.key.iter().map(|row| row.lease_token).collect();
        tokens.extend(
            s.holders
                .iter()
                .filter_map(|h| h.run.as_ref().map(|r| r.token)),
        );
        tokens.extend(s.gateway.requests.iter().map(|r| r.token));
        tokens.sort_unstable();
        tokens.dedup();
        let rank = |t: u8| tokens.binary_search(&t).map_or(t, |i| i as u8 + 1);
        if let Some(row) = s.key.as_mut() {
            row.lease_token = rank(row.lease_token);
        }
        for holder in &mut s.holders {
            if let Some(run) = holder.run.as_mut() {
                run.token = rank(run.token);
            }
        }
        for request in &mut s.gateway.requests {
            request.token = rank(request.token);
        }
    }

    /// Whether `who` takes its next step before time passes: a holder that just read the ride
    /// it took over, unless the scope lets it stand still there.
    fn moves_at_once(&self, s: &State, who: Who) -> bool {
        !self.scope.pause_after_reading_the_ride
            && s.holders[who.index()].run.as_ref().is_some_and(|run| {
                run.at == At::Charging && !run.target.fresh && !run.target.reconciled
            })
    }

    /// Time may pass unless a request must be answered first: the gateway is done with every
    /// request before [`GATEWAY_PROCESSING`] ticks.
    fn time_may_pass(&self, s: &State) -> bool {
        s.gateway
            .requests
            .iter()
            .all(|r| r.sent_ago + 1 < GATEWAY_PROCESSING)
    }

    /// The faults that may strike now.
    fn fault_actions(&self, s: &State, actions: &mut Vec<Action>) {
        for who in Who::ALL {
            if s.holders[who.index()].run.is_none() {
                continue;
            }
            actions.push(Action::Crash(who));
            if self.needs_renewal(s, who) {
                actions.push(Action::RenewalFails(who));
            }
        }
        for (request, r) in s.gateway.requests.iter().enumerate() {
            actions.push(Action::Drop(request));
            if self.waiting_for(s, r).is_some() {
                for client_error in [true, false] {
                    actions.push(Action::Page {
                        request,
                        client_error,
                    });
                }
            }
        }
    }

    /// Whether the reaper deletes the key's row now: finished longer ago than the retention
    /// (`reap_finished`: `created_at < cutoff AND finished_at < cutoff`); without its
    /// protection, any row created before the cutoff.
    fn reapable(&self, s: &State) -> bool {
        let Some(row) = &s.key else {
            return false;
        };
        let past = |ago: Tick| ago > self.settings.key_retention;
        let finished_past = row.finished.is_some_and(|(_, ago)| past(ago));
        if self.protections.has(Protection::ReaperSparesUnfinishedKeys) {
            past(row.created_ago) && finished_past
        } else {
            past(row.created_ago)
        }
    }

    /// Whether `who`'s next step would need a renewal first (and so can meet a failed one).
    fn needs_renewal(&self, s: &State, who: Who) -> bool {
        let Some(run) = &s.holders[who.index()].run else {
            return false;
        };
        let short = self.lease_left(run.lease_age) < i16::from(self.settings.lease_heartbeat);
        match self.step_of(s, who) {
            Some(Step::Reconcile) => short && self.calls_over(s, run).unwrap_or(false),
            Some(Step::CreateCharge) => short && matches!(run.at, At::Recorded { .. }),
            _ => false,
        }
    }
}

macro_rules! always {
    ($name:expr) => {
        Property::always($name.as_str(), |m: &ProtocolModel, s: &State| {
            $name.holds(m.liveness_bound(), s)
        })
    };
}

macro_rules! sometimes {
    ($example:expr) => {
        Property::sometimes($example.as_str(), |_: &ProtocolModel, s: &State| {
            $example.reached(s)
        })
    };
}

/// Every property and example, as the checker takes them. Built here rather than in
/// `properties.rs`, because a [`Property`] is typed by the model: so the properties and examples
/// stay below the model, and only this list knows both.
fn properties_and_examples() -> Vec<Property<ProtocolModel>> {
    vec![
        always!(Name::OneChargePerRequest),
        always!(Name::No502ForAChargedRequest),
        always!(Name::NoWriteUnderAStaleToken),
        always!(Name::AStoredAnswerNeverChanges),
        always!(Name::NoChargeWithoutItsRide),
        always!(Name::EveryKeyFinishes),
        sometimes!(Example::AListAdoptsTheCharge),
        sometimes!(Example::ANewGenerationCharges),
        sometimes!(Example::ARefusalIsStored),
        sometimes!(Example::AStaleHolderIsFencedOut),
        sometimes!(Example::TheCompleterFinishesAKey),
        sometimes!(Example::AChargeLandsAfterItsCallerGaveUp),
        sometimes!(Example::AnExpiredKeyIsBookedAnew),
        sometimes!(Example::AFinishedKeyIsReaped),
    ]
}
