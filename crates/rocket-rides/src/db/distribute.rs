//! `rocket-rides distribute`: the migrated tables spread over a Citus cluster
//! (docs/scaling.md, "Distributing with Citus", tells the layout and why).
//!
//! The layout: one colocation group. The library's key tables are distributed by the key's
//! `owner` (text) and the service's tables by `key_owner`, the same text (`user_id::text`, held
//! to it by a check on every table), colocated with `idempotency_keys`: a user's keys, rides,
//! audit records, jobs and receipts share one shard, so a booking commits on one node. `users`
//! is a reference table (a copy on every node); `failed_jobs` stays on the coordinator.
//!
//! Citus checks foreign keys and unique constraints when it distributes a table, and refuses
//! some that PostgreSQL allows, so the steps run in an order that works:
//!
//! 1. `key_owner` filled and `NOT NULL` on every service table (the migrations' trigger that
//!    filled it for an earlier version's inserts goes: the service writes it itself);
//! 2. the foreign keys among these tables dropped (a table with a foreign key to a local table
//!    cannot be distributed, and `create_reference_table('users')` first would turn every table
//!    that references `users` into a local table of Citus, which cannot be distributed);
//! 3. every primary key and unique constraint of the service's tables made to include
//!    `key_owner` ([`KEYS`]): Citus keeps none without the distribution column;
//! 4. the tables distributed, then `users` made a reference table;
//! 5. the foreign keys of the distributed layout added ([`REFERENCES`]).
//!
//! Each step does only what is not done yet, so a run that fails half-way (a lost connection,
//! a worker down) is finished by running the command again. The reference from `rides` to
//! `idempotency_keys` is not among the foreign keys added back: Citus refuses its
//! `ON DELETE SET NULL` on a key that includes the distribution column, and without it the
//! library's reaper could not delete a finished key that has a ride. A ride whose key is reaped
//! keeps the key's id, which no key takes again.

use anyhow::Context;
use idempotency::store::Statements;
use sqlx::{PgConnection, PgPool};

use super::Pg;

/// What `distribute` says, before it changes anything, on a server without Citus.
pub const WITHOUT_CITUS: &str = "this database has no Citus extension (CREATE EXTENSION citus \
     on the coordinator, add the workers with citus_add_node, then run rocket-rides distribute \
     again): nothing was changed";

/// The distributed tables with their distribution column, in the order they are distributed:
/// the first is the one the others are colocated with.
pub const TABLES: [(&str, &str); 6] = [
    ("idempotency_keys", "owner"),
    ("idempotency_keys_unfinished", "owner"),
    ("rides", "key_owner"),
    ("audit_records", "key_owner"),
    ("staged_jobs", "key_owner"),
    ("ride_receipts", "key_owner"),
];

/// The service's tables whose `key_owner` a migration's trigger filled (20261206100001).
const FILLED_BY_TRIGGER: [&str; 3] = ["audit_records", "staged_jobs", "ride_receipts"];

/// The primary keys and unique constraints of the distributed layout: the table, the names the
/// constraint had on one PostgreSQL (dropped), its name and definition here. Each includes
/// `key_owner`; each is the one-PostgreSQL constraint with `key_owner` for `user_id` (equal by
/// the tables' checks), but `rides_charge_id_key`: "a charge is recorded on at most one ride"
/// becomes per user (docs/scaling.md, "What is lost").
pub const KEYS: [(&str, &[&str], &str, &str); 6] = [
    (
        "rides",
        &["rides_pkey"],
        "rides_pkey",
        "PRIMARY KEY (key_owner, id)",
    ),
    (
        "rides",
        &["rides_idempotency_key_unique"],
        "rides_idempotency_key_unique",
        "UNIQUE (key_owner, idempotency_key_id)",
    ),
    (
        "rides",
        &["rides_charge_id_key", "rides_user_charge_id_key"],
        "rides_owner_charge_id_key",
        "UNIQUE (key_owner, charge_id)",
    ),
    (
        "audit_records",
        &["audit_records_pkey"],
        "audit_records_pkey",
        "PRIMARY KEY (key_owner, id)",
    ),
    (
        "staged_jobs",
        &["staged_jobs_pkey"],
        "staged_jobs_pkey",
        "PRIMARY KEY (key_owner, id)",
    ),
    (
        "ride_receipts",
        &["ride_receipts_pkey"],
        "ride_receipts_pkey",
        "PRIMARY KEY (key_owner, ride_id)",
    ),
];

/// The foreign keys of the distributed layout: to the reference table `users`, and between
/// colocated tables through the distribution column.
pub const REFERENCES: [(&str, &str, &str); 5] = [
    (
        "rides",
        "rides_user_id_fkey",
        "FOREIGN KEY (user_id) REFERENCES users (id)",
    ),
    (
        "audit_records",
        "audit_records_user_id_fkey",
        "FOREIGN KEY (user_id) REFERENCES users (id)",
    ),
    (
        "staged_jobs",
        "staged_jobs_user_id_fkey",
        "FOREIGN KEY (user_id) REFERENCES users (id)",
    ),
    (
        "ride_receipts",
        "ride_receipts_user_id_fkey",
        "FOREIGN KEY (user_id) REFERENCES users (id)",
    ),
    (
        "ride_receipts",
        "ride_receipts_ride_fkey",
        "FOREIGN KEY (key_owner, ride_id) REFERENCES rides (key_owner, id)",
    ),
];

/// The installed version of Citus, or `None` on a server without it.
pub async fn citus_version(pg: &mut Pg<'_>) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT extversion FROM pg_extension WHERE extname = 'citus'")
        .fetch_optional(pg)
        .await
}

/// Distributes the migrated tables (see the module's documentation); refuses, changing
/// nothing, a server without Citus ([`WITHOUT_CITUS`]).
///
/// Its statements run on one connection of `pool`, unnamed: give it a direct connection to the
/// coordinator, as to `migrate`, not a transaction pooler.
pub async fn distribute(pool: &PgPool) -> anyhow::Result<Distributed> {
    let mut conn = pool.acquire().await.context("connect")?;
    // Statements run once each, some with SQL built here: unnamed, so none stays prepared.
    let mut pg = Statements::Unnamed.on(&mut *conn);
    if citus_version(&mut pg)
        .await
        .context("read the Citus version")?
        .is_none()
    {
        anyhow::bail!(WITHOUT_CITUS);
    }
    let mut done = is_distributed(&mut pg, "users").await?;
    for (table, _) in TABLES {
        done &= is_distributed(&mut pg, table).await?;
    }
    if done && missing_references(&mut pg).await?.is_empty() {
        return Ok(Distributed::Already);
    }
    super::fill_key_owners(pool)
        .await
        .context("step 1: fill key_owner")?;
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let statements = prepare_statements(&mut tx).await?;
    let mut pg = Statements::Unnamed.on(&mut *tx);
    for statement in statements {
        sqlx::query(&statement)
            .execute(&mut pg)
            .await
            .with_context(|| format!("steps 1 to 3: {statement}"))?;
    }
    tx.commit().await.context("steps 1 to 3: commit")?;
    let mut pg = Statements::Unnamed.on(&mut *conn);
    // Step 4: Citus's functions commit on the workers themselves: one call at a time.
    let colocated_with = TABLES[0].0;
    for (table, column) in TABLES {
        if is_distributed(&mut pg, table).await? {
            continue;
        }
        let colocate = if table == colocated_with {
            "none"
        } else {
            colocated_with
        };
        sqlx::query("SELECT create_distributed_table($1::regclass, $2, colocate_with => $3)")
            .bind(table)
            .bind(column)
            .bind(colocate)
            .execute(&mut pg)
            .await
            .with_context(|| format!("step 4: distribute {table} by {column}"))?;
        tracing::info!(table, column, "distributed");
    }
    if !is_distributed(&mut pg, "users").await? {
        sqlx::query("SELECT create_reference_table('users')")
            .execute(&mut pg)
            .await
            .context("step 4: make users a reference table")?;
    }
    // Step 5: the foreign keys of the distributed layout.
    for (table, name, definition) in missing_references(&mut pg).await? {
        sqlx::query(&format!(
            "ALTER TABLE {table} ADD CONSTRAINT {name} {definition}"
        ))
        .execute(&mut pg)
        .await
        .with_context(|| format!("step 5: add {name} to {table} ({definition})"))?;
    }
    Ok(Distributed::Now)
}

/// The statements of steps 1 to 3 that are still to do, read in the transaction that runs
/// them: nothing on a database where they are done, so a rerun goes straight to step 4. On a
/// table that is distributed already nothing is changed (a run that failed in step 4 or 5 has
/// done steps 1 to 3 for every table).
pub async fn prepare_statements(conn: &mut PgConnection) -> anyhow::Result<Vec<String>> {
    // Read once each: unnamed, as in `distribute`.
    let mut pg = Statements::Unnamed.on(conn);
    let mut statements = Vec::new();
    // Step 1: the column that will distribute the table, never empty, written by the service.
    for table in FILLED_BY_TRIGGER {
        if is_distributed(&mut pg, table).await? {
            continue;
        }
        let (nullable, trigger): (bool, bool) = sqlx::query_as(
            "SELECT NOT a.attnotnull,
                    EXISTS (SELECT FROM pg_trigger t WHERE t.tgrelid = a.attrelid
                              AND t.tgname = $2 AND NOT t.tgisinternal)
             FROM pg_attribute a
             WHERE a.attrelid = $1::regclass AND a.attname = 'key_owner'",
        )
        .bind(table)
        .bind(format!("{table}_key_owner"))
        .fetch_one(&mut pg)
        .await
        .with_context(|| format!("read key_owner of {table}"))?;
        if trigger {
            statements.push(format!("DROP TRIGGER {table}_key_owner ON {table}"));
        }
        if nullable {
            statements.push(format!(
                "ALTER TABLE {table} VALIDATE CONSTRAINT {table}_key_owner_is_the_user"
            ));
            statements.push(format!(
                "ALTER TABLE {table} ALTER COLUMN key_owner SET NOT NULL"
            ));
        }
    }
    // Step 2: the foreign keys among the tables, where one side is not distributed yet.
    let mut names: Vec<&str> = vec!["users"];
    names.extend(TABLES.iter().map(|(t, _)| *t));
    let references: Vec<(String, String)> = sqlx::query_as(
        "SELECT c.conrelid::regclass::text, c.conname::text
         FROM pg_constraint c
         WHERE c.contype = 'f'
           AND c.conrelid::regclass::text = ANY($1) AND c.confrelid::regclass::text = ANY($1)
           AND NOT (EXISTS (SELECT FROM pg_dist_partition p WHERE p.logicalrelid = c.conrelid)
                    AND EXISTS (SELECT FROM pg_dist_partition p
                                WHERE p.logicalrelid = c.confrelid))
         ORDER BY 1, 2",
    )
    .bind(&names)
    .fetch_all(&mut pg)
    .await
    .context("read the foreign keys")?;
    for (table, name) in references {
        statements.push(format!("ALTER TABLE {table} DROP CONSTRAINT {name}"));
    }
    // Step 3: the keys with the distribution column.
    for (table, old, name, definition) in KEYS {
        if is_distributed(&mut pg, table).await? {
            continue;
        }
        let existing: Vec<(String, String)> = sqlx::query_as(
            "SELECT conname::text, pg_get_constraintdef(oid) FROM pg_constraint
             WHERE conrelid = $1::regclass AND (conname = ANY($2) OR conname = $3)",
        )
        .bind(table)
        .bind(old)
        .bind(name)
        .fetch_all(&mut pg)
        .await
        .with_context(|| format!("read the keys of {table}"))?;
        let wanted = definition.replace(" (", "(").replace(", ", ",");
        let same = |(n, d): &(String, String)| {
            n == name && d.replace(" (", "(").replace(", ", ",") == wanted
        };
        if existing.iter().any(same) {
            continue;
        }
        for (old_name, _) in &existing {
            statements.push(format!("ALTER TABLE {table} DROP CONSTRAINT {old_name}"));
        }
        statements.push(format!(
            "ALTER TABLE {table} ADD CONSTRAINT {name} {definition}"
        ));
    }
    Ok(statements)
}

/// The foreign keys of [`REFERENCES`] that the database does not have.
async fn missing_references(
    pg: &mut Pg<'_>,
) -> anyhow::Result<Vec<(&'static str, &'static str, &'static str)>> {
    let mut missing = Vec::new();
    for (table, name, definition) in REFERENCES {
        let exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT FROM pg_constraint
                            WHERE conrelid = $1::regclass AND conname = $2 AND contype = 'f')",
        )
        .bind(table)
        .bind(name)
        .fetch_one(&mut *pg)
        .await
        .with_context(|| format!("read {name}"))?;
        if !exists {
            missing.push((table, name, definition));
        }
    }
    Ok(missing)
}

/// What `distribute` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Distributed {
    /// The tables were distributed by this call.
    Now,
    /// Every table was distributed already: nothing was changed.
    Already,
}

/// Whether Citus already holds `table` in its metadata (distributed or a reference table).
async fn is_distributed(pg: &mut Pg<'_>, table: &str) -> anyhow::Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT FROM pg_dist_partition
                        WHERE logicalrelid = $1::regclass AND partmethod IN ('h', 'n')
                          AND (partmethod = 'h' OR repmodel = 't'))",
    )
    .bind(table)
    .fetch_one(pg)
    .await
    .with_context(|| format!("is {table} distributed"))
}
