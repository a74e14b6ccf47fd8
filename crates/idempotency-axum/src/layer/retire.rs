//! Every layer key finishes: the retirement of keys whose holder died and whose client never
//! came back.

use std::future::Future;
use std::time::Duration;

use idempotency::{Error, Store, StoredResponse};
use serde_json::json;

use crate::problem::PROBLEM_JSON;

/// The member the layer puts in every key's stored parameters, by which the retirement finds
/// the layer's keys among the application's.
pub(super) const LAYER_TAG: &str = "idempotency_layer";

/// How long a key the layer claimed may stay unfinished, its lease over and no retry come,
/// before it is retired ([`Retirer`]): 24 hours, a day of retries (Stripe keeps keys that long).
/// Within it, a retry with the key runs the handler again, as the default mode promises; past it,
/// the key is finished with [`RETIRED_TYPE`], so that the unfinished keys' gauge (and its alert)
/// comes back to zero and a late retry is told, not run.
pub const DEFAULT_RETIRE_AFTER: Duration = Duration::from_secs(24 * 3600);

/// The shortest [`Retirer::after`] accepts: an hour. Clients retry over minutes, and each retry
/// within the bound still runs the handler; a shorter bound is most likely a unit mistake.
pub const MIN_RETIRE_AFTER: Duration = Duration::from_secs(3600);

/// How many keys of one route a pass retires at most.
pub const DEFAULT_RETIRE_BATCH: i64 = 100;

/// The problem type of a retired key's answer.
pub const RETIRED_TYPE: &str = "urn:problem:idempotency:request-abandoned";

/// The detail of a retired key's answer.
pub const RETIRED_DETAIL: &str =
    "this request stopped before it answered, and no retry came before it was retired: whether \
     its effect happened is unknown; check, and send it again under a new Idempotency-Key if it \
     did not";

/// Retires the keys the layer claimed whose holder died after the claim (a killed process) and
/// whose client never came back: they would stay unfinished for ever, since a one-step handler
/// has no recovery point a [`idempotency::Completer`] could resume from.
///
/// A key unfinished, its lease over, and not attempted for [`Retirer::after`] (by default
/// [`DEFAULT_RETIRE_AFTER`], 24 h) is finished with a stored 500 problem of type
/// [`RETIRED_TYPE`]: a late retry gets that answer, marked replayed, and the handler does not
/// run. **What it means for the effect:** the handler may have made it or not (the process died
/// somewhere in it; in the [transactional mode](super#the-transactional-mode) it did not, as
/// the crash rolled it back). The answer says so; the client checks before it sends the request
/// again under a new key. Within the bound a retry runs the handler again, as before.
///
/// Run it beside the reaper, in one process or many (claims skip each other's keys):
///
/// ```no_run
/// # async fn run(layer: idempotency_axum::IdempotencyLayer, stop: tokio::sync::oneshot::Receiver<()>) {
/// let retirer = layer.retirer();
/// retirer
///     .run_until(std::time::Duration::from_secs(60), async { let _ = stop.await; })
///     .await;
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Retirer {
    store: Store,
    after: Duration,
    batch: i64,
}

impl Retirer {
    pub(super) fn new(store: Store) -> Self {
        Self {
            store,
            after: DEFAULT_RETIRE_AFTER,
            batch: DEFAULT_RETIRE_BATCH,
        }
    }

    /// Retires keys left alone for `after` instead of [`DEFAULT_RETIRE_AFTER`]; refuses less
    /// than [`MIN_RETIRE_AFTER`] (an hour).
    pub fn after(mut self, after: Duration) -> Result<Self, Error> {
        if after < MIN_RETIRE_AFTER {
            return Err(Error::InvalidConfig(format!(
                "the layer's keys retire after an hour at least, got {after:?}"
            )));
        }
        self.after = after;
        Ok(self)
    }

    /// The stored answer of a retired key.
    pub fn answer() -> StoredResponse {
        let problem = json!({
            "type": RETIRED_TYPE,
            "title": "Request abandoned",
            "status": 500,
            "detail": RETIRED_DETAIL,
        });
        StoredResponse::json(
            500,
            &problem,
            vec![("content-type".to_owned(), PROBLEM_JSON.to_owned())],
        )
    }

    /// One pass: retires the keys due now; returns how many.
    pub async fn run_once(&self) -> Result<u64, Error> {
        self.store
            .retire_abandoned(LAYER_TAG, self.after, &Self::answer(), self.batch)
            .await
    }

    /// Passes every `every` until `stop` completes; a failed pass is logged and the next one
    /// tries again.
    pub async fn run_until(&self, every: Duration, stop: impl Future<Output = ()>) {
        tokio::pin!(stop);
        loop {
            if let Err(e) = self.run_once().await {
                tracing::error!(error = %e, "retiring abandoned layer keys failed");
            }
            tokio::select! {
                () = &mut stop => return,
                () = tokio::time::sleep(every) => {}
            }
        }
    }
}
