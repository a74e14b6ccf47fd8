//! Tests only: a constant's doc comment states its value, checked against the value itself, so
//! that the two cannot drift. One helper for every crate of the workspace.
//!
//! ```ignore
//! #[test]
//! fn defaults_state_their_values() {
//!     let runner = include_str!("runner.rs");
//!     testdb::doc_values::duration(runner, "DEFAULT_GRACE", DEFAULT_GRACE);
//!     testdb::doc_values::number(runner, "DEFAULT_BATCH", DEFAULT_BATCH as u64);
//! }
//! ```

use std::time::Duration;

/// Panics unless the doc comment of `const NAME` in `source` (a file's text, by `include_str!`)
/// states `duration` in one of its exact spellings: `200 ms`, `5 s`, `10 min`, `1 h`.
pub fn duration(source: &str, name: &str, duration: Duration) {
    let mut spellings = Vec::new();
    let (secs, millis) = (duration.as_secs(), duration.as_millis());
    if duration.subsec_nanos() == 0 {
        spellings.push(format!("{secs} s"));
        for (unit, size) in [("min", 60), ("h", 3600)] {
            if secs >= size && secs % size == 0 {
                spellings.push(format!("{} {unit}", secs / size));
            }
        }
    }
    if Duration::from_millis(millis as u64) == duration {
        spellings.push(format!("{millis} ms"));
    }
    states(source, name, &spellings);
}

/// Panics unless the doc comment of `const NAME` in `source` states `value` in decimal, not as
/// part of a longer number (`50` is not found in `500`).
pub fn number(source: &str, name: &str, value: u64) {
    states(source, name, &[value.to_string()]);
}

/// Panics unless the doc comment of `const NAME` in `source` states `bytes` as `N bytes`,
/// `N KiB` or `N MiB`.
pub fn bytes(source: &str, name: &str, bytes: u64) {
    let mut spellings = vec![format!("{bytes} bytes")];
    for (unit, size) in [("KiB", 1024), ("MiB", 1024 * 1024)] {
        if bytes >= size && bytes % size == 0 {
            spellings.push(format!("{} {unit}", bytes / size));
        }
    }
    states(source, name, &spellings);
}

fn states(source: &str, name: &str, spellings: &[String]) {
    let doc = doc_of(source, name);
    let found = spellings.iter().any(|spelling| {
        doc.match_indices(spelling.as_str()).any(|(at, _)| {
            let before = doc[..at].chars().next_back();
            let after = doc[at + spelling.len()..].chars().next();
            !before.is_some_and(|c| c.is_ascii_digit() || c == '.')
                && !after.is_some_and(|c| c.is_ascii_alphanumeric())
        })
    });
    assert!(
        found,
        "the doc comment of {name} does not state its value (one of {spellings:?}): {doc:?}"
    );
}

/// The doc comment (`///` lines, joined by spaces) right above `pub const NAME:`.
fn doc_of(source: &str, name: &str) -> String {
    let lines: Vec<&str> = source.lines().collect();
    let declaration = format!("pub const {name}:");
    let Some(at) = lines
        .iter()
        .position(|line| line.trim_start().starts_with(&declaration))
    else {
        panic!("no `{declaration}` in the source given");
    };
    let mut doc: Vec<&str> = lines[..at]
        .iter()
        .rev()
        .map(|line| line.trim_start())
        .take_while(|line| line.starts_with("///") || line.starts_with("#["))
        .filter_map(|line| line.strip_prefix("///"))
        .map(str::trim)
        .collect();
    doc.reverse();
    doc.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = "
/// Waits 5 s, then 500 more.
pub const WAIT: Duration = Duration::from_secs(5);

/// A batch of 500.
#[allow(dead_code)]
pub const BATCH: usize = 500;

/// 64 KiB.
pub const BODY: usize = 64 * 1024;
";

    #[test]
    fn a_stated_value_passes() {
        duration(SOURCE, "WAIT", Duration::from_secs(5));
        duration(SOURCE, "WAIT", Duration::from_millis(5000));
        number(SOURCE, "BATCH", 500);
        bytes(SOURCE, "BODY", 64 * 1024);
    }

    #[test]
    #[should_panic(expected = "does not state its value")]
    fn a_number_inside_a_longer_one_is_not_its_value() {
        number(SOURCE, "BATCH", 50);
    }

    #[test]
    #[should_panic(expected = "does not state its value")]
    fn another_constants_doc_does_not_count() {
        number(SOURCE, "BODY", 500);
    }

    #[test]
    #[should_panic(expected = "does not state its value")]
    fn a_changed_duration_is_caught() {
        duration(SOURCE, "WAIT", Duration::from_secs(6));
    }
}
