//! The HTTP face through a real router, with `oneshot`.

use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idempotency::{Claim, OneStep, StoredResponse};
use idempotency_axum::problem::types;
use idempotency_axum::{acquired_or_respond, replayed_response, retry_after_seconds, RequiredKey};
use tower::ServiceExt;

async fn echo_key(RequiredKey(key): RequiredKey) -> String {
    key.as_str().to_owned()
}

async fn call(key: Option<&[u8]>) -> Response {
    let app = Router::new().route("/", post(echo_key));
    let mut request = Request::post("/");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    app.oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap()
}

async fn body(response: Response) -> Vec<u8> {
    response
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .to_vec()
}

async fn problem_type(response: Response) -> String {
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let json: serde_json::Value = serde_json::from_slice(&body(response).await).unwrap();
    json["type"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn both_key_forms_reach_the_handler_unquoted() {
    assert_eq!(body(call(Some(b"abc")).await).await, b"abc");
    assert_eq!(body(call(Some(b"\"abc\"")).await).await, b"abc");
}

#[tokio::test]
async fn a_missing_key_is_a_400_problem() {
    let response = call(None).await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(problem_type(response).await, types::KEY_MISSING);
}

#[tokio::test]
async fn a_malformed_key_is_a_400_problem() {
    for bad in [&b"\"open"[..], b"two words", b"", &[b'k'; 256]] {
        let response = call(Some(bad)).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        assert_eq!(problem_type(response).await, types::KEY_INVALID);
    }
}

#[tokio::test]
async fn two_key_headers_are_refused() {
    let app = Router::new().route("/", post(echo_key));
    let request = Request::post("/")
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(Body::empty())
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(problem_type(response).await, types::KEY_INVALID);
}

#[tokio::test]
async fn a_replay_carries_the_stored_parts_and_the_replayed_header() {
    let stored = StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), "/rides/9".into()),
        ],
        body: b"{\"ride_id\":9}".to_vec(),
    };
    let response = replayed_response(&stored);
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(response.headers()["location"], "/rides/9");
    assert_eq!(response.headers()["content-type"], "application/json");
    assert_eq!(response.headers()["idempotent-replayed"], "true");
    assert_eq!(body(response).await, stored.body);
}

#[tokio::test]
async fn refused_claims_map_to_422_and_409_with_retry_after() {
    let mismatch = acquired_or_respond::<OneStep>(Claim::Mismatch).unwrap_err();
    assert_eq!(mismatch.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(problem_type(mismatch).await, types::KEY_REUSED);

    // A lease with 7 s left: the client is told to come back in 2 s, not 7 (a live holder is
    // done in milliseconds). Less than that left: the time left, rounded up.
    for (left, told) in [(7_000, "2"), (1_200, "2"), (300, "1")] {
        let in_flight = Claim::InFlight {
            retry_after: Duration::from_millis(left),
        };
        let conflict = acquired_or_respond::<OneStep>(in_flight).unwrap_err();
        assert_eq!(conflict.status(), StatusCode::CONFLICT);
        assert_eq!(conflict.headers()["retry-after"], told, "{left} ms left");
        assert_eq!(problem_type(conflict).await, types::KEY_IN_FLIGHT);
    }
}

#[test]
fn retry_after_rounds_up_to_whole_seconds() {
    assert_eq!(retry_after_seconds(Duration::from_millis(1)), 1);
    assert_eq!(retry_after_seconds(Duration::ZERO), 1);
    assert_eq!(retry_after_seconds(Duration::from_millis(2001)), 3);
    assert_eq!(retry_after_seconds(Duration::from_secs(5)), 5);
}
