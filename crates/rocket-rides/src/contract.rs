//! The HTTP contract's failures, each defined once: its status, its stable problem `type`, its
//! title, its `Retry-After`, whether it is stored and replayed, and which routes answer with
//! it ([`FAILURES`]). `problem.rs` builds the service's answers from it, the OpenAPI document
//! describes each operation's failures from it (`openapi.rs`), and a test holds
//! docs/rocket-rides.md's table of outcomes against it, row for row.
//!
//! The answers the idempotency face builds itself (a missing or malformed key, a reused key, a
//! key in flight) are rows too: the library decides them, this table says what they are.

use std::time::Duration;

use crate::config::OVERLOAD_RETRY_AFTER;

/// How long a client should wait before retrying after the gateway failed.
///
/// Short: the lease is released at once, so the retry is not refused; the wait only spares a
/// gateway that is struggling.
pub const GATEWAY_RETRY_AFTER: Duration = Duration::from_secs(1);

/// How long a client should wait before asking again about a pending charge: a gateway
/// settles a pending card charge in seconds, a bank debit in days; the completer keeps asking.
pub const PENDING_RETRY_AFTER: Duration = Duration::from_secs(5);

/// The stable `type` of each problem the service answers with (the idempotency ones come from
/// [`idempotency_axum::problem::types`]).
pub mod types {
    /// The body is not JSON (400).
    pub const BAD_JSON: &str = "urn:problem:rocket-rides:bad-json";
    /// The body is larger than accepted (413).
    pub const BODY_TOO_LARGE: &str = "urn:problem:rocket-rides:body-too-large";
    /// The body fails validation (400); `errors` lists the fields.
    pub const VALIDATION: &str = "urn:problem:rocket-rides:validation";
    /// No or unknown API key (401).
    pub const UNAUTHORIZED: &str = "urn:problem:rocket-rides:unauthorized";
    /// The card was declined (402).
    pub const PAYMENT_DECLINED: &str = "urn:problem:rocket-rides:payment-declined";
    /// No such resource for this user (404).
    pub const NOT_FOUND: &str = "urn:problem:rocket-rides:not-found";
    /// The gateway refused the charge for good; the request is finished (502, stored).
    pub const PAYMENT_REFUSED: &str = "urn:problem:rocket-rides:payment-refused";
    /// The charge is pending at the gateway; retry later (503).
    pub const PAYMENT_PENDING: &str = "urn:problem:rocket-rides:payment-pending";
    /// Whether an earlier attempt charged cannot be known yet: the gateway may still be working
    /// on it. Retry after `Retry-After` (503).
    pub const PAYMENT_UNCONFIRMED: &str = "urn:problem:rocket-rides:payment-unconfirmed";
    /// The payment gateway is unavailable; retry (503).
    pub const GATEWAY_UNAVAILABLE: &str = "urn:problem:rocket-rides:gateway-unavailable";
    /// The server is shutting down; retry, another instance resumes the request (503).
    pub const SHUTTING_DOWN: &str = "urn:problem:rocket-rides:shutting-down";
    /// The request lost its lease to another worker, which carries on (409).
    pub const LEASE_LOST: &str = "urn:problem:rocket-rides:lease-lost";
    /// Something broke on our side (500).
    pub const INTERNAL: &str = "urn:problem:rocket-rides:internal";
    /// The body could not be read: cut off, or too slow to arrive (400).
    pub const BAD_BODY: &str = "urn:problem:rocket-rides:bad-body";
    /// The body's media type or encoding is not one the route takes (415).
    pub const UNSUPPORTED_MEDIA_TYPE: &str = "urn:problem:rocket-rides:unsupported-media-type";
    /// No route for this path (404).
    pub const NO_ROUTE: &str = "urn:problem:rocket-rides:no-route";
    /// The route does not take this method; `Allow` lists those it does (405).
    pub const METHOD_NOT_ALLOWED: &str = "urn:problem:rocket-rides:method-not-allowed";
    /// The request took longer than the server's deadline (503).
    pub const REQUEST_TIMEOUT: &str = "urn:problem:rocket-rides:request-timeout";
    /// The server is answering as many requests or connections as it takes (503).
    pub const OVER_CAPACITY: &str = "urn:problem:rocket-rides:over-capacity";
    /// The database committed the request's write but did not confirm that its synchronous
    /// standby has it (the wait was cancelled): the outcome is not acknowledged; retry (503).
    pub const COMMIT_UNCONFIRMED: &str = "urn:problem:rocket-rides:commit-unconfirmed";

    use idempotency_axum::problem::types as key;

    /// Every type the service answers with, the idempotency face's included: the OpenAPI
    /// document's closed list.
    pub const ALL: [&str; 26] = [
        BAD_JSON,
        BAD_BODY,
        BODY_TOO_LARGE,
        UNSUPPORTED_MEDIA_TYPE,
        VALIDATION,
        UNAUTHORIZED,
        PAYMENT_DECLINED,
        PAYMENT_REFUSED,
        PAYMENT_PENDING,
        PAYMENT_UNCONFIRMED,
        NOT_FOUND,
        NO_ROUTE,
        METHOD_NOT_ALLOWED,
        GATEWAY_UNAVAILABLE,
        SHUTTING_DOWN,
        LEASE_LOST,
        INTERNAL,
        REQUEST_TIMEOUT,
        OVER_CAPACITY,
        COMMIT_UNCONFIRMED,
        key::KEY_MISSING,
        key::KEY_INVALID,
        key::KEY_REUSED,
        key::KEY_IN_FLIGHT,
        key::BODY_TOO_LARGE,
        key::STORE_FAILED,
    ];
}

/// A failure's `Retry-After`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryAfter {
    /// None: retrying the same request cannot change the answer (or needs the client to fix it).
    None,
    /// Always this long.
    Fixed(Duration),
    /// Computed per answer: a key in flight, the lease's time left (at most 2 s); a payment
    /// unconfirmed, the time until its outcome can be looked up.
    Computed,
}

/// Which routes answer with a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routes {
    /// `POST /rides` alone.
    Booking,
    /// `POST /rides` and `GET /rides/{id}`: the routes that use the database for a client.
    Rides,
    /// `GET /rides/{id}` alone.
    Read,
    /// The routes that take a body (`POST /rides`).
    WithBody,
    /// Every route, answered by the edge (the router's layers and the server loop).
    Every,
    /// No documented route: a path no route has.
    Unrouted,
}

/// One failure of the contract.
#[derive(Debug, Clone, Copy)]
pub struct Failure {
    /// The HTTP status.
    pub status: u16,
    /// The stable problem `type`.
    pub kind: &'static str,
    /// The problem's `title`.
    pub title: &'static str,
    /// Its `Retry-After`.
    pub retry_after: RetryAfter,
    /// Stored with the key and replayed to every retry (a final outcome), or not.
    pub stored: bool,
    /// Which routes answer with it.
    pub routes: Routes,
}

const fn failure(
    status: u16,
    kind: &'static str,
    title: &'static str,
    retry_after: RetryAfter,
    stored: bool,
    routes: Routes,
) -> Failure {
    Failure {
        status,
        kind,
        title,
        retry_after,
        stored,
        routes,
    }
}

use idempotency_axum::problem::types as key;
use RetryAfter::{Computed, Fixed};
use Routes::{Booking, Every, Read, Rides, Unrouted, WithBody};

const NO: RetryAfter = RetryAfter::None;

/// Every failure the service answers with, in the order of docs/rocket-rides.md's table.
pub const FAILURES: [Failure; 24] = [
    failure(
        402,
        types::PAYMENT_DECLINED,
        "Payment declined",
        NO,
        true,
        Booking,
    ),
    failure(
        502,
        types::PAYMENT_REFUSED,
        "Payment refused by the gateway",
        NO,
        true,
        Booking,
    ),
    failure(
        503,
        types::GATEWAY_UNAVAILABLE,
        "Payment gateway unavailable",
        Fixed(GATEWAY_RETRY_AFTER),
        false,
        Booking,
    ),
    failure(
        503,
        types::PAYMENT_PENDING,
        "Payment pending",
        Fixed(PENDING_RETRY_AFTER),
        false,
        Booking,
    ),
    failure(
        503,
        types::PAYMENT_UNCONFIRMED,
        "Payment not confirmed yet",
        Computed,
        false,
        Booking,
    ),
    failure(
        503,
        types::COMMIT_UNCONFIRMED,
        "Outcome not confirmed",
        Fixed(GATEWAY_RETRY_AFTER),
        false,
        Booking,
    ),
    failure(
        503,
        types::SHUTTING_DOWN,
        "Shutting down",
        Fixed(GATEWAY_RETRY_AFTER),
        false,
        Booking,
    ),
    failure(
        409,
        key::KEY_IN_FLIGHT,
        "Request in flight",
        Computed,
        false,
        Booking,
    ),
    failure(
        409,
        types::LEASE_LOST,
        "Request taken over",
        Fixed(GATEWAY_RETRY_AFTER),
        false,
        Booking,
    ),
    failure(
        503,
        types::REQUEST_TIMEOUT,
        "Request timed out",
        Fixed(GATEWAY_RETRY_AFTER),
        false,
        Every,
    ),
    failure(
        503,
        types::OVER_CAPACITY,
        "Over capacity",
        Fixed(OVERLOAD_RETRY_AFTER),
        false,
        Every,
    ),
    failure(500, types::INTERNAL, "Internal error", NO, false, Rides),
    failure(
        422,
        key::KEY_REUSED,
        "Idempotency-Key reused",
        NO,
        false,
        Booking,
    ),
    failure(
        400,
        key::KEY_MISSING,
        "Idempotency-Key missing",
        NO,
        false,
        Booking,
    ),
    failure(
        400,
        key::KEY_INVALID,
        "Idempotency-Key invalid",
        NO,
        false,
        Booking,
    ),
    failure(400, types::BAD_JSON, "Body is not JSON", NO, false, Booking),
    failure(
        400,
        types::VALIDATION,
        "Invalid request body",
        NO,
        false,
        Booking,
    ),
    failure(
        400,
        types::BAD_BODY,
        "Body could not be read",
        NO,
        false,
        WithBody,
    ),
    failure(401, types::UNAUTHORIZED, "Unauthorized", NO, false, Rides),
    failure(
        413,
        types::BODY_TOO_LARGE,
        "Body too large",
        NO,
        false,
        WithBody,
    ),
    failure(
        415,
        types::UNSUPPORTED_MEDIA_TYPE,
        "Unsupported media type",
        NO,
        false,
        WithBody,
    ),
    failure(404, types::NOT_FOUND, "Not found", NO, false, Read),
    failure(404, types::NO_ROUTE, "No such route", NO, false, Unrouted),
    failure(
        405,
        types::METHOD_NOT_ALLOWED,
        "Method not allowed",
        NO,
        false,
        Every,
    ),
];

/// The contract's row for problem `kind`. Panics for a type that has none: every type the
/// service answers with has its row, as a test checks.
pub fn of(kind: &str) -> &'static Failure {
    FAILURES
        .iter()
        .find(|f| f.kind == kind)
        .unwrap_or_else(|| panic!("the HTTP contract has no row for {kind}"))
}

/// The problem of `kind`, as its row defines it (status, type, title, a fixed `Retry-After`).
pub fn problem(kind: &str) -> idempotency_axum::Problem {
    let row = of(kind);
    // Every status in the table is a valid one: a test builds each row's problem.
    let status = http::StatusCode::from_u16(row.status).expect("a valid status");
    let problem = idempotency_axum::Problem::new(status, row.kind, row.title);
    match row.retry_after {
        Fixed(after) => problem.with_retry_after(after),
        NO | Computed => problem,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_has_one_row_and_each_row_builds_its_problem() {
        for kind in types::ALL {
            if [key::BODY_TOO_LARGE, key::STORE_FAILED].contains(&kind) {
                // The idempotency layer's own, for routes it wraps; Rocket Rides wraps none.
                continue;
            }
            assert_eq!(
                FAILURES.iter().filter(|f| f.kind == kind).count(),
                1,
                "{kind}"
            );
            let problem = problem(kind);
            let response = axum::response::IntoResponse::into_response(problem);
            assert_eq!(response.status().as_u16(), of(kind).status, "{kind}");
        }
        assert_eq!(FAILURES.len(), types::ALL.len() - 2);
    }

    /// A row as docs/rocket-rides.md writes it: status, type, `Retry-After`, stored.
    fn written(f: &Failure) -> (u16, String, String, bool) {
        let retry_after = match f.retry_after {
            RetryAfter::None => "—".to_owned(),
            Fixed(after) => after.as_secs().to_string(),
            Computed => "computed".to_owned(),
        };
        (f.status, f.kind.to_owned(), retry_after, f.stored)
    }

    /// The rows of the "Outcomes" table of `doc`, but the success's.
    fn docs_rows(doc: &str) -> Vec<(u16, String, String, bool)> {
        let table = doc
            .split("\n## Outcomes\n")
            .nth(1)
            .expect("docs/rocket-rides.md has its Outcomes section");
        let lines = table.lines().skip_while(|l| !l.starts_with('|'));
        let mut rows = Vec::new();
        for line in lines.take_while(|l| l.starts_with('|')).skip(2) {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let [_, status, kind, retry_after, stored, ..] = cells[..] else {
                panic!("a row of five cells: {line}");
            };
            if kind.starts_with('—') {
                continue;
            }
            let kind = kind.trim_matches('`');
            let kind = match kind.strip_prefix("…:") {
                Some(name) => format!("urn:problem:rocket-rides:{name}"),
                None => kind.to_owned(),
            };
            let stored = match stored {
                "yes" => true,
                "no" => false,
                other => panic!("stored is yes or no, not {other:?}: {line}"),
            };
            let status = status
                .parse()
                .unwrap_or_else(|_| panic!("a status: {line}"));
            rows.push((status, kind, retry_after.to_owned(), stored));
        }
        rows
    }

    #[test]
    fn the_docs_table_is_the_contract() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/rocket-rides.md");
        let doc = std::fs::read_to_string(path).unwrap();
        let mut documented = docs_rows(&doc);
        let mut contract: Vec<_> = FAILURES.iter().map(written).collect();
        documented.sort();
        contract.sort();
        let missing: Vec<_> = contract
            .iter()
            .filter(|r| !documented.contains(r))
            .collect();
        let unknown: Vec<_> = documented
            .iter()
            .filter(|r| !contract.contains(r))
            .collect();
        assert!(
            missing.is_empty() && unknown.is_empty(),
            "docs/rocket-rides.md's Outcomes table differs from contract::FAILURES:\n\
             in the contract, not in the table: {missing:#?}\n\
             in the table, not in the contract: {unknown:#?}"
        );
        assert_eq!(documented.len(), FAILURES.len(), "a row written twice");
    }
}
