//! Stripe's form encoding: `application/x-www-form-urlencoded` with bracket notation, decoded
//! into a nested JSON object.
//!
//! ```text
//! amount=2000&metadata[ride_id]=42&expand[]=customer
//!     ──► {"amount": "2000", "metadata": {"ride_id": "42"}, "expand": ["customer"]}
//! ```
//!
//! Every leaf is a string: the encoding has no types, and each endpoint parses its own
//! parameters. The decoded object is also what an idempotency key's fingerprint is computed
//! over, so two bodies that differ only in the order of their pairs are the same request.
//!
//! The decoder is strict where a lenient one would guess: a name given twice, a name used both
//! as a value and as an object, unbalanced brackets and `[]` anywhere but at the end are refused
//! rather than resolved by "last one wins". Indexed forms (`items[0][price]`) decode as objects
//! keyed by the index; no endpoint of the gateway takes lists of objects.

use serde_json::{Map, Value};

/// The most `name=value` pairs one body may carry.
pub(crate) const MAX_PAIRS: usize = 256;

/// The deepest nesting accepted: `a[b][c][d]` has depth 4.
pub(crate) const MAX_DEPTH: usize = 4;

/// Why a body is not a valid Stripe form. The messages are shown to clients.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum FormError {
    /// Refused by the urlencoded parser. (It decodes invalid UTF-8 lossily rather than failing,
    /// so this is rare.)
    #[error("the request body is not valid application/x-www-form-urlencoded data")]
    Malformed,
    /// More than [`MAX_PAIRS`] pairs.
    #[error("the request has more than {MAX_PAIRS} parameters")]
    TooManyPairs,
    /// Empty name, unbalanced brackets, text after a closing bracket, `[]` before the end.
    #[error("Invalid parameter name: {0}")]
    InvalidName(String),
    /// Deeper than [`MAX_DEPTH`].
    #[error("Parameter {0} is nested too deeply")]
    TooDeep(String),
    /// The same name twice, or a name that is both a value and an object or list.
    #[error("Parameter {0} was given more than once, or both as a value and as an object")]
    Conflict(String),
}

impl FormError {
    /// The parameter at fault, if any.
    pub(crate) fn param(&self) -> Option<&str> {
        match self {
            Self::Malformed | Self::TooManyPairs => None,
            Self::InvalidName(name) | Self::TooDeep(name) | Self::Conflict(name) => Some(name),
        }
    }
}

/// One step of a parameter name's path.
#[derive(Debug, PartialEq, Eq)]
enum Segment<'a> {
    /// `name` or `[name]`: a member of an object.
    Key(&'a str),
    /// `[]`: append to a list; only the last segment may be one.
    Append,
}

/// Decodes a form body (or a query string) into a JSON object.
pub(crate) fn decode(input: &[u8]) -> Result<Map<String, Value>, FormError> {
    let pairs: Vec<(String, String)> =
        serde_urlencoded::from_bytes(input).map_err(|_| FormError::Malformed)?;
    if pairs.len() > MAX_PAIRS {
        return Err(FormError::TooManyPairs);
    }
    let mut root = Map::new();
    for (name, value) in pairs {
        let path = parse_name(&name)?;
        insert(&mut root, &path, value).map_err(|()| FormError::Conflict(name.clone()))?;
    }
    Ok(root)
}

/// Splits `a[b][]` into `[Key("a"), Key("b"), Append]`.
fn parse_name(name: &str) -> Result<Vec<Segment<'_>>, FormError> {
    let invalid = || FormError::InvalidName(name.to_owned());
    let (head, mut rest) = match name.find('[') {
        Some(i) => name.split_at(i),
        None => (name, ""),
    };
    if head.is_empty() || head.contains(']') {
        return Err(invalid());
    }
    let mut path = vec![Segment::Key(head)];
    while !rest.is_empty() {
        // `rest` starts with '[' here: either from the split above or after a closing ']'.
        let inner = rest.strip_prefix('[').ok_or_else(invalid)?;
        let close = inner.find(']').ok_or_else(invalid)?;
        let segment = &inner[..close];
        if segment.contains('[') {
            return Err(invalid());
        }
        path.push(if segment.is_empty() {
            Segment::Append
        } else {
            Segment::Key(segment)
        });
        rest = &inner[close + 1..];
    }
    if path.len() > MAX_DEPTH {
        return Err(FormError::TooDeep(name.to_owned()));
    }
    // `a[][b]` has no single meaning (which element gets `b`?), so only a trailing `[]` is taken.
    if path[..path.len() - 1].contains(&Segment::Append) {
        return Err(invalid());
    }
    Ok(path)
}

/// Puts `value` at `path` under `object`; `Err(())` on a conflict with what is already there.
fn insert(object: &mut Map<String, Value>, path: &[Segment<'_>], value: String) -> Result<(), ()> {
    // `parse_name` returns at least the head, and an Append only as the last segment.
    let (Segment::Key(key), rest) = path.split_first().expect("a path has a head") else {
        unreachable!("parse_name puts a Key first")
    };
    match rest {
        [] => match object.get(*key) {
            None => {
                object.insert((*key).to_owned(), Value::String(value));
                Ok(())
            }
            Some(_) => Err(()),
        },
        [Segment::Append] => {
            let slot = object
                .entry(*key)
                .or_insert_with(|| Value::Array(Vec::new()));
            match slot {
                Value::Array(items) => {
                    items.push(Value::String(value));
                    Ok(())
                }
                _ => Err(()),
            }
        }
        _ => {
            let slot = object
                .entry(*key)
                .or_insert_with(|| Value::Object(Map::new()));
            match slot {
                Value::Object(child) => insert(child, rest, value),
                _ => Err(()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn decoded(input: &str) -> Value {
        Value::Object(decode(input.as_bytes()).unwrap())
    }

    #[test]
    fn bracket_notation_decodes_into_nested_objects() {
        assert_eq!(
            decoded("amount=2000&currency=usd&metadata[ride_id]=42&metadata[user]=u%201"),
            json!({
                "amount": "2000",
                "currency": "usd",
                "metadata": {"ride_id": "42", "user": "u 1"}
            })
        );
    }

    #[test]
    fn deeper_nesting_and_trailing_brackets_decode() {
        assert_eq!(
            decoded("a[b][c]=1&a[b][d]=2&expand[]=x&expand[]=y"),
            json!({"a": {"b": {"c": "1", "d": "2"}}, "expand": ["x", "y"]})
        );
    }

    #[test]
    fn percent_encoded_brackets_and_plus_signs_decode() {
        assert_eq!(
            decoded("metadata%5Bride_id%5D=42&description=two+words"),
            json!({"metadata": {"ride_id": "42"}, "description": "two words"})
        );
    }

    #[test]
    fn pair_order_does_not_change_the_result() {
        assert_eq!(
            decoded("metadata[b]=2&amount=1&metadata[a]=1"),
            decoded("amount=1&metadata[a]=1&metadata[b]=2")
        );
    }

    #[test]
    fn empty_body_is_an_empty_object_and_empty_values_are_kept() {
        assert_eq!(decoded(""), json!({}));
        assert_eq!(decoded("description="), json!({"description": ""}));
    }

    #[test]
    fn repeated_and_conflicting_names_are_refused() {
        let conflict = |s: &str| decode(s.as_bytes()).unwrap_err();
        assert_eq!(
            conflict("amount=1&amount=2"),
            FormError::Conflict("amount".into())
        );
        assert_eq!(
            conflict("metadata=x&metadata[a]=1"),
            FormError::Conflict("metadata[a]".into())
        );
        assert_eq!(
            conflict("metadata[a]=1&metadata=x"),
            FormError::Conflict("metadata".into())
        );
        assert_eq!(conflict("a[]=1&a[b]=2"), FormError::Conflict("a[b]".into()));
    }

    #[test]
    fn malformed_names_are_refused() {
        for name in ["[a]", "a[b", "a]b", "a[b]c", "a[b[c]]", "a[][b]", "=1"] {
            let input = if name.starts_with('=') {
                name.to_owned()
            } else {
                format!("{name}=1")
            };
            assert!(
                matches!(decode(input.as_bytes()), Err(FormError::InvalidName(_))),
                "{name} should be refused"
            );
        }
    }

    #[test]
    fn depth_and_pair_count_are_bounded() {
        assert!(decode(b"a[b][c][d]=1").is_ok());
        assert_eq!(
            decode(b"a[b][c][d][e]=1"),
            Err(FormError::TooDeep("a[b][c][d][e]".into()))
        );
        let many: Vec<String> = (0..=MAX_PAIRS).map(|i| format!("k{i}=v")).collect();
        assert_eq!(
            decode(many.join("&").as_bytes()),
            Err(FormError::TooManyPairs)
        );
    }
}
