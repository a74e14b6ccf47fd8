//! Adversarial tests of the charge path: attacks on "one key, one charge", "no money without a
//! ride" and "only the gateway's own word is final", over HTTP against a real Rocket Rides and a
//! real fakestripe on loopback (with a front between them where an intermediary speaks).
//!
//! Every test asserts the contract the project's docs state (one key, one charge; nothing
//! acknowledged lost; no money without a ride; a stored outcome is true). A test named `fixed_…`
//! broke that contract when it was written, and guards the fix; its failure message says what
//! the service did instead. A test named `defended_…` is an attack that failed from the start.

use crate::common;

use std::time::Duration;

use common::front::FrontAnswer;
use common::{TestApp, RIDE};
use fakestripe::{Faults, Scripted};
use rocket_rides::config::{WorkerArgs, DEFAULT_GATEWAY_PROCESSING_BOUND};
use rocket_rides::problem::types;
use rocket_rides::worker::completer;
use sqlx::PgPool;

const ADOPTED: &str = "gateway_reconciliations_total{outcome=\"adopted\"}";
const NONE_FOUND: &str = "gateway_reconciliations_total{outcome=\"none_found\"}";

/// An error body in the shape many intermediaries use on their own (the Microsoft REST API
/// guidelines' `{"error": {"code", "message"}}`, Azure's front doors and API managements, a
/// custom ingress error page): an object under `error`, but not Stripe's (no `type`, no
/// `Request-Id`), here even served as `text/html` by the front.
const INTERMEDIARY_JSON: &str =
    r#"{"error":{"code":"NotFound","message":"The requested resource was not found."}}"#;
const IDEMPOTENCY_ERROR: &str = r#"{"error":{"type":"idempotency_error","message":"Keys for idempotent requests can only be used with the same parameters they were first used with."}}"#;

/// The stored response status of the only key of this user, if any.
async fn stored_status(app: &TestApp, user_id: i64) -> Option<i32> {
    sqlx::query_scalar("SELECT response_status::int FROM idempotency_keys WHERE owner = $1::text")
        .bind(user_id)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

async fn delete_customer(app: &TestApp, customer: &str) {
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
}

/// `POST /rides` until a final answer, as a client honouring `Retry-After` does: a wait for an
/// unconfirmed payment is spent by moving the service's clock (the gateway's work is over by
/// then in every test here), any other by a short real sleep; bounded.
async fn until_final(app: &TestApp, api_key: &str, key: &str) -> common::Reply {
    testdb::until_every(
        &format!("a final answer for key {key}"),
        Duration::from_millis(200),
        Duration::from_secs(15),
        || async {
            let reply = app.post_ride(Some(api_key), Some(key), RIDE).await;
            if reply.status != 409 && reply.status != 503 {
                return Some(reply);
            }
            if common::problem_kind(&reply) == types::PAYMENT_UNCONFIRMED {
                let after: u64 = reply
                    .header("retry-after")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(1);
                app.clock.advance(Duration::from_secs(after));
            }
            None
        },
    )
    .await
}

/// The invariants one key must satisfy once it finished: one charge at most, a 201 only with a
/// paid ride whose charge is the request's only one, a stored 402/502 only with no succeeded
/// charge at the gateway.
async fn assert_one_key_one_effect(app: &TestApp, user_id: i64, what: &str) {
    let request = common::request_uuid(app, user_id).await;
    let charges = common::charges_of_request(app, &request).await;
    let succeeded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM fakestripe.charges
         WHERE metadata->>'rocket_rides_request' = $1 AND status = 'succeeded'",
    )
    .bind(&request)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let (status, charge_id, generation) = common::ride_state(app, user_id).await;
    let stored = stored_status(app, user_id).await;
    let observed = format!(
        "{what}: stored response {stored:?}, ride {status} (charge {charge_id:?}, generation \
         {generation}), gateway charges naming the request: {charges} ({succeeded} succeeded)"
    );
    assert!(charges <= 1, "CHARGED TWICE for one key. {observed}");
    match stored {
        Some(201) => {
            assert_eq!(status, "paid", "{observed}");
            assert_eq!(succeeded, 1, "{observed}");
        }
        Some(402) | Some(502) => assert_eq!(
            succeeded, 0,
            "A FALSE OUTCOME: a final refusal is stored while the gateway holds a charge that no \
             ride records. {observed}"
        ),
        other => panic!("unexpected stored response {other:?}. {observed}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Attack 1: an intermediary's error body that happens to be an object under "error".
//
// `stripe::classify` takes any body that deserializes as `{"error": {…}}` (every field of the
// error object optional, unknown fields ignored, the Content-Type not looked at) for Stripe's own
// word; a 4xx of it is `ChargeError::Refused` (with `type` "unknown" when the body has none),
// and `booking::charge` stores a refusal at once when the call was the key's first (`fresh`).
// ---------------------------------------------------------------------------------------------

#[testdb::test(template = crate::common::migrated)]
async fn fixed_an_intermediary_json_error_after_the_charge_is_stored_as_a_502_refusal(
    pool: PgPool,
) {
    let (app, user_id, api_key) = common::fronted_app(pool).await;
    // The front forwards the first charge (the gateway charges), then answers on its own, as a
    // proxy that lost the gateway's answer does: a 404 whose body is its own JSON error page,
    // served as text/html.
    app.front()
        .script(vec![FrontAnswer::ForwardThen(404, INTERMEDIARY_JSON)]);
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(
        app.charges().await,
        1,
        "the gateway charged behind the front"
    );
    let observed = format!(
        "first answer {} {}, stored {:?}, ride {:?}, gateway charges {}",
        first.status,
        common::problem_kind(&first),
        stored_status(&app, user_id).await,
        common::ride_state(&app, user_id).await,
        app.charges().await
    );
    assert_eq!(
        (first.status, common::problem_kind(&first).as_str()),
        (503, types::GATEWAY_UNAVAILABLE),
        "an answer that is not the gateway's (no `type`, no Request-Id, text/html) must be an \
         unknown outcome, never a refusal: {observed}"
    );
    // What a client does next: retry with the key until final.
    let last = until_final(&app, &api_key, "k-1").await;
    assert_eq!(last.status, 201, "{last:?}");
    assert_one_key_one_effect(&app, user_id, "after the intermediary's JSON page").await;
}

#[testdb::test(template = crate::common::migrated)]
async fn fixed_an_intermediary_json_error_on_a_new_generation_after_its_charge_is_stored_as_a_502(
    pool: PgPool,
) {
    let (app, user_id, api_key) = common::fronted_app(pool).await;
    // The first attempt: the gateway stores a 500 under the generation-1 key, charging nothing.
    app.set_faults(Faults {
        sticky_500_before_charge: 1.0,
        ..Faults::none()
    });
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(first.status, 503, "{first:?}");
    app.set_faults(Faults::none());
    // The retry: the gateway replays the stored 500 (forwarded), the list finds nothing, the
    // service starts generation 2 and charges under it; the gateway charges, and the front
    // answers that call with its own JSON error page.
    app.front().script(vec![
        FrontAnswer::Forward,
        FrontAnswer::ForwardThen(404, INTERMEDIARY_JSON),
    ]);
    let second = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(app.front().left(), 0, "both charges went through the front");
    assert_eq!(
        app.metric(NONE_FOUND).await,
        1.0,
        "generation 1 was reconciled"
    );
    assert_eq!(
        app.charges().await,
        1,
        "generation 2 charged behind the front"
    );
    let observed = format!(
        "second answer {} {}, stored {:?}, ride {:?}",
        second.status,
        common::problem_kind(&second),
        stored_status(&app, user_id).await,
        common::ride_state(&app, user_id).await,
    );
    assert_ne!(
        second.status, 502,
        "a refusal on a new generation's first call, spoken by an intermediary after the \
         charge, was stored as final: {observed}"
    );
    let last = until_final(&app, &api_key, "k-1").await;
    assert_eq!(last.status, 201, "{last:?}");
    assert_one_key_one_effect(&app, user_id, "after generation 2's intermediary page").await;
}

#[testdb::test(template = crate::common::migrated)]
async fn defended_an_intermediary_json_error_on_a_resumed_call_is_reconciled_and_adopted(
    pool: PgPool,
) {
    let (app, user_id, api_key) = common::fronted_app(pool).await;
    // The first call never reaches the gateway (a bodyless 504 from the front); the retry's
    // call charges and is answered with the front's JSON page.
    app.front().script(vec![
        FrontAnswer::Answer(504, ""),
        FrontAnswer::ForwardThen(404, INTERMEDIARY_JSON),
    ]);
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        503
    );
    let second = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(app.charges().await, 1);
    // Either an unknown outcome (503 gateway-unavailable) or a refusal after an attempt of
    // unknown outcome, kept and reconciled (503 payment-unconfirmed): never final.
    assert_eq!(second.status, 503, "{second:?}");
    app.clock.advance(
        DEFAULT_GATEWAY_PROCESSING_BOUND
            + rocket_rides::config::DEFAULT_LEASE_HEARTBEAT
            + Duration::from_secs(1),
    );
    let third = until_final(&app, &api_key, "k-1").await;
    assert_eq!(third.status, 201, "{third:?}");
    assert_one_key_one_effect(&app, user_id, "resumed call").await;
}

// ---------------------------------------------------------------------------------------------
// Attack 2: a key left unfinished by the previous version, whose calls were never recorded.
//
// Migration 20261201100001 adds `rides.charge_attempted_at` as NULL to every row, and the code
// reads `coalesce(charge_attempted_at, charge_generation_at)` as the last call. The previous
// version resumed keys under generation 1 at any time (client retries, completer backoffs) and
// recorded nothing. Past the key window, `wait_for_calls` waits for nothing and
// `find_own_charge` lists with `created[lte] = charge_generation_at + bound + skew`: a charge
// the previous version made later than that is out of the list, and generation 2 charges again.
// (The same holds for calls an old process makes during a rolling deploy.)
// ---------------------------------------------------------------------------------------------

#[testdb::test(template = crate::common::migrated)]
async fn fixed_a_call_the_previous_version_has_in_flight_is_not_waited_for_past_the_window(
    pool: PgPool,
) {
    // Short limits at the floor the settings allow (common::TestApp::start_short_limits).
    let (app, user_id, api_key) = TestApp::start_short_limits(pool).await;
    // A call under generation 1 that the gateway takes 2.5 s to make (within the 3 s bound):
    // our side gives up after 1 s.
    let customer = common::customer(&app, user_id).await;
    app.gateway
        .script_charges(&customer, vec![Scripted::Hold { ms: 2500 }]);
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(first.status, 503, "{first:?}");
    // As the previous version leaves such a ride: booked 21 s before that call (longer ago than
    // the window), the call itself recorded nowhere.
    sqlx::query(
        "UPDATE rides SET charge_attempted_at = NULL,
                          charge_first_attempt_at = charge_first_attempt_at - interval '21 seconds',
                          charge_generation_at = charge_generation_at - interval '21 seconds'
         WHERE user_id = $1",
    )
    .bind(user_id)
    .execute(&app.pool)
    .await
    .unwrap();
    // The retry comes while that call is still being made at the gateway.
    let second = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    // Let the held charge land, and let any further retry finish.
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let observed = format!(
        "the retry answered {} {}; gateway charges now {}",
        second.status,
        common::problem_kind(&second),
        app.charges().await
    );
    assert_eq!(
        (second.status, common::problem_kind(&second).as_str()),
        (503, types::PAYMENT_UNCONFIRMED),
        "a list must wait for a call that may still be running: {observed}"
    );
    app.clock.advance(Duration::from_secs(4));
    let last = until_final(&app, &api_key, "k-1").await;
    assert_eq!(last.status, 201, "{last:?}");
    assert_one_key_one_effect(&app, user_id, &observed).await;
}

// ---------------------------------------------------------------------------------------------
// Attacks that failed: kept as regression tests.
// ---------------------------------------------------------------------------------------------

#[testdb::test(template = crate::common::migrated)]
async fn defended_a_deleted_customer_after_an_attempt_that_never_reached_the_gateway_finishes_with_a_502(
    pool: PgPool,
) {
    let app = TestApp::start(pool).await;
    let (user_id, api_key) = app.user("rider@example.com", "tok_visa").await;
    let customer = common::customer(&app, user_id).await;
    app.gateway
        .script_charges(&customer, vec![Scripted::FailBefore]);
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        503
    );
    delete_customer(&app, &customer).await;
    let second = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(
        (second.status, common::problem_kind(&second).as_str()),
        (503, types::PAYMENT_UNCONFIRMED),
        "a refusal after an attempt of unknown outcome is not final at once: {second:?}"
    );
    app.clock.advance(
        DEFAULT_GATEWAY_PROCESSING_BOUND
            + rocket_rides::config::DEFAULT_LEASE_HEARTBEAT
            + Duration::from_secs(1),
    );
    let third = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(third.status, 502, "{third:?}");
    assert_eq!(app.charges().await, 0);
    assert_one_key_one_effect(&app, user_id, "deleted customer").await;
    let replay = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, third.body);
}

#[testdb::test(template = crate::common::migrated)]
async fn defended_a_deleted_customer_after_a_charged_attempt_gets_its_charge(pool: PgPool) {
    let app = TestApp::start(pool).await;
    let (user_id, api_key) = app.user("rider@example.com", "tok_visa").await;
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
    delete_customer(&app, &common::customer(&app, user_id).await).await;
    let second = until_final(&app, &api_key, "k-1").await;
    assert_eq!(second.status, 201, "{second:?}");
    assert_one_key_one_effect(&app, user_id, "deleted customer after a charge").await;
}

#[testdb::test(template = crate::common::migrated)]
async fn defended_a_stored_500_after_an_attempt_of_unknown_outcome_adopts_the_charge(pool: PgPool) {
    let (app, user_id, api_key) = common::fronted_app(pool).await;
    // Attempt 1: the front answers a bodyless 504 without forwarding.
    app.front().script(vec![FrontAnswer::Answer(504, "")]);
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        503
    );
    // Attempt 2: the gateway charges and stores a 500 in place of the charge.
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
    assert_eq!(app.charges().await, 1);
    // Attempt 3: the replayed 500 sends the service to the list at once; it finds the charge.
    let third = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(third.status, 201, "{third:?}");
    assert_eq!(app.metric(ADOPTED).await, 1.0);
    assert_one_key_one_effect(&app, user_id, "stored 500 after unknown").await;
}

#[testdb::test(template = crate::common::migrated)]
async fn defended_an_idempotency_error_over_a_pending_charge_adopts_it_and_settles_it(
    pool: PgPool,
) {
    let app = TestApp::start(pool).await;
    let (user_id, api_key) = app.user("rider@example.com", "tok_visa").await;
    app.set_faults(Faults {
        pending_charges: 1.0,
        drop_after_charge: 1.0,
        ..Faults::none()
    });
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        503
    );
    app.set_faults(Faults {
        idempotency_error_on_replay: 1.0,
        ..Faults::none()
    });
    let second = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(
        common::problem_kind(&second),
        types::PAYMENT_UNCONFIRMED,
        "{second:?}"
    );
    app.set_faults(Faults::none());
    app.clock.advance(
        DEFAULT_GATEWAY_PROCESSING_BOUND
            + rocket_rides::config::DEFAULT_LEASE_HEARTBEAT
            + Duration::from_secs(1),
    );
    let third = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(
        (third.status, common::problem_kind(&third).as_str()),
        (503, types::PAYMENT_PENDING),
        "{third:?}"
    );
    assert_eq!(common::ride_state(&app, user_id).await.0, "payment_pending");
    app.gateway.settle_pending_charges(true).await.unwrap();
    let fourth = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(fourth.status, 201, "{fourth:?}");
    assert_one_key_one_effect(&app, user_id, "pending under an idempotency error").await;
}

#[testdb::test(template = crate::common::migrated)]
async fn defended_the_completer_waits_out_an_unconfirmed_key_and_then_finishes_it(pool: PgPool) {
    let (app, user_id, api_key) = common::fronted_app(pool).await;
    app.front()
        .script(vec![FrontAnswer::Json(400, IDEMPOTENCY_ERROR)]);
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(
        common::problem_kind(&first),
        types::PAYMENT_UNCONFIRMED,
        "{first:?}"
    );
    let settings = WorkerArgs::default();
    app.clock
        .advance(settings.completer_grace + Duration::from_secs(1));
    // Inside the bound: the completer claims, cannot decide, and backs off until the bound.
    let report = completer::run_once(&app.state, &settings).await.unwrap();
    assert_eq!((report.claimed, report.retried), (1, 1), "{report:?}");
    app.clock.advance(Duration::from_secs(30));
    let report = completer::run_once(&app.state, &settings).await.unwrap();
    assert_eq!(
        report.claimed, 0,
        "the backoff honours the time the list must wait: {report:?}"
    );
    let early = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(
        common::problem_kind(&early),
        types::PAYMENT_UNCONFIRMED,
        "{early:?}"
    );
    app.clock.advance(DEFAULT_GATEWAY_PROCESSING_BOUND);
    let report = completer::run_once(&app.state, &settings).await.unwrap();
    assert_eq!((report.claimed, report.finished), (1, 1), "{report:?}");
    assert_one_key_one_effect(&app, user_id, "completer after unconfirmed").await;
    let late = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(late.status, 502);
    assert!(late.replayed());
}

#[testdb::test(template = crate::common::migrated)]
async fn defended_many_keys_through_intermediaries_drops_and_conflicts_charge_once_each(
    pool: PgPool,
) {
    let app = TestApp::start(pool).await;
    let (_, api_key) = app.user("rider@example.com", "tok_visa").await;
    app.set_faults(Faults {
        intermediary_before: 0.25,
        intermediary_after: 0.25,
        drop_after_charge: 0.2,
        fail_after_charge: 0.1,
        fail_before_charge: 0.1,
        conflict_in_flight: 0.1,
        seed: Some(7),
        ..Faults::none()
    });
    let keys: Vec<String> = (0..12).map(|i| format!("k-{i}")).collect();
    for key in &keys {
        let mut finished = None;
        for _ in 0..60 {
            let reply = app.post_ride(Some(&api_key), Some(key), RIDE).await;
            match reply.status {
                201 => {
                    finished = Some(reply);
                    break;
                }
                503 | 409 => continue,
                other => panic!("key {key}: unexpected {other}: {reply:?}"),
            }
        }
        assert!(finished.is_some(), "key {key} never finished");
    }
    app.set_faults(Faults::none());
    let (rides, paid, charges, distinct): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM rides),
                (SELECT count(*) FROM rides WHERE status = 'paid'),
                (SELECT count(*) FROM fakestripe.charges),
                (SELECT count(DISTINCT metadata->>'rocket_rides_request') FROM fakestripe.charges)",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((rides, paid, charges, distinct), (12, 12, 12, 12));
    let orphans: i64 = app
        .count(
            "SELECT count(*) FROM fakestripe.charges c
             WHERE NOT EXISTS (SELECT 1 FROM rides r WHERE r.charge_id = c.id)",
        )
        .await;
    assert_eq!(orphans, 0, "every charge belongs to a ride");
}

#[testdb::test(template = crate::common::migrated)]
async fn defended_intermediary_pages_of_every_status_after_the_charge_are_unknown_outcomes(
    pool: PgPool,
) {
    let (app, user_id, api_key) = common::fronted_app(pool).await;
    // Every one of these follows a forwarded call: the gateway charged (then replayed).
    let pages: Vec<(u16, &'static str)> = vec![
        (200, ""),
        (200, "<html>ok</html>"),
        (302, "<html>moved</html>"),
        (400, r#"{"error":"bad request"}"#),
        (402, "<html>402 Payment Required</html>"),
        (404, "{}"),
        (410, ""),
        (413, "<html>413 Request Entity Too Large</html>"),
        (422, r#"{"message":"unprocessable"}"#),
        (401, "<html>401</html>"),
        (403, ""),
    ];
    let n = pages.len();
    app.front().script(
        pages
            .into_iter()
            .map(|(status, page)| FrontAnswer::ForwardThen(status, page))
            .collect(),
    );
    for i in 0..n {
        let reply = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
        assert_eq!(reply.status, 503, "page {i}: {reply:?}");
        assert_eq!(stored_status(&app, user_id).await, None, "page {i}");
    }
    assert_eq!(app.front().left(), 0);
    let last = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(last.status, 201, "{last:?}");
    assert_eq!(app.charges().await, 1);
    assert_one_key_one_effect(&app, user_id, "intermediary pages").await;
}

// ---------------------------------------------------------------------------------------------
// Attack 3: `IdempotencyLayer` starts its handler on a lease that ran out before the claim
// answered.
//
// The lease clock now starts before the claim's statement (so `Store::lease_left` says 0 for a
// claim whose answer was held up past the TTL), and `under_lease`'s doc says it renews "first,
// if little of it is left by this process's own clock"; but it never looks at `lease_left`: the
// handler is spawned at once, a second request takes the expired lease over, and both handlers
// run their effect. The first renewal comes a heartbeat later, after the effect.
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Default)]
struct Effects {
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    failing: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

async fn one_effect(
    axum::extract::State(effects): axum::extract::State<Effects>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    use std::sync::atomic::Ordering;
    if effects.failing.load(Ordering::SeqCst) {
        return http::StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    effects.calls.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    http::StatusCode::CREATED.into_response()
}

async fn send_effect(router: axum::Router) -> u16 {
    use tower::ServiceExt;
    let request = http::Request::post("/effects")
        .header("content-type", "application/json")
        .header("idempotency-key", "k1")
        .body(axum::body::Body::from("{}"))
        .unwrap();
    router.oneshot(request).await.unwrap().status().as_u16()
}

#[sqlx::test(migrations = false)]
async fn fixed_the_layer_runs_a_handler_on_a_lease_that_ran_out_during_its_claim(pool: PgPool) {
    use std::sync::atomic::Ordering;
    idempotency::migrate(&pool).await.unwrap();
    let clock = idempotency::ManualClock::starting_now();
    let ttl = Duration::from_secs(30);
    let store =
        idempotency::Store::new(pool.clone(), std::sync::Arc::new(clock.clone()), ttl).unwrap();
    let layer = idempotency_axum::IdempotencyLayer::new(store, |_| Ok(idempotency::Owner::from(1)))
        .with_heartbeat(Duration::from_millis(50));
    let effects = Effects::default();
    let router = axum::Router::new()
        .route("/effects", axum::routing::post(one_effect))
        .route_layer(layer)
        .with_state(effects.clone());

    // The key exists, unfinished and free: its first attempt answered 503.
    effects.failing.store(true, Ordering::SeqCst);
    assert_eq!(send_effect(router.clone()).await, 503);
    effects.failing.store(false, Ordering::SeqCst);

    // Request A's claim is held up: its takeover's write waits on a table lock another
    // transaction holds (a row lock would not hold it: the takeover locks its row NOWAIT), and
    // the TTL passes meanwhile.
    let mut blocker = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE idempotency_keys IN SHARE MODE")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let a = tokio::spawn(send_effect(router.clone()));
    testdb::until_a_lock_wait(
        &pool,
        "request A's takeover waits on the lock",
        Duration::from_secs(5),
    )
    .await;
    clock.advance(ttl + Duration::from_secs(1));
    blocker.rollback().await.unwrap();
    // A got a lease that is over by its own clock: it runs its handler anyway (the fault), or
    // answers without it.
    testdb::until(
        "request A ran its handler or answered",
        Duration::from_secs(5),
        || async { (effects.calls.load(Ordering::SeqCst) > 0 || a.is_finished()).then_some(()) },
    )
    .await;
    // Request B, the client's retry, takes the expired lease over while A's handler runs.
    let b = send_effect(router.clone()).await;
    let a = a.await.unwrap();
    let calls = effects.calls.load(Ordering::SeqCst);
    assert_eq!(
        calls, 1,
        "ONE KEY, TWO EFFECTS: the handler ran {calls} times at once (A answered {a}, B answered \
         {b}); A's lease had run out by its own clock before its handler started"
    );
}
