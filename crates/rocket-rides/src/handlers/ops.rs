//! The operations routes: liveness, readiness, metrics, the OpenAPI document; and the
//! middleware that counts every answer.

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

use axum::{Extension, Json};
use std::time::Instant;

use crate::metrics::CONTENT_TYPE;
use crate::state::AppState;

/// `GET /healthz`: the process answers.
#[utoipa::path(get, path = "/healthz", tag = "operations", security(()),
    responses((status = 200, description = "Alive.", body = String, content_type = "text/plain")))]
pub async fn healthz() -> &'static str {
    "ok"
}

/// `GET /readyz`: ready when the database answers.
#[utoipa::path(get, path = "/readyz", tag = "operations", security(()),
    responses(
        (status = 200, description = "Ready.", body = String, content_type = "text/plain"),
        (status = 503, description = "The database does not answer.", body = String, content_type = "text/plain"),
    ))]
pub async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    match ready(&state).await {
        Ok(()) => (http::StatusCode::OK, "ready"),
        Err(e) => {
            tracing::warn!(error = %e, "database unreachable");
            (
                http::StatusCode::SERVICE_UNAVAILABLE,
                "database unreachable",
            )
        }
    }
}

/// One statement on the store's pool, as every statement of the service is sent.
async fn ready(state: &AppState) -> Result<(), sqlx::Error> {
    let mut db = state.store.autocommit().await?;
    let mut pg = state.store.statements_on(db.conn());
    sqlx::query("SELECT 1").execute(&mut pg).await?;
    db.done().await
}

/// Middleware: counts every answered request by its route template (never the raw path, whose
/// ids would make the label set unbounded).
pub async fn count_requests(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let response = next.run(request).await;
    let status = response.status().as_u16();
    state
        .metrics
        .http(method.as_str(), &route, status, started.elapsed());
    response
}

/// `GET /metrics`: counters and histograms in the OpenMetrics text format. The unfinished keys
/// are counted in the database at most every [`crate::metrics::UNFINISHED_KEYS_REFRESH`], not
/// per scrape.
#[utoipa::path(get, path = "/metrics", tag = "operations", security(()),
    responses((status = 200, description = "OpenMetrics text.", body = String, content_type = "application/openmetrics-text")))]
pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    state
        .metrics
        .refresh_unfinished_keys(Instant::now(), state.store.count_unfinished())
        .await;
    let pool = (state.pool.size(), state.pool.num_idle());
    (
        [(http::header::CONTENT_TYPE, CONTENT_TYPE)],
        state.metrics.render(Some(pool)),
    )
}

/// `GET /openapi.json`: this document, generated from the handlers and types.
#[utoipa::path(get, path = "/openapi.json", tag = "operations", security(()),
    responses((status = 200, description = "OpenAPI 3.1.", body = Object)))]
pub async fn openapi(
    Extension(doc): Extension<Arc<utoipa::openapi::OpenApi>>,
) -> impl IntoResponse {
    Json(doc)
}
