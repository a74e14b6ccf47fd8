//! A database at the oldest released schema, holding `ROWS` keys, rides and audit records, is
//! migrated to the newest by `rocket_rides::db::migrate` while bookings run against it; no booking
//! may wait on a lock for more than a second.
//!
//! Each booking session sets `lock_timeout` to that second, so a booking that queues behind the
//! migration's exclusive lock (or behind a statement queued behind it) longer than that fails
//! with 55P03 `lock_not_available`: the test counts those, and there must be none.
//!
//! The bookings are the statements a booking makes on the key table, rides and audit records,
//! written for the schema they find: the key's owner column is `user_id` before the crate's
//! 20261202000001 and `owner` after it, and a ride names its key's owner (`key_owner`) from the
//! service's 20261202100001 on. A statement written for the schema that a migration has just
//! changed fails with an error of its own (an unknown or missing column, a changed plan) and the
//! booking is made again for the new schema; every other error fails the test.
//!
//! The migrations from before the rule cannot be edited (their checksums are recorded by the
//! databases that applied them), and several of them hold an exclusive lock for seconds on this
//! many rows: those are applied by their online plans (the crate's `src/migrate/plans.rs`, the
//! service's `src/db/online.rs`), short transactions, backfills in batches and indexes built
//! concurrently. Each lock timeout is told with the statement that held the exclusive lock, by
//! its first line: a migration's opening comment, or a plan's step.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use tokio::sync::Barrier;

use crate::common;

/// Keys, rides and audit records in the database before it is migrated.
const ROWS: i64 = 200_000;
/// Users the rows are spread over.
const USERS: i64 = 1_000;
/// The oldest released schema: each side's first migration alone.
const CRATE_OLDEST_BELOW: i64 = 20261129000002;
const SERVICE_OLDEST_BELOW: i64 = 20261129100002;
/// Bookings running at once during the migration.
const BOOKERS: usize = 4;
/// The longest a booking may wait for a lock: a booking queued longer fails with 55P03.
const BOOKING_LOCK_TIMEOUT: &str = "1s";

/// SQLSTATEs of a statement that met a schema changed under it; the booking is made again.
const SCHEMA_CHANGED: [&str; 3] = [
    "42703", // undefined_column: the owner column was renamed
    "23502", // not_null_violation: rides.key_owner is required now
    "0A000", // feature_not_supported: "cached plan must not change result type"
];
const LOCK_NOT_AVAILABLE: &str = "55P03";

#[derive(Default)]
struct Tally {
    bookings: u64,
    lock_timeouts: u64,
    schema_retries: u64,
    slowest: Duration,
    /// For each lock timeout, the first line of what held an exclusive lock on the bookings'
    /// tables just after it (a migration's opening comment): which migrations made bookings wait.
    holders: BTreeMap<String, u64>,
}

#[sqlx::test(migrations = false)]
async fn bookings_never_wait_a_second_on_a_lock_while_the_oldest_schema_migrates(pool: PgPool) {
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    common::run_below(
        &pool,
        &crates.join("idempotency/migrations"),
        CRATE_OLDEST_BELOW,
    )
    .await;
    common::run_below(
        &pool,
        &crates.join("rocket-rides/migrations"),
        SERVICE_OLDEST_BELOW,
    )
    .await;
    load_oldest_schema(&pool).await;

    let bookings = booking_pool(&pool).await;
    let migrating = Arc::new(AtomicBool::new(true));
    // Every booker has made a booking before the migration starts, so that they run throughout.
    let started = Arc::new(Barrier::new(BOOKERS + 1));
    let bookers: Vec<_> = (0..BOOKERS)
        .map(|n| {
            let (bookings, migrating, started) =
                (bookings.clone(), migrating.clone(), started.clone());
            tokio::spawn(async move { book_until_done(&bookings, n, &migrating, &started).await })
        })
        .collect();
    started.wait().await;
    let begun = Instant::now();
    let migrated = rocket_rides::db::migrate(&pool).await;
    let took = begun.elapsed();
    migrating.store(false, Ordering::SeqCst);
    let mut total = Tally::default();
    for booker in bookers {
        let tally = booker.await.unwrap();
        total.bookings += tally.bookings;
        total.lock_timeouts += tally.lock_timeouts;
        total.schema_retries += tally.schema_retries;
        total.slowest = total.slowest.max(tally.slowest);
        for (holder, n) in tally.holders {
            *total.holders.entry(holder).or_default() += n;
        }
    }
    eprintln!(
        "migrated {ROWS} rows in {took:?}: {} bookings, {} waited past {BOOKING_LOCK_TIMEOUT} \
         on a lock, {} made again for a changed schema, slowest {:?}",
        total.bookings, total.lock_timeouts, total.schema_retries, total.slowest
    );
    for (holder, n) in &total.holders {
        eprintln!("  {n} lock timeouts while this held an exclusive lock: {holder}");
    }
    migrated.unwrap();
    assert_newest_schema(&pool, &crates).await;
    assert!(
        total.bookings > BOOKERS as u64,
        "no booking ran during the migration"
    );
    assert_eq!(
        total.lock_timeouts, 0,
        "bookings waited past {BOOKING_LOCK_TIMEOUT} on a lock"
    );
}

/// `ROWS` finished keys, their paid rides and an audit record each, as the oldest schema holds
/// them (`idempotency_keys.user_id BIGINT`, `rides.idempotency_key_id` referencing the key's id).
async fn load_oldest_schema(pool: &PgPool) {
    sqlx::raw_sql(&format!(
        "INSERT INTO users (id, email, api_key_hash, stripe_customer_id)
         SELECT u, 'rider' || u || '@example.com', sha256(u::text::bytea), 'cus_' || u
         FROM generate_series(1, {USERS}) u;
         SELECT setval('users_id_seq', {USERS});
         INSERT INTO idempotency_keys
             (id, user_id, request_method, request_path, idempotency_key, fingerprint,
              request_params, recovery_point, response_status, response_headers, response_body,
              finished_at)
         SELECT g, 1 + g % {USERS}, 'POST', '/rides', 'seed-' || g, sha256(g::text::bytea),
                '{{}}', 'finished', 201, '[]', '\\x7b7d', now()
         FROM generate_series(1, {ROWS}) g;
         SELECT setval('idempotency_keys_id_seq', {ROWS});
         INSERT INTO rides (id, user_id, idempotency_key_id, origin_lat, origin_lon, target_lat,
                            target_lon, amount_cents, charge_id, status)
         SELECT g, 1 + g % {USERS}, g, 37.77, -122.42, 37.80, -122.27, 2000, 'ch_seed_' || g,
                'paid'
         FROM generate_series(1, {ROWS}) g;
         SELECT setval('rides_id_seq', {ROWS});
         INSERT INTO audit_records (user_id, action, resource_type, resource_id, data)
         SELECT 1 + g % {USERS}, 'ride.created', 'ride', g, '{{}}'
         FROM generate_series(1, {ROWS}) g;
         ANALYZE;"
    ))
    .execute(pool)
    .await
    .unwrap();
}

/// A pool on the test's database whose sessions wait at most `BOOKING_LOCK_TIMEOUT` for a lock.
async fn booking_pool(pool: &PgPool) -> PgPool {
    let options: PgConnectOptions = pool
        .connect_options()
        .as_ref()
        .clone()
        .options([("lock_timeout", BOOKING_LOCK_TIMEOUT)]);
    PgPoolOptions::new()
        .max_connections(BOOKERS as u32)
        .connect_with(options)
        .await
        .unwrap()
}

/// Books until the migration is over, counting what happened.
async fn book_until_done(
    pool: &PgPool,
    booker: usize,
    migrating: &AtomicBool,
    started: &Barrier,
) -> Tally {
    let mut tally = Tally::default();
    let mut first = true;
    let mut n = 0_u64;
    while first || migrating.load(Ordering::SeqCst) {
        n += 1;
        let user = 1 + (booker as i64 * 7919 + n as i64) % USERS;
        let key = format!("live-{booker}-{n}");
        let begun = Instant::now();
        match book(pool, user, &key).await {
            Ok(()) => {
                tally.bookings += 1;
                tally.slowest = tally.slowest.max(begun.elapsed());
            }
            Err(e) => match e.as_database_error().and_then(|d| d.code()).as_deref() {
                Some(LOCK_NOT_AVAILABLE) => {
                    tally.lock_timeouts += 1;
                    *tally
                        .holders
                        .entry(exclusive_holder(pool).await)
                        .or_default() += 1;
                }
                Some(code) if SCHEMA_CHANGED.contains(&code) => tally.schema_retries += 1,
                _ => panic!("booking {key}: {e}"),
            },
        }
        if first {
            first = false;
            started.wait().await;
        }
    }
    tally
}

/// One booking, in two transactions as the service's first two phases: the key is claimed, then
/// the ride, its audit record and the key's finished answer are written together.
async fn book(pool: &PgPool, user: i64, key: &str) -> Result<(), sqlx::Error> {
    let (owner_text, key_owner) = schema_shape(pool).await?;
    let owner_column = if owner_text { "owner" } else { "user_id" };
    let owner = if owner_text { "$1::bigint::text" } else { "$1" };
    let key_id: i64 = sqlx::query_scalar(&format!(
        "INSERT INTO idempotency_keys
             ({owner_column}, request_method, request_path, idempotency_key, fingerprint,
              request_params, recovery_point, locked_until)
         VALUES ({owner}, 'POST', '/rides', $2::text, sha256(convert_to($2::text, 'UTF8')), '{{}}', 'started',
                 now() + interval '30 seconds')
         RETURNING id"
    ))
    .bind(user)
    .bind(key)
    .fetch_one(pool)
    .await?;
    let mut tx = pool.begin().await?;
    let (ride_owner_column, ride_owner) = if key_owner {
        (", key_owner", ", $1::text")
    } else {
        ("", "")
    };
    let ride_id: i64 = sqlx::query_scalar(&format!(
        "INSERT INTO rides (user_id, idempotency_key_id, origin_lat, origin_lon, target_lat,
                            target_lon, amount_cents{ride_owner_column})
         VALUES ($1, $2, 37.77, -122.42, 37.80, -122.27, 2000{ride_owner})
         RETURNING id"
    ))
    .bind(user)
    .bind(key_id)
    .fetch_one(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO audit_records (user_id, action, resource_type, resource_id)
         VALUES ($1, 'ride.created', 'ride', $2)",
    )
    .bind(user)
    .bind(ride_id)
    .execute(&mut *tx)
    .await?;
    sqlx::query(&format!(
        "UPDATE idempotency_keys
         SET recovery_point = 'finished', locked_until = NULL, response_status = 201,
             response_headers = '[]', response_body = '\\x7b7d', finished_at = now(),
             last_run_at = now()
         WHERE {owner_column} = {owner} AND id = $2"
    ))
    .bind(user)
    .bind(key_id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// The first line of the statement of whoever holds a lock on the bookings' tables that stops
/// their writes (`SHARE` and above: an index build's, an exclusive lock), with the lock's mode.
async fn exclusive_holder(pool: &PgPool) -> String {
    let holder: Option<String> = sqlx::query_scalar(
        "SELECT l.mode || ': ' || split_part(a.query, E'\n', 1)
         FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE l.granted
           AND l.mode IN ('ShareLock', 'ShareRowExclusiveLock', 'ExclusiveLock',
                          'AccessExclusiveLock')
           AND a.pid <> pg_backend_pid()
           AND l.relation IN ('idempotency_keys'::regclass, 'rides'::regclass,
                              'audit_records'::regclass)
         LIMIT 1",
    )
    .fetch_optional(pool)
    .await
    .unwrap();
    holder.unwrap_or_else(|| "(released by then)".to_owned())
}

/// Whether the key's owner is text yet (the column `owner`), and whether rides name it
/// (`key_owner`). Read from the catalog, which takes no lock on the tables.
async fn schema_shape(pool: &PgPool) -> Result<(bool, bool), sqlx::Error> {
    sqlx::query_as(
        "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'idempotency_keys'::regclass
                        AND attname = 'owner' AND NOT attisdropped),
                EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'rides'::regclass
                        AND attname = 'key_owner' AND NOT attisdropped)",
    )
    .fetch_one(pool)
    .await
}

/// Every migration of both sides is recorded as applied.
async fn assert_newest_schema(pool: &PgPool, crates: &std::path::Path) {
    for (dir, table) in [
        ("idempotency/migrations", "idempotency_schema_migrations"),
        ("rocket-rides/migrations", "_sqlx_migrations"),
    ] {
        let mut files: Vec<i64> = std::fs::read_dir(crates.join(dir))
            .unwrap()
            .map(|entry| {
                entry.unwrap().file_name().to_str().unwrap()[..14]
                    .parse()
                    .unwrap()
            })
            .collect();
        files.sort_unstable();
        let applied: Vec<i64> =
            sqlx::query_scalar(&format!("SELECT version FROM {table} ORDER BY version"))
                .fetch_all(pool)
                .await
                .unwrap();
        assert_eq!(applied, files, "{table}");
    }
}
