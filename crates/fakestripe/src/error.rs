//! The library's error type: what the gateway's own code can fail with.
//!
//! These never reach a client as such: the HTTP layer logs them and answers with Stripe's
//! generic `api_error` (see [`crate::api_error`]), so no SQL or driver detail leaks into a body.

/// Everything fakestripe's library functions can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The database failed; `context` says what the gateway was doing.
    #[error("{context}: {source}")]
    Database {
        /// What the gateway was doing, with the ids involved.
        context: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },

    /// fakestripe's own migrations failed.
    #[error("apply the fakestripe migrations: {0}")]
    Migrate(#[source] sqlx::migrate::MigrateError),

    /// The TLS certificate or key could not be loaded or used.
    #[error("TLS: {0}")]
    Tls(String),

    /// The idempotency store failed (including its migrations and a lost lease).
    #[error(transparent)]
    Idempotency(#[from] idempotency::Error),
}

impl Error {
    /// Wraps a driver error with what was being done, for `map_err`.
    pub(crate) fn db(context: impl Into<String>) -> impl FnOnce(sqlx::Error) -> Self {
        let context = context.into();
        move |source| Self::Database { context, source }
    }
}
