//! A tower layer that makes a one-step handler idempotent.
//!
//! ```text
//!  request ─► key? ─► scope ─► body (bounded) ─► claim ──acquired──► handler (its own task)
//!                                                  │                   ├─ Store ─────► store, answer
//!                                                  │                   ├─ Release ───► release, answer
//!                                                  │                   ├─ Forget ────► delete key, answer
//!                                                  │                   ├─ panic ─────► release, 500
//!                                                  │                   └─ too large ─► release, answer
//!                                                  └─ replay / 422 / 409 ─► answer without calling the handler
//! ```
//!
//! In the [transactional mode](#the-transactional-mode) the handler runs inside the key's own
//! transaction, which stores the answer with the handler's writes or rolls them back with it.
//!
//! The layer claims the key, calls the handler once, and lets the answer's [`Disposition`] decide
//! what becomes of the key. By default ([`Disposition::for_status`]):
//!
//! - **a final answer is stored** (2xx, 3xx, and 4xx other than 400, 408, 409, 413, 415, 422,
//!   425 and 429): later requests with the key get it byte for byte, with
//!   `Idempotent-Replayed: true`;
//! - **an answer that invites a retry is not** (5xx, 408, 409, 425, 429): the key's lease is
//!   released, and a retry with the key and its payload runs the handler again;
//! - **a validation refusal forgets the key** (400, 413, 415, 422), as Stripe keeps nothing of a
//!   request that failed validation: the key's row is deleted, and a corrected payload may use
//!   the key. The delete is fenced by the lease ([`Store::abandon_or_release`]).
//!
//!   A handler that wrote rows referencing its key before it refused (against
//!   [`Disposition::Forget`]'s contract) keeps the key alive only if their foreign key refuses
//!   the delete (`RESTRICT` or `NO ACTION`): the key is then released instead, with its payload,
//!   a retry with that payload runs the handler again at once, and another payload under the key
//!   is refused (422); this is logged. A foreign key `ON DELETE SET NULL`, which
//!   [`Store::with_retention`] requires, lets the delete through: the rows stay without their
//!   key, and a corrected retry is a new request that runs the handler again. Give a handler
//!   that writes the [transactional mode](#the-transactional-mode), where a refusal rolls its
//!   writes back before the key is forgotten.
//!
//! [`IdempotencyLayer::with_disposition`] decides otherwise, from the answer's status, headers
//! or extensions.
//!
//! - **Scope and fingerprint.** A key is scoped by its owner, the method and the matched route
//!   template (axum's `MatchedPath`: `/accounts/{id}/transfers`), as every key of the library
//!   is; the concrete path and query go into the fingerprint. So `POST /accounts/A/transfers`
//!   and `POST /accounts/B/transfers` with one key are one key with two payloads (422), and a
//!   [`idempotency::Completer`] or the [`Retirer`] of the route finds
//!   every key of it. Outside an axum router (no `MatchedPath`), the path and query are the
//!   scope, as in earlier versions. A key an earlier version stored under the concrete path
//!   still replays (or resumes): a new key under the template is first looked for there (one
//!   read more for a new key only), and the old key answers instead. A scope longer than 255
//!   characters is kept as its SHA-256.
//! - **The handler sees the key it runs under**: a [`ClaimedKey`] in the request's extensions
//!   (and an extractor) gives the key row's id, the request's UUID, the client's key and the
//!   attempt number, so that the handler can derive a foreign idempotency key from the UUID
//!   (`format!("notify-{uuid}")`), the same on every retry, or log it.
//! - **Only the outcome's headers are stored** with the answer: `Content-Type` and `Location` by
//!   default, others named with [`IdempotencyLayer::store_headers`], never those of one delivery
//!   (`Date`, `Set-Cookie`: [`UNSTORABLE_HEADERS`]). The first delivery is built from what was
//!   stored, so it carries exactly the headers every replay will.
//! - **The claimed work runs detached** from the connection, in a task of its own: a client that
//!   hangs up does not cancel it, so the key is never left locked by a dropped future, and the
//!   client's retry finds the answer. The handler itself runs in a task inside it, so that a
//!   **panic** is seen, the key released, and the client answered 500.
//! - **A body that cannot be read** is a 400 (over the limit: 413); nothing is claimed.
//! - **An answer too large to store** (over [`IdempotencyLayer::max_stored_body`], 1 MiB at
//!   most) is passed to its client whole, but not stored: the key is released, and a retry runs
//!   the handler again. Give such a handler an effect that is idempotent by itself, or answer
//!   with a reference to the result rather than the result.
//! - **A JSON body is fingerprinted canonically** (key order and whitespace do not matter); any
//!   other body, and JSON with a NUL character (which PostgreSQL's `jsonb` cannot hold), by its
//!   exact bytes, under a fingerprint of another shape, so that a raw body never matches a JSON
//!   one, whichever came first: the raw body `hello` and the JSON string `"68656c6c6f"` (its hex)
//!   under one key are two payloads (422). Keys stored by earlier versions, which fingerprinted
//!   JSON bodies without a tag and raw bodies as the JSON string of their hex, still replay and
//!   resume; two such keys from before the upgrade stay as ambiguous as they were stored.
//! - **The lease is renewed while the handler runs** (every [`IdempotencyLayer::heartbeat`]), so
//!   a handler slower than the lease TTL is not taken over by a retry and run twice at once. If a
//!   renewal finds the lease taken over, the handler's task is aborted at its next await and its
//!   client gets 409 `lease-lost`: the request that took the key over answers instead. A renewal
//!   that fails otherwise is tried again at the next beat while the lease surely lasts past it;
//!   one that does not answer before the lease would run out
//!   ([`idempotency::Error::LeaseUnconfirmed`]), or that fails with no beat left, aborts the
//!   handler too: the key is released and the client gets 500.
//!
//! # Waiting for the holder
//!
//! A request whose key another request holds gets 409 with `Retry-After` at once, unless its
//! client asks to wait: `Prefer: wait=N` (RFC 7240, seconds; capped by
//! [`IdempotencyLayer::max_wait`], 10 s by default). It then waits up to N seconds for the holder
//! to finish and answers with the stored answer, marked `Idempotent-Replayed: true`; if the holder
//! lets the key go (a 5xx, a crash whose lease runs out), it claims the key itself and runs the
//! handler as any retry would; past N, the usual 409. It holds no pooled connection while it waits:
//! it reads the key now and then, each read a short statement on a pooled connection
//! ([`idempotency::Store::wait_for_answer_paced`]), so a storm of waiters cannot starve the pool.
//! `wait=0`, and a malformed `wait` (`wait=abc`, `wait=1.5`), mean no wait.
//!
//! # Every key finishes
//!
//! A key whose holder died after the claim (the process was killed mid-handler) is taken over by
//! its client's retry once the lease runs out, and the handler runs again. If no retry ever
//! comes, the [`Retirer`] ([`IdempotencyLayer::retirer`]) finishes the key after a bound
//! ([`DEFAULT_RETIRE_AFTER`], 24 h) with a stored 500 problem ([`RETIRED_TYPE`]) that says the
//! outcome is unknown, so the unfinished keys' gauge comes back to zero and a late retry is told
//! rather than run. The layer marks every key it writes (a member of the stored parameters, with
//! the request's method and path), which is how the retirer tells them from the application's.
//!
//! What the default mode cannot do: the handler's writes and the stored answer are not one
//! transaction. If the process dies after the handler's effect and before the answer is stored
//! (or the handler commits a write and then panics), the retry runs the handler again once the
//! lease expires: a deposit is made twice. Use the default mode for handlers whose effect is
//! idempotent by itself (an upsert, a call with a derived foreign key) or when one repetition
//! after a crash is acceptable; make a handler that only writes to the key's database
//! transactional; write handlers with several effects as phases ([`idempotency::Store::phase`],
//! as Rocket Rides does), where every step commits with its recovery point.
//!
//! # The transactional mode
//!
//! [`IdempotencyLayer::transactional`] makes the handler's database writes and the stored answer
//! one transaction. After the claim, the layer opens the key's final phase
//! ([`Store::final_phase_owned`]: a transaction that locks the key row) *before* the handler
//! runs, and hands it to the handler as a [`KeyTransaction`]. The handler writes through it;
//! once the handler has returned, the layer ends the transaction by the answer's disposition:
//!
//! ```text
//!  claim ─► BEGIN; lock the key row ─► handler writes through KeyTransaction ─┬─ Store ─► answer stored, COMMIT (writes and answer together)
//!                                                                             ├─ Release ► ROLLBACK, release
//!                                                                             ├─ Forget ─► ROLLBACK, delete the key
//!                                                                             └─ panic, error, too large ─► ROLLBACK, release, 500
//! ```
//!
//! - **A final answer commits with the writes**: a retry finds both, or neither. If storing it
//!   or the commit fails, the client gets 500, never the handler's answer, and nothing of the
//!   request is kept: the key is released, and a retry runs the handler anew at once. (A commit
//!   whose answer was lost may have landed: the release then finds the key finished and changes
//!   nothing, and the retry replays the answer.)
//! - **An answer that is not stored undoes the handler's writes**: a 5xx, 408, 409, 425 or 429
//!   (released) and a 400, 413, 415 or 422 (forgotten) roll them back, as do a panic, a handler error, an
//!   answer whose body fails and an answer too large to store (these answer 500: a success
//!   whose writes were undone would be a lie). A handler that must keep a write with such an
//!   answer (an audit row of a refusal) stores that answer instead
//!   ([`IdempotencyLayer::with_disposition`]).
//! - **A crash undoes everything**: a process that dies mid-handler loses its connection,
//!   PostgreSQL rolls the transaction back and frees the row, and a retry runs the handler
//!   cleanly once the lease expires.
//! - **No lease heartbeat**: the transaction holds the key row's lock until it ends, so no
//!   request can take the key over meanwhile (a renewal from another connection would wait for
//!   that lock). A retry gets 409 for as long as the transaction lasts, past the lease too: its
//!   takeover locks the row `NOWAIT`, finds it held and answers in flight at once, without
//!   waiting. Once the transaction has ended, a retry replays the answer or runs the handler
//!   anew.
//!
//! What the handler must do in this mode:
//!
//! - **make no foreign call** (a payment gateway, a message queue): the transaction stays open
//!   while it runs, and a call's effect would not roll back with it. Write phases instead;
//! - **be short**: it holds a pooled connection and the key row's lock while it runs. Bound a
//!   stuck one with PostgreSQL's `idle_in_transaction_session_timeout` on the pool's
//!   connections (its commit then fails: 500, nothing kept);
//! - **write through the [`KeyTransaction`] only**. A write through another connection commits
//!   on its own, outside the key's transaction. One of a row that references the key (a foreign
//!   key to `idempotency_keys`) must not be made at all: its foreign-key check waits for a
//!   `KEY SHARE` lock on the key row, which the key's transaction holds `FOR UPDATE` until the
//!   handler returns, while the handler waits for the write. PostgreSQL sees no deadlock (half
//!   of the cycle is the handler's own code): the write waits until a `lock_timeout` or
//!   `statement_timeout` ends it, or for good. And under load, a pool whose connections all
//!   wait for a second one starves;
//! - **let no statement fail unhandled**: a failed statement aborts the transaction, and a
//!   final answer then cannot be stored (500). Try a statement that may fail in a savepoint
//!   (`sqlx::Connection::begin` on the connection).

mod body;
mod claimed;
mod disposition;
mod failed;
mod headers;
mod prefer;
mod retire;
mod service;
mod settle;
mod transaction;

use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{response, HeaderName, StatusCode};
use idempotency::{Owner, Store};

pub use claimed::{ClaimedKey, NOT_CLAIMED_DETAIL};
pub use disposition::Disposition;
pub use headers::{StoredHeaderError, DEFAULT_STORED_HEADERS, UNSTORABLE_HEADERS};
pub use prefer::{wait_preference, DEFAULT_MAX_WAIT};
pub use retire::{
    Retirer, DEFAULT_RETIRE_AFTER, DEFAULT_RETIRE_BATCH, MIN_RETIRE_AFTER, RETIRED_DETAIL,
    RETIRED_TYPE,
};
pub use service::Idempotent;
pub use transaction::{KeyConnection, KeyTransaction, NO_TRANSACTION_DETAIL};

/// The default largest request body the layer buffers to fingerprint it: 64 KiB.
pub const DEFAULT_MAX_BODY: usize = 64 * 1024;

/// The largest response body the layer can store, 1 MiB (the key table's bound); larger answers
/// are passed through and not stored.
pub const MAX_STORED_BODY: usize = 1024 * 1024;

/// Detail of the 413.
pub const BODY_TOO_LARGE_DETAIL: &str = "the request body is larger than this endpoint accepts";

/// Detail of the 400 for a body that could not be read.
pub const BAD_BODY_DETAIL: &str = "the request body could not be read";

/// Detail of the 409 of a request whose lease was taken over while its handler ran.
pub const LEASE_LOST_DETAIL: &str =
    "another request with this Idempotency-Key took the request over; retry to get its answer";

/// Who owns a request's keys: a user id from the request, or the status to refuse it with
/// (typically 401), answered as an `about:blank` problem.
pub type ScopeFn = dyn Fn(&Parts) -> Result<Owner, StatusCode> + Send + Sync;

/// What becomes of the key, from the handler's answer (see [`Disposition`]).
pub type DispositionFn = dyn Fn(&response::Parts) -> Disposition + Send + Sync;

/// Wraps a service so that every request through it needs an `Idempotency-Key`.
#[derive(Clone)]
pub struct IdempotencyLayer {
    store: Store,
    scope: Arc<ScopeFn>,
    disposition: Arc<DispositionFn>,
    max_body: usize,
    max_stored_body: usize,
    stored_headers: Arc<[HeaderName]>,
    transactional: bool,
    max_wait: Duration,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("max_body", &self.max_body)
            .field("max_stored_body", &self.max_stored_body)
            .field("heartbeat", &self.heartbeat())
            .field("stored_headers", &self.stored_headers)
            .field("transactional", &self.transactional)
            .field("max_wait", &self.max_wait)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer over `store`; `scope` tells whose request it is (typically from an extension your
    /// authentication middleware set), or answers instead.
    pub fn new(
        store: Store,
        scope: impl Fn(&Parts) -> Result<Owner, StatusCode> + Send + Sync + 'static,
    ) -> Self {
        Self {
            store,
            scope: Arc::new(scope),
            disposition: Arc::new(|answer: &response::Parts| {
                Disposition::for_status(answer.status)
            }),
            max_body: DEFAULT_MAX_BODY,
            max_stored_body: MAX_STORED_BODY,
            stored_headers: DEFAULT_STORED_HEADERS.map(HeaderName::from_static).into(),
            transactional: false,
            max_wait: DEFAULT_MAX_WAIT,
        }
    }

    /// Runs the handler inside the key's own transaction, handed to it as a [`KeyTransaction`]:
    /// its writes through it commit together with the stored answer, or not at all. A handler
    /// that commits a deposit and then panics, or whose process dies before its answer is
    /// stored, leaves no deposit behind, and the retry makes it once.
    ///
    /// An answer that is not stored (5xx, 409, 400, 413, 415, 422 by default) undoes the handler's
    /// writes. The handler must make no foreign call and should be short: see [the transactional
    /// mode](self#the-transactional-mode) for what it gives and what it asks.
    ///
    /// ```
    /// use idempotency_axum::IdempotencyLayer;
    ///
    /// fn layer(store: idempotency::Store) -> IdempotencyLayer {
    ///     IdempotencyLayer::new(store, |_| Ok(idempotency::Owner::from(1))).transactional()
    /// }
    /// ```
    pub fn transactional(mut self) -> Self {
        self.transactional = true;
        self
    }

    /// The retirement of this layer's keys whose holder died and whose client never came back
    /// (see [`Retirer`]): run it beside the reaper, so that every key the layer claims finishes.
    pub fn retirer(&self) -> Retirer {
        Retirer::new(self.store.clone())
    }

    /// The longest a duplicate waits for its key's holder when its client asks to
    /// (`Prefer: wait=N`, RFC 7240): [`DEFAULT_MAX_WAIT`] (10 s) unless set. Zero turns waiting
    /// off. See [waiting for the holder](self#waiting-for-the-holder).
    pub fn max_wait(mut self, max: Duration) -> Self {
        self.max_wait = max;
        self
    }

    /// How often the lease is renewed while the handler runs: the store's
    /// [`Store::heartbeat`], by default a third of its lease TTL, so that one late renewal still
    /// leaves the lease alive. The [transactional mode](IdempotencyLayer::transactional) renews
    /// nothing: the key's transaction holds its row until the handler is done.
    pub fn heartbeat(&self) -> Duration {
        self.store.heartbeat()
    }

    /// Renews the lease every `every` while the handler runs, kept between 10 ms and a third of
    /// the store's lease TTL (see [`IdempotencyLayer::heartbeat`]).
    pub fn with_heartbeat(mut self, every: Duration) -> Self {
        let every = every.clamp(Duration::from_millis(10), self.store.lease_ttl() / 3);
        // Within the clamp the store accepts it: above zero, below half of the TTL.
        if let Ok(store) = self.store.clone().with_heartbeat(every) {
            self.store = store;
        }
        self
    }

    /// Decides what becomes of the key from the handler's answer (its status, headers and
    /// extensions), instead of [`Disposition::for_status`].
    ///
    /// A handler can decide for itself by putting a [`Disposition`] in its answer's extensions,
    /// with a predicate that looks there first:
    ///
    /// ```
    /// use idempotency_axum::layer::Disposition;
    /// use idempotency_axum::IdempotencyLayer;
    ///
    /// fn layer(store: idempotency::Store) -> IdempotencyLayer {
    ///     IdempotencyLayer::new(store, |_| Ok(idempotency::Owner::from(1))).with_disposition(|answer| {
    ///         answer
    ///             .extensions
    ///             .get::<Disposition>()
    ///             .copied()
    ///             .unwrap_or_else(|| Disposition::for_status(answer.status))
    ///     })
    /// }
    /// ```
    pub fn with_disposition(
        mut self,
        disposition: impl Fn(&response::Parts) -> Disposition + Send + Sync + 'static,
    ) -> Self {
        self.disposition = Arc::new(disposition);
        self
    }

    /// Changes the largest request body accepted (413 above it).
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }

    /// Changes the largest answer body stored, at most [`MAX_STORED_BODY`]. A larger answer is
    /// delivered but not stored, and its key is released (see the module's documentation).
    pub fn max_stored_body(mut self, bytes: usize) -> Self {
        self.max_stored_body = bytes.min(MAX_STORED_BODY);
        self
    }

    /// Stores and replays these headers of an answer instead of [`DEFAULT_STORED_HEADERS`]
    /// (`Content-Type` and `Location`): the list replaces the default, so name those too if the
    /// answer needs them. Names are case-insensitive (`X-Transfer-Id` is `x-transfer-id`), and
    /// every value of a named header is kept.
    ///
    /// Name only headers that describe the request's outcome, since every replay repeats them:
    /// a request id or a timestamp of the first delivery would be repeated too. Refuses a name
    /// that is not a header name, and the headers of one delivery ([`UNSTORABLE_HEADERS`]:
    /// `Date`, `Set-Cookie`, the framing and the connection's headers).
    ///
    /// ```
    /// use idempotency_axum::IdempotencyLayer;
    ///
    /// fn layer(store: idempotency::Store) -> IdempotencyLayer {
    ///     IdempotencyLayer::new(store, |_| Ok(idempotency::Owner::from(1)))
    ///         .store_headers(["content-type", "location", "x-transfer-id"])
    ///         .expect("valid, storable header names")
    /// }
    /// ```
    pub fn store_headers<I>(mut self, names: I) -> Result<Self, StoredHeaderError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        self.stored_headers = headers::stored_header_names(names)?;
        Ok(self)
    }
}

impl<S> tower::Layer<S> for IdempotencyLayer {
    type Service = Idempotent<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotent::new(inner, self.clone())
    }
}
