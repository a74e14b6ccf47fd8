//! RFC 8785 JSON Canonicalization Scheme (JCS), enough of it to fingerprint request bodies.
//!
//! Two bodies that mean the same JSON (keys in another order, other whitespace, `2000` vs
//! `2000.0`, `"\u0041"` vs `"A"`) canonicalize to the same bytes, so they get the same
//! fingerprint. The rules: object members sorted by the UTF-16 code units of their names, no
//! whitespace, strings escaped as ECMAScript's `JSON.stringify` does, and numbers written as
//! ECMAScript's `Number.prototype.toString` writes an IEEE 754 double.

use serde_json::Value;

/// Writes `value` in canonical form.
pub fn canonicalize(value: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, value);
    out
}

fn write_value(out: &mut String, value: &Value) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => write_number(out, n),
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, item);
            }
            out.push(']');
        }
        Value::Object(members) => {
            let mut sorted: Vec<_> = members.iter().collect();
            // RFC 8785 §3.2.3: sort by UTF-16 code units, which differs from byte order for
            // characters beyond the Basic Multilingual Plane.
            sorted.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
            out.push('{');
            for (i, (name, item)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(out, name);
                out.push(':');
                write_value(out, item);
            }
            out.push('}');
        }
    }
}

fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c < ' ' => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

fn write_number(out: &mut String, n: &serde_json::Number) {
    // JSON numbers are IEEE 754 doubles in JCS; an integer that a double holds exactly is
    // written the same way whether it arrived as `20` or `20.0`.
    match n.as_f64() {
        Some(f) => write_double(out, f),
        // serde_json without arbitrary precision always yields an f64.
        None => out.push_str(&n.to_string()),
    }
}

/// ECMAScript `Number.prototype.toString` for a finite double (ECMA-262 §6.1.6.1.20).
fn write_double(out: &mut String, f: f64) {
    if f == 0.0 {
        // Both zeros print as "0".
        out.push('0');
        return;
    }
    if f.is_sign_negative() {
        out.push('-');
    }
    // Rust's `{:e}` gives the shortest digits that round-trip, as ECMAScript requires:
    // "d.ddddde±x". Split it into the digit string and the decimal exponent n, where the value
    // is 0.digits × 10^n.
    let sci = format!("{:e}", f.abs());
    let (mantissa, exponent) = sci
        .split_once('e')
        .expect("`{:e}` always writes an exponent");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let k = digits.len() as i32;
    let n = exponent
        .parse::<i32>()
        .expect("`{:e}` writes an integer exponent")
        + 1;

    if k <= n && n <= 21 {
        out.push_str(&digits);
        out.extend(std::iter::repeat_n('0', (n - k) as usize));
    } else if 0 < n && n <= 21 {
        out.push_str(&digits[..n as usize]);
        out.push('.');
        out.push_str(&digits[n as usize..]);
    } else if -6 < n && n <= 0 {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-n) as usize));
        out.push_str(&digits);
    } else {
        out.push_str(&digits[..1]);
        if k > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if n > 0 { '+' } else { '-' });
        out.push_str(&(n - 1).abs().to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn number(f: f64) -> String {
        let mut s = String::new();
        write_double(&mut s, f);
        s
    }

    #[test]
    fn numbers_are_written_as_ecmascript_writes_them() {
        // Values from RFC 8785 Appendix B and ECMAScript's boundaries.
        assert_eq!(number(0.0), "0");
        assert_eq!(number(-0.0), "0");
        assert_eq!(number(1.0), "1");
        assert_eq!(number(2000.0), "2000");
        assert_eq!(number(-122.42), "-122.42");
        assert_eq!(number(1e21), "1e+21");
        assert_eq!(number(1e20), "100000000000000000000");
        assert_eq!(number(1e-7), "1e-7");
        assert_eq!(number(0.000001), "0.000001");
        assert_eq!(number(123456789.0e-13), "0.0000123456789");
        assert_eq!(number(9007199254740992.0), "9007199254740992");
        assert_eq!(number(f64::MAX), "1.7976931348623157e+308");
        assert_eq!(number(5e-324), "5e-324");
        assert_eq!(number(333333333.3333333), "333333333.3333333");
    }

    #[test]
    fn objects_are_sorted_and_whitespace_dropped() {
        let a: Value = serde_json::from_str(r#"{ "b": 1, "a": [true, null, "x"] }"#).unwrap();
        assert_eq!(canonicalize(&a), r#"{"a":[true,null,"x"],"b":1}"#);
    }

    #[test]
    fn members_sort_by_utf16_code_units() {
        // U+1F600 is a surrogate pair (0xD83D…) and sorts before U+FB01 in UTF-16, after it in UTF-8.
        let v = json!({"\u{fb01}": 1, "\u{1f600}": 2});
        assert_eq!(canonicalize(&v), "{\"\u{1f600}\":2,\"\u{fb01}\":1}");
    }

    #[test]
    fn strings_escape_only_what_ecmascript_escapes() {
        let v = json!("a\"b\\c\n\u{1}\u{7f}é/");
        assert_eq!(canonicalize(&v), "\"a\\\"b\\\\c\\n\\u0001\u{7f}é/\"");
    }

    #[test]
    fn integer_and_float_spellings_agree() {
        let a: Value = serde_json::from_str(r#"{"amount_cents": 2000}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"amount_cents": 2000.0}"#).unwrap();
        let c: Value = serde_json::from_str(r#"{"amount_cents": 2e3}"#).unwrap();
        assert_eq!(canonicalize(&a), canonicalize(&b));
        assert_eq!(canonicalize(&a), canonicalize(&c));
    }
}
