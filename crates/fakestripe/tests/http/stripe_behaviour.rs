//! What real Stripe does that a client must survive: 500s stored under their key, keys that are
//! forgotten after their window, charges that are `pending` before they settle, customers that
//! are deleted (every later charge refused for good), and lists filtered by `created`.

use fakestripe::Faults;
use serde_json::{json, Value};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::support::Gateway;

fn charge_body(customer: &str, request: &str) -> String {
    format!("amount=2000&currency=usd&customer={customer}&metadata[request]={request}")
}

#[testdb::test(template = crate::support::migrated)]
async fn a_sticky_500_without_a_charge_is_replayed_until_the_key_is_forgotten(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    gw.state.set_faults(Faults {
        sticky_500_before_charge: 1.0,
        ..Faults::none()
    });
    let first = gw
        .send_post(
            "/v1/charges",
            Some("sticky-1"),
            &charge_body(&customer, "r1"),
        )
        .await;
    first.stripe_error(500, "api_error");
    assert!(!first.replayed());

    // The fault is off now, yet the key keeps its 500: Stripe stores the result of a request
    // that began executing, errors included.
    gw.state.set_faults(Faults::none());
    let again = gw
        .send_post(
            "/v1/charges",
            Some("sticky-1"),
            &charge_body(&customer, "r1"),
        )
        .await;
    again.stripe_error(500, "api_error");
    assert!(again.replayed(), "the stored 500 is replayed");
    assert_eq!(gw.charge_count().await, 0);
    assert_eq!(gw.state.counters().sticky_500_before_charge, 1);

    // Once the gateway forgets the key, the same key charges afresh.
    assert_eq!(
        gw.state
            .forget_keys(std::time::Duration::ZERO)
            .await
            .unwrap(),
        1
    );
    let after = gw
        .send_post(
            "/v1/charges",
            Some("sticky-1"),
            &charge_body(&customer, "r1"),
        )
        .await;
    assert_eq!(after.status, 200, "{}", after.text);
    assert!(!after.replayed());
    assert_eq!(gw.charge_count().await, 1);
    assert_eq!(gw.state.counters().keys_forgotten, 1);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn a_sticky_500_after_the_charge_hides_it_from_retries_but_not_from_the_list(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    gw.state.set_faults(Faults {
        sticky_500_after_charge: 1.0,
        ..Faults::none()
    });
    let first = gw
        .send_post(
            "/v1/charges",
            Some("sticky-2"),
            &charge_body(&customer, "r2"),
        )
        .await;
    first.stripe_error(500, "api_error");
    gw.state.set_faults(Faults::none());
    let again = gw
        .send_post(
            "/v1/charges",
            Some("sticky-2"),
            &charge_body(&customer, "r2"),
        )
        .await;
    again.stripe_error(500, "api_error");
    assert!(again.replayed());

    // The charge exists, and only a list finds it, by its metadata.
    let list = gw
        .get(&format!("/v1/charges?customer={customer}"))
        .await
        .json();
    let data = list["data"].as_array().unwrap();
    assert_eq!(data.len(), 1, "{list}");
    assert_eq!(data[0]["metadata"]["request"], "r2");
    assert_eq!(data[0]["status"], "succeeded");
    assert_eq!(gw.state.counters().sticky_500_after_charge, 1);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn a_forgotten_key_charges_again_as_stripe_does_after_its_window(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    let first = gw.charge(Some("window-1"), &customer, 2000).await;
    assert_eq!(first.status, 200);
    // A key younger than the window is kept.
    let kept = gw
        .state
        .forget_keys(std::time::Duration::from_secs(3600))
        .await;
    assert_eq!(kept.unwrap(), 0);
    assert!(gw
        .charge(Some("window-1"), &customer, 2000)
        .await
        .replayed());
    // Past it, the key is gone and the same key is a new charge: the danger a client guards
    // against by reconciling before it retries a key older than the window.
    let forgotten = admin_post(&gw, "/keys/forget", json!({"older_than_ms": 0})).await;
    assert_eq!(forgotten, (200, json!({"forgotten": 1})));
    let second = gw.charge(Some("window-1"), &customer, 2000).await;
    assert_eq!(second.status, 200);
    assert!(!second.replayed());
    assert_ne!(first.json()["id"], second.json()["id"]);
    assert_eq!(gw.charge_count().await, 2);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn a_pending_charge_is_not_paid_until_it_settles(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    gw.state.set_faults(Faults {
        pending_charges: 1.0,
        ..Faults::none()
    });
    let created = gw.charge(Some("pending-1"), &customer, 2000).await.json();
    let paid_later = gw.charge(Some("pending-2"), &customer, 3000).await.json();
    for charge in [&created, &paid_later] {
        assert_eq!(charge["status"], "pending");
        assert_eq!(charge["paid"], false);
    }
    // A replay repeats what was stored: still pending. Only a retrieve tells the news.
    let settled = admin_post(&gw, "/charges/settle", json!({"status": "failed"})).await;
    assert_eq!(settled, (200, json!({"settled": 2})));
    let replay = gw.charge(Some("pending-1"), &customer, 2000).await;
    assert!(replay.replayed());
    assert_eq!(replay.json()["status"], "pending");
    let now = gw
        .get(&format!("/v1/charges/{}", created["id"].as_str().unwrap()))
        .await
        .json();
    assert_eq!(now["status"], "failed");
    assert_eq!(now["paid"], false);
    assert_eq!(now["failure_code"], "card_declined");
    assert_eq!(gw.state.counters().pending_charges, 2);

    gw.state.set_faults(Faults {
        pending_charges: 1.0,
        ..Faults::none()
    });
    let third = gw.charge(Some("pending-3"), &customer, 4000).await.json();
    assert_eq!(gw.state.settle_pending_charges(true).await.unwrap(), 1);
    let now = gw
        .get(&format!("/v1/charges/{}", third["id"].as_str().unwrap()))
        .await
        .json();
    assert_eq!(
        (now["status"].clone(), now["paid"].clone()),
        (json!("succeeded"), json!(true))
    );
    let bad = admin_post(&gw, "/charges/settle", json!({"status": "paid"})).await;
    assert_eq!(bad.0, 400, "an unknown status is refused: {}", bad.1);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn a_deleted_customer_is_refused_for_good_but_its_stored_charges_still_replay(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    let before = gw.charge(Some("del-1"), &customer, 2000).await;
    assert_eq!(before.status, 200);

    let deleted = gw
        .http
        .delete(gw.url(&format!("/v1/customers/{customer}")))
        .bearer_auth(crate::support::KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 200);
    assert_eq!(
        serde_json::from_slice::<Value>(&deleted.bytes().await.unwrap()).unwrap(),
        json!({"id": customer, "object": "customer", "deleted": true})
    );
    let shown = gw.get(&format!("/v1/customers/{customer}")).await.json();
    assert_eq!(shown["deleted"], true);

    // A new charge is refused with Stripe's error, and the refusal is not kept: the key is free.
    for _ in 0..2 {
        let refused = gw.charge(Some("del-2"), &customer, 2000).await;
        let error = refused.stripe_error(400, "invalid_request_error");
        assert_eq!(error["code"], "resource_missing");
        assert_eq!(error["param"], "customer");
        assert!(!refused.replayed());
    }
    assert_eq!(gw.key_rows().await, 1, "only the charge's key is kept");
    assert_eq!(gw.state.counters().refused, 2);
    // The key of a refused request may be used again with other parameters.
    let other = gw.customer("tok_visa").await;
    assert_eq!(gw.charge(Some("del-2"), &other, 2000).await.status, 200);

    // The key whose charge was stored before the deletion still replays it.
    let replay = gw.charge(Some("del-1"), &customer, 2000).await;
    assert_eq!(replay.status, 200);
    assert!(replay.replayed());
    assert_eq!(replay.json()["id"], before.json()["id"]);

    // Deleting twice is a 404, as for any unknown customer.
    let again = gw
        .http
        .delete(gw.url(&format!("/v1/customers/{customer}")))
        .bearer_auth(crate::support::KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 404);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn lists_filter_by_created_seconds_and_refuse_unknown_bounds(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    for amount in [1000, 2000, 3000] {
        assert_eq!(gw.charge(None, &customer, amount).await.status, 200);
    }
    // Backdate the first charge by an hour, as if it were made earlier.
    sqlx::query("UPDATE charges SET created = created - interval '1 hour' WHERE amount = 1000")
        .execute(gw.state.pool())
        .await
        .unwrap();
    let all = fakestripe::charges_of_customer(gw.state.pool(), &customer)
        .await
        .unwrap();
    let old = all.iter().find(|c| c.amount == 1000).unwrap();
    let newest = all
        .iter()
        .map(|c| c.created.unix_timestamp())
        .max()
        .unwrap();
    let amounts = |query: String| amounts_listed(&gw, &customer, query);
    let old_second = old.created.unix_timestamp();
    assert_eq!(
        amounts(format!("created[gte]={}", old_second + 1)).await,
        [2000, 3000]
    );
    assert_eq!(amounts(format!("created[lte]={old_second}")).await, [1000]);
    assert_eq!(amounts(format!("created={old_second}")).await, [1000]);
    assert_eq!(
        amounts(format!("created[gt]={old_second}")).await,
        [2000, 3000]
    );
    assert_eq!(
        amounts(format!("created[lt]={}", newest + 1)).await,
        [1000, 2000, 3000]
    );
    assert_eq!(
        amounts(format!("created[gt]={newest}")).await,
        Vec::<i64>::new()
    );

    let bad = gw.get("/v1/charges?created[since]=1").await;
    assert_eq!(
        bad.stripe_error(400, "invalid_request_error")["param"],
        "created[since]"
    );
    let bad = gw.get("/v1/charges?created[gte]=yesterday").await;
    assert_eq!(
        bad.stripe_error(400, "invalid_request_error")["code"],
        "parameter_invalid_integer"
    );
    gw.stop().await;
}

/// The amounts of the customer's charges that a filtered list returns, sorted.
async fn amounts_listed(gw: &Gateway, customer: &str, query: String) -> Vec<i64> {
    let reply = gw
        .get(&format!("/v1/charges?customer={customer}&{query}"))
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let mut amounts: Vec<i64> = reply.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["amount"].as_i64().unwrap())
        .collect();
    amounts.sort();
    amounts
}

/// A JSON POST to the admin API; its status and JSON answer.
async fn admin_post(gw: &Gateway, path: &str, body: Value) -> (u16, Value) {
    let response = gw
        .http
        .post(format!("{}{path}", gw.admin))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let body = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
    (status, body)
}
