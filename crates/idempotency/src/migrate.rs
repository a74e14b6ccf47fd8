//! The crate's own migrations, with a bookkeeping table of their own.
//!
//! The crate's tables are created and upgraded by [`migrate`], which records what it applied in
//! `idempotency_schema_migrations`, not in sqlx's `_sqlx_migrations`: an application's own
//! migrator, sqlx-cli included, sees only the application's migrations and needs no
//! `set_ignore_missing` or `--ignore-missing`.
//!
//! Earlier versions of this crate recorded their migrations in `_sqlx_migrations`. [`migrate`]
//! adopts those entries (their checksums must match the crate's files), moves them to its own
//! table, and deletes them from sqlx's: a database upgrades in place, and its tables are not
//! touched again. (Do not run an earlier version's `migrate` against it after that: it would
//! find its entries gone and try to create the tables anew, and fail.)
//!
//! The tables (the bookkeeping table too) are created in the first schema of the connection's
//! `search_path` that exists (`current_schema()`), and only that schema's `_sqlx_migrations` is
//! adopted from: to keep them in a schema of their own, connect with that schema first
//! (`PgConnectOptions::options([("search_path", "payments")])`), as fakestripe does. Every
//! statement of the crate names its tables unqualified, so the same search path must hold for
//! the pool the [`crate::Store`] uses.
//!
//! Several processes may migrate at once: a transaction-level advisory lock makes them take
//! turns, and all of a plain [`migrate`]'s migrations commit with their bookkeeping rows in one
//! transaction. [`migrate_with`] and [`migrate_online`] apply the migrations from before the
//! live-database rule that hold an exclusive lock for long by an online plan instead (the
//! submodule `online`; the crate's own plans in `plans`): short transactions, backfills in
//! batches, indexes built concurrently, each migration recorded with its file's checksum.
//!
//! The migrating session waits at most [`MIGRATION_LOCK_TIMEOUT`] for any lock (migrations whose
//! files set a bound of their own keep theirs): a migration's exclusive lock queues behind every
//! transaction on its table, and every statement on the table queues behind the migration, so an
//! unbounded wait behind one long transaction stalls all traffic. A migration that gives up fails
//! with [`LOCK_TIMEOUT_MESSAGE`] and the sessions that held locks then, and nothing of its
//! transaction is applied: run it again once they are gone (docs/operations.md, "Migrations on a
//! live database").

use std::time::Duration;

use sqlx::migrate::{Migrate, MigrateError, Migration, MigrationType, Migrator};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool, Postgres};
use sqlx::{Connection, Executor, Row, Transaction};

use crate::Error;

mod online;
mod plans;

use online::{check_plans, plan_for, run_plan, Ledger};
pub use online::{OnlinePlan, BACKFILL_BATCH, STEP_LOCK_TIMEOUT};

/// The crate's bookkeeping table.
pub const MIGRATIONS_TABLE: &str = "idempotency_schema_migrations";

/// The advisory lock migrators take turns on: "idempote" in ASCII.
const LOCK: i64 = 0x6964_656d_706f_7465;

/// The longest the migrating session waits for a lock, 5 s, for migrations whose files set none
/// (the earliest do not, and cannot be changed: their checksums are recorded). Far above the
/// milliseconds a booking's transaction holds its locks, so that traffic alone never fails a
/// migration; far below what clients wait before they give up, since every statement on the
/// table queues behind the migration's wait. The files that set their own say 5 s too.
pub const MIGRATION_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// How a migration that gave up waiting for a lock fails; the sessions that held locks follow.
pub const LOCK_TIMEOUT_MESSAGE: &str = "a migration waited too long for a lock and gave up, \
     applying nothing of its transaction; run migrate again once these sessions, which held \
     locks in the database, have finished";

/// Creates or upgrades the crate's tables in the database behind `pool`. Run it before the
/// application's own migrations, whose tables may reference `idempotency_keys (owner, id)`; or
/// run both with [`migrate_with`], which an upgrade that changes what they reference needs.
/// Migrations already applied are checked against the crate's files, and refused if they differ.
///
/// Everything happens in one transaction on one connection, behind the migrators' advisory lock
/// (taken before the transaction begins, by asking until it is free): all of it commits, or
/// nothing does, and concurrent migrators take turns.
pub async fn migrate(pool: &PgPool) -> Result<(), Error> {
    let mut conn = migrating_connection(pool, "apply the idempotency migrations").await?;
    // The turn is taken before the transaction begins: a transaction open while it waits would
    // be one that another migrator's concurrent index build waits for, while it holds the turn.
    session_lock(&mut conn, true).await?;
    let outcome = apply_ours(&mut conn, None, None).await;
    let outcome = explain_lock_timeout(&mut conn, outcome).await;
    let released = session_lock(&mut conn, false).await;
    outcome.and(released)
}

/// A connection of `pool` to migrate on, closed when dropped, so that the bound its session puts
/// on lock waits, and its quiet notices, never reach the pool's other users.
///
/// The session hears only warnings and errors (`client_min_messages = warning`): the online
/// plans' `IF EXISTS` / `IF NOT EXISTS` statements, which let a step run again after a crash,
/// would otherwise send a `NOTICE … does not exist, skipping` for each on a new database, about
/// 30 lines in a log that says nothing went wrong. Warnings still come through, so the commit
/// watch hears a cancelled wait for the standby.
async fn migrating_connection(
    pool: &PgPool,
    context: &str,
) -> Result<PoolConnection<Postgres>, Error> {
    let mut conn = pool.acquire().await.map_err(Error::db(context))?;
    conn.close_on_drop();
    (&mut *conn)
        .execute("SET client_min_messages = warning")
        .await
        .map_err(Error::db(context))?;
    Ok(conn)
}

/// `SET [LOCAL] lock_timeout` to [`MIGRATION_LOCK_TIMEOUT`], for `scope` "SESSION" or "LOCAL".
fn bound_lock_waits(scope: &str) -> String {
    format!(
        "SET {scope} lock_timeout = '{}ms'",
        MIGRATION_LOCK_TIMEOUT.as_millis()
    )
}

/// `outcome`, with the sessions that hold locks when a migration gave up waiting for one.
async fn explain_lock_timeout(
    conn: &mut PgConnection,
    outcome: Result<(), Error>,
) -> Result<(), Error> {
    let source = match &outcome {
        Err(Error::Database { source, .. }) => source,
        _ => return outcome,
    };
    let lock_not_available = source
        .as_database_error()
        .and_then(|e| e.code())
        .is_some_and(|code| code == "55P03");
    if !lock_not_available {
        return outcome;
    }
    // The oldest transactions first: a lock the migration queued behind is held by one of them.
    let holders: Vec<String> = sqlx::query_scalar(
        "SELECT format('pid %s (%s, in a transaction for %s): %s', a.pid, a.state,
                       date_trunc('second', now() - a.xact_start), left(a.query, 200))
         FROM pg_stat_activity a
         WHERE a.pid <> pg_backend_pid() AND a.datname = current_database()
           AND EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.granted
                       AND l.relation IS NOT NULL)
         ORDER BY a.xact_start NULLS LAST LIMIT 5",
    )
    .fetch_all(&mut *conn)
    .await
    .map_err(Error::db("list the sessions holding locks"))?;
    let holders = if holders.is_empty() {
        "none any more".to_owned()
    } else {
        holders.join("; ")
    };
    Err(Error::Migration(format!(
        "{LOCK_TIMEOUT_MESSAGE}: {holders} ({})",
        outcome.unwrap_err()
    )))
}

/// Runs the crate's migrations and the application's `app` in the order of their versions, the
/// crate's first on a tie, as if they were one directory, and records each in its own table (the
/// application's in sqlx's `_sqlx_migrations`, as `app.run` would).
///
/// An application needs this order when the crate changes something the application's rows
/// reference. Version 20261202000001 of the crate turns the owner into text, and refuses while a
/// foreign key references it as `bigint`: the application drops that foreign key in a migration
/// of a lower version and re-creates it on a text column in one of a higher version, and each
/// runs on its side of the crate's, on a database of any age (a new one too, whose old
/// migrations still create the `bigint` reference first).
///
/// **Numbered apart.** When every one of the application's migrations is numbered below the
/// crate's first (sqlx-cli's sequential numbering: 1, 2, 3), the two sets keep each its own
/// order instead: the crate's pending ones first, then the application's, on a new database and
/// an old one alike. When only some are, those numbered below the crate's first run before
/// `idempotency_keys` exists on a new database: one that names the table is refused, naming the
/// versions, before anything is applied.
///
/// A crate migration is applied before the first pending application migration of a higher or
/// equal version; on an existing database, it follows the application's migrations already
/// applied, whatever their versions. A pending application migration below a crate migration
/// applied already is refused, with nothing applied: the crate's plain [`migrate`] ran on the
/// database first (use one of the two on a database, not both), or the migration was numbered
/// below the crate's after the fact.
///
/// The crate's migrations run as [`migrate`] runs them, in a transaction of their own; the
/// application's as sqlx runs them, each in its own unless it asks for none
/// (`-- no-transaction`). sqlx's advisory lock is held throughout, so concurrent
/// `migrate_with`s take turns. Applied application migrations are checked against `app`'s files
/// before anything is applied. One that `app` does not know is found only at the end, by
/// `app.run` (which honours `set_ignore_missing`), after the pending ones ran; sqlx's own `run`
/// would refuse it before.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), idempotency::Error> {
/// idempotency::migrate_with(&pool, &sqlx::migrate!("./migrations")).await?;
/// # Ok(())
/// # }
/// ```
pub async fn migrate_with(pool: &PgPool, app: &Migrator) -> Result<(), Error> {
    migrate_online(pool, app, &[]).await
}

/// [`migrate_with`], with the application's own online plans: a pending application migration
/// that `plans` names is applied by its plan's steps instead of its file, and recorded in
/// `_sqlx_migrations` with its file's checksum, as the file would have been (the module
/// `online`'s essay; docs/operations.md, "Migrations on a live database"). The crate's own
/// plans are always used. A plan that names no migration of `app`, or a version twice, is
/// refused before anything runs.
pub async fn migrate_online(
    pool: &PgPool,
    app: &Migrator,
    plans: &[OnlinePlan],
) -> Result<(), Error> {
    let versions: Vec<i64> = app.iter().map(|m| m.version).collect();
    check_plans(plans, &versions, "application's")?;
    let ours = plans::plans();
    combined(pool, app, Some((&ours, plans))).await
}

/// [`migrate_with`] from the migrations' files alone, no online plan: each pending migration
/// runs in its file's transaction. The reference the plans are compared against (they must
/// reach the same catalog and the same bookkeeping); on a live database with large tables, use
/// [`migrate_with`] or [`migrate_online`].
pub async fn migrate_with_files(pool: &PgPool, app: &Migrator) -> Result<(), Error> {
    combined(pool, app, None).await
}

/// The crate's plans and the application's; `None` to run every migration from its file.
type Plans<'a> = Option<(&'a [OnlinePlan], &'a [OnlinePlan])>;

async fn combined(pool: &PgPool, app: &Migrator, plans: Plans<'_>) -> Result<(), Error> {
    let app_error = |e: MigrateError| Error::Migration(format!("application migrations: {e}"));
    let mut conn =
        migrating_connection(pool, "migrate the idempotency and application tables").await?;
    // Waiting for another migrator is not bounded: it takes its turn once that one is done. The
    // crate's lock first, by polling, then sqlx's, which no other of these migrators then holds.
    session_lock(&mut conn, true).await?;
    // Another tool's sqlx migrator may hold sqlx's lock: waited for as long as it takes.
    let unbounded = (&mut *conn)
        .execute("SET lock_timeout = 0")
        .await
        .map_err(Error::db("take turns with sqlx migrators"));
    let outcome = match unbounded.and(conn.lock().await.map_err(app_error)) {
        Ok(()) => {
            // The application's migrations run on this session as sqlx runs them.
            let outcome = match (&mut *conn).execute(&*bound_lock_waits("SESSION")).await {
                Ok(_) => interleave(&mut conn, app, plans).await,
                Err(e) => Err(Error::db("bound the migration's lock waits")(e)),
            };
            let outcome = explain_lock_timeout(&mut conn, outcome).await;
            // Released before the outcome is told, success or not; a failed release leaves the
            // lock to the connection's end.
            let unlocked = conn.unlock().await.map_err(app_error);
            // What sqlx itself checks of the applied ones (a missing migration, unless the
            // application allows it); nothing is left for it to apply. Still under the crate's
            // lock: its wait for sqlx's lock is a statement that holds a snapshot, which another
            // migrator's CREATE INDEX CONCURRENTLY would wait for while holding that lock.
            match outcome.and(unlocked) {
                Ok(()) => match (&mut *conn).execute("SET lock_timeout = 0").await {
                    Ok(_) => app.run_direct(&mut *conn).await.map_err(app_error),
                    Err(e) => Err(Error::db("take turns with sqlx migrators")(e)),
                },
                Err(e) => Err(e),
            }
        }
        Err(e) => Err(e),
    };
    let released = session_lock(&mut conn, false).await;
    outcome.and(released)
}

async fn interleave(
    conn: &mut PgConnection,
    app: &Migrator,
    plans: Plans<'_>,
) -> Result<(), Error> {
    let ours = plans.map(|(ours, _)| ours);
    let app_error = |e: MigrateError| Error::Migration(format!("application migrations: {e}"));
    let apart = numbered_apart(app);
    if !apart {
        refuse_references_before_the_table(conn, app).await?;
    }
    // Earlier versions of the crate recorded theirs in sqlx's table: adopted before that table
    // is read as the application's. Numbered apart, the crate's all come first.
    apply_ours(conn, (!apart).then_some(i64::MIN), ours).await?;
    conn.ensure_migrations_table().await.map_err(app_error)?;
    if let Some(version) = conn.dirty_version().await.map_err(app_error)? {
        return Err(app_error(MigrateError::Dirty(version)));
    }
    let applied = conn.list_applied_migrations().await.map_err(app_error)?;
    let mut pending = Vec::new();
    for migration in app.iter() {
        if migration.migration_type.is_down_migration() {
            continue;
        }
        match applied.iter().find(|a| a.version == migration.version) {
            Some(a) if a.checksum != migration.checksum => {
                return Err(app_error(MigrateError::VersionMismatch(migration.version)));
            }
            Some(_) => {}
            None => pending.push(migration),
        }
    }
    pending.sort_by_key(|m| m.version);
    // A pending application migration below a crate migration already applied cannot have its
    // place: the crate's plain `migrate` ran on this database before it (its old migrations
    // would then meet a table they were not written for), or it was numbered after the fact.
    let latest_ours: Option<i64> =
        sqlx::query_scalar("SELECT max(version) FROM idempotency_schema_migrations")
            .fetch_one(&mut *conn)
            .await
            .map_err(Error::db("read the idempotency migrations table"))?;
    if let (Some(first), Some(latest), false) = (pending.first(), latest_ours, apart) {
        if first.version < latest {
            return Err(Error::Migration(format!(
                "application migration {} ({}) is pending below the crate's migration {latest}, \
                 applied already, so their order of versions cannot be kept: was the crate's \
                 plain `migrate` run on this database before the application's migrations? Run \
                 only `migrate_with` on a database; number new application migrations above the \
                 crate's; nothing was applied",
                first.version, first.description
            )));
        }
    }
    for migration in pending {
        apply_ours(conn, Some(migration.version), ours).await?;
        if let Some(plan) = plans.and_then(|(_, app)| plan_for(app, migration.version)) {
            run_plan(conn, plan, migration, Ledger::App).await?;
            continue;
        }
        conn.apply(migration).await.map_err(|e| match e {
            // The database's own error, kept so that a lock timeout is told as one.
            MigrateError::Execute(source) | MigrateError::ExecuteMigration(source, _) => {
                Error::Database {
                    context: format!(
                        "apply application migration {} ({})",
                        migration.version, migration.description
                    ),
                    source,
                }
            }
            e => app_error(e),
        })?;
    }
    apply_ours(conn, None, ours).await
}

/// The version of the crate's first migration, the one that creates `idempotency_keys`.
fn first_of_ours() -> i64 {
    let first = sqlx::migrate!("./migrations")
        .iter()
        .map(|m| m.version)
        .min();
    // The crate holds migrations, or it would have no table to create.
    first.unwrap_or(i64::MAX)
}

/// Whether every one of the application's migrations is numbered below the crate's first (as
/// sqlx-cli's sequential numbering, 1, 2, 3, makes them): the two sets then keep each its own
/// order, the crate's before the application's, since an application migration numbered so
/// could not otherwise reference the crate's tables.
fn numbered_apart(app: &Migrator) -> bool {
    let first = first_of_ours();
    let mut ups = app.iter().filter(|m| !m.migration_type.is_down_migration());
    ups.all(|m| m.version < first)
}

/// Refuses, before anything is written, pending application migrations that are numbered below
/// the crate's first migration and name `idempotency_keys`, when others of the application's
/// are numbered among or above the crate's: in the order of versions they run before the table
/// exists, on a new database. (A mention in a comment counts too: the error says what to do.)
async fn refuse_references_before_the_table(
    conn: &mut PgConnection,
    app: &Migrator,
) -> Result<(), Error> {
    let first = first_of_ours();
    let early: Vec<&Migration> = app
        .iter()
        .filter(|m| !m.migration_type.is_down_migration() && m.version < first)
        .filter(|m| m.sql.to_ascii_lowercase().contains("idempotency_keys"))
        .collect();
    if early.is_empty() {
        return Ok(());
    }
    let applied: Vec<i64> = sqlx::query_scalar("SELECT version FROM _sqlx_migrations")
        .fetch_all(&mut *conn)
        .await
        .or_else(|e| match e.as_database_error().and_then(|e| e.code()) {
            // No bookkeeping yet (42P01, undefined table): nothing of the application's applied.
            Some(code) if code == "42P01" => Ok(Vec::new()),
            _ => Err(e),
        })
        .map_err(Error::db("read the application's applied migrations"))?;
    let pending: Vec<String> = early
        .iter()
        .filter(|m| !applied.contains(&m.version))
        .map(|m| format!("{} ({})", m.version, m.description))
        .collect();
    if pending.is_empty() {
        return Ok(());
    }
    let later = app
        .iter()
        .filter(|m| !m.migration_type.is_down_migration() && m.version >= first)
        .map(|m| m.version.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    Err(Error::Migration(format!(
        "application migrations {} name idempotency_keys but are numbered below the crate's first \
         migration, {first}, which creates that table, while others of the application's \
         ({later}) are numbered among or above the crate's: in the order of versions they would \
         run before the table exists. Renumber them above the crate's migrations, or number \
         every application migration below {first} (the crate's then all run first); nothing \
         was applied",
        pending.join(", ")
    )))
}

/// Applies the crate's pending migrations of a version below `below` (all of them when `None`),
/// after adopting what earlier versions recorded in sqlx's table: in one transaction without
/// `plans`; with them, those between two planned ones in one transaction, and each planned one
/// by its plan, under the migrators' advisory lock held by the session.
async fn apply_ours(
    conn: &mut PgConnection,
    below: Option<i64>,
    plans: Option<&[OnlinePlan]>,
) -> Result<(), Error> {
    let migrator = sqlx::migrate!("./migrations");
    while let Some(version) = apply_ours_until_planned(conn, &migrator, below, plans).await? {
        // A version found among the plans and the migrator's own: neither lookup can fail.
        let migration = migrator.iter().find(|m| m.version == version);
        let plan = plans.and_then(|plans| plan_for(plans, version));
        let (Some(migration), Some(plan)) = (migration, plan) else {
            unreachable!("planned migration {version} is the crate's");
        };
        session_lock(conn, true).await?;
        let outcome = run_plan(conn, plan, migration, Ledger::Crate).await;
        let unlocked = session_lock(conn, false).await;
        outcome.and(unlocked)?;
    }
    Ok(())
}

/// Takes (`take`) or releases the crate's migrators' advisory lock at session level, so that a
/// plain [`migrate`] elsewhere waits while a plan runs its transactions; the wait for it is not
/// bounded, as in [`apply_ours_until_planned`].
async fn session_lock(conn: &mut PgConnection, take: bool) -> Result<(), Error> {
    let context = "take turns with other idempotency migrators";
    if take {
        (&mut *conn)
            .execute("SET lock_timeout = 0")
            .await
            .map_err(Error::db(context))?;
        take_turn(conn, "pg_try_advisory_lock")
            .await
            .map_err(Error::db(context))?;
        (&mut *conn)
            .execute(&*bound_lock_waits("SESSION"))
            .await
            .map_err(Error::db(context))?;
    } else {
        sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(LOCK)
            .execute(&mut *conn)
            .await
            .map_err(Error::db(context))?;
    }
    Ok(())
}

/// How often a migrator waiting for its turn asks again.
const TURN_POLL: Duration = Duration::from_millis(50);

/// Takes the migrators' advisory lock with `function` (`pg_try_advisory_lock` or
/// `pg_try_advisory_xact_lock`), asking again until it is free. Not `pg_advisory_lock`: a
/// session blocked in that statement holds a snapshot, and a migrator building an index
/// `CONCURRENTLY` under the lock waits for every older snapshot to end, so the two would wait for
/// each other (PostgreSQL ends one as a deadlock). Between two tries this session holds none.
async fn take_turn(conn: &mut PgConnection, function: &str) -> Result<(), sqlx::Error> {
    let query = format!("SELECT {function}($1)");
    while !sqlx::query_scalar::<_, bool>(&query)
        .bind(LOCK)
        .fetch_one(&mut *conn)
        .await?
    {
        tokio::time::sleep(TURN_POLL).await;
    }
    Ok(())
}

/// One transaction of [`apply_ours`]: the pending migrations below `below` up to the first one
/// `plans` names, which is returned, uncommitted and unapplied, once the others have committed.
async fn apply_ours_until_planned(
    conn: &mut PgConnection,
    migrator: &Migrator,
    below: Option<i64>,
    plans: Option<&[OnlinePlan]>,
) -> Result<Option<i64>, Error> {
    let ours: Vec<&Migration> = migrator
        .iter()
        .filter(|m| !matches!(m.migration_type, MigrationType::ReversibleDown))
        .collect();
    if let Some(m) = ours.iter().find(|m| m.no_tx) {
        // None of the crate's migrations needs to run outside a transaction; say so if one ever
        // asks, rather than apply it half-guarded.
        return Err(Error::Migration(format!(
            "idempotency migration {} asks to run outside a transaction, which migrate does not do",
            m.version
        )));
    }
    let context = "apply the idempotency migrations";
    let mut tx = conn.begin().await.map_err(Error::db(context))?;
    // Other migrators are waited for as long as they take; locks on tables only so long.
    (&mut *tx)
        .execute("SET LOCAL lock_timeout = 0")
        .await
        .map_err(Error::db(context))?;
    take_turn(&mut tx, "pg_try_advisory_xact_lock")
        .await
        .map_err(Error::db("wait for other idempotency migrators"))?;
    (&mut *tx)
        .execute(&*bound_lock_waits("LOCAL"))
        .await
        .map_err(Error::db("bound the migration's lock waits"))?;
    sqlx::query(
        r#"
        CREATE TABLE IF NOT EXISTS idempotency_schema_migrations (
            version     BIGINT      PRIMARY KEY,
            description TEXT        NOT NULL,
            checksum    BYTEA       NOT NULL,
            applied_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
            -- Recorded by an earlier version of the crate in _sqlx_migrations, and moved here.
            adopted     BOOLEAN     NOT NULL DEFAULT false
        )
        "#,
    )
    .execute(&mut *tx)
    .await
    .map_err(Error::db("create the idempotency migrations table"))?;
    adopt(&mut tx, &ours).await?;
    let recorded = sqlx::query("SELECT version, checksum FROM idempotency_schema_migrations")
        .fetch_all(&mut *tx)
        .await
        .map_err(Error::db("read the idempotency migrations table"))?;
    for migration in ours {
        let done = recorded
            .iter()
            .find(|row| row.get::<i64, _>("version") == migration.version);
        match done {
            Some(row) if row.get::<Vec<u8>, _>("checksum") == *migration.checksum => {}
            Some(_) => return Err(changed(migration)),
            // On a tie, the crate's first.
            None if below.is_some_and(|below| migration.version > below) => {}
            None if plans.is_some_and(|plans| plan_for(plans, migration.version).is_some()) => {
                tx.commit().await.map_err(Error::db(context))?;
                return Ok(Some(migration.version));
            }
            None => run(&mut tx, migration).await?,
        }
    }
    tx.commit().await.map_err(Error::db(context))?;
    Ok(None)
}

/// Moves the crate's entries of `_sqlx_migrations`, as earlier versions recorded them, to its
/// own table.
async fn adopt(tx: &mut Transaction<'_, Postgres>, ours: &[&Migration]) -> Result<(), Error> {
    // sqlx's table of this schema only, the one the crate's tables are created in: a table of
    // that name further down the search path is another application's bookkeeping.
    let table: Option<String> = sqlx::query_scalar(
        "SELECT format('%I._sqlx_migrations', current_schema())
         WHERE to_regclass(format('%I._sqlx_migrations', current_schema())) IS NOT NULL",
    )
    .fetch_optional(&mut **tx)
    .await
    .map_err(Error::db("look for sqlx's migrations table"))?;
    let Some(table) = table else {
        return Ok(());
    };
    let versions: Vec<i64> = ours.iter().map(|m| m.version).collect();
    let entries = sqlx::query(&format!(
        "SELECT version, description, success, checksum FROM {table}
         WHERE version = ANY($1) FOR UPDATE"
    ))
    .bind(&versions)
    .fetch_all(&mut **tx)
    .await
    .map_err(Error::db(
        "read sqlx's entries of the idempotency migrations",
    ))?;
    let mut adopted = Vec::new();
    for entry in &entries {
        let version: i64 = entry.get("version");
        let Some(migration) = ours.iter().find(|m| m.version == version) else {
            continue;
        };
        let description: String = entry.get("description");
        let same_contents = entry.get::<Vec<u8>, _>("checksum") == *migration.checksum;
        if !same_contents && description != migration.description {
            // The application's own migration under a version number the crate uses too: not
            // the crate's to adopt, nor to delete.
            tracing::info!(
                version,
                description,
                "an application migration shares a version with an idempotency migration; left alone"
            );
            continue;
        }
        if !same_contents {
            return Err(changed(migration));
        }
        if !entry.get::<bool, _>("success") {
            return Err(Error::Migration(format!(
                "idempotency migration {version} ({}) failed earlier under sqlx's bookkeeping \
                 (_sqlx_migrations.success = false): repair it by hand, then delete that entry",
                migration.description
            )));
        }
        sqlx::query(
            "INSERT INTO idempotency_schema_migrations (version, description, checksum, adopted)
             VALUES ($1, $2, $3, true) ON CONFLICT (version) DO NOTHING",
        )
        .bind(version)
        .bind(migration.description.to_string())
        .bind(migration.checksum.to_vec())
        .execute(&mut **tx)
        .await
        .map_err(Error::db(format!("adopt idempotency migration {version}")))?;
        adopted.push(version);
    }
    // Only the entries adopted, by version and contents: the application's stay.
    sqlx::query(&format!("DELETE FROM {table} WHERE version = ANY($1)"))
        .bind(&adopted)
        .execute(&mut **tx)
        .await
        .map_err(Error::db(
            "remove the idempotency migrations from sqlx's table",
        ))?;
    if !adopted.is_empty() {
        tracing::info!(
            adopted = adopted.len(),
            "idempotency migrations moved from _sqlx_migrations to {MIGRATIONS_TABLE}"
        );
    }
    Ok(())
}

/// Applies one migration and records it, in the migrator's transaction.
async fn run(tx: &mut Transaction<'_, Postgres>, migration: &Migration) -> Result<(), Error> {
    let context = || {
        format!(
            "apply idempotency migration {} ({})",
            migration.version, migration.description
        )
    };
    (&mut **tx)
        .execute(&*migration.sql)
        .await
        .map_err(Error::db(context()))?;
    sqlx::query(
        "INSERT INTO idempotency_schema_migrations (version, description, checksum)
         VALUES ($1, $2, $3)",
    )
    .bind(migration.version)
    .bind(migration.description.to_string())
    .bind(migration.checksum.to_vec())
    .execute(&mut **tx)
    .await
    .map_err(Error::db(context()))?;
    tracing::info!(
        version = migration.version,
        description = %migration.description,
        "applied idempotency migration"
    );
    Ok(())
}

fn changed(migration: &Migration) -> Error {
    Error::Migration(format!(
        "idempotency migration {} ({}) was applied from other contents than this version of the \
         crate holds: the database and the crate disagree about the key table",
        migration.version, migration.description
    ))
}
