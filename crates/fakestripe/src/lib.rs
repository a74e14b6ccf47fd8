//! fakestripe: a Stripe-compatible fake payment gateway, with real idempotency and fault
//! injection, for tests and demos.
//!
//! It speaks a subset of Stripe's wire format, so a client written for Stripe can talk to it:
//! form-encoded bodies with bracket notation (`metadata[ride_id]=42`), `Authorization: Bearer
//! sk_test_…`, Stripe's objects and list objects, and Stripe's error object
//! (`{"error": {"type", "code", "message", "param"}}`). Its data is kept in PostgreSQL, in a
//! schema of its own, so that an audit can list every charge ever made.
//!
//! | concern | file |
//! |---|---|
//! | form bodies and bracket notation | `form.rs`, `params.rs` |
//! | the secret key and its account | `auth.rs` |
//! | Stripe's error object and messages | `api_error.rs`, [`messages`] |
//! | idempotency keys (claim, atomic phase, replay) | `idempotent.rs` |
//! | charges and customers as Stripe shows them | `model.rs` |
//! | the customer and charge endpoints, list pagination | `customers.rs`, `charges.rs` |
//! | injected faults | `faults.rs` |
//! | faults scripted for one customer's next charges | `scripted.rs` |
//! | every SQL statement, the schema and migrations | `db.rs`, `migrations/` |
//! | the shared state, the gateway's key retention | `state.rs` |
//! | the routers and the server, on top | `app.rs`, `admin.rs` |
//! | HTTPS with rustls | `tls.rs` |
//!
//! # Endpoints
//!
//! `POST /v1/customers`, `GET|DELETE /v1/customers/{id}`, `POST /v1/charges`,
//! `GET /v1/charges/{id}`, `GET /v1/charges` on the Stripe router; `GET|PUT /faults`,
//! `GET /faults/counters`, `POST /keys/forget`, `POST /charges/settle` and `POST /charges/script`
//! on the admin router, served on another listener. Every response of the gateway carries
//! `Request-Id`; an injected intermediary's answer, which stands for one the gateway never
//! sent, does not.
//!
//! # Idempotency
//!
//! A `POST` with `Idempotency-Key` is run at most once per account and key: its rows and its
//! response commit together, a retry gets the stored response with `Idempotent-Replayed: true`,
//! the same key with other parameters gets 400 `idempotency_error`, and a retry while the first
//! request runs gets 409 `idempotency_key_in_use`. The database holds at most one charge per key
//! (`charges.idempotency_key_id UNIQUE`).
//!
//! # Test cards
//!
//! A customer created with `source=tok_visa` can be charged; one created with
//! `source=tok_chargeCustomerFail` is created, but every charge of it is declined (402
//! `card_error` / `card_declined`), and no charge row is kept.

#![warn(missing_docs)]

mod admin;
mod api_error;
mod app;
mod auth;
mod bounds;
mod charges;
mod customers;
mod db;
mod error;
mod faults;
mod form;
mod idempotent;
mod ids;
pub mod messages;
mod model;
mod params;
mod scripted;
mod state;
mod tls;

pub use admin::admin_router;
pub use app::{router, serve, REQUEST_ID};
pub use bounds::MAX_LATENCY_MS;
pub use charges::{MAX_AMOUNT, MIN_USD_AMOUNT};
pub use db::{
    all_charges, charge_by_id, charges_of_customer, connect, connect_with, count_charges, migrate,
    SCHEMA,
};
pub use error::Error;
pub use faults::{FaultCounters, Faults, InvalidFaults};
pub use model::Charge;
pub use scripted::{InvalidScript, Scripted, MAX_SCRIPTED_ACTIONS};
pub use state::{forget_expired_keys, AppState, DEFAULT_IDEMPOTENCY_KEY_TTL, LEASE_TTL};
pub use tls::{serve_tls, server_config, HANDSHAKE_TIMEOUT};
