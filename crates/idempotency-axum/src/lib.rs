//! The HTTP face of the `idempotency` crate for axum services.
//!
//! - [`IdempotencyLayer`] makes a one-step handler idempotent: it claims the key, calls the
//!   handler once, stores its final answer and replays it; the answer's [`Disposition`] says
//!   whether it is final, or releases the key, or forgets it (see [`layer`] for what it cannot
//!   guarantee, and when to write phases instead). Its handler finds the key it runs under,
//!   and the request's UUID to derive foreign keys from, as a [`ClaimedKey`]. In its
//!   transactional mode ([`IdempotencyLayer::transactional`]) the handler writes through the
//!   key's own transaction, a [`KeyTransaction`], and its writes commit with the stored answer
//!   or not at all (`examples/deposits.rs` shows one).
//! - [`RequiredKey`] extracts and validates `Idempotency-Key` (400 problem+json when missing or
//!   malformed, before the handler writes anything).
//! - [`acquired_or_respond`] turns a refused claim into its answer: the stored response replayed
//!   byte for byte with `Idempotent-Replayed: true`, 422 for a reused key with another payload,
//!   409 with `Retry-After` while another request holds the lease.
//! - [`Problem`] is the RFC 9457 body of every refusal, with a stable `type` per situation
//!   ([`problem::types`]).
//!
//! The statuses follow the IETF draft "The Idempotency-Key HTTP Header Field" (400, 409, 422) and
//! Stripe (`Idempotent-Replayed`).

#![warn(missing_docs)]

mod extract;
pub mod layer;
pub mod problem;
mod replay;
mod run;

pub use extract::{RequiredKey, IDEMPOTENCY_KEY, KEY_MISSING_DETAIL, ONE_KEY_DETAIL};
pub use layer::{ClaimedKey, Disposition, IdempotencyLayer, KeyTransaction};
pub use problem::{retry_after_seconds, Problem, PROBLEM_JSON};
pub use replay::{
    acquired_or_respond, replayed_response, stored_response, IDEMPOTENT_REPLAYED,
    KEY_IN_FLIGHT_DETAIL, KEY_REUSED_DETAIL, MAX_IN_FLIGHT_RETRY_AFTER,
};
pub use run::{respond, run, FAILED_DETAIL, RETRY_LATER_DETAIL, TAKEN_OVER_DETAIL};
