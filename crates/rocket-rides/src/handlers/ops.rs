//! The operations routes: liveness, readiness, metrics, the OpenAPI document; and the
//! middleware that counts every answer.

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::metrics::CONTENT_TYPE;
use crate::state::AppState;

/// `GET /healthz`: the process answers.
pub async fn healthz() -> &'static str {
    "ok"
}

/// Ready when the database answers.
pub async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    match sqlx::query("SELECT 1").execute(&state.pool).await {
        Ok(_) => (http::StatusCode::OK, "ready"),
        Err(e) => {
            tracing::warn!(error = %e, "database unreachable");
            (
                http::StatusCode::SERVICE_UNAVAILABLE,
                "database unreachable",
            )
        }
    }
}

/// Middleware: counts every answered request by its route template (never the raw path, whose
/// ids would make the label set unbounded).
pub async fn count_requests(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let method = request.method().as_str().to_owned();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let response = next.run(request).await;
    state
        .metrics
        .http(&method, &route, response.status().as_u16());
    response
}

/// `GET /metrics`.
pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let unfinished: Option<i64> =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE finished_at IS NULL")
            .fetch_one(&state.pool)
            .await
            .inspect_err(|e| tracing::warn!(error = %e, "metrics: cannot count unfinished keys"))
            .ok();
    (
        [(http::header::CONTENT_TYPE, CONTENT_TYPE)],
        state.metrics.render(unfinished),
    )
}

/// `GET /openapi.json`.
pub async fn openapi() -> impl IntoResponse {
    Json(crate::openapi::spec())
}
