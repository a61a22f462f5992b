//! Outage debt: what the `allow` and `local` fallbacks admitted while the store could not
//! answer, recorded per plan and key and charged to the shared bucket once the store answers
//! again (`docs/design/outage-debt.md`).
//!
//! While the store is down the shared bucket refills, and the fallback admits on its own. Without
//! a record of those admissions the fleet finds a full bucket at recovery and admits it on top of
//! what the fallback already let through. The ledger here keeps, per limiter, `(plan, key) →`
//! tokens the fallback admitted; a background task takes them from the shared bucket after
//! recovery, in batched store calls (`min = 0`, `want = debt`: whatever the bucket holds now),
//! and carries what the bucket could not give to later rounds, so the refill pays it off.
//!
//! Charging starts when a call of the limiter finds the store answering again (or, with no
//! such call, after a probe wait without fallback decisions), and stops at a failed round.
//!
//! Bounds: at most [`MAX_KEYS`] keys per limiter (a new key's debt beyond them is counted as
//! dropped and not kept), debt unpaid [`MAX_AGE`] after it was last added to is dropped and
//! counted, one store call in flight per limiter with at most [`BATCH_KEYS`] keys, [`PACE`]
//! between rounds, and the task ends when the ledger is empty.

use crate::store::metered::{Metered, Purpose};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::bucket::{BucketConfig, Tokens};
use crate::metrics::PlanCounters;
use crate::policy::{FallbackMode, Plan};
use crate::store::{AcquireRequest, Store};

/// The most keys one limiter's ledger holds. A key's debt beyond them is counted in
/// `tokenlease_outage_debt_dropped_tokens_total` and not kept; keys already in the ledger keep
/// adding. An entry costs its key plus about 170 bytes (map slot, queue slot, counts), so at
/// most about 12 MB with 1,024-byte keys, about 2.2 MB with 50-byte keys; `docs/design/outage-debt.md` says
/// why not more.
pub(crate) const MAX_KEYS: usize = 10_000;

/// Debt left unpaid this long after it was last added to is dropped and counted: a bucket whose
/// refill has not paid it in that time is taken by callers as fast as it refills, and keeping
/// the debt for ever would keep the charging task for ever.
pub(crate) const MAX_AGE: Duration = Duration::from_secs(300);

/// The most keys one charging call carries (the store takes them in one statement).
pub(crate) const BATCH_KEYS: usize = 256;

/// The pause between two charging rounds while debt remains, unless a whole round's worth of
/// keys waits (then the next round goes at once, still one call at a time).
pub(crate) const PACE: Duration = Duration::from_millis(50);

/// While waiting for the store (at the start, after a failed round), the longest the task
/// waits for word that it answers again before it tries one round itself, if no call of the
/// limiter fell back within [`ACTIVE_GAP`]: from [`PROBE_MIN`], doubling, up to this.
pub(crate) const PROBE_MAX: Duration = Duration::from_secs(5);

/// The first such wait (see [`PROBE_MAX`]).
pub(crate) const PROBE_MIN: Duration = Duration::from_millis(250);

/// Two fallback decisions at most this far apart belong to one episode: while a limiter's last
/// fallback decision is at most this old, its callers still fall back. The charging task sends
/// no probe then (the store is still failing them), and the fallback counts the time between two
/// such decisions as time in fallback (`tokenlease_fallback_active_seconds`).
pub(crate) const ACTIVE_GAP: Duration = Duration::from_secs(1);

/// How often aged debt is looked for (a pass over the ledger).
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// One limiter's outage debt, as [`Limiter::outage_debt`](crate::Limiter::outage_debt) reports
/// it. Tokens are counted since the limiter was built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct OutageDebt {
    /// Tokens the fallback admitted that are not yet charged to the shared bucket.
    pub outstanding: Tokens,
    /// Keys (per plan) with outstanding debt.
    pub keys: usize,
    /// Tokens charged to the shared bucket so far.
    pub charged: Tokens,
    /// Tokens of debt given up so far: beyond the key bound, aged out, or left when the limiter
    /// was dropped (that last part is counted in the metric only).
    pub dropped: Tokens,
}

/// The ledger's limits and pacing. The constants above in production; tests shrink them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    pub(crate) max_keys: usize,
    pub(crate) max_age: Duration,
    pub(crate) batch_keys: usize,
    pub(crate) pace: Duration,
    pub(crate) probe_min: Duration,
    pub(crate) probe_max: Duration,
    /// The deadline of one charging call (the limiter's call deadline).
    pub(crate) deadline: Duration,
}

impl Settings {
    /// The production limits, with `deadline` per store call.
    pub(crate) fn new(deadline: Duration) -> Settings {
        Settings {
            max_keys: MAX_KEYS,
            max_age: MAX_AGE,
            batch_keys: BATCH_KEYS,
            pace: PACE,
            probe_min: PROBE_MIN,
            probe_max: PROBE_MAX,
            deadline,
        }
    }
}

/// A limiter's debt ledger and its charging task. Cheap to clone; `Debt::off()` records nothing.
#[derive(Debug, Clone, Default)]
pub(crate) struct Debt {
    shared: Option<Arc<Shared>>,
}

/// A ledger entry's name: the plan (its index in [`Entries::plans`]) and the key. Cloning it
/// clones one `Arc`: the key is allocated once, when its entry is made.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Id {
    plan: u32,
    key: Arc<str>,
}

/// The entries, per plan and key. Looking a key up allocates nothing (the maps are keyed by
/// `Arc<str>`, which borrows as `str`): a fallback decision during an outage records its debt
/// without allocating, unless its key is new.
#[derive(Default)]
struct Entries {
    /// Plan names seen, interned: an [`Id`]'s `plan` indexes this and `maps`.
    plans: Vec<Arc<str>>,
    maps: Vec<HashMap<Arc<str>, Entry, foldhash::fast::RandomState>>,
    len: usize,
}

impl Entries {
    /// The index of the plan called `name`, added if new (plans are few: a linear search).
    fn plan(&mut self, name: &str) -> u32 {
        match self.plans.iter().position(|p| &**p == name) {
            Some(i) => i as u32,
            None => {
                self.plans.push(name.into());
                self.maps.push(HashMap::default());
                (self.plans.len() - 1) as u32
            }
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Slots held by the maps.
    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.maps.iter().map(HashMap::capacity).sum()
    }

    /// The entry of `key` under plan `plan`, with its id.
    fn find(&mut self, plan: u32, key: &str) -> Option<(Id, &mut Entry)> {
        let map = self.maps.get_mut(plan as usize)?;
        let key = Arc::clone(map.get_key_value(key)?.0);
        let entry = map.get_mut(&*key)?;
        Some((Id { plan, key }, entry))
    }

    fn get_mut(&mut self, id: &Id) -> Option<&mut Entry> {
        self.maps.get_mut(id.plan as usize)?.get_mut(&*id.key)
    }

    fn contains_key(&self, id: &Id) -> bool {
        self.maps
            .get(id.plan as usize)
            .is_some_and(|m| m.contains_key(&*id.key))
    }

    fn insert(&mut self, id: &Id, entry: Entry) {
        if let Some(map) = self.maps.get_mut(id.plan as usize)
            && map.insert(Arc::clone(&id.key), entry).is_none()
        {
            self.len += 1;
        }
    }

    fn remove(&mut self, id: &Id) {
        if let Some(map) = self.maps.get_mut(id.plan as usize)
            && map.remove(&*id.key).is_some()
        {
            self.len -= 1;
        }
    }

    /// Keeps the entries `keep` says to keep.
    fn retain(&mut self, mut keep: impl FnMut(&mut Entry) -> bool) {
        for map in &mut self.maps {
            map.retain(|_, e| keep(e));
        }
        self.len = self.maps.iter().map(HashMap::len).sum();
    }

    /// Takes every entry out.
    fn drain(&mut self) -> impl Iterator<Item = Entry> + '_ {
        self.len = 0;
        self.maps.iter_mut().flat_map(|m| m.drain().map(|(_, e)| e))
    }

    /// Gives memory back from maps using under a quarter of what they hold.
    fn shrink(&mut self) {
        for map in &mut self.maps {
            let (len, cap) = (map.len(), map.capacity());
            if cap > KEEP_SLOTS && len.saturating_mul(4) < cap {
                map.shrink_to(len.saturating_mul(2).max(KEEP_SLOTS / 2));
            }
        }
    }
}

struct Entry {
    /// The plan's bucket when debt was last added (what the charge takes from).
    bucket: BucketConfig,
    counters: Arc<PlanCounters>,
    tokens: Tokens,
    last_added: Instant,
    /// In [`Ledger::queue`].
    queued: bool,
}

impl Entry {
    /// The debt is given up (aged out, or its limiter dropped): counted as dropped and taken
    /// off the outstanding gauge.
    fn give_up(&self) {
        self.counters.debt.dropped(self.tokens);
        self.counters
            .debt
            .outstanding
            .decrement(self.tokens.as_f64());
    }
}

/// Below this many slots the ledger's map and queue keep their memory.
const KEEP_SLOTS: usize = 1024;

impl Ledger {
    /// Gives memory back once the map or the queue uses under a quarter of what it holds: after
    /// a flood of keys is paid off, the ledger does not keep the flood's capacity (a map of
    /// 10,000 entries holds a megabyte or more) for the limiter's life.
    fn shrink(&mut self) {
        self.entries.shrink();
        let (len, cap) = (self.queue.len(), self.queue.capacity());
        if cap > KEEP_SLOTS && len.saturating_mul(4) < cap {
            self.queue
                .shrink_to(len.saturating_mul(2).max(KEEP_SLOTS / 2));
        }
    }
}

#[derive(Default)]
struct Ledger {
    entries: Entries,
    /// Entries waiting for a charging round, oldest first. An entry is here at most once
    /// (`queued`); ids whose entry left the ledger are skipped when they come up.
    queue: VecDeque<Id>,
    outstanding: Tokens,
    charged: Tokens,
    dropped: Tokens,
    last_sweep: Option<Instant>,
}

struct Shared {
    store: Arc<dyn Store>,
    settings: Settings,
    ledger: Mutex<Ledger>,
    /// A charging task runs (or is being started).
    running: AtomicBool,
    /// The task waits for the store to answer again (it starts so: debt comes from calls the
    /// store did not answer).
    parked: AtomicBool,
    wake: Notify,
    /// When the fallback last decided a call of this limiter: nanoseconds since `origin`, plus
    /// one (zero: never). While callers keep falling back, the task does not probe the store.
    last_fallback: AtomicU64,
    /// Tokio's clock when the ledger was made.
    origin: Instant,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Debt")
            .field("settings", &self.settings)
            .field("running", &self.running.load(Ordering::Relaxed))
            .field("parked", &self.parked.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The limiter is gone: its unpaid debt is given up, and leaves the gauge.
        let ledger = self.ledger.get_mut();
        for entry in ledger.entries.drain() {
            entry.give_up();
        }
    }
}

/// One key's part of a charging round.
struct Charge {
    id: Id,
    bucket: BucketConfig,
    want: Tokens,
}

impl Debt {
    /// A ledger charging over `store`.
    pub(crate) fn new(store: Arc<dyn Store>, settings: Settings) -> Debt {
        let origin = crate::clock::instant();
        Debt {
            shared: Some(Arc::new(Shared {
                store,
                settings,
                ledger: Mutex::new(Ledger::default()),
                running: AtomicBool::new(false),
                parked: AtomicBool::new(false),
                wake: Notify::new(),
                last_fallback: AtomicU64::new(0),
                origin,
            })),
        }
    }

    /// Records `cost` admitted by `plan`'s fallback on `key`, if the plan keeps outage debt
    /// (its `allow` or `local` fallback, with `outage_debt` on), and starts the charging task
    /// if none runs. The debt is counted on the plan's `counters`; `now` is the call's reading
    /// of tokio's clock.
    pub(crate) fn record(
        &self,
        plan: &Plan,
        counters: &Arc<PlanCounters>,
        key: &str,
        cost: Tokens,
        now: Instant,
    ) {
        let Some(shared) = &self.shared else { return };
        let fallback = plan.fallback();
        if !fallback.outage_debt || fallback.mode == FallbackMode::Deny || cost.is_zero() {
            return;
        }
        {
            let mut ledger = shared.ledger.lock();
            let ledger = &mut *ledger;
            let plan_ix = ledger.entries.plan(plan.name());
            let full = ledger.entries.len() >= shared.settings.max_keys;
            match ledger.entries.find(plan_ix, key) {
                Some((id, entry)) => {
                    entry.tokens = entry.tokens.saturating_add(cost);
                    entry.last_added = now;
                    entry.bucket = *plan.bucket();
                    if !entry.queued {
                        entry.queued = true;
                        ledger.queue.push_back(id);
                    }
                }
                None if full => {
                    ledger.dropped = ledger.dropped.saturating_add(cost);
                    counters.debt.dropped(cost);
                    return;
                }
                None => {
                    let id = Id {
                        plan: plan_ix,
                        key: key.into(),
                    };
                    ledger.entries.insert(
                        &id,
                        Entry {
                            bucket: *plan.bucket(),
                            counters: Arc::clone(counters),
                            tokens: cost,
                            last_added: now,
                            queued: true,
                        },
                    );
                    ledger.queue.push_back(id);
                }
            }
            ledger.outstanding = ledger.outstanding.saturating_add(cost);
        }
        counters.debt.outstanding.increment(cost.as_f64());
        Shared::ensure_task(shared);
    }

    /// Takes back up to `cost` of `key`'s debt under `plan`: an admission the caller gave up
    /// before it was used (a waiting call dropped while the fallback decided its try) owes the
    /// shared bucket nothing. A charge already in flight for the key may still take the debt as
    /// it stood, which under-admits and never over-admits.
    pub(crate) fn forgive(&self, plan: &Plan, key: &str, cost: Tokens) {
        let Some(shared) = &self.shared else { return };
        let mut ledger = shared.ledger.lock();
        let ledger = &mut *ledger;
        let plan_ix = ledger.entries.plan(plan.name());
        let Some((id, entry)) = ledger.entries.find(plan_ix, key) else {
            return;
        };
        let back = std::cmp::min(cost, entry.tokens);
        entry.tokens = entry.tokens.saturating_sub(back);
        entry.counters.debt.outstanding.decrement(back.as_f64());
        let gone = entry.tokens.is_zero();
        ledger.outstanding = ledger.outstanding.saturating_sub(back);
        // Its queue slot, if any, is skipped when it comes up.
        if gone {
            ledger.entries.remove(&id);
        }
    }

    /// [`record`](Self::record) at the ledger's clock's time now (tests).
    #[cfg(test)]
    pub(crate) fn record_now(
        &self,
        plan: &Plan,
        counters: &Arc<PlanCounters>,
        key: &str,
        cost: Tokens,
    ) {
        if self.shared.is_some() {
            self.record(plan, counters, key, cost, crate::clock::instant());
        }
    }

    /// The fallback decided a call (the store did not answer it): noted, so that the task
    /// does not probe the store while callers still fall back. `now`: the call's reading of
    /// tokio's clock.
    pub(crate) fn fallback_decided(&self, now: Instant) {
        if let Some(shared) = &self.shared {
            let since = now.saturating_duration_since(shared.origin);
            let nanos = u64::try_from(since.as_nanos()).unwrap_or(u64::MAX - 1);
            shared.last_fallback.store(nanos + 1, Ordering::Relaxed);
        }
    }

    /// The store answered a call: a task waiting for that (at its start, or after a failed
    /// round) charges now. One atomic load when nothing waits.
    pub(crate) fn store_answered(&self) {
        if let Some(shared) = &self.shared
            && shared.parked.load(Ordering::Acquire)
        {
            shared.wake.notify_one();
        }
    }

    /// The ledger's figures now.
    pub(crate) fn stats(&self) -> OutageDebt {
        match &self.shared {
            None => OutageDebt::default(),
            Some(shared) => {
                let ledger = shared.ledger.lock();
                OutageDebt {
                    outstanding: ledger.outstanding,
                    keys: ledger.entries.len(),
                    charged: ledger.charged,
                    dropped: ledger.dropped,
                }
            }
        }
    }
}

impl Shared {
    /// Starts the charging task unless one runs. Outside a tokio runtime none can start: the
    /// debt waits for the next record made inside one.
    fn ensure_task(shared: &Arc<Shared>) {
        if shared.running.swap(true, Ordering::AcqRel) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(charge(Arc::downgrade(shared)));
            }
            Err(_) => shared.running.store(false, Ordering::Release),
        }
    }

    /// Whether the fallback decided a call of this limiter within `within`.
    fn fell_back_within(&self, within: Duration, now: Instant) -> bool {
        match self.last_fallback.load(Ordering::Relaxed) {
            0 => false,
            at => {
                let at = self.origin + Duration::from_nanos(at - 1);
                now.saturating_duration_since(at) < within
            }
        }
    }

    /// Drops aged debt; whether any is left. When none is, the task is marked ended (under
    /// the ledger's lock, so a record made after it starts a new one).
    fn still_owing(&self, now: Instant) -> bool {
        let mut ledger = self.ledger.lock();
        self.sweep(&mut ledger, now);
        if ledger.entries.is_empty() {
            ledger.queue.clear();
            ledger.outstanding = Tokens::ZERO;
            self.running.store(false, Ordering::Release);
            return false;
        }
        true
    }

    /// Drops debt unpaid for the maximum age, at most once per [`SWEEP_EVERY`].
    fn sweep(&self, ledger: &mut Ledger, now: Instant) {
        let due = ledger
            .last_sweep
            .is_none_or(|at| now.saturating_duration_since(at) >= SWEEP_EVERY);
        if due {
            ledger.last_sweep = Some(now);
            let max_age = self.settings.max_age;
            let mut aged = Tokens::ZERO;
            ledger.entries.retain(|entry| {
                if now.saturating_duration_since(entry.last_added) < max_age {
                    return true;
                }
                entry.give_up();
                aged = aged.saturating_add(entry.tokens);
                false
            });
            ledger.outstanding = ledger.outstanding.saturating_sub(aged);
            ledger.dropped = ledger.dropped.saturating_add(aged);
            ledger.shrink();
            // Ids of entries that left stay queued until they come up; do not let them pile up.
            if ledger.queue.len() > 2 * ledger.entries.len() + 1024 {
                let entries = &ledger.entries;
                ledger.queue.retain(|id| entries.contains_key(id));
            }
        }
    }

    /// Takes the next round's keys off the queue, after dropping aged debt: `None` when the
    /// ledger is empty, and then the task is marked ended (as in [`still_owing`]).
    ///
    /// [`still_owing`]: Self::still_owing
    fn next_round(&self, now: Instant) -> Option<Vec<Charge>> {
        if !self.still_owing(now) {
            return None;
        }
        let mut ledger = self.ledger.lock();
        let ledger = &mut *ledger;
        let mut round = Vec::with_capacity(self.settings.batch_keys.min(ledger.entries.len()));
        let mut keys = HashSet::with_capacity(round.capacity());
        let mut later = Vec::new();
        while round.len() < self.settings.batch_keys {
            let Some(id) = ledger.queue.pop_front() else {
                break;
            };
            let Some(entry) = ledger.entries.get_mut(&id) else {
                continue;
            };
            // One statement takes each key once: the same key under another plan waits for
            // the next round.
            if !keys.insert(Arc::clone(&id.key)) {
                later.push(id);
                continue;
            }
            entry.queued = false;
            round.push(Charge {
                id,
                bucket: entry.bucket,
                want: std::cmp::min(entry.tokens, entry.bucket.capacity()),
            });
        }
        // Back at the front, in their order: they come first next round.
        for id in later.into_iter().rev() {
            ledger.queue.push_front(id);
        }
        Some(round)
    }

    /// Settles a round the store answered: each key's grant leaves its debt; a key still
    /// owing goes back in the queue.
    fn settle(&self, round: Vec<Charge>, granted: &[Tokens]) {
        let mut ledger = self.ledger.lock();
        let ledger = &mut *ledger;
        for (charge, &granted) in round.into_iter().zip(granted) {
            let Some(entry) = ledger.entries.get_mut(&charge.id) else {
                continue;
            };
            let paid = std::cmp::min(granted, entry.tokens);
            entry.tokens = entry.tokens.saturating_sub(paid);
            entry.counters.debt.charged(paid);
            entry.counters.debt.outstanding.decrement(paid.as_f64());
            ledger.outstanding = ledger.outstanding.saturating_sub(paid);
            ledger.charged = ledger.charged.saturating_add(paid);
            if entry.tokens.is_zero() {
                ledger.entries.remove(&charge.id);
            } else if !entry.queued {
                entry.queued = true;
                ledger.queue.push_back(charge.id);
            }
        }
        ledger.shrink();
    }

    /// Puts a failed round's keys back at the front of the queue.
    fn requeue(&self, round: Vec<Charge>) {
        let mut ledger = self.ledger.lock();
        let ledger = &mut *ledger;
        for charge in round.into_iter().rev() {
            if let Some(entry) = ledger.entries.get_mut(&charge.id)
                && !entry.queued
            {
                entry.queued = true;
                ledger.queue.push_front(charge.id);
            }
        }
    }
}

/// The charging task: rounds of at most `batch_keys` keys, `pace` apart, until the ledger is
/// empty. It starts waiting for the store to answer (debt comes from calls it did not answer),
/// and a round that fails (an error, or no answer by the deadline) sends it back to waiting.
/// It waits for word that a call of the limiter succeeded ([`Debt::store_answered`]); in case
/// none comes (no caller left, or leased keys whose refills land with nobody waiting), it tries
/// a round itself after a probe wait (`probe_min` doubling to `probe_max`), but not while the
/// limiter's callers still fall back (a fallback decision in the last second: the store is still
/// failing them, and a probe would only add a statement beside theirs). Ends when the ledger is empty or the limiter is dropped.
async fn charge(shared: Weak<Shared>) {
    let mut probe: Option<Duration> = None;
    let mut waiting = true;
    loop {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let settings = shared.settings;
        if waiting {
            shared.parked.store(true, Ordering::Release);
            let wait = probe.map_or(settings.probe_min, |p| (p * 2).min(settings.probe_max));
            probe = Some(wait);
            let woken = tokio::select! {
                () = shared.wake.notified() => true,
                () = tokio::time::sleep(wait) => false,
            };
            let now = crate::clock::instant();
            if !woken && shared.fell_back_within(ACTIVE_GAP, now) {
                if !shared.still_owing(now) {
                    return;
                }
                continue;
            }
            waiting = false;
        }
        let Some(round) = shared.next_round(crate::clock::instant()) else {
            return;
        };
        if round.is_empty() {
            // Nothing queued although debt is owed (cannot happen: every owing entry is
            // queued between rounds); look again after the pace.
            tokio::time::sleep(settings.pace).await;
            continue;
        }
        let requests: Vec<AcquireRequest<'_>> = round
            .iter()
            .map(|c| AcquireRequest::lease(&c.id.key, c.bucket, Tokens::ZERO, c.want))
            .collect();
        // One answer per key: a sharded store fails only the keys of a failing shard, and
        // the others' charges, taken in the store, are settled rather than charged again.
        let answer = Metered::new(&*shared.store, Purpose::Debt)
            .acquire_each_within(settings.deadline, &requests)
            .await;
        drop(requests);
        match answer {
            Some(answers) if answers.len() == round.len() && answers.iter().any(Result::is_ok) => {
                probe = None;
                shared.parked.store(false, Ordering::Release);
                let failed = answers.iter().any(Result::is_err);
                let (mut paid, mut unpaid) = (Vec::new(), Vec::new());
                let mut granted = Vec::new();
                for (charge, answer) in round.into_iter().zip(answers) {
                    match answer {
                        Ok(a) => {
                            granted.push(a.granted);
                            paid.push(charge);
                        }
                        Err(_) => unpaid.push(charge),
                    }
                }
                shared.settle(paid, &granted);
                if failed {
                    shared.requeue(unpaid);
                }
                // A backlog of a whole round or more (a flood of keys, each owing a little) is
                // charged round after round, still one call at a time; the pace is for keys
                // the bucket could not pay yet, so that their bucket is asked again only after
                // its refill had time to add something.
                let backlog = shared.ledger.lock().queue.len() >= settings.batch_keys;
                drop(shared);
                if backlog {
                    tokio::task::yield_now().await;
                } else {
                    tokio::time::sleep(settings.pace).await;
                }
            }
            _ => {
                shared.requeue(round);
                waiting = true;
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
