//! `store::StatementsOn`: the store's statement mode applied to the application's own queries
//! by wrapping the connection once. Seen where PostgreSQL keeps them: a named (prepared)
//! statement is listed in the session's `pg_prepared_statements`, an unnamed one never is.

use std::sync::Arc;
use std::time::Duration;

use idempotency::store::{Statements, StatementsOn};
use idempotency::{DatabaseClock, Store};
use sqlx::{Executor, PgConnection, PgPool};

/// The query the tests send through the wrapper; its text is what they look for.
const PROBE: &str = "SELECT $1::bigint + 1";

/// How many statements with the text `sql` this session has prepared (named). The count is
/// itself unnamed, so it never counts itself.
async fn prepared(conn: &mut PgConnection, sql: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_prepared_statements WHERE statement = $1")
        .bind(sql)
        .persistent(false)
        .fetch_one(conn)
        .await
        .unwrap()
}

/// Sends [`PROBE`] through `db` three ways: by `&mut`, twice (one wrapper serves a
/// transaction's queries), and by value.
async fn probe(db: &mut StatementsOn<&mut PgConnection>) {
    for n in 0..2_i64 {
        let v: i64 = sqlx::query_scalar(PROBE)
            .bind(n)
            .fetch_one(&mut *db)
            .await
            .unwrap();
        assert_eq!(v, n + 1);
    }
    let v: i64 = sqlx::query_scalar(PROBE)
        .bind(41_i64)
        .fetch_one(db.reborrow())
        .await
        .unwrap();
    assert_eq!(v, 42);
}

fn store(pool: &PgPool, statements: Statements) -> Store {
    Store::new(
        pool.clone(),
        Arc::new(DatabaseClock),
        Duration::from_secs(30),
    )
    .unwrap()
    .with_statements(statements)
}

#[sqlx::test(migrations = false)]
async fn unnamed_statements_leave_no_prepared_statement_on_the_connection(pool: PgPool) {
    let store = store(&pool, Statements::Unnamed);
    let mut tx = pool.begin().await.unwrap();
    let mut db = store.statements_on(&mut *tx);
    assert_eq!(db.statements(), Statements::Unnamed);
    probe(&mut db).await;
    assert_eq!(prepared(&mut tx, PROBE).await, 0);
    tx.commit().await.unwrap();
}

/// The control of the test above: the same queries in the default mode are named, so the
/// absence above is the wrapper's doing, not the query's.
#[sqlx::test(migrations = false)]
async fn prepared_statements_stay_named_and_cached(pool: PgPool) {
    let store = store(&pool, Statements::Prepared);
    let mut conn = pool.acquire().await.unwrap();
    let mut db = store.statements_on(&mut *conn);
    probe(&mut db).await;
    // Prepared once, then taken from sqlx's cache.
    assert_eq!(prepared(&mut conn, PROBE).await, 1);
}

/// In the default mode a query keeps its own choice: one built `.persistent(false)` (a
/// statement run once, its SQL built at run time) stays unnamed.
#[sqlx::test(migrations = false)]
async fn a_query_that_asks_for_an_unnamed_statement_keeps_it_in_the_default_mode(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let mut db = Statements::Prepared.on(&mut *conn);
    let v: i64 = sqlx::query_scalar(PROBE)
        .bind(1_i64)
        .persistent(false)
        .fetch_one(&mut db)
        .await
        .unwrap();
    assert_eq!(v, 2);
    assert_eq!(prepared(&mut conn, PROBE).await, 0);
}

/// `prepare` makes a named statement, which the pooler would lose: refused when unnamed, and
/// nothing is prepared.
#[sqlx::test(migrations = false)]
async fn prepare_and_describe_are_refused_when_statements_are_unnamed(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let refused = |result: Result<(), sqlx::Error>| {
        let err = result.unwrap_err();
        assert!(
            matches!(err, sqlx::Error::Configuration(_)),
            "unexpected error: {err}"
        );
    };
    refused(
        Statements::Unnamed
            .on(&mut *conn)
            .prepare(PROBE)
            .await
            .map(drop),
    );
    // sqlx describes with a named statement, cached: a later unnamed query of the same text
    // would be sent by that name.
    refused(
        Statements::Unnamed
            .on(&mut *conn)
            .describe(PROBE)
            .await
            .map(drop),
    );
    assert_eq!(prepared(&mut conn, PROBE).await, 0);
    Statements::Prepared
        .on(&mut *conn)
        .prepare(PROBE)
        .await
        .unwrap();
    assert_eq!(prepared(&mut conn, PROBE).await, 1);
}

/// Over a pool the wrapper is a copyable executor, each query on a connection of the pool, and
/// none of them leaves a named statement on it.
#[sqlx::test(migrations = false)]
async fn a_pool_in_unnamed_mode_leaves_no_prepared_statement(pool: PgPool) {
    let db = Statements::Unnamed.on(&pool);
    for n in 0..3_i64 {
        let v: i64 = sqlx::query_scalar(PROBE)
            .bind(n)
            .fetch_one(db)
            .await
            .unwrap();
        assert_eq!(v, n + 1);
    }
    // Every connection the pool holds, each idle: acquiring as many lends each one once.
    let mut conns = Vec::new();
    for _ in 0..pool.size() {
        conns.push(pool.acquire().await.unwrap());
    }
    for conn in &mut conns {
        assert_eq!(prepared(conn, PROBE).await, 0);
    }
}
