//! Holders that stand still between the steps of the charge (a paused process, a frozen virtual
//! machine) and then go on, while nobody took their key over: each of these pauses let a card
//! be charged twice before the charge step closed it (`docs/protocol.md`, "Gaps the model found
//! in the protocol"). A real Rocket Rides and a real fakestripe on loopback; the holder stands
//! still at a failpoint while the test moves the clock and the gateway.

use crate::common;

use std::time::Duration;

use common::{TestApp, RIDE};
use fakestripe::Faults;
use rocket_rides::failpoints::{AFTER_CALL_RECORDED, AFTER_RIDE_LOADED};
use rocket_rides::problem::types;
use sqlx::PgPool;

const ADOPTED: &str = "gateway_reconciliations_total{outcome=\"adopted\"}";
const WINDOW: Duration = common::SHORT_KEY_WINDOW;

/// `POST /rides` under `k-1`, on a task of its own, so that the test can act while the
/// booking stands still.
fn post_in_background(app: &TestApp, api_key: &str) -> tokio::task::JoinHandle<common::Reply> {
    let (http, base, api_key) = (app.http.clone(), app.base.clone(), api_key.to_owned());
    tokio::spawn(async move {
        let request = http
            .post(format!("{base}/rides"))
            .header("content-type", "application/json")
            .header("idempotency-key", "k-1")
            .bearer_auth(api_key)
            .body(RIDE);
        common::Reply::read(request.send().await.unwrap()).await
    })
}

#[testdb::test(template = crate::common::migrated)]
async fn a_call_that_stood_still_after_its_record_is_recorded_again_before_it_leaves(pool: PgPool) {
    let (app, user_id, api_key) = TestApp::start_short_limits(pool).await;
    // The first attempt fails before the gateway charges: generation 1 began at t = 0.
    app.set_faults(Faults {
        fail_before_charge: 1.0,
        ..Faults::none()
    });
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(first.status, 503, "{first:?}");
    app.set_faults(Faults::none());

    // At t = 5 s a retry records its call, then stands still for 14 s: past its lease (nobody
    // takes the key meanwhile) and past the processing bound counted from that record.
    app.clock.advance(Duration::from_secs(5));
    let mut still = app.state.failpoints.stand_still_at(AFTER_CALL_RECORDED);
    let retry = post_in_background(&app, &api_key);
    still.reached().await;
    app.clock.advance(Duration::from_secs(14));
    // It goes on at t = 19 s, inside the window; the gateway is slow with what it sends.
    app.gateway.hold_charges();
    still.go_on();
    let retried = retry.await.unwrap();
    assert_eq!(
        (retried.status, common::problem_kind(&retried).as_str()),
        (503, types::GATEWAY_UNAVAILABLE),
        "{retried:?}"
    );
    app.gateway.charges_held(1).await;

    // At t = 21 s the window has passed. The call still at the gateway left at t = 19 s: the
    // list must wait for it, whatever the record at t = 5 s says.
    app.clock.advance(Duration::from_secs(2));
    let past = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(
        (past.status, common::problem_kind(&past).as_str()),
        (503, types::PAYMENT_UNCONFIRMED),
        "a list now would miss the charge still being made: {past:?}"
    );
    assert_eq!(app.charges().await, 0);

    // The gateway makes the charge; past the wait, the list finds it.
    app.gateway.release_charges();
    common::charges_come_to(&app, 1).await;
    let after: u64 = past.header("retry-after").unwrap().parse().unwrap();
    app.clock.advance(Duration::from_secs(after));
    let done = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(done.status, 201, "{done:?}");
    assert_eq!(app.charges().await, 1, "one charge, adopted");
    let (status, charge_id, generation) = common::ride_state(&app, user_id).await;
    assert_eq!((status.as_str(), generation), ("paid", 1));
    assert_eq!(done.json()["charge_id"].as_str(), charge_id.as_deref());
}

#[testdb::test(template = crate::common::migrated)]
async fn a_holder_that_stood_still_after_reading_its_ride_past_the_window_reconciles_instead_of_calling(
    pool: PgPool,
) {
    let (app, user_id, api_key) = TestApp::start_short_limits(pool).await;
    // The first attempt charges, and its answer is lost.
    app.set_faults(Faults {
        drop_after_charge: 1.0,
        ..Faults::none()
    });
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(first.status, 503, "{first:?}");
    app.set_faults(Faults::none());
    assert_eq!(app.charges().await, 1);

    // Half a second before the window ends, a retry takes the key over and reads its ride:
    // inside the window. It stands still there.
    app.clock.advance(WINDOW - Duration::from_millis(500));
    let mut still = app.state.failpoints.stand_still_at(AFTER_RIDE_LOADED);
    let retry = post_in_background(&app, &api_key);
    still.reached().await;
    // It goes on a second later, past the window, when the gateway may have forgotten the key;
    // this one has.
    app.clock.advance(Duration::from_secs(1));
    app.gateway.forget_keys(Duration::ZERO).await.unwrap();
    still.go_on();
    let retried = retry.await.unwrap();
    assert_eq!(retried.status, 201, "{retried:?}");
    assert_eq!(
        app.charges().await,
        1,
        "the first charge, found by the list, not made again under the forgotten key"
    );
    assert_eq!(app.metric(ADOPTED).await, 1.0);
    let (status, charge_id, generation) = common::ride_state(&app, user_id).await;
    assert_eq!((status.as_str(), generation), ("paid", 1));
    assert_eq!(retried.json()["charge_id"].as_str(), charge_id.as_deref());
}
