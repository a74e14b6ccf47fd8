//! [`Store::builder`]: one way to make a store, with a default for everything but the pool.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use super::model::{Store, DEFAULT_LEASE_TTL};
use super::Statements;
use crate::observe::Observer;
use crate::{Clock, DatabaseClock, Error};

/// How long a finished key answers for its request when the builder is told nothing: 48 hours.
///
/// Stripe keeps its keys 24 hours; twice that lets a client's retries outlast a day-long outage
/// of its own and still replay. The [`Reaper`](crate::runner::Reaper) deletes keys past it.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(48 * 3600);

/// Makes a [`Store`]: see [`Store::builder`].
#[must_use = "a builder does nothing until `build`"]
pub struct StoreBuilder {
    pool: PgPool,
    clock: Arc<dyn Clock>,
    lease_ttl: Duration,
    heartbeat: Option<Duration>,
    retention: Option<Duration>,
    observer: Option<Arc<dyn Observer>>,
    statements: Statements,
}

impl std::fmt::Debug for StoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreBuilder")
            .field("lease_ttl", &self.lease_ttl)
            .field("heartbeat", &self.heartbeat)
            .field("retention", &self.retention)
            .field("statements", &self.statements)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// A store over `pool` with the defaults: the database's clock ([`DatabaseClock`]), leases of
    /// [`DEFAULT_LEASE_TTL`] (30 s) renewed every third of it, a retention of
    /// [`DEFAULT_RETENTION`] (48 h), no observer, prepared statements. Each setting is checked
    /// by [`StoreBuilder::build`], which refuses one out of range with
    /// [`Error::InvalidConfig`].
    ///
    /// ```no_run
    /// # async fn example(pool: sqlx::PgPool) -> Result<(), idempotency::Error> {
    /// let store = idempotency::Store::builder(pool).build()?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn builder(pool: PgPool) -> StoreBuilder {
        StoreBuilder {
            pool,
            clock: Arc::new(DatabaseClock),
            lease_ttl: DEFAULT_LEASE_TTL,
            heartbeat: None,
            retention: Some(DEFAULT_RETENTION),
            observer: None,
            statements: Statements::Prepared,
        }
    }
}

impl StoreBuilder {
    /// The clock for lease arithmetic: a [`ManualClock`](crate::ManualClock) in tests.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The lease TTL (see [`DEFAULT_LEASE_TTL`] for what it must exceed).
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// The period of the lease's renewal during a foreign call ([`Store::with_heartbeat`]); by
    /// default a third of the TTL.
    pub fn heartbeat(mut self, period: Duration) -> Self {
        self.heartbeat = Some(period);
        self
    }

    /// How long a finished key answers for its request ([`Store::with_retention`]).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = Some(retention);
        self
    }

    /// Keeps finished keys for as long as their rows exist: no expiry at read, and no reaper.
    pub fn keep_forever(mut self) -> Self {
        self.retention = None;
        self
    }

    /// Reports claims and phases to `observer` ([`Store::with_observer`]).
    pub fn observer(mut self, observer: Arc<dyn Observer>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// How statements are sent ([`Store::with_statements`]): unnamed behind a transaction pooler.
    pub fn statements(mut self, statements: Statements) -> Self {
        self.statements = statements;
        self
    }

    /// The store, or [`Error::InvalidConfig`] naming the first setting out of range.
    pub fn build(self) -> Result<Store, Error> {
        let mut store = Store::new(self.pool, self.clock, self.lease_ttl)?;
        if let Some(period) = self.heartbeat {
            store = store.with_heartbeat(period)?;
        }
        if let Some(retention) = self.retention {
            store = store.with_retention(retention)?;
        }
        if let Some(observer) = self.observer {
            store = store.with_observer(observer);
        }
        Ok(store.with_statements(self.statements))
    }
}
