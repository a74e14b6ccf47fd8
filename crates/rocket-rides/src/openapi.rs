//! `GET /openapi.json`: the HTTP contract as an OpenAPI 3.1 document.
//!
//! Written by hand from the same constants the handlers use (bounds, problem types), so that a
//! bound changed in code changes here too; a test checks the document against the router.

use serde_json::{json, Value};

use crate::problem::types;
use crate::ride::{MAX_AMOUNT_CENTS, MIN_AMOUNT_CENTS};

/// The document.
pub fn spec() -> Value {
    let problem = |description: &str| {
        json!({
            "description": description,
            "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
        })
    };
    let retry_after = json!({
        "Retry-After": {"description": "Seconds to wait before retrying with the same key.",
                        "schema": {"type": "integer", "minimum": 1}}
    });
    let coordinate = |bound: i64| json!({"type": "number", "minimum": -bound, "maximum": bound});
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Rocket Rides",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Book a ride and charge a card, effectively once per Idempotency-Key."
        },
        "components": {
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
            "parameters": {
                "IdempotencyKey": {
                    "name": "Idempotency-Key", "in": "header", "required": true,
                    "description": "1 to 255 visible ASCII characters, as a Structured Field string (\"...\") or bare.",
                    "schema": {"type": "string", "minLength": 1, "maxLength": 257}
                }
            },
            "schemas": {
                "RideRequest": {
                    "type": "object",
                    "additionalProperties": false,
                    "required": ["origin_lat", "origin_lon", "target_lat", "target_lon", "amount_cents"],
                    "properties": {
                        "origin_lat": coordinate(90), "origin_lon": coordinate(180),
                        "target_lat": coordinate(90), "target_lon": coordinate(180),
                        "amount_cents": {"type": "integer", "minimum": MIN_AMOUNT_CENTS, "maximum": MAX_AMOUNT_CENTS}
                    }
                },
                "Ride": {
                    "type": "object",
                    "required": ["ride_id", "amount_cents", "charge_id", "status", "origin_lat", "origin_lon",
                                 "target_lat", "target_lon", "created_at"],
                    "properties": {
                        "ride_id": {"type": "integer"},
                        "amount_cents": {"type": "integer"},
                        "charge_id": {"type": ["string", "null"]},
                        "status": {"enum": ["pending", "paid", "declined"]},
                        "origin_lat": {"type": "number"}, "origin_lon": {"type": "number"},
                        "target_lat": {"type": "number"}, "target_lon": {"type": "number"},
                        "created_at": {"type": "string", "format": "date-time"}
                    }
                },
                "Problem": {
                    "type": "object",
                    "required": ["type", "title", "status"],
                    "properties": {
                        "type": {"type": "string", "examples": [types::VALIDATION, types::PAYMENT_DECLINED]},
                        "title": {"type": "string"},
                        "status": {"type": "integer"},
                        "detail": {"type": "string"},
                        "errors": {"type": "array", "items": {"type": "object",
                                   "properties": {"field": {"type": "string"}, "message": {"type": "string"}}}}
                    }
                }
            }
        },
        "security": [{"apiKey": []}],
        "paths": {
            "/rides": {"post": {
                "summary": "Book a ride and charge the user's card",
                "parameters": [{"$ref": "#/components/parameters/IdempotencyKey"}],
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RideRequest"}}}},
                "responses": {
                    "201": {
                        "description": "Booked and paid. Replays carry Idempotent-Replayed: true.",
                        "headers": {"Location": {"schema": {"type": "string"}},
                                    "Idempotent-Replayed": {"schema": {"const": "true"}}},
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Ride"}}}
                    },
                    "400": problem("Missing or malformed Idempotency-Key, body not JSON, or invalid fields; nothing is written."),
                    "401": problem("Missing or unknown API key."),
                    "402": problem("The card was declined (stored and replayed)."),
                    "409": {"description": "Another request with this key is in progress.", "headers": retry_after.clone(),
                            "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}},
                    "422": problem("The key was used with another payload."),
                    "500": problem("Internal error; retry with the same key."),
                    "503": {"description": "Payment gateway unavailable, or the server shut down; retry with the same key.",
                            "headers": retry_after,
                            "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}}
                }
            }},
            "/rides/{id}": {"get": {
                "summary": "A ride of the caller",
                "parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "integer"}}],
                "responses": {
                    "200": {"description": "The ride.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Ride"}}}},
                    "401": problem("Missing or unknown API key."),
                    "404": problem("No such ride for this user.")
                }
            }},
            "/healthz": {"get": {"summary": "Liveness", "security": [], "responses": {"200": {"description": "Alive."}}}},
            "/readyz": {"get": {"summary": "Readiness: the database answers", "security": [],
                                "responses": {"200": {"description": "Ready."}, "503": {"description": "Database unreachable."}}}},
            "/metrics": {"get": {"summary": "Prometheus counters", "security": [], "responses": {"200": {"description": "Text exposition format."}}}},
            "/openapi.json": {"get": {"summary": "This document", "security": [], "responses": {"200": {"description": "OpenAPI 3.1."}}}}
        }
    })
}
