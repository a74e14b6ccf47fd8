//! How a booking ends: a charge the gateway showed is settled (paid, pending or failed), a
//! decline or a refusal is the answer, each written in the step's own transaction with the
//! answer the driver stores ([`Advance::Finish`]).

use std::time::Instant;

use idempotency::{Advance, Halt, Step, StoredResponse};
use serde_json::json;

use super::error::{db, BookingError};
use super::rows::{audit, charge_paid};
use super::target::{Charging, Found, RidePoint};
use crate::metrics::GatewayCall;
use crate::problem::types;
use crate::ride::RideView;
use crate::stripe::{Charge, ChargeError, ChargeStatus, Refusal};

impl Charging<'_> {
    /// A charge the gateway showed for this ride: paid, pending or failed by its status.
    pub(super) async fn settle(
        &self,
        step: &mut Step<'_, RidePoint>,
        charge: Charge,
        found: Found,
    ) -> Result<Advance<RidePoint>, Halt> {
        let target = &self.target;
        // Never record a charge that is not this ride's: a wrong amount or customer (or none:
        // every charge we ask for names its customer) means a bug or tampering, and an operator
        // must look before anything is stored.
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
            ))
            .into());
        }
        match charge.status {
            ChargeStatus::Succeeded => {
                let failpoints = &self.rider.state.failpoints;
                crate::failpoints::gateway(failpoints, crate::failpoints::Gateway::Charged).await;
                self.paid(step, &charge, found).await
            }
            ChargeStatus::Pending => {
                if step.lease().await?.recovery_point() == RidePoint::RideCreated {
                    self.record_pending(step, &charge).await?;
                }
                Err(BookingError::PaymentPending(charge.id).into())
            }
            ChargeStatus::Failed => {
                let code = charge.failure_code.as_deref().unwrap_or("card_declined");
                let message = charge
                    .failure_message
                    .as_deref()
                    .unwrap_or("the card was declined");
                self.declined(step, code, message).await
            }
            ChargeStatus::Unknown => Err(BookingError::GatewayUnavailable(format!(
                "charge {} is in a status this build does not know",
                charge.id
            ))
            .into()),
        }
    }

    /// A paid charge: the charge on the ride, its audit record, the receipt job and the 201,
    /// in the step's transaction.
    async fn paid(
        &self,
        step: &mut Step<'_, RidePoint>,
        charge: &Charge,
        found: Found,
    ) -> Result<Advance<RidePoint>, Halt> {
        let mut pg = self.rider.state.store.statements_on(step.tx().await?);
        let ride = charge_paid(
            &mut pg,
            self.rider.user_id,
            self.target.ride_id,
            &charge.id,
            found == Found::Adopted,
        )
        .await?;
        Ok(Advance::Finish(created(&ride)?))
    }

    /// The charge exists but is pending: recorded, in a fenced transaction of its own that
    /// moves the key to `charge_pending`, so that the resumption retrieves it instead of asking
    /// for it again.
    async fn record_pending(
        &self,
        step: &mut Step<'_, RidePoint>,
        charge: &Charge,
    ) -> Result<(), Halt> {
        let (state, user_id, ride_id) = (self.rider.state, self.rider.user_id, self.target.ride_id);
        let mut phase = state
            .store
            .phase(step.lease().await?, RidePoint::ChargePending)
            .await?;
        let mut pg = state.store.statements_on(phase.conn());
        sqlx::query(
            "UPDATE rides SET charge_id = $3, status = 'payment_pending', updated_at = now()
             WHERE id = $1 AND user_id = $2 AND key_owner = $2::text",
        )
        .bind(ride_id)
        .bind(user_id)
        .bind(&charge.id)
        .execute(&mut pg)
        .await
        .map_err(db("record pending charge"))?;
        audit(
            &mut pg,
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
        self,
        step: &mut Step<'_, RidePoint>,
    ) -> Result<Advance<RidePoint>, Halt> {
        let state = self.rider.state;
        let charge_id = self.target.charge_id.clone().ok_or_else(|| {
            BookingError::Internal(format!(
                "ride {} is pending without a charge",
                self.target.ride_id
            ))
        })?;
        let started = Instant::now();
        let result = self
            .under_lease(step, state.stripe.retrieve_charge(&charge_id))
            .await;
        state
            .metrics
            .gateway_call(GatewayCall::RetrieveCharge, started.elapsed());
        let failure = match result? {
            Ok(charge) if charge.id == charge_id => {
                return self.settle(step, charge, Found::Retrieved).await
            }
            Ok(other) => BookingError::Internal(format!(
                "asked for charge {charge_id}, the gateway answered with {}",
                other.id
            )),
            // The recorded charge is unknown to the gateway: nothing the request can decide
            // alone.
            Err(ChargeError::Refused(refusal)) => BookingError::Internal(format!(
                "the gateway does not know pending charge {charge_id}: {}",
                refusal.message
            )),
            Err(ChargeError::Misconfigured(why)) => BookingError::GatewayMisconfigured(why),
            Err(
                e @ (ChargeError::Declined { .. }
                | ChargeError::StoredServerError { .. }
                | ChargeError::Transient(_)
                | ChargeError::UnknownAnswer { .. }),
            ) => BookingError::GatewayUnavailable(e.to_string()),
        };
        Err(failure.into())
    }

    /// A gateway error: a decline or a refusal finishes the request; anything else hands it
    /// back.
    pub(super) async fn refusal_or_error(
        &self,
        step: &mut Step<'_, RidePoint>,
        error: ChargeError,
    ) -> Result<Advance<RidePoint>, Halt> {
        let failure = match error {
            ChargeError::Declined { code, message } => {
                return self.declined(step, &code, &message).await
            }
            ChargeError::Refused(refusal) => return self.refused(step, &refusal).await,
            ChargeError::Misconfigured(why) => BookingError::GatewayMisconfigured(why),
            e @ (ChargeError::StoredServerError { .. }
            | ChargeError::Transient(_)
            | ChargeError::UnknownAnswer { .. }) => BookingError::GatewayUnavailable(e.to_string()),
        };
        Err(failure.into())
    }

    /// A declined card: the ride is marked, the 402 is the answer.
    pub(super) async fn declined(
        &self,
        step: &mut Step<'_, RidePoint>,
        code: &str,
        message: &str,
    ) -> Result<Advance<RidePoint>, Halt> {
        let (state, user_id, ride_id) = (self.rider.state, self.rider.user_id, self.target.ride_id);
        let mut pg = state.store.statements_on(step.tx().await?);
        // A charge recorded pending that then failed is not the ride's charge: it moved no money.
        sqlx::query(
            "UPDATE rides SET status = 'declined', charge_id = NULL,
                              charge_doubt = NULL, charge_refusal = NULL, updated_at = now()
             WHERE id = $1 AND user_id = $2 AND key_owner = $2::text",
        )
        .bind(ride_id)
        .bind(user_id)
        .execute(&mut pg)
        .await
        .map_err(db("mark ride declined"))?;
        audit(
            &mut pg,
            user_id,
            "ride.payment_declined",
            ride_id,
            json!({ "code": code }),
        )
        .await?;
        let problem = crate::contract::problem(types::PAYMENT_DECLINED)
            .with_detail(format!("the card was declined: {message}"))
            .with_extension("decline_code", code.into());
        Ok(Advance::Finish(problem.into()))
    }

    /// A charge the gateway refused for good: the ride failed, the 502 is the answer. Retrying
    /// cannot change the gateway's answer, and a key that never finishes would be retried by
    /// the completer forever.
    pub(super) async fn refused(
        &self,
        step: &mut Step<'_, RidePoint>,
        refusal: &Refusal,
    ) -> Result<Advance<RidePoint>, Halt> {
        let (state, user_id, ride_id) = (self.rider.state, self.rider.user_id, self.target.ride_id);
        tracing::error!(
            key_id = self.rider.key_id,
            ride_id,
            status = refusal.status,
            kind = %refusal.kind,
            code = ?refusal.code,
            message = %redact_secrets(&refusal.message),
            "the gateway refused the charge for good"
        );
        let mut pg = state.store.statements_on(step.tx().await?);
        sqlx::query(
            "UPDATE rides SET status = 'failed', charge_doubt = NULL, charge_refusal = NULL,
                              updated_at = now()
             WHERE id = $1 AND user_id = $2 AND key_owner = $2::text",
        )
        .bind(ride_id)
        .bind(user_id)
        .execute(&mut pg)
        .await
        .map_err(db("mark ride failed"))?;
        let gateway_error = gateway_error(refusal);
        audit(
            &mut pg,
            user_id,
            "ride.payment_refused",
            ride_id,
            gateway_error.clone(),
        )
        .await?;
        let problem = crate::contract::problem(types::PAYMENT_REFUSED)
            .with_detail(format!(
                "the payment gateway refused the charge: {}",
                redact_secrets(&refusal.message)
            ))
            .with_extension("gateway_error", gateway_error);
        state.metrics.payment_refused();
        Ok(Advance::Finish(problem.into()))
    }
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

/// The 201 of a paid ride.
pub(crate) fn created(ride: &RideView) -> Result<StoredResponse, BookingError> {
    Ok(StoredResponse::json(
        201,
        &serde_json::to_value(ride).map_err(|e| BookingError::Internal(e.to_string()))?,
        vec![("location".to_owned(), format!("/rides/{}", ride.ride_id))],
    ))
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
