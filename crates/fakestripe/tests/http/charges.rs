//! `POST /v1/charges` and `GET /v1/charges/{id}`: success, decline, and bad input.

use fakestripe::messages;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::support::{Gateway, Reply};

#[testdb::test(template = crate::support::migrated)]
async fn charge_succeeds_with_a_stripe_charge_object(_: PgPoolOptions, options: PgConnectOptions) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    let body = format!(
        "amount=2000&currency=usd&customer={customer}&description=Ride+42\
         &metadata[ride_id]=42&metadata%5Buser_id%5D=7"
    );
    let reply = gw.send_post("/v1/charges", None, &body).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert!(reply
        .header("request-id")
        .is_some_and(|id| id.starts_with("req_")));
    assert_eq!(reply.header("idempotent-replayed"), None);
    let charge = reply.json();
    let id = charge["id"].as_str().unwrap();
    assert!(id.starts_with("ch_"), "{id}");
    assert_eq!(charge["object"], "charge");
    assert_eq!(charge["amount"], 2000);
    assert_eq!(charge["amount_captured"], 2000);
    assert_eq!(charge["currency"], "usd");
    assert_eq!(charge["customer"], customer.as_str());
    assert_eq!(charge["description"], "Ride 42");
    assert_eq!(
        charge["metadata"],
        serde_json::json!({"ride_id": "42", "user_id": "7"})
    );
    assert_eq!(charge["paid"], true);
    assert_eq!(charge["captured"], true);
    assert_eq!(charge["status"], "succeeded");
    assert_eq!(charge["livemode"], false);

    let fetched = gw.get(&format!("/v1/charges/{id}")).await;
    assert_eq!(fetched.status, 200);
    assert_eq!(fetched.json(), charge);

    let stored = fakestripe::charges_of_customer(gw.state.pool(), &customer)
        .await
        .unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].id, id);
    assert_eq!(stored[0].amount, 2000);
    assert_eq!(stored[0].idempotency_key_id, None);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn declined_card_gets_402_stores_no_charge_and_replays_the_decline(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_chargeCustomerFail").await;

    let first = gw.charge(Some("decline-1"), &customer, 1500).await;
    let error = first.stripe_error(402, "card_error");
    assert_eq!(error["code"], "card_declined");
    assert_eq!(error["decline_code"], "generic_decline");
    assert_eq!(error["message"], messages::CARD_DECLINED);
    assert_eq!(gw.charge_count().await, 0);

    // The decline is a final outcome: kept with the key and replayed exactly.
    let again = gw.charge(Some("decline-1"), &customer, 1500).await;
    assert_eq!(again.status, 402);
    assert!(again.replayed());
    assert_eq!(again.text, first.text);

    // Without a key it is declined all the same.
    let keyless = gw.charge(None, &customer, 1500).await;
    assert_eq!(
        keyless.stripe_error(402, "card_error")["code"],
        "card_declined"
    );
    assert_eq!(gw.charge_count().await, 0);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn bad_input_is_refused_with_stripe_errors_and_writes_nothing(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    let cases = [
        (
            format!("currency=usd&customer={customer}"),
            "amount",
            Some("parameter_missing"),
        ),
        (
            format!("amount=-100&currency=usd&customer={customer}"),
            "amount",
            Some("parameter_invalid_integer"),
        ),
        (
            format!("amount=12.5&currency=usd&customer={customer}"),
            "amount",
            Some("parameter_invalid_integer"),
        ),
        (
            format!("amount=20&currency=usd&customer={customer}"),
            "amount",
            Some("amount_too_small"),
        ),
        (
            format!("amount=2000&currency=dollars&customer={customer}"),
            "currency",
            None,
        ),
        (
            "amount=2000&currency=usd".to_owned(),
            "customer",
            Some("parameter_missing"),
        ),
        (
            "amount=2000&currency=usd&customer=cus_00000000000000".to_owned(),
            "customer",
            Some("resource_missing"),
        ),
        (
            format!("amount=2000&currency=usd&customer={customer}&capture=false"),
            "capture",
            Some("parameter_unknown"),
        ),
        (
            format!("amount=2000&currency=usd&customer={customer}&metadata[a][b]=1"),
            "metadata[a]",
            None,
        ),
        (
            format!("amount=1&amount=2&currency=usd&customer={customer}"),
            "amount",
            None,
        ),
    ];
    for (i, (body, param, code)) in cases.iter().enumerate() {
        // With an idempotency key, to show that refused requests are not stored either.
        let key = format!("bad-{i}");
        let reply = gw.send_post("/v1/charges", Some(&key), body).await;
        let error = reply.stripe_error(400, "invalid_request_error");
        assert_eq!(error["param"], *param, "{body}: {}", reply.text);
        if let Some(code) = code {
            assert_eq!(error["code"], *code, "{body}: {}", reply.text);
        }
        assert!(reply.header("request-id").is_some());
    }
    let missing = gw.charge(None, "cus_00000000000000", 2000).await;
    assert_eq!(
        missing.stripe_error(400, "invalid_request_error")["message"],
        "No such customer: 'cus_00000000000000'"
    );
    assert_eq!(gw.charge_count().await, 0);
    assert_eq!(gw.key_rows().await, 0);

    // A key used by a refused request is still free: a valid request with it runs afresh.
    let reply = gw.charge(Some("bad-0"), &customer, 2000).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert!(!reply.replayed());
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn wrong_or_missing_secret_key_gets_401(_: PgPoolOptions, options: PgConnectOptions) {
    let gw = Gateway::start(options).await;
    let url = gw.url("/v1/charges");
    let body = "amount=2000&currency=usd&customer=cus_00000000000000";
    let post = || gw.http.post(&url).body(body);

    let reply = Reply::read(post().send().await.unwrap()).await;
    assert_eq!(
        reply.stripe_error(401, "invalid_request_error")["message"],
        messages::NO_API_KEY
    );
    for bad in [
        "sk_live_abc",
        "pk_test_abc",
        "sk_test_",
        "sk_test_no-dashes",
    ] {
        let reply = Reply::read(post().bearer_auth(bad).send().await.unwrap()).await;
        let error = reply.stripe_error(401, "invalid_request_error");
        assert_eq!(error["message"], messages::INVALID_API_KEY, "{bad}");
        if bad != "sk_test_" {
            assert!(
                !reply.text.contains(bad),
                "the key must not be echoed: {}",
                reply.text
            );
        }
    }
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM accounts")
        .fetch_one(gw.state.pool())
        .await
        .unwrap();
    assert_eq!(count, 0);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn unknown_ids_and_routes_get_stripe_404s(_: PgPoolOptions, options: PgConnectOptions) {
    let gw = Gateway::start(options).await;
    let reply = gw.get("/v1/charges/ch_missing").await;
    let error = reply.stripe_error(404, "invalid_request_error");
    assert_eq!(error["code"], "resource_missing");
    assert_eq!(error["message"], "No such charge: 'ch_missing'");

    let reply = gw.get("/v1/refunds").await;
    let error = reply.stripe_error(404, "invalid_request_error");
    assert_eq!(
        error["message"],
        "Unrecognized request URL (GET: /v1/refunds)."
    );
    assert!(reply.header("request-id").is_some());

    let reply = Reply::read(
        gw.http
            .delete(gw.url("/v1/charges"))
            .bearer_auth("sk_test_x")
            .send()
            .await
            .unwrap(),
    )
    .await;
    reply.stripe_error(404, "invalid_request_error");
    gw.stop().await;
}
