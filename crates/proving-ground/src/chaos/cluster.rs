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

/// One cluster: its data directory, port and log.
#[derive(Debug)]
pub(crate) struct Cluster {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    log: PathBuf,
}

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
        let port = primary_address.port().to_string();
        run(
            &cluster.bin.join("pg_basebackup"),
            &[
                "-h".as_ref(),
                "127.0.0.1".as_ref(),
                "-p".as_ref(),
                port.as_ref(),
                "-U".as_ref(),
                "postgres".as_ref(),
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
             application_name={STANDBY_NAME}'\nhot_standby = on\n\
             synchronous_standby_names = ''\n",
            port = cluster.port,
            primary = primary_address.port()
        ))?;
        Ok(cluster)
    }

    fn at(dir: &Path, name: &str) -> anyhow::Result<Self> {
        let root = dir.join(name);
        std::fs::create_dir_all(&root).with_context(|| format!("create {}", root.display()))?;
        Ok(Self {
            bin: server_binaries()?,
            data: root.join("data"),
            port: crate::local::free_port()?,
            log: root.join("server.log"),
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
    pub(crate) async fn destroy(self) {
        let _ = self.pg_ctl(&["stop", "-m", "immediate"]).await;
        if let Some(root) = self.data.parent() {
            let _ = std::fs::remove_dir_all(root);
        }
    }

    async fn pg_ctl(&self, args: &[&str]) -> anyhow::Result<()> {
        let data = self.data.to_string_lossy();
        let mut all: Vec<&std::ffi::OsStr> = vec!["-D".as_ref(), data.as_ref().as_ref()];
        all.extend(["-w", "-t", PG_CTL_WAIT_SECS].map(std::ffi::OsStr::new));
        all.extend(args.iter().map(std::ffi::OsStr::new));
        run(&self.bin.join("pg_ctl"), &all).await
    }
}

/// The directory of the installed server binaries.
fn server_binaries() -> anyhow::Result<PathBuf> {
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
    candidates
        .into_iter()
        .find(|bin| bin.join("initdb").exists() && bin.join("pg_ctl").exists())
        .context(
            "no PostgreSQL server binaries (initdb, pg_ctl) under /usr/lib/postgresql/*/bin or \
             pg_config --bindir: run scripts/postgres.sh, which installs them",
        )
}

fn is_root() -> bool {
    // The effective user of this process, as the kernel reports it.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|uid| uid == "0"))
        })
        .unwrap_or(false)
}

/// Creates `data` empty, owned by the user the server runs as, mode 0700.
fn prepare_dir(data: &Path) -> anyhow::Result<()> {
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
