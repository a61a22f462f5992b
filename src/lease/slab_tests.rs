//! Unit tests of `slab.rs`, apart from it so that the loom models, which compile `slab.rs`
//! against loom's atomics, do not compile them too.

use std::sync::atomic::Ordering;

use super::slab::{CHUNK, HotRef, NO_PLAN, Slab};
use super::word::{LeaseWord, Take};

/// Records are handed out once each, recycled when released and reset before reuse; a full
/// slab says so instead of handing out a record twice.
#[test]
fn hands_out_each_record_once_and_recycles_released_ones() {
    let slab = Slab::new(2 * CHUNK);
    let mut held: Vec<HotRef> = (0..2 * CHUNK)
        .map(|_| slab.alloc().expect("room"))
        .collect();
    assert!(slab.alloc().is_none(), "full");
    let mut seen: Vec<u32> = held.iter().map(HotRef::index).collect();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), 2 * CHUNK);

    // Use a record, release it, get it back clean.
    let used = held.pop().expect("one");
    let index = used.index();
    assert_eq!(used.word.top_up(5), 0);
    used.low_water.store(3, Ordering::Relaxed);
    used.spread.store(true, Ordering::Relaxed);
    used.evicted.store(true, Ordering::Relaxed);
    used.dry.store(true, Ordering::Relaxed);
    used.queued.store(true, Ordering::Relaxed);
    used.plan.store(3, Ordering::Relaxed);
    assert!(matches!(used.word.try_take(1, 0), Take::Taken { .. }));
    drop(used);
    assert_eq!(slab.in_use(), 2 * CHUNK - 1);
    let again = slab.alloc().expect("recycled");
    assert_eq!(again.index(), index);
    assert_eq!(again.word.load(), LeaseWord::new_pending().load());
    assert_eq!(again.low_water.load(Ordering::Relaxed), 0);
    assert!(!again.spread.load(Ordering::Relaxed));
    assert!(!again.evicted.load(Ordering::Relaxed));
    assert!(!again.dry.load(Ordering::Relaxed));
    assert!(!again.queued.load(Ordering::Relaxed));
    assert_eq!(size_of::<super::slab::Hot>(), 32);
    assert_eq!(again.plan.load(Ordering::Relaxed), NO_PLAN);
    assert!(std::ptr::eq(&*again, slab.get(index).expect("handed out")));
    assert!(slab.get(u32::MAX).is_none());
}

/// A record's strict lease (holder id, lease id) lives beside it in the slab: the holder is
/// drawn once, the lease id follows each renewal, and the claim's release takes it away, so a
/// recycled record's next slot starts without one.
#[test]
fn a_records_strict_lease_goes_with_its_claim() {
    let slab = Slab::new(4);
    let hot = slab.alloc().expect("room");
    assert_eq!(hot.strict(), None);
    hot.set_strict_lease_id(9);
    assert_eq!(hot.strict(), None, "no lease id without a holder");
    assert_eq!(hot.strict_holder(|| 7), 7);
    assert_eq!(hot.strict_holder(|| 8), 7, "drawn once");
    hot.set_strict_lease_id(3);
    assert_eq!(hot.strict(), Some((7, 3)));
    let other = slab.alloc().expect("room");
    assert_eq!(other.strict(), None, "each record its own");
    let index = hot.index();
    drop(hot);
    let again = slab.alloc().expect("recycled");
    assert_eq!(again.index(), index);
    assert_eq!(again.strict(), None);
}
