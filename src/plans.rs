//! The plans a limiter has been given, across reloads: an append-only registry whose entries
//! never move, so a key's record in the lease table can name its plan by index and a call can
//! read it without a lock or a reference count.
//!
//! Equal plans share one entry ([`PlanRegistry::intern`]), so reloading the same file again,
//! or flipping between two versions of it, adds nothing. The registry is bounded
//! ([`MAX_PLANS`] distinct plans over the limiter's life); a reload that would pass the bound
//! is refused, and adds nothing ([`PlanRegistry::intern_all`]). Entries are never reused: a
//! key's record may name a plan no policy holds any more until the lease actor's next round,
//! and a call reads its entry without a lock or a reference count. So each distinct plan
//! counts once for the limiter's life, however often it is reloaded: flipping between
//! versions costs nothing, and a reload that changes `k` plans uses `k` entries.
//!
//! An entry is found from its plan's [`Identity`] through a hash map, so interning a policy
//! is linear in its plans, whatever the registry holds.
//!
//! Each entry holds its plan's decision counters (`metrics::PlanCounters`): a call that knows its
//! plan's index counts on them without a lookup. They hold their metric handles only while the
//! plan is in force (`Limiter::reload` takes and releases them, `metrics/plan.rs`). The plans a caller names (`Limiter::try_acquire_with`) have no index;
//! their counters are found by their labels (name, fallback mode, shadow mode) in a map beside
//! the entries, which the entries' own counters are in too, so that one set of labels has one
//! set of counters.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::bucket::BucketConfig;
use crate::metrics::{PlanCounters, mode_label};
use crate::policy::Plan;

/// Entries in the first chunk; chunk `k` holds `FIRST << k`.
const FIRST: usize = 8;
/// Chunks: `FIRST · (2^CHUNKS − 1)` entries in all.
const CHUNKS: usize = 13;
/// The most distinct plans one limiter holds over its life (65,528): as many as a policy may
/// define, so a limiter built with any policy holds it.
pub(crate) const MAX_PLANS: usize = crate::policy::MAX_PLANS;

// The chunks hold exactly that many.
const _: () = assert!(FIRST * ((1 << CHUNKS) - 1) == MAX_PLANS);

// A key's record names its plan by a 16-bit index, `u16::MAX` meaning "named by the caller".
const _: () = assert!(MAX_PLANS < u16::MAX as usize);

/// One chunk's entries, each set once.
type Chunk = Box<[OnceLock<Entry>]>;

/// A plan the registry holds, and its decision counters.
#[derive(Debug)]
struct Entry {
    plan: Arc<Plan>,
    counters: Arc<PlanCounters>,
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

/// Append-only, lock-free to read.
#[derive(Default)]
pub(crate) struct PlanRegistry {
    chunks: [OnceLock<Chunk>; CHUNKS],
    /// Entries published so far.
    len: AtomicUsize,
    /// The entries of each identity; its lock serialises appends.
    push: Mutex<ByIdentity>,
    /// The counters of every plan counted so far, entries' and named plans' alike, by their
    /// labels.
    counters: papaya::HashMap<Labels, Arc<PlanCounters>>,
    /// Plan comparisons made by `intern`, for the test that it is linear.
    #[cfg(test)]
    compared: AtomicUsize,
}

impl std::fmt::Debug for PlanRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlanRegistry")
            .field("len", &self.len.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// The chunk and offset of entry `i`.
#[inline]
fn locate(i: usize) -> (usize, usize) {
    let n = i / FIRST + 1;
    let chunk = (usize::BITS - 1 - n.leading_zeros()) as usize;
    (chunk, i - FIRST * ((1 << chunk) - 1))
}

impl PlanRegistry {
    /// Entry `i`, if it exists.
    #[inline]
    fn entry(&self, i: usize) -> Option<&Entry> {
        let (chunk, offset) = locate(i);
        self.chunks.get(chunk)?.get()?.get(offset)?.get()
    }

    /// The plan of entry `i`, if it exists.
    #[inline]
    pub(crate) fn get(&self, i: usize) -> Option<&Arc<Plan>> {
        self.entry(i).map(|e| &e.plan)
    }

    /// The plan of entry `i` and its counters, if it exists.
    #[inline]
    pub(crate) fn get_counted(&self, i: usize) -> Option<(&Arc<Plan>, &Arc<PlanCounters>)> {
        self.entry(i).map(|e| (&e.plan, &e.counters))
    }

    /// The counters of `plan`, whether the registry holds it or a caller named it: found by
    /// its labels, and registered with the recorder installed now (at zero) the first time.
    pub(crate) fn counters_of(&self, plan: &Plan) -> Arc<PlanCounters> {
        self.counters_or(plan, PlanCounters::of)
    }

    /// The counters of `plan`, made by `make` if there are none.
    fn counters_or(&self, plan: &Plan, make: fn(&Plan) -> PlanCounters) -> Arc<PlanCounters> {
        let counters = self.counters.pin();
        if let Some(c) = counters.get(&LabelsOf::new(plan)) {
            return Arc::clone(c);
        }
        let labels = LabelsOf::new(plan);
        let key = Labels {
            name: labels.name.into(),
            mode: labels.mode,
            shadow: labels.shadow,
        };
        Arc::clone(counters.get_or_insert_with(key, || Arc::new(make(plan))))
    }

    /// Runs `f` on the counters of every plan counted so far, entries' and named plans' alike.
    pub(crate) fn each_counters(&self, mut f: impl FnMut(&Arc<PlanCounters>)) {
        for (_, counters) in &self.counters.pin() {
            f(counters);
        }
    }

    /// The entry equal to `plan` (the same `Arc`, or an equal plan), added if there is none:
    /// its index and the shared `Arc`. `None` once the registry holds [`MAX_PLANS`].
    #[cfg(test)]
    pub(crate) fn intern(&self, plan: &Arc<Plan>) -> Option<(u32, &Arc<Plan>)> {
        self.intern_all(std::slice::from_ref(plan)).ok()?.pop()
    }

    /// The entry of each of `plans`, in their order, as [`intern`](Self::intern) finds or adds
    /// it; all or nothing: when the plans no entry equals would take the registry past
    /// [`MAX_PLANS`], nothing is added and [`Full`] says how many there are.
    ///
    /// Takes time in the number of plans and, for each, in the entries of its [`Identity`],
    /// not in the registry's.
    pub(crate) fn intern_all(&self, plans: &[Arc<Plan>]) -> Result<Vec<(u32, &Arc<Plan>)>, Full> {
        let mut by_identity = self.push.lock();
        let found: Vec<Option<u32>> = plans.iter().map(|p| self.find(&by_identity, p)).collect();
        let held = self.len.load(Ordering::Acquire);
        // A plan equal to an earlier new one is counted twice here and added once below:
        // never more than the bound.
        let adding = found.iter().filter(|i| i.is_none()).count();
        if held + adding > MAX_PLANS {
            return Err(Full { held, adding });
        }
        Ok(plans
            .iter()
            .zip(found)
            .map(|(plan, found)| {
                let i = found
                    .or_else(|| self.find(&by_identity, plan))
                    .unwrap_or_else(|| self.append(&mut by_identity, plan));
                (i, self.get(i as usize).expect("published"))
            })
            .collect())
    }

    /// The entry equal to `plan`, if any.
    fn find(&self, by_identity: &ByIdentity, plan: &Arc<Plan>) -> Option<u32> {
        let same = by_identity.get(&Identity::of(plan))?;
        same.iter().copied().find(|&i| {
            #[cfg(test)]
            self.compared.fetch_add(1, Ordering::Relaxed);
            let entry = self.get(i as usize).expect("published");
            Arc::ptr_eq(entry, plan) || **entry == **plan
        })
    }

    /// Adds `plan`, which no entry equals, to a registry below [`MAX_PLANS`]: its index.
    fn append(&self, by_identity: &mut ByIdentity, plan: &Arc<Plan>) -> u32 {
        let len = self.len.load(Ordering::Acquire);
        assert!(len < MAX_PLANS, "room checked before");
        let (chunk, offset) = locate(len);
        let slots = self.chunks[chunk]
            .get_or_init(|| (0..FIRST << chunk).map(|_| OnceLock::new()).collect());
        let entry = Entry {
            plan: Arc::clone(plan),
            // Without handles: `Limiter::reload` takes them for every plan in force.
            counters: self.counters_or(plan, PlanCounters::unheld),
        };
        let _ = slots[offset].set(entry);
        let index = len as u32;
        by_identity
            .entry(Identity::of(plan))
            .or_default()
            .push(index);
        self.len.store(len + 1, Ordering::Release);
        index
    }

    /// Whether some entry equals `plan`.
    #[cfg(test)]
    pub(crate) fn contains(&self, plan: &Plan) -> bool {
        let len = self.len.load(Ordering::Acquire);
        (0..len).any(|i| self.get(i).is_some_and(|p| **p == *plan))
    }

    /// Entries so far.
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
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
    fn chunks_cover_every_index_once() {
        let mut seen = std::collections::HashSet::new();
        for i in 0..MAX_PLANS {
            let (chunk, offset) = locate(i);
            assert!(chunk < CHUNKS && offset < FIRST << chunk, "{i}");
            assert!(seen.insert((chunk, offset)));
        }
    }

    #[test]
    fn equal_plans_share_an_entry_and_entries_never_move() {
        let r = PlanRegistry::default();
        let (a, first) = r.intern(&plan("a", 10)).unwrap();
        let first = Arc::clone(first);
        let (a2, _) = r.intern(&plan("a", 10)).unwrap();
        assert_eq!(a, a2);
        let (b, _) = r.intern(&plan("a", 11)).unwrap();
        assert_ne!(a, b);
        for n in 0..100 {
            r.intern(&plan("n", n + 100)).unwrap();
        }
        assert!(Arc::ptr_eq(r.get(a as usize).unwrap(), &first));
        assert_eq!(r.len(), 102);
        assert!(r.contains(&plan("a", 11)));
        assert!(!r.contains(&plan("a", 12)));
        assert!(r.get(102).is_none());
    }

    /// One set of labels has one set of counters: an entry's, an equal plan's named by a
    /// caller, and those of another version of the plan with the same labels; a change of
    /// fallback mode or of shadow mode has its own.
    #[test]
    fn counters_are_found_by_their_labels() {
        use crate::policy::{FallbackMode, FallbackSettings};
        let r = PlanRegistry::default();
        let (i, _) = r.intern(&plan("a", 10)).unwrap();
        let (_, held) = r.get_counted(i as usize).unwrap();
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

    /// Interning is linear: each plan is compared with the entries of its own identity only,
    /// not with every entry before it. 65,000 distinct plans, then the same again: at most one
    /// comparison a plan (a scan of the registry made about 2·10⁹, over 40 s in a release
    /// build). Counted, not timed, so a busy machine cannot make it flaky; checked every 1,000
    /// plans, so a quadratic registry fails in its first thousand.
    #[test]
    fn interning_compares_each_plan_with_its_equals_only() {
        let r = PlanRegistry::default();
        let plans: Vec<_> = (0..65_000).map(|n| plan(&format!("p{n}"), 10)).collect();
        for (n, p) in plans.iter().enumerate() {
            r.intern(p).unwrap();
            if n % 1_000 == 999 {
                assert_eq!(
                    r.compared.load(Ordering::Relaxed),
                    0,
                    "after {} plans",
                    n + 1
                );
            }
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
