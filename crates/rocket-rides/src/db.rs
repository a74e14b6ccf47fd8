//! Connecting and migrating.

use std::time::Duration;

use idempotency::store::{Statements, StatementsOn};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::PgConnection;

pub mod distribute;
mod online;

/// A connection that sends every query in the key store's statement mode
/// ([`idempotency::Store::statements_on`]), named `pg` where it is used: the service's
/// statements are sent through one, so that behind a transaction pooler
/// (`--database-pooler transaction`) each is unnamed without saying so itself. It wraps the
/// connection of a phase, of [`idempotency::Store::autocommit`] or of a transaction, never the
/// pool: a statement alone on the pool is outside a transaction.
pub type Pg<'c> = StatementsOn<&'c mut PgConnection>;

/// How long to wait for a pooled connection before failing the request (a 500, lease released)
/// rather than queueing without bound when the database is saturated.
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects to `database_url` with a pool of at most `max_connections`.
pub async fn connect(database_url: &str, max_connections: u32) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect(database_url)
        .await
}

/// A pool for a long-running process (`serve`, `worker`): it starts even when the database is
/// down, and connects as it is used. A process that exited whenever PostgreSQL restarts would
/// fail together with it, again and again; this one keeps serving (`/readyz` answers 503, requests
/// that need the database fail) and recovers by itself. The URL is still checked at once, a
/// server that answers with a refusal (credentials, a missing database) fails the start, and a
/// database that does not answer at start is logged.
pub async fn connect_serving(
    database_url: &str,
    max_connections: u32,
) -> Result<PgPool, sqlx::Error> {
    let options: sqlx::postgres::PgConnectOptions = database_url.parse()?;
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect_lazy_with(options);
    match pool.acquire().await {
        Ok(_) => {}
        // The server answered and refused (a wrong password, a database that does not exist):
        // that will not mend by waiting. Other answers (a server shutting down, restarting after
        // a crash) will.
        Err(sqlx::Error::Database(e)) if refusal(e.code().as_deref()) => {
            return Err(sqlx::Error::Database(e))
        }
        Err(e) => tracing::warn!(
            error = %e,
            "the database does not answer; starting anyway, and connecting once it does"
        ),
    }
    Ok(pool)
}

/// Why migrating failed.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// The idempotency crate's migrations.
    #[error(transparent)]
    Library(#[from] idempotency::Error),
    /// The service's own migrations.
    #[error("apply the rocket-rides migrations: {0}")]
    Service(#[from] sqlx::migrate::MigrateError),
    /// The backfill that follows them ([`fill_key_owners`]).
    #[error("fill key_owner of the rows from before 20261206100001: {0}")]
    Fill(#[from] sqlx::Error),
}

/// Applies the idempotency crate's migrations and the service's own, in the order of their
/// versions: `rides` references `idempotency_keys`, by an integer owner before the crate's
/// 20261202000001 and by its text form after. The migrations from before the live-database rule
/// that hold an exclusive lock for long on a large table are applied by their online plans
/// (`online.rs`, and the crate's own), and recorded with their files' checksums.
pub async fn migrate(pool: &PgPool) -> Result<(), MigrateError> {
    // The crate keeps its own bookkeeping, and moves the entries that earlier versions left in
    // sqlx's table to it: sqlx's table holds only the service's migrations.
    idempotency::migrate_online(pool, &migrator(), &online::plans()).await?;
    fill_key_owners(pool).await?;
    Ok(())
}

/// The service's migrations, as their files hold them.
pub fn migrator() -> sqlx::migrate::Migrator {
    sqlx::migrate!("./migrations")
}

/// What [`migrate`] does, with every migration from its file and no online plan: the reference
/// its plans are compared against (`tests/integration/online_plans.rs`).
pub async fn migrate_from_files(pool: &PgPool) -> Result<(), MigrateError> {
    idempotency::migrate_with_files(pool, &migrator()).await?;
    fill_key_owners(pool).await?;
    Ok(())
}

/// The tables that got `key_owner` from 20261206100001, with the column their batches run over.
pub(crate) const KEY_OWNER_FILLED: [(&str, &str); 3] = [
    ("audit_records", "id"),
    ("staged_jobs", "id"),
    ("ride_receipts", "ride_id"),
];

/// Fills `key_owner` of the rows written before 20261206100001 (its trigger fills the rows an
/// earlier version writes since), in ranges of [`idempotency::BACKFILL_BATCH`] ids, each its
/// own transaction: a rerun, or two migrators at once, fill only what is still empty. The
/// service's statements compare `key_owner`, so this runs before the new version starts: it is
/// part of `migrate`.
pub async fn fill_key_owners(pool: &PgPool) -> Result<(), sqlx::Error> {
    // Each statement in a transaction of its own: `migrate` runs this on a direct connection,
    // but the worker's drain (`crate::worker::outbox`) on the service's pool, which may be a
    // transaction pooler's, where an unnamed statement outside a transaction may have its
    // parameters bound to another client's statement (`idempotency::Statements`). Short
    // transactions, one batch each: the backfill never holds many row locks at once.
    for (table, id) in KEY_OWNER_FILLED {
        let mut tx = pool.begin().await?;
        // Unnamed: the SQL is built here for each table, and run a few times at most.
        let mut pg = Statements::Unnamed.on(&mut *tx);
        let (from, to): (Option<i64>, Option<i64>) = sqlx::query_as(&format!(
            "SELECT min({id}), max({id}) FROM {table} WHERE key_owner IS NULL"
        ))
        .fetch_one(&mut pg)
        .await?;
        tx.commit().await?;
        let (Some(mut from), Some(to)) = (from, to) else {
            continue;
        };
        while from <= to {
            let next = from.saturating_add(idempotency::BACKFILL_BATCH);
            let mut tx = pool.begin().await?;
            let mut pg = Statements::Unnamed.on(&mut *tx);
            sqlx::query(&format!(
                "UPDATE {table} SET key_owner = user_id::text
                 WHERE {id} >= $1 AND {id} < $2 AND key_owner IS NULL"
            ))
            .bind(from)
            .bind(next)
            .execute(&mut pg)
            .await?;
            tx.commit().await?;
            from = next;
        }
    }
    Ok(())
}

/// Whether a server's error at connection is a refusal that waiting will not mend: SQLSTATE
/// class 28 (invalid authorization) and 3D000 (the database does not exist).
fn refusal(code: Option<&str>) -> bool {
    code.is_some_and(|code| code.starts_with("28") || code == "3D000")
}

#[cfg(test)]
mod tests {
    use super::refusal;

    #[test]
    fn only_credentials_and_missing_databases_are_refusals() {
        // 28P01 wrong password, 28000 no pg_hba entry, 3D000 no such database.
        for code in ["28P01", "28000", "3D000"] {
            assert!(refusal(Some(code)), "{code}");
        }
        // 57P01 shutting down, 57P02 crash of another backend, 57P03 starting up, 53300 too many
        // connections: each mends by waiting.
        for code in ["57P01", "57P02", "57P03", "53300"] {
            assert!(!refusal(Some(code)), "{code}");
        }
        assert!(!refusal(None));
    }
}
