//! When a call may be admitted on credit (docs/design/lease-credit.md, "Credit while a new key's refill is
//! late"): the rules of [`Leases::credit`], the filter of keys the table removed, and the
//! bookkeeping of what each slot owes (the ledger itself is `credit.rs`, model-checked alone).

use std::hash::BuildHasher;
use std::sync::atomic::Ordering;

use super::slot::{Slot, SlotRef};
use std::time::Duration;

use super::{Leases, actor, word};

/// Words of the filter of keys the table has removed (`Leases::removed`): 4,096 × 64 bits,
/// 32 KiB. A key whose bit is set is never admitted on credit (`Leases::credit`).
pub(super) const REMOVED_WORDS: usize = 4096;

/// A call is admitted on credit only if the actor's last refill answered within this long and
/// no refill failed since (`Leases::credit`): credit stands in for a store that answers slowly,
/// never for one that fails.
const CREDIT_FRESH: Duration = Duration::from_secs(1);

impl Leases {
    /// Admits `cost` nanotokens of `slot` on credit, for a caller that waited out its
    /// `max_wait` for the slot's refill: the refill in flight (or the next one) is asked for
    /// the credit on top of what it wants, and its grant pays it before the lease gets anything
    /// (`actor/refill.rs`'s `apply`). Only for a relaxed lease, while a refill is asked for, when the
    /// store answered a refill of this actor in the last [`CREDIT_FRESH`] and failed none since,
    /// the key is neither denied nor failing, the table never removed the key (`removed`), and
    /// the key's grants so far, its unpaid credit and `cost` stay within `B` (the slot's
    /// largest lease): so the tokens of a window that no grant in it paid for (the lease held
    /// at its start, and credit) are at most `B` per key and instance, as without credit
    /// (`docs/design/lease-credit.md`, "Credit while a new key's refill is late"). Returns why it did not.
    pub(crate) fn credit(&self, slot: &SlotRef, cost: u64) -> Result<(), FallbackCause> {
        let Some(settings) = slot.plan.lease() else {
            return Err(FallbackCause::Other);
        };
        if settings.accounting != crate::policy::Accounting::Relaxed
            || self.stopping.load(Ordering::Acquire)
            || slot.evicted().load(Ordering::Acquire)
            || slot.dry().load(Ordering::Acquire)
            || slot.words().load() & word::PENDING == 0
        {
            return Err(FallbackCause::Other);
        }
        let now = self.now();
        // The key's own rules first, then the store's, so a returning key is counted as one
        // whether or not the store answered lately.
        if slot.fallback_until.load(Ordering::Acquire) > now {
            return Err(FallbackCause::Failing);
        }
        if slot.deny_until.load(Ordering::Acquire) > now {
            return Err(FallbackCause::Other);
        }
        if self.was_removed(&slot.key) {
            return Err(FallbackCause::Returning);
        }
        if !self.store_answers() {
            return Err(FallbackCause::Unanswered);
        }
        let bound = actor::largest_lease(slot, 0);
        let book = slot.book.lock();
        if !self
            .credit
            .give(slot.hot_index(), book.credited.get(), cost, bound)
        {
            return Err(FallbackCause::AtBound);
        }
        drop(book);
        self.counters.credit.add(cost);
        // The refill seen above may have been answered since: ask for another, which pays the
        // credit (nobody waits on it).
        if slot.words().request_refill() {
            self.nudge_soon(slot);
        }
        Ok(())
    }

    /// Counts a call of a leased key that the fallback decides, by its cause.
    pub(crate) fn count_fallback(&self, cause: FallbackCause) {
        self.counters.fallback[cause as usize].fetch_add(1, Ordering::Relaxed);
        metrics::counter!(crate::metrics::LEASE_FALLBACK, "cause" => cause.label()).increment(1);
    }

    /// Whether the store answers: a refill statement of the actor answered in the last
    /// [`CREDIT_FRESH`], and none failed since.
    pub(crate) fn store_answers(&self) -> bool {
        self.refills_answer()
            && self
                .now()
                .saturating_sub(self.refill_ok_at.load(Ordering::Acquire))
                <= CREDIT_FRESH.as_nanos() as u64
    }

    /// Whether a refill statement of the actor has answered, and none failed since.
    pub(crate) fn refills_answer(&self) -> bool {
        let ok_at = self.refill_ok_at.load(Ordering::Acquire);
        ok_at != 0 && self.refill_failed_at.load(Ordering::Acquire) < ok_at
    }

    /// The bit of `key` in the filter of removed keys: (word, mask).
    fn removed_bit(&self, key: &str) -> (usize, u64) {
        let hash = self.hasher.hash_one(key);
        let bit = (hash as usize) % (REMOVED_WORDS * 64);
        (bit / 64, 1 << (bit % 64))
    }

    /// Whether the table may have removed `key` before (a hash filter: it may say so of a key
    /// it never removed, never the other way).
    fn was_removed(&self, key: &str) -> bool {
        let (at, mask) = self.removed_bit(key);
        self.removed[at].load(Ordering::Acquire) & mask != 0
    }

    /// Records that the table removed `key` (actor only, before the slot is retired).
    pub(crate) fn mark_removed(&self, key: &str) {
        let (at, mask) = self.removed_bit(key);
        self.removed[at].fetch_or(mask, Ordering::AcqRel);
    }

    /// The credit `slot` still owes (nanotokens).
    pub(crate) fn owed_by(&self, slot: &Slot) -> u64 {
        self.credit.owed(slot.hot_index())
    }

    /// Pays up to `granted` nanotokens of `slot`'s credit; returns what it paid. The caller holds
    /// the slot's book.
    pub(crate) fn pay_credit(&self, slot: &Slot, granted: u64) -> u64 {
        self.credit.pay(slot.hot_index(), granted)
    }

    /// Drops `slot`'s unpaid credit as it leaves the table, counting it as unpaid.
    pub(crate) fn write_off_credit(&self, slot: &Slot) {
        let unpaid = self.credit.write_off(slot.hot_index());
        if unpaid > 0 {
            self.counters.credit_unpaid.add(unpaid);
        }
    }
}

/// Why the lease table sent a call of a leased key to the fallback (`LeaseStats::fallback_*`,
/// the metric `tokenlease_lease_fallback_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FallbackCause {
    /// The key's last refill or store call failed less than `FAILURE_BACKOFF` ago.
    Failing = 0,
    /// The call waited out `max_wait`; no credit, since no refill of the actor answered in the
    /// last [`CREDIT_FRESH`] (the store is slow, or this limiter was quiet for that long) or
    /// one failed after the last answer.
    Unanswered = 1,
    /// The call waited out `max_wait`; no credit, since the table had removed the key before.
    Returning = 2,
    /// The call waited out `max_wait`; no credit, since the key's grants and credit reached `B`.
    AtBound = 3,
    /// The call waited out `max_wait` (or its plan waits for nothing) and no credit for another
    /// reason: strict accounting, a key the store called empty, the limiter stopping.
    Other = 4,
}

/// How many causes [`FallbackCause`] has.
pub(crate) const FALLBACK_CAUSES: usize = FallbackCause::Other as usize + 1;

impl FallbackCause {
    /// The metric's `cause` label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            FallbackCause::Failing => "failing",
            FallbackCause::Unanswered => "unanswered",
            FallbackCause::Returning => "returning",
            FallbackCause::AtBound => "at_bound",
            FallbackCause::Other => "other",
        }
    }
}
