//! Scripted charges: the faults of one customer's next charges, chosen in order by a test
//! instead of drawn.
//!
//! A probability tells a story in aggregate; a test of one recovery path wants *this* charge to
//! fail before the gateway writes anything and *the next* to hang with its key in use. A script
//! is a queue of [`Scripted`] actions per customer id:
//!
//! ```text
//!  AppState::script_charges(cus, [FailBefore, Hold { ms }])   (or POST /charges/script)
//!                  │
//!                  ▼
//!  queue of cus: FailBefore, Hold { ms }
//!                  │  each POST /v1/charges for cus that passes validation pops the front
//!                  ▼
//!  plan drawn as usual (the seeded sequence does not shift), then replaced by the action:
//!     FailBefore  → 500 api_error before anything is written, as `fail_before_charge`
//!     Hold { ms } → the charge runs and is held `ms` inside its key's transaction, as
//!                   `stalled_charges`, with no random fault
//!     Intermediary { status, empty, after_charge }
//!                 → an intermediary's own answer (an HTML page, or no body), given before the
//!                   request reaches the gateway, or after the charge was committed, as
//!                   `intermediary_before` / `intermediary_after`
//!     (empty)     → the drawn plan
//! ```
//!
//! Every request of the customer that passes validation pops an action, whatever it then meets:
//! a `Hold` popped by a request that is answered without running (a replay, a 409 for a key in
//! use, an unknown customer) is spent without holding anything, and is not counted.
//!
//! In JSON (`POST /charges/script` on the admin API) an action is an object with a tag:
//! `{"action": "fail_before"}`, `{"action": "hold", "ms": 5000}`, or
//! `{"action": "intermediary", "status": 404, "empty": false, "after_charge": true}` (a status of
//! the intermediary's: 400, 404, 502, 503 or 504); unknown fields are refused.

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::bounds::{INTERMEDIARY_STATUSES, MAX_LATENCY_MS};

/// The most actions that may wait for one customer: a bound on what a runaway test can queue.
pub const MAX_SCRIPTED_ACTIONS: usize = 10_000;

/// The longest customer id a script accepts: the longest `customer` a charge accepts.
const MAX_CUSTOMER_LEN: usize = 255;

/// What the next charge of a customer does, in place of the faults drawn for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "WireAction", into = "WireAction")]
pub enum Scripted {
    /// Answer 500 `api_error` before anything is written, as `fail_before_charge`: nothing is
    /// stored, and a retry with the key runs afresh. JSON: `{"action": "fail_before"}`.
    FailBefore,
    /// Run the charge, holding it `ms` milliseconds inside its key's transaction, as
    /// `stalled_charges`: its key is in use meanwhile (a duplicate gets 409), and the charge
    /// commits after the hold even if its client has gone. JSON: `{"action": "hold", "ms": N}`.
    Hold {
        /// How long the charge is held, at most [`MAX_LATENCY_MS`].
        ms: u64,
    },
    /// Answer as an intermediary in front of the gateway would on its own, with `status` (one
    /// of 400, 404, 502, 503, 504) and an HTML page, or no body when `empty`: before anything is
    /// written, or, with `after_charge`, in place of the answer to a charge that was committed
    /// and stored under its key. JSON:
    /// `{"action": "intermediary", "status": 404, "empty": false, "after_charge": true}`.
    Intermediary {
        /// The intermediary's status.
        status: u16,
        /// No body at all, instead of an HTML page.
        empty: bool,
        /// After the charge was committed, instead of before the request reaches the gateway.
        after_charge: bool,
    },
}

/// Why a script was refused. The message is shown to the admin client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidScript {
    /// The customer id is empty or too long.
    #[error("customer must be 1 to {MAX_CUSTOMER_LEN} bytes long, got {0} bytes")]
    Customer(usize),
    /// A hold above [`MAX_LATENCY_MS`]: it would outlast the key's lease.
    #[error("a hold must be at most {MAX_LATENCY_MS} ms, got {0} ms")]
    HoldTooLong(u64),
    /// An intermediary status that is not one an intermediary answers with.
    #[error("an intermediary answers 400, 404, 502, 503 or 504, not {0}")]
    IntermediaryStatus(u16),
    /// The queue would grow past [`MAX_SCRIPTED_ACTIONS`].
    #[error(
        "at most {MAX_SCRIPTED_ACTIONS} actions may wait for one customer: {queued} wait and {adding} more were given"
    )]
    TooMany {
        /// The actions waiting already.
        queued: usize,
        /// The actions given.
        adding: usize,
    },
}

/// The JSON form of a [`Scripted`] action.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireAction {
    action: ActionName,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    status: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    empty: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    after_charge: Option<bool>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum ActionName {
    FailBefore,
    Hold,
    Intermediary,
}

impl TryFrom<WireAction> for Scripted {
    type Error = &'static str;

    fn try_from(wire: WireAction) -> Result<Self, Self::Error> {
        let intermediary_fields =
            wire.status.is_some() || wire.empty.is_some() || wire.after_charge.is_some();
        match (wire.action, wire.ms) {
            (ActionName::FailBefore | ActionName::Hold, _) if intermediary_fields => {
                Err("status, empty and after_charge belong to intermediary")
            }
            (ActionName::FailBefore, None) => Ok(Self::FailBefore),
            (ActionName::FailBefore, Some(_)) => Err("fail_before takes no ms"),
            (ActionName::Hold, Some(ms)) => Ok(Self::Hold { ms }),
            (ActionName::Hold, None) => Err("hold needs ms, the milliseconds to hold the charge"),
            (ActionName::Intermediary, Some(_)) => Err("intermediary takes no ms"),
            (ActionName::Intermediary, None) => Ok(Self::Intermediary {
                status: wire
                    .status
                    .ok_or("intermediary needs status, the intermediary's HTTP status")?,
                empty: wire.empty.unwrap_or(false),
                after_charge: wire.after_charge.unwrap_or(false),
            }),
        }
    }
}

impl From<Scripted> for WireAction {
    fn from(action: Scripted) -> Self {
        match action {
            Scripted::FailBefore => Self {
                action: ActionName::FailBefore,
                ms: None,
                status: None,
                empty: None,
                after_charge: None,
            },
            Scripted::Hold { ms } => Self {
                action: ActionName::Hold,
                ms: Some(ms),
                status: None,
                empty: None,
                after_charge: None,
            },
            Scripted::Intermediary {
                status,
                empty,
                after_charge,
            } => Self {
                action: ActionName::Intermediary,
                ms: None,
                status: Some(status),
                empty: Some(empty),
                after_charge: Some(after_charge),
            },
        }
    }
}

impl Scripted {
    /// Checks the action's range.
    pub fn validate(&self) -> Result<(), InvalidScript> {
        match *self {
            Self::FailBefore => Ok(()),
            Self::Hold { ms } if ms > MAX_LATENCY_MS => Err(InvalidScript::HoldTooLong(ms)),
            Self::Hold { .. } => Ok(()),
            Self::Intermediary { status, .. } => {
                let known = INTERMEDIARY_STATUSES.iter().any(|s| s.as_u16() == status);
                if known {
                    Ok(())
                } else {
                    Err(InvalidScript::IntermediaryStatus(status))
                }
            }
        }
    }
}

/// The customers' queues of actions. A customer's entry goes when its queue empties.
#[derive(Debug, Default)]
pub(crate) struct Scripts {
    queues: HashMap<String, VecDeque<Scripted>>,
}

impl Scripts {
    /// Appends every action, or none if one is refused; returns how many wait now.
    pub(crate) fn append(
        &mut self,
        customer: &str,
        actions: Vec<Scripted>,
    ) -> Result<usize, InvalidScript> {
        if customer.is_empty() || customer.len() > MAX_CUSTOMER_LEN {
            return Err(InvalidScript::Customer(customer.len()));
        }
        actions.iter().try_for_each(Scripted::validate)?;
        let queued = self.left(customer);
        if queued.saturating_add(actions.len()) > MAX_SCRIPTED_ACTIONS {
            return Err(InvalidScript::TooMany {
                queued,
                adding: actions.len(),
            });
        }
        if actions.is_empty() {
            return Ok(queued);
        }
        let queue = self.queues.entry(customer.to_owned()).or_default();
        queue.extend(actions);
        Ok(queue.len())
    }

    /// Drops every action waiting for the customer; returns how many there were.
    pub(crate) fn clear(&mut self, customer: &str) -> usize {
        self.queues.remove(customer).map_or(0, |queue| queue.len())
    }

    /// Takes the customer's next action, if one waits.
    pub(crate) fn pop(&mut self, customer: &str) -> Option<Scripted> {
        let queue = self.queues.get_mut(customer)?;
        let action = queue.pop_front();
        if queue.is_empty() {
            self.queues.remove(customer);
        }
        action
    }

    /// How many actions wait for the customer.
    pub(crate) fn left(&self, customer: &str) -> usize {
        self.queues.get(customer).map_or(0, VecDeque::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_read_and_write_their_tagged_json_form() {
        let actions: Vec<Scripted> =
            serde_json::from_str(r#"[{"action": "fail_before"}, {"action": "hold", "ms": 300}]"#)
                .unwrap();
        assert_eq!(actions, [Scripted::FailBefore, Scripted::Hold { ms: 300 }]);
        assert_eq!(
            serde_json::to_string(&actions).unwrap(),
            r#"[{"action":"fail_before"},{"action":"hold","ms":300}]"#
        );
        for bad in [
            r#"{"action": "hold"}"#,
            r#"{"action": "fail_before", "ms": 5}"#,
            r#"{"action": "hold", "ms": 5, "extra": 1}"#,
            r#"{"action": "fail_before", "extra": 1}"#,
            r#"{"action": "drop"}"#,
            r#"{"ms": 5}"#,
            r#"{"action": "hold", "ms": -1}"#,
        ] {
            assert!(
                serde_json::from_str::<Scripted>(bad).is_err(),
                "{bad} should be refused"
            );
        }
    }

    #[test]
    fn a_refused_script_queues_nothing() {
        let mut scripts = Scripts::default();
        let refused = scripts.append(
            "cus_a",
            vec![
                Scripted::FailBefore,
                Scripted::Hold {
                    ms: MAX_LATENCY_MS + 1,
                },
            ],
        );
        assert_eq!(refused, Err(InvalidScript::HoldTooLong(MAX_LATENCY_MS + 1)));
        assert_eq!(scripts.left("cus_a"), 0);
        assert_eq!(
            scripts.append("", vec![Scripted::FailBefore]),
            Err(InvalidScript::Customer(0))
        );
        let too_many = vec![Scripted::FailBefore; MAX_SCRIPTED_ACTIONS + 1];
        assert!(matches!(
            scripts.append("cus_a", too_many),
            Err(InvalidScript::TooMany { queued: 0, .. })
        ));
        assert_eq!(scripts.left("cus_a"), 0);
    }

    #[test]
    fn actions_pop_in_order_per_customer() {
        let mut scripts = Scripts::default();
        let hold = Scripted::Hold { ms: MAX_LATENCY_MS };
        assert_eq!(scripts.append("cus_a", vec![Scripted::FailBefore]), Ok(1));
        assert_eq!(scripts.append("cus_a", vec![hold]), Ok(2));
        assert_eq!(scripts.pop("cus_b"), None);
        assert_eq!(scripts.pop("cus_a"), Some(Scripted::FailBefore));
        assert_eq!(scripts.pop("cus_a"), Some(hold));
        assert_eq!(scripts.pop("cus_a"), None);
        assert!(scripts.queues.is_empty(), "an emptied queue is dropped");
    }
}
