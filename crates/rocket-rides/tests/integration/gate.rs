//! The admission gate while a booking waits on something that is not the database: the gateway
//! (a held charge of the real fakestripe) or another request's answer (`Prefer: wait`). Such a
//! booking gives its slot back, so replays, reads and other bookings go on; and coming back, it
//! takes one again without being shed. Black-box over real HTTP, a limit of two slots.

use crate::common;

use std::time::Duration;

use common::{Reply, TestApp, RIDE};
use rocket_rides::config::HttpArgs;
use sqlx::{Connection, PgPool};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The gate's slots in these tests.
const SLOTS: u32 = 2;

/// Long enough that a slot freed while a request waits for it is found (the give-back follows
/// the signal the tests wait for by a few statements); a request that finds none in this time
/// is shed.
const WAIT: Duration = Duration::from_millis(500);

async fn gated(pool: PgPool) -> (TestApp, String) {
    let http = HttpArgs {
        admission_limit: Some(SLOTS),
        admission_wait: WAIT,
        ..Default::default()
    };
    let app = TestApp::start_with_edge(pool, http).await;
    let (_, api_key) = app.user("rider@example.com", "tok_visa").await;
    (app, api_key)
}

/// A finished booking: its key (to replay) and its ride's path (to read).
async fn booked(app: &TestApp, api_key: &str) -> (String, Reply) {
    let done = app.post_ride(Some(api_key), Some("done"), RIDE).await;
    assert_eq!(done.status, 201, "{done:?}");
    let path = format!("/rides/{}", done.json()["ride_id"]);
    (path, done)
}

/// A replay and a read of the finished booking, each answered, not shed: a slot was free.
async fn replay_and_read_go_on(app: &TestApp, api_key: &str, path: &str, done: &Reply) {
    let replay = app.post_ride(Some(api_key), Some("done"), RIDE).await;
    assert_eq!(replay.status, 201, "the replay was shed: {replay:?}");
    assert!(replay.replayed() && replay.body == done.body, "{replay:?}");
    let read = app.get(api_key, path).await;
    assert_eq!(read.status, 200, "the read was shed: {read:?}");
}

#[testdb::test(template = crate::common::migrated)]
async fn bookings_waiting_on_the_gateway_leave_their_slots_to_replays_reads_and_bookings(
    pool: PgPool,
) {
    let (app, api_key) = gated(pool).await;
    let (path, done) = booked(&app, &api_key).await;
    // As many bookings as the gate has slots, all at the gateway, which takes its time.
    app.gateway.hold_charges();
    let mut slow: Vec<_> = (0..SLOTS)
        .map(|i| app.spawn_booking(&api_key, &format!("slow-{i}"), false))
        .collect();
    app.gateway.charges_held(SLOTS as usize).await;
    replay_and_read_go_on(&app, &api_key, &path, &done).await;
    // A new booking is admitted too, and reaches the gateway.
    slow.push(app.spawn_booking(&api_key, "one-more", false));
    app.gateway.charges_held(SLOTS as usize + 1).await;

    app.gateway.release_charges();
    for booking in slow {
        let reply = booking.await.unwrap();
        assert_eq!(reply.status, 201, "{reply:?}");
    }
    assert_eq!(app.metric("http_requests_shed_total").await, 0.0);
    // One ride and one charge per key.
    let keys = i64::from(SLOTS) + 2;
    assert_eq!(app.keys().await, keys);
    assert_eq!(app.rides().await, keys);
    assert_eq!(app.charges().await, keys);
}

#[testdb::test(template = crate::common::migrated)]
async fn a_duplicate_waiting_with_prefer_wait_holds_no_slot(pool: PgPool) {
    let (app, api_key) = gated(pool).await;
    let (path, done) = booked(&app, &api_key).await;
    app.gateway.hold_charges();
    let holder = app.spawn_booking(&api_key, "held", false);
    app.gateway.charges_held(1).await;
    // As many duplicates as the gate has slots, each asking to wait for the holder's answer.
    let in_flight = r#"idempotency_claims_total{outcome="in_flight"}"#;
    let waiters: Vec<_> = (0..SLOTS)
        .map(|_| app.spawn_booking(&api_key, "held", true))
        .collect();
    testdb::until(
        "the duplicates all found the key held",
        Duration::from_secs(20),
        || async {
            assert!(
                !waiters.iter().any(|w| w.is_finished()),
                "a duplicate ended before they all found the key held"
            );
            (app.metric(in_flight).await >= f64::from(SLOTS)).then_some(())
        },
    )
    .await;
    // Every duplicate found the key held and waits: none holds a slot meanwhile.
    replay_and_read_go_on(&app, &api_key, &path, &done).await;

    app.gateway.release_charges();
    let first = holder.await.unwrap();
    assert_eq!(first.status, 201, "{first:?}");
    for waiter in waiters {
        let reply = waiter.await.unwrap();
        assert_eq!(reply.status, 201, "{reply:?}");
        assert!(reply.replayed() && reply.body == first.body, "{reply:?}");
    }
    assert_eq!(app.metric("http_requests_shed_total").await, 0.0);
    assert_eq!(app.charges().await, 2, "one charge per key");
}

#[testdb::test(template = crate::common::migrated)]
async fn requests_whose_bodies_are_still_arriving_hold_no_slot(pool: PgPool) {
    let (app, api_key) = gated(pool).await;
    let (path, done) = booked(&app, &api_key).await;
    // As many bookings as the gate has slots send their heads and the first bytes of their
    // bodies, and no more: a slow link, or a client that means to hold the gate.
    let address = app.base.trim_start_matches("http://").to_owned();
    let mut trickling = Vec::new();
    for i in 0..SLOTS {
        let mut stream = TcpStream::connect(&address).await.unwrap();
        let head = format!(
            "POST /rides HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api_key}\r\n\
             Idempotency-Key: trickle-{i}\r\nContent-Type: application/json\r\n\
             Content-Length: 200\r\n\r\n{{\"origin"
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        trickling.push(stream);
    }
    // Each request that follows, sent after those heads were in, finds a slot: none waits
    // behind the bodies, and none is shed (were a slot kept while its body arrives, each would
    // wait the whole wait and get a 503).
    for _ in 0..3 {
        replay_and_read_go_on(&app, &api_key, &path, &done).await;
    }
    let more = app.post_ride(Some(&api_key), Some("more"), RIDE).await;
    assert_eq!(more.status, 201, "{more:?}");
    assert_eq!(app.metric("http_requests_shed_total").await, 0.0);
    // A client without a valid API key is refused at once, its body not waited for (the
    // body-read timeout is 10 s).
    let mut stranger = TcpStream::connect(&address).await.unwrap();
    stranger
        .write_all(
            b"POST /rides HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n\
              Idempotency-Key: stranger\r\nContent-Type: application/json\r\n\
              Content-Length: 200\r\n\r\n{",
        )
        .await
        .unwrap();
    let mut status = [0u8; 12];
    tokio::time::timeout(Duration::from_secs(5), stranger.read_exact(&mut status))
        .await
        .expect("answered before its body came")
        .unwrap();
    assert_eq!(&status, b"HTTP/1.1 401");
    // The slow bodies never came: their requests wrote nothing.
    drop(trickling);
    assert_eq!(app.keys().await, 2, "the two bookings' keys only");
}

/// Sends the `rest` of a raw request sent with `Connection: close`; its answer, once the server
/// closed the connection (within 5 s).
async fn finish(stream: &mut TcpStream, rest: &[u8]) -> String {
    stream.write_all(rest).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer))
        .await
        .expect("answered and closed")
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

#[testdb::test(template = crate::common::migrated)]
async fn a_slow_body_is_admitted_again_as_a_new_request_and_shed_past_the_wait(pool: PgPool) {
    let (app, api_key) = gated(pool.clone()).await;
    let (other_id, other_key) = app.user("other@example.com", "tok_visa").await;
    // A booking sends its head and the start of its body: admitted, it gives its slot back
    // while the rest is awaited.
    let address = app.base.trim_start_matches("http://").to_owned();
    let mut slow = TcpStream::connect(&address).await.unwrap();
    let head = format!(
        "POST /rides HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Authorization: Bearer {api_key}\r\nIdempotency-Key: slow\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{}",
        RIDE.len(),
        &RIDE[..5]
    );
    slow.write_all(head.as_bytes()).await.unwrap();
    // And another, whose body will turn out not to be JSON.
    let mut bad = TcpStream::connect(&address).await.unwrap();
    bad.write_all(head.replace("slow", "bad").as_bytes())
        .await
        .unwrap();
    // Both slots are then taken, and kept: the other rider's bookings, stopped at their ride's
    // insert behind a lock this test holds. Both get in only if the slow one gave its slot back.
    let lock = RiderLock::take(&pool, other_id).await;
    let blocked: Vec<_> = (0..SLOTS)
        .map(|i| app.spawn_booking(&other_key, &format!("blocked-{i}"), false))
        .collect();
    lock.until_waited_on(&app, SLOTS as usize, &blocked).await;
    // The rest of the body comes. The request has written nothing yet: it asks for a slot as a
    // new request does, finds none within the wait, and is shed, not let in on credit past the
    // gate's count.
    let answer = finish(&mut slow, &RIDE.as_bytes()[5..]).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("over-capacity"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("retry-after: 1"),
        "{answer}"
    );
    // A body that fails is answered with its failure at once, not shed: it needs no slot.
    let refused = finish(&mut bad, "x".repeat(RIDE.len() - 5).as_bytes()).await;
    assert!(refused.starts_with("HTTP/1.1 400"), "{refused}");
    assert_eq!(app.metric("http_admission_overdrawn_total").await, 0.0);
    assert_eq!(app.metric("http_requests_shed_total").await, 1.0);

    lock.release().await;
    for booking in blocked {
        let reply = booking.await.unwrap();
        assert_eq!(reply.status, 201, "{reply:?}");
    }
    // The shed booking wrote nothing: its retry is a first attempt, and books.
    assert_eq!(app.keys().await, i64::from(SLOTS));
    let retry = app.post_ride(Some(&api_key), Some("slow"), RIDE).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed(), "{retry:?}");
}

#[testdb::test(template = crate::common::migrated)]
async fn a_booking_back_from_the_gateway_to_no_free_slot_is_not_shed(pool: PgPool) {
    let (app, api_key) = gated(pool.clone()).await;
    let (other_id, other_key) = app.user("other@example.com", "tok_visa").await;
    app.gateway.hold_charges();
    let away = app.spawn_booking(&api_key, "away", false);
    app.gateway.charges_held(1).await;
    // Meanwhile the other rider's bookings take both slots, and keep them: each stops at its
    // ride's insert, behind a lock this test holds on the rider's row.
    let lock = RiderLock::take(&pool, other_id).await;
    let blocked: Vec<_> = (0..SLOTS)
        .map(|i| app.spawn_booking(&other_key, &format!("blocked-{i}"), false))
        .collect();
    lock.until_waited_on(&app, SLOTS as usize, &blocked).await;
    // The gateway answers: the booking finds no slot free, waits, and goes on without one.
    app.gateway.release_charges();
    let reply = away.await.unwrap();
    assert_eq!(reply.status, 201, "shed half-way: {reply:?}");
    assert_eq!(app.metric("http_admission_overdrawn_total").await, 1.0);

    lock.release().await;
    for booking in blocked {
        let reply = booking.await.unwrap();
        assert_eq!(reply.status, 201, "{reply:?}");
    }
    assert_eq!(app.metric("http_requests_shed_total").await, 0.0);
    assert_eq!(app.charges().await, 3, "one charge per key");
}

/// A lock on a rider's row, which a booking of that rider waits for at its ride's insert (the
/// ride's reference to its user), holding its admission slot and a pooled connection: a
/// booking busy in the database for as long as a test needs.
pub(crate) struct RiderLock {
    /// In a transaction that holds the lock.
    connection: sqlx::PgConnection,
}

impl RiderLock {
    /// Locks user `user_id`'s row, on a connection of its own (not the service's pool).
    pub(crate) async fn take(pool: &PgPool, user_id: i64) -> Self {
        let mut connection = sqlx::PgConnection::connect(&common::url_of(pool).await)
            .await
            .unwrap();
        sqlx::raw_sql("BEGIN")
            .execute(&mut connection)
            .await
            .unwrap();
        sqlx::query("SELECT 1 FROM users WHERE id = $1 FOR UPDATE")
            .bind(user_id)
            .execute(&mut connection)
            .await
            .unwrap();
        Self { connection }
    }

    /// Resolves once `count` statements wait on a lock in the test's database, the bookings
    /// behind this one (bounded; panics when one of `bookings` ended first).
    pub(crate) async fn until_waited_on(
        &self,
        app: &TestApp,
        count: usize,
        bookings: &[tokio::task::JoinHandle<Reply>],
    ) {
        testdb::until(
            "the bookings all reached the lock",
            Duration::from_secs(20),
            || async {
                assert!(
                    !bookings.iter().any(|b| b.is_finished()),
                    "a booking ended before they all reached the lock"
                );
                (testdb::lock_waits(&app.pool).await == count as i64).then_some(())
            },
        )
        .await;
    }

    /// Lets the bookings behind it go on.
    pub(crate) async fn release(mut self) {
        sqlx::raw_sql("ROLLBACK")
            .execute(&mut self.connection)
            .await
            .unwrap();
    }
}
