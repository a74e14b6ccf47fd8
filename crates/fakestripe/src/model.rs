//! The gateway's objects and how Stripe shows them: charges and customers, and the test cards a
//! customer can carry.

use serde_json::{json, Value};
use time::OffsetDateTime;

/// The longest description accepted.
pub(crate) const MAX_DESCRIPTION_LEN: usize = 1000;

/// The test tokens a customer's `source` may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// `tok_visa`: every charge succeeds.
    Visa,
    /// `tok_chargeCustomerFail`: the card attaches, every charge is declined.
    ChargeCustomerFail,
}

impl Source {
    /// The token, as sent and stored.
    pub(crate) fn token(self) -> &'static str {
        match self {
            Source::Visa => "tok_visa",
            Source::ChargeCustomerFail => "tok_chargeCustomerFail",
        }
    }

    /// The source of a token, if the gateway knows it.
    pub(crate) fn from_token(token: &str) -> Option<Self> {
        [Source::Visa, Source::ChargeCustomerFail]
            .into_iter()
            .find(|s| s.token() == token)
    }
}

/// A customer row.
#[derive(Debug, Clone)]
pub(crate) struct Customer {
    pub(crate) id: String,
    pub(crate) email: Option<String>,
    pub(crate) description: Option<String>,
    pub(crate) source: Option<Source>,
    pub(crate) metadata: Value,
    /// Deleted (`DELETE /v1/customers/{id}`): kept for its charges, refused for new ones.
    pub(crate) deleted: bool,
    pub(crate) created: OffsetDateTime,
}

impl Customer {
    /// Stripe's customer object; a deleted customer is only its id, as Stripe shows it.
    pub(crate) fn to_json(&self) -> Value {
        if self.deleted {
            return Self::deleted_json(&self.id);
        }
        json!({
            "id": self.id,
            "object": "customer",
            "created": self.created.unix_timestamp(),
            "description": self.description,
            "email": self.email,
            "livemode": false,
            "metadata": self.metadata,
        })
    }

    /// What Stripe shows of a deleted customer.
    pub(crate) fn deleted_json(id: &str) -> Value {
        json!({"id": id, "object": "customer", "deleted": true})
    }
}

/// A charge, as stored. Serialized by [`Charge::to_json`] as Stripe's charge object.
#[derive(Debug, Clone, PartialEq)]
pub struct Charge {
    /// `ch_…`.
    pub id: String,
    /// The account (secret key) that made it.
    pub account_id: i64,
    /// The customer charged, `cus_…`.
    pub customer: String,
    /// In the currency's smallest unit.
    pub amount: i64,
    /// Three lowercase letters.
    pub currency: String,
    /// Free text, if given.
    pub description: Option<String>,
    /// String values under string keys.
    pub metadata: Value,
    /// `succeeded`, `pending` (settles later) or `failed` (a pending charge that was declined).
    /// A charge declined at once is not stored: its 402 is kept with its key instead.
    pub status: String,
    /// Why a `failed` charge failed (`card_declined`).
    pub failure_code: Option<String>,
    /// The human message of a `failed` charge.
    pub failure_message: Option<String>,
    /// The idempotency key whose request made it, while that key is kept.
    pub idempotency_key_id: Option<i64>,
    /// When it was committed.
    pub created: OffsetDateTime,
}

impl Charge {
    /// Stripe's charge object.
    pub fn to_json(&self) -> Value {
        json!({
            "id": self.id,
            "object": "charge",
            "amount": self.amount,
            "amount_captured": self.amount,
            "amount_refunded": 0,
            "captured": true,
            "created": self.created.unix_timestamp(),
            "currency": self.currency,
            "customer": self.customer,
            "description": self.description,
            "failure_code": self.failure_code,
            "failure_message": self.failure_message,
            "livemode": false,
            "metadata": self.metadata,
            "paid": self.status == "succeeded",
            "refunded": false,
            "status": self.status,
        })
    }
}
