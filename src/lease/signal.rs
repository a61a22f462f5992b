//! What a call waiting for a key's tokens outside the lease table listens to
//! (`Limiter::acquire_until`): the `Notify` of the key's slot, which the actor wakes after each
//! answer for the slot (a refill applied, a failure, a retirement) and a refund wakes when it
//! puts tokens back into the lease.
//!
//! Apart so that the limiter's waiting calls reach the slot's `Notify` through one small hook,
//! without the lease table's slots leaving this module.

use std::sync::atomic::Ordering;

use tokio::sync::Notify;

use super::Leases;
use super::slot::WAITER;

impl Leases {
    /// The `Notify` woken when `key`'s lease may have tokens again; `None` when the key is not
    /// in the table. Shared with other slots (`slot.rs`, `WAITERS`): a wake is a hint to look
    /// at the lease again, never a promise that it holds tokens.
    pub(crate) fn refill_signal(&self, key: &str) -> Option<&'static Notify> {
        let table = self.table.pin();
        table.get(key).map(|(slot, _)| slot.notify())
    }

    /// Records that a call of `Limiter::acquire_until` waits first in `key`'s line for `cost`
    /// nanotokens: the key's next refill asks the store for that cost at least, even of a dry
    /// bucket (which is otherwise asked for a whole lease or nothing), and a refusal holds the
    /// key back only until the bucket could pay it. Nothing when the key is not in the table.
    pub(crate) fn mark_waiting(&self, key: &str, cost: u64) {
        let table = self.table.pin();
        if let Some((slot, _)) = table.get(key) {
            slot.need(cost, WAITER, Ordering::Relaxed);
        }
    }
}
