//! The fast path: spending from a key's live lease without waiting ([`Leases::try_take`],
//! [`Leases::try_take_known`]), in a view of the table pinned once for a request's several
//! takes ([`Pinned`]), and what a caller is told when the lease cannot pay.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::counted::{record_given, record_named};
use super::slot::Slot;
use super::table::{Hint, TableRef};
use super::word::Take;
use super::{Fast, Known, Leases, SlotRef, slab};
use crate::plans::PlanRegistry;
use crate::policy::Plan;

/// The lease table pinned for a few takes in a row ([`Leases::pin`]); what it returns stays
/// valid while it lives. Hold it only for work that does not wait. (The HTTP layer's: a request
/// checked against several limits.)
#[cfg(feature = "http")]
pub(crate) struct Pinned<'a> {
    leases: &'a Leases,
    table: TableRef<'a>,
}

#[cfg(feature = "http")]
impl std::fmt::Debug for Pinned<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pinned")
    }
}

#[cfg(feature = "http")]
impl Pinned<'_> {
    /// [`Leases::try_take`] in this view, looking `key` up through `hint` when given (a hint
    /// that only lookups of this same key write).
    #[inline]
    pub(crate) fn try_take(
        &self,
        plan: &Plan,
        chosen: Option<(&Arc<Plan>, u32)>,
        key: &str,
        cost: u64,
        plans: &PlanRegistry,
        hint: Option<&Hint>,
    ) -> Fast {
        self.leases
            .try_take_in(&self.table, plan, chosen, key, cost, plans, hint)
    }
}

impl Leases {
    /// The fast path: spend `cost` nanotokens from `key`'s lease.
    ///
    /// With a live lease holding enough, this is a lookup and a CAS. Creating a slot for a new
    /// key allocates once.
    ///
    /// `chosen` is the plan's shared copy and its index among the limiter's policies when the
    /// policies chose it for `key` (`try_acquire`); a new slot records the index so that later
    /// calls find the plan through [`Leases::try_take_known`]. `plans` holds the plan's
    /// counters.
    #[inline]
    pub(crate) fn try_take(
        &self,
        plan: &Plan,
        chosen: Option<(&Arc<Plan>, u32)>,
        key: &str,
        cost: u64,
        plans: &PlanRegistry,
    ) -> Fast {
        self.try_take_in(&self.table.pin(), plan, chosen, key, cost, plans, None)
    }

    /// A view of the table pinned once for several [`Pinned::try_take`]s: a request checked
    /// against several limits pins it once, not once per limit.
    #[cfg(feature = "http")]
    #[inline]
    pub(crate) fn pin(&self) -> Pinned<'_> {
        Pinned {
            leases: self,
            table: self.table.pin(),
        }
    }

    /// [`try_take`](Self::try_take) in `table`, looking `key` up through `hint` when given
    /// (`TableRef::get_hinted`: only lookups of this same key write it).
    ///
    /// Always inlined: its caller reads what a take left straight from registers (returned
    /// through memory, the two counts were written word by word and read back as one 16-byte
    /// load, which stalled on the store forwarding). A new key's path is apart (`take_new`).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn try_take_in(
        &self,
        table: &TableRef<'_>,
        plan: &Plan,
        chosen: Option<(&Arc<Plan>, u32)>,
        key: &str,
        cost: u64,
        plans: &PlanRegistry,
        hint: Option<&Hint>,
    ) -> Fast {
        let found = match hint {
            Some(hint) => table.get_hinted(key, hint),
            None => table.get(key),
        };
        let (slot, hot) = match found {
            Some((slot, hot)) => {
                // A key first seen through a named plan (`try_acquire_with`,
                // `try_acquire_now_with`) whose plan is the one the policies choose for it: from
                // now on `try_acquire` finds that plan through the record, not by matching the
                // key's prefixes.
                // Recorded only while the registry still holds the plan at that index (a reader
                // checks a reused entry against the slot's plan, `plans.rs`).
                if let Some((shared, index)) = chosen
                    && hot.plan.load(Ordering::Relaxed) == slab::NO_PLAN
                    && (Arc::ptr_eq(&slot.plan, shared) || *slot.plan == **shared)
                    && plans
                        .entry_of(index as usize, shared, &plans.pin())
                        .is_some()
                {
                    hot.plan.store(slab::record_plan(index), Ordering::Relaxed);
                }
                (slot, hot)
            }
            None => return self.take_new(table, plan, chosen, key, cost, plans),
        };
        // The record alone: a quiet key's call does not read its slot.
        match slot
            .words_of(hot)
            .try_take(cost, hot.low_water.load(Ordering::Relaxed))
        {
            Take::Taken { left, nudge } => {
                if nudge {
                    self.nudge_soon(slot);
                }
                // Counted by the plan's name, without pinning the registry: the counters of a
                // plan the policies chose are those of its labels while it is in force, none
                // once a reload removed it (`PlanRegistry::counters_of_given`).
                if chosen.is_some() {
                    record_given(plans, plan);
                } else {
                    record_named(plans, plan);
                }
                self.counted();
                Fast::Taken {
                    left,
                    store_remaining: hot.store_remaining.load(Ordering::Relaxed),
                }
            }
            Take::Short { .. } => self.short(slot, cost),
        }
    }

    /// [`try_take_in`](Self::try_take_in) for a key not in the table: its slot made and its
    /// first refill asked for (or its call sent to the store, for a sparse key).
    #[cold]
    #[inline(never)]
    fn take_new(
        &self,
        table: &TableRef<'_>,
        plan: &Plan,
        chosen: Option<(&Arc<Plan>, u32)>,
        key: &str,
        cost: u64,
        plans: &PlanRegistry,
    ) -> Fast {
        // A key goes into the table only once checked in full (`validate_key`, or
        // `validate_stored_key` for a shadow plan's own key): the limiter skips the scan
        // for NUL bytes on a call the lease answers.
        if table.len() >= self.settings.max_entries
            || self.stopping.load(Ordering::Relaxed)
            || crate::key::validate_stored_key(key).is_err()
        {
            return Fast::NoRoom;
        }
        let now = self.now();
        let (shared, index) = match chosen {
            Some((shared, index))
                if plans
                    .entry_of(index as usize, shared, &plans.pin())
                    .is_some() =>
            {
                (Arc::clone(shared), slab::record_plan(index))
            }
            // A reload released the plan since the policies chose it: the slot holds
            // it as a caller's plan.
            Some((shared, _)) => (Arc::clone(shared), slab::NO_PLAN),
            None => (self.shared_plan(plan), slab::NO_PLAN),
        };
        let Some(slot) = table.get_or_insert_with(key, |hot| {
            hot.plan.store(index, Ordering::Relaxed);
            SlotRef::new(Slot::new(key, shared, now, hot, cost))
        }) else {
            return Fast::NoRoom;
        };
        // A new key is sparse (`Hot::sparse`): while the actor is busy, its call is one
        // store call, and the actor hears of the key in its next gathering (it clears the
        // new record's pending mark and arms the key's idle check). Otherwise the actor
        // is woken for the key's first refill at once, and the call waits for it.
        if self.settings.sparse_direct && self.busy.load(Ordering::Relaxed) {
            self.nudge_soon(slot);
            return Fast::Sparse(SlotRef::clone(slot));
        }
        slot.want(cost);
        self.nudge(slot);
        Fast::Short(SlotRef::clone(slot))
    }

    /// `try_acquire`'s fast path: spends from the lease of a key already in the table whose plan
    /// the policies chose, under the plan its slot holds, which the key's record names by its
    /// index in the registry, instead of matching the key's prefixes. `cost` converts the
    /// caller's cost under that plan (it may refuse it). `None` when this path cannot answer:
    /// the key is not in the table, its plan was named by a caller or has left the registry
    /// (a reload removed it: the slot's lease is not spent under it here), or its lease is
    /// short. Then nothing was changed, and the caller takes the full path.
    ///
    /// The registry is not pinned: one load of the index's state says whether the index still
    /// holds the record's plan ([`PlanRegistry::state`]); only an index given to another plan
    /// after a release (once 65,528 distinct plans were given) is checked against its entry.
    #[inline]
    pub(crate) fn try_take_known<E>(
        &self,
        key: &str,
        plans: &PlanRegistry,
        cost: impl FnOnce(&Plan) -> Result<u64, E>,
    ) -> Option<Result<Known, E>> {
        let table = self.table.pin();
        let (slot, hot) = table.get(key)?;
        let index = hot.plan.load(Ordering::Relaxed) as usize;
        match plans.state(index) {
            crate::plans::LIVE => {}
            crate::plans::REUSED if plans.entry_of(index, &slot.plan, &plans.pin()).is_some() => {}
            _ => return None,
        }
        let plan: &Plan = &slot.plan;
        let nanos = match cost(plan) {
            Ok(nanos) => nanos,
            Err(e) => return Some(Err(e)),
        };
        match slot
            .words_of(hot)
            .try_take(nanos, hot.low_water.load(Ordering::Relaxed))
        {
            Take::Taken { left, nudge } => {
                if nudge {
                    self.nudge_soon(slot);
                }
                record_given(plans, plan);
                self.counted();
                Some(Ok(Known {
                    capacity: plan.capacity(),
                    left,
                    store_remaining: hot.store_remaining.load(Ordering::Relaxed),
                }))
            }
            Take::Short { .. } => None,
        }
    }

    /// The lease could not pay: denied, failing, or ask for a refill.
    #[cold]
    fn short(&self, slot: &SlotRef, cost: u64) -> Fast {
        match closed(slot, self.now()) {
            Some(Closed::Denied { retry_after }) => {
                slot.need(cost, 0, Ordering::AcqRel);
                return Fast::Dry { retry_after };
            }
            Some(Closed::Failing) => return Fast::Failing,
            None => {}
        }
        if self.settings.sparse_direct
            && slot.hot().sparse.load(Ordering::Relaxed)
            && self.busy.load(Ordering::Relaxed)
            && !slot.dry().load(Ordering::Acquire)
        {
            return Fast::Sparse(SlotRef::clone(slot));
        }
        self.ask_refill(slot, cost);
        if slot.dry().load(Ordering::Acquire) {
            // The store said empty and its retry time has passed: a refill is on its way, but
            // until it grants, the store's last word stands. Nobody waits on a dry bucket.
            return Fast::Dry {
                retry_after: self.settings.tick.as_nanos() as u64,
            };
        }
        Fast::Short(SlotRef::clone(slot))
    }
}

/// Why a slot's lease cannot be asked now, whatever it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Closed {
    /// The store said the bucket is empty: denied here for `retry_after` more nanoseconds.
    Denied { retry_after: u64 },
    /// The store failed lately for this key: the fallback decides until the backoff ends.
    Failing,
}

/// `slot`'s windows at `now` (the table's nanoseconds): the one place a call reads them, on
/// the fast path's short answer and in a wait alike.
#[inline]
pub(super) fn closed(slot: &SlotRef, now: u64) -> Option<Closed> {
    let deny_until = slot.deny_until.load(Ordering::Acquire);
    if deny_until > now {
        return Some(Closed::Denied {
            retry_after: deny_until - now,
        });
    }
    if slot.fallback_until.load(Ordering::Acquire) > now {
        return Some(Closed::Failing);
    }
    None
}
