//! The stack under measurement: two fresh databases, the gateway and the service as real
//! processes, and the users whose API keys the load uses.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection};
use tokio::process::{Child, Command};

use crate::local::{free_port, wait_until_answering};

/// The gateway's secret key in the run (any well-shaped key is an account at fakestripe).
const GATEWAY_SECRET_KEY: &str = "sk_test_bench";

/// The programs to run, checked.
#[derive(Debug, Clone)]
pub(crate) struct Programs {
    pub(crate) service: PathBuf,
    pub(crate) gateway: PathBuf,
    /// The service's `--version`.
    pub(crate) service_version: String,
    /// The service has `POST /bench/rides` (its `bench` feature).
    pub(crate) has_baseline: bool,
}

impl Programs {
    /// The given programs, or the ones next to this program; the service's build is read from
    /// its `--version`.
    pub(crate) fn find(service: Option<&Path>, gateway: Option<&Path>) -> anyhow::Result<Self> {
        let beside = |name: &str| -> anyhow::Result<PathBuf> {
            Ok(std::env::current_exe()
                .context("locate this program")?
                .with_file_name(format!("{name}{}", std::env::consts::EXE_SUFFIX)))
        };
        let service = service.map_or_else(|| beside("rocket-rides"), |p| Ok(p.to_owned()))?;
        let gateway = gateway.map_or_else(|| beside("fakestripe"), |p| Ok(p.to_owned()))?;
        anyhow::ensure!(
            gateway.exists(),
            "{} does not exist (build it with `cargo build --release -p fakestripe`, or name it \
             with --gateway-bin)",
            gateway.display()
        );
        let output = std::process::Command::new(&service)
            .arg("--version")
            .output()
            .with_context(|| {
                format!(
                    "run {} (build it with `cargo build --release -p rocket-rides --features \
                     bench`, or name it with --service-bin)",
                    service.display()
                )
            })?;
        let service_version = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        let has_baseline = service_version.contains(rocket_rides::cli::BENCH_MARK);
        if service_version.contains(rocket_rides::cli::FAILPOINTS_MARK) {
            tracing::warn!(
                version = %service_version,
                "the service was built with failpoints: its figures are not a production build's"
            );
        }
        Ok(Self {
            service,
            gateway,
            service_version,
            has_baseline,
        })
    }
}

/// The run's two databases on the server: the service's and the gateway's, apart so that
/// PostgreSQL's per-database statistics tell the service's work from the gateway's.
pub(crate) struct Databases {
    admin: PgConnection,
    pub(crate) service: String,
    pub(crate) gateway: String,
    pub(crate) service_url: String,
    pub(crate) gateway_url: String,
    pub(crate) server: PgConnectOptions,
}

impl Databases {
    pub(crate) async fn create(server_url: &str, run: &str) -> anyhow::Result<Self> {
        let server: PgConnectOptions = server_url.parse().context("parse DATABASE_URL")?;
        let mut admin = server
            .connect()
            .await
            .context("connect to PostgreSQL (DATABASE_URL)")?;
        let service = format!("bench_{run}_service");
        let gateway = format!("bench_{run}_gateway");
        for name in [&service, &gateway] {
            sqlx::query(&format!("CREATE DATABASE {name}"))
                .execute(&mut admin)
                .await
                .with_context(|| format!("create database {name}"))?;
        }
        let url_of = |name: &str| server.clone().database(name).to_url_lossy().to_string();
        Ok(Self {
            service_url: url_of(&service),
            gateway_url: url_of(&gateway),
            admin,
            service,
            gateway,
            server,
        })
    }

    /// The connection to the server's own database, for statistics that span databases.
    pub(crate) fn admin(&mut self) -> &mut PgConnection {
        &mut self.admin
    }

    pub(crate) async fn connect_service(&self) -> anyhow::Result<PgConnection> {
        Ok(self
            .server
            .clone()
            .database(&self.service)
            .connect()
            .await?)
    }

    pub(crate) async fn connect_gateway(&self) -> anyhow::Result<PgConnection> {
        Ok(self
            .server
            .clone()
            .database(&self.gateway)
            .connect()
            .await?)
    }

    /// The service's database through the pooler at `pooler_url` (which forwards every
    /// database name to this server).
    pub(crate) fn service_url_through(&self, pooler_url: &str) -> anyhow::Result<String> {
        let pooler: PgConnectOptions = pooler_url.parse().context("parse the pooler's URL")?;
        Ok(pooler.database(&self.service).to_url_lossy().to_string())
    }

    pub(crate) async fn drop_all(mut self) {
        for name in [&self.service, &self.gateway] {
            let dropped = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                .execute(&mut self.admin)
                .await;
            if let Err(e) = dropped {
                tracing::warn!(database = %name, error = %e, "could not drop");
            }
        }
        let _ = self.admin.close().await;
    }
}

/// A child process that is stopped politely (SIGTERM, then SIGKILL after five seconds).
pub(crate) struct Process {
    child: Child,
    name: &'static str,
}

impl Process {
    fn spawn(
        name: &'static str,
        program: &Path,
        args: &[String],
        env: &[(&str, String)],
        log: &Path,
    ) -> anyhow::Result<Self> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("open {}", log.display()))?;
        let child = Command::new(program)
            .args(args)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .env("RUST_LOG", "warn")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("start {}", program.display()))?;
        Ok(Self { child, name })
    }

    /// The process id, for its CPU time.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    pub(crate) async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(pid) = self.child.id() {
            // SIGTERM through kill(1): the service then closes its connections itself.
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
        }
        match tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await {
            Ok(status) => {
                status.with_context(|| format!("wait for {}", self.name))?;
            }
            Err(_) => {
                tracing::warn!(name = self.name, "did not stop on SIGTERM; killing it");
                self.child.kill().await?;
            }
        }
        Ok(())
    }
}

/// How often a process is started on new ports when it exits before it answers.
const LISTEN_ATTEMPTS: usize = 3;

/// Starts a process that listens on `N` ports picked free, and waits until it answers at the URL
/// that `spawn` returns with it. A port found free can be taken by another socket before the
/// process binds it (the load's own connections draw their ports from the same ephemeral range),
/// and the process then exits: it is started again on new ports, at most [`LISTEN_ATTEMPTS`]
/// times. A process that runs but does not answer is an error at once.
async fn spawn_listening<const N: usize>(
    mut spawn: impl FnMut([u16; N]) -> anyhow::Result<(Process, String)>,
) -> anyhow::Result<(Process, [u16; N])> {
    for attempt in 1..=LISTEN_ATTEMPTS {
        let mut ports = [0; N];
        for port in &mut ports {
            *port = free_port()?;
        }
        let (mut process, probe) = spawn(ports)?;
        // Whichever comes first: the answer, or the process's end (no use waiting for an answer
        // from a process that is gone).
        let status = tokio::select! {
            answered = wait_until_answering(&probe) => return answered.map(|()| (process, ports)),
            status = process.child.wait() => status?,
        };
        anyhow::ensure!(
            attempt < LISTEN_ATTEMPTS,
            "{} exited before answering ({status}), {attempt} times on new ports (see its log)",
            process.name
        );
        tracing::warn!(
            name = process.name,
            attempt,
            %status,
            "exited before answering (see its log); starting it on new ports"
        );
    }
    unreachable!("the last attempt returns")
}

/// One life of the gateway and the service, started together for one measurement.
pub(crate) struct Stack {
    pub(crate) gateway: Process,
    pub(crate) service: Process,
    /// `http://127.0.0.1:port` of the service.
    pub(crate) base: String,
}

impl Stack {
    /// With `pooled`, the URL of the service's database through a PgBouncer in transaction
    /// pooling, the service runs behind it with `DATABASE_POOLER=transaction` (its direct URL as
    /// `MIGRATE_DATABASE_URL`); the gateway always connects directly.
    pub(crate) async fn start(
        programs: &Programs,
        databases: &Databases,
        pooled: Option<&str>,
        logs: &Path,
    ) -> anyhow::Result<Self> {
        let (gateway, gateway_base) = start_gateway(programs, databases, logs).await?;
        let mut env = vec![
            ("STRIPE_API_BASE", gateway_base),
            ("STRIPE_API_KEY", GATEWAY_SECRET_KEY.to_owned()),
        ];
        match pooled {
            Some(url) => env.extend([
                ("DATABASE_URL", url.to_owned()),
                ("DATABASE_POOLER", "transaction".to_owned()),
                ("MIGRATE_DATABASE_URL", databases.service_url.clone()),
            ]),
            None => env.push(("DATABASE_URL", databases.service_url.clone())),
        }
        let log = logs.join(if pooled.is_some() {
            "service-pooled.log"
        } else {
            "service.log"
        });
        let (service, [port]) = spawn_listening(|[port]| {
            let args = [
                "serve".to_owned(),
                "--listen".to_owned(),
                format!("127.0.0.1:{port}"),
                "--metrics-listen".to_owned(),
                "127.0.0.1:0".to_owned(),
            ];
            let service =
                Process::spawn("rocket-rides serve", &programs.service, &args, &env, &log)?;
            Ok((service, format!("http://127.0.0.1:{port}/healthz")))
        })
        .await?;
        let base = format!("http://127.0.0.1:{port}");
        Ok(Self {
            gateway,
            service,
            base,
        })
    }

    pub(crate) async fn stop(self) -> anyhow::Result<()> {
        self.service.stop().await?;
        self.gateway.stop().await
    }
}

async fn start_gateway(
    programs: &Programs,
    databases: &Databases,
    logs: &Path,
) -> anyhow::Result<(Process, String)> {
    let (gateway, [port, _]) = spawn_listening(|[port, admin_port]| {
        let args = [
            "--listen".to_owned(),
            format!("127.0.0.1:{port}"),
            "--admin-listen".to_owned(),
            format!("127.0.0.1:{admin_port}"),
        ];
        let env = [("DATABASE_URL", databases.gateway_url.clone())];
        let gateway = Process::spawn(
            "fakestripe",
            &programs.gateway,
            &args,
            &env,
            &logs.join("gateway.log"),
        )?;
        Ok((gateway, format!("http://127.0.0.1:{admin_port}/faults")))
    })
    .await?;
    Ok((gateway, format!("http://127.0.0.1:{port}")))
}

/// Migrates the service's database and creates `count` users with cards that charge, through
/// the service's own commands (the gateway runs meanwhile). Returns their API keys.
pub(crate) async fn prepare(
    programs: &Programs,
    databases: &Databases,
    count: u32,
    logs: &Path,
) -> anyhow::Result<Vec<String>> {
    let (gateway, gateway_base) = start_gateway(programs, databases, logs).await?;
    let env = [
        ("DATABASE_URL", databases.service_url.clone()),
        ("STRIPE_API_BASE", gateway_base),
        ("STRIPE_API_KEY", GATEWAY_SECRET_KEY.to_owned()),
        ("RUST_LOG", "warn".to_owned()),
    ];
    let run = |args: Vec<String>| {
        let env = env.clone();
        let program = programs.service.clone();
        async move {
            let output = Command::new(&program)
                .args(&args)
                .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
                .output()
                .await
                .with_context(|| format!("run {} {}", program.display(), args.join(" ")))?;
            anyhow::ensure!(
                output.status.success(),
                "{} {} failed: {}",
                program.display(),
                args.join(" "),
                String::from_utf8_lossy(&output.stderr)
            );
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        }
    };
    run(vec!["migrate".to_owned()]).await?;
    let mut keys = Vec::new();
    for i in 0..count {
        let printed = run(vec![
            "users".to_owned(),
            "create".to_owned(),
            "--email".to_owned(),
            format!("rider-{i}@bench.example"),
            "--card".to_owned(),
            "tok_visa".to_owned(),
        ])
        .await?;
        let user: serde_json::Value =
            serde_json::from_str(printed.trim()).context("read `users create`'s output")?;
        let key = user["api_key"]
            .as_str()
            .context("`users create` printed no api_key")?;
        keys.push(key.to_owned());
    }
    gateway.stop().await?;
    Ok(keys)
}
