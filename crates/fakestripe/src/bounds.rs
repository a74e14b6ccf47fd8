//! What a fault may do at most, shared by the faults drawn at random (`faults.rs`) and the
//! ones a test scripts (`scripted.rs`): the longest hold of a charge, and the statuses an
//! intermediary answers with on its own.

use http::StatusCode;

/// The largest `latency_ms + jitter_ms` accepted.
///
/// Latency is spent while the request holds its idempotency key's lease, so it must stay well
/// below [`crate::LEASE_TTL`]: otherwise a slow request would lose its lease to a retry and
/// fail at commit.
pub const MAX_LATENCY_MS: u64 = 20_000;

/// The statuses an intermediary answers with on its own: a proxy that cannot parse or route the
/// request (400, 404, as during a bad deploy of its configuration), or that cannot reach the
/// gateway or gave up waiting for it (502, 503, 504).
pub(crate) const INTERMEDIARY_STATUSES: [StatusCode; 5] = [
    StatusCode::BAD_REQUEST,
    StatusCode::NOT_FOUND,
    StatusCode::BAD_GATEWAY,
    StatusCode::SERVICE_UNAVAILABLE,
    StatusCode::GATEWAY_TIMEOUT,
];
