//! What happened when: every response the clients received and every fault injected, by second.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::report::TimelineBucket;

#[derive(Debug, Default)]
struct Events {
    responses: Vec<(u32, String)>,
    faults: Vec<(u32, String, u64)>,
    /// Added latency: counted, but left out of the timeline, where a delay on nearly every
    /// connection would bury the discrete faults.
    ambient: BTreeMap<String, u64>,
    /// Processes that died of something the harness did not do to them: not a fault it
    /// injected, but a finding for the auditor.
    unexpected_exits: u64,
    /// The leases the harness took over, each as (key id, the token its holder had).
    stolen_leases: Vec<(i64, i64)>,
}

/// Shared by every task of a run. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Recorder {
    start: Instant,
    events: Arc<Mutex<Events>>,
}

impl Recorder {
    pub(crate) fn new() -> Self {
        Self {
            start: Instant::now(),
            events: Arc::default(),
        }
    }

    /// Seconds since the run began: when answers and faults happened.
    pub(crate) fn second(&self) -> u32 {
        self.start.elapsed().as_secs() as u32
    }

    /// One response (a status, or `transport_error`).
    pub(crate) fn response(&self, status: &str) {
        let second = self.second();
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .responses
            .push((second, status.to_owned()));
    }

    /// `count` faults of `kind` injected now.
    pub(crate) fn fault(&self, kind: &str, count: u64) {
        if count == 0 {
            return;
        }
        let second = self.second();
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .faults
            .push((second, kind.to_owned(), count));
    }

    /// `count` connections or calls slowed down on purpose (latency, delay).
    pub(crate) fn ambient(&self, kind: &str, count: u64) {
        if count > 0 {
            let mut events = self.events.lock().unwrap_or_else(|e| e.into_inner());
            *events.ambient.entry(kind.to_owned()).or_default() += count;
        }
    }

    /// The harness took over the lease of key `key_id` from its holder, whose token was
    /// `token`: a fault of `kind`, and a fact for the audit of the holder.
    pub(crate) fn lease_stolen(&self, kind: &str, key_id: i64, token: i64) {
        self.fault(kind, 1);
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stolen_leases
            .push((key_id, token));
    }

    /// Every lease the harness took over, as (key id, its holder's token).
    pub(crate) fn stolen_leases(&self) -> Vec<(i64, i64)> {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stolen_leases
            .clone()
    }

    /// A process exited, or could not start, other than by the harness's hand.
    pub(crate) fn unexpected_exit(&self) {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .unexpected_exits += 1;
    }

    /// How many processes exited other than by the harness's hand.
    pub(crate) fn unexpected_exits(&self) -> u64 {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .unexpected_exits
    }

    /// The second of every fault of one of `kinds`, once per fault (an event of three faults
    /// gives its second three times), in order.
    pub(crate) fn fault_seconds(&self, kinds: &[&str]) -> Vec<u32> {
        let events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        let mut seconds: Vec<u32> = events
            .faults
            .iter()
            .filter(|(_, kind, _)| kinds.contains(&kind.as_str()))
            .flat_map(|(second, _, count)| std::iter::repeat_n(*second, *count as usize))
            .collect();
        seconds.sort_unstable();
        seconds
    }

    /// Totals by kind, latency included.
    pub(crate) fn fault_totals(&self) -> BTreeMap<String, u64> {
        let events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        let mut totals = events.ambient.clone();
        for (_, kind, count) in &events.faults {
            *totals.entry(kind.clone()).or_default() += count;
        }
        totals
    }

    /// Responses by status.
    pub(crate) fn response_totals(&self) -> BTreeMap<String, u64> {
        let events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        let mut totals = BTreeMap::new();
        for (_, status) in &events.responses {
            *totals.entry(status.clone()).or_default() += 1;
        }
        totals
    }

    /// One bucket per second from the start to the last event.
    pub(crate) fn timeline(&self) -> Vec<TimelineBucket> {
        let events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        let last = events
            .responses
            .iter()
            .map(|(s, _)| *s)
            .chain(events.faults.iter().map(|(s, _, _)| *s))
            .max()
            .unwrap_or(0);
        let mut buckets: Vec<TimelineBucket> = (0..=last)
            .map(|second| TimelineBucket {
                second,
                ..TimelineBucket::default()
            })
            .collect();
        for (second, status) in &events.responses {
            *buckets[*second as usize]
                .responses
                .entry(status.clone())
                .or_default() += 1;
        }
        for (second, kind, count) in &events.faults {
            *buckets[*second as usize]
                .faults
                .entry(kind.clone())
                .or_default() += count;
        }
        buckets
    }
}
