//! The benchmark, run briefly against the debug builds: it must run, and the work it counts per
//! request is the design's, whatever the speed, straight to PostgreSQL and behind a PgBouncer in
//! transaction pooling alike. Nothing here looks at a rate or a latency.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// Runs `bench` for a second after a second's warm-up, with `args`, reporting into
/// `report_dir`.
fn bench(args: &[&str], report_dir: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_bench"))
        .args(["--duration", "1s", "--warmup", "1s"])
        .args(args)
        .arg("--report-dir")
        .arg(report_dir)
        .env("RUST_LOG", "error")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run bench")
}

fn run_bench(report_dir: &Path) -> Value {
    let output = bench(
        &[
            "--concurrency",
            "2",
            "--scenario",
            "create,replay,create_pooled,replay_pooled,storm",
            "--users",
            "2",
        ],
        report_dir,
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!("{stderr}");
    assert!(output.status.success(), "bench failed: {}", output.status);
    // The run's PgBouncer is stopped at its end: nothing listens on its port any more.
    let pooler = stderr
        .lines()
        .find_map(|line| line.strip_prefix("bench: PgBouncer in transaction pooling at "))
        .expect("the run started a PgBouncer");
    let port = pooler
        .rsplit_once(':')
        .and_then(|(_, rest)| rest.split('/').next())
        .expect("a port in the pooler's URL");
    assert!(
        std::net::TcpStream::connect(format!("127.0.0.1:{port}")).is_err(),
        "the PgBouncer at {pooler} still listens after the run"
    );
    let run = std::fs::read_dir(report_dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| path.join("report.json").exists())
        .expect("the run wrote a report");
    serde_json::from_slice(&std::fs::read(run.join("report.json")).unwrap()).unwrap()
}

#[test]
fn a_booking_takes_three_transactions_a_replay_one_read_and_key_updates_are_hot() {
    assert!(
        std::env::var("DATABASE_URL").is_ok(),
        "DATABASE_URL names the test server"
    );
    let dir = std::env::temp_dir().join(format!("bench-smoke-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let report = run_bench(&dir);

    assert_eq!(report["passed"], true, "{:#}", report["checks"]);
    let create = &report["create"];
    assert!(create["requests"].as_u64().unwrap() > 0);
    assert_eq!(
        create["answers"]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        ["201"]
    );
    // Counted by PostgreSQL on the service's own database over every request of the run: the
    // read of the key, the claim with the ride, the final phase; the API key is looked up once
    // per user and --api-key-cache-ttl, not per request. (A little above 3 where autovacuum or
    // autoanalyze run in the database meanwhile, or a user's first request looks its key up.)
    let per_create = create["transactions_per_request"].as_f64().unwrap();
    assert!(
        (2.95..=3.2).contains(&per_create),
        "{per_create} transactions per booking"
    );
    assert_eq!(
        create["gateway_transactions_per_request"]
            .as_f64()
            .unwrap()
            .round(),
        1.0
    );
    let hot = create["key_hot_share"].as_f64().unwrap();
    assert!(hot >= 0.8, "{hot} of key-row updates were HOT");

    let replay = &report["replay"];
    let per_replay = replay["transactions_per_request"].as_f64().unwrap();
    assert!(
        (0.95..=1.1).contains(&per_replay),
        "{per_replay} transactions per replay"
    );
    // The database's own count includes catalog writes of an autoanalyze, if one ran; the key
    // table's count is the replays' alone.
    let rows = replay["rows_written_per_request"].as_f64().unwrap();
    assert!(rows < 0.01, "{rows} rows written per replay");
    assert_eq!(
        replay["key_updates"].as_i64().unwrap(),
        0,
        "a replay updated its key"
    );

    assert_eq!(report["storm"]["concurrency"], 64);

    // Behind PgBouncer in transaction pooling: the same answers and the same work per request.
    let measurement = |scenario: &str| {
        report["measurements"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["scenario"] == scenario)
            .unwrap_or_else(|| panic!("no {scenario} measurement"))
            .clone()
    };
    let answers = |m: &Value| {
        m["answers"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect::<Vec<_>>()
    };
    let create_pooled = measurement("create_pooled");
    assert!(create_pooled["requests"].as_u64().unwrap() > 0);
    assert_eq!(answers(&create_pooled), ["201"]);
    let per_create = create_pooled["transactions_per_request"].as_f64().unwrap();
    assert!(
        (2.95..=3.2).contains(&per_create),
        "{per_create} transactions per booking through the pooler"
    );
    let replay_pooled = measurement("replay_pooled");
    assert!(replay_pooled["requests"].as_u64().unwrap() > 0);
    assert_eq!(answers(&replay_pooled), ["201 replayed"]);
    assert_eq!(replay_pooled["key_updates"].as_i64().unwrap(), 0);
    let checks = report["checks"].as_array().unwrap();
    assert!(
        checks
            .iter()
            .any(|c| c["name"] == "pooled_answers" && c["passed"] == true),
        "{checks:#?}"
    );
    let pooler: Vec<(&str, u64)> = report["pooler"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            assert!(r["pooled_vs_direct"].as_f64().unwrap() > 0.0, "{r}");
            (
                r["scenario"].as_str().unwrap(),
                r["concurrency"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(pooler, [("create", 2), ("replay", 2)]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run that names the pooled scenarios and cannot start its PgBouncer fails, saying so, before
/// it measures anything (no report).
#[test]
fn a_pooled_run_without_pgbouncer_fails_with_a_clear_message() {
    let dir = std::env::temp_dir().join(format!("bench-no-pooler-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let output = bench(
        &[
            "--concurrency",
            "1",
            "--scenario",
            "create,create_pooled",
            "--users",
            "1",
            "--pgbouncer-script",
            "/bin/false",
        ],
        &dir,
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "bench passed without a PgBouncer");
    assert!(
        stderr.contains("could not start a PgBouncer") && stderr.contains("create_pooled"),
        "{stderr}"
    );
    let reports = walk(&dir)
        .into_iter()
        .filter(|p| p.ends_with("report.json"))
        .count();
    assert_eq!(reports, 0, "a report was written");
    let _ = std::fs::remove_dir_all(&dir);
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flat_map(|e| {
            let path = e.unwrap().path();
            if path.is_dir() {
                walk(&path)
            } else {
                vec![path]
            }
        })
        .collect()
}

/// The open loop at two low rates and the large tables at 10,000 preloaded bookings: every
/// arrival is accounted for exactly once, the money check covers the open loop's bookings and
/// leaves out the preloaded copies, and the table holds the keys asked for.
#[test]
fn the_open_loop_accounts_for_every_arrival_and_the_preload_loads_what_was_asked() {
    let dir = std::env::temp_dir().join(format!("bench-open-large-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let output = bench(
        &[
            "--concurrency",
            "2",
            "--scenario",
            "create,replay,open,create_large,replay_large",
            "--users",
            "2",
            "--open-rate",
            "20",
            "--open-load",
            "0.5,2",
            "--preload-keys",
            "10000",
            "--reap",
        ],
        &dir,
    );
    eprintln!("{}", String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "bench failed: {}", output.status);
    let report_path = walk(&dir)
        .into_iter()
        .find(|p| p.ends_with("report.json"))
        .expect("the run wrote a report");
    let report: Value = serde_json::from_slice(&std::fs::read(report_path).unwrap()).unwrap();
    assert_eq!(report["passed"], true, "{:#}", report["checks"]);

    let open = report["open_loop"].as_array().unwrap();
    let loads: Vec<f64> = open.iter().map(|o| o["load"].as_f64().unwrap()).collect();
    assert_eq!(loads, [0.5, 2.0]);
    for o in open {
        let n = |field: &str| {
            o[field]
                .as_u64()
                .unwrap_or_else(|| panic!("{field} in {o}"))
        };
        let other: u64 = o["other"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_u64().unwrap())
            .sum();
        assert!(n("arrivals") > 0, "{o}");
        assert_eq!(
            n("created") + n("shed") + n("timeouts") + n("client_dropped") + other,
            n("arrivals"),
            "an arrival counted twice or not at all: {o}"
        );
        let offered = o["offered_requests_per_s"].as_f64().unwrap();
        assert!(
            (offered - 20.0 * o["load"].as_f64().unwrap()).abs() < 1e-9,
            "{o}"
        );
    }
    let money = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "one_charge_per_paid_ride")
        .expect("the money check ran");
    assert!(
        money["detail"]
            .as_str()
            .unwrap()
            .contains("10000 preloaded rides left out"),
        "{money}"
    );

    let large = &report["large_tables"][0];
    assert_eq!(large["preloaded_keys"], 10000, "{large}");
    let rows = |table: &str| large[table]["rows"].as_i64().unwrap();
    assert_eq!(rows("large") - rows("empty"), 10000, "{large}");
    let indexes = large["large"]["indexes"].as_array().unwrap();
    assert!(
        indexes
            .iter()
            .any(|i| i["name"] == "idempotency_keys_pkey" && i["bytes"].as_i64().unwrap() > 0),
        "{large}"
    );
    let ratios: Vec<(&str, u64)> = large["ratios"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["scenario"].as_str().unwrap(),
                r["concurrency"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(ratios, [("create", 2), ("replay", 2)]);
    // The reaper deleted every finished key; without vacuum the table keeps its size.
    let reap = &large["after_reap"];
    assert!(reap["reaped"].as_i64().unwrap() >= 10000, "{reap}");
    assert!(
        reap["table"]["rows"].as_i64().unwrap() < rows("empty"),
        "{reap}"
    );
    assert!(
        reap["table"]["heap_bytes"].as_i64().unwrap()
            >= large["large"]["heap_bytes"].as_i64().unwrap(),
        "{reap}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A load that is not a positive multiple, and an open loop with no capacity to multiply (no
/// `create` in the run, no `--open-rate`), fail with a clear message before anything is made.
#[test]
fn an_open_loop_without_a_capacity_or_with_a_bad_load_fails_before_it_starts() {
    let dir = std::env::temp_dir().join(format!("bench-open-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for (args, expected) in [
        (
            &["--scenario", "open", "--open-load", "0"][..],
            "must be a positive number",
        ),
        (
            &["--scenario", "open", "--open-load", "1,x"][..],
            "must be a positive number",
        ),
        (&["--scenario", "open"][..], "--open-rate"),
    ] {
        let mut all = vec!["--concurrency", "1"];
        all.extend_from_slice(args);
        let output = bench(&all, &dir);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} passed");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
    assert!(walk(&dir).is_empty(), "a run wrote {:?}", walk(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}
