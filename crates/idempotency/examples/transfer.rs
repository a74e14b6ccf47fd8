//! A money transfer, effectively once per idempotency key, with this crate alone.
//!
//! `POST /accounts/{from}/transfers` debits one account, credits another and then tells a
//! notification service, once per key, whatever fails in between:
//!
//! 1. **The claim and the money, in one transaction** ([`Store::begin`]): the key is inserted at
//!    recovery point `moved` together with the debit, the credit and the transfer row. A retry
//!    finds the key and never moves the money again.
//! 2. **The notification, under the lease** ([`Store::call_under_lease`]): a foreign call, between
//!    two phases, with a foreign idempotency key derived from the request's UUID, so that a
//!    resumed transfer asks for the same notification instead of a second one.
//! 3. **The answer, stored by the final phase**: a retry replays it byte for byte.
//!
//! A transfer left behind (its client gone, its process dead) is finished by the [`Completer`],
//! which runs the same [`advance`] from the stored parameters.
//!
//! Run it against any PostgreSQL (it creates the library's tables and two of its own,
//! `example_accounts` and `example_transfers`):
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run -p idempotency --example transfer
//! ```
//!
//! Its tests (`cargo test -p idempotency --example transfer`) crash it between the debit and the
//! notification, and between the notification and the answer, and find one notification.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::{
    Begun, Claim, Completer, DatabaseClock, Fingerprint, IdempotencyKey, Lease, NewRequest, Owner,
    RecoveryPoint, Resumed, Store, StoredResponse,
};
use serde::Deserialize;
use serde_json::{json, Value};
use sqlx::{PgConnection, PgPool};

/// The transfer's recovery points: one per commit separated from the next by a foreign call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Started,
    Moved,
    Finished,
}

impl RecoveryPoint for Step {
    const STARTED: Self = Self::Started;
    const FINISHED: Self = Self::Finished;

    fn name(self) -> &'static str {
        match self {
            Self::Started => "started",
            Self::Moved => "moved",
            Self::Finished => "finished",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        [Self::Started, Self::Moved, Self::Finished]
            .into_iter()
            .find(|p| p.name() == name)
    }
}

/// What is stored with the key: everything the completer needs to finish alone.
#[derive(Debug, Deserialize)]
struct Params {
    to: i64,
    amount_cents: i64,
}

/// The route, as the key's scope names it: a template, so that the completer finds every
/// account's transfers. The account is in the fingerprint, through the stored parameters.
const ROUTE: &str = "/accounts/{from}/transfers";

/// Why a transfer did not answer with a final outcome. Only `Unavailable` leaves work to do.
#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error("bad request: {0}")]
    Invalid(String),
    #[error("this key was used with another payload")]
    Mismatch,
    #[error("a request with this key is in flight; retry in {0:?}")]
    InFlight(Duration),
    #[error("the notification service is unavailable; retry with the same key")]
    Unavailable,
    #[error(transparent)]
    Store(#[from] idempotency::Error),
}

/// The service's state: the key store and the foreign system it calls.
#[derive(Clone)]
struct App {
    store: Store,
    notifier: Notifier,
}

/// A transfer request, with `Idempotency-Key`, from `owner` (whom the authentication names),
/// out of account `from`.
async fn transfer(
    app: &App,
    owner: &Owner,
    from: i64,
    key: &IdempotencyKey,
    body: &Value,
) -> Result<StoredResponse, Failure> {
    // Bad input is refused before the claim: nothing is written, the key stays unused.
    let (Some(to), Some(amount_cents)) = (body["to"].as_i64(), body["amount_cents"].as_i64())
    else {
        return Err(Failure::Invalid(
            "`to` and `amount_cents` are integers".into(),
        ));
    };
    if amount_cents <= 0 || to == from {
        return Err(Failure::Invalid(
            "a positive amount to another account".into(),
        ));
    }
    let params = json!({ "from": from, "to": to, "amount_cents": amount_cents });
    // README: from here. The README shows the lines down to "README: to here" as they stand;
    // crates/proving-ground/tests/integration/docs.rs fails when the two differ.
    let request = NewRequest {
        owner,
        method: "POST",
        route: ROUTE,
        key,
        fingerprint: Fingerprint::of_json("POST", ROUTE, &params),
        params: &params,
    };
    let mut lease = match app.store.begin::<Step>(request, Step::Moved).await? {
        Begun::New(mut first) => {
            let key_id = first.lease().key_id();
            match move_money(first.conn(), owner, key_id, &params).await? {
                None => first.commit().await?,
                Some(refused) => {
                    // A final answer too: stored with the key, replayed to every retry.
                    first.finish(&refused).await?;
                    return Ok(refused);
                }
            }
        }
        Begun::Existing(Claim::Acquired(lease)) => lease,
        Begun::Existing(Claim::Replay(stored)) => return Ok(stored),
        Begun::Existing(Claim::Mismatch) => return Err(Failure::Mismatch),
        Begun::Existing(Claim::InFlight { retry_after }) => {
            return Err(Failure::InFlight(retry_after))
        }
    };
    // README: to here.
    match advance(app, &mut lease).await {
        Ok(answer) => Ok(answer),
        // Another holder took the key over: it answers; nothing of ours is left to undo.
        Err(e @ Failure::Store(idempotency::Error::LeaseLost { .. })) => Err(e),
        Err(e) => {
            // Free the key at once for the client's retry, at the recovery point reached.
            app.store.release(lease).await?;
            Err(e)
        }
    }
}

/// Runs the transfer from its recovery point to its answer: the request's path and the
/// completer's are this one function.
async fn advance(app: &App, lease: &mut Lease<Step>) -> Result<StoredResponse, Failure> {
    let params: Params = serde_json::from_value(lease.params().clone())
        .map_err(|e| Failure::Invalid(format!("stored parameters: {e}")))?;
    if lease.recovery_point() == Step::Started {
        // Only a key claimed without its first phase (Store::claim) is found here.
        let (owner, stored) = (lease.owner().clone(), lease.params().clone());
        let mut phase = app.store.phase(lease, Step::Moved).await?;
        let key_id = phase.key_id();
        if let Some(refused) = move_money(phase.conn(), &owner, key_id, &stored).await? {
            drop(phase);
            app.store.final_phase(lease).await?.finish(&refused).await?;
            return Ok(refused);
        }
        phase.commit().await?;
    }
    // Step::Moved: the money has moved; tell the account's owner, once.
    let notice_key = format!("transfer-notice-{}", lease.request_uuid());
    let text = format!(
        "{} cents sent to account {}",
        params.amount_cents, params.to
    );
    let notice = app
        .store
        .call_under_lease(lease, app.notifier.send(&notice_key, &text))
        .await?
        .map_err(|Unavailable| Failure::Unavailable)?;
    let mut last = app.store.final_phase(lease).await?;
    let transfer_id: i64 = sqlx::query_scalar("SELECT id FROM example_transfers WHERE key_id = $1")
        .bind(last.key_id())
        .fetch_one(&mut *last.conn())
        .await
        .map_err(|e| idempotency::Error::Database {
            context: "read the transfer".into(),
            source: e,
        })?;
    let answer = StoredResponse::json(
        201,
        &json!({"transfer_id": transfer_id, "amount_cents": params.amount_cents, "notice": notice}),
        vec![("location".into(), format!("/transfers/{transfer_id}"))],
    );
    last.finish(&answer).await?;
    Ok(answer)
}

/// Debits `from` (only if it is the owner's and holds enough), credits `to` and records the
/// transfer under the key. A refusal to store instead, with nothing written, when `to` does not
/// exist or the funds are short.
async fn move_money(
    conn: &mut PgConnection,
    owner: &Owner,
    key_id: i64,
    params: &Value,
) -> Result<Option<StoredResponse>, idempotency::Error> {
    let db = |e| idempotency::Error::Database {
        context: "move the money".into(),
        source: e,
    };
    let refusal = |status, error| {
        Some(StoredResponse::json(
            status,
            &json!({ "error": error }),
            vec![],
        ))
    };
    let (from, to, amount) = (
        params["from"].as_i64(),
        params["to"].as_i64(),
        params["amount_cents"].as_i64(),
    );
    // The account credited must exist, and stay until the commit.
    let target: Option<i64> =
        sqlx::query_scalar("SELECT id FROM example_accounts WHERE id = $1 FOR SHARE")
            .bind(to)
            .fetch_optional(&mut *conn)
            .await
            .map_err(db)?;
    if target.is_none() {
        return Ok(refusal(422, "no such account to credit"));
    }
    let debited = sqlx::query(
        "UPDATE example_accounts SET balance_cents = balance_cents - $3 \
         WHERE id = $1 AND owner_id = $2 AND balance_cents >= $3",
    )
    .bind(from)
    .bind(owner.as_str())
    .bind(amount)
    .execute(&mut *conn)
    .await
    .map_err(db)?;
    if debited.rows_affected() == 0 {
        return Ok(refusal(402, "insufficient funds"));
    }
    sqlx::query("UPDATE example_accounts SET balance_cents = balance_cents + $2 WHERE id = $1")
        .bind(to)
        .bind(amount)
        .execute(&mut *conn)
        .await
        .map_err(db)?;
    sqlx::query(
        "INSERT INTO example_transfers (key_id, from_account, to_account, amount_cents) \
         VALUES ($1, $2, $3, $4)",
    )
    .bind(key_id)
    .bind(from)
    .bind(to)
    .bind(amount)
    .execute(&mut *conn)
    .await
    .map_err(db)?;
    Ok(None)
}

/// One completer pass over the transfers that requests left behind.
async fn complete_abandoned(
    app: &App,
    grace: Duration,
) -> Result<idempotency::Pass, idempotency::Error> {
    let shared = app.clone();
    Completer::new(app.store.clone(), "POST", ROUTE)
        .grace(grace)
        .run_once(move |mut lease: Lease<Step>| {
            let app = shared.clone();
            async move {
                match advance(&app, &mut lease).await {
                    Ok(_) => Resumed::Finished,
                    Err(Failure::Store(idempotency::Error::LeaseLost { .. })) => Resumed::Lost,
                    Err(e) => Resumed::failed(lease, e),
                }
            }
        })
        .await
}

async fn create_schema(pool: &PgPool) -> Result<(), Box<dyn std::error::Error>> {
    idempotency::migrate(pool).await?;
    for statement in [
        "CREATE TABLE IF NOT EXISTS example_accounts (
             id BIGINT PRIMARY KEY, owner_id TEXT NOT NULL,
             balance_cents BIGINT NOT NULL CHECK (balance_cents >= 0))",
        // A key past its retention may be deleted: the transfer outlives it.
        "CREATE TABLE IF NOT EXISTS example_transfers (
             id BIGSERIAL PRIMARY KEY,
             key_id BIGINT UNIQUE REFERENCES idempotency_keys (id) ON DELETE SET NULL,
             from_account BIGINT NOT NULL, to_account BIGINT NOT NULL, amount_cents BIGINT NOT NULL)",
    ] {
        sqlx::query(statement).execute(pool).await?;
    }
    Ok(())
}

/// A stand-in for the notification service. Like Stripe, it remembers the idempotency keys it
/// was called with and answers a repeated key with its first answer instead of sending again.
#[derive(Clone, Default)]
struct Notifier(Arc<Mutex<Notices>>, Arc<tokio::sync::Notify>);

#[derive(Default)]
struct Notices {
    by_key: HashMap<String, String>,
    /// Notifications sent, repeats excluded.
    sent: Vec<String>,
    /// For the tests: how the next call fails.
    fault: Option<Fault>,
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    /// Unreachable.
    Down,
    /// Never answers, and sends nothing.
    #[cfg_attr(not(test), allow(dead_code))]
    HangBefore,
    /// Sends, then never answers.
    #[cfg_attr(not(test), allow(dead_code))]
    HangAfter,
}

#[derive(Debug)]
struct Unavailable;

impl Notifier {
    async fn send(&self, key: &str, text: &str) -> Result<String, Unavailable> {
        let fault = self.0.lock().unwrap().fault.take();
        match fault {
            Some(Fault::Down) => return Err(Unavailable),
            Some(Fault::HangBefore) => self.hang().await,
            _ => {}
        }
        let id = {
            let mut notices = self.0.lock().unwrap();
            if !notices.by_key.contains_key(key) {
                notices.sent.push(text.to_owned());
                let id = format!("notice-{}", notices.sent.len());
                notices.by_key.insert(key.to_owned(), id);
            }
            notices.by_key[key].clone()
        };
        if let Some(Fault::HangAfter) = fault {
            self.hang().await;
        }
        Ok(id)
    }

    /// Never answers; tells the tests it got there first.
    async fn hang(&self) {
        self.1.notify_one();
        std::future::pending::<()>().await
    }

    fn sent(&self) -> usize {
        self.0.lock().unwrap().sent.len()
    }
}

fn report(what: &str, outcome: Result<StoredResponse, Failure>) {
    match outcome {
        Ok(answer) => println!(
            "{what}: {} {}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
        ),
        Err(failure) => println!("{what}: {failure}"),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let alice = || Owner::new("alice").expect("a valid owner");
    let url =
        std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL to a PostgreSQL database")?;
    let pool = PgPool::connect(&url).await?;
    create_schema(&pool).await?;
    sqlx::query(
        "INSERT INTO example_accounts VALUES (1, 'alice', 10000), (2, 'bob', 0) ON CONFLICT (id) DO NOTHING",
    )
    .execute(&pool)
    .await?;
    let store = Store::new(pool, Arc::new(DatabaseClock), Duration::from_secs(30))?;
    let app = App {
        store,
        notifier: Notifier::default(),
    };
    let key = IdempotencyKey::parse(format!("example-{}", idempotency::Uuid::new_v4()).as_bytes())?;
    let body = json!({"to": 2, "amount_cents": 2500});
    // The client's first try fails with the notification service away, and the client gives
    // up. The completer finishes the transfer (no grace here: the key was released at once);
    // the client's later send gets the stored answer.
    app.notifier.0.lock().unwrap().fault = Some(Fault::Down);
    report(
        "the client's first try",
        transfer(&app, &alice(), 1, &key, &body).await,
    );
    let pass = complete_abandoned(&app, Duration::ZERO).await?;
    println!(
        "the completer finished {} abandoned transfer(s)",
        pass.finished
    );
    report(
        "the client's retry",
        transfer(&app, &alice(), 1, &key, &body).await,
    );
    println!("notifications sent: {}", app.notifier.sent());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use idempotency::ManualClock;

    const TTL: Duration = Duration::from_secs(30);
    const GRACE: Duration = Duration::from_secs(60);

    /// The owner of account 1, as the authentication would name her.
    fn alice() -> Owner {
        Owner::new("alice").unwrap()
    }

    async fn app(pool: &PgPool) -> (App, ManualClock) {
        create_schema(pool).await.unwrap();
        sqlx::query("INSERT INTO example_accounts VALUES (1, 'alice', 10000), (2, 'bob', 0)")
            .execute(pool)
            .await
            .unwrap();
        let clock = ManualClock::starting_now();
        let store = Store::new(pool.clone(), Arc::new(clock.clone()), TTL).unwrap();
        (
            App {
                store,
                notifier: Notifier::default(),
            },
            clock,
        )
    }

    async fn balances(pool: &PgPool) -> (i64, i64) {
        sqlx::query_as(
            "SELECT (SELECT balance_cents FROM example_accounts WHERE id = 1), \
                               (SELECT balance_cents FROM example_accounts WHERE id = 2)",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    }

    fn key(s: &str) -> IdempotencyKey {
        IdempotencyKey::parse(s.as_bytes()).unwrap()
    }

    /// The process dies while the notification is on its way (`fault`): the key stays behind
    /// with its lease held; the completer, once the lease and the grace are over, finishes it.
    async fn crash_then_complete(pool: PgPool, fault: Fault) {
        let (app, clock) = app(&pool).await;
        app.notifier.0.lock().unwrap().fault = Some(fault);
        let body = json!({"to": 2, "amount_cents": 2500});
        let dying = {
            let app = app.clone();
            let body = body.clone();
            tokio::spawn(async move { transfer(&app, &alice(), 1, &key("crash"), &body).await })
        };
        // The money moves, then the call hangs: the process dies there.
        app.notifier.1.notified().await;
        dying.abort();
        assert!(dying.await.unwrap_err().is_cancelled());
        assert_eq!(balances(&pool).await, (7500, 2500));

        // Before the lease and the grace are over, the completer leaves the key alone.
        assert_eq!(complete_abandoned(&app, GRACE).await.unwrap().claimed, 0);
        clock.advance(GRACE + Duration::from_secs(1));
        let pass = complete_abandoned(&app, GRACE).await.unwrap();
        assert_eq!((pass.claimed, pass.finished), (1, 1), "{pass:?}");

        assert_eq!(
            app.notifier.sent(),
            1,
            "one notification, whatever the crash"
        );
        assert_eq!(balances(&pool).await, (7500, 2500), "the money moved once");
        let replay = transfer(&app, &alice(), 1, &key("crash"), &body)
            .await
            .unwrap();
        assert_eq!(replay.status, 201);
    }

    #[sqlx::test(migrations = false)]
    async fn a_crash_between_the_debit_and_the_notification_sends_one(pool: PgPool) {
        crash_then_complete(pool, Fault::HangBefore).await;
    }

    #[sqlx::test(migrations = false)]
    async fn a_crash_after_the_notification_does_not_send_it_again(pool: PgPool) {
        crash_then_complete(pool, Fault::HangAfter).await;
    }

    #[sqlx::test(migrations = false)]
    async fn a_retry_after_a_failed_notification_resumes_and_then_replays(pool: PgPool) {
        let (app, _clock) = app(&pool).await;
        app.notifier.0.lock().unwrap().fault = Some(Fault::Down);
        let body = json!({"to": 2, "amount_cents": 2500});
        let first = transfer(&app, &alice(), 1, &key("k"), &body).await;
        assert!(matches!(first, Err(Failure::Unavailable)), "{first:?}");
        let second = transfer(&app, &alice(), 1, &key("k"), &body).await.unwrap();
        let third = transfer(&app, &alice(), 1, &key("k"), &body).await.unwrap();
        assert_eq!((second.status, &second.body), (201, &third.body));
        assert_eq!(
            (balances(&pool).await, app.notifier.sent()),
            ((7500, 2500), 1)
        );
        // The same key with another payload changes nothing.
        let swapped = transfer(
            &app,
            &alice(),
            1,
            &key("k"),
            &json!({"to": 2, "amount_cents": 9000}),
        )
        .await;
        assert!(matches!(swapped, Err(Failure::Mismatch)), "{swapped:?}");
        assert_eq!(balances(&pool).await, (7500, 2500));
    }

    #[sqlx::test(migrations = false)]
    async fn sixteen_concurrent_duplicates_make_one_transfer(pool: PgPool) {
        let (app, _clock) = app(&pool).await;
        let body = json!({"to": 2, "amount_cents": 100});
        let sends = (0..16).map(|_| {
            let (app, body) = (app.clone(), body.clone());
            tokio::spawn(async move { transfer(&app, &alice(), 1, &key("dup"), &body).await })
        });
        let mut created = 0;
        for send in sends {
            match send.await.unwrap() {
                Ok(answer) => {
                    assert_eq!(answer.status, 201);
                    created += 1;
                }
                Err(Failure::InFlight(_)) => {}
                Err(other) => panic!("unexpected {other:?}"),
            }
        }
        assert!(created >= 1);
        assert_eq!(
            (balances(&pool).await, app.notifier.sent()),
            ((9900, 100), 1)
        );
    }

    #[sqlx::test(migrations = false)]
    async fn short_funds_are_a_final_answer_and_bad_input_writes_nothing(pool: PgPool) {
        let (app, _clock) = app(&pool).await;
        let much = json!({"to": 2, "amount_cents": 20000});
        let refused = transfer(&app, &alice(), 1, &key("much"), &much)
            .await
            .unwrap();
        assert_eq!(refused.status, 402);
        assert_eq!(
            transfer(&app, &alice(), 1, &key("much"), &much)
                .await
                .unwrap(),
            refused
        );
        // Not the owner's account: refused the same way, and nothing moves.
        let theirs = transfer(
            &app,
            &alice(),
            2,
            &key("theirs"),
            &json!({"to": 1, "amount_cents": 1}),
        )
        .await;
        assert_eq!(theirs.unwrap().status, 402);
        // To an account that does not exist: refused, and nothing is debited.
        let nowhere = json!({"to": 99, "amount_cents": 1});
        let refused = transfer(&app, &alice(), 1, &key("nowhere"), &nowhere).await;
        assert_eq!(refused.unwrap().status, 422);
        for bad in [
            json!({"to": 2}),
            json!({"to": 2, "amount_cents": -5}),
            json!({"to": 1, "amount_cents": 5}),
        ] {
            assert!(matches!(
                transfer(&app, &alice(), 1, &key("bad"), &bad).await,
                Err(Failure::Invalid(_))
            ));
        }
        let keys: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idempotency_keys WHERE idempotency_key = 'bad'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(
            (keys, balances(&pool).await, app.notifier.sent()),
            (0, (10000, 0), 0)
        );
    }
}
