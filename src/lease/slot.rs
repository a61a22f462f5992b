//! One key's lease: the atomic word callers spend from, and what the actor knows about it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};

use parking_lot::Mutex;
use tokio::sync::Notify;

use super::slab::{Hot, HotRef};
use super::words::{Extra, LeaseWords};
use crate::key::SlotKey;
use crate::policy::Plan;
use crate::store::LeaseRef;

/// A shared slot: `triomphe`'s `Arc`, which has no weak count (no `Weak<Slot>` is ever taken),
/// so a slot's allocation is 8 bytes smaller than with std's and fits a 176-byte heap chunk
/// (`docs/design/memory.md`).
pub(crate) type SlotRef = triomphe::Arc<Slot>;

/// One key's lease slot, shared by callers (through the lease table) and the actor.
///
/// The fields a call reads on the fast path (the lease word, the low-water mark, the store's
/// last remaining count) are not here but in the slot's fixed-position record in the table's
/// slab (`slab.rs`), which the table's bucket points at directly: a call on a quiet key with a
/// live lease never reads its slot. The slot holds the claim on that record, a hot key's extra
/// words, and everything the actor and the slow paths need.
#[derive(Debug)]
pub(crate) struct Slot {
    /// The slot's record; released when the slot is dropped.
    hot: HotRef,
    /// A hot key's extra words (`words.rs`), each on its own cache line.
    extra: Extra,
    /// The rest of the slot.
    cold: SlotCold,
}

impl std::ops::Deref for Slot {
    type Target = SlotCold;

    fn deref(&self) -> &SlotCold {
        &self.cold
    }
}

/// The parts of a [`Slot`] besides its record and its extra words.
#[derive(Debug)]
pub(crate) struct SlotCold {
    /// Until this local monotonic time (ns), the store said the bucket is empty: callers are
    /// denied here without asking again. Zero when not set.
    pub(crate) deny_until: AtomicU64,
    /// Until this local monotonic time (ns), the store failed for this key: callers go straight
    /// to the fallback instead of waiting. Zero when not set.
    pub(crate) fallback_until: AtomicU64,
    /// The largest cost (nanotokens) a waiting caller needs: the minimum of the next refill.
    /// Its top bit ([`WAITER`]) says a call of `Limiter::acquire_until` waits in the key's
    /// line: the next refill asks for what that call needs, even of a dry bucket.
    pub(crate) needed: AtomicU64,
    /// The sum of the costs (nanotokens) callers are waiting for.
    pub(crate) waiting: AtomicU64,
    /// The key (in the slot itself when short).
    pub(crate) key: SlotKey,
    /// The key's plan (bucket shape and lease settings).
    pub(crate) plan: Arc<Plan>,
    /// The actor's bookkeeping. The actor locks it, and a refund (to serialise with top-ups);
    /// never while awaiting.
    pub(crate) book: Mutex<Book>,
}

/// What the actor keeps per slot to size, expire and evict the lease.
#[derive(Debug, Default)]
pub(crate) struct Book {
    /// Nanotokens ever credited to the word, plus those that store calls took for the key
    /// while it was sparse (`Leases::record_direct`): spent as soon as credited, they count in
    /// its demand and activity like a lease's spends.
    pub(crate) credited: Wide,
    /// Nanotokens ever taken back from the word (expiry, eviction, shutdown).
    pub(crate) reclaimed: Wide,
    /// When the live lease expires; meaningless while closed.
    pub(crate) expires_at: Ms32,
    /// Demand estimate in nanotokens per second. An `f32`: an estimate that halves its error
    /// at every sample needs no more than its 24 bits of precision (`docs/design/memory.md`).
    pub(crate) demand: f32,
    /// When demand was last sampled, and how much had been spent then.
    pub(crate) sampled_at: Wide,
    pub(crate) spent_at_sample: Wide,
    /// When the slot was last seen spending or asking.
    pub(crate) active_at: Ms32,
    /// The [`spend_mark`] when the relaxed lease last got a new lifetime (a top-up, or a
    /// renewal at expiry because it was spent from): at expiry, a lease spent from since lives
    /// on, and one that was not closes.
    pub(crate) spent_at_renewal: u32,
    /// The [`spend_mark`] when the actor last looked at the slot on its due-queue: its own
    /// sample for idleness, apart from the demand sample, which only refills take.
    pub(crate) spent_at_check: u32,
    /// When the slot's live entry in the actor's due-queue is due; meaningless unless `armed`.
    pub(crate) timer_at: Ms32,
    /// The store's last answer granted nothing: the next refill asks for a whole lease or
    /// nothing, so a dry bucket is asked about once per lease's worth of refill, not per token.
    pub(crate) dry: bool,
    /// Some demand sample spanned at least a lease lifetime: the key has been watched long
    /// enough to call it sparse (`Hot::sparse`) when its demand is below one call a lifetime.
    /// A new key's first calls say nothing about how often it is called.
    pub(crate) watched: bool,
    /// Answers in a row that granted nothing: other instances took the refill first. The wait
    /// before asking again grows with it (up to 4×), so competing instances spread out instead
    /// of all asking at the moment a lease's worth has refilled.
    pub(crate) dry_streak: u8,
    /// The slot has a live entry in the actor's due-queue, due at `timer_at`. At most one entry
    /// is live per slot, so the queue holds at most one live entry per key in the table.
    pub(crate) armed: bool,
    /// The largest cost a caller of this key has waited for (nanotokens): a top-up is split over
    /// a hot key's words only in parts of at least a few such costs.
    pub(crate) max_cost: Wide,
}

/// A `u64` kept as two `u32`s, so that the [`Book`] holding it is 4-byte aligned: with
/// nothing in it aligned to 8, the book and its mutex's byte pack into 72 bytes instead of 80,
/// and a slot fits a smaller heap chunk (`docs/design/memory.md`). The same value, read and written
/// whole by the actor under the book's lock.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Wide([u32; 2]);

impl Wide {
    /// `value`, kept.
    pub(crate) fn new(value: u64) -> Wide {
        Wide([value as u32, (value >> 32) as u32])
    }

    /// The value.
    #[inline]
    pub(crate) fn get(self) -> u64 {
        u64::from(self.0[0]) | (u64::from(self.0[1]) << 32)
    }

    /// Replaces the value.
    #[inline]
    pub(crate) fn set(&mut self, value: u64) {
        *self = Wide::new(value);
    }

    /// Adds `n` to the value (as `+=` on the `u64` it stands for).
    #[inline]
    pub(crate) fn add(&mut self, n: u64) {
        self.set(self.get() + n);
    }
}

/// A time of the lease actor's clock (local monotonic nanoseconds) in 32 bits: whole
/// milliseconds, rounded down, modulo 2³² (49.7 days). Read back with [`Ms32::near`], as the
/// time of that form nearest a time the reader has. The book keeps its lease's expiry, its last
/// activity and its due-queue time so, 12 bytes where they took 24 (`docs/design/memory.md`).
///
/// Rounding down makes a lease expire, and an idle key leave, at most a millisecond early: its
/// tokens go back sooner and nothing more is admitted; the actor looks at slots at its tick's
/// granularity anyway. Each of the three is read only while it is within a lease lifetime (at
/// most 10 minutes) and a tick of the reader's time: an expiry only while the lease is live,
/// the last activity only while the key is in the table (a key idle for a lifetime is evicted,
/// and a key asking for a refill is active), the due-queue time only while armed. So the 24.8
/// days either side that [`Ms32::near`] can tell apart are far more than enough.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ms32(u32);

impl Ms32 {
    /// `ns` (local monotonic) to the millisecond below it.
    pub(crate) fn from_ns(ns: u64) -> Ms32 {
        Ms32((ns / 1_000_000) as u32)
    }

    /// Whether this time comes before `other`, modulo 2³² milliseconds: true when `other` is
    /// less than 24.8 days after it.
    pub(crate) fn precedes(self, other: Ms32) -> bool {
        (self.0.wrapping_sub(other.0) as i32) < 0
    }

    /// The time (local monotonic ns) this stands for, taking of all the times it could stand
    /// for the one nearest `now`: exact to the millisecond when that time is within 24.8 days
    /// of `now`. Never below zero.
    pub(crate) fn near(self, now: u64) -> u64 {
        let now_ms = now / 1_000_000;
        // The signed distance in milliseconds, modulo 2³², from `now` to this time.
        let ahead = i64::from(self.0.wrapping_sub(now_ms as u32) as i32);
        now_ms
            .saturating_add_signed(ahead)
            .saturating_mul(1_000_000)
    }
}

/// The low 32 bits of a slot's spent count: what the actor keeps to tell whether the slot was
/// spent from since it last looked, where the whole count took 8 bytes. Only compared for
/// equality. Two counts that differ by a multiple of 2³² nanotokens (4.29 tokens; 8,388,608
/// tokens when every cost is a whole number) compare equal: the lease then closes at its expiry
/// instead of living on, or the key looks idle and is evicted, and both give its tokens back.
/// Neither admits anything.
pub(crate) fn spend_mark(spent: u64) -> u32 {
    spent as u32
}

impl Book {
    /// Whether the slot's live entry in the actor's due-queue is the one due at `at`. Entries
    /// due within the same millisecond are the same one here: an entry replaced by one in the
    /// same millisecond is handled as the live one is, and the first of the two to be handled
    /// disarms the slot (`Timers::arm`).
    pub(crate) fn armed_for(&self, at: Ms32) -> bool {
        self.armed && self.timer_at == at
    }

    /// When the actor should look at the slot next (local monotonic ns, read near `now`): at
    /// its lease's expiry while the lease is `open`, else at its idle check, a lifetime (`ttl`,
    /// ns) after its last activity.
    pub(crate) fn next_look(&self, open: bool, ttl: u64, now: u64) -> u64 {
        if open {
            self.expires_at.near(now)
        } else {
            self.active_at.near(now).saturating_add(ttl)
        }
    }

    /// [`spend_mark`] of [`spent`](Self::spent).
    pub(crate) fn spend_mark(&self, available: u64) -> u32 {
        spend_mark(self.spent(available))
    }

    /// Nanotokens callers have spent from this slot so far, given what the word holds now.
    pub(crate) fn spent(&self, available: u64) -> u64 {
        self.credited
            .get()
            .saturating_sub(self.reclaimed.get())
            .saturating_sub(available)
    }
}

/// The `Notify`s callers wait on for a refill, shared by every slot of the process: a slot's
/// callers park on the one its address picks ([`Slot::notify`]). One per slot took 32 of the
/// slot's bytes for what most keys never use at once. A caller woken for another slot's answer
/// finds its own lease still short with its refill still asked for (`PENDING` stays set until
/// the answer is applied) and waits again, so the sharing costs spurious wake-ups, never a
/// missed one: a caller enables its wait before it checks the lease, and the actor wakes every
/// caller of the slot's `Notify` after it changed the lease. With 1,024 of them, the actor's
/// answer for 256 keys wakes about a quarter of all waiting callers, once each.
static WAITERS: LazyLock<Box<[Notify]>> =
    LazyLock::new(|| (0..WAITER_SETS).map(|_| Notify::new()).collect());
/// How many [`WAITERS`] there are (a power of two).
const WAITER_SETS: usize = 1024;

impl Slot {
    /// Where callers wait for this slot's refill, and what the actor wakes after every answer.
    #[inline]
    pub(crate) fn notify(&self) -> &'static Notify {
        // A multiplicative hash of the address: slots are 176-byte heap chunks, so the low bits
        // alone would use a few of the sets.
        let at = std::ptr::from_ref(self) as usize as u64;
        let set = at.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - WAITER_SETS.trailing_zeros());
        &WAITERS[set as usize]
    }

    /// A slot for `key` over the fresh record `hot` (see [`Slab::alloc`](super::slab::Slab::alloc)),
    /// made by a call of `first_cost` nanotokens.
    ///
    /// That call is left out of the key's demand: it is what made the slot, at the start of the
    /// first sample's window, so counting it would divide one call by the moment between the
    /// slot's creation and the actor's first look, and size a whole lease for a key called once
    /// (which then went back unspent: two statements for nothing per quiet key).
    pub(crate) fn new(key: &str, plan: Arc<Plan>, now: u64, hot: HotRef, first_cost: u64) -> Slot {
        Slot {
            hot,
            extra: Extra::default(),
            cold: SlotCold {
                deny_until: AtomicU64::new(0),
                fallback_until: AtomicU64::new(0),
                needed: AtomicU64::new(0),
                waiting: AtomicU64::new(0),
                key: SlotKey::new(key),
                plan,
                book: Mutex::new(Book {
                    sampled_at: Wide::new(now),
                    spent_at_sample: Wide::new(first_cost),
                    active_at: Ms32::from_ns(now),
                    ..Book::default()
                }),
            },
        }
    }

    /// The slot's record: its first lease word, low-water mark and the store's remaining count.
    #[inline]
    pub(crate) fn hot(&self) -> &Hot {
        &self.hot
    }

    /// Set once the actor removed the slot from the table: it will never be topped up again.
    /// (In the record's spare bytes, not read by the fast path.)
    #[inline]
    pub(crate) fn evicted(&self) -> &AtomicBool {
        &self.hot.evicted
    }

    /// The store's last answer was "empty": until it grants again, callers whose lease is short
    /// are denied at once (with the store's retry hint) instead of waiting for a refill. (In the
    /// record's spare bytes, not read by the fast path.)
    #[inline]
    pub(crate) fn dry(&self) -> &AtomicBool {
        &self.hot.dry
    }

    /// The record's index in the table's slab.
    pub(crate) fn hot_index(&self) -> u32 {
        self.hot.index()
    }

    /// Strict accounting: the slot's holder id in the store and the id of the grant that last
    /// renewed its lease there; `None` until its first strict refill draws the holder id (the
    /// lease id is 0 until that refill's answer). Kept beside the slot's record in the slab,
    /// since most slots never have one (`docs/design/memory.md`).
    pub(crate) fn strict_lease(&self) -> Option<LeaseRef> {
        self.hot
            .strict()
            .map(|(holder, lease_id)| LeaseRef { holder, lease_id })
    }

    /// The slot's holder id in the store, drawn from `draw` the first time.
    pub(crate) fn strict_holder(&self, draw: impl FnOnce() -> i64) -> i64 {
        self.hot.strict_holder(draw)
    }

    /// Records the id of the grant that renewed the slot's strict lease.
    pub(crate) fn set_strict_lease_id(&self, lease_id: i64) {
        self.hot.set_strict_lease_id(lease_id);
    }

    /// The lease's words, given the slot's record (`hot`, as the table found it, or
    /// [`Slot::hot`]).
    #[inline]
    pub(crate) fn words_of<'a>(&'a self, hot: &'a Hot) -> LeaseWords<'a> {
        LeaseWords::new(hot, &self.extra)
    }

    /// The lease's words.
    #[inline]
    pub(crate) fn words(&self) -> LeaseWords<'_> {
        LeaseWords::new(&self.hot, &self.extra)
    }

    /// Records what a caller waits for, so the next refill brings at least that.
    pub(crate) fn want(&self, cost: u64) {
        // Relaxed: these are published to the actor by what the caller does next
        // (`request_refill`'s release, or the nudge queue), and the actor's `swap`s read them;
        // nothing is published through them (docs/design/memory-orderings.md).
        self.need(cost, 0, Ordering::Relaxed);
        // Saturating: many waiters of large costs (up to 2⁵⁶ nanotokens each) would wrap a sum.
        let _ = self
            .waiting
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                Some(w.saturating_add(cost))
            });
    }
}

/// The top bit of [`SlotCold::needed`]: a call of `Limiter::acquire_until` waits in the key's
/// line for what `needed` holds. Costs stay below it (`TOKENS`, 2⁵⁶ nanotokens at most).
pub(crate) const WAITER: u64 = 1 << 63;

impl SlotCold {
    /// Raises the cost the next refill must bring to `cost` (nanotokens) if it is below, and
    /// sets `flag` ([`WAITER`] or nothing), keeping a flag already set.
    pub(crate) fn need(&self, cost: u64, flag: u64, order: Ordering) {
        let _ = self.needed.fetch_update(order, Ordering::Relaxed, |n| {
            Some((n & !WAITER).max(cost) | (n & WAITER) | flag)
        });
    }

    /// What the next refill must bring, and whether a call of `Limiter::acquire_until` waits
    /// for it; clears both (the actor, planning a refill).
    pub(crate) fn take_needed(&self) -> (u64, bool) {
        let n = self.needed.swap(0, Ordering::AcqRel);
        (n & !WAITER, n & WAITER != 0)
    }
}

/// A slot of `key` for unit tests: a bucket of 10 tokens at 1 a second, its record from `slab`.
#[cfg(test)]
pub(crate) fn test_slot(slab: &Arc<super::slab::Slab>, key: &str) -> SlotRef {
    use crate::bucket::{BucketConfig, Rate, Tokens};
    let bucket =
        BucketConfig::new(Tokens::whole(10), Rate::per_second(1).expect("rate")).expect("bucket");
    SlotRef::new(Slot::new(
        key,
        Arc::new(Plan::new("t", bucket)),
        0,
        slab.alloc().expect("room in the slab"),
        0,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    /// 2³² milliseconds in nanoseconds: where an `Ms32` wraps.
    const WRAP: u64 = (1 << 32) * MS;

    /// A time is read back to its millisecond, rounded down, from a reader's time before or
    /// after it, also across the 32-bit wrap (49.7 days) and at the clock's start.
    #[test]
    fn a_32_bit_time_reads_back_to_its_millisecond_near_the_reader() {
        let lifetime = 600_000 * MS; // the longest lease lifetime, 10 minutes
        for t in [
            0,
            MS - 1,
            123_456_789,
            WRAP - 5 * MS + 7,
            WRAP - 1,
            WRAP,
            WRAP + 3 * MS + 999_999,
            7 * WRAP + 42 * MS + 1,
        ] {
            let stored = Ms32::from_ns(t);
            let back = t / MS * MS;
            for now in [
                t,
                t + 1,
                t + lifetime,
                t.saturating_sub(lifetime),
                t + 24 * 86_400_000 * MS,
            ] {
                assert_eq!(stored.near(now), back, "t {t} read at {now}");
            }
        }
        // Rounded down: never later than the time itself.
        assert!(Ms32::from_ns(1_999_999).near(5 * MS) <= 1_999_999);
        // Near the clock's start, a reader before the time still gets it, and nothing is negative.
        assert_eq!(Ms32::from_ns(10 * MS).near(0), 10 * MS);
        assert_eq!(Ms32::from_ns(WRAP - MS).near(0), 0);
    }

    /// A slot with its `Arc` header (8 bytes: `triomphe`'s has no weak count) fits a 176-byte
    /// malloc chunk (at most 168 bytes asked for, 8 of header): the byte count `docs/design/memory.md`
    /// accounts for. A field that pushes it past 160 costs every key 16 bytes more; so does
    /// anything in the book aligned to 8 (its mutex's byte then takes 8).
    #[test]
    fn a_slot_fits_a_176_byte_chunk() {
        assert_eq!(size_of::<SlotRef>(), 8);
        assert!(size_of::<Slot>() <= 160, "{}", size_of::<Slot>());
        assert_eq!(align_of::<Book>(), 4);
        assert!(size_of::<Book>() <= 68, "{}", size_of::<Book>());
        assert!(
            size_of::<Mutex<Book>>() <= 72,
            "{}",
            size_of::<Mutex<Book>>()
        );
    }
}
