//! The payment gateway client: Stripe's wire format over HTTPS (rustls), so it talks to Stripe or
//! to `fakestripe`.
//!
//! Every outcome of a gateway call falls in one class, and the phase machine depends on the
//! classification being right:
//!
//! | answer | class | what the booking does |
//! |---|---|---|
//! | 2xx with a charge | `Ok(Charge)`: look at its `status` | `succeeded`: paid; `pending`: resolved later by retrieving it; `failed`: a decline |
//! | 402 `card_error` | [`ChargeError::Declined`] | final 402 |
//! | 400/404 `invalid_request_error`, 400 `idempotency_error`, any other 4xx but those below, with Stripe's error object | [`ChargeError::Refused`] | final 502 (retrying cannot help); an `idempotency_error`, or a refusal after an attempt of unknown outcome, only once a list shows no charge for the request |
//! | 401, 403, a certificate the client does not trust | [`ChargeError::Misconfigured`] | 503, logged as an error: ours to fix, never final |
//! | 5xx with Stripe's error body, **replayed** under the key | [`ChargeError::StoredServerError`] | the key holds a 500 for good: reconcile |
//! | 5xx otherwise, 408, 409, 424, 425, 429, no answer, a cut or unreadable answer | [`ChargeError::Transient`] | 503; the retry resumes under the same key |
//! | any other status **without** the gateway's error object (a proxy's HTML page, no body, other JSON) | [`ChargeError::UnknownAnswer`] | 503; the retry resumes under the same key |
//!
//! Only the gateway's own word is final. A load balancer or proxy in front of it answers on its
//! own (a 504 page while the charge goes on behind it, a 404 page for a route it lost), and such
//! an answer says nothing about the charge: it is an unknown outcome, whatever its status, and
//! never a refusal. Every refusal and decline above needs Stripe's error object in the body.
//!
//! A stored 500 is told from a passing one by `Idempotent-Replayed: true`: only a replay proves
//! that the gateway finished with the key (a request still running under it would get 409, not a
//! replay), which is what makes it safe to stop using the key.

use std::collections::BTreeMap;
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

/// The longest gateway body we read; Stripe's objects are a few kilobytes, a page of 100
/// charges some hundred.
const MAX_RESPONSE_BYTES: usize = 1024 * 1024;

/// Charges asked for per page when reconciling (Stripe's largest page).
const LIST_PAGE: u32 = 100;

/// The most pages a reconciling list reads. A customer with more charges than this since the
/// first attempt cannot be reconciled automatically; the list fails as transient and the key
/// stays unfinished, visible to an operator (`rocket-rides keys list --unfinished`).
const MAX_LIST_PAGES: u32 = 100;

/// The metadata entry that names the request a charge was made for: the key row's UUID. A
/// request finds its own charge by it when its gateway key can no longer be trusted to.
pub const REQUEST_METADATA: &str = "rocket_rides_request";

/// A Stripe API client.
#[derive(Debug, Clone)]
pub struct StripeClient {
    http: reqwest::Client,
    base: String,
    secret_key: String,
}

/// A charge as the gateway shows it.
#[derive(Debug, Clone, Deserialize)]
pub struct Charge {
    /// `ch_…`
    pub id: String,
    /// In the currency's smallest unit.
    pub amount: i64,
    /// The customer charged, `cus_…`.
    #[serde(default)]
    pub customer: Option<String>,
    /// How the charge stands.
    pub status: ChargeStatus,
    /// Unix seconds.
    pub created: i64,
    /// String values under string keys.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Why a `failed` charge failed.
    #[serde(default)]
    pub failure_code: Option<String>,
    /// The human message of a `failed` charge.
    #[serde(default)]
    pub failure_message: Option<String>,
}

/// A charge's `status`, as the gateway names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChargeStatus {
    /// Paid.
    Succeeded,
    /// Not paid yet: the gateway settles it later (a bank debit, a card under review).
    Pending,
    /// Not paid, for good: `failure_code` and `failure_message` say why.
    Failed,
    /// A status this build does not know. Nothing is decided on it: the booking answers 503
    /// and asks again later, and a reconciliation prefers any charge of a known status.
    #[serde(other)]
    Unknown,
}

impl Charge {
    /// The request this charge was made for, from its metadata.
    pub fn request(&self) -> Option<&str> {
        self.metadata.get(REQUEST_METADATA).map(String::as_str)
    }
}

/// A created customer.
#[derive(Debug, Clone, Deserialize)]
pub struct Customer {
    /// `cus_…`
    pub id: String,
}

#[derive(Deserialize)]
struct ChargeList {
    data: Vec<Charge>,
    has_more: bool,
}

/// A charge to create.
#[derive(Debug, Clone)]
pub struct NewCharge<'a> {
    /// In cents (`usd`).
    pub amount_cents: i64,
    /// `cus_…`
    pub customer: &'a str,
    /// Shown on the customer's statement and in the dashboard.
    pub description: &'a str,
    /// Kept with the charge; [`REQUEST_METADATA`] names the request.
    pub metadata: &'a [(&'a str, String)],
}

/// A gateway call that did not give a charge (or whose result is unknown).
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
    /// The gateway refused the request for good, in its own error object: retrying cannot
    /// change the answer.
    #[error("gateway refused the request ({} {}): {}", .0.status, .0.kind, .0.message)]
    Refused(Refusal),
    /// Our side is wrong: the gateway refused our credentials (401/403), or its certificate is
    /// not one we trust. Not the request's fault, never final; an operator must act.
    #[error("gateway misconfigured: {0}")]
    Misconfigured(String),
    /// The gateway replayed a 5xx it stored under this key: the key will answer this way until
    /// the gateway forgets it.
    #[error("gateway replayed a stored {status}: {message}")]
    StoredServerError {
        /// HTTP status.
        status: u16,
        /// Stripe's message.
        message: String,
    },
    /// The outcome is unknown or the gateway is unavailable; retry with the same key.
    #[error("gateway unavailable: {0}")]
    Transient(String),
    /// An answer that is not the gateway's own: no error object in its body (an intermediary's
    /// page, an empty body), at a status that would otherwise be final. The request may have
    /// reached the gateway and charged: an unknown outcome, retried with the same key.
    #[error("an answer without the gateway's error object: HTTP {status}")]
    UnknownAnswer {
        /// HTTP status.
        status: u16,
    },
}

/// What the gateway said when it refused a request for good: its status and error object.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, Deserialize)]
pub struct Refusal {
    /// HTTP status.
    pub status: u16,
    /// Stripe's `type` (`invalid_request_error`, `idempotency_error`).
    pub kind: String,
    /// Stripe's `code`, if any (`resource_missing`).
    pub code: Option<String>,
    /// Stripe's `param`, if any (`customer`).
    pub param: Option<String>,
    /// Stripe's human message.
    pub message: String,
}

impl Refusal {
    /// Whether the gateway said the key was used with other parameters: it holds a result under
    /// the key that it will not give, possibly a charge.
    pub fn is_idempotency_error(&self) -> bool {
        self.kind == "idempotency_error"
    }
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
    param: Option<String>,
    message: Option<String>,
}

/// The `type`s of Stripe's error object: the ones its API answers with today, and the older ones
/// its client libraries still know. An error object without one of these is not the gateway's.
const GATEWAY_ERROR_TYPES: [&str; 7] = [
    "api_error",
    "card_error",
    "idempotency_error",
    "invalid_request_error",
    "authentication_error",
    "rate_limit_error",
    "api_connection_error",
];

impl ErrorObject {
    /// Whether this is the gateway's own error object: it names one of Stripe's error types.
    /// A proxy's `{"error": {"message": "Not Found"}}` does not.
    fn is_gateways(&self) -> bool {
        self.kind
            .as_deref()
            .is_some_and(|kind| GATEWAY_ERROR_TYPES.contains(&kind))
    }
}

/// Why a client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The CA file could not be read or holds no certificate.
    #[error("--stripe-ca-file {path}: {why}")]
    CaFile {
        /// The file.
        path: String,
        /// What is wrong.
        why: String,
    },
    /// reqwest refused the configuration.
    #[error("build the gateway client: {0}")]
    Build(#[from] reqwest::Error),
}

impl StripeClient {
    /// A client for the API at `base` (`https://api.stripe.com` or a fakestripe address). It
    /// trusts the platform's root certificates and, in addition, `extra_roots_pem` (a PEM bundle,
    /// for a gateway behind a private CA).
    pub fn new(
        base: &str,
        secret_key: &str,
        connect_timeout: Duration,
        timeout: Duration,
        extra_roots_pem: Option<&[u8]>,
    ) -> Result<Self, reqwest::Error> {
        let mut builder = reqwest::Client::builder()
            .connect_timeout(connect_timeout)
            .timeout(timeout)
            // Only https:// and http:// are used; a redirect from a payment API is a surprise to
            // report, not to follow with our secret key.
            .redirect(reqwest::redirect::Policy::none());
        if let Some(pem) = extra_roots_pem {
            for certificate in reqwest::Certificate::from_pem_bundle(pem)? {
                builder = builder.add_root_certificate(certificate);
            }
        }
        Ok(Self {
            http: builder.build()?,
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
        let form = [("email", email), ("source", source)];
        let answer = self
            .post("/v1/customers", &form, Some(idempotency_key))
            .await?;
        answer.decode("/v1/customers")
    }

    /// `POST /v1/charges` under `idempotency_key`: the same key always yields the same result,
    /// for as long as the gateway keeps the key.
    pub async fn create_charge(
        &self,
        idempotency_key: &str,
        charge: &NewCharge<'_>,
    ) -> Result<Charge, ChargeError> {
        self.post_charge(Some(idempotency_key), charge).await
    }

    /// `POST /v1/charges` without an idempotency key: the benchmark's baseline only, which
    /// measures what a booking costs without any protection. A retry of it can charge twice.
    #[cfg(feature = "bench")]
    pub async fn create_charge_without_key(
        &self,
        charge: &NewCharge<'_>,
    ) -> Result<Charge, ChargeError> {
        self.post_charge(None, charge).await
    }

    async fn post_charge(
        &self,
        idempotency_key: Option<&str>,
        charge: &NewCharge<'_>,
    ) -> Result<Charge, ChargeError> {
        let amount = charge.amount_cents.to_string();
        let metadata: Vec<(String, &str)> = charge
            .metadata
            .iter()
            .map(|(name, value)| (format!("metadata[{name}]"), value.as_str()))
            .collect();
        let mut form = vec![
            ("amount", amount.as_str()),
            ("currency", "usd"),
            ("customer", charge.customer),
            ("description", charge.description),
        ];
        form.extend(metadata.iter().map(|(name, value)| (name.as_str(), *value)));
        let answer = self.post("/v1/charges", &form, idempotency_key).await?;
        answer.decode("/v1/charges")
    }

    /// `GET /v1/charges/{id}`: the charge as it is now (a pending charge may have settled).
    pub async fn retrieve_charge(&self, id: &str) -> Result<Charge, ChargeError> {
        let path = format!("/v1/charges/{id}");
        let answer = self.get(&path, &[]).await?;
        answer.decode(&path)
    }

    /// Every charge created from `since` to `until` (unix seconds, both included), of
    /// `customer` or of any customer, following the list's pages (`has_more`, `starting_after`),
    /// newest first.
    pub async fn list_charges(
        &self,
        customer: Option<&str>,
        since: i64,
        until: i64,
    ) -> Result<Vec<Charge>, ChargeError> {
        let (since, until) = (since.to_string(), until.to_string());
        let limit = LIST_PAGE.to_string();
        let mut charges: Vec<Charge> = Vec::new();
        for _ in 0..MAX_LIST_PAGES {
            let mut query = vec![
                ("created[gte]", since.as_str()),
                ("created[lte]", until.as_str()),
                ("limit", limit.as_str()),
            ];
            if let Some(customer) = customer {
                query.push(("customer", customer));
            }
            if let Some(last) = charges.last() {
                query.push(("starting_after", last.id.as_str()));
            }
            let page: ChargeList = self
                .get("/v1/charges", &query)
                .await?
                .decode("/v1/charges")?;
            charges.extend(page.data);
            if !page.has_more {
                return Ok(charges);
            }
        }
        Err(ChargeError::Transient(format!(
            "{} has more than {} charges from {since} to {until}; reconcile by hand",
            customer.unwrap_or("the account"),
            LIST_PAGE * MAX_LIST_PAGES
        )))
    }

    async fn post(
        &self,
        path: &str,
        form: &[(&str, &str)],
        idempotency_key: Option<&str>,
    ) -> Result<Answer, ChargeError> {
        // Serializing string pairs cannot fail.
        let body = serde_urlencoded::to_string(form).expect("string pairs encode");
        let mut request = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body);
        if let Some(key) = idempotency_key {
            request = request.header("idempotency-key", key);
        }
        self.send(&format!("POST {path}"), request).await
    }

    async fn get(&self, path: &str, query: &[(&str, &str)]) -> Result<Answer, ChargeError> {
        let request = self.http.get(format!("{}{path}", self.base)).query(query);
        self.send(&format!("GET {path}"), request).await
    }

    async fn send(
        &self,
        what: &str,
        request: reqwest::RequestBuilder,
    ) -> Result<Answer, ChargeError> {
        let response = request
            .bearer_auth(&self.secret_key)
            .send()
            .await
            .map_err(|e| transport_error(what, &e))?;
        let status = response.status().as_u16();
        let replayed = response
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
        let body = read_limited(response)
            .await
            .map_err(|why| ChargeError::Transient(format!("{what}: {why}")))?;
        Ok(Answer {
            what: what.to_owned(),
            status,
            replayed,
            body,
        })
    }
}

/// A whole gateway answer, not yet classified.
struct Answer {
    what: String,
    status: u16,
    replayed: bool,
    body: Vec<u8>,
}

impl Answer {
    fn decode<T: for<'de> Deserialize<'de>>(self, path: &str) -> Result<T, ChargeError> {
        classify(path, self.status, self.replayed, &self.body).map_err(|e| match e {
            ChargeError::Transient(why) => ChargeError::Transient(format!("{}: {why}", self.what)),
            other => other,
        })
    }
}

/// A transport failure: a certificate we do not trust is our misconfiguration; anything else
/// (refused, reset, timed out) leaves the outcome unknown.
fn transport_error(what: &str, e: &reqwest::Error) -> ChargeError {
    let text = format!("{what}: {}", describe(e));
    if untrusted_certificate(e) {
        ChargeError::Misconfigured(text)
    } else {
        ChargeError::Transient(text)
    }
}

/// Whether rustls refused the gateway's certificate somewhere in the error's causes.
fn untrusted_certificate(e: &reqwest::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        // reqwest wraps rustls' error in an io::Error (twice, through hyper-util).
        let mut io = cause.downcast_ref::<std::io::Error>();
        while let Some(inner) = io.and_then(|e| e.get_ref()) {
            if let Some(rustls::Error::InvalidCertificate(_)) =
                inner.downcast_ref::<rustls::Error>()
            {
                return true;
            }
            io = inner.downcast_ref::<std::io::Error>();
        }
        source = cause.source();
    }
    false
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
    replayed: bool,
    body: &[u8],
) -> Result<T, ChargeError> {
    if (200..300).contains(&status) {
        // A 2xx whose body we cannot read may still mean a charge: treat as unknown, retry.
        return serde_json::from_slice(body)
            .map_err(|e| ChargeError::Transient(format!("unreadable {status} body: {e}")));
    }
    // Only the gateway itself answers with its error object; a proxy or a load balancer in
    // front of it does not.
    let error = serde_json::from_slice::<ErrorBody>(body)
        .ok()
        .map(|b| b.error)
        .filter(ErrorObject::is_gateways);
    let message = error
        .as_ref()
        .and_then(|e| e.message.clone())
        .unwrap_or_else(|| format!("HTTP {status}"));
    let kind = error.as_ref().and_then(|e| e.kind.clone());
    let Some(error) = error else {
        // Not the gateway's own word. 401/403 stay ours to fix whoever answered; anything else
        // is an unknown outcome (a 5xx was one already).
        return Err(match status {
            401 | 403 => ChargeError::Misconfigured(format!("{path}: {status} {message}")),
            408 | 409 | 424 | 425 | 429 | 500..=599 => {
                ChargeError::Transient(format!("{status} without the gateway's error object"))
            }
            _ => ChargeError::UnknownAnswer { status },
        });
    };
    match status {
        402 if kind.as_deref() == Some("card_error") => Err(ChargeError::Declined {
            code: error.code.unwrap_or_else(|| "card_declined".to_owned()),
            message,
        }),
        401 | 403 => Err(ChargeError::Misconfigured(format!(
            "{path}: {status} {message}"
        ))),
        // 408/425: try again; 409: the same key is still being processed at the gateway (or a
        // lock timed out); 424: a dependency of the gateway failed; 429: rate limited.
        408 | 409 | 424 | 425 | 429 => Err(ChargeError::Transient(format!("{status} {message}"))),
        500..=599 if replayed => Err(ChargeError::StoredServerError { status, message }),
        500..=599 => Err(ChargeError::Transient(format!("{status} {message}"))),
        // Any other 4xx: the gateway processed our request and said no. Asking again with the
        // same parameters gets the same no.
        _ => Err(ChargeError::Refused(Refusal {
            status,
            kind: kind.unwrap_or_else(|| "unknown".to_owned()),
            code: error.code,
            param: error.param,
            message,
        })),
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

    fn run(status: u16, replayed: bool, body: &str) -> Result<Charge, ChargeError> {
        classify("/v1/charges", status, replayed, body.as_bytes())
    }

    const API_ERROR: &str = r#"{"error":{"type":"api_error","message":"boom"}}"#;

    #[test]
    fn declines_refusals_misconfiguration_and_the_unknown_are_told_apart() {
        let declined = r#"{"error":{"type":"card_error","code":"card_declined","message":"Your card was declined."}}"#;
        assert!(matches!(
            run(402, false, declined),
            Err(ChargeError::Declined { .. })
        ));
        for status in [408, 409, 424, 425, 429, 500, 502, 503, 504] {
            assert!(
                matches!(
                    run(status, false, API_ERROR),
                    Err(ChargeError::Transient(_))
                ),
                "{status}"
            );
        }
        assert!(matches!(
            run(200, false, "not json"),
            Err(ChargeError::Transient(_))
        ));
        for status in [401, 403] {
            assert!(matches!(
                run(status, false, "{}"),
                Err(ChargeError::Misconfigured(_))
            ));
        }
        let missing = r#"{"error":{"type":"invalid_request_error","code":"resource_missing","param":"customer","message":"No such customer: 'cus_1'"}}"#;
        match run(400, false, missing) {
            Err(ChargeError::Refused(Refusal {
                status: 400,
                kind,
                code,
                param,
                ..
            })) => {
                assert_eq!(kind, "invalid_request_error");
                assert_eq!(code.as_deref(), Some("resource_missing"));
                assert_eq!(param.as_deref(), Some("customer"));
            }
            other => panic!("{other:?}"),
        }
        let mismatch = r#"{"error":{"type":"idempotency_error","message":"Keys for idempotent requests can only be used with the same parameters"}}"#;
        assert!(matches!(
            run(400, false, mismatch),
            Err(ChargeError::Refused(_))
        ));
        // A 402 that is not a card error is not a decline we can store, and not worth retrying.
        let api_402 = r#"{"error":{"type":"invalid_request_error","message":"no"}}"#;
        assert!(matches!(
            run(402, false, api_402),
            Err(ChargeError::Refused(Refusal { status: 402, .. }))
        ));
        let ok = run(
            200,
            false,
            r#"{"id":"ch_1","amount":2000,"status":"succeeded","created":1,"object":"charge","metadata":{"rocket_rides_request":"r"}}"#,
        )
        .unwrap();
        assert_eq!((ok.id.as_str(), ok.amount), ("ch_1", 2000));
        assert_eq!(ok.request(), Some("r"));
        assert_eq!(ok.status, ChargeStatus::Succeeded);
    }

    #[test]
    fn a_charge_status_is_read_by_name_and_an_unknown_one_decides_nothing() {
        let status = |name: &str| {
            let charge = format!(r#"{{"id":"ch_1","amount":1,"status":"{name}","created":1}}"#);
            serde_json::from_str::<Charge>(&charge).unwrap().status
        };
        assert_eq!(status("succeeded"), ChargeStatus::Succeeded);
        assert_eq!(status("pending"), ChargeStatus::Pending);
        assert_eq!(status("failed"), ChargeStatus::Failed);
        assert_eq!(status("refunded_somehow"), ChargeStatus::Unknown);
        assert_eq!(
            status("Succeeded"),
            ChargeStatus::Unknown,
            "names are exact"
        );
    }

    #[test]
    fn an_answer_without_the_gateways_error_object_is_never_final() {
        for status in [400, 402, 404, 410, 422] {
            for body in [
                "",
                "<html><body>404 Not Found</body></html>",
                "{}",
                r#"{"error":"x"}"#,
                r#"{"error":{}}"#,
                r#"{"error":{"message":"Not Found"}}"#,
                r#"{"error":{"type":"not_found","message":"no route"}}"#,
            ] {
                assert!(
                    matches!(
                        run(status, false, body),
                        Err(ChargeError::UnknownAnswer { status: s }) if s == status
                    ),
                    "{status} {body:?}"
                );
            }
        }
        for status in [500, 502, 504] {
            assert!(matches!(
                run(status, true, "<html>gateway timeout</html>"),
                Err(ChargeError::Transient(_))
            ));
        }
        // Ours to fix whoever said it.
        assert!(matches!(
            run(403, false, "<html>forbidden</html>"),
            Err(ChargeError::Misconfigured(_))
        ));
    }

    #[test]
    fn only_a_replayed_gateway_500_is_a_stored_one() {
        assert!(matches!(
            run(500, true, API_ERROR),
            Err(ChargeError::StoredServerError { status: 500, .. })
        ));
        // Without the replay header the gateway may still be working on the key.
        assert!(matches!(
            run(500, false, API_ERROR),
            Err(ChargeError::Transient(_))
        ));
        // A 502 from a proxy in front of the gateway has no Stripe error body.
        assert!(matches!(
            run(502, true, "<html>bad gateway</html>"),
            Err(ChargeError::Transient(_))
        ));
    }
}
