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
//!    wait (a lane that fell behind); lanes that keep up take turns, so that each statement
//!    carries about what one store's lane's would,
//! 4. applies each statement's answers as soon as that statement answers, whatever the other
//!    lanes are doing: a slow or failing shard delays only its own keys (and another lane's
//!    turn by at most two of that lane's statement times).
//!
//! Its work follows what is due, not the number of keys: a slot is looked at when its lease
//! expires and when its idle check comes, and an idle table with nothing due costs no wake-up.
//!
//! Only the actor adds tokens to a word or takes them back, and a key has one lane, whose
//! refill statements in flight hold distinct slots and never run beside a give-back, so at
//! most one refill is in flight per key, and a return and a refill of one key never overlap.
//! A slot whose refill is in flight is not expired until its answer is applied.
//!
//! This file holds the actor as a type, [`Actor`], which owns its state (the lanes, and the
//! [`State`] every phase shares: the table, the due-queue, the returns to send, the ids) and
//! has a method for each phase of its loop: sleep until something is due, apply an answer,
//! gather nudges, a round, stop; beside it its gauges, and what takes over when a task ends
//! early (`adopt`, `shut_down_here`). The phases' parts in the other files take the `State`
//! (and the lanes) rather than its fields one by one. The actor's other files, their
//! roles and which way they depend on each other are in DESIGN.md, "The layers".

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::slot::{Slot, SlotRef};
use super::timers::Timers;
use super::word::{CLOSED, PENDING};
use super::{GATHER, Leases};
use crate::metrics as m;
use crate::policy::LeaseSettings;

mod expiry;
mod lanes;
mod refill;
mod returns;
mod sizing;

use expiry::{expire, retire_stale};
use lanes::{Done, Lanes, dispatch, finish};
use returns::{Carried, Ids, shut_down};

pub(super) use returns::Return;
pub(super) use sizing::largest_lease;

/// Keys per store statement.
const CHUNK: usize = 256;

/// After a failed refill, callers of the key go to the fallback for this long instead of
/// waiting for another refill.
pub(super) const FAILURE_BACKOFF: Duration = Duration::from_millis(100);
/// A table of more keys than this has its outstanding-tokens gauge summed at most once per
/// [`SLOW_PASS`]; a smaller one (a pass of microseconds) as often as once per tick.
const SMALL_TABLE: usize = 4096;
/// The least time between two passes over a large table for the outstanding gauge, and the
/// longest a pass waits for the actor to fall quiet after work.
const SLOW_PASS: u64 = 1_000_000_000;

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

/// What every phase of the actor reads and writes beside its lanes: the table, the due-queue,
/// the give-backs waiting to be sent (held in a guard that hands them to the next actor if this
/// one ends early) and the ids of returns and strict leases.
struct State<'a> {
    leases: &'a Leases,
    timers: Timers,
    returns: Carried<'a>,
    ids: Ids,
}

impl<'a> State<'a> {
    /// `leases`' state for a new actor, with what an actor that ended early left to give back.
    fn new(leases: &'a Leases) -> Self {
        let carried = std::mem::take(&mut *leases.carry.lock());
        State {
            leases,
            timers: Timers::default(),
            returns: Carried::new(leases, carried),
            ids: Ids::new(),
        }
    }
}

/// The lease actor of one table: its state, owned, and the phases of its loop as methods
/// (sleep until something is due, apply an answer, gather nudges, a round). See the
/// [module docs](self).
struct Actor<'a> {
    state: State<'a>,
    lanes: Lanes<'a>,
    gauges: Gauges,
    counts: CountsFlush,
    /// The table's tick (ns).
    tick: u64,
}

impl<'a> Actor<'a> {
    /// The actor of `leases`; `restarted` when an earlier actor of the same table ended early.
    fn new(leases: &'a Leases, restarted: bool) -> Self {
        let mut state = State::new(leases);
        if restarted {
            adopt(leases, &mut state.timers);
        }
        Actor {
            state,
            lanes: Lanes::default(),
            gauges: Gauges::default(),
            counts: CountsFlush::default(),
            tick: leases.settings.tick.as_nanos() as u64,
        }
    }

    fn stopping(&self) -> bool {
        self.state.leases.stopping.load(Ordering::Acquire)
    }

    /// The next time something is due without a wake-up: a due-queue entry, a gauge pass, a
    /// give-back to send again, a lane held back for another's statement, a flush of the
    /// decision counts.
    fn wake_at(&self) -> Option<u64> {
        let leases = self.state.leases;
        [
            self.state.timers.next(leases.now()),
            self.gauges.due(self.tick, leases.table.len()),
            retry_due(&self.state.returns.items, leases.now()),
            self.lanes.held_until,
            self.counts.due(leases),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Sleeps until a caller wakes the actor, something is due, or a statement answers (the
    /// answer, returned to be applied at once, whatever the other lanes' statements are doing).
    async fn sleep(&mut self) -> Option<Done> {
        let leases = self.state.leases;
        let wake_at = self.wake_at();
        // Nothing in flight and nothing to send again: idle until woken (`Leases::until_idle`).
        let idle = self.lanes.jobs.is_empty()
            && self.state.returns.items.is_empty()
            && self.lanes.inflight.is_empty();
        leases.set_idle(idle);
        let lanes = &mut self.lanes;
        let mut answered = None;
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
        self.counts.flush_if_due(leases);
        answered
    }

    /// Applies a statement's answer alone and gives its lane its next statement. Nudges that
    /// came meanwhile have left the wake-up's permit, so the next round follows at once.
    fn answer(&mut self, done: Done) {
        finish(&mut self.state, &mut self.lanes, done);
        if self.stopping() {
            return;
        }
        let now = self.state.leases.now();
        dispatch(&mut self.state, &mut self.lanes, now);
        after_work(self.state.leases, &mut self.gauges, self.tick, true);
    }

    /// Low-water nudges only, and nothing else due: gathers more of them for a moment (their
    /// callers are still paid from their leases), so a million quiet keys crossing their marks
    /// cost a statement per 256 keys and a wake-up per gathering, not one each. A waiting
    /// caller's nudge ends the gathering at once, and so does an answer.
    async fn gather(&mut self) {
        let leases = self.state.leases;
        let now = leases.now();
        if !leases.soon.load(Ordering::Acquire)
            || leases.urgent.load(Ordering::Acquire)
            || self
                .state
                .timers
                .next(now)
                .is_some_and(|at| at <= now.saturating_add(self.tick))
        {
            return;
        }
        let until = crate::clock::instant() + GATHER.min(leases.settings.tick);
        let lanes = &mut self.lanes;
        let mut answered = None;
        tokio::select! {
            () = leases.wake.notified() => {}
            () = tokio::time::sleep_until(until) => {}
            done = lanes.next(), if !lanes.jobs.is_empty() => answered = Some(done),
        }
        if let Some(done) = answered {
            finish(&mut self.state, &mut self.lanes, done);
        }
    }

    /// One round: the slots that asked for a refill, a reload's stale slots, what the
    /// due-queue holds for this tick, then a statement on every idle lane with work.
    fn round(&mut self) {
        let leases = self.state.leases;
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
            self.lanes.queue(lane, slot);
            nudged += 1;
        }
        if leases.overflowed.swap(false, Ordering::AcqRel) {
            nudged += scan_pending(leases, &mut self.lanes);
        }
        let reload = leases.reload.lock().take();
        let mut looked = match reload {
            Some(stale) => retire_stale(&mut self.state, &stale),
            None => 0,
        };
        looked += expire(&mut self.state, now, self.tick, &self.lanes.inflight);
        let worked = looked > 0 || nudged > 0 || !self.state.returns.items.is_empty();
        // Each idle lane's give-backs first, then its refills: a strict lease closed in this
        // round is settled before the same slot's renewal replaces its entry in the store.
        dispatch(&mut self.state, &mut self.lanes, now);
        self.lanes.shrink(now);
        after_work(leases, &mut self.gauges, self.tick, worked);
    }

    /// After the limiter stopped: statements in flight finish first (each within the store's
    /// call timeout; their grants go into slots that are closed next, and their failed
    /// returns are sent again), then every lease closes and everything goes back.
    async fn stop(mut self) {
        while !self.lanes.jobs.is_empty() {
            let done = self.lanes.next().await;
            finish(&mut self.state, &mut self.lanes, done);
        }
        let leases = self.state.leases;
        shut_down(&mut self.state).await;
        publish_counters(leases);
        publish_outstanding(leases);
        m::flush_all();
    }
}

/// The actor's loop; ends after giving everything back once the limiter stops. `restarted`
/// when an earlier actor of the same table ended early.
pub(super) async fn run(leases: Arc<Leases>, restarted: bool) {
    let _alive = Alive(&leases);
    let mut actor = Actor::new(&leases, restarted);
    loop {
        if let Some(done) = actor.sleep().await {
            actor.answer(done);
            if actor.stopping() {
                break;
            }
            continue;
        }
        if actor.stopping() {
            break;
        }
        actor.gather().await;
        if actor.stopping() {
            break;
        }
        actor.round();
    }
    actor.stop().await;
}

/// When the actor adds the lease decisions the threads counted to the counters
/// (`metrics::flush_all`): at most every [`FLUSH_EVERY`](m::FLUSH_EVERY) while decisions come
/// (a caller that counts the first since a flush wakes the actor, `Leases::counted`), and once
/// more a period after the last, for a decision whose count was not yet visible to the flush
/// before (its caller saw the mark of the earlier period still set). A quiet limiter makes no
/// flush and no wake-up.
#[derive(Default)]
struct CountsFlush {
    /// When the last flush was made (local ns).
    flushed_at: u64,
    /// A flush follows one that found counts, a period later.
    trailing: bool,
}

impl CountsFlush {
    fn due(&self, leases: &Leases) -> Option<u64> {
        let period = m::FLUSH_EVERY.as_nanos() as u64;
        (self.trailing || leases.counts_due()).then(|| self.flushed_at.saturating_add(period))
    }

    fn flush_if_due(&mut self, leases: &Leases) {
        let now = leases.now();
        if self.due(leases).is_some_and(|at| at <= now) {
            let marked = leases.take_counts_due();
            let found = m::flush_all();
            self.flushed_at = now;
            self.trailing = marked || found;
        }
    }
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

/// Sets the table-size gauge and the token counters (no pass over the slots).
fn publish_counters(leases: &Leases) {
    // Whole tokens, rounded as `Leases::stats` rounds them.
    let whole = |n: &crate::lease::total::Total| n.tokens() as u64;
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

fn lease_settings(slot: &Slot) -> LeaseSettings {
    slot.plan.lease().copied().unwrap_or_default()
}

/// [`Limiter::shutdown`](crate::Limiter::shutdown) after the actor ended early: closes every
/// lease and gives everything back (what the actor left included) on the caller's runtime.
pub(super) async fn shut_down_here(leases: &Leases) {
    let mut state = State::new(leases);
    shut_down(&mut state).await;
    publish_counters(leases);
    publish_outstanding(leases);
    m::flush_all();
}
