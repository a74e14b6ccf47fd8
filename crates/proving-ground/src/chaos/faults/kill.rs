//! The kill family: API processes and the worker killed (SIGKILL) at random, one API process
//! paused past its lease, and leases taken over in the database under their holders' feet.
//! The supervisor ([`super::super::processes`]) counts the kills and the pause; the lease
//! stealer counts its own.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinSet;

use super::LEASE_STOLEN;
use crate::chaos::options::FaultFamily;
use crate::chaos::services::{LEASE_HEARTBEAT, LEASE_TTL};
use crate::chaos::stack::Stack;

/// How long a paused API process stays stopped: past its lease (8 s) and the completer's grace
/// (9 s) after its keys' last attempt, so that the completer takes them over meanwhile.
const PAUSE: Duration = Duration::from_secs(14);
/// When an API process is paused, as a share of the requests done: once, after PostgreSQL's
/// crash or failover half-way, early enough that the run outlasts the pause. A frozen process holds its clients until their attempts time out,
/// and the run's load falls meanwhile; the controls of the crash and of the failover need the
/// load at that moment.
const PAUSE_AT: f64 = 0.65;
/// How often the harness looks for a renewed lease to take over.
const STEAL_EVERY: Duration = Duration::from_secs(1);

/// Starts the family's tasks, if it is on. The leases of `spared` users are never taken over.
pub(super) fn start(
    stack: &Arc<Stack>,
    spared: Vec<i64>,
    tasks: &mut JoinSet<()>,
) -> anyhow::Result<()> {
    if !stack.args.on(FaultFamily::Kill) {
        return Ok(());
    }
    tasks.spawn(kill_apis(stack.clone(), task_rng(stack)));
    tasks.spawn(pause_one(stack.clone(), task_rng(stack)));
    let ttl = rocket_rides::config::parse_duration(LEASE_TTL).map_err(anyhow::Error::msg)?;
    let heartbeat =
        rocket_rides::config::parse_duration(LEASE_HEARTBEAT).map_err(anyhow::Error::msg)?;
    tasks.spawn(steal_leases(
        stack.clone(),
        spared,
        ttl + Duration::from_millis(500),
        ttl - heartbeat.mul_f64(1.5),
    ));
    tasks.spawn(kill_worker(stack.clone(), task_rng(stack)));
    Ok(())
}

/// A generator of the task's own, seeded from the run's.
fn task_rng(stack: &Stack) -> StdRng {
    StdRng::seed_from_u64(stack.rng().random())
}

/// An API process killed every 1.5 to 4 seconds.
async fn kill_apis(stack: Arc<Stack>, mut rng: StdRng) {
    while !stack.stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(rng.random_range(1500..4000))).await;
        stack.apis[rng.random_range(0..stack.apis.len())].kill();
    }
}

/// A pause, at a fixed point of the run: it outlives the lease and the completer's grace, so the
/// keys the process held are taken over, and it finds out when it wakes.
async fn pause_one(stack: Arc<Stack>, mut rng: StdRng) {
    let at = (stack.args.requests as f64 * PAUSE_AT) as u64;
    if stack.reached(at).await {
        stack.apis[rng.random_range(0..stack.apis.len())].pause(PAUSE);
    }
}

/// The worker killed every 3 to 8 seconds.
async fn kill_worker(stack: Arc<Stack>, mut rng: StdRng) {
    while !stack.stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(rng.random_range(3000..8000))).await;
        stack.worker.kill();
    }
}

/// Leases taken over under their holders' feet: a key whose lease was renewed is in a gateway
/// call slower than the heartbeat period. Its token moves on in the database, as when another
/// attempt takes the key over (and then dies, leaving it to the completer); the holder finds out
/// at its next renewal, and must stop there. The straddles' held calls are slow calls too, but a
/// lease taken from one stays locked past its charge, and the straddle proves nothing: their
/// users are `spared`.
async fn steal_leases(
    stack: Arc<Stack>,
    spared: Vec<i64>,
    renewed_after: Duration,
    recently_renewed: Duration,
) {
    while !stack.stop.load(Ordering::Relaxed) {
        tokio::time::sleep(STEAL_EVERY).await;
        if stack.db_faults_held.load(Ordering::SeqCst) {
            continue;
        }
        // Renewed since its last phase, and within the last heartbeat and a half: its
        // holder is alive and waiting on the gateway. Locked rows are in a phase: skipped.
        // The holder's token is the one before the increment.
        let stolen: Result<Option<(i64, i64)>, _> = sqlx::query_as(
            "WITH renewed AS (
                         SELECT owner, id FROM idempotency_keys
                         WHERE finished_at IS NULL
                           AND locked_until > last_run_at + $1 * interval '1 millisecond'
                           AND locked_until > now() + $2 * interval '1 millisecond'
                           AND owner <> ALL($3::text[])
                         ORDER BY random() LIMIT 1
                         FOR UPDATE SKIP LOCKED
                     )
                     UPDATE idempotency_keys k SET lease_token = k.lease_token + 1
                     FROM renewed WHERE k.owner = renewed.owner AND k.id = renewed.id
                     RETURNING k.id, k.lease_token - 1",
        )
        .bind(renewed_after.as_millis() as i64)
        .bind(recently_renewed.as_millis() as i64)
        .bind(&spared)
        .fetch_optional(&stack.pool)
        .await;
        if let Ok(Some((key_id, token))) = stolen {
            stack.recorder.lease_stolen(LEASE_STOLEN, key_id, token);
        }
    }
}
