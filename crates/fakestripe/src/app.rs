//! The gateway on top: the Stripe router, its middleware and the server loop.

use std::future::Future;

use axum::extract::{DefaultBodyLimit, Request};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use http::{HeaderValue, Method, Uri};
use tokio::net::TcpListener;

use crate::api_error::ApiError;
use crate::params::MAX_BODY_BYTES;
use crate::state::AppState;
use crate::{charges, customers, ids};

/// The response header that names a request, as Stripe sends it.
pub const REQUEST_ID: &str = "request-id";

/// The Stripe surface: `/v1/customers` and `/v1/charges`.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/customers", post(customers::create))
        .route(
            "/v1/customers/{id}",
            get(customers::retrieve).delete(customers::delete),
        )
        .route("/v1/charges", post(charges::create).get(charges::list))
        .route("/v1/charges/{id}", get(charges::retrieve))
        .fallback(unrecognized_url)
        .method_not_allowed_fallback(unrecognized_url)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn(request_id))
        .with_state(state)
}

/// Serves `app` on `listener` until `shutdown` completes, then lets open requests finish.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Stripe's 404 for a method and path it does not serve.
async fn unrecognized_url(method: Method, uri: Uri) -> Response {
    ApiError::unrecognized_url(method.as_str(), uri.path()).into_response()
}

/// Adds `Request-Id: req_…` to every response the gateway sends (not to an injected
/// intermediary's answer, which stands for one it never sent).
async fn request_id(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    if response
        .extensions()
        .get::<charges::NotFromTheGateway>()
        .is_some()
    {
        return response;
    }
    // Ids are `req_` and ASCII alphanumerics: always a valid header value.
    let id = HeaderValue::from_str(&ids::request()).expect("an ASCII id is a header value");
    response.headers_mut().insert(REQUEST_ID, id);
    response
}
