//! The database family's tasks: the services' backends terminated (any of them, and ones in
//! the middle of their work), and PostgreSQL itself crashed half-way through the run (or, with
//! `--failover`, its primary killed and the standby promoted). Commits cut from their answers
//! are drawn by the services' database proxy and counted from the table ([`super::FAULTS`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinSet;

use super::CANCEL_SYNC_WAIT;
use crate::chaos::cluster::Replication;
use crate::chaos::options::{FaultFamily, Sabotage};
use crate::chaos::recorder::Recorder;
use crate::chaos::services::SERVICE_APPLICATION;
use crate::chaos::stack::Stack;

/// How long the run's PostgreSQL stays down when it crashes.
const PG_DOWN: Duration = Duration::from_secs(1);
/// How long `--failover` stalls replication before the primary dies (the negative control: at
/// least).
pub(super) const REPLICATION_STALL: Duration = Duration::from_secs(2);
/// How long before the primary dies the waits for its stalled standby are cancelled: shorter
/// than the `Retry-After` (1 s) of the 503 the service answers them with, so that no retry
/// replays, before the primary is gone, a key that only the primary has.
const CANCEL_WINDOW: Duration = Duration::from_millis(400);
/// How long the negative control of durable commits stops the WAL writer before the crash, at
/// least.
const WAL_WRITER_STALL: Duration = Duration::from_secs(1);
/// The 201s a negative control waits for while what backs them cannot last (the WAL writer or
/// the replication stream stalled): then the loss is certain, however slow the run.
const ACKNOWLEDGED_IN_STALL: u64 = 5;
/// How long a negative control waits for them at most.
const STALL_LIMIT: Duration = Duration::from_secs(10);
/// How long after PostgreSQL is back its outage still explains 500s: connections broken by the
/// outage are found broken as they are next used.
pub(super) const OUTAGE_GRACE_SECS: u32 = 2;

/// Starts the family's tasks: the outage when the family is on or with `--failover`, the
/// killers of backends when the family is on.
pub(super) fn start(stack: &Arc<Stack>, tasks: &mut JoinSet<()>) {
    let on = stack.args.on(FaultFamily::Database);
    // Under Patroni, the agents restart and fail over PostgreSQL themselves (faults/patroni.rs).
    if (on || stack.args.failover) && !stack.args.patroni() {
        tasks.spawn(outage(stack.clone()));
    }
    if on {
        let rng = StdRng::seed_from_u64(stack.rng().random());
        tasks.spawn(terminate_any(stack.clone(), rng));
        let rng = StdRng::seed_from_u64(stack.rng().random());
        tasks.spawn(terminate_active(stack.clone(), rng));
    }
}

/// PostgreSQL itself, half-way through: a crash and a restart (crash recovery), or with
/// --failover the primary's death and the standby's promotion. The seconds it is away are
/// noted: 500s then are its doing. While the primary dies (or its WAL writer is stalled), the
/// database killers and the lease stealer hold still.
async fn outage(stack: Arc<Stack>) {
    if !stack.reached(stack.args.requests / 2).await {
        return;
    }
    let (recorder, held) = (&stack.recorder, &stack.db_faults_held);
    let failover = stack.args.failover;
    let mut postgres = stack.postgres.lock().await;
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
        if stack.replication == Replication::Synchronous {
            // Every commit now waits for the standby. The last moment before the primary dies,
            // the waits are cancelled: each such commit reports success with only a warning,
            // and a service that acknowledged it would lose the booking with the primary.
            tokio::time::sleep(REPLICATION_STALL - CANCEL_WINDOW).await;
            let cancelled = cancel_sync_waits(&stack.pool, CANCEL_WINDOW).await;
            recorder.fault(CANCEL_SYNC_WAIT, cancelled);
        } else {
            acknowledged_meanwhile(recorder, REPLICATION_STALL).await;
        }
    }
    if stack.args.without(Sabotage::DurableCommit) {
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
        acknowledged_meanwhile(recorder, WAL_WRITER_STALL).await;
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
            stack
                .outage
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(from..=to);
        }
        Err(e) => {
            eprintln!("chaos: {kind} failed: {e:#}");
            recorder.unexpected_exit();
        }
    }
}

/// Cancels the services' waits for the synchronous standby (their backends in the `SyncRep`
/// wait), every 20 ms for `window`; returns how many.
async fn cancel_sync_waits(pool: &sqlx::PgPool, window: Duration) -> u64 {
    let (started, mut cancelled) = (Instant::now(), 0);
    while started.elapsed() < window {
        let round: Result<i64, _> = sqlx::query_scalar(
            "SELECT count(*) FILTER (WHERE pg_cancel_backend(pid)) FROM pg_stat_activity \
             WHERE wait_event = 'SyncRep' AND application_name = $1",
        )
        .bind(SERVICE_APPLICATION)
        .fetch_one(pool)
        .await;
        match round {
            Ok(n) => cancelled += n.max(0) as u64,
            Err(e) => eprintln!("chaos: cancelling the waits for the standby failed: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cancelled
}

/// Waits `at_least`, then until the clients have received [`ACKNOWLEDGED_IN_STALL`] more 201s
/// than when it began (or [`STALL_LIMIT`] passed).
pub(super) async fn acknowledged_meanwhile(recorder: &Recorder, at_least: Duration) {
    let acknowledged = || recorder.response_totals().get("201").copied().unwrap_or(0);
    let (from, started) = (acknowledged(), Instant::now());
    tokio::time::sleep(at_least).await;
    while acknowledged() < from + ACKNOWLEDGED_IN_STALL && started.elapsed() < STALL_LIMIT {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One random connection of the services (idle or not), never the auditor's own, every half
/// second to a second and a half.
async fn terminate_any(stack: Arc<Stack>, mut rng: StdRng) {
    while !stack.stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(rng.random_range(500..1500))).await;
        if stack.db_faults_held.load(Ordering::SeqCst) {
            continue;
        }
        let killed: Result<Option<bool>, _> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                     WHERE datname = $1 AND application_name <> 'chaos-auditor'
                       AND pid <> pg_backend_pid()
                     ORDER BY random() LIMIT 1",
        )
        .bind(stack.database)
        .fetch_optional(&stack.pool)
        .await;
        if let Ok(Some(true)) = killed {
            stack.recorder.fault("pg_terminate", 1);
        }
    }
}

/// Work in progress: a service backend running a statement or inside a transaction. Looked for
/// often, since such a backend is busy only for moments.
async fn terminate_active(stack: Arc<Stack>, mut rng: StdRng) {
    let mut pause = Duration::from_millis(rng.random_range(300..900));
    while !stack.stop.load(Ordering::Relaxed) {
        tokio::time::sleep(pause).await;
        if stack.db_faults_held.load(Ordering::SeqCst) {
            continue;
        }
        let killed: Result<Option<bool>, _> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                     WHERE datname = $1 AND application_name = $2
                       AND state IN ('active', 'idle in transaction')
                       AND pid <> pg_backend_pid()
                     ORDER BY random() LIMIT 1",
        )
        .bind(stack.database)
        .bind(SERVICE_APPLICATION)
        .fetch_optional(&stack.pool)
        .await;
        pause = if let Ok(Some(true)) = killed {
            stack.recorder.fault("pg_terminate_active", 1);
            Duration::from_millis(rng.random_range(300..900))
        } else {
            // Nothing busy right now: look again soon.
            Duration::from_millis(20)
        };
    }
}
