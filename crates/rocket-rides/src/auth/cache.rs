//! The API keys this process has looked up lately, so that a request does not spend a
//! transaction of its own on its API key.
//!
//! What the cache may and may not do:
//!
//! - **Staleness is bounded by the TTL** (`--api-key-cache-ttl`). An entry is stamped with the
//!   time its look-up was *sent*, before PostgreSQL took the snapshot that found the row, and is
//!   used only while younger than the TTL. A key rotated away at time `r` was read before `r` by
//!   every look-up that still found it, so every such entry is gone by `r + TTL`, however the
//!   look-ups raced each other. One service process's cache is its own; each holds the same bound.
//! - **An entry never names another user.** It is keyed by the full SHA-256 of the key, and holds
//!   the user whose row had that hash when it was read. A key belongs to one user for its whole
//!   life (keys are random and are never handed to someone else), so a stale entry can only let
//!   through the key's own user, and only until the TTL.
//! - **Only keys that were found are kept.** An unknown key is looked up each time: a key that is
//!   being created must work at once, and guessed keys must not fill the cache.
//! - **Its size is bounded** ([`API_KEY_CACHE_CAPACITY`]). When full, expired entries are
//!   dropped; if it is still full, the new key is simply not kept (it is looked up again next
//!   time), so the bound holds whatever the traffic.
//!
//! Time is the store's clock's monotonic time ([`Clock::monotonic`]), so that tests expire
//! entries by moving a [`idempotency::ManualClock`] instead of sleeping.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::Clock;

use super::AuthUser;

/// The most API keys kept at once. 10,000 entries of a 32-byte hash, a user id and a customer id
/// are about a megabyte: far more active users than one process serves, and small enough to
/// never matter.
pub const API_KEY_CACHE_CAPACITY: usize = 10_000;

/// The default TTL: a rotated key stops working within 5 s, while a client sending several
/// requests a second costs one look-up per 5 s instead of one per request.
pub const DEFAULT_API_KEY_CACHE_TTL: Duration = Duration::from_secs(5);

/// The longest TTL accepted: past a minute, a leaked key would keep working too long after it was
/// rotated away.
pub const MAX_API_KEY_CACHE_TTL: Duration = Duration::from_secs(60);

/// API keys looked up lately, with their users. Cheap to clone: clones share the entries.
#[derive(Clone)]
pub struct ApiKeyCache {
    ttl: Duration,
    capacity: usize,
    clock: Arc<dyn Clock>,
    entries: Arc<Mutex<HashMap<[u8; 32], Entry>>>,
}

#[derive(Clone)]
struct Entry {
    user: AuthUser,
    /// The clock's monotonic time when the look-up that found the user was sent.
    looked_up_at: Duration,
}

impl ApiKeyCache {
    /// A cache whose entries live `ttl` on `clock`'s monotonic time; a zero TTL keeps nothing.
    pub fn new(ttl: Duration, clock: Arc<dyn Clock>) -> Self {
        Self::with_capacity(ttl, clock, API_KEY_CACHE_CAPACITY)
    }

    fn with_capacity(ttl: Duration, clock: Arc<dyn Clock>, capacity: usize) -> Self {
        Self {
            ttl,
            capacity,
            clock,
            entries: Arc::default(),
        }
    }

    /// An empty cache on the same clock with another TTL.
    pub fn with_ttl(&self, ttl: Duration) -> Self {
        Self::with_capacity(ttl, self.clock.clone(), self.capacity)
    }

    /// How long an entry is used.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The time to stamp a look-up with: read it before sending the look-up.
    pub fn now(&self) -> Duration {
        self.clock.monotonic()
    }

    /// The user of the key with this hash, if it was found less than the TTL ago.
    pub fn get(&self, hash: &[u8; 32]) -> Option<AuthUser> {
        if self.ttl.is_zero() {
            return None;
        }
        let now = self.now();
        let mut entries = self.lock();
        match entries.get(hash) {
            Some(entry) if self.fresh(entry, now) => Some(entry.user.clone()),
            Some(_) => {
                entries.remove(hash);
                None
            }
            None => None,
        }
    }

    /// Keeps `user` as the owner of the key with this hash, found by a look-up sent at
    /// `looked_up_at` (from [`ApiKeyCache::now`]). An entry from a later look-up is kept instead.
    pub fn put(&self, hash: [u8; 32], user: AuthUser, looked_up_at: Duration) {
        if self.ttl.is_zero() {
            return;
        }
        let now = self.now();
        let mut entries = self.lock();
        if let Some(kept) = entries.get(&hash) {
            if kept.looked_up_at >= looked_up_at {
                return;
            }
        } else if entries.len() >= self.capacity {
            entries.retain(|_, entry| self.fresh(entry, now));
            if entries.len() >= self.capacity {
                return;
            }
        }
        entries.insert(hash, Entry { user, looked_up_at });
    }

    fn fresh(&self, entry: &Entry, now: Duration) -> bool {
        now.saturating_sub(entry.looked_up_at) < self.ttl
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Entry>> {
        // A poisoned lock only means a thread panicked while holding it; every entry is still
        // a complete look-up result, and a stale one is still judged by its stamp.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use idempotency::ManualClock;

    use super::*;

    fn user(id: i64) -> AuthUser {
        AuthUser {
            id,
            customer: format!("cus_{id}"),
        }
    }

    fn cache(ttl: Duration, capacity: usize) -> (ApiKeyCache, ManualClock) {
        let clock = ManualClock::starting_now();
        let cache = ApiKeyCache::with_capacity(ttl, Arc::new(clock.clone()), capacity);
        (cache, clock)
    }

    #[test]
    fn an_entry_lives_the_ttl_from_when_its_look_up_was_sent() {
        let ttl = Duration::from_secs(5);
        let (cache, clock) = cache(ttl, 10);
        let sent = cache.now();
        // The look-up took a second to answer: the entry still dies 5 s after it was sent.
        clock.advance(Duration::from_secs(1));
        cache.put([1; 32], user(1), sent);
        assert_eq!(cache.get(&[1; 32]).map(|u| u.id), Some(1));
        clock.advance(ttl - Duration::from_secs(1) - Duration::from_millis(1));
        assert_eq!(cache.get(&[1; 32]).map(|u| u.id), Some(1));
        clock.advance(Duration::from_millis(1));
        assert!(cache.get(&[1; 32]).is_none());
        assert_eq!(cache.len(), 0, "the expired entry is dropped");
    }

    #[test]
    fn an_older_look_up_does_not_replace_a_newer_one() {
        let ttl = Duration::from_secs(5);
        let (cache, clock) = cache(ttl, 10);
        let older = cache.now();
        clock.advance(Duration::from_secs(2));
        let newer = cache.now();
        cache.put([1; 32], user(1), newer);
        cache.put([1; 32], user(1), older);
        clock.advance(ttl - Duration::from_secs(1));
        // Expiry by the older stamp would have dropped it a second ago.
        assert!(cache.get(&[1; 32]).is_some());
    }

    #[test]
    fn a_zero_ttl_keeps_nothing() {
        let (cache, _clock) = cache(Duration::ZERO, 10);
        cache.put([1; 32], user(1), cache.now());
        assert!(cache.get(&[1; 32]).is_none());
        assert_eq!(cache.len(), 0);
    }

    #[test]
    fn a_full_cache_drops_expired_entries_and_otherwise_keeps_no_more() {
        let ttl = Duration::from_secs(5);
        let (cache, clock) = cache(ttl, 2);
        cache.put([1; 32], user(1), cache.now());
        cache.put([2; 32], user(2), cache.now());
        cache.put([3; 32], user(3), cache.now());
        assert_eq!(cache.len(), 2);
        assert!(
            cache.get(&[3; 32]).is_none(),
            "not kept: the cache was full"
        );
        assert_eq!(cache.get(&[1; 32]).map(|u| u.id), Some(1));

        clock.advance(ttl);
        cache.put([3; 32], user(3), cache.now());
        assert_eq!(cache.len(), 1, "the two expired entries made room");
        assert_eq!(cache.get(&[3; 32]).map(|u| u.id), Some(3));
    }

    #[test]
    fn each_hash_answers_its_own_user() {
        let (cache, _clock) = cache(Duration::from_secs(5), 10);
        cache.put([1; 32], user(1), cache.now());
        cache.put([2; 32], user(2), cache.now());
        assert_eq!(cache.get(&[1; 32]).map(|u| u.id), Some(1));
        assert_eq!(cache.get(&[2; 32]).map(|u| u.id), Some(2));
        assert!(cache.get(&[3; 32]).is_none());
    }
}
