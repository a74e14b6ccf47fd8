//! Settings that would endanger money are refused at start, by the real binary, with a message
//! naming the setting; and secrets from the environment never appear in `--help`.

use std::process::{Command, Output};

fn rocket_rides(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rocket-rides"));
    command.args(args).env_remove("RUST_LOG");
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().expect("run rocket-rides")
}

const LIVE_KEY: &str = "sk_live_51Zq9XvwMarker";
const DATABASE_URL: &str = "postgres://rides:hunter2-password@127.0.0.1:1/rides";

#[test]
fn help_never_prints_the_secret_key_or_the_database_url_from_the_environment() {
    for command in [
        &["serve", "--help"][..],
        &["worker", "--help"],
        &["users", "create", "--help"],
    ] {
        let help = rocket_rides(
            command,
            &[("STRIPE_API_KEY", LIVE_KEY), ("DATABASE_URL", DATABASE_URL)],
        );
        assert!(help.status.success(), "{command:?}: {help:?}");
        let text = String::from_utf8_lossy(&help.stdout);
        assert!(
            text.contains("STRIPE_API_KEY"),
            "{command:?} names the variable"
        );
        assert!(
            !text.contains("Zq9Xvw"),
            "{command:?} printed the key:\n{text}"
        );
        assert!(
            !text.contains("hunter2"),
            "{command:?} printed the URL:\n{text}"
        );
    }
}

#[test]
fn a_live_key_over_plain_http_is_refused_at_start_without_naming_the_key() {
    let refused = rocket_rides(
        &["serve", "--listen", "127.0.0.1:0"],
        &[
            ("STRIPE_API_KEY", LIVE_KEY),
            ("STRIPE_API_BASE", "http://127.0.0.1:1"),
            ("DATABASE_URL", DATABASE_URL),
        ],
    );
    assert!(!refused.status.success());
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(text.contains("--stripe-api-key"), "{text}");
    assert!(!text.contains("Zq9Xvw"), "the key is never echoed: {text}");
}

#[test]
fn a_key_window_below_its_floor_is_refused_at_start_naming_the_setting() {
    let refused = rocket_rides(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--gateway-key-window",
            "10m",
        ],
        &[("DATABASE_URL", DATABASE_URL)],
    );
    assert!(!refused.status.success());
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(text.contains("--gateway-key-window"), "{text}");
}

#[test]
fn a_shutdown_deadline_below_the_gateway_timeout_is_refused_at_start() {
    let refused = rocket_rides(
        &["worker", "--once", "--shutdown-deadline", "1s"],
        &[("DATABASE_URL", DATABASE_URL)],
    );
    assert!(!refused.status.success());
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(text.contains("--shutdown-deadline"), "{text}");
}

#[test]
fn a_key_retention_shorter_than_a_day_is_refused_at_start() {
    let refused = rocket_rides(
        &["worker", "--once", "--key-retention", "1h"],
        &[("DATABASE_URL", DATABASE_URL)],
    );
    assert!(!refused.status.success());
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(text.contains("--key-retention"), "{text}");
}

#[test]
fn serve_takes_the_key_retention_and_refuses_one_shorter_than_a_day() {
    let help = rocket_rides(&["serve", "--help"], &[]);
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(text.contains("--key-retention"), "{text}");
    assert!(text.contains("KEY_RETENTION"), "{text}");
    serve_refuses(
        &["--key-retention", "23h"],
        ("KEY_RETENTION", "1h"),
        &["--key-retention", "at least 24h"],
    );
}

#[test]
fn serve_documents_the_api_key_cache_ttl_and_refuses_one_over_a_minute() {
    let help = rocket_rides(&["serve", "--help"], &[]);
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(text.contains("--api-key-cache-ttl"), "{text}");
    assert!(text.contains("API_KEY_CACHE_TTL"), "{text}");
    assert!(text.contains("rotate-key"), "{text}");
    serve_refuses(
        &["--api-key-cache-ttl", "61s"],
        ("API_KEY_CACHE_TTL", "2m"),
        &["--api-key-cache-ttl", "at most 60s"],
    );
}

#[test]
fn serve_documents_the_admission_gate_and_refuses_a_wait_over_a_second() {
    let help = rocket_rides(&["serve", "--help"], &[]);
    let text = String::from_utf8_lossy(&help.stdout);
    for name in [
        "--admission-limit",
        "ADMISSION_LIMIT",
        "--admission-wait",
        "ADMISSION_WAIT",
    ] {
        assert!(text.contains(name), "{name}: {text}");
    }
    serve_refuses(
        &["--admission-wait", "2s"],
        ("ADMISSION_WAIT", "1001ms"),
        &["--admission-wait", "at most 1s"],
    );
    serve_refuses(
        &["--admission-limit", "0"],
        ("ADMISSION_LIMIT", "many"),
        &["admission-limit"],
    );
}

/// `serve` refuses the setting given as `flag` and, apart, as the variable `env`, with an error
/// that contains each of `wanted`.
fn serve_refuses(flag: &[&str], env: (&str, &str), wanted: &[&str]) {
    for (args, env) in [(flag, &[][..]), (&[], &[env][..])] {
        let mut command = vec!["serve", "--listen", "127.0.0.1:0"];
        command.extend_from_slice(args);
        let mut env = env.to_vec();
        env.push(("DATABASE_URL", DATABASE_URL));
        let refused = rocket_rides(&command, &env);
        assert!(!refused.status.success(), "{args:?} {env:?}");
        let text = String::from_utf8_lossy(&refused.stderr);
        for want in wanted {
            assert!(text.contains(want), "{text}");
        }
    }
}

#[test]
fn metrics_are_either_on_their_own_listener_or_on_the_public_one_never_both() {
    let help = rocket_rides(&["serve", "--help"], &[]);
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(
        text.contains(rocket_rides::cli::DEFAULT_METRICS_LISTEN),
        "{text}"
    );
    for env in [&[][..], &[("METRICS_LISTEN", "127.0.0.1:0")]] {
        let mut command = vec![
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-on-public-listener",
        ];
        if env.is_empty() {
            command.extend(["--metrics-listen", "127.0.0.1:0"]);
        }
        let mut env = env.to_vec();
        env.push(("DATABASE_URL", DATABASE_URL));
        let refused = rocket_rides(&command, &env);
        assert_eq!(
            refused.status.code(),
            Some(2),
            "{command:?} {env:?}: {refused:?}"
        );
        let text = String::from_utf8_lossy(&refused.stderr);
        assert!(text.contains("--metrics-on-public-listener"), "{text}");
        assert!(text.contains("--metrics-listen"), "{text}");
    }
}

/// A configuration error is one clear message even with `RUST_BACKTRACE=1`: no stack backtrace
/// after it (as `main` returning the `anyhow::Error` printed), and nothing else on stderr.
#[test]
fn a_configuration_error_is_one_message_without_a_backtrace_even_with_rust_backtrace() {
    let refused = rocket_rides(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--gateway-key-window",
            "10m",
        ],
        &[
            ("DATABASE_URL", DATABASE_URL),
            ("RUST_BACKTRACE", "1"),
            ("RUST_LIB_BACKTRACE", "1"),
        ],
    );
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(!text.to_lowercase().contains("backtrace"), "{text}");
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one message: {text}");
    assert!(lines[0].starts_with("Error: "), "{text}");
    assert!(lines[0].contains("--gateway-key-window"), "{text}");
}
