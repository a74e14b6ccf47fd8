//! The benchmark, run briefly against the debug builds: it must run, and the work it counts per
//! request is the design's, whatever the speed. Nothing here looks at a rate or a latency.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn run_bench(report_dir: &Path) -> Value {
    let status = Command::new(env!("CARGO_BIN_EXE_bench"))
        .args(["--duration", "1s", "--warmup", "1s", "--concurrency", "2"])
        .args(["--scenario", "create,replay,storm", "--users", "2"])
        .arg("--report-dir")
        .arg(report_dir)
        .env("RUST_LOG", "error")
        .env("RUST_BACKTRACE", "0")
        .status()
        .expect("run bench");
    assert!(status.success(), "bench failed: {status}");
    let run = std::fs::read_dir(report_dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| path.join("report.json").exists())
        .expect("the run wrote a report");
    serde_json::from_slice(&std::fs::read(run.join("report.json")).unwrap()).unwrap()
}

#[test]
fn a_booking_takes_four_transactions_a_replay_two_reads_and_key_updates_are_hot() {
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
    // API key, the read of the key, the claim with the ride, the final phase.
    // (A little above 4 where autovacuum or autoanalyze run in the database meanwhile.)
    let per_create = create["transactions_per_request"].as_f64().unwrap();
    assert!(
        (3.95..=4.2).contains(&per_create),
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
        (1.95..=2.1).contains(&per_replay),
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
    let _ = std::fs::remove_dir_all(&dir);
}
