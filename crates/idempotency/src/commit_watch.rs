//! Commits that a synchronous standby may not have: seeing PostgreSQL's warning that a wait for
//! synchronous replication was cancelled.
//!
//! With synchronous replication (`synchronous_standby_names`, Patroni's `synchronous_mode`),
//! a `COMMIT` returns once a standby has the transaction, so that a failover keeps it. But a
//! cancel that reaches the backend while it waits (`pg_cancel_backend`, an operator's
//! `Ctrl-C`, a pooler's query timeout) ends the wait, and **the `COMMIT` still reports
//! success**: the transaction is committed locally, and the server only sends a `WARNING`
//! ("canceling wait for synchronous replication due to user request"). A service that answers
//! `201` on that success acknowledges a write the next failover may lose. (A
//! `statement_timeout` does not end the wait: PostgreSQL stops its timer before the commit
//! waits. A connection that is merely dropped ends nothing either: the backend keeps waiting,
//! and the client never saw a success.)
//!
//! sqlx hands such warnings to `tracing` only, as events of the target `sqlx::postgres::notice`,
//! raised while the `COMMIT`'s future is polled. [`CommitWatch`] is a `tracing` layer that
//! catches the one warning while the store commits, and the store then reports the commit as
//! [`Error::CommitUnconfirmed`](crate::Error::CommitUnconfirmed) instead of a success: the
//! outcome is unknown, the application answers like for a lost connection (a `503`, and the
//! key resumes on the retry).
//!
//! Install it in the application's subscriber, next to its own layers:
//!
//! ```
//! use tracing_subscriber::layer::SubscriberExt;
//!
//! let subscriber = tracing_subscriber::registry().with(idempotency::commit_watch::layer());
//! tracing::subscriber::with_default(subscriber, || {
//!     assert!(idempotency::commit_watch::installed());
//! });
//! assert!(!idempotency::commit_watch::installed());
//! ```
//!
//! The layer filters for itself (a per-layer filter on that one target and level), so that it
//! enables no other event: a global filter of the application that silences `sqlx` warnings
//! (`RUST_LOG=sqlx=error` through `EnvFilter` as a global layer) would silence its warning too,
//! so give the application's own filter to its own layer (`fmt_layer.with_filter(filter)`).
//! [`installed`] tells whether the current subscriber has the layer and lets the warning
//! through; a service that runs with a synchronous standby checks it at startup.
//!
//! What it cannot do: a *replay* reads what the primary has, and a key whose final commit's
//! wait was cancelled is finished on the primary at once. A retry that comes before the standby
//! caught up replays an answer the next failover may lose. Clients retry after `Retry-After`;
//! a failover that follows a cancelled wait within that time is the remaining window.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::layer::Layer;

/// The target of sqlx's events for the server's notices and warnings.
const NOTICE_TARGET: &str = "sqlx::postgres::notice";
/// How PostgreSQL's warning begins (its `DETAIL` is not part of sqlx's event).
const CANCELLED_WAIT: &str = "canceling wait for synchronous replication";

thread_local! {
    /// The flag of the commit being polled on this thread, if the store is polling one.
    static WATCHED: RefCell<Option<Arc<AtomicBool>>> = const { RefCell::new(None) };
}

/// The layer that sees PostgreSQL's warning of a cancelled wait for synchronous replication
/// while the store commits. Build it with [`layer`], which filters it to that one event.
#[derive(Debug, Default, Clone, Copy)]
pub struct CommitWatch {
    _private: (),
}

/// [`CommitWatch`] with its own filter: only sqlx's warnings reach it, and it enables no other
/// event. Add it to the application's `tracing_subscriber::registry()`.
pub fn layer<S>() -> impl Layer<S> + Send + Sync + 'static
where
    S: Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    CommitWatch::default().with_filter(filter_fn(|m: &Metadata<'_>| {
        m.target() == NOTICE_TARGET && *m.level() == Level::WARN
    }))
}

/// Whether the current subscriber holds [`CommitWatch`] and lets sqlx's warnings reach it: when
/// it does not, a commit whose wait for the synchronous standby was cancelled reports success.
pub fn installed() -> bool {
    let held = tracing::dispatcher::get_default(|d| d.downcast_ref::<CommitWatch>().is_some());
    held && tracing::enabled!(target: NOTICE_TARGET, Level::WARN)
}

impl<S: Subscriber> Layer<S> for CommitWatch {
    fn on_event(&self, event: &Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if event.metadata().target() != NOTICE_TARGET {
            return;
        }
        let mut message = Message(false);
        event.record(&mut message);
        if message.0 {
            WATCHED.with(|watched| {
                if let Some(flag) = &*watched.borrow() {
                    flag.store(true, Ordering::Relaxed);
                }
            });
        }
    }
}

/// Whether an event's message is the warning of a cancelled wait.
struct Message(bool);

impl Visit for Message {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0 |= value.starts_with(CANCELLED_WAIT);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 |= format!("{value:?}")
                .trim_matches('"')
                .starts_with(CANCELLED_WAIT);
        }
    }
}

/// Runs `commit` and tells whether the server warned, while it ran, that its wait for the
/// synchronous standby was cancelled (seen only with [`CommitWatch`] installed).
pub(crate) async fn watched<F: Future>(commit: F) -> (F::Output, bool) {
    let flag = Arc::new(AtomicBool::new(false));
    let output = Watched {
        inner: std::pin::pin!(commit),
        flag: flag.clone(),
    }
    .await;
    (output, flag.load(Ordering::Relaxed))
}

/// A future that marks this thread as watching `flag` for as long as each of its polls runs:
/// sqlx reads the server's answer, and raises the warning, inside the poll of the commit.
struct Watched<'f, F: Future> {
    inner: Pin<&'f mut F>,
    flag: Arc<AtomicBool>,
}

impl<F: Future> Future for Watched<'_, F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let flag = self.flag.clone();
        let outer = WATCHED.with(|watched| watched.borrow_mut().replace(flag));
        let poll = self.inner.as_mut().poll(cx);
        WATCHED.with(|watched| *watched.borrow_mut() = outer);
        poll
    }
}

#[cfg(test)]
mod tests {
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    fn warn_as_sqlx_does(message: &str) {
        tracing::warn!(target: "sqlx::postgres::notice", message);
    }

    #[tokio::test]
    async fn only_the_warning_raised_inside_the_commit_is_seen() {
        let subscriber = tracing_subscriber::registry().with(layer());
        let _guard = tracing::subscriber::set_default(subscriber);
        let cancelled = "canceling wait for synchronous replication due to user request";

        let ((), seen) = watched(async { warn_as_sqlx_does(cancelled) }).await;
        assert!(seen, "the warning inside the commit is seen");

        let ((), seen) =
            watched(async { warn_as_sqlx_does("there is no transaction in progress") }).await;
        assert!(!seen, "another warning is not that one");

        warn_as_sqlx_does(cancelled);
        let ((), seen) = watched(async {}).await;
        assert!(!seen, "a warning outside the commit is not the commit's");

        let ((), seen) =
            watched(async { tracing::warn!(target: "elsewhere", "{cancelled}") }).await;
        assert!(!seen, "the text under another target is not the server's");
    }

    #[tokio::test]
    async fn without_the_layer_nothing_is_seen_and_installed_says_so() {
        assert!(!installed());
        let cancelled = "canceling wait for synchronous replication due to user request";
        let ((), seen) = watched(async { warn_as_sqlx_does(cancelled) }).await;
        assert!(!seen);

        // A global filter that silences sqlx's warnings silences the watch too: not installed.
        let silenced = tracing_subscriber::registry()
            .with(layer())
            .with(tracing_subscriber::filter::Targets::new().with_target("sqlx", Level::ERROR));
        tracing::subscriber::with_default(silenced, || assert!(!installed()));
    }
}
