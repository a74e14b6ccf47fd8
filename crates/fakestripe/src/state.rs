//! The gateway's shared state: the database, the idempotency store, the faults, the scripted
//! charges and the counters, and the test gate; and the gateway's own key retention.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::response::Response;
use idempotency::{DatabaseClock, Store};
use sqlx::PgPool;

use crate::api_error::ApiError;
use crate::faults::{FaultCounters, FaultKind, FaultState, Faults, InvalidFaults, Plan};
use crate::scripted::{InvalidScript, Scripted};

/// How long a request holds its idempotency key before another request may take it over.
///
/// A gateway request holds its key from the claim to the commit of its single phase, which
/// includes the injected latency; the TTL must stay larger than
/// [`crate::MAX_LATENCY_MS`] plus one phase, or a slow request would lose its key to a
/// retry and fail at commit. It is also how long a key stays locked (retries get 409) when the
/// gateway dies mid-request.
pub const LEASE_TTL: Duration = Duration::from_secs(30);

/// How long Stripe keeps an idempotency key: it may prune a key once it is 24 hours old, and a
/// request with a pruned key runs afresh. `fakestripe --idempotency-key-ttl` changes it.
pub const DEFAULT_IDEMPOTENCY_KEY_TTL: Duration = Duration::from_secs(24 * 3600);

/// Keys forgotten per statement.
const FORGET_BATCH: i64 = 1000;

/// Forgets keys older than `ttl` every `ttl / 10` (at least every second, at most every minute)
/// until the process ends: the gateway's own retention, run by the `fakestripe` binary.
pub async fn forget_expired_keys(state: AppState, ttl: Duration) {
    let period = (ttl / 10).clamp(Duration::from_secs(1), Duration::from_secs(60));
    let mut ticker = tokio::time::interval(period);
    loop {
        ticker.tick().await;
        match state.forget_keys(ttl).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(keys = n, "forgot idempotency keys past their window"),
            Err(e) => tracing::warn!(error = %e, "could not forget expired idempotency keys"),
        }
    }
}

/// The state shared by every handler. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    store: Store,
    /// The faults, the scripts and the counters. Held only to read, draw or append, never
    /// across an await.
    faults: Mutex<FaultState>,
    /// Open (true) unless a test holds charges at the gate; see [`AppState::hold_charges`].
    gate: tokio::sync::watch::Sender<bool>,
    /// How many charges wait at the gate now.
    held: tokio::sync::watch::Sender<usize>,
    /// Account ids by secret key (accounts are never deleted, so an entry never goes stale).
    /// Held only to read or insert, never across an await.
    accounts: Mutex<HashMap<String, i64>>,
}

/// The most secret keys whose accounts are cached; more are looked up every time.
const CACHED_ACCOUNTS: usize = 10_000;

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("faults", &self.faults())
            .finish_non_exhaustive()
    }
}

impl AppState {
    /// A state over a pool made by [`crate::connect`], with the given faults.
    ///
    /// # Panics
    ///
    /// If `faults` is out of range; check it first with [`Faults::validate`].
    pub fn new(pool: PgPool, faults: Faults) -> Self {
        if let Err(e) = faults.validate() {
            panic!("invalid faults: {e}");
        }
        // LEASE_TTL is a constant inside the store's accepted range (1 s to 1 h).
        let store = Store::new(pool.clone(), Arc::new(DatabaseClock), LEASE_TTL)
            .expect("LEASE_TTL is a valid lease TTL");
        Self {
            inner: Arc::new(Inner {
                pool,
                store,
                faults: Mutex::new(FaultState::new(faults)),
                gate: tokio::sync::watch::channel(true).0,
                held: tokio::sync::watch::channel(0).0,
                accounts: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The cached account id of a secret key.
    pub(crate) fn cached_account(&self, secret_key: &str) -> Option<i64> {
        self.lock_accounts().get(secret_key).copied()
    }

    /// Caches the account id of a secret key, unless the cache is full.
    pub(crate) fn cache_account(&self, secret_key: String, id: i64) {
        let mut accounts = self.lock_accounts();
        if accounts.len() < CACHED_ACCOUNTS {
            accounts.insert(secret_key, id);
        }
    }

    fn lock_accounts(&self) -> MutexGuard<'_, HashMap<String, i64>> {
        // A panic while holding the lock cannot leave the map inconsistent: reads and single
        // inserts only.
        self.inner
            .accounts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Replaces the faults (and reseeds their generator) for the requests that follow.
    ///
    /// # Panics
    ///
    /// If `faults` is out of range; [`AppState::try_set_faults`] returns the error instead.
    pub fn set_faults(&self, faults: Faults) {
        if let Err(e) = self.try_set_faults(faults) {
            panic!("invalid faults: {e}");
        }
    }

    /// Replaces the faults if they are valid.
    pub fn try_set_faults(&self, faults: Faults) -> Result<(), InvalidFaults> {
        faults.validate()?;
        self.lock_faults().set(faults);
        Ok(())
    }

    /// The current faults.
    pub fn faults(&self) -> Faults {
        self.lock_faults().faults().clone()
    }

    /// How many faults of each kind were injected so far.
    pub fn counters(&self) -> FaultCounters {
        self.lock_faults().counters()
    }

    /// Appends actions to `customer`'s script: each of its next charges that pass validation
    /// takes the first action left, in place of the faults drawn for it ([`Scripted`]).
    ///
    /// # Panics
    ///
    /// If an action is out of range or the queue would grow too long;
    /// [`AppState::try_script_charges`] returns the error instead.
    pub fn script_charges(&self, customer: &str, actions: Vec<Scripted>) {
        if let Err(e) = self.try_script_charges(customer, actions) {
            panic!("invalid script: {e}");
        }
    }

    /// Appends actions to `customer`'s script if every one is valid (otherwise none is), and
    /// returns how many wait for the customer now.
    pub fn try_script_charges(
        &self,
        customer: &str,
        actions: Vec<Scripted>,
    ) -> Result<usize, InvalidScript> {
        self.lock_faults().script(customer, actions)
    }

    /// How many scripted actions wait for `customer`.
    pub fn scripted_left(&self, customer: &str) -> usize {
        self.lock_faults().scripted_left(customer)
    }

    /// Drops the actions waiting for `customer` (its next charges go as drawn); returns how many
    /// there were.
    pub fn clear_script(&self, customer: &str) -> usize {
        self.lock_faults().clear_script(customer)
    }

    /// Holds every charge that has claimed its key, before it commits, until
    /// [`AppState::release_charges`]: a test signal, so that "the gateway is slow" or "the
    /// gateway charges after the caller gave up" is a state a test sets, not a race it wins.
    pub fn hold_charges(&self) {
        self.inner.gate.send_replace(false);
    }

    /// Lets held charges go on, and the ones that follow through.
    pub fn release_charges(&self) {
        self.inner.gate.send_replace(true);
    }

    /// Resolves once at least `count` charges wait at the gate.
    pub async fn charges_held(&self, count: usize) {
        let mut held = self.inner.held.subscribe();
        // The sender lives in `self`, so the channel cannot close while we wait.
        let _ = held.wait_for(|n| *n >= count).await;
    }

    /// Waits at the gate while it is closed.
    pub(crate) async fn pass_gate(&self) {
        let mut gate = self.inner.gate.subscribe();
        if *gate.borrow() {
            return;
        }
        self.inner.held.send_modify(|n| *n += 1);
        let _ = gate.wait_for(|open| *open).await;
        self.inner.held.send_modify(|n| *n -= 1);
    }

    /// Forgets every idempotency key that finished more than `older_than` ago, as Stripe prunes
    /// keys once they are 24 hours old: a request sent later with such a key runs afresh.
    /// Returns how many keys were forgotten.
    pub async fn forget_keys(&self, older_than: Duration) -> Result<u64, crate::Error> {
        let mut forgotten = 0;
        loop {
            let batch = self.store().reap_finished(older_than, FORGET_BATCH).await?;
            forgotten += batch;
            if batch < FORGET_BATCH as u64 {
                break;
            }
        }
        self.lock_faults().record_forgotten(forgotten);
        Ok(forgotten)
    }

    /// Settles every `pending` charge as `succeeded`, or as `failed` (declined); returns how
    /// many. A test decides when a pending charge settles; Stripe decides on its own.
    pub async fn settle_pending_charges(&self, succeeded: bool) -> Result<u64, crate::Error> {
        crate::db::settle_pending_charges(self.pool(), succeeded).await
    }

    /// The database pool (its connections use the `fakestripe` schema).
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    pub(crate) fn store(&self) -> &Store {
        &self.inner.store
    }

    /// The faults of one charge request of `customer`: drawn, or scripted.
    pub(crate) fn plan_faults(&self, customer: &str) -> Plan {
        self.lock_faults().plan_for(customer)
    }

    /// Counts one injected fault.
    pub(crate) fn record_fault(&self, kind: FaultKind) {
        self.lock_faults().record(kind);
    }

    fn lock_faults(&self) -> MutexGuard<'_, FaultState> {
        // A poisoned lock means a thread panicked while holding it; the fault settings and
        // counters are plain values that stay consistent, so carry on with them.
        self.inner.faults.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Runs a request's work in a task of its own, so that a client that hangs up (a timeout, a
/// dropped connection) cannot cancel it half-way: the gateway finishes what it started and
/// releases the key, as Stripe does, and the client's retry finds the outcome.
pub(crate) async fn run_detached<F>(work: F) -> Result<Response, ApiError>
where
    F: Future<Output = Result<Response, ApiError>> + Send + 'static,
{
    match tokio::spawn(work).await {
        Ok(result) => result,
        Err(join) => {
            tracing::error!(error = %join, "request task failed");
            Err(ApiError::server_error())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::sync::{oneshot, Notify};

    use super::*;

    #[tokio::test]
    async fn detached_work_finishes_after_its_caller_is_dropped() {
        let gate = Arc::new(Notify::new());
        let (done_tx, done_rx) = oneshot::channel();
        let work = {
            let gate = gate.clone();
            async move {
                gate.notified().await;
                let _ = done_tx.send(());
                Ok(Response::default())
            }
        };
        let mut caller = Box::pin(run_detached(work));
        // Poll the caller once, so that it spawns the work, then drop it, as hyper drops a
        // handler whose client hung up.
        tokio::select! {
            biased;
            _ = &mut caller => unreachable!("the work waits for the gate"),
            () = std::future::ready(()) => {}
        }
        drop(caller);
        gate.notify_one();
        done_rx
            .await
            .expect("the work ran to its end without its caller");
    }
}
