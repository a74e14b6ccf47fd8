//! `Prefer: wait=N` (RFC 7240): how long a client is willing to wait for a duplicate's answer.

use std::time::Duration;

use http::HeaderMap;

/// The longest a request waits for the holder of its key when it asks (`Prefer: wait=N`) and
/// the layer is not told otherwise ([`super::IdempotencyLayer::max_wait`]). A live holder
/// finishes in milliseconds; a holder that takes longer than this is slow or dead, and the
/// client is better told 409 with `Retry-After` than kept on a connection. It stays well below
/// common proxy and client timeouts (30 s and more).
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(10);

/// The wait a request asks for, capped at `max`: the first `wait` preference of its `Prefer`
/// headers (RFC 7240: a preference given twice counts once, the first), in whole seconds.
///
/// `None` when there is nothing to wait for: no `wait` preference, `wait=0`, or a value that is
/// not a plain number of seconds (`wait=abc`, `wait=-1`, `wait=1.5`), which RFC 7240 says to
/// ignore, as is a `Prefer` header that is not visible ASCII.
pub fn wait_preference(headers: &HeaderMap, max: Duration) -> Option<Duration> {
    let value = headers
        .get_all(http::header::HeaderName::from_static("prefer"))
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .find_map(|preference| {
            // A preference's own parameters follow `;`; `wait` has none that matter here.
            let token = preference.split(';').next()?;
            let (name, value) = token.split_once('=')?;
            name.trim()
                .eq_ignore_ascii_case("wait")
                .then(|| value.trim())
        })?;
    let value = value
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(value);
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // All digits: too many of them to parse is a wait longer than any cap.
    let seconds = value.parse::<u64>().unwrap_or(u64::MAX);
    let wait = Duration::from_secs(seconds).min(max);
    (!wait.is_zero()).then_some(wait)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait_of(values: &[&str]) -> Option<Duration> {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append("prefer", v.parse().unwrap());
        }
        wait_preference(&headers, DEFAULT_MAX_WAIT)
    }

    #[test]
    fn a_wait_preference_is_read_in_seconds_and_capped() {
        assert_eq!(wait_of(&["wait=3"]), Some(Duration::from_secs(3)));
        assert_eq!(
            wait_of(&["respond-async, Wait = 4"]),
            Some(Duration::from_secs(4))
        );
        assert_eq!(
            wait_of(&["return=minimal", "wait=\"5\""]),
            Some(Duration::from_secs(5))
        );
        assert_eq!(wait_of(&["wait=2;x=y"]), Some(Duration::from_secs(2)));
        assert_eq!(wait_of(&["wait=600"]), Some(DEFAULT_MAX_WAIT));
        assert_eq!(
            wait_of(&["wait=99999999999999999999999"]),
            Some(DEFAULT_MAX_WAIT)
        );
        // The first wait counts.
        assert_eq!(wait_of(&["wait=1, wait=7"]), Some(Duration::from_secs(1)));
    }

    #[test]
    fn no_wait_malformed_waits_and_wait_zero_mean_no_wait() {
        assert_eq!(wait_of(&[]), None);
        assert_eq!(wait_of(&["respond-async"]), None);
        assert_eq!(wait_of(&["wait=0"]), None);
        for malformed in [
            "wait=",
            "wait=abc",
            "wait=-1",
            "wait=1.5",
            "wait=+3",
            "wait",
            "waiting=3",
        ] {
            assert_eq!(wait_of(&[malformed]), None, "{malformed}");
        }
    }
}
