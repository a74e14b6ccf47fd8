//! Where "now" comes from.
//!
//! Every statement that compares against the current time names it `$now` ([`Timed`]). In
//! production the clock yields `None` and `$now` is PostgreSQL's own `now()`: one clock for every
//! API process, whatever their hosts' clocks say (on Citus, the clock of the node a client is
//! connected to, which evaluates `now()` once for the statement). Tests use a [`ManualClock`],
//! whose time is bound in place of `$now`, and move it forward to expire a lease, instead of
//! sleeping.
//!
//! A holder also times its own lease, on a second clock: [`Clock::monotonic`], this process's
//! steady time, which no other host's clock and no wall-clock step can move. It is what
//! [`crate::Store::lease_left`] measures, from before the statement that set the lease was sent.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use time::OffsetDateTime;

/// A source of the current time for lease arithmetic.
pub trait Clock: Send + Sync + 'static {
    /// The current time, or `None` to use the database server's `now()`.
    fn now(&self) -> Option<OffsetDateTime>;

    /// This process's steady time, as a duration since a fixed point of the process's own: only
    /// differences between two readings mean anything. By default the operating system's
    /// monotonic clock.
    fn monotonic(&self) -> Duration {
        static START: OnceLock<Instant> = OnceLock::new();
        START.get_or_init(Instant::now).elapsed()
    }
}

/// The production clock: the database server's `now()`.
#[derive(Debug, Clone, Copy, Default)]
pub struct DatabaseClock;

impl Clock for DatabaseClock {
    fn now(&self) -> Option<OffsetDateTime> {
        None
    }
}

/// A clock that stands still until a test moves it. Clones share the same time. Its
/// [`Clock::monotonic`] time starts at zero and moves with it, so that a test that moves the
/// clock past a lease also moves the holder's own measure of that lease.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<Mutex<(OffsetDateTime, Duration)>>);

impl ManualClock {
    /// A clock set to `start`.
    pub fn new(start: OffsetDateTime) -> Self {
        Self(Arc::new(Mutex::new((start, Duration::ZERO))))
    }

    /// A clock set to the current wall-clock time, so that rows it writes look recent.
    pub fn starting_now() -> Self {
        Self::new(OffsetDateTime::now_utc())
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        // A poisoned lock only means another test thread panicked; the time value is still valid.
        let mut now = self.0.lock().unwrap_or_else(|e| e.into_inner());
        now.0 += by;
        now.1 += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Option<OffsetDateTime> {
        Some(self.0.lock().unwrap_or_else(|e| e.into_inner()).0)
    }

    fn monotonic(&self) -> Duration {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).1
    }
}

/// The marker of the current time in a statement's text ([`Timed`]).
pub(crate) const NOW: &str = "$now";

/// A statement's text with its current time in place: `$now` becomes `now()`, the
/// database's clock, under a clock whose [`Clock::now`] is `None`, and a parameter bound to the
/// clock's time otherwise. Made by [`crate::Store::timed`].
///
/// Why not `coalesce($n::timestamptz, now())`, one text for both clocks: Citus refuses a
/// non-immutable function inside `COALESCE` or `CASE` in an `UPDATE` or a `DELETE` ("non-IMMUTABLE
/// functions are not allowed in CASE or COALESCE statements"). A bare `now()` it evaluates once on
/// the node the client is connected to, before it sends the statement to its shard.
///
/// ```
/// # use idempotency::{BindTime, Store};
/// # async fn f(store: Store, pool: sqlx::PgPool) -> Result<(), sqlx::Error> {
/// let timed = store.timed("UPDATE rides SET updated_at = $now WHERE user_id = $1 AND id = $2");
/// sqlx::query(timed.sql())
///     .bind(42_i64)
///     .bind(7_i64)
///     .bind_now(&timed) // last: `$now` is the parameter after `$2`
///     .execute(&pool)
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Timed {
    sql: String,
    now: Option<OffsetDateTime>,
}

impl Timed {
    /// `sql` with `$now` replaced: by `now()` when `now` is `None`, else by the parameter after
    /// the highest one the text names (`$3` if it names `$1` and `$2`), cast to `timestamptz`.
    pub fn new(sql: &str, now: Option<OffsetDateTime>) -> Self {
        let sql = match now {
            None => sql.replace(NOW, "now()"),
            Some(_) => sql.replace(NOW, &format!("${}::timestamptz", highest_param(sql) + 1)),
        };
        Self { sql, now }
    }

    /// The statement's text.
    pub fn sql(&self) -> &str {
        &self.sql
    }

    /// The time to bind in place of `$now`, if the text has a parameter for it.
    pub fn now(&self) -> Option<OffsetDateTime> {
        self.now
    }
}

/// The highest `$n` that `sql` names, 0 for none.
fn highest_param(sql: &str) -> usize {
    sql.split('$')
        .skip(1)
        .filter_map(|rest| {
            let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            rest[..digits].parse::<usize>().ok()
        })
        .max()
        .unwrap_or(0)
}

/// A query that can take the time of a [`Timed`] text: sqlx's `query`, `query_as` and
/// `query_scalar` for PostgreSQL.
pub trait BindTime: Sized {
    /// Binds `now` as the next parameter.
    fn bind_time(self, now: OffsetDateTime) -> Self;

    /// Binds the time of `timed` as the statement's last parameter, if its text has one for it:
    /// call it after every other `bind`.
    fn bind_now(self, timed: &Timed) -> Self {
        match timed.now() {
            Some(now) => self.bind_time(now),
            None => self,
        }
    }
}

impl<'q> BindTime for sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    fn bind_time(self, now: OffsetDateTime) -> Self {
        self.bind(now)
    }
}

impl<'q, O> BindTime for sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
    fn bind_time(self, now: OffsetDateTime) -> Self {
        self.bind(now)
    }
}

impl<'q, O> BindTime
    for sqlx::query::QueryScalar<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>
{
    fn bind_time(self, now: OffsetDateTime) -> Self {
        self.bind(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_database_clock_puts_now_in_the_text() {
        let timed = Timed::new("UPDATE t SET a = $now WHERE id = $1 AND b < $now", None);
        assert_eq!(
            timed.sql(),
            "UPDATE t SET a = now() WHERE id = $1 AND b < now()"
        );
    }

    #[test]
    fn a_clock_with_a_time_puts_the_parameter_after_the_highest_in_the_text() {
        let at = OffsetDateTime::UNIX_EPOCH;
        let timed = Timed::new("SELECT $now, $2, $10, $1 + $now", Some(at));
        assert_eq!(
            timed.sql(),
            "SELECT $11::timestamptz, $2, $10, $1 + $11::timestamptz"
        );
        assert_eq!(
            Timed::new("SELECT $now", Some(at)).sql(),
            "SELECT $1::timestamptz"
        );
    }
}
