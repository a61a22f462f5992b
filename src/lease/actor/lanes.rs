//! The actor's lanes: one per store partition, each sending its own statements (a give-back
//! alone, or refills of distinct slots) and having their answers applied as they come.
//!
//! Apart from the loop because this is where the actor meets the store: which statement a
//! partition may start, what it carries, and what its answer changes. The loop only says
//! when; a slow or failing shard delays only its own lane (beyond another lane's turn,
//! [`Lanes::held`]).

use crate::store::metered::{Metered, Purpose};
use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use super::refill::{Ask, Grant, apply, plan_chunk, schedule};
use super::returns::{Carried, Return, give_back_requests, settle};
use super::{CHUNK, FAILURE_BACKOFF, State};
use crate::bucket::Tokens;
use crate::key::SlotKey;
use crate::lease::Leases;
use crate::lease::late::Outcome;
use crate::lease::slot::SlotRef;
use crate::metrics as m;
use crate::store::{AcquireRequest, Acquired, StoreError};

/// Refill statements one lane may have in flight at once, each of distinct slots (a slot is
/// queued in its lane once, and is in at most one statement): the pool's default size, so a lane
/// that fell behind uses every connection instead of one.
const REFILLS_IN_FLIGHT: usize = 4;

/// The longest a lane that keeps up waits for another lane's refill ([`Lanes::held`]), in
/// ns: where refills take longer (a slow store), waiting callers would wait out their
/// `max_wait`, and the lanes no longer take turns. A busy store's refills take a few
/// milliseconds (the cores shared with the other partitions and the callers), and its lanes
/// gain the most from taking turns: several such refill times.
const MAX_TURN: u64 = 16_000_000;

/// The longest the lanes wait, after a refill answered, for the callers it woke to ask again
/// ([`Turn`]), in ns: the wait ends as soon as they have, so only callers slowed by busy cores
/// make it this long.
const MAX_TURN_GATHER: u64 = 4_000_000;

/// A store statement of the actor in flight: it owns what it sends, and answers with a
/// [`Done`].
pub(super) type Job<'a> = Pin<Box<dyn Future<Output = Done> + Send + 'a>>;

/// A statement's answer, back on the actor.
pub(super) struct Done {
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
    /// When this lane's last refill statement started (local monotonic ns).
    started: u64,
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
pub(super) struct Lanes<'a> {
    /// By partition.
    lanes: HashMap<usize, Lane>,
    /// Slots whose refill is in flight, by address: not expired until it is applied.
    pub(super) inflight: HashSet<usize>,
    /// The statements in flight: per lane, one give-back or up to [`REFILLS_IN_FLIGHT`] refills.
    pub(super) jobs: Vec<Job<'a>>,
    /// Slots whose last refill timed out and was given its one second chance (`late.rs`,
    /// `Outcome::LateOnce`), by address, with when (local monotonic ns): a statement carrying
    /// one of them that times out again fails. A mark goes when the slot's next refill is
    /// applied, or [`LATE_MARK_TTL`] after it was made (a slot that left the table meanwhile);
    /// at most [`LATE_MARKS`] are kept, and a statement whose keys would not fit gets no second
    /// chance. A new slot at the address of a marked one only loses its second chance. Kept
    /// here, not in the slot: the slot's book has no spare byte, and a mark that stalls alone
    /// set would cost every key's memory.
    late: HashMap<usize, u64>,
    /// Each partition's refill statement time (ns), a moving average: how long its lane waits
    /// for another lane's statement before it sends its own ([`Lanes::held`]). Kept while the
    /// lane comes and goes (a store has a few partitions).
    took: HashMap<usize, u64>,
    /// When a lane held back for another lane's statement may go at the latest: the actor
    /// wakes then, if no answer came first.
    pub(super) held_until: Option<u64>,
    /// Slots ever queued on a lane (wrapping): how many callers asked again since a refill
    /// answered ([`Turn`]).
    queued: u64,
    /// After a refill answered on a store of several partitions: the lanes that keep up wait
    /// for the callers it woke to ask again.
    turn: Option<Turn>,
}

/// After a refill answers on a store of several partitions, the lanes that keep up hold their
/// refills back until as many slots have been queued as it refilled (the callers it woke
/// asking again, for their next keys), or half its statement time has passed (at most
/// [`MAX_TURN_GATHER`]). Without it the lane whose turn came sent at once, before the callers
/// came back, and they waited for that lane's next turn: its statement carried what came back
/// during the other lane's statement, not what the answer woke too.
#[derive(Clone, Copy)]
struct Turn {
    /// [`Lanes::queued`] when the refill answered.
    from: u64,
    /// The slots it refilled.
    slots: u64,
    /// When the wait ends at the latest (local monotonic ns).
    until: u64,
}

/// The most slots [`Lanes`] remembers as given a second chance: 65,536 (about 1.5 MiB at most,
/// in a cold start of that many keys whose refills all timed out at once).
const LATE_MARKS: usize = 1 << 16;

/// How long a second chance is remembered: far longer than a re-asked refill takes to be sent
/// and answered or timed out (each within the store's call timeout).
const LATE_MARK_TTL: Duration = Duration::from_secs(10);

impl<'a> Lanes<'a> {
    /// Whether `lane` has a statement in flight.
    fn busy(&self, lane: usize) -> bool {
        self.lanes.get(&lane).is_some_and(Lane::busy)
    }

    /// Whether `lane`, with nothing in flight and fewer than a [`CHUNK`] of slots waiting,
    /// holds its refill back at `now` for another lane's: while another lane's refill started
    /// less than two of this lane's statement times ago is in flight. Then the lanes take
    /// turns, as one store's lane sends one statement after another, and each statement
    /// carries what its lane gathered over the others' statement too: about as many slots as
    /// one lane's would, whatever the number of lanes. A slow or failing lane holds the
    /// others back no longer than that (and [`MAX_TURN`]), a lane that fell behind is never
    /// held back, and a lane not yet measured is not held. `until` gets when the hold ends at the latest.
    fn held(&self, lane: usize, now: u64, until: &mut Option<u64>) -> bool {
        let Some(l) = self.lanes.get(&lane) else {
            return false;
        };
        if l.refills > 0 || l.due.len() >= CHUNK {
            return false;
        }
        if let Some(turn) = self.turn
            && now < turn.until
            && self.queued.wrapping_sub(turn.from) < turn.slots
        {
            *until = Some(until.map_or(turn.until, |u| u.min(turn.until)));
            return true;
        }
        let hold = self
            .took
            .get(&lane)
            .map_or(0, |t| t.saturating_mul(2).min(MAX_TURN));
        let end = self
            .lanes
            .iter()
            .filter(|(other, o)| **other != lane && o.refills > 0)
            .map(|(_, o)| o.started.saturating_add(hold))
            .filter(|&end| end > now)
            .max();
        if let Some(end) = end {
            *until = Some(until.map_or(end, |u| u.min(end)));
        }
        end.is_some()
    }

    /// Gives memory back after a burst of refills (the first calls of a flood of new keys):
    /// the set of slots in flight, and each lane's queue, keep the capacity of their largest
    /// burst otherwise (1 MB for 100,000 new keys, kept while the lane has work).
    pub(super) fn shrink(&mut self, now: u64) {
        if !self.late.is_empty() {
            let horizon = now.saturating_sub(LATE_MARK_TTL.as_nanos() as u64);
            self.late.retain(|_, at| *at >= horizon);
            if self.late.capacity() > 1024 && self.late.len() < self.late.capacity() / 4 {
                self.late.shrink_to(self.late.len() * 2);
            }
        }
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
    pub(super) fn queue(&mut self, lane: usize, slot: SlotRef) {
        // Relaxed: the flag is the actor's own (set here, cleared when the slot leaves its lane).
        if !slot.hot().queued.swap(true, Ordering::Relaxed) {
            self.lanes.entry(lane).or_default().due.push_back(slot);
            self.queued = self.queued.wrapping_add(1);
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
    pub(super) fn next(&mut self) -> impl Future<Output = Done> + '_ {
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
pub(super) fn dispatch<'a>(state: &mut State<'a>, lanes: &mut Lanes<'a>, now: u64) {
    let leases = state.leases;
    let returns = &mut state.returns.items;
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
            lanes.start(leases, lane, true, give_back_job(leases, lane, batch));
        }
    }
    // The lane whose last statement started longest ago first: lanes held back for another's
    // statement take their turns.
    let mut ready: Vec<(u64, usize)> = lanes
        .lanes
        .iter()
        .filter(|(_, l)| l.may_refill())
        .map(|(&lane, l)| (l.started, lane))
        .collect();
    ready.sort_unstable();
    if lanes
        .turn
        .is_some_and(|t| now >= t.until || lanes.queued.wrapping_sub(t.from) >= t.slots)
    {
        lanes.turn = None;
    }
    let mut held_until = None;
    for (_, lane) in ready {
        if lanes.held(lane, now, &mut held_until) {
            continue;
        }
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
            let asks = plan_chunk(state, &part);
            if asks.is_empty() {
                continue;
            }
            for (slot, ..) in &asks {
                lanes.inflight.insert(SlotRef::as_ptr(slot) as usize);
            }
            leases.counters.store_calls.fetch_add(1, Ordering::AcqRel);
            lanes.start(leases, lane, false, refill_job(leases, lane, asks));
            if let Some(l) = lanes.lanes.get_mut(&lane) {
                l.started = now;
            }
        }
        for slot in later {
            lanes.queue(lane, slot);
        }
    }
    lanes.held_until = held_until;
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
        let started = crate::clock::instant();
        // One answer per key: a sharded store fails only the keys of a failing shard.
        let result = Metered::new(&*leases.store, Purpose::Lease)
            .acquire_each(&requests)
            .await;
        let took = crate::clock::instant().saturating_duration_since(started);
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

/// Sends one give-back statement. Its returns are held in a guard until it answers: an actor
/// that ends mid-statement leaves them to the next one.
fn give_back_job(leases: &Leases, lane: usize, batch: Vec<Return>) -> Job<'_> {
    let mut batch = Carried::new(leases, batch);
    Box::pin(async move {
        let requests = give_back_requests(&batch.items);
        // One outcome per return: a sharded store fails only the returns of a failing shard.
        let result = Metered::new(&*leases.store, Purpose::Return)
            .give_back_each(&requests)
            .await;
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
/// ids, and count as stranded after their last attempt (`settle`).
pub(super) fn finish(state: &mut State<'_>, lanes: &mut Lanes<'_>, done: Done) {
    let leases = state.leases;
    if let Some(l) = lanes.lanes.get_mut(&done.lane) {
        match done.work {
            Answered::Refill { took, ref asks, .. } => {
                l.refills = l.refills.saturating_sub(1);
                let took = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
                let avg = lanes.took.entry(done.lane).or_insert(took);
                *avg = *avg - *avg / 4 + took / 4;
                let window = (*avg / 2).min(MAX_TURN_GATHER);
                // Lanes take turns only on a store of several partitions.
                if lanes.took.len() > 1 {
                    lanes.turn = Some(Turn {
                        from: lanes.queued,
                        slots: asks.len() as u64,
                        until: leases.now().saturating_add(window),
                    });
                }
            }
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
            let until = now + FAILURE_BACKOFF.as_nanos() as u64;
            // Credit (`Leases::credit`) is given only while refills answer; a refill that timed
            // out while the store answered is late, not failed (`late.rs`).
            let mut retried = lanes.late.len() + asks.len() > LATE_MARKS;
            if !lanes.late.is_empty() {
                for (slot, ..) in &asks {
                    retried |= lanes
                        .late
                        .remove(&(SlotRef::as_ptr(slot) as usize))
                        .is_some();
                }
            }
            let outcome = leases.refill_outcome(sent, short, &result, now, retried);
            let late = matches!(outcome, Outcome::Late | Outcome::LateOnce);
            let mut answers = result.into_iter();
            for (slot, _, want, hold, planned) in &asks {
                let addr = SlotRef::as_ptr(slot) as usize;
                lanes.inflight.remove(&addr);
                match answers.next() {
                    Some(Ok(answer)) if !short => {
                        let grant = Grant {
                            slot,
                            want: *want,
                            planned: *planned,
                            strict: hold.map(|h| (sent, h.lease_id)),
                        };
                        apply(state, grant, &answer, now);
                    }
                    // Late: the waiters ask again and go on waiting; credit owed is asked for.
                    _ if late && hold.is_none() => {
                        if outcome == Outcome::LateOnce {
                            lanes.late.insert(addr, now);
                        }
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
                schedule(&mut state.timers, slot, now);
            }
        }
        Answered::Return { batch, result } => {
            let retry_at = leases
                .now()
                .saturating_add(leases.settings.tick.as_nanos() as u64)
                .max(1);
            settle(
                leases,
                batch,
                result,
                Some(retry_at),
                &mut state.returns.items,
            );
        }
    }
    lanes.tidy(leases);
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

    /// After a refill answered, a lane that keeps up waits for as many slots to be queued as
    /// the refill carried (its callers asking again), or until the wait's end, whichever
    /// comes first; a lane that fell behind does not wait.
    #[test]
    fn lanes_wait_for_the_callers_a_refill_woke() {
        let slab = Slab::new(16);
        let (a, b, c) = (
            test_slot(&slab, "a"),
            test_slot(&slab, "b"),
            test_slot(&slab, "c"),
        );
        let mut lanes = Lanes::default();
        lanes.queue(1, SlotRef::clone(&a));
        lanes.turn = Some(Turn {
            from: lanes.queued,
            slots: 2,
            until: 1_000,
        });
        let mut until = None;
        assert!(lanes.held(1, 0, &mut until), "none of two came back");
        assert_eq!(until, Some(1_000));
        lanes.queue(1, SlotRef::clone(&b));
        assert!(lanes.held(1, 999, &mut None), "one of two came back");
        assert!(!lanes.held(1, 1_000, &mut None), "the wait is over");
        lanes.queue(0, SlotRef::clone(&c));
        assert!(!lanes.held(1, 0, &mut None), "both came back");
        assert!(!lanes.held(0, 0, &mut None));
    }

    /// A lane that keeps up waits for another lane's refill in flight for two of its own
    /// refill times from when that refill started, and never longer than [`MAX_TURN`].
    #[test]
    fn a_lane_waits_two_refill_times_for_another_and_never_past_the_bound() {
        let slab = Slab::new(16);
        let a = test_slot(&slab, "a");
        for (took, end) in [(1_000_000, 2_000_000), (20_000_000, MAX_TURN)] {
            let mut lanes = Lanes::default();
            lanes.lanes.entry(0).or_default().refills = 1;
            lanes.queue(1, SlotRef::clone(&a));
            lanes.took.insert(1, took);
            let mut until = None;
            assert!(lanes.held(1, end - 1, &mut until), "refill time {took} ns");
            assert_eq!(until, Some(end));
            assert!(!lanes.held(1, end, &mut None), "refill time {took} ns");
            lanes.lanes.entry(0).or_default().refills = 0;
            assert!(
                !lanes.held(1, 0, &mut None),
                "nothing in flight to wait for"
            );
            a.hot().queued.store(false, Ordering::Relaxed);
        }
    }
}
