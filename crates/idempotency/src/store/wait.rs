//! Looking at a key without claiming it, and waiting for its holder to finish.
//!
//! A duplicate that finds its key held is answered 409 at once by default. A client may ask
//! instead to wait a little (`Prefer: wait=N` in HTTP): [`Store::wait_for_answer`] reads the key
//! now and then until its holder has stored an answer, or let the key go, or the deadline came.
//!
//! ```text
//!  held ─► sleep ─► read ─┬─ finished ───────────► KeyState::Finished (replay it)
//!            ▲            ├─ free, gone, mismatch ► that state (claim again)
//!            └── held ◄───┴─ deadline passed ─────► KeyState::Held (409, Retry-After)
//! ```
//!
//! **A waiter holds no connection while it waits.** Each read takes a pooled connection for one
//! short statement and gives it back; between reads the waiter holds nothing. So a storm of
//! waiters costs reads, not connections: a pool of four serves other requests while hundreds
//! wait. (LISTEN/NOTIFY would answer sooner but needs a connection per listener, or one shared
//! listener per process, and a NOTIFY in every statement that finishes or releases a key.) The
//! reads start [`WAIT_POLL_FIRST`] apart, since a live holder finishes in milliseconds, and back
//! off to [`WAIT_POLL_MAX`], which bounds both the load (a waiter reads at most a few times a
//! second) and how late a waiter learns of the answer.

use std::time::Duration;

use sqlx::postgres::PgRow;
use sqlx::Row;
use tokio::time::Instant;

use super::model::{stored_response, NewRequest, Store};
use crate::{Error, StoredResponse};

/// The first pause of a waiter, before its first read: a live holder finishes in milliseconds.
pub const WAIT_POLL_FIRST: Duration = Duration::from_millis(20);

/// The longest pause between two reads of a waiter. It bounds how late a waiter sees the
/// answer once stored; the pauses double up to it, so a waiter reads about four times a second
/// once the holder is slow. Keep it well below a second: waits are asked in whole seconds.
pub const WAIT_POLL_MAX: Duration = Duration::from_millis(250);

/// What a key's row says, read without a lock and without writing anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyState {
    /// No row, or a finished row older than the store's retention (a claim answers it as a new
    /// request).
    Absent,
    /// Finished with the same payload: the stored answer, to replay.
    Finished(StoredResponse),
    /// The key holds another payload.
    Mismatch,
    /// Unfinished, and its lease is held for `lease_left` more.
    Held {
        /// Time left on the holder's lease, rounded up to whole seconds (at least one).
        lease_left: Duration,
    },
    /// Unfinished and its lease free or run out: a claim may take it.
    Claimable,
}

impl Store {
    /// Reads the state of the request's key, by its scope (owner, method, route, key) and its
    /// fingerprint, as a claim would see it; writes nothing and takes no lock.
    pub async fn key_state(&self, req: &NewRequest<'_>) -> Result<KeyState, Error> {
        let context = || {
            format!(
                "read the state of key {:?} of owner {}",
                req.key.as_str(),
                req.owner
            )
        };
        let mut db = self.autocommit().await.map_err(Error::db(context()))?;
        let row = sqlx::query(
            r#"
            SELECT id, fingerprint, finished_at IS NOT NULL AS finished,
                   response_status, response_headers, response_body,
                   ceil(extract(epoch FROM locked_until - coalesce($5::timestamptz, now())) * 1000)
                       ::bigint AS lease_millis_left,
                   -- The claim's own age test (claim.rs): NULL, not expired, for an unfinished
                   -- key or a store without a retention ($6 NULL).
                   finished_at < coalesce($5::timestamptz, now()) - $6 * interval '1 millisecond'
                       AS expired
            FROM idempotency_keys
            WHERE owner = $1 AND request_method = $2 AND request_path = $3
              AND idempotency_key = $4
            "#,
        )
        .bind(req.owner.as_str())
        .bind(req.method)
        .bind(req.route)
        .bind(req.key.as_str())
        .bind(self.now())
        .bind(self.retention_millis())
        .persistent(self.persistent())
        .fetch_optional(db.conn())
        .await
        .map_err(Error::db(context()))?;
        db.done().await.map_err(Error::db(context()))?;
        match row {
            None => Ok(KeyState::Absent),
            Some(row) => state_of(&row, req),
        }
    }

    /// Waits until the key held by another request is no longer held, or until `deadline`, and
    /// says what became of it: [`KeyState::Finished`] (replay the answer), [`KeyState::Held`]
    /// (the deadline came first: answer in flight), or anything else (the holder let the key
    /// go, or it was forgotten or reused: claim again, which may acquire it).
    ///
    /// It sleeps before it first reads (call it after a claim answered [`crate::Claim::InFlight`]),
    /// and between reads; it holds no connection while it sleeps (see [the
    /// module](crate::wait)). A deadline already passed reads once.
    pub async fn wait_for_answer(
        &self,
        req: &NewRequest<'_>,
        deadline: Instant,
    ) -> Result<KeyState, Error> {
        let mut pause = WAIT_POLL_FIRST;
        self.wait_for_answer_paced(req, deadline, &mut pause).await
    }

    /// [`Store::wait_for_answer`] for a waiter that claims again between waits: `pause` is the
    /// next pause, kept across its calls (start it at [`WAIT_POLL_FIRST`]), so that a key read
    /// as claimable whose claim still finds it in flight (a transactional holder past its lease
    /// keeps the row locked) does not start the reads over at [`WAIT_POLL_FIRST`]: the waiter
    /// still reads and claims at most every [`WAIT_POLL_MAX`] once the holder is slow.
    pub async fn wait_for_answer_paced(
        &self,
        req: &NewRequest<'_>,
        deadline: Instant,
        pause: &mut Duration,
    ) -> Result<KeyState, Error> {
        loop {
            let now = Instant::now();
            if now < deadline {
                tokio::time::sleep((*pause).min(deadline - now)).await;
            }
            *pause = (*pause * 2).min(WAIT_POLL_MAX);
            let state = self.key_state(req).await?;
            if !matches!(state, KeyState::Held { .. }) || Instant::now() >= deadline {
                return Ok(state);
            }
        }
    }
}

fn state_of(row: &PgRow, req: &NewRequest<'_>) -> Result<KeyState, Error> {
    if row.get::<Option<bool>, _>("expired") == Some(true) {
        return Ok(KeyState::Absent);
    }
    let fingerprint: Vec<u8> = row.get("fingerprint");
    if fingerprint.as_slice() != req.fingerprint.as_bytes() {
        return Ok(KeyState::Mismatch);
    }
    if row.get::<bool, _>("finished") {
        return stored_response(row, row.get("id")).map(KeyState::Finished);
    }
    Ok(match row.get::<Option<i64>, _>("lease_millis_left") {
        Some(left) if left > 0 => KeyState::Held {
            // Round up, as the claim does: a client that waits that long finds the lease free.
            lease_left: Duration::from_secs((left as u64).div_ceil(1000).max(1)),
        },
        _ => KeyState::Claimable,
    })
}
