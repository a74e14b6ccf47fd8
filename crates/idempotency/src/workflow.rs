//! The library drives the steps: the application describes a request once, as a [`Workflow`],
//! and [`Store::run`] runs it for the request, and the [`Completer`] unchanged for a key its
//! request left behind.
//!
//! ```text
//!  Store::run ──claim merged with the first step──► step(Started) ──Advance::To(p)──► step(p) ── … ──► Advance::Finish(answer)
//!    │                                                │                                  │              stored, lease released
//!    ├─ Replayed · Mismatch · InFlight                └── Halt::retry: the step's writes rolled back, the lease released,
//!    │  (nothing written)                                  the point kept: RetryLater; the next claim resumes from it
//!    └─ Halt::fail(refusal): the step's writes rolled back, the refusal stored as the answer
//! ```
//!
//! A **step** is one transaction: what it writes through [`Step::tx`] commits with the point it
//! advances to, or with the final answer, or not at all. The transaction opens with a fence (the
//! key row locked if the lease is still this holder's), so a holder whose lease was taken over
//! writes nothing. A step that calls a foreign system does so through [`Step::call`], *before*
//! its first write, so that no transaction stays open across the call: the call runs under the
//! lease ([`Store::call_under_lease`]), renewed while it lasts and stopped once the lease may be
//! someone else's. Derive the call's idempotency key from [`Step::foreign_key`], so that a
//! resumed request asks for the same effect again instead of a second one.
//!
//! The driver owns the loop where money is lost:
//!
//! - the claim of a new key commits with the first step's writes (one transaction);
//! - it runs **detached** from the caller: a client that hangs up (the caller's future dropped)
//!   cannot stop the work between two steps; the outcome comes back on a channel;
//! - after a transient failure ([`Halt::retry`], an unconfirmed commit or renewal) it releases
//!   the lease at once, keeping the recovery point; after a lost lease it releases nothing and
//!   writes nothing (the new holder answers);
//! - every way it ends is an [`Outcome`]: the HTTP face turns each into one answer.
//!
//! ```no_run
//! use idempotency::{Advance, Halt, IdempotencyKey, Outcome, Owner, Request, Step, Store, StoredResponse, Workflow};
//! use serde_json::json;
//!
//! idempotency::recovery_points! {
//!     /// One commit before the call, one after.
//!     pub enum Point { Paid = "paid" }
//! }
//!
//! struct Order;
//!
//! impl Workflow for Order {
//!     type Point = Point;
//!     fn route(&self) -> &str { "/orders" }
//!     async fn step(&self, point: Point, step: &mut Step<'_, Point>) -> Result<Advance<Point>, Halt> {
//!         match point {
//!             Point::Started => {
//!                 sqlx::query("INSERT INTO orders (key_id) VALUES ($1)")
//!                     .bind(step.key_id()).execute(step.tx().await?).await?;
//!                 Ok(Advance::To(Point::Paid))
//!             }
//!             Point::Paid => {
//!                 let key = step.foreign_key("ship");
//!                 step.call(async { let _ = key; /* a foreign call */ }).await?;
//!                 Ok(Advance::Finish(StoredResponse::json(201, &json!({"ok": true}), vec![])))
//!             }
//!             Point::Finished => unreachable!("the driver never steps a finished key"),
//!         }
//!     }
//! }
//!
//! # async fn example(store: Store) -> Result<(), Box<dyn std::error::Error>> {
//! let order = std::sync::Arc::new(Order);
//! let request = Request::new(Owner::new("alice")?, IdempotencyKey::parse(b"k1")?, json!({"sku": 7}));
//! match store.run(&order, request).await {
//!     Outcome::Answered(answer) | Outcome::Replayed(answer) => println!("{}", answer.status),
//!     other => println!("{other:?}"),
//! }
//! # Ok(()) }
//! ```

mod complete;
mod drive;

use std::any::Any;
use std::future::Future;
use std::time::Duration;

use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::store::{FirstPhase, Lease, OpenStep, RecoveryPoint, Store};
use crate::{Error, IdempotencyKey, Owner, StoredResponse};

pub use complete::{run_until, Completer};

/// The kinds of a transient failure ([`Outcome::RetryLater`]): the library's own, and the
/// default of a [`Halt::retry`]. An application names its own with [`Halt::kind`].
pub mod kind {
    /// A [`Halt::retry`](super::Halt::retry) that named no kind.
    pub const RETRY: &str = "retry";
    /// A step's commit was not confirmed (the wait for a synchronous standby was cancelled): it
    /// may or may not have committed; the key was released for a retry to resume or replay.
    pub const COMMIT_UNCONFIRMED: &str = "commit-unconfirmed";
    /// A renewal of the lease during a foreign call went unanswered while the lease lasted: the
    /// call was stopped; no other holder is known to have the key, so it was released (fenced:
    /// only if it was still this holder's) for a retry to resume.
    pub const LEASE_UNCONFIRMED: &str = "lease-unconfirmed";
}

/// The most steps one run takes before it stops: a workflow that keeps advancing without
/// finishing is a bug (a cycle among its points), not work to do. The lease is released and the
/// key left to a later attempt.
pub const MAX_STEPS: usize = 8;

/// The `Retry-After` of a [`Halt::retry`] that names none: one second, long enough for a
/// foreign system's blip, short enough that a client retrying on it resumes soon.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// A request described once: its recovery points and the step that leaves each one.
///
/// The driver calls [`Workflow::step`] with the key's current point, runs each step in a
/// transaction of its own, and stops at the first [`Advance::Finish`] or [`Halt`]. The same
/// description serves the request ([`Store::run`]) and the [`Completer`], which resumes a
/// key from its stored point and parameters.
pub trait Workflow: Send + Sync + 'static {
    /// The recovery points, usually declared with [`recovery_points!`](crate::recovery_points).
    type Point: RecoveryPoint;

    /// The route template the keys are scoped by (`/accounts/{id}/transfers`), never a concrete
    /// path: the completer finds every key of the route by it. The path's parameters (the
    /// account's `id`) must be in the request's parameters: the fingerprint is made of the
    /// method, this template and the parameters, so a request that left them out would replay
    /// one account's answer to the same key and body sent to another.
    fn route(&self) -> &str;

    /// The HTTP method: `POST` unless told otherwise.
    fn method(&self) -> &str {
        "POST"
    }

    /// Whether a request's claim tries the key's insert first (one transaction for a new key,
    /// [`Store::begin_optimistic`]) rather than reading the key first ([`Store::begin`]: a
    /// replay is one read that takes no lock and writes nothing, a new key one read more). The
    /// default, `false`, suits a service whose clients retry and replay; a service whose keys
    /// almost never repeat (a payment gateway, where a retry is the exception) may claim insert
    /// first. Measured on Rocket Rides' bookings: insert first saves a transaction per new key
    /// and is no faster for them, and halves the rate of replays. The completer never claims
    /// this way (its keys exist).
    fn claims_insert_first(&self) -> bool {
        false
    }

    /// Runs the step that leaves `point` (never `FINISHED`): its writes go through
    /// [`Step::tx`], its foreign calls through [`Step::call`] (before the first write).
    fn step(
        &self,
        point: Self::Point,
        step: &mut Step<'_, Self::Point>,
    ) -> impl Future<Output = Result<Advance<Self::Point>, Halt>> + Send;
}

/// Where a step leaves the request.
#[derive(Debug)]
pub enum Advance<P> {
    /// Commit the step's writes with this recovery point (not `STARTED`, not `FINISHED`), and
    /// run the step that leaves it.
    To(P),
    /// The final answer: stored with the step's writes, in the same transaction, and the lease
    /// released. Replayed to every later request with the key.
    Finish(StoredResponse),
}

/// Why a step stopped short of advancing: the step returns it, or gets it from `?` on the
/// library's and sqlx's errors.
#[derive(Debug)]
pub struct Halt(pub(crate) Stop);

#[derive(Debug)]
pub(crate) enum Stop {
    Retry {
        cause: String,
        after: Duration,
        kind: &'static str,
    },
    Fail(StoredResponse),
    Error(Error),
    /// A foreign call asked for after the step's first write.
    Misuse(&'static str),
}

impl Halt {
    /// A transient failure (a foreign system away): the step's writes are rolled back, the
    /// lease released, the recovery point kept; the client is told to retry after
    /// [`DEFAULT_RETRY_AFTER`] ([`Halt::after`] for another time), and its retry, or the
    /// completer, resumes here.
    pub fn retry(cause: impl std::fmt::Display) -> Self {
        Self(Stop::Retry {
            cause: cause.to_string(),
            after: DEFAULT_RETRY_AFTER,
            kind: kind::RETRY,
        })
    }

    /// Names the kind of a [`Halt::retry`] ([`kind::RETRY`] unless named), handed back in
    /// [`Outcome::RetryLater`], for an application that answers its transient failures apart (a
    /// payment pending, a gateway away); no effect on other halts. The library's own transient
    /// failures come with [`kind::COMMIT_UNCONFIRMED`] and [`kind::LEASE_UNCONFIRMED`].
    pub fn kind(mut self, name: &'static str) -> Self {
        if let Stop::Retry { kind, .. } = &mut self.0 {
            *kind = name;
        }
        self
    }

    /// Sets the `Retry-After` of a [`Halt::retry`] (and the least time before the completer
    /// tries the key again); no effect on other halts.
    pub fn after(mut self, wait: Duration) -> Self {
        if let Stop::Retry { after, .. } = &mut self.0 {
            *after = wait;
        }
        self
    }

    /// A final refusal (a card declined, an account without funds): the step's writes are rolled
    /// back, and `refusal` is stored as the request's answer, replayed to every retry. To keep
    /// the step's writes with the answer, return [`Advance::Finish`] instead.
    pub fn fail(refusal: StoredResponse) -> Self {
        Self(Stop::Fail(refusal))
    }
}

impl From<Error> for Halt {
    fn from(e: Error) -> Self {
        Self(Stop::Error(e))
    }
}

impl From<sqlx::Error> for Halt {
    fn from(e: sqlx::Error) -> Self {
        Self(Stop::Error(Error::Database {
            context: "a workflow step's statement".into(),
            source: e,
        }))
    }
}

/// A request for [`Store::run`]: the owner (whom the authentication names), the client's key and
/// the parameters (the JSON the completer will resume from). The method and the route are the
/// workflow's unless set; the fingerprint is computed from method, route and parameters.
#[derive(Debug, Clone)]
pub struct Request {
    pub(crate) owner: Owner,
    pub(crate) key: IdempotencyKey,
    pub(crate) params: Value,
    pub(crate) method: Option<String>,
    pub(crate) route: Option<String>,
}

impl Request {
    /// A request of `owner` with `key` and `params`. `params` holds everything the steps need,
    /// the path's parameters included ([`Workflow::route`]): the completer resumes from them, and
    /// the fingerprint that tells a replay from a reused key is made of them.
    pub fn new(owner: Owner, key: IdempotencyKey, params: Value) -> Self {
        Self {
            owner,
            key,
            params,
            method: None,
            route: None,
        }
    }

    /// The HTTP method, when it must be checked against the workflow's: a run whose method or
    /// route differs from the workflow's is refused ([`Outcome::Failed`]) before anything is
    /// written, since its key would be one the completer never finds.
    pub fn method(mut self, method: impl Into<String>) -> Self {
        self.method = Some(method.into());
        self
    }

    /// The route template, checked against the workflow's like [`Request::method`].
    pub fn route(mut self, route: impl Into<String>) -> Self {
        self.route = Some(route.into());
        self
    }
}

/// How a run ended. Every way is here, so that the HTTP face answers each one
/// (`idempotency_axum::respond`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// This run stored the answer (a success, or a final refusal from [`Halt::fail`]).
    Answered(StoredResponse),
    /// The key had finished with the same parameters: its stored answer, unchanged.
    Replayed(StoredResponse),
    /// The key was used with other parameters. Nothing was written.
    Mismatch,
    /// Another holder has the key's lease; retry after `retry_after`. Nothing was written.
    InFlight {
        /// Time left on the other holder's lease, whole seconds rounded up.
        retry_after: Duration,
    },
    /// A transient failure: the lease was released at the recovery point reached, and a retry
    /// after `retry_after` resumes there.
    RetryLater {
        /// When to retry.
        retry_after: Duration,
        /// What failed, for the log (not for a client).
        cause: String,
        /// Which transient failure: the step's [`Halt::kind`], or one of the library's
        /// ([`kind`]).
        kind: &'static str,
    },
    /// Another holder took the lease over during the run: it answers. Nothing more was written,
    /// nothing released.
    Lost,
    /// An error that is no one's transient failure (the database refused a statement, the
    /// workflow misbehaved): the lease was released. The cause is for the log, not for a client.
    Failed {
        /// What failed.
        cause: String,
    },
}

/// What a step has to work with: the lease's facts, a fenced transaction for its writes, and
/// foreign calls under the lease.
pub struct Step<'s, P: RecoveryPoint> {
    store: &'s Store,
    held: Held<P>,
    /// This holder moved the key to its point ([`Step::arrived`]).
    arrived: bool,
    /// What the previous step of this run handed on ([`Step::handed`]).
    pub(crate) handed: Option<Box<dyn Any + Send>>,
    /// What this step hands on to the next ([`Step::hand_on`]).
    pub(crate) hand_on: Option<Box<dyn Any + Send>>,
}

/// What the driver holds between and during steps.
pub(crate) enum Held<P: RecoveryPoint> {
    /// A new key, inserted at `STARTED` in this open transaction: the first step's writes join
    /// it. `savepoint`: the step took its savepoint (it asked for the transaction).
    First {
        phase: FirstPhase<P>,
        savepoint: bool,
    },
    /// A committed key's lease, and the step's transaction once it asked for one.
    Lease {
        lease: Lease<P>,
        open: Option<OpenStep>,
    },
}

impl<P: RecoveryPoint> Held<P> {
    fn lease(&self) -> &Lease<P> {
        match self {
            Self::First { phase, .. } => phase.lease(),
            Self::Lease { lease, .. } => lease,
        }
    }
}

impl<'s, P: RecoveryPoint> Step<'s, P> {
    /// The request's parameters, as stored with its first claim.
    pub fn params(&self) -> &Value {
        self.held.lease().params()
    }

    /// The owner of the key.
    pub fn owner(&self) -> &Owner {
        self.held.lease().owner()
    }

    /// The key row's id, for the application's own rows (a foreign key to the key row).
    pub fn key_id(&self) -> i64 {
        self.held.lease().key_id()
    }

    /// The request's random identifier, unique across databases: name the request with it in
    /// foreign systems.
    pub fn request_uuid(&self) -> Uuid {
        self.held.lease().request_uuid()
    }

    /// The idempotency key of the foreign call `name` (`"charge"`, `"notify"`): the same on
    /// every attempt at this request, different for every request and every name.
    pub fn foreign_key(&self, name: &str) -> String {
        format!("{name}-{}", self.request_uuid())
    }

    /// The step's transaction, for its writes: opened (and fenced) on the first call, committed
    /// with the step's [`Advance`], rolled back with a [`Halt`]. A lease taken over meanwhile
    /// stops the step here ([`Error::LeaseLost`] through `?`), before it writes anything.
    pub async fn tx(&mut self) -> Result<&mut PgConnection, Halt> {
        match &mut self.held {
            Held::First { phase, savepoint } => {
                if !*savepoint {
                    let key_id = phase.lease().key_id();
                    crate::store::savepoint(phase.conn(), key_id).await?;
                    *savepoint = true;
                }
                Ok(phase.conn())
            }
            Held::Lease { lease, open } => {
                if open.is_none() {
                    *open = Some(self.store.open_step(lease).await?);
                }
                // Set just above.
                Ok(open
                    .as_mut()
                    .expect("the step's transaction is open")
                    .conn())
            }
        }
    }

    /// Runs `call`, a call to a foreign system, under the lease: renewed while it lasts,
    /// stopped (dropped) once the lease may be someone else's, never started then (see
    /// [`Store::call_under_lease`]). Call before the step's first write: a transaction is
    /// never held open across a foreign call, and a call after [`Step::tx`] is refused.
    ///
    /// In the first step of a new key, the key is committed at `STARTED` before the call, so
    /// that its lease can be renewed.
    pub async fn call<F>(&mut self, call: F) -> Result<F::Output, Halt>
    where
        F: Future + Send,
    {
        let store = self.store;
        let lease = self.lease().await?;
        Ok(store.call_under_lease(lease, call).await?)
    }

    /// Whether this holder moved the key to the point the step leaves: the claim of a new key,
    /// or the previous step of this run. Then nobody else can have held the key since, and
    /// nothing was done at the point yet (no foreign call made from it): a step may trust what
    /// it wrote there. False for a key claimed again (a retry, the completer), whose earlier
    /// holder may have done anything the point allows.
    pub fn arrived(&self) -> bool {
        self.arrived
    }

    /// Hands `value` to the next step of this run, when this one ends with [`Advance::To`] and
    /// the run goes on: what the step learnt while it wrote (a row's id, a time) that the next
    /// step would otherwise read again, a transaction more. Within one run only: a key claimed
    /// at the next point (a retry, the completer) starts with nothing handed, so the next step
    /// must still be able to read what it needs. A second call replaces the first.
    pub fn hand_on<T: Any + Send>(&mut self, value: T) {
        self.hand_on = Some(Box::new(value));
    }

    /// What the previous step of this run handed on ([`Step::hand_on`]), taken once: `None`
    /// when the key was claimed at this point, when nothing was handed, or when it was not a
    /// `T`.
    pub fn handed<T: Any + Send>(&mut self) -> Option<T> {
        let handed = self.handed.take()?;
        handed.downcast().ok().map(|value| *value)
    }

    /// For experts: the lease itself, for what the step cannot do through [`Step::call`] and
    /// [`Step::tx`]: a fenced write of its own before a call ([`Store::phase`] at the step's
    /// point: a foreign call's record that must commit before the call leaves), a call the
    /// step keeps hold of ([`Store::watch_under_lease`]), the lease's clock
    /// ([`Store::lease_left`]). Each write through it is one fenced transaction of its own,
    /// committed before the step's own; a step that moves the point through it leaves from the
    /// point it moved to.
    ///
    /// Like [`Step::call`], asked for before the step's first write (refused after), and, in
    /// the first step of a new key, the key is committed at `STARTED` first.
    pub async fn lease(&mut self) -> Result<&mut Lease<P>, Halt> {
        const AFTER_WRITE: &str = "a foreign call or the lease asked for after the step's first \
                                   write: make calls first, or end the step with Advance::To \
                                   before the call";
        let after_write = matches!(
            &self.held,
            Held::First {
                savepoint: true,
                ..
            } | Held::Lease { open: Some(_), .. }
        );
        if after_write {
            return Err(Halt(Stop::Misuse(AFTER_WRITE)));
        }
        if let Held::First { .. } = &self.held {
            // Until the commit below answers, the driver holds the key's fence alone: if the
            // commit fails, the release it then tries is fenced like any other.
            let fence = Held::Lease {
                lease: self.held.lease().fence(),
                open: None,
            };
            let Held::First { phase, .. } = std::mem::replace(&mut self.held, fence) else {
                unreachable!("matched just above")
            };
            self.held = Held::Lease {
                lease: phase.commit().await?,
                open: None,
            };
        }
        let Held::Lease { lease, .. } = &mut self.held else {
            unreachable!("a lease is held from here")
        };
        Ok(lease)
    }
}
