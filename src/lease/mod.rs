//! Leased mode: per-key token leases held in memory, spent with one CAS, refilled in the
//! background by an actor.
//!
//! A [`Leases`] owns the lease table (key → [`Slot`]) and is shared by the limiter's callers
//! and one actor task (`actor/`). A caller whose key has a live lease with enough tokens is
//! answered by [`Leases::try_take`]: a table lookup and a CAS on the slot's word
//! ([`word`]); no lock, no allocation, no system call, no `.await`. Below the low-water mark
//! the same CAS asks for a refill and the caller wakes the actor; it does not wait. A caller that
//! finds the lease empty registers what it needs and waits (bounded by the plan's `max_wait`)
//! for the one refill in flight for the key.
//!
//! The actor gathers the keys that asked, sizes each lease from the key's observed demand, and
//! refills them all with one statement; it closes expired leases and gives their unspent tokens
//! back (idempotently, by return id), evicts idle keys to keep the table within its bound, and on
//! shutdown gives every lease back. Its work follows what is due (a queue of expiry and idle
//! checks, at most one entry per key), not the number of keys: an idle table costs nothing. See `docs/design/leases.md` for the overshoot bound.
//!
//! [`Slot`]: slot::Slot

use std::hash::RandomState;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crossbeam_queue::ArrayQueue;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::plans::PlanRegistry;
use crate::policy::Plan;
use crate::store::Store;

mod actor;
mod counted;
mod credit;
use counted::{record_given, record_named};
mod credit_rules;
pub(crate) use credit_rules::FallbackCause;
use credit_rules::{FALLBACK_CAUSES, REMOVED_WORDS};
mod fast;
mod late;
mod signal;
mod slab;
#[cfg(test)]
mod slab_tests;
mod slot;
mod stats;
pub use stats::LeaseStats;
mod heads;
mod sync;
mod table;
mod timers;
mod total;
pub(crate) mod word;
mod words;
#[cfg(test)]
mod words_tests;

#[cfg(feature = "http")]
pub(crate) use fast::Pinned;
#[cfg(test)]
pub(crate) use slab::NO_PLAN;
use slab::Slab;
pub(crate) use slot::SlotRef;
#[cfg(feature = "http")]
pub(crate) use table::Hint;
use table::Table;
use word::Take;

/// Capacity of the queue of slots that asked for a refill: 8,192 cells of 16 bytes (a stamp and
/// a pointer), 128 KiB, allocated and written when the limiter starts. The actor is woken once
/// the queue is half full, so 4,096 keys crossing their low-water marks within one gathering (a
/// million quiet keys called 400,000 times a second) fit; a burst beyond that, as a flood of new
/// keys, costs the actor one scan of the table for `PENDING` slots after the overflow. At 65,536
/// cells (1 MiB) the queue alone was 105 bytes per key of a limiter with 10,000 keys
/// (`TOKENLEASE_BENCH_ONLY=memory`).
const NUDGES: usize = 1 << 13;

/// The most one lease holds, in nanotokens: the lease word's token field, which is
/// [`LeaseSettings::MAX_LEASE`](crate::policy::LeaseSettings::MAX_LEASE). A call costing more
/// is never spent from or waited on here (the limiter decides it by a store call).
pub(crate) const MAX_LEASE_NANOS: u64 = word::TOKENS;

const _: () = assert!(
    crate::policy::LeaseSettings::MAX_LEASE.as_atto() == MAX_LEASE_NANOS as u128 * 1_000_000_000
);

/// The longest the actor gathers low-water nudges before refilling them together.
pub(crate) const GATHER: Duration = Duration::from_millis(10);

/// Counters, written by the actor; the amounts in nanotokens, as totals that never wrap.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) leased: total::Total,
    pub(crate) returned: total::Total,
    pub(crate) stranded: total::Total,
    pub(crate) waived: total::Total,
    pub(crate) store_calls: AtomicU64,
    pub(crate) actor_rounds: AtomicU64,
    /// Actors started again after the previous one ended early.
    pub(crate) actor_restarts: AtomicU64,
    pub(crate) actor_visits: AtomicU64,
    /// Nanotokens admitted on credit.
    pub(crate) credit: total::Total,
    /// Nanotokens admitted on credit and never paid.
    pub(crate) credit_unpaid: total::Total,
    /// Refill statements that timed out and were asked for again (`late.rs`).
    pub(crate) late_refills: AtomicU64,
    /// Refill statements that failed (their keys' callers went to the fallback).
    pub(crate) failed_refills: AtomicU64,
    /// Calls of leased keys sent to the fallback, by `FallbackCause`.
    pub(crate) fallback: [AtomicU64; FALLBACK_CAUSES],
}

/// Settings of the lease table and actor that do not belong to one plan.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TableSettings {
    /// The most keys the table holds; beyond it new keys are decided without a lease.
    pub(crate) max_entries: usize,
    /// The actor's timer granularity: it wakes for the earliest lease due, and handles every
    /// expiry and idle check due within one tick of it in the same round (up to a tick early).
    pub(crate) tick: Duration,
    /// Sparse keys' calls go to the direct-mode coalescer while the actor is busy
    /// (`LimiterBuilder::sparse_keys_direct`).
    pub(crate) sparse_direct: bool,
}

/// The lease table and the handle to its actor.
#[derive(Debug)]
pub(crate) struct Leases {
    /// Key → slot (`table.rs`): lock-free lookups, the key inline next to its slot.
    table: Table,
    /// Lease decisions were counted since the actor's last flush of the threads' counts
    /// (`metrics::flush_all`): set by the first caller after a flush (which wakes the actor),
    /// cleared by the flush. Read by every lease decision, written twice per flush period.
    counts_due: AtomicBool,
    /// One shared copy of each plan the slots use, by name.
    plans: papaya::HashMap<String, Arc<Plan>>,
    settings: TableSettings,
    /// Slots that asked for a refill; the actor drains it. Bounded and lock-free: when full,
    /// a nudge is dropped and `overflowed` is set.
    nudges: ArrayQueue<SlotRef>,
    /// Low-water nudges are queued and the actor was woken for them: later ones do not wake it
    /// again. The actor clears it before it drains the queue.
    soon: AtomicBool,
    /// A caller waits for a refill: the actor refills at once instead of gathering.
    urgent: AtomicBool,
    /// A nudge was dropped: the actor's next round scans the table once for slots with
    /// `PENDING` (the only full pass left in the actor, and only after an overflow).
    overflowed: AtomicBool,
    /// Wakes the actor.
    wake: Notify,
    /// The actor waits with nothing in flight and nothing to send again; `went_idle` tells
    /// [`until_idle`](Leases::until_idle) when it starts to.
    idle: AtomicBool,
    went_idle: Notify,
    /// Set when the limiter is dropped or shut down.
    stopping: AtomicBool,
    /// Tokio's clock when the table started: [`now`](Self::now) counts from there.
    origin: Instant,
    store: Arc<dyn Store>,
    pub(crate) counters: Counters,
    /// How long a refill statement takes, in nanoseconds (a moving average the actor keeps):
    /// leases are sized to last until a refill asked at the low-water mark lands.
    pub(crate) refill_ns: AtomicU64,
    /// The actor has a statement in flight (a refill or a give-back): a sparse key's call that
    /// would wait behind it goes to the direct-mode coalescer instead (`Hot::sparse`). Relaxed:
    /// a hint; a stale read sends one call the other way, and either decides it exactly.
    pub(crate) busy: AtomicBool,
    actor: Mutex<Option<JoinHandle<()>>>,
    /// Whether an actor task is running: set when one is spawned, cleared by the task itself when
    /// it ends, however it ends (its runtime dropped, a panic, shutdown).
    alive: AtomicBool,
    /// Give-backs an actor that ended early left unsent: the next actor sends them.
    carry: Mutex<Vec<actor::Return>>,
    /// After a policy reload: which slots hold a lease of a plan no longer in force. The
    /// actor's next round retires them; a later reload replaces an earlier one not yet seen.
    reload: Mutex<Option<Stale>>,
    /// Credit not yet paid (`credit.rs`): what calls admitted on credit ([`Leases::credit`])
    /// still owe the store, by slot. An entry goes when a grant pays it, or when its slot
    /// leaves the table (then counted as unpaid). Locked after the slot's book.
    credit: credit::Credit,
    /// A hash filter of the keys this table has removed (evicted, retired after a reload): one
    /// bit per hash, set for good. A key whose bit is set gets no credit, so a key's credit is
    /// given by its first slot alone, and a lease of an earlier slot of the same key can never
    /// be spent in the same window as credit (the overshoot bound, `docs/design/leases.md`).
    removed: Box<[AtomicU64]>,
    /// Hashes keys for `removed`.
    hasher: RandomState,
    /// When a refill statement of the actor last answered, and last failed (local monotonic ns,
    /// 0 for never): credit is given only while the store answers.
    pub(crate) refill_ok_at: AtomicU64,
    pub(crate) refill_failed_at: AtomicU64,
    /// When the newest refill statement that answered was sent (local monotonic ns, 0 for
    /// none): a refill sent no later that timed out is late, not failed (`late.rs`).
    refill_ok_sent: AtomicU64,
}

/// `(key, slot's plan, reached through the key's prefix)` → whether the slot's lease must
/// close because the policies changed.
pub(crate) struct Stale(pub(crate) Box<StaleFn>);

/// The test behind [`Stale`].
pub(crate) type StaleFn = dyn Fn(&str, &Plan, bool) -> bool + Send + Sync;

impl std::fmt::Debug for Stale {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Stale")
    }
}

/// What [`Leases::try_take_known`] spent, and under which plan.
#[derive(Debug)]
pub(crate) struct Known {
    /// The capacity of the key's plan, as the policies chose it.
    pub(crate) capacity: crate::bucket::Tokens,
    /// Tokens left in the lease (nanotokens).
    pub(crate) left: u64,
    /// The store's remaining tokens at the last refill (nanotokens).
    pub(crate) store_remaining: u64,
}

/// What the fast path found.
#[derive(Debug)]
pub(crate) enum Fast {
    /// Spent from the lease.
    Taken {
        /// The slot, for the decision's numbers.
        left: u64,
        /// The store's remaining tokens at the last refill (nanotokens).
        store_remaining: u64,
    },
    /// The store said the bucket is empty: denied here until then.
    Dry {
        /// Nanoseconds until the store expects tokens.
        retry_after: u64,
    },
    /// The store failed recently for this key: the fallback decides.
    Failing,
    /// Not enough in the lease; a refill is asked for. Wait on the slot, or decide otherwise.
    Short(SlotRef),
    /// Not enough in the lease, and the key is sparse (called less than once per lease
    /// lifetime, or new): no refill is asked for. Decide with one store call (the direct-mode
    /// coalescer), then report it with [`Leases::record_direct`].
    Sparse(SlotRef),
    /// No slot and the table is full: decide without a lease.
    NoRoom,
    /// The slot waited on was retired (a policy reload closed its lease, or the table shut
    /// down): the call starts over.
    Gone,
}

impl Leases {
    /// A table over `store`, with its actor spawned on the current runtime.
    pub(crate) fn start(store: Arc<dyn Store>, settings: TableSettings) -> Arc<Leases> {
        let origin = crate::clock::instant();
        let leases = Arc::new(Leases {
            // Records for every key the table may hold, the removed keys whose slots are not yet
            // dropped (at most an eighth more, by the table's rebuild rule, plus what the actor
            // holds in flight), and slack.
            table: Table::new(Slab::new(
                settings.max_entries.saturating_mul(2).saturating_add(4096),
            )),
            counts_due: AtomicBool::new(false),
            plans: papaya::HashMap::new(),
            settings,
            nudges: ArrayQueue::new(NUDGES),
            soon: AtomicBool::new(false),
            urgent: AtomicBool::new(false),
            overflowed: AtomicBool::new(false),
            wake: Notify::new(),
            idle: AtomicBool::new(false),
            went_idle: Notify::new(),
            stopping: AtomicBool::new(false),
            origin,
            store,
            counters: Counters::default(),
            refill_ns: AtomicU64::new(0),
            busy: AtomicBool::new(false),
            actor: Mutex::new(None),
            alive: AtomicBool::new(false),
            carry: Mutex::new(Vec::new()),
            reload: Mutex::new(None),
            credit: credit::Credit::new(),
            removed: (0..REMOVED_WORDS).map(|_| AtomicU64::new(0)).collect(),
            hasher: RandomState::new(),
            refill_ok_at: AtomicU64::new(0),
            refill_failed_at: AtomicU64::new(0),
            refill_ok_sent: AtomicU64::new(0),
        });
        leases.ensure_actor();
        leases
    }

    /// Makes sure an actor task runs, starting one on the caller's tokio runtime when none does
    /// (the first leased call, or after the runtime that ran the previous one was dropped or
    /// the task panicked). A restarted actor sends the give-backs its predecessor left, finds
    /// every slot that asked for a refill and queues every lease's expiry again, so no lease is
    /// lost or counted twice. Returns `false` when no actor can run: outside a tokio runtime, or
    /// after shutdown. Cheap when the actor runs (one load).
    pub(crate) fn ensure_actor(self: &Arc<Self>) -> bool {
        if self.alive.load(Ordering::Acquire) {
            return true;
        }
        if self.stopping.load(Ordering::Acquire) {
            return false;
        }
        let mut actor = self.actor.lock();
        if self.alive.load(Ordering::Acquire) {
            return true;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            metrics::counter!(crate::metrics::ACTOR_UNAVAILABLE).increment(1);
            return false;
        };
        let restarted = actor.is_some();
        if restarted {
            metrics::counter!(crate::metrics::ACTOR_RESTARTS).increment(1);
            self.counters.actor_restarts.fetch_add(1, Ordering::AcqRel);
        }
        self.alive.store(true, Ordering::Release);
        *actor = Some(runtime.spawn(actor::run(Arc::clone(self), restarted)));
        true
    }

    /// Called by the actor before it waits: `idle` when it has nothing in flight and nothing to
    /// send again.
    pub(crate) fn set_idle(&self, idle: bool) {
        self.idle.store(idle, Ordering::Release);
        if idle {
            self.went_idle.notify_waiters();
        }
    }

    /// Waits until the actor is idle: waiting with no statement in flight, no give-back to send
    /// again, and no refill asked for and not yet sent (no nudge queued). Returns at once when
    /// no actor runs. For tests, which await this rather than sleep; a timer that falls due
    /// later (a lease's expiry) makes it busy again.
    pub(crate) async fn until_idle(&self) {
        loop {
            let went_idle = self.went_idle.notified();
            tokio::pin!(went_idle);
            went_idle.as_mut().enable();
            let quiet = self.nudges.is_empty()
                && !self.soon.load(Ordering::Acquire)
                && !self.urgent.load(Ordering::Acquire)
                && !self.overflowed.load(Ordering::Acquire)
                && self.reload.lock().is_none();
            if !self.alive.load(Ordering::Acquire) || (quiet && self.idle.load(Ordering::Acquire)) {
                return;
            }
            went_idle.await;
        }
    }

    /// Local monotonic time in nanoseconds (since the table started, by tokio's clock).
    pub(crate) fn now(&self) -> u64 {
        self.nanos_at(crate::clock::instant())
    }

    /// `at` in the table's local nanoseconds.
    pub(crate) fn nanos_at(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.origin).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Records that a caller waits for `cost` nanotokens of `slot` and asks the actor for a
    /// refill, unless one is pending already.
    pub(crate) fn ask_refill(&self, slot: &SlotRef, cost: u64) {
        slot.want(cost);
        if slot.words().request_refill() {
            self.nudge(slot);
        }
    }

    /// [`ask_refill`](Self::ask_refill) for a caller that will not wait (`try_acquire_now_with`
    /// on a sparse key): the actor is woken at once even when a refill is pending, as it is for
    /// a new key's first call, so the lease lands as soon as it can for a later call.
    pub(crate) fn ask_refill_now(&self, slot: &SlotRef, cost: u64) {
        slot.want(cost);
        slot.words().request_refill();
        self.nudge(slot);
    }

    /// Reports what one store call decided for a sparse key ([`Fast::Sparse`]): `spent`
    /// nanotokens taken (zero when denied), and, for a denial, the store's `retry_after` in
    /// nanoseconds. The spend counts in the key's demand as a lease's would, so a key whose
    /// calls speed up is sized a lease at the actor's next look, which this asks for (gathered
    /// with other nudges; nobody waits on it). A denial is the store's word until its retry
    /// time, as for a leased key: calls are denied here until then, without a statement each.
    /// A store call that failed (`failed`: the fallback decided) sends the key's calls to the
    /// fallback for a while without asking again, as a failed refill does.
    pub(crate) fn record_direct(
        &self,
        slot: &SlotRef,
        spent: u64,
        denied_for: Option<u64>,
        failed: bool,
    ) {
        let now = self.now();
        if failed {
            let until = now.saturating_add(actor::FAILURE_BACKOFF.as_nanos() as u64);
            slot.fallback_until.fetch_max(until, Ordering::AcqRel);
        }
        if let Some(retry_after) = denied_for {
            slot.deny_until
                .fetch_max(now.saturating_add(retry_after.max(1)), Ordering::AcqRel);
        }
        if spent > 0 {
            let mut book = slot.book.lock();
            let credited = book.credited.get().saturating_add(spent);
            book.credited.set(credited);
        }
        self.nudge_soon(slot);
    }

    /// Waits for `slot`'s refill and spends `cost` from it, until `deadline`. `plans` holds the
    /// counters of the slot's plan; `given`: the policies chose the call's plan. A `Failing` or `Short` answer sends the call to the
    /// fallback, and is counted by its cause here; `Sparse`, a call that waited out its
    /// deadline while refills of the key landed, got no credit, and the store answers, is
    /// decided by one store call.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped waiter leaves only its cost in the slot's `waiting` sum, which
    /// makes the next refill a little larger; the refill itself goes on.
    pub(crate) async fn wait(
        &self,
        slot: SlotRef,
        cost: u64,
        deadline: Instant,
        plans: &PlanRegistry,
        given: bool,
    ) -> Fast {
        let record = |plan: &Plan| {
            if given {
                record_given(plans, plan);
            } else {
                record_named(plans, plan);
            }
            self.counted();
        };
        // The actor answered for the slot while the call waited (a refill landed, and others
        // took it), as opposed to a refill of the key that is stuck.
        let mut landed = false;
        loop {
            let notified = slot.notify().notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let hot = slot.hot();
            match slot
                .words()
                .try_take(cost, hot.low_water.load(Ordering::Relaxed))
            {
                Take::Taken { left, nudge } => {
                    record(&slot.plan);
                    if nudge {
                        self.nudge_soon(&slot);
                    }
                    return Fast::Taken {
                        left,
                        store_remaining: hot.store_remaining.load(Ordering::Relaxed),
                    };
                }
                Take::Short { pending, .. } => {
                    if slot.evicted().load(Ordering::Acquire) {
                        return Fast::Gone;
                    }
                    match fast::closed(&slot, self.now()) {
                        Some(fast::Closed::Denied { retry_after }) => {
                            return Fast::Dry { retry_after };
                        }
                        Some(fast::Closed::Failing) => {
                            self.count_fallback(FallbackCause::Failing);
                            return Fast::Failing;
                        }
                        None => {}
                    }
                    if !pending {
                        self.ask_refill(&slot, cost);
                    } else {
                        // Maybe a low-water nudge, gathered for up to `GATHER`: a caller waits.
                        self.hurry();
                    }
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                break;
            }
            landed = true;
        }
        // The refill is late: admit the call against it instead of sending it to the fallback,
        // when the rules of `credit` allow.
        match self.credit(&slot, cost) {
            Ok(()) => {
                record(&slot.plan);
                Fast::Taken {
                    left: 0,
                    store_remaining: slot.hot().store_remaining.load(Ordering::Relaxed),
                }
            }
            // No credit, but refills of the key landed (others took them) and the store
            // answers: one store call decides, exactly, not the fallback.
            Err(FallbackCause::AtBound | FallbackCause::Returning)
                if landed && self.store_answers() =>
            {
                Fast::Sparse(slot)
            }
            Err(cause) => {
                self.count_fallback(cause);
                Fast::Short(slot)
            }
        }
    }

    /// The policy index recorded for `key`'s plan (`None` when the key is not in the table,
    /// `Some(slab::NO_PLAN)` when a caller named its plan). For tests.
    #[cfg(test)]
    pub(crate) fn plan_index(&self, key: &str) -> Option<u16> {
        let table = self.table.pin();
        table
            .get(key)
            .map(|(_, hot)| hot.plan.load(Ordering::Relaxed))
    }

    /// The table's shared copy of `plan` (the first one seen with its name).
    fn shared_plan(&self, plan: &Plan) -> Arc<Plan> {
        let plans = self.plans.pin();
        match plans.get(plan.name()) {
            Some(shared) if **shared == *plan => Arc::clone(shared),
            _ => {
                let shared = Arc::new(plan.clone());
                plans.insert(plan.name().to_owned(), Arc::clone(&shared));
                shared
            }
        }
    }

    /// Puts `cost` nanotokens back into `key`'s live lease; `false` when there is none (the
    /// caller then gives them back to the store).
    ///
    /// Only while the lease stays within its bound (`B`, see `actor::largest_lease`): a refund
    /// that would lift it above goes to the store instead, so refunds never add to the overshoot
    /// bound. The slot's bookkeeping lock serialises this with the actor's top-ups (which cap
    /// the lease the same way); callers' takes, which run beside it, only lower the lease.
    pub(crate) fn refund(&self, key: &str, cost: u64) -> bool {
        let table = self.table.pin();
        let Some((slot, hot)) = table.get(key) else {
            return false;
        };
        let book = slot.book.lock();
        let bound = actor::largest_lease(slot, book.max_cost.get());
        let refunded = slot.words_of(hot).refund_within(cost, bound);
        if refunded {
            // Callers waiting for the key's tokens may take these (`signal.rs`).
            slot.notify().notify_waiters();
        }
        refunded
    }

    /// Asks the actor to give every lease back and stop, and waits for it.
    pub(crate) async fn shutdown(&self) {
        self.stop();
        let handle = self.actor.lock().take();
        if let Some(handle) = handle {
            let _ = handle.await;
        }
        // An actor that ended early (its runtime dropped) gave nothing back: do it here.
        if !self.alive.load(Ordering::Acquire) {
            actor::shut_down_here(self).await;
        }
    }

    /// After a policy reload: the actor's next round closes every lease `stale` names, as at
    /// eviction (unspent tokens go back), and the key's next call starts a new one under the
    /// plan it is given then. Never blocks or waits.
    pub(crate) fn reload(&self, stale: Stale) {
        *self.reload.lock() = Some(stale);
        self.urgent.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// Asks the actor to give every lease back and stop, without waiting.
    pub(crate) fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        self.wake.notify_one();
    }
}
