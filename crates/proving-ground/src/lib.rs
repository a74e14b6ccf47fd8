//! Rocket Rides' proving ground: programs that break the real service on purpose and measure it,
//! kept out of the service crate so that a reader of the service meets the service first.
//!
//! | program | what it proves | module |
//! |---|---|---|
//! | `chaos` | every invariant holds while the real processes are killed and cut | [`chaos`](mod@chaos) |
//! | `bench` | what a booking costs, against the same booking without idempotency | [`bench`](mod@bench) |
//!
//! Both start the real programs against PostgreSQL from `scripts/postgres.sh`: `chaos` the
//! `rocket-rides` binary built with its `failpoints` feature (which it checks) and fakestripe
//! in-process; `bench` a release `rocket-rides` built with its `bench` feature and the
//! `fakestripe` binary, each as a process of its own.

pub mod bench;
pub mod chaos;
mod local;
mod pgbouncer;
