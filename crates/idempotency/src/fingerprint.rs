//! The request fingerprint: what makes "the same request" under one key.

use sha2::{Digest, Sha256};

use crate::canonical::canonicalize;

/// SHA-256 over the method, the route template and the canonical JSON of the body.
///
/// Parameters are compared by this digest, never field by field, so the store needs no knowledge
/// of the request's shape. The route template (`/rides/{id}`), not the concrete path, goes in, so
/// that the fingerprint names the operation.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Fingerprints a JSON request.
    pub fn of_json(method: &str, route: &str, body: &serde_json::Value) -> Self {
        let mut hasher = Sha256::new();
        // Each part is length-prefixed so that no two (method, route, body) triples can be
        // concatenated into the same byte string.
        for part in [
            method.as_bytes(),
            route.as_bytes(),
            canonicalize(body).as_bytes(),
        ] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
        Self(hasher.finalize().into())
    }

    /// Fingerprints a request whose body is not JSON, by its exact bytes.
    ///
    /// The body goes in under a part of its own that no JSON fingerprint has (a `raw` marker, then
    /// the bytes), so a raw body and a JSON body can never share a fingerprint, whatever their
    /// text: the hex of one body's bytes sent as a JSON string is another request.
    pub fn of_bytes(method: &str, route: &str, body: &[u8]) -> Self {
        let mut hasher = Sha256::new();
        for part in [method.as_bytes(), route.as_bytes(), b"raw", body] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
        Self(hasher.finalize().into())
    }

    /// The digest as stored in the database.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Rebuilds a fingerprint from its stored bytes; `None` if the length is wrong.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(s: &str) -> serde_json::Value {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn key_order_and_whitespace_do_not_change_the_fingerprint() {
        let a = Fingerprint::of_json("POST", "/rides", &json(r#"{"a":1,"b":2}"#));
        let b = Fingerprint::of_json("POST", "/rides", &json("{ \"b\" : 2,\n \"a\" : 1 }"));
        assert_eq!(a, b);
    }

    #[test]
    fn a_raw_body_never_shares_a_fingerprint_with_a_json_body() {
        let raw = b"\xff not json";
        let as_hex = serde_json::Value::String(hex::encode(raw));
        let as_text = serde_json::Value::String(String::from_utf8_lossy(raw).into_owned());
        let of_raw = Fingerprint::of_bytes("POST", "/t", raw);
        assert_ne!(of_raw, Fingerprint::of_json("POST", "/t", &as_hex));
        assert_ne!(of_raw, Fingerprint::of_json("POST", "/t", &as_text));
        // The bytes of a JSON text are not that JSON either.
        assert_ne!(
            Fingerprint::of_bytes("POST", "/t", br#""x""#),
            Fingerprint::of_json("POST", "/t", &json(r#""x""#))
        );
        assert_eq!(of_raw, Fingerprint::of_bytes("POST", "/t", raw));
        assert_ne!(of_raw, Fingerprint::of_bytes("POST", "/t", b"other"));
    }

    #[test]
    fn method_route_and_values_all_change_the_fingerprint() {
        let base = Fingerprint::of_json("POST", "/rides", &json(r#"{"a":1}"#));
        assert_ne!(
            base,
            Fingerprint::of_json("PUT", "/rides", &json(r#"{"a":1}"#))
        );
        assert_ne!(
            base,
            Fingerprint::of_json("POST", "/charges", &json(r#"{"a":1}"#))
        );
        assert_ne!(
            base,
            Fingerprint::of_json("POST", "/rides", &json(r#"{"a":2}"#))
        );
    }
}
