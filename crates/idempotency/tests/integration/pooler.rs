//! The store behind a pooler in transaction mode (`IDEMPOTENCY_TEST_POOLER_URL`, a PgBouncer
//! with `pool_mode = transaction`; `scripts/test.sh` starts one): with
//! [`Statements::Unnamed`] many concurrent requests all run once and leave exact rows; with the
//! default, the same load fails, which shows that the pooler under test really lends server
//! connections per transaction. Without the variable both tests say so and pass: there is no
//! pooler to test.

use std::sync::Arc;
use std::time::Duration;

use idempotency::{
    Claim, DatabaseClock, Fingerprint, IdempotencyKey, NewRequest, OneStep, Owner, Statements,
    Store, StoredResponse,
};
use serde_json::json;
use sqlx::PgPool;

use crate::pooled;

const TASKS: usize = 16;
const REQUESTS_PER_TASK: usize = 40;

/// Runs `TASKS` tasks, each sending `REQUESTS_PER_TASK` requests of its own (claim, a phase
/// that writes an effect through the phase's connection, the final phase, a read of the effect
/// through [`Store::autocommit`], both wrapped by [`Store::statements_on`]) and then a replay of each; returns how many of them failed, and the first failure.
async fn load(store: &Store) -> (usize, Option<String>) {
    let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let (store, barrier) = (store.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut failed = (0, None);
            for r in 0..REQUESTS_PER_TASK {
                if let Err(e) = one_request(&store, t, r).await {
                    failed.0 += 1;
                    failed.1.get_or_insert(e);
                }
            }
            failed
        }));
    }
    let (mut failed, mut first) = (0, None);
    for task in tasks {
        let (n, e) = task.await.unwrap();
        failed += n;
        first = first.or(e);
    }
    (failed, first)
}

async fn one_request(store: &Store, task: usize, n: usize) -> Result<(), String> {
    let owner = Owner::from(task as i64 + 1);
    let key = IdempotencyKey::parse(format!("key-{n}").as_bytes()).unwrap();
    let body = json!({ "task": task, "n": n });
    let req = NewRequest {
        owner: &owner,
        method: "POST",
        route: "/things",
        key: &key,
        fingerprint: Fingerprint::of_json("POST", "/things", &body),
        params: &body,
    };
    let mut lease = match store
        .claim::<OneStep>(req)
        .await
        .map_err(|e| e.to_string())?
    {
        Claim::Acquired(lease) => lease,
        other => return Err(format!("a new key was not acquired: {other:?}")),
    };
    let mut phase = store
        .final_phase(&mut lease)
        .await
        .map_err(|e| e.to_string())?;
    sqlx::query("INSERT INTO effects (owner, n) VALUES ($1, $2)")
        .bind(task as i64 + 1)
        .bind(n as i64)
        .execute(store.statements_on(phase.conn()))
        .await
        .map_err(|e| e.to_string())?;
    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: format!("{task}/{n}").into_bytes(),
    };
    phase.finish(&response).await.map_err(|e| e.to_string())?;
    // The application's own statement outside a phase, as the store sends its own.
    let mut db = store.autocommit().await.map_err(|e| e.to_string())?;
    let effects: i64 =
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE owner = $1 AND n = $2")
            .bind(task as i64 + 1)
            .bind(n as i64)
            .fetch_one(store.statements_on(db.conn()))
            .await
            .map_err(|e| e.to_string())?;
    db.done().await.map_err(|e| e.to_string())?;
    if effects != 1 {
        return Err(format!("{task}/{n} has {effects} effects"));
    }
    match store
        .claim::<OneStep>(req)
        .await
        .map_err(|e| e.to_string())?
    {
        Claim::Replay(stored) if stored.body == response.body => Ok(()),
        other => Err(format!("the replay of {task}/{n} was {other:?}")),
    }
}

async fn setup(pool: &PgPool, statements: Statements) -> Option<Store> {
    idempotency::migrate(pool).await.unwrap();
    sqlx::query(
        "CREATE TABLE effects (owner BIGINT NOT NULL, n BIGINT NOT NULL, UNIQUE (owner, n))",
    )
    .execute(pool)
    .await
    .unwrap();
    let Some(pooled) = pooled::pooler_pool(pool) else {
        eprintln!("{} is not set: no pooler to test", pooled::POOLER_URL);
        return None;
    };
    let store = Store::new(pooled, Arc::new(DatabaseClock), Duration::from_secs(30))
        .unwrap()
        .with_statements(statements);
    Some(store)
}

#[testdb::test(template = crate::migrated)]
async fn unnamed_statements_run_every_request_once_through_a_transaction_pooler(pool: PgPool) {
    let Some(store) = setup(&pool, Statements::Unnamed).await else {
        return;
    };
    let (failed, first) = load(&store).await;
    assert_eq!(failed, 0, "first failure: {first:?}");
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(effects, (TASKS * REQUESTS_PER_TASK) as i64);
    let finished: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE finished_at IS NOT NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(finished, effects);
}

/// The control: the default statements fail through the same pooler.
#[testdb::test(template = crate::migrated)]
async fn prepared_statements_fail_through_a_transaction_pooler(pool: PgPool) {
    let Some(store) = setup(&pool, Statements::Prepared).await else {
        return;
    };
    let (failed, first) = load(&store).await;
    eprintln!("prepared statements through the pooler: {failed} failed requests; first: {first:?}");
    assert!(
        failed > 0,
        "the default statements ran cleanly: is the pooler in transaction mode?"
    );
}

/// How many of `TASKS` tasks' statements, `QUERIES` each, came back with another task's answer
/// or failed: each task's statement is its own SQL text (`SELECT <task> …`), unnamed, sent on
/// the pooler's pool alone or inside a transaction.
async fn foreign_answers(pool: &PgPool, in_transaction: bool) -> (usize, usize) {
    const QUERIES: usize = 300;
    let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let (pool, barrier) = (pool.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let (mut foreign, mut failed) = (0, 0);
            let sql = format!("SELECT {t}::bigint + $1");
            for _ in 0..QUERIES {
                let query = sqlx::query_scalar::<_, i64>(&sql)
                    .bind(0_i64)
                    .persistent(false);
                let answer = if in_transaction {
                    match pool.begin().await {
                        Ok(mut tx) => match query.fetch_one(&mut *tx).await {
                            Ok(v) => tx.commit().await.map(|()| v),
                            Err(e) => Err(e),
                        },
                        Err(e) => Err(e),
                    }
                } else {
                    query.fetch_one(&pool).await
                };
                match answer {
                    Ok(v) if v == t as i64 => {}
                    Ok(_) => foreign += 1,
                    Err(_) => failed += 1,
                }
            }
            (foreign, failed)
        }));
    }
    let (mut foreign, mut failed) = (0, 0);
    for task in tasks {
        let (f, e) = task.await.unwrap();
        foreign += f;
        failed += e;
    }
    (foreign, failed)
}

/// Why [`Statements::Unnamed`] puts every statement in a transaction: an unnamed statement sent
/// alone through the pooler can run on a server connection where another client's unnamed
/// statement was just parsed, and answer with that client's SQL; inside a transaction, never.
#[sqlx::test(migrations = false)]
async fn an_unnamed_statement_alone_can_run_another_clients_sql_through_a_transaction_pooler(
    pool: PgPool,
) {
    let Some(pooled) = pooled::pooler_pool(&pool) else {
        eprintln!("{} is not set: no pooler to test", pooled::POOLER_URL);
        return;
    };
    let (foreign, failed) = foreign_answers(&pooled, true).await;
    assert_eq!((foreign, failed), (0, 0), "inside transactions");
    let (foreign, failed) = foreign_answers(&pooled, false).await;
    eprintln!("unnamed statements alone through the pooler: {foreign} answered another client's SQL, {failed} failed");
    assert!(
        foreign > 0,
        "no unnamed statement alone answered another client's SQL: is the pooler in transaction mode?"
    );
}
