//! The lease kit: a foreign call (a payment gateway, a notification service, a slow handler) run
//! under a held lease, so that the lease outlives the call and the call never outlives the lease.
//!
//! A call slower than the lease TTL would otherwise let a retry take the key over and make the
//! call a second time at once. And a holder that stood still (a paused process, a frozen virtual
//! machine, a claim whose answer came late) may have lost its key without knowing, while the new
//! holder moved on: a call made now could be one the new holder makes too, under another foreign
//! key. So [`Store::call_under_lease`]:
//!
//! 1. before the call, renews the lease when less than one [`Store::heartbeat`] of it is left by
//!    this process's own monotonic clock ([`Store::lease_left`]), and does not start the call if
//!    the lease was taken over;
//! 2. during the call, renews the lease every heartbeat;
//! 3. stops at once when a renewal finds the lease taken over ([`Error::LeaseLost`]); a renewal
//!    that fails for another reason (the database, for a moment) is tried again at the next beat
//!    while the lease surely lasts past it, and only then stops the call with that error; a
//!    renewal that does not answer before the lease would run out (a pool with no free
//!    connection, a stalled network) stops the call with [`Error::LeaseUnconfirmed`], before the
//!    lease ends.
//!
//! Every write the store makes under a lease (a phase, the final phase, a release, a guarded call)
//! is logged on [`LEASE_LOG`] at debug level just before it is made, and every renewal that found
//! the lease taken over at warn level, so that an audit can check that a holder whose lease was
//! lost wrote nothing after.

use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use crate::store::{Lease, RecoveryPoint, Store};
use crate::Error;

/// The log target of a lease's life: every write about to be made under a lease, at debug level,
/// with the fields `key_id`, `token` and `write` (`phase`, `final_phase`, `release`, `abandon`,
/// `call`); every renewal that found the lease taken over, at warn level, with `key_id`, `token`
/// and `lost_on_renewal = true`.
pub const LEASE_LOG: &str = "idempotency::lease";

/// The most of a lease left unused when a renewal does not answer in time: the caller's time to
/// stop the call (a dropped future stops at once; an aborted task at its next await).
const STOP_MARGIN: Duration = Duration::from_secs(1);

/// Logs a write about to be made under `lease` (see [`LEASE_LOG`]).
pub(crate) fn writing<P: RecoveryPoint>(lease: &Lease<P>, write: &'static str) {
    tracing::debug!(
        target: LEASE_LOG,
        key_id = lease.key_id(),
        token = lease.token(),
        write,
        "writing under the lease"
    );
}

impl Store {
    /// Makes sure `lease` lasts at least one more heartbeat: renews it when less is left by this
    /// process's own clock. Returns [`Error::LeaseLost`] when it was taken over meanwhile: the
    /// holder must then write nothing more and make no foreign call.
    ///
    /// [`Store::call_under_lease`] does this first; call it yourself before work that the kit
    /// does not run (a handler spawned on a task of its own, say).
    pub async fn confirm_lease<P: RecoveryPoint>(&self, lease: &mut Lease<P>) -> Result<(), Error> {
        if self.lease_left(lease) < self.heartbeat {
            self.renew(lease).await?;
        }
        Ok(())
    }

    /// Runs `call`, a call to a foreign system, under `lease`: confirmed before, renewed during,
    /// stopped on loss (see the [module](crate::lease) for the rules). On an error, `call` has
    /// been dropped, or was never started.
    ///
    /// ```no_run
    /// # async fn example(store: idempotency::Store, mut lease: idempotency::Lease<idempotency::OneStep>) -> Result<(), idempotency::Error> {
    /// // Derive the foreign key from the request's UUID: a resumed request asks for the same
    /// // effect, and the foreign system answers it once.
    /// let foreign_key = format!("notify-{}", lease.request_uuid());
    /// let sent = store
    ///     .call_under_lease(&mut lease, async { notify(&foreign_key).await })
    ///     .await?;
    /// # let _ = sent; Ok(()) }
    /// # async fn notify(_key: &str) -> bool { true }
    /// ```
    pub async fn call_under_lease<P, F>(
        &self,
        lease: &mut Lease<P>,
        call: F,
    ) -> Result<F::Output, Error>
    where
        P: RecoveryPoint,
        F: Future,
    {
        let mut call = pin!(call);
        self.watch_under_lease(lease, &mut call).await
    }

    /// Like [`Store::call_under_lease`], but the call stays the caller's: on an error it is neither
    /// dropped nor polled further, so that the caller decides what becomes of it (abort a spawned
    /// task and wait for it to end, say, so that nothing of it runs once the key is released).
    #[tracing::instrument(
        name = "idempotency.call",
        level = "debug",
        skip_all,
        fields(
            key_id = lease.key_id(),
            token = lease.token(),
            recovery_point = lease.recovery_point().name()
        )
    )]
    pub async fn watch_under_lease<P, F>(
        &self,
        lease: &mut Lease<P>,
        call: &mut F,
    ) -> Result<F::Output, Error>
    where
        P: RecoveryPoint,
        F: Future + Unpin,
    {
        self.confirm_lease(lease).await?;
        writing(lease, "call");
        let heartbeat = self.heartbeat;
        let mut ticker =
            tokio::time::interval_at(tokio::time::Instant::now() + heartbeat, heartbeat);
        loop {
            tokio::select! {
                outcome = &mut *call => return Ok(outcome),
                _ = ticker.tick() => match self.renew_in_time(lease).await {
                    Ok(()) => {
                        tracing::debug!(key_id = lease.key_id(), "lease renewed during the call");
                    }
                    Err(e @ (Error::LeaseLost { .. } | Error::LeaseUnconfirmed { .. })) => {
                        return Err(e)
                    }
                    Err(e) if self.lease_left(lease) > heartbeat => {
                        tracing::warn!(
                            key_id = lease.key_id(),
                            error = %e,
                            "could not renew the lease; trying again at the next beat"
                        );
                    }
                    Err(e) => return Err(e),
                },
            }
        }
    }

    /// Renews `lease` while a call runs under it, waiting for the answer no longer than the
    /// lease surely lasts, less a margin in which the caller stops the call. A renewal held up (a
    /// pool with no free connection, a stalled network) would otherwise let the lease run out
    /// while the call goes on, and a new holder make it a second time at once.
    async fn renew_in_time<P: RecoveryPoint>(&self, lease: &mut Lease<P>) -> Result<(), Error> {
        let margin = (self.heartbeat / 2).min(STOP_MARGIN);
        let within = self.lease_left(lease).saturating_sub(margin);
        match tokio::time::timeout(within, self.renew(lease)).await {
            Ok(renewed) => renewed,
            Err(_) => {
                tracing::warn!(
                    target: LEASE_LOG,
                    key_id = lease.key_id(),
                    token = lease.token(),
                    waited = ?within,
                    "no answer to the lease's renewal while it lasted: the call is stopped"
                );
                Err(Error::LeaseUnconfirmed {
                    key_id: lease.key_id(),
                    token: lease.token(),
                })
            }
        }
    }

    /// The period at which [`Store::call_under_lease`] renews a lease, and the least of a lease
    /// that must be left before a call starts.
    pub fn heartbeat(&self) -> Duration {
        self.heartbeat
    }

    /// Sets [`Store::heartbeat`]: above zero and below half of the lease TTL, so that a renewal
    /// that fails once is tried again before the lease ends. By default a third of the TTL.
    pub fn with_heartbeat(mut self, period: Duration) -> Result<Self, Error> {
        self.heartbeat = crate::store::check_heartbeat(self.lease_ttl(), period)?;
        Ok(self)
    }
}
