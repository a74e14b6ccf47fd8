//! `bench`: the real stack under load, measured the way PostgreSQL and the kernel count work.
//!
//! ```text
//!  clients (this process, HDR histograms) ──► rocket-rides serve ──► fakestripe
//!                                                  │                    │
//!                                   database bench_<run>_service   bench_<run>_gateway
//! ```
//!
//! Each scenario at each concurrency gets a life of the stack of its own: the gateway and the
//! service start, the load runs (a warm-up, then the measured time), both stop. PostgreSQL's
//! statistics are read before the start and after the stop (a backend reports its counters when
//! it ends, so every one of the life's transactions is counted). A life without load is
//! measured first, and its fixed cost (start-up queries, the probe's own read) is subtracted.
//!
//! Per request: the service database's transactions and rows written, the gateway database's
//! transactions, the server's WAL bytes, the CPU time of the service, the gateway, PostgreSQL
//! and the clients themselves; and for the key table, the share of its updates that were HOT.
//!
//! `create_pooled` and `replay_pooled` send `create`'s and `replay`'s requests to a service
//! behind a PgBouncer in transaction pooling (`DATABASE_POOLER=transaction`), started by the run
//! through `scripts/pgbouncer.sh` when they are selected and stopped at its end; the report
//! gives each one's rate against the direct scenario's at the same concurrency.
//!
//! `open` offers bookings at fixed rates instead, 0.5×, 1× and 2× the capacity `create`
//! measured at the run's highest concurrency (`--open-load`, `--open-rate`), with Poisson
//! arrivals and each latency counted from the request's intended start ([`open_loop`]): it
//! shows what the service does past its capacity (shed at once with 503s, or queue). It runs
//! after the closed-loop scenarios. `create_large` and `replay_large` run last, once
//! `--preload-keys` finished bookings are loaded into the service's tables ([`preload`]); the
//! report gives the key table's sizes and index depths before and after, and each one's rate
//! against `create`'s and `replay`'s at the same concurrency.
//!
//! The benchmark checks its own results too: every storm key booked once, one gateway charge
//! per paid ride, and every pooled request answered as its direct twin would be. It asserts
//! nothing about speed.

mod load;
pub mod open_loop;
pub mod preload;
mod probe;
pub mod report;
mod stack;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;

pub use self::load::Scenario;
use self::load::{Outcome, Target, REPLAYED_KEY, STORM_SIZE};
use self::open_loop::Offer;
use self::preload::PRELOADED_CHARGE_PREFIX;
use self::probe::{Counters, Cpu};
use self::report::{Check, CpuPerRequest, LargeTable, Latency, Measurement, OpenLoop, Report};
use self::stack::{Databases, Programs, Stack};
use crate::pgbouncer::PgBouncer;

/// `bench` options.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// PostgreSQL server URL; the run creates two fresh databases on that server.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Measured time per scenario and concurrency (after the warm-up).
    #[arg(long, value_parser = parse_bounded_duration, default_value = "5s")]
    pub duration: Duration,
    /// Unmeasured time at the start of each measurement.
    #[arg(long, value_parser = rocket_rides::config::parse_duration, default_value = "1s")]
    pub warmup: Duration,
    /// Client counts to measure `create`, `replay` and `baseline` at (comma-separated). The
    /// storm always sends 64 at once.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32",
          value_parser = clap::value_parser!(u16).range(1..=512))]
    pub concurrency: Vec<u16>,
    /// Scenarios to run, in this order (comma-separated); `open` runs after the closed-loop
    /// ones, `create_large` and `replay_large` last.
    #[arg(
        long,
        value_delimiter = ',',
        value_enum,
        default_value = "create,replay,create_pooled,replay_pooled,storm,baseline,open,create_large,replay_large"
    )]
    pub scenario: Vec<Scenario>,
    /// The script that starts a PgBouncer in transaction pooling in front of DATABASE_URL's
    /// server and prints its URL (and stops it with `--stop URL`); the pooled scenarios only.
    #[arg(long, env = "PGBOUNCER_SCRIPT", default_value = crate::pgbouncer::DEFAULT_SCRIPT)]
    pub pgbouncer_script: PathBuf,
    /// Users the clients spread over.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub users: u16,
    /// The `rocket-rides` binary; `baseline` needs one built with the `bench` feature. Default:
    /// the one next to this program.
    #[arg(long, env = "ROCKET_RIDES_BIN")]
    pub service_bin: Option<PathBuf>,
    /// The `fakestripe` binary. Default: the one next to this program.
    #[arg(long, env = "FAKESTRIPE_BIN")]
    pub gateway_bin: Option<PathBuf>,
    /// Another build to measure side by side (an earlier commit's `rocket-rides`): every
    /// measurement runs on both, alternately, each on databases of its own.
    #[arg(long, requires = "compare_gateway_bin")]
    pub compare_service_bin: Option<PathBuf>,
    /// The `fakestripe` of the build to compare with.
    #[arg(long, requires = "compare_service_bin")]
    pub compare_gateway_bin: Option<PathBuf>,
    /// How many times each measurement runs (per build); the report takes the median.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=20))]
    pub rounds: u16,
    /// Where `<run>/report.json` and the processes' logs go.
    #[arg(long, default_value = "target/bench")]
    pub report_dir: PathBuf,
    /// Keep the run's databases afterwards.
    #[arg(long)]
    pub keep_databases: bool,
    /// `open`: the capacity its loads multiply, in bookings per second. Default: the rate of
    /// `create` at the run's highest concurrency (which `open` then needs in the run).
    #[arg(long, value_parser = parse_positive)]
    pub open_rate: Option<f64>,
    /// `open`: the multiples of the capacity to offer, each in a life of the stack of its own
    /// (comma-separated).
    #[arg(long, value_delimiter = ',', value_parser = parse_positive, default_value = "0.5,1,2")]
    pub open_load: Vec<f64>,
    /// `open`: requests sent and not yet answered at most; an arrival past it is not sent and
    /// is counted as client-dropped.
    #[arg(long, default_value_t = 2000,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub open_max_outstanding: u32,
    /// `open`: how long a request waits for its answer before the client gives up (counted as
    /// a timeout). Above the service's pool acquire timeout, so that its own bounds answer
    /// first.
    #[arg(long, value_parser = rocket_rides::config::parse_duration, default_value = "10s")]
    pub open_timeout: Duration,
    /// `open`: the seed of the arrival times, so that two runs offer the same arrivals.
    #[arg(long, default_value_t = 1)]
    pub open_seed: u64,
    /// `create_large`, `replay_large`: finished bookings loaded into the tables before they run.
    #[arg(long, default_value_t = 1_000_000,
          value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub preload_keys: u64,
    /// After the large scenarios (and the checks), run the reaper over every finished key and
    /// report the key table's dead rows before vacuum. Slow on a million keys: the reaper
    /// deletes in batches of a thousand.
    #[arg(long)]
    pub reap: bool,
}

fn parse_positive(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("must be a positive number, got {s:?}")),
    }
}

fn parse_bounded_duration(s: &str) -> Result<Duration, String> {
    let d = rocket_rides::config::parse_duration(s)?;
    if d < Duration::from_secs(1) || d > Duration::from_secs(600) {
        return Err(format!("must be between 1s and 10m, got {s}"));
    }
    Ok(d)
}

/// Runs the benchmark, prints the table and writes the report; fails when a check failed.
pub async fn run_and_print(args: BenchArgs) -> anyhow::Result<()> {
    let report = run(args).await?;
    println!("{}", report.table());
    anyhow::ensure!(report.passed, "a check failed: see above");
    Ok(())
}

/// One build under measurement, with its own databases and users.
struct Subject {
    name: &'static str,
    programs: Programs,
    databases: Databases,
    /// The service's database through the run's PgBouncer, when pooled scenarios run.
    pooled_url: Option<String>,
    api_keys: Arc<Vec<String>>,
    /// A life of its stack without load: what every measurement subtracts.
    fixed: Counters,
    /// The same, of a life behind the PgBouncer.
    fixed_pooled: Counters,
    logs: PathBuf,
    storm_keys: Vec<String>,
    storm_violations: Vec<String>,
}

/// Runs the benchmark and writes `report.json`.
pub async fn run(args: BenchArgs) -> anyhow::Result<Report> {
    anyhow::ensure!(!args.scenario.is_empty(), "--scenario names no scenario");
    anyhow::ensure!(!args.concurrency.is_empty(), "--concurrency names no count");
    let mut scenarios = args.scenario.clone();
    scenarios.dedup();
    let mut concurrency: Vec<usize> = args.concurrency.iter().map(|&c| usize::from(c)).collect();
    concurrency.sort_unstable();
    concurrency.dedup();
    let mut builds = vec![(
        "current",
        Programs::find(args.service_bin.as_deref(), args.gateway_bin.as_deref())?,
    )];
    if let (Some(service), Some(gateway)) = (&args.compare_service_bin, &args.compare_gateway_bin) {
        builds.push(("compared", Programs::find(Some(service), Some(gateway))?));
    }
    anyhow::ensure!(
        args.open_rate.is_some()
            || !scenarios.contains(&Scenario::Open)
            || scenarios.contains(&Scenario::Create),
        "the open loop multiplies the capacity `create` measures: add create to --scenario, or \
         give the capacity with --open-rate"
    );
    anyhow::ensure!(!args.open_load.is_empty(), "--open-load names no multiple");
    anyhow::ensure!(
        builds[0].1.has_baseline || !scenarios.contains(&Scenario::Baseline),
        "the baseline needs a service built with `--features bench` ({} says {:?}); \
         scripts/bench.sh builds one",
        builds[0].1.service.display(),
        builds[0].1.service_version
    );

    let run = time::OffsetDateTime::now_utc()
        .format(time::macros::format_description!(
            "[year][month][day]t[hour][minute][second]"
        ))
        .context("format the run's name")?
        + &format!("_{}", std::process::id());
    let dir = args.report_dir.join(&run);
    eprintln!("bench: run {run}, logs in {}", dir.display());
    // Before anything is created: a run that cannot have its PgBouncer fails at once.
    let pooler = if scenarios.iter().any(|s| s.pooled()) {
        let advice = "the pooled scenarios (create_pooled, replay_pooled) need a PgBouncer; \
                      leave them out with --scenario to run without one";
        Some(PgBouncer::start(
            "bench",
            &args.pgbouncer_script,
            &args.database_url,
            advice,
        )?)
    } else {
        None
    };

    let mut subjects = Vec::new();
    let mut result = Ok(());
    for (name, programs) in builds {
        let logs = dir.join(name);
        std::fs::create_dir_all(&logs).with_context(|| format!("create {}", logs.display()))?;
        let databases = match Databases::create(&args.database_url, &format!("{run}_{name}")).await
        {
            Ok(databases) => databases,
            Err(e) => {
                result = Err(e);
                break;
            }
        };
        let pooled_url = match &pooler {
            Some(pooler) => match databases.service_url_through(pooler.url()) {
                Ok(url) => Some(url),
                Err(e) => {
                    result = Err(e);
                    databases.drop_all().await;
                    break;
                }
            },
            None => None,
        };
        let mut subject = Subject {
            name,
            programs,
            databases,
            pooled_url,
            api_keys: Arc::default(),
            fixed: Counters::default(),
            fixed_pooled: Counters::default(),
            logs,
            storm_keys: Vec::new(),
            storm_violations: Vec::new(),
        };
        let prepared = prepare(&args, &mut subject).await;
        subjects.push(subject);
        if let Err(e) = prepared {
            result = Err(e);
            break;
        }
    }
    let report = match result {
        Ok(()) => measure_all(&args, &mut subjects, &scenarios, &concurrency, &run).await,
        Err(e) => Err(e),
    };
    for subject in subjects {
        let databases = subject.databases;
        if args.keep_databases || report.is_err() {
            eprintln!(
                "bench: databases {} and {} kept",
                databases.service, databases.gateway
            );
        } else {
            databases.drop_all().await;
        }
    }
    drop(pooler);
    let report = report?;
    report.write_json(&dir.join("report.json"))?;
    eprintln!("bench: report in {}", dir.join("report.json").display());
    Ok(report)
}

/// Migrates, creates the users, books the key the replays replay, and measures the fixed cost of
/// a life of the stack.
async fn prepare(args: &BenchArgs, subject: &mut Subject) -> anyhow::Result<()> {
    let keys = stack::prepare(
        &subject.programs,
        &subject.databases,
        u32::from(args.users),
        &subject.logs,
    )
    .await?;
    subject.api_keys = Arc::new(keys);
    let stack = Stack::start(&subject.programs, &subject.databases, None, &subject.logs).await?;
    let booked = load::book_replayed_key(&Target {
        base: stack.base.clone(),
        api_keys: subject.api_keys.clone(),
        tag: String::new(),
    })
    .await;
    stack.stop().await?;
    booked?;
    let before = probe::counters_at_rest(&mut subject.databases).await?;
    Stack::start(&subject.programs, &subject.databases, None, &subject.logs)
        .await?
        .stop()
        .await?;
    subject.fixed = probe::counters_at_rest(&mut subject.databases)
        .await?
        .since(before);
    if let Some(pooled) = subject.pooled_url.clone() {
        let before = probe::counters_at_rest(&mut subject.databases).await?;
        Stack::start(
            &subject.programs,
            &subject.databases,
            Some(&pooled),
            &subject.logs,
        )
        .await?
        .stop()
        .await?;
        subject.fixed_pooled = probe::counters_at_rest(&mut subject.databases)
            .await?
            .since(before);
    }
    Ok(())
}

async fn measure_all(
    args: &BenchArgs,
    subjects: &mut [Subject],
    scenarios: &[Scenario],
    concurrency: &[usize],
    run: &str,
) -> anyhow::Result<Report> {
    let postmaster = probe::postmaster(subjects[0].databases.admin()).await;
    if postmaster.is_none() {
        eprintln!("bench: PostgreSQL's processes are not visible here; its CPU is not measured");
    }
    let mut measurements = Vec::new();
    // The closed loops first, in the order given; then the open loop, which needs `create`'s
    // capacity; the large tables last, since their preload stays in the databases.
    for &scenario in scenarios
        .iter()
        .filter(|s| **s != Scenario::Open && !s.large())
    {
        measure_closed(
            args,
            subjects,
            scenario,
            concurrency,
            run,
            postmaster,
            &mut measurements,
        )
        .await?;
    }
    let mut open_loop = Vec::new();
    if scenarios.contains(&Scenario::Open) {
        for subject in subjects.iter_mut() {
            let capacity = match args.open_rate {
                Some(rate) => rate,
                None => report::highest_median(&measurements, subject.name, "create")
                    .map(|m| m.requests_per_s)
                    .context("the open loop needs create's rate, and create measured none")?,
            };
            for &load in &args.open_load {
                open_loop.push(measure_open(args, subject, load, capacity, run).await?);
            }
        }
    }
    let mut large_tables = Vec::new();
    if scenarios.iter().any(|s| s.large()) {
        for subject in subjects.iter_mut() {
            large_tables.push(preload_one(args, subject).await?);
        }
        for &scenario in scenarios.iter().filter(|s| s.large()) {
            measure_closed(
                args,
                subjects,
                scenario,
                concurrency,
                run,
                postmaster,
                &mut measurements,
            )
            .await?;
        }
    }

    let mut checks = Vec::new();
    for subject in subjects.iter() {
        if scenarios.contains(&Scenario::Storm) {
            checks.push(storm_check(subject).await?);
        }
        checks.push(charge_check(subject).await?);
    }
    checks.extend(report::pooled_answers_checks(&measurements));
    // Last, once the checks have read the keys: the reaper deletes every finished key.
    let reaped = if args.reap { large_tables.len() } else { 0 };
    for (table, subject) in large_tables.iter_mut().zip(subjects.iter()).take(reaped) {
        eprintln!("bench: reaping every finished key, {} build", subject.name);
        table.after_reap = Some(preload::reap_all(&subject.databases).await?);
    }
    let mut report = Report {
        run: run.to_owned(),
        service_version: subjects[0].programs.service_version.clone(),
        compared_version: subjects.get(1).map(|s| s.programs.service_version.clone()),
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        duration_s: args.duration.as_secs_f64(),
        warmup_s: args.warmup.as_secs_f64(),
        rounds: usize::from(args.rounds),
        users: subjects[0].api_keys.len(),
        create: None,
        replay: None,
        storm: None,
        baseline: None,
        ratios: Vec::new(),
        pooler: Vec::new(),
        comparison: Vec::new(),
        open_loop,
        large_tables,
        measurements,
        checks,
        passed: false,
    };
    report.summarize();
    Ok(report)
}

/// One closed-loop scenario at every concurrency (the storm at its own), every round, every
/// build.
async fn measure_closed(
    args: &BenchArgs,
    subjects: &mut [Subject],
    scenario: Scenario,
    concurrency: &[usize],
    run: &str,
    postmaster: Option<u32>,
    measurements: &mut Vec<Measurement>,
) -> anyhow::Result<()> {
    let counts = if scenario == Scenario::Storm {
        vec![STORM_SIZE]
    } else {
        concurrency.to_vec()
    };
    for c in counts {
        for round in 0..args.rounds {
            // Alternately, so that a drift of the machine touches every build alike.
            for subject in subjects.iter_mut() {
                if scenario == Scenario::Baseline && !subject.programs.has_baseline {
                    continue;
                }
                eprintln!(
                    "bench: {} at c{c}, {} build, round {}",
                    scenario.name(),
                    subject.name,
                    round + 1
                );
                let tag = format!("{run}-{}-c{c}-r{round}", scenario.name());
                let mut m = measure_one(args, subject, scenario, c, &tag, postmaster).await?;
                m.round = round + 1;
                measurements.push(m);
            }
        }
    }
    Ok(())
}

/// One open-loop load in a life of the stack of its own.
async fn measure_open(
    args: &BenchArgs,
    subject: &mut Subject,
    load: f64,
    capacity: f64,
    run: &str,
) -> anyhow::Result<OpenLoop> {
    let offer = Offer {
        rate: load * capacity,
        warmup: args.warmup,
        duration: args.duration,
        max_outstanding: args.open_max_outstanding as usize,
        timeout: args.open_timeout,
        seed: args.open_seed,
    };
    eprintln!(
        "bench: open at {load}× {capacity:.0} = {:.0} req/s, {} build",
        offer.rate, subject.name
    );
    let stack = Stack::start(&subject.programs, &subject.databases, None, &subject.logs).await?;
    let target = Target {
        base: stack.base.clone(),
        api_keys: subject.api_keys.clone(),
        tag: format!("{run}-open-{load}"),
    };
    let measured = open_loop::run(&offer, &target, subject.name, load, capacity).await;
    stack.stop().await?;
    measured
}

/// The key table before and after loading `--preload-keys` finished bookings.
async fn preload_one(args: &BenchArgs, subject: &mut Subject) -> anyhow::Result<LargeTable> {
    let empty = preload::key_table(&subject.databases).await?;
    eprintln!(
        "bench: preloading {} finished bookings, {} build",
        args.preload_keys, subject.name
    );
    let started = std::time::Instant::now();
    let preloaded_keys =
        preload::preload(&subject.databases, REPLAYED_KEY, args.preload_keys).await?;
    let preload_s = started.elapsed().as_secs_f64();
    let large = preload::key_table(&subject.databases).await?;
    Ok(LargeTable {
        build: subject.name,
        preloaded_keys,
        preload_s,
        empty,
        large,
        ratios: Vec::new(),
        after_reap: None,
    })
}

/// One life of the stack: start, load, stop, and the counters around it.
async fn measure_one(
    args: &BenchArgs,
    subject: &mut Subject,
    scenario: Scenario,
    c: usize,
    tag: &str,
    postmaster: Option<u32>,
) -> anyhow::Result<Measurement> {
    let before = probe::counters_at_rest(&mut subject.databases).await?;
    let pooled = if scenario.pooled() {
        Some(
            subject
                .pooled_url
                .clone()
                .context("a pooled scenario without the run's PgBouncer")?,
        )
    } else {
        None
    };
    let stack = Stack::start(
        &subject.programs,
        &subject.databases,
        pooled.as_deref(),
        &subject.logs,
    )
    .await?;
    let pids = (stack.service.pid(), stack.gateway.pid());
    let target = Target {
        base: stack.base.clone(),
        api_keys: subject.api_keys.clone(),
        tag: tag.to_owned(),
    };
    let cpu_before = probe::cpu(pids.0, pids.1, postmaster);
    let outcome = load::run(scenario, c, args.warmup, args.duration, &target).await;
    let cpu = probe::cpu(pids.0, pids.1, postmaster).since(cpu_before);
    stack.stop().await?;
    let outcome = outcome?;
    let counters = probe::counters_at_rest(&mut subject.databases)
        .await?
        .since(before)
        .less(if scenario.pooled() {
            subject.fixed_pooled
        } else {
            subject.fixed
        });
    subject
        .storm_keys
        .extend(outcome.storm_keys.iter().cloned());
    subject
        .storm_violations
        .extend(outcome.storm_violations.iter().cloned());
    Ok(measurement(
        subject.name,
        scenario,
        c,
        &outcome,
        counters,
        cpu,
    ))
}

fn measurement(
    subject: &'static str,
    scenario: Scenario,
    concurrency: usize,
    outcome: &Outcome,
    counters: Counters,
    cpu: Cpu,
) -> Measurement {
    let sent = outcome.sent.max(1) as f64;
    let per = |n: i64| n as f64 / sent;
    Measurement {
        build: subject,
        round: 1,
        scenario: scenario.name(),
        concurrency,
        requests: outcome.measured,
        requests_per_s: outcome.measured as f64 / outcome.measured_for.as_secs_f64().max(1e-9),
        latency_ms: Latency::of(&outcome.latency),
        answers: outcome.answers.clone(),
        requests_sent: outcome.sent,
        transactions_per_request: per(counters.service.transactions),
        rows_written_per_request: per(counters.service.rows_written),
        wal_bytes_per_request: per(counters.wal_bytes),
        gateway_transactions_per_request: per(counters.gateway.transactions),
        key_updates: counters.key_updates,
        key_hot_share: (counters.key_updates > 0)
            .then(|| counters.key_hot_updates as f64 / counters.key_updates as f64),
        cpu_ms_per_request: CpuPerRequest {
            service: cpu.service * 1000.0 / sent,
            gateway: cpu.gateway * 1000.0 / sent,
            clients: cpu.clients * 1000.0 / sent,
            postgres: cpu.postgres.map(|s| s * 1000.0 / sent),
        },
    }
}

/// Every storm key booked exactly one ride, and every round had exactly one request do the work
/// with every replay equal to its answer.
async fn storm_check(subject: &Subject) -> anyhow::Result<Check> {
    let keys = &subject.storm_keys;
    let mut conn = subject.databases.connect_service().await?;
    let (key_rows, rides): (i64, i64) = sqlx::query_as(
        "SELECT count(DISTINCT k.id), count(r.id)
         FROM idempotency_keys k
         LEFT JOIN rides r ON r.key_owner = k.owner AND r.idempotency_key_id = k.id
         WHERE k.idempotency_key = ANY($1)",
    )
    .bind(keys)
    .fetch_one(&mut conn)
    .await?;
    let expected = keys.len() as i64;
    let mut problems = subject.storm_violations.clone();
    if key_rows != expected || rides != expected {
        problems.push(format!(
            "{expected} keys sent, {key_rows} stored, {rides} rides booked"
        ));
    }
    Ok(Check {
        name: "storm_executed_once",
        build: subject.name,
        passed: problems.is_empty(),
        detail: if problems.is_empty() {
            format!("{expected} keys × {STORM_SIZE} requests at once: one ride each")
        } else {
            problems.join("; ")
        },
    })
}

/// Every paid ride's charge is a gateway charge of its own, and every gateway charge is the
/// charge of one paid ride, over the whole run.
async fn charge_check(subject: &Subject) -> anyhow::Result<Check> {
    let databases = &subject.databases;
    let mut service = databases.connect_service().await?;
    // The preloaded rides are copies whose charges were never made (`preload`): counted apart.
    let recorded: Vec<String> = sqlx::query_scalar(
        "SELECT charge_id FROM rides WHERE status = 'paid' AND NOT starts_with(charge_id, $1)",
    )
    .bind(PRELOADED_CHARGE_PREFIX)
    .fetch_all(&mut service)
    .await?;
    let preloaded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM rides WHERE status = 'paid' AND starts_with(charge_id, $1)",
    )
    .bind(PRELOADED_CHARGE_PREFIX)
    .fetch_one(&mut service)
    .await?;
    let made: Vec<String> = sqlx::query_scalar("SELECT id FROM fakestripe.charges")
        .fetch_all(&mut databases.connect_gateway().await?)
        .await?;
    let recorded_set: std::collections::HashSet<&str> =
        recorded.iter().map(String::as_str).collect();
    let made_set: std::collections::HashSet<&str> = made.iter().map(String::as_str).collect();
    let shared = recorded.len() - recorded_set.len();
    let unknown = recorded_set.difference(&made_set).count();
    let orphaned = made_set.difference(&recorded_set).count();
    Ok(Check {
        name: "one_charge_per_paid_ride",
        build: subject.name,
        passed: shared == 0 && unknown == 0 && orphaned == 0,
        detail: format!(
            "{} paid rides, {} gateway charges; {shared} charges on two rides, {unknown} \
             recorded charges the gateway never made, {orphaned} charges of no ride \
             ({preloaded} preloaded rides left out)",
            recorded.len(),
            made.len()
        ),
    })
}
