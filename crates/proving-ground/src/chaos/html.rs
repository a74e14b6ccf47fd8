//! The run's report as one self-contained HTML page.
//!
//! The page must open from a CI artifact or an e-mail attachment, offline and years later: no
//! external resource of any kind (no CDN, font, script or image link), inline CSS, and charts as
//! inline SVG drawn here. Inline SVG in HTML5 needs no `xmlns`, so the page holds no URL at all.
//! Every string from the report goes through [`escape`], since examples quote what the run saw.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io;
use std::path::Path;

use super::report::{Report, TimelineBucket};

/// Renders `report` as a complete HTML document.
pub fn render(report: &Report) -> String {
    let mut out = String::with_capacity(64 * 1024);
    let verdict = if report.passed { "PASSED" } else { "FAILED" };
    let class = if report.passed { "pass" } else { "fail" };
    let held = report.invariants.iter().filter(|i| i.passed).count();

    out.push_str("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n");
    out.push_str("<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n");
    let _ = writeln!(
        out,
        "<title>Chaos run {verdict} · seed {}</title>",
        report.seed
    );
    let _ = writeln!(out, "<style>{CSS}</style>\n</head>\n<body>\n<main>");

    // Header: the verdict first, since it is what a reader came for.
    let _ = writeln!(
        out,
        "<header class=\"verdict {class}\"><div class=\"badge\">{verdict}</div><div>\
         <h1>Rocket Rides chaos run</h1><p>{held} of {} invariants held · seed {} · started {} · \
         {:.1} s</p></div></header>",
        report.invariants.len(),
        report.seed,
        escape(&report.started_at),
        report.duration_secs
    );
    if !report.sabotage.is_empty() {
        let _ = writeln!(
            out,
            "<p class=\"note\"><strong>Negative control.</strong> This run switched off {}: \
             the audit is expected to fail, which shows that it can.</p>",
            report
                .sabotage
                .iter()
                .map(|s| format!("<code>{}</code>", escape(s)))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }

    cards(&mut out, report);

    invariants_table(&mut out, report);

    let statuses = ordered_statuses(report);
    out.push_str("<h2 id=\"responses-chart\">Responses per second</h2>\n");
    chart(
        &mut out,
        &report.timeline,
        |b| &b.responses,
        &statuses,
        "responses / s",
        "no responses recorded",
    );
    let kinds = ordered_faults(report);
    // Kinds that never reach the timeline (latency and delay, which touch nearly every call)
    // are counted in the table below, not charted, where they would bury the discrete faults.
    let charted: Vec<(String, &'static str)> = kinds
        .iter()
        .filter(|(kind, _)| report.timeline.iter().any(|b| b.faults.contains_key(kind)))
        .cloned()
        .collect();
    out.push_str("<h2 id=\"faults-chart\">Faults injected per second</h2>\n");
    let uncharted: Vec<&str> = kinds
        .iter()
        .filter(|k| !charted.contains(k))
        .map(|(kind, _)| kind.as_str())
        .collect();
    if !uncharted.is_empty() {
        let _ = writeln!(
            out,
            "<p class=\"note\">Not charted (they touch nearly every call; see the table): {}</p>",
            escape(&uncharted.join(", "))
        );
    }
    chart(
        &mut out,
        &report.timeline,
        |b| &b.faults,
        &charted,
        "faults / s",
        "no faults injected",
    );

    out.push_str("<div class=\"tables\">\n<section>");
    let outcomes = order_by(&report.outcomes, status_rank);
    counts_table(
        &mut out,
        "Final outcomes",
        "per request",
        "outcome",
        &report.outcomes,
        &colored(&outcomes, status_color),
    );
    out.push_str("</section>\n<section>");
    counts_table(
        &mut out,
        "Responses",
        "every attempt",
        "status",
        &report.responses,
        &statuses,
    );
    out.push_str("</section>\n<section>");
    counts_table(
        &mut out,
        "Faults",
        "by type",
        "fault",
        &report.faults,
        &kinds,
    );
    out.push_str("</section>\n<section>");
    latency_table(&mut out, report);
    out.push_str("</section>\n</div>\n");

    out.push_str(
        "<footer>Written by <code>chaos</code> (Rocket Rides' proving ground). This page is self-contained: it loads \
         nothing from anywhere.</footer>\n</main>\n</body>\n</html>\n",
    );
    out
}

/// The run's settings and its summary, as cards.
fn cards(out: &mut String, report: &Report) {
    out.push_str("<h2>Run</h2>\n<div class=\"cards\">");
    let sabotage = if report.sabotage.is_empty() {
        "none".to_owned()
    } else {
        escape(&report.sabotage.join(", "))
    };
    for (label, value) in [
        ("seed", report.seed.to_string()),
        ("requests", group(report.requests)),
        ("concurrency", report.concurrency.to_string()),
        ("API instances", report.api_instances.to_string()),
        ("database", escape(&report.database)),
        ("duration", format!("{:.1} s", report.duration_secs)),
        ("sabotage", sabotage),
    ] {
        card(out, label, &value);
    }
    out.push_str("</div>\n");

    out.push_str("<h2>Summary</h2>\n<div class=\"cards\">");
    for (label, value) in [
        ("attempts", group(report.attempts)),
        ("retries", group(report.retries)),
        ("gave up", group(report.gave_up)),
        ("faults injected", group(report.faults.values().sum())),
        ("throughput", format!("{:.1} req/s", report.throughput_rps)),
        ("latency p50", millis(report.latency_ms.p50)),
        ("latency p99", millis(report.latency_ms.p99)),
    ] {
        card(out, label, &value);
    }
    out.push_str("</div>\n");
}

/// Writes [`render`]'s page to `path`.
pub fn write(report: &Report, path: &Path) -> io::Result<()> {
    std::fs::write(path, render(report))
}

/// Escapes text for HTML content and for quoted attribute values alike.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// An integer with thin spaces between thousands, which read well in any locale.
fn group(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3 * 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push('\u{202f}');
        }
        out.push(c);
    }
    out
}

fn millis(ms: f64) -> String {
    if ms >= 10_000.0 {
        format!("{:.1} s", ms / 1000.0)
    } else if ms >= 100.0 {
        format!("{ms:.0} ms")
    } else {
        format!("{ms:.1} ms")
    }
}

/// `value` must already be escaped.
fn card(out: &mut String, label: &str, value: &str) {
    // A long value (the sabotage list, a big number) takes two columns rather than breaking.
    let class = if value.chars().count() > 10 {
        "card wide"
    } else {
        "card"
    };
    let _ = write!(
        out,
        "<div class=\"{class}\"><div class=\"label\">{}</div><div class=\"value\">{value}</div></div>",
        escape(label)
    );
}

fn invariants_table(out: &mut String, report: &Report) {
    out.push_str("<h2>Invariants</h2>\n");
    if report.invariants.is_empty() {
        out.push_str("<p class=\"empty\">No invariant was checked.</p>\n");
        return;
    }
    out.push_str(
        "<table class=\"invariants\"><thead><tr><th>invariant</th><th>what it asserts</th>\
         <th class=\"num\">checked</th><th class=\"num\">violations</th><th>verdict</th>\
         <th>examples</th></tr></thead><tbody>\n",
    );
    for inv in &report.invariants {
        let (class, verdict) = if inv.passed {
            ("pass", "PASS")
        } else {
            ("fail", "FAIL")
        };
        let _ = write!(
            out,
            "<tr class=\"{class}\"><td><code class=\"name\">{}</code></td><td>{}</td><td class=\"num\">{}</td>\
             <td class=\"num\">{}</td><td><span class=\"pill {class}\">{verdict}</span></td><td>",
            escape(&inv.name),
            escape(&inv.description),
            group(inv.checked),
            group(inv.violations),
        );
        if !inv.examples.is_empty() {
            out.push_str("<ul class=\"examples\">");
            for example in &inv.examples {
                let _ = write!(out, "<li><code>{}</code></li>", escape(example));
            }
            out.push_str("</ul>");
        }
        out.push_str("</td></tr>\n");
    }
    out.push_str("</tbody></table>\n");
}

/// A count table with a color swatch per key matching the charts, largest first.
fn counts_table(
    out: &mut String,
    title: &str,
    subtitle: &str,
    what: &str,
    counts: &BTreeMap<String, u64>,
    colors: &[(String, &'static str)],
) {
    let _ = writeln!(
        out,
        "<h2>{} <small>{}</small></h2>",
        escape(title),
        escape(subtitle)
    );
    if counts.is_empty() {
        out.push_str("<p class=\"empty\">None.</p>\n");
        return;
    }
    let total: u64 = counts.values().sum();
    let mut sorted: Vec<_> = counts.iter().collect();
    sorted.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    let _ = write!(
        out,
        "<table><thead><tr><th>{}</th><th class=\"num\">count</th><th class=\"num\">share</th>\
         </tr></thead><tbody>",
        escape(what)
    );
    for (key, count) in sorted {
        let color = colors
            .iter()
            .find(|(k, _)| k == key)
            .map_or(OTHER_COLORS[0], |(_, c)| c);
        let _ = write!(
            out,
            "<tr><td><span class=\"swatch\" style=\"background:{color}\"></span>{}</td>\
             <td class=\"num\">{}</td><td class=\"num\">{:.1} %</td></tr>",
            escape(key),
            group(*count),
            100.0 * *count as f64 / total as f64
        );
    }
    let _ = writeln!(
        out,
        "<tr class=\"total\"><td>total</td><td class=\"num\">{}</td><td></td></tr></tbody></table>",
        group(total)
    );
}

fn latency_table(out: &mut String, report: &Report) {
    let p = &report.latency_ms;
    out.push_str(
        "<h2>Latency <small>first attempt to final answer</small></h2>\n<table><thead><tr>\
         <th>percentile</th><th class=\"num\">milliseconds</th></tr></thead><tbody>",
    );
    for (name, value) in [
        ("p50", p.p50),
        ("p90", p.p90),
        ("p99", p.p99),
        ("max", p.max),
    ] {
        let _ = write!(
            out,
            "<tr><td>{name}</td><td class=\"num\">{value:.1}</td></tr>"
        );
    }
    out.push_str("</tbody></table>\n");
}

/// Greys for keys without a color of their own (other statuses, unknown fault kinds).
const OTHER_COLORS: [&str; 4] = ["#8c959f", "#b8c0c8", "#6e7781", "#d0d7de"];

/// The stacking order of statuses, bottom first: successes, then answers the client acts on,
/// then errors on top where they stand out.
fn status_rank(status: &str) -> (u8, &str) {
    let rank = match status {
        "201" => 0,
        "402" => 1,
        "409" => 2,
        "503" => 3,
        "500" => 4,
        "transport_error" => 5,
        "gave_up" => 6,
        _ => 7,
    };
    (rank, status)
}

/// 201 green, 402 amber, 409 blue, 503 orange, 500 and transport errors red, the rest grey.
fn status_color(status: &str, nth_other: usize) -> &'static str {
    match status {
        "201" => "#2f9e44",
        "402" => "#f2b705",
        "409" => "#3b7dd8",
        "503" => "#f76707",
        "500" => "#e03131",
        "transport_error" => "#9c1c1c",
        "gave_up" => "#495057",
        s if s.starts_with('5') => "#ff8787",
        _ => OTHER_COLORS[nth_other % OTHER_COLORS.len()],
    }
}

/// Fault kinds grouped by where they strike, in the order the run's design lists them: processes,
/// crash points, gateway, network, database.
fn fault_rank(kind: &str) -> (u8, &str) {
    let rank = match kind {
        "kill_api" => 0,
        "kill_worker" => 1,
        k if k.starts_with("crash_") => 2,
        "gateway_latency" => 3,
        "gateway_fail_before" => 4,
        "gateway_fail_after" => 5,
        "gateway_drop_after" => 6,
        "gateway_conflict" => 7,
        k if k.starts_with("gateway_") => 8,
        "net_delay" => 9,
        "net_reset" => 10,
        "net_blackhole" => 11,
        "pg_terminate" => 12,
        _ => 13,
    };
    (rank, kind)
}

/// One hue family per place a fault strikes, so the chart reads by family first: purples for
/// killed processes, pinks for crash points, oranges and browns for the gateway, blues for the
/// network, teal for the database.
fn fault_color(kind: &str, nth_other: usize) -> &'static str {
    const CRASH: [&str; 4] = ["#d6336c", "#f783ac", "#a61e4d", "#e599f7"];
    match kind {
        "kill_api" => "#6741d9",
        "kill_worker" => "#9775fa",
        "gateway_latency" => "#ffd43b",
        "gateway_fail_before" => "#ffa94d",
        "gateway_fail_after" => "#e8590c",
        "gateway_drop_after" => "#a0522d",
        "gateway_conflict" => "#c9a227",
        "net_delay" => "#74c0fc",
        "net_reset" => "#1c7ed6",
        "net_blackhole" => "#343a40",
        "pg_terminate" => "#0ca678",
        k if k.starts_with("crash_") => CRASH[nth_other % CRASH.len()],
        _ => OTHER_COLORS[nth_other % OTHER_COLORS.len()],
    }
}

/// The keys of `counts`, sorted by `rank`.
fn order_by(counts: &BTreeMap<String, u64>, rank: fn(&str) -> (u8, &str)) -> Vec<&str> {
    let mut keys: Vec<&str> = counts.keys().map(String::as_str).collect();
    keys.sort_by(|a, b| rank(a).cmp(&rank(b)));
    keys
}

/// Assigns colors in order; `nth_other` counts keys that share a family, so that neighbours in a
/// family get different shades.
fn colored(keys: &[&str], color: fn(&str, usize) -> &'static str) -> Vec<(String, &'static str)> {
    let mut previous_family: Option<&'static str> = None;
    let mut nth = 0;
    let mut out = Vec::with_capacity(keys.len());
    for key in keys {
        let first = color(key, 0);
        // Keys whose first shade equals the previous key's first shade are in the same family.
        if previous_family == Some(first) {
            nth += 1;
        } else {
            nth = 0;
        }
        previous_family = Some(first);
        out.push(((*key).to_owned(), color(key, nth)));
    }
    out
}

/// Every status seen in totals or in the timeline, in stacking order, with its color.
fn ordered_statuses(report: &Report) -> Vec<(String, &'static str)> {
    let mut all = report.responses.clone();
    for bucket in &report.timeline {
        for key in bucket.responses.keys() {
            all.entry(key.clone()).or_default();
        }
    }
    colored(&order_by(&all, status_rank), status_color)
}

/// Every fault kind seen in totals or in the timeline, in stacking order, with its color.
fn ordered_faults(report: &Report) -> Vec<(String, &'static str)> {
    let mut all = report.faults.clone();
    for bucket in &report.timeline {
        for key in bucket.faults.keys() {
            all.entry(key.clone()).or_default();
        }
    }
    colored(&order_by(&all, fault_rank), fault_color)
}

// Chart geometry, in SVG user units; the SVG scales to the page width.
const CHART_WIDTH: f64 = 1100.0;
const CHART_HEIGHT: f64 = 300.0;
const MARGIN_LEFT: f64 = 64.0;
const MARGIN_RIGHT: f64 = 30.0;
const MARGIN_TOP: f64 = 12.0;
const MARGIN_BOTTOM: f64 = 56.0;

/// A stacked bar chart, one bar per second, with a legend, axes, tick labels and grid lines.
/// Each bar carries a `<title>`, which browsers show as a tooltip.
fn chart(
    out: &mut String,
    timeline: &[TimelineBucket],
    pick: fn(&TimelineBucket) -> &BTreeMap<String, u64>,
    series: &[(String, &'static str)],
    y_title: &str,
    empty: &str,
) {
    out.push_str("<figure class=\"chart\">\n<div class=\"legend\">");
    for (key, color) in series {
        let total: u64 = timeline.iter().filter_map(|b| pick(b).get(key)).sum();
        let _ = write!(
            out,
            "<span><span class=\"swatch\" style=\"background:{color}\"></span>{} \
             <span class=\"muted\">{}</span></span>",
            escape(key),
            group(total)
        );
    }
    out.push_str("</div>\n");

    let plot_w = CHART_WIDTH - MARGIN_LEFT - MARGIN_RIGHT;
    let plot_h = CHART_HEIGHT - MARGIN_TOP - MARGIN_BOTTOM;
    let bottom = MARGIN_TOP + plot_h;
    let totals: Vec<u64> = timeline
        .iter()
        .map(|b| series.iter().filter_map(|(k, _)| pick(b).get(k)).sum())
        .collect();
    let max = totals.iter().copied().max().unwrap_or(0);
    let (y_step, y_top) = nice_axis(max);
    let y = |value: u64| bottom - plot_h * value as f64 / y_top as f64;

    let _ = writeln!(
        out,
        "<svg viewBox=\"0 0 {CHART_WIDTH} {CHART_HEIGHT}\" role=\"img\" aria-label=\"{}\">",
        escape(y_title)
    );

    // Horizontal grid lines and y tick labels.
    let mut tick = 0;
    while tick <= y_top {
        let ty = y(tick);
        let _ = writeln!(
            out,
            "<line x1=\"{MARGIN_LEFT}\" x2=\"{:.1}\" y1=\"{ty:.1}\" y2=\"{ty:.1}\" class=\"grid\"/>\
             <text x=\"{:.1}\" y=\"{ty:.1}\" class=\"ytick\">{}</text>",
            MARGIN_LEFT + plot_w,
            MARGIN_LEFT - 8.0,
            group(tick)
        );
        tick += y_step;
    }
    let _ = writeln!(
        out,
        "<text class=\"axis-title\" transform=\"translate(16 {:.1}) rotate(-90)\">{}</text>",
        MARGIN_TOP + plot_h / 2.0,
        escape(y_title)
    );

    // Bars: one per second, stacked in series order from the bottom.
    let n = timeline.len();
    let slot = plot_w / n.max(1) as f64;
    let gap = if slot >= 4.0 { slot * 0.2 } else { 0.0 };
    for (i, bucket) in timeline.iter().enumerate() {
        let counts = pick(bucket);
        if totals[i] == 0 {
            continue;
        }
        let mut tooltip = format!("second {}:", bucket.second);
        for (key, _) in series {
            if let Some(count) = counts.get(key) {
                let _ = write!(tooltip, " {} {count},", escape(key));
            }
        }
        tooltip.pop();
        let _ = write!(out, "<g><title>{tooltip}</title>");
        let x = MARGIN_LEFT + i as f64 * slot + gap / 2.0;
        let mut stacked = 0;
        for (key, color) in series {
            let Some(&count) = counts.get(key) else {
                continue;
            };
            if count == 0 {
                continue;
            }
            let (top, base) = (y(stacked + count), y(stacked));
            let _ = write!(
                out,
                "<rect x=\"{x:.2}\" y=\"{top:.2}\" width=\"{:.2}\" height=\"{:.2}\" fill=\"{color}\"/>",
                slot - gap,
                base - top
            );
            stacked += count;
        }
        out.push_str("</g>\n");
    }

    // X axis, tick marks and labels, on top of the bars.
    let _ = writeln!(
        out,
        "<line x1=\"{MARGIN_LEFT}\" x2=\"{:.1}\" y1=\"{bottom:.1}\" y2=\"{bottom:.1}\" class=\"axis\"/>\
         <line x1=\"{MARGIN_LEFT}\" x2=\"{MARGIN_LEFT}\" y1=\"{MARGIN_TOP}\" y2=\"{bottom:.1}\" class=\"axis\"/>",
        MARGIN_LEFT + plot_w
    );
    let x_step = time_step(n);
    let mut second = 0;
    while second <= n {
        let tx = MARGIN_LEFT + second as f64 * slot;
        let _ = writeln!(
            out,
            "<line x1=\"{tx:.1}\" x2=\"{tx:.1}\" y1=\"{bottom:.1}\" y2=\"{:.1}\" class=\"axis\"/>\
             <text x=\"{tx:.1}\" y=\"{:.1}\" class=\"xtick\">{}</text>",
            bottom + 5.0,
            bottom + 9.0,
            time_label(second)
        );
        second += x_step;
    }
    let _ = writeln!(
        out,
        "<text x=\"{:.1}\" y=\"{:.1}\" class=\"axis-title\">time since start</text>",
        MARGIN_LEFT + plot_w / 2.0,
        CHART_HEIGHT - 8.0
    );
    if max == 0 {
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\" class=\"empty-chart\">{}</text>",
            MARGIN_LEFT + plot_w / 2.0,
            MARGIN_TOP + plot_h / 2.0,
            escape(empty)
        );
    }
    out.push_str("</svg>\n</figure>\n");
}

/// A y axis for counts up to `max`: a step of 1, 2 or 5 times a power of ten giving at most six
/// intervals, and the top of the axis, a multiple of the step. An empty chart gets `0..=1`.
fn nice_axis(max: u64) -> (u64, u64) {
    if max == 0 {
        return (1, 1);
    }
    let mut magnitude = 1u64;
    loop {
        for factor in [1, 2, 5] {
            let step = factor * magnitude;
            if max.div_ceil(step) <= 6 {
                return (step, max.div_ceil(step) * step);
            }
        }
        magnitude *= 10;
    }
}

/// Seconds between x tick labels, so that at most about twelve labels fit.
fn time_step(seconds: usize) -> usize {
    const STEPS: [usize; 12] = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600];
    STEPS
        .into_iter()
        .find(|step| seconds / step <= 12)
        .unwrap_or(7200)
}

fn time_label(second: usize) -> String {
    match second {
        s if s >= 60 && s % 60 == 0 => format!("{} min", s / 60),
        s if s >= 60 => format!("{}:{:02}", s / 60, s % 60),
        s => format!("{s} s"),
    }
}

const CSS: &str = r#"
:root { --pass:#2f9e44; --fail:#d62828; --ink:#1f2328; --muted:#59636e; --line:#d1d9e0; --soft:#f6f8fa; }
* { box-sizing: border-box; }
body { margin: 0; color: var(--ink); background: #fff;
  font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 28px 40px; }
header.verdict { display: flex; align-items: center; gap: 22px; padding: 18px 24px; border-radius: 10px; color: #fff; }
header.pass { background: var(--pass); }
header.fail { background: var(--fail); }
.badge { font-size: 30px; font-weight: 800; letter-spacing: .06em; padding: 4px 16px;
  border: 3px solid rgba(255,255,255,.9); border-radius: 8px; }
header h1 { margin: 0; font-size: 24px; }
header p { margin: 2px 0 0; opacity: .95; }
h2 { font-size: 18px; margin: 28px 0 10px; padding-bottom: 6px; border-bottom: 1px solid var(--line); }
h2 small { font-size: 13px; font-weight: 400; color: var(--muted); margin-left: 6px; }
.note { margin: 14px 0 0; padding: 10px 14px; border-left: 4px solid #f08c00; background: #fff4e6; border-radius: 4px; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(150px, 1fr)); gap: 10px; }
.card.wide { grid-column: span 2; }
.card { background: var(--soft); border: 1px solid var(--line); border-radius: 8px; padding: 8px 14px; }
.label { font-size: 12px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted); }
.value { font-size: 20px; font-weight: 650; font-variant-numeric: tabular-nums; overflow-wrap: anywhere; }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
th, td { text-align: left; padding: 6px 10px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { font-size: 12px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted); background: var(--soft); }
.num { text-align: right; white-space: nowrap; }
tr.fail td { background: #fff5f5; }
tr.total td { font-weight: 650; }
.pill { display: inline-block; padding: 1px 10px; border-radius: 999px; font-weight: 700; font-size: 13px; color: #fff; }
.pill.pass { background: var(--pass); }
.pill.fail { background: var(--fail); }
code { font: 13px/1.4 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; background: #eef1f4;
  padding: 1px 4px; border-radius: 4px; overflow-wrap: anywhere; }
code.name { white-space: nowrap; overflow-wrap: normal; }
ul.examples { margin: 0; padding-left: 18px; }
.chart { margin: 0; border: 1px solid var(--line); border-radius: 8px; padding: 12px 14px 4px; }
.chart svg { display: block; width: 100%; height: auto; }
.legend { display: flex; flex-wrap: wrap; gap: 6px 18px; margin: 0 0 6px; font-size: 13px; }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 2px; margin-right: 6px; vertical-align: -1px; }
.muted { color: var(--muted); }
.empty { color: var(--muted); font-style: italic; }
.tables { display: grid; grid-template-columns: repeat(2, minmax(0, 1fr)); gap: 0 32px; }
svg text { font-family: system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif; font-size: 13px; fill: var(--muted); }
svg .grid { stroke: #e6eaef; stroke-width: 1; }
svg .axis { stroke: #8c959f; stroke-width: 1; }
svg .ytick { text-anchor: end; dominant-baseline: middle; }
svg .xtick { text-anchor: middle; dominant-baseline: hanging; }
svg .axis-title { text-anchor: middle; font-size: 13px; fill: var(--ink); }
svg .empty-chart { text-anchor: middle; font-size: 16px; font-style: italic; }
svg rect { shape-rendering: crispEdges; }
footer { margin-top: 32px; color: var(--muted); font-size: 13px; }
@media (max-width: 760px) { .tables { grid-template-columns: 1fr; } }
"#;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::report::sample_report;

    #[test]
    fn sample_report_renders_charts_and_tables() {
        let report = sample_report();

        let html = render(&report);

        assert!(html.starts_with("<!DOCTYPE html>"));
        assert_eq!(html.matches("<svg").count(), 2);
        assert!(html.contains("FAILED"));
        for inv in &report.invariants {
            assert!(html.contains(&format!(">{}</code>", inv.name)));
        }
        for kind in report.faults.keys() {
            assert!(html.contains(kind.as_str()), "fault {kind} missing");
        }
    }

    #[test]
    fn strings_from_the_report_are_escaped() {
        let mut report = sample_report();
        report.sabotage = vec!["<b>x</b>".to_owned()];

        let html = render(&report);

        assert!(!html.contains("<script>"));
        assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt; &amp; co"));
        assert!(!html.contains("<b>x</b>"));
    }

    #[test]
    fn page_loads_nothing_from_anywhere() {
        let html = render(&sample_report());

        assert!(!html.contains("http://"));
        assert!(!html.contains("https://"));
        assert!(!html.contains("<script"));
        assert!(!html.contains("<link"));
        assert!(!html.contains("url("));
    }

    #[test]
    fn empty_report_renders() {
        let html = render(&Report {
            passed: true,
            ..Report::default()
        });

        assert!(html.contains("PASSED"));
        assert!(html.contains("no faults injected"));
    }

    #[test]
    fn axes_are_round_numbers() {
        assert_eq!(nice_axis(0), (1, 1));
        assert_eq!(nice_axis(3), (1, 3));
        assert_eq!(nice_axis(7), (2, 8));
        assert_eq!(nice_axis(97), (20, 100));
        assert_eq!(nice_axis(101), (20, 120));
        assert_eq!(time_step(60), 5);
        assert_eq!(time_step(600), 60);
        assert_eq!(group(1_234_567), "1\u{202f}234\u{202f}567");
        assert_eq!(group(999), "999");
    }

    /// Writes the sample report's page for a look in a browser:
    /// `cargo test -p rocket-rides --features chaos --lib chaos::html -- --ignored`.
    #[test]
    #[ignore = "writes a file to look at, checks nothing"]
    fn write_sample_page() {
        let path = std::env::temp_dir().join("chaos-sample.html");
        write(&sample_report(), &path).unwrap();
        let mut passed = sample_report();
        passed.sabotage.clear();
        passed.passed = true;
        for inv in &mut passed.invariants {
            inv.violations = 0;
            inv.passed = true;
            inv.examples.clear();
        }
        write(
            &passed,
            &std::env::temp_dir().join("chaos-sample-passed.html"),
        )
        .unwrap();
        // A long run: thin bars and minute ticks.
        let mut long = sample_report();
        let base = long.timeline.clone();
        for round in 1..7u32 {
            long.timeline.extend(base.iter().map(|b| TimelineBucket {
                second: b.second + round * 60,
                ..b.clone()
            }));
        }
        write(&long, &std::env::temp_dir().join("chaos-sample-long.html")).unwrap();
        std::fs::write(
            std::env::temp_dir().join("chaos-sample.txt"),
            sample_report().table(),
        )
        .unwrap();
        eprintln!("wrote {}", path.display());
    }
}
