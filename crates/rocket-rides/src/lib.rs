//! Rocket Rides: book a ride and charge a card, effectively once.
//!
//! | concern | file |
//! |---|---|
//! | the phase machine of `POST /rides`, the gateway key and reconciliation | [`booking`] |
//! | the ride: request validation, the ride as the API shows it | [`ride`] |
//! | strict JSON: no duplicate members, no NUL, numbers as written | [`json`] |
//! | the shared state | [`state`] |
//! | HTTP handlers: rides, operations | [`handlers`] |
//! | routes and the edge's layers, on top | [`app`] |
//! | serving connections: timeouts, bounds | [`server`] |
//! | the admission gate: requests that use the database, as many as the pool serves | [`admission`] |
//! | API keys | [`auth`] |
//! | the Stripe client and its error classes | [`stripe`] |
//! | the HTTP contract's failures, each defined once (status, type, `Retry-After`, stored) | [`contract`] |
//! | errors as problem+json, built from the contract | [`problem`] |
//! | settings and their relations | [`config`] |
//! | counters and histograms, the OpenAPI document | [`metrics`], [`openapi`] |
//! | graceful shutdown in two steps | [`shutdown`] |
//! | logs: text or JSON lines, request ids | [`telemetry`] |
//! | completer, reaper, outbox drain | [`worker`] |
//!
//! Imports run one way: settings, errors, the gateway client and the ride model at the bottom;
//! the state above them; the booking and the worker above the state; the handlers above those;
//! the router and the command line on top.

pub mod admission;
pub mod app;
pub mod auth;
pub mod booking;
pub mod cli;
pub mod config;
pub mod contract;
pub mod db;
pub mod failpoints;
pub mod handlers;
pub mod json;
pub mod metrics;
pub mod openapi;
pub mod problem;
pub mod ride;
pub mod server;
pub mod shutdown;
pub mod state;
pub mod stripe;
pub mod telemetry;
pub mod users;
pub mod worker;
