//! The Stripe API over HTTPS: a client that trusts the gateway's CA talks to it; one that does
//! not is refused by certificate verification, with the reason in its error.

use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::net::TcpListener;

use crate::support::KEY;

/// A private CA and a certificate for 127.0.0.1 and localhost signed by it, as PEM files.
pub(crate) struct TestPki {
    pub(crate) dir: std::path::PathBuf,
    pub(crate) ca_pem: String,
}

impl TestPki {
    pub(crate) fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("fakestripe-tls-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        ca.distinguished_name
            .push(DnType::CommonName, "fakestripe test CA");
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
        let leaf_key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
            .unwrap()
            .signed_by(&leaf_key, &ca)
            .unwrap();
        std::fs::write(dir.join("cert.pem"), leaf.pem()).unwrap();
        std::fs::write(dir.join("key.pem"), leaf_key.serialize_pem()).unwrap();
        Self {
            dir,
            ca_pem: ca.pem(),
        }
    }
}

#[sqlx::test(migrations = false)]
async fn the_api_serves_https_to_a_client_that_trusts_its_ca_and_only_to_it(
    _: PgPoolOptions,
    options: PgConnectOptions,
) {
    let pki = TestPki::new("serve");
    let config =
        fakestripe::server_config(&pki.dir.join("cert.pem"), &pki.dir.join("key.pem")).unwrap();
    let pool = fakestripe::connect_with(options).await.unwrap();
    let state = fakestripe::AppState::new(pool, fakestripe::Faults::none());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("https://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(fakestripe::serve_tls(
        listener,
        fakestripe::router(state.clone()),
        Arc::clone(&config),
        async move {
            let _ = stopped.await;
        },
    ));

    let trusting = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(pki.ca_pem.as_bytes()).unwrap())
        .build()
        .unwrap();
    let reply = trusting
        .post(format!("{base}/v1/customers"))
        .bearer_auth(KEY)
        .form(&[("email", "tls@example.com"), ("source", "tok_visa")])
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 200);

    let untrusting = reqwest::Client::new();
    let refused = untrusting
        .get(format!("{base}/v1/charges"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap_err();
    let mut chain = refused.to_string();
    let mut source = std::error::Error::source(&refused);
    while let Some(cause) = source {
        chain.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    assert!(chain.contains("invalid peer certificate"), "{chain}");

    let _ = stop.send(());
    server.await.unwrap().unwrap();
    state.pool().close().await;
    let _ = std::fs::remove_dir_all(&pki.dir);
}

#[test]
fn a_missing_or_empty_certificate_file_is_a_clear_error() {
    let pki = TestPki::new("bad");
    let missing = fakestripe::server_config(&pki.dir.join("nope.pem"), &pki.dir.join("key.pem"))
        .unwrap_err()
        .to_string();
    assert!(missing.contains("nope.pem"), "{missing}");
    std::fs::write(pki.dir.join("empty.pem"), "").unwrap();
    let empty = fakestripe::server_config(&pki.dir.join("empty.pem"), &pki.dir.join("key.pem"))
        .unwrap_err()
        .to_string();
    assert!(empty.contains("no PEM certificate"), "{empty}");
    let _ = std::fs::remove_dir_all(&pki.dir);
}
