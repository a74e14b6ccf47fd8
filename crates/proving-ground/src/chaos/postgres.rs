//! The run's PostgreSQL: a private cluster (so that it may crash), reached through proxies.
//!
//! ```text
//!  API processes, worker ──► service proxy (cuts after COMMIT) ──┐
//!  the harness (auditor, killers) ──► harness proxy ──────────────┼──► primary ──replication proxy──► standby
//!                                                                 └──► (after a failover) the promoted standby
//! ```
//!
//! The services and the harness reach the server through proxies of their own, as through a
//! virtual IP: a failover points both at the promoted standby. The standby, with `--failover`,
//! streams through a third proxy, which the negative control stalls before the primary dies.
//! Under `--ha patroni` there is no cluster of ours: both proxies front HAProxy, which routes to
//! the Patroni leader ([`super::patroni`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use sqlx::{ConnectOptions, Connection, PgConnection};

use super::cluster::{Cluster, Replication};
use super::patroni::Patroni;
use super::pgproxy::PgProxy;
use crate::pgbouncer::PgBouncer;

/// The service's database in the cluster.
const DATABASE: &str = "rocket_rides";

/// How long a failover run waits for its standby to stream (and, synchronous, to be the sync one).
const STANDBY_WAIT: Duration = Duration::from_secs(60);

pub(crate) struct Postgres {
    /// The run's own primary; none under `--ha patroni`, where [`Postgres::ha`] holds the
    /// servers.
    primary: Option<Cluster>,
    ha: Option<Arc<Patroni>>,
    standby: Option<Cluster>,
    services: PgProxy,
    harness: PgProxy,
    replication: Option<PgProxy>,
    cut_probability: f64,
    root: PathBuf,
    /// The WAL writer stopped by [`Postgres::stall_wal_writer`], killed at the crash.
    stalled_wal_writer: Option<u32>,
    /// `--pooler pgbouncer`: the PgBouncer between the services' proxy and the primary,
    /// stopped when this is dropped.
    pooler: Option<PgBouncer>,
}

impl Postgres {
    /// A fresh cluster under `root`, started, with the service's database created, the
    /// services' proxy cutting a connection after a `COMMIT` with `cut_probability`. With
    /// `pgbouncer` (the script that starts one), the services' proxy fronts a PgBouncer in
    /// transaction pooling in front of the cluster; the harness's proxy fronts the cluster.
    pub(crate) async fn start(
        root: &Path,
        cut_probability: f64,
        seed: u64,
        pgbouncer: Option<&Path>,
    ) -> anyhow::Result<Self> {
        let primary = Cluster::create(root, "primary").await?;
        primary
            .start()
            .await
            .context("start the run's PostgreSQL")?;
        let upstream = primary.address();
        let (pooler, services_upstream) = match pgbouncer {
            Some(script) => {
                let pooler = start_pgbouncer(script, upstream).await?;
                let options: sqlx::postgres::PgConnectOptions =
                    pooler.url().parse().context("parse the PgBouncer's URL")?;
                let address = format!("127.0.0.1:{}", options.get_port()).parse()?;
                (Some(pooler), address)
            }
            None => (None, upstream),
        };
        let mut this = Self::behind(
            Some(primary),
            None,
            [services_upstream, upstream],
            root,
            cut_probability,
            seed,
        )
        .await?;
        this.pooler = pooler;
        Ok(this)
    }

    /// The service's database in a Patroni cluster under `root` (its logs in `logs`): the
    /// services and the harness reach it through HAProxy, which routes to the leader.
    pub(crate) async fn start_patroni(
        root: &Path,
        logs: &Path,
        synchronous: bool,
        cut_probability: f64,
        seed: u64,
    ) -> anyhow::Result<Self> {
        let ha = Patroni::start(&root.join("patroni"), logs, synchronous).await?;
        let upstream = ha.address();
        Self::behind(
            None,
            Some(Arc::new(ha)),
            [upstream, upstream],
            root,
            cut_probability,
            seed,
        )
        .await
    }

    /// The services' proxy and the harness's in front of their `upstreams`, in that order, and
    /// the service's database created through the harness's.
    async fn behind(
        primary: Option<Cluster>,
        ha: Option<Arc<Patroni>>,
        [services_upstream, harness_upstream]: [std::net::SocketAddr; 2],
        root: &Path,
        cut_probability: f64,
        seed: u64,
    ) -> anyhow::Result<Self> {
        let services = PgProxy::start(services_upstream, cut_probability, seed).await?;
        let harness = PgProxy::start(harness_upstream, 0.0, seed).await?;
        let this = Self {
            primary,
            ha,
            standby: None,
            services,
            harness,
            replication: None,
            cut_probability,
            root: root.to_owned(),
            stalled_wal_writer: None,
            pooler: None,
        };
        let mut admin = this.connect("postgres").await?;
        sqlx::query(&format!("CREATE DATABASE {DATABASE}"))
            .execute(&mut admin)
            .await?;
        admin.close().await?;
        Ok(this)
    }

    /// The Patroni cluster, under `--ha patroni`.
    pub(crate) fn ha(&self) -> Option<Arc<Patroni>> {
        self.ha.clone()
    }

    fn primary(&self) -> anyhow::Result<&Cluster> {
        self.primary
            .as_ref()
            .context("the run's own primary (there is none under --ha patroni)")
    }

    async fn connect(&self, database: &str) -> anyhow::Result<PgConnection> {
        Ok(format!(
            "postgres://postgres@{}/{database}",
            self.harness.local_addr()
        )
        .parse::<sqlx::postgres::PgConnectOptions>()?
        .connect()
        .await?)
    }

    /// The URL the services use: through their proxy, their connections named
    /// `application_name`.
    pub(crate) fn service_url(&self, application_name: &str) -> String {
        format!(
            "postgres://postgres@{}/{DATABASE}?application_name={application_name}",
            self.services.local_addr()
        )
    }

    /// The URL the harness uses.
    pub(crate) fn harness_url(&self) -> String {
        format!(
            "postgres://postgres@{}/{DATABASE}",
            self.harness.local_addr()
        )
    }

    /// The database's name, as `pg_stat_activity` shows it.
    pub(crate) fn database(&self) -> &'static str {
        DATABASE
    }

    /// Connections cut after their `COMMIT` so far.
    pub(crate) fn cuts(&self) -> u64 {
        self.services.cuts()
    }

    /// Stops cutting connections (the calm part of the run).
    pub(crate) fn calm(&mut self) {
        self.cut_probability = 0.0;
        self.services.set_cut_probability(0.0);
    }

    /// Holds the cuts after `COMMIT` (`true`) or lets them go on (`false`).
    pub(crate) fn hold_cuts(&self, hold: bool) {
        let p = if hold { 0.0 } else { self.cut_probability };
        self.services.set_cut_probability(p);
    }

    /// Adds a streaming standby, through a proxy, and waits until it streams (and, with
    /// synchronous replication, until the primary counts it as its synchronous standby).
    pub(crate) async fn add_standby(&mut self, replication: Replication) -> anyhow::Result<()> {
        let proxy = PgProxy::start(self.primary()?.address(), 0.0, 0).await?;
        let standby = Cluster::standby_of(proxy.local_addr(), &self.root, "standby").await?;
        standby.start().await.context("start the standby")?;
        self.replication = Some(proxy);
        self.standby = Some(standby);
        let mut admin = self.connect("postgres").await?;
        let wanted = match replication {
            Replication::Synchronous => {
                sqlx::query(&format!(
                    "ALTER SYSTEM SET synchronous_standby_names = '{}'",
                    super::cluster::STANDBY_NAME
                ))
                .execute(&mut admin)
                .await?;
                sqlx::query("SELECT pg_reload_conf()")
                    .execute(&mut admin)
                    .await?;
                "sync"
            }
            Replication::Asynchronous | Replication::None => "async",
        };
        let started = Instant::now();
        loop {
            let state: Option<String> = sqlx::query_scalar(
                "SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'",
            )
            .fetch_optional(&mut admin)
            .await?;
            if state.as_deref() == Some(wanted) {
                return Ok(());
            }
            anyhow::ensure!(
                started.elapsed() < STANDBY_WAIT,
                "the standby is not streaming as {wanted} after {STANDBY_WAIT:?} (state {state:?})"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Kills the server (`-m immediate`), waits `down`, and starts it again: crash recovery.
    pub(crate) async fn crash_and_restart(&mut self, down: Duration) -> anyhow::Result<()> {
        // A stopped process cannot take the shutdown's signal: it dies first, unwritten WAL and
        // all (its death alone would make the server restart every backend).
        if let Some(pid) = self.stalled_wal_writer.take() {
            super::processes::signal(pid, "KILL").await?;
        }
        self.primary()?.crash().await?;
        tokio::time::sleep(down).await;
        self.primary()?.start().await
    }

    /// Stops the primary's WAL writer (SIGSTOP): asynchronous commits then stay in shared
    /// memory, unwritten, until the server dies (the negative control of durable commits).
    pub(crate) async fn stall_wal_writer(&mut self) -> anyhow::Result<()> {
        let mut conn = self.connect(DATABASE).await?;
        let pid: i32 =
            sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'")
                .fetch_one(&mut conn)
                .await
                .context("find the WAL writer")?;
        conn.close().await?;
        let pid = u32::try_from(pid).context("a process id")?;
        super::processes::signal(pid, "STOP").await?;
        self.stalled_wal_writer = Some(pid);
        Ok(())
    }

    /// Stalls the replication stream (the negative control's way to make the loss certain).
    pub(crate) fn stall_replication(&self) {
        if let Some(proxy) = &self.replication {
            proxy.set_paused(true);
        }
    }

    /// Kills the primary, promotes the standby and points both proxies at it.
    pub(crate) async fn fail_over(&mut self) -> anyhow::Result<()> {
        let standby = self
            .standby
            .take()
            .context("a failover needs a standby (--failover)")?;
        self.primary()?.crash().await?;
        standby.promote().await.context("promote the standby")?;
        self.services.set_upstream(standby.address());
        self.harness.set_upstream(standby.address());
        // The old primary stays down: it is gone, as a failed machine would be.
        if let Some(old) = self.primary.replace(standby) {
            old.destroy().await;
        }
        Ok(())
    }

    /// Stops every server and deletes the clusters (or keeps them, stopped, for inspection).
    pub(crate) async fn finish(self, keep: bool) {
        // Its clients are gone; its server is about to be.
        drop(self.pooler);
        if let Some(ha) = self.ha {
            // The fault tasks, which held the other references, are over.
            match Arc::try_unwrap(ha) {
                Ok(ha) => ha.finish(keep),
                Err(ha) => drop(ha),
            }
        }
        if keep {
            if let Some(primary) = self.primary {
                primary.keep().await;
            }
            if let Some(standby) = self.standby {
                standby.keep().await;
            }
            eprintln!(
                "chaos: the run's PostgreSQL clusters are kept, stopped, in {}",
                self.root.display()
            );
            return;
        }
        if let Some(primary) = self.primary {
            primary.destroy().await;
        }
        if let Some(standby) = self.standby {
            standby.destroy().await;
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// A PgBouncer in transaction pooling in front of the server at `server`, started by `script`
/// (which may install it, and blocks meanwhile).
async fn start_pgbouncer(script: &Path, server: std::net::SocketAddr) -> anyhow::Result<PgBouncer> {
    let script = script.to_owned();
    let url = format!("postgres://postgres@{server}/postgres");
    tokio::task::spawn_blocking(move || {
        PgBouncer::start(
            "chaos",
            &script,
            &url,
            "--pooler pgbouncer needs pgbouncer (scripts/pgbouncer.sh installs it where apt-get \
             can, as root)",
        )
    })
    .await
    .context("the PgBouncer's start")?
}
