//! The `Idempotency-Key` value, validated once at the edge.

use std::fmt;

/// The longest key accepted, in characters. Stripe documents 255; the column is bounded to match.
pub const MAX_KEY_LEN: usize = 255;

/// The grammar [`IdempotencyKey::parse`] accepts, as a regular expression for API documents
/// (OpenAPI's `pattern`, ECMA-262 syntax): a bare key, or a quoted one with a few parameters.
/// Every value it matches is accepted; the parser also takes a few rarer forms (longer
/// parameters, byte sequences) that it leaves out.
pub const KEY_PATTERN: &str = concat!(
    r#"^(?:[\x21\x23-\x2B\x2D-\x7E]{1,255}"#,
    r#"|"(?:[\x21\x23-\x5B\x5D-\x7E]|\\[\x22\x5C]){1,255}""#,
    r#"(?:;[a-z*][a-z0-9_.*-]{0,15}(?:=(?:[0-9]{1,15}|[A-Za-z*][A-Za-z0-9*_.:/-]{0,31}))?){0,4})$"#
);

/// A validated idempotency key: 1 to [`MAX_KEY_LEN`] visible ASCII characters (`!` to `~`).
///
/// It parses both forms clients send:
/// - the IETF draft's Structured Field string, `"8e03978e-40d5-43e8-bc93-6894a57f9324"`, with `\"`
///   and `\\` escapes, optionally followed by RFC 8941 parameters (`"k1";x=1`), which are
///   checked and ignored;
/// - the bare token that Stripe's client libraries send, `8e03978e-40d5-43e8-bc93-6894a57f9324`:
///   visible ASCII without `"` or `,`.
///
/// Both denote the same key: the quotes are syntax, not part of the key. A comma outside a
/// quoted string is refused: it is what a proxy makes of two header lines merged into one
/// (`a, b`), and no one of them can be picked.
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
    /// An opening quote without a closing one, a backslash escape other than `\"` and `\\`, or
    /// a quote inside a bare key.
    #[error("the Idempotency-Key is not a valid Structured Field string")]
    BadQuoting,
    /// Several values, as two header lines merged by a proxy (`a, b`).
    #[error("the Idempotency-Key holds several values; send exactly one key")]
    SeveralValues,
    /// Something after the quoted key that is not RFC 8941 parameters (`;name=value`).
    #[error("the Idempotency-Key has malformed parameters after its string")]
    BadParameters,
}

impl IdempotencyKey {
    /// Parses a header value in either form.
    pub fn parse(raw: &[u8]) -> Result<Self, KeyError> {
        // Header values may carry optional whitespace around them (RFC 9110 §5.5).
        let raw = raw.trim_ascii();
        let key = match raw.strip_prefix(b"\"") {
            Some(quoted) => {
                let (key, rest) = unquote(quoted)?;
                parameters(rest)?;
                key
            }
            None if raw.contains(&b',') => return Err(KeyError::SeveralValues),
            None if raw.contains(&b'"') => return Err(KeyError::BadQuoting),
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

/// Decodes the body of an sf-string (RFC 8941 §3.3.3) after its opening quote; returns it and
/// what follows the closing quote.
fn unquote(rest: &[u8]) -> Result<(Vec<u8>, &[u8]), KeyError> {
    let mut out = Vec::with_capacity(rest.len());
    let mut i = 0;
    while let Some(&b) = rest.get(i) {
        match b {
            b'\\' => match rest.get(i + 1) {
                Some(&escaped @ (b'"' | b'\\')) => {
                    out.push(escaped);
                    i += 2;
                    continue;
                }
                _ => return Err(KeyError::BadQuoting),
            },
            b'"' => return Ok((out, &rest[i + 1..])),
            other => out.push(other),
        }
        i += 1;
    }
    Err(KeyError::BadQuoting)
}

/// Checks RFC 8941 parameters (§3.1.2): `*( ";" *SP key [ "=" bare-item ] )`. The key's
/// parameters carry nothing this crate uses; they are accepted and ignored, as the draft's
/// Item field allows them.
fn parameters(mut rest: &[u8]) -> Result<(), KeyError> {
    while let Some((&first, after)) = rest.split_first() {
        match first {
            b',' => return Err(KeyError::SeveralValues),
            b';' => rest = after,
            _ => return Err(KeyError::BadParameters),
        }
        while let Some(after) = rest.strip_prefix(b" ") {
            rest = after;
        }
        // key = ( lcalpha / "*" ) *( lcalpha / DIGIT / "_" / "-" / "." / "*" )
        let key_len = rest
            .iter()
            .take_while(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b'*'))
            .count();
        if key_len == 0 || !matches!(rest[0], b'a'..=b'z' | b'*') {
            return Err(KeyError::BadParameters);
        }
        rest = &rest[key_len..];
        if let Some(value) = rest.strip_prefix(b"=") {
            rest = bare_item(value)?;
        }
    }
    Ok(())
}

/// Skips one RFC 8941 bare item (§3.3): a string, a boolean, a byte sequence, a number or a
/// token; returns what follows it.
fn bare_item(value: &[u8]) -> Result<&[u8], KeyError> {
    let bad = KeyError::BadParameters;
    let (&first, after) = value.split_first().ok_or(bad)?;
    let skip =
        |rest: &[u8], allowed: fn(u8) -> bool| rest.iter().take_while(|b| allowed(**b)).count();
    match first {
        b'"' => unquote(after).map(|(_, rest)| rest).map_err(|_| bad),
        b'?' => match after.split_first() {
            Some((b'0' | b'1', rest)) => Ok(rest),
            _ => Err(bad),
        },
        b':' => {
            let n = skip(after, |b| {
                b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'=')
            });
            after[n..].strip_prefix(b":").ok_or(bad)
        }
        b'-' | b'0'..=b'9' => {
            let n = skip(after, |b| b.is_ascii_digit() || b == b'.');
            Ok(&after[n..])
        }
        b'*' | b'A'..=b'Z' | b'a'..=b'z' => {
            let n = skip(after, |b| {
                b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(&b)
            });
            Ok(&after[n..])
        }
        _ => Err(bad),
    }
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
        assert_eq!(parse("\"a\"b\""), Err(KeyError::BadParameters));
        assert_eq!(parse(r#""a\nb""#), Err(KeyError::BadQuoting));
        assert_eq!(parse(r#"a"b"#), Err(KeyError::BadQuoting));
    }

    #[test]
    fn parameters_after_the_string_are_checked_and_ignored() {
        for header in [
            r#""k1";x=1"#,
            r#""k1"; x=1;y"#,
            r#""k1";a="q;,";b=?1;c=:AQID:;d=tok/en;e=-1.5;*f"#,
        ] {
            assert_eq!(parse(header).unwrap(), "k1", "{header}");
        }
        for header in [
            r#""k1"x"#,
            r#""k1";X=1"#,
            r#""k1";=1"#,
            r#""k1";a=""#,
            r#""k1";a=?2"#,
        ] {
            assert_eq!(parse(header), Err(KeyError::BadParameters), "{header}");
        }
    }

    #[test]
    fn several_values_are_refused() {
        assert_eq!(parse("a,b"), Err(KeyError::SeveralValues));
        assert_eq!(parse("a, b"), Err(KeyError::SeveralValues));
        assert_eq!(parse(r#""a", "b""#), Err(KeyError::SeveralValues));
        assert_eq!(parse(r#""a";x=1, "b""#), Err(KeyError::SeveralValues));
        // Inside quotes a comma is a character of the key.
        assert_eq!(parse(r#""a,b""#).unwrap(), "a,b");
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
