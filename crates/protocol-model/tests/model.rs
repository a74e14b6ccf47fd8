//! The protocol, checked: the real protocol keeps every property in every reachable state of
//! the biggest scope, and of the scopes where a holder stands still where the biggest one
//! assumes it does not; each protection's absence is found as a counterexample, printed as a
//! path of actions. Run with `--nocapture` to see the state counts, the times and the traces.

use protocol_model::{
    check, Example, Name, Protection, Protections, ProtocolModel, Relation, Scope, Settings, Until,
};

/// The scope of the negative variants: the real one, read as written (no
/// symmetry, so that "client 0" stays client 0 in a trace), with only the faults the
/// counterexample needs (a breadth-first search in a bigger scope finds the same trace or a
/// shorter one, slower).
fn narrow(faults: u8) -> Scope {
    Scope {
        faults,
        symmetry: false,
        ..Scope::default()
    }
}

#[test]
fn the_protocol_keeps_every_property_in_every_reachable_state() {
    let model = ProtocolModel::new(Protections::default(), Scope::default());
    assert_eq!(model.settings, Settings::MODEL);
    let checked = check(model, Until::Exhausted, 2);
    println!("{}", checked.summary());
    for name in checked.broken() {
        println!(
            "{}",
            checked.trace(name).expect("a broken property has a trace")
        );
    }
    assert_eq!(
        checked.broken(),
        Vec::<Name>::new(),
        "{}",
        checked.summary()
    );
    assert!(
        checked.unique_states >= 100_000,
        "the biggest check explores at least 100,000 states: {}",
        checked.summary()
    );
}

#[test]
fn the_checker_reaches_every_example() {
    // Without them the properties above could hold because nothing ever happens.
    for example in Example::ALL {
        let scope = Scope {
            examples: true,
            ..narrow(1)
        };
        let checked = check(
            ProtocolModel::new(Protections::default(), scope),
            Until::Reached(example),
            1,
        );
        let path = checked.example(example);
        println!(
            "{:?}: {}",
            example,
            path.map_or("not reached".to_owned(), |p| format!(
                "reached in {} actions",
                p.clone().into_actions().len()
            ))
        );
        assert!(
            path.is_some(),
            "{example:?} not reached: {}",
            checked.summary()
        );
    }
}

/// Checks the protocol without `protection` until the property it guards breaks, prints the
/// counterexample, and fails if there is none.
fn without(protection: Protection, faults: u8) {
    let model = ProtocolModel::new(Protections::without(protection), narrow(faults));
    let checked = check(model, Until::Broken(protection.guards()), 1);
    println!("{}", checked.summary());
    let trace = checked.trace(protection.guards()).unwrap_or_else(|| {
        panic!(
            "without {protection:?}, no counterexample to \"{}\": {}",
            protection.guards().as_str(),
            checked.summary()
        )
    });
    println!("{trace}");
}

#[test]
fn without_the_fence_a_holder_whose_lease_was_taken_over_still_writes() {
    without(Protection::Fence, 0);
}

#[test]
fn without_the_in_flight_guard_a_list_misses_a_call_still_running_and_charges_twice() {
    without(Protection::InFlightGuard, 0);
}

#[test]
fn an_intermediarys_4xx_page_taken_for_a_refusal_stores_a_502_for_a_charged_card() {
    without(Protection::OnlyTheGatewaysWordIsFinal, 1);
}

#[test]
fn a_lease_clock_started_at_the_claims_answer_lets_a_stale_holder_charge_twice() {
    without(Protection::LeaseClockFromTheSend, 0);
}

#[test]
fn a_processing_bound_no_longer_than_the_timeout_lists_too_early_and_charges_twice() {
    without(Protection::ProcessingBoundAboveTheTimeout, 0);
}

#[test]
fn a_key_window_below_its_floor_still_charges_once_as_every_call_is_waited_for() {
    // The floor keeps reconciliations rare; one charge does not rest on it: every call leaves
    // within a heartbeat of its record, and the list waits the processing bound past the last
    // record. Without the first (a first call sent up to a lease after its phase), this window
    // charges twice.
    let settings = Settings {
        gateway_key_window: Settings::MODEL.lease_ttl,
        ..Settings::MODEL
    };
    assert_eq!(settings.broken(), vec![Relation::KeyWindowFloor]);
    let mut model = ProtocolModel::new(Protections::default(), narrow(0));
    model.settings = settings;
    keeps_every_property(model);
}

#[test]
fn a_key_window_longer_than_the_gateways_memory_charges_twice() {
    without(Protection::KeyWindowWithinTheGatewaysMemory, 0);
}

#[test]
fn a_reaper_that_deletes_unfinished_keys_leaves_a_key_that_never_finishes() {
    without(Protection::ReaperSparesUnfinishedKeys, 0);
}

#[test]
fn a_refusal_after_an_unknown_outcome_stored_at_once_is_a_502_for_a_charged_card() {
    without(Protection::RefusalAfterAnUnknownOutcomeReconciles, 1);
}

#[test]
fn a_5xx_that_was_not_replayed_taken_for_a_stored_one_charges_twice() {
    without(Protection::OnlyAReplayed5xxIsStored, 1);
}

/// Checks `model` exhaustively, and fails with the trace of any property it breaks.
fn keeps_every_property(model: ProtocolModel) {
    let checked = check(model, Until::Exhausted, 2);
    println!("{}", checked.summary());
    for name in checked.broken() {
        println!(
            "{}",
            checked.trace(name).expect("a broken property has a trace")
        );
    }
    assert_eq!(
        checked.broken(),
        Vec::<Name>::new(),
        "{}",
        checked.summary()
    );
}

/// A holder may stand still between the phase that records its call and the call's departure.
/// No faults beyond the pauses and the timeouts: a bigger scope outgrows CI's two minutes.
fn pause_between_record_and_send(symmetry: bool) -> Scope {
    Scope {
        pause_between_record_and_send: true,
        symmetry,
        ..narrow(0)
    }
}

/// A holder that took a key over may stand still between reading its ride and its next step;
/// the scope as above.
fn pause_after_reading_the_ride(symmetry: bool) -> Scope {
    Scope {
        pause_after_reading_the_ride: true,
        symmetry,
        ..narrow(0)
    }
}

/// Checks the protocol without `protection`, in `scope`, until a request is charged twice,
/// prints the counterexample, and fails if there is none.
fn without_in(protection: Protection, scope: Scope) {
    let model = ProtocolModel::new(Protections::without(protection), scope);
    let checked = check(model, Until::Broken(Name::OneChargePerRequest), 1);
    println!("{}", checked.summary());
    let trace = checked
        .trace(Name::OneChargePerRequest)
        .unwrap_or_else(|| panic!("no double charge found: {}", checked.summary()));
    println!("{trace}");
}

#[test]
fn a_holder_that_stands_still_after_recording_its_call_records_it_anew_and_charges_once() {
    keeps_every_property(ProtocolModel::new(
        Protections::default(),
        pause_between_record_and_send(true),
    ));
}

// The shortest double charge in this scope is the first call's, as without the pause: one
// protection covers a recorded call that stood still and a first call sent late.
#[test]
fn sending_late_after_a_pause_between_record_attempt_and_the_send_hides_the_charge_from_the_list() {
    without_in(
        Protection::SendWithinAHeartbeatOfItsRecord,
        pause_between_record_and_send(false),
    );
}

#[test]
fn a_holder_that_stands_still_after_reading_its_ride_decides_the_window_at_its_record() {
    keeps_every_property(ProtocolModel::new(
        Protections::default(),
        pause_after_reading_the_ride(true),
    ));
}

#[test]
fn a_window_decided_at_the_load_lets_a_paused_holder_call_under_a_key_the_gateway_forgot() {
    without_in(
        Protection::WindowDecidedAtTheRecord,
        pause_after_reading_the_ride(false),
    );
}

#[test]
fn a_first_call_sent_up_to_a_lease_after_its_phase_is_beyond_a_list_without_skew() {
    // The model's gateway keeps our clock: the list needs no skew, and has none.
    assert_eq!(Settings::MODEL.reconcile_clock_skew, 0);
    without_in(Protection::SendWithinAHeartbeatOfItsRecord, narrow(0));
}
