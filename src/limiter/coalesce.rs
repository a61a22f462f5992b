//! Direct mode's statements: a few in flight, each carrying every key that is waiting.
//!
//! Two things make a direct-mode take expensive: the round trip and commit of its statement,
//! and, on a hot row, every other writer queued on the row lock. So the limiter
//!
//! - keeps at most one statement per key in flight: callers of a key whose statement is in
//!   flight queue behind it, and all queued callers of one cost leave together in the key's next
//!   statement as one request (`min = step = cost`, `want = n × cost`);
//! - keeps at most `max_in_flight` statements in flight (about the pool size): a caller that
//!   finds a slot free sends its statement at once, alone (one round trip, no added latency);
//!   callers that arrive while every slot is busy wait, and the next statement to leave carries
//!   all of their keys (up to `max_batch`, distinct and sorted) in one `acquire_many`.
//!
//! A store of several parts ([`Store::partition`]: a sharded store's shards, a Citus cluster's
//! workers) gets all of this per part: a statement carries keys of one part, and each part
//! has its own statements in flight, capped by its own connections
//! ([`Store::partition_calls`]), its own load, adaptive limit and gather window ([`Part`]). So
//! a part's statements carry as many keys as one store's would at that part's load, and a
//! slow or failing part holds up no other part's statements (beyond another part's turn: a
//! part that would send a statement of few keys while another part's statement is in flight
//! holds it back for a bounded time, [`turns`]).
//!
//! Every caller has a deadline. A caller whose deadline passes before its answer, or that finds
//! `max_queued` callers already waiting, is not answered here ([`Unanswered`]): the limiter's
//! fallback decides it at once.
//!
//! When a key's statement comes back, the callers that queued behind it and ask for more than
//! the bucket has left are denied from that answer, at the statement's own store time, without
//! another statement: the pure bucket at that time denies them too (see [`deny_from`]).

use crate::store::metered::{Metered, Purpose};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::bucket::{BucketConfig, Tokens};
use crate::store::{AcquireRequest, Acquired, Store, StoreError};

mod answer;
mod load;
mod turns;

use answer::{deny_from, share_out};
use load::Load;

/// Why a caller got no answer from the store; the plan's fallback decides it.
#[derive(Debug)]
pub(crate) enum Unanswered {
    /// The statement that carried the caller failed (or its task went away).
    Store,
    /// The caller's deadline passed first.
    Deadline,
    /// Too many callers were waiting already.
    Overloaded,
}

/// How many statements, keys and waiting callers the coalescer allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Settings {
    /// Statements in flight at once, over every part (about the store's pool size).
    pub(crate) max_in_flight: usize,
    /// Statements in flight at once once the lease actor runs on the same pool
    /// ([`Coalescer::share_with_leases`]): `max_in_flight`, or one fewer when the coalescer
    /// also carries sparse keys' calls, so that the actor's refills find a connection (one
    /// fewer per part, too).
    pub(crate) leased_in_flight: usize,
    /// Keys in one statement.
    pub(crate) max_batch: usize,
    /// Callers waiting for a statement; beyond this a caller goes straight to the fallback.
    pub(crate) max_queued: usize,
    /// Choose each part's statements in flight from what the coalescer measures (at most its
    /// connections): the user did not set `LimiterBuilder::statements_in_flight`.
    pub(crate) adaptive: bool,
}

/// The keys a statement should carry when callers wait: the adaptive limit keeps about this
/// many callers' keys in each statement. Measured on the 2-core test machine (pgbench, the
/// many-key take, prepared): 136–139 µs of server CPU per decision at 2 keys a statement,
/// 81–83 µs at 4, 47 µs at 8, 28–29 µs at 16 (docs/design/direct-mode.md).
const TARGET_BATCH: f64 = 16.0;

/// The longest a free slot waits for more callers before its statement leaves (the gather
/// window is a quarter of the recent statement time, within this and [`MIN_GATHER`]).
const MAX_GATHER: Duration = Duration::from_millis(1);
/// The shortest gather window.
const MIN_GATHER: Duration = Duration::from_micros(50);

type Reply = oneshot::Sender<Result<Acquired, Unanswered>>;

/// One waiting caller.
struct Waiter {
    bucket: BucketConfig,
    cost: Tokens,
    deadline: Instant,
    reply: Reply,
}

/// A key with callers waiting or a statement in flight.
#[derive(Default)]
struct KeyQueue {
    /// Callers not yet in a statement, in arrival order.
    waiters: VecDeque<Waiter>,
    /// A statement in flight carries this key.
    busy: bool,
    /// Listed in its part's [`Part::ready`].
    ready: bool,
    /// The part of the store holding the key ([`Store::partition`]): a statement carries keys
    /// of one part only.
    part: usize,
}

/// One part of the store ([`Store::partition`]): its keys ready to leave, its statements in
/// flight and what its adaptive limit is chosen from. A part is made when its first key is
/// seen and kept (a store has a few parts).
struct Part {
    /// Keys of this part with waiters and no statement in flight, in the order they became
    /// ready.
    ready: VecDeque<String>,
    /// This part's statements in flight.
    in_flight: usize,
    /// This part's connections ([`Store::partition_calls`]), or the user's number of
    /// statements in flight: its statements in flight never exceed it.
    calls: usize,
    /// This part's callers that ever arrived (wrapping), for its arrival rate.
    arrivals: u64,
    /// What its adaptive limit is chosen from (with [`Settings::adaptive`]).
    load: Load,
    /// The adaptive limit on its statements in flight (with [`Settings::adaptive`]).
    limit: usize,
    /// A statement of this part is held back for the gather window: a timer sends it.
    gathering: bool,
    /// When this part's last statement was sent, or its gather window began: its turn
    /// ([`turns`]).
    started: Option<Instant>,
    /// This part's statement is held back for another part's turn until then at the latest
    /// ([`turns`]): that part's answer, or a timer then, lets it go.
    held: Option<Instant>,
    /// Let go by another part's answer, which carried this many callers: its gather window
    /// waits for them to come back, whatever the part's own rate, and ends once they have
    /// ([`turns`]).
    turn: Option<u64>,
}

impl Part {
    fn new(calls: usize) -> Self {
        Part {
            ready: VecDeque::new(),
            in_flight: 0,
            calls,
            arrivals: 0,
            load: Load::default(),
            limit: calls,
            gathering: false,
            started: None,
            held: None,
            turn: None,
        }
    }
}

/// Everything behind the coalescer's lock. The lock is held for map and queue operations only,
/// never across an await.
#[derive(Default)]
struct State {
    keys: HashMap<String, KeyQueue>,
    /// The store's parts seen so far.
    parts: HashMap<usize, Part>,
    /// Statements in flight, over every part.
    in_flight: usize,
    /// Callers in some key's `waiters`.
    queued: usize,
    /// Callers that ever arrived, over every part (wrapping).
    arrivals: u64,
    /// The part gathering for its turn ([`Part::turn`]), and the arrivals at which its window
    /// ends: (part, arrivals then, callers expected).
    turn: Option<(usize, u64, u64)>,
}

/// A statement: keys of one part.
struct Batch {
    part: usize,
    items: Vec<Item>,
}

/// What a part's free slot does now.
enum Next {
    /// Send this statement.
    Send(Batch),
    /// Wait this long for more callers; a timer then sends what is ready.
    Gather(Duration),
    /// Wait for another part's statement, until then at the latest ([`turns`]).
    Hold(Instant),
    /// Nothing to send, or no slot free.
    Nothing,
}

/// One key's request in a statement, and the callers it answers.
struct Item {
    key: String,
    bucket: BucketConfig,
    cost: Tokens,
    waiters: Vec<Waiter>,
}

impl Item {
    fn request(&self) -> AcquireRequest<'_> {
        // Never ask for more than the bucket could ever grant: the answer is the same, and
        // `n × cost` cannot overflow.
        let cost = self.cost.as_atto().max(1);
        let fit = self.bucket.capacity().as_atto() / cost;
        let n = std::cmp::min(self.waiters.len() as u128, fit.max(1));
        AcquireRequest {
            key: &self.key,
            bucket: self.bucket,
            min: self.cost,
            want: Tokens::from_atto(cost * n),
            step: self.cost,
            hold: None,
        }
    }
}

/// The table of waiting keys and the statements in flight.
pub(crate) struct Coalescer {
    state: Mutex<State>,
    settings: Settings,
    /// The lease actor runs: at most [`Settings::leased_in_flight`] statements in flight.
    leases_run: AtomicBool,
}

impl std::fmt::Debug for Coalescer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coalescer")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Coalescer {
    pub(crate) fn new(settings: Settings) -> Arc<Self> {
        Arc::new(Coalescer {
            state: Mutex::new(State::default()),
            settings: Settings {
                max_in_flight: settings.max_in_flight.max(1),
                leased_in_flight: settings
                    .leased_in_flight
                    .clamp(1, settings.max_in_flight.max(1)),
                max_batch: settings.max_batch.max(1),
                max_queued: settings.max_queued.max(1),
                adaptive: settings.adaptive,
            },
            leases_run: AtomicBool::new(false),
        })
    }

    /// The lease actor started on the same store: from now on at most
    /// [`Settings::leased_in_flight`] statements in flight.
    pub(crate) fn share_with_leases(&self) {
        self.leases_run.store(true, Ordering::Relaxed);
    }

    /// The connections the lease actor is left, on the whole store and on each part.
    fn left_to_leases(&self) -> usize {
        if self.leases_run.load(Ordering::Relaxed) {
            self.settings.max_in_flight - self.settings.leased_in_flight
        } else {
            0
        }
    }

    /// Statements allowed in flight now, over every part.
    fn total_cap(&self) -> usize {
        self.settings.max_in_flight - self.left_to_leases()
    }

    /// `part`'s statements allowed in flight now: its connections (less the lease actor's),
    /// within its adaptive limit.
    fn cap(&self, part: &Part) -> usize {
        let cap = part.calls.saturating_sub(self.left_to_leases()).max(1);
        if self.settings.adaptive {
            cap.min(part.limit).max(1)
        } else {
            cap
        }
    }

    /// The part's connections: what the store says, within the statements in flight allowed
    /// in all; the user's number when they chose one.
    fn part_calls(&self, store: &dyn Store, part: usize) -> usize {
        let max = self.settings.max_in_flight;
        if self.settings.adaptive {
            store.partition_calls(part).unwrap_or(max).clamp(1, max)
        } else {
            max
        }
    }

    /// How long a part's free slot waits for more callers before it sends what is ready, if it
    /// should: while fewer than [`TARGET_BATCH`] of its keys are ready and another caller is
    /// expected within the window, a quarter of its statements' time (within [`MIN_GATHER`]
    /// and [`MAX_GATHER`]); half its statements' time when its turn came ([`turns`]). Without
    /// the wait, the callers of a statement that just finished come back one by one, the first
    /// finds the slot free and leaves alone, and statements alternate between one key and all
    /// the others.
    fn gather_window(&self, part: &Part) -> Option<Duration> {
        if !self.settings.adaptive || (part.ready.len() as f64) >= TARGET_BATCH {
            return None;
        }
        // A part whose turn came waits for the callers of the answer that let it go, and its
        // window ends as soon as they have come back (`turns`): it may be longer, one
        // statement time up to a quarter of the longest turn, for callers slowed by busy cores
        // or paced by their own schedule (an open loop's callers come back at their next send,
        // not at once). Measured over two shards, 16 paced callers: half a statement time
        // carried 9.6 keys a statement, one 10.2, one and a half or two 9.5-9.8.
        if part.turn.is_some() {
            let most = turns::MAX_TURN / 4;
            return Some(Duration::from_secs_f64(part.load.statement).clamp(MIN_GATHER, most));
        }
        let window =
            Duration::from_secs_f64(part.load.statement / 4.0).clamp(MIN_GATHER, MAX_GATHER);
        // Worth waiting only when another caller is expected within the window.
        if part.load.rate * window.as_secs_f64() < 1.0 {
            return None;
        }
        Some(window)
    }

    /// The next statement of `part` to send now, or the gather window to wait first
    /// (`gathering` is set and the caller must start the timer, [`Coalescer::gather`]).
    fn next(&self, state: &mut State, part: usize, now: Instant) -> Next {
        let total = self.total_cap();
        let Some(p) = state.parts.get_mut(&part) else {
            return Next::Nothing;
        };
        if (p.gathering || p.held.is_some()) && (p.ready.len() as f64) < TARGET_BATCH {
            // The timer sends it (or, when held, the other part's answer).
            return Next::Nothing;
        }
        if p.in_flight >= self.cap(p) || state.in_flight >= total {
            return Next::Nothing;
        }
        if p.ready.is_empty() {
            return Next::Nothing;
        }
        if let Some(until) = self.held_until(state, part, now) {
            if let Some(p) = state.parts.get_mut(&part) {
                p.held = Some(until);
            }
            return Next::Hold(until);
        }
        let Some(p) = state.parts.get_mut(&part) else {
            return Next::Nothing;
        };
        p.held = None;
        let window = self.gather_window(p);
        let turn = p.turn.take();
        if let Some(window) = window {
            p.gathering = true;
            p.started = Some(now);
            if let Some(callers) = turn {
                state.turn = Some((part, state.arrivals, callers));
            }
            return Next::Gather(window);
        }
        // A statement that leaves full during a gather window leaves the window running: until
        // its timer, no other statement of the part leaves with fewer keys (a second slot
        // would take the callers the next full statement gathers).
        if state.turn.is_some_and(|(t, ..)| t == part) {
            state.turn = None;
        }
        match state.next_batch(&self.settings, part, now) {
            Some(batch) => Next::Send(batch),
            None => Next::Nothing,
        }
    }

    /// Waits out `part`'s gather window, then sends what is ready.
    fn gather(self: &Arc<Self>, store: &Arc<dyn Store>, part: usize, window: Duration) {
        let (this, store) = (Arc::clone(self), Arc::clone(store));
        tokio::spawn(async move {
            tokio::time::sleep(window).await;
            let batch = {
                let mut state = this.state.lock();
                let total = this.total_cap();
                if state.turn.is_some_and(|(t, ..)| t == part) {
                    state.turn = None;
                }
                // Not gathering any more: its statement left when its turn's callers came
                // back (a statement that left full keeps the window to its end).
                let free = state.in_flight < total
                    && state.parts.get_mut(&part).is_some_and(|p| {
                        std::mem::replace(&mut p.gathering, false) && p.in_flight < this.cap(p)
                    });
                if free {
                    state.next_batch(&this.settings, part, crate::clock::instant())
                } else {
                    None
                }
            };
            if let Some(batch) = batch {
                this.spawn(&store, batch);
            }
        });
    }

    /// Takes `cost` from `key`'s bucket, in a statement shared with other callers, answering by
    /// `deadline` at the latest. `now` is the caller's reading of tokio's clock.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in the sense that matters: statements run in their own tasks, so dropping
    /// the future never stalls a key or other callers; a dropped caller's share of a grant is
    /// counted as spent.
    pub(crate) async fn take(
        self: &Arc<Self>,
        store: &Arc<dyn Store>,
        key: &str,
        bucket: BucketConfig,
        cost: Tokens,
        now: Instant,
        deadline: Instant,
    ) -> Result<Acquired, Unanswered> {
        let (reply, rx) = oneshot::channel();
        let part = store.partition(key);
        let batch = {
            let mut state = self.state.lock();
            if state.queued >= self.settings.max_queued {
                return Err(Unanswered::Overloaded);
            }
            state.queued += 1;
            let State {
                keys,
                parts,
                arrivals,
                ..
            } = &mut *state;
            let p = parts
                .entry(part)
                .or_insert_with(|| Part::new(self.part_calls(store.as_ref(), part)));
            p.arrivals = p.arrivals.wrapping_add(1);
            *arrivals = arrivals.wrapping_add(1);
            if !keys.contains_key(key) {
                keys.insert(
                    key.to_owned(),
                    KeyQueue {
                        part,
                        ..KeyQueue::default()
                    },
                );
            }
            let entry = keys.get_mut(key).expect("inserted above");
            entry.waiters.push_back(Waiter {
                bucket,
                cost,
                deadline,
                reply,
            });
            if !entry.busy && !entry.ready {
                entry.ready = true;
                p.ready.push_back(key.to_owned());
            }
            let next = self.next(&mut state, part, now);
            (next, self.turn_ends(&mut state, now))
        };
        let (batch, turn) = batch;
        self.act(store, part, batch);
        if let Some(turn) = turn {
            self.spawn(store, turn);
        }
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(Unanswered::Store),
            Err(_) => Err(Unanswered::Deadline),
        }
    }

    fn spawn(self: &Arc<Self>, store: &Arc<dyn Store>, batch: Batch) {
        tokio::spawn(Arc::clone(self).run(Arc::clone(store), batch));
    }

    /// Does what [`Coalescer::next`] said for `part`: sends its statement or starts its timer.
    fn act(self: &Arc<Self>, store: &Arc<dyn Store>, part: usize, next: Next) {
        match next {
            Next::Send(batch) => self.spawn(store, batch),
            Next::Gather(window) => self.gather(store, part, window),
            Next::Hold(until) => self.hold(store, part, until),
            Next::Nothing => {}
        }
    }

    /// Sends `batch` as one statement and answers its callers; then, while callers are waiting
    /// and a slot is free, sends the next statement from the same task.
    async fn run(self: Arc<Self>, store: Arc<dyn Store>, mut batch: Batch) {
        loop {
            let mut flight = Flight {
                coalescer: &self,
                part: batch.part,
                keys: batch.items.iter().map(|item| item.key.clone()).collect(),
                armed: true,
            };
            let sent = crate::clock::instant();
            let result = {
                let requests: Vec<AcquireRequest<'_>> =
                    batch.items.iter().map(Item::request).collect();
                // One answer per key: a sharded store fails only the keys of a failing shard.
                let mut answers = Metered::new(&*store, Purpose::Take)
                    .acquire_each(&requests)
                    .await;
                if answers.len() != requests.len() {
                    let err = StoreError::Protocol(format!(
                        "{} answers for {} requests",
                        answers.len(),
                        requests.len()
                    ));
                    answers = requests.iter().map(|_| Err(err.clone())).collect();
                }
                answers
            };
            flight.armed = false;
            let (mut next, timers) = self.finish(batch, result, sent);
            drop(flight);
            for (part, timer) in timers {
                self.act(&store, part, timer);
            }
            batch = match next.pop() {
                Some(batch) => batch,
                None => return,
            };
            for other in next {
                self.spawn(&store, other);
            }
        }
    }

    /// Answers a finished statement's callers and those queued behind it that its answer
    /// decides, frees its keys and its slot, and returns the statements to send next, and the
    /// parts whose gather window or hold starts. `sent`: when the statement was sent.
    fn finish(
        &self,
        batch: Batch,
        result: Vec<Result<Acquired, StoreError>>,
        sent: Instant,
    ) -> (Vec<Batch>, Vec<(usize, Next)>) {
        let now = crate::clock::instant();
        let took = now.saturating_duration_since(sent);
        let part = batch.part;
        let mut answers: Vec<(Reply, Result<Acquired, Unanswered>)> = Vec::new();
        let callers: usize = batch.items.iter().map(|item| item.waiters.len()).sum();
        let keys: Vec<(String, BucketConfig)> = batch
            .items
            .iter()
            .map(|item| (item.key.clone(), item.bucket))
            .collect();
        let mut outcomes: Vec<Option<Acquired>> = Vec::with_capacity(keys.len());
        // Callers of a bucket of several limits a partial grant did not reach (`share_out`).
        let mut left: Vec<Vec<Waiter>> = Vec::with_capacity(keys.len());
        for (item, result) in batch.items.into_iter().zip(result) {
            match result {
                Ok(acquired) => {
                    left.push(share_out(item, &acquired, &mut answers));
                    outcomes.push(Some(acquired));
                }
                Err(_) => {
                    for waiter in item.waiters {
                        answers.push((waiter.reply, Err(Unanswered::Store)));
                    }
                    outcomes.push(None);
                    left.push(Vec::new());
                }
            }
        }
        let next = {
            let mut state = self.state.lock();
            // Every part's statements waited for this slot when all of them were taken.
            let all_taken = state.in_flight >= self.total_cap();
            state.in_flight -= 1;
            if let Some(p) = state.parts.get_mut(&part) {
                p.in_flight -= 1;
                if self.settings.adaptive {
                    Self::adapt(p, took, now);
                    let limits: usize = state.parts.values().map(|p| p.limit).sum();
                    metrics::gauge!(crate::metrics::STATEMENTS_IN_FLIGHT_LIMIT).set(limits as f64);
                }
            }
            for (((key, bucket), outcome), left) in keys.into_iter().zip(outcomes).zip(left) {
                let State {
                    keys: table,
                    parts,
                    queued,
                    ..
                } = &mut *state;
                let Some(entry) = table.get_mut(&key) else {
                    for waiter in left {
                        answers.push((waiter.reply, Err(Unanswered::Store)));
                    }
                    continue;
                };
                entry.busy = false;
                // They go first in the key's next statement.
                for waiter in left.into_iter().rev() {
                    entry.waiters.push_front(waiter);
                    *queued += 1;
                }
                let before = entry.waiters.len();
                match outcome {
                    Some(acquired) => {
                        deny_from(&acquired, &bucket, &mut entry.waiters, &mut answers);
                    }
                    None => {
                        // Callers queued behind a failed statement share its failure at once
                        // rather than wait for another: the store is failing.
                        for waiter in entry.waiters.drain(..) {
                            answers.push((waiter.reply, Err(Unanswered::Store)));
                        }
                    }
                }
                *queued -= before - entry.waiters.len();
                if entry.waiters.is_empty() {
                    table.remove(&key);
                } else if !entry.ready {
                    entry.ready = true;
                    if let Some(p) = parts.get_mut(&entry.part) {
                        p.ready.push_back(key);
                    }
                }
            }
            // This statement's part; every part held back for its turn (they may go now); and,
            // if the slot freed was the last, every other part with keys ready. The part whose
            // last statement started longest ago first, so that held parts take their turns.
            let mut order: Vec<(Option<Instant>, usize)> = state
                .parts
                .iter_mut()
                .filter(|(p, q)| {
                    **p == part || q.held.is_some() || (all_taken && !q.ready.is_empty())
                })
                .map(|(&p, q)| {
                    q.turn = q.held.take().map(|_| callers as u64);
                    (q.started, p)
                })
                .collect();
            order.sort_unstable();
            let mut next = Vec::new();
            let mut timers = Vec::new();
            for (_, p) in order {
                loop {
                    match self.next(&mut state, p, now) {
                        Next::Send(batch) => next.push(batch),
                        Next::Nothing => break,
                        timer => {
                            timers.push((p, timer));
                            break;
                        }
                    }
                }
            }
            (next, timers)
        };
        for (reply, answer) in answers {
            // A caller that went away has its share counted as spent.
            let _ = reply.send(answer);
        }
        next
    }

    /// Frees the slot and the keys of a statement whose task was dropped before it finished
    /// (the runtime shut down): its callers see their reply channel closed.
    fn abandon(&self, part: usize, keys: &[String]) {
        let mut state = self.state.lock();
        state.in_flight -= 1;
        let State {
            keys: table, parts, ..
        } = &mut *state;
        let Some(p) = parts.get_mut(&part) else {
            return;
        };
        p.in_flight -= 1;
        for key in keys {
            let Some(entry) = table.get_mut(key) else {
                continue;
            };
            entry.busy = false;
            if entry.waiters.is_empty() {
                table.remove(key);
            } else if !entry.ready {
                entry.ready = true;
                p.ready.push_back(key.clone());
            }
        }
    }
}

/// Gives a statement's slot and keys back if its task is dropped mid-flight.
struct Flight<'a> {
    coalescer: &'a Coalescer,
    part: usize,
    keys: Vec<String>,
    armed: bool,
}

impl Drop for Flight<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.coalescer.abandon(self.part, &self.keys);
        }
    }
}

impl State {
    /// `part`'s next statement, if its callers are waiting (the caller checked that a slot is
    /// free): up to `max_batch` of its ready keys, each with the callers of its first caller's
    /// cost, sorted by key. Callers that gave up or whose deadline passed leave the queue here.
    fn next_batch(&mut self, settings: &Settings, part: usize, now: Instant) -> Option<Batch> {
        let State {
            keys,
            parts,
            queued,
            in_flight,
            ..
        } = self;
        let p = parts.get_mut(&part)?;
        let mut items = Vec::new();
        while items.len() < settings.max_batch {
            let Some(key) = p.ready.pop_front() else {
                break;
            };
            let Some(entry) = keys.get_mut(&key) else {
                continue;
            };
            entry.ready = false;
            let before = entry.waiters.len();
            let mut group = Vec::new();
            let mut rest = VecDeque::new();
            let mut first: Option<(Tokens, BucketConfig)> = None;
            for waiter in entry.waiters.drain(..) {
                if waiter.reply.is_closed() {
                    continue;
                }
                if waiter.deadline <= now {
                    let _ = waiter.reply.send(Err(Unanswered::Deadline));
                    continue;
                }
                let shape = *first.get_or_insert((waiter.cost, waiter.bucket));
                if (waiter.cost, waiter.bucket) == shape {
                    group.push(waiter);
                } else {
                    rest.push_back(waiter);
                }
            }
            entry.waiters = rest;
            *queued -= before - entry.waiters.len();
            let Some((cost, bucket)) = first else {
                keys.remove(&key);
                continue;
            };
            entry.busy = true;
            items.push(Item {
                key,
                bucket,
                cost,
                waiters: group,
            });
        }
        if items.is_empty() {
            return None;
        }
        p.started = Some(now);
        p.in_flight += 1;
        *in_flight += 1;
        items.sort_unstable_by(|a, b| a.key.cmp(&b.key));
        Some(Batch { part, items })
    }
}
