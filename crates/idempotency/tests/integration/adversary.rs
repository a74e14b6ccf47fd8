//! Adversarial tests of the library, black-box, through its public API over a real PostgreSQL:
//! the lease kit under a stuck renewal, completers racing each other, the reaper racing claims
//! of expired keys, the owned final phase and the abandon of a stale holder, and the migrations
//! bookkeeping under a search path of several schemas.
//!
//! Each test names the interleaving it forces and the safe outcome it expects. Some found real
//! bugs when they were written (a renewal stuck on an exhausted pool; a
//! migrate that adopted another schema's bookkeeping), fixed since; they stay as regression tests.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency::runner::DEFAULT_GRACE;
use idempotency::{
    Abandoned, Claim, Completer, DatabaseClock, Error, Fingerprint, IdempotencyKey, Lease,
    ManualClock, NewRequest, OffsetDateTime, OneStep, Owner, Resumed, Store, StoredResponse,
};
use serde_json::{json, Value};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

const ROUTE: &str = "/attacks";

fn key(s: &str) -> IdempotencyKey {
    IdempotencyKey::parse(s.as_bytes()).unwrap()
}

fn request<'a>(owner: &'a Owner, key: &'a IdempotencyKey, body: &'a Value) -> NewRequest<'a> {
    NewRequest {
        owner,
        method: "POST",
        route: ROUTE,
        key,
        fingerprint: Fingerprint::of_json("POST", ROUTE, body),
        params: body,
    }
}

fn acquired(claim: Claim<OneStep>) -> Lease<OneStep> {
    match claim {
        Claim::Acquired(lease) => lease,
        other => panic!("expected an acquired lease, got {other:?}"),
    }
}

fn answer(body: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        body: body.as_bytes().to_vec(),
    }
}

/// Waits (bounded) until the one key's lease has ended by the database's clock.
async fn lease_ended_in_the_database(pool: &PgPool) {
    testdb::until(
        "the lease ended in the database",
        Duration::from_secs(30),
        || async {
            sqlx::query_scalar::<_, bool>("SELECT locked_until < now() FROM idempotency_keys")
                .fetch_one(pool)
                .await
                .unwrap()
                .then_some(())
        },
    )
    .await;
}

/// A clock on a whole second, so that times computed in Rust and in SQL meet exactly.
fn whole_second_clock() -> ManualClock {
    let second = OffsetDateTime::now_utc().unix_timestamp();
    ManualClock::new(OffsetDateTime::from_unix_timestamp(second).unwrap())
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

// ---------------------------------------------------------------------------------------------
// 1. The lease kit: a renewal that cannot get a connection
// ---------------------------------------------------------------------------------------------

/// Interleaving: a holder runs a foreign call on a task of its own under `watch_under_lease`
/// (as the layer's default mode runs its handler). At the first beat the store's pool is
/// exhausted (every connection busy with other requests), so the renewal waits for a connection
/// for the pool's `acquire_timeout`, longer than the lease has left. The lease ends in the
/// database; another process (its own pool) takes the key over and starts the call again.
///
/// Safe outcome: the kit stops vouching for the lease before it ends (it returns an error no
/// later than the lease's end by its own clock), so that the caller aborts the call before the
/// new holder may start: never two calls at once.
///
/// What happens: the renewal is not bounded by the lease. `watch_under_lease` stays inside the
/// renewal until the pool frees a connection (5 s here; sqlx's default `acquire_timeout` is
/// 30 s, the default TTL 30 s and heartbeat 10 s, so with the defaults up to 10 s past the
/// lease), the watched task keeps running, and the first call makes its effect after the
/// takeover: two holders' calls overlap.
#[testdb::test(template = crate::migrated)]

async fn a_renewal_stuck_on_an_exhausted_pool_lets_the_call_outlive_its_lease(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    const TTL: Duration = Duration::from_secs(2);
    // The holder's process: a pool of one connection, and a long acquire timeout.
    let small = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(8))
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    let holder = Store::new(small.clone(), Arc::new(DatabaseClock), TTL)
        .unwrap()
        .with_heartbeat(Duration::from_millis(400))
        .unwrap();
    // Another API process, with its own pool.
    let other = Store::new(pool.clone(), Arc::new(DatabaseClock), TTL).unwrap();
    let (k, body) = (key("stuck-renewal"), json!({"cents": 500}));

    let claimed_at = Instant::now();
    let mut lease = acquired(
        holder
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    // Load: the pool's one connection is busy until the key has been taken over.
    let hog = small.acquire().await.unwrap();

    let effects = Arc::new(AtomicUsize::new(0));
    let effect_of_first = Arc::new(Mutex::new(None::<Instant>));
    let (e, at) = (effects.clone(), effect_of_first.clone());
    let (taken, mut work_done) = tokio::sync::watch::channel(false);
    // The foreign call: work that outlasts the lease (it ends when another holder has the key),
    // then its effect.
    let mut call = tokio::spawn(async move {
        let _ = work_done.wait_for(|done| *done).await;
        e.fetch_add(1, Ordering::SeqCst);
        *at.lock().unwrap() = Some(Instant::now());
    });
    // The retry on the other process, once the lease has ended in the database.
    let (o, k2, b2) = (other.clone(), k.clone(), body.clone());
    let takeover = tokio::spawn(async move {
        lease_ended_in_the_database(o.pool()).await;
        let claim = o
            .claim::<OneStep>(request(&Owner::from(1), &k2, &b2))
            .await
            .unwrap();
        let taken_at = Instant::now();
        drop(hog);
        let _ = taken.send(true);
        (matches!(claim, Claim::Acquired(_)), taken_at)
    });

    let watched = holder.watch_under_lease(&mut lease, &mut call).await;
    let returned_after = claimed_at.elapsed();
    if watched.is_err() {
        call.abort();
        let _ = call.await;
    }
    let (taken_over, taken_at) = takeover.await.unwrap();
    let first_effect = *effect_of_first.lock().unwrap();
    let overlapped = taken_over && first_effect.is_some_and(|at| at > taken_at);
    assert!(
        !overlapped,
        "the first holder's call made its effect after another holder took the key over \
         (watch returned {watched:?} after {returned_after:?}, the lease was {TTL:?})"
    );
    assert!(
        returned_after <= TTL + Duration::from_millis(200),
        "the kit vouched for the lease past its end: it returned after {returned_after:?}"
    );
}

/// Interleaving: as above, but the pool's `acquire_timeout` is shorter than a beat: each
/// renewal fails at once, is tried again while the lease lasts past the next beat, and then the
/// kit gives up. This is the case the kit was built for, kept as a regression test.
///
/// Safe outcome: `watch_under_lease` returns the pool's error before the lease ends, the caller
/// aborts the call, and the call never makes its effect.
///
/// Mutation that fails it: retrying a failed renewal for ever (`Err(e) if true => warn`), or
/// giving up only on `LeaseLost`.
#[testdb::test(template = crate::migrated)]
async fn renewals_that_fail_fast_stop_the_call_before_the_lease_ends(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    const TTL: Duration = Duration::from_secs(2);
    let small = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(100))
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    let holder = Store::new(small.clone(), Arc::new(DatabaseClock), TTL)
        .unwrap()
        .with_heartbeat(Duration::from_millis(400))
        .unwrap();
    let (k, body) = (key("fast-failure"), json!({"cents": 500}));
    let claimed_at = Instant::now();
    let mut lease = acquired(
        holder
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    let hog = small.acquire().await.unwrap();
    let effects = Arc::new(AtomicUsize::new(0));
    let e = effects.clone();
    // A call whose work ends only when the test says (after the kit has given up): a kit that
    // vouches on is caught by the bound below, not by a call that happened to end.
    let (work_done, mut done) = tokio::sync::watch::channel(false);
    let mut call = tokio::spawn(async move {
        let _ = done.wait_for(|done| *done).await;
        e.fetch_add(1, Ordering::SeqCst);
    });
    let watched = tokio::time::timeout(TTL * 2, holder.watch_under_lease(&mut lease, &mut call))
        .await
        .expect("the kit stopped vouching for the lease while it lasted");
    let returned_after = claimed_at.elapsed();
    assert!(
        matches!(watched, Err(Error::Database { .. })),
        "{watched:?}"
    );
    assert!(returned_after < TTL, "returned after {returned_after:?}");
    call.abort();
    // The aborted call has ended once awaited: its work can no longer make the effect.
    let _ = call.await;
    let _ = work_done.send(true);
    drop(hog);
    assert_eq!(effects.load(Ordering::SeqCst), 0);
    // The lease is still this holder's (nobody took it): it can be released.
    holder.release(lease).await.unwrap();
}

/// Interleaving: the call completes while the renewal of the same beat finds the lease taken
/// over (the holder's clock was moved past the lease and another request took the key).
/// `call_under_lease` does not poll the call while it renews, so the two cannot both "win"; the
/// kit must then report the loss, and the stale holder's phases must be refused.
///
/// Safe outcome: whatever the kit answers, the stale holder can neither open a phase nor finish
/// nor release the key; the new holder finishes it, once.
///
/// Mutation that fails it: a fence that does not compare `lease_token` (the final phase's
/// `SELECT … FOR UPDATE` without `lease_token = $3`).
#[testdb::test(template = crate::migrated)]
async fn a_call_finishing_as_its_lease_is_lost_leaves_the_stale_holder_unable_to_write(
    pool: PgPool,
) {
    idempotency::migrate(&pool).await.unwrap();
    const TTL: Duration = Duration::from_secs(3);
    let clock = ManualClock::starting_now();
    let store = Store::new(pool.clone(), Arc::new(clock.clone()), TTL)
        .unwrap()
        .with_heartbeat(Duration::from_millis(100))
        .unwrap();
    let (k, body) = (key("photo-finish"), json!({"cents": 500}));
    let mut stale = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    let slot: Arc<Mutex<Option<Lease<OneStep>>>> = Arc::default();
    let (other, k2, b2, put) = (store.clone(), k.clone(), body.clone(), slot.clone());
    // Whichever wins the photo finish (the call's end or the renewal's loss) is acceptable;
    // what matters is what the stale holder can do after.
    let _outcome = store
        .call_under_lease(&mut stale, async move {
            clock.advance(TTL + Duration::from_secs(1));
            let fresh = acquired(
                other
                    .claim(request(&Owner::from(1), &k2, &b2))
                    .await
                    .unwrap(),
            );
            *put.lock().unwrap() = Some(fresh);
            // Finish just as the next beat is due.
            tokio::time::sleep(Duration::from_millis(100)).await;
        })
        .await;
    // The kit may stop the call before its takeover (the lease ran out by the holder's clock,
    // so the next beat stops it without asking): then the takeover comes after.
    let taken = slot.lock().unwrap().take();
    let mut fresh = match taken {
        Some(fresh) => fresh,
        None => acquired(
            store
                .claim(request(&Owner::from(1), &k, &body))
                .await
                .unwrap(),
        ),
    };
    assert!(matches!(
        store.final_phase(&mut stale).await,
        Err(Error::LeaseLost { .. })
    ));
    assert!(matches!(
        store.renew(&mut stale).await,
        Err(Error::LeaseLost { .. })
    ));
    assert!(matches!(
        store.release(stale).await,
        Err(Error::LeaseLost { .. })
    ));
    let phase = store.final_phase(&mut fresh).await.unwrap();
    phase.finish(&answer("once")).await.unwrap();
    assert!(matches!(
        store.claim::<OneStep>(request(&Owner::from(1), &k, &body)).await.unwrap(),
        Claim::Replay(r) if r.body == b"once"
    ));
}

// ---------------------------------------------------------------------------------------------
// 2. The runners
// ---------------------------------------------------------------------------------------------

async fn abandoned_keys(store: &Store, n: usize) {
    for i in 0..n {
        let (k, body) = (key(&format!("abandoned-{i}")), json!({"i": i}));
        let lease = acquired(
            store
                .claim(request(&Owner::from(1 + (i as i64 % 3)), &k, &body))
                .await
                .unwrap(),
        );
        store.release(lease).await.unwrap();
    }
}

/// Interleaving: two completers (two worker processes) run passes at the same moment over the
/// same 24 abandoned keys; each closure makes a foreign effect (counted per key), then finishes
/// the key.
///
/// Safe outcome: each key's closure runs exactly once across both completers, every key ends
/// finished, and both passes together finish exactly 24.
///
/// Mutation that fails it: the completer's claim without `FOR UPDATE SKIP LOCKED` and without
/// the re-check of `locked_until` in its `UPDATE` (two completers then take the same key).
#[testdb::test(template = crate::migrated)]
async fn two_completers_at_once_run_each_abandoned_key_once(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let clock = ManualClock::starting_now();
    let store = Store::new(
        pool.clone(),
        Arc::new(clock.clone()),
        Duration::from_secs(30),
    )
    .unwrap();
    abandoned_keys(&store, 24).await;
    clock.advance(DEFAULT_GRACE + Duration::from_secs(1));
    let runs: Arc<Mutex<Vec<i64>>> = Arc::default();
    let completer = |store: Store| {
        let runs = runs.clone();
        let completer = Completer::new(store.clone(), "POST", ROUTE)
            .concurrency(3)
            .batch(100);
        async move {
            completer
                .run_once(move |mut lease: Lease<OneStep>| {
                    let (store, runs) = (store.clone(), runs.clone());
                    async move {
                        runs.lock().unwrap().push(lease.key_id());
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        match store.final_phase(&mut lease).await {
                            Ok(phase) => match phase.finish(&answer("completed")).await {
                                Ok(()) => Resumed::Finished,
                                Err(Error::LeaseLost { .. }) => Resumed::Lost,
                                Err(e) => Resumed::failed(lease, e),
                            },
                            Err(Error::LeaseLost { .. }) => Resumed::Lost,
                            Err(e) => Resumed::failed(lease, e),
                        }
                    }
                })
                .await
                .unwrap()
        }
    };
    // Two stores over two pools: two processes.
    let second_pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    let second = Store::new(second_pool, Arc::new(clock), Duration::from_secs(30)).unwrap();
    let (a, b) = tokio::join!(completer(store.clone()), completer(second));
    let mut runs = runs.lock().unwrap().clone();
    let total = runs.len();
    runs.sort_unstable();
    runs.dedup();
    assert_eq!(total, runs.len(), "a key was resumed twice: {a:?} {b:?}");
    assert_eq!(a.finished + b.finished, 24, "{a:?} {b:?}");
    assert_eq!(a.lost + b.lost, 0, "{a:?} {b:?}");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE finished_at IS NULL"
        )
        .await,
        0
    );
    assert_eq!(store.count_unfinished().await.unwrap(), 0);
}

/// Interleaving: the application's closure lies (says `Finished` without finishing), and
/// another panics. Neither may make the completer drop its key or invent an outcome.
///
/// Safe outcome: both keys stay unfinished and unanswered (no stored response). The liar's key
/// is claimed again once its lease is over; the panicked one is released with the completer's
/// backoff, as a failure would be, and claimed again after it, not before. A correct closure
/// then finishes both.
///
/// Mutation that fails it: a completer that marks the key finished (or deletes it from
/// `idempotency_keys_unfinished`) on the closure's word; one that leaves a panicked key locked
/// until its lease runs out and retries it at once.
#[testdb::test(template = crate::migrated)]
async fn a_lying_or_panicking_closure_leaves_its_key_to_the_next_pass(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    const TTL: Duration = Duration::from_secs(5);
    let clock = ManualClock::starting_now();
    let store = Store::new(pool.clone(), Arc::new(clock.clone()), TTL).unwrap();
    abandoned_keys(&store, 2).await;
    clock.advance(DEFAULT_GRACE + Duration::from_secs(1));
    let completer = Completer::new(store.clone(), "POST", ROUTE)
        .backoff(Duration::from_secs(60), Duration::from_secs(60));
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let pass = completer
        .run_once(move |lease: Lease<OneStep>| {
            let n = c.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    // Lies: "finished", and drops the lease.
                    drop(lease);
                    Resumed::Finished
                } else {
                    panic!("the closure's own bug");
                }
            }
        })
        .await
        .unwrap();
    assert_eq!((pass.finished, pass.panicked), (1, 1), "{pass:?}");
    assert_eq!(store.count_unfinished().await.unwrap(), 2);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE response_status IS NOT NULL"
        )
        .await,
        0
    );
    // While the leases last, nobody takes them.
    let idle = completer
        .run_once(|_lease: Lease<OneStep>| async { Resumed::Finished })
        .await
        .unwrap();
    assert_eq!(idle.claimed, 0, "{idle:?}");
    // The panicked key is free, and kept from completers for the backoff.
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys
             WHERE locked_until IS NULL AND next_attempt_at IS NOT NULL"
        )
        .await,
        1
    );
    let finish = |store: Store| {
        move |mut lease: Lease<OneStep>| {
            let s = store.clone();
            async move {
                let phase = s.final_phase(&mut lease).await.unwrap();
                phase.finish(&answer("done")).await.unwrap();
                Resumed::Finished
            }
        }
    };
    // After the liar's lease, a correct closure finishes its key; the other waits out its backoff.
    clock.advance(TTL + Duration::from_secs(1));
    let pass = completer.run_once(finish(store.clone())).await.unwrap();
    assert_eq!((pass.claimed, pass.finished), (1, 1), "{pass:?}");
    clock.advance(Duration::from_secs(60));
    let pass = completer.run_once(finish(store.clone())).await.unwrap();
    assert_eq!((pass.claimed, pass.finished), (1, 1), "{pass:?}");
    assert_eq!(store.count_unfinished().await.unwrap(), 0);
}

/// Interleaving: a completer's attempt fails and the key is released with a backoff; another
/// completer pass comes during the backoff; the client's own retry comes during the backoff
/// too; then, past the backoff, the completer passes again.
///
/// Safe outcome: the completer stays away during the backoff; the client's retry claims the key
/// at once (the backoff keeps only completers away) and finishes it; the later pass finds
/// nothing to do.
///
/// Mutation that fails it: a completer claim that ignores `next_attempt_at`, or a request's
/// claim that honours it.
#[testdb::test(template = crate::migrated)]
async fn a_client_retry_during_the_completers_backoff_wins_and_the_completer_stays_away(
    pool: PgPool,
) {
    idempotency::migrate(&pool).await.unwrap();
    let clock = ManualClock::starting_now();
    let store = Store::new(
        pool.clone(),
        Arc::new(clock.clone()),
        Duration::from_secs(5),
    )
    .unwrap();
    let (k, body) = (key("abandoned-0"), json!({"i": 0}));
    let lease = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    store.release(lease).await.unwrap();
    clock.advance(DEFAULT_GRACE + Duration::from_secs(1));
    let completer = Completer::new(store.clone(), "POST", ROUTE)
        .backoff(Duration::from_secs(60), Duration::from_secs(600));
    let pass = completer
        .run_once(|lease: Lease<OneStep>| async move { Resumed::failed(lease, "gateway away") })
        .await
        .unwrap();
    assert_eq!(pass.retried, 1);
    let runs = Arc::new(AtomicUsize::new(0));
    let counting = |runs: Arc<AtomicUsize>| {
        move |lease: Lease<OneStep>| {
            runs.fetch_add(1, Ordering::SeqCst);
            async move { Resumed::failed(lease, "should not run") }
        }
    };
    clock.advance(Duration::from_secs(30));
    let pass = completer.run_once(counting(runs.clone())).await.unwrap();
    assert_eq!(
        pass.claimed, 0,
        "the completer ignored its backoff: {pass:?}"
    );
    let mut mine = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    store
        .final_phase(&mut mine)
        .await
        .unwrap()
        .finish(&answer("client"))
        .await
        .unwrap();
    clock.advance(Duration::from_secs(31));
    let pass = completer.run_once(counting(runs.clone())).await.unwrap();
    assert_eq!(pass.claimed, 0, "{pass:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

// ---------------------------------------------------------------------------------------------
// 3. Expiry at read and the reaper
// ---------------------------------------------------------------------------------------------

const RETENTION: Duration = Duration::from_secs(24 * 3600);

async fn finished(store: &Store, name: &str, body: &Value, answer_body: &str) -> i64 {
    let k = key(name);
    let mut lease = acquired(
        store
            .claim(request(&Owner::from(1), &k, body))
            .await
            .unwrap(),
    );
    let id = lease.key_id();
    store
        .final_phase(&mut lease)
        .await
        .unwrap()
        .finish(&answer(answer_body))
        .await
        .unwrap();
    id
}

/// Interleaving: two keys finished at the same instant; the clock stands exactly `retention`
/// later (to the microsecond); a claim of one and a reaper pass run on the same clock; then one
/// microsecond later, both again.
///
/// Safe outcome: at the boundary neither key is expired for either (a replay, and the reaper
/// keeps both); just past it, a claim is a new request and the reaper deletes the other. The
/// two never disagree, so a late retry's fate does not depend on when the reaper ran.
///
/// Mutation that fails it: `<=` in one of the two age tests but not the other.
#[testdb::test(template = crate::migrated)]
async fn a_key_exactly_at_the_retention_boundary_is_kept_by_both_claim_and_reaper(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let clock = whole_second_clock();
    let store = Store::new(
        pool.clone(),
        Arc::new(clock.clone()),
        Duration::from_secs(30),
    )
    .unwrap()
    .with_retention(RETENTION)
    .unwrap();
    let body = json!({"cents": 1});
    finished(&store, "boundary", &body, "first").await;
    let other = finished(&store, "boundary-too", &body, "second").await;
    clock.advance(RETENTION);
    assert_eq!(store.reap_expired(100).await.unwrap(), 0);
    let k = key("boundary");
    assert!(matches!(
        store.claim::<OneStep>(request(&Owner::from(1), &k, &body)).await.unwrap(),
        Claim::Replay(r) if r.body == b"first"
    ));
    clock.advance(Duration::from_micros(1));
    let lease = acquired(
        store
            .claim::<OneStep>(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    assert_eq!(lease.token(), 1, "a new request");
    assert_eq!(store.reap_expired(100).await.unwrap(), 1);
    assert!(store.find(other).await.unwrap().is_none());
    assert!(store.find(lease.key_id()).await.unwrap().is_some());
    store.release(lease).await.unwrap();
}

/// Interleaving: a claim of an expired key has deleted the old row and inserted the new one in
/// its open transaction (`Store::begin`), when a reaper pass and a second claim run; then the
/// first claim commits its first phase.
///
/// Safe outcome: the reaper deletes nothing of the new key (it never sees the uncommitted row,
/// and the old one is the claim's), the second claim gets no lease (it waits, then finds the
/// key held), and exactly one request runs under the expired key's name.
///
/// Mutation that fails it: a reaper whose delete does not re-check `finished_at` (it would
/// delete a new, unfinished key), or an expiry delete not fenced on `finished_at`.
#[testdb::test(template = crate::migrated)]
async fn a_claim_of_an_expired_key_racing_the_reaper_and_another_claim_runs_once(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let clock = whole_second_clock();
    let store = Store::new(
        pool.clone(),
        Arc::new(clock.clone()),
        Duration::from_secs(30),
    )
    .unwrap()
    .with_retention(RETENTION)
    .unwrap();
    let body = json!({"cents": 1});
    let old = finished(&store, "expiring", &body, "old").await;
    clock.advance(RETENTION + Duration::from_secs(1));
    let k = key("expiring");
    let first = match store
        .begin::<OneStep>(request(&Owner::from(1), &k, &body), OneStep::Started)
        .await
        .unwrap()
    {
        idempotency::Begun::New(first) => first,
        other => panic!("expected a new key, got {other:?}"),
    };
    let new_id = first.lease().key_id();
    assert_ne!(new_id, old);
    let reaper = store.clone();
    let reaping = tokio::spawn(async move { reaper.reap_expired(100).await.unwrap() });
    let (s2, k2, b2) = (store.clone(), k.clone(), body.clone());
    let second = tokio::spawn(async move {
        s2.claim::<OneStep>(request(&Owner::from(1), &k2, &b2))
            .await
            .unwrap()
    });
    // The second claim waits on the new key's insert, and the reaper on the old row the first
    // claim deleted (or has ended, having seen nothing to reap), before the first commits.
    let watcher = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    testdb::until(
        "the second claim and the reaper wait on the first claim's transaction",
        Duration::from_secs(10),
        || async {
            let waiting = testdb::lock_waits(&watcher).await;
            (waiting >= 2 || (waiting >= 1 && reaping.is_finished())).then_some(())
        },
    )
    .await;
    let lease = first.commit().await.unwrap();
    let reaped = reaping.await.unwrap();
    let second = second.await.unwrap();
    assert!(
        matches!(second, Claim::InFlight { .. }),
        "the second claim got {second:?}"
    );
    assert!(reaped <= 1, "reaped {reaped}");
    assert!(
        store.find(new_id).await.unwrap().is_some(),
        "the new key was reaped"
    );
    assert!(store.find(old).await.unwrap().is_none());
    store.release(lease).await.unwrap();
    assert_eq!(store.count_unfinished().await.unwrap(), 1);
}

/// Interleaving: the reaper runs on a store whose clock is ahead of the claims' (a misconfigured
/// worker), or behind.
///
/// Safe outcome: neither can delete an unfinished key, however far ahead its clock; a clock
/// behind deletes nothing that has not expired.
///
/// Mutation that fails it: a reaper delete without `finished_at IS NOT NULL`.
#[testdb::test(template = crate::migrated)]
async fn a_reaper_with_its_clock_far_ahead_never_deletes_an_unfinished_key(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    let clock = whole_second_clock();
    let store = Store::new(
        pool.clone(),
        Arc::new(clock.clone()),
        Duration::from_secs(30),
    )
    .unwrap()
    .with_retention(RETENTION)
    .unwrap();
    let body = json!({"cents": 1});
    let done = finished(&store, "done", &body, "x").await;
    let k = key("open");
    let open = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    let open_id = open.key_id();
    store.release(open).await.unwrap();
    let ahead = ManualClock::new(OffsetDateTime::now_utc() + Duration::from_secs(100 * 24 * 3600));
    let reaper = Store::new(pool.clone(), Arc::new(ahead), Duration::from_secs(30))
        .unwrap()
        .with_retention(RETENTION)
        .unwrap();
    let behind = ManualClock::new(OffsetDateTime::now_utc() - Duration::from_secs(100 * 24 * 3600));
    let late = Store::new(pool.clone(), Arc::new(behind), Duration::from_secs(30))
        .unwrap()
        .with_retention(RETENTION)
        .unwrap();
    assert_eq!(late.reap_expired(100).await.unwrap(), 0);
    assert_eq!(reaper.reap_expired(100).await.unwrap(), 1);
    assert!(store.find(done).await.unwrap().is_none());
    assert!(store.find(open_id).await.unwrap().is_some());
}

// ---------------------------------------------------------------------------------------------
// 4. The owned final phase and abandon_or_release by a stale holder
// ---------------------------------------------------------------------------------------------

/// Interleaving: holder A opens its owned final phase (the key row locked); A's lease runs out
/// by the clock while it writes; B's claim comes. Then A finishes.
///
/// Safe outcome: B's claim cannot take the key over while A's transaction holds the row: it is
/// answered in flight at once (the takeover locks `NOWAIT`, and holds no connection waiting);
/// once A finishes, B's retry replays A's answer. One effect.
///
/// Mutation that fails it: a final phase that fences without locking the row (`SELECT 1 …`
/// without `FOR UPDATE`): B would take the key over and both would write.
#[testdb::test(template = crate::migrated)]
async fn a_takeover_waits_for_an_owned_final_phase_past_its_lease_and_replays_it(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    sqlx::query("CREATE TABLE effects (key_id BIGINT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    const TTL: Duration = Duration::from_secs(3);
    let clock = ManualClock::starting_now();
    let store = Store::new(pool.clone(), Arc::new(clock.clone()), TTL).unwrap();
    let (k, body) = (key("owned"), json!({"cents": 1}));
    let lease = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    let mut phase = store.final_phase_owned(lease).await.unwrap();
    sqlx::query("INSERT INTO effects VALUES ($1)")
        .bind(phase.lease().key_id())
        .execute(phase.conn())
        .await
        .unwrap();
    clock.advance(TTL + Duration::from_secs(1));
    let during = store
        .claim::<OneStep>(request(&Owner::from(1), &k, &body))
        .await
        .unwrap();
    assert!(
        matches!(during, Claim::InFlight { .. }),
        "the row is held: {during:?}"
    );
    phase
        .finish(&answer("A"))
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    let retried = store
        .claim::<OneStep>(request(&Owner::from(1), &k, &body))
        .await
        .unwrap();
    assert!(
        matches!(&retried, Claim::Replay(r) if r.body == b"A"),
        "{retried:?}"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM effects").await, 1);
}

/// Interleaving: holder A's lease is taken over by B (A paused past it); A, resuming, refuses
/// its request and calls `abandon_or_release` (on one key), or opens `final_phase_owned` (on
/// another).
///
/// Safe outcome: A deletes nothing and releases nothing (`LeaseLost`), and `final_phase_owned`
/// hands A's lease back with `LeaseLost`; B's keys are intact and B finishes them.
///
/// Mutation that fails it: the delete of `abandon_or_release`, or the fence of the final phase,
/// not compared with the token.
#[testdb::test(template = crate::migrated)]
async fn a_stale_holder_can_neither_forget_nor_finish_the_new_holders_key(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    const TTL: Duration = Duration::from_secs(3);
    let clock = ManualClock::starting_now();
    let store = Store::new(pool.clone(), Arc::new(clock.clone()), TTL).unwrap();
    let body = json!({"cents": 1});
    let (k1, k2) = (key("stale-forget"), key("stale-finish"));
    let stale1 = acquired(
        store
            .claim(request(&Owner::from(1), &k1, &body))
            .await
            .unwrap(),
    );
    let stale2 = acquired(
        store
            .claim(request(&Owner::from(1), &k2, &body))
            .await
            .unwrap(),
    );
    clock.advance(TTL + Duration::from_secs(1));
    let fresh1 = acquired(
        store
            .claim(request(&Owner::from(1), &k1, &body))
            .await
            .unwrap(),
    );
    let fresh2 = acquired(
        store
            .claim(request(&Owner::from(1), &k2, &body))
            .await
            .unwrap(),
    );
    assert!(matches!(
        store.abandon_or_release(stale1).await,
        Err(Error::LeaseLost { .. })
    ));
    let stale_token = stale2.token();
    match store.final_phase_owned(stale2).await {
        Err((Error::LeaseLost { .. }, back)) => assert_eq!(back.token(), stale_token),
        other => panic!(
            "expected the lease back with LeaseLost, got {:?}",
            other.map(|_| ())
        ),
    }
    for (fresh, k) in [(fresh1, &k1), (fresh2, &k2)] {
        let phase = store.final_phase_owned(fresh).await.unwrap();
        phase.finish(&answer("B")).await.unwrap();
        assert!(matches!(
            store.claim::<OneStep>(request(&Owner::from(1), k, &body)).await.unwrap(),
            Claim::Replay(r) if r.body == b"B"
        ));
    }
}

/// Interleaving: a handler wrote a row referencing its key, then refused (a 400 after a write,
/// against `Forget`'s contract); `abandon_or_release` cannot delete the key.
///
/// Safe outcome: the key is released, keeping its payload: the same payload resumes it (one
/// more attempt, same row and UUID), another payload is a mismatch, never a fresh key that
/// would let the row's effect be made again under a new UUID.
///
/// Mutation that fails it: a fallback that deletes the referencing rows, or that releases
/// without keeping the fingerprint.
#[testdb::test(template = crate::migrated)]
async fn a_referenced_key_that_cannot_be_forgotten_keeps_its_payload(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    sqlx::query("CREATE TABLE notes (key_id BIGINT NOT NULL REFERENCES idempotency_keys (id))")
        .execute(&pool)
        .await
        .unwrap();
    let store = Store::new(
        pool.clone(),
        Arc::new(DatabaseClock),
        Duration::from_secs(30),
    )
    .unwrap();
    let (k, body) = (key("referenced"), json!({"cents": 1}));
    let lease = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    let (id, uuid) = (lease.key_id(), lease.request_uuid());
    sqlx::query("INSERT INTO notes VALUES ($1)")
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        store.abandon_or_release(lease).await.unwrap(),
        Abandoned::Released
    );
    let other = json!({"cents": 2});
    assert!(matches!(
        store
            .claim::<OneStep>(request(&Owner::from(1), &k, &other))
            .await
            .unwrap(),
        Claim::Mismatch
    ));
    let again = acquired(
        store
            .claim(request(&Owner::from(1), &k, &body))
            .await
            .unwrap(),
    );
    assert_eq!((again.key_id(), again.request_uuid()), (id, uuid));
    store.release(again).await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// 5. Migrations under a search path of several schemas
// ---------------------------------------------------------------------------------------------

async fn pool_with_search_path(pool: &PgPool, path: &str) -> PgPool {
    let options = pool
        .connect_options()
        .as_ref()
        .clone()
        .options([("search_path", path)]);
    PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .unwrap()
}

/// Interleaving: application A was migrated by an earlier version of the crate in schema
/// `public` (its entries in `public._sqlx_migrations`). Application B, new, keeps its tables in
/// schema `b` and connects with `search_path = b, public` (public second, for extensions and
/// shared types, a common setting). B runs `idempotency::migrate`.
///
/// Safe outcome: B gets its own key table in `b`; A's bookkeeping and tables are untouched (A's
/// next `migrate` adopts its own entries as usual), and the two applications never share keys.
///
/// What happens: `adopt` looks for `_sqlx_migrations` through the search path
/// (`to_regclass('_sqlx_migrations')`), finds A's in `public`, moves A's entries into
/// `b.idempotency_schema_migrations` and deletes them from A's table. B's bookkeeping then says
/// every migration is applied, so no table is created in `b`; B's store resolves
/// `idempotency_keys` through the search path to A's `public.idempotency_keys`, and B replays
/// A's stored answers for A's keys (same user id, route and key). A's next `migrate` finds no
/// entries and no bookkeeping of its own, runs the first migration again, and fails on the
/// existing table.
#[sqlx::test(migrations = false)]

async fn a_second_schema_on_the_search_path_gets_its_own_tables_and_leaves_the_others_alone(
    pool: PgPool,
) {
    // A, as an earlier version migrated it, in public.
    let mut earlier = sqlx::migrate!("./migrations");
    earlier.set_ignore_missing(true);
    earlier.run(&pool).await.unwrap();
    let a_store = Store::new(
        pool.clone(),
        Arc::new(DatabaseClock),
        Duration::from_secs(30),
    )
    .unwrap();
    let body = json!({"cents": 5});
    finished(&a_store, "shared-name", &body, "A's answer").await;
    let a_entries = count(&pool, "SELECT count(*) FROM public._sqlx_migrations").await;
    assert!(a_entries > 0);

    sqlx::query("CREATE SCHEMA b").execute(&pool).await.unwrap();
    let b_pool = pool_with_search_path(&pool, "b,public").await;
    idempotency::migrate(&b_pool).await.unwrap();

    let in_b = count(
        &pool,
        "SELECT count(*) FROM pg_tables WHERE schemaname = 'b' AND tablename = 'idempotency_keys'",
    )
    .await;
    let a_left = count(&pool, "SELECT count(*) FROM public._sqlx_migrations").await;
    let b_store = Store::new(
        b_pool.clone(),
        Arc::new(DatabaseClock),
        Duration::from_secs(30),
    )
    .unwrap();
    let k = key("shared-name");
    let b_claim = b_store
        .claim::<OneStep>(request(&Owner::from(1), &k, &body))
        .await
        .unwrap();
    let a_again = idempotency::migrate(&pool).await;
    assert!(
        in_b == 1
            && a_left == a_entries
            && matches!(b_claim, Claim::Acquired(_))
            && a_again.is_ok(),
        "B's key table in b: {in_b}; A's entries left: {a_left} of {a_entries}; B's claim of A's \
         key: {b_claim:?}; A's next migrate: {a_again:?}"
    );
}

/// Interleaving: eight migrators start together on a fresh database, half of them on a search
/// path that names a schema of their own first.
///
/// Safe outcome: every migrator succeeds, each schema gets its tables once, and a store on each
/// works.
///
/// Mutation that fails it: no advisory lock (two `CREATE TABLE idempotency_keys` race and one
/// fails), or a lock taken after the bookkeeping table is read.
#[sqlx::test(migrations = false)]
async fn concurrent_migrators_in_two_schemas_all_succeed(pool: PgPool) {
    sqlx::query("CREATE SCHEMA other")
        .execute(&pool)
        .await
        .unwrap();
    let other = pool_with_search_path(&pool, "other").await;
    let mut migrators = tokio::task::JoinSet::new();
    for i in 0..8 {
        let p = if i % 2 == 0 {
            pool.clone()
        } else {
            other.clone()
        };
        migrators.spawn(async move { idempotency::migrate(&p).await });
    }
    while let Some(done) = migrators.join_next().await {
        done.unwrap().unwrap();
    }
    for schema in ["public", "other"] {
        let n = count(
            &pool,
            &format!(
                "SELECT count(*) FROM pg_tables WHERE schemaname = '{schema}' \
                 AND tablename IN ('idempotency_keys', 'idempotency_schema_migrations')"
            ),
        )
        .await;
        assert_eq!(n, 2, "{schema}");
    }
    let body = json!({"cents": 5});
    let k = key("two-schemas");
    for p in [&pool, &other] {
        let store =
            Store::new(p.clone(), Arc::new(DatabaseClock), Duration::from_secs(30)).unwrap();
        let lease = acquired(
            store
                .claim(request(&Owner::from(1), &k, &body))
                .await
                .unwrap(),
        );
        assert_eq!(lease.token(), 1, "each schema has its own key");
        store.release(lease).await.unwrap();
    }
}
