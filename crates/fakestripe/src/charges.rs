//! Charges: `POST /v1/charges`, `GET /v1/charges/{id}`, `GET /v1/charges`, and the one place
//! where faults are injected.
//!
//! A charge request goes through [`crate::faults`]' points around the idempotent run of
//! [`crate::idempotent`]; see those modules for the order of events.

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::HeaderMap;
use http_body_util::{Full, Limited};
use idempotency::{IdempotencyKey, StoredResponse};
use serde_json::{json, Value};

use crate::api_error::ApiError;
use crate::auth::Account;
use crate::db::{self, Cursor, NewCharge, Page};
use crate::faults::{
    AfterCharge, BeforeCharge, FaultKind, IntermediaryAnswer, IntermediaryBody, Plan, Stored,
};
use crate::idempotent::{self, Call, Done, Hold, Operation};
use crate::messages;
use crate::model::{Charge, MAX_DESCRIPTION_LEN};
use crate::params::{self, FormBody, QueryParams};
use crate::state::{run_detached, AppState};

/// The route, as the idempotency key's scope and fingerprint name it.
pub(crate) const ROUTE: &str = "/v1/charges";

/// The largest amount, in the currency's smallest unit: Stripe allows eight digits.
pub const MAX_AMOUNT: i64 = 99_999_999;

/// The smallest `usd` amount, in cents, as Stripe requires.
pub const MIN_USD_AMOUNT: i64 = 50;

/// The page size of `GET /v1/charges` without `limit`.
pub(crate) const DEFAULT_LIMIT: i64 = 10;

/// The largest `limit`.
pub(crate) const MAX_LIMIT: i64 = 100;

/// `POST /v1/charges` (`amount`, `currency`, `customer`, `description`, `metadata[…]`).
///
/// The parameters are checked first; then the key is claimed, so that a key with a stored
/// result replays it, whatever happened since; then, inside the charge's transaction, the
/// customer is looked up (an unknown or deleted one is refused, and nothing is kept).
pub(crate) async fn create(
    State(state): State<AppState>,
    account: Account,
    headers: HeaderMap,
    FormBody(params): FormBody,
) -> Result<Response, ApiError> {
    let key = idempotent::key_from_headers(&headers)?;
    let charge = parse_new_charge(&params)?;

    let plan = state.plan_faults(&charge.customer_id);
    if let Some(before) = plan.before {
        return answer_before(&state, before);
    }

    let params = Value::Object(params);
    run_detached(async move {
        let op = Operation::CreateCharge {
            charge,
            pending: plan.pending,
        };
        let call = Call {
            account_id: account.id,
            route: ROUTE,
            key: key.clone(),
            params,
            op,
            stored: plan.stored,
            hold: Hold {
                delay: plan.delay,
                fault: plan.delay_fault,
            },
        };
        let ran = idempotent::run(&state, call);
        let outcome = match ran.await? {
            Done::Ran(outcome) => outcome,
            Done::Replay(stored) => return Ok(replay(&state, &plan, key.as_ref(), &stored)),
            Done::Answer(response) => return Ok(response),
        };
        if outcome.stored_server_error {
            state.record_fault(match plan.stored {
                Stored::ServerErrorAfterCharge => FaultKind::Sticky500AfterCharge,
                Stored::ServerErrorInstead | Stored::Outcome => FaultKind::Sticky500BeforeCharge,
            });
            return Ok(idempotency_axum::stored_response(&outcome.response));
        }
        if outcome.charged && plan.pending {
            state.record_fault(FaultKind::PendingCharge);
        }
        if outcome.charged {
            return deliver_after_charge(&state, plan.after_charge, &outcome.response);
        }
        Ok(idempotency_axum::stored_response(&outcome.response))
    })
    .await
}

/// The answer of a request struck before it claims its key: nothing is written.
fn answer_before(state: &AppState, before: BeforeCharge) -> Result<Response, ApiError> {
    match before {
        BeforeCharge::Intermediary(answer) => {
            state.record_fault(FaultKind::IntermediaryBefore);
            Ok(intermediary_response(answer))
        }
        BeforeCharge::ConflictInFlight => {
            state.record_fault(FaultKind::ConflictInFlight);
            Err(ApiError::idempotency_key_in_use())
        }
        BeforeCharge::FailBefore => {
            state.record_fault(FaultKind::FailBeforeCharge);
            Err(ApiError::server_error())
        }
        BeforeCharge::ScriptedFailBefore => {
            state.record_fault(FaultKind::ScriptedFailBefore);
            Err(ApiError::server_error())
        }
    }
}

/// The replay of the key's stored result, or, under `idempotency_error_on_replay`, Stripe's 400
/// for a key reused with other parameters in place of a stored charge. Only a stored charge is
/// struck: the fault stands for a retry whose parameters changed after its first attempt
/// charged, when the client must find its charge some other way. Stored 500s and declines are
/// replayed as usual.
fn replay(
    state: &AppState,
    plan: &Plan,
    key: Option<&IdempotencyKey>,
    stored: &StoredResponse,
) -> Response {
    match key {
        Some(key) if plan.idempotency_error_on_replay && holds_charge(stored) => {
            state.record_fault(FaultKind::IdempotencyErrorOnReplay);
            ApiError::idempotency_mismatch(key.as_str()).into_response()
        }
        // Only a key replays, so `None` does not happen here; a replay not struck
        // goes as it is.
        Some(_) | None => idempotency_axum::replayed_response(stored),
    }
}

/// Whether a stored response is a charge object (succeeded or pending when stored).
fn holds_charge(stored: &StoredResponse) -> bool {
    stored.status == 200
        && serde_json::from_slice::<Value>(&stored.body)
            .is_ok_and(|body| body["object"] == "charge")
}

/// What the client of a request that has just committed a charge receives.
fn deliver_after_charge(
    state: &AppState,
    after_charge: AfterCharge,
    response: &StoredResponse,
) -> Result<Response, ApiError> {
    match after_charge {
        AfterCharge::Respond => Ok(idempotency_axum::stored_response(response)),
        AfterCharge::Fail => {
            state.record_fault(FaultKind::FailAfterCharge);
            Err(ApiError::server_error())
        }
        AfterCharge::Drop => {
            state.record_fault(FaultKind::DropAfterCharge);
            Ok(aborted_response())
        }
        AfterCharge::Intermediary(answer) => {
            state.record_fault(FaultKind::IntermediaryAfter);
            Ok(intermediary_response(answer))
        }
    }
}

/// The answer an intermediary in front of the gateway gives on its own: its status, with a
/// small HTML page or no body at all. It has none of the gateway's marks (Stripe's error object,
/// `Idempotent-Replayed`, `Request-Id`), so a client cannot mistake it for Stripe's verdict.
fn intermediary_response(answer: IntermediaryAnswer) -> Response {
    let mut response = match answer.body {
        IntermediaryBody::Html => {
            let title = format!(
                "{} {}",
                answer.status.as_u16(),
                answer.status.canonical_reason().unwrap_or_default()
            );
            let page = format!(
                "<html>\r\n<head><title>{title}</title></head>\r\n<body>\r\n\
                 <center><h1>{title}</h1></center>\r\n</body>\r\n</html>\r\n"
            );
            ([(CONTENT_TYPE, "text/html")], page).into_response()
        }
        IntermediaryBody::Empty => ([(CONTENT_LENGTH, "0")], Body::empty()).into_response(),
    };
    *response.status_mut() = answer.status;
    response.extensions_mut().insert(NotFromTheGateway);
    response
}

/// Marks a response the gateway stands for not having sent, so that `crate::app` does not
/// give it the gateway's `Request-Id`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NotFromTheGateway;

/// A response that never arrives: its body fails on the first read, and hyper then closes the
/// connection before flushing anything, so the client sees the connection end without a
/// response (a transport error, as when a network drops a gateway's answer).
///
/// The failing body is two bytes behind a one-byte limit: `Limited` refuses it on its first
/// poll, and no custom body type is needed. (A zero-byte limit would not do: hyper would see an
/// empty body and never poll it.)
fn aborted_response() -> Response {
    let body = Limited::new(Full::new(Bytes::from_static(b"xx")), 1);
    Response::new(Body::new(body))
}

fn parse_new_charge(params: &params::Params) -> Result<NewCharge, ApiError> {
    params::reject_unknown(
        params,
        &["amount", "currency", "customer", "description", "metadata"],
    )?;
    let amount = match params::optional_integer(params, "amount")? {
        None => return Err(ApiError::missing("amount")),
        Some(amount) if amount <= 0 => {
            return Err(ApiError::invalid_code(
                "amount",
                "parameter_invalid_integer",
                messages::INVALID_POSITIVE_INTEGER,
            ))
        }
        Some(amount) if amount > MAX_AMOUNT => {
            return Err(ApiError::invalid_code(
                "amount",
                "amount_too_large",
                format!("Amount must be no more than {MAX_AMOUNT}"),
            ))
        }
        Some(amount) => amount,
    };
    let currency = params::required_string(params, "currency", 255)?.to_ascii_lowercase();
    if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_lowercase()) {
        return Err(ApiError::invalid(
            "currency",
            format!("Invalid currency: {currency}"),
        ));
    }
    if currency == "usd" && amount < MIN_USD_AMOUNT {
        return Err(ApiError::invalid_code(
            "amount",
            "amount_too_small",
            "Amount must be at least $0.50 usd",
        ));
    }
    let customer_id = params::required_string(params, "customer", 255)?;
    let description = params::optional_string(params, "description", MAX_DESCRIPTION_LEN)?;
    let metadata = params::metadata(params)?;
    Ok(NewCharge {
        customer_id,
        amount,
        currency,
        description,
        metadata,
    })
}

/// `GET /v1/charges/{id}`.
pub(crate) async fn retrieve(
    State(state): State<AppState>,
    account: Account,
    Path(id): Path<String>,
) -> Result<axum::Json<Value>, ApiError> {
    match db::find_charge(state.pool(), account.id, &id).await? {
        Some(charge) => Ok(axum::Json(charge.to_json())),
        None => Err(ApiError::not_found("charge", &id)),
    }
}

/// `GET /v1/charges` (`limit`, `starting_after`, `ending_before`, `customer`, `created`): a list
/// object, newest first.
pub(crate) async fn list(
    State(state): State<AppState>,
    account: Account,
    QueryParams(params): QueryParams,
) -> Result<Response, ApiError> {
    params::reject_unknown(
        &params,
        &[
            "created",
            "customer",
            "ending_before",
            "limit",
            "starting_after",
        ],
    )?;
    let limit = params::optional_integer(&params, "limit")?.unwrap_or(DEFAULT_LIMIT);
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(ApiError::invalid_code(
            "limit",
            "parameter_invalid_integer",
            messages::LIMIT_OUT_OF_RANGE,
        ));
    }
    let after = params::optional_string(&params, "starting_after", 255)?;
    let before = params::optional_string(&params, "ending_before", 255)?;
    let (cursor, cursor_param) = match (after, before) {
        (Some(_), Some(_)) => return Err(ApiError::bad_request(messages::ONE_CURSOR_ONLY)),
        (Some(id), None) => (Cursor::After(id), "starting_after"),
        (None, Some(id)) => (Cursor::Before(id), "ending_before"),
        (None, None) => (Cursor::Newest, ""),
    };
    let customer = params::optional_string(&params, "customer", 255)?;
    let created = params::created_range(&params)?;
    let page = db::list_charges(
        state.pool(),
        account.id,
        customer.as_deref(),
        created,
        &cursor,
        limit,
    )
    .await?;
    let (charges, has_more) = match page {
        Page::Found { charges, has_more } => (charges, has_more),
        Page::NoSuchCursor => {
            let id = cursor.id().unwrap_or_default();
            return Err(ApiError::no_such_param("charge", id, cursor_param));
        }
    };
    let data: Vec<Value> = charges.iter().map(Charge::to_json).collect();
    Ok(axum::Json(json!({
        "object": "list",
        "data": data,
        "has_more": has_more,
        "url": ROUTE,
    }))
    .into_response())
}
