//! A workflow behind axum: `respond` answers every `Outcome` in one conversion, `Problem` becomes
//! a stored answer with one content type, and a multi-step handler is one call
//! (`idempotency_axum::run`) from the extracted key to the answer, through a real router.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::Response;
use axum::routing::post;
use axum::{Json, Router};
use http::{Request as HttpRequest, StatusCode};
use http_body_util::BodyExt;
use idempotency::{Advance, Halt, Outcome, Owner, Request, Step, Store, StoredResponse, Workflow};
use idempotency_axum::problem::types;
use idempotency_axum::{respond, Problem, RequiredKey, FAILED_DETAIL, IDEMPOTENT_REPLAYED};
use serde_json::{json, Value};
use sqlx::PgPool;
use tower::ServiceExt;

async fn body_json(response: Response) -> Value {
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes).unwrap()
}

/// The status, `Retry-After` and problem type of a refusal.
async fn refusal(outcome: Outcome) -> (StatusCode, Option<String>, String, Value) {
    let response = respond(outcome);
    let status = response.status();
    let retry = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let types: Vec<_> = response.headers().get_all("content-type").iter().collect();
    assert_eq!(types, ["application/problem+json"]);
    let body = body_json(response).await;
    (
        status,
        retry,
        body["type"].as_str().unwrap().to_owned(),
        body,
    )
}

#[tokio::test]
async fn every_outcome_has_one_answer() {
    let stored = StoredResponse::json(
        201,
        &json!({"id": 1}),
        vec![("location".into(), "/t/1".into())],
    );
    let answered = respond(Outcome::Answered(stored.clone()));
    assert_eq!(answered.status(), StatusCode::CREATED);
    assert_eq!(answered.headers()["location"], "/t/1");
    assert!(answered.headers().get(IDEMPOTENT_REPLAYED).is_none());
    let replayed = respond(Outcome::Replayed(stored));
    assert_eq!(replayed.status(), StatusCode::CREATED);
    assert_eq!(replayed.headers()[IDEMPOTENT_REPLAYED], "true");
    assert_eq!(body_json(replayed).await, json!({"id": 1}));

    let (status, retry, kind, _) = refusal(Outcome::Mismatch).await;
    assert_eq!(
        (status, retry, kind.as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, None, types::KEY_REUSED)
    );
    let in_flight = Outcome::InFlight {
        retry_after: Duration::from_secs(30),
    };
    let (status, retry, kind, _) = refusal(in_flight).await;
    assert_eq!(
        (status, retry.as_deref(), kind.as_str()),
        (StatusCode::CONFLICT, Some("2"), types::KEY_IN_FLIGHT),
        "a live holder finishes soon: at most 2 s"
    );
    let later = Outcome::RetryLater {
        retry_after: Duration::from_millis(6500),
        cause: "the notifier at 10.0.0.7 refused".into(),
        kind: idempotency::workflow::kind::RETRY,
    };
    let (status, retry, kind, body) = refusal(later).await;
    assert_eq!(
        (status, retry.as_deref(), kind.as_str()),
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Some("7"),
            types::RETRY_LATER
        )
    );
    assert!(
        !body.to_string().contains("10.0.0.7"),
        "no cause in the body: {body}"
    );
    let (status, _, kind, _) = refusal(Outcome::Lost).await;
    assert_eq!(
        (status, kind.as_str()),
        (StatusCode::CONFLICT, types::LEASE_LOST)
    );
    let failed = Outcome::Failed {
        cause: "relation \"secret_table\" does not exist".into(),
    };
    let (status, retry, kind, body) = refusal(failed).await;
    assert_eq!(
        (status, retry, kind.as_str()),
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            types::REQUEST_FAILED
        )
    );
    assert_eq!(body["detail"], FAILED_DETAIL);
    assert!(
        !body.to_string().contains("secret_table"),
        "no cause in the body: {body}"
    );
}

#[test]
fn a_problem_is_stored_with_one_content_type() {
    let problem = Problem::new(
        StatusCode::PAYMENT_REQUIRED,
        "urn:problem:card-declined",
        "Card declined",
    )
    .with_detail("the card was declined")
    .with_retry_after(Duration::from_secs(3));
    let stored = StoredResponse::from(problem);
    assert_eq!(stored.status, 402);
    assert_eq!(
        stored.headers,
        [(
            "content-type".to_owned(),
            "application/problem+json".to_owned()
        )]
    );
    let body: Value = serde_json::from_slice(&stored.body).unwrap();
    assert_eq!(body["type"], "urn:problem:card-declined");
    assert_eq!(body["detail"], "the card was declined");
}

idempotency::recovery_points! {
    /// One commit before the answer.
    enum Point {
        Counted = "counted",
    }
}

/// Counts each new key once, then answers 201 with the count, or refuses an amount of zero
/// with a stored 422 problem.
struct Count(AtomicUsize);

impl Workflow for Count {
    type Point = Point;

    fn route(&self) -> &str {
        "/counts"
    }

    async fn step(&self, point: Point, step: &mut Step<'_, Point>) -> Result<Advance<Point>, Halt> {
        match point {
            Point::Started => {
                if step.params()["amount"] == 0 {
                    let problem =
                        Problem::new(StatusCode::UNPROCESSABLE_ENTITY, "urn:problem:zero", "Zero");
                    return Err(Halt::fail(problem.into()));
                }
                Ok(Advance::To(Point::Counted))
            }
            Point::Counted => {
                let n = self.0.fetch_add(1, Ordering::SeqCst) + 1;
                Ok(Advance::Finish(StoredResponse::json(
                    201,
                    &json!({"count": n}),
                    vec![],
                )))
            }
            Point::Finished => unreachable!("the driver never steps a finished key"),
        }
    }
}

async fn count(
    State((store, workflow)): State<(Store, Arc<Count>)>,
    RequiredKey(key): RequiredKey,
    Json(body): Json<Value>,
) -> Response {
    let owner = Owner::new("alice").unwrap();
    idempotency_axum::run(&store, &workflow, Request::new(owner, key, body)).await
}

async fn post_count(app: &Router, key: &str, body: Value) -> Response {
    let request = HttpRequest::post("/counts")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    app.clone().oneshot(request).await.unwrap()
}

#[testdb::test(template = crate::migrated)]
async fn a_workflow_handler_is_one_call_from_key_to_answer(pool: PgPool) {
    let store = Store::builder(pool).build().unwrap();
    let workflow = Arc::new(Count(AtomicUsize::new(0)));
    let app = Router::new()
        .route("/counts", post(count))
        .with_state((store, workflow.clone()));
    let first = post_count(&app, "k1", json!({"amount": 5})).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(body_json(first).await, json!({"count": 1}));
    let again = post_count(&app, "k1", json!({"amount": 5})).await;
    assert_eq!(again.headers()[IDEMPOTENT_REPLAYED], "true");
    assert_eq!(body_json(again).await, json!({"count": 1}));
    let swapped = post_count(&app, "k1", json!({"amount": 6})).await;
    assert_eq!(swapped.status(), StatusCode::UNPROCESSABLE_ENTITY);
    // A refusal stored as the answer, replayed with its one content type.
    let zero = post_count(&app, "k2", json!({"amount": 0})).await;
    assert_eq!(zero.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let zero = post_count(&app, "k2", json!({"amount": 0})).await;
    assert_eq!(zero.headers()[IDEMPOTENT_REPLAYED], "true");
    let types: Vec<_> = zero.headers().get_all("content-type").iter().collect();
    assert_eq!(types, ["application/problem+json"]);
    assert_eq!(workflow.0.load(Ordering::SeqCst), 1);
}
