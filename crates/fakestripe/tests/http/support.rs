//! A gateway started on ephemeral ports over a test's database, and a client for it.

use fakestripe::{AppState, Faults};
use serde_json::Value;
use sqlx::postgres::PgConnectOptions;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// The secret key most tests use.
pub(crate) const KEY: &str = "sk_test_fakestripe_tests";

/// A running gateway: the Stripe API and the admin API, each on its own port.
pub(crate) struct Gateway {
    pub(crate) base: String,
    pub(crate) admin: String,
    pub(crate) state: AppState,
    pub(crate) http: reqwest::Client,
    stop: Vec<oneshot::Sender<()>>,
}

/// A response, read whole.
#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    pub(crate) headers: reqwest::header::HeaderMap,
    pub(crate) text: String,
}

impl Reply {
    pub(crate) async fn read(response: reqwest::Response) -> Self {
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = response.text().await.expect("read the response body");
        Self {
            status,
            headers,
            text,
        }
    }

    pub(crate) fn json(&self) -> Value {
        serde_json::from_str(&self.text)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.text))
    }

    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("ASCII header"))
    }

    pub(crate) fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// Asserts a Stripe error object of this status and type, and returns its `error` member.
    #[track_caller]
    pub(crate) fn stripe_error(&self, status: u16, kind: &str) -> Value {
        assert_eq!(
            self.status, status,
            "unexpected status, body: {}",
            self.text
        );
        let body = self.json();
        let error = body["error"].clone();
        assert_eq!(error["type"], kind, "unexpected error type: {}", self.text);
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{}",
            self.text
        );
        error
    }
}

/// The body form of an intermediary's answer, as [`Reply::intermediary`] found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IntermediaryForm {
    Html,
    Empty,
}

/// The statuses an intermediary in front of the gateway answers with on its own.
pub(crate) const INTERMEDIARY_STATUSES: [u16; 5] = [400, 404, 502, 503, 504];

impl Reply {
    /// Asserts an intermediary's own answer: one of its statuses, a small HTML page naming the
    /// status or no body at all, and none of the gateway's marks (Stripe's error object,
    /// `Idempotent-Replayed`, `Request-Id`). Returns the body form.
    #[track_caller]
    pub(crate) fn intermediary(&self) -> IntermediaryForm {
        assert!(
            INTERMEDIARY_STATUSES.contains(&self.status),
            "status {} is not an intermediary's: {}",
            self.status,
            self.text
        );
        assert_eq!(self.header("idempotent-replayed"), None);
        assert_eq!(self.header("request-id"), None, "the gateway never saw it");
        if let Ok(body) = serde_json::from_str::<Value>(&self.text) {
            panic!("an intermediary sends no JSON, let alone Stripe's error object: {body}");
        }
        match self.header("content-type") {
            Some("text/html") => {
                let page = self.text.trim();
                assert!(
                    page.starts_with("<html>") && page.ends_with("</html>"),
                    "{page}"
                );
                assert!(page.contains(&self.status.to_string()), "{page}");
                IntermediaryForm::Html
            }
            None => {
                assert_eq!(self.header("content-length"), Some("0"));
                assert!(self.text.is_empty(), "{}", self.text);
                IntermediaryForm::Empty
            }
            Some(other) => panic!("unexpected content-type {other}: {}", self.text),
        }
    }
}

impl Gateway {
    /// Starts a gateway with no faults over the test's database.
    pub(crate) async fn start(options: PgConnectOptions) -> Self {
        Self::start_with(options, Faults::none()).await
    }

    pub(crate) async fn start_with(options: PgConnectOptions, faults: Faults) -> Self {
        let pool = fakestripe::connect_with(options)
            .await
            .expect("connect and migrate");
        let state = AppState::new(pool, faults);
        let mut stop = Vec::new();
        let mut addrs = Vec::new();
        for app in [
            fakestripe::router(state.clone()),
            fakestripe::admin_router(state.clone()),
        ] {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            addrs.push(format!(
                "http://{}",
                listener.local_addr().expect("local addr")
            ));
            let (tx, rx) = oneshot::channel::<()>();
            stop.push(tx);
            tokio::spawn(fakestripe::serve(listener, app, async move {
                let _ = rx.await;
            }));
        }
        let http = reqwest::Client::builder()
            // A bound on a hung test, not a wait: no test expects to reach it.
            .timeout(std::time::Duration::from_secs(60))
            .build()
            .expect("client");
        let admin = addrs.pop().expect("two listeners");
        let base = addrs.pop().expect("two listeners");
        Self {
            base,
            admin,
            state,
            http,
            stop,
        }
    }

    /// Stops both servers and closes the pool, so that the test database can be dropped.
    pub(crate) async fn stop(self) {
        for tx in self.stop {
            let _ = tx.send(());
        }
        self.state.pool().close().await;
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// A form POST with the default key and, optionally, an idempotency key.
    pub(crate) fn post(
        &self,
        path: &str,
        idempotency_key: Option<&str>,
        body: &str,
    ) -> reqwest::RequestBuilder {
        let mut request = self
            .http
            .post(self.url(path))
            .bearer_auth(KEY)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body.to_owned());
        if let Some(key) = idempotency_key {
            request = request.header("idempotency-key", key);
        }
        request
    }

    pub(crate) async fn send_post(
        &self,
        path: &str,
        idempotency_key: Option<&str>,
        body: &str,
    ) -> Reply {
        Reply::read(
            self.post(path, idempotency_key, body)
                .send()
                .await
                .expect("send"),
        )
        .await
    }

    pub(crate) async fn get(&self, path: &str) -> Reply {
        let response = self
            .http
            .get(self.url(path))
            .bearer_auth(KEY)
            .send()
            .await
            .expect("send");
        Reply::read(response).await
    }

    /// Creates a customer with this test token and returns its id.
    pub(crate) async fn customer(&self, source: &str) -> String {
        let reply = self
            .send_post(
                "/v1/customers",
                None,
                &format!("email=rider%40example.com&source={source}"),
            )
            .await;
        assert_eq!(reply.status, 200, "{}", reply.text);
        reply.json()["id"].as_str().expect("customer id").to_owned()
    }

    /// A charge of `amount` cents to `customer`.
    pub(crate) async fn charge(&self, key: Option<&str>, customer: &str, amount: i64) -> Reply {
        let body = format!("amount={amount}&currency=usd&customer={customer}");
        self.send_post("/v1/charges", key, &body).await
    }

    pub(crate) async fn charge_count(&self) -> i64 {
        fakestripe::count_charges(self.state.pool())
            .await
            .expect("count charges")
    }

    /// Sends a JSON body to the admin API.
    pub(crate) async fn admin_send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: &str,
    ) -> Reply {
        let response = self
            .http
            .request(method, format!("{}{path}", self.admin))
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .expect("send to the admin API");
        Reply::read(response).await
    }

    pub(crate) async fn key_rows(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
            .fetch_one(self.state.pool())
            .await
            .expect("count keys")
    }
}

/// The template of the tests that start a [`Gateway`] (`#[testdb::test(template = …)]`): what
/// [`fakestripe::connect_with`] migrates, done once per test binary instead of once per test.
pub(crate) async fn migrated(pool: sqlx::PgPool) {
    let options = pool.connect_options().as_ref().clone();
    let gateway = fakestripe::connect_with(options)
        .await
        .expect("connect and migrate");
    gateway.close().await;
}
