//! The clients: each request gets a fresh key and is retried with that same key, with exponential
//! backoff and jitter, honouring `Retry-After`, until it has a final answer or its time is up.
//! Everything a client received is kept for the auditor.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::recorder::Recorder;

/// One user of the run.
#[derive(Debug, Clone)]
pub(crate) struct ClientUser {
    pub id: i64,
    pub api_key: String,
    pub declines: bool,
}

/// `count` users of a kind of their own, with good cards (`{prefix}{i}@chaos.example`), and
/// their customers at the gateway: for requests whose gateway faults a script chooses, so that
/// the script strikes nobody else.
pub(crate) async fn dedicated_users(
    pool: &sqlx::PgPool,
    stripe: &rocket_rides::stripe::StripeClient,
    prefix: &str,
    count: usize,
) -> anyhow::Result<Vec<(ClientUser, String)>> {
    let mut users = Vec::with_capacity(count);
    for i in 0..count {
        let email = format!("{prefix}{i}@chaos.example");
        let user = rocket_rides::users::create_user(pool, stripe, &email, "tok_visa").await?;
        let customer = user.stripe_customer_id.clone();
        let client = ClientUser {
            id: user.id,
            api_key: user.api_key,
            declines: false,
        };
        users.push((client, customer));
    }
    Ok(users)
}

/// A request's log before its first attempt.
pub(crate) fn new_log(
    user: ClientUser,
    key: String,
    amount_cents: i64,
    body: String,
) -> RequestLog {
    RequestLog {
        user,
        key,
        amount_cents,
        body,
        answers: Vec::new(),
        late: None,
        swapped: None,
        final_status: None,
        latency_ms: 0.0,
    }
}

/// Sends the request's next attempt and keeps its answer in the log, counted by the recorder;
/// returns the `Retry-After` asked for, and whether the answer is final (then also kept as the
/// log's final status).
pub(crate) async fn attempt(
    http: &reqwest::Client,
    target: SocketAddr,
    recorder: &Recorder,
    log: &mut RequestLog,
) -> (Option<Duration>, bool) {
    let (mut answer, retry_after) =
        send(http, target, &log.user.api_key, &log.key, &log.body).await;
    answer.second = recorder.second();
    recorder.response(
        &answer
            .status
            .map_or_else(|| "transport_error".to_owned(), |s| s.to_string()),
    );
    let status = answer.status;
    // Final answers, and client errors that no retry can change. A 502 is final only as the
    // service's stored refusal (payment-refused); another 502 (a proxy's) invites a retry.
    let refused = is_payment_refused(&answer);
    log.answers.push(answer);
    match status {
        Some(s) if refused || !matches!(s, 409 | 500..=599) => {
            log.final_status = Some(s);
            (retry_after, true)
        }
        _ => (retry_after, false),
    }
}

/// One answer, as the client got it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Answer {
    /// `None`: no HTTP answer (connection refused, reset, timed out, body cut off).
    pub status: Option<u16>,
    pub replayed: bool,
    /// What a replay must repeat; kept for final answers (201, 402, 502) only.
    pub body: Option<Vec<u8>>,
    pub location: Option<String>,
    pub content_type: Option<String>,
    /// When it came, in seconds of the run (see [`Recorder::second`]); 0 after the run.
    pub second: u32,
    /// A problem of type `over-capacity`: the service shed the request before doing anything.
    pub over_capacity: bool,
}

/// One request and everything that happened to it.
#[derive(Debug, Clone)]
pub(crate) struct RequestLog {
    pub user: ClientUser,
    pub key: String,
    pub amount_cents: i64,
    /// The exact body sent, for the verification replay.
    pub body: String,
    pub answers: Vec<Answer>,
    /// The answer to the same request asked once more after the run (see [`verify`]).
    pub late: Option<Answer>,
    /// The answer to the same key with another amount, for a sample of requests after the run.
    pub swapped: Option<Answer>,
    /// The final status, if one came before the client gave up.
    pub final_status: Option<u16>,
    pub latency_ms: f64,
}

/// How the clients behave.
#[derive(Debug, Clone)]
pub(crate) struct ClientPlan {
    pub seed: u64,
    pub requests: u64,
    pub concurrency: u32,
    /// Where to send: one address per API instance (each behind its network proxy).
    pub targets: Vec<SocketAddr>,
    pub users: Vec<ClientUser>,
    /// Time limit of one attempt.
    pub attempt_timeout: Duration,
    /// After this long without a final answer, the client gives up; the completer must finish.
    pub give_up_after: Duration,
}

/// First retry delay; doubles per attempt up to [`MAX_BACKOFF`].
const BASE_BACKOFF: Duration = Duration::from_millis(100);
/// Longest pause between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Runs every client to completion; `done` counts finished requests for the progress bar.
pub(crate) async fn run(
    plan: Arc<ClientPlan>,
    recorder: Recorder,
    done: Arc<AtomicU64>,
) -> Vec<RequestLog> {
    let next = Arc::new(AtomicU64::new(0));
    let http = reqwest::Client::builder()
        .timeout(plan.attempt_timeout)
        .pool_max_idle_per_host(0)
        .build()
        .expect("a plain HTTP client builds");
    let mut clients = tokio::task::JoinSet::new();
    for client in 0..plan.concurrency {
        let (plan, recorder, done, next, http) = (
            plan.clone(),
            recorder.clone(),
            done.clone(),
            next.clone(),
            http.clone(),
        );
        clients.spawn(async move {
            let mut rng = StdRng::seed_from_u64(plan.seed ^ (u64::from(client) << 32));
            let mut logs = Vec::new();
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                if index >= plan.requests {
                    return logs;
                }
                logs.push(one_request(&plan, &http, &recorder, &mut rng, index).await);
                done.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    let mut logs = Vec::new();
    while let Some(result) = clients.join_next().await {
        // A client task panicking is a harness bug: fail loudly.
        logs.extend(result.expect("client task"));
    }
    logs
}

async fn one_request(
    plan: &ClientPlan,
    http: &reqwest::Client,
    recorder: &Recorder,
    rng: &mut StdRng,
    index: u64,
) -> RequestLog {
    let user = plan.users[rng.random_range(0..plan.users.len())].clone();
    let amount_cents = rng.random_range(50..=100_000);
    let body = format!(
        r#"{{"origin_lat": {:.5}, "origin_lon": {:.5}, "target_lat": {:.5}, "target_lon": {:.5}, "amount_cents": {amount_cents}}}"#,
        rng.random_range(-90.0..=90.0),
        rng.random_range(-180.0..=180.0),
        rng.random_range(-90.0..=90.0),
        rng.random_range(-180.0..=180.0),
    );
    let key = format!("chaos-{}-{index}", plan.seed);
    let started = Instant::now();
    let mut log = new_log(user, key, amount_cents, body);
    let mut attempt = 0u32;
    loop {
        let target = plan.targets[rng.random_range(0..plan.targets.len())];
        let (retry_after, finished) = self::attempt(http, target, recorder, &mut log).await;
        if finished {
            break;
        }
        attempt += 1;
        let backoff = BASE_BACKOFF
            .saturating_mul(1 << attempt.min(5))
            .min(MAX_BACKOFF);
        let jittered = backoff.mul_f64(rng.random_range(0.5..=1.0));
        let wait = retry_after.map_or(jittered, |after| after.max(jittered));
        if started.elapsed() + wait >= plan.give_up_after {
            break;
        }
        tokio::time::sleep(wait).await;
    }
    log.latency_ms = started.elapsed().as_secs_f64() * 1000.0;
    log
}

/// Sends one `POST /rides`; the `Retry-After` comes back apart.
pub(crate) async fn send(
    http: &reqwest::Client,
    target: SocketAddr,
    api_key: &str,
    key: &str,
    body: &str,
) -> (Answer, Option<Duration>) {
    let sent = http
        .post(format!("http://{target}/rides"))
        .bearer_auth(api_key)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await;
    let Ok(response) = sent else {
        return (Answer::default(), None);
    };
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let replayed = header("idempotent-replayed").is_some();
    let (location, content_type) = (header("location"), header("content-type"));
    let retry_after = header("retry-after")
        .and_then(|v| v.parse().ok())
        .map(Duration::from_secs);
    match response.bytes().await {
        Ok(bytes) => {
            let over_capacity = status == 503
                && serde_json::from_slice::<serde_json::Value>(&bytes).is_ok_and(|problem| {
                    problem["type"] == rocket_rides::problem::types::OVER_CAPACITY
                });
            let body = matches!(status, 201 | 402 | 502).then(|| bytes.to_vec());
            (
                Answer {
                    status: Some(status),
                    replayed,
                    body,
                    location,
                    content_type,
                    second: 0,
                    over_capacity,
                },
                retry_after,
            )
        }
        // Headers came, the body did not: as good as no answer.
        Err(_) => (Answer::default(), None),
    }
}

/// Every how many requests one is also sent with another amount under its key after the run.
const SWAP_EVERY: usize = 10;

/// After the run, with no fault in the way, asks once more for every request: each must now get
/// the answer stored for its key (the completer's, for requests whose clients gave up). For every
/// tenth request it also sends the same key with another amount, which must be refused. These
/// answers are not part of the traffic figures; the auditor reads them from the logs.
pub(crate) async fn verify(plan: &ClientPlan, logs: &mut [RequestLog]) {
    let http = reqwest::Client::builder()
        .timeout(plan.attempt_timeout)
        .build()
        .expect("a plain HTTP client builds");
    let target = plan.targets[0];
    let permits = Arc::new(tokio::sync::Semaphore::new(plan.concurrency as usize));
    let mut asks = tokio::task::JoinSet::new();
    for (i, log) in logs.iter().enumerate() {
        let (http, permits) = (http.clone(), permits.clone());
        let (api_key, key, body) = (log.user.api_key.clone(), log.key.clone(), log.body.clone());
        let swapped_body = (i % SWAP_EVERY == 0).then(|| {
            body.replace(
                &format!("\"amount_cents\": {}", log.amount_cents),
                &format!("\"amount_cents\": {}", log.amount_cents + 1),
            )
        });
        asks.spawn(async move {
            // The semaphore is never closed.
            let _permit = permits.acquire_owned().await.expect("semaphore is open");
            let late = send_admitted(&http, target, &api_key, &key, &body).await;
            let swapped = match swapped_body {
                Some(other) => Some(send_admitted(&http, target, &api_key, &key, &other).await),
                None => None,
            };
            (i, late, swapped)
        });
    }
    while let Some(result) = asks.join_next().await {
        let (i, late, swapped) = result.expect("verification task");
        logs[i].late = Some(late);
        logs[i].swapped = swapped;
    }
}

/// How often a question after the run is asked again after a shed.
const SHED_RETRIES: u32 = 10;

/// [`send`], asked again after its `Retry-After` while the service sheds it (503
/// `over-capacity`: refused at the door, nothing done), as a client honouring it does. The
/// questions after the run come all at once, more than one process admits
/// (`--admission-limit`).
async fn send_admitted(
    http: &reqwest::Client,
    target: SocketAddr,
    api_key: &str,
    key: &str,
    body: &str,
) -> Answer {
    let mut tries = 0;
    loop {
        let (answer, retry_after) = send(http, target, api_key, key, body).await;
        tries += 1;
        let shed = answer.over_capacity;
        match retry_after {
            Some(after) if shed && tries <= SHED_RETRIES => tokio::time::sleep(after).await,
            _ => return answer,
        }
    }
}

/// Whether an answer is the service's stored refusal of a payment (502 `payment-refused`).
pub(crate) fn is_payment_refused(answer: &Answer) -> bool {
    answer.status == Some(502)
        && answer
            .body
            .as_deref()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(b).ok())
            .is_some_and(|b| b["type"] == rocket_rides::problem::types::PAYMENT_REFUSED)
}
