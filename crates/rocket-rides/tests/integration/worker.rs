//! The background work against a real PostgreSQL and a real fakestripe: completer, reaper,
//! outbox drain, lease heartbeat, graceful shutdown.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{TestApp, RIDE, TTL};
use fakestripe::Faults;
use idempotency::Claim;
use rocket_rides::config::{GatewayArgs, LeaseArgs, WorkerArgs};
use rocket_rides::failpoints;
use rocket_rides::problem::types;
use rocket_rides::worker::{completer, outbox, reaper};
use sqlx::PgPool;

fn settings() -> WorkerArgs {
    WorkerArgs::default()
}

/// Past the completer's grace (and so past every lease).
fn past_grace(app: &TestApp) {
    app.clock
        .advance(settings().completer_grace + Duration::from_secs(1));
}

/// A request for `key` that dies right after `point`.
async fn abandon(app: &TestApp, api_key: &str, key: &str, point: &'static str) {
    app.state.failpoints.arm(point);
    let reply = app.post_ride(Some(api_key), Some(key), RIDE).await;
    assert_eq!(reply.status, 500, "{reply:?}");
}

/// Eight requests that die after creating their rides, left past the completer's grace.
async fn abandon_eight_past_grace(app: &TestApp, api_key: &str) {
    for i in 0..8 {
        abandon(
            app,
            api_key,
            &format!("k-{i}"),
            failpoints::AFTER_RIDE_CREATED,
        )
        .await;
    }
    past_grace(app);
}

/// Keys acquired exactly twice: by their request, then by one completer.
async fn worked_by_one_completer(app: &TestApp) -> i64 {
    app.count("SELECT count(*) FROM idempotency_keys WHERE attempts = 2")
        .await
}

async fn unfinished(app: &TestApp) -> i64 {
    app.count("SELECT count(*) FROM idempotency_keys WHERE finished_at IS NULL")
        .await
}

#[testdb::test(template = crate::common::migrated)]
async fn the_completer_finishes_keys_abandoned_at_each_recovery_point(pool: PgPool) {
    let app = TestApp::start(pool).await;
    let (_, api_key) = app.user("rider@example.com", "tok_visa").await;
    let points = [
        failpoints::AFTER_RIDE_CREATED,
        failpoints::AFTER_GATEWAY_CHARGE,
        failpoints::AFTER_GATEWAY_CHARGE,
    ];
    for (i, point) in points.into_iter().enumerate() {
        abandon(&app, &api_key, &format!("k-{i}"), point).await;
    }
    // The third as an earlier version left it, with its charge recorded.
    app.as_left_at_charge_created("k-2").await;
    let at: Vec<String> =
        sqlx::query_scalar("SELECT recovery_point FROM idempotency_keys ORDER BY id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(at, ["ride_created", "ride_created", "charge_created"]);

    past_grace(&app);
    let report = completer::run_once(&app.state, &settings()).await.unwrap();
    assert_eq!((report.claimed, report.finished), (3, 3), "{report:?}");
    assert_eq!(unfinished(&app).await, 0);
    assert_eq!(app.rides().await, 3);
    assert_eq!(
        app.charges().await,
        3,
        "one charge per key, the derived key found the made one"
    );
    let paid = app
        .count(
            "SELECT count(*) FROM rides r JOIN fakestripe.charges c ON c.id = r.charge_id
             WHERE r.status = 'paid' AND c.amount = r.amount_cents",
        )
        .await;
    assert_eq!(paid, 3);
    // The client that comes back gets the answer the completer stored.
    for i in 0..3 {
        let reply = app
            .post_ride(Some(&api_key), Some(&format!("k-{i}")), RIDE)
            .await;
        assert_eq!(reply.status, 201);
        assert!(reply.replayed());
    }
    // And the receipts of the completed rides go out.
    assert_eq!(
        outbox::run_once(&app.state, 100).await.unwrap().delivered,
        3
    );
    assert_eq!(app.count("SELECT count(*) FROM ride_receipts").await, 3);
}

#[testdb::test(template = crate::common::migrated)]
async fn two_completers_at_once_never_work_the_same_key(pool: PgPool) {
    let app = Arc::new(TestApp::start(pool).await);
    let (_, api_key) = app.user("rider@example.com", "tok_visa").await;
    abandon_eight_past_grace(&app, &api_key).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let mut passes = Vec::new();
    for _ in 0..2 {
        let (app, barrier) = (app.clone(), barrier.clone());
        passes.push(tokio::spawn(async move {
            let settings = WorkerArgs {
                completer_batch: 5,
                ..settings()
            };
            barrier.wait().await;
            completer::run_once(&app.state, &settings).await.unwrap()
        }));
    }
    let mut claimed = 0;
    for pass in passes {
        let report = pass.await.unwrap();
        assert_eq!(report.claimed, report.finished, "{report:?}");
        claimed += report.claimed;
    }
    // Each key was acquired twice in all: by its request, then by exactly one completer.
    let twice = worked_by_one_completer(&app).await;
    assert_eq!(twice, claimed as i64);
    // Whatever the first pass left (batches of 5), a later pass finishes; nothing twice.
    completer::run_once(&app.state, &settings()).await.unwrap();
    assert_eq!(unfinished(&app).await, 0);
    assert_eq!(worked_by_one_completer(&app).await, 8);
    assert_eq!((app.rides().await, app.charges().await), (8, 8));
}

#[testdb::test(template = crate::common::migrated)]
async fn a_completer_skips_keys_another_completer_is_claiming_instead_of_waiting(pool: PgPool) {
    let app = TestApp::start(pool).await;
    let (_, api_key) = app.user("rider@example.com", "tok_visa").await;
    abandon_eight_past_grace(&app, &api_key).await;
    // Completer A is in the middle of its claim: it holds the row locks of four keys.
    let mut a = app.pool.begin().await.unwrap();
    let locked: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM idempotency_keys ORDER BY id LIMIT 4 FOR UPDATE")
            .fetch_all(&mut *a)
            .await
            .unwrap();
    // Completer B neither waits for A nor takes A's keys: it works the other four.
    let b = tokio::time::timeout(
        Duration::from_secs(10),
        completer::run_once(&app.state, &settings()),
    )
    .await
    .expect("completer B must not wait on completer A's locks")
    .unwrap();
    assert_eq!((b.claimed, b.finished), (4, 4));
    let untouched: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_keys WHERE id = ANY($1) AND attempts = 1",
    )
    .bind(&locked)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(untouched, 4);
    // A dies before committing; the next pass takes its four keys, each exactly once.
    a.rollback().await.unwrap();
    let next = completer::run_once(&app.state, &settings()).await.unwrap();
    assert_eq!((next.claimed, next.finished), (4, 4));
    assert_eq!(worked_by_one_completer(&app).await, 8);
    assert_eq!((app.rides().await, app.charges().await), (8, 8));
}

#[testdb::test(template = crate::common::migrated)]
async fn the_completer_leaves_live_leases_and_young_keys_alone(pool: PgPool) {
    let app = TestApp::start(pool).await;
    let (_, api_key) = app.user("rider@example.com", "tok_visa").await;
    abandon(&app, &api_key, "k-1", failpoints::AFTER_RIDE_CREATED).await;

    // The dead request's lease still runs.
    assert_eq!(
        completer::run_once(&app.state, &settings())
            .await
            .unwrap()
            .claimed,
        0
    );
    // The lease is over, but the key is younger than the grace: its client may still retry.
    app.clock.advance(TTL + Duration::from_secs(1));
    assert_eq!(
        completer::run_once(&app.state, &settings())
            .await
            .unwrap()
            .claimed,
        0
    );
    // Past the grace, the completer takes it.
    app.clock.advance(settings().completer_grace);
    let report = completer::run_once(&app.state, &settings()).await.unwrap();
    assert_eq!((report.claimed, report.finished), (1, 1));
}

#[testdb::test(template = crate::common::migrated)]
async fn a_key_whose_gateway_keeps_failing_is_retried_with_backoff_and_stays_unfinished(
    pool: PgPool,
) {
    let app = TestApp::start(pool).await;
    let (user_id, api_key) = app.user("rider@example.com", "tok_visa").await;
    abandon(&app, &api_key, "k-1", failpoints::AFTER_RIDE_CREATED).await;
    app.set_faults(Faults {
        fail_before_charge: 1.0,
        ..Faults::default()
    });
    past_grace(&app);

    let first = completer::run_once(&app.state, &settings()).await.unwrap();
    assert_eq!((first.claimed, first.retried), (1, 1));
    assert_eq!(
        app.key_state(user_id).await,
        Some(("ride_created".into(), false))
    );
    // Within the backoff (5 s), the key is left alone.
    assert_eq!(
        completer::run_once(&app.state, &settings())
            .await
            .unwrap()
            .claimed,
        0
    );
    app.clock.advance(Duration::from_secs(5));
    let second = completer::run_once(&app.state, &settings()).await.unwrap();
    assert_eq!(second.retried, 1);
    // The backoff doubled: 5 s is not enough now, 10 s is.
    app.clock.advance(Duration::from_secs(5));
    assert_eq!(
        completer::run_once(&app.state, &settings())
            .await
            .unwrap()
            .claimed,
        0
    );
    let key = app
        .state
        .store
        .list(idempotency::KeyFilter::Unfinished, 10)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(
        key.attempts, 3,
        "visible: the request and two completer attempts"
    );
    assert!(key.finished_at.is_none());
    assert_eq!(app.charges().await, 0);

    // The gateway recovers; the next attempt after the backoff finishes the key.
    app.set_faults(Faults::default());
    app.clock.advance(Duration::from_secs(5));
    let last = completer::run_once(&app.state, &settings()).await.unwrap();
    assert_eq!(last.finished, 1);
    assert_eq!((app.rides().await, app.charges().await), (1, 1));
}

#[testdb::test(template = crate::common::migrated)]
async fn the_reaper_deletes_only_finished_keys_past_retention_and_keeps_the_rides(pool: PgPool) {
    let app = TestApp::start(pool).await;
    let (_, api_key) = app.user("rider@example.com", "tok_visa").await;
    for i in 0..5 {
        assert_eq!(
            app.post_ride(Some(&api_key), Some(&format!("k-{i}")), RIDE)
                .await
                .status,
            201
        );
    }
    abandon(&app, &api_key, "stuck", failpoints::AFTER_RIDE_CREATED).await;
    let settings = WorkerArgs {
        reaper_batch: 2,
        ..settings()
    };

    // Within retention nothing goes.
    assert_eq!(reaper::run_once(&app.state, &settings).await.unwrap(), 0);
    app.clock
        .advance(settings.key_retention + Duration::from_secs(1));
    // Five finished keys in batches of two; the unfinished one stays whatever its age.
    assert_eq!(reaper::run_once(&app.state, &settings).await.unwrap(), 5);
    assert_eq!(app.keys().await, 1);
    assert_eq!(unfinished(&app).await, 1);
    assert_eq!(app.rides().await, 6);
    assert_eq!(
        app.count("SELECT count(*) FROM rides WHERE idempotency_key_id IS NULL")
            .await,
        5
    );

    // After reaping, the old key string starts a new request.
    let again = app.post_ride(Some(&api_key), Some("k-0"), RIDE).await;
    assert_eq!(again.status, 201);
    assert!(!again.replayed());
    assert_eq!(app.rides().await, 7);
}

/// Reaping a key makes PostgreSQL find the rows that reference it (`ON DELETE SET NULL` on the
/// ride's reference): each reference to the key table must lead an index of its table, or every
/// deleted key walks a whole index or table, and the reaper slows as rides accumulate.
#[sqlx::test(migrations = false)]
async fn every_reference_to_the_key_table_leads_an_index_for_the_reaper(pool: PgPool) {
    rocket_rides::db::migrate(&pool).await.unwrap();
    let references: Vec<(String, bool)> = sqlx::query_as(
        "SELECT f.conname::text,
                EXISTS (SELECT 1 FROM pg_index x
                        WHERE x.indrelid = f.conrelid AND x.indisvalid
                          AND x.indkey[0] = ANY (f.conkey))
         FROM pg_constraint f
         WHERE f.contype = 'f' AND f.confrelid = 'idempotency_keys'::regclass",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    // The ride's reference at least: not a test that finds nothing to check.
    assert!(
        references
            .iter()
            .any(|(name, _)| name == "rides_idempotency_key_fkey"),
        "{references:?}"
    );
    let unindexed: Vec<&str> = references
        .iter()
        .filter(|(_, indexed)| !indexed)
        .map(|(name, _)| name.as_str())
        .collect();
    assert!(unindexed.is_empty(), "no index leads with {unindexed:?}");
}

#[testdb::test(template = crate::common::migrated)]
async fn a_drain_that_fails_between_effect_and_delete_loses_no_receipt_and_makes_no_second(
    pool: PgPool,
) {
    let app = TestApp::start(pool).await;
    let (_, api_key) = app.user("rider@example.com", "tok_visa").await;
    for i in 0..2 {
        let booked = app
            .post_ride(Some(&api_key), Some(&format!("k-{i}")), RIDE)
            .await;
        assert_eq!(booked.status, 201, "{booked:?}");
    }
    app.state.failpoints.arm(failpoints::AFTER_RECEIPT_EFFECT);
    let err = outbox::run_once(&app.state, 100).await.unwrap_err();
    assert!(matches!(err, outbox::DrainError::Crashed(_)), "{err}");
    let state: Vec<(String, i64)> = sqlx::query_as(
        "SELECT 'receipts', count(*) FROM ride_receipts
         UNION ALL SELECT 'staged', count(*) FROM staged_jobs
         UNION ALL SELECT 'failed', count(*) FROM failed_jobs
         UNION ALL SELECT 'paid rides', count(*) FROM rides WHERE status = 'paid'",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        app.count("SELECT count(*) FROM ride_receipts").await,
        0,
        "{state:?}"
    );
    assert_eq!(
        app.count("SELECT count(*) FROM staged_jobs").await,
        2,
        "{state:?}"
    );

    assert_eq!(
        outbox::run_once(&app.state, 100).await.unwrap().delivered,
        2
    );
    assert_eq!(
        outbox::run_once(&app.state, 100).await.unwrap().delivered,
        0
    );
    assert_eq!(app.count("SELECT count(*) FROM ride_receipts").await, 2);
    assert_eq!(app.count("SELECT count(*) FROM staged_jobs").await, 0);
}

#[testdb::test(template = crate::common::migrated)]
async fn a_job_delivered_twice_makes_one_receipt(pool: PgPool) {
    let app = TestApp::start(pool).await;
    let (_, api_key) = app.user("rider@example.com", "tok_visa").await;
    app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    // The same job again, as a drain that died after its effect and before its commit of the
    // delete would leave it if effect and delete were not one transaction.
    sqlx::query(
        "INSERT INTO staged_jobs (user_id, job_name, job_args)
         SELECT user_id, job_name, job_args FROM staged_jobs",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        outbox::run_once(&app.state, 100).await.unwrap().delivered,
        2
    );
    assert_eq!(app.count("SELECT count(*) FROM ride_receipts").await, 1);
}

/// A `migrate` cut short after migration 20261206100001 leaves older jobs without `key_owner`
/// (tried: a kill 60 ms into the fill). The drain addresses each user's jobs by owner: without
/// its own fill it would pass such jobs over, at the head of the queue, and deliver nothing.
#[testdb::test(template = crate::common::migrated)]
async fn jobs_left_without_their_owner_by_a_cut_short_migrate_are_still_delivered(pool: PgPool) {
    let app = TestApp::start(pool).await;
    let (_, api_key) = app.user("rider@example.com", "tok_visa").await;
    for i in 0..3 {
        app.post_ride(Some(&api_key), Some(&format!("k-{i}")), RIDE)
            .await;
    }
    sqlx::query("UPDATE staged_jobs SET key_owner = NULL")
        .execute(&app.pool)
        .await
        .unwrap();
    // A batch of one: the unfilled job is the whole pass, as at the head of a long queue.
    let mut delivered = 0;
    for _ in 0..3 {
        delivered += outbox::run_once(&app.state, 1).await.unwrap().delivered;
    }
    assert_eq!(delivered, 3);
    assert_eq!(app.count("SELECT count(*) FROM ride_receipts").await, 3);
    assert_eq!(
        app.count("SELECT count(*) FROM ride_receipts WHERE key_owner = user_id::text")
            .await,
        3
    );
    assert_eq!(app.count("SELECT count(*) FROM staged_jobs").await, 0);
}

#[testdb::test(template = crate::common::migrated)]
async fn two_drains_at_once_deliver_every_receipt_exactly_once(pool: PgPool) {
    let app = Arc::new(TestApp::start(pool).await);
    let (_, api_key) = app.user("rider@example.com", "tok_visa").await;
    for i in 0..10 {
        app.post_ride(Some(&api_key), Some(&format!("k-{i}")), RIDE)
            .await;
    }
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let mut drains = Vec::new();
    for _ in 0..2 {
        let (app, barrier) = (app.clone(), barrier.clone());
        drains.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut delivered = 0;
            loop {
                match outbox::run_once(&app.state, 3).await.unwrap().delivered {
                    0 => return delivered,
                    n => delivered += n,
                }
            }
        }));
    }
    let mut delivered = 0;
    for drain in drains {
        delivered += drain.await.unwrap();
    }
    assert_eq!(delivered, 10);
    assert_eq!(app.count("SELECT count(*) FROM ride_receipts").await, 10);
    assert_eq!(app.count("SELECT count(*) FROM staged_jobs").await, 0);
}

async fn app_with_heartbeat(pool: PgPool) -> TestApp {
    let lease = LeaseArgs {
        lease_ttl: TTL,
        lease_heartbeat: Duration::from_millis(100),
    };
    TestApp::start_with_lease(pool, GatewayArgs::default(), lease).await
}

#[testdb::test(template = crate::common::migrated)]
async fn the_heartbeat_keeps_the_lease_of_a_slow_gateway_call(pool: PgPool) {
    let app = Arc::new(app_with_heartbeat(pool).await);
    let (_, api_key) = app.user("rider@example.com", "tok_visa").await;
    // The gateway holds the charge until the test lets it go: a call as slow as the test needs.
    app.gateway.hold_charges();
    let request = {
        let (app, api_key) = (app.clone(), api_key.clone());
        tokio::spawn(async move { app.post_ride(Some(&api_key), Some("k-1"), RIDE).await })
    };
    app.gateway.charges_held(1).await;
    let renewed = |app: Arc<TestApp>, beyond: Duration| async move {
        // The lease as renewed by the holder must end after the moved clock + most of a TTL.
        let deadline = app.clock_now() + beyond;
        testdb::until("the lease was renewed", Duration::from_secs(5), || async {
            let until: Option<time::OffsetDateTime> =
                sqlx::query_scalar("SELECT locked_until FROM idempotency_keys")
                    .fetch_one(&app.pool)
                    .await
                    .unwrap();
            until.is_some_and(|u| u > deadline).then_some(())
        })
        .await;
    };
    // Move time nearly a TTL on, twice, each time waiting for the holder to renew.
    for _ in 0..2 {
        app.clock.advance(TTL - Duration::from_secs(5));
        renewed(app.clone(), Duration::from_secs(20)).await;
    }
    // 50 s after the claim, a 30 s lease would be over; the renewed one is not.
    let second = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(second.status, 409);
    app.gateway.release_charges();
    let first = request.await.unwrap();
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!((app.rides().await, app.charges().await), (1, 1));
}

#[testdb::test(template = crate::common::migrated)]
async fn a_holder_whose_lease_was_taken_over_stops_and_writes_nothing(pool: PgPool) {
    let app = Arc::new(app_with_heartbeat(pool).await);
    let (user_id, api_key) = app.user("rider@example.com", "tok_visa").await;
    // The gateway holds the charge: without a heartbeat the holder would only learn of the
    // takeover after its call timed out (10 s), and answer 503 instead of stopping at once.
    app.gateway.hold_charges();
    let request = {
        let (app, api_key) = (app.clone(), api_key.clone());
        tokio::spawn(async move { app.post_ride(Some(&api_key), Some("k-1"), RIDE).await })
    };
    app.gateway.charges_held(1).await;
    // Another holder takes the key over while the first waits on the gateway. The first one's
    // heartbeat may renew between our clock move and our claim; then we move on and try again.
    let mut taker = None;
    for _ in 0..20 {
        app.expire_leases();
        let claim = app.claim(user_id, "k-1").await;
        match claim {
            Claim::Acquired(lease) => {
                taker = Some(lease);
                break;
            }
            Claim::InFlight { .. } => continue,
            other => panic!("the takeover should acquire: {other:?}"),
        }
    }
    let taker = taker.expect("the takeover acquires within a few tries");

    // The first holder's next heartbeat finds the lease gone: it stops with 409, writing nothing.
    let first = request.await.unwrap();
    assert_eq!(first.status, 409, "{first:?}");
    assert_eq!(first.problem_type(), types::LEASE_LOST);
    assert_eq!(
        app.key_state(user_id).await,
        Some(("ride_created".into(), true))
    );
    assert_eq!(
        app.count("SELECT count(*) FROM rides WHERE charge_id IS NOT NULL")
            .await,
        0
    );

    // The new holder carries on from ride_created under the same gateway key (the completer
    // and retry tests show that path); the test ends here, with the gateway call still running.
    drop(taker);
    app.gateway.release_charges();
}

#[testdb::test(template = crate::common::migrated)]
async fn sigterm_during_a_slow_request_exits_in_bounded_time_and_leaves_the_key_resumable(
    pool: PgPool,
) {
    let app = TestApp::start(pool).await;
    let (user_id, api_key) = app.user("rider@example.com", "tok_visa").await;
    app.gateway.hold_charges();

    // A real `rocket-rides serve` process, against the same database and gateway.
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let mut server = tokio::process::Command::new(env!("CARGO_BIN_EXE_rocket-rides"))
        .arg("serve")
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .args(["--metrics-listen", "127.0.0.1:0"])
        // The deadline may not be shorter than the gateway timeout: both short, so that the
        // held call ends within a second, by whichever comes first.
        .args(["--gateway-timeout", "1s", "--gateway-connect-timeout", "1s"])
        .args(["--lease-ttl", "6s", "--lease-heartbeat", "2s"])
        .arg("--shutdown-deadline")
        .arg("1s")
        .env("DATABASE_URL", common::url_of(&app.pool).await)
        .env("STRIPE_API_BASE", app.state.stripe.base())
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    testdb::until_every(
        "the server came up",
        Duration::from_millis(25),
        Duration::from_secs(10),
        || async {
            app.http
                .get(format!("{base}/healthz"))
                .send()
                .await
                .is_ok()
                .then_some(())
        },
    )
    .await;

    let request = {
        let (http, api_key, base) = (app.http.clone(), api_key.clone(), base.clone());
        tokio::spawn(async move {
            http.post(format!("{base}/rides"))
                .bearer_auth(api_key)
                .header("idempotency-key", "k-1")
                .header("content-type", "application/json")
                .body(RIDE)
                .send()
                .await
        })
    };
    // The request is inside its gateway call, which the gateway holds.
    app.gateway.charges_held(1).await;
    let pid = server.id().unwrap().to_string();
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(kill.success());

    let status = tokio::time::timeout(Duration::from_secs(10), server.wait())
        .await
        .expect("the server exits within the shutdown deadline and a margin")
        .unwrap();
    assert!(status.success(), "{status:?}");
    let answer = request.await.unwrap().unwrap();
    assert_eq!(answer.status(), 503);
    assert_eq!(answer.headers()["retry-after"], "1");
    // The key is free, at its recovery point: the retry, served by another instance, resumes.
    assert_eq!(
        app.key_state(user_id).await,
        Some(("ride_created".into(), false))
    );
    app.gateway.release_charges();
    let done = app.post_until_final(&api_key, "k-1", RIDE).await;
    assert_eq!(done.status, 201, "{done:?}");
    assert_eq!((app.rides().await, app.charges().await), (1, 1));
}

#[testdb::test(template = crate::common::migrated)]
async fn the_worker_counts_what_its_loops_did_on_its_metrics_endpoint(pool: PgPool) {
    let app = TestApp::start(pool).await;
    let (_, api_key) = app.user("rider@example.com", "tok_visa").await;
    abandon(&app, &api_key, "k-1", failpoints::AFTER_RIDE_CREATED).await;
    past_grace(&app);
    rocket_rides::worker::run_once(&app.state, &settings())
        .await
        .unwrap();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let router = rocket_rides::app::metrics_router(app.state.clone());
    tokio::spawn(rocket_rides::app::serve(
        listener,
        router,
        Default::default(),
        Default::default(),
        std::future::pending(),
    ));
    let text = app
        .http
        .get(format!("http://{address}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "completer_keys_total{outcome=\"claimed\"} 1",
        "completer_keys_total{outcome=\"finished\"} 1",
        "completer_keys_total{outcome=\"retried\"} 0",
        "outbox_receipts_delivered_total 1",
        "idempotency_keys_unfinished 0",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
}

#[testdb::test(template = crate::common::migrated)]
async fn the_completer_finishes_a_key_the_gateway_refuses_for_good_instead_of_retrying_forever(
    pool: PgPool,
) {
    let app = TestApp::start(pool).await;
    let (user_id, api_key) = app.user("rider@example.com", "tok_visa").await;
    abandon(&app, &api_key, "k-1", failpoints::AFTER_RIDE_CREATED).await;
    // Meanwhile the customer was deleted at the gateway: every charge of it is refused.
    let customer: String = sqlx::query_scalar("SELECT stripe_customer_id FROM users WHERE id = $1")
        .bind(user_id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let deleted = app
        .http
        .delete(format!(
            "{}/v1/customers/{customer}",
            app.state.stripe.base()
        ))
        .bearer_auth("sk_test_rocketrides")
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 200);
    past_grace(&app);
    // A refusal after an attempt whose outcome is unknown (the crash) is not final at once: the
    // customer's charges are listed first, once no call under the key can still be running.
    let report = completer::run_once(&app.state, &settings()).await.unwrap();
    assert_eq!((report.claimed, report.retried), (1, 1), "{report:?}");
    // Past its backoff but not the bound, the completer leaves the key alone: nothing could be
    // decided yet.
    app.clock
        .advance(settings().completer_backoff + Duration::from_secs(1));
    let report = completer::run_once(&app.state, &settings()).await.unwrap();
    assert_eq!(report.claimed, 0, "{report:?}");
    app.clock.advance(
        rocket_rides::config::DEFAULT_GATEWAY_PROCESSING_BOUND
            + rocket_rides::config::DEFAULT_LEASE_HEARTBEAT
            + Duration::from_secs(1),
    );
    let report = completer::run_once(&app.state, &settings()).await.unwrap();
    assert_eq!((report.claimed, report.finished), (1, 1), "{report:?}");
    assert_eq!(unfinished(&app).await, 0);
    // The client's late retry gets the stored refusal.
    let late = app.post_ride(Some(&api_key), Some("k-1"), RIDE).await;
    assert_eq!(late.status, 502);
    assert!(late.replayed());
    assert_eq!(late.problem_type(), types::PAYMENT_REFUSED);
    assert_eq!(app.charges().await, 0);
}

#[testdb::test(template = crate::common::migrated)]
async fn a_job_that_cannot_run_is_moved_aside_and_the_others_are_delivered(pool: PgPool) {
    let app = TestApp::start(pool).await;
    let (user_id, api_key) = app.user("rider@example.com", "tok_visa").await;
    // A job with unreadable arguments, staged before any good one: first in every batch.
    sqlx::query(
        "INSERT INTO staged_jobs (user_id, job_name, job_args)
         VALUES ($1, 'send_ride_receipt', '{\"ride\": \"seven\"}')",
    )
    .bind(user_id)
    .execute(&app.pool)
    .await
    .unwrap();
    for key in ["k-1", "k-2"] {
        assert_eq!(
            app.post_ride(Some(&api_key), Some(key), RIDE).await.status,
            201
        );
    }
    let drained = outbox::run_once(&app.state, 100).await.unwrap();
    assert_eq!(
        drained,
        outbox::Drained {
            delivered: 2,
            failed: 1
        }
    );
    assert_eq!(app.count("SELECT count(*) FROM ride_receipts").await, 2);
    assert_eq!(app.count("SELECT count(*) FROM staged_jobs").await, 0);
    // The next drain finds nothing left to do: the bad job no longer stands in the way.
    assert_eq!(
        outbox::run_once(&app.state, 100).await.unwrap(),
        outbox::Drained::default()
    );
    let mut conn = app.pool.acquire().await.unwrap();
    let mut pg = app.state.store.statements_on(&mut *conn);
    let failed = outbox::failed_jobs(&mut pg, 10).await.unwrap();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].user_id, Some(user_id));
    assert!(
        failed[0].error.contains("unreadable arguments"),
        "{}",
        failed[0].error
    );
    let metrics = app.state.metrics.render(None);
    assert!(metrics.contains("outbox_jobs_failed_total 1"), "{metrics}");

    // An operator lists them with `rocket-rides jobs list`.
    let listed = tokio::process::Command::new(env!("CARGO_BIN_EXE_rocket-rides"))
        .args(["jobs", "list"])
        .env("DATABASE_URL", common::url_of(&app.pool).await)
        .output()
        .await
        .unwrap();
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    let line: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(line["job_name"], "send_ride_receipt");
    assert_eq!(line["job_args"]["ride"], "seven");
}
