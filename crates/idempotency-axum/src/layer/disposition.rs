//! What becomes of a key once its handler has answered: stored, released or forgotten.

use http::StatusCode;

/// What the layer does with the key once the handler has answered. The answer itself is
/// delivered to its client in every case.
///
/// [`Disposition::for_status`] is the default; [`IdempotencyLayer::with_disposition`] replaces
/// it.
///
/// [`IdempotencyLayer::with_disposition`]: super::IdempotencyLayer::with_disposition
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// The answer is the request's outcome: it is stored under the key and replayed byte for
    /// byte to every later request with the key and payload. The key's payload is then fixed:
    /// another payload under it is refused with 422.
    Store,
    /// The answer is a passing failure (the service is down, the request was throttled): the
    /// key keeps its row and its payload, its lease is released, and a retry with the key runs
    /// the handler again at once. In the [transactional mode](super#the-transactional-mode)
    /// the handler's writes are rolled back first.
    Release,
    /// The request was refused before it had any effect (its payload is invalid): the key's
    /// row is deleted, so that the key is as if it had never been sent and a corrected payload
    /// may use it. Use it only for answers of a handler that wrote and called nothing: a
    /// forgotten key takes a new row on its next use, and a new request UUID
    /// ([`ClaimedKey::request_uuid`](super::ClaimedKey::request_uuid)), so a foreign call made
    /// under the old one would be made again. In the [transactional
    /// mode](super#the-transactional-mode) the handler's writes are rolled back first.
    ///
    /// The delete is fenced by the lease. In the default mode, rows the handler wrote that
    /// reference the key get what their foreign key says: `RESTRICT` or `NO ACTION` refuses the
    /// delete, and the key is released instead, keeping its row and payload, as for
    /// [`Disposition::Release`]; `ON DELETE SET NULL` (which
    /// [`Store::with_retention`](idempotency::Store::with_retention) requires) lets it through,
    /// the rows lose their reference, and a corrected retry runs the handler again as a new
    /// request. A handler that writes belongs in the transactional mode (see the [module's
    /// documentation](super)).
    Forget,
}

impl Disposition {
    /// The default disposition of an answer with `status`:
    ///
    /// - 400, 413, 415 and 422, refusals of the request's own shape (a handler's validation, or
    ///   an axum extractor's rejection of a body too large or of the wrong type):
    ///   [`Disposition::Forget`], as Stripe keeps nothing of a request that failed validation,
    ///   so that the corrected request may use the key;
    /// - 5xx, and 408, 409, 425 and 429, which invite a retry: [`Disposition::Release`];
    /// - anything else (2xx, 3xx, the other 4xx): [`Disposition::Store`].
    pub fn for_status(status: StatusCode) -> Self {
        match status.as_u16() {
            400 | 413 | 415 | 422 => Self::Forget,
            408 | 409 | 425 | 429 => Self::Release,
            _ if status.is_server_error() => Self::Release,
            _ => Self::Store,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_forgets_validation_releases_retryables_and_stores_the_rest() {
        let cases = [
            (200, Disposition::Store),
            (201, Disposition::Store),
            (303, Disposition::Store),
            (400, Disposition::Forget),
            (402, Disposition::Store),
            (404, Disposition::Store),
            (408, Disposition::Release),
            (409, Disposition::Release),
            (413, Disposition::Forget),
            (415, Disposition::Forget),
            (422, Disposition::Forget),
            (425, Disposition::Release),
            (429, Disposition::Release),
            (500, Disposition::Release),
            (503, Disposition::Release),
        ];
        for (status, expected) in cases {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(Disposition::for_status(status), expected, "{status}");
        }
    }
}
