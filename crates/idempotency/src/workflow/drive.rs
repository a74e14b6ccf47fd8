//! The driver: the claim merged with the first step, the steps one transaction each, detached
//! from the caller, and every way it ends mapped to an [`Outcome`].

use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument;

use super::{Advance, Halt, Held, Outcome, Request, Step, Stop, Workflow, MAX_STEPS};
use crate::store::{Begun, Claim, Lease, NewRequest, RecoveryPoint, Store};
use crate::{Error, Fingerprint, StoredResponse};

/// How a drive ended, before the request's or the completer's view of it.
pub(super) enum Driven<P> {
    /// The answer is stored (a success or a final refusal).
    Finished(StoredResponse),
    /// Another holder took the lease over: nothing to release.
    Lost,
    /// Stopped short of an answer. `lease`: the lease to let go (none when the key's first step
    /// rolled back with its claim); `transient`: the kind of a failure a retry may get past
    /// ([`super::kind`]), none for the others.
    Stopped {
        lease: Option<Lease<P>>,
        cause: String,
        retry_after: Duration,
        transient: Option<&'static str>,
    },
}

impl Store {
    /// Runs `workflow` for `request`: the claim (merged with the first step for a new key),
    /// then the steps from the key's recovery point until an answer, at most
    /// [`MAX_STEPS`](super::MAX_STEPS) of them.
    ///
    /// The run is **detached**: it goes on in a task of its own, and dropping this future (a
    /// client that hung up) does not stop it between two steps; the outcome of a dropped run is
    /// its stored answer, for the client's retry. A run that panics leaves its lease to expire
    /// and is reported as [`Outcome::Failed`].
    pub async fn run<W: Workflow>(&self, workflow: &Arc<W>, request: Request) -> Outcome {
        let (store, workflow) = (self.clone(), workflow.clone());
        detached(async move { run_request(&store, &*workflow, request).await }).await
    }

    /// Runs `workflow` from a lease the caller holds (a claim of its own, a test's): the steps
    /// from the lease's recovery point, as [`Store::run`] runs them after its claim and the
    /// [`Completer`](super::Completer) for each abandoned key, detached the same way. The lease
    /// is released after a transient failure, never after a lost one.
    pub async fn resume<W: Workflow>(&self, workflow: &Arc<W>, lease: Lease<W::Point>) -> Outcome {
        let (store, workflow) = (self.clone(), workflow.clone());
        detached(async move {
            let held = Held::Lease { lease, open: None };
            settle(&store, drive(&store, &*workflow, held).await).await
        })
        .await
    }
}

/// Runs `run` in a task of its own, so that dropping the caller's future does not stop it
/// between two steps; a task that panics leaves its lease to expire.
async fn detached(run: impl std::future::Future<Output = Outcome> + Send + 'static) -> Outcome {
    let (send, outcome) = tokio::sync::oneshot::channel();
    let run = async move {
        let outcome = run.await;
        // The caller may be gone: the work is done either way.
        let _ = send.send(outcome);
    };
    tokio::spawn(run.instrument(tracing::Span::current()));
    outcome.await.unwrap_or_else(|_| Outcome::Failed {
        cause: "the workflow's task panicked".into(),
    })
}

async fn run_request<W: Workflow>(store: &Store, workflow: &W, request: Request) -> Outcome {
    let (method, route) = (workflow.method(), workflow.route());
    if request.method.as_deref().is_some_and(|m| m != method)
        || request.route.as_deref().is_some_and(|r| r != route)
    {
        return Outcome::Failed {
            cause: format!(
                "a request for {} {} run by the workflow of {method} {route}: its key would be \
                 one that workflow's completer never finds",
                request.method.as_deref().unwrap_or(method),
                request.route.as_deref().unwrap_or(route),
            ),
        };
    }
    let claim = NewRequest {
        owner: &request.owner,
        method,
        route,
        key: &request.key,
        fingerprint: Fingerprint::of_json(method, route, &request.params),
        params: &request.params,
    };
    let started = <W::Point as RecoveryPoint>::STARTED;
    let begun = if workflow.claims_insert_first() {
        store.begin_optimistic::<W::Point>(claim, started).await
    } else {
        store.begin::<W::Point>(claim, started).await
    };
    let held = match begun {
        Ok(Begun::New(phase)) => Held::First {
            phase,
            savepoint: false,
        },
        Ok(Begun::Existing(Claim::Acquired(lease))) => Held::Lease { lease, open: None },
        Ok(Begun::Existing(Claim::Replay(stored))) => return Outcome::Replayed(stored),
        Ok(Begun::Existing(Claim::Mismatch)) => return Outcome::Mismatch,
        Ok(Begun::Existing(Claim::InFlight { retry_after })) => {
            return Outcome::InFlight { retry_after }
        }
        // Nothing is held: nothing to release.
        Err(e) => return ended_by::<W::Point>(e, None).into_outcome(),
    };
    settle(store, drive(store, workflow, held).await).await
}

/// The outcome of a drive: the lease it stopped with released (at the point reached), unless
/// it was lost.
async fn settle<P: RecoveryPoint>(store: &Store, driven: Driven<P>) -> Outcome {
    match driven {
        Driven::Finished(answer) => Outcome::Answered(answer),
        Driven::Lost => Outcome::Lost,
        Driven::Stopped {
            lease,
            cause,
            retry_after,
            transient,
        } => {
            if let Some(lease) = lease {
                let key_id = lease.key_id();
                // Free the key at once for the client's retry, at the point reached.
                match store.release(lease).await {
                    Ok(()) => {}
                    // An unconfirmed commit may have committed: the key finished or moved on by
                    // this holder's own step, which is no sign of another holder. The answer
                    // stays unconfirmed; the retry finds the outcome.
                    Err(Error::LeaseLost { .. })
                        if transient != Some(super::kind::COMMIT_UNCONFIRMED) =>
                    {
                        return Outcome::Lost
                    }
                    Err(e) => {
                        tracing::warn!(key_id, error = %e, "could not release the key; its lease expires instead");
                    }
                }
            }
            tracing::warn!(%cause, ?transient, "the workflow stopped short of an answer");
            stopped(cause, retry_after, transient)
        }
    }
}

fn stopped(cause: String, retry_after: Duration, transient: Option<&'static str>) -> Outcome {
    match transient {
        Some(kind) => Outcome::RetryLater {
            retry_after,
            cause,
            kind,
        },
        None => Outcome::Failed { cause },
    }
}

impl<P> Driven<P> {
    /// The outcome of a drive that held nothing to release.
    fn into_outcome(self) -> Outcome {
        match self {
            Self::Finished(answer) => Outcome::Answered(answer),
            Self::Lost => Outcome::Lost,
            Self::Stopped {
                cause,
                retry_after,
                transient,
                ..
            } => stopped(cause, retry_after, transient),
        }
    }
}

/// Runs steps from the held key's recovery point until an answer or a halt, at most
/// [`MAX_STEPS`].
pub(super) async fn drive<W: Workflow>(
    store: &Store,
    workflow: &W,
    mut held: Held<W::Point>,
) -> Driven<W::Point> {
    // Whether this holder moved the key to its point ([`Step::arrived`]): a new key's claim, or
    // the previous step of this drive.
    let mut arrived = matches!(held, Held::First { .. });
    // What the previous step handed on ([`Step::hand_on`]): nothing for the first.
    let mut handed = None;
    for _ in 0..MAX_STEPS {
        let point = held.lease().recovery_point();
        let mut step = Step {
            store,
            held,
            arrived,
            handed: handed.take(),
            hand_on: None,
        };
        let result = workflow.step(point, &mut step).await;
        held = step.held;
        let (answer, roll_back) = match result {
            Ok(Advance::To(to)) => match held.advance(store, to).await {
                Ok(next) => {
                    held = next;
                    arrived = true;
                    handed = step.hand_on;
                    continue;
                }
                Err((e, lease)) => return ended_by(e, lease),
            },
            Ok(Advance::Finish(answer)) => (answer, false),
            Err(Halt(Stop::Fail(refusal))) => (refusal, true),
            Err(Halt(Stop::Retry { cause, after, kind })) => {
                return Driven::Stopped {
                    lease: held.let_go(),
                    cause,
                    retry_after: after,
                    transient: Some(kind),
                }
            }
            Err(Halt(Stop::Misuse(why))) => {
                return Driven::Stopped {
                    lease: held.let_go(),
                    cause: why.into(),
                    retry_after: Duration::ZERO,
                    transient: None,
                }
            }
            Err(Halt(Stop::Error(e))) => {
                let lease = held.let_go();
                return ended_by(e, lease);
            }
        };
        return match held.finish(store, &answer, roll_back).await {
            Ok(()) => Driven::Finished(answer),
            Err((e, lease)) => ended_by(e, lease),
        };
    }
    Driven::Stopped {
        lease: held.let_go(),
        cause: format!("the workflow took {MAX_STEPS} steps without an answer"),
        retry_after: Duration::ZERO,
        transient: None,
    }
}

/// The end of a drive by a store error: a lost lease is never released (the new holder answers);
/// an unconfirmed commit or renewal is an unknown outcome, released for a retry to resume or
/// replay; the rest is a failure, released too.
fn ended_by<P>(e: Error, lease: Option<Lease<P>>) -> Driven<P> {
    let transient = match &e {
        Error::LeaseLost { .. } => return Driven::Lost,
        Error::CommitUnconfirmed { .. } => Some(super::kind::COMMIT_UNCONFIRMED),
        // No other holder is known: the release below is fenced, so it frees the key only if
        // it is still this holder's, and a retry resumes at once instead of after the lease.
        Error::LeaseUnconfirmed { .. } => Some(super::kind::LEASE_UNCONFIRMED),
        Error::UnknownRecoveryPoint { .. }
        | Error::InvalidTransition { .. }
        | Error::Corrupt { .. }
        | Error::Migration(_)
        | Error::InvalidConfig(_)
        | Error::Database { .. } => None,
    };
    Driven::Stopped {
        lease,
        cause: e.to_string(),
        retry_after: super::DEFAULT_RETRY_AFTER,
        transient,
    }
}

impl<P: RecoveryPoint> Held<P> {
    /// Commits the step's writes with recovery point `to`. On an error, the lease to let go, if
    /// one is held.
    async fn advance(self, store: &Store, to: P) -> Result<Self, (Error, Option<Lease<P>>)> {
        match self {
            Self::First { phase, .. } => match store.commit_first_step(phase, to).await {
                Ok(lease) => Ok(Self::Lease { lease, open: None }),
                // The first step's transaction is gone with its claim: nothing is held.
                Err(e) => Err((e, None)),
            },
            Self::Lease { mut lease, open } => {
                let open = match open {
                    Some(open) => open,
                    None => match store.open_step(&lease).await {
                        Ok(open) => open,
                        Err(e) => return Err((e, Some(lease))),
                    },
                };
                match store.commit_step(open, &mut lease, to).await {
                    Ok(()) => Ok(Self::Lease { lease, open: None }),
                    Err(e) => Err((e, Some(lease))),
                }
            }
        }
    }

    /// Stores `answer` with the step's writes (or without them: `roll_back`) and releases the
    /// lease, in one transaction.
    async fn finish(
        self,
        store: &Store,
        answer: &StoredResponse,
        roll_back: bool,
    ) -> Result<(), (Error, Option<Lease<P>>)> {
        match self {
            Self::First {
                mut phase,
                savepoint,
            } => {
                if roll_back && savepoint {
                    let key_id = phase.lease().key_id();
                    if let Err(e) = crate::store::roll_back_step(phase.conn(), key_id).await {
                        return Err((e, None));
                    }
                }
                phase.finish(answer).await.map_err(|e| (e, None))
            }
            Self::Lease { mut lease, open } => {
                let (open, roll_back) = match open {
                    Some(open) => (open, roll_back),
                    // Nothing was written: nothing to roll back.
                    None => match store.open_step(&lease).await {
                        Ok(open) => (open, false),
                        Err(e) => return Err((e, Some(lease))),
                    },
                };
                match store.finish_step(open, &mut lease, answer, roll_back).await {
                    Ok(()) => Ok(()),
                    Err(e) => Err((e, Some(lease))),
                }
            }
        }
    }

    /// Rolls back the step's transaction, if any, and hands back the lease to let go: none for a
    /// new key, whose claim rolls back with its first step (as if the request never came).
    fn let_go(self) -> Option<Lease<P>> {
        match self {
            Self::First { .. } => None,
            // Dropping the step's transaction rolls it back.
            Self::Lease { lease, .. } => Some(lease),
        }
    }
}
