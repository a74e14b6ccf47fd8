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

use crate::contract::{types, Failure, RetryAfter, Routes, FAILURES};

/// The document's fixed parts; the paths come from the router (`crate::app::router`).
#[derive(OpenApi)]
#[openapi(
    info(
        title = "Rocket Rides",
        description = "Book a ride and charge a card, effectively once per Idempotency-Key."
    ),
    modifiers(&ApiKeyAuth),
    // Every failure's body; the failures themselves are added from the contract (`Edge`).
    components(schemas(crate::problem::ProblemDocument)),
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

/// Completes the document once the router has added its paths and their schemas: each
/// operation's failures from the HTTP contract's table (`contract.rs`), the HTTP server's own
/// answers, the key's grammar, and the closed list of problem types.
pub fn complete(doc: &mut utoipa::openapi::OpenApi) {
    Edge.modify(doc);
}

/// Each operation's failures, from the contract; what the HTTP server answers itself; the key's
/// grammar; and the closed list of problem types.
struct Edge;

impl Modify for Edge {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for (path, item) in openapi.paths.paths.iter_mut() {
            let operations = [
                ("get", &mut item.get),
                ("post", &mut item.post),
                ("put", &mut item.put),
                ("delete", &mut item.delete),
                ("patch", &mut item.patch),
            ];
            for (method, operation) in operations {
                let Some(operation) = operation else {
                    continue;
                };
                let takes_body = operation.request_body.is_some();
                failures(operation, |routes| {
                    answers(routes, method, path, takes_body)
                });
                server_answers(operation);
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

/// Whether the operation `method path` answers with the failures of `routes`.
fn answers(routes: Routes, method: &str, path: &str, takes_body: bool) -> bool {
    let booking = method == "post" && path == crate::ride::RIDES_ROUTE;
    let read = method == "get" && path == "/rides/{id}";
    match routes {
        Routes::Booking => booking,
        Routes::Read => read,
        Routes::Rides => booking || read,
        Routes::WithBody => takes_body,
        Routes::Every => true,
        Routes::Unrouted => false,
    }
}

/// The operation's failures, one response per status, from the contract's rows
/// ([`crate::contract::FAILURES`]): each type with its title, whether it is stored and
/// replayed, and a `Retry-After` header when one of them carries it.
fn failures(operation: &mut Operation, applies: impl Fn(Routes) -> bool) {
    let mut statuses: Vec<u16> = FAILURES
        .iter()
        .filter(|f| applies(f.routes))
        .map(|f| f.status)
        .collect();
    statuses.sort_unstable();
    statuses.dedup();
    for status in statuses {
        let rows: Vec<&Failure> = FAILURES
            .iter()
            .filter(|f| f.status == status && applies(f.routes))
            .collect();
        let description: Vec<String> = rows
            .iter()
            .map(|f| {
                let outcome = if f.stored {
                    "stored and replayed"
                } else {
                    "not stored"
                };
                let retry = match f.retry_after {
                    RetryAfter::None => "",
                    RetryAfter::Fixed(_) | RetryAfter::Computed => "; retry after `Retry-After`",
                };
                format!("`{}`: {} ({outcome}{retry}).", f.kind, f.title)
            })
            .collect();
        let mut response = ResponseBuilder::new()
            .description(description.join(" "))
            .content(idempotency_axum::PROBLEM_JSON, problem());
        if rows.iter().any(|f| f.retry_after != RetryAfter::None) {
            response = response.header("Retry-After", retry_after());
        }
        operation
            .responses
            .responses
            .insert(status.to_string(), RefOr::T(response.build()));
    }
}

fn problem() -> utoipa::openapi::Content {
    ContentBuilder::new()
        .schema(Some(utoipa::openapi::Ref::from_schema_name("Problem")))
        .build()
}

fn retry_after() -> utoipa::openapi::header::Header {
    HeaderBuilder::new()
        .schema(Some(
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .minimum(Some(1)),
        ))
        .description(Some("Seconds to wait"))
        .build()
}

/// What the HTTP server itself answers, without a problem body.
fn server_answers(operation: &mut Operation) {
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
