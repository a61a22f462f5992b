//! Refills: what each slot that asked asks the store for (its strict lease's renewal
//! included), and how a grant goes into the slot when the answer comes.
//!
//! Apart because it is the per-slot part of a refill, the same whichever lane sends it: the
//! lanes batch the asks into statements and hand each answer back here.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::returns::{Ids, queue_return};
use super::sizing::{largest_lease, sample_demand, target_size};
use super::{State, lease_settings};
use crate::bucket::Tokens;
use crate::lease::Leases;
use crate::lease::slot::{Ms32, Slot, SlotRef};
use crate::lease::timers::Timers;
use crate::lease::word::{CLOSED, TOKENS};
use crate::policy::Accounting;
use crate::store::{Acquired, Hold};

/// A contended key's lease is spread over one word per core once its target reaches `HOT_PARTS²`
/// of its largest cost; a top-up is split into parts of at least `HOT_PARTS` costs.
const HOT_PARTS: u64 = 4;

/// One slot's refill request: the slot, the least and the most it asks for (nanotokens), its
/// strict lease's renewal, and the target lease size it was planned for (nanotokens; read when
/// its answer is applied, carried here rather than kept in every slot's book), with the cost of
/// the call of `Limiter::acquire_until` it was asked for, if one waits first in the key's line.
pub(super) type Ask = (SlotRef, u64, u64, Option<Hold>, Planned);

/// What a refill was planned for, read when its answer is applied: the target lease size
/// (nanotokens), and the cost of a call of `Limiter::acquire_until` waiting first in the key's
/// line ([`WAITER`](crate::lease::slot::WAITER)), if one does: a refusal then holds the key's
/// callers back only until the bucket could pay that cost, not a whole lease.
#[derive(Debug, Clone, Copy)]
pub(super) struct Planned {
    pub(super) target: u64,
    pub(super) waiter: Option<u64>,
}

/// The strict-lease part of a refill request: the slot's holder id (drawn on its first strict
/// refill), a fresh lease id, and what the slot keeps of its current lease. The store counts
/// the lease for twice its lifetime plus two ticks: the actor closes it locally at one lifetime
/// (measured from before the request was sent, so never later than the store's count runs
/// out), woken by its due-queue entry at that time (or up to a tick before it), and the margin
/// covers a wake-up that comes late.
fn hold(leases: &Leases, slot: &Slot, ids: &mut Ids) -> Option<Hold> {
    let settings = lease_settings(slot);
    if settings.accounting != Accounting::Strict {
        return None;
    }
    let holder = slot.strict_holder(|| ids.next().max(1));
    Some(Hold {
        holder,
        lease_id: ids.next(),
        kept: Tokens::from_nanos(u128::from(slot.words().available())),
        lifetime: settings.ttl * 2 + leases.settings.tick * 2,
    })
}

/// What one slot asks the store for: (min, want) in nanotokens, with what they were planned
/// for, or `None` when nothing is needed. Samples the slot's demand.
///
/// Credit the slot owes (`owed`, `Leases::credit`) is asked for on top of both: the grant
/// pays it first (`apply`).
fn plan_refill(slot: &Slot, now: u64, landing: u64, owed: u64) -> Option<(u64, u64, Planned)> {
    let settings = lease_settings(slot);
    let largest = largest_lease(slot, 0);
    let available = slot.words().available();
    // Never more than a lease holds: the limiter sends a call costing more to the store
    // (`LeaseSettings::MAX_LEASE`), and a grant above it would only go back.
    let (needed, for_waiter) = slot.take_needed();
    let needed = needed.min(TOKENS);
    let waiting = slot.waiting.swap(0, Ordering::AcqRel).min(TOKENS);
    let for_waiter = for_waiter && needed > 0;
    let mut book = slot.book.lock();
    let max_cost = book.max_cost.get().max(needed);
    book.max_cost.set(max_cost);
    sample_demand(&mut book, available, now, 1_000_000, &settings);
    let target = if book.dry {
        // A key whose bucket ran dry wants more than it gets: ask for the largest lease, so
        // that a dry bucket is asked about once per lease's worth of refill, not once per token.
        largest
    } else {
        target_size(
            f64::from(book.demand),
            book.max_cost.get(),
            &settings,
            Duration::from_nanos(landing),
        )
        .min(largest)
    };
    // A key sized a lease is not sparse; one sized none, watched for a lifetime at least, is:
    // its next call the word cannot pay is one store call through the direct-mode coalescer,
    // not a wait for this actor (`Hot::sparse`). A new key stays as it started (sparse) until
    // either is known.
    if target > 0 {
        slot.hot().sparse.store(false, Ordering::Relaxed);
    } else if book.watched {
        slot.hot().sparse.store(true, Ordering::Relaxed);
    }
    let want = target
        .max(waiting)
        .saturating_sub(available)
        .max(needed)
        .min(largest.max(needed));
    if want == 0 && owed == 0 {
        return None;
    }
    // A top-up nobody waits for is worth a round trip only if it brings a good part of what is
    // wanted; with a caller waiting, whatever pays that caller is (asking it for more would
    // deny a call the bucket could pay). A bucket that ran dry is asked for the whole lease or
    // nothing, unless a call waits in the key's line for its tokens (`acquire_until`): it is
    // served as soon as the bucket holds its cost, as an ideal bucket would serve it.
    let min = if want == 0 {
        0
    } else if book.dry && !for_waiter {
        want
    } else if needed > 0 {
        needed.clamp(1, want)
    } else {
        (want / 2).clamp(1, want)
    };
    let planned = Planned {
        target,
        waiter: for_waiter.then_some(needed),
    };
    Some((min.saturating_add(owed), want.saturating_add(owed), planned))
}

/// Plans the refill of up to [`CHUNK`](super::CHUNK) slots of one lane: what each asks the
/// store for (one ask per distinct key). A slot that needs nothing has its pending mark cleared
/// and its waiters woken, and is queued on the due-queue at once; the asked slots are queued
/// when the answer is applied.
pub(super) fn plan_chunk(state: &mut State<'_>, part: &[SlotRef]) -> Vec<Ask> {
    let leases = state.leases;
    let State { timers, ids, .. } = state;
    let now = leases.now();
    // How long a refill takes to land: the last round trips, plus a tick for a nudge that was
    // dropped and found by the sweep.
    let landing = leases
        .refill_ns
        .load(Ordering::Relaxed)
        .saturating_add(leases.settings.tick.as_nanos() as u64);
    let mut asks: Vec<Ask> = Vec::with_capacity(part.len());
    let mut keys = HashSet::with_capacity(part.len());
    for slot in part {
        if slot.evicted().load(Ordering::Acquire) {
            continue;
        }
        if !keys.insert(&*slot.key) {
            // Another slot of the same key (evicted and re-created): next round.
            slot.words().request_refill();
            leases.nudge(slot);
            schedule(timers, slot, now);
            continue;
        }
        match plan_refill(slot, now, landing, leases.owed_by(slot)) {
            Some((min, want, planned)) => {
                let hold = hold(leases, slot, ids);
                asks.push((SlotRef::clone(slot), min, want, hold, planned));
            }
            None => {
                slot.words().clear_pending();
                slot.notify().notify_waiters();
                schedule(timers, slot, now);
            }
        }
    }
    asks
}

/// Queues `slot` on the due-queue after a refill round (whatever its answer), unless it has an
/// entry due no later: at its lease's expiry if it has a live lease, else at its idle check.
pub(super) fn schedule(timers: &mut Timers, slot: &SlotRef, now: u64) {
    if slot.evicted().load(Ordering::Acquire) {
        return;
    }
    let live = slot.words().load() & CLOSED == 0;
    let ttl = lease_settings(slot).ttl.as_nanos() as u64;
    let mut book = slot.book.lock();
    let at = book.next_look(live, ttl, now);
    timers.arm(slot, &mut book, at);
}

/// One slot's ask of a refill statement, as its answer is applied.
pub(super) struct Grant<'s> {
    pub(super) slot: &'s SlotRef,
    /// What the ask wanted (nanotokens).
    pub(super) want: u64,
    pub(super) planned: Planned,
    /// For a strict lease, when the request was sent and the new lease's id: the store renewed
    /// the holder's entry under that id, and the lease expires here one lifetime after sending.
    pub(super) strict: Option<(u64, i64)>,
}

/// Puts one refill's answer into its slot (`grant`) and wakes the slot's waiters.
pub(super) fn apply(state: &mut State<'_>, grant: Grant<'_>, answer: &Acquired, now: u64) {
    let Grant {
        slot,
        want,
        planned,
        strict,
    } = grant;
    let leases = state.leases;
    let settings = lease_settings(slot);
    let ttl = settings.ttl.as_nanos() as u64;
    if let Some((sent, lease_id)) = strict {
        slot.set_strict_lease_id(lease_id);
        let mut book = slot.book.lock();
        book.expires_at = Ms32::from_ns(sent.saturating_add(ttl));
    }
    let granted = u64::try_from(answer.granted.as_nanos()).unwrap_or(TOKENS);
    let remaining = u64::try_from(answer.remaining.as_nanos()).unwrap_or(u64::MAX);
    slot.hot()
        .store_remaining
        .store(remaining, Ordering::Relaxed);
    // How long until the bucket could grant what was wanted, if nobody else takes from it: a
    // scarce bucket is asked again then, not sooner, so it costs one round trip per lease.
    let until_want = slot
        .plan
        .bucket()
        .time_to_refill(Tokens::from_nanos(u128::from(
            want.saturating_sub(remaining),
        )));
    if granted == 0 {
        let retry = u64::try_from(answer.retry_after.as_nanos()).unwrap_or(u64::MAX);
        let streak = {
            let mut book = slot.book.lock();
            book.dry = true;
            book.dry_streak = book.dry_streak.saturating_add(1);
            book.dry_streak
        };
        // A waiting call asked for its own cost: the store's retry time is when the bucket
        // could pay it, and the call tries again then (it is first in its key's line, so no
        // other caller of this limiter competes with it).
        let wait = if planned.waiter.is_some() {
            retry.max(1)
        } else {
            retry
                .max(until_want)
                .max(1)
                .saturating_mul(u64::from(streak.min(4)))
        };
        slot.deny_until
            .store(now.saturating_add(wait), Ordering::Release);
        slot.dry().store(true, Ordering::Release);
        slot.words().clear_pending();
    } else {
        leases.counters.leased.add(granted);
        let mut book = slot.book.lock();
        // Split a top-up over a hot key's words only in parts of a few costs each, so that
        // no word is left holding less than a caller needs while the others hold the rest.
        let split_min = book.max_cost.get().max(1).saturating_mul(HOT_PARTS);
        if slot.words().contended() && planned.target >= split_min.saturating_mul(HOT_PARTS) {
            slot.words().spread_out();
        }
        // A lease never holds more than its bound (`largest_lease`): tokens refunded into the
        // word while this refill was in flight would otherwise ride on top of the grant, and a
        // lease that callers keep refunding into would grow past the bound round after round.
        // What does not fit goes back to the store.
        // Credit the slot owes is paid first: those tokens were spent when the credit was
        // given, so they count as credited and spent at once (as a sparse key's store call).
        let paid = leases.pay_credit(slot, granted);
        let room =
            largest_lease(slot, book.max_cost.get()).saturating_sub(slot.words().available());
        let placed = (granted - paid).min(room);
        let unplaced = if slot.evicted().load(Ordering::Acquire) {
            granted - paid
        } else {
            (granted - paid - placed) + slot.words().top_up(placed, split_min)
        };
        // `unplaced` can exceed `granted` by tokens a hot key's words held and could not hold
        // again (see `LeaseWords::top_up`); they were credited before and leave now.
        let credited = (book.credited.get() + granted).saturating_sub(unplaced);
        book.credited.set(credited);
        if strict.is_none() {
            book.expires_at = Ms32::from_ns(now.saturating_add(ttl));
            book.spent_at_renewal = book.spend_mark(slot.words().available());
        }
        book.active_at = Ms32::from_ns(now);
        // Less than wanted: the bucket is scarce. No background top-up then (it would find the
        // bucket empty); when this lease is spent, callers are denied until a whole lease has
        // refilled, and the next refill asks for all of it.
        let scarce = granted < want;
        book.dry = scarce;
        book.dry_streak = 0;
        let size = planned.target.max(slot.words().available());
        let low_water = if scarce {
            0
        } else {
            (size as f64 * settings.low_water) as u64
        };
        slot.hot().low_water.store(low_water, Ordering::Relaxed);
        drop(book);
        // The next call waiting in the key's line asks for its own cost once the bucket could
        // pay it (the cost of this one, as far as the actor knows), not once a whole lease has
        // refilled.
        let deny_until = if let (true, Some(need)) = (scarce, planned.waiter) {
            let short = Tokens::from_nanos(u128::from(need.saturating_sub(remaining)));
            now.saturating_add(slot.plan.bucket().time_to_refill(short))
        } else if scarce {
            now.saturating_add(until_want)
        } else {
            0
        };
        slot.deny_until.store(deny_until, Ordering::Release);
        slot.fallback_until.store(0, Ordering::Release);
        slot.dry().store(scarce, Ordering::Release);
        // The strict lease as renewed above (holder and this answer's lease id).
        queue_return(
            &mut state.returns.items,
            &mut state.ids,
            slot,
            unplaced,
            || strict.and_then(|_| slot.strict_lease()),
        );
        // Credit given after this refill was planned is still owed: the next refill asks for
        // it (nobody waits on it). A grant that paid credit left the lease short of what the
        // key's demand wants (a cold key's first grant is its first callers' costs, and those
        // were credited): the next refill tops it up before the key's next call, off that
        // call's path, as the grant would have for a caller that went to the fallback.
        if (paid > 0 || leases.owed_by(slot) > 0) && slot.words().request_refill() {
            leases.nudge_soon(slot);
        }
    }
    slot.notify().notify_waiters();
}
