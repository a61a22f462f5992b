//! One key's lease: the atomic word callers spend from, and what the actor knows about it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crossbeam_utils::CachePadded;
use parking_lot::Mutex;
use tokio::sync::Notify;

use super::word::LeaseWord;
use crate::policy::Plan;

/// One key's lease slot, shared by callers (through the lease table) and the actor.
#[derive(Debug)]
pub(crate) struct Slot {
    /// The word callers spend from. Padded to its own cache line: a hot key's word is written by
    /// every caller, and sharing its line with the fields below would make the actor's reads and
    /// the callers' low-water reads bounce it.
    pub(crate) word: CachePadded<LeaseWord>,
    /// Below this many nanotokens left, a caller asks for a refill. Written by the actor at each
    /// top-up, read by callers.
    pub(crate) low_water: AtomicU64,
    /// Until this local monotonic time (ns), the store said the bucket is empty: callers are
    /// denied here without asking again. Zero when not set.
    pub(crate) deny_until: AtomicU64,
    /// Until this local monotonic time (ns), the store failed for this key: callers go straight
    /// to the fallback instead of waiting. Zero when not set.
    pub(crate) fallback_until: AtomicU64,
    /// The largest cost (nanotokens) a waiting caller needs: the minimum of the next refill.
    pub(crate) needed: AtomicU64,
    /// The sum of the costs (nanotokens) callers are waiting for.
    pub(crate) waiting: AtomicU64,
    /// Tokens (nanotokens, saturating) the shared bucket held after the last refill, for
    /// `Decision::remaining`.
    pub(crate) store_remaining: AtomicU64,
    /// Set once the actor removed the slot from the table: it will never be topped up again.
    pub(crate) evicted: AtomicBool,
    /// Callers waiting for a refill wait here; the actor wakes them after every answer.
    pub(crate) notify: Notify,
    /// The key.
    pub(crate) key: Box<str>,
    /// The key's plan (bucket shape and lease settings).
    pub(crate) plan: Arc<Plan>,
    /// The actor's bookkeeping; only the actor locks it, never while awaiting.
    pub(crate) book: Mutex<Book>,
}

/// What the actor keeps per slot to size, expire and evict the lease.
#[derive(Debug, Default)]
pub(crate) struct Book {
    /// Nanotokens ever credited to the word.
    pub(crate) credited: u64,
    /// Nanotokens ever taken back from the word (expiry, eviction, shutdown).
    pub(crate) reclaimed: u64,
    /// When the live lease expires (local monotonic ns); meaningless while closed.
    pub(crate) expires_at: u64,
    /// Demand estimate in nanotokens per second.
    pub(crate) demand: f64,
    /// When demand was last sampled, and how much had been spent then.
    pub(crate) sampled_at: u64,
    pub(crate) spent_at_sample: u64,
    /// When the slot was last seen spending or asking (local monotonic ns).
    pub(crate) active_at: u64,
    /// The target lease size at the last refill (nanotokens).
    pub(crate) target: u64,
}

impl Book {
    /// Nanotokens callers have spent from this slot so far, given what the word holds now.
    pub(crate) fn spent(&self, available: u64) -> u64 {
        self.credited
            .saturating_sub(self.reclaimed)
            .saturating_sub(available)
    }
}

impl Slot {
    pub(crate) fn new(key: &str, plan: Arc<Plan>, now: u64) -> Slot {
        Slot {
            word: CachePadded::new(LeaseWord::new_pending()),
            low_water: AtomicU64::new(0),
            deny_until: AtomicU64::new(0),
            fallback_until: AtomicU64::new(0),
            needed: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            store_remaining: AtomicU64::new(0),
            evicted: AtomicBool::new(false),
            notify: Notify::new(),
            key: key.into(),
            plan,
            book: Mutex::new(Book {
                sampled_at: now,
                active_at: now,
                ..Book::default()
            }),
        }
    }

    /// Records what a caller waits for, so the next refill brings at least that.
    pub(crate) fn want(&self, cost: u64) {
        self.needed.fetch_max(cost, Ordering::AcqRel);
        self.waiting.fetch_add(cost, Ordering::AcqRel);
    }
}
