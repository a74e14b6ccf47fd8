//! An intermediary in front of the gateway answering on its own, before the request reaches the
//! gateway (`intermediary_before`) or in place of a committed charge's answer
//! (`intermediary_after`).

use fakestripe::Faults;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::support::{Gateway, IntermediaryForm};

#[testdb::test(template = crate::support::migrated)]
async fn intermediary_before_answers_without_stripe_marks_and_writes_nothing(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    gw.state.set_faults(Faults {
        intermediary_before: 1.0,
        seed: Some(5),
        ..Faults::none()
    });

    let mut forms = Vec::new();
    let mut statuses = Vec::new();
    for i in 0..12 {
        let reply = gw.charge(Some(&format!("ib-{i}")), &customer, 2000).await;
        let form = reply.intermediary();
        if !forms.contains(&form) {
            forms.push(form);
        }
        if !statuses.contains(&reply.status) {
            statuses.push(reply.status);
        }
    }
    // The seed draws both body forms and more than one status, so both are shown to be drawn.
    assert_eq!(forms.len(), 2, "{forms:?}");
    assert!(forms.contains(&IntermediaryForm::Html) && forms.contains(&IntermediaryForm::Empty));
    assert!(statuses.len() > 1, "{statuses:?}");

    let list = gw.get(&format!("/v1/charges?customer={customer}")).await;
    assert_eq!(list.status, 200, "{}", list.text);
    assert_eq!(
        list.json()["data"],
        serde_json::json!([]),
        "no charge was made"
    );
    assert_eq!(gw.key_rows().await, 0, "no key was even claimed");
    assert_eq!(gw.state.counters().intermediary_before, 12);

    // Once the intermediary lets requests through, the retry runs afresh and charges once.
    gw.state.set_faults(Faults::none());
    let retry = gw.charge(Some("ib-0"), &customer, 2000).await;
    assert_eq!(retry.status, 200, "{}", retry.text);
    assert!(!retry.replayed());
    let again = gw.charge(Some("ib-0"), &customer, 2000).await;
    assert!(again.replayed());
    assert_eq!(again.json()["id"], retry.json()["id"]);
    assert_eq!(gw.charge_count().await, 1);
    gw.stop().await;
}

#[testdb::test(template = crate::support::migrated)]
async fn intermediary_after_commits_the_charge_and_the_retry_returns_it(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let gw = Gateway::start(options).await;
    let customer = gw.customer("tok_visa").await;
    let declining = gw.customer("tok_chargeCustomerFail").await;
    gw.state.set_faults(Faults {
        intermediary_after: 1.0,
        ..Faults::none()
    });

    let reply = gw.charge(Some("ia-1"), &customer, 2000).await;
    reply.intermediary();
    let charges = fakestripe::charges_of_customer(gw.state.pool(), &customer)
        .await
        .unwrap();
    assert_eq!(
        charges.len(),
        1,
        "the charge was committed before the answer was replaced"
    );
    assert_eq!(gw.state.counters().intermediary_after, 1);

    // A replay is never struck, even with the fault still on; nor is a decline.
    let retry = gw.charge(Some("ia-1"), &customer, 2000).await;
    assert_eq!(retry.status, 200, "{}", retry.text);
    assert!(retry.replayed());
    assert_eq!(retry.json()["id"], charges[0].id.as_str());
    gw.charge(Some("ia-decline"), &declining, 2000)
        .await
        .stripe_error(402, "card_error");
    assert_eq!(gw.state.counters().intermediary_after, 1);

    gw.state.set_faults(Faults::none());
    let retry = gw.charge(Some("ia-1"), &customer, 2000).await;
    assert_eq!(retry.status, 200, "{}", retry.text);
    assert!(retry.replayed());
    assert_eq!(retry.json()["id"], charges[0].id.as_str());
    assert_eq!(gw.charge_count().await, 1);
    gw.stop().await;
}
