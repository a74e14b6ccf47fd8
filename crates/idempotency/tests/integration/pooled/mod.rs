//! The store's pool in a test: direct, or through the PgBouncer in transaction pooling that
//! `IDEMPOTENCY_TEST_POOLER_URL` names (`scripts/pgbouncer.sh` starts one; `scripts/test.sh`
//! runs the store's tests through it). The test's database is created and migrated on the
//! direct URL as usual; only the store's statements (and the test's own inside phases, sent
//! through `store.statements_on(phase.conn())`) go through the pooler.

use std::str::FromStr;

use std::sync::Arc;
use std::time::Duration;

use idempotency::{Clock, Statements, Store};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

/// The variable that names the pooler; its database name is replaced by the test's.
pub(crate) const POOLER_URL: &str = "IDEMPOTENCY_TEST_POOLER_URL";

/// The pool and the statements the store of a test over `pool`'s database uses: through the
/// pooler with [`Statements::Unnamed`] when [`POOLER_URL`] is set, else `pool` itself.
#[allow(dead_code)] // tests/integration/pooler.rs makes its pools itself
pub(crate) fn store_pool(pool: &PgPool) -> (PgPool, Statements) {
    match pooler_pool(pool) {
        Some(pooled) => (pooled, Statements::Unnamed),
        None => (pool.clone(), Statements::Prepared),
    }
}

/// A store over `pool`'s database as [`store_pool`] tells.
#[allow(dead_code)] // tests/integration/pooler.rs makes its stores itself
pub(crate) fn store(pool: &PgPool, clock: Arc<dyn Clock>, ttl: Duration) -> Store {
    let (pool, statements) = store_pool(pool);
    Store::new(pool, clock, ttl)
        .unwrap()
        .with_statements(statements)
}

/// A pool on `pool`'s database through the pooler, when [`POOLER_URL`] is set.
pub(crate) fn pooler_pool(pool: &PgPool) -> Option<PgPool> {
    let url = std::env::var(POOLER_URL).ok().filter(|u| !u.is_empty())?;
    let database = pool
        .connect_options()
        .get_database()
        .expect("a test pool names its database")
        .to_owned();
    let options = PgConnectOptions::from_str(&url)
        .unwrap_or_else(|e| panic!("{POOLER_URL} is not a PostgreSQL URL: {e}"))
        .database(&database);
    Some(
        PgPoolOptions::new()
            .max_connections(5)
            // As sqlx's test pools: connections left idle close soon, so that the pooler's to
            // the test database do too, before the database is dropped.
            .idle_timeout(Some(Duration::from_secs(1)))
            .connect_lazy_with(options),
    )
}
