//! The completer of a workflow: finishes the keys its requests left behind by running the same
//! [`Workflow`], and [`run_until`], which runs it beside the reaper until a stop signal.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::drive::{drive, Driven};
use super::{Held, Workflow};
use crate::runner::{self, Pass, Reaper, Resumed};
use crate::store::{Lease, Store};
use crate::Error;

/// Finishes the abandoned keys of a workflow's route (unfinished, lease free or over, left alone
/// past a grace period) by running the workflow from each key's recovery point with its stored
/// parameters, as a retry of the request would. A failed attempt is released with an exponential
/// backoff and tried again later; a key is never dropped, and no outcome is invented for it.
///
/// Built on the closure-based [`runner::Completer`] (its settings and their defaults apply).
#[derive(Debug)]
pub struct Completer<W> {
    inner: runner::Completer,
    store: Store,
    workflow: Arc<W>,
}

impl<W> Clone for Completer<W> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            store: self.store.clone(),
            workflow: self.workflow.clone(),
        }
    }
}

impl<W: Workflow> Completer<W> {
    /// A completer of `workflow`'s keys, with [`runner::Completer::new`]'s defaults.
    pub fn new(store: Store, workflow: Arc<W>) -> Self {
        let inner = runner::Completer::new(store.clone(), workflow.method(), workflow.route());
        Self {
            inner,
            store,
            workflow,
        }
    }

    /// How long a key must have been left alone before it is taken ([`runner::DEFAULT_GRACE`]
    /// by default): above the store's lease TTL, or [`Error::InvalidConfig`] naming both (why:
    /// [`runner::Completer::grace`]).
    pub fn grace(mut self, grace: Duration) -> Result<Self, Error> {
        self.inner = self.inner.grace(grace)?;
        Ok(self)
    }

    /// The backoff after a key's first failed attempt, doubled after each further one up to
    /// `max` ([`runner::backoff`]).
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.inner = self.inner.backoff(base, max);
        self
    }

    /// The most keys one pass takes ([`runner::Completer::batch`]).
    pub fn batch(mut self, keys: usize) -> Self {
        self.inner = self.inner.batch(keys);
        self
    }

    /// How many keys are worked at once ([`runner::DEFAULT_CONCURRENCY`] by default).
    pub fn concurrency(mut self, keys: usize) -> Self {
        self.inner = self.inner.concurrency(keys);
        self
    }

    /// One pass over the abandoned keys (see [`runner::Completer::run_once`]).
    pub async fn run_once(&self) -> Result<Pass, Error> {
        let (store, workflow) = (self.store.clone(), self.workflow.clone());
        self.inner
            .run_once(move |lease| resume(store.clone(), workflow.clone(), lease))
            .await
    }

    /// A pass every `every` until `stop` completes.
    pub async fn run_until(&self, every: Duration, stop: impl Future<Output = ()>) {
        let (store, workflow) = (self.store.clone(), self.workflow.clone());
        self.inner
            .run_until(every, stop, move |lease| {
                resume(store.clone(), workflow.clone(), lease)
            })
            .await
    }
}

/// One completer attempt at a key: the request's own steps, from its recovery point.
async fn resume<W: Workflow>(
    store: Store,
    workflow: Arc<W>,
    lease: Lease<W::Point>,
) -> Resumed<W::Point> {
    match drive(&store, &*workflow, Held::Lease { lease, open: None }).await {
        Driven::Finished(_) => Resumed::Finished,
        Driven::Lost => Resumed::Lost,
        Driven::Stopped {
            lease: Some(lease),
            cause,
            retry_after,
            ..
        } => Resumed::Failed {
            lease,
            error: cause,
            not_before: retry_after,
        },
        // The completer's keys are committed ones: a drive that starts from a lease always
        // hands it back. Should that change, nothing is held to release, and the lease expires.
        Driven::Stopped { lease: None, .. } => Resumed::Lost,
    }
}

/// Runs the workflow's [`Completer`] and, when the store has a retention, the [`Reaper`], side
/// by side, each a pass every `every`, until `stop` completes; a pass under way then runs to its
/// end. For a worker process: one call, one stop signal.
pub async fn run_until<W: Workflow>(
    completer: &Completer<W>,
    every: Duration,
    stop: impl Future<Output = ()>,
) {
    let (stopped, signal) = tokio::sync::watch::channel(false);
    let wait = |mut signal: tokio::sync::watch::Receiver<bool>| async move {
        // An error means the sender is gone, which happens only once `stop` completed.
        let _ = signal.wait_for(|stopped| *stopped).await;
    };
    let reaper = Reaper::new(completer.store.clone()).ok();
    let reap = async {
        match &reaper {
            Some(reaper) => reaper.run_until(every, wait(signal.clone())).await,
            None => tracing::info!("the store keeps keys for good: no reaper runs"),
        }
    };
    let announce = async {
        stop.await;
        let _ = stopped.send(true);
    };
    tokio::join!(
        announce,
        completer.run_until(every, wait(signal.clone())),
        reap
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workflow::{Advance, Halt, Step};
    use crate::OneStep;

    #[derive(Debug)]
    struct Nothing;

    impl Workflow for Nothing {
        type Point = OneStep;

        fn route(&self) -> &str {
            "/nothing"
        }

        async fn step(
            &self,
            _: OneStep,
            _: &mut Step<'_, OneStep>,
        ) -> Result<Advance<OneStep>, Halt> {
            unreachable!("the completer is never run here")
        }
    }

    #[tokio::test]
    async fn a_grace_at_or_below_the_lease_ttl_is_refused() {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .unwrap();
        let ttl = Duration::from_secs(30);
        let store = Store::builder(pool).lease_ttl(ttl).build().unwrap();
        let completer = || Completer::new(store.clone(), Arc::new(Nothing));
        for grace in [Duration::ZERO, ttl] {
            match completer().grace(grace) {
                Err(Error::InvalidConfig(why)) => {
                    assert!(why.contains(&format!("grace ({grace:?})")), "{why}");
                    assert!(why.contains("lease TTL (30s)"), "{why}");
                }
                other => panic!("grace {grace:?} accepted: {other:?}"),
            }
        }
        assert!(completer().grace(ttl + Duration::from_millis(1)).is_ok());
    }
}
