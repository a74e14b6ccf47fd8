//! What becomes of the key once the handler has run: its answer stored, the key released or
//! forgotten, in either of the layer's modes.

use std::collections::VecDeque;

use axum::body::{Body, Bytes};
use axum::response::Response;
use http_body_util::BodyExt;
use idempotency::{Abandoned, Lease, OneStep, OwnedFinalPhase, Store, StoredResponse};
use tokio::task::JoinError;

use super::body::Resumed;
use super::failed::{internal_response, store_failed};
use super::headers::kept_headers;
use super::{Disposition, IdempotencyLayer};
use crate::replay::stored_response;

/// What the layer holds of the key once the handler has run.
pub(super) enum Held {
    /// The lease alone (the default mode): whatever the handler wrote is committed already.
    Lease(Lease<OneStep>),
    /// The key's open transaction, with the handler's writes in it (the transactional mode).
    Transaction(OwnedFinalPhase<OneStep>),
}

impl Held {
    fn key_id(&self) -> i64 {
        match self {
            Self::Lease(lease) => lease.key_id(),
            Self::Transaction(phase) => phase.lease().key_id(),
        }
    }

    /// The lease, with the handler's writes in the key's transaction rolled back.
    async fn into_lease(self) -> Lease<OneStep> {
        match self {
            Self::Lease(lease) => lease,
            Self::Transaction(phase) => phase.roll_back().await,
        }
    }

    /// Releases the key, keeping its row: a retry runs the handler again.
    pub(super) async fn release(self, store: &Store) {
        release(store, self.into_lease().await).await;
    }

    /// Deletes the key (or releases it while rows reference it).
    async fn forget(self, store: &Store) {
        forget(store, self.into_lease().await).await;
    }

    /// Stores the answer and finishes the key; in the transactional mode, in the transaction of
    /// the handler's writes. If that fails, nothing of it is kept: a 500 to deliver instead, and
    /// the key is released for the retry (a release that finds the key finished after all, its
    /// commit's answer lost, changes nothing).
    async fn finish(self, store: &Store, stored: &StoredResponse) -> Result<(), Response> {
        let (error, lease) = match self {
            Self::Lease(mut lease) => {
                let finished = match store.final_phase(&mut lease).await {
                    Ok(phase) => phase.finish(stored).await,
                    Err(e) => Err(e),
                };
                match finished {
                    Ok(()) => return Ok(()),
                    Err(e) => (e, lease),
                }
            }
            Self::Transaction(phase) => match phase.finish(stored).await {
                Ok(()) => return Ok(()),
                Err(failed) => failed,
            },
        };
        if !matches!(error, idempotency::Error::LeaseLost { .. }) {
            release(store, lease).await;
        }
        Err(store_failed(error))
    }
}

/// Does with the key what the handler's run and its answer's disposition say, and gives the
/// answer to deliver. A handler that failed or panicked releases the key, with a 500.
pub(super) async fn settle<E: std::fmt::Display>(
    layer: &IdempotencyLayer,
    held: Held,
    ran: Result<Result<Response, E>, JoinError>,
) -> Result<Response, Response> {
    let answer = match ran {
        Ok(Ok(answer)) => answer,
        Ok(Err(e)) => {
            held.release(&layer.store).await;
            return Err(internal_response(&format!("the handler failed: {e}")));
        }
        Err(e) => {
            held.release(&layer.store).await;
            return Err(internal_response(&format!("the handler panicked: {e}")));
        }
    };
    let (answer_parts, answer_body) = answer.into_parts();
    match (layer.disposition)(&answer_parts) {
        Disposition::Store => {}
        Disposition::Release => {
            held.release(&layer.store).await;
            return Ok(Response::from_parts(answer_parts, answer_body));
        }
        Disposition::Forget => {
            held.forget(&layer.store).await;
            return Ok(Response::from_parts(answer_parts, answer_body));
        }
    }
    let collected = match collect_up_to(answer_body, layer.max_stored_body).await {
        Collected::Whole(bytes) => bytes,
        Collected::TooLarge(resumed) => return too_large(layer, held, answer_parts, resumed).await,
        Collected::Broken(e) => {
            // The answer cannot be delivered either: nothing to replay, the key goes back.
            held.release(&layer.store).await;
            return Err(internal_response(&format!("the answer's body failed: {e}")));
        }
    };
    let stored = StoredResponse {
        status: answer_parts.status.as_u16(),
        headers: kept_headers(&layer.stored_headers, &answer_parts.headers),
        body: collected.to_vec(),
    };
    held.finish(&layer.store, &stored).await?;
    // The first delivery is built from what was stored, so replays repeat exactly this.
    Ok(stored_response(&stored))
}

/// An answer too large to store: the key is released. In the default mode the answer is
/// delivered whole (its effect is done); in the transactional mode the handler's writes are
/// rolled back with the key's transaction, so a success would be a lie: 500.
async fn too_large(
    layer: &IdempotencyLayer,
    held: Held,
    answer_parts: http::response::Parts,
    resumed: Resumed,
) -> Result<Response, Response> {
    let (key_id, limit) = (held.key_id(), layer.max_stored_body);
    let transactional = matches!(held, Held::Transaction(_));
    held.release(&layer.store).await;
    if transactional {
        return Err(internal_response(&format!(
            "the answer of key {key_id} is larger than the {limit} bytes it may store; its \
             writes were rolled back and the key released"
        )));
    }
    tracing::warn!(
        key_id,
        limit,
        "answer too large to store; delivered, not stored, key released"
    );
    Ok(Response::from_parts(answer_parts, Body::new(resumed)))
}

/// An answer's body, read up to a limit.
enum Collected {
    /// All of it, within the limit.
    Whole(Bytes),
    /// Over the limit: what was read, and the rest, to deliver whole.
    TooLarge(Resumed),
    /// It failed mid-way.
    Broken(axum::Error),
}

async fn collect_up_to(mut body: Body, limit: usize) -> Collected {
    let mut read: VecDeque<http_body::Frame<Bytes>> = VecDeque::new();
    let mut size = 0;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(e) => return Collected::Broken(e),
        };
        size += frame.data_ref().map_or(0, Bytes::len);
        read.push_back(frame);
        if size > limit {
            return Collected::TooLarge(Resumed { read, rest: body });
        }
    }
    let mut whole = Vec::with_capacity(size);
    for frame in read {
        if let Ok(data) = frame.into_data() {
            whole.extend_from_slice(&data);
        }
    }
    Collected::Whole(Bytes::from(whole))
}

pub(super) async fn release(store: &Store, lease: Lease<OneStep>) {
    let key_id = lease.key_id();
    if let Err(e) = store.release(lease).await {
        tracing::warn!(key_id, error = %e, "could not release the idempotency lease");
    }
}

/// Deletes the key of an answer that leaves nothing to keep, so that the key may be used again
/// with another payload; a key that rows of the application reference is released instead.
async fn forget(store: &Store, lease: Lease<OneStep>) {
    let key_id = lease.key_id();
    match store.abandon_or_release(lease).await {
        Ok(Abandoned::Deleted) => {}
        // The handler wrote rows that reference its key, against `Forget`'s contract: the key
        // keeps its row and payload, released, so that a retry runs the handler again at once.
        Ok(Abandoned::Released) => tracing::warn!(
            key_id,
            "could not forget the idempotency key: rows of the application reference it; \
             released instead, with its payload"
        ),
        // Another request took the key over: it is that request's to settle.
        Err(e @ idempotency::Error::LeaseLost { .. }) => {
            tracing::warn!(key_id, error = %e, "could not forget the idempotency key");
        }
        // The database failed. The store took the lease with the failed write, so the key stays
        // locked until its lease expires, and a retry with its payload then runs the handler
        // again.
        Err(e) => tracing::error!(
            key_id,
            error = %e,
            "could not forget the idempotency key; it stays locked until its lease expires"
        ),
    }
}
