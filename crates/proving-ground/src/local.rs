//! What both programs need to run processes on loopback: a free port, and waiting for a process
//! to answer.

use std::time::Duration;

/// A port the OS reports free on 127.0.0.1. The short window before a child binds it is harmless
/// on a machine where nothing else races for loopback ports.
pub(crate) fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Waits, for at most ten seconds, until `url` answers with a success status.
pub(crate) async fn wait_until_answering(url: &str) -> anyhow::Result<()> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(1))
        .build()?;
    for _ in 0..200 {
        if let Ok(response) = http.get(url).send().await {
            if response.status().is_success() {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("{url} did not answer within 10 s (see the process's log)")
}
