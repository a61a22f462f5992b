//! Credit: calls of a new key admitted against its late refill (`docs/design/lease-credit.md`, "Credit while a
//! new key's refill is late").
//!
//! A caller that waited out its `max_wait` for its key's refill may be admitted on credit
//! (`Leases::credit` has the rules); the refill, or the next one, asks the store for the credit on
//! top of what it wants, and its grant pays the credit before the lease gets anything
//! (`actor/refill.rs`'s `apply`). This ledger holds what each slot still owes, by the slot's record index,
//! and enforces the bound: a slot's grants so far, its unpaid credit and the new call's cost
//! stay within the slot's largest lease `B`.
//!
//! Callers give credit and the actor pays it, each holding the slot's bookkeeping lock, under
//! which the actor also adds grants to the slot's `credited` count: so a caller that reads that
//! count sees every grant whose payment it could miss. The ledger's own mutex makes each of its
//! operations atomic. Like the rest of the lease core it uses the names of `super::sync`, so the
//! loom model `tests/models/loom_lease_credit.rs` compiles it against loom's.

use std::collections::HashMap;

use super::sync::Mutex;

/// Unpaid credit by slot record index (nanotokens); an entry only while something is owed.
#[derive(Debug)]
pub(crate) struct Credit {
    owed: Mutex<HashMap<u32, u64>>,
}

impl Credit {
    /// An empty ledger.
    pub(crate) fn new() -> Credit {
        Credit {
            owed: Mutex::new(HashMap::new()),
        }
    }

    /// Gives `cost` nanotokens on credit to the slot of record `index`, if `granted` (what the
    /// slot's grants have brought so far, read under its bookkeeping lock, which the caller
    /// holds), its unpaid credit and `cost` together stay within `bound`. Returns whether it did.
    pub(crate) fn give(&self, index: u32, granted: u64, cost: u64, bound: u64) -> bool {
        let mut owed = self.owed.lock();
        let unpaid = owed.get(&index).copied().unwrap_or(0);
        if granted.saturating_add(unpaid).saturating_add(cost) > bound {
            return false;
        }
        owed.insert(index, unpaid + cost);
        true
    }

    /// What the slot of record `index` owes.
    pub(crate) fn owed(&self, index: u32) -> u64 {
        self.owed.lock().get(&index).copied().unwrap_or(0)
    }

    /// Pays up to `granted` nanotokens of what the slot of record `index` owes, from a grant
    /// (the actor, holding the slot's bookkeeping lock); returns what it paid.
    pub(crate) fn pay(&self, index: u32, granted: u64) -> u64 {
        let mut owed = self.owed.lock();
        let Some(unpaid) = owed.get_mut(&index) else {
            return 0;
        };
        let paid = granted.min(*unpaid);
        *unpaid -= paid;
        if *unpaid == 0 {
            owed.remove(&index);
        }
        paid
    }

    /// Forgets what the slot of record `index` owes (it leaves the table) and returns it.
    pub(crate) fn write_off(&self, index: u32) -> u64 {
        self.owed.lock().remove(&index).unwrap_or(0)
    }

    /// What every slot owes together.
    pub(crate) fn total(&self) -> u64 {
        self.owed.lock().values().sum()
    }
}
