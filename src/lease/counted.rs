//! How callers wake the lease actor and count their decisions: the nudges that ask for a
//! refill (at once, or gathered), a waiting caller's hurry, the mark that tells the actor lease
//! decisions wait to be added to the counters (`metrics::flush_all`), and the counting of a
//! decision on a plan without a registry index.

use std::sync::atomic::Ordering;

use super::{Leases, NUDGES, SlotRef};
use crate::plans::PlanRegistry;
use crate::policy::Plan;

impl Leases {
    /// Tells the actor that `slot` wants a refill. Never blocks.
    pub(super) fn nudge(&self, slot: &SlotRef) {
        self.queue(slot);
        self.urgent.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// Asks for a refill of a lease that crossed its low-water mark and still pays its callers:
    /// nobody waits, so the actor gathers these for up to [`GATHER`](super::GATHER) and refills them together.
    /// Only the first such nudge of a gathering wakes the actor (a wake-up of a parked thread is
    /// a system call), and one that finds the queue half full, so that it is drained before it
    /// overflows. The lease's low-water share is sized to last a refill plus a tick
    /// (`actor/sizing.rs::target_size`), which covers the gathering.
    #[inline]
    pub(super) fn nudge_soon(&self, slot: &SlotRef) {
        self.queue(slot);
        if !self.soon.swap(true, Ordering::AcqRel) || self.nudges.len() >= NUDGES / 2 {
            self.wake.notify_one();
        }
    }

    fn queue(&self, slot: &SlotRef) {
        // A full queue drops the nudge; the actor's next round then scans for PENDING slots.
        if self.nudges.push(SlotRef::clone(slot)).is_err() {
            self.overflowed.store(true, Ordering::Release);
        }
    }

    /// After a lease decision was counted (`metrics::record_lease_allowed_named`): the first since
    /// the actor's last flush of the counts wakes it, so that the decision reaches the recorder
    /// within [`FLUSH_EVERY`](crate::metrics::FLUSH_EVERY) however quiet the service is. One
    /// relaxed load otherwise.
    #[inline]
    pub(super) fn counted(&self) {
        if !self.counts_due.load(Ordering::Relaxed) {
            self.counts_now_due();
        }
    }

    #[cold]
    fn counts_now_due(&self) {
        if !self.counts_due.swap(true, Ordering::AcqRel) {
            self.wake.notify_one();
        }
    }

    /// Takes the mark [`counted`](Self::counted) set: whether decisions were counted since the
    /// last call (the actor, as it flushes).
    pub(crate) fn take_counts_due(&self) -> bool {
        self.counts_due.swap(false, Ordering::SeqCst)
    }

    /// Whether lease decisions were counted since the actor's last flush.
    pub(crate) fn counts_due(&self) -> bool {
        self.counts_due.load(Ordering::Acquire)
    }

    /// Ends the actor's gathering of low-water nudges at once: a caller waits for a refill
    /// that a nudge already asked for. Wakes the actor only if no caller did since its last
    /// round.
    pub(super) fn hurry(&self) {
        if !self.urgent.swap(true, Ordering::AcqRel) {
            self.wake.notify_one();
        }
    }
}

/// Counts a decision allowed from a lease under `plan`, a plan without a registry index (named
/// by its caller, or a slot's shared copy): on the counters `plans` holds for its labels.
#[inline]
pub(super) fn record_named(plans: &PlanRegistry, plan: &Plan) {
    crate::metrics::record_lease_allowed_named(plan, || plans.counters_of(plan));
}

/// [`record_named`] for a plan the policies chose: on no counters once a reload removed it.
#[inline]
pub(super) fn record_given(plans: &PlanRegistry, plan: &Plan) {
    crate::metrics::record_lease_allowed_named(plan, || plans.counters_of_given(plan));
}
