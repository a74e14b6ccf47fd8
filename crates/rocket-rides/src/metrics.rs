//! `GET /metrics`: counters in the Prometheus text format (version 0.0.4).
//!
//! Hand-written rather than pulled from a metrics crate: a handful of counters, each a plain
//! atomic or a small map under a mutex, rendered on scrape. The unfinished-key gauge is read from
//! the database at scrape time, so it is true across every API process and the worker.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The media type of the text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// How a claim ended.
#[derive(Debug, Clone, Copy)]
pub enum ClaimOutcome {
    /// The request got the lease.
    Acquired,
    /// A finished key's stored response was replayed.
    Replayed,
    /// The key was reused with another payload (422).
    Mismatch,
    /// Another request held the lease (409).
    InFlight,
}

/// How a gateway charge call ended.
#[derive(Debug, Clone, Copy)]
pub enum ChargeOutcome {
    /// Charged (or the charge made earlier under the same key was returned).
    Charged,
    /// The card was declined.
    Declined,
    /// No usable answer; resumed later.
    Unavailable,
    /// The gateway refused the request for good (the request finishes with a 502).
    Refused,
    /// The gateway refused our credentials, or its certificate is not trusted.
    Misconfigured,
    /// The charge was created `pending`.
    Pending,
    /// The gateway replayed a 5xx it stored under the key (the key is reconciled).
    StoredError,
}

/// The labels of `gateway_charges_total`, in the order of [`ChargeOutcome`].
const CHARGE_OUTCOMES: [&str; 7] = [
    "charged",
    "declined",
    "unavailable",
    "refused",
    "misconfigured",
    "pending",
    "stored_error",
];

impl ChargeOutcome {
    /// The outcome of one call's result.
    pub fn of(result: &Result<crate::stripe::Charge, crate::stripe::ChargeError>) -> Self {
        use crate::stripe::ChargeError;
        match result {
            Ok(charge) if charge.status == "pending" => Self::Pending,
            Ok(charge) if charge.status == "failed" => Self::Declined,
            Ok(_) => Self::Charged,
            Err(ChargeError::Declined { .. }) => Self::Declined,
            Err(ChargeError::Refused { .. }) => Self::Refused,
            Err(ChargeError::Misconfigured(_)) => Self::Misconfigured,
            Err(ChargeError::StoredServerError { .. }) => Self::StoredError,
            Err(ChargeError::Transient(_)) => Self::Unavailable,
        }
    }
}

/// How a reconciliation (a list of the customer's charges) ended.
#[derive(Debug, Clone, Copy)]
pub enum Reconciliation {
    /// The charge made for the request was found and adopted.
    Adopted,
    /// None was found; a new generation of the gateway key charges.
    NoneFound,
}

/// The service's counters. Cheap to clone; clones share the counts.
#[derive(Debug, Clone, Default)]
pub struct Metrics(Arc<Counters>);

#[derive(Debug, Default)]
struct Counters {
    /// (method, route template, status) → count.
    http: Mutex<BTreeMap<(String, String, u16), u64>>,
    claims: [AtomicU64; 4],
    charges: [AtomicU64; 7],
    reconciliations: [AtomicU64; 2],
    payments_refused: AtomicU64,
    leases_lost: AtomicU64,
    /// Completer outcomes, in the order of [`COMPLETER_OUTCOMES`].
    completer: [AtomicU64; 5],
    receipts_delivered: AtomicU64,
    keys_reaped: AtomicU64,
}

/// What the completer did with a key, in the order of [`COMPLETER_OUTCOMES`].
#[derive(Debug, Clone, Copy)]
pub enum CompleterOutcome {
    /// Claimed.
    Claimed,
    /// Driven to a final state.
    Finished,
    /// Released with a backoff after a failed attempt.
    Retried,
    /// Its lease was taken over during the attempt.
    Lost,
    /// Its recovery point is unknown to this build.
    Undecodable,
}

/// The labels of `completer_keys_total`.
const COMPLETER_OUTCOMES: [&str; 5] = ["claimed", "finished", "retried", "lost", "undecodable"];

impl Metrics {
    /// Counts one claim.
    pub fn claim(&self, outcome: ClaimOutcome) {
        self.0.claims[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one gateway charge call.
    pub fn charge(&self, outcome: ChargeOutcome) {
        self.0.charges[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one reconciliation.
    pub fn reconciliation(&self, outcome: Reconciliation) {
        self.0.reconciliations[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request finished with a 502 because the gateway refused its charge for good.
    pub fn payment_refused(&self) {
        self.0.payments_refused.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request or completer attempt that found its lease taken over.
    pub fn lease_lost(&self) {
        self.0.leases_lost.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one completer pass: how many keys had each outcome.
    pub fn completer_pass(&self, counts: [(CompleterOutcome, usize); 5]) {
        for (outcome, n) in counts {
            self.0.completer[outcome as usize].fetch_add(n as u64, Ordering::Relaxed);
        }
    }

    /// Counts receipts the outbox drain delivered.
    pub fn receipts_delivered(&self, n: u64) {
        self.0.receipts_delivered.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts keys the reaper deleted.
    pub fn keys_reaped(&self, n: u64) {
        self.0.keys_reaped.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts one answered request, by method, route template and status.
    pub fn http(&self, method: &str, route: &str, status: u16) {
        let mut http = self.0.http.lock().unwrap_or_else(|e| e.into_inner());
        *http
            .entry((method.to_owned(), route.to_owned(), status))
            .or_default() += 1;
    }

    /// The text exposition, with the unfinished-key gauge read by the caller.
    pub fn render(&self, unfinished_keys: Option<i64>) -> String {
        let mut out = String::new();
        out.push_str(
            "# HELP http_requests_total HTTP requests answered, by route template and status.\n",
        );
        out.push_str("# TYPE http_requests_total counter\n");
        for ((method, route, status), count) in
            self.0.http.lock().unwrap_or_else(|e| e.into_inner()).iter()
        {
            let _ = writeln!(
                out,
                "http_requests_total{{method=\"{method}\",route=\"{route}\",status=\"{status}\"}} {count}"
            );
        }
        out.push_str("# HELP idempotency_claims_total Claims of idempotency keys, by outcome.\n");
        out.push_str("# TYPE idempotency_claims_total counter\n");
        for (i, name) in ["acquired", "replayed", "mismatch", "in_flight"]
            .iter()
            .enumerate()
        {
            let count = self.0.claims[i].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "idempotency_claims_total{{outcome=\"{name}\"}} {count}"
            );
        }
        out.push_str(
            "# HELP gateway_charges_total Calls to the gateway's charge endpoint, by outcome.\n",
        );
        out.push_str("# TYPE gateway_charges_total counter\n");
        for (name, counter) in CHARGE_OUTCOMES.iter().zip(&self.0.charges) {
            let count = counter.load(Ordering::Relaxed);
            let _ = writeln!(out, "gateway_charges_total{{outcome=\"{name}\"}} {count}");
        }
        out.push_str("# HELP gateway_reconciliations_total Lists of a customer's charges made because the gateway key could not be trusted, by outcome.\n");
        out.push_str("# TYPE gateway_reconciliations_total counter\n");
        for (name, counter) in ["adopted", "none_found"]
            .iter()
            .zip(&self.0.reconciliations)
        {
            let count = counter.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "gateway_reconciliations_total{{outcome=\"{name}\"}} {count}"
            );
        }
        out.push_str("# HELP payments_refused_total Requests finished with 502 because the gateway refused the charge for good.\n");
        out.push_str("# TYPE payments_refused_total counter\n");
        let refused = self.0.payments_refused.load(Ordering::Relaxed);
        let _ = writeln!(out, "payments_refused_total {refused}");
        out.push_str("# HELP idempotency_leases_lost_total Requests stopped because another holder took their key over.\n");
        out.push_str("# TYPE idempotency_leases_lost_total counter\n");
        let _ = writeln!(
            out,
            "idempotency_leases_lost_total {}",
            self.0.leases_lost.load(Ordering::Relaxed)
        );
        out.push_str(
            "# HELP completer_keys_total Keys the completer claimed, and how each attempt ended.\n",
        );
        out.push_str("# TYPE completer_keys_total counter\n");
        for (name, counter) in COMPLETER_OUTCOMES.iter().zip(&self.0.completer) {
            let count = counter.load(Ordering::Relaxed);
            let _ = writeln!(out, "completer_keys_total{{outcome=\"{name}\"}} {count}");
        }
        out.push_str(
            "# HELP outbox_receipts_delivered_total Ride receipts the outbox drain delivered.\n",
        );
        out.push_str("# TYPE outbox_receipts_delivered_total counter\n");
        let delivered = self.0.receipts_delivered.load(Ordering::Relaxed);
        let _ = writeln!(out, "outbox_receipts_delivered_total {delivered}");
        out.push_str("# HELP reaper_keys_deleted_total Finished keys the reaper deleted.\n");
        out.push_str("# TYPE reaper_keys_deleted_total counter\n");
        let reaped = self.0.keys_reaped.load(Ordering::Relaxed);
        let _ = writeln!(out, "reaper_keys_deleted_total {reaped}");
        if let Some(unfinished) = unfinished_keys {
            out.push_str(
                "# HELP idempotency_keys_unfinished Keys not yet finished, across all processes.\n",
            );
            out.push_str("# TYPE idempotency_keys_unfinished gauge\n");
            let _ = writeln!(out, "idempotency_keys_unfinished {unfinished}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_render_in_the_text_format() {
        let metrics = Metrics::default();
        metrics.claim(ClaimOutcome::Acquired);
        metrics.claim(ClaimOutcome::Replayed);
        metrics.claim(ClaimOutcome::Replayed);
        metrics.charge(ChargeOutcome::Unavailable);
        metrics.http("POST", "/rides", 201);
        let text = metrics.render(Some(3));
        assert!(
            text.contains("idempotency_claims_total{outcome=\"replayed\"} 2\n"),
            "{text}"
        );
        assert!(text.contains("idempotency_claims_total{outcome=\"mismatch\"} 0\n"));
        assert!(text.contains("gateway_charges_total{outcome=\"unavailable\"} 1\n"));
        assert!(text
            .contains("http_requests_total{method=\"POST\",route=\"/rides\",status=\"201\"} 1\n"));
        assert!(text.contains("idempotency_keys_unfinished 3\n"));
    }
}
