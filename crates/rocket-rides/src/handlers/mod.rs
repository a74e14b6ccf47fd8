//! The HTTP handlers, above the state and below the router.

#[cfg(feature = "bench")]
pub mod bench;
pub mod ops;
pub mod rides;
