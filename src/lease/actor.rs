//! The lease actor: refills, expiry, eviction and give-backs for one lease table.
//!
//! One tokio task per limiter. It sleeps until a caller nudges it or its tick comes, then:
//! 1. gathers the slots that asked for a refill (nudges, plus a scan for `PENDING` on ticks),
//! 2. on ticks, closes expired leases (their tokens go back) and evicts idle keys,
//! 3. refills every gathered slot with one `acquire_many` statement per 256 keys,
//! 4. gives back what was reclaimed, one statement per 256 keys, retrying failures with the
//!    same return ids (so a retry never credits twice).
//!
//! Only the actor adds tokens to a word or takes them back, and it handles one round at a time,
//! so at most one refill is in flight per key.

use std::collections::HashSet;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Leases;
use super::slot::Slot;
use super::word::{CLOSED, PENDING, TOKENS};
use crate::bucket::Tokens;
use crate::metrics as m;
use crate::policy::{Accounting, LeaseSettings};
use crate::store::{AcquireRequest, GiveBack, Hold, LeaseRef};

/// A contended key's lease is spread over one word per core once its target reaches `HOT_PARTS²`
/// of its largest cost; a top-up is split into parts of at least `HOT_PARTS` costs.
const HOT_PARTS: u64 = 4;
/// Keys per store statement.
const CHUNK: usize = 256;
/// Attempts at giving a return back before its tokens count as stranded.
const RETURN_ATTEMPTS: u32 = 5;
/// After a failed refill, callers of the key go to the fallback for this long instead of
/// waiting for another refill.
const FAILURE_BACKOFF: Duration = Duration::from_millis(100);

/// Unused tokens on their way back to the store.
struct Return {
    id: i64,
    slot: Arc<Slot>,
    amount: u64,
    attempts: u32,
    /// The strict lease the return settles; `None` for relaxed leases.
    lease: Option<LeaseRef>,
}

/// Return ids: 63 random bits each, from a per-actor random hasher over a counter.
struct Ids {
    hasher: RandomState,
    next: u64,
}

impl Ids {
    fn next(&mut self) -> i64 {
        self.next += 1;
        (self.hasher.hash_one(self.next) >> 1) as i64
    }
}

/// The actor's loop; ends after giving everything back once the limiter stops.
pub(super) async fn run(leases: Arc<Leases>) {
    let mut tick = tokio::time::interval(leases.settings.tick);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut returns: Vec<Return> = Vec::new();
    let mut ids = Ids {
        hasher: RandomState::new(),
        next: 0,
    };
    loop {
        let scan = tokio::select! {
            () = leases.wake.notified() => false,
            _ = tick.tick() => true,
        };
        if leases.stopping.load(Ordering::Acquire) {
            break;
        }
        let now = leases.now();
        let mut due = Vec::new();
        let mut seen = HashSet::new();
        while let Some(slot) = leases.nudges.pop() {
            if seen.insert(Arc::as_ptr(&slot) as usize) {
                due.push(slot);
            }
        }
        if scan {
            sweep(&leases, now, &mut due, &mut seen, &mut returns, &mut ids);
        }
        // Returns first: a strict lease closed in this round is settled before the same slot's
        // renewal replaces its entry in the store.
        if !returns.is_empty() {
            give_back(&leases, &mut returns).await;
        }
        if !due.is_empty() {
            refill(&leases, due, &mut returns, &mut ids).await;
        }
        if !returns.is_empty() {
            give_back(&leases, &mut returns).await;
        }
        if scan {
            publish(&leases);
        }
    }
    shut_down(&leases, &mut returns, &mut ids).await;
    publish(&leases);
}

/// Sets the lease gauges and token counters from the exact counters.
fn publish(leases: &Leases) {
    let stats = leases.stats();
    metrics::gauge!(m::OUTSTANDING).set(stats.outstanding);
    metrics::gauge!(m::TABLE_KEYS).set(stats.keys as f64);
    metrics::counter!(m::TOKENS_LEASED).absolute(stats.leased as u64);
    metrics::counter!(m::TOKENS_RETURNED).absolute(stats.returned as u64);
    metrics::counter!(m::TOKENS_STRANDED).absolute(stats.stranded as u64);
}

/// The tick's scan: find slots that asked for a refill but whose nudge was dropped, close expired
/// leases, and evict keys that stayed idle for a lease lifetime after closing.
fn sweep(
    leases: &Leases,
    now: u64,
    due: &mut Vec<Arc<Slot>>,
    seen: &mut HashSet<usize>,
    returns: &mut Vec<Return>,
    ids: &mut Ids,
) {
    let table = leases.table.pin();
    let mut evict = Vec::new();
    for (key, slot) in table.iter() {
        let word = slot.words().load();
        let ttl = lease_settings(slot).ttl.as_nanos() as u64;
        let mut book = slot.book.lock();
        // Active: spent since the last sweep, or asking for a refill. (Compared with the demand
        // sample instead, a key that went quiet with its lease above the low-water mark took
        // no refill to update that sample, looked active on every tick and was never evicted.)
        let spent = book.spent(word & TOKENS);
        if spent != book.spent_at_sweep || word & PENDING != 0 {
            book.active_at = now;
            book.spent_at_sweep = spent;
        }
        if word & PENDING != 0 && seen.insert(Arc::as_ptr(slot) as usize) {
            due.push(Arc::clone(slot));
        }
        if word & CLOSED == 0 && now >= book.expires_at && !renew_if_spent(slot, &mut book, now) {
            let reclaimed = slot.words().close();
            book.reclaimed += reclaimed;
            queue_return(returns, ids, slot, reclaimed, book.lease());
        } else if word & CLOSED != 0
            && word & PENDING == 0
            && now.saturating_sub(book.active_at) >= ttl
        {
            evict.push(key.clone());
        }
    }
    let evicted = !evict.is_empty();
    for key in evict {
        if let Some(slot) = table.remove(&key) {
            retire(slot, returns, ids);
        }
    }
    if evicted {
        // A view rebuilds at most once, so a large batch of evictions leaves most of its keys as
        // tombstones, each holding its slot. Once this view (and the arrays it pinned) is gone,
        // rebuild again if they pass the table's share, so a flood's dead slots are freed now and
        // not at the next tick's first eviction (E4's peak heap).
        drop(table);
        leases.table.pin().compact();
    }
}

/// At a relaxed lease's expiry: if callers spent from it during its lifetime, it lives another
/// lifetime instead of closing, and `true` is returned. A relaxed lease's unspent tokens are
/// already out of the shared bucket, and the overshoot bound (`N·B`, DESIGN.md §8) holds
/// whatever its age; the lifetime exists so that tokens of a key nobody calls go back. Closing an
/// active lease instead would send its next caller to wait for a refill, and a lease sized for a
/// lifetime of demand that its callers had not yet drained to the low-water mark would close
/// under them (with many keys, all at once). A strict lease always closes: the store stops
/// counting it two lifetimes after its renewal was sent (§13).
fn renew_if_spent(slot: &Slot, book: &mut super::slot::Book, now: u64) -> bool {
    let settings = lease_settings(slot);
    if settings.accounting != Accounting::Relaxed {
        return false;
    }
    let spent = book.spent(slot.words().available());
    if spent == book.spent_at_renewal {
        return false;
    }
    book.spent_at_renewal = spent;
    book.expires_at = now.saturating_add(settings.ttl.as_nanos() as u64);
    true
}

/// Queues `amount` nanotokens of `slot` to go back to the store, under a fresh return id,
/// settling the strict lease `lease` if there is one.
fn queue_return(
    returns: &mut Vec<Return>,
    ids: &mut Ids,
    slot: &Arc<Slot>,
    amount: u64,
    lease: Option<LeaseRef>,
) {
    if amount > 0 {
        returns.push(Return {
            id: ids.next(),
            slot: Arc::clone(slot),
            amount,
            attempts: 0,
            lease,
        });
    }
}

/// Takes a slot out of service for good (evicted, or shutting down): it is never topped up
/// again, its unspent tokens go back, and its waiters wake to find it closed.
fn retire(slot: &Arc<Slot>, returns: &mut Vec<Return>, ids: &mut Ids) {
    slot.evicted.store(true, Ordering::Release);
    let reclaimed = slot.words().close();
    let lease = {
        let mut book = slot.book.lock();
        book.reclaimed += reclaimed;
        book.lease()
    };
    queue_return(returns, ids, slot, reclaimed, lease);
    slot.notify.notify_waiters();
}

fn lease_settings(slot: &Slot) -> LeaseSettings {
    slot.plan.lease().copied().unwrap_or_default()
}

/// The strict-lease part of a refill request: the slot's holder id (drawn on its first strict
/// refill), a fresh lease id, and what the slot keeps of its current lease. The store counts
/// the lease for twice its lifetime plus two ticks: the actor closes it locally at one lifetime
/// (measured from before the request was sent, so never later than the store's count runs
/// out), on a tick, and the margin covers a tick that comes late.
fn hold(leases: &Leases, slot: &Slot, ids: &mut Ids) -> Option<Hold> {
    let settings = lease_settings(slot);
    if settings.accounting != Accounting::Strict {
        return None;
    }
    let holder = {
        let mut book = slot.book.lock();
        if book.holder == 0 {
            book.holder = ids.next().max(1);
        }
        book.holder
    };
    Some(Hold {
        holder,
        lease_id: ids.next(),
        kept: Tokens::from_nanos(u128::from(slot.words().available())),
        lifetime: settings.ttl * 2 + leases.settings.tick * 2,
    })
}

/// What one slot asks the store for: (min, want) in nanotokens, or `None` when nothing is
/// needed. Samples the slot's demand and sets its next target size.
fn plan_refill(slot: &Slot, now: u64, landing: u64) -> Option<(u64, u64)> {
    let settings = lease_settings(slot);
    let largest = largest_lease(slot, 0);
    let available = slot.words().available();
    let needed = slot.needed.swap(0, Ordering::AcqRel);
    let waiting = slot.waiting.swap(0, Ordering::AcqRel);
    let mut book = slot.book.lock();
    book.max_cost = book.max_cost.max(needed);
    let elapsed = now.saturating_sub(book.sampled_at);
    if elapsed >= 1_000_000 {
        let spent = book.spent(available);
        let rate = (spent - book.spent_at_sample.min(spent)) as f64 * 1e9 / elapsed as f64;
        book.demand = if book.demand == 0.0 {
            rate
        } else {
            0.5 * book.demand + 0.5 * rate
        };
        book.sampled_at = now;
        book.spent_at_sample = spent;
    }
    let target = if book.dry {
        // A key whose bucket ran dry wants more than it gets: ask for the largest lease, so
        // that a dry bucket is asked about once per lease's worth of refill, not once per token.
        largest
    } else {
        target_size(
            book.demand,
            book.max_cost,
            &settings,
            Duration::from_nanos(landing),
        )
        .min(largest)
    };
    book.target = target;
    let want = target
        .max(waiting)
        .saturating_sub(available)
        .max(needed)
        .min(largest.max(needed));
    if want == 0 {
        return None;
    }
    // A top-up is worth a round trip only if it brings a good part of what is wanted; a bucket
    // that ran dry is asked for the whole lease or nothing.
    let min = if book.dry {
        want
    } else {
        needed.max(want / 2).clamp(1, want)
    };
    Some((min, want))
}

/// The most a lease of `slot` holds (nanotokens): `B = max_fraction × capacity`, or the largest
/// cost a caller of the key waited for (`max_cost`) when that is more, since a lease must hold
/// one call's cost. This is the `B` of the overshoot bound (DESIGN.md §8); refunds and top-ups
/// never lift a lease above it.
pub(super) fn largest_lease(slot: &Slot, max_cost: u64) -> u64 {
    let settings = lease_settings(slot);
    let capacity = u64::try_from(slot.plan.capacity().as_nanos()).unwrap_or(TOKENS);
    ((capacity as f64 * settings.max_fraction) as u64)
        .clamp(1, TOKENS)
        .max(max_cost.min(TOKENS))
}

/// The lease size (nanotokens) for a key spending `demand` nanotokens a second in calls of at
/// most `max_cost`, before the cap of `max_fraction × capacity`:
///
/// - **Sparse** (fewer than one call's cost expected over a lease lifetime): zero. The key gets
///   exactly what its waiting callers need, one batched refill per call, and nothing sits
///   leased for a lifetime only to be given back.
/// - Otherwise the largest of: a refresh interval of demand (what a hot key is sized by); a
///   lifetime of demand, so that a quiet key is refilled about twice per lifetime instead of
///   twice per refresh interval (a quiet key's lease sized to the refresh interval alone was a
///   fraction of one call, and every call waited for a refill); and enough that the part left at
///   the low-water mark serves the calls expected until a refill lands (`landing`), plus one.
fn target_size(demand: f64, max_cost: u64, settings: &LeaseSettings, landing: Duration) -> u64 {
    let cost = max_cost.max(1) as f64;
    let lifetime = demand * settings.ttl.as_secs_f64();
    if lifetime < cost {
        return 0;
    }
    let refresh = demand * settings.refresh.as_secs_f64();
    let until_landed = (demand * landing.as_secs_f64() + cost) / settings.low_water.max(0.01);
    refresh.max(lifetime).max(until_landed) as u64
}

/// Refills `due` slots, one statement per chunk of distinct keys.
async fn refill(leases: &Leases, due: Vec<Arc<Slot>>, returns: &mut Vec<Return>, ids: &mut Ids) {
    // Chunk first, so the round's temporaries stay small however many keys are due.
    for part in due.chunks(CHUNK) {
        refill_chunk(leases, part, returns, ids).await;
    }
}

/// Refills up to [`CHUNK`] slots with one statement.
async fn refill_chunk(
    leases: &Leases,
    part: &[Arc<Slot>],
    returns: &mut Vec<Return>,
    ids: &mut Ids,
) {
    let now = leases.now();
    // How long a refill takes to land: the last round trips, plus a tick for a nudge that was
    // dropped and found by the sweep.
    let landing = leases
        .refill_ns
        .load(Ordering::Relaxed)
        .saturating_add(leases.settings.tick.as_nanos() as u64);
    let mut asks: Vec<(Arc<Slot>, u64, u64, Option<Hold>)> = Vec::with_capacity(part.len());
    let mut keys = HashSet::with_capacity(part.len());
    for slot in part {
        if slot.evicted.load(Ordering::Acquire) {
            continue;
        }
        if !keys.insert(&*slot.key) {
            // Another slot of the same key (evicted and re-created): next round.
            slot.words().request_refill();
            continue;
        }
        match plan_refill(slot, now, landing) {
            Some((min, want)) => {
                let hold = hold(leases, slot, ids);
                asks.push((Arc::clone(slot), min, want, hold));
            }
            None => {
                slot.words().clear_pending();
                slot.notify.notify_waiters();
            }
        }
    }
    drop(keys);
    if asks.is_empty() {
        return;
    }
    {
        let chunk = &asks[..];
        let requests: Vec<AcquireRequest<'_>> = chunk
            .iter()
            .map(|(slot, min, want, hold)| AcquireRequest {
                key: &slot.key,
                bucket: *slot.plan.bucket(),
                min: Tokens::from_nanos(u128::from(*min)),
                want: Tokens::from_nanos(u128::from(*want)),
                step: Tokens::from_nanos(1),
                hold: *hold,
            })
            .collect();
        let sent = leases.now();
        let started = Instant::now();
        leases.counters.store_calls.fetch_add(1, Ordering::AcqRel);
        metrics::counter!(m::DB_CALLS, "kind" => "lease").increment(1);
        let result = leases.store.acquire_many(&requests).await;
        let took = started.elapsed();
        metrics::histogram!(m::REFILL_SECONDS).record(took);
        let took = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        let before = leases.refill_ns.load(Ordering::Relaxed);
        leases
            .refill_ns
            .store(before / 2 + took / 2, Ordering::Relaxed);
        let now = leases.now();
        match result {
            Ok(answers) => {
                for ((slot, _, want, hold), answer) in chunk.iter().zip(answers) {
                    let strict = hold.map(|h| (sent, h.lease_id));
                    apply(leases, slot, *want, &answer, now, strict, returns, ids);
                }
            }
            Err(_) => {
                metrics::counter!(m::DB_ERRORS, "kind" => "lease").increment(1);
                let until = now + FAILURE_BACKOFF.as_nanos() as u64;
                for (slot, _, _, _) in chunk {
                    slot.fallback_until.store(until, Ordering::Release);
                    slot.words().clear_pending();
                    slot.notify.notify_waiters();
                }
            }
        }
    }
}

/// Puts one refill's answer into its slot and wakes the slot's waiters. `strict` is, for a
/// strict lease, when the request was sent and the new lease's id: the store renewed the
/// holder's entry under that id, and the lease expires here one lifetime after sending.
#[allow(clippy::too_many_arguments)]
fn apply(
    leases: &Leases,
    slot: &Arc<Slot>,
    want: u64,
    answer: &crate::store::Acquired,
    now: u64,
    strict: Option<(u64, i64)>,
    returns: &mut Vec<Return>,
    ids: &mut Ids,
) {
    let settings = lease_settings(slot);
    let ttl = settings.ttl.as_nanos() as u64;
    if let Some((sent, lease_id)) = strict {
        let mut book = slot.book.lock();
        book.lease_id = lease_id;
        book.expires_at = sent.saturating_add(ttl);
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
        let wait = retry
            .max(until_want)
            .max(1)
            .saturating_mul(u64::from(streak.min(4)));
        slot.deny_until
            .store(now.saturating_add(wait), Ordering::Release);
        slot.dry.store(true, Ordering::Release);
        slot.words().clear_pending();
    } else {
        leases.counters.leased.fetch_add(granted, Ordering::AcqRel);
        let mut book = slot.book.lock();
        // Split a top-up over a hot key's words only in parts of a few costs each, so that
        // no word is left holding less than a caller needs while the others hold the rest.
        let split_min = book.max_cost.max(1).saturating_mul(HOT_PARTS);
        if slot.words().contended() && book.target >= split_min.saturating_mul(HOT_PARTS) {
            slot.words().spread_out();
        }
        // A lease never holds more than its bound (`largest_lease`): tokens refunded into the
        // word while this refill was in flight would otherwise ride on top of the grant, and a
        // lease that callers keep refunding into would grow past the bound round after round.
        // What does not fit goes back to the store.
        let room = largest_lease(slot, book.max_cost).saturating_sub(slot.words().available());
        let placed = granted.min(room);
        let unplaced = if slot.evicted.load(Ordering::Acquire) {
            granted
        } else {
            (granted - placed) + slot.words().top_up(placed, split_min)
        };
        // `unplaced` can exceed `granted` by tokens a hot key's words held and could not hold
        // again (see `LeaseWords::top_up`); they were credited before and leave now.
        book.credited = (book.credited + granted).saturating_sub(unplaced);
        if strict.is_none() {
            book.expires_at = now.saturating_add(ttl);
            book.spent_at_renewal = book.spent(slot.words().available());
        }
        book.active_at = now;
        // Less than wanted: the bucket is scarce. No background top-up then (it would find the
        // bucket empty); when this lease is spent, callers are denied until a whole lease has
        // refilled, and the next refill asks for all of it.
        let scarce = granted < want;
        book.dry = scarce;
        book.dry_streak = 0;
        let size = book.target.max(slot.words().available());
        let low_water = if scarce {
            0
        } else {
            (size as f64 * settings.low_water) as u64
        };
        slot.hot().low_water.store(low_water, Ordering::Relaxed);
        drop(book);
        let deny_until = if scarce {
            now.saturating_add(until_want)
        } else {
            0
        };
        slot.deny_until.store(deny_until, Ordering::Release);
        slot.fallback_until.store(0, Ordering::Release);
        slot.dry.store(scarce, Ordering::Release);
        let lease = strict.map(|(_, lease_id)| LeaseRef {
            holder: slot.book.lock().holder,
            lease_id,
        });
        queue_return(returns, ids, slot, unplaced, lease);
    }
    slot.notify.notify_waiters();
}

/// Gives reclaimed tokens back, one statement per chunk of distinct keys. Failed returns stay
/// queued with their ids; after [`RETURN_ATTEMPTS`] they count as stranded.
async fn give_back(leases: &Leases, returns: &mut Vec<Return>) {
    let mut pending = std::mem::take(returns);
    while !pending.is_empty() {
        let mut keys = HashSet::new();
        let (batch, rest): (Vec<Return>, Vec<Return>) = pending
            .into_iter()
            .partition(|r| keys.len() < CHUNK && keys.insert(r.slot.key.clone()));
        pending = rest;
        let requests: Vec<GiveBack<'_>> = batch
            .iter()
            .map(|r| GiveBack {
                id: r.id,
                key: &r.slot.key,
                bucket: *r.slot.plan.bucket(),
                amount: Tokens::from_nanos(u128::from(r.amount)),
                lease: r.lease,
            })
            .collect();
        leases.counters.store_calls.fetch_add(1, Ordering::AcqRel);
        metrics::counter!(m::DB_CALLS, "kind" => "return").increment(1);
        let result = leases.store.give_back(&requests).await;
        drop(requests);
        match result {
            Ok(_) => {
                let total: u64 = batch.iter().map(|r| r.amount).sum();
                leases.counters.returned.fetch_add(total, Ordering::AcqRel);
            }
            Err(_) => {
                metrics::counter!(m::DB_ERRORS, "kind" => "return").increment(1);
                for mut r in batch {
                    r.attempts += 1;
                    if r.attempts >= RETURN_ATTEMPTS {
                        leases
                            .counters
                            .stranded
                            .fetch_add(r.amount, Ordering::AcqRel);
                    } else {
                        returns.push(r);
                    }
                }
            }
        }
    }
}

/// Closes every lease, empties the table and gives everything back (retrying each return up
/// to its attempts).
async fn shut_down(leases: &Leases, returns: &mut Vec<Return>, ids: &mut Ids) {
    {
        let table = leases.table.pin();
        for (_, slot) in table.iter() {
            retire(slot, returns, ids);
        }
        table.clear();
    }
    for _ in 0..RETURN_ATTEMPTS {
        if returns.is_empty() {
            break;
        }
        give_back(leases, returns).await;
    }
    for r in returns.drain(..) {
        leases
            .counters
            .stranded
            .fetch_add(r.amount, Ordering::AcqRel);
    }
}
