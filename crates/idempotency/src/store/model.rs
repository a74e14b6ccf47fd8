//! The store and what it hands out: the key, the lease and the claim's outcome, and the
//! application's recovery points; and what the files of statements share: reading a key's row,
//! and telling a delete that a foreign key refused.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use sqlx::postgres::{PgPool, PgRow};
use sqlx::types::Json;
use sqlx::Row;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::observe::{Observed, Observer};
use crate::{Clock, Error, Fingerprint, IdempotencyKey, Owner, StoredResponse, Timed};

/// The lease time-to-live when none is configured: 30 s.
///
/// A holder that dies keeps its key locked this long, so retries get 409 until then; a holder that
/// lives must finish each phase (or renew) within it. It must stay larger than the longest foreign
/// call made between two phases (the gateway timeout) plus the time of one phase.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(30);

/// A named stage of an application's request, stored as text in `recovery_point`.
///
/// Implement it for an enum whose variants are the application's recovery points. `STARTED` is
/// written when a key is first claimed, `FINISHED` when its response is stored.
pub trait RecoveryPoint: Copy + Eq + std::fmt::Debug + Send + Sync + 'static {
    /// The point of a key that has just been inserted.
    const STARTED: Self;
    /// The point of a key whose response is stored.
    const FINISHED: Self;
    /// The stored name (at most 64 characters).
    fn name(self) -> &'static str;
    /// Parses a stored name.
    fn from_name(name: &str) -> Option<Self>;
}

/// The recovery points of a request with a single phase: just claimed, or finished. A key found
/// `Started` by a later claim is one whose phase never committed; it runs again from the start.
/// (A request with several effects defines its own points, one per committed step.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OneStep {
    /// Claimed; nothing committed yet.
    Started,
    /// The response is stored.
    Finished,
}

impl RecoveryPoint for OneStep {
    const STARTED: Self = Self::Started;
    const FINISHED: Self = Self::Finished;

    fn name(self) -> &'static str {
        match self {
            Self::Started => "started",
            Self::Finished => "finished",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        [Self::Started, Self::Finished]
            .into_iter()
            .find(|p| p.name() == name)
    }
}

/// What a claim attempt is about.
#[derive(Debug, Clone, Copy)]
pub struct NewRequest<'a> {
    /// The owner of the key: keys of different owners never meet.
    pub owner: &'a Owner,
    /// The HTTP method, `POST`.
    pub method: &'a str,
    /// The route template, `/rides`.
    pub route: &'a str,
    /// The client's key.
    pub key: &'a IdempotencyKey,
    /// The fingerprint of method, route and body.
    pub fingerprint: Fingerprint,
    /// The parameters a completer needs to finish the request alone.
    pub params: &'a Value,
}

/// The outcome of a claim.
#[derive(Debug)]
pub enum Claim<P> {
    /// The caller holds the lease and must run the request from `lease.recovery_point()`.
    Acquired(Lease<P>),
    /// The key finished earlier with the same payload: answer with this response.
    Replay(StoredResponse),
    /// The key was used with another payload.
    Mismatch,
    /// Another holder has the lease for `retry_after` more.
    InFlight {
        /// Time left on the other holder's lease, rounded up to whole seconds (at least one).
        retry_after: Duration,
    },
}

/// A held lease on one key row: the right to run its next phases, fenced by `token`.
///
/// Dropping it without finishing or releasing leaves the key locked until the lease expires.
#[derive(Debug)]
#[must_use = "a dropped lease blocks its key until the lease expires: finish or release it"]
pub struct Lease<P> {
    pub(super) key_id: i64,
    pub(super) request_uuid: Uuid,
    pub(super) owner: Owner,
    pub(super) token: i64,
    pub(super) attempts: i32,
    pub(super) completer_attempts: i32,
    pub(super) recovery_point: P,
    pub(super) params: Value,
    pub(super) locked_until: OffsetDateTime,
    /// When this process sent the statement that last took or extended the lease, on its own
    /// monotonic clock ([`Clock::monotonic`]). From *before* the statement: the database set the
    /// lease's end while the statement ran, so a wait for a lock, a slow network or a pause
    /// between the statement and its answer counts against the lease, never in its favour.
    pub(super) confirmed_at: Duration,
}

impl<P: RecoveryPoint> Lease<P> {
    /// The key row's id, stable for the key's life. It comes from a sequence of this database:
    /// use it for the application's own rows (a foreign key to the key row), and
    /// [`Lease::request_uuid`] for anything another system sees.
    pub fn key_id(&self) -> i64 {
        self.key_id
    }

    /// A random identifier made when the key row was inserted, stable for the key's life and
    /// unique across databases: derive foreign idempotency keys from it, and name the request
    /// with it in foreign systems, so that two databases on one gateway account never share a
    /// foreign key.
    pub fn request_uuid(&self) -> Uuid {
        self.request_uuid
    }

    /// The owner of the key.
    pub fn owner(&self) -> &Owner {
        &self.owner
    }

    /// The same key and token, without the parameters: what a runner keeps to release the key
    /// when the task it handed the lease to panicked with it. Never used while that task may
    /// still act on the lease.
    pub(crate) fn fence(&self) -> Self {
        Self {
            key_id: self.key_id,
            request_uuid: self.request_uuid,
            owner: self.owner.clone(),
            token: self.token,
            attempts: self.attempts,
            completer_attempts: self.completer_attempts,
            recovery_point: self.recovery_point,
            params: Value::Null,
            locked_until: self.locked_until,
            confirmed_at: self.confirmed_at,
        }
    }

    /// The fencing token this holder acquired.
    pub fn token(&self) -> i64 {
        self.token
    }

    /// How many times the key's lease has been acquired, this time included.
    pub fn attempts(&self) -> i32 {
        self.attempts
    }

    /// How many of those acquisitions were a completer's (its backoff doubles with them).
    pub fn completer_attempts(&self) -> i32 {
        self.completer_attempts
    }

    /// The last committed phase: where to resume.
    pub fn recovery_point(&self) -> P {
        self.recovery_point
    }

    /// The parameters stored with the first claim.
    pub fn params(&self) -> &Value {
        &self.params
    }

    /// When the lease ends unless a phase or a renewal extends it.
    pub fn locked_until(&self) -> OffsetDateTime {
        self.locked_until
    }
}

/// The key store. Cheap to clone; clones share the pool and the clock.
#[derive(Clone)]
pub struct Store {
    pub(super) pool: PgPool,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) lease_ttl: Duration,
    pub(crate) heartbeat: Duration,
    pub(crate) observer: Observed,
    /// How long a finished key answers for its request; `None`: for as long as its row exists.
    pub(super) retention: Option<Duration>,
    /// Prepared and cached, or unnamed in explicit transactions ([`Store::with_statements`]).
    pub(super) statements: super::Statements,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("lease_ttl", &self.lease_ttl)
            .field("heartbeat", &self.heartbeat)
            .field("retention", &self.retention)
            .field("statements", &self.statements)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// The shortest retention [`Store::with_retention`] accepts: one hour (1 h).
    ///
    /// Clients retry over minutes (a backoff, a queue that drains after an outage, a person who
    /// presses the button again), and each of those retries must replay. A retention shorter than
    /// an hour is most likely a unit mistake (seconds meant as hours), and it would turn ordinary
    /// retries into second effects. An application that tells its clients how long they may
    /// retry keeps its keys at least that long (Rocket Rides: Stripe's 24 hours, 48 by default).
    pub const MIN_RETENTION: Duration = Duration::from_secs(3600);

    /// The longest retention [`Store::with_retention`] accepts: ten years. To keep keys for
    /// good, set none.
    pub const MAX_RETENTION: Duration = Duration::from_secs(10 * 366 * 24 * 3600);

    /// A store over `pool`, with `clock` for lease arithmetic and leases of `lease_ttl`, renewed
    /// every third of it under [`Store::call_under_lease`] (see [`Store::with_heartbeat`]). It
    /// has no retention: a finished key replays for as long as its row exists (see
    /// [`Store::with_retention`]). It is [`Store::builder`] with [`StoreBuilder::keep_forever`],
    /// and refuses what [`StoreBuilder::build`] refuses (a TTL outside 1 s to 1 h).
    ///
    /// [`StoreBuilder::keep_forever`]: super::StoreBuilder::keep_forever
    /// [`StoreBuilder::build`]: super::StoreBuilder::build
    pub fn new(pool: PgPool, clock: Arc<dyn Clock>, lease_ttl: Duration) -> Result<Self, Error> {
        Self::builder(pool)
            .clock(clock)
            .lease_ttl(lease_ttl)
            .keep_forever()
            .build()
    }

    /// How long a finished key answers for its request ([`Store::with_retention`]); `None`: for
    /// as long as its row exists.
    pub fn retention(&self) -> Option<Duration> {
        self.retention
    }

    /// The pool the store writes through; the application's phase writes share its transactions.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The configured lease TTL.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// Reports every claim and every committed phase to `observer`, for metrics (see
    /// [`Observer`]).
    pub fn with_observer(mut self, observer: Arc<dyn Observer>) -> Self {
        self.observer = Observed::new(observer);
        self
    }

    /// The injected time: `None` in production, where the database decides. The application's
    /// own statements that compare against "now" take it through [`Store::timed`].
    pub fn now(&self) -> Option<OffsetDateTime> {
        self.clock.now()
    }

    /// `sql` with its marker of the current time, `$now`, made the store clock's: `now()` in
    /// production, a parameter bound to the injected time in tests (see [`Timed`]). How the
    /// store writes every statement that compares against "now", and how an application writes
    /// its own, so that Citus can route them (no `coalesce($n, now())`).
    pub fn timed(&self, sql: &str) -> Timed {
        Timed::new(sql, self.clock.now())
    }

    /// How long `lease` surely lasts, by this process's own clock: the TTL from when the
    /// statement that last took or extended the lease was sent, less the time since. A holder
    /// that stood still (a pause of its process or machine, a claim whose answer was held up)
    /// past its lease may have lost the key without knowing; before a side effect outside the
    /// database, it renews a lease with little left, and a takeover then shows as
    /// [`Error::LeaseLost`]. The database's time is not needed, so clocks that disagree do not
    /// matter.
    pub fn lease_left<P>(&self, lease: &Lease<P>) -> Duration {
        let since = self.clock.monotonic().saturating_sub(lease.confirmed_at);
        self.lease_ttl.saturating_sub(since)
    }

    /// A reading of the lease clock, taken before a statement that sets a lease is sent.
    pub(crate) fn lease_clock(&self) -> Duration {
        self.clock.monotonic()
    }

    pub(crate) fn ttl_millis(&self) -> i64 {
        // Bounded to one hour by `new`, so it fits.
        self.lease_ttl.as_millis() as i64
    }

    /// The retention in milliseconds, for `$n * interval '1 millisecond'`; NULL in SQL when
    /// there is none, which makes every age comparison with it NULL (not expired).
    pub(crate) fn retention_millis(&self) -> Option<i64> {
        // Bounded to ten years by `with_retention`, so it fits.
        self.retention.map(|r| r.as_millis() as i64)
    }
}

/// The lease a claim's row grants; `asked_at` is the lease clock's reading from before the
/// claim's statement was sent.
pub(crate) fn lease_from_row<P: RecoveryPoint>(
    row: &PgRow,
    owner: Owner,
    asked_at: Duration,
) -> Result<Lease<P>, Error> {
    let key_id: i64 = row.get("id");
    let point: String = row.get("recovery_point");
    let recovery_point =
        P::from_name(&point).ok_or(Error::UnknownRecoveryPoint { key_id, point })?;
    Ok(Lease {
        key_id,
        request_uuid: row.get("request_uuid"),
        owner,
        token: row.get("lease_token"),
        attempts: row.get("attempts"),
        completer_attempts: row.get("completer_attempts"),
        recovery_point,
        params: row.get::<Json<Value>, _>("request_params").0,
        locked_until: row.get("locked_until"),
        confirmed_at: asked_at,
    })
}

pub(crate) fn stored_response(row: &PgRow, key_id: i64) -> Result<StoredResponse, Error> {
    let status: Option<i16> = row.get("response_status");
    let headers: Option<Json<Vec<(String, String)>>> =
        row.try_get("response_headers")
            .map_err(|_| Error::Corrupt {
                key_id,
                what: "response_headers",
            })?;
    let body: Option<Vec<u8>> = row.get("response_body");
    match (status, headers, body) {
        (Some(status), Some(Json(headers)), Some(body)) => {
            let status = u16::try_from(status).map_err(|_| Error::Corrupt {
                key_id,
                what: "response_status",
            })?;
            Ok(StoredResponse {
                status,
                headers,
                body,
            })
        }
        _ => Err(Error::Corrupt {
            key_id,
            what: "stored response",
        }),
    }
}

/// PostgreSQL's `foreign_key_violation`: a key's row is deleted (expired, abandoned) while a row
/// of another table still references it under a foreign key that forbids the delete.
const FOREIGN_KEY_VIOLATION: &str = "23503";

/// Whether `e` is a delete that the application's foreign keys refused.
pub(super) fn is_referenced(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some(FOREIGN_KEY_VIOLATION))
}
