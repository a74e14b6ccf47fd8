//! The crate's own migrations bookkeeping: a fresh database, one migrated by an earlier version
//! (which shared sqlx's `_sqlx_migrations`) upgraded in place with rows in it, and the refusals.

use std::sync::Arc;
use std::time::Duration;

use idempotency::{
    Claim, DatabaseClock, Error, Fingerprint, IdempotencyKey, NewRequest, OneStep, Owner, Store,
    StoredResponse,
};
use serde_json::json;
use sqlx::PgPool;

use crate::support;

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
    let owner = Owner::from(4);
    let request = NewRequest {
        owner: &owner,
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

/// The crate's migrations (or the application's) below `below`, as an earlier version held them.
async fn migrator_below(dir: &str, below: i64) -> sqlx::migrate::Migrator {
    support::migrator_of(dir, below, &[]).await
}

/// The version of the crate's migration that turned the owner into text.
const OWNER_TEXT: i64 = 20261202000001;

/// A database as the crate's versions before the text owner left it, recording in sqlx's
/// table, with the application's first migration (an integer owner referenced) beside it, and
/// rows: a finished key, an unfinished one, and an order referencing the first. Returns the
/// finished key's stored answer.
async fn earlier_database(pool: &PgPool) -> StoredResponse {
    let mut earlier = migrator_below("migrations", OWNER_TEXT).await;
    earlier.set_ignore_missing(true);
    earlier.run(pool).await.unwrap();
    let mut app = migrator_below("tests/app_upgrade", 20261201900001).await;
    app.set_ignore_missing(true);
    app.run(pool).await.unwrap();
    let body = json!({"cents": 5});
    let fingerprint = Fingerprint::of_json("POST", "/orders", &body);
    let answer = StoredResponse::json(201, &json!({"order": 1}), vec![]);
    // Written as that schema had it (user_id BIGINT): today's store speaks of `owner`.
    let key_id: i64 = sqlx::query_scalar(
        "INSERT INTO idempotency_keys
             (user_id, request_method, request_path, idempotency_key, fingerprint,
              request_params, recovery_point, response_status, response_headers, response_body,
              finished_at)
         VALUES (4, 'POST', '/orders', 'finished', $1, $2, 'finished', $3, $4, $5, now())
         RETURNING id",
    )
    .bind(fingerprint.as_bytes().as_slice())
    .bind(sqlx::types::Json(&body))
    .bind(answer.status as i16)
    .bind(sqlx::types::Json(&answer.headers))
    .bind(&answer.body)
    .fetch_one(pool)
    .await
    .unwrap();
    sqlx::raw_sql(&format!(
        "INSERT INTO orders (user_id, key_id) VALUES (4, {key_id});
         WITH k AS (
             INSERT INTO idempotency_keys
                 (user_id, request_method, request_path, idempotency_key, fingerprint,
                  request_params, recovery_point)
             SELECT 4, 'POST', '/orders', 'unfinished', fingerprint, request_params, 'started'
             FROM idempotency_keys WHERE id = {key_id}
             RETURNING user_id, id, request_method, request_path, created_at)
         INSERT INTO idempotency_keys_unfinished
             (user_id, key_id, request_method, request_path, created_at)
         SELECT * FROM k;"
    ))
    .execute(pool)
    .await
    .unwrap();
    answer
}

async fn owner_type(pool: &PgPool) -> Option<String> {
    sqlx::query_scalar(
        "SELECT data_type::text FROM information_schema.columns
         WHERE table_name = 'idempotency_keys' AND column_name = 'owner'",
    )
    .fetch_optional(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrations = false)]
async fn a_database_of_the_earlier_bookkeeping_upgrades_in_place_with_its_keys(pool: PgPool) {
    let answer = earlier_database(&pool).await;
    let earlier = migrator_below("migrations", OWNER_TEXT)
        .await
        .iter()
        .count();
    // Before the upgrade, an application migrator that does not ignore the crate's entries fails.
    let strict = sqlx::migrate!("./tests/app_upgrade").run(&pool).await;
    assert!(
        strict.is_err(),
        "sqlx should see the crate's entries as missing"
    );

    idempotency::migrate_with(&pool, &sqlx::migrate!("./tests/app_upgrade"))
        .await
        .unwrap();

    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_schema_migrations WHERE adopted"
        )
        .await as usize,
        earlier
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_schema_migrations WHERE NOT adopted"
        )
        .await as usize,
        crate_migrations() - earlier,
        "the text owner's migration, applied"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM _sqlx_migrations").await,
        3,
        "only the application's entries stay in sqlx's table"
    );
    assert_eq!(owner_type(&pool).await.as_deref(), Some("text"));
    // The keys are as they were, their owner in its decimal form.
    let store = Store::new(
        pool.clone(),
        Arc::new(DatabaseClock),
        Duration::from_secs(30),
    )
    .unwrap();
    assert!(matches!(claim(&store, "finished").await, Claim::Replay(r) if r == answer));
    let Claim::Acquired(open) = claim(&store, "unfinished").await else {
        panic!("the unfinished key, free to claim");
    };
    assert_eq!(open.owner().as_str(), "4");
    store.release(open).await.unwrap();
    // The order still references its key, and the re-created foreign key checks the owner.
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM orders o JOIN idempotency_keys k
             ON k.owner = o.key_owner AND k.id = o.key_id"
        )
        .await,
        1
    );
    let wrong_owner = sqlx::query(
        "INSERT INTO orders (user_id, key_owner, key_id)
         SELECT 5, '5', id FROM idempotency_keys WHERE idempotency_key = 'finished'",
    )
    .execute(&pool)
    .await
    .unwrap_err();
    assert_eq!(
        wrong_owner
            .as_database_error()
            .and_then(|e| e.code())
            .as_deref(),
        Some("23503"),
        "{wrong_owner}"
    );
    // And again: nothing to do.
    idempotency::migrate_with(&pool, &sqlx::migrate!("./tests/app_upgrade"))
        .await
        .unwrap();
    idempotency::migrate(&pool).await.unwrap();
}

#[sqlx::test(migrations = false)]
async fn the_text_owner_refuses_a_reference_by_an_integer_owner_and_changes_nothing(pool: PgPool) {
    earlier_database(&pool).await;
    let earlier = migrator_below("migrations", OWNER_TEXT)
        .await
        .iter()
        .count();
    let refused = idempotency::migrate(&pool).await.unwrap_err();
    let why = refused.to_string();
    assert!(
        why.contains("orders_user_id_key_id_fkey on orders") && why.contains("migrate_with"),
        "names the foreign key and the way out: {why}"
    );
    // One transaction: nothing adopted, nothing converted.
    assert_eq!(
        count(&pool, "SELECT count(*) FROM _sqlx_migrations").await as usize,
        earlier + 1
    );
    assert_eq!(owner_type(&pool).await, None);
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
async fn a_new_database_runs_old_application_migrations_on_their_side_of_the_crates(pool: PgPool) {
    // The application's first migration references an integer owner: on a new database it must
    // run before the crate turns the owner into text, and its re-creation after.
    idempotency::migrate_with(&pool, &sqlx::migrate!("./tests/app_upgrade"))
        .await
        .unwrap();
    assert_eq!(owner_type(&pool).await.as_deref(), Some("text"));
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM pg_constraint
             WHERE conname = 'orders_key_fkey' AND confrelid = 'idempotency_keys'::regclass"
        )
        .await,
        1
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_schema_migrations WHERE NOT adopted"
        )
        .await as usize,
        crate_migrations()
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM _sqlx_migrations").await,
        3
    );
}

#[sqlx::test(migrations = false)]
async fn combined_migrators_that_start_together_take_turns(pool: PgPool) {
    let runs = (0..4).map(|_| {
        let pool = pool.clone();
        tokio::spawn(async move {
            idempotency::migrate_with(&pool, &sqlx::migrate!("./tests/app_upgrade")).await
        })
    });
    for run in runs {
        run.await.unwrap().unwrap();
    }
    assert_eq!(
        count(&pool, "SELECT count(*) FROM _sqlx_migrations").await,
        3
    );
}

#[sqlx::test(migrations = false)]
async fn an_application_migration_applied_from_other_contents_is_refused_before_anything_runs(
    pool: PgPool,
) {
    let first = migrator_below("tests/app_upgrade", 20261203000001).await;
    idempotency::migrate_with(&pool, &first).await.unwrap();
    sqlx::query("UPDATE _sqlx_migrations SET checksum = '\\x00'")
        .execute(&pool)
        .await
        .unwrap();
    let refused = idempotency::migrate_with(&pool, &sqlx::migrate!("./tests/app_upgrade"))
        .await
        .unwrap_err();
    assert!(matches!(refused, Error::Migration(_)), "{refused}");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM _sqlx_migrations").await,
        2,
        "nothing more applied"
    );
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

/// The version of the crate's migration that adds a column to the key table: it needs the
/// table's exclusive lock, and its file sets no bound on the wait of its own.
const REQUEST_UUID: i64 = 20261130000001;

#[sqlx::test(migrations = false)]
async fn a_migration_behind_a_long_transaction_gives_up_naming_it_and_applies_nothing(
    pool: PgPool,
) {
    let mut earlier = migrator_below("migrations", REQUEST_UUID).await;
    earlier.set_ignore_missing(true);
    earlier.run(&pool).await.unwrap();
    // A transaction that read the key table and stays open holds a lock the migration's
    // ALTER TABLE must wait for.
    let mut reader = pool.begin().await.unwrap();
    let holder: i32 = sqlx::query_scalar(
        "SELECT pg_backend_pid() FROM (SELECT count(*) FROM idempotency_keys) AS long_reader",
    )
    .fetch_one(&mut *reader)
    .await
    .unwrap();

    let begun = std::time::Instant::now();
    let refused = idempotency::migrate(&pool).await.unwrap_err().to_string();
    let waited = begun.elapsed();

    assert!(
        refused.starts_with(idempotency::LOCK_TIMEOUT_MESSAGE),
        "{refused}"
    );
    assert!(refused.contains(&format!("pid {holder} ")), "{refused}");
    assert!(refused.contains("long_reader"), "{refused}");
    assert!(
        waited >= idempotency::MIGRATION_LOCK_TIMEOUT
            && waited < idempotency::MIGRATION_LOCK_TIMEOUT * 3,
        "gave up after {waited:?}"
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM pg_attribute
             WHERE attrelid = 'idempotency_keys'::regclass AND attname = 'request_uuid'"
        )
        .await,
        0,
        "nothing of the run is applied"
    );
    // The pool's other sessions wait without a bound, as before: the migration's is its own.
    let bound: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(bound, "0");

    reader.rollback().await.unwrap();
    idempotency::migrate(&pool).await.unwrap();
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_schema_migrations").await as usize,
        crate_migrations()
    );
}

/// An index built concurrently, as a `-- no-transaction` migration of the application's.
fn concurrent_index(prelude: &str) -> String {
    format!(
        "-- no-transaction\n{prelude}CREATE INDEX CONCURRENTLY orders_key_id_idx ON orders (key_id);\n"
    )
}

#[sqlx::test(migrations = false)]
async fn a_concurrent_index_runs_alone_in_its_migration_and_not_after_a_set(pool: PgPool) {
    // PostgreSQL runs the statements of one query string in one implicit transaction, where a
    // concurrent build is refused: the lock bound comes from the migrating session instead.
    let with_set = concurrent_index("SET lock_timeout = '5s';\n");
    let app = support::migrator_of(
        "tests/app_migrations",
        i64::MAX,
        &[("20270101000002_orders_key_id.sql", &with_set)],
    )
    .await;
    let refused = idempotency::migrate_with(&pool, &app).await.unwrap_err();
    assert!(
        refused
            .to_string()
            .contains("cannot run inside a transaction block"),
        "{refused}"
    );

    let alone = concurrent_index("");
    let app = support::migrator_of(
        "tests/app_migrations",
        i64::MAX,
        &[("20270101000002_orders_key_id.sql", &alone)],
    )
    .await;
    idempotency::migrate_with(&pool, &app).await.unwrap();
    let valid: bool = sqlx::query_scalar(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = 'orders_key_id_idx'::regclass",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(valid);
}

/// An application's migration that gives up waiting for a lock is told like the crate's own:
/// the message, and the session that held the lock.
#[sqlx::test(migrations = false)]
async fn an_application_migration_behind_a_long_transaction_gives_up_naming_it(pool: PgPool) {
    let app = support::migrator_of("tests/app_migrations", i64::MAX, &[]).await;
    idempotency::migrate_with(&pool, &app).await.unwrap();
    let mut reader = pool.begin().await.unwrap();
    let holder: i32 = sqlx::query_scalar(
        "SELECT pg_backend_pid() FROM (SELECT count(*) FROM orders) AS long_reader",
    )
    .fetch_one(&mut *reader)
    .await
    .unwrap();
    let app = support::migrator_of(
        "tests/app_migrations",
        i64::MAX,
        &[(
            "20270101000002_orders_note.sql",
            "SET LOCAL lock_timeout = '1s';\nALTER TABLE orders ADD COLUMN note TEXT;\n",
        )],
    )
    .await;
    let refused = idempotency::migrate_with(&pool, &app)
        .await
        .unwrap_err()
        .to_string();
    reader.rollback().await.unwrap();
    assert!(
        refused.starts_with(idempotency::LOCK_TIMEOUT_MESSAGE)
            && refused.contains(&format!("pid {holder} ")),
        "{refused}"
    );
}

#[sqlx::test(migrations = false)]
async fn an_online_plan_naming_no_migration_or_one_twice_is_refused_before_anything_runs(
    pool: PgPool,
) {
    let app = sqlx::migrate!("./tests/app_migrations");
    let unknown = [idempotency::OnlinePlan::new(19990101000001)];
    let refused = idempotency::migrate_online(&pool, &app, &unknown)
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("19990101000001"), "{refused}");
    let first = app.iter().next().unwrap().version;
    let twice = [
        idempotency::OnlinePlan::new(first),
        idempotency::OnlinePlan::new(first),
    ];
    let refused = idempotency::migrate_online(&pool, &app, &twice)
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("two online plans"), "{refused}");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM pg_class WHERE relname IN ('idempotency_keys', '_sqlx_migrations')"
        )
        .await,
        0,
        "nothing ran"
    );
}

/// The server's notices a session heard, as sqlx reports them (`tracing`, target
/// `sqlx::postgres::notice`, the notice's text as `message`).
#[derive(Clone, Default)]
struct Notices(Arc<std::sync::Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Notices {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if event.metadata().target() != "sqlx::postgres::notice" {
            return;
        }
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let mut message = Message(String::new());
        event.record(&mut message);
        self.0.lock().unwrap().push(message.0);
    }
}

#[sqlx::test(migrations = false)]
async fn migrating_a_new_database_prints_no_notice(pool: PgPool) {
    use tracing_subscriber::layer::SubscriberExt;
    let notices = Notices::default();
    // The test's runtime has one thread: every connection's messages are read on it.
    let _listening =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(notices.clone()));
    // The listener hears notices at all: a session that asks for one gets it.
    sqlx::raw_sql("DROP TABLE IF EXISTS no_such_table")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(notices.0.lock().unwrap().len(), 1, "{:?}", notices.0);
    notices.0.lock().unwrap().clear();

    // Both migrators, on a new database and again on a migrated one.
    idempotency::migrate_with(&pool, &sqlx::migrate!("./tests/app_migrations"))
        .await
        .unwrap();
    idempotency::migrate_with(&pool, &sqlx::migrate!("./tests/app_migrations"))
        .await
        .unwrap();
    idempotency::migrate(&pool).await.unwrap();
    assert_eq!(*notices.0.lock().unwrap(), Vec::<String>::new());
    // Each migrating session's quiet is its own: the pool's connections still hear notices.
    sqlx::raw_sql("DROP TABLE IF EXISTS no_such_table")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(notices.0.lock().unwrap().len(), 1, "{:?}", notices.0);
}

/// An application migration that references the key table, numbered as sqlx-cli's sequential
/// numbering does.
const SEQUENTIAL_ORDERS: (&str, &str) = (
    "1_orders.sql",
    "CREATE TABLE orders (
         owner  TEXT NOT NULL,
         id     BIGSERIAL,
         key_id BIGINT,
         PRIMARY KEY (owner, id),
         FOREIGN KEY (owner, key_id) REFERENCES idempotency_keys (owner, id)
             ON DELETE SET NULL (key_id)
     );",
);

#[sqlx::test(migrations = false)]
async fn application_migrations_numbered_below_the_crates_run_after_them(pool: PgPool) {
    let app = support::migrator_of("tests/app_migrations", 0, &[SEQUENTIAL_ORDERS]).await;
    idempotency::migrate_with(&pool, &app).await.unwrap();
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM pg_constraint WHERE confrelid = 'idempotency_keys'::regclass"
        )
        .await,
        1
    );
    // A later one of the application's, on the now migrated database, keeps its own order.
    let later = (
        "2_order_notes.sql",
        "ALTER TABLE orders ADD COLUMN note TEXT;",
    );
    let app = support::migrator_of("tests/app_migrations", 0, &[SEQUENTIAL_ORDERS, later]).await;
    idempotency::migrate_with(&pool, &app).await.unwrap();
    idempotency::migrate_with(&pool, &app).await.unwrap();
    assert_eq!(
        count(&pool, "SELECT count(*) FROM _sqlx_migrations").await,
        2
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_schema_migrations WHERE NOT adopted"
        )
        .await as usize,
        crate_migrations()
    );
}

#[sqlx::test(migrations = false)]
async fn a_database_the_plain_migrate_made_takes_application_migrations_numbered_apart(
    pool: PgPool,
) {
    idempotency::migrate(&pool).await.unwrap();
    let app = support::migrator_of("tests/app_migrations", 0, &[SEQUENTIAL_ORDERS]).await;
    idempotency::migrate_with(&pool, &app).await.unwrap();
    assert_eq!(
        count(&pool, "SELECT count(*) FROM _sqlx_migrations").await,
        1
    );
}

#[sqlx::test(migrations = false)]
async fn a_low_numbered_reference_among_timestamped_migrations_is_refused_naming_it(pool: PgPool) {
    // The application's others are numbered above the crate's: in the order of versions, 1 would
    // run before the key table exists.
    let app = support::migrator_of("tests/app_migrations", i64::MAX, &[SEQUENTIAL_ORDERS]).await;
    let error = idempotency::migrate_with(&pool, &app).await.unwrap_err();
    let message = error.to_string();
    for part in [
        "1 (orders)",
        "20261129000001",
        "20270101000001",
        "nothing was applied",
    ] {
        assert!(message.contains(part), "{part:?} not in {message}");
    }
    assert!(matches!(error, Error::Migration(_)), "{error:?}");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM pg_class
             WHERE relname IN ('idempotency_keys', 'idempotency_schema_migrations',
                               '_sqlx_migrations', 'orders')"
        )
        .await,
        0
    );
}
