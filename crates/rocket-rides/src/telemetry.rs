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
///
/// The filter (`RUST_LOG`) is the log's own, not the subscriber's: the library's commit watch
/// ([`idempotency::commit_watch`]) sees sqlx's warnings whatever the log shows.
pub fn init(format: LogFormat) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;

    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let log = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let log = match format {
        LogFormat::Text => log.boxed(),
        LogFormat::Json => log
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .boxed(),
    };
    // The chaos harness's negative control runs a process without it (`no-commit-watch`).
    let sabotaged = crate::failpoints::Failpoints::from_env().is_ok_and(|f| f.no_commit_watch());
    tracing_subscriber::registry()
        .with(log.with_filter(filter))
        .with((!sabotaged).then(idempotency::commit_watch::layer))
        .init();
    if sabotaged {
        tracing::warn!("sabotaged: no commit watch");
    }
}
