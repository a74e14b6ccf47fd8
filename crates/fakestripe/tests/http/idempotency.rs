//! Stripe's idempotency semantics on `POST /v1/charges`.

use std::sync::Arc;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::Barrier;

use crate::support::{Gateway, Reply, KEY};

#[testdb::test(template = crate::support::migrated)]
async fn replay_returns_the_stored_response_byte_for_byte_with_replayed_header(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    let body = format!("amount=2000&currency=usd&customer={customer}&metadata[ride_id]=1");

    let first = gw.send_post("/v1/charges", Some("ride-1"), &body).await;
    assert_eq!(first.status, 200, "{}", first.text);
    assert!(!first.replayed());

    let second = gw.send_post("/v1/charges", Some("ride-1"), &body).await;
    assert_eq!(second.status, 200);
    assert!(second.replayed());
    assert_eq!(second.text, first.text);
    assert_eq!(second.header("content-type"), Some("application/json"));
    // A replay is a new delivery: it gets its own request id.
    assert_ne!(second.header("request-id"), first.header("request-id"));

    // The same parameters in another order are the same request.
    let reordered = format!("metadata[ride_id]=1&customer={customer}&currency=usd&amount=2000");
    let third = gw
        .send_post("/v1/charges", Some("ride-1"), &reordered)
        .await;
    assert!(third.replayed());
    assert_eq!(third.text, first.text);

    assert_eq!(gw.charge_count().await, 1);
    let charges = fakestripe::all_charges(gw.state.pool()).await.unwrap();
    assert_eq!(charges[0].id, first.json()["id"].as_str().unwrap());
    assert!(charges[0].idempotency_key_id.is_some());
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn same_key_with_other_parameters_is_an_idempotency_error(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    let first = gw.charge(Some("ride-2"), &customer, 2000).await;
    assert_eq!(first.status, 200);

    let other = gw.charge(Some("ride-2"), &customer, 2500).await;
    let error = other.stripe_error(400, "idempotency_error");
    assert!(
        error["message"].as_str().unwrap().contains("'ride-2'"),
        "{}",
        other.text
    );
    assert!(!other.replayed());
    assert_eq!(gw.charge_count().await, 1);

    // The original request still replays.
    let again = gw.charge(Some("ride-2"), &customer, 2000).await;
    assert!(again.replayed());
    assert_eq!(again.text, first.text);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn keys_are_scoped_to_their_account(_: PgPoolOptions, options: PgConnectOptions) {
    let gw = Gateway::start(options).await;
    let mine = gw.customer("tok_visa").await;
    let first = gw.charge(Some("shared-key"), &mine, 2000).await;
    assert_eq!(first.status, 200);

    // Another account's customer, charged under the same key by that account.
    let other_key = "sk_test_other_account";
    let theirs = gw
        .http
        .post(gw.url("/v1/customers"))
        .bearer_auth(other_key)
        .body("source=tok_visa")
        .send()
        .await
        .unwrap();
    let theirs = Reply::read(theirs).await.json()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let reply = gw
        .http
        .post(gw.url("/v1/charges"))
        .bearer_auth(other_key)
        .header("idempotency-key", "shared-key")
        .body(format!("amount=2000&currency=usd&customer={theirs}"))
        .send()
        .await
        .unwrap();
    let reply = Reply::read(reply).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert!(!reply.replayed());
    assert_eq!(gw.charge_count().await, 2);
    assert_ne!(KEY, other_key);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn concurrent_duplicates_make_exactly_one_charge(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    const TASKS: usize = 16;
    let gw = Arc::new(Gateway::start(options).await);
    let customer = gw.customer("tok_visa").await;
    let barrier = Arc::new(Barrier::new(TASKS));
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let (gw, barrier, customer) = (gw.clone(), barrier.clone(), customer.clone());
        tasks.push(tokio::spawn(async move {
            let request = gw.post(
                "/v1/charges",
                Some("double-click"),
                &format!("amount=2000&currency=usd&customer={customer}"),
            );
            // All requests leave together.
            barrier.wait().await;
            Reply::read(request.send().await.expect("send")).await
        }));
    }
    let mut fresh = Vec::new();
    let mut replays = Vec::new();
    let mut in_flight = 0;
    for task in tasks {
        let reply = task.await.unwrap();
        match reply.status {
            200 if reply.replayed() => replays.push(reply),
            200 => fresh.push(reply),
            409 => {
                let error = reply.stripe_error(409, "idempotency_error");
                assert_eq!(error["code"], "idempotency_key_in_use");
                in_flight += 1;
            }
            other => panic!("unexpected status {other}: {}", reply.text),
        }
    }
    assert_eq!(fresh.len(), 1, "exactly one request runs the charge");
    assert_eq!(fresh.len() + replays.len() + in_flight, TASKS);
    for replay in &replays {
        assert_eq!(replay.text, fresh[0].text);
    }
    assert_eq!(gw.charge_count().await, 1);
    assert_eq!(gw.key_rows().await, 1);
    Arc::into_inner(gw).expect("tasks are done").stop().await;
}
