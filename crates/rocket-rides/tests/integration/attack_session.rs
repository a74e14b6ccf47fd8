//! An adversary's try at the charge step: a holder that stands still between its call's record
//! and the send, while another request takes its key over, charges and answers. When the
//! paused holder goes on, it must send nothing: one charge, one answer.

use crate::common;

use std::time::Duration;

use common::{TestApp, RIDE};
use fakestripe::Faults;
use rocket_rides::failpoints::AFTER_CALL_RECORDED;
use sqlx::PgPool;

#[testdb::test(template = crate::common::migrated)]
async fn a_holder_paused_after_its_record_whose_key_was_taken_over_sends_nothing(pool: PgPool) {
    let (app, user_id, api_key) = TestApp::start_short_limits(pool).await;
    // The first attempt fails before the gateway charges: the ride waits at its charge.
    app.set_faults(Faults {
        fail_before_charge: 1.0,
        ..Faults::none()
    });
    let first = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(first.status, 503, "{first:?}");
    app.set_faults(Faults::none());

    // A retry records its call and stands still before sending it.
    app.clock.advance(Duration::from_secs(1));
    let mut still = app.state.failpoints.stand_still_at(AFTER_CALL_RECORDED);
    let paused = {
        let (http, base, api_key) = (app.http.clone(), app.base.clone(), api_key.clone());
        tokio::spawn(async move {
            let request = http
                .post(format!("{base}/rides"))
                .header("content-type", "application/json")
                .header("idempotency-key", "k-1")
                .bearer_auth(api_key)
                .body(RIDE);
            common::Reply::read(request.send().await.unwrap()).await
        })
    };
    still.reached().await;
    // Its lease runs out; another retry takes the key over, charges and answers.
    app.clock.advance(Duration::from_secs(7));
    let taken = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(taken.status, 201, "{taken:?}");
    assert_eq!(app.charges().await, 1);

    // The paused holder goes on: it must not send its call.
    still.go_on();
    let late = paused.await.unwrap();
    assert!(
        late.status == 201 || late.status == 409,
        "the late holder answers the stored answer or that it lost the key: {late:?}"
    );
    common::charges_come_to(&app, 1).await;
    assert_eq!(app.charges().await, 1, "one charge");
    let (status, charge_id, generation) = common::ride_state(&app, user_id).await;
    assert_eq!((status.as_str(), generation), ("paid", 1));
    assert_eq!(taken.json()["charge_id"].as_str(), charge_id.as_deref());
    // A later retry replays the one answer.
    let again = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(again.status, 201, "{again:?}");
    assert_eq!(again.json()["charge_id"], taken.json()["charge_id"]);
}
