//! The admin surface, served on its own listener so that the Stripe surface stays Stripe's:
//!
//! - `GET /faults`: the current [`Faults`] as JSON;
//! - `PUT /faults`: replaces them (every field optional, unknown fields and out-of-range values
//!   refused with 400) and answers with the new ones;
//! - `GET /faults/counters`: the [`FaultCounters`];
//! - `POST /keys/forget` (`{"older_than_ms": N}`, default 0): forgets the idempotency keys that
//!   finished more than N ms ago, as Stripe prunes keys after 24 hours; answers `{"forgotten": n}`;
//! - `POST /charges/settle` (`{"status": "succeeded" | "failed"}`): settles every pending charge;
//!   answers `{"settled": n}`;
//! - `POST /charges/script` (`{"customer": "cus_…", "actions": [{"action": "fail_before"},
//!   {"action": "hold", "ms": 5000}]}`): appends [`Scripted`] actions to the customer's script;
//!   answers `{"customer": "cus_…", "left": n}`, the actions now waiting. Unknown fields, unknown
//!   actions and holds above [`crate::MAX_LATENCY_MS`] are refused with 400, and then nothing is
//!   queued.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http::StatusCode;
use serde_json::json;

use crate::faults::{FaultCounters, Faults};
use crate::scripted::Scripted;
use crate::state::AppState;

/// The admin router.
pub fn admin_router(state: AppState) -> Router {
    Router::new()
        .route("/faults", get(get_faults).put(put_faults))
        .route("/faults/counters", get(get_counters))
        .route("/keys/forget", post(forget_keys))
        .route("/charges/settle", post(settle_charges))
        .route("/charges/script", post(script_charges))
        .with_state(state)
}

async fn get_faults(State(state): State<AppState>) -> Json<Faults> {
    Json(state.faults())
}

async fn put_faults(State(state): State<AppState>, body: Bytes) -> Response {
    // Parsed by hand rather than with `Json`, so that every refusal is a 400 with a message.
    let faults: Faults = match serde_json::from_slice(&body) {
        Ok(faults) => faults,
        Err(e) => return bad_request(format!("invalid faults: {e}")),
    };
    match state.try_set_faults(faults) {
        Ok(()) => {
            tracing::info!(faults = ?state.faults(), "faults set");
            Json(state.faults()).into_response()
        }
        Err(e) => bad_request(e.to_string()),
    }
}

async fn get_counters(State(state): State<AppState>) -> Json<FaultCounters> {
    Json(state.counters())
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Forget {
    #[serde(default)]
    older_than_ms: u64,
}

async fn forget_keys(State(state): State<AppState>, body: Bytes) -> Response {
    let forget: Forget = if body.is_empty() {
        Forget { older_than_ms: 0 }
    } else {
        match serde_json::from_slice(&body) {
            Ok(forget) => forget,
            Err(e) => return bad_request(format!("invalid request: {e}")),
        }
    };
    match state
        .forget_keys(std::time::Duration::from_millis(forget.older_than_ms))
        .await
    {
        Ok(n) => Json(json!({ "forgotten": n })).into_response(),
        Err(e) => server_error(&e),
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "lowercase")]
enum Settled {
    Succeeded,
    Failed,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Settle {
    status: Settled,
}

async fn settle_charges(State(state): State<AppState>, body: Bytes) -> Response {
    let settle: Settle = match serde_json::from_slice(&body) {
        Ok(settle) => settle,
        Err(e) => return bad_request(format!("invalid request: {e}")),
    };
    let succeeded = matches!(settle.status, Settled::Succeeded);
    match state.settle_pending_charges(succeeded).await {
        Ok(n) => Json(json!({ "settled": n })).into_response(),
        Err(e) => server_error(&e),
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Script {
    customer: String,
    actions: Vec<Scripted>,
}

async fn script_charges(State(state): State<AppState>, body: Bytes) -> Response {
    let script: Script = match serde_json::from_slice(&body) {
        Ok(script) => script,
        Err(e) => return bad_request(format!("invalid script: {e}")),
    };
    match state.try_script_charges(&script.customer, script.actions) {
        Ok(left) => {
            tracing::info!(customer = %script.customer, left, "charges scripted");
            Json(json!({ "customer": script.customer, "left": left })).into_response()
        }
        Err(e) => bad_request(format!("invalid script: {e}")),
    }
}

fn server_error(error: &crate::Error) -> Response {
    tracing::error!(error = %error, "admin request failed");
    let body = json!({"error": {"type": "api_error", "message": "the admin request failed"}});
    (StatusCode::INTERNAL_SERVER_ERROR, Json(body)).into_response()
}

fn bad_request(message: String) -> Response {
    let body = json!({"error": {"type": "invalid_request_error", "message": message}});
    (StatusCode::BAD_REQUEST, Json(body)).into_response()
}
