//! RFC 8785, the JSON Canonicalization Scheme: one byte string per JSON value, whatever the key
//! order, the whitespace or the spelling of its numbers, so that a fingerprint of the canonical
//! form tells two payloads apart only when they differ as JSON.
//!
//! The work is done by `serde_json_canonicalizer`, which passes the RFC's published vectors:
//! Appendix B's numbers, the sorting example, the author's test data and the 100-million-line
//! ECMAScript number file (checked in `tests/integration/rfc8785.rs`, the last one in part; the crate's own
//! CI runs it whole). The crate also turns on serde_json's `float_roundtrip`, without which
//! serde_json reads some numbers as the neighbouring double. This crate had its own
//! canonicaliser until those vectors showed it writing ties with the odd digit.

use serde_json::Value;

/// The RFC 8785 canonical form of `value`.
pub fn canonicalize(value: &Value) -> String {
    // A `Value` holds only strings, finite numbers, and the like: serialization cannot fail.
    serde_json_canonicalizer::to_string(value).expect("a JSON value has a canonical form")
}
