//! Tests only: one fresh PostgreSQL database per test, as `#[sqlx::test]` gives, but migrated
//! once per test binary instead of once per test.
//!
//! ```ignore
//! #[testdb::test(template = crate::support::migrated)]
//! async fn a_finished_key_replays(pool: PgPool) { … }
//! ```
//!
//! - `#[testdb::test]` alone: an empty database of the test's own (what
//!   `#[sqlx::test(migrations = false)]` gave), for the tests of migrations themselves.
//! - `template = f`, `f` an `async fn(PgPool)` that migrates: the first test of a test binary to
//!   need it makes a *template* database, runs `f` on it once, and marks it a template; every
//!   test then gets `CREATE DATABASE … TEMPLATE` of it, a copy made by the server at file level,
//!   instead of running every migration again. A test that migrates anyway finds nothing to do.
//!
//! The template is named after the test binary (its path, size and modification time) and `f`'s
//! name, so a rebuilt binary, whose migrations may have changed, makes a new one, and two
//! binaries (or two checkouts sharing a server) never share one. Test processes make it one at a
//! time: the maker holds a PostgreSQL advisory lock on the server of `DATABASE_URL`; the others
//! wait on it, then find the template ready (marked `IS_TEMPLATE` only once `f` succeeded, so a
//! maker that died leaves nothing another would use). Safe under nextest's process per test and
//! under `cargo test`'s threads.
//!
//! Clean-up: a passing test's database is dropped when it ends; a failing test's is kept for
//! inspection (its name is printed). Whoever makes a template first drops the test databases
//! older than [`STALE_DATABASE`] and the templates older than [`STALE_TEMPLATE`].
//!
//! Like `#[sqlx::test]`: `DATABASE_URL` names the server (its user may create databases), each
//! test runs on a current-thread Tokio runtime, and its pool holds at most 5 connections.

use std::future::Future;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, Executor, PgConnection, PgPool};

pub mod doc_values;
mod wait;

pub use wait::{lock_waits, until, until_a_lock_wait, until_every, POLL_EVERY};

pub use testdb_macros::test;

/// Every database this crate makes starts with this.
pub const PREFIX: &str = "_testdb_";
/// A test database older than this belonged to a test that failed (kept for inspection) or a
/// process that was killed: no test runs this long.
pub const STALE_DATABASE: Duration = Duration::from_secs(6 * 3600);
/// A template older than this belongs to a test binary long since rebuilt.
pub const STALE_TEMPLATE: Duration = Duration::from_secs(24 * 3600);

/// A database migrated once per test binary, to clone per test (built by `#[testdb::test]`).
pub struct Template {
    /// The migrating function's name (its type's name: the same however the test spells it).
    pub name: &'static str,
    /// Migrates the template's database.
    pub migrate: fn(PgPool) -> Pin<Box<dyn Future<Output = ()>>>,
}

/// A test function `#[testdb::test]` can run.
pub trait TestFn {
    /// Runs the test against the database that `connect` names.
    fn call(self, pool: PgPoolOptions, connect: PgConnectOptions) -> impl Future<Output = ()>;
}

impl<Fut: Future<Output = ()>> TestFn for fn(PgPool) -> Fut {
    async fn call(self, pool: PgPoolOptions, connect: PgConnectOptions) {
        let pool = pool
            .connect_with(connect)
            .await
            .expect("testdb: connect the test's pool");
        self(pool.clone()).await;
        // As `#[sqlx::test]` does: a pool a test leaked stops nobody for long.
        if tokio::time::timeout(Duration::from_secs(10), pool.close())
            .await
            .is_err()
        {
            eprintln!("testdb: the test held on to its pool after it ended");
        }
    }
}

impl<Fut: Future<Output = ()>> TestFn for fn(PgPoolOptions, PgConnectOptions) -> Fut {
    async fn call(self, pool: PgPoolOptions, connect: PgConnectOptions) {
        self(pool, connect).await
    }
}

/// Runs `test` on a new database (a copy of `template`'s, when given); `#[testdb::test]` calls
/// this. `test_path` names the test in messages.
pub fn run(test_path: &str, template: Option<Template>, test: impl TestFn) {
    let url =
        std::env::var("DATABASE_URL").expect("testdb: DATABASE_URL must name a PostgreSQL server");
    let server: PgConnectOptions = url
        .parse()
        .expect("testdb: DATABASE_URL is not a PostgreSQL URL");
    let name = runtime().block_on(create(&server, template.as_ref()));
    let pool = PgPoolOptions::new()
        .max_connections(5)
        .idle_timeout(Some(Duration::from_secs(1)));
    let connect = server.clone().database(&name);
    // The test's runtime ends (and with it any task the test left) before the database is
    // dropped; a panic is the test's failure, passed on once the database is dealt with.
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
        runtime().block_on(test.call(pool, connect))
    }));
    match outcome {
        Ok(()) => runtime().block_on(drop_database(&server, &name)),
        Err(panic) => {
            eprintln!("testdb: {test_path} failed; its database {name} is kept");
            std::panic::resume_unwind(panic)
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("testdb: start a Tokio runtime")
}

async fn connect(server: &PgConnectOptions) -> PgConnection {
    PgConnection::connect_with(server)
        .await
        .expect("testdb: connect to the server of DATABASE_URL")
}

/// Creates the test's database, copying the template (made first if need be).
async fn create(server: &PgConnectOptions, template: Option<&Template>) -> String {
    let mut conn = connect(server).await;
    let name = format!(
        "{PREFIX}{}_{}",
        unix_seconds(SystemTime::now()),
        uuid::Uuid::new_v4().simple()
    );
    let create = match template {
        Some(template) => {
            let source = ensure_template(&mut conn, server, template).await;
            format!(r#"CREATE DATABASE "{name}" TEMPLATE "{source}""#)
        }
        None => format!(r#"CREATE DATABASE "{name}""#),
    };
    conn.execute(create.as_str())
        .await
        .unwrap_or_else(|e| panic!("testdb: {create}: {e}"));
    let _ = conn.close().await;
    name
}

/// The template's name, made and migrated if no ready one exists.
async fn ensure_template(
    conn: &mut PgConnection,
    server: &PgConnectOptions,
    template: &Template,
) -> String {
    let name = template_name(template.name);
    if is_ready(conn, &name).await {
        return name;
    }
    // One maker at a time; the others wait here and then find it ready. The lock is the
    // session's: a maker that dies releases it with its connection.
    let key = lock_key(&name);
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(key)
        .execute(&mut *conn)
        .await
        .expect("testdb: take the template lock");
    if !is_ready(conn, &name).await {
        sweep(conn).await;
        // What a maker that died half-way left.
        execute(
            conn,
            &format!(r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#),
        )
        .await;
        execute(conn, &format!(r#"CREATE DATABASE "{name}""#)).await;
        let pool = PgPoolOptions::new()
            .max_connections(5)
            .connect_with(server.clone().database(&name))
            .await
            .expect("testdb: connect to the new template");
        (template.migrate)(pool.clone()).await;
        pool.close().await;
        // Marked only now: a template is ready once migrated. No connection may reach it from
        // here on, since one would make `CREATE DATABASE … TEMPLATE` fail.
        execute(
            conn,
            &format!(r#"ALTER DATABASE "{name}" WITH IS_TEMPLATE true ALLOW_CONNECTIONS false"#),
        )
        .await;
        let made = unix_seconds(SystemTime::now());
        execute(
            conn,
            &format!(r#"COMMENT ON DATABASE "{name}" IS '{made}'"#),
        )
        .await;
    }
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(key)
        .execute(&mut *conn)
        .await
        .expect("testdb: release the template lock");
    name
}

async fn is_ready(conn: &mut PgConnection, name: &str) -> bool {
    sqlx::query_scalar::<_, bool>("SELECT datistemplate FROM pg_database WHERE datname = $1")
        .bind(name)
        .fetch_optional(&mut *conn)
        .await
        .expect("testdb: read pg_database")
        .unwrap_or(false)
}

/// `_testdb_tpl_` and a hash of the test binary (path, size, modification time) and the
/// migrating function: a rebuilt binary gets a template of its own.
fn template_name(function: &str) -> String {
    let mut hasher = DefaultHasher::new();
    function.hash(&mut hasher);
    let exe = std::env::current_exe().expect("testdb: the test binary's path");
    exe.hash(&mut hasher);
    if let Ok(meta) = std::fs::metadata(&exe) {
        meta.len().hash(&mut hasher);
        meta.modified().ok().hash(&mut hasher);
    }
    format!("{PREFIX}tpl_{:016x}", hasher.finish())
}

fn lock_key(name: &str) -> i64 {
    let mut hasher = DefaultHasher::new();
    name.hash(&mut hasher);
    hasher.finish() as i64
}

/// Drops the test databases and templates left long enough ago (see the crate's doc).
async fn sweep(conn: &mut PgConnection) {
    let now = unix_seconds(SystemTime::now());
    let rows: Vec<(String, bool, Option<String>)> = sqlx::query_as(
        "SELECT datname, datistemplate, shobj_description(oid, 'pg_database')
         FROM pg_database WHERE starts_with(datname, $1)",
    )
    .bind(PREFIX)
    .fetch_all(&mut *conn)
    .await
    .expect("testdb: list the test databases");
    for (name, is_template, comment) in rows {
        let stale = if name.starts_with(&format!("{PREFIX}tpl_")) {
            let made = comment.and_then(|c| c.parse::<u64>().ok());
            is_template && made.is_some_and(|m| m + STALE_TEMPLATE.as_secs() < now)
        } else {
            let made = name[PREFIX.len()..]
                .split('_')
                .next()
                .and_then(|s| s.parse::<u64>().ok());
            made.is_some_and(|m| m + STALE_DATABASE.as_secs() < now)
        };
        if stale {
            // Best effort: another process may be dropping it too.
            if is_template {
                let _ = conn
                    .execute(format!(r#"ALTER DATABASE "{name}" WITH IS_TEMPLATE false"#).as_str())
                    .await;
            }
            let _ = conn
                .execute(format!(r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#).as_str())
                .await;
        }
    }
}

async fn drop_database(server: &PgConnectOptions, name: &str) {
    let mut conn = connect(server).await;
    execute(
        &mut conn,
        &format!(r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#),
    )
    .await;
    let _ = conn.close().await;
}

async fn execute(conn: &mut PgConnection, sql: &str) {
    conn.execute(sql)
        .await
        .unwrap_or_else(|e| panic!("testdb: {sql}: {e}"));
}

fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Barrier, Mutex};

    use super::{connect, execute, run, runtime, template_name, Template};
    use sqlx::postgres::PgConnectOptions;
    use sqlx::PgPool;
    use std::future::Future;
    use std::pin::Pin;

    /// A template of its own for each test run: the name is what the template is keyed by.
    fn unique(migrate: fn(PgPool) -> Pin<Box<dyn Future<Output = ()>>>) -> Template {
        let name = format!("testdb::tests::{}", uuid::Uuid::new_v4().simple());
        Template {
            name: Box::leak(name.into_boxed_str()),
            migrate,
        }
    }

    async fn exists(name: &str) -> bool {
        let server: PgConnectOptions = std::env::var("DATABASE_URL").unwrap().parse().unwrap();
        let mut conn = connect(&server).await;
        sqlx::query_scalar::<_, bool>("SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)")
            .bind(name)
            .fetch_one(&mut conn)
            .await
            .unwrap()
    }

    static MIGRATIONS: AtomicUsize = AtomicUsize::new(0);
    static DATABASES: Mutex<Vec<String>> = Mutex::new(Vec::new());

    fn migrate_once(pool: PgPool) -> Pin<Box<dyn Future<Output = ()>>> {
        Box::pin(async move {
            MIGRATIONS.fetch_add(1, Ordering::SeqCst);
            sqlx::query("CREATE TABLE migrated (n INT)")
                .execute(&pool)
                .await
                .unwrap();
        })
    }

    async fn sees_the_template(pool: PgPool) {
        // The clone holds what the template's migration made, and is a database of its own.
        sqlx::query("INSERT INTO migrated VALUES (1)")
            .execute(&pool)
            .await
            .unwrap();
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM migrated")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(rows, 1, "another test's row in this test's database");
        let name: String = sqlx::query_scalar("SELECT current_database()")
            .fetch_one(&pool)
            .await
            .unwrap();
        DATABASES.lock().unwrap().push(name);
    }

    #[test]
    fn tests_starting_together_migrate_the_template_once_and_each_get_a_copy_then_drop_it() {
        const TESTS: usize = 6;
        let template = unique(migrate_once);
        let (name, migrate) = (template.name, template.migrate);
        let start = Barrier::new(TESTS);
        std::thread::scope(|s| {
            for _ in 0..TESTS {
                s.spawn(|| {
                    start.wait();
                    let test: fn(PgPool) -> _ = sees_the_template;
                    run("together", Some(Template { name, migrate }), test);
                });
            }
        });
        assert_eq!(MIGRATIONS.load(Ordering::SeqCst), 1);
        let databases = DATABASES.lock().unwrap().clone();
        assert_eq!(databases.len(), TESTS);
        runtime().block_on(async {
            for db in &databases {
                assert!(!exists(db).await, "{db} outlived its passing test");
            }
            let template = template_name(name);
            assert!(exists(&template).await);
            // Tidy: this template is used by no later run.
            drop_template(&template).await;
        });
    }

    static ATTEMPTS: AtomicUsize = AtomicUsize::new(0);

    fn fails_first(pool: PgPool) -> Pin<Box<dyn Future<Output = ()>>> {
        Box::pin(async move {
            sqlx::query("CREATE TABLE half (n INT)")
                .execute(&pool)
                .await
                .unwrap();
            if ATTEMPTS.fetch_add(1, Ordering::SeqCst) == 0 {
                panic!("the first migration fails half-way");
            }
            sqlx::query("CREATE TABLE whole (n INT)")
                .execute(&pool)
                .await
                .unwrap();
        })
    }

    async fn sees_the_whole_migration(pool: PgPool) {
        sqlx::query("SELECT FROM whole")
            .execute(&pool)
            .await
            .unwrap();
    }

    #[test]
    fn a_template_whose_migration_failed_is_never_cloned_and_is_made_again() {
        let template = unique(fails_first);
        let (name, migrate) = (template.name, template.migrate);
        let test: fn(PgPool) -> _ = sees_the_whole_migration;
        let first =
            std::panic::catch_unwind(|| run("first", Some(Template { name, migrate }), test));
        assert!(first.is_err(), "the failed migration failed the test");
        run("second", Some(Template { name, migrate }), test);
        assert_eq!(ATTEMPTS.load(Ordering::SeqCst), 2);
        runtime().block_on(drop_template(&template_name(name)));
    }

    async fn drop_template(name: &str) {
        let server: PgConnectOptions = std::env::var("DATABASE_URL").unwrap().parse().unwrap();
        let mut conn = connect(&server).await;
        execute(
            &mut conn,
            &format!(r#"ALTER DATABASE "{name}" WITH IS_TEMPLATE false"#),
        )
        .await;
        execute(&mut conn, &format!(r#"DROP DATABASE "{name}""#)).await;
    }
}
