//! The HTTP edge, black-box over real TCP: timeouts, load shedding, strict input, problems for
//! every error, one spelling per ride id. Every refused input writes nothing.

use crate::common;

use std::time::Duration;

use common::{TestApp, RIDE};
use rocket_rides::config::HttpArgs;
use rocket_rides::problem::types;
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn app_with_user(pool: PgPool) -> (TestApp, i64, String) {
    let app = TestApp::start(pool).await;
    let (id, key) = app.user("rider@example.com", "tok_visa").await;
    (app, id, key)
}

fn short_timeouts() -> HttpArgs {
    HttpArgs {
        header_read_timeout: Duration::from_millis(300),
        body_read_timeout: Duration::from_millis(300),
        ..Default::default()
    }
}

fn address(app: &TestApp) -> String {
    app.base.trim_start_matches("http://").to_owned()
}

/// Reads until the server closes the connection, within `limit`; what it sent.
async fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let read = tokio::time::timeout(limit, async {
        let mut buffer = [0u8; 4096];
        loop {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buffer[..n]),
            }
        }
    })
    .await;
    read.is_ok().then_some(got)
}

/// Rows that a refused request must not have written.
async fn nothing_written(app: &TestApp) {
    assert_eq!(app.keys().await, 0, "no key row");
    assert_eq!(app.rides().await, 0, "no ride");
    assert_eq!(app.charges().await, 0, "no charge");
}

#[testdb::test(template = crate::common::migrated)]
async fn a_client_that_sends_half_its_headers_is_cut_off(pool: PgPool) {
    let app = TestApp::start_with_edge(pool, short_timeouts()).await;
    let mut stream = TcpStream::connect(address(&app)).await.unwrap();
    stream
        .write_all(b"POST /rides HTTP/1.1\r\nHost: x\r\nContent-Ty")
        .await
        .unwrap();
    let closed = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    assert!(
        closed.is_some(),
        "the connection is closed after the header-read timeout"
    );
}

#[testdb::test(template = crate::common::migrated)]
async fn an_idle_keep_alive_connection_is_closed(pool: PgPool) {
    let app = TestApp::start_with_edge(pool, short_timeouts()).await;
    let mut stream = TcpStream::connect(address(&app)).await.unwrap();
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let answer = read_until_closed(&mut stream, Duration::from_secs(5))
        .await
        .expect("the idle connection is closed");
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
}

#[testdb::test(template = crate::common::migrated)]
async fn a_body_that_never_arrives_is_a_400_and_writes_nothing(pool: PgPool) {
    let app = TestApp::start_with_edge(pool, short_timeouts()).await;
    let (_, api_key) = app.user("rider@example.com", "tok_visa").await;
    let mut stream = TcpStream::connect(address(&app)).await.unwrap();
    let head = format!(
        "POST /rides HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api_key}\r\n\
         Idempotency-Key: k-1\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n{{\"origin"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let answer = read_until_closed(&mut stream, Duration::from_secs(5))
        .await
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    assert!(text.contains(types::BAD_BODY), "{text}");
    nothing_written(&app).await;
}

#[testdb::test(template = crate::common::migrated)]
async fn a_request_past_its_deadline_is_a_503_with_retry_after(pool: PgPool) {
    let http = HttpArgs {
        request_timeout: Duration::from_millis(500),
        ..Default::default()
    };
    let app = TestApp::start_with_edge(pool, http).await;
    let (user_id, api_key) = app.user("rider@example.com", "tok_visa").await;
    // Another transaction holds the key's row: the request's claim waits on it.
    let mut holder = app.pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO idempotency_keys (owner, request_method, request_path, idempotency_key,
                                       fingerprint, request_params, recovery_point)
         VALUES ($1::text, 'POST', '/rides', 'k-1', decode(repeat('00', 32), 'hex'), '{}', 'started')",
    )
    .bind(user_id)
    .execute(&mut *holder)
    .await
    .unwrap();
    let reply = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(reply.status, 503, "{reply:?}");
    assert_eq!(reply.problem_type(), types::REQUEST_TIMEOUT);
    assert!(reply.header("retry-after").is_some());
    holder.rollback().await.unwrap();
    let metrics = app.state.metrics.render(None);
    assert!(
        metrics.contains("http_requests_timed_out_total 1"),
        "{metrics}"
    );
}

#[testdb::test(template = crate::common::migrated)]
async fn requests_past_the_bound_in_flight_are_shed_at_once(pool: PgPool) {
    let http = HttpArgs {
        http_max_in_flight: 1,
        ..Default::default()
    };
    let app = TestApp::start_with_edge(pool, http).await;
    let (_, api_key) = app.user("rider@example.com", "tok_visa").await;
    // One booking in flight, held at the gateway.
    app.gateway.hold_charges();
    let booking = {
        let (http, base, key) = (app.http.clone(), app.base.clone(), api_key.clone());
        tokio::spawn(async move {
            http.post(format!("{base}/rides"))
                .bearer_auth(key)
                .header("idempotency-key", "k-1")
                .header("content-type", "application/json")
                .body(RIDE)
                .send()
                .await
        })
    };
    app.gateway.charges_held(1).await;
    let shed = app.get(&api_key, "/healthz").await;
    assert_eq!(shed.status, 503, "{shed:?}");
    assert_eq!(shed.problem_type(), types::OVER_CAPACITY);
    assert_eq!(shed.header("retry-after"), Some("1"));
    assert!(
        shed.header("x-request-id").is_some(),
        "a shed answer is traced too"
    );
    app.gateway.release_charges();
    assert_eq!(booking.await.unwrap().unwrap().status(), 201);
    assert_eq!(app.get(&api_key, "/healthz").await.status, 200);
}

/// Rows of the user's key `key`.
async fn key_rows(app: &TestApp, key: &str) -> i64 {
    app.count_owned(format!(
        "SELECT count(*) FROM idempotency_keys WHERE idempotency_key = '{key}'"
    ))
    .await
}

#[testdb::test(template = crate::common::migrated)]
async fn bookings_past_the_admission_limit_are_shed_after_the_wait_and_write_nothing(pool: PgPool) {
    const ADMITTED: usize = 2;
    const SHED: usize = 4;
    let http = HttpArgs {
        admission_limit: Some(ADMITTED as u32),
        admission_wait: Duration::from_millis(20),
        ..Default::default()
    };
    let app = TestApp::start_with_edge(pool.clone(), http).await;
    let (user_id, api_key) = app.user("rider@example.com", "tok_visa").await;
    // The admitted bookings hold their slots in the database, at their ride's insert, until
    // the lock on their rider lets them go on.
    let lock = crate::gate::RiderLock::take(&pool, user_id).await;
    let mut admitted: Vec<_> = (0..ADMITTED)
        .map(|i| app.spawn_booking(&api_key, &format!("admitted-{i}"), false))
        .collect();
    lock.until_waited_on(&app, ADMITTED, &admitted).await;
    // More at once than the gate admits: each waits its 20 ms, finds no slot, and is shed.
    let shed: Vec<_> = (0..SHED)
        .map(|i| app.spawn_booking(&api_key, &format!("shed-{i}"), false))
        .collect();
    for (i, reply) in shed.into_iter().enumerate() {
        let reply = reply.await.unwrap();
        assert_eq!(reply.status, 503, "{reply:?}");
        assert_eq!(reply.problem_type(), types::OVER_CAPACITY);
        assert_eq!(reply.header("retry-after"), Some("1"));
        assert_eq!(key_rows(&app, &format!("shed-{i}")).await, 0, "shed-{i}");
    }
    // A read of a ride uses the database too; the probes and the metrics do not, and pass.
    let read = app.get(&api_key, "/rides/1").await;
    assert_eq!(read.status, 503, "{read:?}");
    assert_eq!(read.problem_type(), types::OVER_CAPACITY);
    for probe in ["/healthz", "/readyz", "/openapi.json"] {
        assert_eq!(app.get(&api_key, probe).await.status, 200, "{probe}");
    }
    assert_eq!(app.metric("http_requests_shed_total").await, 5.0);
    assert_eq!(
        app.keys().await,
        0,
        "the shed wrote nothing (the admitted claim with their ride, still uncommitted)"
    );
    // A client that hangs up frees no slot: its booking goes on in its own task, which uses
    // the database until it ends, and holds the slot as long.
    admitted.remove(0).abort();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after_hang_up = app
        .post_ride(Some(&api_key), Some("after-hang-up"), RIDE)
        .await;
    assert_eq!(after_hang_up.status, 503, "{after_hang_up:?}");
    assert_eq!(after_hang_up.problem_type(), types::OVER_CAPACITY);
    assert_eq!(key_rows(&app, "after-hang-up").await, 0);

    lock.release().await;
    for reply in admitted {
        let reply = reply.await.unwrap();
        assert_eq!(reply.status, 201, "{reply:?}");
    }
    // The abandoned booking finished in its task: its retry is a replay once it has.
    let abandoned = testdb::until_every(
        "the abandoned booking's retry is answered other than 409",
        Duration::from_millis(50),
        Duration::from_secs(30),
        || async {
            let reply = app
                .post_ride(Some(&api_key), Some("admitted-0"), RIDE)
                .await;
            (reply.status != 409).then_some(reply)
        },
    )
    .await;
    assert_eq!(abandoned.status, 201, "{abandoned:?}");
    assert!(abandoned.replayed(), "{abandoned:?}");
    // The shed ones' retries, under the same keys, are first attempts: each books once.
    for key in (0..SHED)
        .map(|i| format!("shed-{i}"))
        .chain(["after-hang-up".to_owned()])
    {
        let first = app.post_ride(Some(&api_key), Some(&key), RIDE).await;
        assert_eq!(first.status, 201, "{first:?}");
        assert!(!first.replayed(), "{key} had written nothing");
        let again = app.post_ride(Some(&api_key), Some(&key), RIDE).await;
        assert!(again.replayed() && again.body == first.body, "{again:?}");
    }
    let total = (ADMITTED + SHED + 1) as i64;
    assert_eq!(app.rides().await, total);
    assert_eq!(app.charges().await, total);
    assert_eq!(app.keys().await, total);
}

#[testdb::test(template = crate::common::migrated)]
async fn connections_past_the_bound_get_a_503_problem_at_once(pool: PgPool) {
    let http = HttpArgs {
        http_max_connections: 1,
        ..Default::default()
    };
    let app = TestApp::start_with_edge(pool, http).await;
    // The first connection holds the one place: idle, after a request.
    let mut first = TcpStream::connect(address(&app)).await.unwrap();
    first
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buffer = [0u8; 1024];
    let n = first.read(&mut buffer).await.unwrap();
    assert!(buffer[..n].starts_with(b"HTTP/1.1 200"));
    let mut second = TcpStream::connect(address(&app)).await.unwrap();
    let _ = second
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let answer = read_until_closed(&mut second, Duration::from_secs(5))
        .await
        .expect("answered and closed at once");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(text.contains("application/problem+json"), "{text}");
    assert!(text.contains(types::OVER_CAPACITY), "{text}");
    drop(first);
}

#[testdb::test(template = crate::common::migrated)]
async fn the_bearer_scheme_is_case_insensitive_and_two_authorizations_are_refused(pool: PgPool) {
    let (app, _, api_key) = app_with_user(pool).await;
    for scheme in ["bearer", "BEARER"] {
        let reply = app
            .http
            .get(format!("{}/rides/1", app.base))
            .header("authorization", format!("{scheme} {api_key}"))
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), 404, "{scheme}: authenticated, no such ride");
    }
    let two = app
        .http
        .get(format!("{}/rides/1", app.base))
        .header("authorization", format!("Bearer {api_key}"))
        .header("authorization", "Bearer rr_test_someone_else")
        .send()
        .await
        .unwrap();
    assert_eq!(two.status(), 401);
    let body: serde_json::Value = serde_json::from_slice(&two.bytes().await.unwrap()).unwrap();
    assert_eq!(
        body["detail"],
        rocket_rides::problem::ONE_AUTHORIZATION_DETAIL
    );
}

/// `POST /rides` with these headers and body.
async fn post_raw(
    app: &TestApp,
    api_key: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> common::Reply {
    let mut request = app
        .http
        .post(format!("{}/rides", app.base))
        .bearer_auth(api_key)
        .header("idempotency-key", "k-1");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    common::Reply::read(request.body(body.to_owned()).send().await.unwrap()).await
}

/// A refused body: what it is, its headers, its bytes, the status and problem type it gets.
type Case = (
    &'static str,
    Vec<(&'static str, &'static str)>,
    String,
    u16,
    &'static str,
);

#[testdb::test(template = crate::common::migrated)]
async fn bodies_are_read_strictly_and_refused_ones_write_nothing(pool: PgPool) {
    let (app, _, api_key) = app_with_user(pool).await;
    let json = [("content-type", "application/json")];
    let ride = |origin_lat: &str, amount: &str| {
        format!(
            r#"{{"origin_lat": {origin_lat}, "origin_lon": -122.42, "target_lat": 37.80, "target_lon": -122.27, "amount_cents": {amount}}}"#
        )
    };
    let duplicate = r#"{"amount_cents": 100, "amount_cents": 2000, "origin_lat": 37.77, "origin_lon": -122.42, "target_lat": 37.80, "target_lon": -122.27}"#;
    let nul = r#"{"origin_lat": 37.77, "origin_lon": -122.42, "target_lat": 37.80, "target_lon": -122.27, "amount_cents": 2000, "note": "a\u0000b"}"#;
    let cases: Vec<Case> = vec![
        (
            "duplicate member",
            json.to_vec(),
            duplicate.to_owned(),
            400,
            types::BAD_JSON,
        ),
        (
            "NUL in a string",
            json.to_vec(),
            nul.to_owned(),
            400,
            types::BAD_JSON,
        ),
        (
            "amount rounded up",
            json.to_vec(),
            ride("37.77", "49.999999999999999"),
            400,
            types::VALIDATION,
        ),
        (
            "amount not an integer token",
            json.to_vec(),
            ride("37.77", "2000.0"),
            400,
            types::VALIDATION,
        ),
        (
            "latitude just past 90",
            json.to_vec(),
            ride("90.0000000000000001", "2000"),
            400,
            types::VALIDATION,
        ),
        (
            "no content type",
            vec![],
            RIDE.to_owned(),
            415,
            types::UNSUPPORTED_MEDIA_TYPE,
        ),
        (
            "text/plain",
            vec![("content-type", "text/plain")],
            RIDE.to_owned(),
            415,
            types::UNSUPPORTED_MEDIA_TYPE,
        ),
        (
            "gzip on a plain body",
            vec![
                ("content-type", "application/json"),
                ("content-encoding", "gzip"),
            ],
            RIDE.to_owned(),
            415,
            types::UNSUPPORTED_MEDIA_TYPE,
        ),
    ];
    for (case, headers, body, status, kind) in cases {
        let reply = post_raw(&app, &api_key, &headers, &body).await;
        assert_eq!(reply.status, status, "{case}: {reply:?}");
        assert_eq!(reply.problem_type(), kind, "{case}");
    }
    nothing_written(&app).await;
    // Parameters of the media type are fine, and so is an explicit identity encoding.
    let fine = post_raw(
        &app,
        &api_key,
        &[
            ("content-type", "Application/JSON; charset=utf-8"),
            ("content-encoding", "identity"),
        ],
        RIDE,
    )
    .await;
    assert_eq!(fine.status, 201, "{fine:?}");
}

#[testdb::test(template = crate::common::migrated)]
async fn a_ride_id_has_one_spelling(pool: PgPool) {
    let (app, _, api_key) = app_with_user(pool).await;
    let ride = app
        .post_ride(Some(&api_key), Some("k-1"), RIDE)
        .await
        .json();
    let id = ride["ride_id"].as_i64().unwrap();
    assert_eq!(app.get(&api_key, &format!("/rides/{id}")).await.status, 200);
    let spelled: String = id
        .to_string()
        .bytes()
        .map(|b| format!("%{b:02X}"))
        .collect();
    for other in [
        format!("0{id}"),
        format!("+{id}"),
        spelled,
        format!("{id}.0"),
    ] {
        let reply = app.get(&api_key, &format!("/rides/{other}")).await;
        assert_eq!(reply.status, 404, "/rides/{other}");
        assert_eq!(reply.problem_type(), types::NOT_FOUND);
    }
}

#[testdb::test(template = crate::common::migrated)]
async fn unknown_routes_and_methods_are_problems(pool: PgPool) {
    let (app, _, api_key) = app_with_user(pool).await;
    let missing = app.get(&api_key, "/nowhere").await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.problem_type(), types::NO_ROUTE);
    let reply = app
        .http
        .delete(format!("{}/rides", app.base))
        .send()
        .await
        .unwrap();
    let reply = common::Reply::read(reply).await;
    assert_eq!(reply.status, 405);
    assert_eq!(reply.problem_type(), types::METHOD_NOT_ALLOWED);
    assert_eq!(reply.header("allow"), Some("POST"));
}

#[testdb::test(template = crate::common::migrated)]
async fn made_up_methods_add_no_series_to_the_metrics(pool: PgPool) {
    let (app, _, _) = app_with_user(pool).await;
    for method in ["FOOBAR", "BAZ", "QUUX"] {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let reply = app
            .http
            .request(method, format!("{}/rides", app.base))
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), 405);
    }
    let text = app
        .http
        .get(format!("{}/metrics", app.metrics_base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!text.contains("FOOBAR"), "{text}");
    assert!(
        text.contains(r#"http_requests_total{method="OTHER",route="/rides",status="405"} 3"#),
        "{text}"
    );
}

/// The paths of the OpenAPI document served at `base`.
async fn documented_paths(app: &common::TestApp, base: &str) -> serde_json::Value {
    let doc: serde_json::Value = serde_json::from_slice(
        &app.http
            .get(format!("{base}/openapi.json"))
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap(),
    )
    .unwrap();
    doc["paths"].clone()
}

#[testdb::test(template = crate::common::migrated)]
async fn metrics_stay_off_the_public_listener_unless_asked_for_there(pool: PgPool) {
    let (app, _, _) = app_with_user(pool).await;
    let status = |url: String| {
        let http = app.http.clone();
        async move { http.get(url).send().await.unwrap().status().as_u16() }
    };
    // The default: the public listener neither serves nor documents them; their own does.
    assert_eq!(status(format!("{}/metrics", app.base)).await, 404);
    assert!(
        documented_paths(&app, &app.base)
            .await
            .get("/metrics")
            .is_none(),
        "not documented where not served"
    );
    assert_eq!(status(format!("{}/metrics", app.metrics_base)).await, 200);
    // Asked for on the public listener (`--metrics-on-public-listener`): served and documented.
    let (public, _stop) =
        common::spawn(rocket_rides::app::api_router(app.state.clone(), true)).await;
    assert_eq!(status(format!("{public}/metrics")).await, 200);
    assert!(documented_paths(&app, &public)
        .await
        .get("/metrics")
        .is_some());
}

#[testdb::test(template = crate::common::migrated)]
async fn a_409_asks_for_a_retry_within_two_seconds(pool: PgPool) {
    let (app, _, api_key) = app_with_user(pool).await;
    app.state
        .failpoints
        .arm(rocket_rides::failpoints::AFTER_RIDE_CREATED);
    assert_eq!(
        app.post_ride(Some(&api_key), Some("k-1"), RIDE)
            .await
            .status,
        500
    );
    // The dead request's lease has 30 s left; the client is told 2 s, not 30.
    let busy = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(busy.status, 409);
    let after: u64 = busy.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=2).contains(&after), "Retry-After {after}");
}

#[testdb::test(template = crate::common::migrated)]
async fn shutdown_waits_for_a_booking_whose_client_hung_up(pool: PgPool) {
    let (app, user_id, api_key) = app_with_user(pool).await;
    app.gateway.hold_charges();
    // The client gives up while its booking waits at the gateway.
    let hung_up = app
        .http
        .post(format!("{}/rides", app.base))
        .bearer_auth(&api_key)
        .header("idempotency-key", "k-1")
        .header("content-type", "application/json")
        .timeout(Duration::from_millis(300))
        .body(RIDE)
        .send()
        .await;
    assert!(hung_up.is_err(), "the client hung up");
    app.gateway.charges_held(1).await;
    let tasks = app.state.tasks.clone();
    tasks.close();
    assert_eq!(tasks.len(), 1, "the detached booking is tracked");
    app.gateway.release_charges();
    tokio::time::timeout(Duration::from_secs(10), tasks.wait())
        .await
        .expect("the booking ends, and the wait with it");
    assert_eq!(
        app.key_state(user_id).await,
        Some(("finished".to_owned(), false)),
        "the booking finished before the wait returned"
    );
}
