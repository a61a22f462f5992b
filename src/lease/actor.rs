//! The lease actor: refills, expiry, eviction and give-backs for one lease table.
//!
//! One tokio task per limiter. It sleeps until a caller nudges it, the earliest entry of its
//! due-queue comes, a gauge update is due, or one of its store calls answers, then:
//! 1. gathers the slots that asked for a refill (nudges; after a dropped nudge, one scan of the
//!    table for `PENDING`),
//! 2. handles the due-queue entries due within a tick: closes expired leases (their tokens go
//!    back), evicts keys idle for a lease lifetime after closing, and re-queues the rest,
//! 3. sends what is due to the store per partition of the store (`Store::partition`: a shard
//!    of a `ShardedStore`, or one partition for a single store), each partition its own *lane*:
//!    give-backs first, one statement per 256 keys, alone in the lane, retrying failures with
//!    the same return ids (so a retry never credits twice), then refills, one `acquire_each`
//!    statement per 256 keys, a second to fourth one in flight only while a whole 256 more
//!    wait (a lane that fell behind),
//! 4. applies each statement's answers as soon as that statement answers, whatever the other
//!    lanes are doing: a slow or failing shard delays only its own keys.
//!
//! Its work follows what is due, not the number of keys: a slot is looked at when its lease
//! expires and when its idle check comes, and an idle table with nothing due costs no wake-up.
//!
//! Only the actor adds tokens to a word or takes them back, and a key has one lane, whose
//! refill statements in flight hold distinct slots and never run beside a give-back, so at
//! most one refill is in flight per key, and a return and a refill of one key never overlap.
//! A slot whose refill is in flight is not expired until its answer is applied.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use super::slot::{Ms32, Slot, SlotRef};
use super::timers::Timers;
use super::word::{CLOSED, PENDING, TOKENS};
use super::{GATHER, Leases};
use crate::bucket::Tokens;
use crate::key::SlotKey;
use crate::metrics as m;
use crate::policy::{Accounting, LeaseSettings, Plan};
use crate::store::{AcquireRequest, Acquired, GiveBack, Hold, LeaseRef, StoreError};

/// A contended key's lease is spread over one word per core once its target reaches `HOT_PARTS²`
/// of its largest cost; a top-up is split into parts of at least `HOT_PARTS` costs.
const HOT_PARTS: u64 = 4;
/// A relaxed lease is sized for this many lifetimes of demand (at most `B`): it lives on while
/// it is spent from, so this sets how often a quiet key is refilled (every 16 lifetimes, at the
/// low-water mark), which is what a million quiet keys cost the actor. Its unspent tokens are
/// out of the shared bucket whatever its size, so the overshoot bound (`N·B`) does not change.
const QUIET_LIFETIMES: f64 = 32.0;
/// A strict lease closes at its lifetime and is counted against the bucket until then, so it
/// holds only a few lifetimes of demand.
const QUIET_LIFETIMES_STRICT: f64 = 4.0;
/// A relaxed lease nobody spent from in its last lifetime lives on while its key has been
/// silent for fewer than this many of its expected gaps between calls (`expects_a_call`)...
const SILENT_CALLS: f64 = 4.0;
/// ... and for fewer than this many lifetimes ...
const SILENT_LIFETIMES: f64 = 8.0;
/// ... but at least this many, for any key that has been called since its first call (its demand
/// is above zero): demand is sampled at refills, whose windows end at the call that asked for
/// them, and reads high for a quiet key (a key called once a second, asked 0.3 s after the last
/// sample, reads 3.3 calls a second); gaps of three lifetimes come once in twenty calls of a
/// key called once a lifetime.
const FEWEST_SILENT_LIFETIMES: f64 = 3.0;
/// A relaxed key is sparse (sized no lease) when fewer than this many calls are expected over
/// the longest a relaxed lease lives without a call (`SILENT_LIFETIMES` lifetimes).
const SPARSE_CALLS: f64 = 2.0;
/// The longest refill `waives` compares (nanoseconds): well inside the range of the local clock's
/// 32-bit milliseconds.
const FULL_AT_HORIZON: u64 = 3_600_000_000_000;
/// Keys per store statement.
const CHUNK: usize = 256;
/// Refill statements one lane may have in flight at once, each of distinct slots (a slot is
/// queued in its lane once, and is in at most one statement): the pool's default size, so a lane
/// that fell behind uses every connection instead of one.
const REFILLS_IN_FLIGHT: usize = 4;
/// Attempts at giving a return back before its tokens count as stranded.
const RETURN_ATTEMPTS: u32 = 5;
/// After a failed refill, callers of the key go to the fallback for this long instead of
/// waiting for another refill.
pub(super) const FAILURE_BACKOFF: Duration = Duration::from_millis(100);
/// A table of more keys than this has its outstanding-tokens gauge summed at most once per
/// [`SLOW_PASS`]; a smaller one (a pass of microseconds) as often as once per tick.
const SMALL_TABLE: usize = 4096;
/// The least time between two passes over a large table for the outstanding gauge, and the
/// longest a pass waits for the actor to fall quiet after work.
const SLOW_PASS: u64 = 1_000_000_000;

/// Unused tokens on their way back to the store.
#[derive(Debug)]
pub(super) struct Return {
    id: i64,
    /// The key and its plan, copied from the slot: a queued return does not keep the evicted
    /// slot (176 bytes and its fast-path record) alive while it waits for its lane.
    key: SlotKey,
    plan: Arc<Plan>,
    amount: u64,
    attempts: u32,
    /// The strict lease the return settles; `None` for relaxed leases.
    lease: Option<LeaseRef>,
    /// After a failed attempt: not sent again before this local monotonic time (ns); `0` for
    /// a return not tried yet.
    not_before: u64,
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

/// When the outstanding-tokens gauge is summed next (a pass over every slot): after the actor
/// did work, once it has been quiet for a tick or at the latest [`SLOW_PASS`] after the work
/// began, and never sooner than a tick (a small table) or [`SLOW_PASS`] (a large one) after the
/// previous pass. Nothing changes while the actor does nothing (what callers spend from a live
/// lease aside), so an idle actor makes no pass.
#[derive(Default)]
struct Gauges {
    /// When the actor first did work since the last pass; `None` when it did none.
    dirty_since: Option<u64>,
    /// When the actor last did work.
    worked_at: u64,
    /// When the last pass was made.
    passed_at: u64,
}

impl Gauges {
    fn due(&self, tick: u64, keys: usize) -> Option<u64> {
        let since = self.dirty_since?;
        let gap = if keys > SMALL_TABLE { SLOW_PASS } else { tick };
        let quiet = self
            .worked_at
            .saturating_add(tick)
            .min(since.saturating_add(SLOW_PASS));
        Some(quiet.max(self.passed_at.saturating_add(gap)))
    }
}

/// Clears [`Leases::alive`] when the actor's task ends, however it ends: its loop returned, it
/// panicked, or its runtime was dropped with the task in it.
struct Alive<'a>(&'a Leases);

impl Drop for Alive<'_> {
    fn drop(&mut self) {
        self.0.alive.store(false, Ordering::Release);
        // Whoever awaits an idle actor stops waiting: there is none.
        self.0.went_idle.notify_waiters();
    }
}

/// Returns on their way back. Should the task end before they are sent (its runtime dropped
/// mid-statement), whatever is left goes to [`Leases::carry`] for the next actor: a return
/// whose statement may have reached the store is sent again under the same id, which credits
/// once.
struct Carried<'a> {
    leases: &'a Leases,
    items: Vec<Return>,
}

impl<'a> Carried<'a> {
    fn new(leases: &'a Leases, items: Vec<Return>) -> Self {
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

/// After an actor ended early: every open lease's expiry and every closed lease's idle check go
/// on the new actor's due-queue (the old one's went with it), and the next round looks for
/// every slot that asked for a refill (the old actor's lanes went with it too, so no slot is
/// queued in one).
fn adopt(leases: &Leases, timers: &mut Timers) {
    let now = leases.now();
    let table = leases.table.pin();
    for slot in table.values() {
        slot.hot().queued.store(false, Ordering::Relaxed);
        let closed = slot.words().load() & CLOSED != 0;
        let ttl = lease_settings(slot).ttl.as_nanos() as u64;
        let mut book = slot.book.lock();
        book.armed = false;
        let at = book.next_look(!closed, ttl, now);
        timers.arm(slot, &mut book, at);
    }
    leases.overflowed.store(true, Ordering::Release);
}

/// The actor's loop; ends after giving everything back once the limiter stops. `restarted`
/// when an earlier actor of the same table ended early.
pub(super) async fn run(leases: Arc<Leases>, restarted: bool) {
    let _alive = Alive(&leases);
    let leases: &Leases = &leases;
    let tick = leases.settings.tick.as_nanos() as u64;
    let mut timers = Timers::default();
    if restarted {
        adopt(leases, &mut timers);
    }
    let mut gauges = Gauges::default();
    let carried = std::mem::take(&mut *leases.carry.lock());
    let mut returns = Carried::new(leases, carried);
    let returns = &mut returns.items;
    let mut lanes = Lanes::default();
    let mut ids = Ids {
        hasher: RandomState::new(),
        next: 0,
    };
    loop {
        let wake_at = [
            timers.next(leases.now()),
            gauges.due(tick, leases.table.len()),
            retry_due(returns, leases.now()),
        ]
        .into_iter()
        .flatten()
        .min();
        // A statement's answer wakes the actor too, and is applied at once, whatever the
        // other lanes' statements are doing.
        let mut answered = None;
        // Nothing in flight and nothing to send again: idle until woken (`Leases::until_idle`).
        let idle = lanes.jobs.is_empty() && returns.is_empty() && lanes.inflight.is_empty();
        leases.set_idle(idle);
        match wake_at {
            Some(at) => {
                let deadline = leases.origin + Duration::from_nanos(at.saturating_add(1));
                tokio::select! {
                    () = leases.wake.notified() => {}
                    () = tokio::time::sleep_until(deadline) => {}
                    done = lanes.next(), if !lanes.jobs.is_empty() => answered = Some(done),
                }
            }
            None => tokio::select! {
                () = leases.wake.notified() => {}
                done = lanes.next(), if !lanes.jobs.is_empty() => answered = Some(done),
            },
        }
        leases.set_idle(false);
        if let Some(done) = answered.take() {
            // An answer alone: apply it and give its lane its next statement. Nudges that came
            // meanwhile have left the wake-up's permit, so the next round follows at once.
            finish(leases, done, &mut lanes, &mut timers, returns, &mut ids);
            if leases.stopping.load(Ordering::Acquire) {
                break;
            }
            let now = leases.now();
            dispatch(leases, &mut lanes, &mut timers, returns, &mut ids, now);
            after_work(leases, &mut gauges, tick, true);
            continue;
        }
        if leases.stopping.load(Ordering::Acquire) {
            break;
        }
        // Low-water nudges only, and nothing else due: gather more of them for a moment (their
        // callers are still paid from their leases), so a million quiet keys crossing their marks
        // cost a statement per 256 keys and a wake-up per gathering, not one each. A waiting
        // caller's nudge ends the gathering at once, and so does an answer.
        if leases.soon.load(Ordering::Acquire)
            && !leases.urgent.load(Ordering::Acquire)
            && timers
                .next(leases.now())
                .is_none_or(|at| at > leases.now().saturating_add(tick))
        {
            let until = leases.instant() + GATHER.min(leases.settings.tick);
            tokio::select! {
                () = leases.wake.notified() => {}
                () = tokio::time::sleep_until(until) => {}
                done = lanes.next(), if !lanes.jobs.is_empty() => answered = Some(done),
            }
            if let Some(done) = answered.take() {
                finish(leases, done, &mut lanes, &mut timers, returns, &mut ids);
            }
            if leases.stopping.load(Ordering::Acquire) {
                break;
            }
        }
        // Cleared before the queue is drained: a nudge queued after this wakes the next round.
        leases.urgent.store(false, Ordering::Release);
        leases.soon.store(false, Ordering::Release);
        leases.counters.actor_rounds.fetch_add(1, Ordering::AcqRel);
        let now = leases.now();
        // Straight into the lanes, which hold each slot once: a round that gathers the first
        // calls of a flood of new keys builds no list or set of its own beside them (at 100,000
        // keys those took 2 MB that the allocator then kept).
        let mut nudged = 0usize;
        while let Some(slot) = leases.nudges.pop() {
            let lane = leases.store.partition(&slot.key);
            lanes.queue(lane, slot);
            nudged += 1;
        }
        if leases.overflowed.swap(false, Ordering::AcqRel) {
            nudged += scan_pending(leases, &mut lanes);
        }
        let reload = leases.reload.lock().take();
        let mut looked = match reload {
            Some(stale) => retire_stale(leases, &stale, &mut timers, returns, &mut ids),
            None => 0,
        };
        looked += expire(
            leases,
            &mut timers,
            now,
            tick,
            returns,
            &mut ids,
            &lanes.inflight,
        );
        let worked = looked > 0 || nudged > 0 || !returns.is_empty();
        // Each idle lane's give-backs first, then its refills: a strict lease closed in this
        // round is settled before the same slot's renewal replaces its entry in the store.
        dispatch(leases, &mut lanes, &mut timers, returns, &mut ids, now);
        lanes.shrink();
        after_work(leases, &mut gauges, tick, worked);
    }
    // Statements in flight finish first (each within the store's call timeout): their grants
    // go into slots that are closed next, and their failed returns are sent again below.
    while !lanes.jobs.is_empty() {
        let done = lanes.next().await;
        finish(leases, done, &mut lanes, &mut timers, returns, &mut ids);
    }
    shut_down(leases, returns, &mut ids).await;
    publish_counters(leases);
    publish_outstanding(leases);
}

/// After a round or an answer: publishes the counters if the actor `worked`, and the gauges
/// when their pass is due.
fn after_work(leases: &Leases, gauges: &mut Gauges, tick: u64, worked: bool) {
    let now = leases.now();
    if worked {
        publish_counters(leases);
        gauges.worked_at = now;
        gauges.dirty_since.get_or_insert(now);
    }
    if gauges
        .due(tick, leases.table.len())
        .is_some_and(|at| at <= now)
    {
        publish_outstanding(leases);
        gauges.passed_at = now;
        // Work in this very round may be followed by spends the pass did not see.
        gauges.dirty_since = worked.then_some(now);
    }
}

/// When the earliest return that failed is due to be sent again, if one waits for a time
/// after `now`. One whose time has come waits for its lane only, and the answer that frees the
/// lane sends it: waking for it again would spin while the lane is busy.
fn retry_due(returns: &[Return], now: u64) -> Option<u64> {
    returns
        .iter()
        .map(|r| r.not_before)
        .filter(|&at| at > now)
        .min()
}

/// A store statement of the actor in flight: it owns what it sends, and answers with a
/// [`Done`].
type Job<'a> = Pin<Box<dyn Future<Output = Done> + Send + 'a>>;

/// One slot's refill request: the slot, the least and the most it asks for (nanotokens), its
/// strict lease's renewal, and the target lease size it was planned for (nanotokens; read when
/// its answer is applied, carried here rather than kept in every slot's book).
type Ask = (SlotRef, u64, u64, Option<Hold>, u64);

/// A statement's answer, back on the actor.
struct Done {
    /// The partition the statement went to.
    lane: usize,
    work: Answered,
}

/// What a statement was, and what the store answered.
enum Answered {
    /// A refill: the asks sent, one answer per ask.
    Refill {
        asks: Vec<Ask>,
        result: Vec<Result<Acquired, StoreError>>,
        /// When the request was sent (local monotonic ns; taken before it was built).
        sent: u64,
        took: Duration,
    },
    /// A give-back: the returns sent, one outcome per return.
    Return {
        batch: Vec<Return>,
        result: Vec<Result<(), StoreError>>,
    },
}

/// One store partition's work: its statements in flight (one give-back alone, or up to
/// [`REFILLS_IN_FLIGHT`] refills of distinct slots), and the slots waiting for a
/// refill behind it.
#[derive(Default)]
struct Lane {
    /// Refill statements of this lane in flight (at most [`REFILLS_IN_FLIGHT`]).
    refills: usize,
    /// A give-back statement of this lane is in flight: it runs alone.
    returning: bool,
    /// Slots waiting for a refill, in the order they asked; each once (its record's
    /// `queued` flag says it is here).
    due: VecDeque<SlotRef>,
}

impl Lane {
    /// A statement of this lane is in flight.
    fn busy(&self) -> bool {
        self.returning || self.refills > 0
    }

    /// Whether another refill statement may start: never beside a give-back (a strict lease's
    /// return is settled before its key's renewal); the first whenever slots wait; more, up to
    /// [`REFILLS_IN_FLIGHT`], only while a whole [`CHUNK`] waits, so that a lane that keeps up
    /// still sends one statement of every slot that asked meanwhile, and only a lane that
    /// falls behind (the first calls of a flood of new keys) spreads over more connections.
    fn may_refill(&self) -> bool {
        !self.returning
            && match self.refills {
                0 => !self.due.is_empty(),
                n => n < REFILLS_IN_FLIGHT && self.due.len() >= CHUNK,
            }
    }
}

/// The actor's lanes, one per store partition with work (`Store::partition`), and their
/// statements in flight. A lane with nothing in flight and nothing waiting is dropped, so
/// there are at most as many as partitions with work, and a lane holds each slot once.
#[derive(Default)]
struct Lanes<'a> {
    /// By partition.
    lanes: HashMap<usize, Lane>,
    /// Slots whose refill is in flight, by address: not expired until it is applied.
    inflight: HashSet<usize>,
    /// The statements in flight: per lane, one give-back or up to [`REFILLS_IN_FLIGHT`] refills.
    jobs: Vec<Job<'a>>,
}

impl<'a> Lanes<'a> {
    /// Whether `lane` has a statement in flight.
    fn busy(&self, lane: usize) -> bool {
        self.lanes.get(&lane).is_some_and(Lane::busy)
    }

    /// Gives memory back after a burst of refills (the first calls of a flood of new keys):
    /// the set of slots in flight, and each lane's queue, keep the capacity of their largest
    /// burst otherwise (1 MB for 100,000 new keys, kept while the lane has work).
    fn shrink(&mut self) {
        let capacity = self.inflight.capacity();
        if capacity > 1024 && self.inflight.len() < capacity / 4 {
            self.inflight.shrink_to(self.inflight.len() * 2);
        }
        for lane in self.lanes.values_mut() {
            let capacity = lane.due.capacity();
            if capacity > 1024 && lane.due.len() < capacity / 4 {
                lane.due.shrink_to(lane.due.len() * 2);
            }
        }
    }

    /// Queues `slot` for a refill on `lane`, unless it waits in a lane already.
    fn queue(&mut self, lane: usize, slot: SlotRef) {
        // Relaxed: the flag is the actor's own (set here, cleared when the slot leaves its lane).
        if !slot.hot().queued.swap(true, Ordering::Relaxed) {
            self.lanes.entry(lane).or_default().due.push_back(slot);
        }
    }

    /// Takes up to `n` slots off the front of `lane`'s queue: a slot nudged from now on is
    /// queued again.
    fn take(&mut self, lane: usize, n: usize) -> Vec<SlotRef> {
        let Some(l) = self.lanes.get_mut(&lane) else {
            return Vec::new();
        };
        let n = l.due.len().min(n);
        let part: Vec<SlotRef> = l.due.drain(..n).collect();
        for slot in &part {
            slot.hot().queued.store(false, Ordering::Relaxed);
        }
        part
    }

    /// Starts `job` on `lane`: a give-back (`returning`) or a refill.
    fn start(&mut self, leases: &Leases, lane: usize, returning: bool, job: Job<'a>) {
        let l = self.lanes.entry(lane).or_default();
        if returning {
            l.returning = true;
        } else {
            l.refills += 1;
        }
        self.jobs.push(job);
        leases.busy.store(true, Ordering::Relaxed);
    }

    /// The next statement to answer (pending for ever when none is in flight).
    fn next(&mut self) -> impl Future<Output = Done> + '_ {
        std::future::poll_fn(move |cx: &mut Context<'_>| {
            for i in 0..self.jobs.len() {
                if let Poll::Ready(done) = self.jobs[i].as_mut().poll(cx) {
                    drop(self.jobs.swap_remove(i));
                    return Poll::Ready(done);
                }
            }
            Poll::Pending
        })
    }

    /// Drops the lanes with nothing to do, and says whether a statement is in flight.
    fn tidy(&mut self, leases: &Leases) {
        self.lanes.retain(|_, l| l.busy() || !l.due.is_empty());
        leases.busy.store(!self.jobs.is_empty(), Ordering::Relaxed);
    }
}

/// Starts a statement on every idle lane with work: up to [`CHUNK`] of its returns whose time
/// has come, else a refill of up to [`CHUNK`] of its waiting slots. Slots that need nothing
/// are done with at once.
fn dispatch<'a>(
    leases: &'a Leases,
    lanes: &mut Lanes<'a>,
    timers: &mut Timers,
    returns: &mut Vec<Return>,
    ids: &mut Ids,
    now: u64,
) {
    if !returns.is_empty() {
        let mut batches: HashMap<usize, (HashSet<SlotKey>, Vec<Return>)> = HashMap::new();
        let mut rest = Vec::new();
        for r in returns.drain(..) {
            let lane = leases.store.partition(&r.key);
            if r.not_before > now || lanes.busy(lane) {
                rest.push(r);
                continue;
            }
            let (keys, batch) = batches.entry(lane).or_default();
            if keys.len() < CHUNK && keys.insert(r.key.clone()) {
                batch.push(r);
            } else {
                rest.push(r);
            }
        }
        *returns = rest;
        for (lane, (_, batch)) in batches {
            leases.counters.store_calls.fetch_add(1, Ordering::AcqRel);
            metrics::counter!(m::DB_CALLS, "kind" => "return").increment(1);
            lanes.start(leases, lane, true, give_back_job(leases, lane, batch));
        }
    }
    let ready: Vec<usize> = lanes
        .lanes
        .iter()
        .filter(|(_, l)| l.may_refill())
        .map(|(&lane, _)| lane)
        .collect();
    for lane in ready {
        // Slots whose refill is still in flight in another statement of the lane: queued
        // again after this round, so that a key has one refill in flight at a time.
        let mut later = Vec::new();
        while lanes.lanes.get(&lane).is_some_and(Lane::may_refill) {
            let mut part = lanes.take(lane, CHUNK);
            if part.is_empty() {
                break;
            }
            if lanes.lanes.get(&lane).is_some_and(|l| l.refills > 0) {
                part.retain(|slot| {
                    let busy = lanes.inflight.contains(&(SlotRef::as_ptr(slot) as usize));
                    if busy {
                        later.push(SlotRef::clone(slot));
                    }
                    !busy
                });
            }
            let asks = plan_chunk(leases, &part, timers, ids);
            if asks.is_empty() {
                continue;
            }
            for (slot, ..) in &asks {
                lanes.inflight.insert(SlotRef::as_ptr(slot) as usize);
            }
            leases.counters.store_calls.fetch_add(1, Ordering::AcqRel);
            metrics::counter!(m::DB_CALLS, "kind" => "lease").increment(1);
            lanes.start(leases, lane, false, refill_job(leases, lane, asks));
        }
        for slot in later {
            lanes.queue(lane, slot);
        }
    }
    lanes.tidy(leases);
}

/// Sends one refill statement.
fn refill_job(leases: &Leases, lane: usize, asks: Vec<Ask>) -> Job<'_> {
    let sent = leases.now();
    Box::pin(async move {
        let requests: Vec<AcquireRequest<'_>> = asks
            .iter()
            .map(|(slot, min, want, hold, _)| AcquireRequest {
                key: &slot.key,
                bucket: *slot.plan.bucket(),
                min: Tokens::from_nanos(u128::from(*min)),
                want: Tokens::from_nanos(u128::from(*want)),
                step: Tokens::from_nanos(1),
                hold: *hold,
            })
            .collect();
        let started = leases.instant();
        // One answer per key: a sharded store fails only the keys of a failing shard.
        let result = leases.store.acquire_each(&requests).await;
        let took = leases.instant().saturating_duration_since(started);
        drop(requests);
        Done {
            lane,
            work: Answered::Refill {
                asks,
                result,
                sent,
                took,
            },
        }
    })
}

/// The store's requests for `returns`, borrowing their keys.
fn give_back_requests(returns: &[Return]) -> Vec<GiveBack<'_>> {
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

/// Sends one give-back statement. Its returns are held in a guard until it answers: an actor
/// that ends mid-statement leaves them to the next one.
fn give_back_job(leases: &Leases, lane: usize, batch: Vec<Return>) -> Job<'_> {
    let mut batch = Carried::new(leases, batch);
    Box::pin(async move {
        let requests = give_back_requests(&batch.items);
        // One outcome per return: a sharded store fails only the returns of a failing shard.
        let result = leases.store.give_back_each(&requests).await;
        drop(requests);
        Done {
            lane,
            work: Answered::Return {
                batch: std::mem::take(&mut batch.items),
                result,
            },
        }
    })
}

/// Applies one statement's answers. A refill's grants go into their slots (a key whose store
/// failed sends its callers to the fallback for [`FAILURE_BACKOFF`]) and each slot is queued
/// on the due-queue; a give-back's failed returns are sent again a tick later, under the same
/// ids, and count as stranded after [`RETURN_ATTEMPTS`].
fn finish(
    leases: &Leases,
    done: Done,
    lanes: &mut Lanes<'_>,
    timers: &mut Timers,
    returns: &mut Vec<Return>,
    ids: &mut Ids,
) {
    if let Some(l) = lanes.lanes.get_mut(&done.lane) {
        match done.work {
            Answered::Refill { .. } => l.refills = l.refills.saturating_sub(1),
            Answered::Return { .. } => l.returning = false,
        }
    }
    match done.work {
        Answered::Refill {
            asks,
            result,
            sent,
            took,
        } => {
            metrics::histogram!(m::REFILL_SECONDS).record(took);
            let took = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
            let before = leases.refill_ns.load(Ordering::Relaxed);
            leases
                .refill_ns
                .store(before / 2 + took / 2, Ordering::Relaxed);
            let now = leases.now();
            let short = result.len() != asks.len();
            if short || result.iter().any(Result::is_err) {
                metrics::counter!(m::DB_ERRORS, "kind" => "lease").increment(1);
            }
            let until = now + FAILURE_BACKOFF.as_nanos() as u64;
            // Credit (`Leases::credit`) is given only while refills answer; a refill that timed
            // out while a newer one answered is late, not failed (`late.rs`).
            let late = leases.refill_outcome(sent, short, &result, now);
            let mut answers = result.into_iter();
            for (slot, _, want, hold, target) in &asks {
                lanes.inflight.remove(&(SlotRef::as_ptr(slot) as usize));
                match answers.next() {
                    Some(Ok(answer)) if !short => {
                        let strict = hold.map(|h| (sent, h.lease_id));
                        apply(
                            leases, slot, *want, *target, &answer, now, strict, returns, ids,
                        );
                    }
                    // Late: the waiters ask again and go on waiting; credit owed is asked for.
                    _ if late && hold.is_none() => {
                        slot.words().clear_pending();
                        slot.notify().notify_waiters();
                        if leases.owed_by(slot) > 0 && slot.words().request_refill() {
                            leases.nudge_soon(slot);
                        }
                    }
                    _ => {
                        slot.fallback_until.store(until, Ordering::Release);
                        slot.words().clear_pending();
                        slot.notify().notify_waiters();
                    }
                }
                schedule(timers, slot, now);
            }
        }
        Answered::Return { batch, result } => {
            let short = result.len() != batch.len();
            if short || result.iter().any(Result::is_err) {
                metrics::counter!(m::DB_ERRORS, "kind" => "return").increment(1);
            }
            let retry_at = leases
                .now()
                .saturating_add(leases.settings.tick.as_nanos() as u64)
                .max(1);
            let mut outcomes = result.into_iter();
            let mut credited = 0u64;
            for mut r in batch {
                match outcomes.next() {
                    Some(Ok(())) if !short => credited += r.amount,
                    _ => {
                        r.attempts += 1;
                        if r.attempts >= RETURN_ATTEMPTS {
                            leases
                                .counters
                                .stranded
                                .fetch_add(r.amount, Ordering::AcqRel);
                        } else {
                            r.not_before = retry_at;
                            returns.push(r);
                        }
                    }
                }
            }
            if credited > 0 {
                leases
                    .counters
                    .returned
                    .fetch_add(credited, Ordering::AcqRel);
            }
        }
    }
    lanes.tidy(leases);
}

/// Sets the table-size gauge and the token counters (no pass over the slots).
fn publish_counters(leases: &Leases) {
    // Whole tokens, rounded as `Leases::stats` rounds them.
    let whole = |n: &std::sync::atomic::AtomicU64| (n.load(Ordering::Acquire) as f64 / 1e9) as u64;
    let c = &leases.counters;
    metrics::gauge!(m::TABLE_KEYS).set(leases.table.len() as f64);
    metrics::counter!(m::TOKENS_LEASED).absolute(whole(&c.leased));
    metrics::counter!(m::TOKENS_RETURNED).absolute(whole(&c.returned));
    metrics::counter!(m::TOKENS_STRANDED).absolute(whole(&c.stranded));
    metrics::counter!(m::TOKENS_WAIVED).absolute(whole(&c.waived));
}

/// Sets the lease gauges and token counters from the exact counters, summing what every live
/// lease holds (a pass over the table).
fn publish_outstanding(leases: &Leases) {
    let stats = leases.stats();
    leases
        .counters
        .actor_visits
        .fetch_add(stats.keys as u64, Ordering::AcqRel);
    metrics::gauge!(m::OUTSTANDING).set(stats.outstanding);
    metrics::gauge!(m::OUTSTANDING_BOUND).set(stats.outstanding_bound);
    metrics::gauge!(m::TABLE_KEYS).set(stats.keys as f64);
    metrics::counter!(m::TOKENS_LEASED).absolute(stats.leased as u64);
    metrics::counter!(m::TOKENS_RETURNED).absolute(stats.returned as u64);
    metrics::counter!(m::TOKENS_STRANDED).absolute(stats.stranded as u64);
    metrics::counter!(m::TOKENS_WAIVED).absolute(stats.waived as u64);
}

/// After a dropped nudge: queues every slot that asked for a refill (by its `PENDING` bit) on
/// its lane, and says how many it found.
fn scan_pending(leases: &Leases, lanes: &mut Lanes<'_>) -> usize {
    let table = leases.table.pin();
    let (mut visited, mut pending) = (0u64, 0usize);
    for slot in table.values() {
        visited += 1;
        if slot.words().load() & PENDING != 0 {
            lanes.queue(leases.store.partition(&slot.key), SlotRef::clone(slot));
            pending += 1;
        }
    }
    leases
        .counters
        .actor_visits
        .fetch_add(visited, Ordering::AcqRel);
    pending
}

/// Handles the due-queue entries due within a tick of `now`: closes expired leases, evicts keys
/// that stayed idle for a lease lifetime after closing, and queues every other slot again for
/// its next due time. A slot whose refill is in flight (`inflight`) is left alone: applying
/// the answer queues it again. Returns how many entries it handled.
fn expire(
    leases: &Leases,
    timers: &mut Timers,
    now: u64,
    tick: u64,
    returns: &mut Vec<Return>,
    ids: &mut Ids,
    inflight: &HashSet<usize>,
) -> u64 {
    // Everything due within the next tick is handled now, up to a tick early: entries close
    // together cost one wake-up, not one each.
    let horizon = now.saturating_add(tick);
    let mut evict = Vec::new();
    let mut looked = 0u64;
    while let Some((entry_at, slot)) = timers.pop_due(horizon) {
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
                leases
                    .counters
                    .waived
                    .fetch_add(reclaimed, Ordering::AcqRel);
            } else {
                queue_return(returns, ids, &slot, reclaimed, || slot.strict_lease());
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
        timers.arm(&slot, &mut book, next.max(horizon.saturating_add(1)));
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
                retire(leases, removed, returns, ids);
            }
        }
        // A view rebuilds at most once, so a large batch of evictions leaves most of its keys as
        // tombstones, each holding its slot. Once this view (and the arrays it pinned) is gone,
        // rebuild again if they pass the table's share, so a flood's dead slots are freed now and
        // not at the next batch's first eviction (E4's peak heap).
        drop(table);
        leases.table.pin().compact();
        timers.shrink();
    }
    looked
}

/// After a policy reload: retires every slot whose lease `stale` names (its plan changed or
/// was removed, or its key's rule names another plan now). Returns how many slots it looked at.
fn retire_stale(
    leases: &Leases,
    stale: &super::Stale,
    timers: &mut Timers,
    returns: &mut Vec<Return>,
    ids: &mut Ids,
) -> u64 {
    let table = leases.table.pin();
    let mut gone = Vec::new();
    let mut looked = 0u64;
    for (_, slot) in table.iter() {
        looked += 1;
        let by_key = slot.hot().plan.load(Ordering::Relaxed) != super::slab::NO_PLAN;
        if (stale.0)(&slot.key, &slot.plan, by_key) {
            gone.push(SlotRef::clone(slot));
        }
    }
    for slot in &gone {
        if let Some(removed) = table.remove(&slot.key) {
            retire(leases, removed, returns, ids);
        }
    }
    drop(table);
    if !gone.is_empty() {
        leases.table.pin().compact();
        timers.shrink();
    }
    leases
        .counters
        .actor_visits
        .fetch_add(looked, Ordering::AcqRel);
    looked
}

/// Queues `slot` on the due-queue after a refill round (whatever its answer), unless it has an
/// entry due no later: at its lease's expiry if it has a live lease, else at its idle check.
fn schedule(timers: &mut Timers, slot: &SlotRef, now: u64) {
    if slot.evicted().load(Ordering::Acquire) {
        return;
    }
    let live = slot.words().load() & CLOSED == 0;
    let ttl = lease_settings(slot).ttl.as_nanos() as u64;
    let mut book = slot.book.lock();
    let at = book.next_look(live, ttl, now);
    timers.arm(slot, &mut book, at);
}

/// At a relaxed lease's expiry: if callers spent from it during its lifetime, or its key is
/// still expected to be called soon (`expects_a_call`), it lives another lifetime instead of
/// closing, and `true` is returned. A relaxed lease's unspent tokens are
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
/// admitted beyond the bound of §8, which waived tokens only lower. A strict lease is always
/// settled: its tokens are counted against the bucket until then (§13).
fn waives(slot: &Slot, book: &super::slot::Book, now: u64) -> bool {
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

/// Whether a relaxed lease nobody spent from during its last lifetime is still expected to be
/// called soon: its key's demand says a call comes every `1 / rate`, and it has been silent
/// (since the actor last saw it spend) for less than [`SILENT_CALLS`] such gaps, kept between
/// [`FEWEST_SILENT_LIFETIMES`] and [`SILENT_LIFETIMES`] lifetimes. A key with no demand (never
/// called since its first call) closes at its lifetime. A key called about once a lifetime misses a whole lifetime
/// about a third of the time; closing its lease then sent its next call to wait for a refill,
/// and cost the store a statement to take a new lease (and, before `waives`, one to give the
/// old one back) about every third call. A key whose demand was high and stopped is silent for
/// many of its gaps within a lifetime and closes at its expiry as before.
fn expects_a_call(book: &super::slot::Book, settings: &LeaseSettings, now: u64) -> bool {
    let cost = book.max_cost.get().max(1) as f64;
    let calls_per_ns = f64::from(book.demand) / cost / 1e9;
    if calls_per_ns <= 0.0 {
        return false;
    }
    let silent = now.saturating_sub(book.active_at.near(now)) as f64;
    let ttl = settings.ttl.as_nanos() as f64;
    let allowed =
        (SILENT_CALLS / calls_per_ns).clamp(ttl * FEWEST_SILENT_LIFETIMES, ttl * SILENT_LIFETIMES);
    silent < allowed
}

/// Queues `amount` nanotokens of `slot` to go back to the store, under a fresh return id,
/// settling the strict lease `lease` gives, if there is one. `lease` is asked only when there
/// is something to give back: the slot's strict lease sits behind the slab's free-list lock,
/// and most closes of a quiet key's lease give back nothing.
fn queue_return(
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
fn retire(leases: &Leases, slot: &SlotRef, returns: &mut Vec<Return>, ids: &mut Ids) {
    leases.mark_removed(&slot.key);
    slot.evicted().store(true, Ordering::Release);
    leases.write_off_credit(slot);
    let reclaimed = slot.words().close();
    slot.book.lock().reclaimed.add(reclaimed);
    queue_return(returns, ids, slot, reclaimed, || slot.strict_lease());
    slot.notify().notify_waiters();
}

fn lease_settings(slot: &Slot) -> LeaseSettings {
    slot.plan.lease().copied().unwrap_or_default()
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

/// Samples a slot's demand (nanotokens a second) if the last sample is at least `least` ns old:
/// what was spent since, over the time since, averaged with the estimate so far. Refills
/// sample (at least a millisecond apart), and so does a relaxed lease's expiry when a whole
/// lifetime has passed since, so a lease nobody spends from sees its key's estimate fall.
fn sample_demand(
    book: &mut super::slot::Book,
    available: u64,
    now: u64,
    least: u64,
    settings: &LeaseSettings,
) {
    let elapsed = now.saturating_sub(book.sampled_at.get());
    if elapsed >= least.max(1) {
        let spent = book.spent(available);
        let rate = (spent - book.spent_at_sample.get().min(spent)) as f64 * 1e9 / elapsed as f64;
        book.demand = if book.demand == 0.0 {
            rate as f32
        } else {
            (0.5 * f64::from(book.demand) + 0.5 * rate) as f32
        };
        book.watched |= elapsed >= settings.ttl.as_nanos() as u64;
        book.sampled_at.set(now);
        book.spent_at_sample.set(spent);
    }
}

/// What one slot asks the store for: (min, want) in nanotokens, with the target lease size
/// they come from, or `None` when nothing is needed. Samples the slot's demand.
///
/// Credit the slot owes (`owed`, `Leases::credit`) is asked for on top of both: the grant
/// pays it first (`apply`).
fn plan_refill(slot: &Slot, now: u64, landing: u64, owed: u64) -> Option<(u64, u64, u64)> {
    let settings = lease_settings(slot);
    let largest = largest_lease(slot, 0);
    let available = slot.words().available();
    let needed = slot.needed.swap(0, Ordering::AcqRel);
    let waiting = slot.waiting.swap(0, Ordering::AcqRel);
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
    // nothing.
    let min = if want == 0 {
        0
    } else if book.dry {
        want
    } else if needed > 0 {
        needed.clamp(1, want)
    } else {
        (want / 2).clamp(1, want)
    };
    Some((min.saturating_add(owed), want.saturating_add(owed), target))
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
/// - **Sparse** (fewer than one call's cost expected over a strict lease's lifetime, or fewer
///   than [`SPARSE_CALLS`] over the [`SILENT_LIFETIMES`] a relaxed one may live): zero. The key gets
///   exactly what its waiting callers need, one batched refill per call, and nothing sits
///   leased for a lifetime only to be given back.
/// - Otherwise the largest of: a refresh interval of demand (what a hot key is sized by); a few
///   lifetimes of demand ([`QUIET_LIFETIMES`]), so that a quiet key is refilled every couple of
///   lifetimes instead of twice per refresh interval (a quiet key's lease sized to the refresh interval alone was a
///   fraction of one call, and every call waited for a refill); and enough that the part left at
///   the low-water mark serves the calls expected until a refill lands (`landing`), plus one.
fn target_size(demand: f64, max_cost: u64, settings: &LeaseSettings, landing: Duration) -> u64 {
    let cost = max_cost.max(1) as f64;
    let lifetime = demand * settings.ttl.as_secs_f64();
    // What a lease may serve before it closes: a relaxed one lives on through up to
    // `SILENT_LIFETIMES` silent lifetimes of a key still expected to call (`expects_a_call`),
    // and its unspent tokens are mostly waived, not returned (`waives`).
    let longest = match settings.accounting {
        Accounting::Relaxed => lifetime * SILENT_LIFETIMES / SPARSE_CALLS,
        Accounting::Strict => lifetime,
    };
    if longest < cost {
        return 0;
    }
    let refresh = demand * settings.refresh.as_secs_f64();
    // A lease spent from during its lifetime lives on (`renew_if_spent`), so a quiet key's lease
    // is sized for a few lifetimes: its refills come every couple of lifetimes, and a million
    // quiet keys cost the actor hundreds of thousands of refills a second, not millions.
    let lifetime = lifetime
        * match settings.accounting {
            Accounting::Relaxed => QUIET_LIFETIMES,
            Accounting::Strict => QUIET_LIFETIMES_STRICT,
        };
    let until_landed = (demand * landing.as_secs_f64() + cost) / settings.low_water.max(0.01);
    refresh.max(lifetime).max(until_landed) as u64
}

/// Plans the refill of up to [`CHUNK`] slots of one lane: what each asks the store for (one
/// ask per distinct key). A slot that needs nothing has its pending mark cleared and its waiters
/// woken, and is queued on the due-queue at once; the asked slots are queued when the answer is
/// applied.
fn plan_chunk(leases: &Leases, part: &[SlotRef], timers: &mut Timers, ids: &mut Ids) -> Vec<Ask> {
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
            Some((min, want, target)) => {
                let hold = hold(leases, slot, ids);
                asks.push((SlotRef::clone(slot), min, want, hold, target));
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

/// Puts one refill's answer into its slot and wakes the slot's waiters. `strict` is, for a
/// strict lease, when the request was sent and the new lease's id: the store renewed the
/// holder's entry under that id, and the lease expires here one lifetime after sending.
#[allow(clippy::too_many_arguments)]
fn apply(
    leases: &Leases,
    slot: &SlotRef,
    want: u64,
    target: u64,
    answer: &crate::store::Acquired,
    now: u64,
    strict: Option<(u64, i64)>,
    returns: &mut Vec<Return>,
    ids: &mut Ids,
) {
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
        let wait = retry
            .max(until_want)
            .max(1)
            .saturating_mul(u64::from(streak.min(4)));
        slot.deny_until
            .store(now.saturating_add(wait), Ordering::Release);
        slot.dry().store(true, Ordering::Release);
        slot.words().clear_pending();
    } else {
        leases.counters.leased.fetch_add(granted, Ordering::AcqRel);
        let mut book = slot.book.lock();
        // Split a top-up over a hot key's words only in parts of a few costs each, so that
        // no word is left holding less than a caller needs while the others hold the rest.
        let split_min = book.max_cost.get().max(1).saturating_mul(HOT_PARTS);
        if slot.words().contended() && target >= split_min.saturating_mul(HOT_PARTS) {
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
        let size = target.max(slot.words().available());
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
        slot.dry().store(scarce, Ordering::Release);
        // The strict lease as renewed above (holder and this answer's lease id).
        queue_return(returns, ids, slot, unplaced, || {
            strict.and_then(|_| slot.strict_lease())
        });
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
        metrics::counter!(m::DB_CALLS, "kind" => "return").increment(1);
        leases.busy.store(true, Ordering::Relaxed);
        // One outcome per return: a sharded store fails only the returns of a failing shard.
        let result = leases.store.give_back_each(&requests).await;
        leases.busy.store(false, Ordering::Relaxed);
        drop(requests);
        let short = result.len() != batch.items.len();
        if short || result.iter().any(Result::is_err) {
            metrics::counter!(m::DB_ERRORS, "kind" => "return").increment(1);
        }
        let mut outcomes = result.into_iter();
        let mut credited = 0u64;
        for mut r in batch.items.drain(..) {
            match outcomes.next() {
                Some(Ok(())) if !short => credited += r.amount,
                _ => {
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
        if credited > 0 {
            leases
                .counters
                .returned
                .fetch_add(credited, Ordering::AcqRel);
        }
    }
}

/// [`Limiter::shutdown`](crate::Limiter::shutdown) after the actor ended early: closes every
/// lease and gives everything back (what the actor left included) on the caller's runtime.
pub(super) async fn shut_down_here(leases: &Leases) {
    let mut ids = Ids {
        hasher: RandomState::new(),
        next: 0,
    };
    let carried = std::mem::take(&mut *leases.carry.lock());
    let mut returns = Carried::new(leases, carried);
    shut_down(leases, &mut returns.items, &mut ids).await;
    publish_counters(leases);
    publish_outstanding(leases);
}

/// Closes every lease, empties the table and gives everything back (retrying each return up
/// to its attempts).
async fn shut_down(leases: &Leases, returns: &mut Vec<Return>, ids: &mut Ids) {
    {
        let table = leases.table.pin();
        for (_, slot) in table.iter() {
            retire(leases, slot, returns, ids);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::slab::Slab;
    use crate::lease::slot::test_slot;

    /// A lane holds each slot once, however often it is queued, until it is taken off the
    /// lane; then it can be queued again. Slots keep their order.
    #[test]
    fn a_lane_holds_each_slot_once_until_it_is_taken() {
        let slab = Slab::new(16);
        let (a, b) = (test_slot(&slab, "a"), test_slot(&slab, "b"));
        let mut lanes = Lanes::default();
        for _ in 0..3 {
            lanes.queue(0, SlotRef::clone(&a));
            lanes.queue(0, SlotRef::clone(&b));
        }
        lanes.queue(1, SlotRef::clone(&a));
        assert_eq!(lanes.lanes[&0].due.len(), 2);
        assert!(!lanes.lanes.contains_key(&1), "a waits in lane 0 already");
        let first = lanes.take(0, 1);
        assert!(SlotRef::ptr_eq(&first[0], &a));
        lanes.queue(0, SlotRef::clone(&b));
        lanes.queue(0, SlotRef::clone(&a));
        let rest = lanes.take(0, CHUNK);
        assert_eq!(rest.len(), 2);
        assert!(SlotRef::ptr_eq(&rest[0], &b) && SlotRef::ptr_eq(&rest[1], &a));
        assert!(lanes.take(0, CHUNK).is_empty());
        assert!(lanes.take(7, CHUNK).is_empty(), "a lane never used");
    }
}
