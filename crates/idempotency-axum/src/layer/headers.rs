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

/// The values of `names` in `headers`, every one of each, as the key stores them. A value that
/// is not visible ASCII cannot be stored as text, and is left out.
pub(super) fn kept_headers(names: &[HeaderName], headers: &HeaderMap) -> Vec<(String, String)> {
    names
        .iter()
        .flat_map(|name| {
            headers.get_all(name).iter().filter_map(move |value| {
                Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned()))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let names = stored_header_names(["link"]).unwrap();
        assert_eq!(
            kept_headers(&names, &headers),
            [
                ("link".to_owned(), "</a>; rel=next".to_owned()),
                ("link".to_owned(), "</b>; rel=prev".to_owned()),
            ]
        );
    }
}
