//! The crate's documentation beyond its first screen. Nothing to call here.

#[doc = include_str!("modes.md")]
pub mod modes {}
