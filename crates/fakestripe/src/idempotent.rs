//! Stripe's idempotency, built on the `idempotency` crate.
//!
//! A `POST` with an `Idempotency-Key` runs as one key of the account (`user_id` = account id)
//! in a single transaction, claim included:
//!
//! ```text
//!  validate ──► begin: insert the key ──► new: { look-ups, business rows, stored response } ──► commit, respond
//!    │ 400        │   (one transaction)        └─ refused (unknown customer): rolled back with the key, 400
//!    │ (nothing   ├─ exists, finished → the stored status and body, `Idempotent-Replayed: true`
//!    │  stored)   ├─ exists, other parameters → 400 idempotency_error
//!    │            └─ being run by another request → 409 idempotency_error / idempotency_key_in_use
//!    └─ failure inside the transaction: rolled back with the key; a retry runs it afresh
//! ```
//!
//! The key, the business rows (a charge, a customer) and the stored response commit in one
//! transaction, so a key is either unused or finished with exactly the effect its response
//! describes; no key is ever visible half done. A concurrent request with the same key waits on
//! the uncommitted insert for at most the connections' `lock_timeout` and is then answered 409,
//! as Stripe answers a key in use. A charge row also carries its key's id under a UNIQUE
//! constraint, so the database refuses a second charge for one key even if a lease were ever
//! shared.
//!
//! As with Stripe, a key with a stored result replays it before the request's references are
//! looked up again; a request refused by validation (an unknown or deleted customer, found after
//! the claim) keeps nothing, its key included, so that the key can be used again. The injected
//! sticky 500s are stored like any result ([`crate::faults`]).
//!
//! Differences from Stripe, both deliberate: an internal failure of the fake itself (a database
//! error) is not stored, so a retry can succeed; and keys are scoped per endpoint by the library,
//! so reusing a key on another endpoint starts a new request instead of failing.
//!
//! The fingerprint is taken over the decoded form parameters as a JSON object, so the order of
//! the pairs in the body does not matter, but their values do (`amount=0100` is not `amount=100`).
//!
//! # Why not `Store::run`
//!
//! Stripe's semantics fit the library's one path: a request here is a one-step
//! [`Workflow`](idempotency::Workflow) (the same key replays: `Outcome::Replayed`; other
//! parameters: `Outcome::Mismatch`, 400; in flight: `Outcome::InFlight`, 409; a refusal halts the
//! step and rolls the new key back with it; the run is detached, so a fault may drop the
//! connection after the charge commits). Written that way, every fakestripe test passes. It is
//! not used for one reason, its cost: [`Store::run`](idempotency::Store::run) claims with
//! `Store::begin`, which reads the key in a statement of its own before the transaction that
//! inserts it, so a new charge takes two transactions of the gateway's database where
//! `begin_optimistic` (insert first, read only on a conflict) takes one. One transaction per
//! charge is a target of docs/performance.md ("fakestripe: one transaction per charge"), checked
//! by proving-ground's bench test (`gateway_transactions_per_request` rounds to 1), so that the
//! benchmark measures the service, not its fake gateway. Measured with the move (that test, the
//! debug builds): 2.0 gateway transactions per create, against 1.0 without it. The move waits
//! for a way to ask `Store::run` to claim insert-first.
//!
//! The axum face fits less: `IdempotencyLayer` answers another payload under a key with a 422
//! and a key in flight with a 409, both problem+json, where Stripe answers 400 and 409 with its
//! own error object (`idempotency_error`), which Stripe's client libraries read; and it claims
//! (`Store::claim`) in a transaction of its own before the handler's.

use axum::response::Response;
use http::HeaderMap;
use idempotency::{
    Begun as Claimed, Claim, Fingerprint, FirstPhase, IdempotencyKey, Lease, NewRequest, Owner,
    StoredResponse,
};
use serde_json::Value;
use sqlx::PgConnection;

use crate::api_error::ApiError;
use crate::db::{self, NewCharge, NewCustomer};
use crate::faults::{FaultKind, Stored};
use crate::model::Source;
use crate::state::AppState;
use crate::Error;

/// The request header, as Stripe names it.
pub(crate) const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// A gateway request has a single phase (the charge and its stored response commit together),
/// so its keys use the library's one-step points.
pub(crate) type Point = idempotency::OneStep;

/// The request's idempotency key, if it sent one.
pub(crate) fn key_from_headers(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, ApiError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    match (values.next(), values.next()) {
        (None, _) => Ok(None),
        (Some(value), None) => IdempotencyKey::parse(value.as_bytes())
            .map(Some)
            .map_err(|e| ApiError::bad_request(format!("Invalid Idempotency-Key: {e}"))),
        (Some(_), Some(_)) => Err(ApiError::bad_request(
            "Invalid Idempotency-Key: send exactly one Idempotency-Key header",
        )),
    }
}

/// What a `POST` does once it may run: its parameters validated; the objects it refers to are
/// looked up inside its transaction, after the claim, so that a key with a stored result replays
/// it even if those objects changed since (a customer deleted after its charge).
#[derive(Debug, Clone)]
pub(crate) enum Operation {
    /// `POST /v1/customers`.
    CreateCustomer(NewCustomer),
    /// `POST /v1/charges`; `pending` makes the charge `pending` instead of `succeeded`.
    CreateCharge { charge: NewCharge, pending: bool },
}

/// The result of an operation that ran.
#[derive(Debug)]
pub(crate) struct Outcome {
    /// The response, as stored with the key (if any) and delivered.
    pub(crate) response: StoredResponse,
    /// Whether this run committed a charge (a decline commits none).
    pub(crate) charged: bool,
    /// Whether a 500 was kept in place of the operation's own result.
    pub(crate) stored_server_error: bool,
}

/// Why an operation gave no outcome to keep.
#[derive(Debug)]
enum Failure {
    /// The gateway refuses the request (an unknown customer, or a deleted one: `deleted`).
    /// Nothing is kept under the key, as Stripe keeps nothing for a request that fails
    /// validation.
    Refused { error: ApiError, deleted: bool },
    /// The database failed.
    Internal(Error),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Self::Internal(e)
    }
}

impl From<idempotency::Error> for Failure {
    fn from(e: idempotency::Error) -> Self {
        Self::Internal(e.into())
    }
}

/// What a request may do after its claim.
#[derive(Debug)]
pub(crate) enum Begun {
    /// Run the operation.
    Run(Work),
    /// The key holds this result: replay it ([`idempotency_axum::replayed_response`]), unless an
    /// injected fault answers in its place (`idempotency_error_on_replay`, [`crate::faults`]).
    Replay(StoredResponse),
    /// Answer at once: a refusal (other parameters, or the key in use).
    Answer(Response),
}

/// Where an operation runs.
#[derive(Debug)]
pub(crate) enum Work {
    /// The request has no key: a transaction of its own.
    Unkeyed,
    /// A new key, inserted in this open transaction: the operation joins it.
    New(FirstPhase<Point>),
    /// A key left unfinished by an earlier process, taken over: a final phase under the lease.
    Resumed(Lease<Point>),
}

/// Claims the request's key, if it has one: one transaction that inserts it, left open for the
/// operation when the key is new.
pub(crate) async fn begin(
    state: &AppState,
    account_id: i64,
    route: &str,
    key: Option<&IdempotencyKey>,
    params: &Value,
) -> Result<Begun, ApiError> {
    let Some(key) = key else {
        return Ok(Begun::Run(Work::Unkeyed));
    };
    let owner = Owner::from(account_id);
    let request = NewRequest {
        owner: &owner,
        method: "POST",
        route,
        key,
        fingerprint: Fingerprint::of_json("POST", route, params),
        params,
    };
    let claimed = state
        .store()
        .begin_optimistic::<Point>(request, Point::Started)
        .await
        .map_err(|e| ApiError::internal(&Error::from(e)))?;
    let claim = match claimed {
        Claimed::New(first) => return Ok(Begun::Run(Work::New(first))),
        Claimed::Existing(claim) => claim,
    };
    Ok(match claim {
        Claim::Acquired(lease) => Begun::Run(Work::Resumed(lease)),
        Claim::Replay(stored) => Begun::Replay(stored),
        Claim::Mismatch => Begun::Answer(axum::response::IntoResponse::into_response(
            ApiError::idempotency_mismatch(key.as_str()),
        )),
        Claim::InFlight { .. } => Begun::Answer(axum::response::IntoResponse::into_response(
            ApiError::idempotency_key_in_use(),
        )),
    })
}

/// Runs the operation and, under a key, keeps `stored` in the same transaction: its own
/// response, or a 500 in its place (the injected sticky errors of [`crate::faults`]).
pub(crate) async fn complete(
    state: &AppState,
    account_id: i64,
    work: Work,
    op: &Operation,
    stored: Stored,
) -> Result<Outcome, ApiError> {
    match work {
        Work::Unkeyed => {
            let result = async {
                let context = || format!("run a request of account {account_id} without a key");
                let mut tx = state.pool().begin().await.map_err(Error::db(context()))?;
                let outcome = execute(&mut tx, account_id, None, op, stored).await?;
                tx.commit().await.map_err(Error::db(context()))?;
                Ok::<_, Failure>(outcome)
            };
            result.await.map_err(|failure| answer(state, failure))
        }
        Work::New(mut first) => {
            let key_id = first.lease().key_id();
            let result = async {
                let outcome = execute(first.conn(), account_id, Some(key_id), op, stored).await?;
                first.finish(&outcome.response).await?;
                Ok::<_, Failure>(outcome)
            };
            // On failure the transaction rolls back with the key: nothing is kept, and a retry
            // (or another request with the key) runs afresh, as with Stripe.
            result.await.map_err(|failure| answer(state, failure))
        }
        Work::Resumed(lease) => complete_resumed(state, account_id, lease, op, stored).await,
    }
}

/// The operation of a key that an earlier process left unfinished, in a final phase.
async fn complete_resumed(
    state: &AppState,
    account_id: i64,
    mut lease: Lease<Point>,
    op: &Operation,
    stored: Stored,
) -> Result<Outcome, ApiError> {
    let store = state.store();
    let result = async {
        let mut phase = store.final_phase(&mut lease).await?;
        let key_id = phase.key_id();
        let outcome = execute(phase.conn(), account_id, Some(key_id), op, stored).await?;
        phase.finish(&outcome.response).await?;
        Ok::<_, Failure>(outcome)
    }
    .await;
    match result {
        Ok(outcome) => Ok(outcome),
        Err(refused @ Failure::Refused { .. }) => {
            // The phase rolled back; the key goes too, so that nothing is kept for a refused
            // request and the key may be used again, as with Stripe.
            if let Err(e) = store.abandon(lease).await {
                tracing::warn!(error = %e, "could not forget the key of a refused request");
            }
            Err(answer(state, refused))
        }
        Err(Failure::Internal(error)) => {
            // The phase rolled back. Free the key now rather than when the lease expires, so
            // that the client's retry runs at once instead of getting 409s until then.
            if let Err(release) = store.release(lease).await {
                tracing::warn!(error = %release, "could not release an idempotency key");
            }
            Err(ApiError::internal(&error))
        }
    }
}

/// The answer to a failed operation; a refusal for a deleted customer is counted, as the
/// permanent refusal it injects.
fn answer(state: &AppState, failure: Failure) -> ApiError {
    match failure {
        Failure::Refused { error, deleted } => {
            if deleted {
                state.record_fault(FaultKind::Refused);
            }
            error
        }
        Failure::Internal(error) => ApiError::internal(&error),
    }
}

/// The operation's writes, on the phase's connection.
async fn execute(
    conn: &mut PgConnection,
    account_id: i64,
    key_id: Option<i64>,
    op: &Operation,
    stored: Stored,
) -> Result<Outcome, Failure> {
    let outcome = |response, charged| Outcome {
        response,
        charged,
        stored_server_error: false,
    };
    match op {
        Operation::CreateCustomer(new) => {
            let customer = db::insert_customer(conn, account_id, new).await?;
            Ok(outcome(ok_json(&customer.to_json()), false))
        }
        Operation::CreateCharge { charge, pending } => {
            let customer = db::find_customer(&mut *conn, account_id, &charge.customer_id).await?;
            let customer = match customer {
                Some(customer) if !customer.deleted => customer,
                found => {
                    return Err(Failure::Refused {
                        error: ApiError::no_such_param("customer", &charge.customer_id, "customer"),
                        deleted: found.is_some(),
                    })
                }
            };
            let server_error = || Outcome {
                response: ApiError::server_error().to_stored(),
                charged: false,
                stored_server_error: true,
            };
            if stored == Stored::ServerErrorInstead {
                return Ok(server_error());
            }
            match customer.source {
                Some(Source::Visa) => {
                    let charge =
                        db::insert_charge(conn, account_id, charge, *pending, key_id).await?;
                    tracing::info!(charge = %charge.id, amount = charge.amount, status = %charge.status, "charge created");
                    if stored == Stored::ServerErrorAfterCharge {
                        return Ok(Outcome {
                            charged: true,
                            ..server_error()
                        });
                    }
                    Ok(outcome(ok_json(&charge.to_json()), true))
                }
                // A decline is a final outcome: kept with the key and replayed, but no charge row.
                Some(Source::ChargeCustomerFail) => {
                    Ok(outcome(ApiError::card_declined().to_stored(), false))
                }
                None => Ok(outcome(ApiError::no_active_card().to_stored(), false)),
            }
        }
    }
}
fn ok_json(body: &Value) -> StoredResponse {
    StoredResponse::json(200, body, Vec::new())
}
