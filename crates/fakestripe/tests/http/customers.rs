//! `POST /v1/customers` and `GET /v1/customers/{id}`.

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::support::Gateway;

#[testdb::test(template = crate::support::migrated)]
async fn created_customer_is_a_stripe_customer_object_and_can_be_retrieved(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let reply = gw
        .send_post(
            "/v1/customers",
            None,
            "email=ann%40example.com&source=tok_visa&metadata[user_id]=7",
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert!(reply
        .header("request-id")
        .is_some_and(|id| id.starts_with("req_")));
    let customer = reply.json();
    let id = customer["id"].as_str().unwrap();
    assert!(id.starts_with("cus_") && id.len() == 18, "{id}");
    assert_eq!(customer["object"], "customer");
    assert_eq!(customer["email"], "ann@example.com");
    assert_eq!(customer["livemode"], false);
    assert_eq!(customer["metadata"]["user_id"], "7");
    assert!(customer["created"].as_i64().is_some());

    let fetched = gw.get(&format!("/v1/customers/{id}")).await;
    assert_eq!(fetched.status, 200);
    assert_eq!(fetched.json(), customer);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn unknown_source_token_is_refused_with_param_source(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let reply = gw
        .send_post("/v1/customers", None, "source=tok_nonsense")
        .await;
    let error = reply.stripe_error(400, "invalid_request_error");
    assert_eq!(error["param"], "source");
    assert_eq!(error["code"], "resource_missing");
    assert_eq!(error["message"], "No such token: 'tok_nonsense'");

    let reply = gw
        .send_post("/v1/customers", None, "email=not-an-email")
        .await;
    assert_eq!(
        reply.stripe_error(400, "invalid_request_error")["code"],
        "email_invalid"
    );
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM customers")
        .fetch_one(gw.state.pool())
        .await
        .unwrap();
    assert_eq!(count, 0);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn customers_of_another_account_do_not_exist(_: PgPoolOptions, options: PgConnectOptions) {
    let gw = Gateway::start(options).await;
    let id = gw.customer("tok_visa").await;
    // HTTP Basic with the key as user name, as `curl -u sk_test_…:` sends it.
    let reply = gw
        .http
        .get(gw.url(&format!("/v1/customers/{id}")))
        .basic_auth("sk_test_someone_else", Some(""))
        .send()
        .await
        .unwrap();
    let reply = crate::support::Reply::read(reply).await;
    let error = reply.stripe_error(404, "invalid_request_error");
    assert_eq!(error["code"], "resource_missing");
    assert_eq!(error["message"], format!("No such customer: '{id}'"));

    // And the same Basic credentials of the owner do see it.
    let reply = gw
        .http
        .get(gw.url(&format!("/v1/customers/{id}")))
        .basic_auth(crate::support::KEY, Some(""))
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 200);
    gw.stop().await;
}
