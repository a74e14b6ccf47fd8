//! A money transfer, effectively once per idempotency key, described once as a [`Workflow`]:
//! `Started` moves the money (in one transaction with the key's claim), `Moved` tells a
//! notification service under the lease, with a foreign key derived from the request, and stores
//! the 201. [`Store::run`] runs it for the request, detached from the caller; the [`Completer`]
//! runs the same workflow for a transfer its client left behind. Its tests crash it on both sides
//! of the notification and find one.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run -p idempotency --example transfer
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use idempotency::workflow::Completer;
use idempotency::{
    Advance, Halt, IdempotencyKey, Outcome, Owner, Request, Step, Store, StoredResponse, Workflow,
};
use serde_json::{json, Value};
use sqlx::PgPool;

idempotency::recovery_points! {
    /// The transfer's points: one per commit that a foreign call separates from the next.
    enum Point {
        /// The money has moved; the notification and the answer are next.
        Moved = "moved",
    }
}

/// The route, as the key's scope names it: a template, so that the completer finds every
/// account's transfers. The account is in the fingerprint, through the parameters.
const ROUTE: &str = "/accounts/{from}/transfers";

/// The transfer, described once: the request and the completer both run it.
#[derive(Default)]
struct Transfer {
    notifier: Notifier,
}

// README: from here. The README shows the lines down to "README: to here" as they stand;
// crates/proving-ground/tests/integration/docs.rs fails when the two differ.
impl Workflow for Transfer {
    type Point = Point;

    fn route(&self) -> &str {
        ROUTE
    }

    async fn step(&self, point: Point, step: &mut Step<'_, Point>) -> Result<Advance<Point>, Halt> {
        match point {
            Point::Started => {
                move_money(step).await?;
                Ok(Advance::To(Point::Moved))
            }
            Point::Moved => {
                let key = step.foreign_key("transfer-notice");
                let notice = step
                    .call(self.notifier.send(key))
                    .await?
                    .map_err(|Unavailable| Halt::retry("the notification service is away"))?;
                let id: i64 =
                    sqlx::query_scalar("SELECT id FROM example_transfers WHERE key_id = $1")
                        .bind(step.key_id())
                        .fetch_one(step.tx().await?)
                        .await?;
                let amount = &step.params()["amount_cents"];
                let body = json!({"transfer_id": id, "amount_cents": amount, "notice": notice});
                let location = ("location".to_owned(), format!("/transfers/{id}"));
                let answer = StoredResponse::json(201, &body, vec![location]);
                Ok(Advance::Finish(answer))
            }
            Point::Finished => unreachable!("the driver never steps a finished transfer"),
        }
    }
}

/// A transfer request with `Idempotency-Key`, from `owner` (whom the authentication names), out
/// of account `from`. Bad input is refused before the run: nothing is written.
async fn transfer(
    app: &App,
    owner: Owner,
    from: i64,
    key: IdempotencyKey,
    body: &Value,
) -> Result<Outcome, &'static str> {
    let (Some(to), Some(amount_cents)) = (body["to"].as_i64(), body["amount_cents"].as_i64())
    else {
        return Err("`to` and `amount_cents` are integers");
    };
    if amount_cents <= 0 || to == from {
        return Err("a positive amount to another account");
    }
    let params = json!({ "from": from, "to": to, "amount_cents": amount_cents });
    let request = Request::new(owner, key, params);
    Ok(app.store.run(&app.transfer, request).await)
}
// README: to here.

/// Debits `from` (only if it is the owner's and holds enough), credits `to` (which must exist)
/// and records the transfer under the key, in one statement of the step's transaction. A
/// refusal is the final answer, stored without the step's writes.
async fn move_money(step: &mut Step<'_, Point>) -> Result<(), Halt> {
    let (owner, key_id, p) = (step.owner().to_string(), step.key_id(), step.params());
    let (from, to) = (p["from"].as_i64(), p["to"].as_i64());
    let amount = p["amount_cents"].as_i64();
    let (target, moved): (bool, bool) = sqlx::query_as(
        "WITH target AS (SELECT id FROM example_accounts WHERE id = $2 FOR SHARE),
         debit AS (UPDATE example_accounts SET balance_cents = balance_cents - $3
                   WHERE id = $1 AND owner_id = $5 AND balance_cents >= $3
                     AND EXISTS (SELECT FROM target) RETURNING id),
         credit AS (UPDATE example_accounts SET balance_cents = balance_cents + $3
                    WHERE id = $2 AND EXISTS (SELECT FROM debit) RETURNING id),
         moved AS (INSERT INTO example_transfers (key_id, from_account, to_account, amount_cents)
                   SELECT $4, $1, $2, $3 FROM credit RETURNING id)
         SELECT EXISTS (SELECT FROM target), EXISTS (SELECT FROM moved)",
    )
    .bind(from)
    .bind(to)
    .bind(amount)
    .bind(key_id)
    .bind(owner)
    .fetch_one(step.tx().await?)
    .await?;
    let refuse = |status, error: &str| {
        let body = json!({ "error": error });
        Err(Halt::fail(StoredResponse::json(status, &body, vec![])))
    };
    match (target, moved) {
        (true, true) => Ok(()),
        (false, _) => refuse(422, "no such account to credit"),
        (true, false) => refuse(402, "insufficient funds"),
    }
}

/// The service's state: the key store and the workflow (which holds the foreign system).
#[derive(Clone)]
struct App {
    store: Store,
    transfer: Arc<Transfer>,
}

/// One pass of the worker over the transfers that requests left behind (a service runs
/// [`idempotency::workflow::run_until`], the completer beside the reaper, until it stops).
async fn complete_abandoned(app: &App) -> Result<idempotency::runner::Pass, idempotency::Error> {
    let completer = Completer::new(app.store.clone(), app.transfer.clone());
    completer.run_once().await
}

async fn create_schema(pool: &PgPool) -> Result<(), Box<dyn std::error::Error>> {
    idempotency::migrate(pool).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS example_accounts (id BIGINT PRIMARY KEY, owner_id TEXT NOT NULL,
             balance_cents BIGINT NOT NULL CHECK (balance_cents >= 0));
         -- A key past its retention may be deleted: the transfer outlives it.
         CREATE TABLE IF NOT EXISTS example_transfers (id BIGSERIAL PRIMARY KEY,
             key_id BIGINT UNIQUE REFERENCES idempotency_keys (id) ON DELETE SET NULL,
             from_account BIGINT NOT NULL, to_account BIGINT NOT NULL, amount_cents BIGINT NOT NULL);
         INSERT INTO example_accounts VALUES (1, 'alice', 10000), (2, 'bob', 0) ON CONFLICT (id) DO NOTHING",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// A stand-in for the notification service. Like Stripe, it answers a repeated idempotency key
/// with its first answer instead of sending again. Its next call may fail (`fail_next`).
#[derive(Clone, Default)]
struct Notifier(Arc<Mutex<Notices>>, Arc<tokio::sync::Notify>);

/// The notices sent, by idempotency key, and the next call's fault.
type Notices = (HashMap<String, String>, Option<Fault>);

#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(not(test), allow(dead_code))]
enum Fault {
    Down,
    /// Never answers, and sends nothing.
    HangBefore,
    /// Sends, then never answers.
    HangAfter,
}

#[derive(Debug)]
struct Unavailable;

impl Notifier {
    async fn send(&self, key: String) -> Result<String, Unavailable> {
        let fault = self.0.lock().unwrap().1.take();
        match fault {
            Some(Fault::Down) => return Err(Unavailable),
            Some(Fault::HangBefore) => self.hang().await,
            _ => {}
        }
        let id = {
            let mut notices = self.0.lock().unwrap();
            let next = format!("notice-{}", notices.0.len() + 1);
            notices.0.entry(key).or_insert(next).clone()
        };
        if fault == Some(Fault::HangAfter) {
            self.hang().await;
        }
        Ok(id)
    }

    /// Never answers; tells the tests it got there.
    async fn hang(&self) {
        self.1.notify_one();
        std::future::pending::<()>().await
    }

    fn fail_next(&self, fault: Fault) {
        self.0.lock().unwrap().1 = Some(fault);
    }

    fn sent(&self) -> usize {
        self.0.lock().unwrap().0.len()
    }
}

/// The first try fails with the notification service away; the client's retry resumes after the
/// debit and gets the 201, and the next is its replay. The worker finds nothing left behind.
#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL to a database")?;
    let pool = PgPool::connect(&url).await?;
    create_schema(&pool).await?;
    let store = Store::builder(pool).build()?;
    let app = App {
        store,
        transfer: Arc::default(),
    };
    let key = IdempotencyKey::parse(format!("example-{}", idempotency::Uuid::new_v4()).as_bytes())?;
    let (alice, body) = (Owner::new("alice")?, json!({"to": 2, "amount_cents": 2500}));
    app.transfer.notifier.fail_next(Fault::Down);
    for attempt in 1..=3 {
        let shown = match transfer(&app, alice.clone(), 1, key.clone(), &body).await? {
            Outcome::Answered(r) | Outcome::Replayed(r) => String::from_utf8_lossy(&r.body).into(),
            other => format!("{other:?}"),
        };
        println!("try {attempt}: {shown}");
    }
    let pass = complete_abandoned(&app).await?;
    let sent = app.transfer.notifier.sent();
    println!("worker: {pass:?}\nnotices sent: {sent}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use idempotency::runner::DEFAULT_GRACE as GRACE;
    use idempotency::ManualClock;
    use std::time::Duration;

    const TTL: Duration = Duration::from_secs(30);

    /// The owner of account 1, as the authentication would name her.
    fn alice() -> Owner {
        Owner::new("alice").unwrap()
    }

    async fn app(pool: &PgPool) -> (App, ManualClock) {
        create_schema(pool).await.unwrap();
        let clock = ManualClock::starting_now();
        let store = Store::builder(pool.clone())
            .clock(Arc::new(clock.clone()))
            .lease_ttl(TTL)
            .build()
            .unwrap();
        let transfer = Arc::default();
        (App { store, transfer }, clock)
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

    /// The stored answer of a run: its first delivery or a replay.
    fn answer(outcome: Result<Outcome, &str>) -> StoredResponse {
        match outcome {
            Ok(Outcome::Answered(answer) | Outcome::Replayed(answer)) => answer,
            other => panic!("expected an answer, got {other:?}"),
        }
    }

    fn key(s: &str) -> IdempotencyKey {
        IdempotencyKey::parse(s.as_bytes()).unwrap()
    }

    /// The process dies while the notification is on its way (`fault`): the key stays behind
    /// with its lease held; the completer, once the lease and the grace are over, finishes it.
    async fn crash_then_complete(pool: PgPool, fault: Fault) {
        let (app, clock) = app(&pool).await;
        app.transfer.notifier.fail_next(fault);
        let body = json!({"to": 2, "amount_cents": 2500});
        let dying = {
            let app = app.clone();
            let body = body.clone();
            tokio::spawn(async move { transfer(&app, alice(), 1, key("crash"), &body).await })
        };
        // The money moves, then the call hangs: the process dies there.
        app.transfer.notifier.1.notified().await;
        dying.abort();
        assert!(dying.await.unwrap_err().is_cancelled());
        assert_eq!(balances(&pool).await, (7500, 2500));

        // Before the lease and the grace are over, the completer leaves the key alone.
        assert_eq!(complete_abandoned(&app).await.unwrap().claimed, 0);
        clock.advance(GRACE + Duration::from_secs(1));
        let pass = complete_abandoned(&app).await.unwrap();
        assert_eq!((pass.claimed, pass.finished), (1, 1), "{pass:?}");

        assert_eq!(
            app.transfer.notifier.sent(),
            1,
            "one notification, whatever the crash"
        );
        assert_eq!(balances(&pool).await, (7500, 2500), "the money moved once");
        let replay = transfer(&app, alice(), 1, key("crash"), &body).await;
        assert!(
            matches!(replay, Ok(Outcome::Replayed(ref r)) if r.status == 201),
            "{replay:?}"
        );
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
        app.transfer.notifier.fail_next(Fault::Down);
        let body = json!({"to": 2, "amount_cents": 2500});
        let first = transfer(&app, alice(), 1, key("k"), &body).await;
        assert!(matches!(first, Ok(Outcome::RetryLater { .. })), "{first:?}");
        let second = answer(transfer(&app, alice(), 1, key("k"), &body).await);
        let third = answer(transfer(&app, alice(), 1, key("k"), &body).await);
        assert_eq!((second.status, &second.body), (201, &third.body));
        assert_eq!(
            (balances(&pool).await, app.transfer.notifier.sent()),
            ((7500, 2500), 1)
        );
        // The same key with another payload changes nothing.
        let swapped = transfer(
            &app,
            alice(),
            1,
            key("k"),
            &json!({"to": 2, "amount_cents": 9000}),
        )
        .await;
        assert!(matches!(swapped, Ok(Outcome::Mismatch)), "{swapped:?}");
        assert_eq!(balances(&pool).await, (7500, 2500));
    }

    #[sqlx::test(migrations = false)]
    async fn sixteen_concurrent_duplicates_make_one_transfer(pool: PgPool) {
        let (app, _clock) = app(&pool).await;
        let body = json!({"to": 2, "amount_cents": 100});
        let sends = (0..16).map(|_| {
            let (app, body) = (app.clone(), body.clone());
            tokio::spawn(async move { transfer(&app, alice(), 1, key("dup"), &body).await })
        });
        let mut created = 0;
        for send in sends {
            match send.await.unwrap() {
                Ok(Outcome::Answered(answer)) => {
                    assert_eq!(answer.status, 201);
                    created += 1;
                }
                Ok(Outcome::Replayed(answer)) => assert_eq!(answer.status, 201),
                Ok(Outcome::InFlight { .. }) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(created, 1, "one run stored the answer");
        assert_eq!(
            (balances(&pool).await, app.transfer.notifier.sent()),
            ((9900, 100), 1)
        );
    }

    #[sqlx::test(migrations = false)]
    async fn short_funds_are_a_final_answer_and_bad_input_writes_nothing(pool: PgPool) {
        let (app, _clock) = app(&pool).await;
        let much = json!({"to": 2, "amount_cents": 20000});
        let refused = answer(transfer(&app, alice(), 1, key("much"), &much).await);
        assert_eq!(refused.status, 402);
        let again = transfer(&app, alice(), 1, key("much"), &much).await;
        assert!(
            matches!(again, Ok(Outcome::Replayed(ref r)) if *r == refused),
            "{again:?}"
        );
        // Not the owner's account: refused the same way, and nothing moves.
        let theirs = transfer(
            &app,
            alice(),
            2,
            key("theirs"),
            &json!({"to": 1, "amount_cents": 1}),
        )
        .await;
        assert_eq!(answer(theirs).status, 402);
        // To an account that does not exist: refused, and nothing is debited.
        let nowhere = json!({"to": 99, "amount_cents": 1});
        let refused = transfer(&app, alice(), 1, key("nowhere"), &nowhere).await;
        assert_eq!(answer(refused).status, 422);
        for bad in [
            json!({"to": 2}),
            json!({"to": 2, "amount_cents": -5}),
            json!({"to": 1, "amount_cents": 5}),
        ] {
            assert!(transfer(&app, alice(), 1, key("bad"), &bad).await.is_err());
        }
        let keys: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idempotency_keys WHERE idempotency_key = 'bad'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(
            (keys, balances(&pool).await, app.transfer.notifier.sent()),
            (0, (10000, 0), 0)
        );
    }
}
