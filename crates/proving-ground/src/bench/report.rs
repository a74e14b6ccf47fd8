//! The benchmark's report: one row per scenario and concurrency, the headline figures, the
//! ratios, and the checks; as a table on stdout and as `report.json`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

/// Latency percentiles, in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
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

/// A correctness check the benchmark makes on its own results.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub build: &'static str,
    pub passed: bool,
    pub detail: String,
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
    pub comparison: Vec<Comparison>,
    pub measurements: Vec<Measurement>,
    pub checks: Vec<Check>,
    pub passed: bool,
}

impl Report {
    /// The median round of one build's scenario at one concurrency, by requests per second.
    fn median(&self, build: &str, scenario: &str, concurrency: usize) -> Option<&Measurement> {
        let mut rounds: Vec<&Measurement> = self
            .measurements
            .iter()
            .filter(|m| m.build == build && m.scenario == scenario && m.concurrency == concurrency)
            .collect();
        rounds.sort_by(|a, b| a.requests_per_s.total_cmp(&b.requests_per_s));
        rounds.get(rounds.len().saturating_sub(1) / 2).copied()
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
            let concurrency = report
                .measurements
                .iter()
                .filter(|m| m.build == "current" && m.scenario == name)
                .map(|m| m.concurrency)
                .max()?;
            report.median("current", name, concurrency).cloned()
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
        self.passed = self.checks.iter().all(|c| c.passed);
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
            "{:<8} {:<9} {:>4} {:>8} {:>7} {:>7} {:>7} {:>8}  {:>6} {:>6} {:>8} {:>6} {:>5}  {:>6} {:>6} {:>6} {:>6}  answers",
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
                "{:<8} {:<9} {:>4} {:>8.0} {:>7.2} {:>7.2} {:>7.2} {:>8.1}  {:>6.2} {:>6.2} {:>8.0} {:>6.2} {:>5}  {:>6.2} {:>6.2} {:>6} {:>6.2}  {}",
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
                    "create / baseline at c{}: {:.0} / {:.0} req/s = {:.2}×",
                    r.concurrency,
                    r.create_requests_per_s,
                    r.baseline_requests_per_s,
                    r.create_vs_baseline
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

    pub fn write_json(&self, path: &Path) -> std::io::Result<()> {
        let mut json = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        json.push(b'\n');
        std::fs::write(path, json)
    }
}
