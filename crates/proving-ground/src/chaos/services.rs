//! The service's processes as the run starts them: the `rocket-rides` binary (built with its
//! failpoints), its settings, its crash points and the protections `--without` takes away.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use super::faults;
use super::options::{ChaosArgs, FaultFamily, Sabotage};
use super::processes::ProcessSpec;

/// The lease of the API processes: short, so that abandoned keys are taken over within the run.
/// It must stay at least the gateway timeout + 5 s (checked by the processes themselves).
pub(crate) const LEASE_TTL: &str = "8s";
const GATEWAY_TIMEOUT: &str = "3s";
/// The gateway's longest processing time: above its slowest charge in the run (the straddle's
/// hold, [`super::stack::STRADDLE_HOLD`]), so the services wait that long before they list.
const GATEWAY_PROCESSING_BOUND: &str = "10s";
const GATEWAY_CONNECT_TIMEOUT: &str = "500ms";
/// Short, so that a slow gateway call outlives it: the heartbeat then renews mid-call.
pub(crate) const LEASE_HEARTBEAT: &str = "1s";
/// How long the services trust a gateway key: as short as the services allow (twice the gateway
/// timeout, the lease and the processing bound), so that keys left unfinished by crashes and
/// given-up clients are resumed past it and reconciled within the run, and charges straddle it.
pub(crate) const GATEWAY_KEY_WINDOW: Duration = Duration::from_secs(42);
/// The completer's grace: above the lease TTL, as the worker requires.
const COMPLETER_GRACE: &str = "9s";
/// The `application_name` of the services' database connections.
pub(crate) const SERVICE_APPLICATION: &str = "rocket-rides";
/// The secret key the run's services use at the gateway.
pub(crate) const GATEWAY_SECRET: &str = "sk_test_chaos";

/// How to start the service's processes.
pub(crate) struct Services {
    program: PathBuf,
    /// The environment of every process, without the crash points.
    pub env: Vec<(String, String)>,
    /// The crash points, when the crash family is on.
    crash_spec: Option<String>,
    completer_grace: &'static str,
    /// Where the processes' logs go.
    dir: PathBuf,
}

impl Services {
    /// The services of a run of `args`, reaching their database at `database_url` and the
    /// gateway at `gateway`, logging into `dir`.
    pub(crate) fn new(
        args: &ChaosArgs,
        program: PathBuf,
        dir: &Path,
        database_url: String,
        gateway: SocketAddr,
    ) -> Self {
        let mut env = vec![
            // Named, so that the database killer finds the services' connections among the others.
            ("DATABASE_URL".to_owned(), database_url),
            ("STRIPE_API_BASE".to_owned(), format!("http://{gateway}")),
            ("STRIPE_API_KEY".to_owned(), GATEWAY_SECRET.to_owned()),
            ("LEASE_TTL".to_owned(), LEASE_TTL.to_owned()),
            ("GATEWAY_TIMEOUT".to_owned(), GATEWAY_TIMEOUT.to_owned()),
            (
                "GATEWAY_CONNECT_TIMEOUT".to_owned(),
                GATEWAY_CONNECT_TIMEOUT.to_owned(),
            ),
            ("LEASE_HEARTBEAT".to_owned(), LEASE_HEARTBEAT.to_owned()),
            (
                "GATEWAY_KEY_WINDOW".to_owned(),
                format!("{}s", GATEWAY_KEY_WINDOW.as_secs()),
            ),
            (
                "GATEWAY_PROCESSING_BOUND".to_owned(),
                GATEWAY_PROCESSING_BOUND.to_owned(),
            ),
            // No shorter than the gateway timeout, as the services require.
            ("SHUTDOWN_DEADLINE".to_owned(), GATEWAY_TIMEOUT.to_owned()),
            ("DATABASE_MAX_CONNECTIONS".to_owned(), "10".to_owned()),
            // Every API's metrics on a free loopback port: the default port would be taken twice.
            ("METRICS_LISTEN".to_owned(), "127.0.0.1:0".to_owned()),
            // Warnings, and the lease's life in a booking, which the audit reads.
            (
                "RUST_LOG".to_owned(),
                format!("warn,{}=debug", idempotency::LEASE_LOG),
            ),
            ("LOG_FORMAT".to_owned(), "json".to_owned()),
            ("NO_COLOR".to_owned(), "1".to_owned()),
        ];
        // Behind the transaction pooler, every statement unnamed and inside a transaction; the
        // negative control runs them as against PostgreSQL itself.
        if args.pgbouncer() && !args.without(Sabotage::UnnamedStatements) {
            env.push(("DATABASE_POOLER".to_owned(), "transaction".to_owned()));
        }
        let sabotage = sabotage_switches(args);
        if !sabotage.is_empty() {
            env.push((
                rocket_rides::failpoints::SABOTAGE_ENV.to_owned(),
                sabotage.join(","),
            ));
        }
        Self {
            program,
            env,
            crash_spec: args.on(FaultFamily::Crash).then(faults::crash_spec),
            completer_grace: if args.without(Sabotage::Completer) {
                "1000h"
            } else {
                COMPLETER_GRACE
            },
            dir: dir.to_owned(),
        }
    }

    /// The environment with the crash points armed (when the crash family is on), drawn from
    /// `seed`.
    pub(crate) fn crash_env(&self, seed: u64) -> Vec<(String, String)> {
        let mut env = self.env.clone();
        if let Some(spec) = &self.crash_spec {
            env.push((
                rocket_rides::failpoints::FAILPOINTS_ENV.to_owned(),
                spec.clone(),
            ));
            env.push((
                rocket_rides::failpoints::FAILPOINT_SEED_ENV.to_owned(),
                seed.to_string(),
            ));
        }
        env
    }

    /// An API process `name` serving on `addr`.
    pub(crate) fn api(
        &self,
        name: &str,
        addr: SocketAddr,
        env: Vec<(String, String)>,
    ) -> ProcessSpec {
        ProcessSpec {
            name: name.to_owned(),
            kill_kind: "kill_api",
            program: self.program.clone(),
            args: vec!["serve".into(), "--listen".into(), addr.to_string()],
            env,
            log: self.dir.join(format!("{name}.log")),
            restart_delay: Duration::from_millis(300),
        }
    }

    /// The worker.
    pub(crate) fn worker(&self, env: Vec<(String, String)>) -> ProcessSpec {
        ProcessSpec {
            name: "worker".into(),
            kill_kind: "kill_worker",
            program: self.program.clone(),
            args: [
                "worker",
                "--completer-interval",
                "300ms",
                "--completer-grace",
                self.completer_grace,
                "--completer-backoff",
                "500ms",
                "--completer-backoff-max",
                "3s",
                "--drain-interval",
                "200ms",
                // Small drain transactions: a crash in one redoes ten jobs, not a hundred.
                "--drain-batch",
                "10",
                // Keys a crash or a give-up left behind are many in a large run; work them in parallel.
                "--completer-concurrency",
                "16",
            ]
            .map(String::from)
            .to_vec(),
            env,
            log: self.dir.join("worker.log"),
            restart_delay: Duration::from_millis(500),
        }
    }
}

/// The service's sabotage switches that `--without` turns on.
fn sabotage_switches(args: &ChaosArgs) -> Vec<&'static str> {
    args.without
        .iter()
        .filter_map(|sabotage| match sabotage {
            Sabotage::DerivedKey => Some(rocket_rides::failpoints::SABOTAGE_FRESH_GATEWAY_KEY),
            Sabotage::UnknownOutcome => {
                Some(rocket_rides::failpoints::SABOTAGE_UNKNOWN_IS_DECLINED)
            }
            Sabotage::LeaseStop => {
                Some(rocket_rides::failpoints::SABOTAGE_CARRY_ON_AFTER_LOST_LEASE)
            }
            Sabotage::AtomicPhase => Some(rocket_rides::failpoints::SABOTAGE_SPLIT_FIRST_PHASE),
            Sabotage::InFlightGuard => {
                Some(rocket_rides::failpoints::SABOTAGE_LIST_WHILE_IN_FLIGHT)
            }
            Sabotage::UnknownAnswers => {
                Some(rocket_rides::failpoints::SABOTAGE_UNKNOWN_ANSWER_IS_REFUSAL)
            }
            Sabotage::CommitWatch => Some(rocket_rides::failpoints::SABOTAGE_NO_COMMIT_WATCH),
            // Applied to the worker's arguments, to the database, and to the pooler setting.
            Sabotage::Completer
            | Sabotage::SyncReplication
            | Sabotage::DurableCommit
            | Sabotage::UnnamedStatements => None,
        })
        .collect()
}

/// The service binary to spawn, checked to have the crash points and sabotage switches that the
/// run configures: a build without them would ignore them, and the run would prove nothing.
pub(crate) fn service_binary(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    let program = match given {
        Some(path) => path.to_owned(),
        None => std::env::current_exe()
            .context("locate this program")?
            .with_file_name(format!("rocket-rides{}", std::env::consts::EXE_SUFFIX)),
    };
    let version = std::process::Command::new(&program)
        .arg("--version")
        .output()
        .with_context(|| {
            format!(
                "run {} (build it with `cargo build -p rocket-rides --features failpoints`, or \
                 name it with --service-bin)",
                program.display()
            )
        })?;
    let version = String::from_utf8_lossy(&version.stdout);
    anyhow::ensure!(
        version.contains(rocket_rides::cli::FAILPOINTS_MARK),
        "{} was built without the failpoints feature ({}); build it with \
         `cargo build -p rocket-rides --features failpoints`",
        program.display(),
        version.trim()
    );
    Ok(program)
}

/// Waits (bounded) until every API process answers `/healthz` through its address.
pub(crate) async fn wait_until_serving(targets: &[SocketAddr]) -> anyhow::Result<()> {
    for target in targets {
        crate::local::wait_until_answering(&format!("http://{target}/healthz"))
            .await
            .with_context(|| format!("the API behind {target} did not come up"))?;
    }
    Ok(())
}
