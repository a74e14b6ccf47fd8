//! Rocket Rides' protocol as a model, checked exhaustively with `stateright`.
//!
//! The chaos run samples interleavings of the real processes; this crate explores every
//! interleaving of a model of them, breadth-first, and prints each counterexample as a path of
//! actions. The names are the library's and Rocket Rides' (`docs/protocol.md`,
//! `docs/rocket-rides.md`): the key row with its recovery point, lease (`locked_until`), fencing
//! token, gateway-key generation, the last call's record (`charge_attempted_at`) and kept doubt;
//! the stored answer; two request holders and the completer, each of which may crash (lose its
//! memory) or stand still after any step; the reaper with the retention; and a gateway that
//! charges once per key, replays what it stored (a 500 included), forgets keys after its memory,
//! refuses, answers `idempotency_error`, loses answers after charging, lets an intermediary answer
//! with a page of its own, and goes on with a request after its caller gave up.
//!
//! ```text
//!  client 0 ─┐                         ┌── key row: recovery point, lease, token,
//!  client 1 ─┼─ claim / phases ───────►│   ride: generation, its age, last record,
//!  completer ┘   (fenced by the token) │   doubt; the stored answer   ◄── reaper
//!       │                              └──────────────────────────────
//!       └── create charge / list ────► gateway: memory per key, charges, requests in flight
//! ```
//!
//! Time is in ticks, relative: the state keeps how long ago things happened, each only up to
//! the threshold it is compared with, so the state space is finite and a key's whole life (the
//! key window, the gateway's memory, the retention) is explored without a horizon. The settings
//! keep the relations `rocket-rides` checks at start ([`Settings`], [`Relation`]).
//!
//! A negative variant is the same model with one protection off ([`Protections::without`]);
//! `tests/model.rs` checks the real protocol in the biggest scope ([`Scope::default`]), and in
//! the scopes where a holder stands still between reading its ride and its call, or between its
//! call's record and the send ([`Scope::pause_after_reading_the_ride`],
//! [`Scope::pause_between_record_and_send`]); and each variant until the property its
//! protection guards breaks, the last two in those scopes (the double charges the model found
//! in the protocol before they were fixed). What the model covers and leaves out, and the tests
//! and chaos checks that check each property in the real processes, are in `docs/protocol.md`,
//! "The protocol as a model".
//!
//! ```
//! use protocol_model::{check, Name, Protection, Protections, ProtocolModel, Scope, Until};
//!
//! let scope = Scope { faults: 0, symmetry: false, ..Scope::default() };
//! let model = ProtocolModel::new(Protections::without(Protection::Fence), scope);
//! let checked = check(model, Until::Broken(Name::NoWriteUnderAStaleToken), 1);
//! let trace = checked.trace(Name::NoWriteUnderAStaleToken).expect("a counterexample");
//! assert!(trace.contains("takes the key over"), "{trace}");
//! ```

mod check;
mod gateway;
mod model;
mod properties;
mod protections;
mod settings;
mod state;
mod steps;

pub use check::{check, describe, Checked, Until};
pub use model::{Action, Processing, ProtocolModel, Scope, Step};
pub use properties::{Example, Name};
pub use protections::{Protection, Protections};
pub use settings::{
    Relation, Settings, SettingsError, Tick, GATEWAY_KEY_MEMORY, GATEWAY_PROCESSING, LEASE_MARGIN,
};
pub use state::*;
