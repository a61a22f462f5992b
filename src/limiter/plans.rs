//! The plans a limiter has been given, across reloads: an append-only registry whose entries
//! never move, so a key's record in the lease table can name its plan by index and a call can
//! read it without a lock or a reference count.
//!
//! Equal plans share one entry ([`PlanRegistry::intern`]), so reloading the same file again,
//! or flipping between two versions of it, adds nothing. The registry is bounded
//! ([`MAX_PLANS`] distinct plans over the limiter's life); a reload that would pass the bound
//! is refused.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::policy::Plan;

/// Entries in the first chunk; chunk `k` holds `FIRST << k`.
const FIRST: usize = 8;
/// Chunks: `FIRST · (2^CHUNKS − 1)` entries in all.
const CHUNKS: usize = 13;
/// The most distinct plans one limiter holds over its life (65,528).
pub(crate) const MAX_PLANS: usize = FIRST * ((1 << CHUNKS) - 1);

// A key's record names its plan by a 16-bit index, `u16::MAX` meaning "named by the caller".
const _: () = assert!(MAX_PLANS < u16::MAX as usize);

/// One chunk's entries, each set once.
type Chunk = Box<[OnceLock<Arc<Plan>>]>;

/// Append-only, lock-free to read.
#[derive(Default)]
pub(crate) struct PlanRegistry {
    chunks: [OnceLock<Chunk>; CHUNKS],
    /// Entries published so far.
    len: AtomicUsize,
    /// Serialises appends.
    push: Mutex<()>,
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
    pub(crate) fn get(&self, i: usize) -> Option<&Arc<Plan>> {
        let (chunk, offset) = locate(i);
        self.chunks.get(chunk)?.get()?.get(offset)?.get()
    }

    /// The entry equal to `plan` (the same `Arc`, or an equal plan), added if there is none:
    /// its index and the shared `Arc`. `None` once the registry holds [`MAX_PLANS`].
    pub(crate) fn intern(&self, plan: &Arc<Plan>) -> Option<(u32, &Arc<Plan>)> {
        let _push = self.push.lock();
        let len = self.len.load(Ordering::Acquire);
        for i in 0..len {
            let entry = self.get(i).expect("published");
            if Arc::ptr_eq(entry, plan) || **entry == **plan {
                return Some((i as u32, entry));
            }
        }
        if len >= MAX_PLANS {
            return None;
        }
        let (chunk, offset) = locate(len);
        let slots = self.chunks[chunk]
            .get_or_init(|| (0..FIRST << chunk).map(|_| OnceLock::new()).collect());
        let _ = slots[offset].set(Arc::clone(plan));
        self.len.store(len + 1, Ordering::Release);
        Some((len as u32, slots[offset].get().expect("just set")))
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
}
