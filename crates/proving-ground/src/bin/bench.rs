//! `bench`: measures the real stack under load and writes `target/bench/<run>/report.json`.
//! See `scripts/bench.sh`, which builds the release programs first.

use clap::Parser;
use tracing_subscriber::EnvFilter;

/// Measure Rocket Rides under load, against the same booking without idempotency.
#[derive(Debug, Parser)]
#[command(name = "bench", version)]
struct Cli {
    #[command(flatten)]
    args: proving_ground::bench::BenchArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn,sqlx=warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    proving_ground::bench::run_and_print(Cli::parse().args).await
}
