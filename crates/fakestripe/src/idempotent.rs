//! Stripe's idempotency, built on the `idempotency` crate's one path: each `POST` with an
//! `Idempotency-Key` is a one-step [`Workflow`] that [`Store::run`](idempotency::Store::run) runs for the account
//! (`owner` = account id), the claim (insert first: `Workflow::claims_insert_first`) and the
//! step in one transaction:
//!
//! ```text
//!  validate ──► Store::run: claim ──new──► step: { hold, look-ups, business rows } ──► Finish(response): commit, respond
//!    │ 400       (one transaction)            └─ refused (unknown customer): Halt, rolled back with the claim → 400
//!    │ (nothing    ├─ finished → Replayed: the stored status and body, `Idempotent-Replayed: true`
//!    │  stored)    ├─ other parameters → Mismatch: 400 idempotency_error
//!    │             └─ being run by another request → InFlight: 409 idempotency_error / idempotency_key_in_use
//!    └─ failure inside the step: rolled back with the claim; a retry runs it afresh (500)
//! ```
//!
//! The key, the business rows (a charge, a customer) and the stored response commit in one
//! transaction, so a key is either unused or finished with exactly the effect its response
//! describes; no key is ever visible half done. A concurrent request with the same key waits on
//! the uncommitted insert for at most the connections' `lock_timeout` and is then answered 409,
//! as Stripe answers a key in use. A charge row also carries its key's id under a UNIQUE
//! constraint, so the database refuses a second charge for one key even if a lease were ever
//! shared. The run is detached from the client's connection (by the library, and by
//! [`crate::state::run_detached`] around it): a client that hangs up does not stop a charge
//! half way, and a fault may drop the connection after the charge commits ([`crate::faults`]).
//!
//! As with Stripe, a key with a stored result replays it before the request's references are
//! looked up again; a request refused by validation (an unknown or deleted customer, found after
//! the claim) keeps nothing, its key included, so that the key can be used again: the step halts
//! and, the key being new, its claim rolls back with it. The injected sticky 500s are stored like
//! any result ([`crate::faults`]).
//!
//! The workflow is made per request: it holds the request's validated operation and, for the
//! handler, what the step did (a charge committed or not, a refusal's error object), which the
//! library's [`Outcome`](idempotency::Outcome) does not carry. It needs no completer: a key of
//! the gateway is never left unfinished (its claim commits only with its answer). A key that an
//! earlier version left unfinished is taken over and run by the same step; refused, it is
//! released rather than deleted (the library lets go of a key it took over, it does not forget
//! it), so the same key with other parameters is then a 400 `idempotency_error` where Stripe
//! would run it: a case the gateway of this version cannot create.
//!
//! Differences from Stripe, both deliberate: an internal failure of the fake itself (a database
//! error) is not stored, so a retry can succeed; and keys are scoped per endpoint by the library,
//! so reusing a key on another endpoint starts a new request instead of failing.
//!
//! The fingerprint is taken over the decoded form parameters as a JSON object, so the order of
//! the pairs in the body does not matter, but their values do (`amount=0100` is not `amount=100`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::HeaderMap;
use idempotency::{
    Advance, Halt, IdempotencyKey, OneStep, Outcome as Ran, Owner, Request, Step, StoredResponse,
    Workflow,
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

/// What a charge waits for once its key is claimed and before its writes, inside its
/// transaction: the tests' gate, then the injected latency (counted as `fault` when injected).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Hold {
    /// The latency injected.
    pub(crate) delay: Duration,
    /// The fault the latency stands for, counted once the request runs.
    pub(crate) fault: Option<FaultKind>,
}

impl Hold {
    async fn wait(self, state: &AppState) {
        state.pass_gate().await;
        if let Some(kind) = self.fault {
            state.record_fault(kind);
        }
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
    }
}

/// The result of an operation that ran.
#[derive(Debug, Clone)]
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

/// What a request came to.
#[derive(Debug)]
pub(crate) enum Done {
    /// The operation ran in this request: its result, stored with the key if it has one.
    Ran(Outcome),
    /// The key holds this result: replay it ([`idempotency_axum::replayed_response`]), unless an
    /// injected fault answers in its place (`idempotency_error_on_replay`, [`crate::faults`]).
    Replay(StoredResponse),
    /// Answer at once: a refusal (other parameters, or the key in use).
    Answer(Response),
}

/// One `POST`, validated: whose, on which route, under which key, and what it does.
#[derive(Debug)]
pub(crate) struct Call {
    /// The account the request authenticated as: the key's owner.
    pub(crate) account_id: i64,
    /// The route, as the key's scope names it.
    pub(crate) route: &'static str,
    /// The client's key, if it sent one.
    pub(crate) key: Option<IdempotencyKey>,
    /// The decoded form parameters: the fingerprint's payload.
    pub(crate) params: Value,
    /// What the request does.
    pub(crate) op: Operation,
    /// What is kept in place of the operation's own response (the injected sticky errors).
    pub(crate) stored: Stored,
    /// What the request waits for before its writes.
    pub(crate) hold: Hold,
}

/// Runs `call`: under its key as a one-step workflow of the library
/// ([`Store::run`](idempotency::Store::run)), or without one in a transaction of its own.
pub(crate) async fn run(state: &AppState, call: Call) -> Result<Done, ApiError> {
    let Call {
        account_id,
        route,
        key,
        params,
        op,
        stored,
        hold,
    } = call;
    let Some(key) = key else {
        hold.wait(state).await;
        return run_unkeyed(state, account_id, &op, stored)
            .await
            .map(Done::Ran);
    };
    let request = Arc::new(OneRequest {
        state: state.clone(),
        account_id,
        route,
        op,
        stored,
        hold,
        result: Mutex::default(),
    });
    let ran = state
        .store()
        .run(
            &request,
            Request::new(Owner::from(account_id), key.clone(), params),
        )
        .await;
    let result = request
        .result
        .lock()
        .expect("no step panics holding it")
        .take();
    match ran {
        // The step that finished the key put its outcome here first.
        Ran::Answered(response) => Ok(Done::Ran(match result {
            Some(Ok(outcome)) => outcome,
            Some(Err(_)) | None => Outcome {
                response,
                charged: false,
                stored_server_error: false,
            },
        })),
        Ran::Replayed(stored) => Ok(Done::Replay(stored)),
        Ran::Mismatch => Ok(Done::Answer(
            ApiError::idempotency_mismatch(key.as_str()).into_response(),
        )),
        Ran::InFlight { .. } | Ran::Lost => Ok(Done::Answer(
            ApiError::idempotency_key_in_use().into_response(),
        )),
        Ran::RetryLater { cause, .. } | Ran::Failed { cause } => match result {
            Some(Err(refused @ Failure::Refused { .. })) => Err(answer(state, refused)),
            Some(Err(Failure::Internal(error))) => Err(ApiError::internal(&error)),
            Some(Ok(_)) | None => {
                tracing::error!(%cause, "request failed");
                Err(ApiError::server_error())
            }
        },
    }
}

/// A request without a key: its operation in a transaction of its own.
async fn run_unkeyed(
    state: &AppState,
    account_id: i64,
    op: &Operation,
    stored: Stored,
) -> Result<Outcome, ApiError> {
    let result = async {
        let context = || format!("run a request of account {account_id} without a key");
        let mut tx = state.pool().begin().await.map_err(Error::db(context()))?;
        let outcome = execute(&mut tx, account_id, None, op, stored).await?;
        tx.commit().await.map_err(Error::db(context()))?;
        Ok::<_, Failure>(outcome)
    };
    result.await.map_err(|failure| answer(state, failure))
}

/// One keyed request, as the library's one-step workflow.
struct OneRequest {
    state: AppState,
    account_id: i64,
    route: &'static str,
    op: Operation,
    stored: Stored,
    hold: Hold,
    /// What the step did, for the handler: its outcome, or why it halted.
    result: Mutex<Option<Result<Outcome, Failure>>>,
}

impl Workflow for OneRequest {
    type Point = OneStep;

    fn route(&self) -> &str {
        self.route
    }

    /// A gateway's keys almost never repeat (a retry is the exception): the claim tries the
    /// insert first, so a new charge is one transaction, the claim with the charge.
    fn claims_insert_first(&self) -> bool {
        true
    }

    async fn step(
        &self,
        point: OneStep,
        step: &mut Step<'_, OneStep>,
    ) -> Result<Advance<OneStep>, Halt> {
        match point {
            OneStep::Started => {}
            OneStep::Finished => unreachable!("the driver never steps a finished key"),
        }
        self.hold.wait(&self.state).await;
        let key_id = step.key_id();
        let conn = step.tx().await?;
        let result = execute(conn, self.account_id, Some(key_id), &self.op, self.stored).await;
        let next = match &result {
            Ok(outcome) => Ok(Advance::Finish(outcome.response.clone())),
            // Rolled back with the claim of a new key: nothing is kept, as with Stripe.
            Err(Failure::Refused { .. }) => Err(Halt::retry("the request was refused")),
            Err(Failure::Internal(error)) => Err(Halt::retry(error)),
        };
        *self.result.lock().expect("no step panics holding it") = Some(result);
        next
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
