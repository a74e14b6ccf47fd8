//! Rocket Rides: book a ride and charge a card, effectively once.
//!
//! | concern | file |
//! |---|---|
//! | the phase machine of `POST /rides` | [`booking`] |
//! | request validation, ride view, handlers | [`rides`] |
//! | API keys | [`auth`] |
//! | the Stripe client and its error classes | [`stripe`] |
//! | errors as problem+json | [`problem`] |
//! | settings and their relations | [`config`] |
//! | routes, state, serving | [`app`] |
//! | `GET /metrics`, `GET /openapi.json` | [`metrics`], [`openapi`] |
//! | graceful shutdown in two steps | [`shutdown`] |
//! | completer, reaper, outbox drain | [`worker`] |

pub mod app;
pub mod auth;
pub mod booking;
#[cfg(feature = "chaos")]
pub mod chaos;
pub mod cli;
pub mod config;
pub mod db;
pub mod failpoints;
pub mod metrics;
pub mod openapi;
pub mod problem;
pub mod rides;
pub mod shutdown;
pub mod stripe;
pub mod users;
pub mod worker;
