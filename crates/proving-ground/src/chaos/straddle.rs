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
    let mut log = RequestLog {
        user,
        key,
        amount_cents,
        body,
        answers: Vec::new(),
        late: None,
        swapped: None,
        final_status: None,
        latency_ms: 0.0,
    };
    let started = Instant::now();
    let mut window_end: Option<OffsetDateTime> = None;
    let mut held_at: Option<OffsetDateTime> = None;
    let mut counted = false;
    loop {
        let now = db_now(&plan.pool).await;
        if window_end.is_none() {
            window_end = generation_at(&plan.pool, &log)
                .await
                .map(|at| at + plan.window);
        }
        let straddling = matches!((window_end, now), (Some(end), Some(now)) if now >= end - LEAD);
        if !straddling {
            // Keep the charge from being made until the window's last moment.
            if plan.gateway.scripted_left(&customer) == 0 {
                plan.gateway
                    .script_charges(&customer, vec![Scripted::FailBefore]);
            }
        } else if held_at.is_none() && plan.gateway.scripted_left(&customer) == 0 {
            let ms = plan.hold.as_millis() as u64;
            plan.gateway
                .script_charges(&customer, vec![Scripted::Hold { ms }]);
            held_at = now;
        }
        let (mut answer, retry_after) =
            clients::send(http, target, &log.user.api_key, &log.key, &log.body).await;
        answer.second = recorder.second();
        recorder.response(
            &answer
                .status
                .map_or_else(|| "transport_error".to_owned(), |s| s.to_string()),
        );
        let status = answer.status;
        let refused = clients::is_payment_refused(&answer);
        log.answers.push(answer);
        // Counted once the held charge was taken (by this attempt or the completer's) and it
        // straddles the window's end.
        if let (Some(at), Some(end), false) = (held_at, window_end, counted) {
            if plan.gateway.scripted_left(&customer) == 0 && at < end && end < at + plan.hold {
                recorder.fault(KIND, 1);
                counted = true;
            }
        }
        match status {
            Some(s) if refused || !matches!(s, 409 | 500..=599) => {
                log.final_status = Some(s);
                break;
            }
            _ => {}
        }
        let settled_by = plan.window + plan.settle_within;
        if started.elapsed() > settled_by {
            break;
        }
        let wait = match (straddling, window_end, now) {
            (false, Some(end), Some(now)) => {
                let until_lead = (end - LEAD - now).try_into().unwrap_or(Duration::ZERO);
                CADENCE.min(until_lead).max(Duration::from_millis(50))
            }
            (false, _, _) => CADENCE,
            (true, _, _) => retry_after.unwrap_or(Duration::from_secs(1)),
        };
        tokio::time::sleep(wait).await;
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
         JOIN idempotency_keys k ON k.user_id = r.user_id AND k.id = r.idempotency_key_id
         WHERE k.user_id = $1 AND k.idempotency_key = $2",
    )
    .bind(log.user.id)
    .bind(&log.key)
    .fetch_optional(pool)
    .await
    .ok()
    .flatten()
}
