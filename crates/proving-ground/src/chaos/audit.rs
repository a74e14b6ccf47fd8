//! The auditor: the invariants (docs/protocol.md, docs/rocket-rides.md), each a named check with
//! counts, computed from the service's tables, the gateway's tables and what the clients
//! received. Every check looks from both sides where it can: from what clients were told to the
//! rows, and from the rows back to what was asked.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde_json::Value;
use sqlx::PgPool;

use super::clients::{is_payment_refused, Answer, RequestLog};
use super::faults::LEASE_STOLEN;
use super::leases::LostLease;
use super::report::{InvariantResult, MAX_EXAMPLES};

/// What the database held after the completer's final pass, before the late questions of
/// [`super::clients::verify`] (which, as ordinary retries, would finish any key left behind).
#[derive(Debug, Default)]
pub(crate) struct Snapshot {
    /// `user key at point` for every key not finished by then.
    pub unfinished: Vec<String>,
    /// (user, key) of every key that existed.
    pub keys: HashSet<(i64, String)>,
    /// All keys.
    pub total_keys: u64,
}

impl Snapshot {
    pub(crate) async fn take(pool: &PgPool) -> sqlx::Result<Self> {
        let rows: Vec<(i64, String, String, bool)> = sqlx::query_as(
            "SELECT owner::bigint, idempotency_key, recovery_point, finished_at IS NOT NULL
             FROM idempotency_keys",
        )
        .fetch_all(pool)
        .await?;
        let mut snapshot = Self {
            total_keys: rows.len() as u64,
            ..Self::default()
        };
        for (user, key, point, finished) in rows {
            if !finished {
                snapshot
                    .unfinished
                    .push(format!("user {user} key {key} stuck at {point}"));
            }
            snapshot.keys.insert((user, key));
        }
        Ok(snapshot)
    }
}

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
            examples: self.violations.into_iter().take(MAX_EXAMPLES).collect(),
        }
    }
}

#[derive(Debug, Clone, sqlx::FromRow)]
struct Ride {
    id: i64,
    user_id: i64,
    key: Option<String>,
    /// The request UUID of its key, which its charge's metadata must name.
    request: Option<String>,
    /// The key's stored status, once finished.
    response_status: Option<i16>,
    amount_cents: i32,
    charge_id: Option<String>,
    status: String,
    customer: String,
    /// Its charge was found by a reconciling list rather than answered by the create call.
    adopted: bool,
}

#[derive(Debug, Clone, sqlx::FromRow)]
struct GatewayCharge {
    id: String,
    amount: i64,
    customer_id: String,
    ride_id: Option<String>,
    request: Option<String>,
}

/// How long after a crash or a database fault a 500 is its consequence: a request whose
/// connection the fault cut answers within a statement's time, one caught in a gateway call
/// within the gateway timeout.
pub(crate) const FAULT_500_WINDOW_SECS: u32 = 5;

/// What the run did, besides the requests: for the checks that look at faults.
pub(crate) struct RunFacts<'a> {
    /// API or worker processes that died of something other than the harness's kills and crash
    /// points.
    pub process_exits: u64,
    /// Users whose customer the gateway came to refuse.
    pub refused_users: &'a HashSet<i64>,
    /// When a database fault that fails one request at most was injected (seconds of the run):
    /// a backend terminated, a commit cut.
    pub db_fault_seconds: &'a [u32],
    /// The seconds PostgreSQL was away (crashed and restarting, failing over), with a short
    /// grace after.
    pub outage_seconds: &'a [u32],
    /// The fault kinds the run configured, each of which must have been injected.
    pub configured: &'a [&'static str],
    /// How many faults of each kind were injected.
    pub injected: &'a BTreeMap<String, u64>,
    /// The renewals that found their lease taken over, from the services' logs.
    pub lost_leases: &'a [LostLease],
    /// The leases the harness took over whose holder found out at its next write, which the
    /// fence refused (key id, token), from the services' logs.
    pub fenced_after_steal: &'a [(i64, i64)],
}

/// Runs every check of [`CHECKS`], in its order. `pool` reaches the service's database,
/// `gateway` the gateway's.
pub(crate) async fn audit(
    pool: &PgPool,
    gateway: &PgPool,
    logs: &[RequestLog],
    before: &Snapshot,
    facts: &RunFacts<'_>,
) -> anyhow::Result<Vec<InvariantResult>> {
    let evidence = Evidence::load(pool, gateway, logs, before, facts).await?;
    Ok(judge(&evidence))
}

/// Every check of [`CHECKS`] over `evidence`, in its order: pure, so that each check can be
/// tried on made-up evidence.
fn judge(evidence: &Evidence<'_>) -> Vec<InvariantResult> {
    CHECKS
        .iter()
        .map(|spec| {
            let mut check = Check::new(spec.name, spec.description);
            (spec.run)(evidence, &mut check);
            check.result()
        })
        .collect()
}

/// One invariant: its name in the report, what it says, and the function that checks it.
struct CheckSpec {
    name: &'static str,
    description: &'static str,
    run: fn(&Evidence<'_>, &mut Check),
}

/// Every check, in the order of the report.
const CHECKS: &[CheckSpec] = &[
    // 1. One key, one effect: from the rows back to the requests.
    CheckSpec {
        name: "one_ride_per_key",
        description: "every ride belongs to one requested key, of its user and amount, and no key \
            has two",
        run: one_ride_per_key,
    },
    CheckSpec {
        name: "one_charge_per_key",
        description: "at most one gateway charge per ride (so per key)",
        run: one_charge_per_key,
    },
    // 2. Nothing acknowledged is lost.
    CheckSpec {
        name: "acknowledged_201_is_paid",
        description: "every 201 a client received names its own ride (user, key, amount), paid \
            with that charge, and the charge exists at the gateway with the same amount",
        run: acknowledged_201_is_paid,
    },
    // 3. No money without a ride.
    CheckSpec {
        name: "no_charge_without_ride",
        description: "every gateway charge is the recorded charge of exactly one ride, for its \
            amount, on its owner's card",
        run: no_charge_without_ride,
    },
    // 4. Replays are exact.
    CheckSpec {
        name: "replays_equal_first_answer",
        description:
            "every later final answer (201, 402, 502 refused) for a key repeats the first \
            one's status, body bytes, Location and Content-Type, marked Idempotent-Replayed",
        run: replays_equal_first_answer,
    },
    // 5. A payload cannot be swapped.
    CheckSpec {
        name: "payload_swap_refused",
        description: "the same key with another amount is refused with 422 (the rides keep their \
            amounts: see one_ride_per_key)",
        run: payload_swap_refused,
    },
    // 7. Every started request finishes, without its client's help.
    CheckSpec {
        name: "every_key_finished",
        description: "after the completer's final pass, before any late retry, no key is left \
            unfinished",
        run: every_key_finished,
    },
    CheckSpec {
        name: "every_request_answered_afterwards",
        description: "asked again after the run, every request gets a final answer, replayed when \
            its key existed",
        run: every_request_answered_afterwards,
    },
    CheckSpec {
        name: "no_unexpected_answer",
        description:
            "during the run every answer was final (201, 402, 502 refused) or asked for a \
            retry (409, 503, no answer; a 500 only while PostgreSQL was away, or within 5 s after \
            a database fault that fails one request, no more 500s than such faults), and no API or \
            worker process died other than by the harness's hand",
        run: no_unexpected_answer,
    },
    // Effects after payment: one receipt per paid ride.
    CheckSpec {
        name: "one_receipt_per_paid_ride",
        description: "every paid ride has its receipt, and no other ride has one",
        run: one_receipt_per_paid_ride,
    },
    // Declines: from the cards to the rides and the answers.
    CheckSpec {
        name: "declines_follow_the_card",
        description: "rides of declining cards are declined and charged nothing; rides of good \
            cards are not declined; every 402 was for a declining card (a user whose customer the \
            gateway came to refuse may also have failed rides); at least one request came from a \
            declining card",
        run: declines_follow_the_card,
    },
    // Refusals: the gateway's permanent no finishes the request, with no money moved.
    CheckSpec {
        name: "refused_keys_finish_with_502_and_no_charge",
        description: "every failed ride belongs to a user whose customer the gateway refuses, has \
            no gateway charge and its key finished with a 502; no stored 502 has a gateway charge \
            naming its request; every 502 answer was for such a user's failed ride",
        run: refused_keys_finish_with_502_and_no_charge,
    },
    // Adoption: a charge found by listing is the one the request made, and its only one.
    CheckSpec {
        name: "adopted_charge_is_the_rides_one_charge",
        description: "every charge a ride adopted from a reconciling list names the ride's own \
            request in its metadata and is the only charge that does",
        run: adopted_charge_is_the_rides_one_charge,
    },
    CheckSpec {
        name: "lost_lease_stopped_its_holder",
        description: "every lease renewal that found the lease taken over stopped its holder: no \
            write (a phase, a gateway call, a release) followed under that key and fencing token; \
            when the harness took leases over, at least one holder found out, at a renewal or at \
            the write after its call that the fence refused",
        run: lost_lease_stopped_its_holder,
    },
    CheckSpec {
        name: "every_fault_exercised",
        description: "every fault kind the run configured was injected at least once",
        run: every_fault_exercised,
    },
];

/// What the checks read: the service's rows, the gateway's charges, what the clients received
/// and what the run did.
struct Evidence<'a> {
    rides: Vec<Ride>,
    /// Succeeded charges only: money moved. (The run makes no pending charges.)
    charges: Vec<GatewayCharge>,
    /// The rides that have a receipt.
    receipts: HashSet<i64>,
    /// The requests of the keys that stored a 502.
    refused_requests: Vec<String>,
    logs: &'a [RequestLog],
    before: &'a Snapshot,
    facts: &'a RunFacts<'a>,
}

impl<'a> Evidence<'a> {
    async fn load(
        pool: &PgPool,
        gateway: &PgPool,
        logs: &'a [RequestLog],
        before: &'a Snapshot,
        facts: &'a RunFacts<'a>,
    ) -> anyhow::Result<Self> {
        let rides: Vec<Ride> = sqlx::query_as(
            "SELECT r.id, r.user_id, k.idempotency_key AS key, k.request_uuid::text AS request,
                k.response_status, r.amount_cents, r.charge_id, r.status,
                u.stripe_customer_id AS customer,
                EXISTS (SELECT 1 FROM audit_records a
                        WHERE a.user_id = r.user_id AND a.resource_type = 'ride'
                          AND a.resource_id = r.id AND a.action = 'ride.charged'
                          AND (a.data->>'adopted')::boolean) AS adopted
         FROM rides r JOIN users u ON u.id = r.user_id
         LEFT JOIN idempotency_keys k ON k.id = r.idempotency_key_id",
        )
        .fetch_all(pool)
        .await?;
        let charges: Vec<GatewayCharge> = sqlx::query_as(
            "SELECT id, amount, customer_id, metadata->>'ride_id' AS ride_id,
                metadata->>'rocket_rides_request' AS request
         FROM fakestripe.charges WHERE status = 'succeeded'",
        )
        .fetch_all(gateway)
        .await?;
        let receipts: Vec<i64> = sqlx::query_scalar("SELECT ride_id FROM ride_receipts")
            .fetch_all(pool)
            .await?;
        let refused_requests: Vec<String> = sqlx::query_scalar(
            "SELECT request_uuid::text FROM idempotency_keys WHERE response_status = 502",
        )
        .fetch_all(pool)
        .await?;
        Ok(Self {
            rides,
            charges,
            receipts: receipts.into_iter().collect(),
            refused_requests,
            logs,
            before,
            facts,
        })
    }

    fn rides_by_id(&self) -> HashMap<i64, &Ride> {
        self.rides.iter().map(|r| (r.id, r)).collect()
    }

    fn charges_by_id(&self) -> HashMap<&str, &GatewayCharge> {
        self.charges.iter().map(|c| (c.id.as_str(), c)).collect()
    }

    /// The ids of the charges naming each ride (`(none)` for those naming none).
    fn charges_per_ride(&self) -> HashMap<&str, Vec<&str>> {
        let mut charges_per_ride: HashMap<&str, Vec<&str>> = HashMap::new();
        for charge in &self.charges {
            let ride = charge.ride_id.as_deref().unwrap_or("(none)");
            charges_per_ride.entry(ride).or_default().push(&charge.id);
        }
        charges_per_ride
    }
}

fn one_ride_per_key(evidence: &Evidence<'_>, check: &mut Check) {
    let logs_by_key: HashMap<(i64, &str), &RequestLog> = evidence
        .logs
        .iter()
        .map(|l| ((l.user.id, l.key.as_str()), l))
        .collect();
    let mut per_key: HashMap<(i64, &str), u64> = HashMap::new();
    for ride in &evidence.rides {
        let Some(key) = ride.key.as_deref() else {
            check.expect(false, || format!("ride {} has no key", ride.id));
            continue;
        };
        *per_key.entry((ride.user_id, key)).or_default() += 1;
        let asked = logs_by_key.get(&(ride.user_id, key));
        check.expect(
            asked.is_some_and(|log| log.amount_cents == i64::from(ride.amount_cents)),
            || {
                format!(
                    "ride {} (user {}, key {key}) matches no request",
                    ride.id, ride.user_id
                )
            },
        );
    }
    for ((user, key), count) in &per_key {
        check.expect(*count == 1, || {
            format!("user {user} key {key}: {count} rides")
        });
    }
}

fn one_charge_per_key(evidence: &Evidence<'_>, check: &mut Check) {
    for (ride, ids) in &evidence.charges_per_ride() {
        check.expect(ids.len() == 1, || {
            format!("ride {ride}: {} charges {ids:?}", ids.len())
        });
    }
}

fn acknowledged_201_is_paid(evidence: &Evidence<'_>, check: &mut Check) {
    let (rides_by_id, charges_by_id) = (evidence.rides_by_id(), evidence.charges_by_id());
    for log in evidence.logs {
        for answer in all_answers(log).filter(|a| a.status == Some(201)) {
            let body: Value = answer
                .body
                .as_deref()
                .and_then(|b| serde_json::from_slice(b).ok())
                .unwrap_or_default();
            let ride_id = body["ride_id"].as_i64().unwrap_or(-1);
            let charge_id = body["charge_id"].as_str().unwrap_or("");
            let holds = rides_by_id.get(&ride_id).is_some_and(|ride| {
                ride.user_id == log.user.id
                    && ride.key.as_deref() == Some(log.key.as_str())
                    && ride.status == "paid"
                    && ride.charge_id.as_deref() == Some(charge_id)
                    && i64::from(ride.amount_cents) == log.amount_cents
                    && charges_by_id
                        .get(charge_id)
                        .is_some_and(|c| c.amount == log.amount_cents)
            });
            check.expect(holds, || {
                format!(
                    "key {}: 201 for ride {ride_id}, charge {charge_id:?}",
                    log.key
                )
            });
        }
    }
}

fn no_charge_without_ride(evidence: &Evidence<'_>, check: &mut Check) {
    let rides_by_id = evidence.rides_by_id();
    for charge in &evidence.charges {
        let ride = charge
            .ride_id
            .as_deref()
            .and_then(|id| id.parse().ok())
            .and_then(|id| rides_by_id.get(&id));
        let holds = ride.is_some_and(|ride| {
            ride.charge_id.as_deref() == Some(charge.id.as_str())
                && i64::from(ride.amount_cents) == charge.amount
                && ride.customer == charge.customer_id
        });
        check.expect(holds, || {
            format!(
                "charge {} (ride {:?}) is recorded on no ride",
                charge.id, charge.ride_id
            )
        });
    }
}

fn replays_equal_first_answer(evidence: &Evidence<'_>, check: &mut Check) {
    for log in evidence.logs {
        let finals: Vec<&Answer> = all_answers(log).filter(|a| is_final(a)).collect();
        let Some(first) = finals.first() else {
            continue;
        };
        for later in &finals[1..] {
            let same = later.status == first.status
                && later.body == first.body
                && later.location == first.location
                && later.content_type == first.content_type;
            check.expect(same && later.replayed, || {
                format!(
                    "key {}: answer {:?} (replayed: {}) differs from the first {:?}",
                    log.key, later.status, later.replayed, first.status
                )
            });
        }
    }
}

fn payload_swap_refused(evidence: &Evidence<'_>, check: &mut Check) {
    for log in evidence.logs {
        if let Some(swapped) = &log.swapped {
            check.expect(swapped.status == Some(422), || {
                format!("key {}: another amount got {:?}", log.key, swapped.status)
            });
        }
    }
}

fn every_key_finished(evidence: &Evidence<'_>, check: &mut Check) {
    check.checked = evidence.before.total_keys;
    check.violations = evidence.before.unfinished.clone();
}

fn every_request_answered_afterwards(evidence: &Evidence<'_>, check: &mut Check) {
    for log in evidence.logs {
        let answer = log.late.clone().unwrap_or_default();
        let existed = evidence
            .before
            .keys
            .contains(&(log.user.id, log.key.clone()));
        check.expect(is_final(&answer) && (answer.replayed || !existed), || {
            format!(
                "key {}: late answer {:?}, replayed: {}",
                log.key, answer.status, answer.replayed
            )
        });
    }
}

fn no_unexpected_answer(evidence: &Evidence<'_>, check: &mut Check) {
    let facts = evidence.facts;
    // A 500 is the service's honest answer to a request whose database connection failed
    // under it. Outside PostgreSQL's outages, each terminated backend or cut commit fails one
    // request at most: the 500s must be no more than those faults, and each near one of them.
    let during_outage = |second: u32| facts.outage_seconds.contains(&second);
    let near_db_fault = |second: u32| {
        facts
            .db_fault_seconds
            .iter()
            .any(|&f| f <= second + 1 && second <= f + FAULT_500_WINDOW_SECS)
    };
    let mut budget = facts.db_fault_seconds.len() as u64;
    for log in evidence.logs {
        for answer in &log.answers {
            let retry = match answer.status {
                None | Some(409 | 503) => true,
                Some(500) if during_outage(answer.second) => true,
                Some(500) if near_db_fault(answer.second) && budget > 0 => {
                    budget -= 1;
                    true
                }
                _ => false,
            };
            check.expect(is_final(answer) || retry, || {
                format!(
                    "key {}: unexpected {:?} at second {}",
                    log.key, answer.status, answer.second
                )
            });
        }
    }
    let process_exits = facts.process_exits;
    check.expect(process_exits == 0, || {
        format!("{process_exits} processes exited on their own (see their logs)")
    });
}

fn one_receipt_per_paid_ride(evidence: &Evidence<'_>, check: &mut Check) {
    let receipts = &evidence.receipts;
    for ride in &evidence.rides {
        let paid = ride.status == "paid";
        check.expect(paid == receipts.contains(&ride.id), || {
            format!(
                "ride {} ({}) receipt: {}",
                ride.id,
                ride.status,
                receipts.contains(&ride.id)
            )
        });
    }
}

fn declines_follow_the_card(evidence: &Evidence<'_>, check: &mut Check) {
    let refused_users = evidence.facts.refused_users;
    let declining: HashSet<i64> = evidence
        .logs
        .iter()
        .filter(|l| l.user.declines)
        .map(|l| l.user.id)
        .collect();
    check.expect(!declining.is_empty(), || {
        "no request came from a declining card: the check would pass for nothing (use more \
         users: every fifth one declines)"
            .to_owned()
    });
    for ride in &evidence.rides {
        let expected = if declining.contains(&ride.user_id) {
            "declined"
        } else {
            "paid"
        };
        let refused = refused_users.contains(&ride.user_id) && ride.status == "failed";
        check.expect(ride.status == expected || refused, || {
            format!(
                "ride {} of user {} is {}, expected {expected}",
                ride.id, ride.user_id, ride.status
            )
        });
    }
    for log in evidence.logs {
        for answer in all_answers(log).filter(|a| a.status == Some(402)) {
            check.expect(log.user.declines, || {
                format!(
                    "key {} (user {}): 402 for a good card {answer:?}",
                    log.key, log.user.id
                )
            });
        }
    }
}

fn refused_keys_finish_with_502_and_no_charge(evidence: &Evidence<'_>, check: &mut Check) {
    let refused_users = evidence.facts.refused_users;
    let charges_per_ride = evidence.charges_per_ride();
    let charged_requests: HashSet<&str> = evidence
        .charges
        .iter()
        .filter_map(|c| c.request.as_deref())
        .collect();
    for ride in evidence.rides.iter().filter(|r| r.status == "failed") {
        let charged = ride
            .request
            .as_deref()
            .is_some_and(|r| charged_requests.contains(r))
            || charges_per_ride.contains_key(ride.id.to_string().as_str());
        check.expect(
            refused_users.contains(&ride.user_id) && !charged && ride.response_status == Some(502),
            || {
                format!(
                    "ride {} of user {} failed (refused user: {}, charged: {charged}, key status \
                     {:?})",
                    ride.id,
                    ride.user_id,
                    refused_users.contains(&ride.user_id),
                    ride.response_status
                )
            },
        );
    }
    // A stored 502 says "nothing was charged": no gateway charge may name its request.
    for request in &evidence.refused_requests {
        check.expect(!charged_requests.contains(request.as_str()), || {
            format!("request {request} stored a 502, and a gateway charge names it")
        });
    }
    let rides_by_key: HashMap<(i64, &str), &Ride> = evidence
        .rides
        .iter()
        .filter_map(|r| Some(((r.user_id, r.key.as_deref()?), r)))
        .collect();
    for log in evidence.logs {
        for answer in all_answers(log).filter(|a| a.status == Some(502)) {
            let ride = rides_by_key.get(&(log.user.id, log.key.as_str()));
            check.expect(
                is_payment_refused(answer)
                    && refused_users.contains(&log.user.id)
                    && ride.is_some_and(|r| r.status == "failed"),
                || format!("key {} (user {}): a 502 {answer:?}", log.key, log.user.id),
            );
        }
    }
}

fn adopted_charge_is_the_rides_one_charge(evidence: &Evidence<'_>, check: &mut Check) {
    let charges_by_id = evidence.charges_by_id();
    let mut charges_per_request: HashMap<&str, u64> = HashMap::new();
    for request in evidence.charges.iter().filter_map(|c| c.request.as_deref()) {
        *charges_per_request.entry(request).or_default() += 1;
    }
    for ride in evidence.rides.iter().filter(|r| r.adopted) {
        let charge = ride
            .charge_id
            .as_deref()
            .and_then(|id| charges_by_id.get(id));
        let holds = charge.is_some_and(|c| c.request.is_some() && c.request == ride.request)
            && ride
                .request
                .as_deref()
                .is_some_and(|r| charges_per_request.get(r) == Some(&1));
        check.expect(holds, || {
            format!(
                "ride {} adopted charge {:?}, which does not name its request alone",
                ride.id, ride.charge_id
            )
        });
    }
}

fn lost_lease_stopped_its_holder(evidence: &Evidence<'_>, check: &mut Check) {
    let facts = evidence.facts;
    for lost in facts.lost_leases {
        check.expect(lost.writes_after.is_empty(), || {
            format!(
                "key {} token {} ({}): went on to write {:?} after its renewal lost the lease",
                lost.key_id, lost.token, lost.log, lost.writes_after
            )
        });
    }
    let stolen = facts.injected.get(LEASE_STOLEN).copied().unwrap_or(0);
    // A holder whose call ended before its next beat finds out at its next write instead, which
    // the fence refuses: that counts too (a run of few steals can have no renewal find out).
    if stolen > 0 && facts.lost_leases.is_empty() && facts.fenced_after_steal.is_empty() {
        check.expect(false, || {
            format!(
                "{stolen} leases taken over, and no holder found out (no renewal, no write \
                 after its call): the check saw nothing"
            )
        });
    }
}

fn every_fault_exercised(evidence: &Evidence<'_>, check: &mut Check) {
    let facts = evidence.facts;
    for kind in facts.configured {
        let count = facts.injected.get(*kind).copied().unwrap_or(0);
        check.expect(count > 0, || format!("fault never exercised: {kind}"));
    }
}

/// A final answer: a ride (201), a decline (402) or the gateway's stored refusal (502).
fn is_final(answer: &Answer) -> bool {
    matches!(answer.status, Some(201 | 402)) || is_payment_refused(answer)
}

/// Every answer a request got: during the run, then the late one.
fn all_answers(log: &RequestLog) -> impl Iterator<Item = &Answer> {
    log.answers.iter().chain(log.late.iter())
}

/// Each check against made-up evidence: a run where everything held, and, per check, the damage
/// it must find.
#[cfg(test)]
mod tests;
