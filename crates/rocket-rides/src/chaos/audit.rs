//! The auditor: the invariants of DESIGN.md, each a named check with counts, computed from the
//! service's tables, the gateway's tables and what the clients received.

use std::collections::{HashMap, HashSet};

use serde_json::Value;
use sqlx::PgPool;

use super::clients::RequestLog;
use super::report::InvariantResult;

/// At most this many examples per violated invariant.
const EXAMPLES: usize = 5;

struct Check {
    name: &'static str,
    description: &'static str,
    checked: u64,
    violations: Vec<String>,
}

impl Check {
    fn new(name: &'static str, description: &'static str) -> Self {
        Self {
            name,
            description,
            checked: 0,
            violations: Vec::new(),
        }
    }

    fn expect(&mut self, holds: bool, example: impl FnOnce() -> String) {
        self.checked += 1;
        if !holds {
            self.violations.push(example());
        }
    }

    fn result(self) -> InvariantResult {
        InvariantResult {
            name: self.name.to_owned(),
            description: self.description.to_owned(),
            checked: self.checked,
            violations: self.violations.len() as u64,
            passed: self.violations.is_empty(),
            examples: self.violations.into_iter().take(EXAMPLES).collect(),
        }
    }
}

#[derive(Debug, sqlx::FromRow)]
struct Ride {
    id: i64,
    user_id: i64,
    key: Option<String>,
    amount_cents: i32,
    charge_id: Option<String>,
    status: String,
}

#[derive(Debug, sqlx::FromRow)]
struct GatewayCharge {
    id: String,
    amount: i64,
    ride_id: Option<String>,
}

/// Runs every check. `pool` reaches the run's database (the service's tables and the gateway's
/// `fakestripe` schema).
pub(crate) async fn audit(
    pool: &PgPool,
    logs: &[RequestLog],
    declining_customers: &[String],
) -> anyhow::Result<Vec<InvariantResult>> {
    let rides: Vec<Ride> = sqlx::query_as(
        "SELECT r.id, r.user_id, k.idempotency_key AS key, r.amount_cents, r.charge_id, r.status
         FROM rides r LEFT JOIN idempotency_keys k ON k.id = r.idempotency_key_id",
    )
    .fetch_all(pool)
    .await?;
    let charges: Vec<GatewayCharge> = sqlx::query_as(
        "SELECT id, amount, metadata->>'ride_id' AS ride_id FROM fakestripe.charges",
    )
    .fetch_all(pool)
    .await?;
    let rides_by_id: HashMap<i64, &Ride> = rides.iter().map(|r| (r.id, r)).collect();
    let charges_by_id: HashMap<&str, &GatewayCharge> =
        charges.iter().map(|c| (c.id.as_str(), c)).collect();

    // 1. One key, one effect.
    let mut one_ride = Check::new(
        "one_ride_per_key",
        "at most one ride per (user, idempotency key), and every ride belongs to a key",
    );
    let mut per_key: HashMap<(i64, &str), u64> = HashMap::new();
    for ride in &rides {
        match &ride.key {
            Some(key) => *per_key.entry((ride.user_id, key.as_str())).or_default() += 1,
            None => one_ride
                .violations
                .push(format!("ride {} has no key", ride.id)),
        }
    }
    for ((user, key), count) in &per_key {
        one_ride.expect(*count == 1, || {
            format!("user {user} key {key}: {count} rides")
        });
    }

    let mut one_charge = Check::new(
        "one_charge_per_key",
        "at most one gateway charge per ride (so per key)",
    );
    let mut charges_per_ride: HashMap<&str, Vec<&str>> = HashMap::new();
    for charge in &charges {
        let ride = charge.ride_id.as_deref().unwrap_or("(none)");
        charges_per_ride.entry(ride).or_default().push(&charge.id);
    }
    for (ride, ids) in &charges_per_ride {
        one_charge.expect(ids.len() == 1, || {
            format!("ride {ride}: {} charges {ids:?}", ids.len())
        });
    }

    // 2. Nothing acknowledged is lost.
    let mut acknowledged = Check::new(
        "acknowledged_201_is_paid",
        "every 201 a client received names a paid ride with that charge, and the charge exists \
         at the gateway with the same amount",
    );
    for log in logs {
        for answer in log.answers.iter().filter(|a| a.status == Some(201)) {
            let body: Value = answer
                .body
                .as_deref()
                .and_then(|b| serde_json::from_slice(b).ok())
                .unwrap_or_default();
            let ride_id = body["ride_id"].as_i64().unwrap_or(-1);
            let charge_id = body["charge_id"].as_str().unwrap_or("");
            let holds = rides_by_id.get(&ride_id).is_some_and(|ride| {
                ride.status == "paid"
                    && ride.charge_id.as_deref() == Some(charge_id)
                    && i64::from(ride.amount_cents) == log.amount_cents
                    && charges_by_id
                        .get(charge_id)
                        .is_some_and(|c| c.amount == i64::from(ride.amount_cents))
            });
            acknowledged.expect(holds, || {
                format!(
                    "key {}: 201 for ride {ride_id}, charge {charge_id:?}",
                    log.key
                )
            });
        }
    }

    // 3. No money without a ride.
    let mut no_orphan = Check::new(
        "no_charge_without_ride",
        "every gateway charge is the recorded charge of exactly one ride, for its amount",
    );
    for charge in &charges {
        let ride = charge
            .ride_id
            .as_deref()
            .and_then(|id| id.parse().ok())
            .and_then(|id| rides_by_id.get(&id));
        let holds = ride.is_some_and(|ride| {
            ride.charge_id.as_deref() == Some(charge.id.as_str())
                && i64::from(ride.amount_cents) == charge.amount
        });
        no_orphan.expect(holds, || {
            format!(
                "charge {} (ride {:?}) is recorded on no ride",
                charge.id, charge.ride_id
            )
        });
    }

    // 4. Replays are exact.
    let mut replays = Check::new(
        "replays_equal_first_answer",
        "every final answer (201, 402) a client got for a key has the status and body bytes of \
         the first one",
    );
    for log in logs {
        let finals: Vec<_> = log
            .answers
            .iter()
            .filter(|a| matches!(a.status, Some(201 | 402)))
            .collect();
        let Some(first) = finals.first() else {
            continue;
        };
        for later in &finals[1..] {
            replays.expect(
                later.status == first.status && later.body == first.body && later.replayed,
                || {
                    format!(
                        "key {}: answer {:?} (replayed: {}) differs from the first {:?}",
                        log.key, later.status, later.replayed, first.status
                    )
                },
            );
        }
    }

    // 7. Every started request finishes.
    let unfinished: Vec<(i64, String, String)> = sqlx::query_as(
        "SELECT user_id, idempotency_key, recovery_point FROM idempotency_keys WHERE finished_at IS NULL",
    )
    .fetch_all(pool)
    .await?;
    let keys: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(pool)
        .await?;
    let mut finished = Check::new(
        "every_key_finished",
        "after the completer's final pass, no key is left unfinished",
    );
    finished.checked = keys as u64;
    finished.violations = unfinished
        .iter()
        .map(|(u, k, p)| format!("user {u} key {k} stuck at {p}"))
        .collect();

    // Effects after payment: one receipt per paid ride.
    let receipts: Vec<i64> = sqlx::query_scalar("SELECT ride_id FROM ride_receipts")
        .fetch_all(pool)
        .await?;
    let receipts: HashSet<i64> = receipts.into_iter().collect();
    let mut one_receipt = Check::new(
        "one_receipt_per_paid_ride",
        "every paid ride has its receipt, and no other ride has one",
    );
    for ride in &rides {
        let paid = ride.status == "paid";
        one_receipt.expect(paid == receipts.contains(&ride.id), || {
            format!(
                "ride {} ({}) receipt: {}",
                ride.id,
                ride.status,
                receipts.contains(&ride.id)
            )
        });
    }

    // Declined cards charge nothing.
    let declined_charges: i64 =
        sqlx::query_scalar("SELECT count(*) FROM fakestripe.charges WHERE customer_id = ANY($1)")
            .bind(declining_customers)
            .fetch_one(pool)
            .await?;
    let mut declines = Check::new(
        "declined_cards_charge_nothing",
        "no gateway charge for a declining card, and every 402 was for one",
    );
    declines.expect(declined_charges == 0, || {
        format!("{declined_charges} charges on declining cards")
    });
    for log in logs.iter().filter(|l| l.final_status == Some(402)) {
        declines.expect(log.user.declines, || {
            format!(
                "key {} (user {}): 402 for a good card",
                log.key, log.user.id
            )
        });
    }

    Ok([
        one_ride,
        one_charge,
        acknowledged,
        no_orphan,
        replays,
        finished,
        one_receipt,
        declines,
    ]
    .into_iter()
    .map(Check::result)
    .collect())
}
