//! The background runners: the [`Completer`], which finishes what requests left behind, and the
//! [`Reaper`], which deletes finished keys past their retention.
//!
//! Both run a pass at a time ([`Completer::run_once`], [`Reaper::run_once`]) for tests and for a
//! scheduler of the application's own, or a loop until a stop signal ([`Completer::run_until`],
//! [`Reaper::run_until`]) in a worker process. Any number of worker processes may run them at
//! once: the completer claims with `FOR UPDATE SKIP LOCKED`, and two completers never take the
//! same key.
//!
//! # The completer
//!
//! A key whose client gave up, or whose process died, stays unfinished at its last recovery
//! point. The completer claims such keys of one route (unfinished, lease free or over, untouched
//! for longer than a grace period that protects a client still retrying), each with a fresh fencing
//! token as a request's claim would, and hands each lease to the application's closure, which
//! resumes the request from [`Lease::recovery_point`] with the stored [`Lease::params`] — the same
//! phase machine the request runs. The closure says how it went ([`Resumed`]); a failed attempt is
//! released with an exponential backoff ([`backoff`]) and tried again later, for as long as it
//! takes: the completer never drops a key and never invents an outcome for it.
//!
//! ```no_run
//! use idempotency::{Completer, OneStep, Resumed, Store};
//!
//! # async fn example(store: Store) -> Result<(), idempotency::Error> {
//! let completer = Completer::new(store.clone(), "POST", "/transfers");
//! let pass = completer
//!     .run_once(move |mut lease: idempotency::Lease<OneStep>| {
//!         let store = store.clone();
//!         async move {
//!             // Resume from lease.recovery_point() with lease.params(), as the request would.
//!             match store.final_phase(&mut lease).await {
//!                 Ok(phase) => match phase.finish(&todo_response()).await {
//!                     Ok(()) => Resumed::Finished,
//!                     Err(idempotency::Error::LeaseLost { .. }) => Resumed::Lost,
//!                     Err(e) => Resumed::failed(lease, e),
//!                 },
//!                 Err(idempotency::Error::LeaseLost { .. }) => Resumed::Lost,
//!                 Err(e) => Resumed::failed(lease, e),
//!             }
//!         }
//!     })
//!     .await?;
//! println!("finished {} abandoned keys", pass.finished);
//! # Ok(()) }
//! # fn todo_response() -> idempotency::StoredResponse { unimplemented!() }
//! ```

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tracing::Instrument;

use crate::store::{Lease, RecoveryPoint, Store};
use crate::Error;

/// What the application's closure made of an abandoned key the completer handed it.
#[derive(Debug)]
pub enum Resumed<P> {
    /// The key reached its final state: its final phase committed (or a phase found it finished).
    Finished,
    /// The attempt failed for a reason that may pass (a foreign system away, the database for a
    /// moment). The completer releases the lease and keeps completers away from the key for its
    /// [`backoff`], and at least `not_before` (a time the application knows nothing can be decided
    /// before).
    Failed {
        /// The lease, to release.
        lease: Lease<P>,
        /// What went wrong, for the log.
        error: String,
        /// The least time before the next attempt.
        not_before: Duration,
    },
    /// Another holder took the key over ([`Error::LeaseLost`]): it finishes the key, and nothing is
    /// released.
    Lost,
}

impl<P> Resumed<P> {
    /// A failed attempt, retried after the completer's backoff.
    pub fn failed(lease: Lease<P>, error: impl std::fmt::Display) -> Self {
        Self::Failed {
            lease,
            error: error.to_string(),
            not_before: Duration::ZERO,
        }
    }
}

/// What one completer pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// Keys claimed.
    pub claimed: usize,
    /// Keys driven to a final state.
    pub finished: usize,
    /// Keys released with a backoff after a failed attempt.
    pub retried: usize,
    /// Keys whose lease another holder took during the attempt.
    pub lost: usize,
    /// Keys claimed whose recovery point the application does not know; their leases expire.
    pub undecodable: usize,
    /// Attempts that panicked; their keys are released with a backoff, as failed ones are.
    pub panicked: usize,
}

/// The backoff after a completer's `completer_attempts`-th attempt at a key failed: `base`,
/// doubled with every further completer attempt, capped at `max`. A client's own retries do not
/// count: they are not the completer's failures.
pub fn backoff(completer_attempts: i32, base: Duration, max: Duration) -> Duration {
    let doublings = completer_attempts.saturating_sub(1).clamp(0, 30) as u32;
    base.saturating_mul(1 << doublings).min(max)
}

/// How long a key is left to its client before a [`Completer`] takes it, by default: 60 s, or
/// twice the store's lease TTL when the TTL is as long or longer (a grace must exceed the TTL,
/// see [`Completer::grace`]).
pub const DEFAULT_GRACE: Duration = Duration::from_secs(60);
/// The most keys a completer pass claims, by default: 50.
pub const DEFAULT_BATCH: usize = 50;
/// How many keys a completer works at once, by default: 4.
pub const DEFAULT_CONCURRENCY: usize = 4;
/// The backoff after a key's first failed completer attempt, by default: 5 s.
pub const DEFAULT_BACKOFF: Duration = Duration::from_secs(5);
/// The most a completer's backoff grows to, by default: 10 min.
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(600);
/// The most keys one reaper statement deletes, by default: 500.
pub const DEFAULT_REAP_BATCH: i64 = 500;

/// Finishes the abandoned keys of one route with the application's closure. See the
/// [module](crate::runner).
#[derive(Debug, Clone)]
pub struct Completer {
    store: Store,
    method: String,
    route: String,
    grace: Duration,
    batch: usize,
    concurrency: usize,
    backoff: Duration,
    backoff_max: Duration,
}

impl Completer {
    /// A completer of the keys of `method` and `route` (as the requests' claims name them), with
    /// the defaults: [`DEFAULT_GRACE`] (or twice the store's lease TTL, when that is longer),
    /// [`DEFAULT_BATCH`] keys a pass, [`DEFAULT_CONCURRENCY`] at once, and a backoff from
    /// [`DEFAULT_BACKOFF`] to [`DEFAULT_BACKOFF_MAX`].
    pub fn new(store: Store, method: &str, route: &str) -> Self {
        let ttl = store.lease_ttl();
        Self {
            store,
            method: method.to_owned(),
            route: route.to_owned(),
            grace: if DEFAULT_GRACE > ttl {
                DEFAULT_GRACE
            } else {
                ttl.saturating_mul(2)
            },
            batch: DEFAULT_BATCH,
            concurrency: DEFAULT_CONCURRENCY,
            backoff: DEFAULT_BACKOFF,
            backoff_max: DEFAULT_BACKOFF_MAX,
        }
    }

    /// How long a key must have been left alone (since its last attempt) before the completer
    /// takes it, so that a client still retrying its own key is not raced: above the store's
    /// lease TTL, or [`Error::InvalidConfig`] naming both.
    ///
    /// At or below the TTL, a key whose request is alive but slow (between two renewals, or
    /// waiting for its next phase) could look abandoned, and the completer would take it over
    /// while its client's own retry is under way: two holders in turn where one would do, each
    /// fenced but each making the client wait. A test that wants a released key taken at once
    /// moves its [`ManualClock`](crate::ManualClock) past the grace instead.
    pub fn grace(mut self, grace: Duration) -> Result<Self, Error> {
        let ttl = self.store.lease_ttl();
        if grace <= ttl {
            return Err(Error::InvalidConfig(format!(
                "the completer's grace ({grace:?}) must exceed the store's lease TTL ({ttl:?}), \
                 or the completer races requests that are still alive"
            )));
        }
        self.grace = grace;
        Ok(self)
    }

    /// The most keys one pass claims (at least one).
    pub fn batch(mut self, keys: usize) -> Self {
        self.batch = keys.max(1);
        self
    }

    /// How many keys are worked at once (at least one). Keys are claimed this many at a time, so
    /// that no claimed key waits with a live lease that nobody works.
    pub fn concurrency(mut self, keys: usize) -> Self {
        self.concurrency = keys.max(1);
        self
    }

    /// The backoff after a key's first failed completer attempt, doubled after each further one
    /// up to `max` (see [`backoff`]).
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.backoff = base;
        self.backoff_max = max.max(base);
        self
    }

    /// One pass: claims abandoned keys a few at a time and runs `resume` on each, until a round
    /// comes back short or the batch is done. Fails only when a claim fails; each key's own
    /// failure is handled (released with a backoff) and counted.
    pub async fn run_once<P, F, Fut>(&self, resume: F) -> Result<Pass, Error>
    where
        P: RecoveryPoint,
        F: Fn(Lease<P>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Resumed<P>> + Send + 'static,
    {
        self.pass(&Arc::new(resume)).await
    }

    /// Runs a pass every `every` until `stop` completes; a pass that fails (the database away) is
    /// logged and tried again at the next tick. A pass under way when `stop` completes runs to
    /// its end: stop the closure's work with a signal of its own to stop sooner.
    pub async fn run_until<P, F, Fut>(
        &self,
        every: Duration,
        stop: impl Future<Output = ()>,
        resume: F,
    ) where
        P: RecoveryPoint,
        F: Fn(Lease<P>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Resumed<P>> + Send + 'static,
    {
        let resume = Arc::new(resume);
        repeat(every, stop, || self.pass(&resume), "completer").await;
    }

    async fn pass<P, F, Fut>(&self, resume: &Arc<F>) -> Result<Pass, Error>
    where
        P: RecoveryPoint,
        F: Fn(Lease<P>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Resumed<P>> + Send + 'static,
    {
        let mut pass = Pass::default();
        while pass.claimed < self.batch {
            let want = self.concurrency.min(self.batch - pass.claimed);
            let claimed = self
                .store
                .claim_abandoned::<P>(&self.method, &self.route, self.grace, want as i64)
                .await?;
            let got = claimed.len();
            pass.claimed += got;
            let mut tasks = JoinSet::new();
            for lease in claimed {
                match lease {
                    Ok(lease) => {
                        let (resume, completer) = (resume.clone(), self.clone());
                        tasks.spawn(async move { completer.attempt(lease, &*resume).await });
                    }
                    Err(e) => {
                        // Code and data disagree: say so loudly; the lease expires on its own.
                        tracing::error!(error = %e, "the completer cannot resume a key");
                        pass.undecodable += 1;
                    }
                }
            }
            while let Some(outcome) = tasks.join_next().await {
                match outcome {
                    Ok(Attempt::Finished) => pass.finished += 1,
                    Ok(Attempt::Retried) => pass.retried += 1,
                    Ok(Attempt::Lost) => pass.lost += 1,
                    Ok(Attempt::Panicked) => pass.panicked += 1,
                    Err(e) => {
                        tracing::error!(error = %e, "a completer attempt panicked");
                        pass.panicked += 1;
                    }
                }
            }
            if got < want {
                break;
            }
        }
        if pass.claimed > 0 {
            tracing::info!(
                method = %self.method,
                route = %self.route,
                claimed = pass.claimed,
                finished = pass.finished,
                retried = pass.retried,
                lost = pass.lost,
                "completer pass"
            );
        }
        Ok(pass)
    }

    async fn attempt<P, F, Fut>(&self, lease: Lease<P>, resume: &F) -> Attempt
    where
        P: RecoveryPoint,
        F: Fn(Lease<P>) -> Fut,
        Fut: Future<Output = Resumed<P>> + Send + 'static,
    {
        let (key_id, attempts) = (lease.key_id(), lease.completer_attempts());
        let span = tracing::info_span!(
            "idempotency.complete",
            key_id,
            token = lease.token(),
            recovery_point = lease.recovery_point().name()
        );
        // In a task of its own, so that a panic of the application's code is caught here: the
        // lease went down with it, and the key is released with a backoff through its fence, as
        // a failure would be, instead of staying locked until the lease runs out and being
        // retried at once, panic after panic.
        let fence = lease.fence();
        let resumed = match tokio::spawn(resume(lease).instrument(span)).await {
            Ok(resumed) => resumed,
            Err(panicked) => {
                let wait = backoff(attempts, self.backoff, self.backoff_max);
                tracing::error!(
                    key_id,
                    completer_attempts = attempts,
                    error = %panicked,
                    retry_in = ?wait,
                    "a completer attempt panicked"
                );
                if let Err(e) = self.store.release_with_backoff(fence, wait).await {
                    tracing::warn!(key_id, error = %e, "could not release the key; its lease expires instead");
                }
                return Attempt::Panicked;
            }
        };
        let (lease, error, not_before) = match resumed {
            Resumed::Finished => {
                tracing::info!(key_id, "the completer finished a key");
                return Attempt::Finished;
            }
            Resumed::Lost => {
                tracing::info!(key_id, "another holder took the key over");
                return Attempt::Lost;
            }
            Resumed::Failed {
                lease,
                error,
                not_before,
            } => (lease, error, not_before),
        };
        let wait = backoff(attempts, self.backoff, self.backoff_max).max(not_before);
        // Loud: a key that keeps failing shows here, attempt after attempt.
        tracing::warn!(
            key_id,
            completer_attempts = attempts,
            error = %error,
            retry_in = ?wait,
            "completer attempt failed"
        );
        if let Err(e) = self.store.release_with_backoff(lease, wait).await {
            tracing::warn!(key_id, error = %e, "could not release the key; its lease expires instead");
        }
        Attempt::Retried
    }
}

enum Attempt {
    Finished,
    Retried,
    Lost,
    Panicked,
}

/// Deletes finished keys past the store's retention, in batches. See the [module](crate::runner).
///
/// It reaps with the retention the store's claims expire keys with ([`Store::with_retention`]),
/// so that reaping changes no answer: a late retry's fate never depends on when the reaper ran.
#[derive(Debug, Clone)]
pub struct Reaper {
    store: Store,
    batch: i64,
}

impl Reaper {
    /// A reaper of the keys that finished longer ago than `store`'s retention,
    /// [`DEFAULT_REAP_BATCH`] per statement.
    /// A store without a retention keeps its keys for good, and is refused
    /// ([`Error::InvalidConfig`]).
    pub fn new(store: Store) -> Result<Self, Error> {
        if store.retention().is_none() {
            return Err(Error::InvalidConfig(
                "a reaper needs a store with a retention (Store::with_retention)".into(),
            ));
        }
        Ok(Self {
            store,
            batch: DEFAULT_REAP_BATCH,
        })
    }

    /// The most keys one statement deletes (at least one): short statements hold few locks.
    pub fn batch(mut self, keys: i64) -> Self {
        self.batch = keys.max(1);
        self
    }

    /// Deletes batches until one comes back short; returns how many keys were deleted.
    pub async fn run_once(&self) -> Result<u64, Error> {
        let mut total = 0;
        loop {
            let deleted = self.store.reap_expired(self.batch).await?;
            total += deleted;
            if deleted < self.batch as u64 {
                if total > 0 {
                    tracing::info!(deleted = total, "reaper pass");
                }
                return Ok(total);
            }
        }
    }

    /// Runs a pass every `every` until `stop` completes; a failing pass is logged and tried again
    /// at the next tick.
    pub async fn run_until(&self, every: Duration, stop: impl Future<Output = ()>) {
        repeat(every, stop, || self.run_once(), "reaper").await;
    }
}

/// Calls `pass` every `every` until `stop` completes.
async fn repeat<T, Fut>(
    every: Duration,
    stop: impl Future<Output = ()>,
    mut pass: impl FnMut() -> Fut,
    runner: &'static str,
) where
    Fut: Future<Output = Result<T, Error>>,
{
    let mut stop = pin!(stop);
    loop {
        if let Err(e) = pass().await {
            tracing::error!(runner, error = %e, "pass failed; trying again at the next tick");
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = &mut stop => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_with_the_completers_attempts_and_is_capped() {
        let (base, max) = (Duration::from_secs(5), Duration::from_secs(60));
        assert_eq!(backoff(1, base, max), Duration::from_secs(5));
        assert_eq!(backoff(2, base, max), Duration::from_secs(10));
        assert_eq!(backoff(3, base, max), Duration::from_secs(20));
        assert_eq!(backoff(5, base, max), Duration::from_secs(60));
        assert_eq!(backoff(i32::MAX, base, max), Duration::from_secs(60));
    }

    /// A store that never connects: the completer's settings need only its lease TTL.
    fn store(lease_ttl: Duration) -> Store {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .unwrap();
        Store::new(pool, Arc::new(crate::DatabaseClock), lease_ttl).unwrap()
    }

    #[tokio::test]
    async fn a_grace_at_or_below_the_lease_ttl_is_refused_naming_both() {
        let ttl = Duration::from_secs(30);
        for grace in [Duration::ZERO, ttl - Duration::from_millis(1), ttl] {
            let completer = Completer::new(store(ttl), "POST", "/rides");
            match completer.grace(grace) {
                Err(Error::InvalidConfig(message)) => {
                    assert!(message.contains(&format!("{grace:?}")), "{message}");
                    assert!(message.contains("30s"), "{message}");
                }
                other => panic!("grace {grace:?} accepted: {other:?}"),
            }
        }
        let completer = Completer::new(store(ttl), "POST", "/rides")
            .grace(ttl + Duration::from_millis(1))
            .unwrap();
        assert_eq!(completer.grace, ttl + Duration::from_millis(1));
    }

    #[tokio::test]
    async fn the_default_grace_exceeds_a_long_lease_ttl() {
        let short = Completer::new(store(Duration::from_secs(30)), "POST", "/rides");
        assert_eq!(short.grace, DEFAULT_GRACE);
        let long = Completer::new(store(Duration::from_secs(60)), "POST", "/rides");
        assert_eq!(long.grace, Duration::from_secs(120));
    }
}
