//! Adversarial review of the text owner in Rocket Rides and fakestripe: a ride or a charge can
//! reference only a key of its own user or account, reaping keeps them, and the migration
//! orderings, each finding of the review kept as a test of its fix.

use sqlx::PgPool;

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

fn code(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
}

/// Two users and, for each owner text given, one finished key of that owner on POST /rides.
async fn seed(pool: &PgPool, owners: &[&str]) -> Vec<i64> {
    sqlx::raw_sql(
        "INSERT INTO users (id, email, api_key_hash, stripe_customer_id) VALUES
             (7, 'a@example.com', decode(repeat('07', 32), 'hex'), 'cus_7'),
             (8, 'b@example.com', decode(repeat('08', 32), 'hex'), 'cus_8');",
    )
    .execute(pool)
    .await
    .unwrap();
    let mut ids = Vec::new();
    for owner in owners {
        ids.push(
            sqlx::query_scalar(
                "INSERT INTO idempotency_keys
                     (owner, request_method, request_path, idempotency_key, fingerprint,
                      request_params, recovery_point, response_status, response_headers,
                      response_body, finished_at)
                 VALUES ($1, 'POST', '/rides', 'k', decode(repeat('00', 32), 'hex'), '{}',
                         'finished', 201, '[]', '\\x7b7d', now())
                 RETURNING id",
            )
            .bind(owner)
            .fetch_one(pool)
            .await
            .unwrap(),
        );
    }
    ids
}

async fn insert_ride(pool: &PgPool, user: i64, key_owner: &str, key_id: i64) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO rides (user_id, key_owner, idempotency_key_id, origin_lat, origin_lon,
                            target_lat, target_lon, amount_cents)
         VALUES ($1, $2, $3, 0, 0, 0, 0, 100)",
    )
    .bind(user)
    .bind(key_owner)
    .bind(key_id)
    .execute(pool)
    .await
    .map(|_| ())
}

#[sqlx::test(migrations = false)]
async fn a_ride_references_only_a_key_of_its_users_canonical_owner(pool: PgPool) {
    rocket_rides::db::migrate(&pool).await.unwrap();
    let ids = seed(&pool, &["7", "07", " 7", "+7", "8"]).await;
    let (own, padded, spaced, plus, other) = (ids[0], ids[1], ids[2], ids[3], ids[4]);
    // Keys whose owner parses as user 7 but is not its decimal form: the check refuses the
    // owner text, and with the canonical text the foreign key refuses the key.
    for (key_owner, key_id) in [("07", padded), (" 7", spaced), ("+7", plus)] {
        let refused = insert_ride(&pool, 7, key_owner, key_id).await.unwrap_err();
        assert_eq!(
            code(&refused).as_deref(),
            Some("23514"),
            "{key_owner:?}: {refused}"
        );
        let refused = insert_ride(&pool, 7, "7", key_id).await.unwrap_err();
        assert_eq!(
            code(&refused).as_deref(),
            Some("23503"),
            "{key_owner:?}: {refused}"
        );
    }
    // Another user's key, under either owner text.
    assert_eq!(
        code(&insert_ride(&pool, 7, "7", other).await.unwrap_err()).as_deref(),
        Some("23503")
    );
    assert_eq!(
        code(&insert_ride(&pool, 7, "8", other).await.unwrap_err()).as_deref(),
        Some("23514")
    );
    // Its own key, once; a second ride of the same key is refused.
    insert_ride(&pool, 7, "7", own).await.unwrap();
    assert_eq!(
        code(&insert_ride(&pool, 7, "7", own).await.unwrap_err()).as_deref(),
        Some("23505")
    );
    // key_owner cannot be left out.
    let missing = sqlx::query(
        "INSERT INTO rides (user_id, idempotency_key_id, origin_lat, origin_lon, target_lat,
                            target_lon, amount_cents)
         VALUES (8, $1, 0, 0, 0, 0, 100)",
    )
    .bind(other)
    .execute(&pool)
    .await
    .unwrap_err();
    assert_eq!(code(&missing).as_deref(), Some("23502"));
    // A ride's owner cannot be moved to another user afterwards, nor its key to another's.
    let moved = sqlx::query("UPDATE rides SET user_id = 8 WHERE idempotency_key_id = $1")
        .bind(own)
        .execute(&pool)
        .await
        .unwrap_err();
    assert_eq!(code(&moved).as_deref(), Some("23514"));
    let repointed = sqlx::query("UPDATE rides SET idempotency_key_id = $1 WHERE user_id = 7")
        .bind(other)
        .execute(&pool)
        .await
        .unwrap_err();
    assert_eq!(code(&repointed).as_deref(), Some("23503"));
    // Reaping the key keeps the ride, its user and its owner text.
    sqlx::query("DELETE FROM idempotency_keys WHERE id = $1")
        .bind(own)
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM rides
             WHERE user_id = 7 AND key_owner = '7' AND idempotency_key_id IS NULL"
        )
        .await,
        1
    );
}

#[sqlx::test(migrations = false)]
async fn a_charge_references_only_a_key_of_its_own_account(pool: PgPool) {
    let options = pool.connect_options().as_ref().clone();
    let gateway = fakestripe::connect_with(options).await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO accounts (id, secret_key) VALUES (1, 'sk_test_one'), (2, 'sk_test_two');
         INSERT INTO customers (id, account_id) VALUES ('cus_aaaaaaaaaaaaaa', 1);",
    )
    .execute(&gateway)
    .await
    .unwrap();
    let key_of = |owner: &'static str| {
        let gateway = gateway.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "INSERT INTO idempotency_keys
                     (owner, request_method, request_path, idempotency_key, fingerprint,
                      request_params, recovery_point)
                 VALUES ($1, 'POST', '/v1/charges', 'k', decode(repeat('00', 32), 'hex'), '{}',
                         'started')
                 RETURNING id",
            )
            .bind(owner)
            .fetch_one(&gateway)
            .await
            .unwrap()
        }
    };
    let (own, padded, other) = (key_of("1").await, key_of("01").await, key_of("2").await);
    let charge = |n: u8, key_owner: &'static str, key_id: i64| {
        let gateway = gateway.clone();
        async move {
            sqlx::query(
                "INSERT INTO charges (id, account_id, customer_id, amount, currency,
                                      idempotency_key_id, key_owner)
                 VALUES ($1, 1, 'cus_aaaaaaaaaaaaaa', 100, 'usd', $2, $3)",
            )
            .bind(format!("ch_{}{}", (b'a' + n) as char, "x".repeat(23)))
            .bind(key_id)
            .bind(key_owner)
            .execute(&gateway)
            .await
            .map(|_| ())
        }
    };
    assert_eq!(
        code(&charge(0, "1", other).await.unwrap_err()).as_deref(),
        Some("23503")
    );
    assert_eq!(
        code(&charge(1, "1", padded).await.unwrap_err()).as_deref(),
        Some("23503")
    );
    assert_eq!(
        code(&charge(2, "01", padded).await.unwrap_err()).as_deref(),
        Some("23514")
    );
    charge(3, "1", own).await.unwrap();
    sqlx::query("DELETE FROM idempotency_keys WHERE id = $1")
        .bind(own)
        .execute(&gateway)
        .await
        .unwrap();
    assert_eq!(
        count(
            &gateway,
            "SELECT count(*) FROM charges WHERE key_owner = '1' AND idempotency_key_id IS NULL"
        )
        .await,
        1
    );
}

/// The crate's plain `migrate` on a new database (a tool, a fixture, an older deploy script)
/// turns the owner into text first; Rocket Rides' old migration 20261130100002 could then never
/// run. `rocket-rides migrate` refuses at once, saying why, and applies nothing.
#[sqlx::test(migrations = false)]
async fn plain_crate_migrate_first_makes_rocket_rides_migrate_refuse_clearly(pool: PgPool) {
    idempotency::migrate(&pool).await.unwrap();
    for _ in 0..2 {
        let refused = rocket_rides::db::migrate(&pool)
            .await
            .unwrap_err()
            .to_string();
        assert!(refused.contains("plain `migrate`"), "{refused}");
        assert_eq!(
            count(&pool, "SELECT count(*) FROM _sqlx_migrations").await,
            0
        );
    }
}

#[sqlx::test(migrations = false)]
async fn rocket_rides_migrate_on_a_new_database_twice_and_concurrently(pool: PgPool) {
    let runs: Vec<_> = (0..3)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move { rocket_rides::db::migrate(&pool).await })
        })
        .collect();
    for run in runs {
        run.await.unwrap().unwrap();
    }
    rocket_rides::db::migrate(&pool).await.unwrap();
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM pg_constraint WHERE conname = 'rides_idempotency_key_fkey'
               AND pg_get_constraintdef(oid) LIKE 'FOREIGN KEY (key_owner, idempotency_key_id)%'"
        )
        .await,
        1
    );
}

use crate::common;

/// `rider()` parses a key's owner leniently (`"07"` and `"+7"` are user 7). A key the service did
/// not write, owned by such a look-alike of a user, abandoned on POST /rides past the grace: the
/// completer must never book or charge it for that user. It holds today because the ride's
/// foreign key (key_owner = user_id::text) refuses the key; this guards it.
#[sqlx::test(migrations = false)]
async fn the_completer_never_books_or_charges_a_look_alike_owners_key_for_a_user(pool: PgPool) {
    let app = common::TestApp::start(pool).await;
    let (user, api_key) = app.user("rider@example.com", "tok_visa").await;
    // A real request dies after its ride: its key, at ride_created, is the template.
    app.state
        .failpoints
        .arm(rocket_rides::failpoints::AFTER_RIDE_CREATED);
    let reply = app
        .post_ride(Some(&api_key), Some("real"), common::RIDE)
        .await;
    assert_eq!(reply.status, 500, "{reply:?}");
    for (owner, point) in [
        (format!("0{user}"), "ride_created"),
        (format!("+{user}"), "started"),
    ] {
        sqlx::query(
            "WITH k AS (
                 INSERT INTO idempotency_keys
                     (owner, request_method, request_path, idempotency_key, fingerprint,
                      request_params, recovery_point, created_at, last_run_at)
                 SELECT $1, request_method, request_path, idempotency_key, fingerprint,
                        request_params, $2, created_at, last_run_at
                 FROM idempotency_keys WHERE idempotency_key = 'real' AND owner = $3
                 RETURNING owner, id, request_method, request_path, created_at)
             INSERT INTO idempotency_keys_unfinished
                 (owner, key_id, request_method, request_path, created_at)
             SELECT * FROM k",
        )
        .bind(&owner)
        .bind(point)
        .bind(user.to_string())
        .execute(&app.pool)
        .await
        .unwrap();
    }
    let settings = rocket_rides::config::WorkerArgs::default();
    for _ in 0..3 {
        app.clock
            .advance(settings.completer_grace + settings.completer_backoff_max);
        let _ = rocket_rides::worker::completer::run_once(&app.state, &settings).await;
    }
    // The completer did take the look-alikes up (and failed them).
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) FROM idempotency_keys
             WHERE owner <> '{user}' AND completer_attempts > 0 AND finished_at IS NULL"
        ))
        .await,
        2
    );
    // The real key is finished with its one ride and one charge; the look-alikes have none.
    assert_eq!(
        app.count("SELECT count(*) FROM rides WHERE status = 'paid'")
            .await,
        1
    );
    assert_eq!(app.rides().await, 1);
    assert_eq!(app.charges().await, 1);
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) FROM rides WHERE user_id = {user} AND key_owner <> '{user}'"
        ))
        .await,
        0
    );
}

/// A database of the first build (2026-11-29: rides reference `idempotency_keys (id)`
/// only), with a paid ride, on which the crate's plain `migrate` ran alone.
#[sqlx::test(migrations = false)]
async fn plain_crate_migrate_on_a_first_build_database_makes_the_service_refuse_clearly(
    pool: PgPool,
) {
    common::earlier_database_with_a_paid_ride(&pool, 20261130000000, 20261130000000).await;
    // The crate's 20261130000002 (the primary key with the user, CASCADE) drops the rides'
    // reference by id before the owner change looks for references, so a plain migrate gets
    // through; Rocket Rides' pending migrations could then never run. The service's migrator
    // refuses at once, saying why, and applies nothing: the database needs an operator, not a
    // retry loop. (`rocket-rides migrate` alone upgrades the same database: the test below.)
    idempotency::migrate(&pool).await.unwrap();
    let applied = count(&pool, "SELECT count(*) FROM _sqlx_migrations").await;
    let refused = rocket_rides::db::migrate(&pool)
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("plain `migrate`"), "{refused}");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM _sqlx_migrations").await,
        applied
    );
}

/// The control of the finding above: the same first-build database, upgraded by
/// `rocket-rides migrate` alone, keeps its ride on its key.
#[sqlx::test(migrations = false)]
async fn a_first_build_database_upgrades_by_rocket_rides_migrate_alone(pool: PgPool) {
    common::earlier_database_with_a_paid_ride(&pool, 20261130000000, 20261130000000).await;
    rocket_rides::db::migrate(&pool).await.unwrap();
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM rides r JOIN idempotency_keys k
             ON k.owner = r.key_owner AND k.id = r.idempotency_key_id WHERE k.owner = '7'"
        )
        .await,
        1
    );
}
