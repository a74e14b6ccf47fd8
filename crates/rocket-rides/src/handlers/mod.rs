//! The HTTP handlers, above the state and below the router.

pub mod ops;
pub mod rides;
