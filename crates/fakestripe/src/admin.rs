//! The admin surface, served on its own listener so that the Stripe surface stays Stripe's:
//!
//! - `GET /faults`: the current [`Faults`] as JSON;
//! - `PUT /faults`: replaces them (every field optional, unknown fields and out-of-range values
//!   refused with 400) and answers with the new ones;
//! - `GET /faults/counters`: the [`FaultCounters`].

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use http::StatusCode;
use serde_json::json;

use crate::app::AppState;
use crate::faults::{FaultCounters, Faults};

/// The admin router.
pub fn admin_router(state: AppState) -> Router {
    Router::new()
        .route("/faults", get(get_faults).put(put_faults))
        .route("/faults/counters", get(get_counters))
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

fn bad_request(message: String) -> Response {
    let body = json!({"error": {"type": "invalid_request_error", "message": message}});
    (StatusCode::BAD_REQUEST, Json(body)).into_response()
}
