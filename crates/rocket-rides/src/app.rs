//! The service: its state, its routes, and how it is served.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, State};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use idempotency::{Clock, Store};
use sqlx::PgPool;
use tokio::net::TcpListener;

use crate::config::{GatewayArgs, LeaseArgs};
use crate::metrics::Metrics;
use crate::shutdown::Signal;
use crate::stripe::StripeClient;

/// The largest request body accepted; a ride request is about 120 bytes.
pub const MAX_BODY_BYTES: usize = 16 * 1024;

/// Why the service's state could not be built.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A setting, or a relation between settings, does not hold.
    #[error("invalid settings: {0}")]
    Settings(String),
    /// The key store refused its configuration.
    #[error(transparent)]
    Store(#[from] idempotency::Error),
    /// The gateway client could not be built.
    #[error(transparent)]
    Gateway(#[from] crate::stripe::ClientError),
}

/// Everything a handler needs. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    /// The database.
    pub pool: PgPool,
    /// The idempotency key store, over the same pool.
    pub store: Store,
    /// The payment gateway.
    pub stripe: StripeClient,
    /// How often a request renews its lease while it waits on the gateway.
    pub heartbeat: Duration,
    /// How long after its first use a gateway key is trusted to be remembered.
    pub gateway_key_window: Duration,
    /// Fires when in-flight work must give up its lease (the shutdown deadline passed).
    pub giving_up: Signal,
    /// Counters for `GET /metrics`.
    pub metrics: Metrics,
    /// Crash points armed by tests.
    #[cfg(feature = "failpoints")]
    pub failpoints: crate::failpoints::Failpoints,
}

impl AppState {
    /// Builds the state from validated settings.
    pub fn new(
        pool: PgPool,
        clock: Arc<dyn Clock>,
        gateway: &GatewayArgs,
        lease: &LeaseArgs,
    ) -> Result<Self, StartError> {
        crate::config::validate(gateway, lease).map_err(StartError::Settings)?;
        let store = Store::new(pool.clone(), clock, lease.lease_ttl)?;
        let stripe = StripeClient::from_args(gateway)?;
        Ok(Self {
            pool,
            store,
            stripe,
            heartbeat: lease.lease_heartbeat,
            gateway_key_window: gateway.gateway_key_window,
            giving_up: Signal::never(),
            metrics: Metrics::default(),
            #[cfg(feature = "failpoints")]
            failpoints: crate::failpoints::Failpoints::from_env().map_err(StartError::Settings)?,
        })
    }
}

/// The routes.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/rides", post(crate::rides::create))
        .route("/rides/{id}", get(crate::rides::show))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(crate::metrics::scrape))
        .route("/openapi.json", get(crate::openapi::document))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::metrics::count_requests,
        ))
        .with_state(state)
}

/// The routes of `rocket-rides worker --metrics-listen`: its counters and liveness.
pub fn worker_router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(crate::metrics::scrape))
        .with_state(state)
}

/// Ready when the database answers.
async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
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
