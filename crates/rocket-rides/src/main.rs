//! The `rocket-rides` binary: parses the command line, sets up logging, runs.
//!
//! An error ends it with one message on stderr (the error and its causes, on one line) and exit
//! status 1. `main` does not return the error: the standard library would print it with
//! `Debug`, which for an `anyhow::Error` adds a stack backtrace whenever `RUST_BACKTRACE` is
//! set, after a configuration error too, where the message alone says what to fix.

use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = rocket_rides::cli::Cli::parse();
    rocket_rides::telemetry::init(cli.log_format());
    match rocket_rides::cli::run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("Error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
