//! HTTPS: the gateway served over TLS (rustls), so that a client's whole path to a real Stripe,
//! certificate verification included, can be tested against the fake.
//!
//! `fakestripe --tls-cert cert.pem --tls-key key.pem` serves the Stripe API over HTTPS; the admin
//! API stays plain HTTP on its own (private) listener.

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::Error;

/// How long a client has to complete its TLS handshake before the connection is closed: a peer
/// that connects and stays silent must not hold a task forever.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A server configuration from a PEM certificate chain (leaf first) and a PEM private key.
pub fn server_config(cert_pem: &Path, key_pem: &Path) -> Result<Arc<rustls::ServerConfig>, Error> {
    let certs = CertificateDer::pem_file_iter(cert_pem)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            Error::Tls(format!(
                "read certificates from {}: {e}",
                cert_pem.display()
            ))
        })?;
    if certs.is_empty() {
        return Err(Error::Tls(format!(
            "{} holds no PEM certificate",
            cert_pem.display()
        )));
    }
    let key = PrivateKeyDer::from_pem_file(key_pem).map_err(|e| {
        Error::Tls(format!(
            "read the private key from {}: {e}",
            key_pem.display()
        ))
    })?;
    // The provider is named rather than taken from a process-wide default, so that nothing else
    // linked into the process can change it.
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| Error::Tls(format!("TLS protocol versions: {e}")))?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(|e| Error::Tls(format!("certificate and key do not make a server: {e}")))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Serves `app` over HTTPS on `listener` until `shutdown` completes, then lets open connections
/// finish their requests.
pub async fn serve_tls(
    listener: TcpListener,
    app: Router,
    config: Arc<rustls::ServerConfig>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let acceptor = TlsAcceptor::from(config);
    let graceful = GracefulShutdown::new();
    let http = hyper::server::conn::http1::Builder::new();
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                // A failed accept (out of file descriptors, a reset before accept) concerns one
                // connection, not the server.
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let (acceptor, app, http, watcher) = (
            acceptor.clone(),
            app.clone(),
            http.clone(),
            graceful.watcher(),
        );
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            let service = TowerToHyperService::new(app);
            let connection = http.serve_connection(TokioIo::new(tls), service);
            if let Err(e) = watcher.watch(connection).await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    graceful.shutdown().await;
    Ok(())
}
