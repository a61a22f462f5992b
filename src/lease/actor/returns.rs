//! Give-backs: unspent tokens on their way back to the store, under return ids that make a
//! retry credit once, and what becomes of each return when its statement answers.
//!
//! Apart because a return outlives the slot it came from (evicted, or the actor itself gone)
//! and is sent by two callers, the lanes while the actor runs and the shutdown here after it
//! stops, which settle their answers with the one function `settle`.

use crate::store::metered::{Metered, Purpose};
use std::collections::HashSet;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{CHUNK, State};
use crate::bucket::Tokens;
use crate::key::SlotKey;
use crate::lease::Leases;
use crate::lease::slot::SlotRef;
use crate::policy::Plan;
use crate::store::{GiveBack, LeaseRef, StoreError};

/// Attempts at giving a return back before its tokens count as stranded.
const RETURN_ATTEMPTS: u32 = 5;

/// Unused tokens on their way back to the store.
#[derive(Debug)]
pub(in crate::lease) struct Return {
    id: i64,
    /// The key and its plan, copied from the slot: a queued return does not keep the evicted
    /// slot (176 bytes and its fast-path record) alive while it waits for its lane.
    pub(super) key: SlotKey,
    plan: Arc<Plan>,
    amount: u64,
    attempts: u32,
    /// The strict lease the return settles; `None` for relaxed leases.
    lease: Option<LeaseRef>,
    /// After a failed attempt: not sent again before this local monotonic time (ns); `0` for
    /// a return not tried yet.
    pub(super) not_before: u64,
}

/// Return ids: 63 random bits each, from a per-actor random hasher over a counter.
pub(super) struct Ids {
    hasher: RandomState,
    next: u64,
}

impl Ids {
    /// A fresh sequence, under a hasher of its own.
    pub(super) fn new() -> Ids {
        Ids {
            hasher: RandomState::new(),
            next: 0,
        }
    }

    pub(super) fn next(&mut self) -> i64 {
        self.next += 1;
        (self.hasher.hash_one(self.next) >> 1) as i64
    }
}

/// Returns on their way back. Should the task end before they are sent (its runtime dropped
/// mid-statement), whatever is left goes to [`Leases::carry`] for the next actor: a return
/// whose statement may have reached the store is sent again under the same id, which credits
/// once.
pub(super) struct Carried<'a> {
    leases: &'a Leases,
    pub(super) items: Vec<Return>,
}

impl<'a> Carried<'a> {
    pub(super) fn new(leases: &'a Leases, items: Vec<Return>) -> Self {
        Carried { leases, items }
    }
}

impl Drop for Carried<'_> {
    fn drop(&mut self) {
        if !self.items.is_empty() {
            self.leases.carry.lock().append(&mut self.items);
        }
    }
}

/// The store's requests for `returns`, borrowing their keys.
pub(super) fn give_back_requests(returns: &[Return]) -> Vec<GiveBack<'_>> {
    returns
        .iter()
        .map(|r| GiveBack {
            id: r.id,
            key: &r.key,
            bucket: *r.plan.bucket(),
            amount: Tokens::from_nanos(u128::from(r.amount)),
            lease: r.lease,
        })
        .collect()
}

/// Queues `amount` nanotokens of `slot` to go back to the store, under a fresh return id,
/// settling the strict lease `lease` gives, if there is one. `lease` is asked only when there
/// is something to give back: the slot's strict lease sits behind the slab's free-list lock,
/// and most closes of a quiet key's lease give back nothing.
pub(super) fn queue_return(
    returns: &mut Vec<Return>,
    ids: &mut Ids,
    slot: &SlotRef,
    amount: u64,
    lease: impl FnOnce() -> Option<LeaseRef>,
) {
    if amount > 0 {
        returns.push(Return {
            id: ids.next(),
            key: slot.key.clone(),
            plan: Arc::clone(&slot.plan),
            amount,
            attempts: 0,
            lease: lease(),
            not_before: 0,
        });
    }
}

/// Takes a slot out of service for good (evicted, or shutting down): it is never topped up
/// again, its unspent tokens go back, and its waiters wake to find it closed. Its key gets no
/// credit from now on, and credit it still owes counts as unpaid.
pub(super) fn retire(state: &mut State<'_>, slot: &SlotRef) {
    let leases = state.leases;
    leases.mark_removed(&slot.key);
    slot.evicted().store(true, Ordering::Release);
    leases.write_off_credit(slot);
    let reclaimed = slot.words().close();
    slot.book.lock().reclaimed.add(reclaimed);
    queue_return(
        &mut state.returns.items,
        &mut state.ids,
        slot,
        reclaimed,
        || slot.strict_lease(),
    );
    slot.notify().notify_waiters();
}

/// At shutdown: gives reclaimed tokens back, one statement per chunk of distinct keys (a
/// sharded store sends each shard's part concurrently), waiting for each. Failed returns stay
/// queued with their ids; after [`RETURN_ATTEMPTS`] they count as stranded. While running, the
/// actor sends give-backs through its lanes instead (`dispatch`).
async fn give_back(leases: &Leases, returns: &mut Vec<Return>) {
    // Held in guards across the statement: an actor that ends mid-statement leaves them to
    // the next one.
    let mut pending = Carried::new(leases, std::mem::take(returns));
    while !pending.items.is_empty() {
        let mut keys = HashSet::new();
        let (batch, rest): (Vec<Return>, Vec<Return>) = std::mem::take(&mut pending.items)
            .into_iter()
            .partition(|r| keys.len() < CHUNK && keys.insert(r.key.clone()));
        pending.items = rest;
        let mut batch = Carried::new(leases, batch);
        let requests = give_back_requests(&batch.items);
        leases.counters.store_calls.fetch_add(1, Ordering::AcqRel);
        leases.busy.store(true, Ordering::Relaxed);
        // One outcome per return: a sharded store fails only the returns of a failing shard.
        let result = Metered::new(&*leases.store, Purpose::Return)
            .give_back_each(&requests)
            .await;
        leases.busy.store(false, Ordering::Relaxed);
        drop(requests);
        settle(
            leases,
            std::mem::take(&mut batch.items),
            result,
            None,
            returns,
        );
    }
}

/// Settles one give-back statement's `batch` by its `result` (one outcome per return, in
/// order; a short answer fails them all): what was credited counts as returned; a failed
/// return goes back on `returns` with one attempt more, not to be sent again before
/// `retry_at` when that is given, and after [`RETURN_ATTEMPTS`] counts as stranded instead.
pub(super) fn settle(
    leases: &Leases,
    batch: Vec<Return>,
    result: Vec<Result<(), StoreError>>,
    retry_at: Option<u64>,
    returns: &mut Vec<Return>,
) {
    let short = result.len() != batch.len();
    let mut outcomes = result.into_iter();
    let mut credited = 0u64;
    for mut r in batch {
        match outcomes.next() {
            Some(Ok(())) if !short => credited += r.amount,
            _ => {
                r.attempts += 1;
                if r.attempts >= RETURN_ATTEMPTS {
                    leases.counters.stranded.add(r.amount);
                } else {
                    if let Some(at) = retry_at {
                        r.not_before = at;
                    }
                    returns.push(r);
                }
            }
        }
    }
    if credited > 0 {
        leases.counters.returned.add(credited);
    }
}

/// Closes every lease, empties the table and gives everything back (retrying each return up
/// to its attempts).
pub(super) async fn shut_down(state: &mut State<'_>) {
    let leases = state.leases;
    {
        let table = leases.table.pin();
        for (_, slot) in table.iter() {
            retire(state, slot);
        }
        table.clear();
    }
    let returns = &mut state.returns.items;
    for _ in 0..RETURN_ATTEMPTS {
        if returns.is_empty() {
            break;
        }
        give_back(leases, returns).await;
    }
    for r in returns.drain(..) {
        leases.counters.stranded.add(r.amount);
    }
}
