//! The plans a limiter holds: those of the policies in force, each at an index, so a key's
//! record in the lease table can name its plan by index and a call can read it without a lock
//! or a reference count.
//!
//! Equal plans share one entry ([`PlanRegistry::intern_all`]), so reloading the same file again,
//! or flipping between two versions of it, adds nothing. The registry is bounded
//! ([`MAX_PLANS`] distinct plans at once); a reload interns its new plans beside those in
//! force, all or none ([`PlanRegistry::intern_all`]: one that would pass the bound is refused
//! and adds nothing), and once its policies are in force releases every entry they do not hold
//! ([`PlanRegistry::release_all_but`]): the entry leaves at once, is freed once no reader may
//! hold it, and its index goes to another plan once no fresh index is left.
//!
//! # Why a record may name a released index
//!
//! A key's record may name a plan no policy holds any more until the lease actor's next round
//! (and, for a call that chose its plan before the reload and writes the index after that
//! round, until the key's slot leaves the table). So:
//!
//! - Entries sit in one array, index → entry, which each reload that changes it replaces whole
//!   (trimmed after the last entry held), published in a one-entry `papaya` map: a reader pins
//!   it ([`PlanRegistry::pin`]) and the array it finds, with its entries, stays allocated until
//!   it unpins (epoch-based reclamation; no `unsafe`). A `papaya` map of the entries themselves
//!   never shrank: 65,000 plans and back to one left 4.7 MB of empty tables.
//! - Each index also has a state ([`PlanRegistry::state`]: [`LIVE`], [`REUSED`], or none), in
//!   chunks kept for the registry's life, which `try_acquire`'s fast path reads with one load
//!   instead of pinning the array: a released index is none, and the call takes the full path,
//!   as for a changed plan.
//! - An index given to another plan after a release is [`REUSED`]. A record naming it may mean
//!   the earlier plan, so a reader uses it only when the key's slot holds the very same `Arc`
//!   of the entry's plan (the slot keeps that plan alive, so no other plan can be at that
//!   address). A [`LIVE`] index names the only plan it ever held, which is the plan the slot of
//!   every record naming it holds: the fast path decides under the slot's plan. Fresh indices
//!   are taken first, so the fast path pins the registry only once 65,528 distinct plans were
//!   given, and then only on reused indices.
//! - A call holds the `Arc` of the plan its policies chose, not a reference into the registry;
//!   before it writes the plan's index into a record, and before it counts on the entry's
//!   counters, it checks that the registry still holds that very plan at that index
//!   ([`PlanRegistry::entry_of`]).
//!
//! An entry is found from its plan's [`Identity`] through a hash map, so interning a policy
//! is linear in its plans, whatever the registry holds.
//!
//! Each plan's decision counters (`metrics::PlanCounters`) are in a map beside the entries, by
//! their labels (name, fallback mode, shadow mode), for the entries' plans and the plans a
//! caller names (`Limiter::try_acquire_with`) alike, so that one set of labels has one set of
//! counters; a lease decision, counted per thread by the plan's name, looks them up only when a
//! thread's count changes plan (`metrics.rs`). They hold their metric handles only while the
//! plan is in force (`Limiter::reload` takes and releases them, `metrics/plan.rs`), and the
//! registry forgets them once released ([`PlanRegistry::forget_released_counters`]).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::bucket::BucketConfig;
use crate::metrics::{PlanCounters, mode_label};
use crate::policy::Plan;

/// The most distinct plans one limiter holds at once (65,528): as many as a policy may define,
/// so a limiter built with any policy holds it.
pub(crate) const MAX_PLANS: usize = crate::policy::MAX_PLANS;

// A key's record names its plan by a 16-bit index, `u16::MAX` meaning "named by the caller".
const _: () = assert!(MAX_PLANS < u16::MAX as usize);

/// Indices in the first chunk of [`PlanRegistry::states`]; chunk `k` holds `FIRST << k`.
const FIRST: usize = 8;
/// Chunks of states: `FIRST · (2^CHUNKS − 1)` indices in all.
const CHUNKS: usize = 13;

// The chunks cover exactly the indices.
const _: () = assert!(FIRST * ((1 << CHUNKS) - 1) == MAX_PLANS);

/// [`PlanRegistry::state`] of an index that holds an entry never held by another plan: the
/// only plan a record naming it can mean.
pub(crate) const LIVE: u8 = 1;
/// [`PlanRegistry::state`] of an index that holds an entry put where another was released: a
/// record naming it may mean the earlier plan.
pub(crate) const REUSED: u8 = 2;

/// The chunk of states index `i` is in, and its place there.
#[inline]
fn locate(i: usize) -> (usize, usize) {
    let n = i / FIRST + 1;
    let chunk = (usize::BITS - 1 - n.leading_zeros()) as usize;
    (chunk, i - FIRST * ((1 << chunk) - 1))
}

/// The registry's entries by index (`None` where there is none), as one array replaced whole
/// by each reload that changes it.
type Slots = Box<[Option<Arc<Entry>>]>;

/// The cell that publishes the current [`Slots`] (and the counters' map): a one-entry `papaya`
/// map, whose replaced values are freed once no reader that may have found them is pinned
/// (epoch-based reclamation, `seize`).
type Cell<V> = papaya::HashMap<u8, V, foldhash::fast::RandomState>;

/// The key of a [`Cell`]'s entry.
const CURRENT: u8 = 0;
/// The key a [`Cell`] retires empty values under, to flush a replaced one (see [`publish`]).
const SCRATCH: u8 = 1;

/// An empty cell whose replaced values are freed as soon as the readers that may hold them
/// have left (the `seize` collector's batches of one).
fn cell<V>() -> Cell<V> {
    papaya::HashMap::builder()
        .hasher(foldhash::fast::RandomState::default())
        .collector(seize::Collector::new().batch_size(1))
        .build()
}

/// Puts `value` in `cell`'s entry. `seize` hands a retired batch to the readers active at that
/// moment only once it holds one retired object per such reader, so a few empty values are
/// retired after it: the replaced one, and all it holds (65,000 entries after a large reload),
/// is freed once the readers that might hold it have moved on, not after 32 more reloads (the
/// demo grew by 40 MB a round trip without this).
fn publish<V: Send + Sync>(cell: &Cell<V>, value: V, empty: impl Fn() -> V) {
    cell.pin().insert(CURRENT, value);
    let cores = std::thread::available_parallelism().map_or(4, std::num::NonZero::get);
    for _ in 0..2 * cores + 8 {
        cell.pin().insert(SCRATCH, empty());
    }
}

/// The counters by labels.
type CountersMap = papaya::HashMap<Labels, Arc<PlanCounters>>;

/// A reader's view of the entries: what it finds stays valid until it is dropped.
pub(crate) type Pinned<'r> =
    papaya::HashMapRef<'r, u8, Slots, foldhash::fast::RandomState, papaya::LocalGuard<'r>>;

/// A plan the registry holds (its decision counters are in the map of counters, by its labels).
#[derive(Debug)]
pub(crate) struct Entry {
    /// The plan.
    pub(crate) plan: Arc<Plan>,
}

/// The labels a plan's counters are registered with.
#[derive(Debug, PartialEq, Eq)]
struct Labels {
    name: Box<str>,
    mode: &'static str,
    shadow: bool,
}

/// [`Labels`] borrowed from a plan, to look its counters up without allocating.
struct LabelsOf<'p> {
    name: &'p str,
    mode: &'static str,
    shadow: bool,
}

impl<'p> LabelsOf<'p> {
    fn new(plan: &'p Plan) -> LabelsOf<'p> {
        LabelsOf {
            name: plan.name(),
            mode: mode_label(plan.fallback().mode),
            shadow: plan.shadow(),
        }
    }
}

// The two hash alike, field by field, as the map needs of an equivalent key.
impl Hash for Labels {
    fn hash<H: Hasher>(&self, state: &mut H) {
        LabelsOf {
            name: &self.name,
            mode: self.mode,
            shadow: self.shadow,
        }
        .hash(state);
    }
}

impl Hash for LabelsOf<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.name.hash(state);
        self.mode.hash(state);
        self.shadow.hash(state);
    }
}

impl papaya::Equivalent<Labels> for LabelsOf<'_> {
    fn equivalent(&self, key: &Labels) -> bool {
        *key.name == *self.name && key.mode == self.mode && key.shadow == self.shadow
    }
}

/// What equal plans have in common, hashed to find a plan's entry: the entries of one
/// identity are the versions of a plan that differ only in their lease or fallback settings
/// (which hold floats, and are compared, not hashed).
#[derive(Debug, PartialEq, Eq, Hash)]
struct Identity {
    name: String,
    bucket: BucketConfig,
    shadow: bool,
}

impl Identity {
    fn of(plan: &Plan) -> Identity {
        Identity {
            name: plan.name().to_owned(),
            bucket: *plan.bucket(),
            shadow: plan.shadow(),
        }
    }
}

/// The entries of each identity.
type ByIdentity = HashMap<Identity, Vec<u32>>;

/// Why [`PlanRegistry::intern_all`] added nothing: the plans it was given that no entry
/// equals would take the registry past [`MAX_PLANS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Full {
    /// The entries the registry holds.
    pub(crate) held: usize,
    /// The plans no entry equals.
    pub(crate) adding: usize,
}

/// What the writers' lock guards.
#[derive(Default)]
struct Book {
    /// The entries of each identity.
    by_identity: ByIdentity,
    /// Slots below this have been used; those above never were.
    fresh: usize,
    /// Slots used before and emptied since, reused once no fresh slot is left.
    free: Vec<u32>,
}

/// Lock-free to read; entries released through epoch-based reclamation.
pub(crate) struct PlanRegistry {
    /// The entries, by index: one array, replaced by each reload that changes it.
    slots: Cell<Slots>,
    /// Each index's state ([`LIVE`], [`REUSED`], 0 for none), in chunks made as the indices are
    /// first used and kept for the registry's life (at most 64 KiB, 8 bytes for a policy of up
    /// to 8 plans): what `try_acquire`'s fast path reads instead of pinning the entries.
    states: [OnceLock<Box<[AtomicU8]>>; CHUNKS],
    /// Entries held now.
    live: AtomicUsize,
    /// Serialises writers (interning, releasing).
    push: Mutex<Book>,
    /// Serialises reloads: interning, putting in force and releasing go together.
    reload: Mutex<()>,
    /// The counters of every plan counted so far, entries' and named plans' alike, by their
    /// labels: a map that a release replaces with a smaller one (`papaya`'s never shrinks).
    counters: Cell<CountersMap>,
    /// Serialises adding counters with replacing their map, so that none is lost.
    adding: Mutex<()>,
    /// Plan comparisons made by `intern`, for the test that it is linear.
    #[cfg(test)]
    compared: AtomicUsize,
}

impl Default for PlanRegistry {
    fn default() -> PlanRegistry {
        PlanRegistry {
            slots: cell(),
            states: std::array::from_fn(|_| OnceLock::new()),
            live: AtomicUsize::new(0),
            push: Mutex::default(),
            reload: Mutex::default(),
            counters: cell(),
            adding: Mutex::default(),
            #[cfg(test)]
            compared: AtomicUsize::new(0),
        }
    }
}

impl std::fmt::Debug for PlanRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlanRegistry")
            .field("live", &self.live.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl PlanRegistry {
    /// A reader's view: entries it finds stay allocated until it is dropped.
    #[inline]
    pub(crate) fn pin(&self) -> Pinned<'_> {
        self.slots.pin()
    }

    /// The state of index `i`: [`LIVE`] when it holds an entry that no other plan held before
    /// (a record naming `i` means that entry's plan, the one its slot holds), [`REUSED`] when
    /// it holds one put where another was released (check the entry against the slot's plan),
    /// 0 when it holds none. Two loads, no pin: set before the entries are published, cleared
    /// before a release publishes the array without them. A reader that finds it stale by a
    /// reload decides as a call that came just before the reload.
    #[inline]
    pub(crate) fn state(&self, i: usize) -> u8 {
        let (chunk, offset) = locate(i);
        self.states
            .get(chunk)
            .and_then(OnceLock::get)
            .and_then(|states| states.get(offset))
            .map_or(0, |s| s.load(Ordering::Acquire))
    }

    /// Sets the state of index `i` (below [`MAX_PLANS`]).
    fn set_state(&self, i: usize, state: u8) {
        let (chunk, offset) = locate(i);
        let states = self.states[chunk]
            .get_or_init(|| (0..FIRST << chunk).map(|_| AtomicU8::new(0)).collect());
        states[offset].store(state, Ordering::Release);
    }

    /// Entry `i`, if the registry holds one there, found through `pinned` (from
    /// [`pin`](Self::pin)).
    #[inline]
    pub(crate) fn entry<'g>(&self, i: usize, pinned: &'g Pinned<'_>) -> Option<&'g Entry> {
        pinned.get(&CURRENT)?.get(i)?.as_deref()
    }

    /// The entry that holds `plan` (the same `Arc`) at slot `i`, if it still does: what the
    /// policies chose for a key, checked before its counters are used or its index recorded.
    #[inline]
    pub(crate) fn entry_of<'g>(
        &self,
        i: usize,
        plan: &Arc<Plan>,
        pinned: &'g Pinned<'_>,
    ) -> Option<&'g Entry> {
        self.entry(i, pinned).filter(|e| Arc::ptr_eq(&e.plan, plan))
    }

    /// The counters of `plan`, whether the registry holds it or a caller named it: found by
    /// its labels, and registered with the recorder installed now (at zero) the first time.
    pub(crate) fn counters_of(&self, plan: &Plan) -> Arc<PlanCounters> {
        self.counters_or(plan, PlanCounters::of)
    }

    /// The counters of `plan`, a plan the policies chose for a call: those of its labels
    /// while a plan of its labels is in force (a reload registers them before it puts its
    /// policies in force); once a reload removed it, counters of its own that hold no handle
    /// and are kept nowhere, so that a call in flight across the reload, or a key's lease
    /// that outlives it until the actor's next round, registers no series for it again.
    pub(crate) fn counters_of_given(&self, plan: &Plan) -> Arc<PlanCounters> {
        let cell = self.counters.pin();
        match cell
            .get(&CURRENT)
            .and_then(|m| m.pin().get(&LabelsOf::new(plan)).cloned())
        {
            Some(c) => c,
            None => Arc::new(PlanCounters::unheld(plan)),
        }
    }

    /// The counters of `plan`, made by `make` if there are none.
    fn counters_or(&self, plan: &Plan, make: fn(&Plan) -> PlanCounters) -> Arc<PlanCounters> {
        {
            let cell = self.counters.pin();
            if let Some(c) = cell
                .get(&CURRENT)
                .and_then(|m| m.pin().get(&LabelsOf::new(plan)).cloned())
            {
                return c;
            }
        }
        let _adding = self.adding.lock();
        let cell = self.counters.pin();
        let map = match cell.get(&CURRENT) {
            Some(map) => map,
            None => cell.get_or_insert_with(CURRENT, CountersMap::new),
        };
        let labels = LabelsOf::new(plan);
        let key = Labels {
            name: labels.name.into(),
            mode: labels.mode,
            shadow: labels.shadow,
        };
        Arc::clone(map.pin().get_or_insert_with(key, || Arc::new(make(plan))))
    }

    /// Runs `f` on the counters of every plan counted so far, entries' and named plans' alike.
    pub(crate) fn each_counters(&self, mut f: impl FnMut(&Arc<PlanCounters>)) {
        let cell = self.counters.pin();
        if let Some(map) = cell.get(&CURRENT) {
            for (_, counters) in &map.pin() {
                f(counters);
            }
        }
    }

    /// Forgets the counters of plans of earlier policies that hold no handles any more (a
    /// reload released them): a later call that names such a plan registers them afresh. When
    /// most go, the rest move to a map of their own size (a `papaya` map never shrinks).
    pub(crate) fn forget_released_counters(&self) {
        let released = |c: &PlanCounters| c.is_policy() && !c.is_held();
        let _adding = self.adding.lock();
        let cell = self.counters.pin();
        let Some(map) = cell.get(&CURRENT) else {
            return;
        };
        let (all, gone) = map.pin().iter().fold((0, 0), |(all, gone), (_, c)| {
            (all + 1, gone + usize::from(released(c)))
        });
        if gone == 0 {
            return;
        }
        if 4 * (all - gone) >= all {
            map.pin().retain(|_, c| !released(c));
            return;
        }
        // Most go: the rest move to a map of their size.
        let kept = CountersMap::new();
        {
            let (old, new) = (map.pin(), kept.pin());
            for (labels, c) in &old {
                if !released(c) {
                    let key = Labels {
                        name: labels.name.clone(),
                        mode: labels.mode,
                        shadow: labels.shadow,
                    };
                    new.insert(key, Arc::clone(c));
                }
            }
        }
        drop(cell);
        publish(&self.counters, kept, CountersMap::new);
    }

    /// Locks out other reloads while the caller interns, puts in force and releases.
    pub(crate) fn reloading(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.reload.lock()
    }

    /// Runs `f` on the plan of every entry held now.
    pub(crate) fn each_plan(&self, mut f: impl FnMut(&Arc<Plan>)) {
        let pinned = self.pin();
        for entry in pinned.get(&CURRENT).iter().flat_map(|s| s.iter()).flatten() {
            f(&entry.plan);
        }
    }

    /// The entry equal to `plan` (the same `Arc`, or an equal plan), added if there is none:
    /// its index and the shared `Arc`. `None` once the registry holds [`MAX_PLANS`].
    #[cfg(test)]
    pub(crate) fn intern(&self, plan: &Arc<Plan>) -> Option<(u32, Arc<Plan>)> {
        self.intern_all(std::slice::from_ref(plan)).ok()?.pop()
    }

    /// The entry of each of `plans`, in their order: the entry equal to it (the same `Arc`, or an
    /// equal plan), or a new one; all or nothing: when the plans no entry equals would take the
    /// registry past [`MAX_PLANS`], nothing is added and [`Full`] says how many there are.
    ///
    /// Takes time in the number of plans and, for each, in the entries of its [`Identity`],
    /// not in the registry's.
    pub(crate) fn intern_all(&self, plans: &[Arc<Plan>]) -> Result<Vec<(u32, Arc<Plan>)>, Full> {
        let mut book = self.push.lock();
        let pinned = self.pin();
        let current: &[Option<Arc<Entry>>] = pinned.get(&CURRENT).map_or(&[], |s| s);
        let found: Vec<Option<u32>> = plans.iter().map(|p| self.find(&book, current, p)).collect();
        let held = self.live.load(Ordering::Acquire);
        // A plan equal to an earlier new one is counted twice here and added once below:
        // never more than the bound.
        let adding = found.iter().filter(|i| i.is_none()).count();
        if held + adding > MAX_PLANS {
            return Err(Full { held, adding });
        }
        if adding == 0 {
            return Ok(found
                .into_iter()
                .map(|i| {
                    let i = i.expect("found");
                    (
                        i,
                        Arc::clone(&current[i as usize].as_ref().expect("held").plan),
                    )
                })
                .collect());
        }
        // The new array: the entries held, and the new ones.
        let mut next = current.to_vec();
        let interned = plans
            .iter()
            .zip(found)
            .map(|(plan, found)| {
                let i = found
                    .or_else(|| self.find(&book, &next, plan))
                    .unwrap_or_else(|| self.append(&mut book, &mut next, plan));
                (
                    i,
                    Arc::clone(&next[i as usize].as_ref().expect("held").plan),
                )
            })
            .collect();
        drop(pinned);
        publish(&self.slots, next.into_boxed_slice(), Slots::default);
        Ok(interned)
    }

    /// The entry equal to `plan` among `slots`, if any.
    fn find(&self, book: &Book, slots: &[Option<Arc<Entry>>], plan: &Arc<Plan>) -> Option<u32> {
        let same = book.by_identity.get(&Identity::of(plan))?;
        same.iter().copied().find(|&i| {
            #[cfg(test)]
            self.compared.fetch_add(1, Ordering::Relaxed);
            let entry = slots[i as usize].as_ref().expect("held");
            Arc::ptr_eq(&entry.plan, plan) || *entry.plan == **plan
        })
    }

    /// Adds `plan`, which no entry equals, to `slots`, of a registry below [`MAX_PLANS`]: its
    /// index. An index never used is taken first; once none is left, one a release emptied.
    fn append(
        &self,
        book: &mut Book,
        slots: &mut Vec<Option<Arc<Entry>>>,
        plan: &Arc<Plan>,
    ) -> u32 {
        let (index, reused) = if book.fresh < MAX_PLANS {
            book.fresh += 1;
            (book.fresh - 1, false)
        } else {
            (book.free.pop().expect("room checked before") as usize, true)
        };
        // The plan's counters, by its labels, without handles: `Limiter::reload` takes them for
        // every plan in force.
        self.counters_or(plan, PlanCounters::unheld);
        let entry = Entry {
            plan: Arc::clone(plan),
        };
        if slots.len() <= index {
            slots.resize(index + 1, None);
        }
        slots[index] = Some(Arc::new(entry));
        self.set_state(index, if reused { REUSED } else { LIVE });
        let index = u32::try_from(index).expect("below MAX_PLANS");
        book.by_identity
            .entry(Identity::of(plan))
            .or_default()
            .push(index);
        self.live.fetch_add(1, Ordering::AcqRel);
        index
    }

    /// Releases every entry but those of `keep` (the indices of the plans in force): each
    /// leaves the registry at once (a new array without it is published), is freed once no
    /// reader that may have found it is pinned, and its index is free for another plan (module
    /// docs). Returns how many were released.
    pub(crate) fn release_all_but(&self, keep: &[u32]) -> usize {
        let mut book = self.push.lock();
        let pinned = self.pin();
        let Some(current) = pinned.get(&CURRENT) else {
            return 0;
        };
        let mut next: Vec<Option<Arc<Entry>>> = vec![None; current.len()];
        for &i in keep {
            if let Some(slot) = next.get_mut(i as usize) {
                slot.clone_from(&current[i as usize]);
            }
        }
        let mut released = 0;
        for (i, entry) in current.iter().enumerate() {
            let Some(entry) = entry else { continue };
            if next[i].is_some() {
                continue;
            }
            let identity = Identity::of(&entry.plan);
            if let Some(same) = book.by_identity.get_mut(&identity) {
                same.retain(|&j| j as usize != i);
                if same.is_empty() {
                    book.by_identity.remove(&identity);
                }
            }
            book.free.push(u32::try_from(i).expect("below MAX_PLANS"));
            self.set_state(i, 0);
            released += 1;
        }
        if released == 0 {
            return 0;
        }
        self.live.fetch_sub(released, Ordering::AcqRel);
        // Nothing after the last entry held: the array shrinks with the plans in force.
        while next.last().is_some_and(Option::is_none) {
            next.pop();
        }
        drop(pinned);
        publish(&self.slots, next.into_boxed_slice(), Slots::default);
        if book.by_identity.capacity() > 4 * book.by_identity.len().max(64) {
            book.by_identity.shrink_to_fit();
        }
        if book.free.capacity() > 4 * book.free.len().max(64) {
            book.free.shrink_to_fit();
        }
        released
    }

    /// Whether some entry equals `plan`.
    #[cfg(test)]
    pub(crate) fn contains(&self, plan: &Plan) -> bool {
        let mut found = false;
        self.each_plan(|p| found |= **p == *plan);
        found
    }

    /// Entries held now.
    pub(crate) fn len(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::{BucketConfig, Rate, Tokens};

    fn plan(name: &str, capacity: u64) -> Arc<Plan> {
        Arc::new(Plan::new(
            name,
            BucketConfig::new(Tokens::whole(capacity), Rate::per_second(1).unwrap()).unwrap(),
        ))
    }

    #[test]
    fn equal_plans_share_an_entry_and_entries_stay_at_their_index() {
        let r = PlanRegistry::default();
        let (a, first) = r.intern(&plan("a", 10)).unwrap();
        let (a2, _) = r.intern(&plan("a", 10)).unwrap();
        assert_eq!(a, a2);
        let (b, _) = r.intern(&plan("a", 11)).unwrap();
        assert_ne!(a, b);
        for n in 0..100 {
            r.intern(&plan("n", n + 100)).unwrap();
        }
        let guard = r.pin();
        assert!(Arc::ptr_eq(
            &r.entry(a as usize, &guard).unwrap().plan,
            &first
        ));
        assert_eq!(r.len(), 102);
        assert!(r.contains(&plan("a", 11)));
        assert!(!r.contains(&plan("a", 12)));
        assert!(r.entry(102, &guard).is_none());
    }

    #[test]
    fn state_chunks_cover_every_index_once() {
        let mut seen = std::collections::HashSet::new();
        for i in 0..MAX_PLANS {
            let (chunk, offset) = locate(i);
            assert!(chunk < CHUNKS && offset < FIRST << chunk, "{i}");
            assert!(seen.insert((chunk, offset)));
        }
        assert_eq!(PlanRegistry::default().state(u16::MAX as usize), 0);
    }

    /// An index's state follows its entry: live when interned, none once released, reused
    /// when another plan takes it.
    #[test]
    fn an_index_state_follows_its_entry() {
        let r = PlanRegistry::default();
        let (a, _) = r.intern(&plan("a", 1)).unwrap();
        let (b, _) = r.intern(&plan("b", 1)).unwrap();
        assert_eq!((r.state(a as usize), r.state(b as usize)), (LIVE, LIVE));
        assert_eq!(r.state(b as usize + 1), 0, "no entry there");
        r.release_all_but(&[b]);
        assert_eq!((r.state(a as usize), r.state(b as usize)), (0, LIVE));
        let fill: Vec<_> = (0..MAX_PLANS - 2)
            .map(|n| plan("n", n as u64 + 2))
            .collect();
        r.intern_all(&fill).unwrap();
        let (x, _) = r.intern(&plan("x", 1)).unwrap();
        assert_eq!(x, a);
        assert_eq!(r.state(x as usize), REUSED);
    }

    /// One set of labels has one set of counters: an entry's, an equal plan's named by a
    /// caller, and those of another version of the plan with the same labels; a change of
    /// fallback mode or of shadow mode has its own.
    #[test]
    fn counters_are_found_by_their_labels() {
        use crate::policy::{FallbackMode, FallbackSettings};
        let r = PlanRegistry::default();
        let (i, shared) = r.intern(&plan("a", 10)).unwrap();
        assert!(r.entry(i as usize, &r.pin()).is_some());
        let held = &r.counters_of_given(&shared);
        assert!(Arc::ptr_eq(held, &r.counters_of(&plan("a", 10))));
        assert!(Arc::ptr_eq(held, &r.counters_of(&plan("a", 11))));
        let shadow = (*plan("a", 10)).clone().with_shadow(true);
        assert!(!Arc::ptr_eq(held, &r.counters_of(&shadow)));
        let deny = (*plan("a", 10))
            .clone()
            .with_fallback(FallbackSettings::new(FallbackMode::Deny));
        assert!(!Arc::ptr_eq(held, &r.counters_of(&deny)));
        assert!(Arc::ptr_eq(&r.counters_of(&deny), &r.counters_of(&deny)));
        assert!(!Arc::ptr_eq(held, &r.counters_of(&plan("b", 10))));
    }

    /// A release lets go of every entry but those kept, and frees their indices: a new plan
    /// takes a fresh index while there is one (its entry not reused), then a released one
    /// (reused). An equal plan interned again after its release is a new entry.
    #[test]
    fn released_entries_go_and_their_indices_are_taken_again_last() {
        let r = PlanRegistry::default();
        let (a, _) = r.intern(&plan("a", 1)).unwrap();
        let (b, b_plan) = r.intern(&plan("b", 1)).unwrap();
        assert_eq!(r.release_all_but(&[b]), 1);
        assert_eq!(r.len(), 1);
        assert!(!r.contains(&plan("a", 1)));
        let guard = r.pin();
        assert!(r.entry(a as usize, &guard).is_none());
        assert!(r.entry_of(b as usize, &b_plan, &guard).is_some());
        assert!(
            r.entry_of(b as usize, &plan("b", 1), &guard).is_none(),
            "another Arc"
        );
        // Fresh indices first: `a` again is a new entry at a new index.
        let (a2, _) = r.intern(&plan("a", 1)).unwrap();
        assert!(a2 > b && r.state(a2 as usize) == LIVE);
        let fill: Vec<_> = (0..MAX_PLANS - 3)
            .map(|n| plan("n", n as u64 + 2))
            .collect();
        r.intern_all(&fill).unwrap();
        assert_eq!(r.len(), MAX_PLANS - 1);
        assert!(
            r.intern_all(&[plan("x", 1), plan("y", 1)]).is_err(),
            "one index left"
        );
        let (x, _) = r.intern(&plan("x", 1)).unwrap();
        assert_eq!(x, a);
        assert_eq!(r.state(x as usize), REUSED);
        assert_eq!(r.len(), MAX_PLANS);
    }

    /// Interning is linear: each plan is compared with the entries of its own identity only,
    /// not with every entry before it. 65,000 distinct plans, then the same again: at most one
    /// comparison a plan (a scan of the registry made about 2·10⁹, over 40 s in a release
    /// build). Counted, not timed, so a busy machine cannot make it flaky; checked every 1,000
    /// plans, so a quadratic registry fails in its first thousand.
    #[test]
    fn interning_compares_each_plan_with_its_equals_only() {
        let r = PlanRegistry::default();
        let plans: Vec<_> = (0..65_000).map(|n| plan(&format!("p{n}"), 10)).collect();
        // In reloads of 1,000 plans each (a reload publishes one new array of entries).
        for (n, some) in plans.chunks(1_000).enumerate() {
            r.intern_all(some).unwrap();
            assert_eq!(
                r.compared.load(Ordering::Relaxed),
                0,
                "after {} plans",
                (n + 1) * 1_000
            );
        }
        // Equal plans in other `Arc`s: one comparison each finds the entry.
        for (n, p) in plans.iter().enumerate() {
            let again = Arc::new((**p).clone());
            assert_eq!(r.intern(&again).unwrap().0 as usize, n);
        }
        assert_eq!(r.compared.load(Ordering::Relaxed), 65_000);
        assert_eq!(r.len(), 65_000);
    }
}
