//! Logs: human lines or JSON lines, on stderr, with every line of a request carrying its
//! request id (the `http_request` span that the router opens for each request).

use clap::ValueEnum;
use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event, with the span's fields (the request id) in front.
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `fields`, `target`, and `span` with the
    /// request id, for log shippers.
    Json,
}

/// The filter when `RUST_LOG` is not set: sqlx logs every statement and migration notice at
/// info, which does not belong in the default output.
pub const DEFAULT_FILTER: &str = "info,sqlx=warn";

/// Installs the global subscriber; call once, first thing in `main`.
pub fn init(format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .init(),
    }
}
