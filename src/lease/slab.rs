//! The fast path's fields of every lease, packed into fixed-position records.
//!
//! A call on a key with a live lease reads its lease word, its low-water mark and the store's
//! last remaining count, and CASes the word. Those fields live here, in a [`Hot`] record of 32
//! bytes, and not in the key's [`Slot`]: records sit side by side in chunks of
//! 1,024, and the table's bucket holds the record's index, so a call touches the bucket and one
//! record and nothing else. With 100,000 keys the records take 3.2 MB, where the slots they came
//! from (each with its key, its plan, its bookkeeping and its waiters) were spread over tens of
//! megabytes of heap: most calls on a random key missed the cache and the TLB on the slot
//! (benches/README.md has the profile).
//!
//! A record never moves: chunks are allocated when first needed and kept until the slab is
//! dropped, and the table's rebuilds copy only the index. A record is handed out by
//! [`Slab::alloc`] and comes back when its [`HotRef`] (owned by the slot) is dropped; since the
//! table's entries hold the slot, that is after every reader that could have found the record
//! through the table has left (the table's arrays are reclaimed by epoch). A recycled record is
//! reset before it is handed out again.
//!
//! # Memory orderings
//!
//! A record's hand-over needs no ordering of its own fields: everything a record's previous
//! users did happens before its release (the last `Arc<Slot>` dropped, after the table's epoch
//! let every reader go), the release and the next hand-out are ordered by the free list's
//! mutex, and the new owner publishes the record (its index in a bucket) through the bucket's
//! `OnceLock`, an acquire/release pair. So [`Hot::reset`] stores `Relaxed`, and a reader that
//! finds the record through the table sees it reset or newer, never half-reset, and never while
//! an older handle to it lives (`tests/models/loom_lease_words.rs` checks all three). The fields'
//! own orderings, in use, are given beside each.
//!
//! The atomics and the mutex come from `super::sync`, so that the loom models can compile this
//! file against loom's; `Arc` and `OnceLock` stay std's there (see `sync.rs`).
//!
//! [`Slot`]: super::slot::Slot

use std::sync::Arc;

use super::sync::{AtomicBool, AtomicU16, AtomicU64, Mutex, OnceLock, Ordering};
use super::word::LeaseWord;

/// Records per chunk, as a shift.
const SHIFT: u32 = 10;
/// Records per chunk.
pub(super) const CHUNK: usize = 1 << SHIFT;
/// The most records a slab holds, whatever the table's bound: 2²⁶ (64 Mi) keys would need tens
/// of gigabytes of slots, and the chunk directory stays at 1.5 MB.
pub(super) const MAX_RECORDS: usize = 1 << 26;

/// One lease's fast-path fields. Two records share a cache line.
#[derive(Debug)]
#[repr(C, align(32))]
pub(crate) struct Hot {
    /// The word callers spend from: the whole lease of a quiet key, the first of a hot key's
    /// words (`words.rs`).
    pub(crate) word: LeaseWord,
    /// Below this many nanotokens left, a caller asks for a refill. Written by the actor at each
    /// top-up, read by callers. Relaxed both ways: a threshold read afresh by every call, which
    /// publishes nothing; a caller that reads the previous one asks for a refill a call early
    /// or late.
    pub(crate) low_water: AtomicU64,
    /// Tokens (nanotokens, saturating) the shared bucket held after the last refill, for
    /// `Decision::remaining`. Relaxed both ways: the actor stores it before the top-up, whose
    /// release (and the caller's acquiring take) orders it (`word.rs`).
    pub(crate) store_remaining: AtomicU64,
    /// Set once the slot has a hot key's extra words: callers look for them in the slot only then,
    /// so a quiet key's call never reads its slot. Release (the actor, once the words are in
    /// place) and Acquire (callers): it publishes the extra words (`words.rs`).
    pub(crate) spread: AtomicBool,
    /// The slot's [`Slot::evicted`]: kept here, in the record's spare bytes, to keep the slot
    /// within a smaller heap chunk (`docs/design/memory.md`). Not read by the fast path.
    ///
    /// [`Slot::evicted`]: super::slot::Slot::evicted
    pub(crate) evicted: AtomicBool,
    /// The slot's [`Slot::dry`], for the same reason. Not read by the fast path.
    ///
    /// [`Slot::dry`]: super::slot::Slot::dry
    pub(crate) dry: AtomicBool,
    /// The key is sparse: its calls come less often than one per lease lifetime, so a call the
    /// lease cannot pay goes to the direct-mode coalescer (a batched store call, several in
    /// flight) instead of waiting for the actor's refill. A new key starts sparse: nothing is
    /// known of its demand, and a key called less often than once per lease lifetime is a new
    /// key at every call (idle keys leave the table after a lifetime). The actor clears it when
    /// it sizes the key a lease, and sets it again when it sizes none for a key it has watched
    /// for a lifetime. Relaxed both ways: a hint read afresh by every call that the lease cannot
    /// pay; a stale read sends one call the other way, and either way decides it exactly.
    /// Not read by the fast path.
    pub(crate) sparse: AtomicBool,
    /// The slot waits in the lease actor's queue for a refill: a slot nudged again while it
    /// waits is not queued twice. Kept here, in the record's spare byte, where a set of queued
    /// slots beside the queue took 9 bytes a slot at the peak of a burst (a flood of 100,000 new
    /// keys queued most of them at once), which the allocator then kept. Written and read by
    /// the actor only (Relaxed); not read by the fast path.
    pub(crate) queued: AtomicBool,
    /// The index of the key's plan in the limiter's plan registry, when the policies chose it
    /// ([`NO_PLAN`] when a caller named the plan): `try_acquire` on a key in the table reads its
    /// plan here instead of matching the key's prefixes again. 16 bits: the registry holds at
    /// most `MAX_PLANS` (65,528) plans at once, so every index fits below [`NO_PLAN`]. A reload
    /// may release the plan and give its index to another; a reader tells them apart
    /// (`plans.rs`). Relaxed both ways: stored before the record's bucket is published (the
    /// bucket's `OnceLock` orders it), or once, from [`NO_PLAN`], by a call whose plan the
    /// policies chose.
    pub(crate) plan: AtomicU16,
}

/// [`Hot::plan`] of a key whose plan was not chosen by the policies.
pub(crate) const NO_PLAN: u16 = u16::MAX;

/// `index` as a [`Hot::plan`]: [`NO_PLAN`] if it did not fit (the registry's bound keeps every
/// index below it; this keeps a larger one from naming another plan).
#[inline]
pub(crate) fn record_plan(index: u32) -> u16 {
    u16::try_from(index).unwrap_or(NO_PLAN)
}

impl Hot {
    /// A record as a new slot starts: no live lease, a refill asked for.
    pub(crate) fn new_pending() -> Hot {
        Hot {
            word: LeaseWord::new_pending(),
            low_water: AtomicU64::new(0),
            store_remaining: AtomicU64::new(0),
            spread: AtomicBool::new(false),
            evicted: AtomicBool::new(false),
            dry: AtomicBool::new(false),
            sparse: AtomicBool::new(true),
            queued: AtomicBool::new(false),
            plan: AtomicU16::new(NO_PLAN),
        }
    }

    /// Puts a recycled record back into the state of [`Hot::new_pending`]. Only while no one
    /// else can reach it (between its release and its next hand-out).
    fn reset(&self) {
        // Relaxed: ordered after the previous users by the free list's mutex, and before the
        // next readers by the bucket that publishes the record (module docs).
        self.word.reset_pending();
        self.low_water.store(0, Ordering::Relaxed);
        self.store_remaining.store(0, Ordering::Relaxed);
        self.spread.store(false, Ordering::Relaxed);
        self.evicted.store(false, Ordering::Relaxed);
        self.dry.store(false, Ordering::Relaxed);
        self.sparse.store(true, Ordering::Relaxed);
        self.queued.store(false, Ordering::Relaxed);
        self.plan.store(NO_PLAN, Ordering::Relaxed);
    }
}

/// The records of one lease table. See the [module docs](self).
#[derive(Debug)]
pub(crate) struct Slab {
    /// Chunk `i` holds records `i · CHUNK ..`; allocated on first use, never freed or moved.
    chunks: Box<[OnceLock<Box<[Hot]>>]>,
    /// Records handed out or recycled; only `alloc` and `HotRef::drop` take it.
    free: Mutex<Free>,
}

#[derive(Debug, Default)]
struct Free {
    /// Released records, reused first (the most recently released, still in cache).
    recycled: Vec<u32>,
    /// Records `0 .. next` have been handed out at least once.
    next: usize,
    /// The strict lease each record's slot holds in the store, for the few slots that have
    /// one: kept here rather than in every slot's book, which saves a pointer per key, and
    /// dropped with the record's claim ([`HotRef`]), so a recycled record starts without one.
    /// Only the lease actor reads and writes it. (Holder id, lease id): the store's
    /// `LeaseRef`, which the loom models of this file do not compile.
    strict: std::collections::HashMap<u32, (i64, i64)>,
}

impl Slab {
    /// A slab with room for `records` records (rounded up to whole chunks, at most
    /// [`MAX_RECORDS`]). Allocates only the chunk directory.
    pub(crate) fn new(records: usize) -> Arc<Slab> {
        let chunks = records.clamp(1, MAX_RECORDS).div_ceil(CHUNK);
        Arc::new(Slab {
            chunks: (0..chunks).map(|_| OnceLock::new()).collect(),
            free: Mutex::new(Free::default()),
        })
    }

    /// Record `index`, if it was ever handed out.
    #[inline]
    pub(crate) fn get(&self, index: u32) -> Option<&Hot> {
        let index = index as usize;
        self.chunks
            .get(index >> SHIFT)?
            .get()
            .map(|chunk| &chunk[index & (CHUNK - 1)])
    }

    /// A fresh record (as [`Hot::new_pending`]); `None` when every record is in use.
    pub(crate) fn alloc(self: &Arc<Self>) -> Option<HotRef> {
        let mut free = self.free.lock();
        let index = match free.recycled.pop() {
            Some(index) => {
                if let Some(hot) = self.get(index) {
                    hot.reset();
                }
                index
            }
            None => {
                let index = free.next;
                let chunk = self.chunks.get(index >> SHIFT)?;
                chunk.get_or_init(|| (0..CHUNK).map(|_| Hot::new_pending()).collect());
                free.next += 1;
                u32::try_from(index).ok()?
            }
        };
        Some(HotRef {
            slab: Arc::clone(self),
            index,
        })
    }

    /// Records handed out and not yet released.
    #[cfg(test)]
    pub(super) fn in_use(&self) -> usize {
        let free = self.free.lock();
        free.next - free.recycled.len()
    }
}

/// A slot's claim on its record: the record is released when this is dropped.
#[derive(Debug)]
pub(crate) struct HotRef {
    slab: Arc<Slab>,
    index: u32,
}

impl HotRef {
    /// The record's index in its slab: what the table's bucket holds.
    pub(crate) fn index(&self) -> u32 {
        self.index
    }

    /// The strict lease this record's slot holds in the store, if it ever drew a holder id:
    /// (holder id, lease id).
    pub(crate) fn strict(&self) -> Option<(i64, i64)> {
        self.slab.free.lock().strict.get(&self.index).copied()
    }

    /// The slot's holder id in the store, drawn from `draw` the first time (lease id 0 until
    /// its first strict refill is answered).
    pub(crate) fn strict_holder(&self, draw: impl FnOnce() -> i64) -> i64 {
        self.slab
            .free
            .lock()
            .strict
            .entry(self.index)
            .or_insert_with(|| (draw(), 0))
            .0
    }

    /// Records the id of the grant that renewed the slot's strict lease, if it has a holder.
    pub(crate) fn set_strict_lease_id(&self, lease_id: i64) {
        if let Some(held) = self.slab.free.lock().strict.get_mut(&self.index) {
            held.1 = lease_id;
        }
    }
}

impl std::ops::Deref for HotRef {
    type Target = Hot;

    #[inline]
    fn deref(&self) -> &Hot {
        self.slab
            .get(self.index)
            .expect("a record's chunk is allocated before the record is handed out")
    }
}

impl Drop for HotRef {
    fn drop(&mut self) {
        let mut free = self.slab.free.lock();
        if !free.strict.is_empty() {
            free.strict.remove(&self.index);
            // Memory back after a flood of strict keys has left.
            let capacity = free.strict.capacity();
            if capacity > 1024 && free.strict.len() < capacity / 4 {
                let keep = free.strict.len() * 2;
                free.strict.shrink_to(keep);
            }
        }
        free.recycled.push(self.index);
    }
}
