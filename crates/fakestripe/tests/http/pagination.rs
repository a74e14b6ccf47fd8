//! `GET /v1/charges`: Stripe's list object and cursor pagination in both directions.

use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::support::Gateway;

fn ids(page: &Value) -> Vec<String> {
    page["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_owned())
        .collect()
}

#[testdb::test(template = crate::support::migrated)]
async fn pages_return_each_charge_exactly_once_in_both_directions(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    const CHARGES: usize = 7;
    const LIMIT: usize = 3;
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    let other = gw.customer("tok_visa").await;
    for i in 0..CHARGES {
        assert_eq!(
            gw.charge(None, &customer, 1000 + i as i64).await.status,
            200
        );
    }
    assert_eq!(gw.charge(None, &other, 5000).await.status, 200);
    // Newest first, as the store orders them.
    let mut expected: Vec<String> = fakestripe::charges_of_customer(gw.state.pool(), &customer)
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.id)
        .collect();
    expected.reverse();

    // Forwards: starting_after the last charge of each page.
    let filter = format!("customer={customer}&limit={LIMIT}");
    let mut seen = Vec::new();
    let mut query = filter.clone();
    loop {
        let reply = gw.get(&format!("/v1/charges?{query}")).await;
        assert_eq!(reply.status, 200, "{}", reply.text);
        let page = reply.json();
        assert_eq!(page["object"], "list");
        assert_eq!(page["url"], "/v1/charges");
        let page_ids = ids(&page);
        assert!(page_ids.len() <= LIMIT);
        seen.extend(page_ids.iter().cloned());
        if page["has_more"] == false {
            break;
        }
        query = format!("{filter}&starting_after={}", page_ids.last().unwrap());
    }
    assert_eq!(seen, expected, "forwards: every charge once, newest first");

    // Backwards: ending_before the first charge of each page, from the oldest.
    let oldest = expected.last().unwrap().clone();
    let mut seen = vec![oldest.clone()];
    let mut query = format!("{filter}&ending_before={oldest}");
    loop {
        let page = gw.get(&format!("/v1/charges?{query}")).await.json();
        let page_ids = ids(&page);
        assert!(!page_ids.is_empty() && page_ids.len() <= LIMIT);
        // Each page is newest first too; pages come in from the oldest end.
        seen.splice(0..0, page_ids.iter().cloned());
        if page["has_more"] == false {
            break;
        }
        query = format!("{filter}&ending_before={}", page_ids.first().unwrap());
    }
    assert_eq!(seen, expected, "backwards: every charge once");

    // Without the filter the other customer's charge is listed too.
    let all = gw.get("/v1/charges?limit=100").await.json();
    assert_eq!(ids(&all).len(), CHARGES + 1);
    assert_eq!(all["has_more"], false);
    // The default page size is 10.
    let default = gw.get("/v1/charges").await.json();
    assert_eq!(ids(&default).len(), CHARGES + 1);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn bad_list_parameters_are_refused(_: PgPoolOptions, options: PgConnectOptions) {
    let gw = Gateway::start(options).await;
    for (query, param) in [
        ("limit=0", Some("limit")),
        ("limit=101", Some("limit")),
        ("limit=ten", Some("limit")),
        ("starting_after=ch_missing", Some("starting_after")),
        ("ending_before=ch_missing", Some("ending_before")),
        ("starting_after=ch_a&ending_before=ch_b", None),
        ("created[after]=0", Some("created[after]")),
        ("created=soon", Some("created")),
    ] {
        let reply = gw.get(&format!("/v1/charges?{query}")).await;
        let error = reply.stripe_error(400, "invalid_request_error");
        if let Some(param) = param {
            assert_eq!(error["param"], param, "{query}: {}", reply.text);
        }
    }
    gw.stop().await;
}
