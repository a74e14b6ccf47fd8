//! Strict JSON for request bodies: what serde_json accepts, minus what lets two readers of the
//! same bytes see two different requests.
//!
//! - **A member name twice** (`{"amount_cents": 100, "amount_cents": 200}`): serde_json keeps the
//!   last, other parsers the first; a proxy that checks the amount may see another than the one
//!   charged. Refused.
//! - **A NUL in a string** (`"\u0000"`): PostgreSQL's `jsonb` cannot store it, so it would fail
//!   at the claim, on every retry. Refused.
//! - **Numbers** are kept as the client wrote them ([`Members`]), so that they can be checked on
//!   their exact decimal text before anything rounds them (`49.999999999999999` is not 50, and
//!   `90.0000000000000001` is not 90).

use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::Value;

/// The top-level members of a JSON object, each as the text the client wrote.
pub type Members = Vec<(String, Box<RawValue>)>;

/// A body that is not strict JSON: the message is for the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct JsonError(pub String);

/// Parses `body` as strict JSON: the value (for fingerprints and stored parameters) and, when it
/// is an object, its members as written.
pub fn parse(body: &[u8]) -> Result<(Value, Option<Members>), JsonError> {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    Strict
        .deserialize(&mut deserializer)
        .and_then(|()| deserializer.end())
        .map_err(|e| JsonError(e.to_string()))?;
    let value: Value = serde_json::from_slice(body).map_err(|e| JsonError(e.to_string()))?;
    let members = match value {
        Value::Object(_) => Some(members(body)?),
        _ => None,
    };
    Ok((value, members))
}

/// The members of an object, in order, with their raw text: read with a visitor, so that no
/// intermediate map forgets a duplicate (they were refused above anyway) or rounds a number.
fn members(body: &[u8]) -> Result<Members, JsonError> {
    struct Pairs;
    impl<'de> Visitor<'de> for Pairs {
        type Value = Vec<(String, Box<RawValue>)>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut pairs = Vec::new();
            while let Some(name) = map.next_key::<String>()? {
                pairs.push((name, map.next_value::<Box<RawValue>>()?));
            }
            Ok(pairs)
        }
    }
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    deserializer
        .deserialize_map(Pairs)
        .map_err(|e| JsonError(e.to_string()))
}

/// A visitor that walks a whole document and fails on a repeated member name or a NUL.
struct Strict;

impl<'de> DeserializeSeed<'de> for Strict {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

fn no_nul<E: de::Error>(text: &str) -> Result<(), E> {
    if text.contains('\0') {
        return Err(E::custom("a string contains a NUL character (\\u0000)"));
    }
    Ok(())
}

impl<'de> Visitor<'de> for Strict {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E: de::Error>(self, text: &str) -> Result<(), E> {
        no_nul(text)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Strict)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = HashSet::new();
        while let Some(name) = map.next_key::<String>()? {
            no_nul(&name)?;
            map.next_value_seed(Strict)?;
            if !seen.insert(name.clone()) {
                return Err(de::Error::custom(format!(
                    "the member {name:?} appears more than once"
                )));
            }
        }
        Ok(())
    }
}

/// Compares the absolute value of a JSON number, given as its text, with a whole `bound`,
/// exactly: no rounding to a double on the way. `None` when `text` is not a JSON number.
pub fn abs_cmp(text: &str, bound: u64) -> Option<std::cmp::Ordering> {
    let digits_of = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let unsigned = text.strip_prefix('-').unwrap_or(text);
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        Some(at) => {
            let exp = &unsigned[at + 1..];
            let exp_digits = exp.strip_prefix(['+', '-']).unwrap_or(exp);
            if !digits_of(exp_digits) {
                return None;
            }
            // An exponent beyond any bound we compare with saturates: 1e999999 is just "large".
            let magnitude: i64 = exp_digits.parse().unwrap_or(i64::MAX / 4).min(i64::MAX / 4);
            let exp = if exp.starts_with('-') {
                -magnitude
            } else {
                magnitude
            };
            (&unsigned[..at], exp)
        }
        None => (unsigned, 0),
    };
    let (whole, fraction) = match mantissa.split_once('.') {
        Some((whole, fraction)) if digits_of(fraction) => (whole, fraction),
        Some(_) => return None,
        None => (mantissa, ""),
    };
    if !digits_of(whole) || (whole.len() > 1 && whole.starts_with('0')) {
        return None;
    }
    // The number is 0.DIGITS × 10^point, DIGITS without leading or trailing zeros.
    let all: String = format!("{whole}{fraction}");
    let leading = all.len() - all.trim_start_matches('0').len();
    let digits = all.trim_start_matches('0').trim_end_matches('0');
    if digits.is_empty() {
        return Some(if bound == 0 {
            std::cmp::Ordering::Equal
        } else {
            std::cmp::Ordering::Less
        });
    }
    let point = whole.len() as i64 - leading as i64 + exponent;
    let bound_text = bound.to_string();
    let bound_digits = bound_text.trim_end_matches('0');
    let bound_point = bound_text.len() as i64;
    if bound == 0 {
        return Some(std::cmp::Ordering::Greater);
    }
    Some(
        point
            .cmp(&bound_point)
            .then_with(|| digits.cmp(bound_digits)),
    )
}

#[cfg(test)]
mod tests {
    use std::cmp::Ordering::{Equal, Greater, Less};

    use super::*;

    #[test]
    fn duplicate_members_and_nul_characters_are_refused_at_any_depth() {
        assert!(parse(br#"{"a": 1, "a": 2}"#).is_err());
        assert!(parse(br#"{"x": {"a": 1, "a": 2}}"#).is_err());
        assert!(parse(br#"[{"a": 1}, {"b": 1, "b": 1}]"#).is_err());
        assert!(parse(br#"{"a": "x\u0000y"}"#).is_err());
        assert!(parse(br#"{"a\u0000": 1}"#).is_err());
        assert!(parse(br#"{"a": 1} trailing"#).is_err());
        // Escapes of other names are other names.
        assert!(parse(br#"{"a": 1, "\u0061b": 2}"#).is_ok());
        let (value, members) = parse(br#"{"b": 1.50, "a": [1, "x"]}"#).unwrap();
        assert_eq!(value["b"], 1.5);
        let members = members.unwrap();
        assert_eq!(members[0].0, "b");
        assert_eq!(members[0].1.get(), "1.50", "kept as written");
        assert!(parse(b"[1]").unwrap().1.is_none());
    }

    #[test]
    fn numbers_compare_with_a_bound_on_their_exact_text() {
        for (text, expected) in [
            ("90", Equal),
            ("-90", Equal),
            ("90.0", Equal),
            ("9e1", Equal),
            ("900e-1", Equal),
            ("90.0000000000000001", Greater),
            ("89.99999999999999999", Less),
            ("90.00000000000000000000000001e0", Greater),
            ("0.9e2", Equal),
            ("1e3", Greater),
            ("1e-999999999", Less),
            ("1e999999999", Greater),
            ("0", Less),
            ("-0.0", Less),
            ("180.5", Greater),
        ] {
            assert_eq!(abs_cmp(text, 90), Some(expected), "{text}");
        }
        for not_a_number in ["", "-", "1.", ".5", "01", "1e", "1e+", "NaN", "1.5.2", "+1"] {
            assert_eq!(abs_cmp(not_a_number, 90), None, "{not_a_number:?}");
        }
    }
}
