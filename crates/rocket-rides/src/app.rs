//! The service on top: its routes and the layers of its edge. How it is served (connections,
//! their timeouts and bounds) is [`crate::server`].

use std::sync::Arc;

use axum::body::Body;
use axum::error_handling::HandleErrorLayer;
use axum::extract::{DefaultBodyLimit, Request};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{BoxError, Extension, Router};
use http::HeaderName;
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::ServiceBuilder;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::timeout::{RequestBodyTimeoutLayer, TimeoutBody};
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::admission::AdmissionLayer;
use crate::config::MAX_BODY_BYTES;
use crate::handlers::{ops, rides};
use crate::metrics::Metrics;
use crate::openapi::ApiDoc;
use crate::problem::ApiError;
pub use crate::server::serve;
pub use crate::state::{AppState, StartError};

/// The routes, and the OpenAPI document generated from them. `/metrics` is one of them only
/// when metrics are asked for on the public listener (`serve --metrics-on-public-listener`);
/// otherwise [`metrics_router`] serves them on a listener of their own. The routes that use the
/// database on a client's behalf pass `gate` first; the operations' routes do not
/// ([`crate::admission`] says why).
pub fn routes(
    with_metrics: bool,
    gate: AdmissionLayer,
) -> (Router<AppState>, utoipa::openapi::OpenApi) {
    let rides = OpenApiRouter::new()
        .routes(routes!(rides::create))
        .routes(routes!(rides::show))
        .route_layer(gate.clone());
    let mut routes = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .merge(rides)
        .routes(routes!(ops::healthz))
        .routes(routes!(ops::readyz))
        .routes(routes!(ops::openapi));
    if with_metrics {
        routes = routes.routes(routes!(ops::metrics));
    }
    let (routes, mut doc) = routes.split_for_parts();
    crate::openapi::complete(&mut doc);
    // The benchmark's baseline is left out of the document: no client should ever call it.
    // The claim's order is read here, so that a bad `BENCH_CLAIM` stops the service at start.
    // `POST /rides` reads it through `Booking::claims_insert_first`.
    #[cfg(feature = "bench")]
    crate::config::claim_inserts_first();
    #[cfg(feature = "bench")]
    let routes = routes.route(
        "/bench/rides",
        axum::routing::post(crate::handlers::bench::create).route_layer(gate),
    );
    #[cfg(not(feature = "bench"))]
    drop(gate);
    (routes, doc)
}

/// The service as `serve` runs it by default: every route but `/metrics`, which
/// [`metrics_router`] serves on a listener of its own.
pub fn router(state: AppState) -> Router {
    api_router(state, false)
}

/// The service: the routes, their document, and the layers of the edge, innermost first:
///
/// - every answer counted and timed by route template (`route_layer`, so only routed requests);
/// - unknown paths and methods answered as problems (404, 405 with `Allow`);
/// - bodies bounded in size and in the pause between two of their pieces;
/// - on the routes that use the database, the admission gate: as many at once as the pool
///   serves (or six per CPU where fewer), a short bounded wait for a slot, then a shed
///   ([`crate::admission`]);
/// - a deadline on the whole request, and a bound on requests in flight past which requests are
///   shed at once (503 problems with `Retry-After`, never queued);
/// - request ids and the request's span, outermost, so that every answer (a shed one too)
///   carries its id.
pub fn api_router(state: AppState, with_metrics: bool) -> Router {
    let metrics = state.metrics.clone();
    let http = state.http.clone();
    let slots = http.admission_slots(state.pool.options().get_max_connections());
    let gate = AdmissionLayer::new(
        slots,
        http.admission_wait,
        http.admission_overload_wait,
        metrics.clone(),
    );
    let (routes, doc) = routes(with_metrics, gate);
    routes
        .fallback(|| async { ApiError::NoRoute })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .layer(Extension(Arc::new(doc)))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            ops::count_requests,
        ))
        .with_state(state)
        .layer(
            ServiceBuilder::new()
                .layer(HandleErrorLayer::new(move |error: BoxError| {
                    let metrics = metrics.clone();
                    async move { edge_error(&metrics, error) }
                }))
                .load_shed()
                .layer(GlobalConcurrencyLimitLayer::new(
                    http.http_max_in_flight as usize,
                ))
                .timeout(http.request_timeout)
                .layer(RequestBodyTimeoutLayer::new(http.body_read_timeout))
                .map_request(|request: Request<TimeoutBody<Body>>| request.map(Body::new)),
        )
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

/// The answer to a request the edge stopped: shed (too many in flight) or past its deadline.
/// (A request the admission gate sheds is answered by the gate, with the same problem.)
fn edge_error(metrics: &Metrics, error: BoxError) -> Response {
    if error.is::<tower::load_shed::error::Overloaded>() {
        metrics.request_shed();
        return ApiError::OverCapacity.into_response();
    }
    if error.is::<tower::timeout::error::Elapsed>() {
        metrics.request_timed_out();
        return ApiError::RequestTimeout.into_response();
    }
    ApiError::Internal(format!("edge: {error}")).into_response()
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

/// The routes of a metrics listener (`serve --metrics-listen`, on loopback by default;
/// `worker --metrics-listen`): the metrics and liveness. Its requests are not counted: a scrape
/// is not an answer of the API.
pub fn metrics_router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(ops::healthz))
        .route("/metrics", get(ops::metrics))
        .fallback(|| async { ApiError::NoRoute })
        .with_state(state)
}
