//! An intermediary's own answers for requests a script chooses (part of
//! `gateway_intermediary_answer`): a 404 page after the charge was made, and an empty 400 before
//! the request reached the gateway, each to the *first* attempt of a request of a dedicated user.
//!
//! The gateway's faults draw such answers too, but by chance; these make sure that every run
//! meets the case where money is lost if an intermediary's 4xx is taken for the gateway's
//! refusal: a first attempt, charged, answered with a page. The service must answer 503 and find
//! the charge under the same key on the retry; `--without unknown-answers` stores a 502 instead.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use fakestripe::Scripted;

use super::clients::{self, ClientUser, RequestLog};
use super::recorder::Recorder;

/// What each scripted request's first charge call is answered with.
const ANSWERS: [Scripted; 2] = [
    Scripted::Intermediary {
        status: 404,
        empty: false,
        after_charge: true,
    },
    Scripted::Intermediary {
        status: 400,
        empty: true,
        after_charge: false,
    },
];

/// What the scripted requests need.
pub(crate) struct Intermediaries {
    /// One user per answer of [`ANSWERS`], with its customer at the gateway.
    pub users: Vec<(ClientUser, String)>,
    pub targets: Vec<SocketAddr>,
    pub gateway: fakestripe::AppState,
    pub attempt_timeout: Duration,
    /// The longest a request is retried before its client gives up.
    pub give_up_after: Duration,
    pub seed: u64,
}

/// How many users the requests need.
pub(crate) const USERS: usize = ANSWERS.len();

/// Runs every scripted request to its end and returns their logs, for the auditor.
pub(crate) async fn run(plan: Intermediaries, recorder: Recorder) -> Vec<RequestLog> {
    let http = reqwest::Client::builder()
        .timeout(plan.attempt_timeout)
        .pool_max_idle_per_host(0)
        .build()
        .expect("a plain HTTP client builds");
    let mut logs = Vec::new();
    for (i, ((user, customer), answer)) in plan.users.iter().zip(ANSWERS).enumerate() {
        plan.gateway.script_charges(customer, vec![answer]);
        let amount_cents = 2_000 + i as i64;
        let body = format!(
            r#"{{"origin_lat": 5.5, "origin_lon": 6.5, "target_lat": 7.5, "target_lon": 8.5, "amount_cents": {amount_cents}}}"#
        );
        let key = format!("chaos-{}-intermediary-{i}", plan.seed);
        let mut log = clients::new_log(user.clone(), key, amount_cents, body);
        let started = Instant::now();
        loop {
            let target = plan.targets[log.answers.len() % plan.targets.len()];
            let (retry_after, finished) =
                clients::attempt(&http, target, &recorder, &mut log).await;
            if finished || started.elapsed() > plan.give_up_after {
                break;
            }
            tokio::time::sleep(retry_after.unwrap_or(Duration::from_millis(500))).await;
        }
        // Disarmed once the request is over: a request whose attempts never reached the gateway
        // (its client gave up while the database was away) leaves its answer armed, and the
        // question asked again after the run would meet it instead.
        plan.gateway.clear_script(customer);
        log.latency_ms = started.elapsed().as_secs_f64() * 1000.0;
        logs.push(log);
    }
    logs
}
