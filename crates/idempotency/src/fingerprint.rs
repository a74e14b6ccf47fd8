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
