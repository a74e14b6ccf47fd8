//! The fixed messages of Stripe error objects, as the gateway sends them and tests compare them.
//!
//! The wording follows Stripe's where it is known. Messages that name a value (`No such
//! customer: 'cus_…'`) are built by the functions at the end of this module.

/// 401 without any credentials.
pub const NO_API_KEY: &str = "You did not provide an API key. You need to provide your API key \
    in the Authorization header, using Bearer auth (e.g. 'Authorization: Bearer \
    YOUR_SECRET_KEY').";

/// 401 for credentials that are not a `sk_test_…` key; the key itself is never echoed.
pub const INVALID_API_KEY: &str = "Invalid API Key provided. fakestripe accepts secret test keys \
    of the form sk_test_ followed by letters, digits or underscores.";

/// 402 for a customer whose card declines every charge (`tok_chargeCustomerFail`).
pub const CARD_DECLINED: &str = "Your card was declined.";

/// 402 for a customer without a payment source.
pub const NO_ACTIVE_CARD: &str = "Cannot charge a customer that has no active card";

/// 409 while another request with the same idempotency key is being processed.
pub const IDEMPOTENCY_KEY_IN_USE: &str = "There is currently another in-progress request using \
    this Idempotency Key (that probably means you submitted twice, and the other request is \
    still going through). Try waiting a few seconds before making this request again.";

/// 500 for an internal failure or an injected one; the detail goes to the log only.
pub const API_ERROR: &str = "An unknown error occurred while processing your request. \
    You can safely retry it with the same Idempotency-Key.";

/// 400 for an amount that is not a whole number of the currency's smallest unit above zero.
pub const INVALID_POSITIVE_INTEGER: &str = "Invalid positive integer";

/// 400 for both list cursors at once.
pub const ONE_CURSOR_ONLY: &str =
    "You may only specify one of these parameters: ending_before, starting_after.";

/// 400 for a `limit` outside 1..=100.
pub const LIMIT_OUT_OF_RANGE: &str = "This value must be between 1 and 100.";

/// 400 for a key reused with other parameters.
pub fn idempotency_mismatch(key: &str) -> String {
    format!(
        "Keys for idempotent requests can only be used with the same parameters they were first \
         used with. Try using a key other than '{key}' if you meant to execute a different \
         request."
    )
}

/// 400 for a missing required parameter.
pub fn missing_param(param: &str) -> String {
    format!("Missing required param: {param}.")
}

/// 400 for a parameter no endpoint here knows.
pub fn unknown_param(param: &str) -> String {
    format!("Received unknown parameter: {param}")
}

/// 400 for an object id that does not exist in the caller's account.
pub fn no_such(object: &str, id: &str) -> String {
    format!("No such {object}: '{id}'")
}

/// 404 for a method and path the gateway does not serve.
pub fn unrecognized_url(method: &str, path: &str) -> String {
    format!("Unrecognized request URL ({method}: {path}).")
}

/// 400 for an empty value of a parameter that cannot be unset.
pub fn empty_param(param: &str) -> String {
    format!(
        "You passed an empty string for '{param}'. We assume empty values are an attempt to unset \
         a parameter; however '{param}' cannot be unset. You should remove '{param}' from your \
         request or supply a non-empty value."
    )
}

/// 400 for a value that is not a whole number.
pub fn invalid_integer(value: &str) -> String {
    format!("Invalid integer: {value}")
}
