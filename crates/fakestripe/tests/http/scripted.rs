//! Scripted charges: one customer's next charges fail or hang as a test says, in order.

use std::time::{Duration, Instant};

use fakestripe::{Scripted, MAX_LATENCY_MS};
use reqwest::Method;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::support::{Gateway, Reply};

#[testdb::test(template = crate::support::migrated)]
async fn a_script_fails_then_holds_its_customers_charges_in_order(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let scripted = gw.customer("tok_visa").await;
    let other = gw.customer("tok_visa").await;
    let script = format!(
        r#"{{"customer": "{scripted}",
             "actions": [{{"action": "fail_before"}}, {{"action": "hold", "ms": 300}}]}}"#
    );
    let reply = gw
        .admin_send(Method::POST, "/charges/script", &script)
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(reply.json()["left"], 2);
    assert_eq!(gw.state.scripted_left(&scripted), 2);

    // Another customer's charges go as drawn (no faults), and leave the script alone.
    let unscripted = gw.charge(Some("other-1"), &other, 2000).await;
    assert_eq!(unscripted.status, 200, "{}", unscripted.text);
    assert_eq!(gw.state.scripted_left(&scripted), 2);

    // FailBefore: a 500 before anything is written.
    gw.charge(Some("sc-1"), &scripted, 2000)
        .await
        .stripe_error(500, "api_error");
    let charges = || fakestripe::charges_of_customer(gw.state.pool(), &scripted);
    assert!(charges().await.unwrap().is_empty());
    assert_eq!(gw.key_rows().await, 1, "only the other customer's key");
    let counters = gw.state.counters();
    assert_eq!(
        (counters.scripted_fail_before, counters.fail_before_charge),
        (1, 0)
    );

    // Hold: the retry claims the key and waits at the gate, where a duplicate finds the key
    // in use; the scripted hold starts once the gate opens.
    gw.state.hold_charges();
    let body = format!("amount=2000&currency=usd&customer={scripted}");
    let held = tokio::spawn(gw.post("/v1/charges", Some("sc-1"), &body).send());
    gw.state.charges_held(1).await;
    assert_eq!(gw.state.scripted_left(&scripted), 0);
    let duplicate = gw.charge(Some("sc-1"), &scripted, 2000).await;
    let error = duplicate.stripe_error(409, "idempotency_error");
    assert_eq!(error["code"], "idempotency_key_in_use");
    assert_eq!(gw.state.counters().scripted_holds, 0, "not started yet");

    let released = Instant::now();
    gw.state.release_charges();
    let held = Reply::read(held.await.unwrap().expect("the held charge answers")).await;
    assert!(
        released.elapsed() >= Duration::from_millis(300),
        "answered after {:?}",
        released.elapsed()
    );
    assert_eq!(held.status, 200, "{}", held.text);
    assert!(!held.replayed(), "the retry after FailBefore ran afresh");
    assert_eq!(gw.state.counters().scripted_holds, 1);
    let made = charges().await.unwrap();
    assert_eq!(made.len(), 1);
    assert_eq!(held.json()["id"], made[0].id.as_str());

    // The script is spent: the next charge goes as drawn, without a hold.
    let after = gw.charge(Some("sc-2"), &scripted, 2000).await;
    assert_eq!(after.status, 200, "{}", after.text);
    assert_eq!(gw.state.counters().scripted_holds, 1);
    assert_eq!(gw.charge_count().await, 3);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn admin_script_endpoint_refuses_bad_scripts_and_queues_nothing(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let too_long = r#"{"customer": "x", "actions": [{"action": "hold", "ms": 99999999}]}"#;
    let reply = gw
        .admin_send(Method::POST, "/charges/script", too_long)
        .await;
    assert_eq!(reply.status, 400, "{}", reply.text);
    let message = reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.contains("99999999") && message.contains(&MAX_LATENCY_MS.to_string()),
        "{message}"
    );

    for bad in [
        r#"{"customer": "x", "actions": [], "replace": true}"#,
        r#"{"customer": "x", "actions": [{"action": "hold", "ms": 5, "jitter": 1}]}"#,
        r#"{"customer": "x", "actions": [{"action": "explode"}]}"#,
        r#"{"customer": "x", "actions": [{"action": "hold"}]}"#,
        r#"{"customer": "x", "actions": [{"action": "fail_before", "ms": 5}]}"#,
        r#"{"customer": "x", "actions": [{"action": "fail_before"},
                                         {"action": "hold", "ms": 99999999}]}"#,
        r#"{"customer": "", "actions": [{"action": "fail_before"}]}"#,
        r#"{"actions": [{"action": "fail_before"}]}"#,
        "not json",
    ] {
        let reply = gw.admin_send(Method::POST, "/charges/script", bad).await;
        assert_eq!(reply.status, 400, "{bad}: {}", reply.text);
        assert!(
            reply.json()["error"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("invalid script: ")),
            "{bad}: {}",
            reply.text
        );
    }
    let unknown = gw
        .admin_send(
            Method::POST,
            "/charges/script",
            r#"{"customer": "x", "actions": [], "replace": true}"#,
        )
        .await;
    assert!(unknown.text.contains("unknown field"), "{}", unknown.text);
    assert_eq!(
        gw.state.scripted_left("x"),
        0,
        "refused scripts queue nothing"
    );

    // The same customer with a valid script is accepted: the refusals were for their values.
    let good = r#"{"customer": "x", "actions": [{"action": "hold", "ms": 20000}]}"#;
    let reply = gw.admin_send(Method::POST, "/charges/script", good).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(gw.state.scripted_left("x"), 1);
    // And the library refuses what the endpoint refuses.
    assert!(gw
        .state
        .try_script_charges("x", vec![Scripted::Hold { ms: 99_999_999 }])
        .is_err());
    assert_eq!(gw.state.scripted_left("x"), 1);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn a_scripted_intermediary_answers_on_its_own_before_or_after_the_charge(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    gw.state.script_charges(
        &customer,
        vec![
            Scripted::Intermediary {
                status: 404,
                empty: false,
                after_charge: true,
            },
            Scripted::Intermediary {
                status: 400,
                empty: true,
                after_charge: false,
            },
        ],
    );
    let charges = || fakestripe::charges_of_customer(gw.state.pool(), &customer);
    // After the charge: a 404 page, and the charge is made and stored under its key.
    let after = gw.charge(Some("i-1"), &customer, 2000).await;
    assert_eq!(after.status, 404, "{}", after.text);
    assert!(after.text.contains("<html>"), "{}", after.text);
    assert!(!after.text.contains("\"error\""));
    assert_eq!(charges().await.unwrap().len(), 1);
    // Before: an empty 400, and nothing is written.
    let before = gw.charge(Some("i-2"), &customer, 2000).await;
    assert_eq!(before.status, 400, "{}", before.text);
    assert!(before.text.is_empty(), "{}", before.text);
    assert_eq!(charges().await.unwrap().len(), 1);
    let counters = gw.state.counters();
    assert_eq!(
        (counters.intermediary_after, counters.intermediary_before),
        (1, 1)
    );
    // The retries get the gateway's own answers: the stored charge, and a fresh one.
    let replay = gw.charge(Some("i-1"), &customer, 2000).await;
    assert_eq!((replay.status, replay.replayed()), (200, true));
    let fresh = gw.charge(Some("i-2"), &customer, 2000).await;
    assert_eq!((fresh.status, fresh.replayed()), (200, false));
    assert_eq!(charges().await.unwrap().len(), 2);
    // A status no intermediary here answers with is refused, and queues nothing.
    let bad = gw.state.try_script_charges(
        &customer,
        vec![Scripted::Intermediary {
            status: 200,
            empty: true,
            after_charge: false,
        }],
    );
    assert!(bad.is_err());
    assert_eq!(gw.state.scripted_left(&customer), 0);
    let parsed: Vec<Scripted> = serde_json::from_str(
        r#"[{"action": "intermediary", "status": 504, "empty": true, "after_charge": true}]"#,
    )
    .unwrap();
    assert_eq!(
        parsed,
        [Scripted::Intermediary {
            status: 504,
            empty: true,
            after_charge: true
        }]
    );
    assert!(
        serde_json::from_str::<Scripted>(r#"{"action": "hold", "ms": 5, "status": 404}"#).is_err()
    );
}
