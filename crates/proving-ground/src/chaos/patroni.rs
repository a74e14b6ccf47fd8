//! `--ha patroni`: the service's database in a Patroni cluster, as operators run PostgreSQL with
//! high availability: one etcd member (the consensus store, holding the leader's lease), two
//! nodes each a Patroni agent with its PostgreSQL, and HAProxy in front, routing to whichever
//! node answers `GET /primary` on its Patroni REST API.
//!
//! ```text
//!  services ──PgProxy (cuts after COMMIT)──┐
//!  harness  ──PgProxy──────────────────────┴──► HAProxy ──► leader (node0 or node1)
//!                                               (checks /primary)      │ synchronous stream
//!                      etcd ◄── both agents hold or watch the lease    ▼
//!                                                                     standby
//! ```
//!
//! Everything listens on 127.0.0.1 on ports found free outside the kernel's ephemeral range
//! ([`crate::local::free_port`]: the standby's ports wait seconds for their process, and a test
//! beside the run must not be handed them meanwhile); the data lives under the run's cluster
//! directory and the logs in its report directory. Dropping a [`Patroni`] kills every process it
//! started (an error or a panic must not leave a postmaster behind), as [`super::cluster`] does.
//! As root, the agents (and so PostgreSQL) run as `postgres`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context;
use sqlx::{ConnectOptions, Connection};
use tokio::process::{Child, Command};

use super::cluster;

/// The lease of the leader in etcd, and how often each agent looks: Patroni's own defaults are
/// 30 s and 10 s; shorter, so that a dead agent's lease runs out within a short run. The
/// constraint Patroni states: `loop_wait + 2 * retry_timeout <= ttl`.
const TTL_SECS: u32 = 10;
const LOOP_WAIT_SECS: u32 = 2;
const RETRY_TIMEOUT_SECS: u32 = 4;
/// How long one attempt at the cluster may take to come up (bootstrap, base backup, the standby
/// streaming): about ten seconds on two loaded cores, so six times that means something is
/// broken, and [`Patroni::start`] makes one fresh attempt (new ports, new directories).
const SETUP_WAIT: Duration = Duration::from_secs(60);
/// How many attempts [`Patroni::start`] makes.
const SETUP_ATTEMPTS: u32 = 2;
/// How long a switchover may be refused (no synchronous standby named yet) before it fails.
const SWITCHOVER_WAIT: Duration = Duration::from_secs(20);
/// The nodes' names, in Patroni and in HAProxy.
const NODES: [&str; 2] = ["node0", "node1"];

/// A Patroni cluster of two nodes, etcd and HAProxy, all of them children of this process.
pub(crate) struct Patroni {
    root: PathBuf,
    nodes: Vec<Node>,
    etcd: Mutex<Option<Child>>,
    haproxy: Mutex<Option<Child>>,
    haproxy_address: SocketAddr,
    /// `synchronous_mode` (false only for the negative control).
    synchronous: bool,
    http: reqwest::Client,
    /// The `postgres` user's ids, when we are root.
    ids: Option<(u32, u32)>,
}

/// One node: its agent's configuration and process, its PostgreSQL's port and data.
pub(crate) struct Node {
    pub name: &'static str,
    config: PathBuf,
    data: PathBuf,
    log: PathBuf,
    pg_port: u16,
    rest_port: u16,
    agent: Mutex<Option<Child>>,
}

impl Node {
    /// The PostgreSQL server's address (direct, not through HAProxy).
    pub(crate) fn address(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.pg_port))
    }

    fn rest(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.rest_port)
    }

    /// The postmaster's process id, from its `postmaster.pid`, if it runs.
    pub(crate) fn postmaster_pid(&self) -> Option<u32> {
        let text = std::fs::read_to_string(self.data.join("postmaster.pid")).ok()?;
        text.lines().next()?.trim().parse().ok()
    }
}

impl Patroni {
    /// Starts etcd, both agents and HAProxy under `root` (logs in `logs`), and waits until one
    /// node leads and the other streams from it (as its synchronous standby when `synchronous`).
    ///
    /// An attempt that is not healthy within [`SETUP_WAIT`] is stopped, its logs kept beside
    /// the next ones (`patroni-node1.attempt-1.log`, …), what it lacked printed, and a fresh
    /// cluster started, [`SETUP_ATTEMPTS`] times at most. Nothing of the run has happened yet
    /// (no request, no fault): a cluster that never came up is the machine's trouble, not a
    /// finding, and the next run must not inherit it.
    pub(crate) async fn start(root: &Path, logs: &Path, synchronous: bool) -> anyhow::Result<Self> {
        let mut attempt = 1;
        loop {
            let dir = if attempt == 1 {
                root.to_owned()
            } else {
                root.with_file_name(format!(
                    "{}-attempt-{attempt}",
                    root.file_name().unwrap_or_default().to_string_lossy()
                ))
            };
            match Self::start_once(&dir, logs, synchronous).await {
                Ok(this) => return Ok(this),
                Err(e) if attempt < SETUP_ATTEMPTS => {
                    eprintln!(
                        "chaos: Patroni attempt {attempt} failed, starting a fresh cluster: {e:#}"
                    );
                    let _ = std::fs::remove_dir_all(&dir);
                    for file in ["etcd", "haproxy", "patroni-node0", "patroni-node1"] {
                        let _ = std::fs::rename(
                            logs.join(format!("{file}.log")),
                            logs.join(format!("{file}.attempt-{attempt}.log")),
                        );
                    }
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One attempt of [`Patroni::start`].
    async fn start_once(root: &Path, logs: &Path, synchronous: bool) -> anyhow::Result<Self> {
        for program in ["patroni", "etcd", "haproxy"] {
            anyhow::ensure!(
                which(program).is_some(),
                "--ha patroni needs `{program}` on PATH: scripts/chaos.sh --ha patroni installs \
                 patroni, etcd-server and haproxy (Debian: apt-get install -y patroni \
                 etcd-server haproxy)"
            );
        }
        let bin = cluster::server_binaries()?;
        cluster::create_reachable_dir(root)?;
        let ids = if cluster::is_root() {
            Some(postgres_ids()?)
        } else {
            None
        };
        let etcd_client = crate::local::free_port()?;
        let etcd_peer = crate::local::free_port()?;
        let etcd = spawn_etcd(root, logs, etcd_client, etcd_peer)?;
        let mut nodes = Vec::new();
        for name in NODES {
            let dir = root.join(name);
            cluster::create_reachable_dir(&dir)?;
            let node = Node {
                name,
                config: dir.join("patroni.yml"),
                data: dir.join("data"),
                log: logs.join(format!("patroni-{name}.log")),
                pg_port: crate::local::free_port()?,
                rest_port: crate::local::free_port()?,
                agent: Mutex::new(None),
            };
            std::fs::write(
                &node.config,
                config(&node, &dir, &bin, etcd_client, synchronous),
            )?;
            cluster::prepare_dir(&node.data)?;
            nodes.push(node);
        }
        let haproxy_address = SocketAddr::from(([127, 0, 0, 1], crate::local::free_port()?));
        let haproxy_config = root.join("haproxy.cfg");
        std::fs::write(
            &haproxy_config,
            haproxy_config_text(haproxy_address, &nodes),
        )?;
        let haproxy = Command::new("haproxy")
            .arg("-db")
            .arg("-f")
            .arg(&haproxy_config)
            .stdin(Stdio::null())
            .stdout(log_file(&logs.join("haproxy.log"))?)
            .stderr(log_file(&logs.join("haproxy.log"))?)
            .kill_on_drop(true)
            .spawn()
            .context("start haproxy")?;
        let this = Self {
            root: root.to_owned(),
            nodes,
            etcd: Mutex::new(Some(etcd)),
            haproxy: Mutex::new(Some(haproxy)),
            haproxy_address,
            synchronous,
            http: reqwest::Client::builder()
                .no_proxy()
                .timeout(Duration::from_secs(2))
                .build()?,
            ids,
        };
        // The first agent bootstraps the cluster; the second, started once there is a leader,
        // clones it with pg_basebackup.
        this.start_agent(0)?;
        let started = Instant::now();
        while this.leader().await.is_none() {
            if started.elapsed() >= SETUP_WAIT {
                anyhow::bail!(
                    "no Patroni leader after {SETUP_WAIT:?}; {}",
                    this.diagnosis().await
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        this.start_agent(1)?;
        this.wait_healthy(SETUP_WAIT.saturating_sub(started.elapsed()))
            .await?;
        Ok(this)
    }

    /// HAProxy's address: the leader, whichever node that is.
    pub(crate) fn address(&self) -> SocketAddr {
        self.haproxy_address
    }

    pub(crate) fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub(crate) fn synchronous(&self) -> bool {
        self.synchronous
    }

    /// Starts node `i`'s agent (again, after it was killed): it finds its PostgreSQL running or
    /// not, and the lease held by the other node or by nobody, and acts on it (rejoins, rewinds).
    pub(crate) fn start_agent(&self, i: usize) -> anyhow::Result<()> {
        let node = &self.nodes[i];
        let dir = node.config.parent().unwrap_or(&self.root);
        let mut command = Command::new("patroni");
        command
            .arg(&node.config)
            .current_dir(dir)
            .env("HOME", dir)
            .stdin(Stdio::null())
            .stdout(log_file(&node.log)?)
            .stderr(log_file(&node.log)?)
            .kill_on_drop(true);
        if let Some((uid, gid)) = self.ids {
            command.uid(uid).gid(gid);
        }
        let child = command
            .spawn()
            .with_context(|| format!("start {}'s agent", node.name))?;
        *lock(&node.agent) = Some(child);
        Ok(())
    }

    /// SIGKILL of node `i`'s agent: its PostgreSQL goes on (there is no watchdog), and its lease
    /// runs out after the ttl.
    pub(crate) async fn kill_agent(&self, i: usize) -> anyhow::Result<()> {
        let child = lock(&self.nodes[i].agent).take();
        if let Some(mut child) = child {
            child.start_kill()?;
            child.wait().await?;
        }
        Ok(())
    }

    /// The node that answers `/primary` (holds the lease and runs a primary), if one does.
    pub(crate) async fn leader(&self) -> Option<usize> {
        for (i, node) in self.nodes.iter().enumerate() {
            if let Ok(response) = self.http.get(node.rest("/primary")).send().await {
                if response.status().is_success() {
                    return Some(i);
                }
            }
        }
        None
    }

    /// Whether one node leads and the other streams from it (synchronously, in synchronous
    /// mode): the cluster can then lose its leader without losing a commit.
    pub(crate) async fn healthy(&self) -> Option<usize> {
        let leader = self.leader().await?;
        let standby = &self.nodes[1 - leader];
        let path = if self.synchronous {
            "/sync"
        } else {
            "/replica"
        };
        let response = self.http.get(standby.rest(path)).send().await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        // Patroni's answer comes from its `/sync` key, which can name a standby that does not
        // stream yet (after the leader's restart on a new timeline): the leader must see it
        // streaming too.
        let wanted = if self.synchronous { "sync" } else { "async" };
        let mut conn = format!(
            "postgres://postgres@{}/postgres",
            self.nodes[leader].address()
        )
        .parse::<sqlx::postgres::PgConnectOptions>()
        .ok()?
        .connect()
        .await
        .ok()?;
        let streaming: Option<i32> = sqlx::query_scalar(
            "SELECT 1 FROM pg_stat_replication
             WHERE application_name = $1 AND state = 'streaming' AND sync_state = $2",
        )
        .bind(standby.name)
        .bind(wanted)
        .fetch_optional(&mut conn)
        .await
        .ok()?;
        let _ = conn.close().await;
        streaming.map(|_| leader)
    }

    /// Waits until [`Patroni::healthy`], at most `limit`; returns the leader.
    pub(crate) async fn wait_healthy(&self, limit: Duration) -> anyhow::Result<usize> {
        let started = Instant::now();
        loop {
            if let Some(leader) = self.healthy().await {
                return Ok(leader);
            }
            if started.elapsed() >= limit {
                anyhow::bail!(
                    "the Patroni cluster is not healthy (a leader and a streaming {}standby) \
                     after {limit:?}; {}",
                    if self.synchronous { "synchronous " } else { "" },
                    self.diagnosis().await
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// What an unhealthy cluster lacks, for an error: each node's role and state as its agent
    /// reports them (or that it does not answer), and the last lines of its log that say
    /// something went wrong (a port already in use, a failed base backup, …).
    async fn diagnosis(&self) -> String {
        let mut text = String::new();
        for node in &self.nodes {
            let state = match self.http.get(node.rest("/patroni")).send().await {
                Ok(response) => {
                    let text = response.text().await.unwrap_or_default();
                    let body: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
                    format!("role {}, state {}", body["role"], body["state"])
                }
                Err(e) => format!("its agent does not answer ({e})"),
            };
            let log = std::fs::read_to_string(&node.log).unwrap_or_default();
            let trouble: Vec<&str> = log
                .lines()
                .filter(|line| {
                    [
                        "FATAL",
                        "ERROR",
                        "PANIC",
                        "Address already in use",
                        "failed",
                    ]
                    .iter()
                    .any(|word| line.contains(word))
                        && !line.contains("the database system is starting up")
                })
                .collect();
            let last = &trouble[trouble.len().saturating_sub(3)..];
            text.push_str(&format!(
                "{} (PostgreSQL port {}, REST port {}): {state}; last trouble in {}: {:?}. ",
                node.name,
                node.pg_port,
                node.rest_port,
                node.log.display(),
                last
            ));
        }
        text
    }

    /// A planned switchover away from `leader`, through its REST API; Patroni answers once
    /// the other node has taken over. No candidate is named: Patroni takes the synchronous
    /// standby, and refuses (412) while its `/sync` key does not name one yet, which it may
    /// not for a loop or two after the standby streams: asked again meanwhile.
    pub(crate) async fn switchover(&self, leader: usize) -> anyhow::Result<()> {
        let body = format!(r#"{{"leader": "{}"}}"#, self.nodes[leader].name);
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(60))
            .build()?;
        let started = Instant::now();
        loop {
            let response = http
                .post(self.nodes[leader].rest("/switchover"))
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
                .await?;
            let status = response.status();
            let text = response.text().await.unwrap_or_default();
            if status.is_success() {
                return Ok(());
            }
            anyhow::ensure!(
                started.elapsed() < SWITCHOVER_WAIT,
                "switchover: {status} {text}"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Stops everything; deletes the data unless `keep`.
    pub(crate) fn finish(self, keep: bool) {
        let root = self.root.clone();
        drop(self);
        if keep {
            eprintln!(
                "chaos: the run's Patroni cluster is kept, stopped, in {}",
                root.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&root);
        }
    }
}

impl Drop for Patroni {
    fn drop(&mut self) {
        // The agents first, so that none restarts its PostgreSQL; then every postmaster (a
        // child of an agent, or orphaned by a killed one); then HAProxy and etcd.
        for node in &self.nodes {
            if let Some(mut child) = lock(&node.agent).take() {
                let _ = child.start_kill();
            }
        }
        for node in &self.nodes {
            if let Some(pid) = node.postmaster_pid() {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .stderr(Stdio::null())
                    .status();
            }
        }
        for child in [&self.haproxy, &self.etcd] {
            if let Some(mut child) = lock(child).take() {
                let _ = child.start_kill();
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A node's Patroni configuration.
///
/// `synchronous_mode_strict` stays off. With two nodes, strict mode stops every write while the
/// standby is away, which it is after each failover until the old leader has rewound and
/// rejoined. Off, the lone leader goes on, and the cost is availability, not commits: Patroni
/// promotes only a node it recorded as synchronous (the `/sync` key), so while the leader runs
/// alone no failover happens, and a commit it acknowledged is lost only if its disk is lost too,
/// which the harness does not do.
///
/// `use_pg_rewind` with `wal_log_hints`: a killed agent leaves its PostgreSQL running as a
/// primary until the agent comes back (there is no watchdog), so the old leader's timeline has
/// diverged and must be rewound to rejoin; failing that, its data is recloned.
///
/// `maximum_lag_on_failover` is 1 GiB rather than 1 MB. In synchronous mode, lag is WAL no client
/// was told is committed (the synchronous standby has every acknowledged commit), so a lagging
/// synchronous standby must still be promoted. (We saw a synchronous standby refuse once, "not
/// the healthiest node", leaving the cluster leaderless; the lag limit is one of the reasons
/// Patroni gives that answer, and whether it was this one is not established.) In the
/// negative control it makes the loss the one
/// asynchronous replication allows, not one the lag limit happens to catch.
fn config(node: &Node, dir: &Path, bin: &Path, etcd_client: u16, synchronous: bool) -> String {
    let maximum_lag: u64 = 1 << 30;
    format!(
        "scope: chaos
name: {name}
log:
  level: INFO
restapi:
  listen: 127.0.0.1:{rest}
  connect_address: 127.0.0.1:{rest}
etcd3:
  hosts: 127.0.0.1:{etcd_client}
watchdog:
  mode: off
bootstrap:
  dcs:
    ttl: {TTL_SECS}
    loop_wait: {LOOP_WAIT_SECS}
    retry_timeout: {RETRY_TIMEOUT_SECS}
    maximum_lag_on_failover: {maximum_lag}
    synchronous_mode: {synchronous}
    synchronous_mode_strict: false
    postgresql:
      use_pg_rewind: true
      parameters:
        wal_level: replica
        wal_log_hints: 'on'
        hot_standby: 'on'
        max_connections: 200
        max_wal_senders: 10
        max_replication_slots: 10
        fsync: 'on'
        synchronous_commit: 'on'
  initdb:
    - encoding: UTF8
    - auth: trust
postgresql:
  listen: 127.0.0.1:{pg}
  connect_address: 127.0.0.1:{pg}
  data_dir: {data}
  bin_dir: {bin}
  pgpass: {dir}/pgpass
  remove_data_directory_on_rewind_failure: true
  authentication:
    superuser:
      username: postgres
    replication:
      username: postgres
    rewind:
      username: postgres
  parameters:
    unix_socket_directories: '{dir}'
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
",
        name = node.name,
        rest = node.rest_port,
        pg = node.pg_port,
        data = node.data.display(),
        bin = bin.display(),
        dir = dir.display(),
    )
}

/// HAProxy: one TCP listener, to the node whose agent answers `/primary` with 200. Checked every
/// half second, down after two failures; a node marked down has its sessions cut
/// (`on-marked-down shutdown-sessions`), so that no connection stays on a demoted primary.
fn haproxy_config_text(address: SocketAddr, nodes: &[Node]) -> String {
    let mut text = format!(
        "global
    maxconn 2000
defaults
    mode tcp
    timeout connect 2s
    timeout client 30m
    timeout server 30m
    timeout check 1s
listen primary
    bind {address}
    option httpchk GET /primary
    http-check expect status 200
    default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions
"
    );
    for node in nodes {
        text.push_str(&format!(
            "    server {} 127.0.0.1:{} maxconn 500 check port {}\n",
            node.name, node.pg_port, node.rest_port
        ));
    }
    text
}

fn spawn_etcd(root: &Path, logs: &Path, client: u16, peer: u16) -> anyhow::Result<Child> {
    let client_url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    Command::new("etcd")
        .args(["--name", "etcd0", "--data-dir"])
        .arg(root.join("etcd"))
        .args(["--listen-client-urls", &client_url])
        .args(["--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url])
        .args(["--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &format!("etcd0={peer_url}")])
        .stdin(Stdio::null())
        .stdout(log_file(&logs.join("etcd.log"))?)
        .stderr(log_file(&logs.join("etcd.log"))?)
        .kill_on_drop(true)
        .spawn()
        .context("start etcd")
}

fn log_file(path: &Path) -> anyhow::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("open {}", path.display()))
}

/// The `postgres` user's uid and gid.
fn postgres_ids() -> anyhow::Result<(u32, u32)> {
    let id = |flag: &str| -> anyhow::Result<u32> {
        let out = std::process::Command::new("id")
            .args([flag, "postgres"])
            .output()
            .context("run id")?;
        anyhow::ensure!(out.status.success(), "there is no `postgres` user");
        Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
    };
    Ok((id("-u")?, id("-g")?))
}

/// Whether `program` is on PATH.
pub(crate) fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|path| path.is_file())
    })
}
