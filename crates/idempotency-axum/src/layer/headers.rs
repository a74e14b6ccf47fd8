//! Which headers of an answer are stored with it and replayed.

use std::sync::Arc;

use http::{HeaderMap, HeaderName};

/// The headers of a handler's answer that are stored and replayed unless
/// [`IdempotencyLayer::store_headers`] says otherwise: those that describe the outcome.
/// Per-delivery headers (`Date`, request ids) are not.
///
/// [`IdempotencyLayer::store_headers`]: super::IdempotencyLayer::store_headers
pub const DEFAULT_STORED_HEADERS: [&str; 2] = ["content-type", "location"];

/// Headers that are never stored, whatever [`IdempotencyLayer::store_headers`] is given, because
/// they belong to one delivery rather than to the request's outcome:
///
/// - the framing (`content-length`, `transfer-encoding`, `trailer`), which each delivery
///   computes from the stored body;
/// - the connection's own (`connection`, `keep-alive`, `proxy-connection`, `te`, `upgrade`);
/// - `date`, the moment of one delivery; a replay sent with the first one's would lie about its
///   age;
/// - `set-cookie`: a cookie is a credential or a session's state. Stored, it would sit in the
///   key table, readable by whoever reads that table, for as long as the key is kept, and every
///   replay would set it again, even after the session it belongs to was ended. Set cookies
///   outside the layer;
/// - `idempotent-replayed`, which the layer sets itself.
///
/// [`IdempotencyLayer::store_headers`]: super::IdempotencyLayer::store_headers
pub const UNSTORABLE_HEADERS: [&str; 10] = [
    "connection",
    "content-length",
    "date",
    "idempotent-replayed",
    "keep-alive",
    "proxy-connection",
    "set-cookie",
    "te",
    "trailer",
    "transfer-encoding",
];

/// Why [`IdempotencyLayer::store_headers`] refused its list.
///
/// [`IdempotencyLayer::store_headers`]: super::IdempotencyLayer::store_headers
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredHeaderError {
    /// The name is not a valid header name (RFC 9110 §5.1).
    InvalidName(String),
    /// The header is one of [`UNSTORABLE_HEADERS`].
    Unstorable(HeaderName),
}

impl std::fmt::Display for StoredHeaderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::InvalidName(name) => {
                write!(f, "cannot store header {name:?}: it is not a header name")
            }
            Self::Unstorable(name) => write!(
                f,
                "cannot store header {name}: it belongs to one delivery, not to the outcome"
            ),
        }
    }
}

impl std::error::Error for StoredHeaderError {}

/// The names to store, validated, in their lowercase form and without repeats.
pub(super) fn stored_header_names<I>(names: I) -> Result<Arc<[HeaderName]>, StoredHeaderError>
where
    I: IntoIterator,
    I::Item: AsRef<str>,
{
    let mut kept: Vec<HeaderName> = Vec::new();
    for name in names {
        let name = name.as_ref();
        // `from_bytes` lowercases, so that `X-Transfer-Id` and `x-transfer-id` are one name.
        let parsed = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| StoredHeaderError::InvalidName(name.to_owned()))?;
        if UNSTORABLE_HEADERS.contains(&parsed.as_str()) {
            return Err(StoredHeaderError::Unstorable(parsed));
        }
        if !kept.contains(&parsed) {
            kept.push(parsed);
        }
    }
    Ok(kept.into())
}

/// The values of `names` in `headers`, every one of each, as the key stores them: as text, so a
/// value beyond visible ASCII is kept when it is UTF-8 (a replay sends the same bytes). One that
/// is not cannot be stored as text; it is left out of the stored answer, and said loudly, for the
/// replay will lack it.
pub(super) fn kept_headers(names: &[HeaderName], headers: &HeaderMap) -> Vec<(String, String)> {
    names
        .iter()
        .flat_map(|name| {
            headers.get_all(name).iter().filter_map(move |value| {
                match std::str::from_utf8(value.as_bytes()) {
                    Ok(text) => Some((name.as_str().to_owned(), text.to_owned())),
                    Err(_) => {
                        tracing::error!(
                            header = name.as_str(),
                            "a header chosen to be stored is not UTF-8 and cannot be kept: its \
                             replays will lack it"
                        );
                        None
                    }
                }
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn names_are_lowercased_and_kept_once() {
        let names = stored_header_names(["X-Transfer-Id", "x-transfer-id", "Location"]).unwrap();
        assert_eq!(names.as_ref(), ["x-transfer-id", "location"]);
    }

    #[test]
    fn a_name_that_is_not_a_header_name_is_refused() {
        assert_eq!(
            stored_header_names(["x transfer"]),
            Err(StoredHeaderError::InvalidName("x transfer".to_owned()))
        );
        assert!(stored_header_names([""]).is_err());
    }

    #[test]
    fn per_delivery_headers_are_refused_in_any_case() {
        for name in [
            "Set-Cookie",
            "date",
            "Content-Length",
            "Idempotent-Replayed",
        ] {
            let refused = stored_header_names(["location", name]);
            assert!(
                matches!(refused, Err(StoredHeaderError::Unstorable(_))),
                "{name}: {refused:?}"
            );
        }
    }

    #[test]
    fn every_value_of_a_stored_header_is_kept_in_order() {
        let mut headers = HeaderMap::new();
        headers.append("link", "</a>; rel=next".parse().unwrap());
        headers.append("link", "</b>; rel=prev".parse().unwrap());
        headers.append("x-delivery", "first".parse().unwrap());
        // UTF-8 beyond ASCII is kept, byte for byte; other bytes cannot be stored as text.
        headers.append(
            "x-delivery",
            HeaderValue::from_bytes("café".as_bytes()).unwrap(),
        );
        headers.append("x-delivery", HeaderValue::from_bytes(b"caf\xe9").unwrap());
        let names = stored_header_names(["link"]).unwrap();
        assert_eq!(
            kept_headers(&names, &headers),
            [
                ("link".to_owned(), "</a>; rel=next".to_owned()),
                ("link".to_owned(), "</b>; rel=prev".to_owned()),
            ]
        );
        let names = stored_header_names(["x-delivery"]).unwrap();
        let kept = kept_headers(&names, &headers);
        assert_eq!(
            kept,
            [
                ("x-delivery".to_owned(), "first".to_owned()),
                ("x-delivery".to_owned(), "café".to_owned()),
            ]
        );
        // And a replay sends the same bytes again.
        let replayed = HeaderValue::try_from(kept[1].1.as_str()).unwrap();
        assert_eq!(replayed.as_bytes(), "café".as_bytes());
    }
}
