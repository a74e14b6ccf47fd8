//! [`Store::builder`]: one way to make a store, with a default for everything but the pool; the
//! rules its settings are checked by; and [`Store::with_retention`], the older setter of one.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use super::model::{Store, DEFAULT_LEASE_TTL};
use super::Statements;
use crate::observe::{Observed, Observer};
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

    /// Sets how long a finished key answers for its request: between [`Store::MIN_RETENTION`]
    /// (an hour) and [`Store::MAX_RETENTION`].
    ///
    /// **Expiry at read.** A claim ([`Store::claim`], [`Store::begin`],
    /// [`Store::begin_optimistic`]) that finds the key finished more than `retention` ago
    /// (`finished_at < now - retention`, by the store's clock) answers it as it would a key never
    /// seen: in one transaction it deletes the old row and inserts a new one, with a new id, a new
    /// [`Lease::request_uuid`](crate::Lease::request_uuid) (so foreign keys derived from it are new too) and token 1. The
    /// payload does not matter: another payload after expiry is a new request, not a
    /// [`Claim::Mismatch`](crate::Claim::Mismatch). So whether a late retry replays or runs again depends only on the
    /// time since its key finished, never on when a reaper last ran. An unfinished key never
    /// expires: it still owes a result.
    ///
    /// **The reaper agrees.** [`Store::reap_expired`] deletes, with this retention, exactly the
    /// keys a claim would find expired (the same age test); it only keeps the table small.
    ///
    /// **Rows that reference keys.** The old row is deleted, so a foreign key to
    /// `idempotency_keys` must allow that: `ON DELETE SET NULL` keeps the application's rows
    /// (Rocket Rides' rides). A `RESTRICT` or `NO ACTION` foreign key with a referencing row makes
    /// the claim fail with an [`Error::Database`] that says so, and changes nothing; the key keeps
    /// failing until the reference is gone.
    ///
    /// **Concurrent claims** of an expired key: the delete is fenced on the row's id and
    /// `finished_at` and re-checks the age; the first claimer's delete locks the old row until its
    /// transaction ends, and the others then find it gone and read again: they see the new row
    /// held ([`Claim::InFlight`](crate::Claim::InFlight)) or, once it finished, its replay. Exactly one of them runs.
    ///
    /// By default a store has no retention, so that upgrading the library changes no answer:
    /// keys replay until something deletes them ([`Store::reap_finished`]), as before.
    pub fn with_retention(mut self, retention: Duration) -> Result<Self, Error> {
        self.retention = Some(check_retention(retention)?);
        Ok(self)
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
    ///
    /// Every rule on a store's settings is written once, below, and checked here; the older
    /// [`Store::new`] is this builder with no retention, and [`Store::with_heartbeat`] and
    /// [`Store::with_retention`] apply the same rules.
    pub fn build(self) -> Result<Store, Error> {
        check_lease_ttl(self.lease_ttl)?;
        let heartbeat = match self.heartbeat {
            Some(period) => check_heartbeat(self.lease_ttl, period)?,
            None => self.lease_ttl / 3,
        };
        let retention = self.retention.map(check_retention).transpose()?;
        Ok(Store {
            pool: self.pool,
            clock: self.clock,
            lease_ttl: self.lease_ttl,
            heartbeat,
            observer: self.observer.map_or_else(Observed::none, Observed::new),
            retention,
            statements: self.statements,
        })
    }
}

/// A lease TTL between 1 s and 1 h: shorter, a phase or a renewal cannot be sure to make it;
/// longer, a dead holder keeps its key locked for longer than any client waits.
fn check_lease_ttl(ttl: Duration) -> Result<Duration, Error> {
    if ttl < Duration::from_secs(1) || ttl > Duration::from_secs(3600) {
        return Err(Error::InvalidConfig(format!(
            "lease TTL must be between 1 s and 1 h, got {ttl:?}"
        )));
    }
    Ok(ttl)
}

/// A heartbeat above zero and below half of the lease TTL, so that a renewal that fails once is
/// tried again before the lease ends.
pub(crate) fn check_heartbeat(ttl: Duration, period: Duration) -> Result<Duration, Error> {
    if period.is_zero() || period * 2 >= ttl {
        return Err(Error::InvalidConfig(format!(
            "the heartbeat must be above zero and below half of the lease TTL ({ttl:?}), got \
             {period:?}"
        )));
    }
    Ok(period)
}

/// A retention between [`Store::MIN_RETENTION`] and [`Store::MAX_RETENTION`] (why: there).
fn check_retention(retention: Duration) -> Result<Duration, Error> {
    if !(Store::MIN_RETENTION..=Store::MAX_RETENTION).contains(&retention) {
        return Err(Error::InvalidConfig(format!(
            "the key retention must be between 1 h and 10 years (for good: set none), got \
             {retention:?}"
        )));
    }
    Ok(retention)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .unwrap()
    }

    fn refused(built: Result<Store, Error>) -> String {
        match built {
            Err(Error::InvalidConfig(why)) => why,
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn build_refuses_each_setting_out_of_range_and_the_older_paths_say_the_same() {
        let ttl = refused(Store::builder(pool()).lease_ttl(Duration::ZERO).build());
        assert!(
            ttl.contains("lease TTL must be between 1 s and 1 h"),
            "{ttl}"
        );
        let new = Store::new(pool(), Arc::new(DatabaseClock), Duration::ZERO);
        assert_eq!(refused(new), ttl);

        let (thirty, fifteen) = (Duration::from_secs(30), Duration::from_secs(15));
        let beat = refused(Store::builder(pool()).heartbeat(fifteen).build());
        assert!(
            beat.contains("below half of the lease TTL (30s), got 15s"),
            "{beat}"
        );
        let store = Store::new(pool(), Arc::new(DatabaseClock), thirty).unwrap();
        assert_eq!(refused(store.with_heartbeat(fifteen)), beat);

        let short = Duration::from_secs(3599);
        let kept = refused(Store::builder(pool()).retention(short).build());
        assert!(kept.contains("between 1 h and 10 years"), "{kept}");
        let store = Store::new(pool(), Arc::new(DatabaseClock), thirty).unwrap();
        assert_eq!(refused(store.with_retention(short)), kept);
    }

    #[tokio::test]
    async fn build_applies_what_it_accepts() {
        let store = Store::builder(pool())
            .lease_ttl(Duration::from_secs(9))
            .heartbeat(Duration::from_secs(4))
            .retention(Store::MIN_RETENTION)
            .build()
            .unwrap();
        assert_eq!(store.lease_ttl(), Duration::from_secs(9));
        assert_eq!(store.heartbeat(), Duration::from_secs(4));
        assert_eq!(store.retention(), Some(Store::MIN_RETENTION));
        let defaults = Store::builder(pool()).build().unwrap();
        assert_eq!(defaults.heartbeat(), DEFAULT_LEASE_TTL / 3);
        assert_eq!(defaults.retention(), Some(DEFAULT_RETENTION));
        let bare = Store::new(pool(), Arc::new(DatabaseClock), DEFAULT_LEASE_TTL).unwrap();
        assert_eq!(bare.retention(), None);
    }
}
