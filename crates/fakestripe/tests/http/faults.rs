//! Injected faults on `POST /v1/charges`, set through the library and through the admin API.

use fakestripe::{messages, FaultCounters, Faults, Scripted};
use reqwest::Method;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::{Gateway, Reply, KEY};

#[testdb::test(template = crate::support::migrated)]
async fn fail_before_charge_answers_500_and_writes_nothing(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    gw.state.set_faults(Faults {
        fail_before_charge: 1.0,
        ..Faults::none()
    });

    let reply = gw.charge(Some("fb-1"), &customer, 2000).await;
    reply.stripe_error(500, "api_error");
    assert_eq!(gw.charge_count().await, 0);
    assert_eq!(gw.key_rows().await, 0, "the key was not even claimed");
    assert_eq!(gw.state.counters().fail_before_charge, 1);

    // Once the gateway recovers, the retry runs the charge afresh.
    gw.state.set_faults(Faults::none());
    let retry = gw.charge(Some("fb-1"), &customer, 2000).await;
    assert_eq!(retry.status, 200, "{}", retry.text);
    assert!(!retry.replayed());
    assert_eq!(gw.charge_count().await, 1);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn fail_after_charge_commits_and_the_retry_returns_the_charge(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    gw.state.set_faults(Faults {
        fail_after_charge: 1.0,
        ..Faults::none()
    });

    let reply = gw.charge(Some("fa-1"), &customer, 2000).await;
    reply.stripe_error(500, "api_error");
    let charges = fakestripe::charges_of_customer(gw.state.pool(), &customer)
        .await
        .unwrap();
    assert_eq!(charges.len(), 1, "the charge was committed before the 500");

    // The retry replays the stored charge, even with the fault still on: replays are not struck.
    let retry = gw.charge(Some("fa-1"), &customer, 2000).await;
    assert_eq!(retry.status, 200, "{}", retry.text);
    assert!(retry.replayed());
    assert_eq!(retry.json()["id"], charges[0].id.as_str());
    assert_eq!(gw.charge_count().await, 1);
    assert_eq!(gw.state.counters().fail_after_charge, 1);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn drop_after_charge_is_a_transport_error_and_the_retry_returns_the_charge(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    gw.state.set_faults(Faults {
        drop_after_charge: 1.0,
        ..Faults::none()
    });

    let result = gw
        .post(
            "/v1/charges",
            Some("da-1"),
            &format!("amount=2000&currency=usd&customer={customer}"),
        )
        .send()
        .await;
    // No response at all, not even a status line: the client cannot tell what happened.
    let error = result.expect_err("the connection must end without a response");
    assert!(!error.is_timeout() && error.status().is_none(), "{error:?}");
    let charges = fakestripe::charges_of_customer(gw.state.pool(), &customer)
        .await
        .unwrap();
    assert_eq!(charges.len(), 1, "the charge was committed before the drop");

    let retry = gw.charge(Some("da-1"), &customer, 2000).await;
    assert_eq!(retry.status, 200, "{}", retry.text);
    assert!(retry.replayed());
    assert_eq!(retry.json()["id"], charges[0].id.as_str());
    assert_eq!(gw.charge_count().await, 1);
    assert_eq!(gw.state.counters().drop_after_charge, 1);

    // A charge without a key is dropped the same way, and still made. Read raw from the
    // socket: not one byte of a response arrives before the connection closes.
    let body = format!("amount=3000&currency=usd&customer={customer}");
    let request = format!(
        "POST /v1/charges HTTP/1.1\r\nHost: fakestripe\r\nAuthorization: Bearer {KEY}\r\n\
         Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut socket = TcpStream::connect(gw.base.trim_start_matches("http://"))
        .await
        .unwrap();
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut received = Vec::new();
    // A reset instead of a clean close is as good: either way no response came.
    let _ = socket.read_to_end(&mut received).await;
    assert!(
        received.is_empty(),
        "got {:?}",
        String::from_utf8_lossy(&received)
    );
    assert_eq!(gw.charge_count().await, 2);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn conflict_in_flight_answers_409_and_writes_nothing(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    gw.state.set_faults(Faults {
        conflict_in_flight: 1.0,
        ..Faults::none()
    });

    let reply = gw.charge(Some("cf-1"), &customer, 2000).await;
    let error = reply.stripe_error(409, "idempotency_error");
    assert_eq!(error["code"], "idempotency_key_in_use");
    assert_eq!(gw.charge_count().await, 0);
    assert_eq!(gw.key_rows().await, 0);

    gw.state.set_faults(Faults::none());
    let retry = gw.charge(Some("cf-1"), &customer, 2000).await;
    assert_eq!(retry.status, 200);
    assert!(!retry.replayed());
    assert_eq!(gw.state.counters().conflict_in_flight, 1);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn declines_and_customer_requests_are_never_struck(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    gw.state.set_faults(Faults {
        fail_after_charge: 1.0,
        drop_after_charge: 1.0,
        latency_ms: 1,
        ..Faults::none()
    });
    // Faults apply to POST /v1/charges only.
    let declining = gw.customer("tok_chargeCustomerFail").await;
    // A decline commits no charge, so the after-charge faults do not apply to it.
    let reply = gw.charge(Some("dc-1"), &declining, 2000).await;
    reply.stripe_error(402, "card_error");
    assert_eq!(
        gw.state.counters(),
        FaultCounters {
            latency: 1,
            ..FaultCounters::default()
        },
        "only the latency was injected"
    );
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn admin_api_sets_validates_and_counts_faults(_: PgPoolOptions, options: PgConnectOptions) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    let admin = |path: &str| format!("{}{path}", gw.admin);

    let current = Reply::read(gw.http.get(admin("/faults")).send().await.unwrap()).await;
    assert_eq!(current.status, 200);
    assert_eq!(
        serde_json::from_str::<Faults>(&current.text).unwrap(),
        Faults::none()
    );

    for bad in [
        r#"{"fail_after_charge": 1.5}"#,
        r#"{"drop_after_charge": -0.1}"#,
        r#"{"latency_ms": 999999}"#,
        r#"{"fail_after_chrage": 1}"#,
        "not json",
    ] {
        let reply = gw
            .http
            .put(admin("/faults"))
            .body(bad)
            .send()
            .await
            .unwrap();
        let reply = Reply::read(reply).await;
        assert_eq!(reply.status, 400, "{bad}: {}", reply.text);
        assert!(reply.json()["error"]["message"].is_string());
    }
    assert_eq!(
        gw.state.faults(),
        Faults::none(),
        "refused settings change nothing"
    );

    let reply = gw
        .http
        .put(admin("/faults"))
        .header("content-type", "application/json")
        .body(r#"{"fail_before_charge": 1, "seed": 42}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 200);
    let expected = Faults {
        fail_before_charge: 1.0,
        seed: Some(42),
        ..Faults::none()
    };
    assert_eq!(gw.state.faults(), expected);

    gw.charge(Some("admin-1"), &customer, 2000)
        .await
        .stripe_error(500, "api_error");
    let counters = Reply::read(gw.http.get(admin("/faults/counters")).send().await.unwrap()).await;
    let counters: FaultCounters = serde_json::from_str(&counters.text).unwrap();
    assert_eq!(
        counters,
        FaultCounters {
            fail_before_charge: 1,
            ..FaultCounters::default()
        }
    );
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn idempotency_error_on_replay_strikes_only_keys_that_hold_a_charge(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    let declining = gw.customer("tok_chargeCustomerFail").await;

    // Keys holding a succeeded charge, a pending one (since failed), a decline and a sticky 500.
    let first = gw.charge(Some("ie-1"), &customer, 2000).await;
    assert_eq!(first.status, 200, "{}", first.text);
    gw.state.set_faults(Faults {
        pending_charges: 1.0,
        ..Faults::none()
    });
    let pending = gw.charge(Some("ie-pending"), &customer, 2000).await;
    assert_eq!(pending.json()["status"], "pending", "{}", pending.text);
    gw.state.settle_pending_charges(false).await.unwrap();
    gw.state.set_faults(Faults {
        sticky_500_before_charge: 1.0,
        ..Faults::none()
    });
    gw.charge(Some("ie-500"), &customer, 2000)
        .await
        .stripe_error(500, "api_error");
    gw.state.set_faults(Faults::none());
    gw.charge(Some("ie-decline"), &declining, 2000)
        .await
        .stripe_error(402, "card_error");
    let keys = gw.key_rows().await;

    gw.state.set_faults(Faults {
        idempotency_error_on_replay: 1.0,
        ..Faults::none()
    });
    for key in ["ie-1", "ie-pending"] {
        // The same parameters as the first request: only the fault makes it a mismatch.
        let retry = gw.charge(Some(key), &customer, 2000).await;
        let error = retry.stripe_error(400, "idempotency_error");
        assert_eq!(error["message"], messages::idempotency_mismatch(key));
        assert!(!retry.replayed());
    }
    assert_eq!(gw.charge_count().await, 2, "no charge was added");
    assert_eq!(gw.key_rows().await, keys, "nothing was written");
    assert_eq!(gw.state.counters().idempotency_error_on_replay, 2);

    // A stored 500 and a stored decline replay as usual.
    let sticky = gw.charge(Some("ie-500"), &customer, 2000).await;
    sticky.stripe_error(500, "api_error");
    assert!(sticky.replayed());
    let decline = gw.charge(Some("ie-decline"), &declining, 2000).await;
    decline.stripe_error(402, "card_error");
    assert!(decline.replayed());
    // A fresh key has no charge to protect: it charges.
    let fresh = gw.charge(Some("ie-2"), &customer, 2000).await;
    assert_eq!(fresh.status, 200, "{}", fresh.text);
    assert!(!fresh.replayed());
    assert_eq!(gw.charge_count().await, 3);
    assert_eq!(gw.state.counters().idempotency_error_on_replay, 2);

    // The key was left as it was: without the fault it replays its charge.
    gw.state.set_faults(Faults::none());
    let replay = gw.charge(Some("ie-1"), &customer, 2000).await;
    assert!(replay.replayed());
    assert_eq!(replay.text, first.text);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn admin_counters_name_the_intermediary_replay_and_scripted_faults(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    let set = |faults: &'static str| {
        let gw = &gw;
        async move {
            let reply = gw.admin_send(Method::PUT, "/faults", faults).await;
            assert_eq!(reply.status, 200, "{faults}: {}", reply.text);
        }
    };

    set(r#"{"intermediary_before": 1}"#).await;
    gw.charge(Some("cn-0"), &customer, 2000)
        .await
        .intermediary();
    set(r#"{"intermediary_after": 1}"#).await;
    gw.charge(Some("cn-1"), &customer, 2000)
        .await
        .intermediary();
    set(r#"{"idempotency_error_on_replay": 1}"#).await;
    gw.charge(Some("cn-1"), &customer, 2000)
        .await
        .stripe_error(400, "idempotency_error");
    set("{}").await;
    gw.state.script_charges(
        &customer,
        vec![Scripted::FailBefore, Scripted::Hold { ms: 0 }],
    );
    gw.charge(Some("cn-2"), &customer, 2000)
        .await
        .stripe_error(500, "api_error");
    assert_eq!(gw.charge(Some("cn-2"), &customer, 2000).await.status, 200);

    let reply = Reply::read(
        gw.http
            .get(format!("{}/faults/counters", gw.admin))
            .send()
            .await
            .unwrap(),
    )
    .await;
    let counters = reply.json();
    for name in [
        "intermediary_before",
        "intermediary_after",
        "idempotency_error_on_replay",
        "scripted_fail_before",
        "scripted_holds",
    ] {
        assert_eq!(counters[name], 1, "{name} in {counters}");
    }
    // Each was counted under its own name only.
    assert_eq!(
        serde_json::from_value::<FaultCounters>(counters).unwrap(),
        FaultCounters {
            intermediary_before: 1,
            intermediary_after: 1,
            idempotency_error_on_replay: 1,
            scripted_fail_before: 1,
            scripted_holds: 1,
            ..FaultCounters::default()
        }
    );
    gw.stop().await;
}
