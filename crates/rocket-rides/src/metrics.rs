//! The service's counters and histograms, in the OpenMetrics text format
//! (`prometheus-client`).
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `http_requests_total` | counter | `method` (unknown methods are `OTHER`), `route` (the template, `unmatched` for none), `status` |
//! | `http_request_duration_seconds` | histogram | `method`, `route`, `status` |
//! | `http_requests_shed_total`, `http_requests_timed_out_total` | counter | requests answered 503 by the edge: too many in flight or no admission slot within `--admission-wait` (or `--admission-overload-wait` within a second of a shed), past the deadline |
//! | `http_admission_overdrawn_total` | counter | admitted bookings that came back from the gateway or a wait to no free slot and went on on credit, paid back by the next slot let go (never shed half-way) |
//! | `http_connections_open` | gauge | |
//! | `http_connections_refused_total` | counter | connections answered 503 and closed: too many open |
//! | `idempotency_claims_total` | counter | `outcome`: acquired, replayed, mismatch, in_flight |
//! | `idempotency_claim_duration_seconds` | histogram | |
//! | `booking_phase_duration_seconds` | histogram | `phase`: the recovery point a phase commits (ride_created, charge_pending, finished), as the key store reports it |
//! | `gateway_call_duration_seconds` | histogram | `call`: create_charge, list_charges, retrieve_charge |
//! | `gateway_charges_total` | counter | `outcome`: charged, declined, unavailable, refused, misconfigured, pending, stored_error |
//! | `gateway_reconciliations_total` | counter | `outcome`: adopted, none_found |
//! | `payments_refused_total` | counter | |
//! | `idempotency_leases_lost_total` | counter | |
//! | `completer_keys_total` | counter | `outcome`: claimed, finished, retried, lost, undecodable, panicked |
//! | `outbox_receipts_delivered_total`, `outbox_jobs_failed_total`, `reaper_keys_deleted_total` | counter | |
//! | `idempotency_keys_unfinished` | gauge | read from the database at most every [`UNFINISHED_KEYS_REFRESH`] (5 s), not per scrape; true across every process |
//! | `db_pool_connections` | gauge | `state`: in_use, idle (this process's pool, at scrape time) |
//! | `db_pool_connections_max` | gauge | the most connections this process's pool opens (`--max-connections`) |
//!
//! Every label value comes from a closed set (route templates, not paths; known methods), so the
//! number of series is bounded whatever clients send. Series of known outcomes exist from the
//! start, at zero, so that a rate over them is defined before the first event.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry, Unit};

/// How long a read of `idempotency_keys_unfinished` stands: a scrape within this time of the
/// last read shows that read's value instead of counting again. The count reads a table of every
/// unfinished key (every shard, on a distributed database): read per scrape, its cost would grow
/// with the number of scrapers and their rate. Short next to the 15 minutes over which
/// `ops/prometheus/alerts.yml` looks for growth, and next to a scrape interval of 15 s or more.
pub const UNFINISHED_KEYS_REFRESH: Duration = Duration::from_secs(5);

/// The media type of the text exposition format.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// How a claim ended: the library's own outcomes, which the store reports.
pub use idempotency::ClaimOutcome;

const CLAIM_OUTCOMES: [&str; 4] = [
    ClaimOutcome::Acquired.name(),
    ClaimOutcome::Replayed.name(),
    ClaimOutcome::Mismatch.name(),
    ClaimOutcome::InFlight.name(),
];

/// How a gateway charge call ended.
#[derive(Debug, Clone, Copy)]
pub enum ChargeOutcome {
    /// Charged (or the charge made earlier under the same key was returned).
    Charged,
    /// The card was declined.
    Declined,
    /// No usable answer; resumed later.
    Unavailable,
    /// The gateway refused the request for good (the request finishes with a 502).
    Refused,
    /// The gateway refused our credentials, or its certificate is not trusted.
    Misconfigured,
    /// The charge was created `pending`.
    Pending,
    /// The gateway replayed a 5xx it stored under the key (the key is reconciled).
    StoredError,
    /// An answer without the gateway's own error object (a proxy's page, no body): an unknown
    /// outcome, resumed later under the same key.
    UnknownAnswer,
}

/// The labels of `gateway_charges_total`, in the order of [`ChargeOutcome`].
const CHARGE_OUTCOMES: [&str; 8] = [
    "charged",
    "declined",
    "unavailable",
    "refused",
    "misconfigured",
    "pending",
    "stored_error",
    "unknown_answer",
];

impl ChargeOutcome {
    /// The outcome of one call's result.
    pub fn of(result: &Result<crate::stripe::Charge, crate::stripe::ChargeError>) -> Self {
        use crate::stripe::{ChargeError, ChargeStatus};
        match result {
            Ok(charge) => match charge.status {
                ChargeStatus::Pending => Self::Pending,
                ChargeStatus::Failed => Self::Declined,
                ChargeStatus::Succeeded => Self::Charged,
                // Answered 503 and asked again, as an unavailable gateway.
                ChargeStatus::Unknown => Self::Unavailable,
            },
            Err(ChargeError::Declined { .. }) => Self::Declined,
            Err(ChargeError::Refused(_)) => Self::Refused,
            Err(ChargeError::Misconfigured(_)) => Self::Misconfigured,
            Err(ChargeError::StoredServerError { .. }) => Self::StoredError,
            Err(ChargeError::Transient(_)) => Self::Unavailable,
            Err(ChargeError::UnknownAnswer { .. }) => Self::UnknownAnswer,
        }
    }
}

/// How a reconciliation (a list of the customer's charges) ended.
#[derive(Debug, Clone, Copy)]
pub enum Reconciliation {
    /// The charge made for the request was found and adopted.
    Adopted,
    /// None was found; a new generation of the gateway key charges, or the gateway's refusal
    /// is stored.
    NoneFound,
    /// Put off: a call under the current key may still be running at the gateway (its last
    /// attempt is younger than `--gateway-processing-bound`); the request answered 503.
    Deferred,
}

const RECONCILIATIONS: [&str; 3] = ["adopted", "none_found", "deferred"];

/// What the completer did with a key.
#[derive(Debug, Clone, Copy)]
pub enum CompleterOutcome {
    /// Claimed.
    Claimed,
    /// Driven to a final state.
    Finished,
    /// Released with a backoff after a failed attempt.
    Retried,
    /// Its lease was taken over during the attempt.
    Lost,
    /// Its recovery point is unknown to this build.
    Undecodable,
    /// Its attempt panicked; the lease expires and the key is tried again.
    Panicked,
}

const COMPLETER_OUTCOMES: [&str; 6] = [
    "claimed",
    "finished",
    "retried",
    "lost",
    "undecodable",
    "panicked",
];

/// A call to the gateway, for `gateway_call_duration_seconds`.
#[derive(Debug, Clone, Copy)]
pub enum GatewayCall {
    /// `POST /v1/charges`.
    CreateCharge,
    /// `GET /v1/charges` (every page of one reconciliation).
    ListCharges,
    /// `GET /v1/charges/{id}`.
    RetrieveCharge,
}

const GATEWAY_CALLS: [&str; 3] = ["create_charge", "list_charges", "retrieve_charge"];

/// The methods that are their own label value; any other is `OTHER`.
const KNOWN_METHODS: [&str; 7] = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpLabels {
    method: &'static str,
    route: String,
    status: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabel {
    call: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// Seconds, from 1 ms to about 33 s, doubling: a phase takes milliseconds, a gateway call up to
/// its timeout.
fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// The service's metrics. Cheap to clone; clones share the registry.
#[derive(Clone)]
pub struct Metrics(Arc<Inner>);

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

struct Inner {
    registry: Registry,
    edge: Edge,
    bookings: Bookings,
    upkeep: Upkeep,
}

/// The HTTP edge: requests, their time, the gate and the connections.
struct Edge {
    http_requests: Family<HttpLabels, Counter>,
    http_duration: Histograms<HttpLabels>,
    requests_shed: Counter,
    requests_timed_out: Counter,
    admission_overdrawn: Counter,
    connections_open: Gauge,
    connections_refused: Counter,
}

/// The bookings: claims, phases, the gateway and how requests ended.
struct Bookings {
    claims: Family<OutcomeLabel, Counter>,
    claim_duration: Histogram,
    phase_duration: Histograms<PhaseLabel>,
    gateway_duration: Histograms<CallLabel>,
    charges: Family<OutcomeLabel, Counter>,
    reconciliations: Family<OutcomeLabel, Counter>,
    payments_refused: Counter,
    leases_lost: Counter,
}

/// The worker's loops and the database: what finishes, delivers and reaps, and the pool.
struct Upkeep {
    completer: Family<OutcomeLabel, Counter>,
    receipts_delivered: Counter,
    jobs_failed: Counter,
    keys_reaped: Counter,
    unfinished_keys: Gauge,
    /// When `unfinished_keys` was last read (tried, whether the database answered or not).
    unfinished_read_at: tokio::sync::Mutex<Option<Instant>>,
    pool_connections: Family<StateLabel, Gauge>,
    pool_max: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut r = Registry::default();
        let inner = Inner {
            edge: Edge::register(&mut r),
            bookings: Bookings::register(&mut r),
            upkeep: Upkeep::register(&mut r),
            registry: r,
        };
        // Known outcomes start at zero.
        for (family, names) in [
            (&inner.bookings.claims, &CLAIM_OUTCOMES[..]),
            (&inner.bookings.charges, &CHARGE_OUTCOMES[..]),
            (&inner.bookings.reconciliations, &RECONCILIATIONS[..]),
            (&inner.upkeep.completer, &COMPLETER_OUTCOMES[..]),
        ] {
            for outcome in names {
                drop(family.get_or_create(&OutcomeLabel { outcome }));
            }
        }
        Self(Arc::new(inner))
    }
}

impl Edge {
    /// Registers each metric of the family in `r`.
    fn register(r: &mut Registry) -> Self {
        Self {
        http_requests: add(
            r,
            "http_requests",
            "HTTP requests answered, by method, route template and status",
            Family::<HttpLabels, Counter>::default(),
        ),
        http_duration: seconds(
            r,
            "http_request_duration",
            "Time to answer an HTTP request, by method, route template and status",
            Family::new_with_constructor(seconds_histogram),
        ),
        requests_shed: add(
            r,
            "http_requests_shed",
            "Requests answered 503 at once because as many were in flight as the server takes",
            Counter::default(),
        ),
        requests_timed_out: add(
            r,
            "http_requests_timed_out",
            "Requests answered 503 because they ran past the request deadline",
            Counter::default(),
        ),
        admission_overdrawn: add(
            r,
            "http_admission_overdrawn",
            "Admitted bookings that came back from the gateway or a wait to no free admission slot and went on on credit",
            Counter::default(),
        ),
        connections_open: add(
            r,
            "http_connections_open",
            "Connections open now",
            Gauge::default(),
        ),
        connections_refused: add(
            r,
            "http_connections_refused",
            "Connections answered 503 and closed because as many were open as the server takes",
            Counter::default(),
        ),
        }
    }
}

impl Bookings {
    /// Registers each metric of the family in `r`.
    fn register(r: &mut Registry) -> Self {
        Self {
        claims: add(
            r,
            "idempotency_claims",
            "Claims of idempotency keys, by outcome",
            Family::<OutcomeLabel, Counter>::default(),
        ),
        claim_duration: seconds(
            r,
            "idempotency_claim_duration",
            "Time of one claim: the read of the key and, for a new or abandoned key, the write that \
             claims it (a new key's insert opens the transaction of its first phase)",
            seconds_histogram(),
        ),
        phase_duration: seconds(
            r,
            "booking_phase_duration",
            "Time of one atomic phase of a booking, from its first statement to its commit, by the \
             recovery point it commits",
            Family::new_with_constructor(seconds_histogram),
        ),
        gateway_duration: seconds(
            r,
            "gateway_call_duration",
            "Time of one call to the payment gateway, by call",
            Family::new_with_constructor(seconds_histogram),
        ),
        charges: add(
            r,
            "gateway_charges",
            "Calls to the gateway's charge endpoint, by outcome",
            Family::<OutcomeLabel, Counter>::default(),
        ),
        reconciliations: add(
            r,
            "gateway_reconciliations",
            "Lists of a customer's charges made because the gateway key could not be trusted, by \
             outcome",
            Family::<OutcomeLabel, Counter>::default(),
        ),
        payments_refused: add(
            r,
            "payments_refused",
            "Requests finished with 502 because the gateway refused the charge for good",
            Counter::default(),
        ),
        leases_lost: add(
            r,
            "idempotency_leases_lost",
            "Requests stopped because another holder took their key over",
            Counter::default(),
        ),
        }
    }
}

impl Upkeep {
    /// Registers each metric of the family in `r`.
    fn register(r: &mut Registry) -> Self {
        Self {
        completer: add(
            r,
            "completer_keys",
            "Keys the completer claimed, and how each attempt ended",
            Family::<OutcomeLabel, Counter>::default(),
        ),
        receipts_delivered: add(
            r,
            "outbox_receipts_delivered",
            "Ride receipts the outbox drain delivered",
            Counter::default(),
        ),
        jobs_failed: add(
            r,
            "outbox_jobs_failed",
            "Staged jobs that could not be run and were moved to failed_jobs",
            Counter::default(),
        ),
        keys_reaped: add(
            r,
            "reaper_keys_deleted",
            "Finished keys the reaper deleted",
            Counter::default(),
        ),
        unfinished_keys: add(
            r,
            "idempotency_keys_unfinished",
            "Keys not yet finished, across all processes (read from the database at most every 5 s)",
            Gauge::default(),
        ),
        unfinished_read_at: tokio::sync::Mutex::new(None),
        pool_connections: add(
            r,
            "db_pool_connections",
            "This process's database connections, in use or idle (read at scrape time)",
            Family::<StateLabel, Gauge>::default(),
        ),
        pool_max: add(
            r,
            "db_pool_connections_max",
            "The most database connections this process's pool opens",
            Gauge::default(),
        ),
        }
    }
}

/// Registers `metric` under `name` and hands it back, to keep.
fn add<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// Registers `metric`, measured in seconds, under `name` and hands it back, to keep.
fn seconds<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register_with_unit(name, help, Unit::Seconds, metric.clone());
    metric
}

impl Metrics {
    /// The size this process's pool may grow to: what `db_pool_connections{state="in_use"}`
    /// saturates at.
    pub fn pool_max(&self, max_connections: u32) {
        self.0.upkeep.pool_max.set(i64::from(max_connections));
    }

    /// Counts a request shed by the edge.
    pub fn request_shed(&self) {
        self.0.edge.requests_shed.inc();
    }

    /// Counts an admitted booking that went on without a slot (see [`crate::admission`]).
    pub fn admission_overdrawn(&self) {
        self.0.edge.admission_overdrawn.inc();
    }

    /// Counts a request stopped at its deadline.
    pub fn request_timed_out(&self) {
        self.0.edge.requests_timed_out.inc();
    }

    /// A connection was accepted.
    pub fn connection_opened(&self) {
        self.0.edge.connections_open.inc();
    }

    /// A connection ended.
    pub fn connection_closed(&self) {
        self.0.edge.connections_open.dec();
    }

    /// A connection was refused: too many open.
    pub fn connection_refused(&self) {
        self.0.edge.connections_refused.inc();
    }

    /// Counts one claim and how long it took.
    pub fn claim(&self, outcome: ClaimOutcome, took: Duration) {
        let outcome = outcome.name();
        self.0
            .bookings
            .claims
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
        self.0.bookings.claim_duration.observe(took.as_secs_f64());
    }

    /// Times one committed phase of a booking, by the recovery point it committed.
    pub fn phase(&self, phase: &'static str, took: Duration) {
        self.0
            .bookings
            .phase_duration
            .get_or_create(&PhaseLabel { phase })
            .observe(took.as_secs_f64());
    }

    /// Times one gateway call.
    pub fn gateway_call(&self, call: GatewayCall, took: Duration) {
        let call = GATEWAY_CALLS[call as usize];
        self.0
            .bookings
            .gateway_duration
            .get_or_create(&CallLabel { call })
            .observe(took.as_secs_f64());
    }

    /// Counts one gateway charge call.
    pub fn charge(&self, outcome: ChargeOutcome) {
        let outcome = CHARGE_OUTCOMES[outcome as usize];
        self.0
            .bookings
            .charges
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    /// Counts one reconciliation.
    pub fn reconciliation(&self, outcome: Reconciliation) {
        let outcome = RECONCILIATIONS[outcome as usize];
        self.0
            .bookings
            .reconciliations
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    /// Counts a request finished with a 502 because the gateway refused its charge for good.
    pub fn payment_refused(&self) {
        self.0.bookings.payments_refused.inc();
    }

    /// Counts a request or completer attempt that found its lease taken over.
    pub fn lease_lost(&self) {
        self.0.bookings.leases_lost.inc();
    }

    /// Counts one completer pass: how many keys had each outcome.
    pub fn completer_pass(&self, counts: [(CompleterOutcome, usize); 6]) {
        for (outcome, n) in counts {
            let outcome = COMPLETER_OUTCOMES[outcome as usize];
            self.0
                .upkeep
                .completer
                .get_or_create(&OutcomeLabel { outcome })
                .inc_by(n as u64);
        }
    }

    /// Counts receipts the outbox drain delivered.
    pub fn receipts_delivered(&self, n: u64) {
        self.0.upkeep.receipts_delivered.inc_by(n);
    }

    /// Counts staged jobs moved aside.
    pub fn jobs_failed(&self, n: u64) {
        self.0.upkeep.jobs_failed.inc_by(n);
    }

    /// Counts keys the reaper deleted.
    pub fn keys_reaped(&self, n: u64) {
        self.0.upkeep.keys_reaped.inc_by(n);
    }

    /// Counts one answered request and how long it took, by method, route template and status.
    /// A method outside the known ones is counted as `OTHER`, so that made-up methods cannot
    /// add series.
    pub fn http(&self, method: &str, route: &str, status: u16, took: Duration) {
        let method = KNOWN_METHODS
            .iter()
            .find(|m| **m == method)
            .copied()
            .unwrap_or("OTHER");
        let labels = HttpLabels {
            method,
            route: route.to_owned(),
            status,
        };
        self.0.edge.http_requests.get_or_create(&labels).inc();
        self.0
            .edge
            .http_duration
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }

    /// Sets `idempotency_keys_unfinished` from `count` (the database's count, not yet run) when
    /// the last read is [`UNFINISHED_KEYS_REFRESH`] old or more at `now`; otherwise, or while
    /// another scrape is reading, leaves it as it is and never runs `count`. A failed read keeps
    /// the last value, and is not tried again before the interval has passed either.
    pub async fn refresh_unfinished_keys<E: std::fmt::Display>(
        &self,
        now: Instant,
        count: impl Future<Output = Result<i64, E>>,
    ) {
        // A scrape does not wait on another's read: it shows the value as it stands.
        let Ok(mut read_at) = self.0.upkeep.unfinished_read_at.try_lock() else {
            return;
        };
        if read_at.is_some_and(|at| now.saturating_duration_since(at) < UNFINISHED_KEYS_REFRESH) {
            return;
        }
        *read_at = Some(now);
        match count.await {
            Ok(unfinished) => {
                self.0.upkeep.unfinished_keys.set(unfinished);
            }
            Err(e) => tracing::warn!(error = %e, "metrics: cannot count unfinished keys"),
        }
    }

    /// The text exposition. This process's pool (connections, idle) is read first; the
    /// unfinished keys are as [`Metrics::refresh_unfinished_keys`] last set them.
    pub fn render(&self, pool: Option<(u32, usize)>) -> String {
        if let Some((size, idle)) = pool {
            let idle = idle as i64;
            let in_use = (i64::from(size) - idle).max(0);
            for (state, value) in [("in_use", in_use), ("idle", idle)] {
                self.0
                    .upkeep
                    .pool_connections
                    .get_or_create(&StateLabel { state })
                    .set(value);
            }
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        prometheus_client::encoding::text::encode(&mut out, &self.0.registry)
            .expect("encoding into a String");
        out
    }
}

/// The key store reports its claims and committed phases here
/// ([`idempotency::Store::with_observer`]): the service times none of them by hand.
impl idempotency::Observer for Metrics {
    fn claimed(&self, _route: &str, outcome: ClaimOutcome, took: Duration) {
        self.claim(outcome, took);
    }

    fn phase_committed(&self, point: &'static str, took: Duration) {
        self.phase(point, took);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn counters_and_histograms_render_in_the_text_format() {
        let metrics = Metrics::default();
        metrics.claim(ClaimOutcome::Acquired, Duration::from_millis(2));
        metrics.claim(ClaimOutcome::Replayed, Duration::from_millis(1));
        metrics.claim(ClaimOutcome::Replayed, Duration::from_millis(1));
        metrics.charge(ChargeOutcome::Unavailable);
        metrics.http("POST", "/rides", 201, Duration::from_millis(30));
        metrics.http("FOOBAR", "/rides", 405, Duration::from_millis(1));
        metrics.http("BAZ", "/rides", 405, Duration::from_millis(1));
        metrics.pool_max(20);
        let no_count = async { Err::<i64, _>("not read in this test") };
        metrics
            .refresh_unfinished_keys(Instant::now(), no_count)
            .await;
        let text = metrics.render(Some((10, 7)));
        for line in [
            "idempotency_claims_total{outcome=\"replayed\"} 2",
            "idempotency_claims_total{outcome=\"mismatch\"} 0",
            "gateway_charges_total{outcome=\"unavailable\"} 1",
            "http_requests_total{method=\"POST\",route=\"/rides\",status=\"201\"} 1",
            "http_requests_total{method=\"OTHER\",route=\"/rides\",status=\"405\"} 2",
            "http_request_duration_seconds_count{method=\"POST\",route=\"/rides\",status=\"201\"} 1",
            "idempotency_claim_duration_seconds_count 3",
            "idempotency_keys_unfinished 0",
            "db_pool_connections{state=\"in_use\"} 3",
            "db_pool_connections_max 20",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        assert!(!text.contains("FOOBAR"), "made-up methods are not labels");
    }

    #[tokio::test]
    async fn the_unfinished_keys_are_read_at_most_once_per_refresh_interval() {
        let metrics = Metrics::default();
        let reads = std::sync::atomic::AtomicUsize::new(0);
        // Counts its runs: a count that is not awaited never reads.
        let count = |n: i64| {
            let reads = &reads;
            async move {
                reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if n < 0 {
                    Err("the database does not answer")
                } else {
                    Ok(n)
                }
            }
        };
        let gauge = |metrics: &Metrics| {
            let text = metrics.render(None);
            let line = text
                .lines()
                .find(|l| l.starts_with("idempotency_keys_unfinished "))
                .map(str::to_owned);
            line.unwrap()
        };
        let start = Instant::now();
        let just_before = UNFINISHED_KEYS_REFRESH - Duration::from_millis(1);
        metrics.refresh_unfinished_keys(start, count(3)).await;
        assert_eq!(gauge(&metrics), "idempotency_keys_unfinished 3");
        metrics
            .refresh_unfinished_keys(start + just_before, count(7))
            .await;
        assert_eq!(gauge(&metrics), "idempotency_keys_unfinished 3");
        assert_eq!(reads.load(std::sync::atomic::Ordering::SeqCst), 1);
        let second = start + UNFINISHED_KEYS_REFRESH;
        metrics.refresh_unfinished_keys(second, count(7)).await;
        assert_eq!(gauge(&metrics), "idempotency_keys_unfinished 7");
        // A failed read keeps the last value and waits out the interval like any other.
        let third = second + UNFINISHED_KEYS_REFRESH;
        metrics.refresh_unfinished_keys(third, count(-1)).await;
        metrics
            .refresh_unfinished_keys(third + just_before, count(9))
            .await;
        assert_eq!(gauge(&metrics), "idempotency_keys_unfinished 7");
        assert_eq!(reads.load(std::sync::atomic::Ordering::SeqCst), 3);
    }
}
