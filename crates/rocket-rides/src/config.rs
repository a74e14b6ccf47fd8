//! Settings: every time limit named, defaulted, validated, and checked against the others; and,
//! in a build with the `bench` feature, the benchmark's choice of claim (`BENCH_CLAIM`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use idempotency::Statements;

use crate::auth::cache::MAX_API_KEY_CACHE_TTL;
use crate::stripe::{ClientError, StripeClient, DEFAULT_CONNECT_TIMEOUT, DEFAULT_GATEWAY_TIMEOUT};

/// The largest request body accepted; a ride request is about 120 bytes.
pub const MAX_BODY_BYTES: usize = 16 * 1024;

/// How much longer than the gateway timeout the lease must be: the time of the phase that records
/// the charge after the call returns, with room for a slow database.
pub const LEASE_MARGIN: Duration = Duration::from_secs(5);

/// Where the payment gateway is and how long to wait for it.
#[derive(Debug, Clone, Args)]
pub struct GatewayArgs {
    /// Base URL of the Stripe-compatible API (Stripe itself, or a fakestripe). A live secret key
    /// (`sk_live_…`, `rk_live_…`) is refused over plain http://.
    #[arg(
        long,
        env = "STRIPE_API_BASE",
        default_value = "http://127.0.0.1:12111"
    )]
    pub stripe_api_base: String,
    /// Secret key for the gateway. Its value from the environment is never shown in `--help`.
    #[arg(
        long,
        env = "STRIPE_API_KEY",
        default_value = "sk_test_rocketrides",
        hide_env_values = true,
        hide_default_value = true
    )]
    pub stripe_api_key: String,
    /// TCP connect timeout for the gateway (e.g. 2s, 500ms).
    #[arg(long, env = "GATEWAY_CONNECT_TIMEOUT", value_parser = parse_duration,
          default_value = "2s")]
    pub gateway_connect_timeout: Duration,
    /// Time limit of one gateway call; must stay below the lease TTL minus 5 s.
    #[arg(long, env = "GATEWAY_TIMEOUT", value_parser = parse_duration, default_value = "10s")]
    pub gateway_timeout: Duration,
    /// PEM certificates to trust for the gateway, besides the platform's roots (a gateway or a
    /// proxy behind a private CA).
    #[arg(long, env = "STRIPE_CA_FILE")]
    pub stripe_ca_file: Option<PathBuf>,
    /// How long after a key's first use the gateway is trusted to remember it. A charge resumed
    /// later than this is reconciled first (the customer's charges are listed for one naming the
    /// request) instead of being asked for again under a key the gateway may have forgotten.
    /// Stripe keeps keys for 24 h; keep this below that by more than the gateway timeout.
    /// At least twice (--gateway-timeout + --lease-ttl + --gateway-processing-bound).
    #[arg(long, env = "GATEWAY_KEY_WINDOW", value_parser = parse_duration, default_value = "23h")]
    pub gateway_key_window: Duration,
    /// The longest the gateway may still be working on a request after it was sent, whatever
    /// became of our side of the call (timed out, abandoned, its process paused or killed). A
    /// reconciling list is made only once the last call under the current key is older than
    /// this, so that a charge still being made is not missed and made again. Above
    /// --gateway-timeout.
    #[arg(long, env = "GATEWAY_PROCESSING_BOUND", value_parser = parse_duration,
          default_value = "5m")]
    pub gateway_processing_bound: Duration,
}

impl GatewayArgs {
    /// The gateway client these settings describe: reads `--stripe-ca-file` if given.
    pub fn client(&self) -> Result<StripeClient, ClientError> {
        let pem = match &self.stripe_ca_file {
            None => None,
            Some(path) => {
                let ca_error = |why: String| ClientError::CaFile {
                    path: path.display().to_string(),
                    why,
                };
                let pem = std::fs::read(path).map_err(|e| ca_error(e.to_string()))?;
                let found = reqwest::Certificate::from_pem_bundle(&pem)
                    .map_err(|e| ca_error(format!("not a PEM bundle: {e}")))?;
                if found.is_empty() {
                    return Err(ca_error("holds no PEM certificate".into()));
                }
                Some(pem)
            }
        };
        Ok(StripeClient::new(
            &self.stripe_api_base,
            &self.stripe_api_key,
            self.gateway_connect_timeout,
            self.gateway_timeout,
            pem.as_deref(),
        )?)
    }
}

/// What stands between the service and PostgreSQL (`--database-pooler`): how the service sends
/// its statements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DatabasePooler {
    /// PostgreSQL itself, or a pooler in session mode (PgBouncer's `pool_mode = session`): named
    /// prepared statements, cached per connection, and reads sent alone. The safe default.
    #[default]
    Session,
    /// A pooler in transaction mode (PgBouncer's `pool_mode = transaction`): every statement
    /// unnamed and inside an explicit transaction ([`Statements::Unnamed`]). Migrations need a
    /// direct connection then (`--migrate-database-url`).
    Transaction,
}

impl DatabasePooler {
    /// How the key store, and with it every statement of the service, is sent.
    pub fn statements(self) -> Statements {
        match self {
            Self::Session => Statements::Prepared,
            Self::Transaction => Statements::Unnamed,
        }
    }
}

/// How long Stripe keeps an idempotency key: it may forget it once it is 24 hours old.
pub const STRIPE_KEY_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// Default of `--gateway-key-window`: an hour inside Stripe's retention, so that a key is trusted
/// only while the gateway surely remembers it.
pub const DEFAULT_GATEWAY_KEY_WINDOW: Duration = Duration::from_secs(23 * 3600);

/// Default of `--gateway-processing-bound`: how long the gateway may still be at work on a
/// request we sent. Stripe's own client libraries wait 80 s for an answer by default before
/// they give up; five minutes is well past that, and past any call of ours (the gateway
/// timeout, 10 s). It only delays the rare reconciliation (a key resumed past its window, a
/// refusal or an `idempotency_error` after an attempt of unknown outcome), never a booking.
pub const DEFAULT_GATEWAY_PROCESSING_BOUND: Duration = Duration::from_secs(5 * 60);

/// The shortest `--key-retention`: Stripe keeps idempotency keys for 24 hours, and clients are
/// written to retry within that. A key that expires sooner makes a late retry book and charge
/// again.
pub const MIN_KEY_RETENTION: Duration = STRIPE_KEY_RETENTION;

/// Default of `--key-retention`: twice Stripe's 24 hours, so that a client retrying for as long
/// as Stripe remembers its own keys, and then some, still gets its first answer.
pub const DEFAULT_KEY_RETENTION: Duration = Duration::from_secs(48 * 3600);

/// How long a finished key answers for its request, in `serve`: the API's key store expires a
/// key at read once it finished longer ago than this (the request is then a new one), so the
/// answer to a late retry never depends on when the reaper last ran. The worker's reaper takes
/// the same flag ([`WorkerArgs::key_retention`]); give both processes the same value.
#[derive(Debug, Clone, Args)]
pub struct RetentionArgs {
    /// How long a finished key replays its answer; a retry later than this books a new ride. The
    /// worker's --key-retention must be the same. At least 24h, as long as Stripe keeps its keys.
    #[arg(long, env = "KEY_RETENTION", value_parser = parse_duration, default_value = "48h")]
    pub key_retention: Duration,
}

impl Default for RetentionArgs {
    fn default() -> Self {
        Self {
            key_retention: DEFAULT_KEY_RETENTION,
        }
    }
}

/// `serve`'s API key cache.
#[derive(Debug, Clone, Args)]
pub struct ApiKeyArgs {
    /// How long an API key is trusted after its look-up in the database, per process: a key
    /// rotated away (`users rotate-key`) keeps working at most this long. 0 looks the key up on
    /// every request; at most 60s.
    #[arg(long, env = "API_KEY_CACHE_TTL", value_parser = parse_duration, default_value = "5s")]
    pub api_key_cache_ttl: Duration,
}

/// Checks `--api-key-cache-ttl`.
pub fn validate_api_key_cache_ttl(ttl: Duration) -> Result<(), String> {
    if ttl > MAX_API_KEY_CACHE_TTL {
        return Err(format!(
            "--api-key-cache-ttl ({ttl:?}) must be at most {MAX_API_KEY_CACHE_TTL:?}: a key \
             rotated away keeps working this long"
        ));
    }
    Ok(())
}

/// Checks `--key-retention`, for `serve` and `worker` alike.
pub fn validate_key_retention(retention: Duration) -> Result<(), String> {
    if retention < MIN_KEY_RETENTION {
        return Err(format!(
            "--key-retention ({retention:?}) must be at least 24h, as long as Stripe keeps its \
             keys: a retry after its key expired books and charges again"
        ));
    }
    Ok(())
}

/// The key window's floor: this many times the life of one attempt (the gateway timeout, a
/// lease that may expire after it, and the gateway's processing bound). A call that starts just
/// before the window ends, times out, loses its lease and is taken over lives within one such
/// span; the window leaves room for several, so that a key is reconciled only when it was
/// really left behind, not while its attempts still come and go.
pub const KEY_WINDOW_FLOOR_FACTOR: u32 = 2;

/// The idempotency lease.
#[derive(Debug, Clone, Args)]
pub struct LeaseArgs {
    /// How long a request holds its key before another attempt may take it over.
    #[arg(long, env = "LEASE_TTL", value_parser = parse_duration, default_value = "30s")]
    pub lease_ttl: Duration,
    /// How often a request renews its lease while it waits on the gateway; below lease TTL / 2,
    /// so that one late renewal still leaves the lease alive.
    #[arg(long, env = "LEASE_HEARTBEAT", value_parser = parse_duration, default_value = "10s")]
    pub lease_heartbeat: Duration,
}

/// Default of `--lease-heartbeat`: a third of the default lease TTL.
pub const DEFAULT_LEASE_HEARTBEAT: Duration = Duration::from_secs(10);

/// The HTTP edge: what a client may take of the server before it is cut off or turned away.
///
/// Every limit answers one way a client can hold the server: a connection that never finishes
/// its headers, an idle keep-alive connection, a body that trickles in or never comes, a request
/// that takes too long, too many connections, too many requests at once.
#[derive(Debug, Clone, Args)]
pub struct HttpArgs {
    /// Time a client has to send a request's head (request line and headers). The same time
    /// closes an idle keep-alive connection that sends no next request (hyper applies one
    /// timer to both). At most 60s.
    #[arg(long, env = "HTTP_HEADER_READ_TIMEOUT", value_parser = parse_duration,
          default_value = "10s")]
    pub header_read_timeout: Duration,
    /// Longest wait for the next piece of a request body; a body that trickles in slower, or a
    /// `Content-Length` that is never delivered, ends the request with a 400.
    #[arg(long, env = "HTTP_BODY_READ_TIMEOUT", value_parser = parse_duration,
          default_value = "10s")]
    pub body_read_timeout: Duration,
    /// Longest time to answer one request, its body included; past it the client gets 503 with
    /// `Retry-After` (a booking goes on in its own task and is found by the retry). Must exceed
    /// the gateway timeout plus the admission wait.
    #[arg(long, env = "HTTP_REQUEST_TIMEOUT", value_parser = parse_duration,
          default_value = "30s")]
    pub request_timeout: Duration,
    /// Open connections at most. Past it, a new connection is answered 503 at once and closed,
    /// so that a crowd of idle or slow clients cannot use up the process's file descriptors.
    #[arg(long, env = "HTTP_MAX_CONNECTIONS", default_value_t = 512,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub http_max_connections: u32,
    /// Requests being answered at once at most. Past it, 503 with `Retry-After` at once: work is
    /// shed, never queued without bound.
    #[arg(long, env = "HTTP_MAX_IN_FLIGHT", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub http_max_in_flight: u32,
    /// Requests that use the database (`POST /rides`, `GET /rides/{id}`) admitted at once at
    /// most. Default: --max-connections, the pool's size, or 6 per CPU of this process where
    /// that is fewer (past it, more bookings at once only share the processors, each longer,
    /// for no more bookings per second). A request that finds every slot
    /// taken waits at most --admission-wait, then gets 503 with `Retry-After`; it has written
    /// nothing. A booking gives its slot back while it waits on the gateway (past 20 ms) or on
    /// another request (`Prefer: wait`), and takes one again after, at once and never shed; a
    /// request whose body is still arriving after 20 ms gives it back too, and asks for one
    /// again like a new request once the body is in. A limit at or above --http-max-in-flight
    /// leaves only that bound.
    #[arg(long, env = "ADMISSION_LIMIT",
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub admission_limit: Option<u32>,
    /// Longest wait of a request for an admission slot before it is shed: long enough for a
    /// burst's queue to clear ((clients - limit) / bookings per second), short enough that
    /// past capacity the queue stays short. 0 sheds at once. At most 1s, the `Retry-After` of
    /// a shed.
    #[arg(long, env = "ADMISSION_WAIT", value_parser = parse_duration, default_value = "200ms")]
    pub admission_wait: Duration,
    /// Longest wait for an admission slot within a second of a shed, when the queue stands:
    /// past capacity an admitted request then waits this long at most, not the whole
    /// --admission-wait, and the rest are shed sooner. Below capacity nothing is shed and the
    /// whole wait applies. At most --admission-wait (a longer one is cut to it).
    #[arg(long, env = "ADMISSION_OVERLOAD_WAIT", value_parser = parse_duration,
          default_value = "10ms")]
    pub admission_overload_wait: Duration,
}

/// Default of `--admission-wait` (measured with `bench`'s open loop, docs/performance.md).
pub const DEFAULT_ADMISSION_WAIT: Duration = Duration::from_millis(200);

/// Default of `--admission-overload-wait`, 10 ms: past capacity a slot frees every couple of
/// milliseconds (500 bookings a second on two cores), so a queue of 10 ms still hands every
/// freed slot on at once, and what an admitted booking waits stays small beside its own time
/// (measured with `bench`'s open loop, docs/performance.md: with 12 slots, the 2× p99 was 2.4
/// times the 0.5× p99 with 10 ms, 3.1 times with 25 ms).
pub const DEFAULT_ADMISSION_OVERLOAD_WAIT: Duration = Duration::from_millis(10);

/// The admission gate's slots per CPU of the process when `--admission-limit` is not set and
/// the pool is larger: past about this many requests at once per core, bookings only share the
/// processors (the service's own, and on a small machine the database's and the gateway's),
/// each taking longer, for no more bookings per second. Measured with `bench` on two cores
/// (docs/performance.md): the closed loop of 32 clients booked 409, 501, 527, 513 and 526 a
/// second with 8, 10, 12, 14 and 20 slots; with 12 and the 10 ms overload wait, at twice its
/// capacity the 201s' p99 was 2.3 times the p99 at half of it, against 3.7 times with 20 slots
/// and 25 ms, for as many bookings a second in the closed loop. On a machine of many cores the
/// pool's size is the bound, as before.
pub const ADMISSION_SLOTS_PER_CPU: u32 = 6;

/// The longest `--admission-wait`: a client told by a shed to come back after this long
/// (`Retry-After: 1`) would do better to come back than to wait longer in the queue.
pub const MAX_ADMISSION_WAIT: Duration = OVERLOAD_RETRY_AFTER;

/// How long a client should wait after the server shed its request or connection.
pub const OVERLOAD_RETRY_AFTER: Duration = Duration::from_secs(1);

impl HttpArgs {
    /// The admission gate's slots: `--admission-limit`, or the pool's `max_connections`, or
    /// [`ADMISSION_SLOTS_PER_CPU`] per CPU this process may use where that is fewer.
    pub fn admission_slots(&self, max_connections: u32) -> u32 {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        self.admission_slots_on(max_connections, cpus)
    }

    /// [`HttpArgs::admission_slots`] on a machine of `cpus` processors.
    fn admission_slots_on(&self, max_connections: u32, cpus: usize) -> u32 {
        let per_cpu = u32::try_from(cpus)
            .unwrap_or(u32::MAX)
            .saturating_mul(ADMISSION_SLOTS_PER_CPU);
        self.admission_limit
            .unwrap_or_else(|| max_connections.min(per_cpu))
    }
}

impl Default for HttpArgs {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            http_max_connections: 512,
            http_max_in_flight: 256,
            admission_limit: None,
            admission_wait: DEFAULT_ADMISSION_WAIT,
            admission_overload_wait: DEFAULT_ADMISSION_OVERLOAD_WAIT,
        }
    }
}

/// Checks the edge's limits against each other and against the gateway's.
pub fn validate_http(http: &HttpArgs, gateway: &GatewayArgs) -> Result<(), String> {
    if http.header_read_timeout < Duration::from_millis(100)
        || http.header_read_timeout > Duration::from_secs(60)
    {
        return Err(format!(
            "--header-read-timeout ({:?}) must be between 100ms and 60s",
            http.header_read_timeout
        ));
    }
    if http.body_read_timeout < Duration::from_millis(100) {
        return Err(format!(
            "--body-read-timeout ({:?}) must be at least 100ms",
            http.body_read_timeout
        ));
    }
    if http.admission_wait > MAX_ADMISSION_WAIT {
        return Err(format!(
            "--admission-wait ({:?}) must be at most {MAX_ADMISSION_WAIT:?}: a shed request is \
             told to retry after that long, and a longer wait is a queue",
            http.admission_wait
        ));
    }
    if http.request_timeout <= gateway.gateway_timeout + http.admission_wait {
        return Err(format!(
            "--request-timeout ({:?}) must exceed --gateway-timeout ({:?}) plus --admission-wait \
             ({:?}): a booking may wait for its slot, then on the gateway, within its request",
            http.request_timeout, gateway.gateway_timeout, http.admission_wait
        ));
    }
    Ok(())
}

/// The longest request head (request line and headers) read, in bytes: a larger one is refused
/// with 431 by hyper, so that an unfinished head holds at most this much memory.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;

/// How long `serve` and `worker` let work in flight finish after SIGTERM before giving it up.
#[derive(Debug, Clone, Args)]
pub struct ShutdownArgs {
    /// After SIGTERM/SIGINT, how long in-flight requests may run on; then they release their
    /// leases and stop. Keep it below your orchestrator's kill timeout (Kubernetes: 30 s).
    #[arg(long, env = "SHUTDOWN_DEADLINE", value_parser = parse_duration, default_value = "10s")]
    pub shutdown_deadline: Duration,
}

/// The background loops of `rocket-rides worker`.
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    /// Pause between two completer passes.
    #[arg(long, env = "COMPLETER_INTERVAL", value_parser = parse_duration, default_value = "5s")]
    pub completer_interval: Duration,
    /// How old an unfinished key must be before the completer takes it: longer than the lease
    /// TTL, so that a live client gets the first chance to retry its own request.
    #[arg(long, env = "COMPLETER_GRACE", value_parser = parse_duration, default_value = "60s")]
    pub completer_grace: Duration,
    /// Keys claimed per completer pass.
    #[arg(long, env = "COMPLETER_BATCH", default_value_t = 50,
          value_parser = clap::value_parser!(i64).range(1..=1000))]
    pub completer_batch: i64,
    /// Keys worked at once by one completer.
    #[arg(long, env = "COMPLETER_CONCURRENCY", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub completer_concurrency: u32,
    /// First backoff after a failed completer attempt; doubles with each attempt.
    #[arg(long, env = "COMPLETER_BACKOFF", value_parser = parse_duration, default_value = "5s")]
    pub completer_backoff: Duration,
    /// Longest backoff: a key that keeps failing is still retried at least this often.
    #[arg(long, env = "COMPLETER_BACKOFF_MAX", value_parser = parse_duration,
          default_value = "10m")]
    pub completer_backoff_max: Duration,
    /// Pause between two reaper passes.
    #[arg(long, env = "REAPER_INTERVAL", value_parser = parse_duration, default_value = "1m")]
    pub reaper_interval: Duration,
    /// How long finished keys replay; the reaper deletes them after it, and `serve` answers them
    /// as new requests after it: give `serve` the same value. At least 24h, as long as Stripe
    /// keeps its keys.
    #[arg(long, env = "KEY_RETENTION", value_parser = parse_duration, default_value = "48h")]
    pub key_retention: Duration,
    /// Keys deleted per reaper statement; small enough that no statement holds locks for long.
    #[arg(long, env = "REAPER_BATCH", default_value_t = 1000,
          value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub reaper_batch: i64,
    /// Pause between two outbox drains.
    #[arg(long, env = "DRAIN_INTERVAL", value_parser = parse_duration, default_value = "1s")]
    pub drain_interval: Duration,
    /// Jobs delivered per drain transaction.
    #[arg(long, env = "DRAIN_BATCH", default_value_t = 100,
          value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub drain_batch: i64,
}

impl Default for WorkerArgs {
    fn default() -> Self {
        Self {
            completer_interval: Duration::from_secs(5),
            completer_grace: Duration::from_secs(60),
            completer_batch: 50,
            completer_concurrency: 4,
            completer_backoff: Duration::from_secs(5),
            completer_backoff_max: Duration::from_secs(600),
            reaper_interval: Duration::from_secs(60),
            key_retention: DEFAULT_KEY_RETENTION,
            reaper_batch: 1000,
            drain_interval: Duration::from_secs(1),
            drain_batch: 100,
        }
    }
}

/// Checks the worker's limits against each other and against the lease.
pub fn validate_worker(worker: &WorkerArgs, lease: &LeaseArgs) -> Result<(), String> {
    if worker.completer_grace <= lease.lease_ttl {
        return Err(format!(
            "--completer-grace ({:?}) must exceed --lease-ttl ({:?}): the client's own retry \
             comes first",
            worker.completer_grace, lease.lease_ttl
        ));
    }
    if worker.completer_backoff.is_zero() || worker.completer_backoff > worker.completer_backoff_max
    {
        return Err(format!(
            "--completer-backoff ({:?}) must be above zero and at most --completer-backoff-max ({:?})",
            worker.completer_backoff, worker.completer_backoff_max
        ));
    }
    for (name, value) in [
        ("--completer-interval", worker.completer_interval),
        ("--reaper-interval", worker.reaper_interval),
        ("--drain-interval", worker.drain_interval),
    ] {
        if value < Duration::from_millis(10) {
            return Err(format!("{name} ({value:?}) must be at least 10ms"));
        }
    }
    validate_key_retention(worker.key_retention)
}

/// Checks the shutdown deadline against the gateway: a call in flight at SIGTERM gets its
/// answer and records it, instead of being abandoned to an unknown outcome (which is safe, but
/// holds the key until the gateway's processing bound has passed).
pub fn validate_shutdown(shutdown: &ShutdownArgs, gateway: &GatewayArgs) -> Result<(), String> {
    if shutdown.shutdown_deadline < gateway.gateway_timeout {
        return Err(format!(
            "--shutdown-deadline ({:?}) must be at least --gateway-timeout ({:?}): a gateway call \
             in flight at shutdown must be let finish",
            shutdown.shutdown_deadline, gateway.gateway_timeout
        ));
    }
    Ok(())
}

impl Default for GatewayArgs {
    fn default() -> Self {
        Self {
            stripe_api_base: "http://127.0.0.1:12111".into(),
            stripe_api_key: "sk_test_rocketrides".into(),
            gateway_connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            gateway_timeout: DEFAULT_GATEWAY_TIMEOUT,
            stripe_ca_file: None,
            gateway_key_window: DEFAULT_GATEWAY_KEY_WINDOW,
            gateway_processing_bound: DEFAULT_GATEWAY_PROCESSING_BOUND,
        }
    }
}

impl Default for LeaseArgs {
    fn default() -> Self {
        Self {
            lease_ttl: idempotency::DEFAULT_LEASE_TTL,
            lease_heartbeat: DEFAULT_LEASE_HEARTBEAT,
        }
    }
}

/// Checks the relations between the limits; the message says which one fails and how to fix it.
pub fn validate(gateway: &GatewayArgs, lease: &LeaseArgs) -> Result<(), String> {
    if gateway.gateway_connect_timeout.is_zero() || gateway.gateway_timeout.is_zero() {
        return Err("gateway timeouts must be greater than zero".into());
    }
    if gateway.gateway_connect_timeout > gateway.gateway_timeout {
        return Err(format!(
            "--gateway-connect-timeout ({:?}) must not exceed --gateway-timeout ({:?})",
            gateway.gateway_connect_timeout, gateway.gateway_timeout
        ));
    }
    if lease.lease_ttl < gateway.gateway_timeout + LEASE_MARGIN {
        return Err(format!(
            "--lease-ttl ({:?}) must be at least --gateway-timeout ({:?}) + {:?}: otherwise a lease \
             can expire while its holder still waits on a charge",
            lease.lease_ttl, gateway.gateway_timeout, LEASE_MARGIN
        ));
    }
    if lease.lease_heartbeat.is_zero() || lease.lease_heartbeat * 2 >= lease.lease_ttl {
        return Err(format!(
            "--lease-heartbeat ({:?}) must be above zero and below half of --lease-ttl ({:?})",
            lease.lease_heartbeat, lease.lease_ttl
        ));
    }
    if gateway.gateway_processing_bound <= gateway.gateway_timeout {
        return Err(format!(
            "--gateway-processing-bound ({:?}) must exceed --gateway-timeout ({:?}): the gateway \
             may go on with a request after we stopped waiting for it",
            gateway.gateway_processing_bound, gateway.gateway_timeout
        ));
    }
    let floor = key_window_floor(gateway, lease);
    if gateway.gateway_key_window < floor {
        return Err(format!(
            "--gateway-key-window ({:?}) must be at least {floor:?}: {KEY_WINDOW_FLOOR_FACTOR} \
             times --gateway-timeout ({:?}) + --lease-ttl ({:?}) + --gateway-processing-bound \
             ({:?})",
            gateway.gateway_key_window,
            gateway.gateway_timeout,
            lease.lease_ttl,
            gateway.gateway_processing_bound
        ));
    }
    if gateway.gateway_key_window + gateway.gateway_processing_bound > STRIPE_KEY_RETENTION {
        return Err(format!(
            "--gateway-key-window ({:?}) with --gateway-processing-bound ({:?}) must stay within \
             the gateway's key retention ({:?}): a call made at the window's end must be over \
             before the gateway may forget its key",
            gateway.gateway_key_window, gateway.gateway_processing_bound, STRIPE_KEY_RETENTION
        ));
    }
    let base = gateway.stripe_api_base.to_ascii_lowercase();
    if !base.starts_with("http://") && !base.starts_with("https://") {
        return Err(format!(
            "--stripe-api-base {:?} must be an http:// or https:// URL",
            gateway.stripe_api_base
        ));
    }
    let live = ["sk_live_", "rk_live_"]
        .iter()
        .any(|prefix| gateway.stripe_api_key.starts_with(prefix));
    if live && base.starts_with("http://") {
        // The message names the setting, never the key.
        return Err(format!(
            "--stripe-api-key is a live key and --stripe-api-base {:?} is plain http://: a live \
             key is only ever sent over https://",
            gateway.stripe_api_base
        ));
    }
    Ok(())
}

/// The shortest key window these settings allow (see [`KEY_WINDOW_FLOOR_FACTOR`]).
pub fn key_window_floor(gateway: &GatewayArgs, lease: &LeaseArgs) -> Duration {
    (gateway.gateway_timeout + lease.lease_ttl + gateway.gateway_processing_bound)
        * KEY_WINDOW_FLOOR_FACTOR
}

/// Parses `250ms`, `10s`, `5m`, `2h` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration such as 500ms, 10s, 5m or 2h"))?;
    let unit_millis = match unit {
        "ms" => 1,
        "" | "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return Err(format!("{text:?} has an unknown unit: use ms, s, m or h")),
    };
    number
        .checked_mul(unit_millis)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("{text:?} is too long"))
}

// Here, below both of its readers: the router checks it at start, the booking asks it at every
// claim.
#[cfg(feature = "bench")]
/// Whether `POST /rides` claims its key insert-first (`BENCH_CLAIM=insert-first`) rather than
/// read-first (`read-first`, or unset), read once per process, when the router is built; any
/// other value stops the service there rather than be measured as something it is not.
pub(crate) fn claim_inserts_first() -> bool {
    static INSERT_FIRST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *INSERT_FIRST.get_or_init(|| match std::env::var("BENCH_CLAIM").as_deref() {
        Ok("insert-first") => true,
        Ok("read-first") | Err(_) => false,
        Ok(other) => panic!("BENCH_CLAIM must be insert-first or read-first, not {other:?}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("10d").is_err());
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn lease_must_outlast_the_gateway_timeout() {
        let gateway = GatewayArgs::default();
        assert_eq!(validate(&gateway, &LeaseArgs::default()), Ok(()));
        let short = LeaseArgs {
            lease_ttl: Duration::from_secs(12),
            ..Default::default()
        };
        let err = validate(&gateway, &short).unwrap_err();
        assert!(err.contains("--lease-ttl"), "{err}");
    }

    #[test]
    fn heartbeat_must_be_below_half_the_lease() {
        let lease = LeaseArgs {
            lease_heartbeat: Duration::from_secs(15),
            ..Default::default()
        };
        let err = validate(&GatewayArgs::default(), &lease).unwrap_err();
        assert!(err.contains("--lease-heartbeat"), "{err}");
    }

    #[test]
    fn completer_grace_must_exceed_the_lease() {
        let lease = LeaseArgs::default();
        assert_eq!(validate_worker(&WorkerArgs::default(), &lease), Ok(()));
        let eager = WorkerArgs {
            completer_grace: Duration::from_secs(30),
            ..Default::default()
        };
        let err = validate_worker(&eager, &lease).unwrap_err();
        assert!(err.contains("--completer-grace"), "{err}");
        let short = WorkerArgs {
            key_retention: Duration::from_secs(60),
            ..Default::default()
        };
        assert!(validate_worker(&short, &lease).is_err());
    }

    #[test]
    fn the_key_window_has_a_floor_above_one_attempts_life() {
        let floor = key_window_floor(&GatewayArgs::default(), &LeaseArgs::default());
        assert_eq!(floor, Duration::from_secs(2 * (10 + 30 + 300)));
        let short = GatewayArgs {
            gateway_key_window: floor - Duration::from_millis(1),
            ..Default::default()
        };
        let err = validate(&short, &LeaseArgs::default()).unwrap_err();
        assert!(err.contains("--gateway-key-window"), "{err}");
        assert!(err.contains("--gateway-processing-bound"), "{err}");
        let at_floor = GatewayArgs {
            gateway_key_window: floor,
            ..Default::default()
        };
        assert_eq!(validate(&at_floor, &LeaseArgs::default()), Ok(()));
        // The example: a window of 2 s with a gateway timeout of 1 s.
        let tiny = GatewayArgs {
            gateway_timeout: Duration::from_secs(1),
            gateway_connect_timeout: Duration::from_secs(1),
            gateway_key_window: Duration::from_secs(2),
            gateway_processing_bound: Duration::from_secs(2),
            ..Default::default()
        };
        let lease = LeaseArgs {
            lease_ttl: Duration::from_secs(6),
            lease_heartbeat: Duration::from_secs(2),
        };
        assert!(validate(&tiny, &lease)
            .unwrap_err()
            .contains("--gateway-key-window"));
    }

    #[test]
    fn the_processing_bound_must_exceed_the_gateway_timeout() {
        let bound = GatewayArgs {
            gateway_processing_bound: DEFAULT_GATEWAY_TIMEOUT,
            ..Default::default()
        };
        let err = validate(&bound, &LeaseArgs::default()).unwrap_err();
        assert!(err.contains("--gateway-processing-bound"), "{err}");
    }

    #[test]
    fn a_live_key_is_refused_over_plain_http_and_never_named() {
        for key in ["sk_live_abc123", "rk_live_abc123"] {
            let plain = GatewayArgs {
                stripe_api_key: key.into(),
                ..Default::default()
            };
            let err = validate(&plain, &LeaseArgs::default()).unwrap_err();
            assert!(err.contains("--stripe-api-key"), "{err}");
            assert!(!err.contains("abc123"), "the key is not echoed: {err}");
            let upper = GatewayArgs {
                stripe_api_base: "HTTP://api.example".into(),
                ..plain.clone()
            };
            assert!(validate(&upper, &LeaseArgs::default()).is_err());
            let tls = GatewayArgs {
                stripe_api_base: "https://api.stripe.com".into(),
                ..plain
            };
            assert_eq!(validate(&tls, &LeaseArgs::default()), Ok(()));
        }
    }

    #[test]
    fn the_key_retention_is_at_least_stripes_24_hours() {
        let lease = LeaseArgs::default();
        let day = WorkerArgs {
            key_retention: MIN_KEY_RETENTION,
            ..Default::default()
        };
        assert_eq!(validate_worker(&day, &lease), Ok(()));
        let hour = WorkerArgs {
            key_retention: Duration::from_secs(3600),
            ..Default::default()
        };
        let err = validate_worker(&hour, &lease).unwrap_err();
        assert!(err.contains("--key-retention"), "{err}");
        assert_eq!(validate_key_retention(MIN_KEY_RETENTION), Ok(()));
        assert_eq!(
            validate_key_retention(RetentionArgs::default().key_retention),
            Ok(())
        );
        let err = validate_key_retention(MIN_KEY_RETENTION - Duration::from_secs(1)).unwrap_err();
        assert!(err.contains("--key-retention"), "{err}");
    }

    #[test]
    fn the_shutdown_deadline_lets_a_gateway_call_finish() {
        let gateway = GatewayArgs::default();
        let ok = ShutdownArgs {
            shutdown_deadline: gateway.gateway_timeout,
        };
        assert_eq!(validate_shutdown(&ok, &gateway), Ok(()));
        let short = ShutdownArgs {
            shutdown_deadline: Duration::from_secs(1),
        };
        let err = validate_shutdown(&short, &gateway).unwrap_err();
        assert!(err.contains("--shutdown-deadline"), "{err}");
    }

    #[test]
    fn the_key_window_must_stay_inside_the_gateways_retention() {
        let wide = GatewayArgs {
            gateway_key_window: STRIPE_KEY_RETENTION,
            ..Default::default()
        };
        let err = validate(&wide, &LeaseArgs::default()).unwrap_err();
        assert!(err.contains("--gateway-key-window"), "{err}");
        let zero = GatewayArgs {
            gateway_key_window: Duration::ZERO,
            ..Default::default()
        };
        assert!(validate(&zero, &LeaseArgs::default()).is_err());
    }

    #[test]
    fn the_edges_flags_default_to_its_defaults() {
        #[derive(clap::Parser)]
        struct Edge {
            #[command(flatten)]
            http: HttpArgs,
        }
        let flags = <Edge as clap::Parser>::try_parse_from(["edge"])
            .unwrap()
            .http;
        let defaults = HttpArgs::default();
        assert_eq!(flags.admission_wait, defaults.admission_wait);
        assert_eq!(
            flags.admission_overload_wait,
            defaults.admission_overload_wait
        );
        assert!(defaults.admission_overload_wait < defaults.admission_wait);
    }

    #[test]
    fn the_gates_slots_are_the_pools_or_six_per_cpu_where_fewer_unless_set() {
        let unset = HttpArgs::default();
        // Two cores, a pool of 20: the processors bind first.
        assert_eq!(unset.admission_slots_on(20, 2), 12);
        // Sixteen cores: the pool does.
        assert_eq!(unset.admission_slots_on(20, 16), 20);
        assert_eq!(unset.admission_slots_on(20, 4), 20);
        assert_eq!(unset.admission_slots_on(3, 1), 3);
        // Set, the limit is the operator's, above the pool's size or the processors' too.
        let set = HttpArgs {
            admission_limit: Some(64),
            ..HttpArgs::default()
        };
        assert_eq!(set.admission_slots_on(20, 2), 64);
        assert_eq!(set.admission_slots_on(20, 64), 64);
    }

    #[test]
    fn the_edges_limits_are_checked() {
        let gateway = GatewayArgs::default();
        assert_eq!(validate_http(&HttpArgs::default(), &gateway), Ok(()));
        for (http, flag) in [
            (
                HttpArgs {
                    header_read_timeout: Duration::from_secs(61),
                    ..Default::default()
                },
                "--header-read-timeout",
            ),
            (
                HttpArgs {
                    body_read_timeout: Duration::from_millis(10),
                    ..Default::default()
                },
                "--body-read-timeout",
            ),
            (
                HttpArgs {
                    request_timeout: Duration::from_secs(10),
                    ..Default::default()
                },
                "--request-timeout",
            ),
            (
                // Above the gateway's timeout, but not by the wait at the gate.
                HttpArgs {
                    request_timeout: gateway.gateway_timeout + Duration::from_millis(100),
                    ..Default::default()
                },
                "plus --admission-wait",
            ),
            (
                HttpArgs {
                    admission_wait: Duration::from_millis(1001),
                    ..Default::default()
                },
                "--admission-wait",
            ),
        ] {
            let err = validate_http(&http, &gateway).unwrap_err();
            assert!(err.contains(flag), "{err}");
        }
    }

    #[test]
    fn connect_timeout_must_not_exceed_the_call_timeout() {
        let gateway = GatewayArgs {
            gateway_connect_timeout: Duration::from_secs(11),
            ..Default::default()
        };
        assert!(validate(&gateway, &LeaseArgs::default()).is_err());
    }
}
