//! The run's stack, and the one context every task of the run shares ([`Stack`]): the
//! databases, the in-process gateway and its proxy, the service's processes and their proxies,
//! the recorder, the run's seeded generator and the signals the tasks share.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context;
use rand::rngs::StdRng;
use rand::Rng;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgConnection, PgPool};

use super::clients::{self, ClientUser};
use super::cluster::{self, Replication};
use super::faults;
use super::intermediary;
use super::options::{ChaosArgs, FaultFamily, Sabotage};
use super::postgres::Postgres;
use super::processes::Supervised;
use super::proxy::{Proxy, ProxyFaults};
use super::recorder::Recorder;
use super::services::{self, Services, GATEWAY_SECRET, SERVICE_APPLICATION};

/// The straddle's held charge: longer than the gateway timeout plus `Retry-After` (3 s + 1 s),
/// shorter than the processing bound, and long enough that the retry after the timeout comes
/// seconds before the charge is made, whatever the other faults add to it.
pub(crate) const STRADDLE_HOLD: Duration = Duration::from_millis(8_500);
/// Requests whose charge straddles its key's window, each of a user of its own: several, since
/// a process killed under one (its lease then outlives the charge) spoils it.
const STRADDLES: usize = 6;
/// How long setting up the run's PostgreSQL (a cluster, a standby) may take: room for the
/// Patroni cluster's two attempts of a minute each (chaos/patroni.rs).
const SETUP_LIMIT: Duration = Duration::from_secs(150);

/// What every task of the run shares.
pub(crate) struct Stack {
    pub args: ChaosArgs,
    pub recorder: Recorder,
    /// The run's generator, after the stack's own draws: the fault tasks draw their seeds from
    /// it, one after the other, as they start.
    rng: Mutex<StdRng>,
    /// Set when the faults stop.
    pub stop: AtomicBool,
    /// Requests done by the clients.
    pub done: Arc<AtomicU64>,
    /// The auditor's connections to the service's database.
    pub pool: PgPool,
    /// The in-process gateway, its database, and its address (not through its proxy).
    pub gateway: fakestripe::AppState,
    pub gateway_pool: PgPool,
    pub gateway_addr: SocketAddr,
    pub stop_gateway: tokio::sync::oneshot::Sender<()>,
    /// The run's PostgreSQL, its service database and how its standby replicates.
    pub postgres: tokio::sync::Mutex<Postgres>,
    pub database: &'static str,
    pub replication: Replication,
    pub services: Services,
    pub apis: Vec<Supervised>,
    pub worker: Supervised,
    /// The API processes' addresses, through their proxies.
    pub targets: Vec<SocketAddr>,
    /// The clients' proxies to the API processes, then the API processes' proxy to the gateway.
    pub proxies: Vec<Proxy>,
    /// Users whose customer the gateway came to refuse.
    pub refused_users: Mutex<HashSet<i64>>,
    /// The seconds PostgreSQL was away.
    pub outage: Mutex<Vec<u32>>,
    /// Set while the primary dies (or its WAL writer is stalled): the database killers and the
    /// lease stealer hold still.
    pub db_faults_held: AtomicBool,
}

/// The run's users: the clients', and the scripted requests' (straddles, intermediaries), with
/// good cards of their own, so that their customers' scripts at the gateway strike nobody else,
/// and apart from the users the harness may refuse.
pub(crate) struct Cast {
    pub users: Vec<ClientUser>,
    pub straddlers: Vec<(ClientUser, String)>,
    pub intermediated: Vec<(ClientUser, String)>,
}

/// What the run undoes at its end: the gateway's database, on `DATABASE_URL`'s server.
pub(crate) struct Teardown {
    /// A connection to the server.
    pub admin: PgConnection,
    pub gateway_database: String,
}

impl Stack {
    /// Starts everything, in order: the databases, the gateway, the users, the standby, the
    /// service's processes. Draws from `rng` in that order too.
    pub(crate) async fn start(
        args: ChaosArgs,
        program: PathBuf,
        run_name: &str,
        dir: &Path,
        mut rng: StdRng,
    ) -> anyhow::Result<(Arc<Stack>, Cast, Teardown)> {
        let (admin, gateway_database, gateway_url) =
            gateway_database(&args.database_url, run_name).await?;
        let replication = match (args.failover, args.without(Sabotage::SyncReplication)) {
            (false, _) => Replication::None,
            (true, false) => Replication::Synchronous,
            (true, true) => Replication::Asynchronous,
        };
        let cut_probability = if args.on(FaultFamily::Database) {
            faults::commit_cut_probability()
        } else {
            0.0
        };
        let root = cluster::clusters_dir().join(run_name);
        let seed = rng.random();
        let mut postgres = tokio::time::timeout(SETUP_LIMIT, async {
            if args.patroni() {
                let synchronous = !args.without(Sabotage::SyncReplication);
                Postgres::start_patroni(&root, dir, synchronous, cut_probability, seed).await
            } else {
                let pgbouncer = args.pgbouncer().then_some(args.pgbouncer_script.as_path());
                Postgres::start(&root, cut_probability, seed, pgbouncer).await
            }
        })
        .await
        .context("the run's PostgreSQL did not start in time")??;
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect_with(
                postgres
                    .harness_url()
                    .parse::<PgConnectOptions>()?
                    .application_name("chaos-auditor"),
            )
            .await?;
        rocket_rides::db::migrate(&pool).await?;

        let recorder = Recorder::new();
        let gateway = Gateway::start(&args, &gateway_url, &mut rng).await?;
        let cast = gateway.cast(&args, &pool).await?;
        if args.failover {
            tokio::time::timeout(SETUP_LIMIT, postgres.add_standby(replication))
                .await
                .context("the standby did not start streaming in time")??;
        }

        // The API processes and the worker: the service's binary, with failpoints compiled in.
        let mut service_url = postgres.service_url(SERVICE_APPLICATION);
        if args.without(Sabotage::DurableCommit) {
            service_url.push_str("&options[synchronous_commit]=off");
        }
        let services = Services::new(&args, program, dir, service_url, gateway.proxy.local_addr());
        let (mut apis, mut targets, mut proxies) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..args.api_instances {
            let port = crate::local::free_port()?;
            let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
            let spec = services.api(&format!("api-{i}"), addr, services.crash_env(rng.random()));
            apis.push(Supervised::start(spec, recorder.clone()));
            let name = format!("client-api-{i}");
            let proxy = Proxy::start(&name, addr, gateway.network, rng.random()).await?;
            targets.push(proxy.local_addr());
            proxies.push(proxy);
        }
        let worker = services.worker(services.crash_env(rng.random()));
        let worker = Supervised::start(worker, recorder.clone());
        services::wait_until_serving(&targets).await?;
        proxies.push(gateway.proxy);

        let stack = Stack {
            recorder,
            rng: Mutex::new(rng),
            stop: AtomicBool::new(false),
            done: Arc::default(),
            pool,
            gateway: gateway.state,
            gateway_pool: gateway.pool,
            gateway_addr: gateway.addr,
            stop_gateway: gateway.stop,
            database: postgres.database(),
            postgres: tokio::sync::Mutex::new(postgres),
            replication,
            services,
            apis,
            worker,
            targets,
            proxies,
            refused_users: Mutex::default(),
            outage: Mutex::default(),
            db_faults_held: AtomicBool::new(false),
            args,
        };
        let teardown = Teardown {
            admin,
            gateway_database,
        };
        Ok((Arc::new(stack), cast, teardown))
    }

    /// The run's generator, for a task's seed.
    pub(crate) fn rng(&self) -> MutexGuard<'_, StdRng> {
        self.rng.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until the clients have done `at` requests: true then, false if the run stopped
    /// first.
    pub(crate) async fn reached(&self, at: u64) -> bool {
        while !self.stop.load(Ordering::Relaxed) && self.done.load(Ordering::Relaxed) < at {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        !self.stop.load(Ordering::Relaxed)
    }
}

/// Creates the gateway's database on the server of `database_url`: returns a connection to
/// the server, the database's name and its URL.
async fn gateway_database(
    database_url: &str,
    run_name: &str,
) -> anyhow::Result<(PgConnection, String, String)> {
    let server: PgConnectOptions = database_url.parse().context("parse DATABASE_URL")?;
    let gateway_database = format!("rocket_rides_{}_gateway", run_name.replace('-', "_"));
    let mut admin = server
        .clone()
        .connect()
        .await
        .context("connect to PostgreSQL")?;
    sqlx::query(&format!("CREATE DATABASE {gateway_database}"))
        .execute(&mut admin)
        .await?;
    let gateway_url = server
        .clone()
        .database(&gateway_database)
        .to_url_lossy()
        .to_string();
    Ok((admin, gateway_database, gateway_url))
}

/// The gateway, in-process, and the network between the API and it.
struct Gateway {
    state: fakestripe::AppState,
    pool: PgPool,
    addr: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    /// Its faults once the run's users exist (none when the family is off).
    faults: fakestripe::Faults,
    /// The faults of every loopback proxy.
    network: ProxyFaults,
    proxy: Proxy,
}

impl Gateway {
    /// Serves the gateway with its database at `url`; draws its faults' seed and its proxy's.
    async fn start(args: &ChaosArgs, url: &str, rng: &mut StdRng) -> anyhow::Result<Self> {
        let pool = fakestripe::connect(url).await?;
        let gateway_faults = faults::gateway_faults(rng.random());
        let faults = if args.on(FaultFamily::Gateway) {
            gateway_faults.clone()
        } else {
            fakestripe::Faults::default()
        };
        let state = fakestripe::AppState::new(pool.clone(), faults.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(fakestripe::serve(
            listener,
            fakestripe::router(state.clone()),
            async {
                let _ = stopped.await;
            },
        ));
        let network = if args.on(FaultFamily::Network) {
            faults::network_faults()
        } else {
            ProxyFaults::default()
        };
        let proxy = Proxy::start("api-gateway", addr, network, rng.random()).await?;
        Ok(Self {
            state,
            pool,
            addr,
            stop,
            faults: gateway_faults,
            network,
            proxy,
        })
    }

    /// Creates the run's users through the gateway directly, its faults off meanwhile (setup is
    /// not under test); the scripted requests' users only when the gateway family is on.
    async fn cast(&self, args: &ChaosArgs, pool: &PgPool) -> anyhow::Result<Cast> {
        let stripe = rocket_rides::stripe::StripeClient::new(
            &format!("http://{}", self.addr),
            GATEWAY_SECRET,
            Duration::from_secs(2),
            Duration::from_secs(10),
            None,
        )?;
        self.state.set_faults(fakestripe::Faults::default());
        let mut users = Vec::new();
        for i in 0..args.users {
            let declines = i % 5 == 4;
            let card = if declines {
                "tok_chargeCustomerFail"
            } else {
                "tok_visa"
            };
            let user = rocket_rides::users::create_user(
                pool,
                &stripe,
                &format!("rider{i}@chaos.example"),
                card,
            )
            .await?;
            users.push(ClientUser {
                id: user.id,
                api_key: user.api_key,
                declines,
            });
        }
        let (mut straddlers, mut intermediated) = (Vec::new(), Vec::new());
        // Under Patroni, no straddles: a failover in the last seconds of a straddle's key
        // window keeps its held attempt from the gateway, and the straddle is spoiled (its
        // script fails its customer's charges for good). The runs without Patroni prove the
        // guard they test.
        if args.on(FaultFamily::Straddle) && !args.patroni() {
            straddlers = clients::dedicated_users(pool, &stripe, "straddler", STRADDLES).await?;
        }
        if args.on(FaultFamily::Gateway) {
            intermediated =
                clients::dedicated_users(pool, &stripe, "intermediated", intermediary::USERS)
                    .await?;
            self.state.set_faults(self.faults.clone());
        }
        Ok(Cast {
            users,
            straddlers,
            intermediated,
        })
    }
}
