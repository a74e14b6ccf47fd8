//! The admission gate: the requests that use the database are admitted as many at once as the
//! database can serve (`--admission-limit`: by default the pool's size, or six per CPU where
//! that is fewer, [`crate::config::ADMISSION_SLOTS_PER_CPU`]); a request that finds
//! every slot taken waits for one at most `--admission-wait`, then is shed with the 503
//! `over-capacity` problem and its `Retry-After`.
//!
//! ```text
//!  request ──slot free?──yes──────────────────────────► handler (auth, claim, booking task)
//!                  │                                        │ holds the slot while it uses the
//!                  └─no──wait ≤ --admission-wait──slot──┘   │ database; gives it back while it
//!                                     │                     │ waits on the gateway or on another
//!                                     │                     │ holder (Prefer: wait), and takes
//!                                     │                     ▼ one again after, never shed
//!                                     └─none──► 503 over-capacity, Retry-After: nothing written
//! ```
//!
//! Why a gate of its own and not only `--http-max-in-flight`: a count of requests in flight far
//! above the pool's connections lets them queue for a connection, each of a booking's four
//! transactions again, so that past capacity every answer waits seconds; a count near the
//! pool's size sheds the bursts of a load below capacity. Here the count is the pool's, and the
//! short wait absorbs bursts: a burst's queue clears in (its size ÷ bookings per second). The
//! wait is bounded, so the queue is too: at most the arrivals of one `--admission-wait` wait at
//! once. On a machine of few cores the processors bind before the pool: past a few bookings at
//! once per core, each more only shares them, every booking takes longer and no more are
//! served, so the count is then six per CPU.
//! `--http-max-in-flight` stays the outer bound of the whole edge.
//!
//! # Past capacity, a short wait
//!
//! The wait absorbs a burst; under a load the gate cannot serve, it is only a queue: every
//! admitted request would first wait nearly the whole `--admission-wait` for its slot (the oldest
//! waiter gets each slot freed), and the answers' latency would be that wait plus the request.
//! So a shed tells the gate that its queue stands: for [`OVERLOADED_FOR`] after any shed, a
//! request that finds no free slot waits at most `--admission-overload-wait` (10 ms by default),
//! and only when that long has passed without a shed does the whole wait come back. Below
//! capacity nothing is shed and nothing changes (a closed loop of more clients than slots, whose
//! queue clears within the whole wait, never starts it); past capacity the queue holds a few
//! milliseconds of arrivals, still enough to hand every freed slot on at once, so the gate
//! serves at least as many as before, each sooner, and sheds the rest sooner too. It is the
//! controlled-delay rule of queues that must keep latency bounded under overload: the wait a
//! queue may impose depends on whether it has drained lately. A client that ignores
//! `Retry-After` and sends again at once keeps the queue standing, and the short wait with it.
//!
//! # A slot is for the database, not for the gateway
//!
//! A booking waiting on the gateway, or a duplicate waiting for another request's answer
//! (`Prefer: wait`), holds no pooled connection: were it to keep its slot, a slow gateway would
//! bring the gate's capacity down to its limit divided by the gateway's time, and shed replays
//! and reads that need the database for a millisecond behind bookings that use none of it. So
//! the booking gives its slot back across each gateway call that has not answered within
//! [`HOLD_THROUGH`] ([`Admitted::away`]) and the handler across a `Prefer: wait`, and each
//! takes one again after. (A request body still arriving after as long gives its slot back
//! too, so that clients sending their bodies slowly cannot hold the database's routes shut;
//! but having written nothing yet, once its body has come and is a valid request, it is
//! admitted again as a new request is, and may be shed: [`Admitted::give_back_during`],
//! [`Admitted::admit_again`].) Taking it again is never a shed,
//! nor a wait: a booking admitted once may have charged meanwhile, its answer must not be a
//! capacity 503, and finishing a booking already started comes before starting a new one. So
//! a booking that comes back to no free slot goes on at once on credit (counted as
//! `http_admission_overdrawn_total`), and the next slot any request lets go pays the debt: it
//! is not handed to a new request. The gate's count is exceeded by at most the bookings back
//! from the gateway at one instant, and only until as many slots are let go; the pool's own
//! bound still holds meanwhile.
//!
//! The gate is on the routes that use the database on a client's behalf (`POST /rides`,
//! `GET /rides/{id}`, the benchmark's baseline), never on `/healthz`, `/readyz`, `/metrics` or
//! `/openapi.json`: a probe shed under load would take a busy but healthy process out of a load
//! balancer's rotation and put its load on the others. `/readyz` still takes a pooled
//! connection for its one statement, and gets one within a statement's time, since the admitted
//! requests hold at most one connection each at a time.
//!
//! It sits before the handler, so before the API key's look-up and the idempotency key's claim:
//! a shed request has written nothing, and its retry under the same key is a first attempt.
//!
//! It is the service's own rather than `idempotency-axum`'s: what it guards is this process's
//! pool, which routes use it is the service's choice, and its refusal is the service's problem
//! document and counter. A library version would take all three as parameters and gain little
//! over this one file.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tower::{Layer, Service};

use crate::metrics::Metrics;
use crate::problem::ApiError;

/// How long a request keeps its slot through work that uses no pooled connection before it
/// gives the slot back ([`Admitted::away`]). A call that answers within a booking's own time in
/// the database (a few milliseconds) costs the gate less held than given back and taken again
/// on credit: measured with a gateway on loopback, giving every call's slot back raised the
/// 201s' p50 at capacity from 14 to 177 ms (docs/performance.md). A slow gateway's call (real
/// Stripe answers in hundreds of milliseconds) gives its slot back after this long.
pub const HOLD_THROUGH: Duration = Duration::from_millis(20);

/// How long after a shed the gate keeps the short wait (`--admission-overload-wait`): sheds
/// that come at least this often keep it. The `Retry-After` of a shed: the clients shed come
/// back after as long.
pub const OVERLOADED_FOR: Duration = crate::config::OVERLOAD_RETRY_AFTER;

/// A slot of the gate, held by an admitted request: put in the request's extensions, so that
/// work the handler detaches from the connection (the booking's task) takes it along and the
/// slot is freed only once that work is done. Cloning shares the one slot: given back
/// ([`Admitted::away`]) by one clone, it is given back for all.
#[derive(Clone)]
pub struct Admitted(Arc<Slot>);

struct Slot {
    gate: AdmissionLayer,
    held: Mutex<Held>,
}

/// What an admitted request holds of the gate.
enum Held {
    /// A slot.
    Slot(OwnedSemaphorePermit),
    /// A slot on credit: the request came back to none free, and the next slot let go is its.
    Credit,
    /// Nothing: the request is away from the database.
    Away,
}

impl Admitted {
    /// Runs `work`, which uses no pooled connection (a gateway call): if it has not ended
    /// within [`HOLD_THROUGH`], with the slot given back until it does, then taken again
    /// ([`Admitted::take_again`]). Dropped half-way (the booking given up), the slot simply
    /// stays given back.
    pub async fn away<T>(&self, work: impl Future<Output = T>) -> T {
        let out = self.give_back_during(work).await;
        // A no-op when the work ended within the hold and the slot was kept.
        self.take_again();
        out
    }

    /// Runs `work`, which comes before the request writes anything (reading its body): if it
    /// has not ended within [`HOLD_THROUGH`], with the slot given back, and not taken again: the
    /// request asks for one with [`Admitted::admit_again`] once it knows it has work for the
    /// database (a body that fails, or is not a valid request, is answered without a slot).
    pub async fn give_back_during<T>(&self, work: impl Future<Output = T>) -> T {
        let mut work = std::pin::pin!(work);
        if let Ok(out) = tokio::time::timeout(HOLD_THROUGH, &mut work).await {
            return out;
        }
        self.give_back();
        work.await
    }

    /// After [`Admitted::give_back_during`], asks for a slot as a new request does: it waits at
    /// most the gate's wait, and past it is shed (`false`, counted). Nothing was written, so the
    /// shed's retry is a first attempt; and a client cannot pass the gate's count by sending its
    /// body slowly, as it could on credit. A slot still held is kept (`true` at once).
    pub async fn admit_again(&self) -> bool {
        if !matches!(*self.held(), Held::Away) {
            return true;
        }
        let Some(permit) = self.0.gate.admit().await else {
            return false;
        };
        let mut held = self.held();
        match *held {
            Held::Away => *held = Held::Slot(permit),
            // Another clone took one meanwhile (none does before the first write): keep it.
            Held::Slot(_) | Held::Credit => drop(permit),
        }
        true
    }

    /// Gives the slot back, if held, for as long as the request uses no pooled connection.
    pub fn give_back(&self) {
        let held = std::mem::replace(&mut *self.held(), Held::Away);
        self.0.gate.let_go(held);
    }

    /// Takes a slot again after [`Admitted::give_back`], at once and never shed: a free one,
    /// or, when none is, one on credit (the module's doc says why). A slot still held is kept.
    pub fn take_again(&self) {
        let mut held = self.held();
        if !matches!(*held, Held::Away) {
            return;
        }
        let gate = &self.0.gate;
        *held = match gate.slots.clone().try_acquire_owned() {
            Ok(permit) => Held::Slot(permit),
            Err(_) => {
                gate.debt.fetch_add(1, Ordering::AcqRel);
                gate.metrics.admission_overdrawn();
                Held::Credit
            }
        };
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        // Never held across an await: a poisoned lock is only a panicked give-back or take.
        self.0.held.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let held = std::mem::replace(
            self.held.get_mut().unwrap_or_else(|e| e.into_inner()),
            Held::Away,
        );
        self.gate.let_go(held);
    }
}

/// The gate as a tower layer ([`AdmissionLayer::new`]); one gate, shared by every route it
/// wraps.
#[derive(Clone)]
pub struct AdmissionLayer {
    slots: Arc<Semaphore>,
    /// Slots taken on credit and not yet paid back by a slot let go.
    debt: Arc<AtomicUsize>,
    wait: Duration,
    /// The wait within [`OVERLOADED_FOR`] of a shed: at most `wait`.
    overload_wait: Duration,
    /// When the gate last shed a request.
    last_shed: Arc<Mutex<Option<Instant>>>,
    metrics: Metrics,
}

impl AdmissionLayer {
    /// A gate of `limit` slots (at least one) whose requests wait at most `wait` for one, or
    /// at most `overload_wait` (cut to `wait`) within [`OVERLOADED_FOR`] of a shed; a shed is
    /// counted in `metrics` (`http_requests_shed_total`).
    pub fn new(limit: u32, wait: Duration, overload_wait: Duration, metrics: Metrics) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(limit.max(1) as usize)),
            debt: Arc::new(AtomicUsize::new(0)),
            wait,
            overload_wait: overload_wait.min(wait),
            last_shed: Arc::new(Mutex::new(None)),
            metrics,
        }
    }
}

impl<S> Layer<S> for AdmissionLayer {
    type Service = Admission<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Admission {
            inner,
            gate: self.clone(),
        }
    }
}

/// The gate in front of one route's service.
#[derive(Clone)]
pub struct Admission<S> {
    inner: S,
    gate: AdmissionLayer,
}

impl<S> Service<Request> for Admission<S>
where
    S: Service<Request, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request) -> Self::Future {
        // The service that was polled ready is the one called; its clone stays for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let gate = self.gate.clone();
        Box::pin(async move {
            let Some(permit) = gate.admit().await else {
                return Ok(ApiError::OverCapacity.into_response());
            };
            let admitted = Admitted(Arc::new(Slot {
                gate: gate.clone(),
                held: Mutex::new(Held::Slot(permit)),
            }));
            request.extensions_mut().insert(admitted.clone());
            let response = inner.call(request).await;
            // Held until the answer is made, whatever the handler did with the request's copy.
            drop(admitted);
            response
        })
    }
}

impl AdmissionLayer {
    /// Lets go of what a request held: a slot goes to a request on credit if one waits for it
    /// (forgotten by the semaphore: it stands for that request's from now on), else back to
    /// the gate; a slot on credit cancels a debt not yet paid, or else returns the slot that
    /// paid it.
    fn let_go(&self, held: Held) {
        let paid = || {
            self.debt
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| d.checked_sub(1))
                .is_ok()
        };
        match held {
            Held::Slot(permit) if paid() => permit.forget(),
            Held::Slot(permit) => drop(permit),
            Held::Credit if paid() => {}
            Held::Credit => self.slots.add_permits(1),
            Held::Away => {}
        }
    }

    /// A slot: at once when one is free, else the first freed within the wait (the semaphore
    /// hands slots out in arrival order), else none: the shed is remembered and counted.
    async fn admit(&self) -> Option<OwnedSemaphorePermit> {
        if let Ok(permit) = self.slots.clone().try_acquire_owned() {
            return Some(permit);
        }
        let wait = self.wait_now();
        let permit = if wait.is_zero() {
            None
        } else {
            // The semaphore is never closed: an error cannot come.
            tokio::time::timeout(wait, self.slots.clone().acquire_owned())
                .await
                .ok()
                .and_then(Result::ok)
        };
        if permit.is_none() {
            *self.last_shed() = Some(Instant::now());
            self.metrics.request_shed();
        }
        permit
    }

    /// How long a request that finds no free slot may wait for one now: the whole wait, or the
    /// overload wait within [`OVERLOADED_FOR`] of a shed.
    fn wait_now(&self) -> Duration {
        match *self.last_shed() {
            Some(shed) if shed.elapsed() < OVERLOADED_FOR => self.overload_wait,
            _ => self.wait,
        }
    }

    fn last_shed(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        // Never held across an await: a poisoned lock is only a panicked read or write of a time.
        self.last_shed.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use std::future::poll_fn;

    use axum::body::Body;
    use tokio::sync::{mpsc, watch};
    use tower::ServiceExt;

    use super::*;

    /// The overload wait of the gates below.
    const OVERLOAD_WAIT: Duration = Duration::from_millis(5);

    /// A gate of one slot in front of a service that says when a request entered it and
    /// answers 200 once `go` is true, with whether the request carried its slot.
    fn gated(
        wait: Duration,
        metrics: &Metrics,
    ) -> (
        impl Service<Request, Response = Response, Error = std::convert::Infallible, Future: Send>
            + Clone,
        mpsc::UnboundedReceiver<()>,
        watch::Sender<bool>,
    ) {
        behind(&AdmissionLayer::new(
            1,
            wait,
            OVERLOAD_WAIT,
            metrics.clone(),
        ))
    }

    /// [`gated`]'s service behind `gate`.
    fn behind(
        gate: &AdmissionLayer,
    ) -> (
        impl Service<Request, Response = Response, Error = std::convert::Infallible, Future: Send>
            + Clone,
        mpsc::UnboundedReceiver<()>,
        watch::Sender<bool>,
    ) {
        let (entered, entries) = mpsc::unbounded_channel();
        let (go, gone) = watch::channel(false);
        let inner = tower::service_fn(move |request: Request| {
            let (entered, mut gone) = (entered.clone(), gone.clone());
            async move {
                assert!(request.extensions().get::<Admitted>().is_some());
                entered.send(()).unwrap();
                gone.wait_for(|go| *go).await.unwrap();
                Ok::<_, std::convert::Infallible>(Response::new(Body::empty()))
            }
        });
        (gate.layer(inner), entries, go)
    }

    fn request() -> Request {
        Request::new(Body::empty())
    }

    #[tokio::test]
    async fn a_request_without_a_slot_is_admitted_when_one_frees_within_the_wait() {
        let metrics = Metrics::default();
        let (service, mut entries, go) = gated(Duration::from_secs(1), &metrics);
        let first = tokio::spawn(service.clone().oneshot(request()));
        entries.recv().await.unwrap();
        let mut second = Box::pin(service.oneshot(request()));
        // The slot is the first's: the second waits for it.
        assert!(poll_fn(|cx| Poll::Ready(second.as_mut().poll(cx)))
            .await
            .is_pending());
        go.send_replace(true);
        assert_eq!(first.await.unwrap().unwrap().status(), 200);
        assert_eq!(second.await.unwrap().status(), 200);
        assert!(entries.recv().await.is_some(), "the second entered");
        assert!(metrics.render(None).contains("http_requests_shed_total 0"));
    }

    /// An admitted request of `gate`, holding its one free slot.
    fn admitted(gate: &AdmissionLayer) -> Admitted {
        let permit = gate.slots.clone().try_acquire_owned().unwrap();
        Admitted(Arc::new(Slot {
            gate: gate.clone(),
            held: Mutex::new(Held::Slot(permit)),
        }))
    }

    #[test]
    fn a_request_back_to_no_free_slot_goes_on_on_credit_and_the_next_slot_let_go_is_its() {
        let metrics = Metrics::default();
        let gate =
            AdmissionLayer::new(1, Duration::from_millis(10), OVERLOAD_WAIT, metrics.clone());
        let back = admitted(&gate);
        back.give_back();
        // While it is away, another request takes the one slot.
        let other = admitted(&gate);
        // Back, it finds none free and goes on at once, on credit: not shed.
        back.take_again();
        assert!(matches!(*back.held(), Held::Credit));
        let rendered = metrics.render(None);
        assert!(
            rendered.contains("http_admission_overdrawn_total 1"),
            "{rendered}"
        );
        // The slot the other lets go pays the debt: no new request gets it.
        drop(other);
        assert_eq!(gate.slots.available_permits(), 0);
        // Done, the request on credit hands that slot back to the gate.
        drop(back);
        assert_eq!(gate.slots.available_permits(), 1);
        assert_eq!(gate.debt.load(Ordering::Acquire), 0);
    }

    #[tokio::test]
    async fn work_that_ends_within_the_hold_keeps_the_slot_and_longer_work_gives_it_back() {
        let gate = AdmissionLayer::new(
            1,
            Duration::from_millis(10),
            OVERLOAD_WAIT,
            Metrics::default(),
        );
        let slot = admitted(&gate);
        // A call that answers at once: the slot is held throughout.
        let free_during = slot.away(async { gate.slots.available_permits() }).await;
        assert_eq!(
            free_during, 0,
            "the slot was given back for a call of no time"
        );
        assert!(matches!(*slot.held(), Held::Slot(_)));
        assert_eq!(gate.slots.available_permits(), 0);
        // A call that has not answered within the hold: the slot is free while it runs.
        let (answer, answered) = tokio::sync::oneshot::channel::<()>();
        let away = tokio::spawn({
            let slot = slot.clone();
            async move { slot.away(async { answered.await.unwrap() }).await }
        });
        while gate.slots.available_permits() == 0 {
            tokio::task::yield_now().await;
        }
        answer.send(()).unwrap();
        away.await.unwrap();
        // Back: the free slot is its again.
        assert!(matches!(*slot.held(), Held::Slot(_)));
        assert_eq!(gate.slots.available_permits(), 0);
    }

    #[test]
    fn a_debt_not_yet_paid_is_cancelled_when_the_request_on_credit_ends_first() {
        let gate = AdmissionLayer::new(
            1,
            Duration::from_millis(10),
            OVERLOAD_WAIT,
            Metrics::default(),
        );
        let back = admitted(&gate);
        back.give_back();
        let other = admitted(&gate);
        back.take_again();
        drop(back);
        assert_eq!(gate.debt.load(Ordering::Acquire), 0);
        drop(other);
        assert_eq!(
            gate.slots.available_permits(),
            1,
            "the gate has its one slot"
        );
    }

    #[tokio::test]
    async fn after_a_shed_the_gate_waits_short_until_it_has_shed_nothing_for_a_while() {
        let wait = Duration::from_secs(30);
        let metrics = Metrics::default();
        let gate = AdmissionLayer::new(1, wait, OVERLOAD_WAIT, metrics.clone());
        let (service, mut entries, go) = behind(&gate);
        // Nothing shed yet: a request without a slot may wait the whole wait.
        assert_eq!(gate.wait_now(), wait);
        let holder = tokio::spawn(service.clone().oneshot(request()));
        entries.recv().await.unwrap();
        // A shed a moment ago (the whole wait is too long to sit through here): the queue
        // stands, and the next request without a slot is shed after the short wait.
        *gate.last_shed() = Some(Instant::now());
        assert_eq!(gate.wait_now(), OVERLOAD_WAIT);
        let before = *gate.last_shed();
        let shed = tokio::time::timeout(wait / 2, service.clone().oneshot(request()))
            .await
            .expect("shed after the short wait, not the whole one")
            .unwrap();
        assert_eq!(shed.status(), 503);
        assert!(
            *gate.last_shed() > before,
            "the shed is remembered: sheds that keep coming keep the short wait"
        );
        assert!(metrics.render(None).contains("http_requests_shed_total 1"));
        // A second without a shed: the whole wait is back for the next burst.
        *gate.last_shed() = Instant::now().checked_sub(OVERLOADED_FOR);
        assert_eq!(gate.wait_now(), wait);
        go.send_replace(true);
        assert_eq!(holder.await.unwrap().unwrap().status(), 200);
        // A gate whose whole wait is shorter keeps that: the short wait never lengthens it.
        let short = AdmissionLayer::new(1, Duration::from_millis(1), OVERLOAD_WAIT, metrics);
        *short.last_shed() = Some(Instant::now());
        assert_eq!(short.wait_now(), Duration::from_millis(1));
    }

    #[tokio::test]
    async fn a_request_without_a_slot_past_the_wait_is_shed_and_never_enters() {
        let metrics = Metrics::default();
        let (service, mut entries, go) = gated(Duration::from_millis(10), &metrics);
        let first = tokio::spawn(service.clone().oneshot(request()));
        entries.recv().await.unwrap();
        let shed = service.clone().oneshot(request()).await.unwrap();
        assert_eq!(shed.status(), 503);
        assert_eq!(shed.headers()["retry-after"], "1");
        assert!(metrics.render(None).contains("http_requests_shed_total 1"));
        go.send_replace(true);
        assert_eq!(first.await.unwrap().unwrap().status(), 200);
        assert!(entries.try_recv().is_err(), "the shed one never entered");
        // The slot is free again.
        assert_eq!(service.oneshot(request()).await.unwrap().status(), 200);
    }
}
