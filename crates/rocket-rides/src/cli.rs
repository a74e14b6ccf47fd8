//! The command line: `rocket-rides migrate | distribute | users create|rotate-key | serve | keys list|show`.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use idempotency::{DatabaseClock, KeyFilter, Store};

use crate::app::{self, AppState};
use crate::config::{
    ApiKeyArgs, DatabasePooler, GatewayArgs, HttpArgs, LeaseArgs, RetentionArgs, ShutdownArgs,
    WorkerArgs,
};
use crate::shutdown::{os_signal, Shutdown, HARD_STOP_MARGIN};
use crate::telemetry::LogFormat;

/// What `--version` says of a build with crash points and sabotage switches (tests and the
/// chaos harness, which refuses a binary without them).
pub const FAILPOINTS_MARK: &str = "built with failpoints";

/// What `--version` says of a build with the benchmark's baseline route (`bench`).
pub const BENCH_MARK: &str = "built with bench";

#[cfg(all(feature = "failpoints", not(feature = "bench")))]
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (built with failpoints)");
#[cfg(all(feature = "bench", not(feature = "failpoints")))]
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (built with bench)");
#[cfg(all(feature = "failpoints", feature = "bench"))]
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (built with failpoints) (built with bench)"
);
#[cfg(not(any(feature = "failpoints", feature = "bench")))]
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Where `serve` answers `GET /metrics` unless told otherwise: loopback only, next to the API's
/// default port, so that a scraper on the same host reaches it and nobody else does.
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:8081";

/// Rocket Rides: book a ride and charge a card, effectively once.
#[derive(Debug, Parser)]
#[command(name = "rocket-rides", version = VERSION)]
pub struct Cli {
    /// How log lines are written to stderr: `text`, or `json` (one object per line).
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

impl Cli {
    /// The log format asked for.
    pub fn log_format(&self) -> LogFormat {
        self.log_format
    }
}

/// What `migrate` says, and does not do, when it would migrate through a transaction pooler.
pub const MIGRATE_THROUGH_POOLER: &str = "--database-pooler transaction: migrations cannot run \
     through a pooler in transaction mode (sqlx's migrator holds a session advisory lock and \
     prepares named statements); give --migrate-database-url (MIGRATE_DATABASE_URL), a \
     connection straight to PostgreSQL or through a session-mode pool";

#[derive(Debug, Args)]
struct DatabaseArgs {
    /// PostgreSQL connection URL.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    #[command(flatten)]
    pooler: PoolerArgs,
}

#[derive(Debug, Clone, Copy, Args)]
struct PoolerArgs {
    /// What is between the service and PostgreSQL: `session` (PostgreSQL itself, or a pooler in
    /// session mode) or `transaction` (a pooler in transaction mode, such as PgBouncer's
    /// `pool_mode = transaction`: every statement is sent unnamed, inside a transaction).
    #[arg(long, env = "DATABASE_POOLER", value_enum, default_value_t = DatabasePooler::Session)]
    database_pooler: DatabasePooler,
}

impl DatabaseArgs {
    /// A key store on `pool` with the statements `--database-pooler` asks for, for commands
    /// that hold no lease.
    fn store(&self, pool: sqlx::PgPool) -> anyhow::Result<Store> {
        Ok(Store::new(
            pool,
            Arc::new(DatabaseClock),
            idempotency::DEFAULT_LEASE_TTL,
        )?
        .with_statements(self.pooler.database_pooler.statements()))
    }
}

#[derive(Debug, Args)]
struct MigrateArgs {
    /// PostgreSQL connection URL; migrations run on it unless --migrate-database-url is given.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        required_unless_present = "migrate_database_url"
    )]
    database_url: Option<String>,
    #[command(flatten)]
    pooler: PoolerArgs,
    /// The URL migrations run on, when DATABASE_URL goes through a pooler in transaction mode:
    /// straight to PostgreSQL (or through a session-mode pool). Required with
    /// `--database-pooler transaction`.
    #[arg(long, env = "MIGRATE_DATABASE_URL", hide_env_values = true)]
    migrate_database_url: Option<String>,
}

impl MigrateArgs {
    /// The URL to migrate on: `--migrate-database-url`, else `--database-url` unless that goes
    /// through a transaction pooler.
    fn url(&self) -> anyhow::Result<&str> {
        match (&self.migrate_database_url, self.pooler.database_pooler) {
            (Some(url), _) => Ok(url.as_str()),
            (None, DatabasePooler::Transaction) => anyhow::bail!(MIGRATE_THROUGH_POOLER),
            (None, DatabasePooler::Session) => self
                .database_url
                .as_deref()
                .context("--database-url or --migrate-database-url is required"),
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create or update the database tables (on --migrate-database-url when given).
    Migrate {
        #[command(flatten)]
        db: MigrateArgs,
    },
    /// Spread the migrated tables over a Citus cluster (docs/scaling.md); refuses a server
    /// without Citus, and does nothing where they are spread already.
    Distribute {
        #[command(flatten)]
        db: MigrateArgs,
    },
    /// Manage users.
    Users {
        #[command(subcommand)]
        command: UsersCommand,
    },
    /// Serve the HTTP API.
    Serve {
        #[command(flatten)]
        db: DatabaseArgs,
        /// Address to listen on.
        #[arg(long, env = "LISTEN", default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        /// Largest number of database connections.
        #[arg(long, env = "DATABASE_MAX_CONNECTIONS", default_value_t = 20)]
        max_connections: u32,
        /// Serve `GET /metrics` (and `GET /healthz`) on this address, apart from the API's, so
        /// that metrics stay off the public listener. Loopback by default; port 0 takes a free
        /// port, logged as `serving metrics`.
        #[arg(long, env = "METRICS_LISTEN", default_value = DEFAULT_METRICS_LISTEN)]
        metrics_listen: SocketAddr,
        /// Serve `GET /metrics` on the API's listener instead, to anyone who can reach it, and
        /// open no metrics listener.
        #[arg(
            long,
            env = "METRICS_ON_PUBLIC_LISTENER",
            conflicts_with = "metrics_listen"
        )]
        metrics_on_public_listener: bool,
        #[command(flatten)]
        http: HttpArgs,
        #[command(flatten)]
        gateway: GatewayArgs,
        #[command(flatten)]
        lease: LeaseArgs,
        #[command(flatten)]
        retention: RetentionArgs,
        #[command(flatten)]
        api_key: ApiKeyArgs,
        #[command(flatten)]
        shutdown: ShutdownArgs,
    },
    /// Run the completer, the outbox drain and the reaper.
    Worker {
        #[command(flatten)]
        db: DatabaseArgs,
        /// Run each loop once and exit (for cron-style use and for tests).
        #[arg(long)]
        once: bool,
        /// Serve the worker's counters (`GET /metrics`) on this address.
        #[arg(long, env = "WORKER_METRICS_LISTEN")]
        metrics_listen: Option<SocketAddr>,
        #[command(flatten)]
        worker: WorkerArgs,
        #[command(flatten)]
        gateway: GatewayArgs,
        #[command(flatten)]
        lease: LeaseArgs,
        #[command(flatten)]
        shutdown: ShutdownArgs,
    },
    /// Inspect idempotency keys: recovery points, leases, attempts.
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Inspect staged jobs that could not be run.
    Jobs {
        #[command(subcommand)]
        command: JobsCommand,
    },
}

#[derive(Debug, Subcommand)]
enum UsersCommand {
    /// Create a user with a card at the gateway; prints the API key once, as JSON.
    Create {
        #[command(flatten)]
        db: DatabaseArgs,
        /// The user's email.
        #[arg(long)]
        email: String,
        /// The card, as a gateway token (tok_visa charges fine, tok_chargeCustomerFail declines).
        #[arg(long, default_value = "tok_visa")]
        card: String,
        #[command(flatten)]
        gateway: GatewayArgs,
    },
    /// Give a user a new API key, printed once as JSON; the old one is refused once each serving
    /// process's cached look-up of it expires (serve's --api-key-cache-ttl, 5s by default).
    RotateKey {
        #[command(flatten)]
        db: DatabaseArgs,
        /// The user's email.
        #[arg(long)]
        email: String,
    },
}

#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// List keys, newest first, one JSON object per line.
    List {
        #[command(flatten)]
        db: DatabaseArgs,
        /// Only keys that have not finished.
        #[arg(long, conflicts_with = "status")]
        unfinished: bool,
        /// Only keys finished with this stored status (502: refused by the gateway for good).
        #[arg(long, value_parser = clap::value_parser!(u16).range(100..=599))]
        status: Option<u16>,
        /// How many.
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(i64).range(1..=10_000))]
        limit: i64,
    },
    /// Show one key as JSON.
    Show {
        #[command(flatten)]
        db: DatabaseArgs,
        /// The key row's id.
        id: i64,
    },
}

#[derive(Debug, Subcommand)]
enum JobsCommand {
    /// List the jobs moved aside because they cannot be run, newest first, one JSON object per
    /// line, with the error of each.
    List {
        #[command(flatten)]
        db: DatabaseArgs,
        /// How many.
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(i64).range(1..=10_000))]
        limit: i64,
    },
}

/// Runs a parsed command line.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Migrate { db } => {
            // Refused before any connection: nothing is written.
            let url = db.url()?;
            let pool = crate::db::connect(url, 2).await.context(
                "connect to the database to migrate (is the URL right and PostgreSQL running?)",
            )?;
            crate::db::migrate(&pool).await.context("migrate")?;
            eprintln!("migrations applied");
        }
        Command::Distribute { db } => {
            let url = db.url()?;
            let pool = crate::db::connect(url, 2).await.context(
                "connect to the database to distribute (is the URL right and PostgreSQL running?)",
            )?;
            match crate::db::distribute::distribute(&pool).await? {
                crate::db::distribute::Distributed::Now => eprintln!("tables distributed"),
                crate::db::distribute::Distributed::Already => {
                    eprintln!("tables already distributed: nothing changed")
                }
            }
        }
        Command::Users {
            command:
                UsersCommand::Create {
                    db,
                    email,
                    card,
                    gateway,
                },
        } => {
            crate::config::validate(&gateway, &LeaseArgs::default()).map_err(anyhow::Error::msg)?;
            let pool = connect(&db, 2).await?;
            let stripe = gateway.client()?;
            let store = db.store(pool)?;
            let user = crate::users::create_user_on(&store, &stripe, &email, &card).await?;
            println!("{}", serde_json::to_string(&user)?);
        }
        Command::Users {
            command: UsersCommand::RotateKey { db, email },
        } => {
            let store = db.store(connect(&db, 2).await?)?;
            // A rotation acknowledged on a commit the standby may not have would bring the old
            // key back with a failover: refused where the watch could not see that.
            idempotency::commit_watch::check(store.pool()).await?;
            let rotated = crate::users::rotate_api_key(&store, &email).await?;
            println!("{}", serde_json::to_string(&rotated)?);
        }
        Command::Serve {
            db,
            listen,
            max_connections,
            metrics_listen,
            metrics_on_public_listener,
            http,
            gateway,
            lease,
            retention,
            api_key,
            shutdown,
        } => {
            let metrics = if metrics_on_public_listener {
                MetricsAt::PublicListener
            } else {
                MetricsAt::Listener(metrics_listen)
            };
            serve(Serving {
                db,
                listen,
                max_connections,
                metrics,
                http,
                gateway,
                lease,
                retention,
                api_key,
                shutdown,
            })
            .await?;
        }
        Command::Worker {
            db,
            once,
            metrics_listen,
            worker,
            gateway,
            lease,
            shutdown,
        } => work(db, once, metrics_listen, worker, gateway, lease, shutdown).await?,
        Command::Jobs {
            command: JobsCommand::List { db, limit },
        } => {
            let store = db.store(connect(&db, 2).await?)?;
            let mut conn = store.autocommit().await?;
            let mut pg = store.statements_on(conn.conn());
            let jobs = crate::worker::outbox::failed_jobs(&mut pg, limit).await?;
            conn.done().await?;
            for job in jobs {
                println!("{}", serde_json::to_string(&job)?);
            }
        }
        Command::Keys { command } => {
            let (db, which) = match command {
                KeysCommand::List {
                    db,
                    unfinished,
                    status,
                    limit,
                } => {
                    let filter = match (unfinished, status) {
                        (true, _) => KeyFilter::Unfinished,
                        (false, Some(status)) => KeyFilter::FinishedWith(status),
                        (false, None) => KeyFilter::All,
                    };
                    (db, Err((filter, limit)))
                }
                KeysCommand::Show { db, id } => (db, Ok(id)),
            };
            let store = db.store(connect(&db, 2).await?)?;
            match which {
                Ok(id) => {
                    let key = store
                        .find(id)
                        .await?
                        .with_context(|| format!("no key {id}"))?;
                    println!("{}", serde_json::to_string_pretty(&key)?);
                }
                Err((filter, limit)) => {
                    for key in store.list(filter, limit).await? {
                        println!("{}", serde_json::to_string(&key)?);
                    }
                }
            }
        }
    }
    Ok(())
}

/// Where `serve` answers `GET /metrics`.
#[derive(Debug, Clone, Copy)]
enum MetricsAt {
    /// On a listener of its own (`--metrics-listen`, loopback by default).
    Listener(SocketAddr),
    /// On the API's listener, to anyone (`--metrics-on-public-listener`).
    PublicListener,
}

/// What `serve` runs with: its command line.
struct Serving {
    db: DatabaseArgs,
    listen: SocketAddr,
    max_connections: u32,
    metrics: MetricsAt,
    http: HttpArgs,
    gateway: GatewayArgs,
    lease: LeaseArgs,
    retention: RetentionArgs,
    api_key: ApiKeyArgs,
    shutdown: ShutdownArgs,
}

/// `rocket-rides serve`: the API (and its metrics listener) until SIGTERM or SIGINT, then the
/// two-step shutdown.
/// `worker`: the completer, the reaper and the outbox drain, once or until shut down.
async fn work(
    db: DatabaseArgs,
    once: bool,
    metrics_listen: Option<std::net::SocketAddr>,
    worker: WorkerArgs,
    gateway: GatewayArgs,
    lease: LeaseArgs,
    shutdown: ShutdownArgs,
) -> anyhow::Result<()> {
    crate::config::validate(&gateway, &lease).map_err(anyhow::Error::msg)?;
    crate::config::validate_worker(&worker, &lease).map_err(anyhow::Error::msg)?;
    crate::config::validate_shutdown(&shutdown, &gateway).map_err(anyhow::Error::msg)?;
    let connections = worker.completer_concurrency + 2;
    // A worker that runs once has nothing to wait for: no database, no run.
    let pool = if once {
        connect(&db, connections).await?
    } else {
        connect_serving(&db, connections).await?
    };
    // The worker's claims agree with the API's on what has expired, as its reaper does.
    let mut state = AppState::new(pool, Arc::new(DatabaseClock), &gateway, &lease)?
        .with_key_retention(worker.key_retention)?
        .with_statements(db.pooler.database_pooler.statements());
    refuse_an_unseen_cancelled_wait(&state).await?;
    if once {
        crate::worker::run_once(&state, &worker).await?;
    } else {
        let steps = Shutdown::new();
        let stopping = steps.stopping();
        state.giving_up = steps.giving_up();
        if let Some(address) = metrics_listen {
            let listener = tokio::net::TcpListener::bind(address)
                .await
                .with_context(|| format!("listen on {address}"))?;
            let mut stopping = steps.stopping();
            let (router, counters) = (app::metrics_router(state.clone()), state.metrics.clone());
            tokio::spawn(app::serve(
                listener,
                router,
                HttpArgs::default(),
                counters,
                async move { stopping.wait().await },
            ));
        }
        tokio::spawn(steps.run(os_signal(), shutdown.shutdown_deadline));
        tracing::info!("worker running");
        crate::worker::run(&state, &worker, stopping).await;
        tracing::info!("stopped");
    }
    Ok(())
}

/// Refuses to run where a commit whose wait for a synchronous standby was cancelled would be
/// taken for a success: the commit watch missing from the subscriber, or `client_min_messages`
/// keeping the server's warnings away ([`idempotency::commit_watch::check`]). A database that
/// does not answer yet is only logged: the pool waits for it, and the check is the settings'.
async fn refuse_an_unseen_cancelled_wait(state: &AppState) -> anyhow::Result<()> {
    if state.failpoints.no_commit_watch() {
        return Ok(());
    }
    match idempotency::commit_watch::check(&state.pool).await {
        Ok(()) => Ok(()),
        Err(e @ idempotency::Error::InvalidConfig(_)) => Err(anyhow::Error::new(e)),
        Err(e) => {
            tracing::warn!(error = %e, "could not check client_min_messages yet");
            Ok(())
        }
    }
}

async fn serve(settings: Serving) -> anyhow::Result<()> {
    let Serving {
        db,
        listen,
        max_connections,
        metrics,
        http,
        gateway,
        lease,
        retention,
        api_key,
        shutdown,
    } = settings;
    // Every setting is checked before the first connection: a mistake is one message, at once.
    crate::config::validate(&gateway, &lease).map_err(anyhow::Error::msg)?;
    crate::config::validate_http(&http, &gateway).map_err(anyhow::Error::msg)?;
    crate::config::validate_shutdown(&shutdown, &gateway).map_err(anyhow::Error::msg)?;
    crate::config::validate_key_retention(retention.key_retention).map_err(anyhow::Error::msg)?;
    crate::config::validate_api_key_cache_ttl(api_key.api_key_cache_ttl)
        .map_err(anyhow::Error::msg)?;
    let pool = connect_serving(&db, max_connections).await?;
    // Finished keys expire at read after the retention: a late retry's answer depends on its
    // key's age, not on when the worker's reaper last ran.
    let mut state = AppState::new(pool, Arc::new(DatabaseClock), &gateway, &lease)?
        .with_key_retention(retention.key_retention)?
        .with_api_key_cache_ttl(api_key.api_key_cache_ttl)?
        .with_statements(db.pooler.database_pooler.statements());
    refuse_an_unseen_cancelled_wait(&state).await?;
    state.http = http.clone();
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("listen on {listen}"))?;
    let steps = Shutdown::new();
    state.giving_up = steps.giving_up();
    if let MetricsAt::Listener(address) = metrics {
        let metrics = tokio::net::TcpListener::bind(address)
            .await
            .with_context(|| format!("listen for metrics on {address} (--metrics-listen)"))?;
        tracing::info!(address = %metrics.local_addr()?, "serving metrics");
        let mut stopping = steps.stopping();
        let (router, limits, counters) = (
            app::metrics_router(state.clone()),
            http.clone(),
            state.metrics.clone(),
        );
        tokio::spawn(app::serve(metrics, router, limits, counters, async move {
            stopping.wait().await
        }));
    }
    tracing::info!(address = %listener.local_addr()?, "serving");
    let mut stopping = steps.stopping();
    tokio::spawn(steps.run(os_signal(), shutdown.shutdown_deadline));
    let mut giving_up = state.giving_up.clone();
    let tasks = state.tasks.clone();
    let router = app::api_router(state.clone(), matches!(metrics, MetricsAt::PublicListener));
    let serving = app::serve(listener, router, http, state.metrics.clone(), async move {
        stopping.wait().await
    });
    let hard_stop = async {
        giving_up.wait().await;
        tokio::time::sleep(HARD_STOP_MARGIN).await;
    };
    tokio::pin!(hard_stop);
    tokio::select! {
        served = serving => served?,
        () = &mut hard_stop => {
            tracing::warn!("connections still open past the shutdown deadline; exiting")
        }
    }
    // Bookings run detached from their connections: a client that hung up does not end
    // its booking. Wait for them too; at the deadline they release their leases and end.
    tasks.close();
    tokio::select! {
        () = tasks.wait() => {}
        () = &mut hard_stop => {
            tracing::warn!(left = tasks.len(), "bookings still running past the shutdown deadline; exiting")
        }
    }
    tracing::info!("stopped");
    Ok(())
}

async fn connect_serving(db: &DatabaseArgs, max_connections: u32) -> anyhow::Result<sqlx::PgPool> {
    crate::db::connect_serving(&db.database_url, max_connections)
        .await
        .context("read DATABASE_URL")
}

async fn connect(db: &DatabaseArgs, max_connections: u32) -> anyhow::Result<sqlx::PgPool> {
    crate::db::connect(&db.database_url, max_connections)
        .await
        .context("connect to the database (is DATABASE_URL right and PostgreSQL running?)")
}
