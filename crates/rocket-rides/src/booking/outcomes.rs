//! How a booking ends: a charge the gateway showed is settled (paid, pending or failed), a
//! decline or a refusal is stored, and each final phase stores its response with the ride's
//! rows in one transaction.

use std::time::Instant;

use idempotency::{Lease, StoredResponse};
use idempotency_axum::Problem;
use serde_json::json;

use super::charge::{under_lease, ChargeTarget};
use super::rows::{audit, charge_paid, stage_receipt};
use super::{crash_point, db, rider, BookingError, RidePoint, Step};
use crate::metrics::GatewayCall;
use crate::problem::types;
use crate::ride::RideView;
use crate::state::AppState;
use crate::stripe::{Charge, ChargeError, Refusal};

/// How the charge being settled was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Found {
    /// The gateway answered the create call.
    Created,
    /// A reconciling list found it by its metadata.
    Adopted,
    /// Retrieved again, after it was recorded pending.
    Retrieved,
}

/// A charge the gateway showed for this ride: paid, pending or failed by its status.
pub(super) async fn settle(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    target: &ChargeTarget,
    charge: Charge,
    found: Found,
) -> Result<Step, BookingError> {
    // Never record a charge that is not this ride's: a wrong amount or customer (or none: every
    // charge we ask for names its customer) means a bug or tampering, and an operator must look
    // before anything is stored.
    if charge.amount != i64::from(target.amount_cents)
        || charge.customer.as_deref() != Some(target.customer.as_str())
    {
        return Err(BookingError::Internal(format!(
            "gateway charge {} ({} cents, customer {:?}) does not match ride {} ({} cents, {})",
            charge.id,
            charge.amount,
            charge.customer,
            target.ride_id,
            target.amount_cents,
            target.customer
        )));
    }
    match charge.status.as_str() {
        "succeeded" => {
            crash_point(state, crate::failpoints::AFTER_GATEWAY_CHARGE)?;
            paid(state, lease, target.ride_id, &charge, found).await
        }
        "pending" => {
            if lease.recovery_point() == RidePoint::RideCreated {
                record_pending(state, lease, target.ride_id, &charge).await?;
            }
            Err(BookingError::PaymentPending(charge.id))
        }
        "failed" => {
            let code = charge.failure_code.as_deref().unwrap_or("card_declined");
            let message = charge
                .failure_message
                .as_deref()
                .unwrap_or("the card was declined");
            declined(state, lease, target.ride_id, code, message).await
        }
        other => Err(BookingError::GatewayUnavailable(format!(
            "charge {} is in a status this build does not know: {other:?}",
            charge.id
        ))),
    }
}

/// The final phase of a paid charge: the charge on the ride, its audit record, the receipt job
/// and the stored 201, in one transaction.
async fn paid(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    ride_id: i64,
    charge: &Charge,
    found: Found,
) -> Result<Step, BookingError> {
    let user_id = rider(lease)?;
    let mut phase = state.store.final_phase(lease).await?;
    let adopted = found == Found::Adopted;
    let ride = charge_paid(
        phase.conn(),
        state.store.persistent(),
        user_id,
        ride_id,
        &charge.id,
        adopted,
    )
    .await?;
    let response = created(&ride)?;
    phase.finish(&response).await?;
    Ok(Step::Respond(response))
}

/// The charge exists but is pending: recorded, so that the resumption retrieves it instead of
/// asking for it again.
async fn record_pending(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    ride_id: i64,
    charge: &Charge,
) -> Result<(), BookingError> {
    let user_id = rider(lease)?;
    let mut phase = state.store.phase(lease, RidePoint::ChargePending).await?;
    sqlx::query(
        "UPDATE rides SET charge_id = $3, status = 'payment_pending', updated_at = now()
         WHERE id = $1 AND user_id = $2",
    )
    .bind(ride_id)
    .bind(user_id)
    .bind(&charge.id)
    .persistent(state.store.persistent())
    .execute(phase.conn())
    .await
    .map_err(db("record pending charge"))?;
    audit(
        phase.conn(),
        state.store.persistent(),
        user_id,
        "ride.charge_pending",
        ride_id,
        json!({ "charge_id": charge.id }),
    )
    .await?;
    phase.commit().await?;
    Ok(())
}

/// From `charge_pending`: asks the gateway how the charge stands now.
pub(super) async fn resolve_pending(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
) -> Result<Step, BookingError> {
    let target = ChargeTarget::load(state, lease).await?;
    let charge_id = target.charge_id.clone().ok_or_else(|| {
        BookingError::Internal(format!(
            "ride {} is pending without a charge",
            target.ride_id
        ))
    })?;
    let started = Instant::now();
    let result = under_lease(state, lease, state.stripe.retrieve_charge(&charge_id)).await;
    state
        .metrics
        .gateway_call(GatewayCall::RetrieveCharge, started.elapsed());
    let result = result?;
    match result {
        Ok(charge) if charge.id == charge_id => {
            settle(state, lease, &target, charge, Found::Retrieved).await
        }
        Ok(other) => Err(BookingError::Internal(format!(
            "asked for charge {charge_id}, the gateway answered with {}",
            other.id
        ))),
        // The recorded charge is unknown to the gateway: nothing the request can decide alone.
        Err(ChargeError::Refused(refusal)) => Err(BookingError::Internal(format!(
            "the gateway does not know pending charge {charge_id}: {}",
            refusal.message
        ))),
        Err(ChargeError::Misconfigured(why)) => Err(BookingError::GatewayMisconfigured(why)),
        Err(
            e @ (ChargeError::Declined { .. }
            | ChargeError::StoredServerError { .. }
            | ChargeError::Transient(_)
            | ChargeError::UnknownAnswer { .. }),
        ) => Err(BookingError::GatewayUnavailable(e.to_string())),
    }
}

/// A gateway error: a decline or a refusal finishes the request; anything else hands it back.
pub(super) async fn refusal_or_error(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    ride_id: i64,
    error: ChargeError,
) -> Result<Step, BookingError> {
    match error {
        ChargeError::Declined { code, message } => {
            declined(state, lease, ride_id, &code, &message).await
        }
        ChargeError::Refused(refusal) => refused(state, lease, ride_id, &refusal).await,
        ChargeError::Misconfigured(why) => Err(BookingError::GatewayMisconfigured(why)),
        e @ (ChargeError::StoredServerError { .. }
        | ChargeError::Transient(_)
        | ChargeError::UnknownAnswer { .. }) => {
            Err(BookingError::GatewayUnavailable(e.to_string()))
        }
    }
}

/// The final phase of a declined card: the ride is marked, the 402 is stored.
pub(super) async fn declined(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    ride_id: i64,
    code: &str,
    message: &str,
) -> Result<Step, BookingError> {
    let user_id = rider(lease)?;
    let mut phase = state.store.final_phase(lease).await?;
    // A charge recorded pending that then failed is not the ride's charge: it moved no money.
    sqlx::query(
        "UPDATE rides SET status = 'declined', charge_id = NULL,
                          charge_doubt = NULL, charge_refusal = NULL, updated_at = now()
         WHERE id = $1 AND user_id = $2",
    )
    .bind(ride_id)
    .bind(user_id)
    .persistent(state.store.persistent())
    .execute(phase.conn())
    .await
    .map_err(db("mark ride declined"))?;
    audit(
        phase.conn(),
        state.store.persistent(),
        user_id,
        "ride.payment_declined",
        ride_id,
        json!({ "code": code }),
    )
    .await?;
    let problem = Problem::new(
        http::StatusCode::PAYMENT_REQUIRED,
        types::PAYMENT_DECLINED,
        "Payment declined",
    )
    .with_detail(format!("the card was declined: {message}"))
    .with_extension("decline_code", code.into());
    let response = problem_response(&problem);
    phase.finish(&response).await?;
    Ok(Step::Respond(response))
}

/// A refusal made up from an answer without the gateway's error object: only the negative
/// control `--without unknown-answers` takes one.
pub(super) fn made_up_refusal(status: u16) -> Refusal {
    Refusal {
        status,
        kind: "unknown".to_owned(),
        code: None,
        param: None,
        message: format!("HTTP {status}"),
    }
}

/// A refusal as the 502's `gateway_error` and the audit record show it.
pub(super) fn gateway_error(refusal: &Refusal) -> serde_json::Value {
    json!({
        "status": refusal.status,
        "type": refusal.kind,
        "code": refusal.code,
        "param": refusal.param,
    })
}

/// The final phase of a charge the gateway refused for good: the ride failed, the 502 is stored.
/// Retrying cannot change the gateway's answer, and a key that never finishes would be retried
/// by the completer forever.
pub(super) async fn refused(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
    ride_id: i64,
    refusal: &Refusal,
) -> Result<Step, BookingError> {
    tracing::error!(
        key_id = lease.key_id(),
        ride_id,
        status = refusal.status,
        kind = %refusal.kind,
        code = ?refusal.code,
        message = %redact_secrets(&refusal.message),
        "the gateway refused the charge for good"
    );
    let user_id = rider(lease)?;
    let mut phase = state.store.final_phase(lease).await?;
    sqlx::query(
        "UPDATE rides SET status = 'failed', charge_doubt = NULL, charge_refusal = NULL,
                          updated_at = now()
         WHERE id = $1 AND user_id = $2",
    )
    .bind(ride_id)
    .bind(user_id)
    .persistent(state.store.persistent())
    .execute(phase.conn())
    .await
    .map_err(db("mark ride failed"))?;
    let gateway_error = gateway_error(refusal);
    audit(
        phase.conn(),
        state.store.persistent(),
        user_id,
        "ride.payment_refused",
        ride_id,
        gateway_error.clone(),
    )
    .await?;
    let problem = Problem::new(
        http::StatusCode::BAD_GATEWAY,
        types::PAYMENT_REFUSED,
        "Payment refused by the gateway",
    )
    .with_detail(format!(
        "the payment gateway refused the charge: {}",
        redact_secrets(&refusal.message)
    ))
    .with_extension("gateway_error", gateway_error);
    let response = problem_response(&problem);
    phase.finish(&response).await?;
    state.metrics.payment_refused();
    Ok(Step::Respond(response))
}

/// The final phase of a key an earlier version left at `charge_created`: its charge is on the
/// ride already; the receipt job and the stored 201.
pub(super) async fn finish_recorded(
    state: &AppState,
    lease: &mut Lease<RidePoint>,
) -> Result<Step, BookingError> {
    let user_id = rider(lease)?;
    let key_id = lease.key_id();
    let mut phase = state.store.final_phase(lease).await?;
    let ride = RideView::by_key(
        &mut *phase.conn(),
        state.store.persistent(),
        user_id,
        key_id,
    )
    .await
    .map_err(db("load ride"))?
    .ok_or_else(|| BookingError::Internal(format!("no ride for key {key_id}")))?;
    stage_receipt(
        phase.conn(),
        state.store.persistent(),
        user_id,
        ride.ride_id,
    )
    .await?;
    let response = created(&ride)?;
    phase.finish(&response).await?;
    Ok(Step::Respond(response))
}

/// The 201 of a paid ride.
pub(crate) fn created(ride: &RideView) -> Result<StoredResponse, BookingError> {
    Ok(StoredResponse::json(
        201,
        &serde_json::to_value(ride).map_err(|e| BookingError::Internal(e.to_string()))?,
        vec![("location".to_owned(), format!("/rides/{}", ride.ride_id))],
    ))
}

fn problem_response(problem: &Problem) -> StoredResponse {
    StoredResponse {
        status: problem.status().as_u16(),
        headers: vec![(
            "content-type".to_owned(),
            idempotency_axum::PROBLEM_JSON.to_owned(),
        )],
        body: problem.body().to_string().into_bytes(),
    }
}

/// Replaces anything shaped like a secret API key (`sk_…`, `rk_…`) in a gateway's message, so
/// that what a gateway echoes never reaches a client's body or a log in clear.
pub fn redact_secrets(message: &str) -> String {
    message
        .split(' ')
        .map(|word| {
            let bare = word.trim_start_matches(|c: char| !c.is_ascii_alphanumeric());
            if bare.starts_with("sk_") || bare.starts_with("rk_") {
                "[redacted]"
            } else {
                word
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_keys_are_redacted_from_gateway_messages() {
        assert_eq!(
            redact_secrets("Invalid API Key provided: sk_live_abc123 (check it)"),
            "Invalid API Key provided: [redacted] (check it)"
        );
        assert_eq!(
            redact_secrets("No such customer: 'cus_1'"),
            "No such customer: 'cus_1'"
        );
        assert_eq!(redact_secrets("key 'rk_test_x'"), "key [redacted]");
    }
}
