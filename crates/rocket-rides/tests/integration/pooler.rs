//! Rocket Rides behind PgBouncer in transaction pooling (`--database-pooler transaction`).
//!
//! The service under test (the in-process [`TestApp`]) reaches its database only through a
//! PgBouncer with `pool_mode = transaction`: the one `ROCKET_RIDES_TEST_POOLER_URL` names
//! (`scripts/test.sh` starts one), or else one these tests start with `scripts/pgbouncer.sh`.
//! The test's database is migrated, and the fake gateway and the test's own reads run, on the
//! direct URL. Concurrent clients book rides, some sending the same key twice at once, some
//! replaying; with the transaction setting every booking is created once, replays are exact,
//! one ride and one charge per key, no 5xx. The control: the same load with the session
//! statements through the same pooler fails, so the pooler really lends server connections per
//! transaction. When no PgBouncer can be started the tests say so and pass, unless `CI=true`.

use crate::common;

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Reply, TestApp};
use idempotency::Statements;
use rocket_rides::config::WorkerArgs;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

/// The variable naming a running pooler in transaction mode; its database name is replaced by
/// the test's.
const POOLER_URL: &str = "ROCKET_RIDES_TEST_POOLER_URL";

const TASKS: usize = 8;
const BOOKINGS_PER_TASK: usize = 20;
const BOOKINGS: usize = TASKS * BOOKINGS_PER_TASK;

/// The service's pool: a few connections per task, within the pooler's `default_pool_size`
/// (20 in `scripts/pgbouncer.sh`).
const SERVICE_CONNECTIONS: u32 = 10;

/// A pooler for one test: the one named by [`POOLER_URL`], or one started here and stopped
/// when dropped.
struct Pooler {
    url: String,
    started: bool,
}

impl Drop for Pooler {
    fn drop(&mut self) {
        if self.started {
            let _ = std::process::Command::new(script())
                .arg("--stop")
                .arg(&self.url)
                .status();
        }
    }
}

fn script() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/pgbouncer.sh")
}

/// The pooler, or `None` (said on stderr) when none can be started outside CI. Under
/// `CI=true` a pooler that cannot be started fails the test.
fn pooler() -> Option<Pooler> {
    if let Some(url) = std::env::var(POOLER_URL).ok().filter(|u| !u.is_empty()) {
        return Some(Pooler {
            url,
            started: false,
        });
    }
    // One start at a time: the script may install PgBouncer first.
    static STARTING: Mutex<()> = Mutex::new(());
    let _one = STARTING.lock().unwrap_or_else(|e| e.into_inner());
    let server = std::env::var("DATABASE_URL").expect("DATABASE_URL is set for the tests");
    let started = std::process::Command::new(script())
        .arg(&server)
        .stderr(std::process::Stdio::inherit())
        .output();
    match started {
        Ok(out) if out.status.success() => Some(Pooler {
            url: String::from_utf8(out.stdout).unwrap().trim().to_owned(),
            started: true,
        }),
        other => {
            let why = format!("scripts/pgbouncer.sh could not start a PgBouncer: {other:?}");
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!("{why}");
            }
            eprintln!("{why}; skipping (set {POOLER_URL} to a pooler in transaction mode)");
            None
        }
    }
}

/// A pool on `pool`'s database through the pooler at `url`.
fn through(url: &str, pool: &PgPool) -> PgPool {
    let database = pool
        .connect_options()
        .get_database()
        .expect("a test pool names its database")
        .to_owned();
    let options = PgConnectOptions::from_str(url)
        .unwrap_or_else(|e| panic!("{url} is not a PostgreSQL URL: {e}"))
        .database(&database);
    PgPoolOptions::new()
        .max_connections(SERVICE_CONNECTIONS)
        .acquire_timeout(rocket_rides::db::ACQUIRE_TIMEOUT)
        // Connections left idle close soon, so that the pooler's to the test database do too,
        // before the database is dropped.
        .idle_timeout(Some(Duration::from_secs(1)))
        .connect_lazy_with(options)
}

/// What the clients saw.
#[derive(Debug, Default)]
struct Tally {
    /// 201s without `Idempotent-Replayed`, per key.
    created: HashMap<String, usize>,
    /// Replays whose status, body and `Location` were the first 201's.
    exact_replays: usize,
    /// 409s to the second of two requests sent at once (retried until final).
    conflicts: usize,
    /// Answers with a 5xx status.
    server_errors: usize,
    /// Anything else the contract does not allow here, the first few.
    unexpected: Vec<String>,
    /// Requests sent.
    requests: usize,
}

impl Tally {
    fn merge(&mut self, other: Tally) {
        for (key, n) in other.created {
            *self.created.entry(key).or_default() += n;
        }
        self.exact_replays += other.exact_replays;
        self.conflicts += other.conflicts;
        self.server_errors += other.server_errors;
        self.requests += other.requests;
        self.unexpected.extend(other.unexpected);
        self.unexpected.truncate(10);
    }

    fn note(&mut self, what: String) {
        if self.unexpected.len() < 10 {
            self.unexpected.push(what);
        }
    }

    /// Keys created other than exactly once.
    fn not_created_once(&self, keys: &[String]) -> usize {
        keys.iter()
            .filter(|k| self.created.get(*k).copied().unwrap_or(0) != 1)
            .count()
    }

    /// Counts a final answer to `key`; returns the first 201 of it, if this is one.
    fn answer(&mut self, key: &str, reply: Reply, first: Option<&Reply>) -> Option<Reply> {
        self.requests += 1;
        if reply.status >= 500 {
            self.server_errors += 1;
            self.note(format!(
                "{key}: {} {}",
                reply.status,
                String::from_utf8_lossy(&reply.body)
            ));
            return None;
        }
        if reply.status != 201 {
            self.note(format!("{key}: {}", reply.status));
            return None;
        }
        if !reply.replayed() {
            *self.created.entry(key.to_owned()).or_default() += 1;
            return Some(reply);
        }
        match first {
            Some(first)
                if first.body == reply.body
                    && first.header("location") == reply.header("location") =>
            {
                self.exact_replays += 1
            }
            Some(_) => self.note(format!("{key}: a replay differs from the first 201")),
            // The replay answered first (the pair's other request created): compared below.
            None => {}
        }
        None
    }
}

fn body(task: usize, n: usize) -> String {
    format!(
        r#"{{"origin_lat": 37.77, "origin_lon": -122.42, "target_lat": 37.80, "target_lon": -122.27, "amount_cents": {}}}"#,
        1000 + task * 100 + n
    )
}

/// `POST /rides` until an answer other than 409, or the last 409 (a lease that a failed request
/// could not release stays held: the test's clock does not move); 409s before it are counted.
async fn post_past_conflicts(
    app: &TestApp,
    api_key: &str,
    key: &str,
    body: &str,
    tally: &mut Tally,
) -> Reply {
    let mut tries = 0;
    loop {
        let reply = app.post_ride(Some(api_key), Some(key), body).await;
        tries += 1;
        if reply.status != 409 || tries == 100 {
            return reply;
        }
        tally.requests += 1;
        tally.conflicts += 1;
        // A live holder finishes in milliseconds.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One client's bookings: every fourth sends its key twice at once, every other one is replayed
/// afterwards, and the rest read their ride back.
async fn client(app: Arc<TestApp>, task: usize, api_key: String) -> Tally {
    let mut tally = Tally::default();
    for n in 0..BOOKINGS_PER_TASK {
        let (key, body) = (format!("pooler-{task}-{n}"), body(task, n));
        let first = if n % 4 == 1 {
            let mut second = Tally::default();
            let (a, b) = tokio::join!(
                post_past_conflicts(&app, &api_key, &key, &body, &mut tally),
                post_past_conflicts(&app, &api_key, &key, &body, &mut second),
            );
            tally.merge(second);
            let (a_replayed, b_replayed) = (a.replayed(), b.replayed());
            let (created, replay) = if a_replayed { (b, a) } else { (a, b) };
            if a_replayed == b_replayed && created.status == 201 && replay.status == 201 {
                tally.note(format!(
                    "{key}: two answers at once, both replayed={a_replayed}"
                ));
            }
            let first = tally.answer(&key, created, None);
            tally.answer(&key, replay, first.as_ref());
            first
        } else {
            let reply = post_past_conflicts(&app, &api_key, &key, &body, &mut tally).await;
            tally.answer(&key, reply, None)
        };
        let Some(first) = first else { continue };
        if n % 2 == 0 {
            let replay = post_past_conflicts(&app, &api_key, &key, &body, &mut tally).await;
            tally.answer(&key, replay, Some(&first));
        } else {
            let location = first.header("location").unwrap_or("").to_owned();
            let ride = app.get(&api_key, &location).await;
            tally.requests += 1;
            if ride.status >= 500 {
                tally.server_errors += 1;
            }
            if ride.status != 200 || ride.json()["ride_id"] != first.json()["ride_id"] {
                tally.note(format!("GET {location}: {}", ride.status));
            }
        }
    }
    tally
}

/// Runs the clients at once over `users`; returns what they saw and how long it took.
async fn load(app: &Arc<TestApp>, users: &[(i64, String)]) -> (Tally, Duration) {
    let started = Instant::now();
    let tasks: Vec<_> = users
        .iter()
        .enumerate()
        .map(|(task, (_, api_key))| tokio::spawn(client(app.clone(), task, api_key.clone())))
        .collect();
    let mut tally = Tally::default();
    for task in tasks {
        tally.merge(task.await.unwrap());
    }
    (tally, started.elapsed())
}

fn keys() -> Vec<String> {
    (0..TASKS)
        .flat_map(|t| (0..BOOKINGS_PER_TASK).map(move |n| format!("pooler-{t}-{n}")))
        .collect()
}

fn report(what: &str, tally: &Tally, took: Duration) {
    eprintln!(
        "{what}: {BOOKINGS} bookings in {took:.2?} ({:.0} bookings/s, {} requests, {:.0} requests/s): \
         {} keys created once, {} exact replays, {} conflicts, {} 5xx; unexpected: {:?}",
        BOOKINGS as f64 / took.as_secs_f64(),
        tally.requests,
        tally.requests as f64 / took.as_secs_f64(),
        BOOKINGS - tally.not_created_once(&keys()),
        tally.exact_replays,
        tally.conflicts,
        tally.server_errors,
        tally.unexpected,
    );
}

/// The contract held: each booking created once, replays exact, no 5xx; in the database one
/// ride and one charge per key, each ride paid with its charge's amount.
async fn assert_every_booking_once(app: &TestApp, tally: &Tally) {
    assert_eq!(tally.server_errors, 0, "5xx: {:?}", tally.unexpected);
    assert!(tally.unexpected.is_empty(), "{:?}", tally.unexpected);
    assert_eq!(tally.not_created_once(&keys()), 0, "keys not created once");
    // Every even booking is replayed, and every pair has one replay.
    let pairs = (0..BOOKINGS_PER_TASK).filter(|n| n % 4 == 1).count();
    let replayed = (0..BOOKINGS_PER_TASK).filter(|n| n % 2 == 0).count();
    assert_eq!(tally.exact_replays, TASKS * (pairs + replayed));
    let n = BOOKINGS as i64;
    assert_eq!(app.rides().await, n, "rides");
    assert_eq!(app.keys().await, n, "keys");
    for (what, sql) in [
        (
            "keys finished",
            "SELECT count(*) FROM idempotency_keys WHERE finished_at IS NOT NULL",
        ),
        (
            "keys with a ride",
            "SELECT count(DISTINCT idempotency_key_id) FROM rides",
        ),
        (
            "paid rides",
            "SELECT count(*) FROM rides WHERE status = 'paid'",
        ),
        ("charges", "SELECT count(*) FROM fakestripe.charges"),
        (
            "requests charged",
            "SELECT count(DISTINCT metadata->>'rocket_rides_request') FROM fakestripe.charges",
        ),
        (
            "rides with their charge",
            "SELECT count(*) FROM rides r
             JOIN fakestripe.charges c ON c.id = r.charge_id AND c.amount = r.amount_cents",
        ),
    ] {
        assert_eq!(app.count(sql).await, n, "{what}");
    }
}

async fn users(app: &TestApp) -> Vec<(i64, String)> {
    let mut users = Vec::new();
    for t in 0..TASKS {
        users.push(app.user(&format!("rider{t}@example.com"), "tok_visa").await);
    }
    users
}

#[testdb::test(template = crate::common::migrated)]
async fn the_transaction_setting_books_every_ride_once_through_a_transaction_pooler(pool: PgPool) {
    let Some(pooler) = pooler() else { return };
    let service = through(&pooler.url, &pool);
    let app = Arc::new(TestApp::start_through(pool, service, Statements::Unnamed).await);
    // Users are created through the pooler too, as `users create` would be.
    let users = users(&app).await;
    let (tally, took) = load(&app, &users).await;
    report(
        "transaction pooler, --database-pooler transaction",
        &tally,
        took,
    );
    assert_every_booking_once(&app, &tally).await;

    // The worker's statements, and the operations routes, through the pooler as well.
    let worker = WorkerArgs {
        drain_batch: 1000,
        ..Default::default()
    };
    rocket_rides::worker::run_once(&app.state, &worker)
        .await
        .unwrap();
    assert_eq!(
        app.count("SELECT count(*) FROM ride_receipts").await,
        BOOKINGS as i64
    );
    let ready = app
        .http
        .get(format!("{}/readyz", app.base))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    let metrics = app
        .http
        .get(format!("{}/metrics", app.metrics_base))
        .send()
        .await
        .unwrap();
    assert_eq!(metrics.status(), 200);
    let text = metrics.text().await.unwrap();
    assert!(
        text.lines().any(|l| l == "idempotency_keys_unfinished 0"),
        "{text}"
    );
}

/// The control: the session statements (the default) through the same pooler fail.
#[testdb::test(template = crate::common::migrated)]
async fn session_statements_fail_through_a_transaction_pooler(pool: PgPool) {
    let Some(pooler) = pooler() else { return };
    let service = through(&pooler.url, &pool);
    let direct = pool.clone();
    let app = Arc::new(TestApp::start_through(pool, service, Statements::Prepared).await);
    // The users on the direct pool: the control is about the bookings.
    let mut users = Vec::new();
    for t in 0..TASKS {
        let email = format!("rider{t}@example.com");
        let user = rocket_rides::users::create_user(&direct, &app.state.stripe, &email, "tok_visa")
            .await
            .unwrap();
        users.push((user.id, user.api_key));
    }
    let (tally, took) = load(&app, &users).await;
    report(
        "transaction pooler, --database-pooler session (control)",
        &tally,
        took,
    );
    let failures = tally.server_errors + tally.unexpected.len() + tally.not_created_once(&keys());
    assert!(
        failures > 0,
        "the session statements ran cleanly through the pooler: is it in transaction mode?"
    );
}

/// The same load straight to PostgreSQL with the default statements: the baseline of the
/// figures above, held to the same contract.
#[testdb::test(template = crate::common::migrated)]
async fn the_same_load_books_every_ride_once_direct(pool: PgPool) {
    let app = Arc::new(TestApp::start(pool).await);
    let users = users(&app).await;
    let (tally, took) = load(&app, &users).await;
    report("direct, --database-pooler session", &tally, took);
    assert_every_booking_once(&app, &tally).await;
}

fn rocket_rides(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_rocket-rides"));
    command
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("DATABASE_URL")
        .env_remove("DATABASE_POOLER")
        .env_remove("MIGRATE_DATABASE_URL");
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().expect("run rocket-rides")
}

async fn tables(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_tables WHERE schemaname NOT IN ('pg_catalog', 'information_schema')",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// `migrate` under `--database-pooler transaction` without `--migrate-database-url` refuses,
/// saying why, before it connects: the database is left as it was. With it, it migrates there,
/// and never connects to DATABASE_URL (which here answers nothing).
#[sqlx::test(migrations = false)]
async fn migrate_through_a_transaction_pooler_refuses_and_writes_nothing(pool: PgPool) {
    let url = common::url_of(&pool).await;
    for args in [
        &["migrate", "--database-pooler", "transaction"][..],
        &["migrate"],
    ] {
        let refused = rocket_rides(
            args,
            &[("DATABASE_URL", &url), ("DATABASE_POOLER", "transaction")],
        );
        assert!(!refused.status.success(), "{args:?}: {refused:?}");
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(
            stderr.contains(rocket_rides::cli::MIGRATE_THROUGH_POOLER),
            "{args:?}: {stderr}"
        );
        assert_eq!(tables(&pool).await, 0, "{args:?} wrote to the database");
    }

    let nowhere = "postgres://postgres@127.0.0.1:1/nowhere";
    let migrated = rocket_rides(
        &["migrate", "--migrate-database-url", &url],
        &[
            ("DATABASE_URL", nowhere),
            ("DATABASE_POOLER", "transaction"),
        ],
    );
    assert!(migrated.status.success(), "{migrated:?}");
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(applied > 0);
    assert!(tables(&pool).await > 0);
    // The session default migrates on DATABASE_URL, as before.
    let again = rocket_rides(&["migrate"], &[("DATABASE_URL", &url)]);
    assert!(again.status.success(), "{again:?}");
}

/// The `.rs` files under the service's `src`: (path, text).
fn service_sources() -> Vec<(String, String)> {
    fn walk(dir: &std::path::Path, files: &mut Vec<(String, String)>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, files);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                files.push((path.display().to_string(), text));
            }
        }
    }
    let mut files = Vec::new();
    walk(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut files,
    );
    files
}

/// What the source scan found in one file's text.
#[derive(Default, Debug)]
struct Scan {
    /// Each `sqlx::query…(`, up to its `.fetch…(` or `.execute(` and its executor.
    statements: Vec<(usize, String)>,
    /// Each `pg` made: the connection a wrapper of the store wraps.
    wrapped: Vec<(usize, String)>,
    /// What breaks the rule: (line, why).
    refused: Vec<(usize, String)>,
}

/// The forms a `pg` may wrap: a transaction or a connection, never the pool (a statement alone
/// on the pool is outside a transaction, which behind a transaction pooler can run another
/// client's SQL). A new form is refused until it is added here with its reason.
const WRAPPED_CONNECTIONS: &[&str] = &[
    "step.tx().await?",
    "&mut *tx",
    "&mut *conn",
    "conn",
    "conn.conn()",
    "db.conn()",
    "phase.conn()",
];

/// The text of a call's arguments, from just after its `(` in `rest` to the parenthesis that
/// closes it.
fn arguments(rest: &str) -> &str {
    let mut depth = 1;
    let end = rest
        .char_indices()
        .find_map(|(i, c)| {
            depth += match c {
                '(' => 1,
                ')' => -1,
                _ => 0,
            };
            (depth == 0).then_some(i)
        })
        .unwrap_or(rest.len());
    &rest[..end]
}

/// Scans one file's text: every statement must be sent through a `pg`, every `pg` made by a
/// wrapper of the store around a connection (`Store::statements_on`, or `Statements::Unnamed.on`
/// for the migration-time statements on a direct connection) or taken as a `&mut Pg`, and no
/// other name of sqlx's statement builders may be used (an import of `query`, `QueryBuilder`,
/// `raw_sql`), since the statements are found by `sqlx::query`.
fn scan(text: &str) -> Scan {
    let line_of = |at: usize| text[..at].lines().count() + 1;
    let mut found = Scan::default();
    for (at, _) in text.match_indices("sqlx::query") {
        let rest = &text[at..];
        let end = [".fetch", ".execute("]
            .iter()
            .filter_map(|end| rest.find(end))
            .min()
            .unwrap_or(rest.len());
        // The executor too: up to the end of its call.
        let end = rest[end..].find(')').map_or(rest.len(), |e| end + e + 1);
        let chain = rest[..end].to_owned();
        let through_pg = ["(pg)", "(&mut pg)", "(&mut *pg)"]
            .iter()
            .any(|executor| chain.ends_with(executor));
        if !through_pg {
            found.refused.push((
                line_of(at),
                format!("not sent through a pg (Store::statements_on): {chain}"),
            ));
        }
        found.statements.push((line_of(at), chain));
    }
    for wrapper in ["statements_on(", "Statements::Unnamed.on("] {
        for (at, call) in text.match_indices(wrapper) {
            if text[..at].ends_with("fn ") {
                continue;
            }
            let wrapped = arguments(&text[at + call.len()..]).trim().to_owned();
            if !WRAPPED_CONNECTIONS.contains(&wrapped.as_str()) {
                found.refused.push((
                    line_of(at),
                    format!("wraps what is not a known connection or transaction: {wrapped}"),
                ));
            }
            found.wrapped.push((line_of(at), wrapped));
        }
    }
    for (at, _) in text.match_indices("pg: ") {
        let typed = &text[at + "pg: ".len()..];
        if !typed.starts_with("&mut Pg<") {
            let shown: String = typed.chars().take(30).collect();
            found.refused.push((
                line_of(at),
                format!("a pg taken as something else than &mut Pg: {shown}"),
            ));
        }
    }
    for (index, line) in text.lines().enumerate() {
        let line = line.trim_start();
        let other_name = line.starts_with("use sqlx::")
            && ["query", "QueryBuilder", "raw_sql"]
                .iter()
                .any(|name| line.contains(name));
        let builder = ["QueryBuilder", "raw_sql("]
            .iter()
            .any(|name| line.contains(name));
        if !line.starts_with("//") && (other_name || builder) {
            found.refused.push((
                index + 1,
                format!("a statement the scan cannot follow: {line}"),
            ));
        }
    }
    found
}

/// The source of the claim above: each statement of the service is sent through a `pg`
/// (`rocket_rides::db::Pg`, a connection wrapped once by `Store::statements_on`, so that it is
/// unnamed when the store's are, or by `Statements::Unnamed.on` for the migration-time
/// statements on a direct connection), and no `pg` wraps the pool. A statement added otherwise
/// fails here, whether or not the load above reaches it; the scan's own refusals are tried on
/// made-up sources below.
#[test]
fn every_statement_of_the_service_follows_the_store() {
    let (mut statements, mut wrapped, mut refused) = (0, 0, Vec::new());
    for (file, text) in service_sources() {
        let found = scan(&text);
        statements += found.statements.len();
        wrapped += found.wrapped.len();
        refused.extend(
            found
                .refused
                .into_iter()
                .map(|(line, why)| format!("{file}:{line} {why}")),
        );
    }
    assert!(
        statements >= 20,
        "the scan finds the statements: {statements}"
    );
    assert!(wrapped >= 10, "the scan finds the wrappers: {wrapped}");
    assert!(refused.is_empty(), "{refused:#?}");
}

#[test]
fn the_source_scan_refuses_every_way_around_the_store() {
    let through_pg = "fn f(pg: &mut Pg<'_>) { sqlx::query(\"SELECT 1\").execute(&mut *pg) }";
    let wrapped = "let mut pg = state.store.statements_on(db.conn());";
    for good in [through_pg, wrapped] {
        let found = scan(good);
        assert!(found.refused.is_empty(), "{good}: {:?}", found.refused);
    }
    for bad in [
        // On the pool, or another executor.
        "sqlx::query(\"SELECT 1\").execute(&state.pool)",
        // Another name for sqlx's statements, which the scan would not find.
        "use sqlx::query;\nquery(\"SELECT 1\").execute(&state.pool)",
        "use sqlx::{query_as, PgPool};",
        "let mut b = sqlx::QueryBuilder::new(\"SELECT \");",
        "sqlx::raw_sql(\"SELECT 1\").execute(&state.pool)",
        // A pg that is the pool in disguise.
        "fn f(pg: &PgPool) { sqlx::query(\"SELECT 1\").execute(pg) }",
        "let mut pg = state.store.statements_on(&state.db);",
        "let mut pg = Statements::Unnamed.on(&state.pool);",
    ] {
        assert!(!scan(bad).refused.is_empty(), "not refused: {bad}");
    }
}

#[test]
fn help_documents_the_pooler_settings_and_hides_the_migration_url() {
    for command in [
        &["serve", "--help"][..],
        &["worker", "--help"],
        &["users", "create", "--help"],
        &["keys", "list", "--help"],
        &["jobs", "list", "--help"],
        &["migrate", "--help"],
    ] {
        let help = rocket_rides(
            command,
            &[("MIGRATE_DATABASE_URL", "postgres://u:hunter2@127.0.0.1:1/d")],
        );
        assert!(help.status.success(), "{command:?}: {help:?}");
        let text = String::from_utf8_lossy(&help.stdout);
        for named in ["--database-pooler", "DATABASE_POOLER", "transaction"] {
            assert!(text.contains(named), "{command:?} names {named}:\n{text}");
        }
        assert!(!text.contains("hunter2"), "{command:?}:\n{text}");
    }
    let help = rocket_rides(&["migrate", "--help"], &[]);
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(text.contains("--migrate-database-url"), "{text}");
    assert!(text.contains("MIGRATE_DATABASE_URL"), "{text}");
}

/// The binary's commands that touch the database, through the pooler with the transaction
/// setting, the migration beside it.
#[sqlx::test(migrations = false)]
async fn the_commands_run_through_a_transaction_pooler(pool: PgPool) {
    let Some(pooler) = pooler() else { return };
    let direct = common::url_of(&pool).await;
    let mut pooled = reqwest::Url::parse(&pooler.url).expect("the pooler's URL is a URL");
    pooled.set_path(pool.connect_options().get_database().unwrap());
    let env = [
        ("DATABASE_URL", pooled.as_str()),
        ("DATABASE_POOLER", "transaction"),
        ("MIGRATE_DATABASE_URL", direct.as_str()),
    ];
    for command in [
        &["migrate"][..],
        &["worker", "--once"],
        &["keys", "list", "--unfinished"],
        &["jobs", "list"],
    ] {
        let ran = rocket_rides(command, &env);
        assert!(ran.status.success(), "{command:?}: {ran:?}");
    }
    assert!(tables(&pool).await > 0);
}
