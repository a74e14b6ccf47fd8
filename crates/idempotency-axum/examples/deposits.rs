//! Deposits into an account, once per idempotency key: `IdempotencyLayer` in its transactional
//! mode.
//!
//! `POST /accounts/{id}/deposits` with `{"amount_cents": 2500}` and an `Idempotency-Key` credits
//! the account and records the deposit, through the key's own transaction (`KeyTransaction`),
//! which the layer opened before the handler ran and commits with the answer it stores. A retry
//! gets that answer with `Idempotent-Replayed: true`; a handler that crashes after its writes
//! leaves nothing, and the retry deposits once; the key with another amount is a 422. The
//! handler makes no foreign call, as the transaction stays open while it runs (a deposit that
//! calls a gateway is a workflow of steps: the `idempotency` crate's `transfer` example).
//!
//! Run it against any PostgreSQL (it creates the library's tables, `deposit_accounts` and
//! `deposits`): it serves on a loopback port, sends itself a deposit, its retry and the key with
//! another amount, prints the answers and exits.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run -p idempotency-axum --example deposits
//! ```

use axum::extract::Path;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use http::request::Parts;
use http::{header, StatusCode};
use idempotency::{Owner, Store};
use idempotency_axum::{ClaimedKey, IdempotencyLayer, KeyTransaction, Problem};
use serde::Deserialize;
use serde_json::json;
use sqlx::PgPool;

/// The route. The layer scopes a key by this template (axum's `MatchedPath`) and puts the
/// concrete path in the fingerprint: one key sent to two accounts is one key with two payloads,
/// and the second is refused (422).
const DEPOSITS: &str = "/accounts/{id}/deposits";

/// The largest deposit accepted: 10 000.00 (the 422's detail says so).
const MAX_DEPOSIT_CENTS: i64 = 1_000_000;

#[derive(Debug, Deserialize)]
struct Deposit {
    amount_cents: i64,
}

/// The service: one route behind the layer.
fn app(store: Store) -> Router {
    Router::new()
        .route(DEPOSITS, post(deposit))
        .route_layer(idempotency(store))
}

/// Every deposit needs an `Idempotency-Key`, and runs in its key's transaction.
fn idempotency(store: Store) -> IdempotencyLayer {
    IdempotencyLayer::new(store, user_of).transactional()
}

/// Whose request it is, from `X-User-Id`: a stand-in for authentication, which this example
/// does not do. A real service reads the user that its authentication middleware put in the
/// request's extensions, and refuses the request (401) without one.
fn user_of(parts: &Parts) -> Result<Owner, StatusCode> {
    parts
        .headers
        .get("x-user-id")
        .and_then(|value| value.to_str().ok()?.parse().ok())
        .ok_or(StatusCode::UNAUTHORIZED)
}

/// Credits the caller's account and records the deposit, both in the key's transaction. An
/// answer is stored only when the writes commit; a 422 or a 5xx would roll them back.
async fn deposit(
    Path(account): Path<i64>,
    claimed: ClaimedKey,
    tx: KeyTransaction,
    Json(deposit): Json<Deposit>,
) -> Result<impl IntoResponse, Problem> {
    let amount = deposit.amount_cents;
    if !(1..=MAX_DEPOSIT_CENTS).contains(&amount) {
        return Err(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "urn:problem:example:invalid-amount",
            "Invalid amount",
        )
        .with_detail("amount_cents must be between 1 and 1000000"));
    }
    let mut conn = tx.conn().await?;
    // Only the caller's own account: another user's id finds nothing, as an unknown one does.
    let balance: Option<i64> = sqlx::query_scalar(
        "UPDATE deposit_accounts SET balance_cents = balance_cents + $1
         WHERE id = $2 AND owner = $3
         RETURNING balance_cents",
    )
    .bind(amount)
    .bind(account)
    .bind(claimed.owner().as_str())
    .fetch_optional(&mut *conn)
    .await
    .map_err(db_failed)?;
    let Some(balance) = balance else {
        return Err(Problem::new(
            StatusCode::NOT_FOUND,
            "urn:problem:example:no-account",
            "No such account",
        ));
    };
    let deposit_id: i64 = sqlx::query_scalar(
        "INSERT INTO deposits (account_id, amount_cents, key_id) VALUES ($1, $2, $3)
         RETURNING id",
    )
    .bind(account)
    .bind(amount)
    .bind(claimed.key_id())
    .fetch_one(&mut *conn)
    .await
    .map_err(db_failed)?;
    let location = format!("/accounts/{account}/deposits/{deposit_id}");
    let body = json!({
        "deposit_id": deposit_id,
        "account_id": account,
        "amount_cents": amount,
        "balance_cents": balance,
    });
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(body),
    ))
}

/// A database failure: 500 without detail, the cause to the log. The layer rolls back.
fn db_failed(e: sqlx::Error) -> Problem {
    tracing::error!(error = %e, "deposit failed");
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "urn:problem:example:internal",
        "Internal error",
    )
}

/// The library's tables and the example's. `deposits.key_id` is unique, so that one key makes
/// one deposit by the database's word too, and `ON DELETE SET NULL`, so that a key deleted after
/// its retention keeps its deposit.
async fn create_schema(pool: &PgPool) -> Result<(), Box<dyn std::error::Error>> {
    idempotency::migrate(pool).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS deposit_accounts (
             id BIGINT PRIMARY KEY,
             owner TEXT NOT NULL,
             balance_cents BIGINT NOT NULL
         );
         CREATE TABLE IF NOT EXISTS deposits (
             id BIGSERIAL PRIMARY KEY,
             account_id BIGINT NOT NULL REFERENCES deposit_accounts (id),
             amount_cents BIGINT NOT NULL,
             key_id BIGINT UNIQUE REFERENCES idempotency_keys (id) ON DELETE SET NULL
         );
         INSERT INTO deposit_accounts VALUES (1, '7', 0) ON CONFLICT (id) DO NOTHING;",
    )
    .execute(pool)
    .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url =
        std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL to a PostgreSQL database")?;
    let pool = PgPool::connect(&url).await?;
    create_schema(&pool).await?;
    let store = Store::builder(pool).build()?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    println!("serving on {base}");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serve = axum::serve(listener, app(store)).with_graceful_shutdown(async {
        let _ = stopped.await;
    });
    let server = tokio::spawn(async move { serve.await });
    client_session(&base).await?;
    let _ = stop.send(());
    server.await??;
    Ok(())
}

/// User 7 deposits 25.00 into account 1, sends it again (its first answer was lost, say), and
/// then tries the key with another amount.
async fn client_session(base: &str) -> Result<(), Box<dyn std::error::Error>> {
    let client = reqwest::Client::new();
    let key = format!("deposit-{}", idempotency::Uuid::new_v4());
    for (what, body) in [
        ("deposit", r#"{"amount_cents": 2500}"#),
        ("its retry", r#"{"amount_cents": 2500}"#),
        ("the key, another amount", r#"{"amount_cents": 9900}"#),
    ] {
        let answer = client
            .post(format!("{base}/accounts/1/deposits"))
            .header("idempotency-key", &key)
            .header("x-user-id", "7")
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await?;
        let replayed = answer.headers().contains_key("idempotent-replayed");
        let status = answer.status();
        println!(
            "{what}: {status} (replayed: {replayed}) {}",
            answer.text().await?
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::response::Response;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    async fn store(pool: &PgPool) -> Store {
        create_schema(pool).await.unwrap();
        Store::builder(pool.clone()).build().unwrap()
    }

    /// Sends user 7's deposit of 25.00 into account 1 under `key`: the status, whether it was
    /// replayed, and the body.
    async fn send(app: &Router, key: &str) -> (StatusCode, bool, Vec<u8>) {
        send_to(app, 1, key).await
    }

    async fn send_to(app: &Router, account: i64, key: &str) -> (StatusCode, bool, Vec<u8>) {
        let request = http::Request::post(format!("/accounts/{account}/deposits"))
            .header("idempotency-key", key)
            .header("x-user-id", "7")
            .header("content-type", "application/json")
            .body(Body::from(r#"{"amount_cents": 2500}"#))
            .unwrap();
        let answer = app.clone().oneshot(request).await.unwrap();
        let replayed =
            (answer.headers().get("idempotent-replayed")).is_some_and(|value| value == "true");
        let status = answer.status();
        let body = answer.into_body().collect().await.unwrap().to_bytes();
        (status, replayed, body.to_vec())
    }

    /// The number of deposits and the account's balance.
    async fn ledger(pool: &PgPool) -> (i64, i64) {
        sqlx::query_as(
            "SELECT (SELECT count(*) FROM deposits), balance_cents
             FROM deposit_accounts WHERE id = 1",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    }

    #[sqlx::test(migrations = false)]
    async fn a_retry_is_replayed_with_idempotent_replayed_and_deposits_nothing(pool: PgPool) {
        let app = app(store(&pool).await);
        let (status, replayed, body) = send(&app, "k1").await;
        assert_eq!((status, replayed), (StatusCode::CREATED, false));
        let (status, replayed, again) = send(&app, "k1").await;
        assert_eq!((status, replayed), (StatusCode::CREATED, true));
        assert_eq!(again, body, "byte for byte");
        assert_eq!(ledger(&pool).await, (1, 2500));
    }

    #[sqlx::test(migrations = false)]
    async fn a_crash_after_the_writes_leaves_nothing_and_the_retry_deposits_once(pool: PgPool) {
        let store = store(&pool).await;
        // The same service, but its handler's task dies once the writes are made, before the
        // layer stores the answer.
        let crash = tower::util::MapResponseLayer::new(|_: Response| -> Response {
            panic!("the process dies before the answer is stored")
        });
        let crashing = Router::new()
            .route(DEPOSITS, post(deposit).layer(crash))
            .route_layer(idempotency(store.clone()));
        let (status, _, _) = send(&crashing, "k1").await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(ledger(&pool).await, (0, 0), "the writes were rolled back");
        let (status, replayed, _) = send(&app(store), "k1").await;
        assert_eq!((status, replayed), (StatusCode::CREATED, false));
        assert_eq!(ledger(&pool).await, (1, 2500), "one deposit");
    }

    #[sqlx::test(migrations = false)]
    async fn one_key_sent_to_another_account_is_refused_as_another_payload(pool: PgPool) {
        let app = app(store(&pool).await);
        assert_eq!(send(&app, "k1").await.0, StatusCode::CREATED);
        let (status, replayed, _) = send_to(&app, 2, "k1").await;
        assert_eq!(
            (status, replayed),
            (StatusCode::UNPROCESSABLE_ENTITY, false)
        );
        let scopes: Vec<String> = sqlx::query_scalar("SELECT request_path FROM idempotency_keys")
            .fetch_all(&pool)
            .await
            .unwrap();
        assert_eq!(
            scopes,
            [DEPOSITS],
            "the key is scoped by the route's template"
        );
        assert_eq!(ledger(&pool).await, (1, 2500));
    }

    #[sqlx::test(migrations = false)]
    async fn another_users_account_is_not_found_and_unchanged(pool: PgPool) {
        let app = app(store(&pool).await);
        let request = http::Request::post("/accounts/1/deposits")
            .header("idempotency-key", "k1")
            .header("x-user-id", "8")
            .header("content-type", "application/json")
            .body(Body::from(r#"{"amount_cents": 2500}"#))
            .unwrap();
        let answer = app.oneshot(request).await.unwrap();
        assert_eq!(answer.status(), StatusCode::NOT_FOUND);
        assert_eq!(ledger(&pool).await, (0, 0));
    }
}
