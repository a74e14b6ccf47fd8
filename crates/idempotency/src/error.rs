//! The store's error type.

/// Everything the store can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The fence (a phase's fenced update, the final phase's fenced lock, a renewal or a release)
    /// matched no row: another worker took the lease over (or the key is gone or finished).
    /// Everything the phase wrote has been rolled back; the holder must stop.
    #[error("lease lost on idempotency key {key_id}: token {token} is no longer current")]
    LeaseLost {
        /// The key row.
        key_id: i64,
        /// The token the holder acquired.
        token: i64,
    },

    /// A renewal of the lease did not answer before the lease would have run out, so that the
    /// holder can no longer vouch for it: [`crate::Store::call_under_lease`] stops its call. The
    /// lease may still be the holder's: release it, and a retry resumes.
    #[error("lease on idempotency key {key_id} (token {token}) could not be renewed in time")]
    LeaseUnconfirmed {
        /// The key row.
        key_id: i64,
        /// The token the holder acquired.
        token: i64,
    },

    /// The row's recovery point is not one the application knows: its code and its data disagree.
    #[error("idempotency key {key_id} is at unknown recovery point {point:?}")]
    UnknownRecoveryPoint {
        /// The key row.
        key_id: i64,
        /// The stored name.
        point: String,
    },

    /// A phase was asked to move to `started` or `finished`: the claim writes the first, and
    /// only [`crate::Store::final_phase`] the second, with the response.
    #[error("idempotency key {key_id}: a phase cannot move to {to:?}; finish with final_phase")]
    InvalidTransition {
        /// The key row.
        key_id: i64,
        /// The point asked for.
        to: &'static str,
    },

    /// A stored value does not have the shape this crate writes.
    #[error("idempotency key {key_id} holds a malformed {what}")]
    Corrupt {
        /// The key row.
        key_id: i64,
        /// Which column.
        what: &'static str,
    },

    /// The crate's migrations and the database disagree (an applied migration whose contents
    /// changed, one that failed earlier).
    #[error("{0}")]
    Migration(String),

    /// A setting is out of its valid range.
    #[error("invalid idempotency setting: {0}")]
    InvalidConfig(String),

    /// The commit went through on the primary, but the server warned that its wait for the
    /// synchronous standby was cancelled: the standby may not have it, and a failover would lose
    /// it. Take it for an unknown outcome, as a commit whose answer was lost: do not acknowledge
    /// it (answer a `503`), release the lease if you hold one, and let the retry resume or
    /// replay. Seen only with [`crate::commit_watch`] installed.
    #[error("{context}: committed on the primary, but its wait for the synchronous standby was cancelled")]
    CommitUnconfirmed {
        /// What the store was committing, with the key involved.
        context: String,
    },

    /// The database failed; `context` says what the store was doing.
    #[error("{context}: {source}")]
    Database {
        /// What the store was doing, with the key or user involved.
        context: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
}

impl Error {
    pub(crate) fn db(context: impl Into<String>) -> impl FnOnce(sqlx::Error) -> Self {
        let context = context.into();
        move |source| Self::Database { context, source }
    }
}
