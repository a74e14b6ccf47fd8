//! Crash points inside the phase machine, armable only in builds with the `failpoints` feature.
//!
//! A test arms a point on the service's state; when the request passes it, the request stops
//! right there as if the process had died: no further phase, no lease release, no response body
//! of substance. The lease is left to expire, exactly as after a real crash. Nothing on the
//! request surface can arm a point.

#[cfg(feature = "failpoints")]
use std::collections::HashSet;
#[cfg(feature = "failpoints")]
use std::sync::{Arc, Mutex};

/// After the phase that creates the ride has committed.
pub const AFTER_RIDE_CREATED: &str = "after_ride_created";
/// After the gateway charged the card, before the charge is recorded.
pub const AFTER_GATEWAY_CHARGE: &str = "after_gateway_charge";
/// After the phase that records the charge has committed.
pub const AFTER_CHARGE_CREATED: &str = "after_charge_created";
/// After the final phase has committed, before the response leaves.
pub const AFTER_FINISHED: &str = "after_finished";

/// In the outbox drain, after a receipt was written and before its job is deleted.
pub const AFTER_RECEIPT_EFFECT: &str = "after_receipt_effect";

/// The armed points. Each fires once, then disarms itself.
#[cfg(feature = "failpoints")]
#[derive(Debug, Clone, Default)]
pub struct Failpoints(Arc<Mutex<HashSet<&'static str>>>);

#[cfg(feature = "failpoints")]
impl Failpoints {
    /// Arms `point` for the next request that passes it.
    pub fn arm(&self, point: &'static str) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(point);
    }

    /// Whether `point` is armed; disarms it.
    pub fn fire(&self, point: &'static str) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(point)
    }
}

/// Whether the request or job passing `point` must stop here as if the process died. Always
/// false in builds without the `failpoints` feature.
#[cfg(feature = "failpoints")]
pub(crate) fn hit(state: &crate::app::AppState, point: &'static str) -> bool {
    state.failpoints.fire(point)
}

/// Whether the request or job passing `point` must stop here as if the process died. Always
/// false in builds without the `failpoints` feature.
#[cfg(not(feature = "failpoints"))]
pub(crate) fn hit(_state: &crate::app::AppState, _point: &'static str) -> bool {
    false
}
