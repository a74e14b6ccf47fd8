//! A key table grown large before `create_large` and `replay_large` run: N finished bookings,
//! loaded in SQL in one `INSERT … SELECT … generate_series` per table, then `ANALYZE` and a
//! `CHECKPOINT`.
//!
//! Each preloaded booking is a copy of a real one, the key the replays replay (booked through
//! the service before any measurement): its key row (finished, with its stored answer), its
//! ride (paid), and the ride's audit records. Only what must differ differs: the key's name and
//! request UUID, the ride's key and charge, the audit records' ride. Copying every other
//! column from the real rows keeps the copies as wide as what a booking writes, whatever
//! columns later migrations add. (The booking's receipt job is left out: the worker's drain
//! deletes it.)
//!
//! The preloaded rides' charges were never made at the gateway: their ids start with
//! [`PRELOADED_CHARGE_PREFIX`], and the run's money check leaves them out, saying how many.

use anyhow::Context;
use serde::Serialize;
use sqlx::PgConnection;

use super::stack::Databases;

/// The key name of every preloaded key, before its number.
pub(crate) const PRELOADED_KEY_PREFIX: &str = "bench-preloaded-";

/// The charge id of every preloaded ride, before its number.
pub(crate) const PRELOADED_CHARGE_PREFIX: &str = "ch_bench_preloaded_";

/// The key table and its indexes, as PostgreSQL stores them.
#[derive(Debug, Clone, Serialize)]
pub struct KeyTable {
    pub rows: i64,
    /// The heap alone, and the heap with its indexes and TOAST.
    pub heap_bytes: i64,
    pub total_bytes: i64,
    pub indexes: Vec<KeyIndex>,
}

/// One index of the key table.
#[derive(Debug, Clone, Serialize)]
pub struct KeyIndex {
    pub name: String,
    pub bytes: i64,
    /// Levels above the leaves (`bt_metap(index).level`: 0 for a root that is a leaf); `null`
    /// where `pageinspect` is not installable in the server.
    pub btree_level: Option<i64>,
}

/// Loads `count` finished bookings copied from the key `template` (a finished booking's key
/// name) and its rows, and analyzes the tables; returns the preloaded keys counted afterwards.
pub(crate) async fn preload(
    databases: &Databases,
    template: &str,
    count: u64,
) -> anyhow::Result<i64> {
    let mut conn = databases.connect_service().await?;
    let (key_id, ride_id): (i64, i64) = sqlx::query_as(
        "SELECT k.id, r.id FROM idempotency_keys k
         JOIN rides r ON r.key_owner = k.owner AND r.idempotency_key_id = k.id
         WHERE k.idempotency_key = $1 AND k.finished_at IS NOT NULL",
    )
    .bind(template)
    .fetch_one(&mut conn)
    .await
    .with_context(|| format!("find the finished booking {template} to copy"))?;
    let count = i64::try_from(count).context("--preload-keys is too large")?;
    let keys = copy_statement(
        &mut conn,
        "idempotency_keys",
        &[
            ("idempotency_key", format!("'{PRELOADED_KEY_PREFIX}' || g")),
            ("request_uuid", "gen_random_uuid()".to_owned()),
            // A millisecond apart, as if booked one after another: the time indexes get as
            // many distinct entries as a real history gives them.
            (
                "created_at",
                "t.created_at - g * interval '1 millisecond'".to_owned(),
            ),
            (
                "last_run_at",
                "t.last_run_at - g * interval '1 millisecond'".to_owned(),
            ),
            (
                "finished_at",
                "t.finished_at - g * interval '1 millisecond'".to_owned(),
            ),
        ],
        "idempotency_keys t CROSS JOIN generate_series(1, $1) g WHERE t.id = $2",
    )
    .await?;
    let rides = copy_statement(
        &mut conn,
        "rides",
        &[
            ("idempotency_key_id", "k.id".to_owned()),
            ("charge_id", format!("'{PRELOADED_CHARGE_PREFIX}' || g")),
        ],
        // The scope's unique index finds each copy's key.
        &format!(
            "rides t CROSS JOIN generate_series(1, $1) g
             JOIN idempotency_keys k ON k.owner = t.key_owner
              AND k.idempotency_key = '{PRELOADED_KEY_PREFIX}' || g
             WHERE t.id = $2"
        ),
    )
    .await?;
    let audits = copy_statement(
        &mut conn,
        "audit_records",
        &[("resource_id", "r.id".to_owned())],
        &format!(
            "audit_records t CROSS JOIN generate_series(1, $1) g
             JOIN rides r ON r.charge_id = '{PRELOADED_CHARGE_PREFIX}' || g
             WHERE t.resource_type = 'ride' AND t.resource_id = $2"
        ),
    )
    .await?;
    for (statement, id) in [(keys, key_id), (rides, ride_id), (audits, ride_id)] {
        sqlx::query(&statement)
            .bind(count)
            .bind(id)
            .execute(&mut conn)
            .await
            .with_context(|| format!("preload: {statement}"))?;
    }
    sqlx::query("ANALYZE idempotency_keys, rides, audit_records")
        .execute(&mut conn)
        .await?;
    // The load leaves about a gigabyte of dirty pages per million keys, which the checkpointer
    // would write out over the next minutes, during the measurements. A table that grew over
    // days has no such debt: it is paid here, before them. Without the right to (a role that is
    // neither a superuser nor in `pg_checkpoint`), the run goes on and says so.
    if let Err(e) = sqlx::query("CHECKPOINT").execute(&mut conn).await {
        tracing::warn!("preload: CHECKPOINT refused ({e}); the measurements after it share the machine with the checkpointer");
    }
    let loaded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_keys WHERE starts_with(idempotency_key, $1)",
    )
    .bind(PRELOADED_KEY_PREFIX)
    .fetch_one(&mut conn)
    .await?;
    Ok(loaded)
}

/// `INSERT INTO table (every column the table does not number itself) SELECT … FROM from`,
/// each column copied from the template row `t` unless `changed` gives its expression.
async fn copy_statement(
    conn: &mut PgConnection,
    table: &str,
    changed: &[(&str, String)],
    from: &str,
) -> anyhow::Result<String> {
    // Serial and identity columns number the copies themselves; generated ones cannot be
    // written.
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns
         WHERE table_schema = current_schema() AND table_name = $1
           AND is_identity = 'NO' AND is_generated = 'NEVER'
           AND coalesce(column_default, '') NOT LIKE 'nextval(%'
         ORDER BY ordinal_position",
    )
    .bind(table)
    .fetch_all(&mut *conn)
    .await?;
    anyhow::ensure!(!columns.is_empty(), "preload: no table {table}");
    let values: Vec<String> = columns
        .iter()
        .map(|column| {
            changed
                .iter()
                .find(|(name, _)| name == column)
                .map_or_else(|| format!("t.{column}"), |(_, expr)| expr.clone())
        })
        .collect();
    Ok(format!(
        "INSERT INTO {table} ({}) SELECT {} FROM {from}",
        columns.join(", "),
        values.join(", ")
    ))
}

/// The key table's rows and sizes, and each of its indexes' size and btree depth.
pub(crate) async fn key_table(databases: &Databases) -> anyhow::Result<KeyTable> {
    let mut conn = databases.connect_service().await?;
    // Installed in the run's own database only, and only where the server ships it.
    let inspect = sqlx::query("CREATE EXTENSION IF NOT EXISTS pageinspect")
        .execute(&mut conn)
        .await
        .is_ok();
    let (rows, heap_bytes, total_bytes): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM idempotency_keys),
                pg_relation_size('idempotency_keys'), pg_total_relation_size('idempotency_keys')",
    )
    .fetch_one(&mut conn)
    .await?;
    let listed: Vec<(String, i64, bool)> = sqlx::query_as(
        "SELECT c.relname::text, pg_relation_size(c.oid), a.amname = 'btree'
         FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am a ON a.oid = c.relam
         WHERE i.indrelid = 'idempotency_keys'::regclass ORDER BY c.relname",
    )
    .fetch_all(&mut conn)
    .await?;
    let mut indexes = Vec::new();
    for (name, bytes, btree) in listed {
        let btree_level = if inspect && btree {
            Some(
                sqlx::query_scalar("SELECT level FROM bt_metap($1)")
                    .bind(&name)
                    .fetch_one(&mut conn)
                    .await
                    .with_context(|| format!("bt_metap({name})"))?,
            )
        } else {
            None
        };
        indexes.push(KeyIndex {
            name,
            bytes,
            btree_level,
        });
    }
    Ok(KeyTable {
        rows,
        heap_bytes,
        total_bytes,
        indexes,
    })
}

/// The key table once the reaper has deleted every finished key, before any vacuum.
#[derive(Debug, Clone, Serialize)]
pub struct AfterReap {
    /// Keys the reaper deleted, and the seconds it took (in batches of [`REAP_BATCH`]).
    pub reaped: u64,
    pub reap_s: f64,
    /// Dead row versions in the key table, as PostgreSQL counts them (`n_dead_tup`): what
    /// only a vacuum makes reusable.
    pub dead_tuples: i64,
    pub table: KeyTable,
}

/// Keys per reaper statement: the worker's default (`--reaper-batch`).
pub(crate) const REAP_BATCH: i64 = 1000;

/// Runs the library's reaper with a retention of zero until no finished key is left (every key
/// the run made and preloaded is finished), then reads the key table and its dead rows.
pub(crate) async fn reap_all(databases: &Databases) -> anyhow::Result<AfterReap> {
    let started = std::time::Instant::now();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&databases.service_url)
        .await?;
    let store = idempotency::Store::new(
        pool.clone(),
        std::sync::Arc::new(idempotency::DatabaseClock),
        std::time::Duration::from_secs(30),
    )?;
    let mut reaped = 0;
    loop {
        let deleted = store
            .reap_finished(std::time::Duration::ZERO, REAP_BATCH)
            .await?;
        if deleted == 0 {
            break;
        }
        reaped += deleted;
    }
    // A backend reports its statistics when it ends: close the pool before reading them.
    pool.close().await;
    let reap_s = started.elapsed().as_secs_f64();
    let mut conn = databases.connect_service().await?;
    // The statistics a backend reported are read once per transaction; a fresh connection's
    // first read may still miss the reaper's last report, so wait for it to settle.
    let mut dead_tuples = 0;
    for _ in 0..50 {
        sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(&mut conn)
            .await?;
        dead_tuples = sqlx::query_scalar(
            "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'idempotency_keys'",
        )
        .fetch_one(&mut conn)
        .await?;
        if dead_tuples >= reaped as i64 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    Ok(AfterReap {
        reaped,
        reap_s,
        dead_tuples,
        table: key_table(databases).await?,
    })
}
