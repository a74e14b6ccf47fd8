//! The model's state: the key row (with its ride), the gateway, the holders, and the ghost
//! record the properties read.
//!
//! Time is relative: the state holds no clock, only how long ago each thing happened (`…_ago`)
//! or how long until it ends (`…_for`, `…_left`), each counted only up to the threshold it is
//! compared with (a lease 20 ticks over behaves as one 1 tick over). So the state space is
//! finite without a horizon, and the checker covers a key's whole life: the window, the
//! gateway's memory and the retention included.

use crate::settings::Tick;

/// How many requests (incarnations of the key: a key that expired at read is booked anew under
/// a new `request_uuid`) the model follows.
pub const REQUESTS: usize = 2;

/// Who acts on the key: two request holders (a client's requests, each in a process that may
/// crash) and the completer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Who {
    /// A request holder: `0` or `1`.
    Client(u8),
    /// The completer of `rocket-rides worker`.
    Completer,
}

impl Who {
    /// Every actor, in the order of [`State::holders`].
    pub const ALL: [Who; 3] = [Who::Client(0), Who::Client(1), Who::Completer];

    /// The index in [`State::holders`].
    pub fn index(self) -> usize {
        match self {
            Who::Client(i) => usize::from(i),
            Who::Completer => 2,
        }
    }
}

/// The whole world at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct State {
    /// How many more faults may strike.
    pub faults_left: u8,
    /// How long ago the faults stopped for good, if they did: from then on every actor that can
    /// move does before time passes.
    pub calm_for: Option<Tick>,
    /// The key's row in `idempotency_keys`, with its ride; `None` before the first claim and
    /// after the row is deleted.
    pub key: Option<KeyRow>,
    /// The request (`request_uuid`) the next inserted row gets.
    pub next_request: u8,
    /// The payment gateway.
    pub gateway: Gateway,
    /// The actors' memories, by [`Who::index`].
    pub holders: [Holder; 3],
    /// What happened, for the properties.
    pub ghost: Ghost,
}

/// The key's row and its ride, in substance.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyRow {
    /// Which request this row is (its `request_uuid`).
    pub request: u8,
    /// `lease_token`: the fencing token.
    pub lease_token: u8,
    /// `locked_until`, as the time left; `None` once released or over.
    pub locked_for: Option<Tick>,
    /// `created_at`, as an age.
    pub created_ago: Tick,
    /// `last_run_at` (the last claim or phase), as an age.
    pub last_run_ago: Tick,
    /// `completer_attempts > 0`.
    pub worked_by_completer: bool,
    /// `next_attempt_at`, as the time left (the completer's backoff).
    pub backoff_left: Tick,
    /// The ride's charge columns.
    pub ride: Ride,
    /// The stored answer, with `finished_at` as an age; `None` while the key is at
    /// `ride_created`.
    pub finished: Option<(Outcome, Tick)>,
}

impl KeyRow {
    /// The key's recovery point, by its library name.
    pub fn recovery_point(&self) -> &'static str {
        if self.finished.is_some() {
            "finished"
        } else {
            "ride_created"
        }
    }

    /// Whether the lease is held (`locked_until > now`).
    pub fn held(&self) -> bool {
        self.locked_for.is_some()
    }
}

/// The ride's charge columns (`rides.charge_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ride {
    /// `charge_generation`.
    pub generation: u8,
    /// `charge_generation_at` (when the current generation began), as an age.
    pub generation_ago: Tick,
    /// `charge_attempted_at` (the last call's record), as an age.
    pub attempted_ago: Tick,
    /// `charge_doubt`, with `charge_refusal` kept beside it.
    pub doubt: Option<Doubt>,
}

/// Why the gateway key cannot simply be asked again (`Doubt` in `booking/reconcile.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Doubt {
    /// The generation's first use is older than the key window.
    PastWindow,
    /// The gateway replayed a 5xx it stored under the key.
    StoredServerError,
    /// The gateway answered `idempotency_error`.
    IdempotencyError,
    /// The gateway refused a resumed call.
    RefusedAfterUnknown,
}

impl Doubt {
    /// Whether the list waits for the calls under the key to be over.
    pub fn waits_for_calls(self) -> bool {
        match self {
            Doubt::StoredServerError => false,
            Doubt::PastWindow | Doubt::IdempotencyError | Doubt::RefusedAfterUnknown => true,
        }
    }

    /// Whether a list that finds no charge starts the next generation (else: a stored 502).
    pub fn charges_again(self) -> bool {
        match self {
            Doubt::PastWindow | Doubt::StoredServerError => true,
            Doubt::IdempotencyError | Doubt::RefusedAfterUnknown => false,
        }
    }
}

/// A final answer, stored with the phase that reaches `finished`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    /// 201: the charge recorded on the ride; `adopted` when a reconciling list found it.
    Paid {
        /// The charge's gateway key.
        charge: GatewayKey,
        /// Found by a list rather than answered to the create call.
        adopted: bool,
    },
    /// 502 `payment-refused`.
    Refused,
}

/// The key a charge is asked for under: `rocket-rides:{request_uuid}:charge:{generation}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GatewayKey {
    /// The request (`request_uuid`).
    pub request: u8,
    /// The generation.
    pub generation: u8,
}

/// The payment gateway: what it remembers under each key, its charges, and the requests on
/// their way to it or being worked on.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Gateway {
    /// Keys it remembers, with the first use and the stored result.
    pub memory: Vec<Remembered>,
    /// Every charge it made (it never forgets a charge; a list finds it by its metadata).
    pub charges: Vec<Charge>,
    /// Requests sent and not yet answered or lost.
    pub requests: Vec<Request>,
}

/// A key the gateway remembers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Remembered {
    /// The key.
    pub key: GatewayKey,
    /// Its first use, as an age.
    pub first_used_ago: Tick,
    /// `true`: a charge; `false`: a 500 it will replay.
    pub charged: bool,
}

/// A charge the gateway made, with its metadata (the request). [`Gateway::charges`] is in the
/// order they were made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Charge {
    /// The key it was made under; its `request` is the charge's metadata.
    pub key: GatewayKey,
    /// `created` is later than the ride's last record plus the processing bound and the clock
    /// skew: a reconciling list's range (`find_own_charge`) misses it, until a later record
    /// moves the range past it.
    pub beyond_the_list: bool,
}

/// A create-charge request on its way to the gateway or being worked on there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Request {
    /// Who sent it.
    pub from: Who,
    /// The sender's fencing token when it sent it: with the key, names the call.
    pub token: u8,
    /// The gateway key.
    pub key: GatewayKey,
    /// How long ago it left.
    pub sent_ago: Tick,
}

/// One actor's memory: lost entirely when it crashes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Holder {
    /// How many more requests a client sends (the completer's are unbounded: its backoff and
    /// the grace pace it).
    pub attempts_left: u8,
    /// The attempt under way, if any.
    pub run: Option<Run>,
}

/// An attempt that acquired the key's lease (or whose claim is on its way back).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Run {
    /// The request it works on.
    pub request: u8,
    /// Its fencing token.
    pub token: u8,
    /// How long ago the claim was sent (and, in the model, executed).
    pub claimed_ago: Tick,
    /// How long ago the holder's lease clock started (`Lease::confirmed_at`): set when the
    /// claim's answer arrives, reset by every phase and renewal.
    pub lease_age: Tick,
    /// What the charge step knows about its ride (`ChargeTarget`).
    pub target: Target,
    /// Where the booking is.
    pub at: At,
}

/// What the charge step knows about its ride (`ChargeTarget` in `booking/charge.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Target {
    /// The current generation.
    pub generation: u8,
    /// The generation was past the window when the ride was loaded.
    pub past_window: bool,
    /// A doubt kept on the ride, or a stored 5xx found by this attempt.
    pub doubt: Option<Doubt>,
    /// `attempted_at` was written by this holder and no call was made since.
    pub fresh: bool,
    /// This attempt already reconciled.
    pub reconciled: bool,
}

impl Target {
    /// The doubt to clear before the key is asked again (`ChargeTarget::doubt`).
    pub fn doubt(&self) -> Option<Doubt> {
        self.doubt.or(self.past_window.then_some(Doubt::PastWindow))
    }
}

/// Where an attempt is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum At {
    /// The claim executed; its answer has not reached the holder yet. `new_key`: it inserted
    /// the key with the ride (`Store::begin`), so the holder knows its ride without a read.
    ClaimAnswer {
        /// The claim inserted the key.
        new_key: bool,
    },
    /// At `ride_created`, at the top of the charge loop.
    Charging,
    /// The call's record is written; the call has not left (only when the scope lets a holder
    /// stand still between the two).
    Recorded {
        /// The call is a resumed one (not the first of its generation).
        resumed: bool,
    },
    /// Waiting for the gateway's answer to its call.
    Calling {
        /// How long ago the request left.
        sent_ago: Tick,
        /// The call was a resumed one (not the first of its generation).
        resumed: bool,
    },
    /// The answer (or the timeout) is here.
    Answered {
        /// What came back.
        answer: Answer,
        /// The call was a resumed one.
        resumed: bool,
    },
    /// The reconciling list came back: the charge it found for the request, if any.
    Listed {
        /// The oldest charge naming the request in the list's range.
        found: Option<GatewayKey>,
        /// The doubt being cleared.
        doubt: Doubt,
    },
}

/// What a create-charge call brought back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Answer {
    /// A charge (made now or replayed).
    Charged(GatewayKey),
    /// A 4xx with the gateway's error object; `idempotency_error` or another refusal.
    Refused {
        /// `idempotency_error`.
        idempotency_error: bool,
    },
    /// A 5xx with the gateway's error body.
    ServerError {
        /// `Idempotent-Replayed: true`.
        replayed: bool,
    },
    /// An intermediary's page without the gateway's error object.
    Page {
        /// A 4xx page (else a 5xx).
        client_error: bool,
    },
    /// No answer before the timeout (or the connection cut).
    NoAnswer,
}

/// What happened, kept for the properties; never read by the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Ghost {
    /// The first answer stored for each request.
    pub stored: [Option<Outcome>; REQUESTS],
    /// A stored or delivered answer differed from the first one stored.
    pub answer_changed: bool,
    /// A write landed under a token that was no longer the row's.
    pub stale_write: bool,
    /// A fenced write found the lease taken over and wrote nothing.
    pub fenced_out: bool,
    /// A row was deleted before it finished.
    pub deleted_unfinished: bool,
    /// The completer stored a final answer.
    pub completer_finished: bool,
    /// A charge was made for a call whose caller had stopped waiting.
    pub late_charge: bool,
}
