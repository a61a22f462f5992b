//! Key heads: the part of a long key up to its last `:`, kept once per lease table, so that a
//! bucket can hold a long key whole as its head's number and its tail's bytes.
//!
//! Keys of one limit share everything but their id (`ratelimit:entity:GET:/bookings/{id}:` and
//! then the booking), so the first bytes a bucket keeps of a long key are the same for every key
//! of the limit, and a lookup had to compare the rest through the slot's copy of the key: two
//! more cache lines (the slot, the key's own allocation) on every hit, most of a lookup's time
//! once the keys outgrow the cache. A bucket whose key has a known head holds the head's number
//! and the tail, and the head's bytes are read from here, one copy for every key that shares
//! it, which stays in the cache.
//!
//! A head is kept only when a second key with it comes in (a head seen once is remembered by its
//! hash, in a bounded set), so ids that contain `:` themselves do not fill the list with heads
//! one key uses; and the list is bounded ([`MAX_HEADS`], [`MAX_HEAD_BYTES`]). A key whose head
//! is not kept is compared through its slot, as before. Heads are never removed while the table
//! lives: they are few (one per limit, per key shape), and a bucket names one by number with no
//! count of its users.

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher;
use std::sync::OnceLock;

/// Heads a table keeps at most.
pub(super) const MAX_HEADS: usize = 1024;
/// Bytes of heads a table keeps at most.
pub(super) const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Hashes of heads seen once, kept at most; then they are forgotten all at once.
const MAX_SEEN: usize = 4096;
/// The number of no head.
pub(super) const NO_HEAD: u16 = u16::MAX;

const _: () = assert!(MAX_HEADS < NO_HEAD as usize);

/// Where `key`'s tail starts when the key can be kept as a head and a tail: it is longer than
/// `inline` bytes, and the part after its last `:` is 1 to `inline` bytes.
#[inline]
pub(super) fn split(key: &str, inline: usize) -> Option<usize> {
    if key.len() <= inline {
        return None;
    }
    let at = key.rfind(':')? + 1;
    (1..=inline).contains(&(key.len() - at)).then_some(at)
}

/// The heads kept, by number: read by lookups without a lock, added to by writers.
#[derive(Debug, Default)]
pub(super) struct Heads {
    /// Allocated at the first head kept: a table of short keys never has it.
    names: OnceLock<Box<[OnceLock<Box<str>>]>>,
}

impl Heads {
    /// Head `id`. Every number a bucket holds names a head set before the bucket was filled.
    #[inline]
    pub(super) fn get(&self, id: u16) -> Option<&str> {
        self.names.get()?.get(usize::from(id))?.get().map(|h| &**h)
    }
}

/// What only writers touch, behind the table's writers' mutex: the heads' numbers by name, and
/// the heads seen once.
#[derive(Debug, Default)]
pub(super) struct HeadIndex {
    ids: HashMap<Box<str>, u16>,
    /// Bytes of the heads kept.
    bytes: usize,
    /// Hashes of heads seen once and not kept.
    seen: HashSet<u64>,
}

impl HeadIndex {
    /// For a new key: its head's number and the head's length, keeping the head when this is
    /// the second key seen with it and there is room; `None` when the key is short, its tail
    /// too long, or its head not kept.
    pub(super) fn for_new(
        &mut self,
        heads: &Heads,
        key: &str,
        inline: usize,
        hasher: &impl BuildHasher,
    ) -> Option<(u16, usize)> {
        let at = split(key, inline)?;
        let head = &key[..at];
        if let Some(&id) = self.ids.get(head) {
            return Some((id, at));
        }
        let hash = hasher.hash_one(head);
        if !self.seen.remove(&hash) {
            if self.seen.len() >= MAX_SEEN {
                self.seen.clear();
            }
            self.seen.insert(hash);
            return None;
        }
        let id = self.ids.len();
        if id >= MAX_HEADS || self.bytes + head.len() > MAX_HEAD_BYTES {
            return None;
        }
        let names = heads
            .names
            .get_or_init(|| (0..MAX_HEADS).map(|_| OnceLock::new()).collect());
        // Writers are serialised and `id` is the next unused number: the cell is empty.
        let _ = names[id].set(head.into());
        let id = u16::try_from(id).ok()?;
        self.ids.insert(head.into(), id);
        self.bytes += head.len();
        Some((id, at))
    }

    /// For a key already in the table (a rebuild): its head's number and length when the head
    /// is kept, without keeping or counting one.
    pub(super) fn known(&self, key: &str, inline: usize) -> Option<(u16, usize)> {
        let at = split(key, inline)?;
        self.ids.get(&key[..at]).map(|&id| (id, at))
    }

    /// Heads kept.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.ids.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_splits_after_its_last_colon_when_the_tail_fits() {
        assert_eq!(split("ratelimit:entity:GET:/b/{id}:1234", 16), Some(29));
        assert_eq!(split("short:1", 16), None, "short keys are inline whole");
        assert_eq!(split("no-colon-in-this-long-key", 16), None);
        assert_eq!(
            split("a-long-key-ending-in-a-colon:", 16),
            None,
            "empty tail"
        );
        let tail = "x".repeat(17);
        assert_eq!(split(&format!("head:{tail}"), 16), None, "tail too long");
        assert_eq!(split(&format!("head:{}", &tail[..16]), 16), Some(5));
        // The id's own colon splits it: such a head is one key's, and is not kept (below).
        assert_eq!(split("ratelimit:entity:x:a:b", 16), Some(21));
    }

    /// A head is kept at its second key, numbered in order; one seen once is not; the list
    /// stops at its bound, and `known` never keeps one.
    #[test]
    fn heads_are_kept_at_their_second_key_and_within_the_bound() {
        let heads = Heads::default();
        let mut index = HeadIndex::default();
        let hasher = foldhash::fast::RandomState::default();
        let key = |head: usize, id: usize| format!("ratelimit:limit-{head}:{id}");
        assert_eq!(index.for_new(&heads, &key(0, 1), 16, &hasher), None);
        assert!(heads.get(0).is_none() && index.known(&key(0, 1), 16).is_none());
        let at = "ratelimit:limit-0:".len();
        assert_eq!(
            index.for_new(&heads, &key(0, 2), 16, &hasher),
            Some((0, at))
        );
        assert_eq!(
            index.for_new(&heads, &key(0, 3), 16, &hasher),
            Some((0, at))
        );
        assert_eq!(index.known(&key(0, 1), 16), Some((0, at)));
        assert_eq!(heads.get(0), Some("ratelimit:limit-0:"));
        assert_eq!(index.known(&key(1, 1), 16), None);
        for h in 1..MAX_HEADS + 10 {
            index.for_new(&heads, &key(h, 1), 16, &hasher);
            let got = index.for_new(&heads, &key(h, 2), 16, &hasher);
            assert_eq!(got.is_some(), h < MAX_HEADS, "head {h}");
        }
        assert_eq!(index.len(), MAX_HEADS);
        assert!(heads.get(u16::try_from(MAX_HEADS).unwrap()).is_none());
        assert!(heads.get(NO_HEAD).is_none());
    }

    /// Heads are bounded in bytes too.
    #[test]
    fn heads_stop_at_their_bytes() {
        let heads = Heads::default();
        let mut index = HeadIndex::default();
        let hasher = foldhash::fast::RandomState::default();
        let long = "h".repeat(1000);
        let mut kept = 0;
        for h in 0..100 {
            let key = |id: usize| format!("{long}{h:03}:{id}");
            index.for_new(&heads, &key(1), 16, &hasher);
            if index.for_new(&heads, &key(2), 16, &hasher).is_some() {
                kept += 1;
            }
        }
        assert_eq!(kept, MAX_HEAD_BYTES / 1004);
        assert!(index.bytes <= MAX_HEAD_BYTES);
    }
}
