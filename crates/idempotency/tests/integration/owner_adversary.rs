//! Adversarial review of the text owner (`Owner`, migration 20261202000001) and of
//! `migrate_with`: owners that look alike never share a key, the table refuses owners the type
//! refuses, and the combined migrator's orderings, failures and refusals.
//!
//! Each finding of the review is kept as a test of its fix: the combined migrator refuses a
//! database the plain one got to first, the crate's migration runs first on a tie, and the
//! table counts an owner's UTF-8 bytes in any database encoding.

use std::sync::Arc;
use std::time::Duration;

use idempotency::{
    Claim, DatabaseClock, Fingerprint, IdempotencyKey, ManualClock, NewRequest, OneStep, Owner,
    OwnerError, Store, StoredResponse,
};
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::support;
use support::migrator_of;

const TTL: Duration = Duration::from_secs(30);

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

fn key(s: &str) -> IdempotencyKey {
    IdempotencyKey::parse(s.as_bytes()).unwrap()
}

fn request<'a>(owner: &'a Owner, key: &'a IdempotencyKey, body: &'a Value) -> NewRequest<'a> {
    NewRequest {
        owner,
        method: "POST",
        route: "/orders",
        key,
        fingerprint: Fingerprint::of_json("POST", "/orders", body),
        params: body,
    }
}

fn acquired(claim: Claim<OneStep>) -> idempotency::Lease<OneStep> {
    match claim {
        Claim::Acquired(lease) => lease,
        other => panic!("expected an acquired lease, got {other:?}"),
    }
}

const OWNER_TEXT: i64 = 20261202000001;

async fn owner_type(pool: &PgPool) -> Option<String> {
    sqlx::query_scalar(
        "SELECT data_type::text FROM information_schema.columns
         WHERE table_name = 'idempotency_keys' AND column_name = 'owner'",
    )
    .fetch_optional(pool)
    .await
    .unwrap()
}

async fn orders_fk(pool: &PgPool) -> i64 {
    count(
        pool,
        "SELECT count(*) FROM pg_constraint
         WHERE contype = 'f' AND conrelid = 'orders'::regclass
           AND confrelid = 'idempotency_keys'::regclass",
    )
    .await
}

/// The database as the crate before the text owner left it (bookkeeping in sqlx's table), with
/// the application's first migration (an integer reference) applied beside it.
async fn earlier_database(pool: &PgPool) {
    let mut earlier = migrator_of("migrations", OWNER_TEXT, &[]).await;
    earlier.set_ignore_missing(true);
    earlier.run(pool).await.unwrap();
    let mut app = migrator_of("tests/app_upgrade", 20261201900001, &[]).await;
    app.set_ignore_missing(true);
    app.run(pool).await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Scope: owners that look alike are different owners, and nothing one does reaches another's.
// ---------------------------------------------------------------------------------------------

#[sqlx::test(migrations = false)]
async fn look_alike_owners_never_share_a_key_a_lease_or_a_replay(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let store = Store::new(pool.clone(), Arc::new(DatabaseClock), TTL).unwrap();
    let prefix = "x".repeat(127);
    let owners: Vec<Owner> = [
        "1".to_owned(),
        "01".to_owned(),
        " 1".to_owned(),
        "1 ".to_owned(),
        "+1".to_owned(),
        "1\n".to_owned(),
        "\u{e9}".to_owned(),   // é, precomposed (NFC)
        "e\u{301}".to_owned(), // é, decomposed (NFD)
        "\u{212b}".to_owned(), // Å, the angstrom sign
        "\u{c5}".to_owned(),   // Å, the letter
        "ß".to_owned(),
        "ss".to_owned(),
        format!("{prefix}a"),
        format!("{prefix}b"),
    ]
    .into_iter()
    .map(|s| Owner::new(s).unwrap())
    .collect();
    let (k, body) = (key("shared"), json!({"cents": 5}));
    // The first owner finishes its key; every other one must see a new key, not its replay.
    let mut first = acquired(store.claim(request(&owners[0], &k, &body)).await.unwrap());
    let answer = StoredResponse::json(201, &json!({"order": "of owner 1"}), vec![]);
    let phase = store.final_phase(&mut first).await.unwrap();
    phase.finish(&answer).await.unwrap();
    let mut ids = std::collections::HashSet::new();
    for owner in &owners[1..] {
        let lease = acquired(store.claim(request(owner, &k, &body)).await.unwrap());
        assert_eq!(lease.owner(), owner);
        assert!(ids.insert(lease.key_id()), "{owner:?} shares a key row");
        // Still held: a second claim of the same owner is in flight, never another's replay.
        assert!(matches!(
            store
                .claim::<OneStep>(request(owner, &k, &body))
                .await
                .unwrap(),
            Claim::InFlight { .. }
        ));
    }
    assert_eq!(
        count(&pool, "SELECT count(DISTINCT owner) FROM idempotency_keys").await as usize,
        owners.len()
    );
    assert!(matches!(
        store.claim::<OneStep>(request(&owners[0], &k, &body)).await.unwrap(),
        Claim::Replay(r) if r == answer
    ));
}

#[test]
fn owners_that_differ_only_after_byte_128_are_refused_not_truncated() {
    let prefix = "o".repeat(128);
    assert_eq!(Owner::new(format!("{prefix}a")), Err(OwnerError::TooLong));
    assert_eq!(Owner::new(format!("{prefix}b")), Err(OwnerError::TooLong));
    // A multi-byte character that straddles byte 128 is refused whole.
    assert_eq!(
        Owner::new(format!("{}é", "o".repeat(127))),
        Err(OwnerError::TooLong)
    );
    assert!(Owner::new("\0").is_err());
    assert!(Owner::new("a\0").is_err());
    assert!(
        " ".parse::<Owner>().is_ok(),
        "whitespace is an owner like any other"
    );
    assert_eq!(Owner::from(0_i64).as_str(), "0");
    assert_eq!(Owner::from(i64::MIN).as_str(), "-9223372036854775808");
}

#[sqlx::test(migrations = false)]
async fn the_table_refuses_the_owners_the_type_refuses(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let insert = |owner: String| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO idempotency_keys
                     (owner, request_method, request_path, idempotency_key, fingerprint,
                      request_params, recovery_point)
                 VALUES ($1, 'POST', '/orders', 'raw', decode(repeat('00', 32), 'hex'), '{}',
                         'started')",
            )
            .bind(owner)
            .execute(&pool)
            .await
        }
    };
    for bad in [String::new(), "a".repeat(129), "é".repeat(65)] {
        let refused = insert(bad.clone()).await.unwrap_err();
        assert_eq!(
            refused.as_database_error().and_then(|e| e.constraint()),
            Some("idempotency_keys_owner_length"),
            "{} bytes: {refused}",
            bad.len()
        );
    }
    // PostgreSQL's text has no NUL: the driver's error, not a stored row.
    assert!(insert("a\0b".to_owned()).await.is_err());
    // Exactly what Owner::new accepts, byte for byte (the database is UTF-8).
    insert("é".repeat(64)).await.unwrap();
    assert!(Owner::new("é".repeat(64)).is_ok());
}

#[sqlx::test(migrations = false)]
async fn one_owners_lease_never_writes_another_owners_key_of_the_same_name(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let clock = ManualClock::starting_now();
    let store = Store::new(pool.clone(), Arc::new(clock.clone()), TTL).unwrap();
    let (one, padded) = (Owner::from(1), Owner::new("01").unwrap());
    let (k, body) = (key("same"), json!({"cents": 5}));
    let a = acquired(store.claim(request(&one, &k, &body)).await.unwrap());
    let b = acquired(store.claim(request(&padded, &k, &body)).await.unwrap());
    let b_id = b.key_id();
    let snapshot = |id: i64| {
        let pool = pool.clone();
        async move {
            sqlx::query_as::<_, (String, i64, Option<time::OffsetDateTime>, Option<i16>)>(
                "SELECT owner, lease_token, locked_until, response_status
                 FROM idempotency_keys WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let before = snapshot(b_id).await;
    // Owner 1 renews, releases, takes over again, abandons: owner "01"'s row never moves.
    let mut a = a;
    store.renew(&mut a).await.unwrap();
    store.release(a).await.unwrap();
    let a = acquired(store.claim(request(&one, &k, &body)).await.unwrap());
    store.abandon(a).await.unwrap();
    assert_eq!(snapshot(b_id).await, before);
    // The completer, past the grace, gets "01"'s key under "01" only.
    store.release(b).await.unwrap();
    clock.advance(Duration::from_secs(3600));
    let taken: Vec<idempotency::Lease<OneStep>> = store
        .claim_abandoned("POST", "/orders", Duration::from_secs(1), 10)
        .await
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(taken.len(), 1);
    assert_eq!((taken[0].key_id(), taken[0].owner()), (b_id, &padded));
    // Finished and past retention, each owner's key is reaped under its own owner.
    let mut lease = taken.into_iter().next().unwrap();
    store
        .final_phase(&mut lease)
        .await
        .unwrap()
        .finish(&StoredResponse::json(201, &json!({}), vec![]))
        .await
        .unwrap();
    clock.advance(Duration::from_secs(3600));
    assert_eq!(
        store
            .reap_finished(Duration::from_secs(60), 100)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        0
    );
}

// ---------------------------------------------------------------------------------------------
// migrate_with: orderings, failures, refusals.
// ---------------------------------------------------------------------------------------------

/// On a new database, the crate's plain `migrate` (run by a tool, a test fixture, a second
/// service sharing the database, an older deploy script) turns the owner into text before any
/// application migration, and the application's old migrations, which reference
/// `idempotency_keys (user_id, id)`, can never run. `migrate_with` cannot mend that; it refuses
/// at once, saying why, and applies nothing, every time.
#[sqlx::test(migrations = false)]
async fn plain_migrate_first_on_a_new_database_makes_migrate_with_refuse_clearly(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let app = sqlx::migrate!("./tests/app_upgrade");
    for _ in 0..2 {
        let refused = idempotency::migrate_with(&pool, &app).await.unwrap_err();
        let why = refused.to_string();
        assert!(
            why.contains("20261201000001") && why.contains("plain `migrate`"),
            "{why}"
        );
        assert_eq!(
            count(&pool, "SELECT count(*) FROM _sqlx_migrations").await,
            0,
            "nothing applied"
        );
    }
}

#[sqlx::test(migrations = false)]
async fn an_app_migrator_that_ignores_missing_ones_upgrades_past_an_unknown_entry(pool: PgPool) {
    earlier_database(&pool).await;
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (20261201500000, 'from another build', true, '\\x00', 1)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut app = sqlx::migrate!("./tests/app_upgrade");
    app.set_ignore_missing(true);
    idempotency::migrate_with(&pool, &app).await.unwrap();
    assert_eq!(owner_type(&pool).await.as_deref(), Some("text"));
    assert_eq!(orders_fk(&pool).await, 1);
    idempotency::migrate_with(&pool, &app).await.unwrap();
}

#[sqlx::test(migrations = false)]
async fn a_failed_application_migration_after_the_owner_change_is_recovered_by_a_rerun(
    pool: PgPool,
) {
    earlier_database(&pool).await;
    sqlx::query("INSERT INTO orders (user_id, key_id) VALUES (4, NULL)")
        .execute(&pool)
        .await
        .unwrap();
    // The re-creation fails half-way (its second statement).
    let broken = migrator_of(
        "tests/app_upgrade",
        20261203000001,
        &[(
            "20261203000001_orders_text_key_owner.sql",
            "ALTER TABLE orders ADD COLUMN key_owner TEXT;\nSELECT 1/0;\n",
        )],
    )
    .await;
    assert!(idempotency::migrate_with(&pool, &broken).await.is_err());
    // Left: the reference released, the owner text, the failed migration not recorded and its
    // half undone (its own transaction).
    assert_eq!(owner_type(&pool).await.as_deref(), Some("text"));
    assert_eq!(orders_fk(&pool).await, 0);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM information_schema.columns
             WHERE table_name = 'orders' AND column_name = 'key_owner'"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM _sqlx_migrations WHERE NOT success"
        )
        .await,
        0
    );
    // The fixed file runs on the rerun.
    idempotency::migrate_with(&pool, &sqlx::migrate!("./tests/app_upgrade"))
        .await
        .unwrap();
    assert_eq!(orders_fk(&pool).await, 1);
}

#[sqlx::test(migrations = false)]
async fn a_failed_release_leaves_the_integer_owner_and_a_rerun_recovers(pool: PgPool) {
    earlier_database(&pool).await;
    let broken = migrator_of(
        "tests/app_upgrade",
        20261201900001,
        &[(
            "20261201900001_orders_release_key_owner.sql",
            "ALTER TABLE orders DROP CONSTRAINT no_such_constraint;\n",
        )],
    )
    .await;
    assert!(idempotency::migrate_with(&pool, &broken).await.is_err());
    assert_eq!(owner_type(&pool).await, None, "the crate's waited");
    assert_eq!(orders_fk(&pool).await, 1, "the reference is still checked");
    idempotency::migrate_with(&pool, &sqlx::migrate!("./tests/app_upgrade"))
        .await
        .unwrap();
    assert_eq!(owner_type(&pool).await.as_deref(), Some("text"));
    assert_eq!(orders_fk(&pool).await, 1);
}

#[sqlx::test(migrations = false)]
async fn no_transaction_application_migrations_run_on_both_sides_of_the_owner_change(pool: PgPool) {
    let app = migrator_of(
        "tests/app_upgrade",
        i64::MAX,
        &[
            (
                "20261201950000_orders_key_index.sql",
                "-- no-transaction\nCREATE INDEX CONCURRENTLY orders_key_idx ON orders (key_id);\n",
            ),
            (
                "20261203500000_orders_owner_index.sql",
                "-- no-transaction\nCREATE INDEX CONCURRENTLY orders_owner_idx ON orders (key_owner);\n",
            ),
        ],
    )
    .await;
    assert_eq!(app.iter().filter(|m| m.no_tx).count(), 2);
    idempotency::migrate_with(&pool, &app).await.unwrap();
    assert_eq!(owner_type(&pool).await.as_deref(), Some("text"));
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname IN ('orders_key_idx', 'orders_owner_idx') AND i.indisvalid"
        )
        .await,
        2
    );
    // And on a database at the earlier schema.
    let other = format!("owner_adv_{}", idempotency::Uuid::new_v4().simple());
    let upgraded = {
        sqlx::query(&format!("CREATE DATABASE \"{other}\""))
            .execute(&pool)
            .await
            .unwrap();
        let options = pool.connect_options().as_ref().clone().database(&other);
        PgPool::connect_with(options).await.unwrap()
    };
    earlier_database(&upgraded).await;
    idempotency::migrate_with(&upgraded, &app).await.unwrap();
    assert_eq!(owner_type(&upgraded).await.as_deref(), Some("text"));
    assert_eq!(orders_fk(&upgraded).await, 1);
    upgraded.close().await;
    let _ = sqlx::query(&format!("DROP DATABASE \"{other}\""))
        .execute(&pool)
        .await;
}

#[sqlx::test(migrations = false)]
async fn an_application_whose_migrations_all_follow_the_crates_migrates_new_and_old(pool: PgPool) {
    idempotency::migrate_with(&pool, &sqlx::migrate!("./tests/app_migrations"))
        .await
        .unwrap();
    assert_eq!(owner_type(&pool).await.as_deref(), Some("text"));
    assert_eq!(orders_fk(&pool).await, 1);
    // A database the crate migrated alone first, then the application joins.
    let second = migrator_of("tests/app_migrations", i64::MAX, &[]).await;
    idempotency::migrate_with(&pool, &second).await.unwrap();
    idempotency::migrate(&pool).await.unwrap();
    assert_eq!(
        count(&pool, "SELECT count(*) FROM _sqlx_migrations").await,
        1
    );
}

#[sqlx::test(migrations = false)]
async fn plain_migrate_refuses_any_reference_to_the_key_table_and_changes_nothing(pool: PgPool) {
    // A reference by (id) alone, as the earliest migrations allowed, stops the change too: it is
    // an application's, whose later migrations a plain `migrate` cannot see, and may still be
    // written for the integer owner.
    let mut earlier = migrator_of("migrations", OWNER_TEXT, &[]).await;
    earlier.set_ignore_missing(true);
    earlier.run(&pool).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE by_id (key_id BIGINT REFERENCES idempotency_keys (id) ON DELETE SET NULL);
         CREATE TABLE by_owner (user_id BIGINT, key_id BIGINT,
             FOREIGN KEY (user_id, key_id) REFERENCES idempotency_keys (user_id, id));",
    )
    .execute(&pool)
    .await
    .unwrap();
    let refused = idempotency::migrate(&pool).await.unwrap_err().to_string();
    assert!(
        refused.contains("by_owner") && refused.contains("by_id"),
        "{refused}"
    );
    assert_eq!(owner_type(&pool).await, None);
    sqlx::query("DROP TABLE by_owner")
        .execute(&pool)
        .await
        .unwrap();
    let refused = idempotency::migrate(&pool).await.unwrap_err().to_string();
    assert!(refused.contains("by_id"), "{refused}");
    assert_eq!(owner_type(&pool).await, None);
    sqlx::query("ALTER TABLE by_id DROP CONSTRAINT by_id_key_id_fkey")
        .execute(&pool)
        .await
        .unwrap();
    idempotency::migrate(&pool).await.unwrap();
    assert_eq!(owner_type(&pool).await.as_deref(), Some("text"));
}

#[sqlx::test(migrations = false)]
async fn the_upgrade_keeps_the_tables_shape_the_store_relies_on(pool: PgPool) {
    earlier_database(&pool).await;
    idempotency::migrate_with(&pool, &sqlx::migrate!("./tests/app_upgrade"))
        .await
        .unwrap();
    // The primary key and the scope's unique index are on the text owner; the fillfactor that
    // keeps updates HOT survives the rewrite; the unfinished table's owner is text too.
    let pk: String = sqlx::query_scalar(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'idempotency_keys_pkey'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(pk, "PRIMARY KEY (owner, id)");
    let scope: String = sqlx::query_scalar(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint
         WHERE conname = 'idempotency_keys_scope_unique'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(scope.starts_with("UNIQUE (owner, "), "{scope}");
    let options: Option<Vec<String>> =
        sqlx::query_scalar("SELECT reloptions FROM pg_class WHERE relname = 'idempotency_keys'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(options, Some(vec!["fillfactor=80".to_owned()]));
    assert_eq!(
        sqlx::query_scalar::<_, String>(
            "SELECT data_type::text FROM information_schema.columns
             WHERE table_name = 'idempotency_keys_unfinished' AND column_name = 'owner'"
        )
        .fetch_one(&pool)
        .await
        .unwrap(),
        "text"
    );
}

/// On a version tie the crate's migration runs first, as documented: an application migration
/// of the owner change's own version may reference `idempotency_keys (owner, id)`.
#[sqlx::test(migrations = false)]
async fn on_a_version_tie_the_crates_migration_runs_first(pool: PgPool) {
    let app = migrator_of(
        "tests/app_migrations",
        0,
        &[(
            "20261202000001_orders.sql",
            "CREATE TABLE orders (owner TEXT NOT NULL, id BIGSERIAL, key_id BIGINT,
                 PRIMARY KEY (owner, id),
                 FOREIGN KEY (owner, key_id) REFERENCES idempotency_keys (owner, id)
                     ON DELETE SET NULL (key_id));\n",
        )],
    )
    .await;
    let ran = idempotency::migrate_with(&pool, &app).await;
    assert!(
        ran.is_ok(),
        "the crate's 20261202000001 should run before the application's: {:?}",
        ran.err().map(|e| e.to_string())
    );
}

/// The table's check counts the owner's UTF-8 bytes, as the type does, whatever the database's
/// encoding: in a LATIN1 database, 128 `é` (128 octets there, 256 bytes in Rust) are refused by
/// the table as by `Owner::new`. An owner the database cannot represent (`€` in LATIN1) is an
/// error of the claim, which writes nothing.
#[sqlx::test(migrations = false)]
async fn in_a_latin1_database_the_owner_check_counts_utf8_bytes(pool: PgPool) {
    let latin = format!("owner_adv_latin1_{}", idempotency::Uuid::new_v4().simple());
    sqlx::query(&format!(
        "CREATE DATABASE \"{latin}\" ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
    ))
    .execute(&pool)
    .await
    .unwrap();
    let latin_pool = PgPool::connect_with(pool.connect_options().as_ref().clone().database(&latin))
        .await
        .unwrap();
    idempotency::migrate(&latin_pool).await.unwrap();
    let long = "é".repeat(128);
    assert_eq!(Owner::new(long.clone()), Err(OwnerError::TooLong));
    let stored = sqlx::query(
        "INSERT INTO idempotency_keys
             (owner, request_method, request_path, idempotency_key, fingerprint, request_params,
              recovery_point)
         VALUES ($1, 'POST', '/orders', 'raw', decode(repeat('00', 32), 'hex'), '{}', 'started')",
    )
    .bind(&long)
    .execute(&latin_pool)
    .await;
    let fits = sqlx::query(
        "INSERT INTO idempotency_keys
             (owner, request_method, request_path, idempotency_key, fingerprint, request_params,
              recovery_point)
         VALUES ($1, 'POST', '/orders', 'raw', decode(repeat('00', 32), 'hex'), '{}', 'started')",
    )
    .bind("é".repeat(64))
    .execute(&latin_pool)
    .await;
    let store = Store::new(latin_pool.clone(), Arc::new(DatabaseClock), TTL).unwrap();
    let euro = Owner::new("€").unwrap();
    let (k, body) = (key("k"), json!({}));
    let claimed = store.claim::<OneStep>(request(&euro, &k, &body)).await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(&latin_pool)
        .await
        .unwrap();
    latin_pool.close().await;
    let _ = sqlx::query(&format!("DROP DATABASE \"{latin}\""))
        .execute(&pool)
        .await;
    assert!(stored.is_err(), "the table took an owner the type refuses");
    assert!(fits.is_ok(), "64 é are 128 UTF-8 bytes: {fits:?}");
    assert!(claimed.is_err(), "'€' cannot be stored in LATIN1");
    assert_eq!(rows, 1, "only the owner that fits was written");
}
