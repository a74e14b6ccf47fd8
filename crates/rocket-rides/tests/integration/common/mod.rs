//! A running Rocket Rides and a running fakestripe, both on loopback, over one fresh database.

#![allow(dead_code, unreachable_pub)]

pub mod front;

use std::sync::Arc;
use std::time::Duration;

use fakestripe::Faults;
use idempotency::{ManualClock, Statements};
use rocket_rides::app::{self, AppState};
use rocket_rides::config::{GatewayArgs, HttpArgs, LeaseArgs};
use serde_json::Value;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// The lease TTL of the service under test.
pub const TTL: Duration = Duration::from_secs(30);

/// A ride body, as a client sends it.
pub const RIDE: &str = r#"{"origin_lat": 37.77, "origin_lon": -122.42, "target_lat": 37.80, "target_lon": -122.27, "amount_cents": 2000}"#;

pub struct TestApp {
    pub base: String,
    /// The metrics listener, apart from the API's, as `serve` runs it by default.
    pub metrics_base: String,
    pub pool: PgPool,
    pub state: AppState,
    pub clock: ManualClock,
    pub gateway: fakestripe::AppState,
    pub http: reqwest::Client,
    /// The front between the service and the gateway, when started with one.
    pub front: Option<front::Front>,
    _stop: Vec<oneshot::Sender<()>>,
}

/// A started server's address and the sender that stops it.
pub async fn spawn(router: axum::Router) -> (String, oneshot::Sender<()>) {
    spawn_with(router, HttpArgs::default()).await
}

/// A started server with these edge limits.
pub async fn spawn_with(router: axum::Router, limits: HttpArgs) -> (String, oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(app::serve(
        listener,
        router,
        limits,
        Default::default(),
        async move {
            let _ = stopped.await;
        },
    ));
    (format!("http://{addr}"), stop)
}

/// A started HTTPS gateway's address and the sender that stops it.
async fn spawn_tls(
    router: axum::Router,
    config: Arc<rustls::ServerConfig>,
) -> (String, oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(fakestripe::serve_tls(
        listener,
        router,
        config,
        async move {
            let _ = stopped.await;
        },
    ));
    (format!("https://{addr}"), stop)
}

/// A private CA and a certificate for 127.0.0.1 signed by it, written as PEM files into a
/// directory of the test's own; and a second, unrelated CA.
pub struct TestPki {
    pub dir: std::path::PathBuf,
    /// The CA that signed the server's certificate.
    pub ca_file: std::path::PathBuf,
    /// A CA that signed nothing here.
    pub other_ca_file: std::path::PathBuf,
    pub server: Arc<rustls::ServerConfig>,
}

impl TestPki {
    pub fn new(name: &str) -> Self {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
        let dir = std::env::temp_dir().join(format!("rocket-rides-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = || {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
        };
        let (ca, other) = (ca(), ca());
        let key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        let file = |name: &str, pem: String| {
            let path = dir.join(name);
            std::fs::write(&path, pem).unwrap();
            path
        };
        let cert = file("cert.pem", leaf.pem());
        let key = file("key.pem", key.serialize_pem());
        Self {
            ca_file: file("ca.pem", ca.pem()),
            other_ca_file: file("other-ca.pem", other.pem()),
            server: fakestripe::server_config(&cert, &key).unwrap(),
            dir,
        }
    }
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The URL of the database behind `pool`: DATABASE_URL's user, password and parameters, with
/// the pool's server (the test server, or a cluster of the test's own) and database.
pub async fn url_of(pool: &PgPool) -> String {
    let name: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(pool)
        .await
        .unwrap();
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL is set for the tests");
    let mut url = reqwest::Url::parse(&base).expect("DATABASE_URL is a URL");
    let options = pool.connect_options();
    // A socket directory is no URL host: such a pool is on DATABASE_URL's own server.
    if !options.get_host().starts_with('/') {
        url.set_host(Some(options.get_host())).unwrap();
        url.set_port(Some(options.get_port())).unwrap();
    }
    url.set_path(&format!("/{name}"));
    url.to_string()
}

/// The template of the tests that start a [`TestApp`] (`#[testdb::test(template = …)]`): what
/// its start migrates (the service's database and the gateway's schema in it), done once per test
/// binary instead of once per test.
pub async fn migrated(pool: PgPool) {
    rocket_rides::db::migrate(&pool).await.unwrap();
    fakestripe::connect(&url_of(&pool).await)
        .await
        .unwrap()
        .close()
        .await;
}

/// The gateway key window of [`TestApp::start_short_limits`]: the floor the settings allow.
pub const SHORT_KEY_WINDOW: Duration = Duration::from_secs(20);
/// The lease heartbeat of [`TestApp::start_short_limits`].
pub const SHORT_HEARTBEAT: Duration = Duration::from_secs(2);

impl TestApp {
    /// Starts both servers over the test's fresh database.
    pub async fn start(pool: PgPool) -> Self {
        Self::start_with(pool, GatewayArgs::default()).await
    }

    pub async fn start_with(pool: PgPool, gateway_args: GatewayArgs) -> Self {
        Self::start_with_lease(
            pool,
            gateway_args,
            LeaseArgs {
                lease_ttl: TTL,
                ..Default::default()
            },
        )
        .await
    }

    /// Starts both servers with the shortest limits the settings allow
    /// ([`SHORT_KEY_WINDOW`] for a 1 s gateway timeout, a 6 s lease renewed every
    /// [`SHORT_HEARTBEAT`], a 3 s processing bound), and makes a rider with a good card;
    /// returns the app, the rider's id and API key.
    pub async fn start_short_limits(pool: PgPool) -> (Self, i64, String) {
        let gateway = GatewayArgs {
            gateway_timeout: Duration::from_secs(1),
            gateway_connect_timeout: Duration::from_secs(1),
            gateway_processing_bound: Duration::from_secs(3),
            gateway_key_window: SHORT_KEY_WINDOW,
            ..Default::default()
        };
        let lease = LeaseArgs {
            lease_ttl: Duration::from_secs(6),
            lease_heartbeat: SHORT_HEARTBEAT,
        };
        let app = Self::start_with_lease(pool, gateway, lease).await;
        let (user_id, api_key) = app.user("rider@example.com", "tok_visa").await;
        (app, user_id, api_key)
    }

    pub async fn start_with_lease(
        pool: PgPool,
        gateway_args: GatewayArgs,
        lease: LeaseArgs,
    ) -> Self {
        Self::start_full(pool, gateway_args, lease, None).await
    }

    /// Starts both servers; with `tls`, fakestripe serves HTTPS with that configuration.
    pub async fn start_full(
        pool: PgPool,
        gateway_args: GatewayArgs,
        lease: LeaseArgs,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> Self {
        Self::start_inner(
            pool,
            gateway_args,
            lease,
            tls,
            HttpArgs::default(),
            false,
            None,
        )
        .await
    }

    /// Starts both servers with a [`front::Front`] between the service and the gateway.
    pub async fn start_fronted(pool: PgPool, gateway_args: GatewayArgs, lease: LeaseArgs) -> Self {
        Self::start_inner(
            pool,
            gateway_args,
            lease,
            None,
            HttpArgs::default(),
            true,
            None,
        )
        .await
    }

    /// The front between the service and the gateway.
    pub fn front(&self) -> &front::Front {
        self.front.as_ref().expect("started with start_fronted")
    }

    /// Starts both servers, the service with these edge limits.
    pub async fn start_with_edge(pool: PgPool, http: HttpArgs) -> Self {
        let lease = LeaseArgs {
            lease_ttl: TTL,
            ..Default::default()
        };
        Self::start_inner(pool, GatewayArgs::default(), lease, None, http, false, None).await
    }

    /// Starts both servers, the service over `service` (a pool on the same database through a
    /// pooler, say) with these statements; the test's `pool` migrates, and the gateway and the
    /// test's own reads use it.
    pub async fn start_through(pool: PgPool, service: PgPool, statements: Statements) -> Self {
        let lease = LeaseArgs {
            lease_ttl: TTL,
            ..Default::default()
        };
        let http = HttpArgs::default();
        let through = Some((service, statements));
        Self::start_inner(
            pool,
            GatewayArgs::default(),
            lease,
            None,
            http,
            false,
            through,
        )
        .await
    }

    async fn start_inner(
        pool: PgPool,
        mut gateway_args: GatewayArgs,
        lease: LeaseArgs,
        tls: Option<Arc<rustls::ServerConfig>>,
        http: HttpArgs,
        fronted: bool,
        through: Option<(PgPool, Statements)>,
    ) -> Self {
        rocket_rides::db::migrate(&pool).await.unwrap();
        let gateway_pool = fakestripe::connect(&url_of(&pool).await).await.unwrap();
        let gateway = fakestripe::AppState::new(gateway_pool, Faults::default());
        let (gateway_base, stop_gateway) = match tls {
            None => spawn(fakestripe::router(gateway.clone())).await,
            Some(config) => spawn_tls(fakestripe::router(gateway.clone()), config).await,
        };

        let front = if fronted {
            Some(front::Front::start(gateway_base.clone()).await)
        } else {
            None
        };
        gateway_args.stripe_api_base = front.as_ref().map_or(gateway_base, |f| f.base.clone());
        let clock = ManualClock::starting_now();
        let (service_pool, statements) = through.unwrap_or((pool.clone(), Statements::Prepared));
        let mut state = AppState::new(service_pool, Arc::new(clock.clone()), &gateway_args, &lease)
            .unwrap()
            .with_statements(statements);
        state.http = http.clone();
        let (base, stop_api) = spawn_with(app::router(state.clone()), http).await;
        let (metrics_base, stop_metrics) = spawn(app::metrics_router(state.clone())).await;
        Self {
            base,
            metrics_base,
            pool,
            state,
            clock,
            gateway,
            http: reqwest::Client::new(),
            front,
            _stop: vec![stop_api, stop_metrics, stop_gateway],
        }
    }

    /// Creates a user through the same code as `rocket-rides users create`; returns (id, api key).
    pub async fn user(&self, email: &str, card: &str) -> (i64, String) {
        // On the service's store: its pool and statements.
        let user =
            rocket_rides::users::create_user_on(&self.state.store, &self.state.stripe, email, card)
                .await
                .unwrap();
        (user.id, user.api_key)
    }

    /// `POST /rides` of [`RIDE`] on a task of its own; with `wait`, as `Prefer: wait=10`.
    pub fn spawn_booking(
        &self,
        api_key: &str,
        key: &str,
        wait: bool,
    ) -> tokio::task::JoinHandle<Reply> {
        let mut request = self
            .http
            .post(format!("{}/rides", self.base))
            .bearer_auth(api_key)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(RIDE);
        if wait {
            request = request.header("prefer", "wait=10");
        }
        tokio::spawn(async move { Reply::read(request.send().await.unwrap()).await })
    }

    /// `POST /rides` with optional API key and idempotency key header values.
    pub async fn post_ride(&self, api_key: Option<&str>, key: Option<&str>, body: &str) -> Reply {
        let mut request = self
            .http
            .post(format!("{}/rides", self.base))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(api_key) = api_key {
            request = request.bearer_auth(api_key);
        }
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        Reply::read(request.send().await.unwrap()).await
    }

    pub async fn get(&self, api_key: &str, path: &str) -> Reply {
        let response = self
            .http
            .get(format!("{}{path}", self.base))
            .bearer_auth(api_key)
            .send()
            .await
            .unwrap();
        Reply::read(response).await
    }

    pub async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(&self.pool).await.unwrap()
    }

    /// [`TestApp::count`] of a statement built at run time.
    pub async fn count_owned(&self, sql: String) -> i64 {
        self.count(&sql).await
    }

    pub async fn rides(&self) -> i64 {
        self.count("SELECT count(*) FROM rides").await
    }

    pub async fn keys(&self) -> i64 {
        self.count("SELECT count(*) FROM idempotency_keys").await
    }

    /// Charges recorded at the gateway.
    pub async fn charges(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM fakestripe.charges")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub fn set_faults(&self, faults: Faults) {
        self.gateway.set_faults(faults);
    }

    /// Claims `key` for `RIDE` directly through the store, as a second holder would.
    pub async fn claim(
        &self,
        user_id: i64,
        key: &str,
    ) -> idempotency::Claim<rocket_rides::booking::RidePoint> {
        let key = idempotency::IdempotencyKey::parse(key.as_bytes()).unwrap();
        let (request, body) = rocket_rides::ride::RideRequest::parse(RIDE.as_bytes()).unwrap();
        let params = serde_json::to_value(request).unwrap();
        let route = rocket_rides::ride::RIDES_ROUTE;
        self.state
            .store
            .claim(idempotency::NewRequest {
                owner: &idempotency::Owner::from(user_id),
                method: "POST",
                route,
                key: &key,
                fingerprint: idempotency::Fingerprint::of_json("POST", route, &body),
                params: &params,
            })
            .await
            .unwrap()
    }

    /// The service's current (moved) time.
    pub fn clock_now(&self) -> time::OffsetDateTime {
        use idempotency::Clock;
        self.clock.now().unwrap()
    }

    /// Moves the service's clock past every lease it has granted.
    pub fn expire_leases(&self) {
        self.clock.advance(TTL + Duration::from_secs(1));
    }

    /// The recovery point of the only key of this user.
    pub async fn key_state(&self, user_id: i64) -> Option<(String, bool)> {
        sqlx::query_as(
            "SELECT recovery_point, locked_until IS NOT NULL FROM idempotency_keys WHERE owner = $1::text",
        )
        .bind(user_id)
        .fetch_optional(&self.pool)
        .await
        .unwrap()
    }

    /// Waits (bounded) until the user's key has reached `point`: the signal that a request in
    /// another task or process is now inside the gateway call.
    pub async fn wait_for_point(&self, user_id: i64, point: &str) {
        testdb::until(
            &format!("the key of user {user_id} reached {point}"),
            Duration::from_secs(10),
            || async {
                self.key_state(user_id)
                    .await
                    .is_some_and(|(p, _)| p == point)
                    .then_some(())
            },
        )
        .await;
    }

    /// `POST /rides` until a final answer, honouring `Retry-After` on 409 and 503, as a client
    /// does; bounded.
    pub async fn post_until_final(&self, api_key: &str, key: &str, body: &str) -> Reply {
        for _ in 0..30 {
            let reply = self.post_ride(Some(api_key), Some(key), body).await;
            if reply.status != 409 && reply.status != 503 {
                return reply;
            }
            let after: u64 = reply.header("retry-after").unwrap().parse().unwrap();
            tokio::time::sleep(Duration::from_secs(after)).await;
        }
        panic!("no final answer for key {key}");
    }

    /// The value of one sample of `GET /metrics` on the metrics listener, such as
    /// `gateway_reconciliations_total{outcome="adopted"}`; 0 when absent.
    pub async fn metric(&self, sample: &str) -> f64 {
        let text = self
            .http
            .get(format!("{}/metrics", self.metrics_base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find_map(|line| line.strip_prefix(sample)?.strip_prefix(' '))
            .map_or(0.0, |v| v.parse().unwrap())
    }

    /// Leaves the key `key`, whose request died after the gateway charged, as earlier versions
    /// left a request that died after recording its charge: the charge on the ride, paid, the
    /// key at `charge_created` with no response stored.
    pub async fn as_left_at_charge_created(&self, key: &str) {
        let recorded = sqlx::query(
            "WITH k AS (SELECT owner, id, request_uuid FROM idempotency_keys
                        WHERE idempotency_key = $1),
                  c AS (SELECT id FROM fakestripe.charges
                        WHERE metadata->>'rocket_rides_request' = (SELECT request_uuid::text FROM k)),
                  r AS (UPDATE rides SET charge_id = (SELECT id FROM c), status = 'paid'
                        WHERE (key_owner, idempotency_key_id) = (SELECT owner, id FROM k)
                        RETURNING id)
             UPDATE idempotency_keys SET recovery_point = 'charge_created'
             WHERE id = (SELECT id FROM k) AND recovery_point = 'ride_created'
               AND (SELECT count(*) FROM r) = 1",
        )
        .bind(key)
        .execute(&self.pool)
        .await
        .unwrap();
        assert_eq!(
            recorded.rows_affected(),
            1,
            "key {key} was not charged at ride_created"
        );
    }

    /// The recovery point of the only key of this user.
    pub async fn recovery_point(&self, user_id: i64) -> String {
        sqlx::query_scalar("SELECT recovery_point FROM idempotency_keys WHERE owner = $1::text")
            .bind(user_id)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

/// A response, read whole.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Vec<u8>,
}

impl Reply {
    pub async fn read(response: reqwest::Response) -> Self {
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.bytes().await.unwrap().to_vec();
        Self {
            status,
            headers,
            body,
        }
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// The problem `type`, for a problem+json answer.
    pub fn problem_type(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        self.json()["type"].as_str().unwrap().to_owned()
    }
}

/// Both servers with a [`front::Front`] between the service and the gateway, default limits and
/// the tests' lease, and one user with a good card: (app, user id, API key).
pub async fn fronted_app(pool: PgPool) -> (TestApp, i64, String) {
    let lease = LeaseArgs {
        lease_ttl: TTL,
        ..Default::default()
    };
    let app = TestApp::start_fronted(pool, GatewayArgs::default(), lease).await;
    let (id, api_key) = app.user("rider@example.com", "tok_visa").await;
    (app, id, api_key)
}

/// The user's only ride: (status, charge id, key generation).
pub async fn ride_state(app: &TestApp, user_id: i64) -> (String, Option<String>, i32) {
    sqlx::query_as("SELECT status, charge_id, charge_generation FROM rides WHERE user_id = $1")
        .bind(user_id)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// The problem `type` of an answer; empty for an answer that is not a problem.
pub fn problem_kind(reply: &Reply) -> String {
    reply.json()["type"].as_str().unwrap_or_default().to_owned()
}

/// The request UUID of the only key of this user.
pub async fn request_uuid(app: &TestApp, user_id: i64) -> String {
    sqlx::query_scalar("SELECT request_uuid::text FROM idempotency_keys WHERE owner = $1::text")
        .bind(user_id)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// Gateway charges whose metadata names this request.
pub async fn charges_of_request(app: &TestApp, request: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM fakestripe.charges
         WHERE metadata->>'rocket_rides_request' = $1 AND status = 'succeeded'",
    )
    .bind(request)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

/// The user's customer id at the gateway.
pub async fn customer(app: &TestApp, user_id: i64) -> String {
    sqlx::query_scalar("SELECT stripe_customer_id FROM users WHERE id = $1")
        .bind(user_id)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// Waits (bounded) until the gateway holds `n` charges.
pub async fn charges_come_to(app: &TestApp, n: i64) {
    testdb::until(
        &format!("the gateway came to {n} charges"),
        Duration::from_secs(10),
        || async { (app.charges().await == n).then_some(()) },
    )
    .await;
}

/// The migrations of `dir` below `below`, recorded in sqlx's table as the oldest bookkeeping did
/// (the crate adopts its own entries from there).
pub async fn run_below(pool: &PgPool, dir: &std::path::Path, below: i64) {
    let copy = std::env::temp_dir().join(format!("rocket-rides-earlier-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let name = entry.unwrap().file_name();
        let version: i64 = name.to_str().unwrap()[..14].parse().unwrap();
        if version < below {
            std::fs::copy(dir.join(&name), copy.join(&name)).unwrap();
        }
    }
    let mut migrator = sqlx::migrate::Migrator::new(copy.as_path()).await.unwrap();
    std::fs::remove_dir_all(&copy).unwrap();
    migrator.set_ignore_missing(true);
    migrator.run(pool).await.unwrap();
}

/// A database as an earlier build left it: the crate's migrations below `crate_below` and the
/// service's below `service_below`, with user 7, a finished key 70 and its paid ride, written as
/// that schema had them (`idempotency_keys.user_id BIGINT`).
pub async fn earlier_database_with_a_paid_ride(
    pool: &PgPool,
    crate_below: i64,
    service_below: i64,
) {
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    run_below(pool, &crates.join("idempotency/migrations"), crate_below).await;
    run_below(pool, &crates.join("rocket-rides/migrations"), service_below).await;
    sqlx::raw_sql(
        "INSERT INTO users (id, email, api_key_hash, stripe_customer_id)
         VALUES (7, 'rider@example.com', decode(repeat('07', 32), 'hex'), 'cus_7');
         INSERT INTO idempotency_keys
             (id, user_id, request_method, request_path, idempotency_key, fingerprint,
              request_params, recovery_point, response_status, response_headers, response_body,
              finished_at)
         VALUES (70, 7, 'POST', '/rides', 'k-1', decode(repeat('00', 32), 'hex'), '{}',
                 'finished', 201, '[]', '\\x7b7d', now());
         INSERT INTO rides (user_id, idempotency_key_id, origin_lat, origin_lon, target_lat,
                            target_lon, amount_cents, charge_id, status)
         VALUES (7, 70, 0, 0, 0, 0, 100, 'ch_1', 'paid');",
    )
    .execute(pool)
    .await
    .unwrap();
}
