//! Rocket Rides against the gateway as Stripe really behaves: over HTTPS, shared by several
//! databases, forgetting its keys after a window, storing its 500s under them, answering
//! `pending`, and refusing for good. A real Rocket Rides and a real fakestripe on loopback.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{TestApp, TestPki, RIDE, TTL};
use fakestripe::Faults;
use idempotency::DatabaseClock;
use rocket_rides::config::{GatewayArgs, LeaseArgs, DEFAULT_GATEWAY_KEY_WINDOW};
use rocket_rides::failpoints;
use rocket_rides::problem::types;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

const ADOPTED: &str = "gateway_reconciliations_total{outcome=\"adopted\"}";
const NONE_FOUND: &str = "gateway_reconciliations_total{outcome=\"none_found\"}";

async fn app_with_user(pool: PgPool) -> (TestApp, i64, String) {
    let app = TestApp::start(pool).await;
    let (id, api_key) = app.user("rider@example.com", "tok_visa").await;
    (app, id, api_key)
}

/// The ride's (status, charge id, key generation).
async fn ride(app: &TestApp, user_id: i64) -> (String, Option<String>, i32) {
    sqlx::query_as("SELECT status, charge_id, charge_generation FROM rides WHERE user_id = $1")
        .bind(user_id)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// A booking whose charge the gateway made, but whose process died before recording it.
async fn charged_then_crashed(app: &TestApp, api_key: &str) {
    app.state.failpoints.arm(failpoints::AFTER_GATEWAY_CHARGE);
    let crashed = app.post_ride(Some(api_key), Some("k-1"), RIDE).await;
    assert_eq!(crashed.status, 500);
    assert_eq!(app.charges().await, 1, "the gateway charged");
}

#[testdb::test(template = crate::common::migrated)]
async fn every_charge_names_its_request_and_ride_in_its_metadata(pool: PgPool) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    let reply = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    let request = common::request_uuid(&app, user_id).await;
    let metadata: serde_json::Value = sqlx::query_scalar("SELECT metadata FROM fakestripe.charges")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(metadata["rocket_rides_request"], request.as_str());
    assert_eq!(metadata["ride_id"], reply.json()["ride_id"].to_string());
    // The normal path lists nothing.
    assert_eq!(
        app.metric(ADOPTED).await + app.metric(NONE_FOUND).await,
        0.0
    );
}

#[testdb::test(template = crate::common::migrated)]
async fn two_databases_on_one_gateway_account_never_share_a_gateway_key(pool: PgPool) {
    let (app, _, api_key) = app_with_user(pool).await;
    // A second database (staging beside production, a reset development database) whose
    // sequences start over, served by a second Rocket Rides on the same gateway account.
    let name: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    // PostgreSQL cuts names at 63 bytes; sqlx's test names are that long already.
    let other = format!("{}_b", &name[..40]).to_lowercase();
    // A run that failed half-way may have left it behind.
    sqlx::query(&format!("DROP DATABASE IF EXISTS {other} WITH (FORCE)"))
        .execute(&app.pool)
        .await
        .unwrap();
    sqlx::query(&format!("CREATE DATABASE {other}"))
        .execute(&app.pool)
        .await
        .unwrap();
    let url = common::url_of(&app.pool).await.replace(&name, &other);
    let other_pool = PgPoolOptions::new().connect(&url).await.unwrap();
    rocket_rides::db::migrate(&other_pool).await.unwrap();
    let gateway = GatewayArgs {
        stripe_api_base: app.state.stripe.base().to_owned(),
        ..Default::default()
    };
    let lease = LeaseArgs {
        lease_ttl: TTL,
        ..Default::default()
    };
    let other_state = rocket_rides::app::AppState::new(
        other_pool.clone(),
        Arc::new(DatabaseClock),
        &gateway,
        &lease,
    )
    .unwrap();
    let (other_base, _stop) = common::spawn(rocket_rides::app::router(other_state.clone())).await;
    // The same email in both databases: still two customers, two users, two rides.
    let user = rocket_rides::users::create_user(
        &other_pool,
        &other_state.stripe,
        "rider@example.com",
        "tok_visa",
    )
    .await
    .unwrap();

    // Both databases' first key row has id 1; only the UUID tells their requests apart.
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    let second = app
        .http
        .post(format!("{other_base}/rides"))
        .bearer_auth(&user.api_key)
        .header("idempotency-key", "k-1")
        .header("content-type", "application/json")
        .body(RIDE)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(second.status().as_u16(), 201);
    let second: serde_json::Value = serde_json::from_slice(&second.bytes().await.unwrap()).unwrap();
    assert_ne!(first.json()["charge_id"], second["charge_id"]);
    assert_eq!(app.charges().await, 2);
    let customers: i64 = sqlx::query_scalar("SELECT count(*) FROM fakestripe.customers")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(customers, 2, "one customer per database's user");

    other_pool.close().await;
    sqlx::query(&format!("DROP DATABASE {other} WITH (FORCE)"))
        .execute(&app.pool)
        .await
        .unwrap();
}

#[testdb::test(template = crate::common::migrated)]
async fn a_charge_resumed_one_second_inside_the_window_asks_the_gateway_under_the_same_key(
    pool: PgPool,
) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    charged_then_crashed(&app, &api_key).await;
    app.clock
        .advance(DEFAULT_GATEWAY_KEY_WINDOW - Duration::from_secs(1));
    let resumed = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(resumed.status, 201, "{resumed:?}");
    // The gateway still knew the key and answered with the charge it made: no list call.
    assert_eq!(app.charges().await, 1);
    assert_eq!(
        app.metric(ADOPTED).await + app.metric(NONE_FOUND).await,
        0.0
    );
    assert_eq!(ride(&app, user_id).await.2, 1);
}

#[testdb::test(template = crate::common::migrated)]
async fn a_charge_resumed_one_second_past_the_window_is_found_by_listing_not_made_again(
    pool: PgPool,
) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    charged_then_crashed(&app, &api_key).await;
    // Past the window the gateway may have forgotten the key; here it has.
    app.gateway.forget_keys(Duration::ZERO).await.unwrap();
    app.clock
        .advance(DEFAULT_GATEWAY_KEY_WINDOW + Duration::from_secs(1));
    let resumed = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(resumed.status, 201, "{resumed:?}");
    assert_eq!(
        app.charges().await,
        1,
        "the forgotten key was not asked again"
    );
    assert_eq!(app.metric(ADOPTED).await, 1.0);
    let (status, charge_id, generation) = ride(&app, user_id).await;
    assert_eq!((status.as_str(), generation), ("paid", 1));
    assert_eq!(resumed.json()["charge_id"].as_str(), charge_id.as_deref());
    let adopted: bool = sqlx::query_scalar(
        "SELECT (data->>'adopted')::boolean FROM audit_records WHERE action = 'ride.charged'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(adopted, "the audit record says the charge was adopted");
}

#[testdb::test(template = crate::common::migrated)]
async fn past_the_window_with_no_charge_a_new_generation_charges_exactly_once(pool: PgPool) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    app.state.failpoints.arm(failpoints::AFTER_RIDE_CREATED);
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        500
    );
    app.clock
        .advance(DEFAULT_GATEWAY_KEY_WINDOW + Duration::from_secs(1));
    let resumed = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(resumed.status, 201, "{resumed:?}");
    assert_eq!(app.charges().await, 1);
    assert_eq!(app.metric(NONE_FOUND).await, 1.0);
    assert_eq!(ride(&app, user_id).await.2, 2);
}

#[testdb::test(template = crate::common::migrated)]
async fn a_crash_after_the_list_and_before_the_new_generations_charge_resumes_under_it(
    pool: PgPool,
) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    app.state.failpoints.arm(failpoints::AFTER_RIDE_CREATED);
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        500
    );
    app.clock
        .advance(DEFAULT_GATEWAY_KEY_WINDOW + Duration::from_secs(1));
    app.state.failpoints.arm(failpoints::AFTER_NEW_GENERATION);
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        500
    );
    assert_eq!(
        ride(&app, user_id).await.2,
        2,
        "the generation was recorded first"
    );
    assert_eq!(app.charges().await, 0);

    // The new generation charges, and the process dies before recording it.
    app.expire_leases();
    app.state.failpoints.arm(failpoints::AFTER_GATEWAY_CHARGE);
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        500
    );
    assert_eq!(app.charges().await, 1);

    // Within the new generation's window, the same key finds that charge: nothing more listed.
    app.expire_leases();
    let resumed = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(resumed.status, 201, "{resumed:?}");
    assert_eq!(app.charges().await, 1);
    assert_eq!(app.metric(NONE_FOUND).await, 1.0);
    assert_eq!(app.metric(ADOPTED).await, 0.0);
    assert_eq!(ride(&app, user_id).await.2, 2);
}

#[testdb::test(template = crate::common::migrated)]
async fn a_crash_after_adopting_replays_the_adopted_charge(pool: PgPool) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    charged_then_crashed(&app, &api_key).await;
    app.gateway.forget_keys(Duration::ZERO).await.unwrap();
    app.clock
        .advance(DEFAULT_GATEWAY_KEY_WINDOW + Duration::from_secs(1));
    // The adopted charge is recorded with the stored response, in one transaction: a crash
    // right after it leaves a finished key, not a recorded charge without an answer.
    app.state.failpoints.arm(failpoints::AFTER_FINISHED);
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        500
    );
    assert_eq!(app.recovery_point(user_id).await, "finished");
    let replayed = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(replayed.status, 201, "{replayed:?}");
    assert!(replayed.replayed());
    assert_eq!(app.charges().await, 1);
    let charge_id: String = sqlx::query_scalar("SELECT id FROM fakestripe.charges")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(replayed.json()["charge_id"], charge_id.as_str());
}

#[testdb::test(template = crate::common::migrated)]
async fn a_sticky_500_without_a_charge_is_reconciled_and_charged_once_under_a_new_generation(
    pool: PgPool,
) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    app.set_faults(Faults {
        sticky_500_before_charge: 1.0,
        ..Faults::none()
    });
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(
        first.status, 503,
        "a first 500 is a passing failure: {first:?}"
    );
    // The gateway is well again, but keeps the 500 under the key for as long as it keeps the key.
    app.set_faults(Faults::none());
    let retry = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(app.charges().await, 1);
    assert_eq!(app.metric(NONE_FOUND).await, 1.0);
    assert_eq!(
        app.metric("gateway_charges_total{outcome=\"stored_error\"}")
            .await,
        1.0
    );
    assert_eq!(ride(&app, user_id).await.2, 2);
}

#[testdb::test(template = crate::common::migrated)]
async fn a_sticky_500_after_the_charge_is_reconciled_by_adopting_that_charge(pool: PgPool) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    app.set_faults(Faults {
        sticky_500_after_charge: 1.0,
        ..Faults::none()
    });
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        503
    );
    app.set_faults(Faults::none());
    let retry = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(
        app.charges().await,
        1,
        "the charge behind the 500 was adopted"
    );
    assert_eq!(app.metric(ADOPTED).await, 1.0);
    assert_eq!(ride(&app, user_id).await.2, 1);
}

#[testdb::test(template = crate::common::migrated)]
async fn a_sticky_500_followed_by_a_crash_still_ends_with_one_charge(pool: PgPool) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    app.set_faults(Faults {
        sticky_500_after_charge: 1.0,
        ..Faults::none()
    });
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        503
    );
    app.set_faults(Faults::none());
    // The retry finds the charge by listing, and dies before recording it.
    app.state.failpoints.arm(failpoints::AFTER_GATEWAY_CHARGE);
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        500
    );
    app.expire_leases();
    // The key still replays its 500; the next attempt lists again and adopts the same charge.
    let resumed = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(resumed.status, 201, "{resumed:?}");
    assert_eq!(app.charges().await, 1);
    assert_eq!(app.metric(ADOPTED).await, 2.0);
    let request = common::request_uuid(&app, user_id).await;
    assert_eq!(common::charges_of_request(&app, &request).await, 1);
}

#[testdb::test(template = crate::common::migrated)]
async fn a_reconciling_list_that_spans_two_pages_finds_the_charge(pool: PgPool) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    charged_then_crashed(&app, &api_key).await;
    // 120 newer charges of the same customer push ours to the second page (pages of 100).
    let customer = common::customer(&app, user_id).await;
    for i in 0..120 {
        let metadata = [("rocket_rides_request", format!("another-{i}"))];
        let charge = rocket_rides::stripe::NewCharge {
            amount_cents: 1000,
            customer: &customer,
            description: "another request",
            metadata: &metadata,
        };
        app.state
            .stripe
            .create_charge(&format!("other-{i}"), &charge)
            .await
            .unwrap();
    }
    app.gateway.forget_keys(Duration::ZERO).await.unwrap();
    app.clock
        .advance(DEFAULT_GATEWAY_KEY_WINDOW + Duration::from_secs(1));
    let resumed = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(resumed.status, 201, "{resumed:?}");
    assert_eq!(app.metric(ADOPTED).await, 1.0);
    let request = common::request_uuid(&app, user_id).await;
    assert_eq!(
        common::charges_of_request(&app, &request).await,
        1,
        "no second charge"
    );
}

#[testdb::test(template = crate::common::migrated)]
async fn a_permanent_refusal_finishes_the_request_with_a_stored_502_and_no_charge(pool: PgPool) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    let customer = common::customer(&app, user_id).await;
    let deleted = app
        .http
        .delete(format!(
            "{}/v1/customers/{customer}",
            app.state.stripe.base()
        ))
        .bearer_auth("sk_test_rocketrides")
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 200);

    let refused = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(refused.status, 502, "{refused:?}");
    assert_eq!(refused.problem_type(), types::PAYMENT_REFUSED);
    let body = refused.json();
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("No such customer"),
        "the detail says what the gateway said: {body}"
    );
    assert_eq!(body["gateway_error"]["code"], "resource_missing");
    assert_eq!(body["gateway_error"]["param"], "customer");
    let replay = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, refused.body);
    assert_eq!(app.charges().await, 0);
    assert_eq!(ride(&app, user_id).await.0, "failed");
    assert_eq!(
        app.key_state(user_id).await,
        Some(("finished".into(), false))
    );
    assert_eq!(app.metric("payments_refused_total").await, 1.0);

    // An operator finds refused keys with `keys list --status 502`.
    let listed = tokio::process::Command::new(env!("CARGO_BIN_EXE_rocket-rides"))
        .args(["keys", "list", "--status", "502"])
        .env("DATABASE_URL", common::url_of(&app.pool).await)
        .output()
        .await
        .unwrap();
    assert!(listed.status.success());
    let lines: Vec<serde_json::Value> = String::from_utf8(listed.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["response_status"], 502);
    assert_eq!(lines[0]["idempotency_key"], "k-1");
}

#[testdb::test(template = crate::common::migrated)]
async fn a_gateway_that_refuses_our_credentials_is_a_503_never_a_final_answer(pool: PgPool) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    // The same database served with a secret key the gateway refuses (401).
    let gateway = GatewayArgs {
        stripe_api_base: app.state.stripe.base().to_owned(),
        stripe_api_key: "not-a-secret-key".to_owned(),
        ..Default::default()
    };
    let lease = LeaseArgs {
        lease_ttl: TTL,
        ..Default::default()
    };
    let state = rocket_rides::app::AppState::new(
        app.pool.clone(),
        Arc::new(DatabaseClock),
        &gateway,
        &lease,
    )
    .unwrap();
    let (base, _stop) = common::spawn(rocket_rides::app::router(state.clone())).await;
    let reply = app
        .http
        .post(format!("{base}/rides"))
        .bearer_auth(&api_key)
        .header("idempotency-key", "k-1")
        .header("content-type", "application/json")
        .body(RIDE)
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status().as_u16(), 503);
    assert_eq!(
        app.key_state(user_id).await,
        Some(("ride_created".into(), false)),
        "not finished, lease released"
    );
    let metrics = state.metrics.render(None);
    assert!(
        metrics.contains("gateway_charges_total{outcome=\"misconfigured\"} 1"),
        "{metrics}"
    );
    // Fixed, the retry completes the booking.
    let fixed = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(fixed.status, 201, "{fixed:?}");
}

#[testdb::test(template = crate::common::migrated)]
async fn a_pending_charge_is_not_paid_until_the_gateway_says_so(pool: PgPool) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    app.set_faults(Faults {
        pending_charges: 1.0,
        ..Faults::none()
    });
    let pending = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(pending.status, 503, "{pending:?}");
    assert_eq!(pending.problem_type(), types::PAYMENT_PENDING);
    assert!(pending.header("retry-after").is_some());
    let (status, charge_id, _) = ride(&app, user_id).await;
    assert_eq!(status, "payment_pending");
    assert!(charge_id.is_some());
    assert_eq!(app.recovery_point(user_id).await, "charge_pending");
    // Still pending: still not paid.
    let again = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(again.status, 503);

    app.gateway.settle_pending_charges(true).await.unwrap();
    let paid = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(paid.status, 201, "{paid:?}");
    assert_eq!(paid.json()["charge_id"].as_str(), charge_id.as_deref());
    assert_eq!(app.charges().await, 1);
}

#[testdb::test(template = crate::common::migrated)]
async fn a_pending_charge_that_fails_is_a_stored_decline(pool: PgPool) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    app.set_faults(Faults {
        pending_charges: 1.0,
        ..Faults::none()
    });
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        503
    );
    app.gateway.settle_pending_charges(false).await.unwrap();
    let declined = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(declined.status, 402, "{declined:?}");
    assert_eq!(declined.problem_type(), types::PAYMENT_DECLINED);
    assert!(app
        .post_ride(Some(&api_key), Some("k-1"), RIDE)
        .await
        .replayed());
    let (status, charge_id, _) = ride(&app, user_id).await;
    assert_eq!((status.as_str(), charge_id), ("declined", None));
}

#[testdb::test(template = crate::common::migrated)]
async fn over_https_a_gateway_signed_by_the_configured_ca_is_trusted(pool: PgPool) {
    let pki = TestPki::new("trusted");
    let gateway = GatewayArgs {
        stripe_ca_file: Some(pki.ca_file.clone()),
        ..Default::default()
    };
    let lease = LeaseArgs {
        lease_ttl: TTL,
        ..Default::default()
    };
    let app = TestApp::start_full(pool, gateway, lease, Some(pki.server.clone())).await;
    assert!(app.state.stripe.base().starts_with("https://"));
    let (_, api_key) = app.user("rider@example.com", "tok_visa").await;
    let reply = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert_eq!(app.charges().await, 1);
}

#[testdb::test(template = crate::common::migrated)]
async fn over_https_an_untrusted_certificate_is_a_clear_error_and_never_a_charge(pool: PgPool) {
    let pki = TestPki::new("untrusted");
    let gateway = GatewayArgs {
        stripe_ca_file: Some(pki.other_ca_file.clone()),
        ..Default::default()
    };
    let lease = LeaseArgs {
        lease_ttl: TTL,
        ..Default::default()
    };
    let app = TestApp::start_full(pool, gateway, lease, Some(pki.server.clone())).await;

    // `users create` exits non-zero, naming the certificate problem.
    let url = common::url_of(&app.pool).await;
    // Spawned without blocking: the gateway under test serves from this test's runtime.
    let run = |ca: &std::path::Path| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_rocket-rides"))
            .args([
                "users",
                "create",
                "--email",
                "cli@example.com",
                "--card",
                "tok_visa",
            ])
            .env("DATABASE_URL", &url)
            .env("STRIPE_API_BASE", app.state.stripe.base())
            .env("STRIPE_CA_FILE", ca)
            .env("RUST_LOG", "off")
            .output()
    };
    let refused = run(&pki.other_ca_file).await.unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("invalid peer certificate"), "{stderr}");
    assert!(stderr.contains("misconfigured"), "{stderr}");
    // The same command with the right CA works, and takes up the user the failed run began.
    let created = run(&pki.ca_file).await.unwrap();
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let user: serde_json::Value = serde_json::from_slice(&created.stdout).unwrap();
    let api_key = user["api_key"].as_str().unwrap();

    // `serve` answers 503, logs the error and counts it; nothing is charged or finished.
    let reply = app.post_ride(Some(api_key), Some("k-1"), RIDE).await;
    assert_eq!(reply.status, 503, "{reply:?}");
    assert_eq!(
        app.metric("gateway_charges_total{outcome=\"misconfigured\"}")
            .await,
        1.0
    );
    assert_eq!(app.charges().await, 0);
    assert_eq!(
        app.count("SELECT count(*) FROM idempotency_keys WHERE finished_at IS NULL")
            .await,
        1
    );
}

#[sqlx::test(migrations = false)]
async fn a_ca_file_that_holds_no_certificate_is_refused_at_start(pool: PgPool) {
    let pki = TestPki::new("empty-ca");
    let empty = pki.dir.join("empty.pem");
    std::fs::write(&empty, "").unwrap();
    let gateway = GatewayArgs {
        stripe_ca_file: Some(empty),
        ..Default::default()
    };
    let error = rocket_rides::app::AppState::new(
        pool,
        Arc::new(DatabaseClock),
        &gateway,
        &LeaseArgs::default(),
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(error.contains("--stripe-ca-file"), "{error}");
    assert!(error.contains("no PEM certificate"), "{error}");
}

#[testdb::test(template = crate::common::migrated)]
async fn an_unconfirmed_lease_renewal_is_a_503_and_the_key_is_released(pool: PgPool) {
    let lease = LeaseArgs {
        lease_ttl: TTL,
        lease_heartbeat: Duration::from_secs(1),
    };
    let app = TestApp::start_with_lease(pool, GatewayArgs::default(), lease).await;
    let (user_id, api_key) = app.user("rider@example.com", "tok_visa").await;
    // The booking waits on the gateway.
    app.gateway.hold_charges();
    let booking = {
        let (http, base, key) = (app.http.clone(), app.base.clone(), api_key.clone());
        tokio::spawn(async move {
            let request = http
                .post(format!("{base}/rides"))
                .bearer_auth(key)
                .header("idempotency-key", "k-1")
                .header("content-type", "application/json")
                .body(RIDE);
            common::Reply::read(request.send().await.unwrap()).await
        })
    };
    app.gateway.charges_held(1).await;
    // Another transaction holds the key row, so the renewal at the next beat waits, and by the
    // holder's clock only a fifth of a second of its lease is left: no answer in time.
    let mut blocker = app.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE owner = $1::text FOR UPDATE")
        .bind(user_id)
        .execute(&mut *blocker)
        .await
        .unwrap();
    app.clock.advance(TTL - Duration::from_millis(200));
    // Once the holder has given the call up, its release waits behind the blocker too.
    let releasing = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                     AND query LIKE '%locked_until = NULL%'";
    testdb::until(
        "the holder released its key after the unconfirmed renewal",
        Duration::from_secs(10),
        || async {
            let waiting: i64 = sqlx::query_scalar(releasing)
                .fetch_one(&app.pool)
                .await
                .unwrap();
            (waiting > 0).then_some(())
        },
    )
    .await;
    blocker.rollback().await.unwrap();
    let reply = booking.await.unwrap();
    assert_eq!(reply.status, 503, "{reply:?}");
    assert_eq!(reply.problem_type(), types::GATEWAY_UNAVAILABLE);
    assert_eq!(reply.header("retry-after"), Some("1"));
    // No other holder: the key was released at its point, for the retry to resume at once.
    let (point, released): (String, bool) = sqlx::query_as(
        "SELECT recovery_point, locked_until IS NULL FROM idempotency_keys WHERE owner = $1::text",
    )
    .bind(user_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((point.as_str(), released), ("ride_created", true));
    app.gateway.release_charges();
}
