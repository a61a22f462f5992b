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
//! Every caller has a deadline. A caller whose deadline passes before its answer, or that finds
//! `max_queued` callers already waiting, is not answered here ([`Unanswered`]): the limiter's
//! fallback decides it at once.
//!
//! When a key's statement comes back, the callers that queued behind it and ask for more than
//! the bucket has left are denied from that answer, at the statement's own store time, without
//! another statement: the pure bucket at that time denies them too (see [`deny_from`]).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::bucket::{BucketConfig, BucketState, Outcome, Tokens};
use crate::clock::{SharedClock, timestamp_from_system_time};
use crate::store::{AcquireRequest, Acquired, Store, StoreError, nanos};

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
    /// Statements in flight at once (about the store's pool size).
    pub(crate) max_in_flight: usize,
    /// Statements in flight at once once the lease actor runs on the same pool
    /// ([`Coalescer::share_with_leases`]): `max_in_flight`, or one fewer when the coalescer
    /// also carries sparse keys' calls, so that the actor's refills find a connection.
    pub(crate) leased_in_flight: usize,
    /// Keys in one statement.
    pub(crate) max_batch: usize,
    /// Callers waiting for a statement; beyond this a caller goes straight to the fallback.
    pub(crate) max_queued: usize,
    /// Choose the statements in flight from what the coalescer measures (at most the cap
    /// above): the user did not set `LimiterBuilder::statements_in_flight`.
    pub(crate) adaptive: bool,
}

/// The keys a statement should carry when callers wait: the adaptive limit keeps about this
/// many callers' keys in each statement. Measured on the 2-core test machine (pgbench, the
/// many-key take, prepared): 136–139 µs of server CPU per decision at 2 keys a statement,
/// 81–83 µs at 4, 47 µs at 8, 28–29 µs at 16 (DESIGN.md §7).
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
    /// Listed in [`State::ready`].
    ready: bool,
    /// The part of the store holding the key ([`Store::partition`]): a statement carries keys
    /// of one part only.
    part: usize,
}

/// Everything behind the coalescer's lock. The lock is held for map and queue operations only,
/// never across an await.
#[derive(Default)]
struct State {
    keys: HashMap<String, KeyQueue>,
    /// Keys with waiters and no statement in flight, in the order they became ready.
    ready: VecDeque<String>,
    /// Statements in flight.
    in_flight: usize,
    /// Callers in some key's `waiters`.
    queued: usize,
    /// Callers that ever arrived (wrapping), for the arrival rate.
    arrivals: u64,
    /// What the adaptive limit measures (with [`Settings::adaptive`]).
    load: Load,
    /// A statement is held back for the gather window: a timer sends it.
    gathering: bool,
}

/// The load the adaptive limit is chosen from: moving averages (about 8 samples) of the callers'
/// arrival rate and of a statement's time, both measured as statements finish.
#[derive(Default)]
struct Load {
    /// When the last statement finished, and `arrivals` then.
    last: Option<(Instant, u64)>,
    /// Callers per second.
    rate: f64,
    /// A statement's time, in seconds.
    statement: f64,
}

impl Load {
    /// The callers that arrive while one statement runs (λ·S).
    fn per_statement(&self) -> f64 {
        self.rate * self.statement
    }
}

/// What a free slot does now.
enum Next {
    /// Send this statement.
    Send(Vec<Item>),
    /// Wait this long for more callers; a timer then sends what is ready.
    Gather(Duration),
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
    /// The adaptive limit on statements in flight (with [`Settings::adaptive`]).
    limit: AtomicUsize,
    /// A key of a part other than 0 was seen (a sharded store): statements to different parts
    /// must not wait for each other, so the limit stays at the cap.
    parts: AtomicBool,
    /// The limiter's clock.
    clock: SharedClock,
}

impl std::fmt::Debug for Coalescer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coalescer")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Coalescer {
    pub(crate) fn new(settings: Settings, clock: SharedClock) -> Arc<Self> {
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
            limit: AtomicUsize::new(settings.max_in_flight.max(1)),
            parts: AtomicBool::new(false),
            clock,
        })
    }

    /// The lease actor started on the same store: from now on at most
    /// [`Settings::leased_in_flight`] statements in flight.
    pub(crate) fn share_with_leases(&self) {
        self.leases_run.store(true, Ordering::Relaxed);
    }

    /// Statements allowed in flight now.
    fn cap(&self) -> usize {
        let cap = if self.leases_run.load(Ordering::Relaxed) {
            self.settings.leased_in_flight
        } else {
            self.settings.max_in_flight
        };
        if self.settings.adaptive && !self.parts.load(Ordering::Relaxed) {
            cap.min(self.limit.load(Ordering::Relaxed)).max(1)
        } else {
            cap
        }
    }

    /// Whether adaptation applies: the user left the number open and the store is one part.
    fn adaptive(&self) -> bool {
        self.settings.adaptive && !self.parts.load(Ordering::Relaxed)
    }

    /// The adaptive limit after a statement that took `took` finished at `now`.
    ///
    /// Callers arriving at rate λ while each statement takes S leave λ·S callers for the next
    /// statements; with L statements in flight each carries about λ·S / L of them. So
    /// L = λ·S / [`TARGET_BATCH`] (at least 1) makes every statement carry about
    /// [`TARGET_BATCH`] keys when that many callers wait, which is where the server's cost per
    /// decision levels off; a lone caller finds a slot free and its statement leaves at once.
    fn adapt(&self, load: &mut Load, arrivals: u64, took: Duration, now: Instant) {
        let smooth = |old: f64, sample: f64| {
            if old == 0.0 {
                sample
            } else {
                old + (sample - old) / 8.0
            }
        };
        load.statement = smooth(load.statement, took.as_secs_f64());
        if let Some((at, before)) = load.last {
            let dt = now.saturating_duration_since(at).as_secs_f64();
            if dt > 0.0 {
                let arrived = arrivals.wrapping_sub(before) as f64;
                load.rate = smooth(load.rate, arrived / dt);
            }
        }
        load.last = Some((now, arrivals));
        let limit = (load.per_statement() / TARGET_BATCH).round() as usize;
        let limit = limit.clamp(1, self.settings.max_in_flight);
        self.limit.store(limit, Ordering::Relaxed);
        metrics::gauge!(crate::metrics::STATEMENTS_IN_FLIGHT_LIMIT).set(limit as f64);
    }

    /// How long a free slot waits for more callers before it sends what is ready, if it should:
    /// while fewer than [`TARGET_BATCH`] keys are ready and another caller is expected within
    /// the window, a quarter of a statement's time (within [`MIN_GATHER`] and [`MAX_GATHER`]). Without the wait, the callers of a statement that just finished come
    /// back one by one, the first finds the slot free and leaves alone, and statements
    /// alternate between one key and all the others.
    fn gather_window(&self, state: &State) -> Option<Duration> {
        if !self.adaptive() || (state.ready.len() as f64) >= TARGET_BATCH {
            return None;
        }
        let window =
            Duration::from_secs_f64(state.load.statement / 4.0).clamp(MIN_GATHER, MAX_GATHER);
        // Worth waiting only when another caller is expected within the window.
        if state.load.rate * window.as_secs_f64() < 1.0 {
            return None;
        }
        Some(window)
    }

    /// The next statement to send now, or the gather window to wait first (`gathering` is set
    /// and the caller must start the timer, [`Coalescer::gather`]).
    fn next(&self, state: &mut State, now: Instant) -> Next {
        if state.gathering && (state.ready.len() as f64) < TARGET_BATCH {
            // The timer sends it.
            return Next::Nothing;
        }
        let cap = self.cap();
        if state.in_flight >= cap {
            return Next::Nothing;
        }
        if !state.ready.is_empty()
            && let Some(window) = self.gather_window(state)
        {
            state.gathering = true;
            return Next::Gather(window);
        }
        match state.next_batch(&self.settings, cap, now) {
            Some(batch) => Next::Send(batch),
            None => Next::Nothing,
        }
    }

    /// Waits out a gather window, then sends what is ready.
    fn gather(self: &Arc<Self>, store: &Arc<dyn Store>, window: Duration) {
        let (this, store) = (Arc::clone(self), Arc::clone(store));
        tokio::spawn(async move {
            tokio::time::sleep(window).await;
            let batch = {
                let mut state = this.state.lock();
                state.gathering = false;
                state.next_batch(&this.settings, this.cap(), this.clock.instant())
            };
            if let Some(batch) = batch {
                this.spawn(&store, batch);
            }
        });
    }

    /// Takes `cost` from `key`'s bucket, in a statement shared with other callers, answering by
    /// `deadline` at the latest. `now` is the caller's reading of the limiter's clock.
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
            state.arrivals = state.arrivals.wrapping_add(1);
            if part != 0 {
                self.parts.store(true, Ordering::Relaxed);
            }
            let State { keys, ready, .. } = &mut *state;
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
                ready.push_back(key.to_owned());
            }
            self.next(&mut state, now)
        };
        match batch {
            Next::Send(batch) => self.spawn(store, batch),
            Next::Gather(window) => self.gather(store, window),
            Next::Nothing => {}
        }
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(Unanswered::Store),
            Err(_) => Err(Unanswered::Deadline),
        }
    }

    fn spawn(self: &Arc<Self>, store: &Arc<dyn Store>, batch: Vec<Item>) {
        tokio::spawn(Arc::clone(self).run(Arc::clone(store), batch));
    }

    /// Sends `batch` as one statement and answers its callers; then, while callers are waiting
    /// and a slot is free, sends the next statement from the same task.
    async fn run(self: Arc<Self>, store: Arc<dyn Store>, mut batch: Vec<Item>) {
        loop {
            let mut flight = Flight {
                coalescer: &self,
                keys: batch.iter().map(|item| item.key.clone()).collect(),
                armed: true,
            };
            let sent = self.clock.instant();
            let result = {
                let requests: Vec<AcquireRequest<'_>> = batch.iter().map(Item::request).collect();
                metrics::counter!(crate::metrics::DB_CALLS, "kind" => "take").increment(1);
                // One answer per key: a sharded store fails only the keys of a failing shard.
                let mut answers = store.acquire_each(&requests).await;
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
            if result.iter().any(Result::is_err) {
                metrics::counter!(crate::metrics::DB_ERRORS, "kind" => "take").increment(1);
            }
            flight.armed = false;
            let (mut next, window) = self.finish(batch, result, sent);
            drop(flight);
            if let Some(window) = window {
                self.gather(&store, window);
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
    /// decides, frees its keys and its slot, and returns the statements to send next. `sent`:
    /// when the statement was sent.
    fn finish(
        &self,
        batch: Vec<Item>,
        result: Vec<Result<Acquired, StoreError>>,
        sent: Instant,
    ) -> (Vec<Vec<Item>>, Option<Duration>) {
        let now = self.clock.instant();
        let took = now.saturating_duration_since(sent);
        let mut answers: Vec<(Reply, Result<Acquired, Unanswered>)> = Vec::new();
        let keys: Vec<(String, BucketConfig)> = batch
            .iter()
            .map(|item| (item.key.clone(), item.bucket))
            .collect();
        let mut outcomes: Vec<Option<Acquired>> = Vec::with_capacity(keys.len());
        for (item, result) in batch.into_iter().zip(result) {
            match result {
                Ok(acquired) => {
                    share_out(item, &acquired, &mut answers);
                    outcomes.push(Some(acquired));
                }
                Err(_) => {
                    for waiter in item.waiters {
                        answers.push((waiter.reply, Err(Unanswered::Store)));
                    }
                    outcomes.push(None);
                }
            }
        }
        let next = {
            let mut state = self.state.lock();
            state.in_flight -= 1;
            if self.adaptive() {
                let arrivals = state.arrivals;
                self.adapt(&mut state.load, arrivals, took, now);
            }
            for ((key, bucket), outcome) in keys.into_iter().zip(outcomes) {
                let State {
                    keys: table,
                    ready,
                    queued,
                    ..
                } = &mut *state;
                let Some(entry) = table.get_mut(&key) else {
                    continue;
                };
                entry.busy = false;
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
                    ready.push_back(key);
                }
            }
            let mut next = Vec::new();
            let mut window = None;
            loop {
                match self.next(&mut state, now) {
                    Next::Send(batch) => next.push(batch),
                    Next::Gather(w) => {
                        window = Some(w);
                        break;
                    }
                    Next::Nothing => break,
                }
            }
            (next, window)
        };
        for (reply, answer) in answers {
            // A caller that went away has its share counted as spent.
            let _ = reply.send(answer);
        }
        next
    }

    /// Frees the slot and the keys of a statement whose task was dropped before it finished
    /// (the runtime shut down): its callers see their reply channel closed.
    fn abandon(&self, keys: &[String]) {
        let mut state = self.state.lock();
        state.in_flight -= 1;
        let State {
            keys: table, ready, ..
        } = &mut *state;
        for key in keys {
            let Some(entry) = table.get_mut(key) else {
                continue;
            };
            entry.busy = false;
            if entry.waiters.is_empty() {
                table.remove(key);
            } else if !entry.ready {
                entry.ready = true;
                ready.push_back(key.clone());
            }
        }
    }
}

/// Gives a statement's slot and keys back if its task is dropped mid-flight.
struct Flight<'a> {
    coalescer: &'a Coalescer,
    keys: Vec<String>,
    armed: bool,
}

impl Drop for Flight<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.coalescer.abandon(&self.keys);
        }
    }
}

impl State {
    /// The next statement, if a slot is free and callers are waiting: up to `max_batch` ready
    /// keys, each with the callers of its first caller's cost, sorted by key. Callers that gave
    /// up or whose deadline passed leave the queue here.
    fn next_batch(&mut self, settings: &Settings, cap: usize, now: Instant) -> Option<Vec<Item>> {
        if self.in_flight >= cap {
            return None;
        }
        let mut items = Vec::new();
        // One statement holds keys of one part of the store (one shard): the first key's.
        // Keys of other parts keep their place at the front of the queue, for the next
        // statement; the scan past them is bounded.
        let mut part: Option<usize> = None;
        let mut skipped: Vec<String> = Vec::new();
        while items.len() < settings.max_batch {
            let Some(key) = self.ready.pop_front() else {
                break;
            };
            let Some(entry) = self.keys.get_mut(&key) else {
                continue;
            };
            if part.is_some_and(|p| p != entry.part) {
                if skipped.len() < 4 * settings.max_batch {
                    skipped.push(key);
                    continue;
                }
                self.ready.push_front(key);
                break;
            }
            let entry_part = entry.part;
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
            self.queued -= before - entry.waiters.len();
            let Some((cost, bucket)) = first else {
                self.keys.remove(&key);
                continue;
            };
            entry.busy = true;
            part = Some(entry_part);
            items.push(Item {
                key,
                bucket,
                cost,
                waiters: group,
            });
        }
        for key in skipped.into_iter().rev() {
            self.ready.push_front(key);
        }
        if items.is_empty() {
            return None;
        }
        self.in_flight += 1;
        items.sort_unstable_by(|a, b| a.key.cmp(&b.key));
        Some(items)
    }
}

/// The bucket as a statement left it: `remaining` tokens, refilled up to the store's time plus
/// however far the row's refill time was ahead of it (another writer's clock). The `ahead` part
/// is recovered exactly from `reset_after = ahead + time_to_refill(capacity − remaining)`.
fn state_after(acquired: &Acquired, bucket: &BucketConfig) -> BucketState {
    let now = timestamp_from_system_time(acquired.store_now);
    let to_full = bucket.time_to_refill(bucket.capacity().saturating_sub(acquired.remaining));
    let reset = u64::try_from(acquired.reset_after.as_nanos()).unwrap_or(u64::MAX);
    BucketState {
        tokens: acquired.remaining,
        last_refill: now.saturating_add(reset.saturating_sub(to_full)),
    }
}

/// The pure bucket's denial of `cost` from `state` at `acquired`'s store time, or `None` when
/// it would allow it.
fn denial(
    state: BucketState,
    acquired: &Acquired,
    bucket: &BucketConfig,
    cost: Tokens,
) -> Option<Acquired> {
    let now = timestamp_from_system_time(acquired.store_now);
    match state.take(bucket, now, cost) {
        Ok((
            _,
            Outcome::Denied {
                remaining,
                retry_after,
            },
        )) => Some(Acquired {
            granted: Tokens::ZERO,
            remaining,
            retry_after: nanos(retry_after),
            ..*acquired
        }),
        _ => None,
    }
}

/// Hands a grant of `k × cost` to the item's first `k` callers, each with what it would have
/// seen had the takes after it not happened yet; the rest are denied as the pure bucket denies
/// them at the statement's store time.
fn share_out(
    item: Item,
    acquired: &Acquired,
    answers: &mut Vec<(Reply, Result<Acquired, Unanswered>)>,
) {
    let cost = item.cost.as_atto().max(1);
    let admitted = (acquired.granted.as_atto() / cost) as usize;
    let state = state_after(acquired, &item.bucket);
    let ahead = state
        .last_refill
        .saturating_since(timestamp_from_system_time(acquired.store_now));
    let denied = denial(state, acquired, &item.bucket, item.cost).unwrap_or(Acquired {
        granted: Tokens::ZERO,
        ..*acquired
    });
    for (i, waiter) in item.waiters.into_iter().enumerate() {
        let answer = if i < admitted {
            let later = (admitted - 1 - i) as u128 * cost;
            let remaining = acquired.remaining.saturating_add(Tokens::from_atto(later));
            let to_full = item
                .bucket
                .time_to_refill(item.bucket.capacity().saturating_sub(remaining));
            Acquired {
                granted: waiter.cost,
                remaining,
                retry_after: std::time::Duration::ZERO,
                reset_after: nanos(ahead.saturating_add(to_full)),
                store_now: acquired.store_now,
            }
        } else {
            denied
        };
        answers.push((waiter.reply, Ok(answer)));
    }
}

/// Denies, from a statement's answer for their key, the callers queued behind it that ask for
/// more than the bucket had left: the pure bucket at the statement's store time denies them,
/// and a denial changes nothing in the bucket, so no other decision moves. They queued while
/// the statement was in flight, so that store time falls within their wait or just before it.
/// Callers whose cost the bucket still holds, or under another bucket shape, stay queued.
fn deny_from(
    acquired: &Acquired,
    bucket: &BucketConfig,
    waiters: &mut VecDeque<Waiter>,
    answers: &mut Vec<(Reply, Result<Acquired, Unanswered>)>,
) {
    if waiters.iter().all(|w| w.cost <= acquired.remaining) {
        return;
    }
    let state = state_after(acquired, bucket);
    let mut rest = VecDeque::with_capacity(waiters.len());
    for waiter in waiters.drain(..) {
        let denied = (waiter.bucket == *bucket && waiter.cost > acquired.remaining)
            .then(|| denial(state, acquired, bucket, waiter.cost))
            .flatten();
        match denied {
            Some(answer) => answers.push((waiter.reply, Ok(answer))),
            None => rest.push_back(waiter),
        }
    }
    *waiters = rest;
}
