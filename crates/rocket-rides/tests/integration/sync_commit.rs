//! A commit whose wait for the synchronous standby is cancelled reports success, with only a
//! warning: the transaction is committed on the primary, and the next failover may lose it. The
//! service must not acknowledge it (no 201), and the key must resume.
//!
//! Each test runs a PostgreSQL cluster of its own (`initdb` from the installed server binaries)
//! with `synchronous_standby_names` naming a standby that never comes: once it is set, every
//! commit of the service waits, until the test cancels the wait with `pg_cancel_backend`. (The
//! in-process gateway's commits, on the cluster's default `synchronous_commit = local`, do not.) The tests run on one
//! thread, so that the commit watch installed for the test (a thread's default subscriber) sees
//! every poll of the service's commits.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{TestApp, RIDE};
use rocket_rides::problem::types;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use tracing_subscriber::layer::SubscriberExt;

/// A PostgreSQL cluster of the test's own, stopped and removed when dropped.
struct Cluster {
    bin: PathBuf,
    root: PathBuf,
    port: u16,
    as_postgres: bool,
}

impl Cluster {
    /// Creates and starts a cluster; `None` (the test skips) where no server binaries are
    /// installed, unless under CI, where that is a failure.
    fn start(name: &str) -> Option<Self> {
        let Some(bin) = server_binaries() else {
            assert!(
                std::env::var_os("CI").is_none(),
                "no PostgreSQL server binaries: scripts/postgres.sh --server-binaries installs them"
            );
            eprintln!("skipped: no PostgreSQL server binaries (initdb, pg_ctl)");
            return None;
        };
        let root = std::env::temp_dir().join(format!("rr-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        // initdb and postgres refuse to run as root: the cluster is the postgres user's.
        let as_postgres = is_root();
        if as_postgres {
            let status = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(&root)
                .status()
                .unwrap();
            assert!(status.success(), "chown {}", root.display());
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let cluster = Self {
            bin,
            root,
            port,
            as_postgres,
        };
        let data = cluster.data();
        cluster.run(
            "initdb",
            &["-D", &data, "-A", "trust", "-U", "postgres", "--no-sync"],
        );
        let conf = format!(
            "port = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = ''\n\
             fsync = off\nsynchronous_commit = local\nmax_connections = 60\n"
        );
        std::fs::OpenOptions::new()
            .append(true)
            .open(Path::new(&data).join("postgresql.conf"))
            .and_then(|mut f| std::io::Write::write_all(&mut f, conf.as_bytes()))
            .unwrap();
        let log = cluster.root.join("server.log");
        cluster.run(
            "pg_ctl",
            &["-D", &data, "-l", log.to_str().unwrap(), "-w", "start"],
        );
        Some(cluster)
    }

    fn data(&self) -> String {
        self.root.join("data").to_str().unwrap().to_owned()
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn run(&self, program: &str, args: &[&str]) {
        let program = self.bin.join(program);
        let mut command = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&program);
            c
        } else {
            Command::new(&program)
        };
        let out = command.args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{} {args:?}: {}",
            program.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let data = self.data();
        let _ = std::panic::catch_unwind(|| {
            self.run("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"])
        });
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

/// The installed server binaries: `/usr/lib/postgresql/<newest>/bin`, or `pg_config --bindir`.
fn server_binaries() -> Option<PathBuf> {
    let mut candidates: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|dir| {
            dir.flatten()
                .filter_map(|e| {
                    let version = e.file_name().to_str()?.parse().ok()?;
                    Some((version, e.path().join("bin")))
                })
                .collect()
        })
        .unwrap_or_default();
    candidates.sort_by_key(|(version, _)| std::cmp::Reverse(*version));
    let mut candidates: Vec<PathBuf> = candidates.into_iter().map(|(_, bin)| bin).collect();
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        if out.status.success() {
            candidates.push(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
        }
    }
    candidates
        .into_iter()
        .find(|bin| bin.join("initdb").exists() && bin.join("pg_ctl").exists())
}

/// Names a synchronous standby that never connects (every commit then waits for it), or none.
async fn synchronous(admin: &PgPool, on: bool) {
    let names = if on { "nobody" } else { "" };
    sqlx::query(&format!(
        "ALTER SYSTEM SET synchronous_standby_names = '{names}'"
    ))
    .execute(admin)
    .await
    .unwrap();
    sqlx::query("SELECT pg_reload_conf()")
        .execute(admin)
        .await
        .unwrap();
    // A new backend reads the reloaded file; the wait itself follows the checkpointer's view
    // of it, a moment later.
    testdb::until(
        &format!("synchronous_standby_names became {names:?}"),
        Duration::from_secs(5),
        || async {
            let mut conn = admin.acquire().await.unwrap();
            sqlx::query("SELECT 1").execute(&mut *conn).await.unwrap();
            let shown: String = sqlx::query_scalar("SHOW synchronous_standby_names")
                .fetch_one(&mut *conn)
                .await
                .unwrap();
            conn.detach();
            (shown == names).then_some(())
        },
    )
    .await;
    // The checkpointer, which releases the waits, shows nothing of its view: a moment for it.
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// Cancels every wait for the synchronous standby, every 10 ms, until [`Canceller::stop`].
fn cancel_waits(admin: PgPool) -> Canceller {
    let stop = Arc::new(AtomicBool::new(false));
    let until = stop.clone();
    let task = tokio::spawn(async move {
        let mut cancelled = 0;
        while !until.load(Ordering::Relaxed) {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FILTER (WHERE pg_cancel_backend(pid)) FROM pg_stat_activity \
                 WHERE wait_event = 'SyncRep'",
            )
            .fetch_one(&admin)
            .await
            .unwrap();
            cancelled += n as u64;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        cancelled
    });
    Canceller { stop, task }
}

/// The task of [`cancel_waits`].
struct Canceller {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<u64>,
}

impl Canceller {
    /// Stops the cancels and returns how many waits they cancelled, the last one's included:
    /// the cancelled statement's answer can arrive before the cancel's own, so the count is
    /// read once the task has ended, never while it may still be adding to it.
    async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.task
            .await
            .expect("the canceller ends without panicking")
    }
}

/// Where the first wait for the standby happens.
#[derive(Clone, Copy)]
enum WaitsFrom {
    /// Every commit of the request waits: the first to be cancelled is the first phase's (the
    /// key and its ride).
    FirstPhase,
    /// The standby is named while the gateway charges: the waits cancelled are the gateway's
    /// and the phases' after the charge, the final one (the stored 201) included.
    AfterTheCharge,
}

struct Run {
    app: TestApp,
    admin: PgPool,
    user_id: i64,
    api_key: String,
    _cluster: Cluster,
}

/// An admin pool on `cluster`, and the service on it with its commits waiting for the standby;
/// the gateway's (a system of its own, on the cluster's default) do not.
async fn service_on(cluster: &Cluster) -> (PgPool, TestApp) {
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect(&cluster.url())
        .await
        .unwrap();
    let service: PgConnectOptions = cluster.url().parse().unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(20)
        .connect_with(service.options([("synchronous_commit", "on")]))
        .await
        .unwrap();
    (admin, TestApp::start(pool).await)
}

/// Books a ride on a cluster of its own while every wait for the standby from `from` on is
/// cancelled; returns the first answer and how many waits were cancelled.
async fn book_with_cancelled_waits(
    name: &str,
    from: WaitsFrom,
) -> Option<(Run, common::Reply, u64)> {
    let cluster = Cluster::start(name)?;
    let (admin, app) = service_on(&cluster).await;
    let (user_id, api_key) = app.user("sync@example.com", "tok_visa").await;
    let canceller = cancel_waits(admin.clone());
    let reply = match from {
        WaitsFrom::FirstPhase => {
            synchronous(&admin, true).await;
            app.post_ride(Some(&api_key), Some("k-sync"), RIDE).await
        }
        WaitsFrom::AfterTheCharge => {
            // The charge waits at the gateway's gate until the standby is named.
            app.gateway.hold_charges();
            let booking = app.post_ride(Some(&api_key), Some("k-sync"), RIDE);
            let naming = async {
                app.gateway.charges_held(1).await;
                synchronous(&admin, true).await;
                app.gateway.release_charges();
            };
            let (reply, ()) = tokio::join!(booking, naming);
            reply
        }
    };
    let cancelled = canceller.stop().await;
    let run = Run {
        app,
        admin,
        user_id,
        api_key,
        _cluster: cluster,
    };
    Some((run, reply, cancelled))
}

/// The commit watch, as `rocket-rides serve` installs it, for this thread.
fn watched() -> tracing::subscriber::DefaultGuard {
    let guard = tracing::subscriber::set_default(
        tracing_subscriber::registry().with(idempotency::commit_watch::layer()),
    );
    assert!(idempotency::commit_watch::installed());
    guard
}

/// With the waits answered again, the retry with the same key ends in one ride, one charge.
async fn retry_resumes(run: &Run) {
    synchronous(&run.admin, false).await;
    run.app.expire_leases();
    let retry = run.app.post_until_final(&run.api_key, "k-sync", RIDE).await;
    assert_eq!(
        retry.status,
        201,
        "{}",
        String::from_utf8_lossy(&retry.body)
    );
    let ride_id = retry.json()["ride_id"].as_i64().unwrap();
    assert_eq!(run.app.rides().await, 1);
    assert_eq!(run.app.charges().await, 1, "one charge for the one key");
    let (status, charge): (String, Option<String>) =
        sqlx::query_as("SELECT status, charge_id FROM rides WHERE id = $1 AND user_id = $2")
            .bind(ride_id)
            .bind(run.user_id)
            .fetch_one(&run.app.pool)
            .await
            .unwrap();
    assert_eq!(status, "paid");
    assert!(charge.is_some());
}

fn assert_not_acknowledged(reply: &common::Reply, cancelled: u64) {
    assert!(
        cancelled > 0,
        "the test cancelled no wait: it proves nothing"
    );
    assert_eq!(
        reply.status,
        503,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(reply.problem_type(), types::COMMIT_UNCONFIRMED);
    assert!(reply.header("retry-after").is_some());
}

#[tokio::test(flavor = "current_thread")]
async fn a_final_commit_whose_wait_for_the_standby_is_cancelled_is_no_201_and_the_key_resumes() {
    let _watch = watched();
    let Some((run, reply, cancelled)) =
        book_with_cancelled_waits("sync-final", WaitsFrom::AfterTheCharge).await
    else {
        return;
    };
    assert_not_acknowledged(&reply, cancelled);
    retry_resumes(&run).await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_first_phase_whose_wait_for_the_standby_is_cancelled_charges_nothing_and_resumes() {
    let _watch = watched();
    let Some((run, reply, cancelled)) =
        book_with_cancelled_waits("sync-first", WaitsFrom::FirstPhase).await
    else {
        return;
    };
    assert_not_acknowledged(&reply, cancelled);
    // The key and its ride are on the primary, but no charge was asked for under a request the
    // standby may not know.
    assert_eq!(run.app.charges().await, 0);
    retry_resumes(&run).await;
}

/// The control: without the watch, the same cancelled waits are acknowledged as a 201 — a
/// booking the next failover may lose.
#[tokio::test(flavor = "current_thread")]
async fn without_the_commit_watch_a_cancelled_wait_is_acknowledged() {
    assert!(!idempotency::commit_watch::installed());
    let Some((_run, reply, cancelled)) =
        book_with_cancelled_waits("sync-control", WaitsFrom::AfterTheCharge).await
    else {
        return;
    };
    assert!(
        cancelled > 0,
        "the test cancelled no wait: it proves nothing"
    );
    assert_eq!(
        reply.status,
        201,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
}

/// Why no timeout of ours is a cancel: PostgreSQL stops a statement's timer before its commit
/// waits for the standby, so a `statement_timeout` never ends the wait (and so never turns it
/// into a success with a warning). Only a cancel does.
#[tokio::test(flavor = "current_thread")]
async fn a_statement_timeout_does_not_end_a_wait_for_the_standby() {
    let Some(cluster) = Cluster::start("sync-timeout") else {
        return;
    };
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect(&cluster.url())
        .await
        .unwrap();
    let options: PgConnectOptions = cluster.url().parse().unwrap();
    let options = options.options([("synchronous_commit", "on"), ("statement_timeout", "200ms")]);
    let mut conn = sqlx::ConnectOptions::connect(&options).await.unwrap();
    sqlx::query("CREATE TABLE t (x int)")
        .execute(&mut conn)
        .await
        .unwrap();
    synchronous(&admin, true).await;
    let insert = tokio::spawn(async move {
        let done = sqlx::query("INSERT INTO t VALUES (1)")
            .execute(&mut conn)
            .await
            .map(|_| ());
        (done, conn)
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let waiting: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep' \
         AND query LIKE 'INSERT INTO t%'",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!(
        waiting, 1,
        "five times its statement_timeout on, the insert still waits"
    );
    let canceller = cancel_waits(admin.clone());
    let (done, _conn) = insert.await.unwrap();
    assert!(canceller.stop().await > 0);
    // Cancelled, the wait ends with a success: the row is there.
    done.unwrap();
    synchronous(&admin, false).await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM t")
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(rows, 1);
}

/// A pool whose `client_min_messages` keeps the server's warnings away (for the role, the
/// database, or in the URL's `options`) cannot see a cancelled wait: the check refuses it, and
/// `serve` does not start on it.
#[tokio::test(flavor = "current_thread")]
async fn the_commit_watch_refuses_connections_that_hide_the_servers_warnings() {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL is set for the tests");
    let base: PgConnectOptions = url.parse().unwrap();
    let _watch = watched();
    let warned = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(base.clone())
        .await
        .unwrap();
    idempotency::commit_watch::check(&warned).await.unwrap();
    let hidden = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(base.options([("client_min_messages", "error")]))
        .await
        .unwrap();
    let refused = idempotency::commit_watch::check(&hidden).await.unwrap_err();
    assert!(
        refused.to_string().contains("client_min_messages"),
        "{refused}"
    );

    // The binary: refused at startup, before it listens.
    let separator = if url.contains('?') { '&' } else { '?' };
    let out = Command::new(env!("CARGO_BIN_EXE_rocket-rides"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .env(
            "DATABASE_URL",
            format!("{url}{separator}options=-c%20client_min_messages%3Derror"),
        )
        .env("STRIPE_API_KEY", "sk_test_unused")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("client_min_messages"), "{stderr}");
}

/// `users rotate-key` does not report a rotation done (nor print its key) on a commit whose wait
/// for the standby was cancelled: a failover would lose it, and the leaked key would work again.
#[tokio::test(flavor = "current_thread")]
async fn a_rotation_whose_wait_for_the_standby_is_cancelled_is_not_acknowledged() {
    let _watch = watched();
    let Some(cluster) = Cluster::start("rotate") else {
        return;
    };
    let (admin, app) = service_on(&cluster).await;
    app.user("rot@example.com", "tok_visa").await;
    let canceller = cancel_waits(admin.clone());
    synchronous(&admin, true).await;
    let rotated = rocket_rides::users::rotate_api_key(&app.state.store, "rot@example.com").await;
    let cancelled = canceller.stop().await;
    synchronous(&admin, false).await;
    assert!(cancelled > 0, "no wait was cancelled");
    assert!(
        matches!(
            rotated,
            Err(rocket_rides::users::RotateKeyError::Unconfirmed(
                idempotency::Error::CommitUnconfirmed { .. }
            ))
        ),
        "{rotated:?}"
    );
}
