//! The service on top: its routes, and how it is served.

use std::future::Future;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use tokio::net::TcpListener;

use crate::config::MAX_BODY_BYTES;
use crate::handlers::{ops, rides};
pub use crate::state::{AppState, StartError};

/// The routes.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/rides", post(rides::create))
        .route("/rides/{id}", get(rides::show))
        .route("/healthz", get(ops::healthz))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .route("/openapi.json", get(ops::openapi))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            ops::count_requests,
        ))
        .with_state(state)
}

/// The routes of `rocket-rides worker --metrics-listen`: its counters and liveness.
pub fn worker_router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(ops::healthz))
        .route("/metrics", get(ops::metrics))
        .with_state(state)
}

/// Serves `router` on `listener` until `shutdown` resolves, then drains in-flight requests.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}
