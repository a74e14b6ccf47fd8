//! The auditor can fail, in milliseconds: every check of [`CHECKS`] runs on a made-up run where
//! everything held ([`World::healthy`]), then on the same run with one piece of damage that the
//! check exists to find. No database: the checks are pure functions of their [`Evidence`].

use super::*;

use crate::chaos::clients::{self, ClientUser};

/// A good card.
const GOOD: i64 = 1;
/// A declining card.
const DECLINING: i64 = 2;
/// A good card whose customer the gateway came to refuse.
const REFUSED: i64 = 3;
/// The second of the run at which a database fault that may fail one request struck.
const DB_FAULT_AT: u32 = 20;
/// A second during which PostgreSQL was away.
const OUTAGE_AT: u32 = 30;

/// Everything [`Evidence`] borrows or holds, owned, so that a test can damage any part of it.
struct World {
    rides: Vec<Ride>,
    charges: Vec<GatewayCharge>,
    receipts: HashSet<i64>,
    refused_requests: Vec<String>,
    logs: Vec<RequestLog>,
    before: Snapshot,
    process_exits: u64,
    refused_users: HashSet<i64>,
    db_fault_seconds: Vec<u32>,
    outage_seconds: Vec<u32>,
    configured: Vec<&'static str>,
    injected: BTreeMap<String, u64>,
    lost_leases: Vec<LostLease>,
    fenced_after_steal: Vec<(i64, i64)>,
}

fn user(id: i64) -> ClientUser {
    ClientUser {
        id,
        api_key: format!("api-key-{id}"),
        declines: id == DECLINING,
    }
}

/// An answer with a body, as the clients keep final answers.
fn answer(status: u16, body: &Value, second: u32) -> Answer {
    Answer {
        status: Some(status),
        body: Some(body.to_string().into_bytes()),
        location: body["ride_id"].as_i64().map(|id| format!("/rides/{id}")),
        content_type: Some(
            if status == 201 {
                "application/json"
            } else {
                "application/problem+json"
            }
            .to_owned(),
        ),
        second,
        ..Answer::default()
    }
}

/// A retry answer, without a body (409, 503, 500, or `None` for no answer at all).
fn retry(status: Option<u16>, second: u32) -> Answer {
    Answer {
        status,
        second,
        ..Answer::default()
    }
}

fn replayed(answer: &Answer) -> Answer {
    Answer {
        replayed: true,
        second: 0,
        ..answer.clone()
    }
}

fn booked(ride_id: i64, charge_id: &str, amount_cents: i64) -> Value {
    serde_json::json!({ "ride_id": ride_id, "charge_id": charge_id, "amount_cents": amount_cents })
}

fn problem(kind: &str) -> Value {
    serde_json::json!({ "type": kind, "title": kind })
}

fn log(user_id: i64, key: &str, amount_cents: i64, answers: Vec<Answer>) -> RequestLog {
    let late = answers.last().map(replayed);
    let mut log = clients::new_log(user(user_id), key.to_owned(), amount_cents, "{}".to_owned());
    log.answers = answers;
    log.late = late;
    log
}

#[allow(clippy::too_many_arguments)]
fn ride(
    id: i64,
    user_id: i64,
    key: &str,
    response_status: i16,
    amount_cents: i32,
    charge_id: Option<&str>,
    status: &str,
    adopted: bool,
) -> Ride {
    Ride {
        id,
        user_id,
        key: Some(key.to_owned()),
        request: Some(format!("req-{key}")),
        response_status: Some(response_status),
        amount_cents,
        charge_id: charge_id.map(str::to_owned),
        status: status.to_owned(),
        customer: format!("cus_{user_id}"),
        adopted,
    }
}

fn charge(id: &str, amount: i64, user_id: i64, ride_id: i64, key: &str) -> GatewayCharge {
    GatewayCharge {
        id: id.to_owned(),
        amount,
        customer_id: format!("cus_{user_id}"),
        ride_id: Some(ride_id.to_string()),
        request: Some(format!("req-{key}")),
    }
}

impl World {
    /// A run where every invariant held, and every check has something to look at: a ride paid
    /// after a 503 and a 500 near a database fault, its payload swap refused; a decline; a
    /// refusal; a ride whose charge was adopted after a request with no answer and a 500 during
    /// an outage; a lease taken over whose holder stopped; every configured fault injected.
    fn healthy() -> Self {
        let paid = answer(201, &booked(10, "ch_10", 2_000), 4);
        let declined = answer(402, &problem("urn:problem:rocket-rides:card-declined"), 2);
        let refused = answer(
            502,
            &problem(rocket_rides::problem::types::PAYMENT_REFUSED),
            3,
        );
        let adopted = answer(201, &booked(13, "ch_13", 2_100), 40);
        let mut first = log(
            GOOD,
            "k1",
            2_000,
            vec![retry(Some(503), 1), retry(Some(500), DB_FAULT_AT + 1), paid],
        );
        first.swapped = Some(retry(Some(422), 0));
        Self {
            rides: vec![
                ride(10, GOOD, "k1", 201, 2_000, Some("ch_10"), "paid", false),
                ride(11, DECLINING, "k2", 402, 1_500, None, "declined", false),
                ride(12, REFUSED, "k3", 502, 900, None, "failed", false),
                ride(13, GOOD, "k4", 201, 2_100, Some("ch_13"), "paid", true),
            ],
            charges: vec![
                charge("ch_10", 2_000, GOOD, 10, "k1"),
                charge("ch_13", 2_100, GOOD, 13, "k4"),
            ],
            receipts: [10, 13].into(),
            refused_requests: vec!["req-k3".to_owned()],
            logs: vec![
                first,
                log(DECLINING, "k2", 1_500, vec![declined]),
                log(REFUSED, "k3", 900, vec![refused]),
                log(
                    GOOD,
                    "k4",
                    2_100,
                    vec![retry(None, 35), retry(Some(500), OUTAGE_AT), adopted],
                ),
            ],
            before: Snapshot {
                unfinished: Vec::new(),
                keys: [
                    (GOOD, "k1"),
                    (DECLINING, "k2"),
                    (REFUSED, "k3"),
                    (GOOD, "k4"),
                ]
                .map(|(user, key)| (user, key.to_owned()))
                .into(),
                total_keys: 4,
            },
            process_exits: 0,
            refused_users: [REFUSED].into(),
            db_fault_seconds: vec![DB_FAULT_AT],
            outage_seconds: vec![OUTAGE_AT, OUTAGE_AT + 1],
            configured: vec!["kill_api", LEASE_STOLEN],
            injected: [("kill_api".to_owned(), 2), (LEASE_STOLEN.to_owned(), 1)].into(),
            lost_leases: vec![LostLease {
                log: "api-0.log".to_owned(),
                key_id: 7,
                token: 3,
                writes_after: Vec::new(),
            }],
            fenced_after_steal: Vec::new(),
        }
    }

    /// Every check's result on this world, as the run's audit computes them.
    fn judge(&self) -> Vec<InvariantResult> {
        let facts = RunFacts {
            process_exits: self.process_exits,
            refused_users: &self.refused_users,
            db_fault_seconds: &self.db_fault_seconds,
            outage_seconds: &self.outage_seconds,
            configured: &self.configured,
            injected: &self.injected,
            lost_leases: &self.lost_leases,
            fenced_after_steal: &self.fenced_after_steal,
        };
        let evidence = Evidence {
            rides: self.rides.clone(),
            charges: self.charges.clone(),
            receipts: self.receipts.clone(),
            refused_requests: self.refused_requests.clone(),
            logs: &self.logs,
            before: &self.before,
            facts: &facts,
        };
        judge(&evidence)
    }

    /// The result of the check named `name`.
    fn verdict(&self, name: &str) -> InvariantResult {
        self.judge()
            .into_iter()
            .find(|result| result.name == name)
            .unwrap_or_else(|| panic!("no check {name}"))
    }

    fn ride(&mut self, id: i64) -> &mut Ride {
        self.rides.iter_mut().find(|r| r.id == id).unwrap()
    }

    fn log(&mut self, key: &str) -> &mut RequestLog {
        self.logs.iter_mut().find(|l| l.key == key).unwrap()
    }
}

/// Damages the healthy world with `damage`, and checks that `name` fails with exactly
/// `violations` violations, the first of which mentions `example`.
fn fails(name: &str, violations: u64, example: &str, damage: impl FnOnce(&mut World)) {
    let mut world = World::healthy();
    damage(&mut world);
    let result = world.verdict(name);
    assert!(!result.passed, "{result:?}");
    assert_eq!(result.violations, violations, "{result:?}");
    assert!(
        result.examples[0].contains(example),
        "{example:?} not in {result:?}"
    );
}

#[test]
fn a_run_where_everything_held_passes_every_check_and_each_looked_at_something() {
    let results = World::healthy().judge();
    assert_eq!(results.len(), CHECKS.len());
    for result in &results {
        assert!(result.passed, "{result:?}");
        assert!(result.checked > 0, "{} examined nothing", result.name);
    }
}

/// Every check has a test below that it must fail: the names of those tests' checks, kept in
/// step with [`CHECKS`].
#[test]
fn every_check_has_a_failing_case_below() {
    let covered = [
        "one_ride_per_key",
        "one_charge_per_key",
        "acknowledged_201_is_paid",
        "no_charge_without_ride",
        "replays_equal_first_answer",
        "payload_swap_refused",
        "every_key_finished",
        "every_request_answered_afterwards",
        "no_unexpected_answer",
        "one_receipt_per_paid_ride",
        "declines_follow_the_card",
        "refused_keys_finish_with_502_and_no_charge",
        "adopted_charge_is_the_rides_one_charge",
        "lost_lease_stopped_its_holder",
        "every_fault_exercised",
    ];
    let names: Vec<&str> = CHECKS.iter().map(|spec| spec.name).collect();
    assert_eq!(names, covered);
}

#[test]
fn one_ride_per_key_fails_on_a_second_ride_for_a_key() {
    fails("one_ride_per_key", 1, "key k1: 2 rides", |w| {
        w.rides
            .push(ride(14, GOOD, "k1", 201, 2_000, None, "paid", false));
        w.receipts.insert(14);
    });
}

#[test]
fn one_ride_per_key_fails_on_a_ride_of_another_amount_than_asked() {
    fails("one_ride_per_key", 1, "ride 10 (user 1, key k1)", |w| {
        w.ride(10).amount_cents = 2_001;
    });
}

#[test]
fn one_ride_per_key_fails_on_a_ride_without_a_key() {
    fails("one_ride_per_key", 1, "ride 12 has no key", |w| {
        w.ride(12).key = None;
    });
}

#[test]
fn one_charge_per_key_fails_on_a_second_charge_for_a_ride() {
    fails("one_charge_per_key", 1, "ride 10: 2 charges", |w| {
        w.charges.push(charge("ch_10b", 2_000, GOOD, 10, "k1"));
    });
}

#[test]
fn acknowledged_201_is_paid_fails_when_the_charge_is_gone_from_the_gateway() {
    // Two 201s name it: the answer during the run and the late replay.
    fails(
        "acknowledged_201_is_paid",
        2,
        "key k1: 201 for ride 10",
        |w| {
            w.charges.retain(|c| c.id != "ch_10");
        },
    );
}

#[test]
fn acknowledged_201_is_paid_fails_when_the_ride_is_lost() {
    fails(
        "acknowledged_201_is_paid",
        2,
        "key k4: 201 for ride 13",
        |w| {
            w.rides.retain(|r| r.id != 13);
        },
    );
}

#[test]
fn acknowledged_201_is_paid_fails_when_the_ride_is_not_paid() {
    fails(
        "acknowledged_201_is_paid",
        2,
        "key k1: 201 for ride 10",
        |w| {
            w.ride(10).status = "pending".to_owned();
        },
    );
}

#[test]
fn no_charge_without_ride_fails_on_a_charge_naming_no_ride() {
    fails("no_charge_without_ride", 1, "charge ch_99", |w| {
        w.charges.push(charge("ch_99", 500, GOOD, 99, "k9"));
    });
}

#[test]
fn no_charge_without_ride_fails_on_a_charge_its_ride_does_not_record() {
    fails("no_charge_without_ride", 1, "charge ch_10", |w| {
        w.ride(10).charge_id = Some("ch_other".to_owned());
    });
}

#[test]
fn no_charge_without_ride_fails_on_a_charge_on_another_customers_card() {
    fails("no_charge_without_ride", 1, "charge ch_13", |w| {
        w.charges[1].customer_id = "cus_2".to_owned();
    });
}

#[test]
fn replays_equal_first_answer_fails_on_a_replay_with_other_bytes() {
    fails("replays_equal_first_answer", 1, "key k1", |w| {
        let late = w.log("k1").late.as_mut().unwrap();
        late.body = Some(booked(10, "ch_10", 2_001).to_string().into_bytes());
    });
}

#[test]
fn replays_equal_first_answer_fails_on_a_repeat_not_marked_replayed() {
    fails("replays_equal_first_answer", 1, "key k2", |w| {
        w.log("k2").late.as_mut().unwrap().replayed = false;
    });
}

#[test]
fn payload_swap_refused_fails_when_another_amount_is_booked() {
    fails("payload_swap_refused", 1, "key k1: another amount", |w| {
        w.log("k1").swapped = Some(answer(201, &booked(15, "ch_15", 9_999), 0));
    });
}

#[test]
fn every_key_finished_fails_on_a_key_left_unfinished() {
    fails("every_key_finished", 1, "stuck at ride_created", |w| {
        w.before
            .unfinished
            .push("user 1 key k1 stuck at ride_created".to_owned());
    });
}

#[test]
fn every_request_answered_afterwards_fails_without_a_final_late_answer() {
    fails("every_request_answered_afterwards", 1, "key k1", |w| {
        w.log("k1").late = Some(retry(Some(503), 0));
    });
}

#[test]
fn every_request_answered_afterwards_fails_on_a_new_answer_for_an_existing_key() {
    fails("every_request_answered_afterwards", 1, "key k2", |w| {
        w.log("k2").late.as_mut().unwrap().replayed = false;
    });
}

#[test]
fn no_unexpected_answer_fails_on_a_500_far_from_any_database_fault() {
    fails(
        "no_unexpected_answer",
        1,
        "unexpected Some(500) at second 50",
        |w| {
            w.log("k2").answers.insert(0, retry(Some(500), 50));
        },
    );
}

#[test]
fn no_unexpected_answer_fails_on_more_500s_than_database_faults() {
    // The healthy run's 500 at DB_FAULT_AT + 1 spent the fault's budget of one.
    fails("no_unexpected_answer", 1, "at second 22", |w| {
        w.log("k2")
            .answers
            .insert(0, retry(Some(500), DB_FAULT_AT + 2));
    });
}

#[test]
fn no_unexpected_answer_fails_on_a_client_error() {
    fails("no_unexpected_answer", 1, "unexpected Some(400)", |w| {
        w.log("k4").answers.insert(0, retry(Some(400), 33));
    });
}

#[test]
fn no_unexpected_answer_fails_on_a_502_that_is_not_the_stored_refusal() {
    fails("no_unexpected_answer", 1, "unexpected Some(502)", |w| {
        w.log("k1").answers.insert(0, retry(Some(502), 2));
    });
}

#[test]
fn no_unexpected_answer_fails_when_a_process_died_on_its_own() {
    fails("no_unexpected_answer", 1, "1 processes exited", |w| {
        w.process_exits = 1;
    });
}

#[test]
fn one_receipt_per_paid_ride_fails_on_a_paid_ride_without_its_receipt() {
    fails("one_receipt_per_paid_ride", 1, "ride 13 (paid)", |w| {
        w.receipts.remove(&13);
    });
}

#[test]
fn one_receipt_per_paid_ride_fails_on_a_receipt_for_a_declined_ride() {
    fails("one_receipt_per_paid_ride", 1, "ride 11 (declined)", |w| {
        w.receipts.insert(11);
    });
}

#[test]
fn declines_follow_the_card_fails_on_a_paid_ride_of_a_declining_card() {
    fails(
        "declines_follow_the_card",
        1,
        "ride 11 of user 2 is paid",
        |w| {
            w.ride(11).status = "paid".to_owned();
        },
    );
}

#[test]
fn declines_follow_the_card_fails_on_a_402_for_a_good_card() {
    fails("declines_follow_the_card", 1, "key k1 (user 1): 402", |w| {
        let declined = w.log("k2").answers[0].clone();
        w.log("k1").answers.push(declined);
    });
}

#[test]
fn declines_follow_the_card_fails_on_a_failed_ride_of_a_good_card_not_refused() {
    fails(
        "declines_follow_the_card",
        1,
        "ride 12 of user 3 is failed",
        |w| {
            w.refused_users.clear();
        },
    );
}

#[test]
fn declines_follow_the_card_fails_when_no_request_came_from_a_declining_card() {
    fails(
        "declines_follow_the_card",
        1,
        "no request came from a declining card",
        |w| {
            w.logs.retain(|l| !l.user.declines);
            w.rides.retain(|r| r.user_id != DECLINING);
        },
    );
}

#[test]
fn refused_keys_finish_with_502_and_no_charge_fails_on_a_refused_ride_that_was_charged() {
    // Seen from the ride and from its stored 502; the charge is also no ride's, which
    // no_charge_without_ride reports.
    fails(
        "refused_keys_finish_with_502_and_no_charge",
        2,
        "ride 12 of user 3 failed (refused user: true, charged: true",
        |w| w.charges.push(charge("ch_12", 900, REFUSED, 12, "k3")),
    );
}

#[test]
fn refused_keys_finish_with_502_and_no_charge_fails_on_a_refusal_of_a_customer_never_refused() {
    // The failed ride, and the 502s told for it (the first and its replay).
    fails(
        "refused_keys_finish_with_502_and_no_charge",
        3,
        "ride 12 of user 3 failed (refused user: false",
        |w| w.refused_users.clear(),
    );
}

#[test]
fn refused_keys_finish_with_502_and_no_charge_fails_on_a_stored_502_whose_request_was_charged() {
    fails(
        "refused_keys_finish_with_502_and_no_charge",
        1,
        "request req-k1 stored a 502",
        |w| w.refused_requests.push("req-k1".to_owned()),
    );
}

#[test]
fn refused_keys_finish_with_502_and_no_charge_fails_on_a_refusal_without_a_failed_ride() {
    fails(
        "refused_keys_finish_with_502_and_no_charge",
        2,
        "key k3 (user 3): a 502",
        |w| w.rides.retain(|r| r.id != 12),
    );
}

#[test]
fn adopted_charge_is_the_rides_one_charge_fails_when_another_charge_names_the_request() {
    fails(
        "adopted_charge_is_the_rides_one_charge",
        1,
        "ride 13 adopted charge Some(\"ch_13\")",
        |w| {
            let mut twin = charge("ch_13b", 2_100, GOOD, 13, "k4");
            twin.ride_id = None;
            w.charges.push(twin);
        },
    );
}

#[test]
fn adopted_charge_is_the_rides_one_charge_fails_when_the_charge_names_another_request() {
    fails(
        "adopted_charge_is_the_rides_one_charge",
        1,
        "ride 13 adopted charge",
        |w| w.charges[1].request = Some("req-k1".to_owned()),
    );
}

#[test]
fn lost_lease_stopped_its_holder_fails_on_a_write_after_the_loss() {
    fails(
        "lost_lease_stopped_its_holder",
        1,
        "key 7 token 3 (api-0.log): went on to write [\"call\"]",
        |w| w.lost_leases[0].writes_after.push("call".to_owned()),
    );
}

#[test]
fn a_holder_that_found_out_at_the_fence_instead_of_a_renewal_passes() {
    let mut world = World::healthy();
    world.lost_leases.clear();
    world.fenced_after_steal = vec![(7, 3)];
    let result = world.verdict("lost_lease_stopped_its_holder");
    assert!(result.passed, "{result:?}");
}

#[test]
fn lost_lease_stopped_its_holder_fails_when_no_holder_found_out_its_lease_was_taken_over() {
    fails(
        "lost_lease_stopped_its_holder",
        1,
        "1 leases taken over, and no holder found out",
        |w| w.lost_leases.clear(),
    );
}

#[test]
fn every_fault_exercised_fails_on_a_configured_fault_never_injected() {
    fails(
        "every_fault_exercised",
        1,
        "fault never exercised: net_reset",
        |w| w.configured.push("net_reset"),
    );
}
