//! The recovery point only earlier versions wrote: `charge_created`, the charge recorded on the
//! ride in a phase of its own and the response not stored yet. Kept so that their keys still
//! resume; this version never writes it. (Their other point, `started` — claimed, nothing
//! written — is every new key's first point now: the step that leaves it, in `mod.rs`, serves
//! both.)

use idempotency::{Advance, Halt, Step};

use super::error::{db, BookingError};
use super::outcomes::created;
use super::rows::stage_receipt;
use super::target::{RidePoint, Rider};
use crate::ride::RideView;

/// The final step of a key an earlier version left at `charge_created`: its charge is on the
/// ride already; the receipt job and the 201.
pub(super) async fn finish_recorded(
    rider: &Rider<'_>,
    step: &mut Step<'_, RidePoint>,
) -> Result<Advance<RidePoint>, Halt> {
    let mut pg = rider.state.store.statements_on(step.tx().await?);
    let ride = RideView::by_key(&mut pg, rider.user_id, rider.key_id)
        .await
        .map_err(db("load ride"))?
        .ok_or_else(|| BookingError::Internal(format!("no ride for key {}", rider.key_id)))?;
    stage_receipt(&mut pg, rider.user_id, ride.ride_id).await?;
    Ok(Advance::Finish(created(&ride)?))
}
