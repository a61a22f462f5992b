//! Expiry and idle cleanup: closing each lease whose lifetime is up (or letting a spent-from
//! relaxed one live on), waiving a quiet key's return when the bucket has refilled anyway,
//! evicting keys idle for a lifetime, and retiring leases a policy reload made stale.
//!
//! Apart because it is driven by the due-queue, not by callers: the actor's work follows what
//! is due, and this is all of what comes due.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use super::returns::{queue_return, retire};
use super::sizing::{expects_a_call, sample_demand};
use super::{State, lease_settings};
use crate::bucket::Tokens;
use crate::lease::slot::{Book, Ms32, Slot, SlotRef};
use crate::lease::word::{CLOSED, PENDING};
use crate::policy::Accounting;

/// The longest refill `waives` compares (nanoseconds): well inside the range of the local clock's
/// 32-bit milliseconds.
const FULL_AT_HORIZON: u64 = 3_600_000_000_000;

/// Handles the due-queue entries due within a tick of `now`: closes expired leases, evicts keys
/// that stayed idle for a lease lifetime after closing, and queues every other slot again for
/// its next due time. A slot whose refill is in flight (`inflight`) is left alone: applying
/// the answer queues it again. Returns how many entries it handled.
pub(super) fn expire(state: &mut State<'_>, now: u64, tick: u64, inflight: &HashSet<usize>) -> u64 {
    let leases = state.leases;
    // Everything due within the next tick is handled now, up to a tick early: entries close
    // together cost one wake-up, not one each.
    let horizon = now.saturating_add(tick);
    let mut evict = Vec::new();
    let mut looked = 0u64;
    while let Some((entry_at, slot)) = state.timers.pop_due(horizon) {
        looked += 1;
        if slot.evicted().load(Ordering::Acquire) {
            continue;
        }
        if inflight.contains(&(SlotRef::as_ptr(&slot) as usize)) {
            // Its refill is in flight: the answer, when applied, queues it again (`schedule`).
            let mut book = slot.book.lock();
            if book.armed_for(entry_at) {
                book.armed = false;
            }
            continue;
        }
        let word = slot.words().load();
        let available = slot.words().available();
        let ttl = lease_settings(&slot).ttl.as_nanos() as u64;
        let mut book = slot.book.lock();
        if !book.armed_for(entry_at) {
            continue; // replaced by an earlier entry, handled already
        }
        book.armed = false;
        // Active: spent since the actor last looked, or asking for a refill. (Compared with the
        // demand sample instead, a key that went quiet with its lease above the low-water mark
        // took no refill to update that sample and would look active for ever.)
        let spent = book.spend_mark(available);
        if spent != book.spent_at_check || word & PENDING != 0 {
            book.active_at = Ms32::from_ns(now);
            book.spent_at_check = spent;
        }
        let mut closed = word & CLOSED != 0;
        let expires_at = book.expires_at.near(now);
        if !closed && expires_at <= horizon && !renew_if_spent(&slot, &mut book, now) {
            // A lease lives `ttl` after its last top-up (for a strict one, after the request
            // was sent), or after the last expiry it was spent from before (relaxed only).
            let reclaimed = slot.words().close();
            book.reclaimed.add(reclaimed);
            if waives(&slot, &book, now) {
                leases.counters.waived.add(reclaimed);
            } else {
                queue_return(
                    &mut state.returns.items,
                    &mut state.ids,
                    &slot,
                    reclaimed,
                    || slot.strict_lease(),
                );
            }
            closed = true;
        }
        let idle_at = book.active_at.near(now).saturating_add(ttl);
        let next = if !closed {
            // Renewed above, or not due yet.
            book.expires_at.near(now)
        } else if word & PENDING == 0 && idle_at <= horizon {
            drop(book);
            // Credit still owed (its refill failed, or found the bucket dry) is asked for once
            // more before the key leaves, if refills answer now; otherwise it goes unpaid.
            if leases.owed_by(&slot) > 0
                && leases.refills_answer()
                && slot.fallback_until.load(Ordering::Acquire) <= now
                && slot.deny_until.load(Ordering::Acquire) <= now
                && slot.words().request_refill()
            {
                leases.nudge_soon(&slot);
                continue;
            }
            evict.push(slot);
            continue;
        } else {
            // Closed and asking for a refill (its refill queues it again if it needs sooner),
            // or not idle for a lifetime yet.
            idle_at
        };
        state
            .timers
            .arm(&slot, &mut book, next.max(horizon.saturating_add(1)));
    }
    leases
        .counters
        .actor_visits
        .fetch_add(looked, Ordering::AcqRel);
    if !evict.is_empty() {
        let table = leases.table.pin();
        for slot in evict {
            // Only the actor removes keys, and the slot is not evicted, so the key is this slot's.
            if let Some(removed) = table.remove(&slot.key) {
                retire(state, removed);
            }
        }
        // A view rebuilds at most once, so a large batch of evictions leaves most of its keys as
        // tombstones, each holding its slot. Once this view (and the arrays it pinned) is gone,
        // rebuild again if they pass the table's share, so a flood's dead slots are freed now and
        // not at the next batch's first eviction (E4's peak heap).
        drop(table);
        leases.table.pin().compact();
        state.timers.shrink();
    }
    looked
}

/// After a policy reload: retires every slot whose lease `stale` names (its plan changed or
/// was removed, or its key's rule names another plan now). Returns how many slots it looked at.
pub(super) fn retire_stale(state: &mut State<'_>, stale: &crate::lease::Stale) -> u64 {
    let leases = state.leases;
    let table = leases.table.pin();
    let mut gone = Vec::new();
    let mut looked = 0u64;
    for (_, slot) in table.iter() {
        looked += 1;
        let by_key = slot.hot().plan.load(Ordering::Relaxed) != crate::lease::slab::NO_PLAN;
        if (stale.0)(&slot.key, &slot.plan, by_key) {
            gone.push(SlotRef::clone(slot));
        }
    }
    for slot in &gone {
        if let Some(removed) = table.remove(&slot.key) {
            retire(state, removed);
        }
    }
    drop(table);
    if !gone.is_empty() {
        leases.table.pin().compact();
        state.timers.shrink();
    }
    leases
        .counters
        .actor_visits
        .fetch_add(looked, Ordering::AcqRel);
    looked
}

/// At a relaxed lease's expiry: if callers spent from it during its lifetime, or its key is
/// still expected to be called soon (`expects_a_call`), it lives another lifetime instead of
/// closing, and `true` is returned. A relaxed lease's unspent tokens are
/// already out of the shared bucket, and the overshoot bound (`N·B`, docs/design/leases.md) holds
/// whatever its age; the lifetime exists so that tokens of a key nobody calls go back. Closing an
/// active lease instead would send its next caller to wait for a refill, and a lease sized for a
/// lifetime of demand that its callers had not yet drained to the low-water mark would close
/// under them (with many keys, all at once). A strict lease always closes: the store stops
/// counting it two lifetimes after its renewal was sent (docs/design/strict-accounting.md).
fn renew_if_spent(slot: &Slot, book: &mut Book, now: u64) -> bool {
    let settings = lease_settings(slot);
    if settings.accounting != Accounting::Relaxed {
        return false;
    }
    let available = slot.words().available();
    sample_demand(
        book,
        available,
        now,
        settings.ttl.as_nanos() as u64,
        &settings,
    );
    let spent = book.spend_mark(available);
    if spent == book.spent_at_renewal && !expects_a_call(book, &settings, now) {
        return false;
    }
    book.spent_at_renewal = spent;
    book.expires_at = Ms32::from_ns(now.saturating_add(settings.ttl.as_nanos() as u64));
    true
}

/// Whether a relaxed lease closing at `now` keeps its unspent tokens instead of giving them back:
/// when its bucket, at the store's `remaining` after the lease's last grant, has had time since
/// to refill to its capacity (counted from the slot's last activity, which is no earlier). With no other taker, the return would then be
/// capped away whole, and a statement per close of a quiet key (most of what quiet keys cost
/// the database) buys nothing. Another instance that took from the bucket meanwhile finds at
/// most this lease's tokens fewer, for at most the time they take to refill; no call is ever
/// admitted beyond the overshoot bound (docs/design/leases.md), which waived tokens only lower. A strict lease is always
/// settled: its tokens are counted against the bucket until then (docs/design/strict-accounting.md).
fn waives(slot: &Slot, book: &Book, now: u64) -> bool {
    if lease_settings(slot).accounting != Accounting::Relaxed {
        return false;
    }
    let capacity = u64::try_from(slot.plan.capacity().as_nanos()).unwrap_or(u64::MAX);
    let remaining = slot.hot().store_remaining.load(Ordering::Relaxed);
    let refill = slot
        .plan
        .bucket()
        .time_to_refill(Tokens::from_nanos(u128::from(
            capacity.saturating_sub(remaining),
        )));
    // From the slot's last activity, which is no earlier than the last grant (applying an
    // answer marks the slot active), and a millisecond later for the clock's rounding: never
    // early. A refill longer than an hour is not compared (the local clock's milliseconds wrap
    // after 24 days).
    refill < FULL_AT_HORIZON
        && book
            .active_at
            .near(now)
            .saturating_add(refill)
            .saturating_add(1_000_000)
            <= now
}
