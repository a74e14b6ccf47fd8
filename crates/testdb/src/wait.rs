//! Waiting, in a test, for what has no signal of its own: a row another process writes, a flag
//! a task sets, a server that comes up. One bounded poll, here, instead of a loop with a sleep in
//! every test that needs one; a test that can be told (a `Notify`, a channel, a barrier) or can
//! move an injected clock does that instead.

use std::future::Future;
use std::time::{Duration, Instant};

/// How often [`until`] asks again: a condition is a cheap query or a flag, and a short period
/// keeps a test's wait close to the moment the condition begins to hold.
pub const POLL_EVERY: Duration = Duration::from_millis(10);

/// Asks `condition` every [`POLL_EVERY`] until it gives a value, and returns it; panics, naming
/// `what`, when it has given none within `within`. The deadline is a bound on a hang, never a
/// measure of speed: give one that a loaded machine meets with room to spare.
pub async fn until<T, F, Fut>(what: &str, within: Duration, condition: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    until_every(what, POLL_EVERY, within, condition).await
}

/// [`until`], asking every `every`: for a condition that costs more than a query (a request to
/// a running service, which logs each one).
pub async fn until_every<T, F, Fut>(
    what: &str,
    every: Duration,
    within: Duration,
    mut condition: F,
) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(value) = condition().await {
            return value;
        }
        assert!(
            started.elapsed() < within,
            "testdb::until: {what}: not within {within:?}"
        );
        // The one sleep of the tests' waits: each turn asks the condition again.
        tokio::time::sleep(every).await;
    }
}

/// How many statements of this database wait on a lock now (`pg_stat_activity`): the signal
/// that a statement was sent and is held between its sending and its answer.
pub async fn lock_waits(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(pool)
    .await
    .expect("count the statements waiting on a lock")
}

/// Waits (bounded, [`until`]) until a statement of this database waits on a lock; `what` names
/// it in the panic when none does within `within`.
pub async fn until_a_lock_wait(pool: &sqlx::PgPool, what: &str, within: Duration) {
    until(what, within, || async {
        (lock_waits(pool).await > 0).then_some(())
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test]
    async fn gives_the_first_value_the_condition_gives() {
        let asked = AtomicU32::new(0);
        let got = until("the third turn", Duration::from_secs(5), || async {
            let n = asked.fetch_add(1, Ordering::SeqCst) + 1;
            (n == 3).then_some(n)
        })
        .await;
        assert_eq!(got, 3);
    }

    #[tokio::test]
    #[should_panic(expected = "testdb::until: a condition that never holds: not within")]
    async fn panics_naming_what_never_came() {
        until(
            "a condition that never holds",
            Duration::from_millis(50),
            || async { None::<()> },
        )
        .await;
    }
}
