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
/// with named statements waited 120 s twice, for the same undrained jobs).
const FINAL_PASS_LIMIT: Duration = Duration::from_secs(120);
/// The least time left for the receipts after the final pass: a calm worker delivers a few in
/// well under a second.
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

/// Waits (bounded) until no key is unfinished and no job staged.
async fn finish_every_key(pool: &PgPool) -> anyhow::Result<()> {
    let final_pass = Instant::now();
    loop {
        let left: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM idempotency_keys WHERE finished_at IS NULL)
                  + (SELECT count(*) FROM staged_jobs)",
        )
        .fetch_one(pool)
        .await?;
        if left == 0 || final_pass.elapsed() > FINAL_PASS_LIMIT {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A request that never reached the server during the run was booked just now by its late
/// question; lets the calm worker deliver its receipt before it stops, within `limit`.
async fn deliver_receipts(pool: &PgPool, limit: Duration) -> anyhow::Result<()> {
    let drained = Instant::now();
    while drained.elapsed() < limit {
        let staged: i64 = sqlx::query_scalar("SELECT count(*) FROM staged_jobs")
            .fetch_one(pool)
            .await?;
        if staged == 0 {
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
