//! `POST /rides` end to end: a real Rocket Rides and a real fakestripe on loopback, over a fresh
//! PostgreSQL database per test.

use crate::common;

use std::sync::Arc;

use common::{Reply, TestApp, RIDE};
use fakestripe::Faults;
use idempotency::Claim;
use idempotency_axum::problem::types as key_types;
use rocket_rides::booking::Booking;
use rocket_rides::failpoints;
use rocket_rides::problem::types;
use serde_json::{json, Value};
use sqlx::PgPool;

const OTHER_AMOUNT: &str = r#"{"origin_lat": 37.77, "origin_lon": -122.42, "target_lat": 37.80, "target_lon": -122.27, "amount_cents": 2500}"#;

async fn app_with_user(pool: PgPool) -> (TestApp, i64, String) {
    let app = TestApp::start(pool).await;
    let (id, api_key) = app.user("rider@example.com", "tok_visa").await;
    (app, id, api_key)
}

/// Exactly one ride, paid, whose charge exists at the gateway for the same amount.
async fn assert_one_paid_ride(app: &TestApp) {
    assert_eq!(app.rides().await, 1, "rides");
    assert_eq!(app.charges().await, 1, "gateway charges");
    let matching = app
        .count(
            "SELECT count(*) FROM rides r JOIN fakestripe.charges c ON c.id = r.charge_id
             WHERE r.status = 'paid' AND c.amount = r.amount_cents",
        )
        .await;
    assert_eq!(
        matching, 1,
        "the ride is paid by a gateway charge of its amount"
    );
}

#[testdb::test(template = crate::common::migrated)]
async fn a_new_key_books_a_ride_and_charges_once(pool: PgPool) {
    let (app, _, api_key) = app_with_user(pool).await;
    let reply = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert!(!reply.replayed());
    let ride = reply.json();
    assert_eq!(
        reply.header("location"),
        Some(format!("/rides/{}", ride["ride_id"]).as_str())
    );
    assert_eq!(ride["amount_cents"], 2000);
    assert!(ride["charge_id"].as_str().unwrap().starts_with("ch_"));
    assert_one_paid_ride(&app).await;
    // The receipt job was staged with the final phase.
    assert_eq!(app.count("SELECT count(*) FROM staged_jobs").await, 1);
    let audit = app
        .count(
            "SELECT count(*) FROM audit_records WHERE action IN ('ride.created', 'ride.charged')",
        )
        .await;
    assert_eq!(audit, 2);
}

#[testdb::test(template = crate::common::migrated)]
async fn replay_returns_stored_status_headers_and_body_byte_for_byte(pool: PgPool) {
    let (app, _, api_key) = app_with_user(pool).await;
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    let again = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("location"), first.header("location"));
    assert_eq!(again.header("content-type"), Some("application/json"));
    assert_one_paid_ride(&app).await;
}

#[testdb::test(template = crate::common::migrated)]
async fn same_json_with_other_key_order_and_whitespace_replays(pool: PgPool) {
    let (app, _, api_key) = app_with_user(pool).await;
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    // Another member order, other whitespace, `37.8` for `37.80`: the same JSON value.
    let reordered = "{\n  \"amount_cents\" : 2000, \"target_lon\": -122.27,\"target_lat\":37.8,\n \"origin_lon\": -122.42, \"origin_lat\": 37.77 }";
    let again = app
        .post_ride(Some(&api_key), Some("\"k-1\""), reordered)
        .await;
    assert_eq!(again.status, 201);
    assert!(
        again.replayed(),
        "the quoted key and the reordered body are the same request"
    );
    assert_eq!(again.body, first.body);
}

#[testdb::test(template = crate::common::migrated)]
async fn another_amount_under_the_same_key_is_refused_with_422_and_changes_nothing(pool: PgPool) {
    let (app, _, api_key) = app_with_user(pool).await;
    app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    let reply = app
        .post_ride(Some(&api_key), Some("k-1"), OTHER_AMOUNT)
        .await;
    assert_eq!(reply.status, 422);
    assert_eq!(reply.problem_type(), key_types::KEY_REUSED);
    assert_one_paid_ride(&app).await;
    assert_eq!(app.keys().await, 1);
}

#[testdb::test(template = crate::common::migrated)]
async fn the_same_key_from_two_users_books_two_rides_and_each_sees_only_their_own(pool: PgPool) {
    let app = TestApp::start(pool).await;
    let (_, alice) = app.user("alice@example.com", "tok_visa").await;
    let (_, bob) = app.user("bob@example.com", "tok_visa").await;
    let a = app.post_ride(Some(&alice), Some("shared-key"), RIDE).await;
    let b = app.post_ride(Some(&bob), Some("shared-key"), RIDE).await;
    assert_eq!((a.status, b.status), (201, 201));
    assert!(!b.replayed());
    assert_ne!(a.json()["ride_id"], b.json()["ride_id"]);
    assert_eq!(app.rides().await, 2);
    assert_eq!(app.charges().await, 2);

    let location = a.header("location").unwrap();
    let own = app.get(&alice, location).await;
    assert_eq!(own.status, 200);
    assert_eq!(own.json()["ride_id"], a.json()["ride_id"]);
    let foreign = app.get(&bob, location).await;
    assert_eq!(foreign.status, 404);
    assert_eq!(foreign.problem_type(), types::NOT_FOUND);
    assert_eq!(app.get(&alice, "/rides/999999").await.status, 404);
    assert_eq!(app.get(&alice, "/rides/not-a-number").await.status, 404);
}

#[testdb::test(template = crate::common::migrated)]
async fn a_missing_or_malformed_key_is_400_and_writes_nothing(pool: PgPool) {
    let (app, _, api_key) = app_with_user(pool).await;
    let missing = app.post_ride(Some(&api_key), None, RIDE).await;
    assert_eq!(missing.status, 400);
    assert_eq!(missing.problem_type(), key_types::KEY_MISSING);
    let too_long = "k".repeat(256);
    for bad in ["", "\"unterminated", "has space", too_long.as_str()] {
        let reply = app.post_ride(Some(&api_key), Some(bad), RIDE).await;
        assert_eq!(reply.status, 400, "key {bad:?}");
        assert_eq!(reply.problem_type(), key_types::KEY_INVALID);
    }
    assert_eq!(app.keys().await, 0);
    assert_eq!(app.rides().await, 0);
}

#[testdb::test(template = crate::common::migrated)]
async fn bad_json_or_out_of_range_fields_are_400_naming_the_field_and_write_no_key(pool: PgPool) {
    let (app, _, api_key) = app_with_user(pool).await;
    let not_json = app
        .post_ride(Some(&api_key), Some("k-1"), "{not json")
        .await;
    assert_eq!(not_json.status, 400);
    assert_eq!(not_json.problem_type(), types::BAD_JSON);

    let out_of_range = r#"{"origin_lat": 91, "origin_lon": -122.42, "target_lat": 37.80, "target_lon": -181, "amount_cents": 10}"#;
    let reply = app
        .post_ride(Some(&api_key), Some("k-1"), out_of_range)
        .await;
    assert_eq!(reply.status, 400);
    assert_eq!(reply.problem_type(), types::VALIDATION);
    let fields: Vec<Value> = reply.json()["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["field"].clone())
        .collect();
    assert_eq!(
        fields,
        [
            json!("origin_lat"),
            json!("target_lon"),
            json!("amount_cents")
        ]
    );

    let missing_field = r#"{"origin_lat": 1, "origin_lon": 1, "target_lat": 1, "target_lon": 1}"#;
    let reply = app
        .post_ride(Some(&api_key), Some("k-1"), missing_field)
        .await;
    assert_eq!(reply.status, 400);
    assert_eq!(reply.json()["errors"][0]["field"], "amount_cents");

    assert_eq!(app.keys().await, 0, "no key row for bad input");
    // The key is still free for a good request.
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        201
    );
}

#[testdb::test(template = crate::common::migrated)]
async fn a_missing_or_unknown_api_key_is_401(pool: PgPool) {
    let (app, _, _) = app_with_user(pool).await;
    let none = app.post_ride(None, Some("k-1"), RIDE).await;
    assert_eq!(none.status, 401);
    assert_eq!(none.problem_type(), types::UNAUTHORIZED);
    let unknown = app.post_ride(Some("rr_test_0000"), Some("k-1"), RIDE).await;
    assert_eq!(unknown.status, 401);
    assert_eq!(app.keys().await, 0);
}

#[testdb::test(template = crate::common::migrated)]
async fn sixteen_concurrent_requests_with_one_key_make_one_ride_and_one_charge(pool: PgPool) {
    let (app, _, api_key) = app_with_user(pool).await;
    let app = Arc::new(app);
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (app, api_key, barrier) = (app.clone(), api_key.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            app.post_ride(Some(&api_key), Some("race"), RIDE).await
        }));
    }
    let mut first = Vec::new();
    for task in tasks {
        let reply = task.await.unwrap();
        match reply.status {
            201 if !reply.replayed() => first.push(reply),
            201 => {}
            409 => {
                assert_eq!(reply.problem_type(), key_types::KEY_IN_FLIGHT);
                let after: u64 = reply.header("retry-after").unwrap().parse().unwrap();
                assert!((1..=30).contains(&after), "Retry-After {after}");
            }
            // Sixteen at once are more than the admission gate takes (the test pool's five
            // connections): one that found no slot in time was refused before its claim.
            503 => assert_eq!(reply.problem_type(), types::OVER_CAPACITY),
            other => panic!("unexpected {other}: {reply:?}"),
        }
    }
    assert_eq!(first.len(), 1, "exactly one request did the work");
    assert_one_paid_ride(&app).await;
    // Every replay of the winner is the winner's answer.
    let replay = app.post_ride(Some(&api_key), Some("race"), RIDE).await;
    assert_eq!(replay.body, first[0].body);
}

/// A request that dies right after `point` leaves the key at `expected`; the client's retry is
/// refused while the dead request's lease lasts, then resumes and finishes with one charge.
async fn crash_then_resume(pool: PgPool, point: &'static str, expected: &str) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    app.state.failpoints.arm(point);
    let crashed = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(crashed.status, 500);
    assert_eq!(app.recovery_point(user_id).await, expected);

    let early = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(early.status, 409, "the dead request's lease still holds");
    assert!(early.header("retry-after").is_some());

    app.expire_leases();
    let resumed = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(resumed.status, 201, "{resumed:?}");
    assert_one_paid_ride(&app).await;
    assert_eq!(app.count("SELECT count(*) FROM staged_jobs").await, 1);
    let replay = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, resumed.body);
}

#[testdb::test(template = crate::common::migrated)]
async fn a_request_that_died_after_creating_the_ride_is_resumed_by_a_retry(pool: PgPool) {
    crash_then_resume(pool, failpoints::AFTER_RIDE_CREATED, "ride_created").await;
}

#[testdb::test(template = crate::common::migrated)]
async fn a_request_that_died_after_the_gateway_charged_gets_that_charge_on_retry(pool: PgPool) {
    crash_then_resume(pool, failpoints::AFTER_GATEWAY_CHARGE, "ride_created").await;
}

#[testdb::test(template = crate::common::migrated)]
async fn a_key_an_earlier_version_left_at_charge_created_finishes_with_its_charge(pool: PgPool) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    app.state.failpoints.arm(failpoints::AFTER_GATEWAY_CHARGE);
    let crashed = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(crashed.status, 500);
    app.as_left_at_charge_created("k-1").await;
    let charge_id: String = sqlx::query_scalar("SELECT charge_id FROM rides")
        .fetch_one(&app.pool)
        .await
        .unwrap();

    app.expire_leases();
    let resumed = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(resumed.status, 201, "{resumed:?}");
    assert_eq!(resumed.json()["charge_id"], charge_id.as_str());
    assert_eq!(app.recovery_point(user_id).await, "finished");
    assert_one_paid_ride(&app).await;
    assert_eq!(app.count("SELECT count(*) FROM staged_jobs").await, 1);
}

#[testdb::test(template = crate::common::migrated)]
async fn a_request_that_died_after_finishing_is_replayed_without_waiting(pool: PgPool) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    app.state.failpoints.arm(failpoints::AFTER_FINISHED);
    let crashed = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(crashed.status, 500);
    assert_eq!(app.recovery_point(user_id).await, "finished");
    // The response was stored with the final phase: the retry replays it at once.
    let retry = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_one_paid_ride(&app).await;
}

#[testdb::test(template = crate::common::migrated)]
async fn a_stale_holder_is_fenced_out_and_the_new_holder_finishes_alone(pool: PgPool) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    // A claims and stalls (a long GC pause, a partitioned host) until its lease expires.
    let Claim::Acquired(stale) = app.claim(user_id, "k-1").await else {
        panic!("A should acquire");
    };
    app.expire_leases();
    // B, the client's retry, takes the key over, creates the ride and stalls there in turn
    // (its lease is live: the key is not finished, so only the token tells A and B apart).
    app.state.failpoints.arm(failpoints::AFTER_RIDE_CREATED);
    let b = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(b.status, 500);
    // B resumed A's key from `started` (as an earlier version's claim left it) and created the
    // ride in a phase of its own.
    assert_eq!(app.recovery_point(user_id).await, "ride_created");
    // A wakes up and runs its phases: the first fenced update refuses it, before any write.
    let booking = Arc::new(Booking::new(app.state.clone()));
    let outcome = app.state.store.resume(&booking, stale).await;
    assert_eq!(outcome, idempotency::Outcome::Lost);
    assert_eq!(app.rides().await, 1);
    // Once B's lease is over too, the client's next retry finishes the one ride.
    app.expire_leases();
    let c = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(c.status, 201);
    assert_one_paid_ride(&app).await;
}

#[testdb::test(template = crate::common::migrated)]
async fn a_declined_card_is_a_stored_402_that_replays(pool: PgPool) {
    let app = TestApp::start(pool).await;
    let (_, api_key) = app
        .user("broke@example.com", "tok_chargeCustomerFail")
        .await;
    let declined = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(declined.status, 402, "{declined:?}");
    assert_eq!(declined.problem_type(), types::PAYMENT_DECLINED);
    assert_eq!(declined.json()["decline_code"], "card_declined");
    let again = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(again.status, 402);
    assert!(again.replayed());
    assert_eq!(again.body, declined.body);
    assert_eq!(app.charges().await, 0);
    assert_eq!(
        app.count("SELECT count(*) FROM rides WHERE status = 'declined'")
            .await,
        1
    );
    assert_eq!(
        app.count("SELECT count(*) FROM staged_jobs").await,
        0,
        "no receipt for a decline"
    );
}

/// The gateway fails once in `faults`' way; the client gets 503 with `Retry-After`, the key keeps
/// its recovery point with a free lease, and the immediate retry finishes with one charge.
async fn transient_then_success(pool: PgPool, faults: Faults) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    app.set_faults(faults);
    let failed = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(failed.status, 503, "{failed:?}");
    assert_eq!(failed.problem_type(), types::GATEWAY_UNAVAILABLE);
    assert_eq!(failed.header("retry-after"), Some("1"));
    assert_eq!(app.recovery_point(user_id).await, "ride_created");
    let free = app
        .count("SELECT count(*) FROM idempotency_keys WHERE locked_until IS NULL")
        .await;
    assert_eq!(free, 1, "the lease was released");

    app.set_faults(Faults::default());
    let retry = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed());
    assert_one_paid_ride(&app).await;
}

#[testdb::test(template = crate::common::migrated)]
async fn a_gateway_error_before_charging_is_a_503_and_the_retry_charges_once(pool: PgPool) {
    transient_then_success(
        pool,
        Faults {
            fail_before_charge: 1.0,
            ..Faults::default()
        },
    )
    .await;
}

#[testdb::test(template = crate::common::migrated)]
async fn charged_then_500_is_a_503_and_the_retry_gets_the_same_charge(pool: PgPool) {
    transient_then_success(
        pool,
        Faults {
            fail_after_charge: 1.0,
            ..Faults::default()
        },
    )
    .await;
}

#[testdb::test(template = crate::common::migrated)]
async fn charged_then_dropped_connection_is_a_503_and_the_retry_gets_the_same_charge(pool: PgPool) {
    transient_then_success(
        pool,
        Faults {
            drop_after_charge: 1.0,
            ..Faults::default()
        },
    )
    .await;
}

#[testdb::test(template = crate::common::migrated)]
async fn a_gateway_409_in_flight_is_a_503_and_the_retry_charges_once(pool: PgPool) {
    transient_then_success(
        pool,
        Faults {
            conflict_in_flight: 1.0,
            ..Faults::default()
        },
    )
    .await;
}

#[testdb::test(template = crate::common::migrated)]
async fn an_unreachable_gateway_is_a_503_and_the_retry_charges_once(pool: PgPool) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    // A second service whose gateway address refuses connections (nothing listens there).
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let gateway = rocket_rides::config::GatewayArgs {
        stripe_api_base: dead,
        ..Default::default()
    };
    let broken = rocket_rides::app::AppState::new(
        app.pool.clone(),
        Arc::new(app.clock.clone()),
        &gateway,
        &rocket_rides::config::LeaseArgs {
            lease_ttl: common::TTL,
            ..Default::default()
        },
    )
    .unwrap();
    let router = rocket_rides::app::router(broken);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(rocket_rides::app::serve(
        listener,
        router,
        Default::default(),
        Default::default(),
        std::future::pending(),
    ));

    let failed = app
        .http
        .post(format!("{base}/rides"))
        .bearer_auth(&api_key)
        .header("idempotency-key", "k-1")
        .header("content-type", "application/json")
        .body(RIDE)
        .send()
        .await
        .unwrap();
    assert_eq!(failed.status(), 503);
    assert_eq!(app.recovery_point(user_id).await, "ride_created");
    let retry = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(retry.status, 201);
    assert_one_paid_ride(&app).await;
}

#[testdb::test(template = crate::common::migrated)]
async fn the_database_itself_refuses_a_second_ride_per_key_a_charge_on_two_rides_and_another_owner(
    pool: PgPool,
) {
    // The code never tries this; the constraints are the last line of defence if it ever did.
    let (app, _, api_key) = app_with_user(pool).await;
    let reply = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    let ride_id = reply.json()["ride_id"].as_i64().unwrap();
    let same_key = "INSERT INTO rides (user_id, key_owner, idempotency_key_id, origin_lat,
                                       origin_lon, target_lat, target_lon, amount_cents)
                    SELECT user_id, key_owner, idempotency_key_id, 0, 0, 0, 0, 100
                    FROM rides WHERE id = $1";
    let same_charge = "INSERT INTO rides (user_id, key_owner, charge_id, status, origin_lat,
                                          origin_lon, target_lat, target_lon, amount_cents)
                       SELECT user_id, key_owner, charge_id, 'paid', 0, 0, 0, 0, 100
                       FROM rides WHERE id = $1";
    // A ride cannot name its key under another owner than its user.
    let other_owner = "UPDATE rides SET key_owner = (user_id + 1)::text WHERE id = $1";
    for (sql, constraint) in [
        (same_key, "rides_idempotency_key_unique"),
        (same_charge, "rides_charge_id_key"),
        (other_owner, "rides_key_owner_is_the_user"),
    ] {
        let err = sqlx::query(sql)
            .bind(ride_id)
            .execute(&app.pool)
            .await
            .unwrap_err();
        let db = err.as_database_error().unwrap_or_else(|| panic!("{err}"));
        assert_eq!(db.constraint(), Some(constraint), "{err}");
    }
    assert_eq!(app.rides().await, 1);
}

#[testdb::test(template = crate::common::migrated)]
async fn a_gateway_that_times_out_after_charging_is_a_503_and_the_retry_gets_that_charge(
    pool: PgPool,
) {
    // The story this project exists for: the gateway charges, but too slowly; we give up waiting.
    let gateway = rocket_rides::config::GatewayArgs {
        gateway_timeout: std::time::Duration::from_millis(300),
        gateway_connect_timeout: std::time::Duration::from_millis(300),
        ..Default::default()
    };
    let app = TestApp::start_with(pool, gateway).await;
    let (user_id, api_key) = app.user("rider@example.com", "tok_visa").await;
    // The gateway holds the charge past our timeout and commits it after we gave up.
    app.gateway.hold_charges();
    let timed_out = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(timed_out.status, 503, "{timed_out:?}");
    assert_eq!(app.recovery_point(user_id).await, "ride_created");

    // The gateway finishes the charge on its own; the client's retries (409 at the gateway while
    // it runs, then its replay) end with the charge it made, not a second one.
    app.gateway.release_charges();
    let done = app.post_until_final(&api_key, "k-1", RIDE).await;
    assert_eq!(done.status, 201, "{done:?}");
    assert_one_paid_ride(&app).await;
}

#[testdb::test(template = crate::common::migrated)]
async fn metrics_count_claims_charges_and_answers_by_route_template(pool: PgPool) {
    let (app, _, api_key) = app_with_user(pool).await;
    app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    app.post_ride(Some(&api_key), Some("k-1"), OTHER_AMOUNT)
        .await;
    let location = app.post_ride(Some(&api_key), Some("k-2"), RIDE).await;
    app.get(&api_key, location.header("location").unwrap())
        .await;

    let scrape = app
        .http
        .get(format!("{}/metrics", app.metrics_base))
        .send()
        .await
        .unwrap();
    assert_eq!(
        scrape.headers()["content-type"],
        rocket_rides::metrics::CONTENT_TYPE
    );
    let text = scrape.text().await.unwrap();
    for line in [
        "idempotency_claims_total{outcome=\"acquired\"} 2",
        "idempotency_claims_total{outcome=\"replayed\"} 1",
        "idempotency_claims_total{outcome=\"mismatch\"} 1",
        "gateway_charges_total{outcome=\"charged\"} 2",
        "http_requests_total{method=\"POST\",route=\"/rides\",status=\"201\"} 3",
        "http_requests_total{method=\"POST\",route=\"/rides\",status=\"422\"} 1",
        // The route template, not the ride's path: ids never become labels.
        "http_requests_total{method=\"GET\",route=\"/rides/{id}\",status=\"200\"} 1",
        "idempotency_keys_unfinished 0",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
}

#[testdb::test(template = crate::common::migrated)]
async fn the_openapi_document_describes_the_routes_the_server_has(pool: PgPool) {
    let (app, _, _) = app_with_user(pool).await;
    let doc = app.get("unused", "/openapi.json").await.json();
    assert_eq!(doc["openapi"], "3.1.0");
    let amount = &doc["components"]["schemas"]["RideRequest"]["properties"]["amount_cents"];
    assert_eq!(amount["minimum"], rocket_rides::ride::MIN_AMOUNT_CENTS);
    assert_eq!(amount["maximum"], rocket_rides::ride::MAX_AMOUNT_CENTS);
    let paths = doc["paths"].as_object().unwrap();
    // /rides, /rides/{id}, /healthz, /readyz, /openapi.json; /metrics is on its own listener.
    assert_eq!(paths.len(), 5);
    for (path, operations) in paths {
        for method in operations.as_object().unwrap().keys() {
            let url = format!("{}{}", app.base, path.replace("{id}", "1"));
            let reply = match method.as_str() {
                "get" => app.http.get(url).send().await.unwrap(),
                "post" => app.http.post(url).send().await.unwrap(),
                other => panic!("unexpected method {other}"),
            };
            // Unauthenticated: 401 where a key is needed, 200 elsewhere; never "no such route".
            assert_ne!(
                reply.status(),
                404,
                "{method} {path} is documented but not routed"
            );
            assert_ne!(
                reply.status(),
                405,
                "{method} {path} is documented but not routed"
            );
        }
    }
}

#[testdb::test(template = crate::common::migrated)]
async fn an_oversized_body_is_a_413_problem_and_writes_no_key(pool: PgPool) {
    let (app, _, api_key) = app_with_user(pool).await;
    let padding = " ".repeat(rocket_rides::config::MAX_BODY_BYTES);
    let reply = app
        .post_ride(Some(&api_key), Some("k-1"), &format!("{RIDE}{padding}"))
        .await;
    assert_eq!(reply.status, 413);
    assert_eq!(reply.problem_type(), types::BODY_TOO_LARGE);
    assert_eq!(app.keys().await, 0);
}

#[testdb::test(template = crate::common::migrated)]
async fn a_client_that_hangs_up_mid_request_does_not_leave_its_key_locked(pool: PgPool) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    app.gateway.hold_charges();
    // The client gives up after 300 ms, while the gateway call is under way.
    let impatient = reqwest::Client::builder()
        .timeout(std::time::Duration::from_millis(300))
        .build()
        .unwrap();
    let gone = impatient
        .post(format!("{}/rides", app.base))
        .bearer_auth(&api_key)
        .header("idempotency-key", "k-1")
        .header("content-type", "application/json")
        .body(RIDE)
        .send()
        .await;
    assert!(gone.is_err(), "the client timed out");
    app.gateway.release_charges();
    // The server finishes the request anyway, within the gateway's latency rather than after a
    // lease TTL (30 s) of a key locked by nobody; the retry then replays it.
    app.wait_for_point(user_id, "finished").await;
    let done = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(done.status, 201, "{done:?}");
    assert!(done.replayed());
    assert_one_paid_ride(&app).await;
}

#[testdb::test(template = crate::common::migrated)]
async fn a_key_older_than_the_retention_books_anew_whatever_the_reaper_did(pool: PgPool) {
    let (mut app, _, api_key) = app_with_user(pool).await;
    // The API with its --key-retention, as `serve` runs it.
    let retention = std::time::Duration::from_secs(24 * 3600);
    let state = app.state.clone().with_key_retention(retention).unwrap();
    let (base, _stop) = common::spawn(rocket_rides::app::router(state)).await;
    app.base = base;
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(first.status, 201, "{first:?}");
    app.clock
        .advance(retention - std::time::Duration::from_secs(1));
    let within = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert!(within.replayed(), "within the retention the key replays");
    assert_eq!(within.body, first.body);
    // Past it, with the key still in the table (no reaper ran): a new request, a new ride.
    app.clock.advance(std::time::Duration::from_secs(2));
    let anew = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(anew.status, 201, "{anew:?}");
    assert!(!anew.replayed(), "an expired key is a new request");
    assert_ne!(anew.json()["ride_id"], first.json()["ride_id"]);
    assert_eq!((app.rides().await, app.charges().await), (2, 2));
    // The first ride stays, paid, its reference to the deleted key cleared.
    let kept = app
        .count("SELECT count(*) FROM rides WHERE status = 'paid' AND idempotency_key_id IS NULL")
        .await;
    assert_eq!(kept, 1);
    // And the new key replays in its turn.
    let again = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert!(again.replayed());
    assert_eq!(again.body, anew.body);
}

#[testdb::test(template = crate::common::migrated)]
async fn a_rotated_api_key_is_refused_once_its_cached_look_up_expires(pool: PgPool) {
    use rocket_rides::auth::cache::DEFAULT_API_KEY_CACHE_TTL;

    let app = TestApp::start(pool).await;
    let (alice, old_key) = app.user("alice@example.com", "tok_visa").await;
    let (bob, bob_key) = app.user("bob@example.com", "tok_visa").await;
    // Both keys looked up and cached; each still books for its own user.
    for (key, idem) in [(&old_key, "k-1"), (&bob_key, "k-2"), (&old_key, "k-3")] {
        let reply = app.post_ride(Some(key), Some(idem), RIDE).await;
        assert_eq!(reply.status, 201, "{reply:?}");
    }
    let per_user =
        |user: i64| app.count_owned(format!("SELECT count(*) FROM rides WHERE user_id = {user}"));
    assert_eq!((per_user(alice).await, per_user(bob).await), (2, 1));

    let rotated = rocket_rides::users::rotate_api_key(&app.state.store, "alice@example.com")
        .await
        .unwrap();
    assert_eq!(rotated.id, alice);
    // The new key works at once: it was never looked up, so nothing cached stands in its way.
    let reply = app
        .post_ride(Some(&rotated.api_key), Some("k-4"), RIDE)
        .await;
    assert_eq!(reply.status, 201, "{reply:?}");
    // The old one keeps working for the cache's TTL at most, as its own user only.
    app.clock
        .advance(DEFAULT_API_KEY_CACHE_TTL - std::time::Duration::from_millis(1));
    let stale = app.post_ride(Some(&old_key), Some("k-5"), RIDE).await;
    assert_eq!(stale.status, 201, "{stale:?}");
    assert_eq!((per_user(alice).await, per_user(bob).await), (4, 1));
    app.clock.advance(std::time::Duration::from_millis(1));
    let refused = app.post_ride(Some(&old_key), Some("k-6"), RIDE).await;
    assert_eq!(refused.status, 401, "{refused:?}");
    assert_eq!(refused.problem_type(), types::UNAUTHORIZED);
    // Refused keys are not remembered as refusals either: the moment a key is stored it works.
    let unknown = rocket_rides::auth::generate_api_key();
    let reply = app.post_ride(Some(&unknown), Some("k-7"), RIDE).await;
    assert_eq!(reply.status, 401, "{reply:?}");
    sqlx::query("UPDATE users SET api_key_hash = $1 WHERE id = $2")
        .bind(rocket_rides::auth::hash_api_key(&unknown).as_slice())
        .bind(bob)
        .execute(&app.pool)
        .await
        .unwrap();
    let reply = app.post_ride(Some(&unknown), Some("k-7"), RIDE).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert_eq!((per_user(alice).await, per_user(bob).await), (4, 2));
}

#[testdb::test(template = crate::common::migrated)]
async fn users_rotate_key_prints_a_new_key_and_refuses_an_unknown_email(pool: PgPool) {
    let app = TestApp::start(pool).await;
    let (alice, old_key) = app.user("alice@example.com", "tok_visa").await;
    let url = common::url_of(&app.pool).await;
    let rotate = |email: &str| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_rocket-rides"))
            .args(["users", "rotate-key", "--email", email])
            .env("DATABASE_URL", &url)
            .env("RUST_LOG", "off")
            .output()
    };
    let hashes = || async {
        let rows: Vec<(i64, Vec<u8>)> = sqlx::query_as("SELECT id, api_key_hash FROM users")
            .fetch_all(&app.pool)
            .await
            .unwrap();
        rows
    };
    let before = hashes().await;
    let refused = rotate("nobody@example.com").await.unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("no user with email \"nobody@example.com\" has an API key"),
        "{stderr}"
    );
    assert_eq!(hashes().await, before, "a refused rotation wrote nothing");

    let rotated = rotate("alice@example.com").await.unwrap();
    assert!(
        rotated.status.success(),
        "{}",
        String::from_utf8_lossy(&rotated.stderr)
    );
    let printed: Value = serde_json::from_slice(&rotated.stdout).unwrap();
    assert_eq!(printed["id"], alice);
    let new_key = printed["api_key"].as_str().unwrap();
    assert_ne!(new_key, old_key);
    let stored = rocket_rides::auth::hash_api_key(new_key).to_vec();
    assert_eq!(hashes().await, vec![(alice, stored)]);
    // This service never looked the old key up, so it is refused at once.
    let reply = app.post_ride(Some(&old_key), Some("k-1"), RIDE).await;
    assert_eq!(reply.status, 401, "{reply:?}");
    let reply = app.post_ride(Some(new_key), Some("k-1"), RIDE).await;
    assert_eq!(reply.status, 201, "{reply:?}");
}

#[testdb::test(template = crate::common::migrated)]
async fn a_duplicate_that_prefers_to_wait_gets_the_holders_answer_replayed(pool: PgPool) {
    let app = TestApp::start(pool).await;
    let (user_id, api_key) = app.user("wait@example.com", "tok_visa").await;
    // Another holder has the key (a request still at work).
    let Claim::Acquired(mut lease) = app.claim(user_id, "k-wait").await else {
        panic!("a new key is acquired");
    };
    let in_flight = r#"idempotency_claims_total{outcome="in_flight"}"#;
    let before = app.metric(in_flight).await;
    let waiter = {
        let request = app
            .http
            .post(format!("{}/rides", app.base))
            .header("content-type", "application/json")
            .header("idempotency-key", "k-wait")
            .header("prefer", "wait=10")
            .bearer_auth(&api_key)
            .body(RIDE);
        tokio::spawn(async move { Reply::read(request.send().await.unwrap()).await })
    };
    // Once the waiter has found the key held, the holder answers.
    while app.metric(in_flight).await < before + 1.0 {
        tokio::task::yield_now().await;
    }
    let answer = idempotency::StoredResponse::json(
        201,
        &serde_json::json!({"ride_id": 7}),
        vec![("location".to_owned(), "/rides/7".to_owned())],
    );
    app.state
        .store
        .final_phase(&mut lease)
        .await
        .unwrap()
        .finish(&answer)
        .await
        .unwrap();
    let reply = waiter.await.unwrap();
    assert_eq!(reply.status, 201);
    assert_eq!(reply.headers["idempotent-replayed"], "true");
    assert_eq!(reply.headers["location"], "/rides/7");
    assert_eq!(reply.body, answer.body);
    assert_eq!(app.rides().await, 0, "the waiter booked nothing of its own");
}

#[testdb::test(template = crate::common::migrated)]
async fn a_booking_given_up_at_shutdown_hands_its_key_back_and_charges_nothing(pool: PgPool) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    // A request that died after creating its ride, its lease over.
    app.state.failpoints.arm(failpoints::AFTER_RIDE_CREATED);
    let crashed = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(crashed.status, 500);
    app.expire_leases();
    let Claim::Acquired(lease) = app.claim(user_id, "k-1").await else {
        panic!("the expired key is claimable");
    };
    // The process is past its shutdown deadline.
    let shutdown = rocket_rides::shutdown::Shutdown::new();
    let mut state = app.state.clone();
    state.giving_up = shutdown.giving_up();
    let mut given_up = shutdown.giving_up();
    tokio::spawn(shutdown.run(std::future::ready(()), std::time::Duration::ZERO));
    given_up.wait().await;
    let booking = Arc::new(Booking::new(state));
    let outcome = app.state.store.resume(&booking, lease).await;
    let idempotency::Outcome::RetryLater { kind, .. } = outcome else {
        panic!("expected a retry later, got {outcome:?}");
    };
    assert_eq!(kind, types::SHUTTING_DOWN);
    assert_eq!(app.charges().await, 0);
    // Handed back at its point: the client's retry resumes it at once and books the ride.
    assert_eq!(app.recovery_point(user_id).await, "ride_created");
    let retry = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_one_paid_ride(&app).await;
}
