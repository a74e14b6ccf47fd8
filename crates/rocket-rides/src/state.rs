//! The service's shared state: what every handler, the booking and the worker need.

use std::sync::Arc;
use std::time::Duration;

use idempotency::{Clock, Store};
use sqlx::PgPool;
use tokio_util::task::TaskTracker;

use crate::auth::cache::{ApiKeyCache, DEFAULT_API_KEY_CACHE_TTL};
use crate::config::{GatewayArgs, HttpArgs, LeaseArgs};
use crate::failpoints::Failpoints;
use crate::metrics::Metrics;
use crate::shutdown::Signal;
use crate::stripe::StripeClient;

/// Why the service's state could not be built.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A setting, or a relation between settings, does not hold.
    #[error("invalid settings: {0}")]
    Settings(String),
    /// The key store refused its configuration.
    #[error(transparent)]
    Store(#[from] idempotency::Error),
    /// The gateway client could not be built.
    #[error(transparent)]
    Gateway(#[from] crate::stripe::ClientError),
}

/// Everything a handler needs. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    /// The database. Statements are not sent on it alone: through [`Store::autocommit`] or a
    /// transaction, so that they are safe behind a transaction pooler too.
    pub pool: PgPool,
    /// The idempotency key store, over the same pool; it renews leases every `--lease-heartbeat`
    /// while a request waits on the gateway.
    pub store: Store,
    /// The payment gateway.
    pub stripe: StripeClient,
    /// The API keys looked up lately (`--api-key-cache-ttl`).
    pub api_keys: ApiKeyCache,
    /// How long after its first use a gateway key is trusted to be remembered.
    pub gateway_key_window: Duration,
    /// How long the gateway may still be working on a request we sent: no reconciling list is
    /// made before the last call under the current key is older than this.
    pub gateway_processing_bound: Duration,
    /// Fires when in-flight work must give up its lease (the shutdown deadline passed).
    pub giving_up: Signal,
    /// Counters for `GET /metrics`.
    pub metrics: Metrics,
    /// The edge's limits (timeouts, connections, requests in flight).
    pub http: HttpArgs,
    /// The bookings running detached from their connections: shutdown waits for them.
    pub tasks: TaskTracker,
    /// Crash points armed by tests (empty in builds without the `failpoints` feature).
    pub failpoints: Failpoints,
}

impl AppState {
    /// Builds the state from validated settings.
    pub fn new(
        pool: PgPool,
        clock: Arc<dyn Clock>,
        gateway: &GatewayArgs,
        lease: &LeaseArgs,
    ) -> Result<Self, StartError> {
        crate::config::validate(gateway, lease).map_err(StartError::Settings)?;
        let metrics = Metrics::default();
        metrics.pool_max(pool.options().get_max_connections());
        let api_keys = ApiKeyCache::new(DEFAULT_API_KEY_CACHE_TTL, clock.clone());
        let store = Store::new(pool.clone(), clock, lease.lease_ttl)?
            .with_heartbeat(lease.lease_heartbeat)?
            .with_observer(Arc::new(metrics.clone()));
        let stripe = gateway.client()?;
        Ok(Self {
            pool,
            store,
            stripe,
            api_keys,
            gateway_key_window: gateway.gateway_key_window,
            gateway_processing_bound: gateway.gateway_processing_bound,
            giving_up: Signal::never(),
            http: HttpArgs::default(),
            tasks: TaskTracker::new(),
            metrics,
            failpoints: Failpoints::from_env().map_err(StartError::Settings)?,
        })
    }

    /// Makes the key store, and every statement of the service with it, send its statements as
    /// `statements` says (`--database-pooler`, [`crate::config::DatabasePooler`]). The
    /// service's own statements follow the store: each is sent through a [`crate::db::Pg`],
    /// the connection wrapped once by [`Store::statements_on`], and those that stand alone
    /// are sent on [`Store::autocommit`]'s connection, never on [`AppState::pool`] alone.
    pub fn with_statements(mut self, statements: idempotency::Statements) -> Self {
        self.store = self.store.with_statements(statements);
        self
    }

    /// Keeps API keys for `ttl` after their look-up (`--api-key-cache-ttl`, at most
    /// [`crate::auth::cache::MAX_API_KEY_CACHE_TTL`]; zero looks every key up on every request).
    pub fn with_api_key_cache_ttl(mut self, ttl: Duration) -> Result<Self, StartError> {
        crate::config::validate_api_key_cache_ttl(ttl).map_err(StartError::Settings)?;
        self.api_keys = self.api_keys.with_ttl(ttl);
        Ok(self)
    }

    /// Gives the key store its retention (`--key-retention`, at least 24 h): a key that
    /// finished longer ago is answered as a new request ([`Store::with_retention`]), so the
    /// answer to a late retry depends on the key's age only, not on when the reaper last ran.
    /// `serve` and `worker` set it; without it, keys replay until they are reaped.
    pub fn with_key_retention(mut self, retention: Duration) -> Result<Self, StartError> {
        crate::config::validate_key_retention(retention).map_err(StartError::Settings)?;
        self.store = self.store.with_retention(retention)?;
        Ok(self)
    }
}
