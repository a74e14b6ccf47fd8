//! The payment gateway: a charge per key, a stored result replayed (a 500 included), keys
//! forgotten after its memory, `idempotency_error`, refusals, answers lost after the charge,
//! an intermediary's pages, and requests worked on after their caller stopped waiting.

use crate::model::{Processing, ProtocolModel};
use crate::state::{Answer, At, Charge, Remembered, Request, State, Who};

impl ProtocolModel {
    /// What the gateway may do with the request at `index`: as its key says, or, while faults
    /// may strike, fail with a stored 500 or refuse (a key it does not know), or answer
    /// `idempotency_error` (a key it knows).
    pub(crate) fn gateway_results(&self, s: &State, index: usize) -> Vec<Processing> {
        let key = s.gateway.requests[index].key;
        let known = s.gateway.memory.iter().any(|m| m.key == key);
        let mut results = vec![Processing::AsKeyed];
        if known {
            results.push(Processing::IdempotencyError);
        } else {
            results.push(Processing::FailsWith500);
            results.push(Processing::Refuses);
        }
        results.retain(|r| *r == Processing::AsKeyed || s.calm_for.is_none());
        results
    }

    /// The caller still waiting for `request`'s answer, if any.
    pub(crate) fn waiting_for(&self, s: &State, request: &Request) -> Option<Who> {
        let run = s.holders[request.from.index()].run.as_ref()?;
        let waiting = run.token == request.token
            && run.request == request.key.request
            && run.target.generation == request.key.generation
            && matches!(run.at, At::Calling { .. });
        waiting.then_some(request.from)
    }

    /// The gateway works on the request at `index` and answers (unless the answer is lost).
    pub(crate) fn process(
        &self,
        s: &mut State,
        index: usize,
        result: Processing,
        answer_lost: bool,
    ) {
        let request = s.gateway.requests.remove(index);
        let key = request.key;
        let beyond = s.key.as_ref().is_some_and(|row| {
            row.request == key.request
                && row.ride.attempted_ago
                    > self.settings.gateway_processing_bound + self.settings.reconcile_clock_skew
        });
        let remembered = s.gateway.memory.iter().find(|m| m.key == key).copied();
        let waiting = self.waiting_for(s, &request);
        let answer = match (remembered, result) {
            (Some(m), _) if result != Processing::IdempotencyError => {
                if m.charged {
                    Answer::Charged(key)
                } else {
                    Answer::ServerError { replayed: true }
                }
            }
            (Some(_), _) => Answer::Refused {
                idempotency_error: true,
            },
            (None, Processing::AsKeyed) => {
                s.gateway.memory.push(Remembered {
                    key,
                    first_used_ago: 0,
                    charged: true,
                });
                s.gateway.charges.push(Charge {
                    key,
                    beyond_the_list: beyond,
                });
                if waiting.is_none() && self.scope.examples {
                    s.ghost.late_charge = true;
                }
                Answer::Charged(key)
            }
            (None, Processing::FailsWith500) => {
                s.gateway.memory.push(Remembered {
                    key,
                    first_used_ago: 0,
                    charged: false,
                });
                Answer::ServerError { replayed: false }
            }
            (None, Processing::Refuses | Processing::IdempotencyError) => Answer::Refused {
                idempotency_error: false,
            },
        };
        s.gateway.memory.sort_unstable_by_key(|m| m.key);
        if answer_lost {
            return;
        }
        if let Some(who) = waiting {
            self.deliver(s, who, answer);
        }
    }

    /// An intermediary answers for the gateway; the request goes on (or not) regardless.
    pub(crate) fn page(&self, s: &mut State, index: usize, client_error: bool) {
        let request = s.gateway.requests[index];
        if let Some(who) = self.waiting_for(s, &request) {
            self.deliver(s, who, Answer::Page { client_error });
        }
    }

    fn deliver(&self, s: &mut State, who: Who, answer: Answer) {
        let run = s.holders[who.index()]
            .run
            .as_mut()
            .expect("a waiting caller has a run");
        if let At::Calling { resumed, .. } = run.at {
            run.at = At::Answered { answer, resumed };
        }
    }
}
