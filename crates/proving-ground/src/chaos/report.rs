//! The run's report: what was sent, what was broken, what the auditor found.
//!
//! One [`Report`] value feeds three outputs: the plain-text table printed at the end
//! ([`Report::table`]), the JSON file ([`Report::write_json`]) and the HTML page
//! ([`super::html::render`]). [`Progress`] is the live counterpart on stderr while the run goes.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{self, IsTerminal, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// How many example violations an invariant keeps: enough to start debugging, few enough to read.
pub const MAX_EXAMPLES: usize = 5;

/// Everything a chaos run reports.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The seed every random choice of the run derives from.
    pub seed: u64,
    /// Requests the clients sent, each with its own idempotency key.
    pub requests: u64,
    /// Concurrent clients.
    pub concurrency: u32,
    /// API processes behind the client proxies.
    pub api_instances: u32,
    /// Safety mechanisms switched off on purpose (`--without …`), e.g. `["derived-key"]`: a
    /// negative control whose audit must fail.
    pub sabotage: Vec<String>,
    /// How the services reach their database: `postgres` (the run's own cluster), `failover`
    /// (with a synchronous standby promoted half-way), `patroni` or `pgbouncer` (transaction
    /// pooling in front of the run's own cluster).
    #[serde(default)]
    pub database: String,
    /// When the run started, RFC 3339.
    pub started_at: String,
    /// Wall time of the whole run, in seconds.
    pub duration_secs: f64,
    /// HTTP attempts the clients sent.
    pub attempts: u64,
    /// Attempts beyond the first of each request.
    pub retries: u64,
    /// Requests whose client gave up; the completer must finish them.
    pub gave_up: u64,
    /// Final outcome per request as its client saw it: `"201"`, `"402"`, `"gave_up"`, …
    pub outcomes: BTreeMap<String, u64>,
    /// Every response by status (`"201"`, `"409"`, `"503"`, …) plus `"transport_error"`.
    pub responses: BTreeMap<String, u64>,
    /// Injected faults by kind (`"kill_api"`, `"net_reset"`, `"pg_terminate"`, …).
    pub faults: BTreeMap<String, u64>,
    /// The auditor's checks, in the order they ran.
    pub invariants: Vec<InvariantResult>,
    /// Final outcomes per second of the client phase.
    pub throughput_rps: f64,
    /// Per request, from its first attempt to its final answer.
    pub latency_ms: Percentiles,
    /// One bucket per second since the start.
    pub timeline: Vec<TimelineBucket>,
    /// Whether every invariant held.
    pub passed: bool,
}

/// One named check of the auditor.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct InvariantResult {
    /// Short stable name, e.g. `one_charge_per_key`.
    pub name: String,
    /// What the check asserts, in a sentence.
    pub description: String,
    /// How many items (keys, rides, charges, responses) it examined.
    pub checked: u64,
    /// How many of them broke it.
    pub violations: u64,
    /// `violations == 0`.
    pub passed: bool,
    /// At most [`MAX_EXAMPLES`] offending items, described for a human.
    pub examples: Vec<String>,
}

impl InvariantResult {
    /// A result whose verdict follows from `violations`, keeping at most [`MAX_EXAMPLES`] examples.
    pub fn new(
        name: impl Into<String>,
        description: impl Into<String>,
        checked: u64,
        violations: u64,
        mut examples: Vec<String>,
    ) -> Self {
        examples.truncate(MAX_EXAMPLES);
        InvariantResult {
            name: name.into(),
            description: description.into(),
            checked,
            violations,
            passed: violations == 0,
            examples,
        }
    }
}

/// Latency percentiles, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Slowest sample.
    pub max: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles of `samples` (sorted in place); all zeros when there are none.
    pub fn from_millis(samples: &mut [f64]) -> Self {
        if samples.is_empty() {
            return Percentiles::default();
        }
        samples.sort_by(f64::total_cmp);
        let rank = |p: f64| {
            // Nearest rank: the smallest sample with at least p % of the samples at or below it.
            let rank = (p / 100.0 * samples.len() as f64).ceil() as usize;
            samples[rank.clamp(1, samples.len()) - 1]
        };
        Percentiles {
            p50: rank(50.0),
            p90: rank(90.0),
            p99: rank(99.0),
            max: samples[samples.len() - 1],
        }
    }
}

/// What happened during one second of the run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TimelineBucket {
    /// Seconds since the start of the run.
    pub second: u32,
    /// Responses received in this second, by status (same keys as [`Report::responses`]).
    pub responses: BTreeMap<String, u64>,
    /// Faults injected in this second, by kind (same keys as [`Report::faults`]).
    pub faults: BTreeMap<String, u64>,
}

/// Collects timestamped responses and faults into one-second [`TimelineBucket`]s.
#[derive(Debug, Clone)]
pub struct TimelineBuilder {
    start: Instant,
    buckets: Vec<TimelineBucket>,
}

impl TimelineBuilder {
    /// A timeline whose second 0 begins at `start`.
    pub fn new(start: Instant) -> Self {
        TimelineBuilder {
            start,
            buckets: Vec::new(),
        }
    }

    /// Counts a response (a status like `"201"`, or `"transport_error"`) received at `at`.
    pub fn response(&mut self, at: Instant, status: &str) {
        *self
            .bucket(at)
            .responses
            .entry(status.to_owned())
            .or_default() += 1;
    }

    /// Counts a fault of `kind` injected at `at`.
    pub fn fault(&mut self, at: Instant, kind: &str) {
        *self.bucket(at).faults.entry(kind.to_owned()).or_default() += 1;
    }

    /// The buckets from second 0 to the one holding `end`, empty seconds included, so that a
    /// chart shows quiet seconds as gaps rather than skipping them.
    pub fn finish(mut self, end: Instant) -> Vec<TimelineBucket> {
        self.bucket(end);
        self.buckets
    }

    fn bucket(&mut self, at: Instant) -> &mut TimelineBucket {
        // An event stamped before `start` (a clock read just before it) belongs to second 0.
        let second = at.saturating_duration_since(self.start).as_secs();
        let second = u32::try_from(second).unwrap_or(u32::MAX);
        while self.buckets.len() <= second as usize {
            let next = self.buckets.len() as u32;
            self.buckets.push(TimelineBucket {
                second: next,
                ..TimelineBucket::default()
            });
        }
        &mut self.buckets[second as usize]
    }
}

impl Report {
    /// The human summary printed at the end of a run, without colors.
    pub fn table(&self) -> String {
        self.render_table(false)
    }

    /// The human summary; with `color`, verdicts are green or red (ANSI escapes, for a terminal).
    pub fn render_table(&self, color: bool) -> String {
        let paint = |verdict: bool, text: &str| -> String {
            match (color, verdict) {
                (false, _) => text.to_owned(),
                (true, true) => format!("\x1b[1;32m{text}\x1b[0m"),
                (true, false) => format!("\x1b[1;31m{text}\x1b[0m"),
            }
        };
        let mut out = String::new();

        let sabotage = if self.sabotage.is_empty() {
            "none".to_owned()
        } else {
            format!(
                "without {} (negative control: the audit should fail)",
                self.sabotage.join(", ")
            )
        };
        section(&mut out, "Run");
        rows(
            &mut out,
            &[
                ("seed", self.seed.to_string()),
                ("started", self.started_at.clone()),
                ("duration", format!("{:.1} s", self.duration_secs)),
                ("concurrency", self.concurrency.to_string()),
                ("API instances", self.api_instances.to_string()),
                ("database", self.database.clone()),
                ("sabotage", sabotage),
            ],
        );

        section(&mut out, "Traffic");
        rows(
            &mut out,
            &[
                ("requests", self.requests.to_string()),
                ("attempts", self.attempts.to_string()),
                ("retries", self.retries.to_string()),
                ("gave up", self.gave_up.to_string()),
                (
                    "throughput",
                    format!("{:.1} requests/s", self.throughput_rps),
                ),
                (
                    "latency",
                    format!(
                        "p50 {:.1} ms   p90 {:.1} ms   p99 {:.1} ms   max {:.1} ms",
                        self.latency_ms.p50,
                        self.latency_ms.p90,
                        self.latency_ms.p99,
                        self.latency_ms.max
                    ),
                ),
            ],
        );

        section(&mut out, "Final outcomes (per request)");
        counts(&mut out, &self.outcomes, "status");
        section(&mut out, "Responses (every attempt)");
        counts(&mut out, &self.responses, "status");
        section(&mut out, "Faults injected");
        counts(&mut out, &self.faults, "fault");

        section(&mut out, "Invariants");
        let name_width = self
            .invariants
            .iter()
            .map(|i| i.name.chars().count())
            .chain(["invariant".len()])
            .max()
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "  {:<name_width$}  {:>10}  {:>10}  verdict",
            "invariant", "checked", "violations"
        );
        for inv in &self.invariants {
            let verdict = if inv.passed { "PASS" } else { "FAIL" };
            let _ = writeln!(
                out,
                "  {:<name_width$}  {:>10}  {:>10}  {}",
                inv.name,
                inv.checked,
                inv.violations,
                paint(inv.passed, verdict)
            );
            // A failure explains itself under its line; a pass needs no words.
            if !inv.passed {
                let _ = writeln!(out, "      {}", inv.description);
                for example in &inv.examples {
                    let _ = writeln!(out, "      e.g. {example}");
                }
            }
        }
        if self.invariants.is_empty() {
            let _ = writeln!(out, "  (no invariant was checked)");
        }

        let failed = self.invariants.iter().filter(|i| !i.passed).count();
        let verdict = if self.passed {
            paint(true, "PASSED")
        } else {
            paint(false, "FAILED")
        };
        let detail = if failed == 0 {
            format!("all {} invariants held", self.invariants.len())
        } else {
            format!("{failed} of {} invariants violated", self.invariants.len())
        };
        let _ = writeln!(out, "\n{verdict}: {detail}");
        out
    }

    /// Writes the report as pretty-printed JSON.
    pub fn write_json(&self, path: &Path) -> io::Result<()> {
        let mut json = serde_json::to_vec_pretty(self).map_err(io::Error::other)?;
        json.push(b'\n');
        std::fs::write(path, json)
    }
}

fn section(out: &mut String, title: &str) {
    if !out.is_empty() {
        out.push('\n');
    }
    let _ = writeln!(out, "{title}");
    let _ = writeln!(out, "{}", "─".repeat(title.chars().count()));
}

/// Label/value rows with the values aligned.
fn rows(out: &mut String, rows: &[(&str, String)]) {
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or_default();
    for (key, value) in rows {
        let _ = writeln!(out, "  {key:<width$}  {value}");
    }
}

/// A count table with the share of each key, largest first.
fn counts(out: &mut String, counts: &BTreeMap<String, u64>, what: &str) {
    if counts.is_empty() {
        let _ = writeln!(out, "  (none)");
        return;
    }
    let total: u64 = counts.values().sum();
    let mut sorted: Vec<_> = counts.iter().collect();
    // Largest first; ties in key order, so the table is stable.
    sorted.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    let width = sorted
        .iter()
        .map(|(k, _)| k.chars().count())
        .chain([what.len(), "total".len()])
        .max()
        .unwrap_or_default();
    let count_width = total.to_string().len().max("count".len());
    let _ = writeln!(out, "  {what:<width$}  {:>count_width$}   share", "count");
    for (key, count) in sorted {
        let share = 100.0 * *count as f64 / total.max(1) as f64;
        let _ = writeln!(out, "  {key:<width$}  {count:>count_width$}  {share:5.1} %");
    }
    let _ = writeln!(out, "  {:<width$}  {total:>count_width$}", "total");
}

/// Minimum time between two redraws of the progress line on a terminal.
const REDRAW_EVERY: Duration = Duration::from_millis(100);

/// Width of the bar, in characters, inside its brackets.
const BAR_WIDTH: usize = 30;

/// A progress line on stderr.
///
/// On a terminal it redraws one line in place (at most every [`REDRAW_EVERY`]); otherwise (a CI
/// log, a file) it prints a plain line at every tenth of the way, so that logs stay short.
pub struct Progress {
    total: u64,
    started: Instant,
    out: Box<dyn Write + Send>,
    terminal: bool,
    last_draw: Option<Instant>,
    /// Tenths already printed, when not on a terminal.
    tenths_printed: u64,
    last: (u64, String),
    finished: bool,
}

impl Progress {
    /// A progress line for `total` steps, on stderr.
    pub fn new(total: u64) -> Self {
        let terminal = io::stderr().is_terminal();
        Progress::to_writer(total, Box::new(io::stderr()), terminal)
    }

    fn to_writer(total: u64, out: Box<dyn Write + Send>, terminal: bool) -> Self {
        Progress {
            total,
            started: Instant::now(),
            out,
            terminal,
            last_draw: None,
            tenths_printed: 0,
            last: (0, String::new()),
            finished: false,
        }
    }

    /// Reports `done` steps; `extra` (e.g. `201:812 409:31 faults:17`) follows the count.
    pub fn set(&mut self, done: u64, extra: &str) {
        self.last = (done, extra.to_owned());
        let now = Instant::now();
        if self.terminal {
            let due = self
                .last_draw
                .is_none_or(|last| now.duration_since(last) >= REDRAW_EVERY);
            if due || done >= self.total {
                self.last_draw = Some(now);
                let line = self.line(done, extra);
                // Carriage return and clear-to-end-of-line: redraw in place.
                let _ = write!(self.out, "\r{line}\x1b[K");
                let _ = self.out.flush();
            }
        } else {
            let tenths = (done.min(self.total) * 10)
                .checked_div(self.total)
                .unwrap_or(10);
            if tenths > self.tenths_printed {
                self.tenths_printed = tenths;
                let line = self.line(done, extra);
                let _ = writeln!(self.out, "{line}");
            }
        }
    }

    /// Draws the last state for good and ends the line. Called again, it does nothing.
    pub fn finish(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let (done, extra) = std::mem::take(&mut self.last);
        let line = self.line(done, &extra);
        if self.terminal {
            let _ = writeln!(self.out, "\r{line}\x1b[K");
        } else if self.tenths_printed < 10 || self.total == 0 {
            let _ = writeln!(self.out, "{line}");
        }
        let _ = self.out.flush();
    }

    fn line(&self, done: u64, extra: &str) -> String {
        let fraction = if self.total == 0 {
            1.0
        } else {
            (done as f64 / self.total as f64).min(1.0)
        };
        let filled = (fraction * BAR_WIDTH as f64).round() as usize;
        let bar = format!("{}{}", "#".repeat(filled), ".".repeat(BAR_WIDTH - filled));
        let elapsed = self.started.elapsed().as_secs_f64();
        let mut line = format!(
            "[{bar}] {done}/{} {:3.0}% {elapsed:.0}s",
            self.total,
            fraction * 100.0
        );
        if !extra.is_empty() {
            line.push_str("  ");
            line.push_str(extra);
        }
        line
    }
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Progress")
            .field("total", &self.total)
            .field("terminal", &self.terminal)
            .field("done", &self.last.0)
            .finish_non_exhaustive()
    }
}

/// A realistic report for tests and for looking at the outputs.
#[cfg(test)]
pub(crate) fn sample_report() -> Report {
    let seconds = 60u32;
    let mut timeline = Vec::new();
    for s in 0..seconds {
        let ramp = (f64::from(s) / 5.0).min(1.0);
        let wave = 1.0 + 0.25 * (f64::from(s) / 4.0).sin();
        let base = (90.0 * ramp * wave) as u64;
        let mut responses = BTreeMap::new();
        responses.insert("201".to_owned(), base);
        responses.insert("402".to_owned(), base / 9);
        if s % 7 == 3 || s % 11 == 5 {
            responses.insert("409".to_owned(), 4 + u64::from(s % 5));
        }
        if s % 10 == 4 || s % 10 == 5 {
            responses.insert("503".to_owned(), 12 + u64::from(s % 3) * 4);
        }
        if s % 13 == 9 {
            responses.insert("500".to_owned(), 3);
        }
        if s % 9 == 2 {
            responses.insert("transport_error".to_owned(), 6);
        }
        if s % 17 == 8 {
            responses.insert("422".to_owned(), 1);
        }
        let mut faults = BTreeMap::new();
        let mut put = |kind: &str, n: u64| {
            if n > 0 {
                faults.insert(kind.to_owned(), n);
            }
        };
        put("kill_api", u64::from(s % 12 == 6));
        put("kill_worker", u64::from(s % 20 == 15));
        put("crash_after_ride_created", u64::from(s % 8 == 1));
        put("crash_after_charge", u64::from(s % 9 == 4));
        put("gateway_latency", u64::from(s % 3 == 0) * 2);
        put("gateway_fail_after", u64::from(s % 5 == 2));
        put("gateway_drop_after", u64::from(s % 6 == 5));
        put("net_reset", u64::from(s % 2) * 3);
        put("net_blackhole", u64::from(s % 4 == 1));
        put("pg_terminate", u64::from(s % 15 == 10) * 2);
        timeline.push(TimelineBucket {
            second: s,
            responses,
            faults,
        });
    }
    let mut responses = BTreeMap::new();
    let mut faults = BTreeMap::new();
    for bucket in &timeline {
        for (k, v) in &bucket.responses {
            *responses.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &bucket.faults {
            *faults.entry(k.clone()).or_default() += v;
        }
    }
    let outcomes = BTreeMap::from([
        ("201".to_owned(), 4311),
        ("402".to_owned(), 479),
        ("gave_up".to_owned(), 17),
    ]);
    let requests = outcomes.values().sum();
    let attempts: u64 = responses.values().sum();
    Report {
        seed: 20240611,
        requests,
        concurrency: 32,
        api_instances: 3,
        sabotage: vec!["derived-key".to_owned()],
        database: "postgres".to_owned(),
        started_at: "2025-06-11T09:30:00Z".to_owned(),
        duration_secs: 61.4,
        attempts,
        retries: attempts - requests,
        gave_up: 17,
        outcomes,
        responses,
        faults,
        invariants: vec![
            InvariantResult::new(
                "one_ride_per_key",
                "at most one ride per idempotency key",
                4807,
                0,
                vec![],
            ),
            InvariantResult::new(
                "one_charge_per_key",
                "at most one gateway charge per idempotency key",
                4807,
                3,
                vec![
                    "key 7f3a…: charges ch_1, ch_2".to_owned(),
                    "key <script>alert(1)</script> & co".to_owned(),
                ],
            ),
            InvariantResult::new(
                "acknowledged_rides_exist",
                "every 201 a client received matches a paid ride and a charge of the same amount",
                4311,
                0,
                vec![],
            ),
            InvariantResult::new(
                "no_charge_without_ride",
                "every gateway charge belongs to exactly one ride",
                4314,
                3,
                vec!["charge ch_2 (2000 cents) has no ride".to_owned()],
            ),
            InvariantResult::new(
                "replays_are_exact",
                "every replay equals the first answer a client saw for that key",
                1290,
                0,
                vec![],
            ),
            InvariantResult::new(
                "every_key_finished",
                "every key is finished after the completer's final pass",
                4807,
                0,
                vec![],
            ),
            InvariantResult::new(
                "one_receipt_per_ride",
                "one receipt per paid ride",
                4311,
                0,
                vec![],
            ),
        ],
        throughput_rps: 80.1,
        latency_ms: Percentiles {
            p50: 14.2,
            p90: 88.0,
            p99: 1210.5,
            max: 9870.0,
        },
        timeline,
        passed: false,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let mut samples: Vec<f64> = (1..=100).rev().map(f64::from).collect();

        let p = Percentiles::from_millis(&mut samples);

        assert_eq!(
            p,
            Percentiles {
                p50: 50.0,
                p90: 90.0,
                p99: 99.0,
                max: 100.0
            }
        );
    }

    #[test]
    fn percentiles_of_few_samples_pick_real_samples() {
        let p = Percentiles::from_millis(&mut [30.0, 10.0, 20.0]);

        assert_eq!((p.p50, p.p90, p.p99, p.max), (20.0, 30.0, 30.0, 30.0));
        assert_eq!(Percentiles::from_millis(&mut [7.5]).p50, 7.5);
    }

    #[test]
    fn percentiles_of_nothing_are_zero() {
        assert_eq!(Percentiles::from_millis(&mut []), Percentiles::default());
    }

    #[test]
    fn table_lists_every_invariant_with_its_verdict() {
        let report = sample_report();

        let table = report.table();

        for inv in &report.invariants {
            let line = table
                .lines()
                .find(|l| l.trim_start().starts_with(&format!("{} ", inv.name)))
                .unwrap_or_else(|| panic!("no line for {} in\n{table}", inv.name));
            let verdict = if inv.passed { "PASS" } else { "FAIL" };
            assert!(
                line.ends_with(verdict),
                "{line:?} should end with {verdict}"
            );
            assert!(line.contains(&inv.violations.to_string()));
        }
        assert!(table.contains("FAILED: 2 of 7 invariants violated"));
        assert!(table.contains("derived-key"));
        assert!(table.contains("net_reset"));
        assert!(!table.contains('\x1b'), "no colors unless asked for");
    }

    #[test]
    fn colored_table_paints_verdicts() {
        let table = sample_report().render_table(true);

        assert!(table.contains("\x1b[1;31mFAIL\x1b[0m"));
        assert!(table.contains("\x1b[1;32mPASS\x1b[0m"));
    }

    #[test]
    fn json_round_trips() {
        let report = sample_report();
        let path = std::env::temp_dir().join(format!(
            "chaos-report-round-trip-{}.json",
            std::process::id()
        ));

        report.write_json(&path).unwrap();
        let read: Report = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        std::fs::remove_file(&path).unwrap();

        assert_eq!(read, report);
    }

    #[test]
    fn invariant_keeps_at_most_five_examples_and_derives_its_verdict() {
        let examples = (0..8).map(|i| format!("key {i}")).collect();

        let inv = InvariantResult::new("x", "y", 10, 8, examples);

        assert_eq!(inv.examples.len(), MAX_EXAMPLES);
        assert!(!inv.passed);
        assert!(InvariantResult::new("x", "y", 10, 0, vec![]).passed);
    }

    #[test]
    fn timeline_buckets_by_second_and_fills_quiet_seconds() {
        let start = Instant::now();
        let mut builder = TimelineBuilder::new(start);

        builder.response(start + Duration::from_millis(300), "201");
        builder.response(start + Duration::from_millis(900), "201");
        builder.fault(start + Duration::from_millis(2500), "net_reset");
        let timeline = builder.finish(start + Duration::from_millis(3100));

        assert_eq!(timeline.len(), 4);
        assert_eq!(
            timeline.iter().map(|b| b.second).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        assert_eq!(timeline[0].responses["201"], 2);
        assert!(timeline[1].responses.is_empty());
        assert_eq!(timeline[2].faults["net_reset"], 1);
    }

    /// A writer the test can read back after handing it to [`Progress`].
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn progress_off_a_terminal_prints_one_line_per_tenth() {
        let captured = Captured::default();
        let mut progress = Progress::to_writer(1000, Box::new(captured.clone()), false);

        for done in 1..=1000 {
            progress.set(done, "201:1");
        }
        progress.finish();

        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<_> = text.lines().collect();
        assert_eq!(lines.len(), 10, "{text}");
        assert!(lines[0].contains("100/1000"));
        assert!(lines[9].starts_with(&format!("[{}] 1000/1000 100%", "#".repeat(BAR_WIDTH))));
        assert!(!text.contains('\r'));
    }

    #[test]
    fn progress_on_a_terminal_redraws_in_place() {
        let captured = Captured::default();
        let mut progress = Progress::to_writer(10, Box::new(captured.clone()), true);

        progress.set(5, "");
        progress.set(10, "");
        progress.finish();

        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        assert!(text.starts_with("\r[###############...............] 5/10"));
        assert_eq!(text.matches('\n').count(), 1, "{text:?}");
        assert!(text.ends_with("\x1b[K\n"));
    }
}
