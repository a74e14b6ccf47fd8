//! PostgreSQL clusters of the run's own, made from the installed server binaries, so that the
//! harness may crash one (`pg_ctl stop -m immediate`: the next start runs crash recovery) and,
//! with `--failover`, give it a streaming standby to promote.
//!
//! The binaries are the newest `/usr/lib/postgresql/<version>/bin` that has `initdb` and
//! `pg_ctl` (as `scripts/postgres.sh` finds them), else the directory `pg_config --bindir` names.
//! As root, every command runs as the `postgres` user (`initdb` refuses root), and the data
//! directories are theirs.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use tokio::process::Command;

/// How long `pg_ctl` may take to start, stop or promote.
const PG_CTL_WAIT_SECS: &str = "60";

/// One cluster: its data directory, port and log. Dropping it stops its server (a postmaster
/// started by `pg_ctl` is not this process's child and would outlive it).
#[derive(Debug)]
pub(crate) struct Cluster {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    log: PathBuf,
    /// Stopped for good (destroyed, or kept stopped for inspection): nothing left to stop.
    done: bool,
}

/// The oldest server the migrations run on.
const MIN_MAJOR_VERSION: u32 = 15;

/// How a cluster confirms its commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Replication {
    /// No standby.
    None,
    /// A commit returns once the standby named `standby` has flushed it.
    Synchronous,
    /// A commit returns once it is flushed here; the standby follows when it can.
    Asynchronous,
}

/// The `application_name` a standby reports to its primary.
pub(crate) const STANDBY_NAME: &str = "standby";

impl Cluster {
    /// A new cluster in `dir/name`, not started, on a port of its own.
    pub(crate) async fn create(dir: &Path, name: &str) -> anyhow::Result<Self> {
        let cluster = Self::at(dir, name)?;
        prepare_dir(&cluster.data)?;
        run(
            &cluster.bin.join("initdb"),
            &[
                "-D".as_ref(),
                cluster.data.as_os_str(),
                "-A".as_ref(),
                "trust".as_ref(),
                "-U".as_ref(),
                "postgres".as_ref(),
                "--no-sync".as_ref(),
            ],
        )
        .await?;
        // Durable commits (the default, stated) and room for a standby. A synchronous standby is
        // named only once it streams (`Postgres::add_standby`): before, every commit would wait
        // for it.
        cluster.append_conf(&format!(
            "port = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = ''\n\
             fsync = on\nsynchronous_commit = on\nwal_level = replica\nmax_wal_senders = 4\n\
             max_connections = 200\n",
            port = cluster.port
        ))?;
        Ok(cluster)
    }

    /// A standby of `primary` in `dir/name`: a base backup taken through `primary_address`
    /// (a proxy the harness can stall), streaming from there.
    pub(crate) async fn standby_of(
        primary_address: std::net::SocketAddr,
        dir: &Path,
        name: &str,
    ) -> anyhow::Result<Self> {
        let cluster = Self::at(dir, name)?;
        prepare_dir(&cluster.data)?;
        // In clear (the proxy reads the protocol), and with a fast checkpoint: a spread one
        // waits for every dirty buffer, about a minute and a half after CREATE DATABASE.
        let connection = format!(
            "host=127.0.0.1 port={} user=postgres sslmode=disable gssencmode=disable",
            primary_address.port()
        );
        run(
            &cluster.bin.join("pg_basebackup"),
            &[
                "-d".as_ref(),
                connection.as_ref(),
                "-c".as_ref(),
                "fast".as_ref(),
                "-D".as_ref(),
                cluster.data.as_os_str(),
                "-X".as_ref(),
                "stream".as_ref(),
                "-R".as_ref(),
                "--no-sync".as_ref(),
            ],
        )
        .await?;
        cluster.append_conf(&format!(
            "port = {port}\nprimary_conninfo = 'host=127.0.0.1 port={primary} user=postgres \
             application_name={STANDBY_NAME} sslmode=disable gssencmode=disable'\n\
             hot_standby = on\n\
             synchronous_standby_names = ''\n",
            port = cluster.port,
            primary = primary_address.port()
        ))?;
        Ok(cluster)
    }

    fn at(dir: &Path, name: &str) -> anyhow::Result<Self> {
        let bin = server_binaries()?;
        let root = dir.join(name);
        create_reachable_dir(&root)?;
        Ok(Self {
            bin,
            data: root.join("data"),
            port: crate::local::free_port()?,
            log: root.join("server.log"),
            done: false,
        })
    }

    fn append_conf(&self, lines: &str) -> anyhow::Result<()> {
        use std::io::Write;
        let path = self.data.join("postgresql.auto.conf");
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .with_context(|| format!("open {}", path.display()))?;
        file.write_all(lines.as_bytes())?;
        Ok(())
    }

    /// The address its server listens on.
    pub(crate) fn address(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Starts the server and waits until it accepts connections (after crash recovery, if it
    /// crashed).
    pub(crate) async fn start(&self) -> anyhow::Result<()> {
        self.pg_ctl(&["start", "-l", &self.log.to_string_lossy()])
            .await
    }

    /// Kills the server without a checkpoint or a clean shutdown: everything not flushed is
    /// gone, and the next start replays the WAL.
    pub(crate) async fn crash(&self) -> anyhow::Result<()> {
        self.pg_ctl(&["stop", "-m", "immediate"]).await
    }

    /// Turns a standby into a primary.
    pub(crate) async fn promote(&self) -> anyhow::Result<()> {
        self.pg_ctl(&["promote"]).await
    }

    /// Stops the server, if it runs, and deletes its directory.
    pub(crate) async fn destroy(mut self) {
        let _ = self.pg_ctl(&["stop", "-m", "immediate"]).await;
        if let Some(root) = self.data.parent() {
            let _ = std::fs::remove_dir_all(root);
        }
        self.done = true;
    }

    /// Stops the server, if it runs, and keeps its directory for inspection.
    pub(crate) async fn keep(mut self) {
        let _ = self.pg_ctl(&["stop", "-m", "immediate"]).await;
        self.done = true;
    }

    async fn pg_ctl(&self, args: &[&str]) -> anyhow::Result<()> {
        let data = self.data.to_string_lossy();
        let mut all: Vec<&std::ffi::OsStr> = vec!["-D".as_ref(), data.as_ref().as_ref()];
        all.extend(["-w", "-t", PG_CTL_WAIT_SECS].map(std::ffi::OsStr::new));
        all.extend(args.iter().map(std::ffi::OsStr::new));
        run(&self.bin.join("pg_ctl"), &all).await
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // An error left the run early: the server must not outlive it. Blocking, briefly: drop
        // cannot await.
        let data = self.data.to_string_lossy().into_owned();
        let pg_ctl = self.bin.join("pg_ctl");
        let mut command = if is_root() {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&pg_ctl);
            c
        } else {
            std::process::Command::new(&pg_ctl)
        };
        let _ = command
            .args(["-D", &data, "-m", "immediate", "stop"])
            .current_dir("/")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Creates `dir` (and its parents) so that the `postgres` user can reach into it whatever the
/// umask: mode 0755 on every directory this creates.
pub(crate) fn create_reachable_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut missing = Vec::new();
    let mut at = Some(dir);
    while let Some(path) = at.filter(|p| !p.exists()) {
        missing.push(path.to_owned());
        at = path.parent();
    }
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    for path in missing {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}

/// The major version of the server binaries in `bin`, from `postgres --version`.
fn major_version(bin: &Path) -> Option<u32> {
    let out = std::process::Command::new(bin.join("postgres"))
        .arg("--version")
        .output()
        .ok()?;
    // "postgres (PostgreSQL) 15.10 (Debian …)"
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text.split(") ").nth(1)?;
    version
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// The directory of the installed server binaries, 15 or later.
pub(crate) fn server_binaries() -> anyhow::Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|dir| dir.flatten().map(|e| e.path().join("bin")).collect())
        .unwrap_or_default();
    // Newest major version first.
    candidates.sort_by_key(|p| {
        std::cmp::Reverse(
            p.parent()
                .and_then(|v| v.file_name())
                .and_then(|v| v.to_str())
                .and_then(|v| v.parse::<u32>().ok())
                .unwrap_or(0),
        )
    });
    if let Ok(out) = std::process::Command::new("pg_config")
        .arg("--bindir")
        .output()
    {
        if out.status.success() {
            candidates.push(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
        }
    }
    let bin = candidates
        .into_iter()
        .find(|bin| bin.join("initdb").exists() && bin.join("pg_ctl").exists())
        .context(
            "no PostgreSQL server binaries (initdb, pg_ctl) under /usr/lib/postgresql/*/bin or \
             pg_config --bindir: run scripts/postgres.sh --server-binaries, which installs them",
        )?;
    match major_version(&bin) {
        Some(major) if major >= MIN_MAJOR_VERSION => Ok(bin),
        found => anyhow::bail!(
            "the PostgreSQL server binaries in {} are version {found:?}; the migrations need \
             {MIN_MAJOR_VERSION} or later",
            bin.display()
        ),
    }
}

/// Where this user's runs keep their clusters: `/var/tmp/rocket-rides-chaos-<uid>`, a directory
/// the `postgres` user can reach, of this user's own.
pub(crate) fn clusters_dir() -> PathBuf {
    PathBuf::from(format!(
        "/var/tmp/rocket-rides-chaos-{}",
        uid().unwrap_or(0)
    ))
}

fn uid() -> Option<u32> {
    // The effective user of this process, as the kernel reports it.
    std::fs::read_to_string("/proc/self/status")
        .ok()?
        .lines()
        .find(|l| l.starts_with("Uid:"))?
        .split_whitespace()
        .nth(2)?
        .parse()
        .ok()
}

pub(crate) fn is_root() -> bool {
    uid() == Some(0)
}

/// Creates `data` empty, owned by the user the server runs as, mode 0700.
pub(crate) fn prepare_dir(data: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(data).with_context(|| format!("create {}", data.display()))?;
    std::fs::set_permissions(data, std::fs::Permissions::from_mode(0o700))?;
    if is_root() {
        let root = data.parent().unwrap_or(data);
        let status = std::process::Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(root)
            .status()
            .context("chown the cluster's directory to postgres")?;
        anyhow::ensure!(status.success(), "chown {} failed", root.display());
    }
    Ok(())
}

/// Runs a server tool, as `postgres` when we are root, from `/` (the user may not read our
/// working directory); fails with its output.
async fn run(program: &Path, args: &[&std::ffi::OsStr]) -> anyhow::Result<()> {
    let mut command = if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    };
    let output = tokio::time::timeout(
        Duration::from_secs(120),
        command
            .args(args)
            .current_dir("/")
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .with_context(|| format!("{} did not finish in 120 s", program.display()))?
    .with_context(|| format!("run {}", program.display()))?;
    anyhow::ensure!(
        output.status.success(),
        "{} {:?} failed: {}{}",
        program.display(),
        args,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}
