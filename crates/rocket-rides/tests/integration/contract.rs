//! The OpenAPI document served is the HTTP contract's table (`rocket_rides::contract`): each
//! operation lists, under each status, exactly the problem types the table gives its route,
//! with `Retry-After` where a row carries one.

use crate::common::TestApp;

use rocket_rides::contract::{RetryAfter, Routes, FAILURES};
use sqlx::PgPool;

#[testdb::test(template = crate::common::migrated)]
async fn the_openapi_document_lists_each_operations_failures_from_the_contract(pool: PgPool) {
    let app = TestApp::start(pool).await;
    let doc = app.get("unused", "/openapi.json").await.json();
    let operations = [
        (
            "post",
            "/rides",
            &[
                Routes::Booking,
                Routes::Rides,
                Routes::WithBody,
                Routes::Every,
            ][..],
        ),
        (
            "get",
            "/rides/{id}",
            &[Routes::Read, Routes::Rides, Routes::Every][..],
        ),
        ("get", "/healthz", &[Routes::Every][..]),
    ];
    for (method, path, routes) in operations {
        let responses = &doc["paths"][path][method]["responses"];
        for failure in &FAILURES {
            let answered = routes.contains(&failure.routes);
            let response = &responses[failure.status.to_string()];
            let described = response["description"]
                .as_str()
                .is_some_and(|d| d.contains(&format!("`{}`", failure.kind)));
            assert_eq!(
                described, answered,
                "{method} {path}: {} under {}",
                failure.kind, failure.status
            );
            if answered && failure.retry_after != RetryAfter::None {
                assert!(
                    response["headers"]["Retry-After"].is_object(),
                    "{method} {path}: {} without Retry-After",
                    failure.status
                );
            }
        }
    }
}
