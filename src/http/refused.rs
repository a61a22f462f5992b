//! [`Refused`]: the keys a limit refused, answered from memory until their `retry_after`.
//!
//! A bucket that refused a request holds less than a token until its `retry_after`, whatever
//! else happens but give-backs (which only add): answering its key from memory until then
//! admits nothing the bucket would not, and spends no statement on a client hammering a
//! refused key. A lease already does this for its key (its `deny_until`); this does it for
//! direct-mode plans, whose every call is otherwise a statement.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// The most keys one limit remembers; past it, expired ones are dropped, and a key that still
/// finds no room is not remembered (its next request asks the store, as without memory).
const MAX_REFUSED: usize = 10_000;

/// The keys a limit refused and when each may be asked again.
#[derive(Debug, Default)]
pub(crate) struct Refused {
    keys: papaya::HashMap<Box<str>, Instant>,
    /// Whether a key was ever remembered: a limit that never refused anything (most, on the
    /// leased plans whose leases remember their own refusals) is answered by one load, not by
    /// the map's count.
    ever: AtomicBool,
}

impl Refused {
    /// How long `key` stays refused after `now`, if it is remembered as refused then.
    #[inline]
    pub(crate) fn until(&self, key: &str, now: impl FnOnce() -> Instant) -> Option<Duration> {
        if self.is_empty() {
            return None;
        }
        let keys = self.keys.pin();
        let until = *keys.get(key)?;
        let now = now();
        if until > now {
            Some(until - now)
        } else {
            keys.remove(key);
            None
        }
    }

    /// Remembers that `key` is refused until `until`.
    pub(crate) fn remember(&self, key: &str, until: Instant, now: Instant) {
        let keys = self.keys.pin();
        if keys.len() >= MAX_REFUSED {
            keys.retain(|_, t| *t > now);
            if keys.len() >= MAX_REFUSED {
                return;
            }
        }
        self.ever.store(true, Ordering::Relaxed);
        keys.insert(Box::from(key), until);
    }

    /// Whether nothing is remembered.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        !self.ever.load(Ordering::Relaxed) || self.keys.is_empty()
    }
}
