//! `chaos`: runs the chaos scenario and exits non-zero when an invariant failed. See
//! `scripts/chaos.sh`, which builds the service with its failpoints first.

use clap::Parser;
use tracing_subscriber::EnvFilter;

/// Break the real Rocket Rides processes on purpose and audit that every invariant held.
#[derive(Debug, Parser)]
#[command(name = "chaos", version)]
struct Cli {
    #[command(flatten)]
    args: proving_ground::chaos::ChaosArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            // The in-process gateway logs every charge; sqlx every statement. Neither belongs in
            // the default output.
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn,fakestripe=warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    proving_ground::chaos::run_and_print(Cli::parse().args).await
}
