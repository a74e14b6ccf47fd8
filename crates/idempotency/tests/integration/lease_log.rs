//! The lease log (`idempotency::LEASE_LOG`) names every write made under a lease before it is
//! made, and every renewal that found the lease taken over: the chaos audit's check that a holder
//! whose lease was lost wrote nothing after can see only what is logged here.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::{
    Claim, DatabaseClock, Fingerprint, IdempotencyKey, Lease, NewRequest, OneStep, Owner, Store,
    StoredResponse, LEASE_LOG,
};
use serde_json::json;
use sqlx::PgPool;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};

/// The lease log's events, as `write` names or `lost` for a lost renewal.
#[derive(Clone, Default)]
struct Heard(Arc<Mutex<Vec<String>>>);

struct Fields(Option<String>, bool);

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "write" {
            self.0 = Some(value.to_owned());
        }
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        if field.name() == "lost_on_renewal" {
            self.1 = value;
        }
    }

    fn record_debug(&mut self, _field: &Field, _value: &dyn std::fmt::Debug) {}
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Heard {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        if event.metadata().target() != LEASE_LOG {
            return;
        }
        let mut fields = Fields(None, false);
        event.record(&mut fields);
        let heard = match fields {
            Fields(Some(write), _) => write,
            Fields(None, true) => "lost".to_owned(),
            Fields(None, false) => return,
        };
        self.0.lock().unwrap().push(heard);
    }
}

async fn acquire(store: &Store, key: &str) -> Lease<OneStep> {
    let key = IdempotencyKey::parse(key.as_bytes()).unwrap();
    let body = json!({"cents": 5});
    let owner = Owner::from(2);
    let request = NewRequest {
        owner: &owner,
        method: "POST",
        route: "/payouts",
        key: &key,
        fingerprint: Fingerprint::of_json("POST", "/payouts", &body),
        params: &body,
    };
    match store.claim::<OneStep>(request).await.unwrap() {
        Claim::Acquired(lease) => lease,
        other => panic!("expected an acquired lease, got {other:?}"),
    }
}

#[testdb::test(template = crate::migrated)]
async fn every_write_under_a_lease_and_every_lost_renewal_is_logged_first(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let heard = Heard::default();
    let _logging =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(heard.clone()));
    let store = Store::new(
        pool.clone(),
        Arc::new(DatabaseClock),
        Duration::from_secs(30),
    )
    .unwrap();

    let mut lease = acquire(&store, "finished").await;
    store.call_under_lease(&mut lease, async {}).await.unwrap();
    let answer = StoredResponse::json(201, &json!({}), vec![]);
    store
        .final_phase(&mut lease)
        .await
        .unwrap()
        .finish(&answer)
        .await
        .unwrap();

    store
        .release(acquire(&store, "released").await)
        .await
        .unwrap();
    let backoff = acquire(&store, "backed-off").await;
    store
        .release_with_backoff(backoff, Duration::from_secs(1))
        .await
        .unwrap();
    store
        .abandon(acquire(&store, "abandoned").await)
        .await
        .unwrap();
    let owned = acquire(&store, "owned").await;
    let phase = store
        .final_phase_owned(owned)
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    phase.finish(&answer).await.map_err(|(e, _)| e).unwrap();

    let mut lost = acquire(&store, "lost").await;
    sqlx::query(
        "UPDATE idempotency_keys SET lease_token = lease_token + 1 WHERE idempotency_key = 'lost'",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert!(store.renew(&mut lost).await.is_err());

    assert_eq!(
        *heard.0.lock().unwrap(),
        [
            "call",
            "final_phase",
            "release",
            "release",
            "abandon",
            "final_phase",
            "lost"
        ]
    );
}
