//! The gateway slow across the key window (`gateway_slow_across_window`): a charge asked for
//! just before its key's window ends, which the gateway is still making when the window has
//! passed and the request is resumed.
//!
//! ```text
//!  first attempt ── fail before ── … (a retry every few seconds, each failed before charging)
//!        │                                        window ends
//!        │◄────────────── key window ──────────────►│
//!        │                      retry: held charge ─┼──────────────► the charge lands
//!        │                      (our timeout, 503)  │  retry: past the window → list?
//! ```
//!
//! A few requests of dedicated users, each with a script for its customer at the gateway: every
//! attempt before the window's last second and a half fails before the gateway charges; the one
//! after takes longer than the gateway timeout plus `Retry-After`, and charges after the window
//! has passed. The retry that follows finds the key past its window while the charge is still
//! being made: a service that lists now finds nothing and charges again. The in-flight guard
//! makes it wait for the processing bound instead; `--without in-flight-guard` takes it away.
//!
//! A straddle is counted only on evidence, after its request ended: the attempt that took the
//! hold (the customer's script was spent once it was answered) was sent before the window's end,
//! and a later attempt was sent after the window's end and before the hold could be over.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use fakestripe::Scripted;
use sqlx::PgPool;
use time::OffsetDateTime;

use super::clients::{self, ClientUser, RequestLog};
use super::recorder::Recorder;

/// The fault kind, as counted in the report.
pub(crate) const KIND: &str = "gateway_slow_across_window";

/// How long before the window ends the held charge is asked for.
const LEAD: Duration = Duration::from_millis(1500);
/// The pause between two attempts before the window's end: below the completer's grace, so the
/// client keeps its key.
const CADENCE: Duration = Duration::from_secs(3);
/// Straddles start this far apart, so that the processes' faults strike them differently.
const STAGGER: Duration = Duration::from_secs(2);
/// How many failures wait for the customer's charges before the straddle: enough for every call
/// anyone makes under the key meanwhile (the client's, a completer's, a detached booking's), so
/// that none of them charges early.
const FAILURES_AHEAD: usize = 1_000;

/// What the straddles need.
pub(crate) struct Straddles {
    /// One user per straddle, with its customer at the gateway.
    pub users: Vec<(ClientUser, String)>,
    pub targets: Vec<SocketAddr>,
    /// The services' key window.
    pub window: Duration,
    /// How long the held charge takes: more than the gateway timeout plus `Retry-After`, less
    /// than the processing bound.
    pub hold: Duration,
    /// The longest a straddle goes on after its window ended before the client gives up.
    pub settle_within: Duration,
    /// The run's PostgreSQL, whose clock the services' windows run on.
    pub pool: PgPool,
    pub gateway: fakestripe::AppState,
    pub attempt_timeout: Duration,
    pub seed: u64,
}

/// Runs every straddle to its end and returns their logs, for the auditor.
pub(crate) async fn run(plan: Straddles, recorder: Recorder) -> Vec<RequestLog> {
    let plan = std::sync::Arc::new(plan);
    let http = reqwest::Client::builder()
        .timeout(plan.attempt_timeout)
        .pool_max_idle_per_host(0)
        .build()
        .expect("a plain HTTP client builds");
    let mut straddles = tokio::task::JoinSet::new();
    for i in 0..plan.users.len() {
        let (plan, recorder, http) = (plan.clone(), recorder.clone(), http.clone());
        straddles.spawn(async move {
            tokio::time::sleep(STAGGER * i as u32).await;
            one(&plan, &http, &recorder, i).await
        });
    }
    let mut logs = Vec::new();
    while let Some(log) = straddles.join_next().await {
        logs.push(log.expect("straddle task"));
    }
    logs
}

/// What one straddle saw, in the database's time.
#[derive(Debug, Default)]
struct Seen {
    /// When its current generation's window ends.
    window_end: Option<OffsetDateTime>,
    /// The hold is queued for the customer.
    hold_queued: bool,
    /// When the attempt that took the hold was sent: the one after which the queue was empty.
    held_sent: Option<OffsetDateTime>,
    /// When every attempt was sent.
    sent: Vec<OffsetDateTime>,
}

impl Seen {
    /// Whether the evidence shows a straddle: the hold taken by an attempt sent before the
    /// window's end, and another attempt sent after the end, before the hold could be over.
    fn straddled(&self, hold: Duration) -> bool {
        let (Some(end), Some(held)) = (self.window_end, self.held_sent) else {
            return false;
        };
        held < end && self.sent.iter().any(|&at| end < at && at < held + hold)
    }
}

async fn one(
    plan: &Straddles,
    http: &reqwest::Client,
    recorder: &Recorder,
    i: usize,
) -> RequestLog {
    let (user, customer) = plan.users[i].clone();
    let amount_cents = 1_000 + i as i64;
    let body = format!(
        r#"{{"origin_lat": 1.5, "origin_lon": 2.5, "target_lat": 3.5, "target_lon": 4.5, "amount_cents": {amount_cents}}}"#
    );
    let key = format!("chaos-{}-straddle-{i}", plan.seed);
    let target = plan.targets[i % plan.targets.len()];
    let mut log = clients::new_log(user, key, amount_cents, body);
    let started = Instant::now();
    let mut seen = Seen::default();
    loop {
        let now = db_now(&plan.pool).await;
        if seen.window_end.is_none() {
            seen.window_end = generation_at(&plan.pool, &log)
                .await
                .map(|at| at + plan.window);
        }
        let straddling =
            matches!((seen.window_end, now), (Some(end), Some(now)) if now >= end - LEAD);
        let past_end = matches!((seen.window_end, now), (Some(end), Some(now)) if now >= end);
        if !straddling {
            // Keep the charge from being made until the window's last moment.
            let left = plan.gateway.scripted_left(&customer);
            if left < FAILURES_AHEAD / 2 {
                plan.gateway
                    .script_charges(&customer, vec![Scripted::FailBefore; FAILURES_AHEAD - left]);
            }
        } else if seen.hold_queued && seen.held_sent.is_none() && past_end {
            // The window ended before any attempt took the hold (other faults got in the way):
            // no straddle this time; the request goes on as any other.
            plan.gateway.clear_script(&customer);
        } else if !seen.hold_queued {
            // A failure an attempt did not take is dropped: the next charge is held.
            plan.gateway.clear_script(&customer);
            let ms = plan.hold.as_millis() as u64;
            plan.gateway
                .script_charges(&customer, vec![Scripted::Hold { ms }]);
            seen.hold_queued = true;
        }
        seen.sent.extend(now);
        let (retry_after, finished) = clients::attempt(http, target, recorder, &mut log).await;
        let taken = seen.hold_queued && plan.gateway.scripted_left(&customer) == 0;
        if taken && seen.held_sent.is_none() {
            seen.held_sent = now;
        }
        if finished || started.elapsed() > plan.window + plan.settle_within {
            break;
        }
        let wait = match (straddling, seen.window_end, now) {
            (false, Some(end), Some(now)) => {
                let until_lead = (end - LEAD - now).try_into().unwrap_or(Duration::ZERO);
                CADENCE.min(until_lead).max(Duration::from_millis(50))
            }
            (false, _, _) => CADENCE,
            // Not taken yet (the attempt did not reach the gateway): at once, before the end.
            (true, _, _) if !taken && !past_end => Duration::from_millis(200),
            (true, _, _) => retry_after.unwrap_or(Duration::from_secs(1)),
        };
        tokio::time::sleep(wait).await;
    }
    if seen.straddled(plan.hold) {
        recorder.fault(KIND, 1);
    }
    log.latency_ms = started.elapsed().as_secs_f64() * 1000.0;
    log
}

/// The database's time, on which the services' windows run.
async fn db_now(pool: &PgPool) -> Option<OffsetDateTime> {
    sqlx::query_scalar("SELECT now()")
        .fetch_one(pool)
        .await
        .ok()
}

/// When the current generation of the request's gateway key began, once its ride exists.
async fn generation_at(pool: &PgPool, log: &RequestLog) -> Option<OffsetDateTime> {
    sqlx::query_scalar(
        "SELECT r.charge_generation_at FROM rides r
         JOIN idempotency_keys k ON k.owner = r.key_owner AND k.id = r.idempotency_key_id
         WHERE k.owner = $1::text AND k.idempotency_key = $2",
    )
    .bind(log.user.id)
    .bind(&log.key)
    .fetch_optional(pool)
    .await
    .ok()
    .flatten()
}
