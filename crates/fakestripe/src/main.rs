//! `fakestripe`: the fake payment gateway as a process.
//!
//! ```text
//! fakestripe --listen 127.0.0.1:12111 --admin-listen 127.0.0.1:12112 \
//!            --database-url postgres://… [--drop-after-charge 0.1 …] \
//!            [--tls-cert cert.pem --tls-key key.pem] [--idempotency-key-ttl 24h]
//! ```
//!
//! Every option can also come from the environment (`DATABASE_URL`, `FAKESTRIPE_…`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use fakestripe::{AppState, Faults};
use tokio::net::TcpListener;

#[derive(Debug, Parser)]
#[command(
    name = "fakestripe",
    version,
    about = "A Stripe-compatible fake payment gateway"
)]
struct Cli {
    /// Address of the Stripe API.
    #[arg(long, env = "FAKESTRIPE_LISTEN", default_value = "127.0.0.1:12111")]
    listen: SocketAddr,

    /// Address of the admin API (`/faults`). Keep it private: it changes the gateway's behaviour.
    #[arg(
        long,
        env = "FAKESTRIPE_ADMIN_LISTEN",
        default_value = "127.0.0.1:12112"
    )]
    admin_listen: SocketAddr,

    /// PostgreSQL database; fakestripe keeps its tables in the schema `fakestripe` of it.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,

    /// Serve the Stripe API over HTTPS with this PEM certificate chain (with --tls-key).
    #[arg(long, env = "FAKESTRIPE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,

    /// The PEM private key of --tls-cert.
    #[arg(long, env = "FAKESTRIPE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,

    /// How long an idempotency key is remembered after its request finished (Stripe: 24 hours).
    /// A request sent later with the key runs afresh. Accepts 500ms, 30s, 5m, 24h.
    #[arg(long, env = "FAKESTRIPE_IDEMPOTENCY_KEY_TTL", value_parser = parse_duration,
          default_value = "24h")]
    idempotency_key_ttl: Duration,

    #[command(flatten)]
    faults: FaultArgs,
}

/// The faults at start; `PUT /faults` on the admin API changes them at run time.
#[derive(Debug, clap::Args)]
struct FaultArgs {
    /// Milliseconds added to every charge, while it holds its idempotency key.
    #[arg(long, env = "FAKESTRIPE_LATENCY_MS", default_value_t = 0)]
    latency_ms: u64,

    /// Up to this many more milliseconds per charge, drawn uniformly.
    #[arg(long, env = "FAKESTRIPE_JITTER_MS", default_value_t = 0)]
    jitter_ms: u64,

    /// Probability of a 500 before anything is written.
    #[arg(long, env = "FAKESTRIPE_FAIL_BEFORE_CHARGE", default_value_t = 0.0)]
    fail_before_charge: f64,

    /// Probability of a 500 after the charge is committed.
    #[arg(long, env = "FAKESTRIPE_FAIL_AFTER_CHARGE", default_value_t = 0.0)]
    fail_after_charge: f64,

    /// Probability of a dropped connection after the charge is committed.
    #[arg(long, env = "FAKESTRIPE_DROP_AFTER_CHARGE", default_value_t = 0.0)]
    drop_after_charge: f64,

    /// Probability of a 409 as if the key were in flight, writing nothing.
    #[arg(long, env = "FAKESTRIPE_CONFLICT_IN_FLIGHT", default_value_t = 0.0)]
    conflict_in_flight: f64,

    /// Probability of a 500 stored under the key, without a charge (replayed on every retry).
    #[arg(
        long,
        env = "FAKESTRIPE_STICKY_500_BEFORE_CHARGE",
        default_value_t = 0.0
    )]
    sticky_500_before_charge: f64,

    /// Probability of a charge whose key stores a 500 in its place (replayed on every retry).
    #[arg(
        long,
        env = "FAKESTRIPE_STICKY_500_AFTER_CHARGE",
        default_value_t = 0.0
    )]
    sticky_500_after_charge: f64,

    /// Probability of a charge created `pending`, until settled through the admin API.
    #[arg(long, env = "FAKESTRIPE_PENDING_CHARGES", default_value_t = 0.0)]
    pending_charges: f64,

    /// Probability of an intermediary's own answer (400/404/502/503/504, HTML or empty) in place
    /// of the gateway's, before anything is written.
    #[arg(long, env = "FAKESTRIPE_INTERMEDIARY_BEFORE", default_value_t = 0.0)]
    intermediary_before: f64,

    /// Probability of an intermediary's own answer in place of the response, after the charge is
    /// committed.
    #[arg(long, env = "FAKESTRIPE_INTERMEDIARY_AFTER", default_value_t = 0.0)]
    intermediary_after: f64,

    /// Probability of a 400 `idempotency_error` in place of the replay of a stored charge.
    #[arg(
        long,
        env = "FAKESTRIPE_IDEMPOTENCY_ERROR_ON_REPLAY",
        default_value_t = 0.0
    )]
    idempotency_error_on_replay: f64,

    /// Probability of a charge held `--slow-ms` more while its key is in use.
    #[arg(long, env = "FAKESTRIPE_SLOW_CHARGES", default_value_t = 0.0)]
    slow_charges: f64,

    /// The extra milliseconds of a slow charge.
    #[arg(long, env = "FAKESTRIPE_SLOW_MS", default_value_t = 0)]
    slow_ms: u64,

    /// Probability of a charge held `--stalled-ms` more (past its caller's timeout), then made.
    #[arg(long, env = "FAKESTRIPE_STALLED_CHARGES", default_value_t = 0.0)]
    stalled_charges: f64,

    /// The extra milliseconds of a stalled charge.
    #[arg(long, env = "FAKESTRIPE_STALLED_MS", default_value_t = 0)]
    stalled_ms: u64,

    /// Seed of the fault generator, for reproducible runs.
    #[arg(long, env = "FAKESTRIPE_SEED")]
    seed: Option<u64>,
}

impl From<FaultArgs> for Faults {
    fn from(a: FaultArgs) -> Self {
        Faults {
            latency_ms: a.latency_ms,
            jitter_ms: a.jitter_ms,
            fail_before_charge: a.fail_before_charge,
            fail_after_charge: a.fail_after_charge,
            drop_after_charge: a.drop_after_charge,
            conflict_in_flight: a.conflict_in_flight,
            sticky_500_before_charge: a.sticky_500_before_charge,
            sticky_500_after_charge: a.sticky_500_after_charge,
            pending_charges: a.pending_charges,
            intermediary_before: a.intermediary_before,
            intermediary_after: a.intermediary_after,
            idempotency_error_on_replay: a.idempotency_error_on_replay,
            slow_charges: a.slow_charges,
            slow_ms: a.slow_ms,
            stalled_charges: a.stalled_charges,
            stalled_ms: a.stalled_ms,
            seed: a.seed,
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "fakestripe=info".into()),
        )
        .init();
    let cli = Cli::parse();
    let faults = Faults::from(cli.faults);
    faults.validate().context("invalid fault options")?;

    let tls = match (&cli.tls_cert, &cli.tls_key) {
        (Some(cert), Some(key)) => {
            Some(fakestripe::server_config(cert, key).context("load the TLS certificate")?)
        }
        _ => None,
    };

    let pool = fakestripe::connect(&cli.database_url)
        .await
        .context("prepare the database")?;
    let state = AppState::new(pool, faults);
    tokio::spawn(fakestripe::forget_expired_keys(
        state.clone(),
        cli.idempotency_key_ttl,
    ));
    let api = TcpListener::bind(cli.listen)
        .await
        .with_context(|| format!("listen on {}", cli.listen))?;
    let admin = TcpListener::bind(cli.admin_listen)
        .await
        .with_context(|| format!("listen on {}", cli.admin_listen))?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    tracing::info!(api = %api.local_addr()?, scheme, admin = %admin.local_addr()?, "fakestripe listening");

    let router = fakestripe::router(state.clone());
    let api = async {
        match tls {
            Some(config) => fakestripe::serve_tls(api, router, config, shutdown_signal()).await,
            None => fakestripe::serve(api, router, shutdown_signal()).await,
        }
    };
    let admin = fakestripe::serve(admin, fakestripe::admin_router(state), shutdown_signal());
    let (api, admin) = tokio::join!(api, admin);
    api.context("serve the Stripe API")?;
    admin.context("serve the admin API")?;
    Ok(())
}

/// Completes on Ctrl-C or SIGTERM. Each call waits on its own registration, so both servers
/// see the same signal.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    tracing::info!("shutting down");
}

/// Parses `250ms`, `10s`, `5m`, `2h` or a bare number of seconds.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration such as 500ms, 10s, 5m or 24h"))?;
    let millis = match unit {
        "ms" => 1,
        "" | "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return Err(format!("{text:?} has an unknown unit: use ms, s, m or h")),
    };
    let duration = number
        .checked_mul(millis)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("{text:?} is too long"))?;
    if duration.is_zero() {
        return Err("the window must be longer than zero".into());
    }
    Ok(duration)
}
