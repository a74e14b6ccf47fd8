//! The Patroni faults (`--ha patroni`): the leader's postmaster killed (its agent restarts it in
//! place), the leader's agent killed (its lease runs out and the standby is promoted; the
//! harness restarts the agent, which finds itself demoted and rewinds), and a planned
//! switchover. One task injects them one at a time, spread over the run at seeded points, each
//! kind once before any repeats; before each, the cluster must be healthy (a leader and a
//! streaming synchronous standby), so that every fault meets the cluster Patroni promises to
//! protect. The other database faults hold still from just before a fault until the cluster is
//! healthy again.
//!
//! The negative control (`--without sync-replication`: `synchronous_mode: false`) makes the
//! agent's kill lossy on purpose: the standby's WAL receiver is stopped, the leader acknowledges
//! commits the standby never gets, then the leader's agent and postmaster are killed and the
//! stopped receiver too (its socket's unread bytes die with it), and the standby is promoted
//! without them.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::{ConnectOptions, Connection};
use tokio::task::JoinSet;

use super::database::{acknowledged_meanwhile, OUTAGE_GRACE_SECS, REPLICATION_STALL};
use super::{KILL_AGENT, KILL_LEADER, SWITCHOVER};
use crate::chaos::patroni::Patroni;
use crate::chaos::processes::signal;
use crate::chaos::stack::Stack;

/// The first fault, as a share of the requests done, and the share between two faults (plus a
/// seeded jitter of up to [`JITTER`]): five in a run, at about 10, 30, 50, 70 and 90 %. Three
/// kinds come first, so that every kind strikes even when the run is short and slow.
const FIRST_AT: f64 = 0.1;
const EVERY: f64 = 0.2;
const JITTER: f64 = 0.04;
/// How long a killed agent stays dead: past the leader's ttl (10 s), so that its lease runs out
/// and the standby is promoted while the old primary, without a watchdog, still runs.
const AGENT_DOWN: Duration = Duration::from_secs(14);
/// How long the cluster may take to be healthy again (a rewind, a reclone) before a fault.
const HEALTHY_LIMIT: Duration = Duration::from_secs(90);
/// How often the write probe writes, and how long one write may take.
const PROBE_EVERY: Duration = Duration::from_millis(100);
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Starts the task, under `--ha patroni`.
pub(super) async fn start(stack: &Arc<Stack>, tasks: &mut JoinSet<()>) {
    if !stack.args.patroni() {
        return;
    }
    let (ha, url) = {
        let postgres = stack.postgres.lock().await;
        (postgres.ha(), postgres.harness_url())
    };
    let Some(ha) = ha else { return };
    let rng = StdRng::seed_from_u64(stack.rng().random());
    tasks.spawn(run(stack.clone(), ha, url, rng));
}

async fn run(stack: Arc<Stack>, ha: Arc<Patroni>, url: String, mut rng: StdRng) {
    // The quick ones first and the agent's kill (a lease to run out, a rewind) last, so that a
    // short run meets all three before its clients are done.
    let first = [KILL_LEADER, SWITCHOVER, KILL_AGENT];
    for k in 0.. {
        let share = FIRST_AT + EVERY * k as f64 + rng.random_range(0.0..JITTER);
        if share >= 1.0 {
            return;
        }
        if !stack
            .reached((stack.args.requests as f64 * share) as u64)
            .await
        {
            return;
        }
        let kind = first
            .get(k)
            .copied()
            .unwrap_or_else(|| first[rng.random_range(0..first.len())]);
        if stack.stop.load(Ordering::Relaxed) {
            return;
        }
        if let Err(e) = one(&stack, &ha, &url, kind).await {
            eprintln!("chaos: {kind} failed: {e:#}");
            stack.recorder.unexpected_exit();
            return;
        }
    }
}

/// One fault of `kind`, from a healthy cluster back to a healthy cluster, with the longest time
/// without a successful write meanwhile printed. The other database faults hold still, and
/// 500s are explained, until writes are back (plus a grace); the next fault waits for health.
async fn one(stack: &Stack, ha: &Patroni, url: &str, kind: &'static str) -> anyhow::Result<()> {
    let leader = ha.wait_healthy(HEALTHY_LIMIT).await?;
    stack.db_faults_held.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (from, started) = (stack.recorder.second(), Instant::now());
    let (stop_probe, stopped) = tokio::sync::watch::channel(false);
    let probe = tokio::spawn(longest_without_writes(url.to_owned(), stopped));
    let result = inject(stack, ha, kind, leader).await;
    stack.recorder.fault(kind, 1);
    let back = match result {
        Ok(()) => writes_back(url).await,
        Err(e) => Err(e),
    };
    stack.db_faults_held.store(false, Ordering::SeqCst);
    let to = stack.recorder.second() + OUTAGE_GRACE_SECS;
    stack
        .outage
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .extend(from..=to);
    if kind == KILL_AGENT {
        // The agent comes back, as its supervisor would bring it, once its lease has run out
        // (whether or not the standby took over: the cluster must not stay leaderless).
        tokio::time::sleep(AGENT_DOWN.saturating_sub(started.elapsed())).await;
        ha.start_agent(leader)?;
    }
    back?;
    let healthy = ha.wait_healthy(HEALTHY_LIMIT).await.map(|_| ());
    let _ = stop_probe.send(true);
    let gap = probe.await.unwrap_or_default();
    eprintln!(
        "chaos: {kind} on {}: {:.1} s at most without a write, healthy again after {:.1} s",
        ha.nodes()[leader].name,
        gap.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    healthy
}

/// Injects `kind` on `leader`; returns once the fault is made (the postmaster restarted, the
/// standby leading, the switchover done).
async fn inject(
    stack: &Stack,
    ha: &Patroni,
    kind: &'static str,
    leader: usize,
) -> anyhow::Result<()> {
    let node = &ha.nodes()[leader];
    match kind {
        KILL_LEADER => {
            let pid = node.postmaster_pid().context("the leader's postmaster")?;
            signal(pid, "KILL").await?;
            // Its agent notices and starts it again (a new postmaster).
            let started = Instant::now();
            while node.postmaster_pid() == Some(pid) || node.postmaster_pid().is_none() {
                anyhow::ensure!(
                    started.elapsed() < HEALTHY_LIMIT,
                    "the killed postmaster was not restarted within {HEALTHY_LIMIT:?}"
                );
                tokio::time::sleep(PROBE_EVERY).await;
            }
            Ok(())
        }
        SWITCHOVER => ha.switchover(leader).await,
        KILL_AGENT => {
            if ha.synchronous() {
                ha.kill_agent(leader).await?;
            } else {
                lose_the_stream(stack, ha, leader).await?;
            }
            // The old primary takes writes until HAProxy finds its agent gone; the fault is made
            // once the standby leads.
            let started = Instant::now();
            while ha.leader().await != Some(1 - leader) {
                anyhow::ensure!(
                    started.elapsed() < HEALTHY_LIMIT,
                    "the standby did not take over within {HEALTHY_LIMIT:?}"
                );
                tokio::time::sleep(PROBE_EVERY).await;
            }
            Ok(())
        }
        other => anyhow::bail!("not a Patroni fault: {other}"),
    }
}

/// Waits (at most [`HEALTHY_LIMIT`]) until a write through HAProxy succeeds.
async fn writes_back(url: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        if let Ok(Ok(())) = tokio::time::timeout(PROBE_TIMEOUT, write(url)).await {
            return Ok(());
        }
        anyhow::ensure!(
            started.elapsed() < HEALTHY_LIMIT,
            "no write through HAProxy succeeded within {HEALTHY_LIMIT:?}"
        );
        tokio::time::sleep(PROBE_EVERY).await;
    }
}

/// The negative control's kill: the standby's WAL receiver stopped while the leader
/// acknowledges, then the leader's agent and postmaster killed, then the receiver.
async fn lose_the_stream(stack: &Stack, ha: &Patroni, leader: usize) -> anyhow::Result<()> {
    let standby = &ha.nodes()[1 - leader];
    let mut conn = format!("postgres://postgres@{}/postgres", standby.address())
        .parse::<sqlx::postgres::PgConnectOptions>()?
        .connect()
        .await?;
    // A replica that has just rejoined may not stream yet.
    let started = Instant::now();
    let receiver: i32 = loop {
        let found: Option<i32> =
            sqlx::query_scalar("SELECT pid FROM pg_stat_wal_receiver WHERE status = 'streaming'")
                .fetch_optional(&mut conn)
                .await?;
        if let Some(pid) = found {
            break pid;
        }
        anyhow::ensure!(
            started.elapsed() < HEALTHY_LIMIT,
            "the standby's WAL receiver did not stream within {HEALTHY_LIMIT:?}"
        );
        tokio::time::sleep(PROBE_EVERY).await;
    };
    conn.close().await?;
    let receiver = u32::try_from(receiver)?;
    signal(receiver, "STOP").await?;
    acknowledged_meanwhile(&stack.recorder, REPLICATION_STALL).await;
    ha.kill_agent(leader).await?;
    let postmaster = ha.nodes()[leader]
        .postmaster_pid()
        .context("the leader's postmaster")?;
    signal(postmaster, "KILL").await?;
    signal(receiver, "KILL").await
}

/// Writes through HAProxy every [`PROBE_EVERY`] until told to stop: returns the longest time
/// between two successful writes (or from the start to the first).
async fn longest_without_writes(
    url: String,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Duration {
    let started = Instant::now();
    let (mut last, mut longest) = (started, Duration::ZERO);
    while !*stop.borrow() {
        let wrote = tokio::time::timeout(PROBE_TIMEOUT, write(&url)).await;
        let now = Instant::now();
        if let Ok(Ok(())) = wrote {
            longest = longest.max(now - last);
            last = now;
        }
        tokio::select! {
            _ = tokio::time::sleep(PROBE_EVERY) => {}
            _ = stop.changed() => {}
        }
    }
    longest.max(Instant::now() - last)
}

/// One write, on a connection of its own: a transaction id assigned and committed (waiting for
/// the synchronous standby, in synchronous mode).
async fn write(url: &str) -> anyhow::Result<()> {
    let mut conn = url
        .parse::<sqlx::postgres::PgConnectOptions>()?
        .application_name("chaos-auditor")
        .connect()
        .await?;
    sqlx::query("SELECT txid_current()")
        .execute(&mut conn)
        .await?;
    conn.close().await?;
    Ok(())
}
