//! The benchmark's report: one row per scenario and concurrency, the headline figures, the
//! ratios, and the checks; as a table on stdout and as `report.json`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use super::preload::{AfterReap, KeyTable};

/// Latency percentiles, in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Latency {
    /// The percentiles of a histogram of microseconds.
    pub(crate) fn of(histogram: &hdrhistogram::Histogram<u64>) -> Self {
        let ms = |micros: u64| micros as f64 / 1000.0;
        Self {
            p50: ms(histogram.value_at_quantile(0.50)),
            p90: ms(histogram.value_at_quantile(0.90)),
            p99: ms(histogram.value_at_quantile(0.99)),
            max: ms(histogram.max()),
        }
    }
}

/// CPU time per request, in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct CpuPerRequest {
    pub service: f64,
    pub gateway: f64,
    /// The benchmark's own clients.
    pub clients: f64,
    /// `null` when PostgreSQL's processes are not visible from the benchmark.
    pub postgres: Option<f64>,
}

/// One scenario at one concurrency, on one build, in one round.
#[derive(Debug, Clone, Serialize)]
pub struct Measurement {
    /// `current`, or `compared` (the build given with `--compare-service-bin`).
    pub build: &'static str,
    pub round: u16,
    pub scenario: &'static str,
    pub concurrency: usize,
    /// Requests answered after the warm-up.
    pub requests: u64,
    pub requests_per_s: f64,
    pub latency_ms: Latency,
    /// Answers after the warm-up by status (`"201 replayed"` apart).
    pub answers: BTreeMap<String, u64>,
    /// Every request sent in the stack's life, the warm-up's included: the per-request database
    /// and CPU figures divide by it.
    pub requests_sent: u64,
    /// Transactions (reads included) on the service's database.
    pub transactions_per_request: f64,
    /// Rows inserted, updated and deleted in the service's database.
    pub rows_written_per_request: f64,
    /// WAL of the whole server: the service's database and, when the scenario charges, the
    /// gateway's.
    pub wal_bytes_per_request: f64,
    /// Transactions on the gateway's database.
    pub gateway_transactions_per_request: f64,
    /// Updates of `idempotency_keys`, and the share of them that were HOT.
    pub key_updates: i64,
    pub key_hot_share: Option<f64>,
    pub cpu_ms_per_request: CpuPerRequest,
}

/// The ratio of the idempotent create to the baseline at one concurrency.
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    pub concurrency: usize,
    pub create_requests_per_s: f64,
    pub baseline_requests_per_s: f64,
    pub create_vs_baseline: f64,
    /// WAL bytes per create over WAL bytes per baseline booking.
    pub create_wal_bytes_per_request: f64,
    pub baseline_wal_bytes_per_request: f64,
    pub wal_vs_baseline: f64,
    /// PostgreSQL's CPU per create over its CPU per baseline booking; `null` when PostgreSQL's
    /// processes are not visible from the benchmark.
    pub postgres_cpu_vs_baseline: Option<f64>,
}

/// A scenario behind the transaction pooler against the same scenario straight to PostgreSQL,
/// at one concurrency (medians of the current build).
#[derive(Debug, Clone, Serialize)]
pub struct PoolerRatio {
    /// `create` or `replay`.
    pub scenario: &'static str,
    pub concurrency: usize,
    pub direct_requests_per_s: f64,
    pub pooled_requests_per_s: f64,
    /// pooled / direct, in requests per second.
    pub pooled_vs_direct: f64,
    pub direct_p99_ms: f64,
    pub pooled_p99_ms: f64,
}

/// The current build against the compared one, for one scenario and concurrency (medians).
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub scenario: &'static str,
    pub concurrency: usize,
    pub current_requests_per_s: f64,
    pub compared_requests_per_s: f64,
    /// current / compared.
    pub speedup: f64,
    pub current_p99_ms: f64,
    pub compared_p99_ms: f64,
    pub current_transactions_per_request: f64,
    pub compared_transactions_per_request: f64,
    pub current_wal_bytes_per_request: f64,
    pub compared_wal_bytes_per_request: f64,
}

/// One build's key table grown by `--preload-keys` finished bookings, and what it costs.
#[derive(Debug, Clone, Serialize)]
pub struct LargeTable {
    pub build: &'static str,
    /// Preloaded keys counted in the table after the load.
    pub preloaded_keys: i64,
    /// Seconds the load and its `ANALYZE` took.
    pub preload_s: f64,
    /// The key table before the load (what the other scenarios left) and after it.
    pub empty: KeyTable,
    pub large: KeyTable,
    /// `create_large / create` and `replay_large / replay` at every concurrency both ran at.
    pub ratios: Vec<LargeRatio>,
    /// The key table once the reaper deleted every finished key, the run's last act.
    pub after_reap: Option<AfterReap>,
}

/// A scenario on the preloaded tables against the same scenario earlier in the run (medians).
#[derive(Debug, Clone, Serialize)]
pub struct LargeRatio {
    /// `create` or `replay`.
    pub scenario: &'static str,
    pub concurrency: usize,
    pub empty_requests_per_s: f64,
    pub large_requests_per_s: f64,
    /// large / empty, in requests per second (the goal: at least 0.9).
    pub large_vs_empty: f64,
    pub empty_p99_ms: f64,
    pub large_p99_ms: f64,
}

/// A correctness check the benchmark makes on its own results.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub build: &'static str,
    pub passed: bool,
    pub detail: String,
}

/// The answers of one open-loop measurement, arrivals after the warm-up only.
#[derive(Debug, Clone, Serialize)]
pub struct OpenLoop {
    pub build: &'static str,
    /// The multiple of the capacity offered, and the capacity it multiplies (requests per
    /// second of `create` at the run's highest concurrency, or `--open-rate`).
    pub load: f64,
    pub capacity_requests_per_s: f64,
    pub offered_requests_per_s: f64,
    /// Arrivals in the measured time, counted as they arrive: each one is counted below exactly
    /// once (created, shed, timed out, other, or dropped by the client).
    pub arrivals: u64,
    pub created: u64,
    pub created_per_s: f64,
    /// 503 answers, and their share of the arrivals.
    pub shed: u64,
    pub shed_share: f64,
    /// 503 answers without a `Retry-After` header.
    pub shed_without_retry_after: u64,
    /// Requests the client gave up on after `timeout_s`.
    pub timeouts: u64,
    pub timeout_s: f64,
    /// Arrivals not sent because `max_outstanding` requests were already waiting.
    pub client_dropped: u64,
    pub max_outstanding: usize,
    /// Any other answer by status (`"transport"`: no answer at all).
    pub other: BTreeMap<String, u64>,
    /// Of the 201s and of the 503s, from each request's intended start.
    pub created_latency_ms: Latency,
    pub shed_latency_ms: Option<Latency>,
    /// The 201s' p99 over the p99 at the build's lowest load (the goal: at most 3 at 2×).
    pub created_p99_vs_lowest_load: Option<f64>,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub run: String,
    pub service_version: String,
    /// The build measured side by side, if any.
    pub compared_version: Option<String>,
    pub cpus: usize,
    pub duration_s: f64,
    pub warmup_s: f64,
    /// Runs of each measurement per build; the summaries take the median.
    pub rounds: usize,
    pub users: usize,
    /// Headlines of the current build: each scenario at the highest concurrency it ran (the
    /// median round).
    pub create: Option<Measurement>,
    pub replay: Option<Measurement>,
    pub storm: Option<Measurement>,
    pub baseline: Option<Measurement>,
    pub ratios: Vec<Ratio>,
    /// `create_pooled / create` and `replay_pooled / replay` at every concurrency both ran at.
    pub pooler: Vec<PoolerRatio>,
    pub comparison: Vec<Comparison>,
    /// `open`: one entry per build and load, in the order they ran.
    pub open_loop: Vec<OpenLoop>,
    /// `create_large`, `replay_large`: one entry per build.
    pub large_tables: Vec<LargeTable>,
    pub measurements: Vec<Measurement>,
    pub checks: Vec<Check>,
    pub passed: bool,
}

/// The median round of one build's scenario at one concurrency, by requests per second.
fn median<'a>(
    measurements: &'a [Measurement],
    build: &str,
    scenario: &str,
    concurrency: usize,
) -> Option<&'a Measurement> {
    let mut rounds: Vec<&Measurement> = measurements
        .iter()
        .filter(|m| m.build == build && m.scenario == scenario && m.concurrency == concurrency)
        .collect();
    rounds.sort_by(|a, b| a.requests_per_s.total_cmp(&b.requests_per_s));
    rounds.get(rounds.len().saturating_sub(1) / 2).copied()
}

/// The median round of one build's scenario at the highest concurrency it ran at.
pub(crate) fn highest_median<'a>(
    measurements: &'a [Measurement],
    build: &str,
    scenario: &str,
) -> Option<&'a Measurement> {
    let concurrency = measurements
        .iter()
        .filter(|m| m.build == build && m.scenario == scenario)
        .map(|m| m.concurrency)
        .max()?;
    median(measurements, build, scenario, concurrency)
}

impl Report {
    /// The median round of one build's scenario at one concurrency, by requests per second.
    fn median(&self, build: &str, scenario: &str, concurrency: usize) -> Option<&Measurement> {
        median(&self.measurements, build, scenario, concurrency)
    }

    /// The (scenario, concurrency) pairs measured, in the order they ran.
    fn cells(&self) -> Vec<(&'static str, usize)> {
        let mut cells = Vec::new();
        for m in &self.measurements {
            if !cells.contains(&(m.scenario, m.concurrency)) {
                cells.push((m.scenario, m.concurrency));
            }
        }
        cells
    }

    /// Fills in the headlines, ratios and comparisons from the measurements.
    pub(crate) fn summarize(&mut self) {
        let highest = |report: &Self, name: &str| {
            highest_median(&report.measurements, "current", name).cloned()
        };
        self.create = highest(self, "create");
        self.replay = highest(self, "replay");
        self.storm = highest(self, "storm");
        self.baseline = highest(self, "baseline");
        let cells = self.cells();
        self.ratios = cells
            .iter()
            .filter(|(scenario, _)| *scenario == "create")
            .filter_map(|&(_, c)| {
                let create = self.median("current", "create", c)?;
                let baseline = self.median("current", "baseline", c)?;
                Some(Ratio {
                    concurrency: c,
                    create_requests_per_s: create.requests_per_s,
                    baseline_requests_per_s: baseline.requests_per_s,
                    create_vs_baseline: create.requests_per_s / baseline.requests_per_s,
                    create_wal_bytes_per_request: create.wal_bytes_per_request,
                    baseline_wal_bytes_per_request: baseline.wal_bytes_per_request,
                    wal_vs_baseline: create.wal_bytes_per_request / baseline.wal_bytes_per_request,
                    postgres_cpu_vs_baseline: create
                        .cpu_ms_per_request
                        .postgres
                        .zip(baseline.cpu_ms_per_request.postgres)
                        .map(|(c, b)| c / b),
                })
            })
            .collect();
        self.pooler = cells
            .iter()
            .filter_map(|&(scenario, c)| {
                let direct_name = match scenario {
                    "create_pooled" => "create",
                    "replay_pooled" => "replay",
                    _ => return None,
                };
                let pooled = self.median("current", scenario, c)?;
                let direct = self.median("current", direct_name, c)?;
                Some(PoolerRatio {
                    scenario: direct_name,
                    concurrency: c,
                    direct_requests_per_s: direct.requests_per_s,
                    pooled_requests_per_s: pooled.requests_per_s,
                    pooled_vs_direct: pooled.requests_per_s / direct.requests_per_s,
                    direct_p99_ms: direct.latency_ms.p99,
                    pooled_p99_ms: pooled.latency_ms.p99,
                })
            })
            .collect();
        self.comparison = cells
            .iter()
            .filter_map(|&(scenario, c)| {
                let current = self.median("current", scenario, c)?;
                let compared = self.median("compared", scenario, c)?;
                Some(Comparison {
                    scenario,
                    concurrency: c,
                    current_requests_per_s: current.requests_per_s,
                    compared_requests_per_s: compared.requests_per_s,
                    speedup: current.requests_per_s / compared.requests_per_s,
                    current_p99_ms: current.latency_ms.p99,
                    compared_p99_ms: compared.latency_ms.p99,
                    current_transactions_per_request: current.transactions_per_request,
                    compared_transactions_per_request: compared.transactions_per_request,
                    current_wal_bytes_per_request: current.wal_bytes_per_request,
                    compared_wal_bytes_per_request: compared.wal_bytes_per_request,
                })
            })
            .collect();
        self.summarize_open_loop();
        self.summarize_large_tables();
        self.passed = self.checks.iter().all(|c| c.passed);
    }

    /// Each open-loop load's 201 p99 against the one at its build's lowest load.
    fn summarize_open_loop(&mut self) {
        let lowest: Vec<(&'static str, f64)> = self
            .open_loop
            .iter()
            .map(|o| {
                let lowest = self
                    .open_loop
                    .iter()
                    .filter(|l| l.build == o.build && l.created > 0)
                    .min_by(|a, b| a.load.total_cmp(&b.load))
                    .map_or(f64::NAN, |l| l.created_latency_ms.p99);
                (o.build, lowest)
            })
            .collect();
        for (o, (_, lowest)) in self.open_loop.iter_mut().zip(lowest) {
            o.created_p99_vs_lowest_load =
                (o.created > 0 && lowest > 0.0).then(|| o.created_latency_ms.p99 / lowest);
        }
    }

    /// Each large scenario against its twin on the table the other scenarios left.
    fn summarize_large_tables(&mut self) {
        let cells = self.cells();
        for table in &mut self.large_tables {
            table.ratios = cells
                .iter()
                .filter_map(|&(scenario, c)| {
                    let empty_name = match scenario {
                        "create_large" => "create",
                        "replay_large" => "replay",
                        _ => return None,
                    };
                    let large = median(&self.measurements, table.build, scenario, c)?;
                    let empty = median(&self.measurements, table.build, empty_name, c)?;
                    Some(LargeRatio {
                        scenario: empty_name,
                        concurrency: c,
                        empty_requests_per_s: empty.requests_per_s,
                        large_requests_per_s: large.requests_per_s,
                        large_vs_empty: large.requests_per_s / empty.requests_per_s,
                        empty_p99_ms: empty.latency_ms.p99,
                        large_p99_ms: large.latency_ms.p99,
                    })
                })
                .collect();
        }
    }

    /// The table for a terminal.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "run {} · {} · {} CPUs · {:.0} s per measurement after {:.0} s of warm-up · {} round(s)",
            self.run, self.service_version, self.cpus, self.duration_s, self.warmup_s, self.rounds
        );
        if let Some(compared) = &self.compared_version {
            let _ = writeln!(out, "compared with: {compared}");
        }
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "{:<8} {:<13} {:>4} {:>8} {:>7} {:>7} {:>7} {:>8}  {:>6} {:>6} {:>8} {:>6} {:>5}  {:>6} {:>6} {:>6} {:>6}  answers",
            "build", "scenario", "conc", "req/s", "p50 ms", "p90 ms", "p99 ms", "max ms",
            "tx/req", "rows", "WAL B", "gw tx", "HOT%", "svc ms", "gw ms", "pg ms", "cli ms"
        );
        for m in &self.measurements {
            let hot = m
                .key_hot_share
                .map_or("-".to_owned(), |s| format!("{:.0}", s * 100.0));
            let pg = m
                .cpu_ms_per_request
                .postgres
                .map_or("-".to_owned(), |ms| format!("{ms:.2}"));
            let answers: Vec<String> = m.answers.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            let _ = writeln!(
                out,
                "{:<8} {:<13} {:>4} {:>8.0} {:>7.2} {:>7.2} {:>7.2} {:>8.1}  {:>6.2} {:>6.2} {:>8.0} {:>6.2} {:>5}  {:>6.2} {:>6.2} {:>6} {:>6.2}  {}",
                m.build,
                m.scenario,
                m.concurrency,
                m.requests_per_s,
                m.latency_ms.p50,
                m.latency_ms.p90,
                m.latency_ms.p99,
                m.latency_ms.max,
                m.transactions_per_request,
                m.rows_written_per_request,
                m.wal_bytes_per_request,
                m.gateway_transactions_per_request,
                hot,
                m.cpu_ms_per_request.service,
                m.cpu_ms_per_request.gateway,
                pg,
                m.cpu_ms_per_request.clients,
                answers.join(", ")
            );
        }
        if !self.ratios.is_empty() {
            let _ = writeln!(out);
            for r in &self.ratios {
                let _ = writeln!(
                    out,
                    "create / baseline at c{}: {:.0} / {:.0} req/s = {:.2}×; WAL {:.0} / {:.0} \
                     bytes per request = {:.2}×",
                    r.concurrency,
                    r.create_requests_per_s,
                    r.baseline_requests_per_s,
                    r.create_vs_baseline,
                    r.create_wal_bytes_per_request,
                    r.baseline_wal_bytes_per_request,
                    r.wal_vs_baseline
                );
            }
        }
        if !self.pooler.is_empty() {
            let _ = writeln!(out);
            for r in &self.pooler {
                let _ = writeln!(
                    out,
                    "{}_pooled / {} at c{}: {:.0} / {:.0} req/s = {:.2}× (p99 {:.1} vs {:.1} ms)",
                    r.scenario,
                    r.scenario,
                    r.concurrency,
                    r.pooled_requests_per_s,
                    r.direct_requests_per_s,
                    r.pooled_vs_direct,
                    r.pooled_p99_ms,
                    r.direct_p99_ms
                );
            }
        }
        if !self.comparison.is_empty() {
            let _ = writeln!(out);
            for c in &self.comparison {
                let _ = writeln!(
                    out,
                    "{} at c{}: current {:.0} req/s, compared {:.0} req/s = {:.2}× \
                     (p99 {:.1} vs {:.1} ms, {:.2} vs {:.2} tx, {:.0} vs {:.0} WAL B per request)",
                    c.scenario,
                    c.concurrency,
                    c.current_requests_per_s,
                    c.compared_requests_per_s,
                    c.speedup,
                    c.current_p99_ms,
                    c.compared_p99_ms,
                    c.current_transactions_per_request,
                    c.compared_transactions_per_request,
                    c.current_wal_bytes_per_request,
                    c.compared_wal_bytes_per_request
                );
            }
        }
        self.open_loop_lines(&mut out);
        self.large_table_lines(&mut out);
        let _ = writeln!(out);
        for check in &self.checks {
            let verdict = if check.passed { "ok  " } else { "FAIL" };
            let _ = writeln!(
                out,
                "{verdict} {} ({} build): {}",
                check.name, check.build, check.detail
            );
        }
        out
    }

    fn open_loop_lines(&self, out: &mut String) {
        if self.open_loop.is_empty() {
            return;
        }
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "{:<8} {:>5} {:>8} {:>8} {:>6} {:>8} {:>8} {:>8} {:>7} {:>8} {:>8} {:>6} {:>5} {:>5}  other",
            "open", "load", "offered", "201/s", "shed%", "201 p50", "201 p99", "201 max",
            "p99/low", "503 p50", "503 p99", "no RA", "t/o", "drop"
        );
        for o in &self.open_loop {
            let shed = o.shed_latency_ms.as_ref();
            let shed_ms =
                |f: fn(&Latency) -> f64| shed.map_or("-".to_owned(), |l| format!("{:.1}", f(l)));
            let other: Vec<String> = o.other.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            let _ = writeln!(
                out,
                "{:<8} {:>4.1}× {:>8.0} {:>8.0} {:>6.1} {:>8.1} {:>8.1} {:>8.1} {:>7} {:>8} {:>8} {:>6} {:>5} {:>5}  {}",
                o.build,
                o.load,
                o.offered_requests_per_s,
                o.created_per_s,
                o.shed_share * 100.0,
                o.created_latency_ms.p50,
                o.created_latency_ms.p99,
                o.created_latency_ms.max,
                o.created_p99_vs_lowest_load
                    .map_or("-".to_owned(), |r| format!("{r:.2}×")),
                shed_ms(|l| l.p50),
                shed_ms(|l| l.p99),
                o.shed_without_retry_after,
                o.timeouts,
                o.client_dropped,
                other.join(", ")
            );
        }
    }

    fn large_table_lines(&self, out: &mut String) {
        for t in &self.large_tables {
            let _ = writeln!(out);
            let depth = |table: &KeyTable| -> String {
                table
                    .indexes
                    .iter()
                    .map(|i| {
                        let level = i.btree_level.map_or("?".to_owned(), |l| l.to_string());
                        format!("{} {:.1} MB level {level}", i.name, i.bytes as f64 / 1e6)
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            for (name, table) in [("before", &t.empty), ("after", &t.large)] {
                let _ = writeln!(
                    out,
                    "key table {name} the preload ({} build): {} rows, heap {:.1} MB, total {:.1} MB; {}",
                    t.build,
                    table.rows,
                    table.heap_bytes as f64 / 1e6,
                    table.total_bytes as f64 / 1e6,
                    depth(table)
                );
            }
            if let Some(reap) = &t.after_reap {
                let _ = writeln!(
                    out,
                    "after reaping {} keys in {:.1} s, before vacuum: {} dead rows, heap {:.1} MB, total {:.1} MB",
                    reap.reaped,
                    reap.reap_s,
                    reap.dead_tuples,
                    reap.table.heap_bytes as f64 / 1e6,
                    reap.table.total_bytes as f64 / 1e6
                );
            }
            for r in &t.ratios {
                let _ = writeln!(
                    out,
                    "{}_large / {} at c{} ({} keys preloaded in {:.1} s): {:.0} / {:.0} req/s = {:.2}× (p99 {:.1} vs {:.1} ms)",
                    r.scenario,
                    r.scenario,
                    r.concurrency,
                    t.preloaded_keys,
                    t.preload_s,
                    r.large_requests_per_s,
                    r.empty_requests_per_s,
                    r.large_vs_empty,
                    r.large_p99_ms,
                    r.empty_p99_ms
                );
            }
        }
    }

    pub fn write_json(&self, path: &Path) -> std::io::Result<()> {
        let mut json = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        json.push(b'\n');
        std::fs::write(path, json)
    }
}

/// One check per build that ran a pooled scenario: every `create_pooled` request answered
/// `201` (a booking of its own), every `replay_pooled` request `201 replayed`, none lost. A
/// service that misreads the pooler (named statements, or an unnamed one split across server
/// connections) answers 500s here, or worse, another request's answer.
pub(crate) fn pooled_answers_checks(measurements: &[Measurement]) -> Vec<Check> {
    let mut builds: Vec<&'static str> = Vec::new();
    for m in measurements {
        if m.scenario.ends_with("_pooled") && !builds.contains(&m.build) {
            builds.push(m.build);
        }
    }
    builds
        .into_iter()
        .map(|build| {
            let mut problems = Vec::new();
            let mut answered = 0;
            for m in measurements
                .iter()
                .filter(|m| m.build == build && m.scenario.ends_with("_pooled"))
            {
                let expected = if m.scenario == "create_pooled" {
                    "201"
                } else {
                    "201 replayed"
                };
                let wrong: Vec<String> = m
                    .answers
                    .iter()
                    .filter(|(label, _)| label.as_str() != expected)
                    .map(|(label, n)| format!("{n} × {label}"))
                    .collect();
                if m.requests == 0 {
                    problems.push(format!("{} at c{}: no answer", m.scenario, m.concurrency));
                } else if !wrong.is_empty() {
                    problems.push(format!(
                        "{} at c{}: {} besides {expected}",
                        m.scenario,
                        m.concurrency,
                        wrong.join(", ")
                    ));
                }
                answered += m.requests;
            }
            Check {
                name: "pooled_answers",
                build,
                passed: problems.is_empty(),
                detail: if problems.is_empty() {
                    format!(
                        "{answered} requests through PgBouncer in transaction pooling: every \
                         create a 201 of its own, every replay a replayed 201"
                    )
                } else {
                    problems.join("; ")
                },
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measurement(scenario: &'static str, answers: &[(&str, u64)]) -> Measurement {
        Measurement {
            build: "current",
            round: 1,
            scenario,
            concurrency: 2,
            requests: answers.iter().map(|(_, n)| n).sum(),
            requests_per_s: 100.0,
            latency_ms: Latency {
                p50: 1.0,
                p90: 1.0,
                p99: 1.0,
                max: 1.0,
            },
            answers: answers.iter().map(|(k, n)| ((*k).to_owned(), *n)).collect(),
            requests_sent: 1,
            transactions_per_request: 0.0,
            rows_written_per_request: 0.0,
            wal_bytes_per_request: 0.0,
            gateway_transactions_per_request: 0.0,
            key_updates: 0,
            key_hot_share: None,
            cpu_ms_per_request: CpuPerRequest {
                service: 0.0,
                gateway: 0.0,
                clients: 0.0,
                postgres: None,
            },
        }
    }

    #[test]
    fn pooled_answers_fail_on_a_500_a_fresh_booking_in_a_replay_or_no_answer() {
        let good = [
            measurement("create", &[("500", 3)]),
            measurement("create_pooled", &[("201", 10)]),
            measurement("replay_pooled", &[("201 replayed", 10)]),
        ];
        let checks = pooled_answers_checks(&good);
        assert_eq!(checks.len(), 1);
        assert!(checks[0].passed, "{}", checks[0].detail);
        for bad in [
            measurement("create_pooled", &[("201", 10), ("500", 1)]),
            measurement("replay_pooled", &[("201 replayed", 10), ("201", 1)]),
            measurement("create_pooled", &[]),
            measurement("replay_pooled", &[("transport", 1)]),
        ] {
            let checks = pooled_answers_checks(&[good[1].clone(), bad.clone()]);
            assert!(!checks[0].passed, "{:?} passed", bad.answers);
        }
        assert!(pooled_answers_checks(&good[..1]).is_empty());
    }

    fn report_of(measurements: Vec<Measurement>) -> Report {
        Report {
            run: String::new(),
            service_version: String::new(),
            compared_version: None,
            cpus: 1,
            duration_s: 1.0,
            warmup_s: 1.0,
            rounds: 1,
            users: 1,
            create: None,
            replay: None,
            storm: None,
            baseline: None,
            ratios: Vec::new(),
            pooler: Vec::new(),
            comparison: Vec::new(),
            open_loop: Vec::new(),
            large_tables: Vec::new(),
            measurements,
            checks: Vec::new(),
            passed: false,
        }
    }

    #[test]
    fn the_baseline_ratios_divide_the_creates_rate_wal_and_postgres_cpu_by_the_baselines() {
        let mut create = measurement("create", &[("201", 1)]);
        create.requests_per_s = 300.0;
        create.wal_bytes_per_request = 6_000.0;
        create.cpu_ms_per_request.postgres = Some(1.5);
        let mut baseline = measurement("baseline", &[("201", 1)]);
        baseline.requests_per_s = 400.0;
        baseline.wal_bytes_per_request = 2_400.0;
        let mut report = report_of(vec![create.clone(), baseline.clone()]);
        report.summarize();
        let ratio = &report.ratios[0];
        assert!((ratio.create_vs_baseline - 0.75).abs() < 1e-9);
        assert!((ratio.wal_vs_baseline - 2.5).abs() < 1e-9);
        assert_eq!(ratio.postgres_cpu_vs_baseline, None, "no baseline CPU seen");
        assert!(report
            .table()
            .contains("create / baseline at c2: 300 / 400 req/s = 0.75×; WAL 6000 / 2400"));

        baseline.cpu_ms_per_request.postgres = Some(0.5);
        let mut report = report_of(vec![create, baseline]);
        report.summarize();
        let cpu = report.ratios[0].postgres_cpu_vs_baseline.unwrap();
        assert!((cpu - 3.0).abs() < 1e-9, "{cpu}");
    }

    #[test]
    fn the_pooler_ratios_pair_each_pooled_scenario_with_its_direct_twin() {
        let mut create = measurement("create", &[("201", 1)]);
        create.requests_per_s = 200.0;
        let mut pooled = measurement("create_pooled", &[("201", 1)]);
        pooled.requests_per_s = 150.0;
        let mut report = report_of(vec![create, pooled, measurement("replay_pooled", &[])]);
        report.summarize();
        assert_eq!(
            report.pooler.len(),
            1,
            "replay_pooled has no direct twin here"
        );
        assert_eq!(report.pooler[0].scenario, "create");
        assert!((report.pooler[0].pooled_vs_direct - 0.75).abs() < 1e-9);
        assert!(report
            .table()
            .contains("create_pooled / create at c2: 150 / 200 req/s = 0.75×"));
    }
}
