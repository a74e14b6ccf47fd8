//! `chaos`: starts the real programs, sends payments through them while killing and
//! cutting them, then proves from the databases and the clients' records that every invariant
//! held.
//!
//! ```text
//!  clients ──proxy──► api-0 ┐                       ┌─ fakestripe (in-process, faults on)
//!  clients ──proxy──► api-1 ├─proxy─► gateway ──────┘    its database on DATABASE_URL's server
//!  clients ──proxy──► api-2 ┘        (network faults, per connection and per response)
//!             worker (completer, drain, reaper)
//!  api-i, worker ──PgProxy (cuts after COMMIT)──► the run's own PostgreSQL cluster
//!                                                  (pg_terminate_backend, crash and restart;
//!                                                   --failover: a synchronous standby, promoted)
//!  killers: SIGKILL api-i / worker at random · failpoints: crash at exact points (exit codes)
//! ```
//!
//! The run: a PostgreSQL cluster of its own for the service (see [`postgres`]), a fresh database
//! for the gateway, K API processes and a worker (the `rocket-rides` binary, built with
//! failpoints), users (some with declining cards), C clients sending N requests with fresh keys,
//! every fault on. Then the faults stop, a calm worker finishes what was abandoned, every request
//! is asked once more (the replay must equal the first answer), and the auditor checks the
//! invariants, one of which is that every configured fault kind was injected. The exit status is
//! 0 only if all of them hold.

mod audit;
mod clients;
mod cluster;
pub mod html;
mod intermediary;
mod leases;
mod pgproxy;
mod postgres;
mod processes;
pub mod proxy;
mod recorder;
pub mod report;
mod straddle;

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::ConnectOptions;

use self::clients::{ClientPlan, ClientUser};
use self::processes::{ProcessSpec, Supervised};
use self::proxy::{Proxy, ProxyFaults};
use self::recorder::Recorder;
use self::report::{Percentiles, Report};

/// What `--without` can take away, to show that the auditor catches the damage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Sabotage {
    /// Call the gateway under a fresh key per attempt instead of the key derived from the key
    /// row: retries after "charged, then no answer" charge twice.
    DerivedKey,
    /// Run the worker with a completer grace of 1000 hours, so it never takes a key: requests
    /// whose clients gave up stay unfinished.
    Completer,
    /// With `--failover`: replicate asynchronously, and stall the replication stream before the
    /// primary dies, so that commits it acknowledged are lost with it.
    SyncReplication,
    /// Take a charge whose outcome is unknown (no answer within the gateway timeout, a
    /// connection cut before its answer was whole, a 5xx) for a decline: the request answers 402
    /// though the gateway may have charged the card.
    UnknownOutcome,
    /// Commit a new key at its first recovery point (`ride_created`) before its ride is inserted,
    /// in a transaction of its own: a commit whose answer is lost, or a backend killed in
    /// between, leaves a key naming a ride that does not exist.
    AtomicPhase,
    /// Let a holder whose lease renewal found the lease taken over go on with its gateway call
    /// and its next write (which the fencing token then refuses).
    LeaseStop,
    /// Reconcile at once, without waiting for the last call under the key to be older than the
    /// gateway's processing bound: a charge still being made when its key's window passes is in
    /// no list yet, and a new generation of the key charges again.
    InFlightGuard,
    /// Take an answer without the gateway's error object (an intermediary's HTML page or empty
    /// body, status 4xx) for the gateway's refusal: the request stores a 502 "nothing charged",
    /// though the charge behind the intermediary may have been made.
    UnknownAnswers,
    /// Commit asynchronously (`synchronous_commit = off` on the services' connections), and stop
    /// the WAL writer for a second before PostgreSQL crashes, so that commits it acknowledged are
    /// lost with it. Needs the crash: the database faults on, without `--failover`.
    DurableCommit,
}

/// A fault family that can be switched off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FaultFamily {
    /// SIGKILL of API processes and of the worker; API processes stopped (SIGSTOP) for longer
    /// than their leases, so that their keys are taken over while they hold them; leases taken
    /// over in the database while their holders wait on a slow gateway call.
    Kill,
    /// Process crashes at exact points of the phase machine (failpoints).
    Crash,
    /// Gateway latency, errors before and after charging, dropped connections, 409 in flight.
    Gateway,
    /// Delay, reset and blackhole on the loopback proxies.
    Network,
    /// `pg_terminate_backend` of the service's database connections (idle ones, and ones in
    /// the middle of their work), connections cut right after their `COMMIT`, and a crash of
    /// PostgreSQL itself, restarted with crash recovery.
    Database,
}

/// `chaos` options.
#[derive(Debug, Clone, Args)]
pub struct ChaosArgs {
    /// PostgreSQL server URL; the run creates a fresh database on that server.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Requests to send (each with a fresh key, retried with it).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub requests: u64,
    /// Seed of every random choice of the run (faults, schedule, payloads). Random if not given.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Concurrent clients.
    #[arg(long, default_value_t = 24, value_parser = clap::value_parser!(u32).range(1..=512))]
    pub concurrency: u32,
    /// API processes (separate OS processes on loopback ports).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub api_instances: u32,
    /// Users to spread the requests over; a fifth of them have declining cards.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub users: u32,
    /// Switch a fault family off (repeatable).
    #[arg(long = "no", value_enum)]
    pub no: Vec<FaultFamily>,
    /// Sabotage a protection, to show the auditor catches it (the negative control).
    #[arg(long = "without", value_enum)]
    pub without: Vec<Sabotage>,
    /// A client gives up on a request after this long; the completer must then finish it.
    /// Shorter than the API's lease (8 s), so that requests caught by a crash are often
    /// abandoned by their clients and left to the completer.
    #[arg(long, value_parser = rocket_rides::config::parse_duration, default_value = "6s")]
    pub give_up_after: Duration,
    /// The `rocket-rides` binary to run as the API and worker processes; it must be built with
    /// the `failpoints` feature (`scripts/chaos.sh` builds it). Default: the `rocket-rides` next
    /// to this program.
    #[arg(long, env = "ROCKET_RIDES_BIN")]
    pub service_bin: Option<PathBuf>,
    /// Where the report, the HTML page and the processes' logs go.
    #[arg(long, default_value = "target/chaos")]
    pub report_dir: PathBuf,
    /// Keep the run's database afterwards. By default it is dropped when the audit passes and
    /// kept for inspection when it fails.
    #[arg(long, conflicts_with = "drop_database")]
    pub keep_database: bool,
    /// Drop the run's database afterwards even when the audit fails (tests of the harness).
    #[arg(long)]
    pub drop_database: bool,
    /// Give the run's PostgreSQL a streaming standby with synchronous replication, and fail over
    /// to it half-way through the run: the primary is killed, the standby promoted, and the
    /// services reach it through the same address (instead of the crash and restart).
    #[arg(long)]
    pub failover: bool,
}

/// The lease of the API processes: short, so that abandoned keys are taken over within the run.
/// It must stay at least the gateway timeout + 5 s (checked by the processes themselves).
const LEASE_TTL: &str = "8s";
const GATEWAY_TIMEOUT: &str = "3s";
/// The gateway's longest processing time: above its slowest charge in the run (the straddle's
/// hold, [`STRADDLE_HOLD`]), so the services wait that long before they list.
const GATEWAY_PROCESSING_BOUND: &str = "10s";
/// The straddle's held charge: longer than the gateway timeout plus `Retry-After` (3 s + 1 s),
/// shorter than the processing bound, and long enough that the retry after the timeout comes
/// seconds before the charge is made, whatever the other faults add to it.
const STRADDLE_HOLD: Duration = Duration::from_millis(8_500);
/// Requests whose charge straddles its key's window, each of a user of its own: several, since
/// a process killed under one (its lease then outlives the charge) spoils it.
const STRADDLES: usize = 6;
const GATEWAY_CONNECT_TIMEOUT: &str = "500ms";
/// Short, so that a slow gateway call outlives it: the heartbeat then renews mid-call.
const LEASE_HEARTBEAT: &str = "1s";
/// A slow charge: slower than the heartbeat, within the gateway timeout.
const SLOW_CHARGE_MS: u64 = 2_000;
/// A stalled charge: slower than the gateway timeout; the gateway charges after the service gave
/// up on the call, and answers its retries 409 meanwhile.
const STALLED_CHARGE_MS: u64 = 3_500;
/// How long the services trust a gateway key: as short as the services allow (twice the gateway
/// timeout, the lease and the processing bound), so that keys left unfinished by crashes and
/// given-up clients are resumed past it and reconciled within the run, and charges straddle it.
const GATEWAY_KEY_WINDOW: Duration = Duration::from_secs(42);
/// How long the run's gateway remembers a finished key: longer than the services' window plus
/// their processing bound, as Stripe's 24 hours are longer than the default 23 h window plus
/// its 5 min bound.
const GATEWAY_KEY_TTL: Duration = Duration::from_secs(55);
/// How often the gateway forgets the keys past their TTL.
const GATEWAY_FORGET_EVERY: Duration = Duration::from_secs(2);
/// The completer's grace: above the lease TTL, as the worker requires.
const COMPLETER_GRACE: &str = "9s";
/// How long the calm final pass may take to finish every key before the audit says so.
const FINAL_PASS_LIMIT: Duration = Duration::from_secs(120);
/// Every fault kind each family injects, as counted in the report: a run with the family on must
/// inject each at least once (`every_fault_exercised`).
const FAULT_KINDS: [(FaultFamily, &[&str]); 5] = [
    (
        FaultFamily::Kill,
        &[
            "kill_api",
            "kill_worker",
            processes::PAUSE_KIND,
            LEASE_STOLEN,
        ],
    ),
    (
        FaultFamily::Crash,
        &[
            "crash_after_ride_created",
            "crash_after_gateway_charge",
            "crash_after_finished",
            "crash_after_receipt_effect",
        ],
    ),
    (
        FaultFamily::Gateway,
        &[
            "gateway_fail_before",
            "gateway_fail_after",
            "gateway_drop_after",
            "gateway_conflict",
            "gateway_sticky_500",
            "gateway_refuse",
            "gateway_forget_keys",
            "gateway_slow_past_heartbeat",
            "gateway_slow_past_timeout",
            straddle::KIND,
            INTERMEDIARY_ANSWER,
            IDEMPOTENCY_ERROR,
        ],
    ),
    (
        FaultFamily::Network,
        &["net_reset", "net_blackhole", "net_reset_mid_response"],
    ),
    (
        FaultFamily::Database,
        &[
            "pg_terminate",
            "pg_terminate_active",
            "db_cut_after_commit",
            "pg_crash_restart",
        ],
    ),
];

/// How long a paused API process stays stopped: past its lease (8 s) and the completer's grace
/// (9 s) after its keys' last attempt, so that the completer takes them over meanwhile.
const PAUSE: Duration = Duration::from_secs(14);
/// How often the harness looks for a renewed lease to take over.
const STEAL_EVERY: Duration = Duration::from_secs(1);
/// The fault kind of a lease taken over under its holder.
const LEASE_STOLEN: &str = "lease_stolen";
/// The fault kind of an intermediary in front of the gateway answering on its own (HTML or an
/// empty body, 4xx or 5xx), before forwarding or after the charge was made.
const INTERMEDIARY_ANSWER: &str = "gateway_intermediary_answer";
/// The fault kind of a 400 `idempotency_error` for a key whose earlier attempt charged.
const IDEMPOTENCY_ERROR: &str = "gateway_idempotency_error";
/// When an API process is paused, as a share of the requests done: once, after PostgreSQL's
/// crash or failover half-way, early enough that the run outlasts the pause. A frozen process holds its clients until their attempts time out,
/// and the run's load falls meanwhile; the controls of the crash and of the failover need the
/// load at that moment.
const PAUSE_AT: f64 = 0.65;

/// The probability that a service's `COMMIT` is cut off from its answer.
const DB_CUT_AFTER_COMMIT: f64 = 0.01;
/// How long the run's PostgreSQL stays down when it crashes.
const PG_DOWN: Duration = Duration::from_secs(1);
/// How long `--failover` stalls replication before the primary dies (the negative control: at
/// least).
const REPLICATION_STALL: Duration = Duration::from_secs(2);
/// How long the negative control of durable commits stops the WAL writer before the crash, at
/// least.
const WAL_WRITER_STALL: Duration = Duration::from_secs(1);
/// The 201s a negative control waits for while what backs them cannot last (the WAL writer or
/// the replication stream stalled): then the loss is certain, however slow the run.
const ACKNOWLEDGED_IN_STALL: u64 = 5;
/// How long a negative control waits for them at most.
const STALL_LIMIT: Duration = Duration::from_secs(10);
/// How long setting up the run's PostgreSQL (a cluster, a standby) may take.
const SETUP_LIMIT: Duration = Duration::from_secs(120);

/// The database faults after which one request may honestly answer 500: its backend was
/// terminated, or its commit cut from its answer. (A crashed process answers nothing; while
/// PostgreSQL itself is away, its outage seconds explain the 500s.)
const FAULTS_THAT_ANSWER_500: &[&str] =
    &["db_cut_after_commit", "pg_terminate", "pg_terminate_active"];

/// How long after PostgreSQL is back its outage still explains 500s: connections broken by the
/// outage are found broken as they are next used.
const OUTAGE_GRACE_SECS: u32 = 2;

/// The `application_name` of the services' database connections.
const SERVICE_APPLICATION: &str = "rocket-rides";
/// The secret key the run's services use at the gateway.
const GATEWAY_SECRET: &str = "sk_test_chaos";

/// Runs the scenario and returns its report; `report.passed` says whether every invariant held.
pub async fn run(args: ChaosArgs) -> anyhow::Result<Report> {
    let seed = args.seed.unwrap_or_else(|| {
        use rand::TryRngCore;
        // A fresh seed from the OS, printed below so that the run can be repeated.
        rand::rngs::OsRng
            .try_next_u64()
            .expect("the OS random generator works")
    });
    let mut rng = StdRng::seed_from_u64(seed);
    let on = |family| !args.no.contains(&family);
    let started_at = time::OffsetDateTime::now_utc();
    anyhow::ensure!(
        args.failover || !args.without.contains(&Sabotage::SyncReplication),
        "--without sync-replication sabotages a failover: give --failover too"
    );
    let asynchronous_commit = args.without.contains(&Sabotage::DurableCommit);
    anyhow::ensure!(
        !asynchronous_commit || (on(FaultFamily::Database) && !args.failover),
        "--without durable-commit shows what a crash of PostgreSQL loses: it needs the database \
         faults on (no --no database) and no --failover"
    );
    // Checked before anything starts: a build without failpoints would ignore them.
    let program = service_binary(args.service_bin.as_deref())?;
    // The process id too: two runs with one seed may start within the same second.
    let run_name = format!(
        "chaos-{}-{seed}-{}",
        started_at.unix_timestamp(),
        std::process::id()
    );
    let dir = args.report_dir.join(&run_name);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    eprintln!(
        "chaos: seed {seed}, {} requests, {} clients, {} API processes; reports in {}",
        args.requests,
        args.concurrency,
        args.api_instances,
        dir.display()
    );

    // The gateway's database on the server; the service's in a PostgreSQL of the run's own,
    // which may crash and fail over.
    let server: PgConnectOptions = args.database_url.parse().context("parse DATABASE_URL")?;
    let gateway_database = format!("rocket_rides_{}_gateway", run_name.replace('-', "_"));
    let mut admin = server
        .clone()
        .connect()
        .await
        .context("connect to PostgreSQL")?;
    sqlx::query(&format!("CREATE DATABASE {gateway_database}"))
        .execute(&mut admin)
        .await?;
    let gateway_url = server
        .clone()
        .database(&gateway_database)
        .to_url_lossy()
        .to_string();
    let replication = match (
        args.failover,
        args.without.contains(&Sabotage::SyncReplication),
    ) {
        (false, _) => cluster::Replication::None,
        (true, false) => cluster::Replication::Synchronous,
        (true, true) => cluster::Replication::Asynchronous,
    };
    let cut_probability = if on(FaultFamily::Database) {
        DB_CUT_AFTER_COMMIT
    } else {
        0.0
    };
    let mut postgres = tokio::time::timeout(
        SETUP_LIMIT,
        postgres::Postgres::start(
            &cluster::clusters_dir().join(&run_name),
            cut_probability,
            rng.random(),
        ),
    )
    .await
    .context("the run's PostgreSQL did not start in time")??;
    let database = postgres.database().to_owned();
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(
            postgres
                .harness_url()
                .parse::<PgConnectOptions>()?
                .application_name("chaos-auditor"),
        )
        .await?;
    rocket_rides::db::migrate(&pool).await?;

    // The gateway, in-process, and the network between the API and it.
    let recorder = Recorder::new();
    let gateway_pool = fakestripe::connect(&gateway_url).await?;
    let charges_pool = gateway_pool.clone();
    let gateway_faults = fakestripe::Faults {
        latency_ms: 10,
        jitter_ms: 40,
        fail_before_charge: 0.03,
        fail_after_charge: 0.03,
        drop_after_charge: 0.03,
        conflict_in_flight: 0.02,
        sticky_500_before_charge: 0.02,
        sticky_500_after_charge: 0.01,
        slow_charges: 0.03,
        slow_ms: SLOW_CHARGE_MS,
        stalled_charges: 0.02,
        stalled_ms: STALLED_CHARGE_MS,
        intermediary_before: 0.01,
        intermediary_after: 0.01,
        // Only a key that already holds a charge is struck: rare, so drawn often.
        idempotency_error_on_replay: 0.1,
        seed: Some(rng.random()),
        ..fakestripe::Faults::none()
    };
    let gateway = fakestripe::AppState::new(
        gateway_pool,
        if on(FaultFamily::Gateway) {
            gateway_faults.clone()
        } else {
            fakestripe::Faults::default()
        },
    );
    let gateway_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let gateway_addr = gateway_listener.local_addr()?;
    let (stop_gateway, gateway_stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(fakestripe::serve(
        gateway_listener,
        fakestripe::router(gateway.clone()),
        async {
            let _ = gateway_stopped.await;
        },
    ));
    let network = if on(FaultFamily::Network) {
        ProxyFaults {
            delay_ms: 0,
            jitter_ms: 20,
            reset_probability: 0.03,
            blackhole_probability: 0.008,
            response_reset_probability: 0.01,
        }
    } else {
        ProxyFaults::default()
    };
    let gateway_proxy =
        Arc::new(Proxy::start("api-gateway", gateway_addr, network, rng.random()).await?);

    // Users, created through the gateway directly (setup is not under test).
    let stripe = rocket_rides::stripe::StripeClient::new(
        &format!("http://{gateway_addr}"),
        GATEWAY_SECRET,
        Duration::from_secs(2),
        Duration::from_secs(10),
        None,
    )?;
    gateway.set_faults(fakestripe::Faults::default());
    let mut users = Vec::new();
    for i in 0..args.users {
        let declines = i % 5 == 4;
        let card = if declines {
            "tok_chargeCustomerFail"
        } else {
            "tok_visa"
        };
        let user = rocket_rides::users::create_user(
            &pool,
            &stripe,
            &format!("rider{i}@chaos.example"),
            card,
        )
        .await?;
        users.push(ClientUser {
            id: user.id,
            api_key: user.api_key,
            declines,
        });
    }
    // The users of the scripted requests (straddles, intermediaries): good cards of their own,
    // so that their customers' scripts at the gateway strike nobody else, and apart from the
    // users the harness may refuse.
    let (mut straddlers, mut intermediated) = (Vec::new(), Vec::new());
    if on(FaultFamily::Gateway) {
        straddlers = clients::dedicated_users(&pool, &stripe, "straddler", STRADDLES).await?;
        intermediated =
            clients::dedicated_users(&pool, &stripe, "intermediated", intermediary::USERS).await?;
        gateway.set_faults(gateway_faults);
    }

    if args.failover {
        tokio::time::timeout(SETUP_LIMIT, postgres.add_standby(replication))
            .await
            .context("the standby did not start streaming in time")??;
    }

    // The API processes and the worker: the service's binary, with failpoints compiled in.
    // A new key generation is rare (a reconciliation that found nothing), so its point is
    // armed more often than the others.
    // The others are drawn often enough that a run of a thousand requests meets each of them
    // several times (every configured kind must be exercised).
    let crash_spec = "after_ride_created=0.012,after_new_generation=0.6,\
                      after_gateway_charge=0.025,after_finished=0.015,\
                      after_receipt_effect=0.04";
    let mut service_url = postgres.service_url(SERVICE_APPLICATION);
    if asynchronous_commit {
        service_url.push_str("&options[synchronous_commit]=off");
    }
    let mut env = vec![
        // Named, so that the database killer finds the services' connections among the others.
        ("DATABASE_URL".to_owned(), service_url),
        (
            "STRIPE_API_BASE".to_owned(),
            format!("http://{}", gateway_proxy.local_addr()),
        ),
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
    let service_sabotage: Vec<&str> = args
        .without
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
            // Applied to the worker's arguments below, and to the database above and below.
            Sabotage::Completer | Sabotage::SyncReplication | Sabotage::DurableCommit => None,
        })
        .collect();
    if !service_sabotage.is_empty() {
        env.push((
            rocket_rides::failpoints::SABOTAGE_ENV.to_owned(),
            service_sabotage.join(","),
        ));
    }
    let completer_grace = if args.without.contains(&Sabotage::Completer) {
        "1000h"
    } else {
        COMPLETER_GRACE
    };
    let crash_env = |seed: u64| {
        let mut env = env.clone();
        if on(FaultFamily::Crash) {
            env.push((
                rocket_rides::failpoints::FAILPOINTS_ENV.to_owned(),
                crash_spec.to_owned(),
            ));
            env.push((
                rocket_rides::failpoints::FAILPOINT_SEED_ENV.to_owned(),
                seed.to_string(),
            ));
        }
        env
    };
    let mut apis = Vec::new();
    let mut targets = Vec::new();
    let mut client_proxies = Vec::new();
    for i in 0..args.api_instances {
        let port = crate::local::free_port()?;
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        apis.push(Supervised::start(
            ProcessSpec {
                name: format!("api-{i}"),
                kill_kind: "kill_api",
                program: program.clone(),
                args: vec!["serve".into(), "--listen".into(), addr.to_string()],
                env: crash_env(rng.random()),
                log: dir.join(format!("api-{i}.log")),
                restart_delay: Duration::from_millis(300),
            },
            recorder.clone(),
        ));
        let proxy =
            Arc::new(Proxy::start(&format!("client-api-{i}"), addr, network, rng.random()).await?);
        targets.push(proxy.local_addr());
        client_proxies.push(proxy);
    }
    let worker_args = |env| ProcessSpec {
        name: "worker".into(),
        kill_kind: "kill_worker",
        program: program.clone(),
        args: [
            "worker",
            "--completer-interval",
            "300ms",
            "--completer-grace",
            completer_grace,
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
        log: dir.join("worker.log"),
        restart_delay: Duration::from_millis(500),
    };
    let worker = Supervised::start(worker_args(crash_env(rng.random())), recorder.clone());
    wait_until_serving(&targets).await?;

    // Killers, the gateway's own faults over time, and the sampler of the gateway's and
    // proxies' fault counters.
    let stop = Arc::new(AtomicBool::new(false));
    let mut background = tokio::task::JoinSet::new();
    let done = Arc::new(AtomicU64::new(0));
    let refused_users = Arc::new(std::sync::Mutex::new(HashSet::new()));
    if on(FaultFamily::Gateway) {
        // The gateway forgets finished keys past their TTL, as Stripe does after 24 hours; it
        // counts as the fault only while keys of the service are left unfinished.
        let (forgetter, stopped, recorded, db) = (
            gateway.clone(),
            stop.clone(),
            recorder.clone(),
            pool.clone(),
        );
        background.spawn(async move {
            let (gateway, stop, recorder, pool) = (forgetter, stopped, recorded, db);
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(GATEWAY_FORGET_EVERY).await;
                let unfinished: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM idempotency_keys WHERE finished_at IS NULL",
                )
                .fetch_one(&pool)
                .await
                .unwrap_or(0);
                if let Ok(forgotten) = gateway.forget_keys(GATEWAY_KEY_TTL).await {
                    if forgotten > 0 && unfinished > 0 {
                        recorder.fault("gateway_forget_keys", forgotten);
                    }
                }
            }
        });
        // Permanent refusals: a good card's customer is deleted at the gateway a third of the
        // way into the run, so that its later charges are refused for good.
        let good: Vec<&ClientUser> = users.iter().filter(|u| !u.declines).collect();
        if good.len() > 1 {
            let victim = good[rng.random_range(0..good.len())].id;
            let customer: String =
                sqlx::query_scalar("SELECT stripe_customer_id FROM users WHERE id = $1")
                    .bind(victim)
                    .fetch_one(&pool)
                    .await?;
            let (done, stop, refused_users) = (done.clone(), stop.clone(), refused_users.clone());
            let (total, url) = (
                args.requests,
                format!("http://{gateway_addr}/v1/customers/{customer}"),
            );
            background.spawn(async move {
                if !reached(&done, &stop, total / 3).await {
                    return;
                }
                // Counted as refused before the call: a refusal answered meanwhile is then
                // already explained.
                refused_users
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(victim);
                let deleted = reqwest::Client::new()
                    .delete(url)
                    .bearer_auth(GATEWAY_SECRET)
                    .send()
                    .await;
                if !deleted.is_ok_and(|r| r.status().is_success()) {
                    eprintln!("chaos: could not delete the customer of user {victim}");
                }
            });
        }
    }
    // PostgreSQL itself, half-way through: a crash and a restart (crash recovery), or with
    // --failover the primary's death and the standby's promotion. The seconds it is away are
    // noted: 500s then are its doing.
    let postgres = Arc::new(tokio::sync::Mutex::new(postgres));
    let outage: Arc<std::sync::Mutex<Vec<u32>>> = Arc::default();
    // Set while the primary dies (or its WAL writer is stalled): the database killers and the
    // lease stealer hold still (see below).
    let db_faults_held = Arc::new(AtomicBool::new(false));
    if on(FaultFamily::Database) || args.failover {
        let (postgres, done, stop, recorder, outage, held) = (
            postgres.clone(),
            done.clone(),
            stop.clone(),
            recorder.clone(),
            outage.clone(),
            db_faults_held.clone(),
        );
        let (total, failover) = (args.requests, args.failover);
        let sync_replication = replication == cluster::Replication::Synchronous;
        background.spawn(async move {
            if !reached(&done, &stop, total / 2).await {
                return;
            }
            let mut postgres = postgres.lock().await;
            if failover {
                // A synchronous commit whose wait for the standby is cut short (its backend
                // terminated, its client gone) stays committed on the primary alone, where
                // another request can read it and answer with it: a property of PostgreSQL that
                // synchronous replication does not close. The database faults hold still while
                // the primary dies, so that the run tests what synchronous replication promises.
                held.store(true, Ordering::SeqCst);
                postgres.hold_cuts(true);
                tokio::time::sleep(Duration::from_millis(200)).await;
                // The stream stops: synchronous commits wait, asynchronous ones go on without
                // the standby (the negative control's loss).
                postgres.stall_replication();
                if sync_replication {
                    tokio::time::sleep(REPLICATION_STALL).await;
                } else {
                    acknowledged_meanwhile(&recorder, REPLICATION_STALL).await;
                }
            }
            if asynchronous_commit {
                // The negative control of durable commits: what the WAL writer has not written
                // when the server dies is lost, and a second of it makes the loss certain. The
                // harness's own writes hold still meanwhile: their synchronous commits would
                // flush the others' WAL.
                held.store(true, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(200)).await;
                if let Err(e) = postgres.stall_wal_writer().await {
                    eprintln!("chaos: stalling the WAL writer failed: {e:#}");
                    recorder.unexpected_exit();
                }
                acknowledged_meanwhile(&recorder, WAL_WRITER_STALL).await;
            }
            let from = recorder.second();
            let (kind, result) = if failover {
                ("pg_failover", postgres.fail_over().await)
            } else {
                (
                    "pg_crash_restart",
                    postgres.crash_and_restart(PG_DOWN).await,
                )
            };
            recorder.fault(kind, 1);
            postgres.hold_cuts(false);
            held.store(false, Ordering::SeqCst);
            match result {
                Ok(()) => {
                    let to = recorder.second() + OUTAGE_GRACE_SECS;
                    outage
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .extend(from..=to);
                }
                Err(e) => {
                    eprintln!("chaos: {kind} failed: {e:#}");
                    recorder.unexpected_exit();
                }
            }
        });
    }
    let apis = Arc::new(apis);
    if on(FaultFamily::Kill) {
        let (apis, stop, mut rng) = (
            apis.clone(),
            stop.clone(),
            StdRng::seed_from_u64(rng.random()),
        );
        background.spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(rng.random_range(1500..4000))).await;
                apis[rng.random_range(0..apis.len())].kill();
            }
        });
    }
    if on(FaultFamily::Kill) {
        // A pause, at a fixed point of the run: it outlives the lease and the completer's grace,
        // so the keys the process held are taken over, and it finds out when it wakes.
        let (apis, stop, done, mut rng) = (
            apis.clone(),
            stop.clone(),
            done.clone(),
            StdRng::seed_from_u64(rng.random()),
        );
        let total = args.requests;
        background.spawn(async move {
            if reached(&done, &stop, (total as f64 * PAUSE_AT) as u64).await {
                apis[rng.random_range(0..apis.len())].pause(PAUSE);
            }
        });
    }
    if on(FaultFamily::Kill) {
        // Leases taken over under their holders' feet: a key whose lease was renewed is in a
        // gateway call slower than the heartbeat period. Its token moves on in the database, as
        // when another attempt takes the key over (and then dies, leaving it to the completer);
        // the holder finds out at its next renewal, and must stop there.
        let (pool, stop, recorder, held) = (
            pool.clone(),
            stop.clone(),
            recorder.clone(),
            db_faults_held.clone(),
        );
        // The straddles' held calls are slow calls too, but a lease taken from one stays locked
        // past its charge, and the straddle proves nothing: they are left alone.
        let spared: Vec<i64> = straddlers.iter().map(|(user, _)| user.id).collect();
        let ttl = rocket_rides::config::parse_duration(LEASE_TTL).map_err(anyhow::Error::msg)?;
        let heartbeat =
            rocket_rides::config::parse_duration(LEASE_HEARTBEAT).map_err(anyhow::Error::msg)?;
        let renewed_after = ttl + Duration::from_millis(500);
        let recently_renewed = ttl - heartbeat.mul_f64(1.5);
        background.spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(STEAL_EVERY).await;
                if held.load(Ordering::SeqCst) {
                    continue;
                }
                // Renewed since its last phase, and within the last heartbeat and a half: its
                // holder is alive and waiting on the gateway. Locked rows are in a phase: skipped.
                let stolen: Result<Option<i64>, _> = sqlx::query_scalar(
                    "WITH renewed AS (
                         SELECT user_id, id FROM idempotency_keys
                         WHERE finished_at IS NULL
                           AND locked_until > last_run_at + $1 * interval '1 millisecond'
                           AND locked_until > now() + $2 * interval '1 millisecond'
                           AND user_id <> ALL($3)
                         ORDER BY random() LIMIT 1
                         FOR UPDATE SKIP LOCKED
                     )
                     UPDATE idempotency_keys k SET lease_token = k.lease_token + 1
                     FROM renewed WHERE k.user_id = renewed.user_id AND k.id = renewed.id
                     RETURNING k.id",
                )
                .bind(renewed_after.as_millis() as i64)
                .bind(recently_renewed.as_millis() as i64)
                .bind(&spared)
                .fetch_optional(&pool)
                .await;
                if let Ok(Some(_)) = stolen {
                    recorder.fault(LEASE_STOLEN, 1);
                }
            }
        });
    }
    let worker = Arc::new(worker);
    if on(FaultFamily::Kill) {
        let (worker, stop, mut rng) = (
            worker.clone(),
            stop.clone(),
            StdRng::seed_from_u64(rng.random()),
        );
        background.spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(rng.random_range(3000..8000))).await;
                worker.kill();
            }
        });
    }
    if on(FaultFamily::Database) {
        let (pool, stop, recorder, database, held) = (
            pool.clone(),
            stop.clone(),
            recorder.clone(),
            database.clone(),
            db_faults_held.clone(),
        );
        let killer_rng = StdRng::seed_from_u64(rng.random());
        background.spawn(async move {
            let mut rng = killer_rng;
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(rng.random_range(500..1500))).await;
                if held.load(Ordering::SeqCst) {
                    continue;
                }
                // One random connection of the services (idle or not), never the auditor's own.
                let killed: Result<Option<bool>, _> = sqlx::query_scalar(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                     WHERE datname = $1 AND application_name <> 'chaos-auditor'
                       AND pid <> pg_backend_pid()
                     ORDER BY random() LIMIT 1",
                )
                .bind(&database)
                .fetch_optional(&pool)
                .await;
                if let Ok(Some(true)) = killed {
                    recorder.fault("pg_terminate", 1);
                }
            }
        });
    }
    if on(FaultFamily::Database) {
        // Work in progress: a service backend running a statement or inside a transaction.
        // Looked for often, since such a backend is busy only for moments.
        let (pool, stop, recorder, database, held) = (
            pool.clone(),
            stop.clone(),
            recorder.clone(),
            database.clone(),
            db_faults_held.clone(),
        );
        let mut rng = StdRng::seed_from_u64(rng.random());
        background.spawn(async move {
            let mut pause = Duration::from_millis(rng.random_range(300..900));
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(pause).await;
                if held.load(Ordering::SeqCst) {
                    continue;
                }
                let killed: Result<Option<bool>, _> = sqlx::query_scalar(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                     WHERE datname = $1 AND application_name = $2
                       AND state IN ('active', 'idle in transaction')
                       AND pid <> pg_backend_pid()
                     ORDER BY random() LIMIT 1",
                )
                .bind(&database)
                .bind(SERVICE_APPLICATION)
                .fetch_optional(&pool)
                .await;
                pause = if let Ok(Some(true)) = killed {
                    recorder.fault("pg_terminate_active", 1);
                    Duration::from_millis(rng.random_range(300..900))
                } else {
                    // Nothing busy right now: look again soon.
                    Duration::from_millis(20)
                };
            }
        });
    }
    {
        let (gateway, stop, recorder, postgres) = (
            gateway.clone(),
            stop.clone(),
            recorder.clone(),
            postgres.clone(),
        );
        let proxies: Vec<Arc<Proxy>> = client_proxies
            .iter()
            .cloned()
            .chain([gateway_proxy.clone()])
            .collect();
        background.spawn(async move {
            let mut last_gateway = gateway.counters();
            let mut last_network = proxy::ProxyCounters::default();
            let mut last_cuts = 0;
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let cuts = postgres.lock().await.cuts();
                recorder.fault(pgproxy::DB_CUT_AFTER_COMMIT, cuts - last_cuts);
                last_cuts = cuts;
                let now = gateway.counters();
                recorder.ambient("gateway_latency", now.latency - last_gateway.latency);
                recorder.fault(
                    "gateway_fail_before",
                    now.fail_before_charge - last_gateway.fail_before_charge,
                );
                recorder.fault(
                    "gateway_fail_after",
                    now.fail_after_charge - last_gateway.fail_after_charge,
                );
                recorder.fault(
                    "gateway_drop_after",
                    now.drop_after_charge - last_gateway.drop_after_charge,
                );
                recorder.fault(
                    "gateway_conflict",
                    now.conflict_in_flight - last_gateway.conflict_in_flight,
                );
                recorder.fault(
                    "gateway_sticky_500",
                    (now.sticky_500_before_charge + now.sticky_500_after_charge)
                        - (last_gateway.sticky_500_before_charge
                            + last_gateway.sticky_500_after_charge),
                );
                recorder.fault("gateway_refuse", now.refused - last_gateway.refused);
                recorder.fault(
                    "gateway_slow_past_heartbeat",
                    now.slow_charges - last_gateway.slow_charges,
                );
                recorder.fault(
                    "gateway_slow_past_timeout",
                    now.stalled_charges - last_gateway.stalled_charges,
                );
                recorder.fault(
                    INTERMEDIARY_ANSWER,
                    (now.intermediary_before + now.intermediary_after)
                        - (last_gateway.intermediary_before + last_gateway.intermediary_after),
                );
                recorder.fault(
                    IDEMPOTENCY_ERROR,
                    now.idempotency_error_on_replay - last_gateway.idempotency_error_on_replay,
                );
                last_gateway = now;
                let mut network = proxy::ProxyCounters::default();
                for counters in proxies.iter().map(|p| p.counters()) {
                    network.delayed += counters.delayed;
                    network.reset += counters.reset;
                    network.blackholed += counters.blackholed;
                    network.response_reset += counters.response_reset;
                }
                recorder.ambient("net_delay", network.delayed - last_network.delayed);
                recorder.fault("net_reset", network.reset - last_network.reset);
                recorder.fault(
                    "net_blackhole",
                    network.blackholed - last_network.blackholed,
                );
                recorder.fault(
                    "net_reset_mid_response",
                    network.response_reset - last_network.response_reset,
                );
                last_network = network;
                if stop.load(Ordering::Relaxed) {
                    return;
                }
            }
        });
    }

    // The clients.
    let plan = Arc::new(ClientPlan {
        seed,
        requests: args.requests,
        concurrency: args.concurrency,
        targets: targets.clone(),
        users,
        attempt_timeout: Duration::from_secs(5),
        give_up_after: args.give_up_after,
    });
    let progress = {
        let (done, recorder, total) = (done.clone(), recorder.clone(), args.requests);
        tokio::spawn(async move {
            let mut bar = report::Progress::new(total);
            loop {
                let finished = done.load(Ordering::Relaxed);
                let responses = recorder.response_totals();
                let faults: u64 = recorder.fault_totals().values().sum();
                let extra = format!(
                    "201:{} 503:{} 409:{} err:{} faults:{faults}",
                    responses.get("201").unwrap_or(&0),
                    responses.get("503").unwrap_or(&0),
                    responses.get("409").unwrap_or(&0),
                    responses.get("transport_error").unwrap_or(&0),
                );
                bar.set(finished, &extra);
                if finished >= total {
                    bar.finish();
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let client_phase = Instant::now();
    let straddles = tokio::spawn(straddle::run(
        straddle::Straddles {
            users: straddlers,
            targets: targets.clone(),
            window: GATEWAY_KEY_WINDOW,
            hold: STRADDLE_HOLD,
            settle_within: Duration::from_secs(30),
            pool: pool.clone(),
            gateway: gateway.clone(),
            attempt_timeout: plan.attempt_timeout,
            seed,
        },
        recorder.clone(),
    ));
    let intermediaries = tokio::spawn(intermediary::run(
        intermediary::Intermediaries {
            users: intermediated,
            targets: targets.clone(),
            gateway: gateway.clone(),
            attempt_timeout: plan.attempt_timeout,
            give_up_after: args.give_up_after,
            seed,
        },
        recorder.clone(),
    ));
    let mut logs = clients::run(plan.clone(), recorder.clone(), done).await;
    let _ = progress.await;
    // The faults go on until the scripted requests are over: the straddles outlast a short run.
    logs.extend(straddles.await.context("the straddles")?);
    logs.extend(intermediaries.await.context("the intermediaries")?);
    let client_secs = client_phase.elapsed().as_secs_f64();

    // Calm: no more faults; a worker without crash points finishes what was abandoned.
    stop.store(true, Ordering::Relaxed);
    while background.join_next().await.is_some() {}
    postgres.lock().await.calm();
    gateway.set_faults(fakestripe::Faults::default());
    for proxy in client_proxies.iter().chain([&gateway_proxy]) {
        proxy.set_faults(ProxyFaults::default())?;
    }
    let worker = Arc::into_inner(worker).expect("the killer is done");
    worker.stop().await;
    let apis = Arc::into_inner(apis).expect("the killer is done");
    for api in apis {
        api.stop().await;
    }
    let calm_api_port = crate::local::free_port()?;
    let calm_api: SocketAddr = format!("127.0.0.1:{calm_api_port}").parse()?;
    let calm = Supervised::start(
        ProcessSpec {
            name: "api-calm".into(),
            kill_kind: "kill_api",
            program: program.clone(),
            args: vec!["serve".into(), "--listen".into(), calm_api.to_string()],
            env: env.clone(),
            log: dir.join("api-calm.log"),
            restart_delay: Duration::from_millis(300),
        },
        recorder.clone(),
    );
    let calm_worker = Supervised::start(worker_args(env.clone()), recorder.clone());
    eprintln!("chaos: clients done in {client_secs:.1}s; faults off, the worker finishes what was abandoned");
    let final_pass = Instant::now();
    loop {
        let left: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM idempotency_keys WHERE finished_at IS NULL)
                  + (SELECT count(*) FROM staged_jobs)",
        )
        .fetch_one(&pool)
        .await?;
        if left == 0 || final_pass.elapsed() > FINAL_PASS_LIMIT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    wait_until_serving(&[calm_api]).await?;
    let before = audit::Snapshot::take(&pool).await?;
    let verify_plan = ClientPlan {
        targets: vec![calm_api],
        ..(*plan).clone()
    };
    clients::verify(&verify_plan, &mut logs).await;
    // A request that never reached the server during the run was booked just now by its late
    // question; let the calm worker deliver its receipt before it stops.
    let drained = Instant::now();
    while drained.elapsed() < FINAL_PASS_LIMIT {
        let staged: i64 = sqlx::query_scalar("SELECT count(*) FROM staged_jobs")
            .fetch_one(&pool)
            .await?;
        if staged == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    calm_worker.stop().await;
    calm.stop().await;
    let _ = stop_gateway.send(());

    // The audit and the report.
    let process_exits = recorder.unexpected_exits();
    let refused_users = refused_users
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    // With --failover the database's death is the failover, not a crash and restart.
    let mut configured: Vec<&'static str> = FAULT_KINDS
        .iter()
        .filter(|(family, _)| on(*family))
        .flat_map(|(_, kinds)| kinds.iter().copied())
        .filter(|kind| !(args.failover && *kind == "pg_crash_restart"))
        // A lease is taken over only from a holder waiting on a slow gateway call: slow charges
        // or a slow network make those.
        .filter(|kind| {
            *kind != LEASE_STOLEN || on(FaultFamily::Gateway) || on(FaultFamily::Network)
        })
        .collect();
    if args.failover {
        configured.push("pg_failover");
    }
    let outage_seconds = outage.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let lost_leases = leases::read(&dir)?;
    let facts = audit::RunFacts {
        process_exits,
        refused_users: &refused_users,
        db_fault_seconds: &recorder.fault_seconds(FAULTS_THAT_ANSWER_500),
        outage_seconds: &outage_seconds,
        configured: &configured,
        injected: &recorder.fault_totals(),
        lost_leases: &lost_leases,
    };
    let invariants = audit::audit(&pool, &charges_pool, &logs, &before, &facts).await?;
    let passed = invariants.iter().all(|i| i.passed);
    let mut outcomes = BTreeMap::new();
    for log in &logs {
        let outcome = log
            .final_status
            .map_or_else(|| "gave_up".to_owned(), |s| s.to_string());
        *outcomes.entry(outcome).or_insert(0u64) += 1;
    }
    let attempts: u64 = logs.iter().map(|l| l.answers.len() as u64).sum();
    let mut latencies: Vec<f64> = logs.iter().map(|l| l.latency_ms).collect();
    let report = Report {
        seed,
        requests: args.requests,
        concurrency: args.concurrency,
        api_instances: args.api_instances,
        sabotage: args
            .without
            .iter()
            .filter_map(|s| s.to_possible_value().map(|v| v.get_name().to_owned()))
            .collect(),
        started_at: started_at.format(&time::format_description::well_known::Rfc3339)?,
        duration_secs: client_secs,
        attempts,
        retries: attempts.saturating_sub(args.requests),
        gave_up: outcomes.get("gave_up").copied().unwrap_or(0),
        outcomes,
        responses: recorder.response_totals(),
        faults: recorder.fault_totals(),
        invariants,
        throughput_rps: args.requests as f64 / client_secs.max(0.001),
        latency_ms: Percentiles::from_millis(&mut latencies),
        timeline: recorder.timeline(),
        passed,
    };
    report.write_json(&dir.join("report.json"))?;
    html::write(&report, &dir.join("report.html"))?;
    pool.close().await;
    charges_pool.close().await;
    let drop = args.drop_database || (passed && !args.keep_database);
    if let Some(postgres) = Arc::into_inner(postgres) {
        postgres.into_inner().finish(!drop).await;
    }
    if drop {
        let _ = sqlx::query(&format!(
            "DROP DATABASE IF EXISTS {gateway_database} WITH (FORCE)"
        ))
        .execute(&mut admin)
        .await;
    } else {
        eprintln!("chaos: the gateway's database {gateway_database} is kept for inspection");
    }
    eprintln!("chaos: report in {}", dir.join("report.html").display());
    Ok(report)
}

/// Waits until `done` requests reach `at`: true then, false if the run stopped first.
async fn reached(done: &AtomicU64, stop: &AtomicBool, at: u64) -> bool {
    while !stop.load(Ordering::Relaxed) && done.load(Ordering::Relaxed) < at {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    !stop.load(Ordering::Relaxed)
}

/// Waits `at_least`, then until the clients have received [`ACKNOWLEDGED_IN_STALL`] more 201s
/// than when it began (or [`STALL_LIMIT`] passed).
async fn acknowledged_meanwhile(recorder: &Recorder, at_least: Duration) {
    let acknowledged = || recorder.response_totals().get("201").copied().unwrap_or(0);
    let (from, started) = (acknowledged(), Instant::now());
    tokio::time::sleep(at_least).await;
    while acknowledged() < from + ACKNOWLEDGED_IN_STALL && started.elapsed() < STALL_LIMIT {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The service binary to spawn, checked to have the crash points and sabotage switches that the
/// run configures: a build without them would ignore them, and the run would prove nothing.
fn service_binary(given: Option<&std::path::Path>) -> anyhow::Result<PathBuf> {
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
async fn wait_until_serving(targets: &[SocketAddr]) -> anyhow::Result<()> {
    for target in targets {
        crate::local::wait_until_answering(&format!("http://{target}/healthz"))
            .await
            .with_context(|| format!("the API behind {target} did not come up"))?;
    }
    Ok(())
}

/// Exit status of `chaos`: the table is printed, and failure is an error.
pub async fn run_and_print(args: ChaosArgs) -> anyhow::Result<()> {
    let report = run(args).await?;
    println!("{}", report.table());
    anyhow::ensure!(report.passed, "the audit failed: see the invariants above");
    Ok(())
}
