//! Object ids in Stripe's shape: a type prefix and random letters and digits.
//!
//! They come from the operating system's generator, never from the fault generator: two runs
//! with the same fault `seed` against the same database must not mint the same ids.

use rand::distr::Alphanumeric;
use rand::rngs::OsRng;
use rand::{Rng, TryRngCore};

/// Random characters after `cus_` (Stripe's classic customer ids have 14).
pub(crate) const CUSTOMER_ID_LEN: usize = 14;

/// Random characters after `ch_` (Stripe's current charge ids have 24).
pub(crate) const CHARGE_ID_LEN: usize = 24;

/// Random characters after `req_`.
pub(crate) const REQUEST_ID_LEN: usize = 14;

/// `prefix` followed by `len` random alphanumerics (62 symbols: 14 of them give 83 bits).
pub(crate) fn new_id(prefix: &str, len: usize) -> String {
    // `unwrap_err` panics only if the operating system cannot supply randomness at all, in
    // which case no id could be made safely anyway.
    let mut rng = OsRng.unwrap_err();
    let mut id = String::with_capacity(prefix.len() + len);
    id.push_str(prefix);
    id.extend(
        (&mut rng)
            .sample_iter(Alphanumeric)
            .take(len)
            .map(char::from),
    );
    id
}

/// A new customer id, `cus_…`.
pub(crate) fn customer() -> String {
    new_id("cus_", CUSTOMER_ID_LEN)
}

/// A new charge id, `ch_…`.
pub(crate) fn charge() -> String {
    new_id("ch_", CHARGE_ID_LEN)
}

/// A new request id, `req_…`.
pub(crate) fn request() -> String {
    new_id("req_", REQUEST_ID_LEN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_have_their_prefix_and_length_and_differ() {
        let a = customer();
        assert!(
            a.starts_with("cus_") && a.len() == 4 + CUSTOMER_ID_LEN,
            "{a}"
        );
        assert!(a[4..].chars().all(|c| c.is_ascii_alphanumeric()));
        assert_ne!(a, customer());
        assert_eq!(charge().len(), 3 + CHARGE_ID_LEN);
    }
}
