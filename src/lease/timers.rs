//! The lease actor's due-queue: when to look at which slot next (its lease's expiry, or its idle
//! check).
//!
//! A binary min-heap kept in two arrays side by side, the due times (32-bit milliseconds,
//! [`Ms32`]) and the slots, 12 bytes an entry where a `BinaryHeap` of a `u64` time and a
//! pointer took 16; and the arrays grow by a quarter, not by doubling, so a queue of 100,000
//! entries holds at most 125,000 where doubling held 131,072 (`docs/design/memory.md`).
//!
//! Each slot has at most one live entry, recorded in its [`Book`] (`armed`, `timer_at`), so the
//! queue holds at most one live entry per key in the table. An entry is live while the slot's
//! book says it is armed for the entry's time; an entry replaced by an earlier one is skipped
//! when it comes up, so an entry carries no sequence number.
//!
//! The times are ordered modulo 2³² milliseconds (49.7 days), as [`Ms32`] reads them: every
//! entry is due within a lease lifetime or an idle check (minutes) of when it was queued, and
//! the actor pops each once it is due, so the entries never lie 24.8 days apart, where the order
//! would turn over.

use super::slot::{Book, Ms32, SlotRef};

/// The due-queue. See the module documentation.
#[derive(Default)]
pub(super) struct Timers {
    /// Due times, in heap order, at the same index as their slot.
    at: Vec<Ms32>,
    /// The slots, in the same order.
    slots: Vec<SlotRef>,
}

impl Timers {
    /// Makes sure `slot` is looked at by `at` (local monotonic ns): queues an entry unless the
    /// slot has one due no later. A due time only moves later (a top-up moves the expiry on;
    /// the actor handles entries before the round's refills, so a refill's expiry is later than
    /// any entry queued before it), so in practice this queues only a slot that has no entry.
    /// Should an entry be replaced by an earlier one, the old one is skipped when it comes up:
    /// it is not live ([`Book::armed_for`]) unless the slot is armed for its very time again,
    /// and then it is handled as the live entry is, twice in the same round at most (the first
    /// disarms it).
    ///
    /// Kept to the millisecond, rounded down: the slot is looked at up to a millisecond before
    /// `at`, within the round's tick, and an entry due in the same millisecond as the live one
    /// is not queued.
    pub(super) fn arm(&mut self, slot: &SlotRef, book: &mut Book, at: u64) {
        if book.armed && book.timer_at.near(at) <= at {
            return;
        }
        let due = Ms32::from_ns(at);
        book.armed = true;
        book.timer_at = due;
        self.push(due, SlotRef::clone(slot));
    }

    /// When the earliest entry is due (local monotonic ns, read near `now`).
    pub(super) fn next(&self, now: u64) -> Option<u64> {
        self.at.first().map(|at| at.near(now))
    }

    /// The earliest entry, if it is due by `by` (local monotonic ns): its time and its slot.
    pub(super) fn pop_due(&mut self, by: u64) -> Option<(Ms32, SlotRef)> {
        let first = *self.at.first()?;
        if Ms32::from_ns(by).precedes(first) {
            return None;
        }
        let last = self.at.len() - 1;
        self.at.swap(0, last);
        self.slots.swap(0, last);
        let at = self.at.pop()?;
        let slot = self.slots.pop()?;
        self.sift_down(0);
        Some((at, slot))
    }

    /// How many entries are queued, live or not.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.at.len()
    }

    /// Gives memory back after a flood of keys has left the table.
    pub(super) fn shrink(&mut self) {
        let cap = self.at.capacity().min(self.slots.capacity());
        if cap > 1024 && self.at.len() < cap / 4 {
            let keep = self.at.len() * 2;
            self.at.shrink_to(keep);
            self.slots.shrink_to(keep);
        }
    }

    fn push(&mut self, at: Ms32, slot: SlotRef) {
        if self.at.len() == self.at.capacity() {
            // A quarter more (at least 64): the queue's slack is part of every key's cost, and
            // the copies a smaller step costs are rare and, for large arrays, a remap.
            let more = (self.at.len() / 4).max(64);
            self.at.reserve_exact(more);
            self.slots.reserve_exact(more);
        }
        self.at.push(at);
        self.slots.push(slot);
        self.sift_up(self.at.len() - 1);
    }

    fn sift_up(&mut self, mut i: usize) {
        while i > 0 {
            let parent = (i - 1) / 2;
            if !self.at[i].precedes(self.at[parent]) {
                break;
            }
            self.swap(i, parent);
            i = parent;
        }
    }

    fn sift_down(&mut self, mut i: usize) {
        let len = self.at.len();
        loop {
            let left = 2 * i + 1;
            if left >= len {
                break;
            }
            let right = left + 1;
            let child = if right < len && self.at[right].precedes(self.at[left]) {
                right
            } else {
                left
            };
            if !self.at[child].precedes(self.at[i]) {
                break;
            }
            self.swap(i, child);
            i = child;
        }
    }

    fn swap(&mut self, a: usize, b: usize) {
        self.at.swap(a, b);
        self.slots.swap(a, b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::slab::Slab;
    use crate::lease::slot::test_slot;
    use std::sync::Arc;

    fn slots(n: usize, prefix: &str) -> (Arc<Slab>, Vec<SlotRef>) {
        let slab = Slab::new(n.next_power_of_two().max(1024));
        let slots = (0..n)
            .map(|i| test_slot(&slab, &format!("{prefix}{i}")))
            .collect();
        (slab, slots)
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn entries_come_out_earliest_first_and_only_when_due() {
        let mut timers = Timers::default();
        let (_slab, slots) = slots(200, "k");
        // Due times in a scrambled order, some in the same millisecond.
        for (i, slot) in slots.iter().enumerate() {
            let at = ((i * 7919) % 100) as u64 * MS + 5 * MS + (i as u64 % 3) * 1000;
            timers.arm(slot, &mut slot.book.lock(), at);
        }
        assert_eq!(timers.len(), 200);
        assert_eq!(timers.next(0), Some(5 * MS));
        assert!(timers.pop_due(4 * MS).is_none(), "nothing due yet");
        let mut last = 0;
        let mut popped = 0;
        while let Some((at, slot)) = timers.pop_due(104 * MS) {
            assert!(slot.book.lock().armed_for(at));
            let at = at.near(50 * MS);
            assert!(at >= last, "{at} after {last}");
            last = at;
            popped += 1;
        }
        assert_eq!(popped, 200);
        assert!(timers.next(0).is_none());
    }

    #[test]
    fn the_order_holds_across_the_wrap_of_32_bit_milliseconds() {
        let wrap = (1u64 << 32) * MS;
        let mut timers = Timers::default();
        let (_slab, slots) = slots(4, "w");
        // Two just before the wrap, two just after, queued out of order.
        let times = [wrap + 3 * MS, wrap - 2 * MS, wrap + MS, wrap - 5 * MS];
        for (slot, &at) in slots.iter().zip(&times) {
            timers.arm(slot, &mut slot.book.lock(), at);
        }
        let now = wrap - 10 * MS;
        assert_eq!(timers.next(now), Some(wrap - 5 * MS));
        assert!(timers.pop_due(wrap - 6 * MS).is_none());
        let order: Vec<u64> = std::iter::from_fn(|| timers.pop_due(wrap + 3 * MS))
            .map(|(at, _)| at.near(now))
            .collect();
        assert_eq!(
            order,
            [wrap - 5 * MS, wrap - 2 * MS, wrap + MS, wrap + 3 * MS]
        );
    }

    #[test]
    fn a_slot_armed_no_later_is_not_queued_again_and_an_earlier_time_replaces_the_entry() {
        let mut timers = Timers::default();
        let (_slab, mut one) = slots(1, "again");
        let slot = one.pop().expect("a slot");
        timers.arm(&slot, &mut slot.book.lock(), 10 * MS);
        timers.arm(&slot, &mut slot.book.lock(), 20 * MS);
        assert_eq!(timers.len(), 1, "armed for 10 ms already");
        timers.arm(&slot, &mut slot.book.lock(), 10 * MS + 500);
        assert_eq!(timers.len(), 1, "the same millisecond");
        timers.arm(&slot, &mut slot.book.lock(), 4 * MS);
        assert_eq!(timers.len(), 2, "an earlier time queues a new entry");
        let (first, _) = timers.pop_due(100 * MS).expect("due");
        assert!(slot.book.lock().armed_for(first));
        let (second, _) = timers.pop_due(100 * MS).expect("due");
        assert!(
            !slot.book.lock().armed_for(second),
            "the replaced entry is not live"
        );
    }

    #[test]
    fn the_arrays_grow_by_a_quarter_and_give_memory_back() {
        let mut timers = Timers::default();
        let (_slab, slots) = slots(10_000, "g");
        for (i, slot) in slots.iter().enumerate() {
            timers.arm(slot, &mut slot.book.lock(), i as u64 * MS);
        }
        let cap = timers.at.capacity();
        assert!(
            cap <= 10_000 * 5 / 4 + 64,
            "capacity {cap} for 10,000 entries"
        );
        while timers.len() > 1_000 {
            timers.pop_due(20_000 * MS);
        }
        timers.shrink();
        assert!(timers.at.capacity() <= 2_000 && timers.slots.capacity() <= 2_000);
    }
}
