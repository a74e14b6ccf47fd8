//! Serving HTTP/1.1 with bounds on what a client can hold: hyper's connection with its timer
//! (the header-read timeout, which also closes idle keep-alive connections), a bounded head, and
//! a bound on open connections that answers the connection past it at once instead of letting
//! it wait.
//!
//! ```text
//!  accept ──permit?──yes──► hyper http1 connection (header-read timeout, 16 KiB head)
//!                  │                    └─► the router (body timeout, deadline, shedding)
//!                  └─no──► 503 problem+json written at once, connection closed
//! ```
//!
//! The router's own bounds (body-read timeout, request deadline, requests in flight) are its
//! layers, in [`crate::app`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::config::{HttpArgs, MAX_HEAD_BYTES};
use crate::metrics::Metrics;
use crate::problem::ApiError;

/// How long to pause after a failed accept (out of file descriptors, say) before the next:
/// without it the loop would spin on the same error.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// How long a refused connection gets to take its 503 before it is closed.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(1);

/// Serves `router` on `listener` until `shutdown` resolves; then stops accepting and waits for
/// the open connections to finish the requests they are in.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: HttpArgs,
    metrics: Metrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(MAX_HEAD_BYTES);
    let connections = Arc::new(Semaphore::new(limits.http_max_connections as usize));
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (tcp, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            metrics.connection_refused();
            tokio::spawn(refuse(tcp));
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let connection = graceful.watch(
            http.serve_connection(TokioIo::new(tcp), TowerToHyperService::new(router.clone())),
        );
        let metrics = metrics.clone();
        tokio::spawn(async move {
            metrics.connection_opened();
            // A connection ends with an error when a client hangs up or times out: its own
            // business, not the server's.
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended");
            }
            metrics.connection_closed();
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Answers a connection past the bound with a 503 problem, at once, and closes it.
async fn refuse(mut tcp: TcpStream) {
    let response = over_capacity_response();
    let _ = tokio::time::timeout(REFUSAL_TIMEOUT, async {
        tcp.write_all(&response).await?;
        tcp.shutdown().await?;
        // Read what the client sent meanwhile, so that closing does not reset the connection
        // before it has read the answer.
        let mut sink = [0u8; 4096];
        while tcp.read(&mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}

/// The raw HTTP/1.1 answer of [`ApiError::OverCapacity`].
fn over_capacity_response() -> Vec<u8> {
    let problem = ApiError::OverCapacity.problem();
    let body = problem.body().to_string();
    let retry_after = crate::config::OVERLOAD_RETRY_AFTER.as_secs();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: {}\r\nretry-after: {retry_after}\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        idempotency_axum::PROBLEM_JSON,
        body.len()
    )
    .into_bytes()
}
