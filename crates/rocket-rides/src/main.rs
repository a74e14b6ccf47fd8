//! The `rocket-rides` binary: parses the command line, sets up logging, runs.

use clap::Parser;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            // sqlx logs every statement and migration notice at info; the in-process gateway of a chaos
            // run logs every charge. Neither belongs in the default output.
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn,fakestripe=warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    rocket_rides::cli::run(rocket_rides::cli::Cli::parse()).await
}
