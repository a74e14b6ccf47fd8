//! The final response, as stored and as replayed.

use serde::{Deserialize, Serialize};

/// A response kept with its key and replayed byte for byte.
///
/// Only the headers the application chose to keep are stored (`Location`, `Content-Type`):
/// headers such as `Date` or a request id describe one delivery, not the outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse {
    /// The HTTP status code.
    pub status: u16,
    /// Header name and value pairs, in order.
    pub headers: Vec<(String, String)>,
    /// The body, exactly as first sent.
    pub body: Vec<u8>,
}

impl StoredResponse {
    /// A JSON response with the given extra headers.
    pub fn json(status: u16, body: &serde_json::Value, extra: Vec<(String, String)>) -> Self {
        let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
        headers.extend(extra);
        Self {
            status,
            headers,
            // Serializing a `Value` cannot fail: its keys are strings.
            body: serde_json::to_vec(body).expect("a JSON value serializes"),
        }
    }

    /// The value of the first header with this name, compared case-insensitively.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}
