//! The OpenAPI document: generated from the handlers' `#[utoipa::path]` annotations and the
//! types they take and give (`RideRequest`, `Ride`, `Problem`), through the router that serves
//! them (`utoipa-axum`), so that a route cannot be served without being documented nor
//! documented without being served.

use utoipa::openapi::content::ContentBuilder;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::path::{Operation, ParameterIn};
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::schema::{ObjectBuilder, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{RefOr, Schema};
use utoipa::{Modify, OpenApi};

use crate::problem::types;

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
        (name = "operations", description = "Liveness, readiness, this document; metrics only when served on this listener")
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

/// Completes the document once the router has added its paths and their schemas: the edge's
/// answers on every route, the key's grammar, and the closed list of problem types.
pub fn complete(doc: &mut utoipa::openapi::OpenApi) {
    Edge.modify(doc);
}

/// What every route may answer besides its own statuses, from the edge (the server loop and the
/// router's layers); the key's grammar; and the closed list of problem types.
struct Edge;

impl Modify for Edge {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for item in openapi.paths.paths.values_mut() {
            let operations = [
                &mut item.get,
                &mut item.post,
                &mut item.put,
                &mut item.delete,
                &mut item.patch,
            ];
            for operation in operations.into_iter().flatten() {
                let takes_body = operation.request_body.is_some();
                edge_responses(operation, takes_body);
                key_pattern(operation);
            }
        }
        let components = openapi.components.get_or_insert_with(Default::default);
        if let Some(RefOr::T(Schema::Object(problem))) = components.schemas.get_mut("Problem") {
            problem.properties.insert(
                "type".to_owned(),
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .description(Some("A stable URN per situation; clients switch on it."))
                    .enum_values(Some(types::ALL))
                    .into(),
            );
        }
    }
}

/// Adds the edge's answers to an operation, keeping a description the operation already has.
fn edge_responses(operation: &mut Operation, takes_body: bool) {
    let problem = || {
        ContentBuilder::new()
            .schema(Some(utoipa::openapi::Ref::from_schema_name("Problem")))
            .build()
    };
    let retry_after = || {
        HeaderBuilder::new()
            .schema(Some(
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .minimum(Some(1)),
            ))
            .description(Some("Seconds to wait"))
            .build()
    };
    let problem_response = |description: &str| {
        ResponseBuilder::new()
            .description(description)
            .content(idempotency_axum::PROBLEM_JSON, problem())
            .build()
    };
    add(
        operation,
        "405",
        problem_response(
            "`urn:problem:rocket-rides:method-not-allowed`: another method of the path; `Allow` lists them.",
        ),
    );
    add(
        operation,
        "414",
        ResponseBuilder::new()
            .description("URI too long (answered by the HTTP server itself, without a body).")
            .build(),
    );
    add(
        operation,
        "431",
        ResponseBuilder::new()
            .description(
                "Request head over 16 KiB (answered by the HTTP server itself, without a body).",
            )
            .build(),
    );
    let mut unavailable = ResponseBuilder::new()
        .description(
            "`urn:problem:rocket-rides:over-capacity` (as many requests in flight as the server \
             takes, or no admission slot for a request that uses the database within \
             `--admission-wait`; nothing was written) or `…:request-timeout` (past the request \
             deadline); retry after `Retry-After`.",
        )
        .content(idempotency_axum::PROBLEM_JSON, problem())
        .header("Retry-After", retry_after())
        .build();
    if let Some(RefOr::T(existing)) = operation.responses.responses.get("503") {
        // The route's own 503s and the edge's share the status: one description for all.
        unavailable.description =
            format!("{} Or {}", existing.description, unavailable.description);
    }
    operation
        .responses
        .responses
        .insert("503".to_owned(), RefOr::T(unavailable));
    if takes_body {
        add(
            operation,
            "413",
            problem_response("`urn:problem:rocket-rides:body-too-large`: the body is over 16 KiB."),
        );
        add(
            operation,
            "415",
            problem_response(
                "`urn:problem:rocket-rides:unsupported-media-type`: the body is not sent as \
                 `application/json`, or is encoded.",
            ),
        );
    }
}

/// Adds a response to an operation that does not have one for the status.
fn add(operation: &mut Operation, status: &str, response: utoipa::openapi::Response) {
    operation
        .responses
        .responses
        .entry(status.to_owned())
        .or_insert(RefOr::T(response));
}

/// The `Idempotency-Key` parameter's grammar, from the parser's own constant.
fn key_pattern(operation: &mut Operation) {
    for parameter in operation.parameters.iter_mut().flatten() {
        let RefOr::T(parameter) = parameter else {
            continue;
        };
        if parameter.name == "Idempotency-Key" && parameter.parameter_in == ParameterIn::Header {
            parameter.schema = Some(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .pattern(Some(idempotency::KEY_PATTERN))
                    .into(),
            );
        }
    }
}
