//! The faults at run time: every family's tasks started, and the sampler that counts, every
//! second, what the gateway and the proxies drew by the table ([`super::FAULTS`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use fakestripe::FaultCounters;
use tokio::task::JoinSet;

use super::{database, gateway, kill, patroni, FaultKind, Injection, FAULTS};
use crate::chaos::clients::ClientUser;
use crate::chaos::proxy::ProxyCounters;
use crate::chaos::stack::Stack;

/// Starts every family's tasks, and the sampler of the gateway's and proxies' counters. The
/// families draw their seeds from the run's generator in this order: the gateway's, the kills',
/// the database's, then (under `--ha patroni` only, so that other runs keep their schedule)
/// Patroni's.
pub(crate) async fn start(
    stack: &Arc<Stack>,
    users: &[ClientUser],
    spared: Vec<i64>,
) -> anyhow::Result<JoinSet<()>> {
    let mut tasks = JoinSet::new();
    gateway::start(stack, users, &mut tasks).await?;
    kill::start(stack, spared, &mut tasks)?;
    database::start(stack, &mut tasks);
    patroni::start(stack, &mut tasks).await;
    tasks.spawn(sample(stack.clone()));
    Ok(tasks)
}

/// What the gateway's and proxies' counters and the services' database proxy had counted.
struct Counters {
    cuts: u64,
    gateway: FaultCounters,
    network: Vec<ProxyCounters>,
}

impl Counters {
    /// How many faults of `kind` these counters hold, if they count it.
    fn of(&self, kind: &FaultKind) -> Option<u64> {
        match kind.injection {
            Injection::Gateway { count, .. } => Some(count(&self.gateway)),
            Injection::Network { count, .. } => Some(self.network.iter().map(count).sum()),
            Injection::CommitCut { .. } => Some(self.cuts),
            Injection::Failpoint { .. } | Injection::Task => None,
        }
    }
}

/// Every second, records what the gateway and the proxies injected since the last look, once
/// more after the faults stop.
async fn sample(stack: Arc<Stack>) {
    // The proxies' and the cuts' counts from zero, the gateway's from now.
    let mut last = Counters {
        cuts: 0,
        gateway: stack.gateway.counters(),
        network: Vec::new(),
    };
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = Counters {
            cuts: stack.postgres.lock().await.cuts(),
            gateway: stack.gateway.counters(),
            network: stack.proxies.iter().map(|p| p.counters()).collect(),
        };
        for kind in FAULTS {
            let (Some(counted), Some(before)) = (now.of(kind), last.of(kind)) else {
                continue;
            };
            if kind.ambient {
                stack.recorder.ambient(kind.name, counted - before);
            } else {
                stack.recorder.fault(kind.name, counted - before);
            }
        }
        last = now;
        if stack.stop.load(Ordering::Relaxed) {
            return;
        }
    }
}
