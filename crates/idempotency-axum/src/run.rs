//! A multi-step handler in one call: [`run`] runs a [`Workflow`] for the request and answers its
//! [`Outcome`]; [`respond`] is that answer, for an outcome obtained otherwise.

use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use idempotency::{Outcome, Request, Store, StoredResponse, Workflow};

use crate::problem::{types, Problem, PROBLEM_JSON};
use crate::replay::{
    replayed_response, stored_response, KEY_IN_FLIGHT_DETAIL, KEY_REUSED_DETAIL,
    MAX_IN_FLIGHT_RETRY_AFTER,
};

/// Detail of the 503 of a transient failure.
pub const RETRY_LATER_DETAIL: &str =
    "the request could not be completed now; retry with the same Idempotency-Key";

/// Detail of the 409 of a run whose key another request took over.
pub const TAKEN_OVER_DETAIL: &str =
    "another request with this Idempotency-Key took the request over; retry to get its answer";

/// Detail of the 500 of a failed run: the same for every cause.
pub const FAILED_DETAIL: &str = "the request failed; retry with the same Idempotency-Key";

/// Runs `workflow` for `request` ([`Store::run`]: detached from this handler, so a client that
/// hangs up stops nothing) and answers its outcome ([`respond`]).
///
/// ```no_run
/// # use std::sync::Arc;
/// # use axum::extract::State;
/// # use idempotency::{Owner, Request, Store, Workflow};
/// # use idempotency_axum::RequiredKey;
/// # async fn handler<W: Workflow>(
/// #     State((store, workflow)): State<(Store, Arc<W>)>,
/// #     RequiredKey(key): RequiredKey,
/// #     axum::Json(body): axum::Json<serde_json::Value>,
/// # ) -> axum::response::Response {
/// let owner = Owner::new("alice").expect("a valid owner");
/// idempotency_axum::run(&store, &workflow, Request::new(owner, key, body)).await
/// # }
/// ```
pub async fn run<W: Workflow>(store: &Store, workflow: &Arc<W>, request: Request) -> Response {
    respond(store.run(workflow, request).await)
}

/// The HTTP answer to `outcome`, in one conversion:
///
/// | outcome | answer |
/// |---|---|
/// | `Answered` | the stored answer, as it will be replayed |
/// | `Replayed` | the stored answer with `Idempotent-Replayed: true` |
/// | `Mismatch` | 422 problem+json |
/// | `InFlight` | 409 problem+json, `Retry-After` (at most [`MAX_IN_FLIGHT_RETRY_AFTER`]) |
/// | `RetryLater` | 503 problem+json, `Retry-After` |
/// | `Lost` | 409 problem+json: the request that took the key over answers |
/// | `Failed` | 500 problem+json, no detail of the cause (it goes to the log) |
pub fn respond(outcome: Outcome) -> Response {
    match outcome {
        Outcome::Answered(answer) => stored_response(&answer),
        Outcome::Replayed(answer) => replayed_response(&answer),
        Outcome::Mismatch => Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            types::KEY_REUSED,
            "Idempotency-Key reused",
        )
        .with_detail(KEY_REUSED_DETAIL)
        .into_response(),
        Outcome::InFlight { retry_after } => Problem::new(
            StatusCode::CONFLICT,
            types::KEY_IN_FLIGHT,
            "Request in progress",
        )
        .with_detail(KEY_IN_FLIGHT_DETAIL)
        .with_retry_after(retry_after.min(MAX_IN_FLIGHT_RETRY_AFTER))
        .into_response(),
        Outcome::RetryLater {
            retry_after, cause, ..
        } => {
            tracing::warn!(%cause, "idempotent request to be retried");
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                types::RETRY_LATER,
                "Try again later",
            )
            .with_detail(RETRY_LATER_DETAIL)
            .with_retry_after(retry_after)
            .into_response()
        }
        Outcome::Lost => Problem::new(
            StatusCode::CONFLICT,
            types::LEASE_LOST,
            "Request taken over",
        )
        .with_detail(TAKEN_OVER_DETAIL)
        .with_retry_after(std::time::Duration::from_secs(1))
        .into_response(),
        Outcome::Failed { cause } => {
            tracing::error!(%cause, "idempotent request failed");
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                types::REQUEST_FAILED,
                "Internal error",
            )
            .with_detail(FAILED_DETAIL)
            .into_response()
        }
    }
}

/// A problem stored as a request's final answer ([`idempotency::Halt::fail`]): its status, its
/// body, and one `content-type`, `application/problem+json`. A `Retry-After` is not kept: a
/// final answer is not retried.
impl From<Problem> for StoredResponse {
    fn from(problem: Problem) -> Self {
        StoredResponse {
            status: problem.status().as_u16(),
            headers: vec![("content-type".to_owned(), PROBLEM_JSON.to_owned())],
            // Serializing a `Value` cannot fail: its keys are strings.
            body: serde_json::to_vec(&problem.body()).expect("a JSON value serializes"),
        }
    }
}
