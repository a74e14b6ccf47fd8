//! The crate's own migrations bookkeeping: a fresh database, one migrated by an earlier version
//! (which shared sqlx's `_sqlx_migrations`) upgraded in place with rows in it, and the refusals.

use std::sync::Arc;
use std::time::Duration;

use idempotency::{
    Claim, DatabaseClock, Error, Fingerprint, IdempotencyKey, NewRequest, OneStep, Store,
    StoredResponse,
};
use serde_json::json;
use sqlx::PgPool;

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

fn crate_migrations() -> usize {
    std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .unwrap()
        .count()
}

async fn claim(store: &Store, key: &str) -> Claim<OneStep> {
    let key = IdempotencyKey::parse(key.as_bytes()).unwrap();
    let body = json!({"cents": 5});
    let request = NewRequest {
        user_id: 4,
        method: "POST",
        route: "/orders",
        key: &key,
        fingerprint: Fingerprint::of_json("POST", "/orders", &body),
        params: &body,
    };
    store.claim(request).await.unwrap()
}

#[sqlx::test(migrations = false)]
async fn a_fresh_database_gets_the_crates_bookkeeping_and_leaves_sqlxs_alone(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    idempotency::migrate(&pool).await.unwrap();
    let recorded = count(
        &pool,
        "SELECT count(*) FROM idempotency_schema_migrations WHERE NOT adopted",
    )
    .await;
    assert_eq!(recorded as usize, crate_migrations());
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM pg_class WHERE relname = '_sqlx_migrations'"
        )
        .await,
        0
    );
    // The application's migrator needs no set_ignore_missing: it sees only its own.
    sqlx::migrate!("./tests/app_migrations")
        .run(&pool)
        .await
        .unwrap();
}

#[sqlx::test(migrations = false)]
async fn a_database_of_the_earlier_bookkeeping_upgrades_in_place_with_its_keys(pool: PgPool) {
    // As an earlier version migrated: the crate's entries in _sqlx_migrations, beside the
    // application's, each migrator ignoring the other's.
    let mut earlier = sqlx::migrate!("./migrations");
    earlier.set_ignore_missing(true);
    earlier.run(&pool).await.unwrap();
    let mut app = sqlx::migrate!("./tests/app_migrations");
    app.set_ignore_missing(true);
    app.run(&pool).await.unwrap();
    // With rows in it: a finished key, an unfinished one, an order referencing the first.
    let store = Store::new(
        pool.clone(),
        Arc::new(DatabaseClock),
        Duration::from_secs(30),
    )
    .unwrap();
    let Claim::Acquired(mut done) = claim(&store, "finished").await else {
        panic!("a new key");
    };
    let answer = StoredResponse::json(201, &json!({"order": 1}), vec![]);
    let key_id = done.key_id();
    store
        .final_phase(&mut done)
        .await
        .unwrap()
        .finish(&answer)
        .await
        .unwrap();
    sqlx::query("INSERT INTO orders (user_id, key_id) VALUES (4, $1)")
        .bind(key_id)
        .execute(&pool)
        .await
        .unwrap();
    let Claim::Acquired(open) = claim(&store, "unfinished").await else {
        panic!("a new key");
    };
    store.release(open).await.unwrap();
    // Before the upgrade, an application migrator that does not ignore the crate's entries fails.
    let strict = sqlx::migrate!("./tests/app_migrations").run(&pool).await;
    assert!(
        strict.is_err(),
        "sqlx should see the crate's entries as missing"
    );

    idempotency::migrate(&pool).await.unwrap();

    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_schema_migrations WHERE adopted"
        )
        .await as usize,
        crate_migrations()
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM _sqlx_migrations").await,
        1,
        "only the application's entry stays in sqlx's table"
    );
    sqlx::migrate!("./tests/app_migrations")
        .run(&pool)
        .await
        .unwrap();
    // The keys are as they were.
    assert!(matches!(claim(&store, "finished").await, Claim::Replay(r) if r == answer));
    assert!(matches!(
        claim(&store, "unfinished").await,
        Claim::Acquired(_)
    ));
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM orders WHERE key_id IS NOT NULL"
        )
        .await,
        1
    );
    // And again: nothing to do.
    idempotency::migrate(&pool).await.unwrap();
}

#[sqlx::test(migrations = false)]
async fn an_applied_migration_whose_contents_differ_is_refused(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    sqlx::query(
        "UPDATE idempotency_schema_migrations SET checksum = '\\x00'
         WHERE version = (SELECT min(version) FROM idempotency_schema_migrations)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let refused = idempotency::migrate(&pool).await.unwrap_err();
    assert!(
        matches!(&refused, Error::Migration(why) if why.contains("other contents")),
        "{refused}"
    );
}

#[sqlx::test(migrations = false)]
async fn a_failed_entry_of_the_earlier_bookkeeping_is_refused(pool: PgPool) {
    let mut earlier = sqlx::migrate!("./migrations");
    earlier.set_ignore_missing(true);
    earlier.run(&pool).await.unwrap();
    sqlx::query("UPDATE _sqlx_migrations SET success = false WHERE version = (SELECT max(version) FROM _sqlx_migrations)")
        .execute(&pool)
        .await
        .unwrap();
    let refused = idempotency::migrate(&pool).await.unwrap_err();
    assert!(
        matches!(&refused, Error::Migration(why) if why.contains("failed earlier")),
        "{refused}"
    );
    // Nothing was moved, nothing created: the run is one transaction.
    assert_eq!(
        count(&pool, "SELECT count(*) FROM _sqlx_migrations").await as usize,
        crate_migrations()
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM pg_class WHERE relname = 'idempotency_schema_migrations'"
        )
        .await,
        0
    );
}

#[sqlx::test(migrations = false)]
async fn migrators_that_start_together_take_turns(pool: PgPool) {
    let runs = (0..4).map(|_| {
        let pool = pool.clone();
        tokio::spawn(async move { idempotency::migrate(&pool).await })
    });
    for run in runs {
        run.await.unwrap().unwrap();
    }
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_schema_migrations").await as usize,
        crate_migrations()
    );
}

#[sqlx::test(migrations = false)]
async fn an_application_migration_with_one_of_the_crates_versions_is_left_alone(pool: PgPool) {
    // An application whose own migration, applied before it took up the crate, happens to carry
    // the version of the crate's first one (date-based numbers meet).
    sqlx::raw_sql(
        "CREATE TABLE _sqlx_migrations (
             version BIGINT PRIMARY KEY, description TEXT NOT NULL,
             installed_on TIMESTAMPTZ NOT NULL DEFAULT now(), success BOOLEAN NOT NULL,
             checksum BYTEA NOT NULL, execution_time BIGINT NOT NULL);
         INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (20261129000001, 'create invoices', true, '\\x0102', 7);",
    )
    .execute(&pool)
    .await
    .unwrap();
    idempotency::migrate(&pool).await.unwrap();
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM _sqlx_migrations WHERE description = 'create invoices'"
        )
        .await,
        1,
        "the application's entry stays"
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_schema_migrations WHERE NOT adopted"
        )
        .await as usize,
        crate_migrations(),
        "the crate's migrations ran, none adopted"
    );
    let store = Store::new(
        pool.clone(),
        Arc::new(DatabaseClock),
        Duration::from_secs(30),
    )
    .unwrap();
    assert!(matches!(claim(&store, "k").await, Claim::Acquired(_)));
}
