//! Customers: `POST /v1/customers` and `GET /v1/customers/{id}`.
//!
//! A customer carries at most one test card, given as a Stripe test token in `source`; the
//! token decides the fate of every charge of the customer.

use axum::extract::{Path, State};
use axum::response::Response;
use http::HeaderMap;
use serde_json::Value;

use crate::api_error::ApiError;
use crate::auth::Account;
use crate::db::{self, NewCustomer};
use crate::faults::Stored;
use crate::idempotent::{self, Call, Done, Hold, Operation};
use crate::model::{Customer, Source, MAX_DESCRIPTION_LEN};
use crate::params::{self, FormBody};
use crate::state::{run_detached, AppState};

/// The route, as the idempotency key's scope and fingerprint name it.
pub(crate) const ROUTE: &str = "/v1/customers";

/// The longest email accepted, as Stripe allows.
pub(crate) const MAX_EMAIL_LEN: usize = 512;

/// `POST /v1/customers` (`email`, `description`, `source`, `metadata[…]`).
pub(crate) async fn create(
    State(state): State<AppState>,
    account: Account,
    headers: HeaderMap,
    FormBody(params): FormBody,
) -> Result<Response, ApiError> {
    let key = idempotent::key_from_headers(&headers)?;
    let new = parse_new_customer(&params)?;
    let params = Value::Object(params);
    run_detached(async move {
        let op = Operation::CreateCustomer(new);
        let call = Call {
            account_id: account.id,
            route: ROUTE,
            key,
            params,
            op,
            stored: Stored::Outcome,
            hold: Hold::default(),
        };
        let ran = idempotent::run(&state, call);
        match ran.await? {
            Done::Ran(outcome) => Ok(idempotency_axum::stored_response(&outcome.response)),
            Done::Replay(stored) => Ok(idempotency_axum::replayed_response(&stored)),
            Done::Answer(response) => Ok(response),
        }
    })
    .await
}

fn parse_new_customer(params: &params::Params) -> Result<NewCustomer, ApiError> {
    params::reject_unknown(params, &["description", "email", "metadata", "source"])?;
    let email = params::optional_string(params, "email", MAX_EMAIL_LEN)?;
    if let Some(email) = &email {
        // Stripe's check is loose too: something on each side of an '@'.
        let valid = email.split_once('@').is_some_and(|(user, host)| {
            !user.is_empty() && !host.is_empty() && !email.contains(char::is_whitespace)
        });
        if !valid {
            return Err(ApiError::invalid_code(
                "email",
                "email_invalid",
                format!("Invalid email address: {email}"),
            ));
        }
    }
    let description = params::optional_string(params, "description", MAX_DESCRIPTION_LEN)?;
    let source = match params::optional_string(params, "source", 255)? {
        None => None,
        Some(token) => Some(
            Source::from_token(&token)
                .ok_or_else(|| ApiError::no_such_param("token", &token, "source"))?,
        ),
    };
    let metadata = params::metadata(params)?;
    Ok(NewCustomer {
        email,
        description,
        source,
        metadata,
    })
}

/// `GET /v1/customers/{id}`.
pub(crate) async fn retrieve(
    State(state): State<AppState>,
    account: Account,
    Path(id): Path<String>,
) -> Result<axum::Json<Value>, ApiError> {
    match db::find_customer(state.pool(), account.id, &id).await? {
        Some(customer) => Ok(axum::Json(customer.to_json())),
        None => Err(ApiError::not_found("customer", &id)),
    }
}

/// `DELETE /v1/customers/{id}`: the customer stays (its charges name it) but every later charge
/// of it is refused for good (400 `resource_missing`), as Stripe refuses a deleted customer: the
/// gateway's permanent refusal, for the clients that must handle one.
pub(crate) async fn delete(
    State(state): State<AppState>,
    account: Account,
    Path(id): Path<String>,
) -> Result<axum::Json<Value>, ApiError> {
    if db::delete_customer(state.pool(), account.id, &id).await? {
        tracing::info!(customer = %id, "customer deleted");
        Ok(axum::Json(Customer::deleted_json(&id)))
    } else {
        Err(ApiError::not_found("customer", &id))
    }
}
