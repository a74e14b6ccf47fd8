#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod extract;
pub mod guide;
pub mod layer;
pub mod problem;
mod replay;
mod run;

pub use extract::{RequiredKey, IDEMPOTENCY_KEY, KEY_MISSING_DETAIL, ONE_KEY_DETAIL};
pub use layer::{
    wait_preference, ClaimedKey, Disposition, IdempotencyLayer, KeyTransaction, Retirer,
};
pub use problem::{retry_after_seconds, Problem, PROBLEM_JSON};
pub use replay::{
    acquired_or_respond, replayed_response, stored_response, IDEMPOTENT_REPLAYED,
    KEY_IN_FLIGHT_DETAIL, KEY_REUSED_DETAIL, MAX_IN_FLIGHT_RETRY_AFTER,
};
pub use run::{respond, run, FAILED_DETAIL, RETRY_LATER_DETAIL, TAKEN_OVER_DETAIL};

#[cfg(test)]
mod tests {
    use testdb::doc_values::{bytes, duration};

    /// Every default and bound a user sets against states its value where rustdoc shows it.
    #[test]
    fn every_default_states_its_value_in_its_doc() {
        let layer = include_str!("layer/mod.rs");
        bytes(
            layer,
            "DEFAULT_MAX_BODY",
            crate::layer::DEFAULT_MAX_BODY as u64,
        );
        bytes(
            layer,
            "MAX_STORED_BODY",
            crate::layer::MAX_STORED_BODY as u64,
        );
        let replay = include_str!("replay.rs");
        let retry_after = crate::MAX_IN_FLIGHT_RETRY_AFTER;
        duration(replay, "MAX_IN_FLIGHT_RETRY_AFTER", retry_after);
    }
}
