//! `rocket-rides distribute`: the migrated tables spread over a Citus cluster
//! (docs/scaling.md, "Distributing with Citus", tells the layout and why).
//!
//! The layout: `users` a reference table (a copy on every node); the library's key tables
//! distributed by `owner` and colocated; the service's tables distributed by `user_id` and
//! colocated with `rides`; `failed_jobs` a local table of the coordinator. Citus checks foreign
//! keys and unique constraints when it distributes a table, and refuses some that PostgreSQL
//! allows, so the steps run in an order that works:
//!
//! 1. the foreign keys between these tables are dropped (a table with a foreign key to a local
//!    table cannot be distributed, and `create_reference_table('users')` first would turn every
//!    table that references `users` into a local table of Citus, which cannot be distributed);
//! 2. `rides_charge_id_key` (`charge_id` alone) becomes `(user_id, charge_id)`: Citus keeps
//!    no unique constraint without the distribution column;
//! 3. the tables are distributed, then `users` made a reference table;
//! 4. the foreign keys are added back, except `rides` → `idempotency_keys`, whose tables are in
//!    two colocation groups: Citus keeps foreign keys only between colocated tables that include
//!    the distribution column, and refuses its `ON DELETE SET NULL` in any form. A ride whose key
//!    the reaper deleted keeps the key's id, which no key takes again.
//!
//! A cluster where every table is distributed already is left as it is. A run that fails after
//! step 1 has dropped the foreign keys it has not added back yet: the error names the step, and
//! the keys' definitions are those of the migrations (`rocket-rides migrate` on a copy shows them).

use anyhow::Context;
use sqlx::{PgConnection, PgPool};

/// What `distribute` says, before it changes anything, on a server without Citus.
pub const WITHOUT_CITUS: &str = "this database has no Citus extension (CREATE EXTENSION citus \
     on the coordinator, add the workers with citus_add_node, then run rocket-rides distribute \
     again): nothing was changed";

/// The tables distributed by the key's owner, first the one the other is colocated with.
const KEY_TABLES: [&str; 2] = ["idempotency_keys", "idempotency_keys_unfinished"];

/// The service's tables distributed by `user_id`, first the one the others are colocated with.
const SERVICE_TABLES: [&str; 4] = ["rides", "audit_records", "staged_jobs", "ride_receipts"];

/// The foreign key that cannot be kept: its tables are in two colocation groups.
const DROPPED_REFERENCE: (&str, &str) = ("rides", "idempotency_keys");

/// The installed version of Citus, or `None` on a server without it.
pub async fn citus_version(conn: &mut PgConnection) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT extversion FROM pg_extension WHERE extname = 'citus'")
        .persistent(false)
        .fetch_optional(conn)
        .await
}

/// Distributes the migrated tables (see the module's documentation); refuses, changing
/// nothing, a server without Citus ([`WITHOUT_CITUS`]).
///
/// Its statements run on one connection of `pool`, unnamed: give it a direct connection to the
/// coordinator, as to `migrate`, not a transaction pooler.
pub async fn distribute(pool: &PgPool) -> anyhow::Result<Distributed> {
    let mut conn = pool.acquire().await.context("connect")?;
    let conn = &mut *conn;
    if citus_version(conn)
        .await
        .context("read the Citus version")?
        .is_none()
    {
        anyhow::bail!(WITHOUT_CITUS);
    }
    let mut done = is_distributed(conn, "users").await?;
    for table in KEY_TABLES.iter().chain(&SERVICE_TABLES) {
        done &= is_distributed(conn, table).await?;
    }
    if done {
        return Ok(Distributed::Already);
    }
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    // Step 1: the foreign keys among the tables to distribute, kept to be added back.
    let mut all: Vec<&str> = vec!["users"];
    all.extend(KEY_TABLES);
    all.extend(SERVICE_TABLES);
    let references: Vec<(String, String, String, String)> = sqlx::query_as(
        "SELECT c.conrelid::regclass::text, c.confrelid::regclass::text, c.conname::text,
                pg_get_constraintdef(c.oid)
         FROM pg_constraint c
         WHERE c.contype = 'f'
           AND c.conrelid::regclass::text = ANY($1) AND c.confrelid::regclass::text = ANY($1)
           AND NOT EXISTS (SELECT FROM pg_dist_partition p WHERE p.logicalrelid = c.conrelid)",
    )
    .bind(&all)
    .persistent(false)
    .fetch_all(&mut *tx)
    .await
    .context("read the foreign keys")?;
    for (table, _, name, _) in &references {
        sqlx::query(&format!("ALTER TABLE {table} DROP CONSTRAINT {name}"))
            .persistent(false)
            .execute(&mut *tx)
            .await
            .with_context(|| format!("drop {name} of {table}"))?;
    }
    // Step 2: the unique charge per ride, by user.
    sqlx::query(
        "DO $$ BEGIN
           IF EXISTS (SELECT FROM pg_constraint WHERE conname = 'rides_charge_id_key'
                        AND conrelid = 'rides'::regclass) THEN
             ALTER TABLE rides DROP CONSTRAINT rides_charge_id_key;
             ALTER TABLE rides ADD CONSTRAINT rides_user_charge_id_key UNIQUE (user_id, charge_id);
           END IF;
         END $$",
    )
    .persistent(false)
    .execute(&mut *tx)
    .await
    .context("make the charge unique per user")?;
    tx.commit().await?;
    // Step 3: Citus's functions commit on the workers themselves: one call at a time.
    for (table, column, with) in KEY_TABLES
        .iter()
        .map(|t| (*t, "owner", KEY_TABLES[0]))
        .chain(
            SERVICE_TABLES
                .iter()
                .map(|t| (*t, "user_id", SERVICE_TABLES[0])),
        )
    {
        if is_distributed(conn, table).await? {
            continue;
        }
        let colocate = if table == with { "default" } else { with };
        sqlx::query("SELECT create_distributed_table($1::regclass, $2, colocate_with => $3)")
            .bind(table)
            .bind(column)
            .bind(colocate)
            .persistent(false)
            .execute(&mut *conn)
            .await
            .with_context(|| format!("distribute {table} by {column}"))?;
        tracing::info!(table, column, "distributed");
    }
    if !is_distributed(conn, "users").await? {
        sqlx::query("SELECT create_reference_table('users')")
            .persistent(false)
            .execute(&mut *conn)
            .await
            .context("make users a reference table")?;
    }
    // Step 4: the foreign keys back, but the one across colocation groups.
    for (table, referenced, name, definition) in &references {
        if (table.as_str(), referenced.as_str()) == DROPPED_REFERENCE {
            tracing::warn!(
                table,
                name,
                "not added back: rides and idempotency_keys are not colocated"
            );
            continue;
        }
        sqlx::query(&format!(
            "ALTER TABLE {table} ADD CONSTRAINT {name} {definition}"
        ))
        .persistent(false)
        .execute(&mut *conn)
        .await
        .with_context(|| format!("add {name} of {table} back ({definition})"))?;
    }
    Ok(Distributed::Now)
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
async fn is_distributed(conn: &mut PgConnection, table: &str) -> anyhow::Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT FROM pg_dist_partition
                        WHERE logicalrelid = $1::regclass AND partmethod IN ('h', 'n')
                          AND (partmethod = 'h' OR repmodel = 't'))",
    )
    .bind(table)
    .persistent(false)
    .fetch_one(conn)
    .await
    .with_context(|| format!("is {table} distributed"))
}
