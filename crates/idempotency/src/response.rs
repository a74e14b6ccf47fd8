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
    /// A JSON response with the given extra headers, sent with `Content-Type: application/json`
    /// unless `extra` names a content type of its own (`application/problem+json`): a response
    /// carries one content type.
    pub fn json(status: u16, body: &serde_json::Value, extra: Vec<(String, String)>) -> Self {
        let own_type = extra
            .iter()
            .any(|(name, _)| name.eq_ignore_ascii_case("content-type"));
        let mut headers = Vec::with_capacity(extra.len() + 1);
        if !own_type {
            headers.push(("content-type".to_owned(), "application/json".to_owned()));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_json_response_has_one_content_type_even_when_it_names_its_own() {
        let problem = StoredResponse::json(
            409,
            &serde_json::json!({"type": "about:blank"}),
            vec![
                (
                    "Content-Type".to_owned(),
                    "application/problem+json".to_owned(),
                ),
                ("location".to_owned(), "/x".to_owned()),
            ],
        );
        let types: Vec<_> = problem
            .headers
            .iter()
            .filter(|(name, _)| name.eq_ignore_ascii_case("content-type"))
            .collect();
        assert_eq!(types.len(), 1, "{:?}", problem.headers);
        assert_eq!(
            problem.header("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(problem.header("location"), Some("/x"));
        let plain = StoredResponse::json(201, &serde_json::json!({}), vec![]);
        assert_eq!(
            plain.headers,
            vec![("content-type".to_owned(), "application/json".to_owned())]
        );
    }
}
