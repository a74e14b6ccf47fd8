//! The payment gateway client: Stripe's wire format, so it talks to Stripe or to `fakestripe`.
//!
//! Every outcome of a charge falls in one of three classes, and the phase machine depends on the
//! classification being right:
//! - [`ChargeError::Declined`]: the gateway answered 402 `card_error`. Final: stored as 402.
//! - [`ChargeError::Transient`]: no answer (connect failure, timeout, dropped connection), 5xx,
//!   429, or 409 (the same key is still in flight at the gateway). The charge may or may not exist;
//!   retrying with the same idempotency key finds out without charging twice.
//! - [`ChargeError::Rejected`]: any other 4xx. Our request was wrong; retrying will not help.

use std::time::Duration;

use serde::Deserialize;

/// How long to wait for a TCP connection to the gateway.
///
/// Short, because a gateway that does not accept connections is down: failing fast returns the
/// lease and a 503 to the client sooner. Must stay below [`DEFAULT_GATEWAY_TIMEOUT`].
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long to wait for a whole gateway answer.
///
/// Stripe answers a charge within a few seconds; past this the call is given up as transient and
/// resumed later under the same key. The lease TTL must exceed it (checked at start), so that the
/// lease cannot expire while we still wait on a call that may charge.
pub const DEFAULT_GATEWAY_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest gateway body we read; Stripe's objects are a few kilobytes.
const MAX_RESPONSE_BYTES: usize = 256 * 1024;

/// A Stripe API client.
#[derive(Debug, Clone)]
pub struct StripeClient {
    http: reqwest::Client,
    base: String,
    secret_key: String,
}

/// A created charge.
#[derive(Debug, Clone, Deserialize)]
pub struct Charge {
    /// `ch_…`
    pub id: String,
    /// In the currency's smallest unit.
    pub amount: i64,
}

/// A created customer.
#[derive(Debug, Clone, Deserialize)]
pub struct Customer {
    /// `cus_…`
    pub id: String,
}

/// A charge that did not happen (or whose result is unknown).
#[derive(Debug, thiserror::Error)]
pub enum ChargeError {
    /// The card was refused. Final.
    #[error("card declined: {message}")]
    Declined {
        /// Stripe's `code`, `card_declined`.
        code: String,
        /// Stripe's human message.
        message: String,
    },
    /// The outcome is unknown or the gateway is unavailable; retry with the same key.
    #[error("gateway unavailable: {0}")]
    Transient(String),
    /// The gateway refused the request itself.
    #[error("gateway rejected the request ({status}): {message}")]
    Rejected {
        /// HTTP status.
        status: u16,
        /// Stripe's message.
        message: String,
    },
}

#[derive(Deserialize)]
struct ErrorBody {
    error: ErrorObject,
}

#[derive(Deserialize)]
struct ErrorObject {
    #[serde(rename = "type")]
    kind: Option<String>,
    code: Option<String>,
    message: Option<String>,
}

impl StripeClient {
    /// A client for the API at `base` (`https://api.stripe.com` or a fakestripe address).
    pub fn new(
        base: &str,
        secret_key: &str,
        connect_timeout: Duration,
        timeout: Duration,
    ) -> Result<Self, reqwest::Error> {
        let http = reqwest::Client::builder()
            .connect_timeout(connect_timeout)
            .timeout(timeout)
            .build()?;
        Ok(Self {
            http,
            base: base.trim_end_matches('/').to_owned(),
            secret_key: secret_key.to_owned(),
        })
    }

    /// The API base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// `POST /v1/customers` with a card source token.
    pub async fn create_customer(
        &self,
        email: &str,
        source: &str,
        idempotency_key: &str,
    ) -> Result<Customer, ChargeError> {
        self.post(
            "/v1/customers",
            &[("email", email), ("source", source)],
            idempotency_key,
        )
        .await
    }

    /// `POST /v1/charges` under `idempotency_key`: the same key always yields the same charge.
    pub async fn create_charge(
        &self,
        idempotency_key: &str,
        amount_cents: i64,
        customer: &str,
        description: &str,
        ride_id: i64,
    ) -> Result<Charge, ChargeError> {
        let amount = amount_cents.to_string();
        let ride_id = ride_id.to_string();
        let form = [
            ("amount", amount.as_str()),
            ("currency", "usd"),
            ("customer", customer),
            ("description", description),
            ("metadata[ride_id]", ride_id.as_str()),
        ];
        self.post("/v1/charges", &form, idempotency_key).await
    }

    async fn post<T: for<'de> Deserialize<'de>>(
        &self,
        path: &str,
        form: &[(&str, &str)],
        idempotency_key: &str,
    ) -> Result<T, ChargeError> {
        // Serializing string pairs cannot fail.
        let body = serde_urlencoded::to_string(form).expect("string pairs encode");
        let response = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(&self.secret_key)
            .header("content-type", "application/x-www-form-urlencoded")
            .header("idempotency-key", idempotency_key)
            .body(body)
            .send()
            .await
            .map_err(|e| ChargeError::Transient(format!("POST {path}: {}", describe(&e))))?;
        let status = response.status().as_u16();
        let bytes = read_limited(response)
            .await
            .map_err(|why| ChargeError::Transient(format!("POST {path}: {why}")))?;
        classify(path, status, &bytes)
    }
}

/// Reads a body of at most [`MAX_RESPONSE_BYTES`], chunk by chunk, so that a gateway gone wrong
/// cannot make us buffer without bound. A body cut off mid-way is as good as no answer: the
/// charge may exist, so the caller treats it as transient.
async fn read_limited(mut response: reqwest::Response) -> Result<Vec<u8>, String> {
    if response
        .content_length()
        .is_some_and(|n| n > MAX_RESPONSE_BYTES as u64)
    {
        return Err("oversized response".into());
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| describe(&e))? {
        if body.len() + chunk.len() > MAX_RESPONSE_BYTES {
            return Err("oversized response".into());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

fn classify<T: for<'de> Deserialize<'de>>(
    path: &str,
    status: u16,
    body: &[u8],
) -> Result<T, ChargeError> {
    if (200..300).contains(&status) {
        // A 2xx whose body we cannot read may still mean a charge: treat as unknown, retry.
        return serde_json::from_slice(body).map_err(|e| {
            ChargeError::Transient(format!("POST {path}: unreadable {status} body: {e}"))
        });
    }
    let error = serde_json::from_slice::<ErrorBody>(body)
        .ok()
        .map(|b| b.error);
    let message = error
        .as_ref()
        .and_then(|e| e.message.clone())
        .unwrap_or_else(|| format!("HTTP {status}"));
    match status {
        402 if error.as_ref().and_then(|e| e.kind.as_deref()) == Some("card_error") => {
            Err(ChargeError::Declined {
                code: error
                    .and_then(|e| e.code)
                    .unwrap_or_else(|| "card_declined".to_owned()),
                message,
            })
        }
        // 409: the same idempotency key is still being processed at the gateway.
        409 | 429 | 500..=599 => Err(ChargeError::Transient(format!(
            "POST {path}: {status} {message}"
        ))),
        _ => Err(ChargeError::Rejected { status, message }),
    }
}

fn describe(e: &reqwest::Error) -> String {
    // reqwest's Display omits the cause ("error sending request"); the chain says what broke.
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(status: u16, body: &str) -> Result<Charge, ChargeError> {
        classify("/v1/charges", status, body.as_bytes())
    }

    #[test]
    fn decline_is_final_and_everything_unanswered_is_transient() {
        let declined = r#"{"error":{"type":"card_error","code":"card_declined","message":"Your card was declined."}}"#;
        assert!(matches!(
            run(402, declined),
            Err(ChargeError::Declined { .. })
        ));
        for status in [409, 429, 500, 502, 503] {
            assert!(
                matches!(run(status, "{}"), Err(ChargeError::Transient(_))),
                "{status}"
            );
        }
        assert!(matches!(
            run(200, "not json"),
            Err(ChargeError::Transient(_))
        ));
        assert!(matches!(
            run(400, "{}"),
            Err(ChargeError::Rejected { status: 400, .. })
        ));
        // A 402 that is not a card error is not a decline we can store.
        assert!(matches!(
            run(402, "{}"),
            Err(ChargeError::Rejected { status: 402, .. })
        ));
        let ok = run(200, r#"{"id":"ch_1","amount":2000,"object":"charge"}"#).unwrap();
        assert_eq!((ok.id.as_str(), ok.amount), ("ch_1", 2000));
    }
}
