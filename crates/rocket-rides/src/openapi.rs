//! The OpenAPI document: generated from the handlers' `#[utoipa::path]` annotations and the
//! types they take and give (`RideRequest`, `Ride`, `Problem`), through the router that serves
//! them (`utoipa-axum`), so that a route cannot be served without being documented nor
//! documented without being served.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

/// The document's fixed parts; the paths come from the router (`crate::app::router`).
#[derive(OpenApi)]
#[openapi(
    info(
        title = "Rocket Rides",
        description = "Book a ride and charge a card, effectively once per Idempotency-Key."
    ),
    modifiers(&ApiKeyAuth),
    tags(
        (name = "rides", description = "Booking and reading rides"),
        (name = "operations", description = "Liveness, readiness, metrics, this document")
    )
)]
pub struct ApiDoc;

/// `Authorization: Bearer <api key>` on the ride routes.
struct ApiKeyAuth;

impl Modify for ApiKeyAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}
