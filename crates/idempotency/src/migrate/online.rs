//! Online plans: a migration applied in short steps instead of its file's one transaction.
//!
//! A migration written before the live-database rule (docs/operations.md, "Migrations on a live
//! database") cannot be edited: databases that applied it recorded its checksum. What can change
//! is how a database that has it *ahead* applies it. An [`OnlinePlan`] names a migration by its
//! version and lists steps that reach the same schema without holding an exclusive lock for long:
//!
//! ```text
//!   transaction   a few statements, one short transaction, each lock waited for at most
//!                 STEP_LOCK_TIMEOUT and the whole tried again until MIGRATION_LOCK_TIMEOUT
//!   alone         one statement outside any transaction (CREATE INDEX CONCURRENTLY)
//!   backfill      an UPDATE over ranges of `id`, each range its own transaction
//! ```
//!
//! The migration is then recorded with its file's checksum, as if the file had run, so that
//! sqlx's later runs, and databases that applied the file itself, agree. A test compares the
//! catalog an application's plans produce with the one its files produce (Rocket Rides':
//! `crates/rocket-rides/tests/integration/online_plans.rs`).
//!
//! A plan is not one transaction: one that fails halfway leaves its first steps applied and the
//! migration unrecorded. The next run starts the plan again from its first step, so every step
//! is written to be run again (`IF [NOT] EXISTS`, a concurrent index dropped before it is built).

use std::time::{Duration, Instant};

use sqlx::migrate::Migration;
use sqlx::postgres::PgConnection;
use sqlx::{Connection, Executor};

use crate::Error;

/// Rows of `id` updated by one transaction of a backfill, 5000: a few milliseconds of row locks, so
/// that a booking that updates one of those rows waits far less than its own lock bound.
pub const BACKFILL_BATCH: i64 = 5_000;

/// The longest a plan's transaction step waits for each lock, 200 ms, before it rolls back and is
/// tried again, until [`crate::MIGRATION_LOCK_TIMEOUT`] has passed. While a step waits, it holds the
/// locks it took already and every statement on those tables queues behind it; and a step that
/// locks two tables (a key table and the rides that reference it) can meet an application
/// transaction that took them in the other order, a deadlock that only a timeout ends. Far below
/// the second a booking is allowed to wait, far above the milliseconds a booking holds a lock.
pub const STEP_LOCK_TIMEOUT: Duration = Duration::from_millis(200);

/// How a migration of the given version is applied on a database that has it ahead: the steps, in
/// order, built with the methods below.
#[derive(Debug, Clone)]
pub struct OnlinePlan {
    version: i64,
    steps: Vec<Step>,
}

#[derive(Debug, Clone)]
enum Step {
    Transaction(String),
    Alone(String),
    Backfill { table: String, update: String },
}

impl OnlinePlan {
    /// An empty plan for the migration of `version`.
    pub fn new(version: i64) -> Self {
        Self {
            version,
            steps: Vec::new(),
        }
    }

    /// The version of the migration this plan applies.
    pub fn version(&self) -> i64 {
        self.version
    }

    /// Statements run in one transaction of their own, which waits at most
    /// [`STEP_LOCK_TIMEOUT`] for each lock and is tried again until
    /// [`crate::MIGRATION_LOCK_TIMEOUT`] has passed. Keep them short: no scan, rewrite or
    /// backfill.
    pub fn transaction(mut self, sql: impl Into<String>) -> Self {
        self.steps.push(Step::Transaction(sql.into()));
        self
    }

    /// One statement run outside any transaction: `CREATE INDEX CONCURRENTLY`, `DROP INDEX
    /// CONCURRENTLY`.
    pub fn alone(mut self, sql: impl Into<String>) -> Self {
        self.steps.push(Step::Alone(sql.into()));
        self
    }

    /// An index built `CONCURRENTLY` as `name` from `definition` (what follows `ON`: `"rides
    /// (user_id, id)"`), `unique` or not. A build that failed earlier leaves an invalid index of
    /// that name, so it is dropped first.
    pub fn index_concurrently(self, name: &str, unique: bool, definition: &str) -> Self {
        let unique = if unique { "UNIQUE " } else { "" };
        self.alone(format!("DROP INDEX CONCURRENTLY IF EXISTS {name}"))
            .alone(format!(
                "CREATE {unique}INDEX CONCURRENTLY {name} ON {definition}"
            ))
    }

    /// `update` run once for each range of [`BACKFILL_BATCH`] ids of `table`, from its smallest
    /// `id` to its largest when the backfill starts, each range in a transaction of its own:
    /// `$1` is the range's first id and `$2` the first id after it. Rows inserted later must get
    /// their value otherwise (a default, a trigger), and `update` must skip rows done already
    /// (`AND c IS NULL`), so that the step can run again.
    pub fn backfill(mut self, table: &str, update: impl Into<String>) -> Self {
        self.steps.push(Step::Backfill {
            table: table.to_owned(),
            update: update.into(),
        });
        self
    }

    /// `ALTER COLUMN column SET NOT NULL` without a scan under the exclusive lock: a check
    /// `NOT VALID`, validated under `SHARE UPDATE EXCLUSIVE`, which `SET NOT NULL` then relies
    /// on (PostgreSQL 12 and later), and which is dropped with it.
    pub fn set_not_null(self, table: &str, column: &str) -> Self {
        let check = format!("{table}_{column}_online_not_null");
        self.transaction(format!(
            "ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {check};
             ALTER TABLE {table} ADD CONSTRAINT {check} CHECK ({column} IS NOT NULL) NOT VALID;"
        ))
        .validate(table, &check)
        .transaction(format!(
            "ALTER TABLE {table} ALTER COLUMN {column} SET NOT NULL;
             ALTER TABLE {table} DROP CONSTRAINT {check};"
        ))
    }

    /// `VALIDATE CONSTRAINT`, in a transaction of its own: it scans under `SHARE UPDATE
    /// EXCLUSIVE`, which lets reads and writes go on.
    pub fn validate(self, table: &str, constraint: &str) -> Self {
        self.transaction(format!(
            "ALTER TABLE {table} VALIDATE CONSTRAINT {constraint}"
        ))
    }
}

/// The plan for `version` among `plans`, if any.
pub(super) fn plan_for(plans: &[OnlinePlan], version: i64) -> Option<&OnlinePlan> {
    plans.iter().find(|p| p.version == version)
}

/// Refuses plans that name no migration of `migrations`, or that name one twice: a plan whose
/// version is mistyped would otherwise leave its migration to the file, silently.
pub(super) fn check_plans(
    plans: &[OnlinePlan],
    versions: &[i64],
    whose: &str,
) -> Result<(), Error> {
    for (n, plan) in plans.iter().enumerate() {
        if !versions.contains(&plan.version) {
            return Err(Error::Migration(format!(
                "an online plan names version {}, which is none of the {whose} migrations",
                plan.version
            )));
        }
        if plans[..n].iter().any(|p| p.version == plan.version) {
            return Err(Error::Migration(format!(
                "two online plans name version {}",
                plan.version
            )));
        }
    }
    Ok(())
}

/// Where a migration applied by a plan is recorded: the crate's table, or sqlx's.
#[derive(Debug, Clone, Copy)]
pub(super) enum Ledger {
    Crate,
    App,
}

/// Runs `plan`'s steps on `conn`, which is outside any transaction and whose session bounds its
/// lock waits, and records `migration` in `ledger` with its file's checksum, in the transaction
/// of the last step: a plan is recorded once and only once all of it is applied.
pub(super) async fn run_plan(
    conn: &mut PgConnection,
    plan: &OnlinePlan,
    migration: &Migration,
    ledger: Ledger,
) -> Result<(), Error> {
    let context = |step: usize| {
        format!(
            "apply migration {} ({}) online, step {} of {}",
            migration.version,
            migration.description,
            step + 1,
            plan.steps.len()
        )
    };
    let begun = Instant::now();
    let last_in_transaction = matches!(plan.steps.last(), Some(Step::Transaction(_)));
    for (n, step) in plan.steps.iter().enumerate() {
        match step {
            Step::Transaction(sql) => {
                let last = n + 1 == plan.steps.len();
                let record = last.then_some((migration, ledger, begun));
                transaction_step(conn, sql, record)
                    .await
                    .map_err(Error::db(context(n)))?;
            }
            Step::Alone(sql) => {
                (&mut *conn)
                    .execute(sql.as_str())
                    .await
                    .map_err(Error::db(context(n)))?;
            }
            Step::Backfill { table, update } => {
                backfill(conn, table, update)
                    .await
                    .map_err(Error::db(context(n)))?;
            }
        }
    }
    if !last_in_transaction {
        record_applied(conn, migration, ledger, begun)
            .await
            .map_err(Error::db(format!(
                "record migration {} as applied",
                migration.version
            )))?;
    }
    tracing::info!(
        version = migration.version,
        description = %migration.description,
        steps = plan.steps.len(),
        took = ?begun.elapsed(),
        "applied migration online"
    );
    Ok(())
}

/// One transaction step, tried again while its lock waits run out, until
/// [`crate::MIGRATION_LOCK_TIMEOUT`] has passed; with `record`, the migration is recorded in it.
async fn transaction_step(
    conn: &mut PgConnection,
    sql: &str,
    record: Option<(&Migration, Ledger, Instant)>,
) -> Result<(), sqlx::Error> {
    let deadline = Instant::now() + crate::MIGRATION_LOCK_TIMEOUT;
    loop {
        let outcome = async {
            let mut tx = conn.begin().await?;
            (&mut *tx)
                .execute(&*format!(
                    "SET LOCAL lock_timeout = '{}ms'",
                    STEP_LOCK_TIMEOUT.as_millis()
                ))
                .await?;
            (&mut *tx).execute(sql).await?;
            if let Some((migration, ledger, begun)) = record {
                record_applied(&mut tx, migration, ledger, begun).await?;
            }
            tx.commit().await
        }
        .await;
        match outcome {
            Err(e) if lock_not_available(&e) && Instant::now() < deadline => {
                tokio::time::sleep(STEP_LOCK_TIMEOUT).await;
            }
            outcome => return outcome,
        }
    }
}

fn lock_not_available(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|code| code == "55P03")
}

/// Records `migration` as its file would have been recorded, checksum included.
async fn record_applied(
    conn: &mut PgConnection,
    migration: &Migration,
    ledger: Ledger,
    begun: Instant,
) -> Result<(), sqlx::Error> {
    let elapsed = i64::try_from(begun.elapsed().as_nanos()).unwrap_or(i64::MAX);
    let query = match ledger {
        Ledger::Crate => sqlx::query(
            "INSERT INTO idempotency_schema_migrations (version, description, checksum)
             VALUES ($1, $2, $3)",
        ),
        // As sqlx's own apply writes it, execution_time in nanoseconds.
        Ledger::App => sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES ($1, $2, TRUE, $3, $4)",
        ),
    }
    .bind(migration.version)
    .bind(migration.description.to_string())
    .bind(migration.checksum.to_vec());
    let query = match ledger {
        Ledger::Crate => query,
        Ledger::App => query.bind(elapsed),
    };
    query.execute(&mut *conn).await?;
    Ok(())
}

async fn backfill(conn: &mut PgConnection, table: &str, update: &str) -> Result<(), sqlx::Error> {
    let (first, last): (Option<i64>, Option<i64>) =
        sqlx::query_as(&format!("SELECT min(id), max(id) FROM {table}"))
            .fetch_one(&mut *conn)
            .await?;
    let (Some(first), Some(last)) = (first, last) else {
        return Ok(());
    };
    let mut from = first;
    while from <= last {
        let to = from.saturating_add(BACKFILL_BATCH);
        // Each statement outside a transaction commits by itself: its row locks last one batch.
        sqlx::query(update)
            .bind(from)
            .bind(to)
            .execute(&mut *conn)
            .await?;
        from = to;
    }
    Ok(())
}
