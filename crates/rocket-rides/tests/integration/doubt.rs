//! Charges in doubt: the edges of the charge path where a card could be charged with nothing to
//! show for it. A charge still being made when the key window passes, answers that are not the
//! gateway's own, an `idempotency_error` or a refusal after an attempt whose answer was lost.
//! A real Rocket Rides and a real fakestripe on loopback, and where an intermediary speaks, a
//! real HTTP front between them.

use crate::common;

use std::time::Duration;

use common::front::FrontAnswer;
use common::{TestApp, RIDE};
use fakestripe::Faults;
use rocket_rides::config::{DEFAULT_GATEWAY_PROCESSING_BOUND, DEFAULT_LEASE_HEARTBEAT};
use rocket_rides::problem::types;
use sqlx::PgPool;

const ADOPTED: &str = "gateway_reconciliations_total{outcome=\"adopted\"}";
const NONE_FOUND: &str = "gateway_reconciliations_total{outcome=\"none_found\"}";
const DEFERRED: &str = "gateway_reconciliations_total{outcome=\"deferred\"}";

const NOT_FOUND_PAGE: &str = "<html><body><h1>404 Not Found</h1></body></html>";
const IDEMPOTENCY_ERROR: &str = r#"{"error":{"type":"idempotency_error","message":"Keys for idempotent requests can only be used with the same parameters they were first used with."}}"#;
const NO_SUCH_CUSTOMER: &str = r#"{"error":{"type":"invalid_request_error","code":"resource_missing","param":"customer","message":"No such customer"}}"#;

#[testdb::test(template = crate::common::migrated)]
async fn a_charge_still_running_one_second_after_the_window_is_waited_for_then_adopted(
    pool: PgPool,
) {
    // Short limits at the floor the settings allow (common::TestApp::start_short_limits).
    let (app, user_id, api_key) = TestApp::start_short_limits(pool).await;

    // The first attempt fails before the gateway charges.
    app.set_faults(Faults {
        fail_before_charge: 1.0,
        ..Faults::none()
    });
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(first.status, 503, "{first:?}");
    app.set_faults(Faults::none());

    // Half a second before the window ends, a retry asks again; the gateway takes longer than
    // our timeout to make that charge, and is still at it when the window has passed.
    app.clock
        .advance(Duration::from_secs(20) - Duration::from_millis(500));
    app.gateway.hold_charges();
    let second = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(
        (second.status, common::problem_kind(&second).as_str()),
        (503, types::GATEWAY_UNAVAILABLE)
    );
    app.gateway.charges_held(1).await;

    // One second past the window: the key can no longer be trusted, but the list must wait.
    app.clock.advance(Duration::from_millis(1500));
    let third = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(
        (third.status, common::problem_kind(&third).as_str()),
        (503, types::PAYMENT_UNCONFIRMED),
        "{third:?}"
    );
    let after: u64 = third.header("retry-after").unwrap().parse().unwrap();
    // At most the processing bound plus the heartbeat (3 s + 2 s) less the time since the record.
    assert!((1..=5).contains(&after), "Retry-After {after}");
    assert_eq!(app.charges().await, 0, "nothing was charged meanwhile");
    assert_eq!(app.metric(DEFERRED).await, 1.0);

    // The gateway makes the charge it was asked for.
    app.gateway.release_charges();
    common::charges_come_to(&app, 1).await;

    // Past the processing bound, the list finds it.
    app.clock.advance(Duration::from_secs(after));
    let fourth = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(fourth.status, 201, "{fourth:?}");
    assert_eq!(app.charges().await, 1, "one charge, adopted");
    assert_eq!(app.metric(ADOPTED).await, 1.0);
    assert_eq!(app.metric(NONE_FOUND).await, 0.0);
    let (status, charge_id, generation) = common::ride_state(&app, user_id).await;
    assert_eq!((status.as_str(), generation), ("paid", 1));
    assert_eq!(fourth.json()["charge_id"].as_str(), charge_id.as_deref());
}

#[testdb::test(template = crate::common::migrated)]
async fn a_bodyless_504_after_the_charge_then_a_404_page_are_unknown_outcomes_never_a_refusal(
    pool: PgPool,
) {
    let (app, user_id, api_key) = common::fronted_app(pool).await;
    app.front().script(vec![
        FrontAnswer::ForwardThen(504, ""),
        FrontAnswer::Answer(404, NOT_FOUND_PAGE),
    ]);
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(
        (first.status, common::problem_kind(&first).as_str()),
        (503, types::GATEWAY_UNAVAILABLE)
    );
    assert_eq!(
        app.charges().await,
        1,
        "the gateway charged behind the front"
    );
    let second = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(
        (second.status, common::problem_kind(&second).as_str()),
        (503, types::GATEWAY_UNAVAILABLE),
        "a 404 page is not the gateway's refusal: {second:?}"
    );
    assert_eq!(app.front().left(), 0);
    // The front lets the next one through: the gateway answers with the charge it made.
    let third = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(third.status, 201, "{third:?}");
    assert_eq!(app.charges().await, 1);
    assert_eq!(common::ride_state(&app, user_id).await.0, "paid");
    assert_eq!(
        app.metric(ADOPTED).await + app.metric(NONE_FOUND).await,
        0.0
    );
}

#[testdb::test(template = crate::common::migrated)]
async fn a_404_page_for_a_first_attempt_that_charged_is_never_stored_as_a_refusal(pool: PgPool) {
    let (app, user_id, api_key) = common::fronted_app(pool).await;
    app.front()
        .script(vec![FrontAnswer::ForwardThen(404, NOT_FOUND_PAGE)]);
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(first.status, 503, "{first:?}");
    assert_eq!(app.charges().await, 1);
    let stored: i64 = app
        .count("SELECT count(*) FROM idempotency_keys WHERE response_status IS NOT NULL")
        .await;
    assert_eq!(stored, 0, "nothing final was stored");
    let second = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(second.status, 201, "{second:?}");
    assert_eq!(common::ride_state(&app, user_id).await.0, "paid");
    assert_eq!(app.charges().await, 1);
}

#[testdb::test(template = crate::common::migrated)]
async fn an_idempotency_error_after_a_charged_then_dropped_attempt_adopts_the_charge(pool: PgPool) {
    let (app, user_id, api_key) = common::fronted_app(pool).await;
    // The gateway charges and the connection drops its answer.
    app.set_faults(Faults {
        drop_after_charge: 1.0,
        ..Faults::none()
    });
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(first.status, 503, "{first:?}");
    assert_eq!(app.charges().await, 1);
    // The retry is refused with an idempotency error (a deploy changed the charge's
    // parameters meanwhile, say): the key holds a result, possibly that charge.
    app.set_faults(Faults {
        idempotency_error_on_replay: 1.0,
        ..Faults::none()
    });
    let second = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(
        (second.status, common::problem_kind(&second).as_str()),
        (503, types::PAYMENT_UNCONFIRMED),
        "never a stored 502 for a charged card: {second:?}"
    );
    assert_eq!(app.gateway.counters().idempotency_error_on_replay, 1);
    // The doubt is kept: a retry before the bound neither lists nor asks the key again.
    let early = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(common::problem_kind(&early), types::PAYMENT_UNCONFIRMED);
    assert_eq!(app.gateway.counters().idempotency_error_on_replay, 1);
    app.clock.advance(
        DEFAULT_GATEWAY_PROCESSING_BOUND
            + rocket_rides::config::DEFAULT_LEASE_HEARTBEAT
            + Duration::from_secs(1),
    );
    let third = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(third.status, 201, "{third:?}");
    assert_eq!(app.charges().await, 1);
    assert_eq!(app.metric(ADOPTED).await, 1.0);
    assert_eq!(common::ride_state(&app, user_id).await.0, "paid");
}

#[testdb::test(template = crate::common::migrated)]
async fn an_idempotency_error_with_no_charge_is_stored_as_a_502_once_the_list_shows_none(
    pool: PgPool,
) {
    let (app, user_id, api_key) = common::fronted_app(pool).await;
    app.front()
        .script(vec![FrontAnswer::Json(400, IDEMPOTENCY_ERROR)]);
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(
        common::problem_kind(&first),
        types::PAYMENT_UNCONFIRMED,
        "{first:?}"
    );
    app.clock.advance(
        DEFAULT_GATEWAY_PROCESSING_BOUND
            + rocket_rides::config::DEFAULT_LEASE_HEARTBEAT
            + Duration::from_secs(1),
    );
    let second = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(
        (second.status, common::problem_kind(&second).as_str()),
        (502, types::PAYMENT_REFUSED),
        "{second:?}"
    );
    assert_eq!(second.json()["gateway_error"]["type"], "idempotency_error");
    assert_eq!(app.metric(NONE_FOUND).await, 1.0);
    assert_eq!(app.charges().await, 0);
    assert_eq!(common::ride_state(&app, user_id).await.0, "failed");
    // Final, and replayed as such.
    let replay = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(replay.status, 502);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
}

#[testdb::test(template = crate::common::migrated)]
async fn a_refusal_after_an_attempt_of_unknown_outcome_reconciles_and_finds_the_charge(
    pool: PgPool,
) {
    let (app, user_id, api_key) = common::fronted_app(pool).await;
    app.front().script(vec![
        FrontAnswer::ForwardThen(504, "<html>504 Gateway Time-out</html>"),
        FrontAnswer::Json(400, NO_SUCH_CUSTOMER),
    ]);
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(first.status, 503);
    assert_eq!(app.charges().await, 1);
    let second = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(
        (second.status, common::problem_kind(&second).as_str()),
        (503, types::PAYMENT_UNCONFIRMED),
        "{second:?}"
    );
    app.clock.advance(
        DEFAULT_GATEWAY_PROCESSING_BOUND
            + rocket_rides::config::DEFAULT_LEASE_HEARTBEAT
            + Duration::from_secs(1),
    );
    let third = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(third.status, 201, "{third:?}");
    assert_eq!(app.charges().await, 1);
    assert_eq!(common::ride_state(&app, user_id).await.0, "paid");
}

#[testdb::test(template = crate::common::migrated)]
async fn the_reconciling_list_is_bounded_by_the_first_attempt_and_the_last_call(pool: PgPool) {
    let (app, _, api_key) = common::fronted_app(pool).await;
    // The first attempt fails before charging; the resumed one, hours later, is answered with
    // an idempotency error.
    app.set_faults(Faults {
        fail_before_charge: 1.0,
        ..Faults::none()
    });
    let first_at = app.clock_now().unix_timestamp();
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        503
    );
    app.set_faults(Faults::none());
    app.clock.advance(Duration::from_secs(2 * 3600));
    app.front()
        .script(vec![FrontAnswer::Json(400, IDEMPOTENCY_ERROR)]);
    let last_at = app.clock_now().unix_timestamp();
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        503
    );
    app.clock.advance(
        DEFAULT_GATEWAY_PROCESSING_BOUND
            + rocket_rides::config::DEFAULT_LEASE_HEARTBEAT
            + Duration::from_secs(1),
    );
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        502
    );
    let list = app
        .front()
        .seen()
        .into_iter()
        .find(|r| r.starts_with("GET /v1/charges?"))
        .expect("a list was made");
    let query: Vec<(String, String)> =
        serde_urlencoded::from_str(list.split_once('?').unwrap().1).unwrap();
    let bound = |name: &str| -> i64 {
        query
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("{name} in {list}"))
            .1
            .parse()
            .unwrap()
    };
    let skew = rocket_rides::booking::RECONCILE_CLOCK_SKEW.whole_seconds();
    let processing = DEFAULT_GATEWAY_PROCESSING_BOUND.as_secs() as i64;
    // A call leaves within one heartbeat of its record.
    let heartbeat = DEFAULT_LEASE_HEARTBEAT.as_secs() as i64;
    // From the first attempt, to the last call's record plus a heartbeat and the processing
    // bound: each within the second the clock showed, widened by the skew.
    assert!((first_at - skew..=first_at - skew + 1).contains(&bound("created[gte]")));
    let until = bound("created[lte]");
    let last = last_at + heartbeat + processing + skew;
    assert!(
        (last..=last + 1).contains(&until),
        "{until} for a last call recorded at {last_at}"
    );
}

/// A new request for `k-1`, in the background, standing still after its first step created the
/// ride and its charge step read it, before its first call: the handle lets it go on.
async fn standing_before_its_first_call(
    app: &TestApp,
    api_key: &str,
) -> (
    rocket_rides::failpoints::StandingStill,
    tokio::task::JoinHandle<common::Reply>,
) {
    let mut still = app
        .state
        .failpoints
        .stand_still_at(rocket_rides::failpoints::AFTER_RIDE_LOADED);
    let (http, base, api_key) = (app.http.clone(), app.base.clone(), api_key.to_owned());
    let request = tokio::spawn(async move {
        let request = http
            .post(format!("{base}/rides"))
            .header("content-type", "application/json")
            .header("idempotency-key", "k-1")
            .bearer_auth(api_key)
            .body(RIDE);
        common::Reply::read(request.send().await.unwrap()).await
    });
    still.reached().await;
    (still, request)
}

#[testdb::test(template = crate::common::migrated)]
async fn a_holder_whose_lease_ran_out_before_its_first_call_never_calls(pool: PgPool) {
    let (app, user_id, api_key) = common::fronted_app(pool).await;
    // The first step commits (the ride is created), and then the holder stands still past its
    // lease before its first gateway call.
    let (still, stale) = standing_before_its_first_call(&app, &api_key).await;
    app.expire_leases();
    // Another attempt takes the key over and moves the charge to a new generation.
    let taker = match app.claim(user_id, "k-1").await {
        idempotency::Claim::Acquired(lease) => lease,
        other => panic!("expected a takeover, got {other:?}"),
    };
    assert!(taker.token() > 1);
    sqlx::query("UPDATE rides SET charge_generation = 2 WHERE user_id = $1")
        .bind(user_id)
        .execute(&app.pool)
        .await
        .unwrap();
    // The stale holder wakes: its own clock says its lease may be gone, it records its call
    // first, and the fenced record finds the lease taken: it stops.
    still.go_on();
    let woke = stale.await.unwrap();
    assert_eq!(woke.status, 409, "{woke:?}");
    assert_eq!(woke.problem_type(), types::LEASE_LOST);
    let charge_calls = app
        .front()
        .seen()
        .iter()
        .filter(|r| r.starts_with("POST /v1/charges"))
        .count();
    assert_eq!(charge_calls, 0, "the stale holder never called the gateway");
}

#[testdb::test(template = crate::common::migrated)]
async fn a_gateway_that_will_not_list_a_deleted_customer_is_reconciled_over_the_account(
    pool: PgPool,
) {
    let (app, user_id, api_key) = common::fronted_app(pool).await;
    // Charged behind a front that answered 504; then the customer is refused for good.
    app.front().script(vec![
        FrontAnswer::ForwardThen(504, ""),
        FrontAnswer::Json(400, NO_SUCH_CUSTOMER),
    ]);
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        503
    );
    let second = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(common::problem_kind(&second), types::PAYMENT_UNCONFIRMED);
    // The gateway will not list the customer either.
    app.front()
        .script_lists(vec![FrontAnswer::Json(400, NO_SUCH_CUSTOMER)]);
    app.clock.advance(
        DEFAULT_GATEWAY_PROCESSING_BOUND
            + rocket_rides::config::DEFAULT_LEASE_HEARTBEAT
            + Duration::from_secs(1),
    );
    let third = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(third.status, 201, "{third:?}");
    assert_eq!(app.charges().await, 1);
    assert_eq!(common::ride_state(&app, user_id).await.0, "paid");
    let lists: Vec<String> = app
        .front()
        .seen()
        .into_iter()
        .filter(|r| r.starts_with("GET /v1/charges?"))
        .collect();
    assert_eq!(lists.len(), 2, "{lists:?}");
    assert!(lists[0].contains("customer="));
    assert!(
        !lists[1].contains("customer="),
        "then over the account: {lists:?}"
    );
}

#[testdb::test(template = crate::common::migrated)]
async fn a_ride_left_by_an_earlier_version_waits_from_first_sight_before_it_is_reconciled(
    pool: PgPool,
) {
    let (app, user_id, api_key) = common::fronted_app(pool).await;
    app.set_faults(Faults {
        fail_before_charge: 1.0,
        ..Faults::none()
    });
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        503
    );
    // A retry charges, and its answer is lost.
    app.set_faults(Faults {
        drop_after_charge: 1.0,
        ..Faults::none()
    });
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        503
    );
    app.set_faults(Faults::none());
    assert_eq!(app.charges().await, 1);
    // As an earlier version leaves such a ride: first tried three hours before that retry, and
    // the retry recorded nowhere.
    sqlx::query(
        "UPDATE rides SET charge_attempted_at = NULL,
                          charge_first_attempt_at = charge_first_attempt_at - interval '3 hours',
                          charge_generation_at = charge_generation_at - interval '3 hours'
         WHERE user_id = $1",
    )
    .bind(user_id)
    .execute(&app.pool)
    .await
    .unwrap();
    // Resumed past its window: the last call is unknown, so the list waits from now.
    app.clock.advance(Duration::from_secs(21 * 3600));
    let first_sight = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(
        (
            first_sight.status,
            common::problem_kind(&first_sight).as_str()
        ),
        (503, types::PAYMENT_UNCONFIRMED),
        "{first_sight:?}"
    );
    app.clock.advance(
        DEFAULT_GATEWAY_PROCESSING_BOUND
            + rocket_rides::config::DEFAULT_LEASE_HEARTBEAT
            + Duration::from_secs(1),
    );
    let done = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(done.status, 201, "{done:?}");
    assert_eq!(
        app.charges().await,
        1,
        "the charge the lost answer made, adopted"
    );
    assert_eq!(app.metric(ADOPTED).await, 1.0);
    assert_eq!(common::ride_state(&app, user_id).await.2, 1);
}

#[testdb::test(template = crate::common::migrated)]
async fn a_first_call_a_heartbeat_after_its_phase_is_recorded_before_it_leaves(pool: PgPool) {
    let (app, user_id, api_key) = common::fronted_app(pool).await;
    let (still, request) = standing_before_its_first_call(&app, &api_key).await;
    // More than a heartbeat went by between the first step and the call, and most of the
    // lease is left: the step's time no longer stands for the call's.
    assert!(
        DEFAULT_LEASE_HEARTBEAT + Duration::from_secs(1) < common::TTL - DEFAULT_LEASE_HEARTBEAT
    );
    app.clock
        .advance(DEFAULT_LEASE_HEARTBEAT + Duration::from_secs(1));
    let expected = app.clock_now();
    still.go_on();
    let booked = request.await.unwrap();
    assert_eq!(booked.status, 201, "{booked:?}");
    let attempted: time::OffsetDateTime =
        sqlx::query_scalar("SELECT charge_attempted_at FROM rides WHERE user_id = $1")
            .bind(user_id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    // PostgreSQL keeps microseconds.
    assert!(
        (attempted - expected).abs() < time::Duration::milliseconds(1),
        "the call recorded at {attempted}, when it left at {expected}"
    );
}

#[testdb::test(template = crate::common::migrated)]
async fn a_first_call_after_the_holder_stood_still_is_recorded_before_it_leaves(pool: PgPool) {
    let (app, user_id, api_key) = common::fronted_app(pool).await;
    let (still, request) = standing_before_its_first_call(&app, &api_key).await;
    // Most of the lease went by between the first step and the call, and nobody took over.
    app.clock.advance(common::TTL - Duration::from_secs(1));
    let expected = app.clock_now();
    still.go_on();
    let booked = request.await.unwrap();
    assert_eq!(booked.status, 201, "{booked:?}");
    let (created, attempted): (time::OffsetDateTime, time::OffsetDateTime) = sqlx::query_as(
        "SELECT charge_generation_at, charge_attempted_at FROM rides WHERE user_id = $1",
    )
    .bind(user_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(
        attempted > created,
        "the call's own time: {attempted} after {created}"
    );
    // PostgreSQL keeps microseconds.
    assert!((attempted - expected).abs() < time::Duration::milliseconds(1));
}
