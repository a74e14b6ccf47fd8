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
//! catches a warning while the store commits (any warning: the server translates its text, and a
//! commit sends no other), and the store then reports the commit as
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
//! through, and [`check`] refuses a pool whose `client_min_messages` keeps the server from
//! sending warnings at all: a service checks both at startup.
//!
//! What it cannot do: a *replay* reads what the primary has, and a key whose final commit's
//! wait was cancelled is finished on the primary at once. A retry that comes before the standby
//! caught up replays an answer the next failover may lose: waits are cancelled when the standby
//! is away, so the window lasts until it is back.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::layer::Layer;

/// The target of sqlx's events for the server's notices and warnings.
const NOTICE_TARGET: &str = "sqlx::postgres::notice";

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
        // Any warning of the server while the store commits, not only the English text: the
        // server translates it (`lc_messages`), and a commit sends no other warning. A false
        // alarm costs a 503 and a resumed key; a missed one, a write a failover may lose.
        let metadata = event.metadata();
        if metadata.target() == NOTICE_TARGET && *metadata.level() == Level::WARN {
            WATCHED.with(|watched| {
                if let Some(flag) = &*watched.borrow() {
                    flag.store(true, Ordering::Relaxed);
                }
            });
        }
    }
}

/// Refuses a connection on which the server's warning of a cancelled wait cannot reach the
/// commit watch: the watch not in the current subscriber ([`installed`]), or
/// `client_min_messages` above `warning` (set for the role, the database or in the URL's
/// `options`), which keeps the server from sending warnings at all. Call it at startup, on the
/// pool the store writes through: every connection of a pool gets the same settings.
pub async fn check(pool: &sqlx::PgPool) -> Result<(), crate::Error> {
    if !installed() {
        return Err(crate::Error::InvalidConfig(
            "the commit watch is not in the current tracing subscriber (add \
             idempotency::commit_watch::layer() to it, with the log's filter on the log's own \
             layer): a commit whose wait for a synchronous standby was cancelled would be taken \
             for a success"
                .into(),
        ));
    }
    // Unnamed and inside a transaction, so that it works behind a pooler in transaction mode,
    // which may hand the statement's parse and its execution to different server connections
    // otherwise.
    const READ: &str = "read client_min_messages";
    let mut tx = pool.begin().await.map_err(crate::Error::db(READ))?;
    let level: String = sqlx::query_scalar("SELECT current_setting('client_min_messages')")
        .persistent(false)
        .fetch_one(&mut *tx)
        .await
        .map_err(crate::Error::db(READ))?;
    tx.commit().await.map_err(crate::Error::db(READ))?;
    if matches!(level.as_str(), "error" | "fatal" | "panic") {
        return Err(crate::Error::InvalidConfig(format!(
            "client_min_messages is {level:?} on the store's connections: the server then sends \
             no warning, and a commit whose wait for a synchronous standby was cancelled would \
             be taken for a success; set it to warning or lower for the service's role"
        )));
    }
    Ok(())
}

/// Commits an application's own transaction (one that is not a phase of the store's) under the
/// watch: [`crate::Error::CommitUnconfirmed`] when the server warned that the commit's wait for
/// the synchronous standby was cancelled, so that a write a failover may lose (a revoked
/// credential, a limit lowered) is not reported done. The outcome is then unknown: tell the
/// caller so, and let it run the write again.
/// The store's phases commit through it too.
pub async fn commit(
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
    context: impl Into<String>,
) -> Result<(), crate::Error> {
    let context = context.into();
    let (committed, cancelled) = watched(tx.commit()).await;
    committed.map_err(crate::Error::db(context.clone()))?;
    unless_cancelled(cancelled, context)
}

/// The answer of a write that committed on its own (an autocommit statement), given whether
/// the server reported its wait for the synchronous standby cancelled.
pub(crate) fn unless_cancelled(cancelled: bool, context: String) -> Result<(), crate::Error> {
    if cancelled {
        return Err(crate::Error::CommitUnconfirmed { context });
    }
    Ok(())
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
        let _restore = Restore(WATCHED.with(|watched| watched.borrow_mut().replace(flag)));
        self.inner.as_mut().poll(cx)
    }
}

/// Puts back the flag that was watched before a poll, when the poll ends (or unwinds).
struct Restore(Option<Arc<AtomicBool>>);

impl Drop for Restore {
    fn drop(&mut self) {
        let outer = self.0.take();
        WATCHED.with(|watched| *watched.borrow_mut() = outer);
    }
}

#[cfg(test)]
mod tests {
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    /// Whether `future` panicked when polled.
    async fn futures_unwind<F: Future + std::panic::UnwindSafe>(future: F) -> bool {
        let mut future = std::pin::pin!(future);
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = future.as_mut().poll(&mut cx);
        }))
        .is_err()
    }

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

        // Translated (`lc_messages = 'de_DE.UTF-8'`), it is still the server's warning.
        let german = "storniere Warten auf synchrone Replikation wegen Benutzeraufforderung";
        let ((), seen) = watched(async { warn_as_sqlx_does(german) }).await;
        assert!(seen, "a translated warning is seen");

        let ((), seen) = watched(async {
            tracing::info!(target: "sqlx::postgres::notice", message = "a notice")
        })
        .await;
        assert!(!seen, "a notice is no warning");

        warn_as_sqlx_does(cancelled);
        let ((), seen) = watched(async {}).await;
        assert!(!seen, "a warning outside the commit is not the commit's");

        let ((), seen) =
            watched(async { tracing::warn!(target: "elsewhere", "{cancelled}") }).await;
        assert!(!seen, "the text under another target is not the server's");

        // A commit watched inside another: the warning is the inner one's only.
        let (((), inner), outer) = watched(watched(async { warn_as_sqlx_does(cancelled) })).await;
        assert!(inner && !outer);

        // A poll that unwinds leaves no flag behind.
        let unwound = std::panic::AssertUnwindSafe(watched(async { panic!("in the commit") }));
        assert!(futures_unwind(unwound).await);
        assert!(WATCHED.with(|w| w.borrow().is_none()));
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
