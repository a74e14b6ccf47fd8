//! The `rocket-rides` binary: parses the command line, sets up logging, runs.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = rocket_rides::cli::Cli::parse();
    rocket_rides::telemetry::init(cli.log_format());
    rocket_rides::cli::run(cli).await
}
