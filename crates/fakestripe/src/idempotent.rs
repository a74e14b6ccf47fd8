//! Stripe's idempotency, built on the `idempotency` crate.
//!
//! A `POST` with an `Idempotency-Key` runs as one key of the account (`user_id` = account id)
//! in a single atomic phase:
//!
//! ```text
//!  validate ──► claim ──► Acquired ──► final phase: { business rows + stored response } ──► respond
//!    │ 400        │
//!    │ (nothing   ├─ Replay   → the stored status and body, `Idempotent-Replayed: true`
//!    │  stored)   ├─ Mismatch → 400 idempotency_error (same key, other parameters)
//!    │            └─ InFlight → 409 idempotency_error / idempotency_key_in_use
//!    └─ failure inside the phase: rolled back, lease released; a retry runs it afresh
//! ```
//!
//! The business rows (a charge, a customer) and the stored response commit in one transaction,
//! so a key is either unused or finished with exactly the effect its response describes. A
//! charge row also carries its key's id under a UNIQUE constraint, so the database refuses a
//! second charge for one key even if a lease were ever shared.
//!
//! Differences from Stripe, both deliberate: an internal failure (500) is not stored, so a retry
//! can succeed where Stripe would replay the 500; and keys are scoped per endpoint by the
//! library, so reusing a key on another endpoint starts a new request instead of failing.
//!
//! The fingerprint is taken over the decoded form parameters as a JSON object, so the order of
//! the pairs in the body does not matter, but their values do (`amount=0100` is not `amount=100`).

use axum::response::Response;
use http::HeaderMap;
use idempotency::{Claim, Fingerprint, IdempotencyKey, Lease, NewRequest, StoredResponse};
use serde_json::Value;
use sqlx::PgConnection;

use crate::api_error::ApiError;
use crate::app::AppState;
use crate::customers::{Customer, Source};
use crate::db::{self, NewCharge, NewCustomer};
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

/// What a `POST` does once it may run: validated, with every referenced object looked up.
#[derive(Debug, Clone)]
pub(crate) enum Operation {
    /// `POST /v1/customers`.
    CreateCustomer(NewCustomer),
    /// `POST /v1/charges` against this customer.
    CreateCharge {
        customer: Customer,
        charge: NewCharge,
    },
}

/// The result of an operation that ran.
#[derive(Debug)]
pub(crate) struct Outcome {
    /// The response, as stored with the key (if any) and delivered.
    pub(crate) response: StoredResponse,
    /// Whether this run committed a charge (a decline commits none).
    pub(crate) charged: bool,
}

/// What a request may do after its claim.
#[derive(Debug)]
pub(crate) enum Begun {
    /// Run the operation, under this lease when the request has a key.
    Run(Option<Lease<Point>>),
    /// Answer at once: a replay, or a refusal.
    Answer(Response),
}

/// Claims the request's key, if it has one.
pub(crate) async fn begin(
    state: &AppState,
    account_id: i64,
    route: &str,
    key: Option<&IdempotencyKey>,
    params: &Value,
) -> Result<Begun, ApiError> {
    let Some(key) = key else {
        return Ok(Begun::Run(None));
    };
    let claim = state
        .store()
        .claim::<Point>(NewRequest {
            user_id: account_id,
            method: "POST",
            route,
            key,
            fingerprint: Fingerprint::of_json("POST", route, params),
            params,
        })
        .await
        .map_err(|e| ApiError::internal(&Error::from(e)))?;
    Ok(match claim {
        Claim::Acquired(lease) => Begun::Run(Some(lease)),
        Claim::Replay(stored) => Begun::Answer(idempotency_axum::replayed_response(&stored)),
        Claim::Mismatch => Begun::Answer(axum::response::IntoResponse::into_response(
            ApiError::idempotency_mismatch(key.as_str()),
        )),
        Claim::InFlight { .. } => Begun::Answer(axum::response::IntoResponse::into_response(
            ApiError::idempotency_key_in_use(),
        )),
    })
}

/// Runs the operation and, under a lease, stores its response in the same transaction.
pub(crate) async fn complete(
    state: &AppState,
    account_id: i64,
    lease: Option<Lease<Point>>,
    op: &Operation,
) -> Result<Outcome, ApiError> {
    let Some(mut lease) = lease else {
        let result = async {
            let context = || format!("run a request of account {account_id} without a key");
            let mut tx = state.pool().begin().await.map_err(Error::db(context()))?;
            let outcome = execute(&mut tx, account_id, None, op).await?;
            tx.commit().await.map_err(Error::db(context()))?;
            Ok::<_, Error>(outcome)
        };
        return result.await.map_err(|e| ApiError::internal(&e));
    };

    let store = state.store();
    let result = async {
        let mut phase = store.final_phase(&mut lease).await?;
        let key_id = phase.key_id();
        let outcome = execute(phase.conn(), account_id, Some(key_id), op).await?;
        phase.finish(&outcome.response).await?;
        Ok::<_, Error>(outcome)
    }
    .await;
    match result {
        Ok(outcome) => Ok(outcome),
        Err(error) => {
            // The phase rolled back. Free the key now rather than when the lease expires, so
            // that the client's retry runs at once instead of getting 409s until then.
            if let Err(release) = store.release(lease).await {
                tracing::warn!(error = %release, "could not release an idempotency key");
            }
            Err(ApiError::internal(&error))
        }
    }
}

/// The operation's writes, on the phase's connection.
async fn execute(
    conn: &mut PgConnection,
    account_id: i64,
    key_id: Option<i64>,
    op: &Operation,
) -> Result<Outcome, Error> {
    match op {
        Operation::CreateCustomer(new) => {
            let customer = db::insert_customer(conn, account_id, new).await?;
            Ok(Outcome {
                response: ok_json(&customer.to_json()),
                charged: false,
            })
        }
        Operation::CreateCharge { customer, charge } => match customer.source {
            Some(Source::Visa) => {
                let charge = db::insert_charge(conn, account_id, charge, key_id).await?;
                tracing::info!(charge = %charge.id, amount = charge.amount, "charge succeeded");
                Ok(Outcome {
                    response: ok_json(&charge.to_json()),
                    charged: true,
                })
            }
            // A decline is a final outcome: kept with the key and replayed, but no charge row.
            Some(Source::ChargeCustomerFail) => Ok(Outcome {
                response: ApiError::card_declined().to_stored(),
                charged: false,
            }),
            None => Ok(Outcome {
                response: ApiError::no_active_card().to_stored(),
                charged: false,
            }),
        },
    }
}

fn ok_json(body: &Value) -> StoredResponse {
    StoredResponse::json(200, body, Vec::new())
}
