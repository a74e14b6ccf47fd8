//! The open-loop load: `create` requests offered at a fixed rate, whatever the service answers.
//!
//! The closed-loop clients of [`super::load`] send a request only once the previous one is
//! answered, so a service that slows down is offered less work, and the time a request would
//! have waited to be sent is never counted (coordinated omission). Here arrivals follow a
//! Poisson process (exponential gaps from a seeded generator): each is sent at its time, on a
//! task of its own, and its latency is counted from that *intended* time.
//!
//! ```text
//!  arrival times (seeded) ──► outstanding < cap? ──yes──► task: POST /rides (client timeout)
//!                                    │                        └─► 201 / 503 / other / timeout
//!                                    └─no──► client-dropped (counted, never sent)
//! ```
//!
//! Every arrival is accounted for exactly once: `created + shed + timeouts + other + dropped`
//! is the number of arrivals.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hdrhistogram::Histogram;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use super::load::Target;
use super::load::{histogram, micros, problem_type, RIDE};
use super::report::{Latency, OpenLoop};
use rocket_rides::problem::types::OVER_CAPACITY;

/// What one open-loop measurement offers.
#[derive(Debug, Clone)]
pub(crate) struct Offer {
    /// Requests per second, on average.
    pub(crate) rate: f64,
    pub(crate) warmup: Duration,
    pub(crate) duration: Duration,
    /// Requests sent and not yet answered at most; an arrival past it is dropped by the client.
    pub(crate) max_outstanding: usize,
    /// How long a request may wait for its answer before the client gives up on it.
    pub(crate) timeout: Duration,
    pub(crate) seed: u64,
}

/// What became of one sent request.
enum Fate {
    Created,
    Shed { retry_after: bool },
    TimedOut,
    Other(String),
}

/// The tally of a measurement, filled as answers come in.
struct Tally {
    created: Histogram<u64>,
    shed: Histogram<u64>,
    shed_without_retry_after: u64,
    timeouts: u64,
    dropped: u64,
    other: BTreeMap<String, u64>,
}

impl Tally {
    fn count(&mut self, fate: Fate, latency: Duration) {
        match fate {
            Fate::Created => self.created.saturating_record(micros(latency)),
            Fate::Shed { retry_after } => {
                self.shed.saturating_record(micros(latency));
                if !retry_after {
                    self.shed_without_retry_after += 1;
                }
            }
            Fate::TimedOut => self.timeouts += 1,
            Fate::Other(label) => *self.other.entry(label).or_default() += 1,
        }
    }
}

/// Offers `offer.rate` bookings per second to `target` for the warm-up and the measured time,
/// then waits for the last answer (each is bounded by the client's timeout).
pub(crate) async fn run(
    offer: &Offer,
    target: &Target,
    build: &'static str,
    load: f64,
    capacity: f64,
) -> anyhow::Result<OpenLoop> {
    anyhow::ensure!(
        offer.rate.is_finite() && offer.rate > 0.0,
        "an open-loop rate must be a positive number of requests per second, got {}",
        offer.rate
    );
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(offer.max_outstanding)
        .timeout(offer.timeout)
        .build()?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(offer.seed);
    let outstanding = Arc::new(AtomicUsize::new(0));
    let (answers, mut answered) = tokio::sync::mpsc::unbounded_channel();
    let start = Instant::now();
    let (measure_from, end) = (start + offer.warmup, start + offer.warmup + offer.duration);
    let (mut intended, mut index) = (start, 0u64);
    let (mut arrivals, mut dropped) = (0u64, 0u64);
    loop {
        // An exponential gap: the time to the next arrival of a Poisson process.
        let gap = -(1.0 - rng.random::<f64>()).ln() / offer.rate;
        intended += Duration::from_secs_f64(gap);
        if intended >= end {
            break;
        }
        tokio::time::sleep_until(intended).await;
        let measured = intended >= measure_from;
        arrivals += u64::from(measured);
        if outstanding.load(Ordering::Relaxed) >= offer.max_outstanding {
            dropped += u64::from(measured);
            continue;
        }
        outstanding.fetch_add(1, Ordering::Relaxed);
        let (http, target, outstanding, answers) = (
            http.clone(),
            target.clone(),
            outstanding.clone(),
            answers.clone(),
        );
        let key = format!("{}-{index}", target.tag);
        index += 1;
        tokio::spawn(async move {
            let fate = book(&http, &target, index as usize, &key).await;
            outstanding.fetch_sub(1, Ordering::Relaxed);
            // The receiver lives until every sender is gone: this send cannot fail.
            let _ = answers.send((intended, measured, fate, intended.elapsed()));
        });
    }
    drop(answers);
    let mut tally = Tally {
        created: histogram(),
        shed: histogram(),
        shed_without_retry_after: 0,
        timeouts: 0,
        dropped,
        other: BTreeMap::new(),
    };
    while let Some((_, measured, fate, latency)) = answered.recv().await {
        if measured {
            tally.count(fate, latency);
        }
    }
    Ok(summary(offer, &tally, arrivals, build, load, capacity))
}

/// Sends one booking with a key of its own, as user `user` (modulo the users).
async fn book(http: &reqwest::Client, target: &Target, user: usize, key: &str) -> Fate {
    let api_key = &target.api_keys[user % target.api_keys.len()];
    let sent = http
        .post(format!("{}/rides", target.base))
        .bearer_auth(api_key)
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(RIDE)
        .send()
        .await;
    let response = match sent {
        Ok(response) => response,
        Err(e) if e.is_timeout() => return Fate::TimedOut,
        Err(_) => return Fate::Other("transport".to_owned()),
    };
    let status = response.status().as_u16();
    let retry_after = response.headers().contains_key("retry-after");
    // The answer counts once its body is in: the client's timeout covers the body too.
    let body = match response.bytes().await {
        Ok(body) => body,
        Err(e) if e.is_timeout() => return Fate::TimedOut,
        Err(_) => return Fate::Other("transport".to_owned()),
    };
    match status {
        201 => Fate::Created,
        // Only the refusal at the door is a shed: a 503 for a gateway timeout, a commit left
        // unconfirmed or a deadline comes from a booking that may go on and charge.
        503 if problem_type(&body).as_deref() == Some(OVER_CAPACITY) => Fate::Shed { retry_after },
        503 => Fate::Other(format!(
            "503 {}",
            problem_type(&body).unwrap_or_else(|| "without a problem type".to_owned())
        )),
        other => Fate::Other(other.to_string()),
    }
}

fn summary(
    offer: &Offer,
    tally: &Tally,
    arrivals: u64,
    build: &'static str,
    load: f64,
    capacity: f64,
) -> OpenLoop {
    let seconds = offer.duration.as_secs_f64();
    let (created, shed) = (tally.created.len(), tally.shed.len());
    OpenLoop {
        build,
        load,
        capacity_requests_per_s: capacity,
        offered_requests_per_s: offer.rate,
        arrivals,
        created,
        created_per_s: created as f64 / seconds,
        shed,
        shed_share: shed as f64 / arrivals.max(1) as f64,
        shed_without_retry_after: tally.shed_without_retry_after,
        timeouts: tally.timeouts,
        timeout_s: offer.timeout.as_secs_f64(),
        client_dropped: tally.dropped,
        max_outstanding: offer.max_outstanding,
        other: tally.other.clone(),
        created_latency_ms: Latency::of(&tally.created),
        shed_latency_ms: (shed > 0).then(|| Latency::of(&tally.shed)),
        created_p99_vs_lowest_load: None,
    }
}
