//! The observer hears every claim with its outcome and every committed phase with its point.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::{
    Begun, Claim, ClaimOutcome, DatabaseClock, Fingerprint, IdempotencyKey, NewRequest, Observer,
    Owner, RecoveryPoint, Store, StoredResponse,
};
use serde_json::json;
use sqlx::PgPool;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Point {
    Started,
    Paid,
    Finished,
}

impl RecoveryPoint for Point {
    const STARTED: Self = Self::Started;
    const FINISHED: Self = Self::Finished;

    fn name(self) -> &'static str {
        match self {
            Self::Started => "started",
            Self::Paid => "paid",
            Self::Finished => "finished",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        [Self::Started, Self::Paid, Self::Finished]
            .into_iter()
            .find(|p| p.name() == name)
    }
}

#[derive(Default)]
struct Heard(Mutex<Vec<String>>);

impl Observer for Heard {
    fn claimed(&self, route: &str, outcome: ClaimOutcome, _took: Duration) {
        self.0
            .lock()
            .unwrap()
            .push(format!("claim {route} {}", outcome.name()));
    }

    fn phase_committed(&self, point: &'static str, _took: Duration) {
        self.0.lock().unwrap().push(format!("phase {point}"));
    }
}

#[testdb::test(template = crate::migrated)]
async fn every_claim_and_committed_phase_is_heard(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let heard = Arc::new(Heard::default());
    let store = Store::new(pool, Arc::new(DatabaseClock), Duration::from_secs(30))
        .unwrap()
        .with_observer(heard.clone());
    let key = IdempotencyKey::parse(b"order-1").unwrap();
    let (body, other) = (json!({"cents": 5}), json!({"cents": 6}));
    let owner = Owner::from(1);
    let request = |body| NewRequest {
        owner: &owner,
        method: "POST",
        route: "/orders",
        key: &key,
        fingerprint: Fingerprint::of_json("POST", "/orders", body),
        params: body,
    };
    let Begun::New(first) = store.begin(request(&body), Point::Paid).await.unwrap() else {
        panic!("a new key");
    };
    let mut lease = first.commit().await.unwrap();
    // While the lease is held, a second claim is in flight.
    assert!(matches!(
        store.claim::<Point>(request(&body)).await.unwrap(),
        Claim::InFlight { .. }
    ));
    // A phase that is dropped is not heard; one that commits is.
    drop(store.phase(&mut lease, Point::Paid).await.unwrap());
    store
        .phase(&mut lease, Point::Paid)
        .await
        .unwrap()
        .commit()
        .await
        .unwrap();
    let answer = StoredResponse::json(201, &json!({"ok": true}), vec![]);
    store
        .final_phase(&mut lease)
        .await
        .unwrap()
        .finish(&answer)
        .await
        .unwrap();
    store.claim::<Point>(request(&body)).await.unwrap();
    store.claim::<Point>(request(&other)).await.unwrap();
    assert_eq!(
        *heard.0.lock().unwrap(),
        [
            "claim /orders acquired",
            "phase paid",
            "claim /orders in_flight",
            "phase paid",
            "phase finished",
            "claim /orders replayed",
            "claim /orders mismatch",
        ]
    );
}
