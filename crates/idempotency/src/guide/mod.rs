//! The crate's documentation beyond its first screen: the protocol it implements, and what
//! running it in production asks of you. Nothing to call here.

#[doc = include_str!("protocol.md")]
pub mod protocol {}

#[doc = include_str!("operations.md")]
pub mod operations {}
