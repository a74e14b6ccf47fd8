//! The `Idempotency-Key` value, validated once at the edge.

use std::fmt;

/// The longest key accepted, in characters. Stripe documents 255; the column is bounded to match.
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key: 1 to [`MAX_KEY_LEN`] visible ASCII characters (`!` to `~`).
///
/// It parses both forms clients send:
/// - the IETF draft's Structured Field string, `"8e03978e-40d5-43e8-bc93-6894a57f9324"`, with `\"`
///   and `\\` escapes;
/// - the bare token that Stripe's client libraries send, `8e03978e-40d5-43e8-bc93-6894a57f9324`.
///
/// Both denote the same key: the quotes are syntax, not part of the key.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why a header value is not a valid idempotency key. The messages are shown to clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// Nothing between the quotes, or an empty header.
    #[error("the Idempotency-Key is empty")]
    Empty,
    /// More than [`MAX_KEY_LEN`] characters.
    #[error("the Idempotency-Key is longer than 255 characters")]
    TooLong,
    /// A space, a control character or a non-ASCII byte.
    #[error("the Idempotency-Key may contain only visible ASCII characters")]
    InvalidCharacter,
    /// An opening quote without a closing one, or a backslash escape other than `\"` and `\\`.
    #[error("the Idempotency-Key is not a valid Structured Field string")]
    BadQuoting,
}

impl IdempotencyKey {
    /// Parses a header value in either form.
    pub fn parse(raw: &[u8]) -> Result<Self, KeyError> {
        // Header values may carry optional whitespace around them (RFC 9110 §5.5).
        let raw = raw.trim_ascii();
        let key = match raw.strip_prefix(b"\"") {
            Some(quoted) => unquote(quoted)?,
            None => raw.to_vec(),
        };
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if !key.iter().all(|b| b.is_ascii_graphic()) {
            return Err(KeyError::InvalidCharacter);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong);
        }
        // All bytes are ASCII, checked just above, so this conversion cannot fail.
        Ok(Self(String::from_utf8(key).expect("ASCII is UTF-8")))
    }

    /// The key without quotes.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Decodes the body of an sf-string (RFC 8941 §3.3.3) after its opening quote.
fn unquote(rest: &[u8]) -> Result<Vec<u8>, KeyError> {
    let mut out = Vec::with_capacity(rest.len());
    let mut bytes = rest.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => out.push(escaped),
                _ => return Err(KeyError::BadQuoting),
            },
            // The closing quote must be the last byte.
            b'"' if bytes.as_slice().is_empty() => return Ok(out),
            b'"' => return Err(KeyError::BadQuoting),
            other => out.push(other),
        }
    }
    Err(KeyError::BadQuoting)
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({:?})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<String, KeyError> {
        IdempotencyKey::parse(s.as_bytes()).map(|k| k.as_str().to_owned())
    }

    #[test]
    fn bare_and_quoted_forms_denote_the_same_key() {
        assert_eq!(parse("abc-123").unwrap(), "abc-123");
        assert_eq!(parse("\"abc-123\"").unwrap(), "abc-123");
        assert_eq!(parse("  abc-123 ").unwrap(), "abc-123");
    }

    #[test]
    fn quoted_form_decodes_escapes() {
        assert_eq!(parse(r#""a\"b\\c""#).unwrap(), r#"a"b\c"#);
    }

    #[test]
    fn malformed_quoting_is_refused() {
        assert_eq!(parse("\"abc"), Err(KeyError::BadQuoting));
        assert_eq!(parse("\"a\"b\""), Err(KeyError::BadQuoting));
        assert_eq!(parse(r#""a\nb""#), Err(KeyError::BadQuoting));
    }

    #[test]
    fn empty_keys_are_refused() {
        assert_eq!(parse(""), Err(KeyError::Empty));
        assert_eq!(parse("\"\""), Err(KeyError::Empty));
        assert_eq!(parse("   "), Err(KeyError::Empty));
    }

    #[test]
    fn invisible_and_non_ascii_characters_are_refused() {
        assert_eq!(parse("a b"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse("\"a b\""), Err(KeyError::InvalidCharacter));
        assert_eq!(parse("caf\u{e9}"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse("a\tb"), Err(KeyError::InvalidCharacter));
    }

    #[test]
    fn length_is_bounded_at_255() {
        assert!(parse(&"k".repeat(255)).is_ok());
        assert_eq!(parse(&"k".repeat(256)), Err(KeyError::TooLong));
        assert_eq!(
            parse(&format!("\"{}\"", "k".repeat(256))),
            Err(KeyError::TooLong)
        );
    }
}
