//! fakestripe over real HTTP: a real listener on 127.0.0.1:0, a real client, a fresh database
//! per test (`#[sqlx::test]`), no sleeps.

mod charges;
mod customers;
mod faults;
mod idempotency;
mod intermediary;
mod pagination;
mod scripted;
mod stripe_behaviour;
mod support;
mod tls;
