//! The holders' steps: the claim, the charge loop of `booking/charge.rs`, reconciliation
//! (`booking/reconcile.rs`) and the outcomes (`booking/outcomes.rs`), each a step that one
//! actor takes atomically. A database statement is atomic; between two steps anything else
//! may happen, and the actor may crash.

use crate::model::{ProtocolModel, Step};
use crate::protections::Protection;
use crate::settings::Tick;
use crate::state::{
    Answer, At, Doubt, GatewayKey, KeyRow, Outcome, Request, Ride, Run, State, Target, Who,
    REQUESTS,
};

impl ProtocolModel {
    /// The step `who` takes next, if it can take one now.
    pub(crate) fn step_of(&self, s: &State, who: Who) -> Option<Step> {
        let holder = &s.holders[who.index()];
        let Some(run) = &holder.run else {
            return match who {
                Who::Client(_) => {
                    (holder.attempts_left > 0 && self.claim_fits(s)).then_some(Step::Claim)
                }
                Who::Completer => self.abandoned(s).then_some(Step::ClaimAbandoned),
            };
        };
        Some(match run.at {
            At::ClaimAnswer { .. } => Step::ClaimAnswered,
            At::Charging if run.target.doubt().is_some() => Step::Reconcile,
            At::Charging
                if self.scope.pause_between_record_and_send && self.needs_record(s, run) =>
            {
                Step::RecordAttempt
            }
            // Stood still since its record for a heartbeat or more: recorded anew.
            At::Recorded { .. }
                if self
                    .protections
                    .has(Protection::SendWithinAHeartbeatOfItsRecord)
                    && run.lease_age >= self.settings.lease_heartbeat =>
            {
                Step::RecordAttempt
            }
            At::Charging | At::Recorded { .. } => Step::CreateCharge,
            At::Calling { sent_ago, .. } => {
                if sent_ago < self.settings.gateway_timeout {
                    return None;
                }
                Step::TimeOut
            }
            At::Answered { .. } | At::Listed { .. } => Step::Conclude,
        })
    }

    /// Takes `who`'s step.
    pub(crate) fn step(&self, s: &mut State, who: Who, step: Step) {
        match step {
            Step::Claim => self.claim(s, who),
            Step::ClaimAbandoned => self.claim_abandoned(s),
            Step::ClaimAnswered => self.claim_answered(s, who),
            Step::Reconcile => self.reconcile(s, who),
            Step::RecordAttempt => {
                let run = self.run(s, who);
                let resumed = match run.at {
                    At::Recorded { resumed } => resumed,
                    _ => !run.target.fresh,
                };
                if self.record_attempt(s, who) == Some(true) {
                    self.run_mut(s, who).at = At::Recorded { resumed };
                }
            }
            Step::CreateCharge => self.create_charge(s, who),
            // No answer within the timeout: transient, the lease released.
            Step::TimeOut => self.release(s, who, 1),
            Step::Conclude => self.conclude(s, who),
        }
    }

    pub(crate) fn run<'s>(&self, s: &'s State, who: Who) -> &'s Run {
        s.holders[who.index()]
            .run
            .as_ref()
            .expect("a step is taken only by an actor with a run")
    }

    fn run_mut<'s>(&self, s: &'s mut State, who: Who) -> &'s mut Run {
        s.holders[who.index()]
            .run
            .as_mut()
            .expect("a step is taken only by an actor with a run")
    }

    fn end(&self, s: &mut State, who: Who) {
        s.holders[who.index()].run = None;
    }

    /// Whether a claim could insert a row if it had to: the model follows [`REQUESTS`] rows.
    fn claim_fits(&self, s: &State) -> bool {
        let inserts = match &s.key {
            None => true,
            Some(row) => row.finished.is_some_and(|(_, ago)| self.expired(ago)),
        };
        !inserts || usize::from(s.next_request) < REQUESTS
    }

    /// `finished_at < now - retention`: the key expires at read (and may be reaped).
    fn expired(&self, finished_ago: Tick) -> bool {
        finished_ago > self.settings.key_retention
    }

    /// The completer's candidate: unfinished, lease free or over, past the grace (until a
    /// completer worked it), past its backoff.
    pub(crate) fn abandoned(&self, s: &State) -> bool {
        let Some(row) = &s.key else {
            return false;
        };
        row.finished.is_none()
            && !row.held()
            && (row.worked_by_completer || row.last_run_ago >= self.settings.completer_grace)
            && row.backoff_left == 0
    }

    /// A client's `POST /rides`: `Store::begin(…, ride_created)`.
    fn claim(&self, s: &mut State, who: Who) {
        s.holders[who.index()].attempts_left -= 1;
        let Some(row) = s.key.clone() else {
            self.begin_new(s, who);
            return self.answer_with_the_claim(s, who);
        };
        if let Some((outcome, finished_ago)) = row.finished {
            if self.expired(finished_ago) {
                // Expiry at read: the old row deleted, the key inserted anew.
                s.key = None;
                self.begin_new(s, who);
                return self.answer_with_the_claim(s, who);
            }
            // A replay: the stored answer, nothing written.
            if s.ghost.stored[usize::from(row.request)] != Some(outcome) {
                s.ghost.answer_changed = true;
            }
            return;
        }
        if row.held() {
            return; // 409 key-in-flight: nothing written.
        }
        self.take_over(s, who);
        self.answer_with_the_claim(s, who);
    }

    /// With the lease clock started at the send, when the claim's answer arrives changes
    /// nothing: the holder's own clock counts from the send either way, and nobody else writes
    /// the row while its lease runs. The answer then comes with the claim, one step fewer.
    fn answer_with_the_claim(&self, s: &mut State, who: Who) {
        if self.protections.has(Protection::LeaseClockFromTheSend)
            && s.holders[who.index()].run.is_some()
        {
            self.claim_answered(s, who);
        }
    }

    /// A new key: the row at `ride_created` with its ride, in one transaction; generation 1
    /// begins, and the phase stands for its first call's record.
    fn begin_new(&self, s: &mut State, who: Who) {
        let request = s.next_request;
        s.next_request += 1;
        // A new key's bound counts from its claim.
        if s.calm_for.is_some() {
            s.calm_for = Some(0);
        }
        s.key = Some(KeyRow {
            request,
            lease_token: 1,
            locked_for: Some(self.settings.lease_ttl),
            // Read only by a reaper that deletes unfinished keys (see `tick`).
            created_ago: if self.protections.has(Protection::ReaperSparesUnfinishedKeys) {
                self.settings.key_retention + 1
            } else {
                0
            },
            last_run_ago: 0,
            worked_by_completer: false,
            backoff_left: 0,
            ride: Ride {
                generation: 1,
                generation_ago: 0,
                attempted_ago: 0,
                doubt: None,
            },
            finished: None,
        });
        s.holders[who.index()].run = Some(Run {
            request,
            token: 1,
            claimed_ago: 0,
            lease_age: 0,
            target: Target {
                generation: 1,
                past_window: false,
                doubt: None,
                fresh: true,
                reconciled: false,
            },
            at: At::ClaimAnswer { new_key: true },
        });
    }

    /// The takeover of a key whose lease is free or over: the next token.
    fn take_over(&self, s: &mut State, who: Who) {
        let row = s.key.as_mut().expect("a takeover finds the row");
        row.lease_token += 1;
        row.locked_for = Some(self.settings.lease_ttl);
        if who == Who::Completer {
            row.worked_by_completer = true;
        }
        row.last_run_ago = self.last_run_now(row);
        let (request, token) = (row.request, row.lease_token);
        s.holders[who.index()].run = Some(Run {
            request,
            token,
            claimed_ago: 0,
            lease_age: 0,
            // Loaded when the answer arrives.
            target: Target {
                generation: 0,
                past_window: false,
                doubt: None,
                fresh: false,
                reconciled: false,
            },
            at: At::ClaimAnswer { new_key: false },
        });
    }

    /// The completer's `claim_abandoned`: a takeover under `FOR UPDATE SKIP LOCKED`.
    fn claim_abandoned(&self, s: &mut State) {
        self.take_over(s, Who::Completer);
        self.answer_with_the_claim(s, Who::Completer);
    }

    /// The claim's answer arrives: the lease clock starts, and a taken-over key's ride is read.
    fn claim_answered(&self, s: &mut State, who: Who) {
        let window = self.settings.gateway_key_window;
        let from_the_send = self.protections.has(Protection::LeaseClockFromTheSend);
        let loaded = s.key.as_ref().map(|row| (row.request, row.ride));
        let run = self.run_mut(s, who);
        run.lease_age = if from_the_send { run.claimed_ago } else { 0 };
        let At::ClaimAnswer { new_key } = run.at else {
            return;
        };
        if !new_key {
            let Some(ride) = loaded
                .filter(|(request, _)| *request == run.request)
                .map(|(_, ride)| ride)
            else {
                // No ride for the key: an internal error; the lease runs out.
                return self.end(s, who);
            };
            run.target = Target {
                generation: ride.generation,
                past_window: ride.generation_ago >= window,
                doubt: ride.doubt,
                fresh: false,
                reconciled: false,
            };
        }
        run.at = At::Charging;
    }

    /// Whether a call must be recorded before it leaves: a resumed call always; the first of a
    /// generation when its holder stood still for a heartbeat since the phase that began it
    /// (without [`Protection::SendWithinAHeartbeatOfItsRecord`]: only when its lease is
    /// running out by its own clock).
    ///
    /// A tick is a heartbeat here: a call that leaves within a heartbeat of its record leaves in
    /// the record's tick. The service's list and its wait count one heartbeat past the record
    /// for the real time that "the same tick" stands for.
    pub(crate) fn needs_record(&self, s: &State, run: &Run) -> bool {
        let _ = s;
        let heartbeat = self.settings.lease_heartbeat;
        !run.target.fresh
            || if self
                .protections
                .has(Protection::SendWithinAHeartbeatOfItsRecord)
            {
                run.lease_age >= heartbeat
            } else {
                self.lease_left(run.lease_age) < i16::from(heartbeat)
            }
    }

    /// A fenced write by `who`: `WHERE id = $1 AND lease_token = $2 AND finished_at IS NULL`.
    /// On zero rows (`LeaseLost`) the attempt stops and writes nothing more.
    fn fence(&self, s: &mut State, who: Who) -> bool {
        let run = self.run(s, who);
        let (request, token) = (run.request, run.token);
        let passes = match &s.key {
            Some(row) if row.request == request && row.finished.is_none() => {
                if row.lease_token == token {
                    true
                } else if self.protections.has(Protection::Fence) {
                    false
                } else {
                    s.ghost.stale_write = true;
                    true
                }
            }
            _ => false,
        };
        if !passes {
            s.ghost.fenced_out |= self.scope.examples;
            self.end(s, who);
        }
        passes
    }

    /// An atomic phase at the current recovery point: the fenced update (which extends the
    /// lease) and `write`, in one transaction.
    fn phase(&self, s: &mut State, who: Who, write: impl FnOnce(&mut KeyRow)) -> bool {
        if !self.fence(s, who) {
            return false;
        }
        let row = s.key.as_mut().expect("a fenced write found the row");
        row.locked_for = Some(self.settings.lease_ttl);
        row.last_run_ago = self.last_run_now(row);
        write(row);
        self.run_mut(s, who).lease_age = 0;
        true
    }

    /// `last_run_at = now`, as the age the state keeps for it: the grace no longer counts once
    /// a completer worked the key.
    fn last_run_now(&self, row: &KeyRow) -> Tick {
        if row.worked_by_completer {
            self.settings.completer_grace
        } else {
            0
        }
    }

    /// `charge_attempted_at = now`: every charge of the request is within the reconciling
    /// list's range again.
    fn recorded(s: &mut State, request: u8) {
        let row = s.key.as_mut().expect("a record is written on the row");
        row.ride.attempted_ago = 0;
        for charge in &mut s.gateway.charges {
            if charge.key.request == request {
                charge.beyond_the_list = false;
            }
        }
    }

    /// `record_attempt`: the call's time on the ride before it leaves. The same fenced
    /// statement decides whether the generation is past the key window
    /// ([`Protection::WindowDecidedAtTheRecord`]): past it, nothing is recorded and the call
    /// does not leave; the key is reconciled. `None`: the lease was lost; `Some(true)`: the
    /// call may leave.
    pub(crate) fn record_attempt(&self, s: &mut State, who: Who) -> Option<bool> {
        let window = self.settings.gateway_key_window;
        let at_the_record = self.protections.has(Protection::WindowDecidedAtTheRecord);
        let mut past = false;
        if !self.phase(s, who, |row| {
            past = at_the_record && row.ride.generation_ago >= window;
        }) {
            return None;
        }
        if past {
            let run = self.run_mut(s, who);
            run.target.past_window = true;
            run.at = At::Charging;
            return Some(false);
        }
        let request = self.run(s, who).request;
        Self::recorded(s, request);
        self.run_mut(s, who).target.fresh = false;
        Some(true)
    }

    /// `confirm_lease`: a renewal (fenced) when less than a heartbeat is left by the holder's
    /// own clock.
    fn confirm_lease(&self, s: &mut State, who: Who) -> bool {
        let run = self.run(s, who);
        if self.lease_left(run.lease_age) >= i16::from(self.settings.lease_heartbeat) {
            return true;
        }
        if !self.fence(s, who) {
            return false;
        }
        s.key
            .as_mut()
            .expect("a fenced write found the row")
            .locked_for = Some(self.settings.lease_ttl);
        self.run_mut(s, who).lease_age = 0;
        true
    }

    /// The charge loop's call: recorded first when needed, then sent under the lease.
    fn create_charge(&self, s: &mut State, who: Who) {
        let run = self.run(s, who);
        let resumed = match run.at {
            At::Recorded { resumed } => resumed,
            _ => {
                let resumed = !run.target.fresh;
                if self.needs_record(s, run) && self.record_attempt(s, who) != Some(true) {
                    return;
                }
                resumed
            }
        };
        self.run_mut(s, who).target.fresh = false;
        if !self.confirm_lease(s, who) {
            return;
        }
        let run = self.run_mut(s, who);
        run.at = At::Calling {
            sent_ago: 0,
            resumed,
        };
        let request = Request {
            from: who,
            token: run.token,
            key: GatewayKey {
                request: run.request,
                generation: run.target.generation,
            },
            sent_ago: 0,
        };
        s.gateway.requests.push(request);
    }

    /// Whether `wait_for_calls` lets the list through: the last recorded call is at least the
    /// processing bound old (always, without the in-flight guard). `None`: the ride is gone.
    /// The service waits a heartbeat more, as a call leaves up to a heartbeat after its record;
    /// here it leaves in its record's tick, so that term is no tick (see `needs_record`).
    pub(crate) fn calls_over(&self, s: &State, run: &Run) -> Option<bool> {
        let row = s.key.as_ref().filter(|row| row.request == run.request)?;
        let doubt = run.target.doubt()?;
        if !doubt.waits_for_calls() || !self.protections.has(Protection::InFlightGuard) {
            return Some(true);
        }
        Some(row.ride.attempted_ago >= self.settings.gateway_processing_bound)
    }

    /// `reconcile`: wait for the calls under the key, then list the customer's charges in the
    /// range for one naming the request.
    fn reconcile(&self, s: &mut State, who: Who) {
        let run = self.run(s, who);
        let doubt = run.target.doubt().expect("reconciling has a doubt");
        match self.calls_over(s, run) {
            None => return self.end(s, who),
            Some(false) => {
                // 503 payment-unconfirmed; the completer comes back no sooner.
                let row = s.key.as_ref().expect("the ride was read");
                let left = self.settings.gateway_processing_bound - row.ride.attempted_ago;
                return self.release(s, who, left);
            }
            Some(true) => {}
        }
        self.run_mut(s, who).target.reconciled = true;
        if !self.confirm_lease(s, who) {
            return;
        }
        // From the ride's first attempt (before any call) to the last record plus the bound
        // and the skew; the oldest charge naming the request.
        let request = self.run(s, who).request;
        let found = s
            .gateway
            .charges
            .iter()
            .find(|c| c.key.request == request && !c.beyond_the_list)
            .map(|c| c.key);
        self.run_mut(s, who).at = At::Listed { found, doubt };
    }

    /// What an answer or a list leads to.
    fn conclude(&self, s: &mut State, who: Who) {
        match self.run(s, who).at {
            At::Answered { answer, resumed } => self.answered(s, who, answer, resumed),
            At::Listed { found, doubt } => match found {
                Some(charge) => self.finish(
                    s,
                    who,
                    Outcome::Paid {
                        charge,
                        adopted: true,
                    },
                ),
                None if doubt.charges_again() => self.next_generation(s, who),
                None => self.finish(s, who, Outcome::Refused),
            },
            At::ClaimAnswer { .. } | At::Charging | At::Recorded { .. } | At::Calling { .. } => {}
        }
    }

    /// The charge loop's answer to a call (`charge` in `booking/charge.rs`, the classes of
    /// `stripe.rs`).
    fn answered(&self, s: &mut State, who: Who, answer: Answer, resumed: bool) {
        let p = &self.protections;
        let reconciled = self.run(s, who).target.reconciled;
        match answer {
            Answer::Charged(charge) => self.finish(
                s,
                who,
                Outcome::Paid {
                    charge,
                    adopted: false,
                },
            ),
            Answer::ServerError { replayed }
                if replayed || !p.has(Protection::OnlyAReplayed5xxIsStored) =>
            {
                self.stored_server_error(s, who, reconciled)
            }
            Answer::Page {
                client_error: false,
            } if !p.has(Protection::OnlyAReplayed5xxIsStored) => {
                self.stored_server_error(s, who, reconciled)
            }
            Answer::Page { client_error: true }
                if !p.has(Protection::OnlyTheGatewaysWordIsFinal) =>
            {
                self.finish(s, who, Outcome::Refused)
            }
            Answer::Refused {
                idempotency_error: true,
            } => self.keep_doubt(s, who, Doubt::IdempotencyError),
            Answer::Refused {
                idempotency_error: false,
            } if resumed && p.has(Protection::RefusalAfterAnUnknownOutcomeReconciles) => {
                self.keep_doubt(s, who, Doubt::RefusedAfterUnknown)
            }
            Answer::Refused {
                idempotency_error: false,
            } => self.finish(s, who, Outcome::Refused),
            Answer::ServerError { .. } | Answer::Page { .. } | Answer::NoAnswer => {
                self.release(s, who, 1)
            }
        }
    }

    /// A 5xx the gateway stored: reconcile, once per attempt.
    fn stored_server_error(&self, s: &mut State, who: Who, reconciled: bool) {
        if reconciled {
            return self.release(s, who, 1);
        }
        let run = self.run_mut(s, who);
        run.target.doubt = Some(Doubt::StoredServerError);
        run.at = At::Charging;
    }

    /// `keep_doubt`: the doubt and the refusal on the ride, in a phase of its own.
    fn keep_doubt(&self, s: &mut State, who: Who, doubt: Doubt) {
        if !self.phase(s, who, |row| row.ride.doubt = Some(doubt)) {
            return;
        }
        let run = self.run_mut(s, who);
        run.target.doubt = Some(doubt);
        run.at = At::Charging;
    }

    /// `next_generation`: the next generation of the gateway key, recorded before its call.
    fn next_generation(&self, s: &mut State, who: Who) {
        if !self.phase(s, who, |row| {
            row.ride.generation += 1;
            row.ride.generation_ago = 0;
            row.ride.doubt = None;
        }) {
            return;
        }
        let request = self.run(s, who).request;
        Self::recorded(s, request);
        let run = self.run_mut(s, who);
        run.target = Target {
            generation: run.target.generation + 1,
            past_window: false,
            doubt: None,
            fresh: true,
            reconciled: true,
        };
        run.at = At::Charging;
    }

    /// The final phase: `FOR UPDATE` fenced by the token, then `finish` stores the answer and
    /// clears the lease, in one commit.
    fn finish(&self, s: &mut State, who: Who, outcome: Outcome) {
        if !self.fence(s, who) {
            return;
        }
        let row = s.key.as_mut().expect("a fenced write found the row");
        row.finished = Some((outcome, 0));
        row.locked_for = None;
        // What only an unfinished key's claims, completer and charge step read, in one form.
        row.worked_by_completer = false;
        row.last_run_ago = self.settings.completer_grace;
        row.backoff_left = 0;
        row.ride.generation_ago = self.settings.gateway_key_window;
        row.ride.attempted_ago =
            self.settings.gateway_processing_bound + self.settings.reconcile_clock_skew + 1;
        row.ride.doubt = None;
        let first = &mut s.ghost.stored[usize::from(row.request)];
        match first {
            Some(stored) if *stored != outcome => s.ghost.answer_changed = true,
            Some(_) => {}
            None => *first = Some(outcome),
        }
        if who == Who::Completer && self.scope.examples {
            s.ghost.completer_finished = true;
        }
        self.end(s, who);
    }

    /// A transient failure: the lease released (fenced), the recovery point kept; the
    /// completer also sets its backoff (`release_with_backoff`), at least `backoff`.
    fn release(&self, s: &mut State, who: Who, backoff: Tick) {
        if self.fence(s, who) {
            let row = s.key.as_mut().expect("a fenced write found the row");
            row.locked_for = None;
            if who == Who::Completer {
                row.backoff_left = backoff.max(1);
            }
        }
        self.end(s, who);
    }
}
