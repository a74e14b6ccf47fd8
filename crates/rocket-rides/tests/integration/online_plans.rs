//! The online plans (the crate's and the service's, `src/db/online.rs`) reach what the
//! migrations' files reach: two fresh databases at the oldest schema, holding the same rows, are
//! migrated to the newest, one by `rocket_rides::db::migrate` (the plans), the other by
//! `migrate_from_files` (every migration from its file); their catalogs, their bookkeeping and
//! their rows must be equal.
//!
//! The catalog is compared by name: columns (type, default, nullability), constraints
//! (`pg_get_constraintdef`, validated or not), indexes (`pg_get_indexdef`, valid or not),
//! triggers, functions and storage options. Not the order of columns: the owner's type change
//! is made on a new column, which ends last in the key table.

use std::collections::BTreeSet;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use crate::common;

/// Keys, rides and audit records at the oldest schema: more than two backfill batches.
const ROWS: i64 = 2 * idempotency::BACKFILL_BATCH + 1_000;
const USERS: i64 = 50;
/// The oldest released schema: each side's first migration alone.
const CRATE_OLDEST_BELOW: i64 = 20261129000002;
const SERVICE_OLDEST_BELOW: i64 = 20261129100002;

#[sqlx::test(migrations = false)]
async fn the_online_plans_reach_the_catalog_bookkeeping_and_rows_of_the_files(pool: PgPool) {
    let (files, files_name) = second_database(&pool).await;
    for db in [&pool, &files] {
        oldest_schema_with_rows(db).await;
    }
    rocket_rides::db::migrate(&pool).await.unwrap();
    rocket_rides::db::migrate_from_files(&files).await.unwrap();

    let online = Snapshot::of(&pool).await;
    let from_files = Snapshot::of(&files).await;
    files.close().await;
    sqlx::query(&format!("DROP DATABASE \"{files_name}\" WITH (FORCE)"))
        .execute(&pool)
        .await
        .unwrap();

    for (what, online, from_files) in online.sections(&from_files) {
        assert_eq!(
            online, from_files,
            "{what}: the online plans (left) and the files (right) differ"
        );
    }
    // A later plain run of sqlx's migrator accepts what the plans recorded: same versions, same
    // checksums, nothing left to apply.
    rocket_rides::db::migrator().run(&pool).await.unwrap();
    rocket_rides::db::migrate(&pool).await.unwrap();
}

/// A database beside the test's, on the same server, and its name.
async fn second_database(pool: &PgPool) -> (PgPool, String) {
    let name: String =
        sqlx::query_scalar("SELECT 'online_plans_files_' || left(md5(current_database()), 16)")
            .fetch_one(pool)
            .await
            .unwrap();
    sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(&format!("CREATE DATABASE \"{name}\""))
        .execute(pool)
        .await
        .unwrap();
    let options: PgConnectOptions = pool.connect_options().as_ref().clone().database(&name);
    let files = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .unwrap();
    (files, name)
}

/// The oldest schema, with `ROWS` keys, rides and audit records and a few staged jobs, every
/// value fixed so that both databases hold the same.
async fn oldest_schema_with_rows(pool: &PgPool) {
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    common::run_below(
        pool,
        &crates.join("idempotency/migrations"),
        CRATE_OLDEST_BELOW,
    )
    .await;
    common::run_below(
        pool,
        &crates.join("rocket-rides/migrations"),
        SERVICE_OLDEST_BELOW,
    )
    .await;
    sqlx::raw_sql(&format!(
        "INSERT INTO users (id, email, api_key_hash, stripe_customer_id, created_at)
         SELECT u, 'rider' || u || '@example.com', sha256(u::text::bytea), 'cus_' || u,
                timestamptz '2026-11-29 12:00Z'
         FROM generate_series(1, {USERS}) u;
         SELECT setval('users_id_seq', {USERS});
         INSERT INTO idempotency_keys
             (id, user_id, request_method, request_path, idempotency_key, fingerprint,
              request_params, recovery_point, response_status, response_headers, response_body,
              created_at, last_run_at, finished_at, locked_until)
         SELECT g, 1 + g % {USERS}, 'POST', '/rides', 'seed-' || g, sha256(g::text::bytea),
                '{{}}', CASE WHEN g % 100 = 0 THEN 'started' ELSE 'finished' END,
                CASE WHEN g % 100 = 0 THEN NULL ELSE 201 END,
                CASE WHEN g % 100 = 0 THEN NULL ELSE '[]'::jsonb END,
                CASE WHEN g % 100 = 0 THEN NULL ELSE '\\x7b7d'::bytea END,
                timestamptz '2026-11-29 12:00Z' + g * interval '1 second',
                timestamptz '2026-11-29 12:00Z' + g * interval '1 second',
                CASE WHEN g % 100 = 0 THEN NULL
                     ELSE timestamptz '2026-11-29 12:00Z' + g * interval '1 second' END,
                NULL
         FROM generate_series(1, {ROWS}) g;
         SELECT setval('idempotency_keys_id_seq', {ROWS});
         INSERT INTO rides (id, user_id, idempotency_key_id, origin_lat, origin_lon, target_lat,
                            target_lon, amount_cents, charge_id, status, created_at, updated_at)
         SELECT g, 1 + g % {USERS}, g, 37.77, -122.42, 37.80, -122.27, 2000,
                CASE WHEN g % 100 = 0 THEN NULL ELSE 'ch_seed_' || g END,
                CASE WHEN g % 100 = 0 THEN 'pending' ELSE 'paid' END,
                timestamptz '2026-11-29 12:00Z' + g * interval '1 second',
                timestamptz '2026-11-29 12:00Z' + g * interval '1 second'
         FROM generate_series(1, {ROWS}) g;
         SELECT setval('rides_id_seq', {ROWS});
         INSERT INTO audit_records (id, user_id, action, resource_type, resource_id, data,
                                    created_at)
         SELECT g, 1 + g % {USERS}, 'ride.created', 'ride', g, '{{}}',
                timestamptz '2026-11-29 12:00Z'
         FROM generate_series(1, {ROWS}) g;
         SELECT setval('audit_records_id_seq', {ROWS});
         INSERT INTO staged_jobs (id, job_name, job_args, created_at)
         VALUES (1, 'send_ride_receipt', '{{\"ride_id\": 7}}', timestamptz '2026-11-29 12:00Z'),
                (2, 'send_ride_receipt', '{{}}', timestamptz '2026-11-29 12:00Z');
         SELECT setval('staged_jobs_id_seq', 2);"
    ))
    .execute(pool)
    .await
    .unwrap();
}

/// What is compared, by section.
struct Snapshot {
    sections: Vec<(&'static str, Vec<String>)>,
}

/// The catalog of the database's own schema, its bookkeeping, and its rows' contents: random
/// values (the UUIDs) by their presence only.
const QUERIES: &[(&str, &str)] = &[
    (
        "columns",
        "SELECT format('%s.%s %s %s default %s', c.relname, a.attname,
                       format_type(a.atttypid, a.atttypmod),
                       CASE WHEN a.attnotnull THEN 'NOT NULL' ELSE 'NULL' END,
                       coalesce(pg_get_expr(d.adbin, d.adrelid), '-'))
         FROM pg_attribute a
         JOIN pg_class c ON c.oid = a.attrelid
         LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind = 'r'
           AND a.attnum > 0 AND NOT a.attisdropped",
    ),
    (
        "constraints",
        "SELECT format('%s %s %s %s', conrelid::regclass, conname, pg_get_constraintdef(oid),
                       CASE WHEN convalidated THEN 'valid' ELSE 'NOT VALID' END)
         FROM pg_constraint WHERE connamespace = current_schema()::regnamespace",
    ),
    (
        "indexes",
        "SELECT format('%s %s', pg_get_indexdef(i.indexrelid),
                       CASE WHEN i.indisvalid THEN 'valid' ELSE 'INVALID' END)
         FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
         WHERE c.relnamespace = current_schema()::regnamespace",
    ),
    (
        "triggers and functions",
        "SELECT format('trigger %s on %s', tgname, tgrelid::regclass) FROM pg_trigger
         WHERE NOT tgisinternal
         UNION ALL
         SELECT format('function %s', proname) FROM pg_proc
         WHERE pronamespace = current_schema()::regnamespace",
    ),
    (
        "storage options",
        "SELECT format('%s %s', relname, reloptions) FROM pg_class
         WHERE relnamespace = current_schema()::regnamespace AND reloptions IS NOT NULL",
    ),
    (
        "bookkeeping",
        "SELECT format('sqlx %s %s %s %s', version, description, success, encode(checksum, 'hex'))
         FROM _sqlx_migrations
         UNION ALL
         SELECT format('crate %s %s %s', version, description, encode(checksum, 'hex'))
         FROM idempotency_schema_migrations",
    ),
    (
        "rows",
        "SELECT format('key %s %s %s %s', owner, id, request_uuid IS NOT NULL, completer_attempts)
         FROM idempotency_keys
         UNION ALL
         SELECT format('unfinished %s %s', owner, key_id) FROM idempotency_keys_unfinished
         UNION ALL
         SELECT format('ride %s %s %s %s %s %s %s %s', user_id, id, key_owner, idempotency_key_id,
                       status, charge_generation, charge_first_attempt_at,
                       charge_generation_at)
         FROM rides
         UNION ALL
         SELECT format('user %s %s', id, customer_key IS NOT NULL) FROM users
         UNION ALL
         SELECT format('job %s %s', id, user_id) FROM staged_jobs
         UNION ALL
         SELECT format('failed job %s %s', id, error) FROM failed_jobs",
    ),
];

impl Snapshot {
    async fn of(pool: &PgPool) -> Self {
        let mut sections = Vec::new();
        for (what, sql) in QUERIES {
            let rows: Vec<String> = sqlx::query_scalar(sql).fetch_all(pool).await.unwrap();
            sections.push((*what, rows));
        }
        Self { sections }
    }

    /// Each section's name, with this snapshot's rows and `other`'s, told apart: the rows only
    /// one of them holds.
    fn sections(&self, other: &Self) -> Vec<(&'static str, Vec<String>, Vec<String>)> {
        self.sections
            .iter()
            .zip(&other.sections)
            .map(|((what, mine), (_, theirs))| {
                let (mine, theirs): (BTreeSet<_>, BTreeSet<_>) =
                    (mine.iter().collect(), theirs.iter().collect());
                let only = |a: &BTreeSet<&String>, b: &BTreeSet<&String>| {
                    a.difference(b).map(|r| (*r).clone()).collect()
                };
                (*what, only(&mine, &theirs), only(&theirs, &mine))
            })
            .collect()
    }
}
