//! Graceful shutdown in two steps.
//!
//! ```text
//!  SIGTERM/SIGINT ──► stopping: take no new work (the listener closes, worker loops end)
//!        │
//!        └── deadline ──► giving up: work still in flight stops where it is and releases
//!                          its lease (fenced), keeping its recovery point, so that a retry or
//!                          the completer resumes it at once instead of after the lease TTL
//! ```

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;

/// How long after "giving up" a server still waits for its connections before it exits anyway.
/// Work in flight has released its leases by then; what is left is idle or slow connections,
/// which must not keep the process alive past its orchestrator's kill timeout.
pub const HARD_STOP_MARGIN: Duration = Duration::from_secs(5);

/// One shutdown step that tasks can wait for. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Signal(watch::Receiver<bool>);

impl Signal {
    /// A signal that never fires (tests, `--once` runs).
    pub fn never() -> Self {
        let (_, rx) = watch::channel(false);
        Self(rx)
    }

    /// Whether it has fired.
    pub fn is_set(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once it has fired.
    pub async fn wait(&mut self) {
        if self.0.wait_for(|fired| *fired).await.is_err() {
            // The sender is gone without firing: this step will never come.
            std::future::pending::<()>().await;
        }
    }
}

/// The two steps of a shutdown, and what triggers them.
#[derive(Debug)]
pub struct Shutdown {
    stopping: watch::Sender<bool>,
    giving_up: watch::Sender<bool>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    /// Neither step has fired.
    pub fn new() -> Self {
        Self {
            stopping: watch::channel(false).0,
            giving_up: watch::channel(false).0,
        }
    }

    /// Fires when new work must no longer be taken.
    pub fn stopping(&self) -> Signal {
        Signal(self.stopping.subscribe())
    }

    /// Fires when work in flight must stop and hand its lease back.
    pub fn giving_up(&self) -> Signal {
        Signal(self.giving_up.subscribe())
    }

    /// Waits for `trigger`, fires "stopping", waits `deadline`, fires "giving up".
    pub async fn run(self, trigger: impl Future<Output = ()>, deadline: Duration) {
        trigger.await;
        tracing::info!(
            ?deadline,
            "shutting down: no new work; in-flight work has until the deadline"
        );
        self.stopping.send_replace(true);
        tokio::time::sleep(deadline).await;
        tracing::warn!("shutdown deadline passed: releasing the leases of unfinished work");
        self.giving_up.send_replace(true);
        // Keep the senders alive: receivers treat a dropped sender as "never".
        std::future::pending::<()>().await;
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn os_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        // Installing a handler fails only if signals cannot be used at all in this process.
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("install the SIGTERM handler");
        tokio::select! {
            _ = interrupt => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}
