//! What an operator sees: request ids on every answer and in every log line of a request, and
//! logs as JSON lines.

use crate::common;

use std::process::Stdio;
use std::time::Duration;

use common::{TestApp, RIDE};
use serde_json::Value;
use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, BufReader};

#[testdb::test(template = crate::common::migrated)]
async fn every_answer_carries_a_request_id_taken_from_the_request_or_generated(pool: PgPool) {
    let app = TestApp::start(pool).await;
    let ask = |id: Option<String>| {
        let mut request = app.http.get(format!("{}/healthz", app.base));
        if let Some(id) = id {
            request = request.header("x-request-id", id);
        }
        request.send()
    };
    let echoed = ask(Some("client-chosen-1".into())).await.unwrap();
    assert_eq!(echoed.headers()["x-request-id"], "client-chosen-1");

    let generated = ask(None).await.unwrap();
    let id = generated.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(idempotency::Uuid::parse_str(&id).is_ok(), "a UUID: {id}");

    // A client cannot make every log line of its request arbitrarily long.
    let long = "x".repeat(rocket_rides::app::MAX_REQUEST_ID_LEN + 1);
    let replaced = ask(Some(long.clone())).await.unwrap();
    let id = replaced.headers()["x-request-id"].to_str().unwrap();
    assert_ne!(id, long);
    assert!(idempotency::Uuid::parse_str(id).is_ok());
}

type LogLines = tokio::io::Lines<BufReader<tokio::process::ChildStderr>>;

/// A real `serve` process with JSON logs at `info`, its metrics on a free loopback port: the
/// child, its log lines, the address it serves on, and what it logged before saying so.
async fn serve(env: &[(&str, &str)]) -> (tokio::process::Child, LogLines, String, Vec<Value>) {
    serve_with(&["--metrics-listen", "127.0.0.1:0"], env).await
}

/// [`serve`] with these arguments after `serve --listen 127.0.0.1:0`.
async fn serve_with(
    args: &[&str],
    env: &[(&str, &str)],
) -> (tokio::process::Child, LogLines, String, Vec<Value>) {
    let mut serve = tokio::process::Command::new(env!("CARGO_BIN_EXE_rocket-rides"))
        .args(["--log-format", "json", "serve", "--listen", "127.0.0.1:0"])
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(serve.stderr.take().unwrap()).lines();
    let mut logged: Vec<Value> = Vec::new();
    let address = loop {
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("serve logs within 30 s")
            .unwrap()
            .expect("serve is running");
        let event: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
        if event["fields"]["message"] == "serving" {
            break event["fields"]["address"].as_str().unwrap().to_owned();
        }
        logged.push(event);
    };
    (serve, lines, address, logged)
}

#[testdb::test(template = crate::common::migrated)]
async fn json_logs_are_one_object_per_line_and_every_line_of_a_request_names_it(pool: PgPool) {
    let app = TestApp::start(pool).await;
    let (_, api_key) = app.user("rider@example.com", "tok_visa").await;
    // A real `serve` process whose gateway refuses its secret key: the booking, which runs in a
    // task of its own, logs an error in the request's span.
    let database = common::url_of(&app.pool).await;
    let (mut serve, mut lines, address, mut logged) = serve(&[
        ("DATABASE_URL", &database),
        ("STRIPE_API_BASE", app.state.stripe.base()),
        ("STRIPE_API_KEY", "not-a-secret-key"),
    ])
    .await;

    let reply = app
        .http
        .post(format!("http://{address}/rides"))
        .bearer_auth(&api_key)
        .header("idempotency-key", "k-1")
        .header("content-type", "application/json")
        .header("x-request-id", "req-observed-1")
        .body(RIDE)
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 503);
    assert_eq!(reply.headers()["x-request-id"], "req-observed-1");
    serve.start_kill().unwrap();
    while let Ok(Some(line)) = lines.next_line().await {
        let event: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
        logged.push(event);
    }
    let of_request: Vec<&Value> = logged
        .iter()
        .filter(|e| e["span"]["request_id"] == "req-observed-1")
        .collect();
    let messages: Vec<&str> = of_request
        .iter()
        .filter_map(|e| e["fields"]["message"].as_str())
        .collect();
    assert!(
        messages.contains(&"payment gateway misconfigured"),
        "the detached booking logs in the request's span: {messages:?}"
    );
    assert!(
        messages.contains(&"finished processing request"),
        "{messages:?}"
    );
}

#[testdb::test(template = crate::common::migrated)]
async fn serve_starts_without_its_database_and_is_ready_once_the_database_answers(pool: PgPool) {
    let app = TestApp::start(pool).await;
    // A port that refuses connections now, and forwards to the database later: the database
    // "comes back".
    let door = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let door_addr = door.local_addr().unwrap();
    drop(door);
    let database = common::url_of(&app.pool).await;
    let server_port = app.pool.connect_options().get_port();
    let unreachable = database.replacen(
        &format!("127.0.0.1:{server_port}"),
        &door_addr.to_string(),
        1,
    );
    assert_ne!(unreachable, database, "the test database is on 127.0.0.1");
    let (mut serve, _lines, address, _) = serve(&[
        ("DATABASE_URL", &unreachable),
        ("STRIPE_API_BASE", app.state.stripe.base()),
    ])
    .await;
    let ready = |http: reqwest::Client, address: String| async move {
        http.get(format!("http://{address}/readyz"))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    };
    assert_eq!(ready(app.http.clone(), address.clone()).await, 503);
    // The database comes back at the address the process was given.
    let door = tokio::net::TcpListener::bind(door_addr).await.unwrap();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = door.accept().await {
            tokio::spawn(async move {
                let mut outbound = tokio::net::TcpStream::connect(("127.0.0.1", server_port))
                    .await
                    .unwrap();
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            });
        }
    });
    testdb::until_every(
        "serve became ready once its database answered",
        Duration::from_millis(100),
        Duration::from_secs(10),
        || async { (ready(app.http.clone(), address.clone()).await == 200).then_some(()) },
    )
    .await;
    serve.start_kill().unwrap();
}

#[testdb::test(template = crate::common::migrated)]
async fn serve_answers_metrics_on_its_loopback_metrics_listener_and_not_on_the_api(pool: PgPool) {
    let app = TestApp::start(pool).await;
    let database = common::url_of(&app.pool).await;
    let status = |url: String| {
        let http = app.http.clone();
        async move { http.get(url).send().await.unwrap().status().as_u16() }
    };
    let (mut serve, _lines, address, logged) = serve(&[
        ("DATABASE_URL", &database),
        ("STRIPE_API_BASE", app.state.stripe.base()),
    ])
    .await;
    let metrics = logged
        .iter()
        .find(|e| e["fields"]["message"] == "serving metrics")
        .and_then(|e| e["fields"]["address"].as_str())
        .expect("serve logs its metrics address")
        .to_owned();
    assert!(metrics.starts_with("127.0.0.1:"), "{metrics}");
    assert_eq!(status(format!("http://{address}/metrics")).await, 404);
    assert_eq!(status(format!("http://{metrics}/metrics")).await, 200);
    serve.start_kill().unwrap();

    let (mut serve, _lines, address, logged) = serve_with(
        &["--metrics-on-public-listener"],
        &[
            ("DATABASE_URL", &database),
            ("STRIPE_API_BASE", app.state.stripe.base()),
        ],
    )
    .await;
    assert!(
        !logged
            .iter()
            .any(|e| e["fields"]["message"] == "serving metrics"),
        "no metrics listener when metrics are on the public one"
    );
    assert_eq!(status(format!("http://{address}/metrics")).await, 200);
    serve.start_kill().unwrap();
}
