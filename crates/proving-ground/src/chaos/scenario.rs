//! The run's phases once its stack is up and its faults on: the clients send their requests,
//! the faults stop and a calm stack finishes what was abandoned, every request is asked once
//! more, then the audit and the report.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::ValueEnum;
use sqlx::PgPool;
use tokio::task::JoinSet;

use super::audit;
use super::clients::{self, ClientPlan, RequestLog};
use super::faults;
use super::intermediary;
use super::leases;
use super::options::ChaosArgs;
use super::postgres::Postgres;
use super::processes::Supervised;
use super::proxy::ProxyFaults;
use super::recorder::Recorder;
use super::report::{self, Percentiles, Report};
use super::services::{self, GATEWAY_KEY_WINDOW};
use super::stack::{Cast, Stack, Teardown, STRADDLE_HOLD};
use super::straddle;

/// How long the calm phase may wait, in all, for the worker: to finish every key and drain every
/// staged job (the final pass), then to deliver the receipts of the late questions' bookings.
/// Shared, not one limit each: when the final pass used it up, the worker drains nothing (a
/// sabotage broke it), and a second two minutes changed no run's audit (the PgBouncer control
/// with named statements waited 120 s twice, for the same undrained jobs). A pass that stops
/// moving ends sooner, at [`STALL_LIMIT`].
const FINAL_PASS_LIMIT: Duration = Duration::from_secs(120);
/// How long the final pass waits with nothing moving (the same keys unfinished at the same
/// recovery points, the same jobs staged) before it stops: then waiting cannot help, because a
/// sabotage broke the worker (a key naming a ride that does not exist, statements the pooler
/// refuses), and the audit says so at once instead of at [`FINAL_PASS_LIMIT`].
///
/// It must stay longer than the longest wait a calm worker can meet between two steps of one
/// key, from the stack's settings (`services.rs`). When the calm phase starts, a key may wait for
/// the lease of its holder, stopped or killed (8 s, [`services::LEASE_TTL`]), and for the
/// completer's grace (9 s after it was made); the completer takes it within its interval
/// (0.3 s). Its first attempt may then wait for the gateway's processing bound after the last
/// call before it lists (10 s from that call, made before the calm phase), or find a held
/// straddle's charge still being made ([`STRADDLE_HOLD`], 8.5 s, cut at the gateway timeout of
/// 3 s and then refused 409 in flight until it ends), and after a failed attempt it waits the
/// completer's longest backoff (3 s). The longer of the first two, then every other wait in a row:
/// 25.3 s at the very worst; 30 s leaves room for a loaded machine. Every run prints its final
/// pass's longest wait without a move (`chaos: final pass: …`): 2.0 s for
/// `--requests 1000 --seed 42`, 9.3 s with `--failover`, on 2026-12-06; the most in sixty
/// control runs that day 14.4 s (`--without derived-key`, seed 3). The straddles' key windows
/// (42 s) are over before the calm phase: [`send`] waits for every straddle to end.
const STALL_LIMIT: Duration = Duration::from_secs(30);
/// The least time left for the receipts after the final pass: a calm worker delivers a few in
/// well under a second. Also how long the receipts wait with no staged job delivered before they
/// stop (the drain runs every 200 ms): a worker that delivers nothing in that time delivers
/// nothing at all.
const RECEIPTS_AT_LEAST: Duration = Duration::from_secs(10);

/// What the clients and the scripted requests did.
pub(crate) struct Sent {
    pub logs: Vec<RequestLog>,
    pub plan: Arc<ClientPlan>,
    /// How long the clients took.
    pub secs: f64,
}

/// Sends the requests: the clients', the straddles' and the intermediaries', with a progress
/// bar meanwhile. The faults go on until the scripted requests are over: the straddles outlast
/// a short run.
pub(crate) async fn send(stack: &Arc<Stack>, cast: Cast, seed: u64) -> anyhow::Result<Sent> {
    let args = &stack.args;
    let plan = Arc::new(ClientPlan {
        seed,
        requests: args.requests,
        concurrency: args.concurrency,
        targets: stack.targets.clone(),
        users: cast.users,
        attempt_timeout: Duration::from_secs(5),
        give_up_after: args.give_up_after,
    });
    let progress = tokio::spawn(progress(stack.clone()));
    let client_phase = Instant::now();
    let straddles = tokio::spawn(straddle::run(
        straddle::Straddles {
            users: cast.straddlers,
            targets: stack.targets.clone(),
            window: GATEWAY_KEY_WINDOW,
            hold: STRADDLE_HOLD,
            settle_within: Duration::from_secs(30),
            pool: stack.pool.clone(),
            gateway: stack.gateway.clone(),
            attempt_timeout: plan.attempt_timeout,
            seed,
        },
        stack.recorder.clone(),
    ));
    let intermediaries = tokio::spawn(intermediary::run(
        intermediary::Intermediaries {
            users: cast.intermediated,
            targets: stack.targets.clone(),
            gateway: stack.gateway.clone(),
            attempt_timeout: plan.attempt_timeout,
            give_up_after: args.give_up_after,
            seed,
        },
        stack.recorder.clone(),
    ));
    let mut logs = clients::run(plan.clone(), stack.recorder.clone(), stack.done.clone()).await;
    let _ = progress.await;
    logs.extend(straddles.await.context("the straddles")?);
    logs.extend(intermediaries.await.context("the intermediaries")?);
    Ok(Sent {
        logs,
        plan,
        secs: client_phase.elapsed().as_secs_f64(),
    })
}

/// The progress bar, until the clients are done.
async fn progress(stack: Arc<Stack>) {
    let (recorder, total) = (&stack.recorder, stack.args.requests);
    let mut bar = report::Progress::new(total);
    loop {
        let finished = stack.done.load(Ordering::Relaxed);
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
}

/// What is left of the stack once it is calm and stopped, for the audit.
pub(crate) struct Calmed {
    pub args: ChaosArgs,
    pub recorder: Recorder,
    pub pool: PgPool,
    pub gateway_pool: PgPool,
    pub postgres: Postgres,
    pub refused_users: HashSet<i64>,
    pub outage_seconds: Vec<u32>,
    /// The database after the completer's final pass, before the late questions.
    pub before: audit::Snapshot,
}

/// Calm: the faults stop (every fault task ends), a worker without crash points finishes what
/// was abandoned, and every request is asked once more of an API process without faults.
pub(crate) async fn calm(
    stack: Arc<Stack>,
    mut faults: JoinSet<()>,
    sent: &mut Sent,
) -> anyhow::Result<Calmed> {
    stack.stop.store(true, Ordering::Relaxed);
    while faults.join_next().await.is_some() {}
    let Stack {
        args,
        recorder,
        pool,
        gateway,
        gateway_pool,
        stop_gateway,
        postgres,
        services,
        apis,
        worker,
        proxies,
        refused_users,
        outage,
        ..
    } = Arc::into_inner(stack).expect("every fault task is done");
    let mut postgres = postgres.into_inner();
    postgres.calm();
    gateway.set_faults(fakestripe::Faults::default());
    for proxy in &proxies {
        proxy.set_faults(ProxyFaults::default())?;
    }
    worker.stop().await;
    for api in apis {
        api.stop().await;
    }
    let calm_api_port = crate::local::free_port()?;
    let calm_api: SocketAddr = format!("127.0.0.1:{calm_api_port}").parse()?;
    let calm = Supervised::start(
        services.api("api-calm", calm_api, services.env.clone()),
        recorder.clone(),
    );
    let calm_worker = Supervised::start(services.worker(services.env.clone()), recorder.clone());
    eprintln!(
        "chaos: clients done in {:.1}s; faults off, the worker finishes what was abandoned",
        sent.secs
    );
    let final_pass = Instant::now();
    finish_every_key(&pool).await?;
    services::wait_until_serving(&[calm_api]).await?;
    let before = audit::Snapshot::take(&pool).await?;
    let verify_plan = ClientPlan {
        targets: vec![calm_api],
        ..(*sent.plan).clone()
    };
    clients::verify(&verify_plan, &mut sent.logs).await;
    deliver_receipts(
        &pool,
        FINAL_PASS_LIMIT
            .saturating_sub(final_pass.elapsed())
            .max(RECEIPTS_AT_LEAST),
    )
    .await?;
    calm_worker.stop().await;
    calm.stop().await;
    let _ = stop_gateway.send(());
    Ok(Calmed {
        args,
        recorder,
        pool,
        gateway_pool,
        postgres,
        refused_users: refused_users
            .into_inner()
            .unwrap_or_else(|e| e.into_inner()),
        outage_seconds: outage.into_inner().unwrap_or_else(|e| e.into_inner()),
        before,
    })
}

/// Waits (bounded) until no key is unfinished and no job staged, or until nothing has moved for
/// [`STALL_LIMIT`]; says how long it waited and its longest wait without a move.
async fn finish_every_key(pool: &PgPool) -> anyhow::Result<()> {
    let final_pass = Instant::now();
    let mut watch = Stall::new();
    loop {
        let progress = Progress::read(pool).await?;
        let (done, keys, jobs) = (
            progress.is_empty(),
            progress.unfinished.len(),
            progress.staged.len(),
        );
        let still = watch.still(progress, Instant::now());
        let stalled = still >= STALL_LIMIT;
        if done || stalled || final_pass.elapsed() > FINAL_PASS_LIMIT {
            eprintln!(
                "chaos: final pass: {} in {:.1}s ({} keys unfinished, {} jobs staged; last move \
                 at {:.1}s, longest wait without a move {:.1}s)",
                if done {
                    "done"
                } else if stalled {
                    "stopped, nothing moved for the stall limit"
                } else {
                    "stopped at its limit"
                },
                final_pass.elapsed().as_secs_f64(),
                keys,
                jobs,
                watch.since.duration_since(final_pass).as_secs_f64(),
                watch.longest.max(still).as_secs_f64(),
            );
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// What the worker has left to do, compared between two looks to see whether it moved.
#[derive(PartialEq, Eq)]
struct Progress {
    /// The unfinished keys and their recovery points: a step of a key moves it, a failed attempt
    /// (a new fencing token, a backoff) does not.
    unfinished: Vec<(i64, String)>,
    /// The staged jobs.
    staged: Vec<i64>,
}

impl Progress {
    async fn read(pool: &PgPool) -> anyhow::Result<Self> {
        let unfinished = sqlx::query_as(
            "SELECT id, recovery_point FROM idempotency_keys WHERE finished_at IS NULL ORDER BY id",
        )
        .fetch_all(pool)
        .await?;
        let staged = sqlx::query_scalar("SELECT id FROM staged_jobs ORDER BY id")
            .fetch_all(pool)
            .await?;
        Ok(Self { unfinished, staged })
    }

    fn is_empty(&self) -> bool {
        self.unfinished.is_empty() && self.staged.is_empty()
    }
}

/// How long the worker's work has stood still.
struct Stall<T> {
    last: Option<T>,
    since: Instant,
    /// The longest it stood still before it last moved.
    longest: Duration,
}

impl<T: PartialEq> Stall<T> {
    fn new() -> Self {
        Self {
            last: None,
            since: Instant::now(),
            longest: Duration::ZERO,
        }
    }

    /// How long the work has been `now`, seen `at`.
    fn still(&mut self, now: T, at: Instant) -> Duration {
        if self.last.as_ref() != Some(&now) {
            self.longest = self.longest.max(at.saturating_duration_since(self.since));
            self.since = at;
            self.last = Some(now);
        }
        at.saturating_duration_since(self.since)
    }
}

/// A request that never reached the server during the run was booked just now by its late
/// question; lets the calm worker deliver its receipt before it stops, within `limit`, and no
/// longer than [`RECEIPTS_AT_LEAST`] without delivering one.
async fn deliver_receipts(pool: &PgPool, limit: Duration) -> anyhow::Result<()> {
    let drained = Instant::now();
    let mut watch = Stall::new();
    while drained.elapsed() < limit {
        let staged: Vec<i64> = sqlx::query_scalar("SELECT id FROM staged_jobs ORDER BY id")
            .fetch_all(pool)
            .await?;
        if staged.is_empty() || watch.still(staged, Instant::now()) >= RECEIPTS_AT_LEAST {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// The audit and the report, written to `dir`; then the run's databases are dropped or kept.
pub(crate) async fn audit_and_report(
    calm: Calmed,
    sent: Sent,
    seed: u64,
    started_at: time::OffsetDateTime,
    dir: &Path,
    mut teardown: Teardown,
) -> anyhow::Result<Report> {
    let Calmed { args, recorder, .. } = &calm;
    let logs = &sent.logs;
    let configured = faults::configured(args);
    let stolen = recorder.stolen_leases();
    let lease_log = leases::read(dir, &stolen)?;
    if !stolen.is_empty() {
        eprintln!(
            "chaos: {} leases taken over; renewals that found out: {}; holders refused at the \
             fence after their call: {}",
            stolen.len(),
            lease_log.lost.len(),
            lease_log.fenced.len()
        );
    }
    let facts = audit::RunFacts {
        process_exits: recorder.unexpected_exits(),
        refused_users: &calm.refused_users,
        db_fault_seconds: &recorder.fault_seconds(faults::FAULTS_THAT_ANSWER_500),
        outage_seconds: &calm.outage_seconds,
        configured: &configured,
        injected: &recorder.fault_totals(),
        lost_leases: &lease_log.lost,
        fenced_after_steal: &lease_log.fenced,
    };
    let invariants =
        audit::audit(&calm.pool, &calm.gateway_pool, logs, &calm.before, &facts).await?;
    let passed = invariants.iter().all(|i| i.passed);
    let mut outcomes = BTreeMap::new();
    for log in logs {
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
        database: args.database().to_owned(),
        started_at: started_at.format(&time::format_description::well_known::Rfc3339)?,
        duration_secs: sent.secs,
        attempts,
        retries: attempts.saturating_sub(args.requests),
        gave_up: outcomes.get("gave_up").copied().unwrap_or(0),
        outcomes,
        responses: recorder.response_totals(),
        faults: recorder.fault_totals(),
        invariants,
        throughput_rps: args.requests as f64 / sent.secs.max(0.001),
        latency_ms: Percentiles::from_millis(&mut latencies),
        timeline: recorder.timeline(),
        passed,
    };
    report.write_json(&dir.join("report.json"))?;
    super::html::write(&report, &dir.join("report.html"))?;
    calm.pool.close().await;
    calm.gateway_pool.close().await;
    let drop = args.drop_database || (passed && !args.keep_database);
    calm.postgres.finish(!drop).await;
    let gateway_database = &teardown.gateway_database;
    if drop {
        let _ = sqlx::query(&format!(
            "DROP DATABASE IF EXISTS {gateway_database} WITH (FORCE)"
        ))
        .execute(&mut teardown.admin)
        .await;
    } else {
        eprintln!("chaos: the gateway's database {gateway_database} is kept for inspection");
    }
    eprintln!("chaos: report in {}", dir.join("report.html").display());
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stall_counts_from_the_last_move_and_keeps_the_longest() {
        let start = Instant::now();
        let at = |secs| start + Duration::from_secs(secs);
        let mut watch = Stall::new();
        watch.since = start;
        assert_eq!(watch.still(3, at(0)), Duration::ZERO);
        assert_eq!(watch.still(3, at(5)), Duration::from_secs(5));
        // A move starts the count again; the wait before it is kept.
        assert_eq!(watch.still(2, at(7)), Duration::ZERO);
        assert_eq!(watch.longest, Duration::from_secs(7));
        assert_eq!(watch.still(2, at(9)), Duration::from_secs(2));
        assert_eq!(watch.still(1, at(10)), Duration::ZERO);
        assert_eq!(watch.longest, Duration::from_secs(7));
    }
}
