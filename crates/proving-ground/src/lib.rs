//! Rocket Rides' proving ground: programs that break the real service on purpose and measure it,
//! kept out of the service crate so that a reader of the service meets the service first.
//!
//! | program | what it proves | module |
//! |---|---|---|
//! | `chaos` | every invariant holds while the real processes are killed and cut | [`chaos`] |
//!
//! Both start the real programs: the `rocket-rides` binary (built with its `failpoints` feature,
//! which the harness checks), fakestripe, and PostgreSQL from `scripts/postgres.sh`.

pub mod chaos;
