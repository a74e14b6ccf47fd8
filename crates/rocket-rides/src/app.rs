//! The service on top: its routes, and how it is served.

use std::future::Future;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request};
use axum::routing::get;
use axum::{Extension, Router};
use http::HeaderName;
use tokio::net::TcpListener;
use tower::ServiceBuilder;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::MAX_BODY_BYTES;
use crate::handlers::{ops, rides};
use crate::openapi::ApiDoc;
pub use crate::state::{AppState, StartError};

/// The routes, and the OpenAPI document generated from them.
pub fn routes() -> (Router<AppState>, utoipa::openapi::OpenApi) {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(rides::create))
        .routes(routes!(rides::show))
        .routes(routes!(ops::healthz))
        .routes(routes!(ops::readyz))
        .routes(routes!(ops::metrics))
        .routes(routes!(ops::openapi))
        .split_for_parts()
}

/// The service: the routes, their document and their layers.
pub fn router(state: AppState) -> Router {
    let (routes, doc) = routes();
    routes
        .layer(Extension(Arc::new(doc)))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            ops::count_requests,
        ))
        .with_state(state)
        // Request ids and tracing, outermost first: a client's unusable id is dropped, a missing
        // one generated, the request's span opened with the id, and the id copied onto the
        // answer.
        .layer(
            ServiceBuilder::new()
                .map_request(drop_unusable_request_id)
                .layer(SetRequestIdLayer::new(REQUEST_ID, MakeRequestUuid))
                .layer(
                    TraceLayer::new_for_http()
                        .make_span_with(request_span)
                        .on_response(DefaultOnResponse::new().level(Level::INFO))
                        // A 5xx is logged once, with its cause, where it is answered.
                        .on_failure(()),
                )
                .layer(PropagateRequestIdLayer::new(REQUEST_ID)),
        )
}

/// The span of one request: every log line written while it is served carries its id.
fn request_span(request: &Request) -> tracing::Span {
    let id = request
        .headers()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    tracing::info_span!(
        "http_request",
        request_id = %id,
        method = %request.method(),
        path = %request.uri().path(),
    )
}

/// The header that names a request: taken from the request when it is usable, generated (a
/// UUID) otherwise, echoed on the answer, and a field of the span every log line of the request
/// is written in.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The longest request id taken from a client; a longer one is replaced, so that a client
/// cannot make every log line of its request arbitrarily long.
pub const MAX_REQUEST_ID_LEN: usize = 128;

/// Removes request ids that are too long, not visible ASCII, or repeated.
fn drop_unusable_request_id(mut request: Request) -> Request {
    let headers = request.headers_mut();
    let mut values = headers.get_all(&REQUEST_ID).iter();
    let usable = match (values.next(), values.next()) {
        (Some(value), None) => {
            value.len() <= MAX_REQUEST_ID_LEN
                && !value.is_empty()
                && value.as_bytes().iter().all(|b| b.is_ascii_graphic())
        }
        _ => false,
    };
    if !usable {
        headers.remove(&REQUEST_ID);
    }
    request
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
