//! `fakestripe`: the fake payment gateway as a process.
//!
//! ```text
//! fakestripe --listen 127.0.0.1:12111 --admin-listen 127.0.0.1:12112 \
//!            --database-url postgres://… [--drop-after-charge 0.1 …]
//! ```
//!
//! Every option can also come from the environment (`DATABASE_URL`, `FAKESTRIPE_…`).

use std::net::SocketAddr;

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

    let pool = fakestripe::connect(&cli.database_url)
        .await
        .context("prepare the database")?;
    let state = AppState::new(pool, faults);
    let api = TcpListener::bind(cli.listen)
        .await
        .with_context(|| format!("listen on {}", cli.listen))?;
    let admin = TcpListener::bind(cli.admin_listen)
        .await
        .with_context(|| format!("listen on {}", cli.admin_listen))?;
    tracing::info!(api = %api.local_addr()?, admin = %admin.local_addr()?, "fakestripe listening");

    let api = fakestripe::serve(api, fakestripe::router(state.clone()), shutdown_signal());
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
