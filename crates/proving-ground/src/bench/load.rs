//! The load: clients that send one scenario's requests as fast as the service answers, for a
//! fixed time, and record every latency in an HDR histogram; and what the open loop
//! ([`super::open_loop`]) shares with them: the ride, the target, the histogram's bounds, and
//! the `type` of a problem+json answer.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::ValueEnum;
use hdrhistogram::Histogram;
use rocket_rides::problem::types::OVER_CAPACITY;
use serde::Serialize;

/// The body of every booking: a ride that charges 20.00.
pub(crate) const RIDE: &str = r#"{"origin_lat": 37.77, "origin_lon": -122.42, "target_lat": 37.80, "target_lon": -122.27, "amount_cents": 2000}"#;

/// Requests sent at once, with one key, in each round of the storm.
pub(crate) const STORM_SIZE: usize = 64;

/// The slowest answer recorded exactly; slower ones are recorded as this.
const MAX_RECORDED: Duration = Duration::from_secs(60);

/// What one measurement sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scenario {
    /// `POST /rides`, every request with a key of its own.
    Create,
    /// `POST /rides` with one finished key, over and over: every answer is a replay.
    Replay,
    /// Rounds of 64 requests sent at once with one key each: each key must book once.
    Storm,
    /// `POST /bench/rides`: the same booking without idempotency (a `bench` build only).
    Baseline,
    /// `create` with the service behind a PgBouncer in transaction pooling
    /// (`DATABASE_POOLER=transaction`).
    #[value(name = "create_pooled")]
    #[serde(rename = "create_pooled")]
    CreatePooled,
    /// `replay` with the service behind a PgBouncer in transaction pooling.
    #[value(name = "replay_pooled")]
    #[serde(rename = "replay_pooled")]
    ReplayPooled,
    /// Bookings offered at fixed rates (Poisson arrivals), multiples of the measured capacity,
    /// each latency counted from its intended start ([`super::open_loop`]).
    Open,
    /// `create` once `--preload-keys` finished bookings are in the tables
    /// ([`super::preload`]).
    #[value(name = "create_large")]
    #[serde(rename = "create_large")]
    CreateLarge,
    /// `replay` once the tables are preloaded.
    #[value(name = "replay_large")]
    #[serde(rename = "replay_large")]
    ReplayLarge,
}

impl Scenario {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Replay => "replay",
            Self::Storm => "storm",
            Self::Baseline => "baseline",
            Self::CreatePooled => "create_pooled",
            Self::ReplayPooled => "replay_pooled",
            Self::Open => "open",
            Self::CreateLarge => "create_large",
            Self::ReplayLarge => "replay_large",
        }
    }

    /// The service runs behind the run's PgBouncer.
    pub(crate) fn pooled(self) -> bool {
        matches!(self, Self::CreatePooled | Self::ReplayPooled)
    }

    /// The scenario whose requests this one sends.
    pub(crate) fn requests(self) -> Self {
        match self {
            Self::CreatePooled | Self::CreateLarge => Self::Create,
            Self::ReplayPooled | Self::ReplayLarge => Self::Replay,
            other => other,
        }
    }

    /// The scenario runs on the preloaded tables, after every other.
    pub(crate) fn large(self) -> bool {
        matches!(self, Self::CreateLarge | Self::ReplayLarge)
    }
}

/// What the clients saw.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    /// Every request sent, the warm-up's included (the database and CPU figures count them
    /// all).
    pub(crate) sent: u64,
    /// Requests answered after the warm-up: the rate and the latencies are theirs.
    pub(crate) measured: u64,
    pub(crate) measured_for: Duration,
    pub(crate) latency: Histogram<u64>,
    /// Answers after the warm-up by status; `"201 replayed"` apart from `"201"`, and
    /// `"transport"` for requests that got no answer.
    pub(crate) answers: BTreeMap<String, u64>,
    /// Storm only: the keys sent, and the rounds where more or fewer than one request did the
    /// work or two answers differed.
    pub(crate) storm_keys: Vec<String>,
    pub(crate) storm_violations: Vec<String>,
}

impl Outcome {
    fn empty() -> Self {
        Self {
            sent: 0,
            measured: 0,
            measured_for: Duration::ZERO,
            latency: histogram(),
            answers: BTreeMap::new(),
            storm_keys: Vec::new(),
            storm_violations: Vec::new(),
        }
    }
}

/// Where and as whom the load is sent.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub(crate) base: String,
    pub(crate) api_keys: Arc<Vec<String>>,
    /// Names the keys of this measurement, so that no two measurements share one.
    pub(crate) tag: String,
}

struct Answer {
    label: String,
    replayed: bool,
    status: u16,
    body: Vec<u8>,
    /// The `Retry-After` header, in seconds, when it is one.
    retry_after: Option<u64>,
}

impl Answer {
    /// A refusal at the door (503 `over-capacity`): the request did nothing.
    fn shed(&self) -> bool {
        self.status == 503 && problem_type(&self.body).as_deref() == Some(OVER_CAPACITY)
    }
}

/// The label of a shed among the answers: a closed-loop measurement counts its sheds apart from
/// its requests, whose rate and latencies are of the requests served.
pub(crate) const SHED_LABEL: &str = "503 shed";

/// How often a storm request is sent again after a shed, each time after its `Retry-After`, as
/// a client honouring it does.
const STORM_SHED_RETRIES: u32 = 5;

async fn send(
    http: &reqwest::Client,
    target: &Target,
    path: &str,
    user: usize,
    key: Option<&str>,
) -> Answer {
    let api_key = &target.api_keys[user % target.api_keys.len()];
    let mut request = http
        .post(format!("{}{path}", target.base))
        .bearer_auth(api_key)
        .header("content-type", "application/json")
        .body(RIDE);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    match request.send().await {
        Ok(response) => {
            let status = response.status().as_u16();
            let replayed = response.headers().contains_key("idempotent-replayed");
            let retry_after = response
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok()?.parse().ok());
            let body = response
                .bytes()
                .await
                .map(|b| b.to_vec())
                .unwrap_or_default();
            let label = if replayed {
                format!("{status} replayed")
            } else {
                status.to_string()
            };
            let mut answer = Answer {
                label,
                replayed,
                status,
                body,
                retry_after,
            };
            if answer.shed() {
                SHED_LABEL.clone_into(&mut answer.label);
            }
            answer
        }
        Err(_) => Answer {
            label: "transport".to_owned(),
            replayed: false,
            status: 0,
            body: Vec::new(),
            retry_after: None,
        },
    }
}

pub(crate) fn histogram() -> Histogram<u64> {
    // Microseconds, three significant digits: 1 µs to a minute.
    Histogram::new_with_bounds(1, MAX_RECORDED.as_micros() as u64, 3)
        .expect("valid histogram bounds")
}

fn client(connections: usize) -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(connections)
        .timeout(Duration::from_secs(30))
        .build()?)
}

/// Sends `scenario` with `concurrency` clients for `warmup + duration`.
pub(crate) async fn run(
    scenario: Scenario,
    concurrency: usize,
    warmup: Duration,
    duration: Duration,
    target: &Target,
) -> anyhow::Result<Outcome> {
    let scenario = scenario.requests();
    anyhow::ensure!(
        scenario != Scenario::Open,
        "the open loop runs in open_loop::run"
    );
    if scenario == Scenario::Storm {
        return storm(warmup, duration, target).await;
    }
    let http = client(concurrency)?;
    let start = Instant::now();
    let (measure_from, end) = (start + warmup, start + warmup + duration);
    let mut clients = Vec::new();
    for client_index in 0..concurrency {
        let (http, target) = (http.clone(), target.clone());
        clients.push(tokio::spawn(async move {
            let mut latency = histogram();
            let mut answers: BTreeMap<String, u64> = BTreeMap::new();
            let (mut sent, mut measured) = (0u64, 0u64);
            while Instant::now() < end {
                let key = match scenario {
                    Scenario::Create => Some(format!("{}-{client_index}-{sent}", target.tag)),
                    Scenario::Replay => Some(REPLAYED_KEY.to_owned()),
                    Scenario::Baseline
                    | Scenario::Storm
                    | Scenario::CreatePooled
                    | Scenario::ReplayPooled
                    | Scenario::Open
                    | Scenario::CreateLarge
                    | Scenario::ReplayLarge => None,
                };
                let path = if scenario == Scenario::Baseline {
                    "/bench/rides"
                } else {
                    "/rides"
                };
                // The replayed key is the first user's: a key is scoped by its user.
                let user = if scenario == Scenario::Replay {
                    0
                } else {
                    client_index
                };
                let began = Instant::now();
                let answer = send(&http, &target, path, user, key.as_deref()).await;
                sent += 1;
                if began >= measure_from {
                    // A shed is counted among the answers only: it served nothing.
                    if !answer.shed() {
                        measured += 1;
                        latency.saturating_record(micros(began.elapsed()));
                    }
                    *answers.entry(answer.label).or_default() += 1;
                }
            }
            (sent, measured, latency, answers)
        }));
    }
    let mut outcome = Outcome::empty();
    for client in clients {
        let (sent, measured, latency, answers) = client.await?;
        outcome.sent += sent;
        outcome.measured += measured;
        outcome.latency.add(latency)?;
        for (label, n) in answers {
            *outcome.answers.entry(label).or_default() += n;
        }
    }
    // Requests in flight at the end are answered after it: the rate counts until the last.
    outcome.measured_for = start.elapsed().saturating_sub(warmup);
    Ok(outcome)
}

/// The key the replay scenario sends, booked by the first user before any measurement
/// ([`book_replayed_key`]), so that a replay measurement counts nothing but replays.
pub(crate) const REPLAYED_KEY: &str = "bench-replayed";

/// Books [`REPLAYED_KEY`].
pub(crate) async fn book_replayed_key(target: &Target) -> anyhow::Result<()> {
    let answer = send(&client(1)?, target, "/rides", 0, Some(REPLAYED_KEY)).await;
    anyhow::ensure!(
        answer.status == 201 && !answer.replayed,
        "booking the replayed key answered {}",
        answer.label
    );
    Ok(())
}

pub(crate) fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

/// The `type` of a problem+json body, if it is one.
pub(crate) fn problem_type(body: &[u8]) -> Option<String> {
    let problem: serde_json::Value = serde_json::from_slice(body).ok()?;
    Some(problem.get("type")?.as_str()?.to_owned())
}

/// Rounds of [`STORM_SIZE`] requests at once with one fresh key each, until the time is up.
/// In every round exactly one request may do the work (a `201` that is not a replay); every
/// other answer is a `409` (the key is in flight) or a replay of that same `201`. 64 at once
/// are more than the service admits (`--admission-limit`): a request it sheds is sent again
/// after its `Retry-After`, and its final answer is the one checked and timed.
async fn storm(warmup: Duration, duration: Duration, target: &Target) -> anyhow::Result<Outcome> {
    let http = client(STORM_SIZE)?;
    let start = Instant::now();
    let (measure_from, end) = (start + warmup, start + warmup + duration);
    let mut outcome = Outcome::empty();
    let mut round = 0u64;
    while Instant::now() < end {
        let key = format!("{}-{round}", target.tag);
        round += 1;
        let barrier = Arc::new(tokio::sync::Barrier::new(STORM_SIZE));
        let mut requests = Vec::new();
        for _ in 0..STORM_SIZE {
            let (http, target, key, barrier) =
                (http.clone(), target.clone(), key.clone(), barrier.clone());
            requests.push(tokio::spawn(async move {
                barrier.wait().await;
                let began = Instant::now();
                // One user for the whole round: a key is scoped by its user. A shed request
                // wrote nothing: it is sent again after its Retry-After.
                let mut answer = send(&http, &target, "/rides", 0, Some(&key)).await;
                for _ in 0..STORM_SHED_RETRIES {
                    if !answer.shed() {
                        break;
                    }
                    let after = Duration::from_secs(answer.retry_after.unwrap_or(1));
                    tokio::time::sleep(after).await;
                    answer = send(&http, &target, "/rides", 0, Some(&key)).await;
                }
                (began, began.elapsed(), answer)
            }));
        }
        let mut executed = Vec::new();
        let mut replays = Vec::new();
        for request in requests {
            let (began, took, answer) = request.await?;
            outcome.sent += 1;
            if answer.status == 201 && !answer.replayed {
                executed.push(answer.body.clone());
            } else if answer.status == 201 {
                replays.push(answer.body.clone());
            } else if answer.status != 409 {
                outcome.storm_violations.push(format!(
                    "key {key}: unexpected answer {} {}",
                    answer.label,
                    String::from_utf8_lossy(&answer.body)
                ));
            }
            if began >= measure_from {
                outcome.measured += 1;
                outcome.latency.saturating_record(micros(took));
                *outcome.answers.entry(answer.label).or_default() += 1;
            }
        }
        if executed.len() != 1 {
            outcome.storm_violations.push(format!(
                "key {key}: {} requests did the work",
                executed.len()
            ));
        } else if replays.iter().any(|body| *body != executed[0]) {
            outcome
                .storm_violations
                .push(format!("key {key}: a replay differs from the first answer"));
        }
        outcome.storm_keys.push(key);
    }
    outcome.measured_for = start.elapsed().saturating_sub(warmup);
    Ok(outcome)
}
