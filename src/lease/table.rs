//! The lease table: key → [`Slot`] and its fast-path record, read without a lock, the key stored
//! inline.
//!
//! A lookup is one probe of a flat array of buckets. Each bucket (40 bytes) holds, in one
//! allocation with its neighbours, a one-byte tag of the key's hash, the key itself (when short,
//! or as the number of its head and its tail's bytes, `heads.rs`) or else its first [`INLINE`]
//! bytes, the `Arc<Slot>` and the index of the slot's record in the table's [`Slab`]: a hit
//! costs the bucket's cache line and then the record's, where `papaya` cost an entry pointer, the
//! entry, the key's own allocation and then the slot (benches/README.md). The full hash is not
//! stored: a rebuild, the only place that needs it again, hashes the key anew.
//!
//! Buckets are write-once ([`OnceLock`]), so readers need nothing but an acquire load to read
//! one: a writer fills an empty bucket once, and a removal only marks the entry gone (an atomic
//! flag), leaving a tombstone the probes walk past. Writers (new keys, removals) take a mutex that
//! readers never see. When tombstones and live keys fill the array, or tombstones pass a share of
//! the live keys, a writer copies the live entries into a fresh array and publishes it; the old one
//! is freed once no reader holds it. The current array sits in a two-entry `papaya` map used only
//! as that publication cell: its guard (epoch-based reclamation from `seize`) is what lets a reader
//! hold a bucket reference safely, with no reference count touched and no lock taken. (The second
//! entry is scratch: replacing it a few times after a rebuild flushes the old array's retirement,
//! see [`TableRef::rebuild`].) A new key's insert takes the writers' mutex; it allocates its slot
//! anyway, and the fast path is the lookup of a key that has one.
//!
//! A gone entry still holds its `Arc<Slot>` until the next rebuild, so rebuilds are also triggered
//! by tombstones alone (more than an eighth of the live keys, and at least 256): the memory kept
//! for removed keys stays a small fraction of the table's own.
//!
//! [`Slot`]: super::slot::Slot

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::heads::{HeadIndex, Heads, NO_HEAD};
use super::slab::{Hot, HotRef, Slab};
use super::slot::SlotRef;

/// Key bytes stored in the bucket itself: a key of at most this many bytes whole, a longer
/// key's tail after its head's number, or the first bytes of a longer key without a kept head
/// (compared through its slot's own copy: one more cache line, two with the copy's allocation).
/// 16 bytes are what is left of a 32-byte entry after the slot, the record index (with the
/// removal flag), the head's number, the length and the tag, and make a bucket 40 bytes with the
/// [`OnceLock`]'s state. (A 64-byte, line-aligned bucket with 34 bytes inline measured no faster
/// at 100,000 keys, and E4's flood then peaked above its 64 MiB.)
pub(super) const INLINE: usize = 16;
/// The length byte of a key longer than [`INLINE`] without a kept head.
const LONG: u8 = u8::MAX;
/// The smallest array.
const MIN_BUCKETS: usize = 16;
/// The bit of [`Entry::state`] that says the key was removed; the others are its record's index.
const GONE: u32 = 1 << 31;

const _: () = assert!(super::slab::MAX_RECORDS <= GONE as usize);

/// The tag of a key's hash: its low byte. The home bucket comes from the high bits
/// ([`Buckets::home`]), so keys probed together (same or nearby home) still differ in their
/// tags 255 times in 256.
#[inline]
fn tag(hash: u64) -> u8 {
    hash as u8
}

/// One key's entry: written once, when the key is inserted. 32 bytes.
#[derive(Debug)]
struct Entry {
    slot: SlotRef,
    /// The slot's record in the table's slab (the slot holds it, so it lives as long as the
    /// entry), and [`GONE`] once the key was removed: the entry is a tombstone until the next
    /// rebuild. One word, so a lookup's one acquire load reads both.
    state: AtomicU32,
    /// With [`NO_HEAD`]: the key's length when at most [`INLINE`], else [`LONG`]. With a head:
    /// the tail's length.
    len: u8,
    /// The [`tag`] of the key's hash: a probe passes a bucket of another key on this byte,
    /// without the 8 bytes the whole hash took (which made the bucket 48).
    tag: u8,
    /// The number of the key's head (`heads.rs`), or [`NO_HEAD`].
    head: u16,
    /// The key (short), its tail (with a head), or its first bytes (long), zero-padded.
    inline: [u8; INLINE],
}

impl Entry {
    /// The entry of `key`, whose head is `head` (its number and length) when kept.
    fn new(hash: u64, key: &str, slot: SlotRef, head: Option<(u16, usize)>) -> Entry {
        let bytes = key.as_bytes();
        let (head, part) = match head {
            Some((id, at)) => (id, &bytes[at..]),
            None => (NO_HEAD, &bytes[..bytes.len().min(INLINE)]),
        };
        let mut inline = [0; INLINE];
        inline[..part.len()].copy_from_slice(part);
        let len = if head == NO_HEAD && bytes.len() > INLINE {
            LONG
        } else {
            u8::try_from(part.len()).unwrap_or(LONG)
        };
        Entry {
            tag: tag(hash),
            state: AtomicU32::new(slot.hot_index()),
            slot,
            len,
            head,
            inline,
        }
    }

    /// Whether this entry is `key` (gone or not), `tag` being the [`tag`] of its hash. The tag
    /// first, then the length and inline bytes, then a head's bytes from `heads`; only a long
    /// key without a kept head whose first [`INLINE`] bytes match reads the slot's copy.
    /// (Comparing against a zero-padded copy of the key built once per lookup measured slower:
    /// the copy's variable-length write stalls the 16-byte load that follows it.)
    #[inline]
    fn is(&self, tag: u8, key: &str, heads: &Heads) -> bool {
        if self.tag != tag {
            return false;
        }
        let bytes = key.as_bytes();
        if self.head != NO_HEAD {
            let tail = usize::from(self.len);
            return bytes.len() > tail
                && same_short(&self.inline, &bytes[bytes.len() - tail..])
                && heads
                    .get(self.head)
                    .is_some_and(|head| head.as_bytes() == &bytes[..bytes.len() - tail]);
        }
        if self.len == LONG {
            bytes.len() > INLINE
                && same_short(&self.inline, &bytes[..INLINE])
                && *self.slot.key == *key
        } else {
            usize::from(self.len) == bytes.len() && same_short(&self.inline, bytes)
        }
    }

    /// The entry's key, for hashing it again: the inline bytes when they are all of it (no
    /// read of the slot), else the slot's copy.
    fn key(&self) -> &str {
        if self.len == LONG || self.head != NO_HEAD {
            &self.slot.key
        } else {
            // A short key's inline bytes are the whole of a `str`; the slot's copy is the same.
            std::str::from_utf8(&self.inline[..usize::from(self.len)]).unwrap_or(&self.slot.key)
        }
    }

    /// The slot's record's index.
    #[inline]
    fn hot(&self) -> u32 {
        // Relaxed: the index never changes; only the flag beside it does.
        self.state.load(Ordering::Relaxed) & !GONE
    }

    #[inline]
    fn live(&self) -> bool {
        self.state.load(Ordering::Acquire) & GONE == 0
    }

    /// Marks the key removed.
    fn remove(&self) {
        self.state.fetch_or(GONE, Ordering::Release);
    }
}

/// Whether `key` (at most [`INLINE`] bytes) is the first `key.len()` bytes of `inline`, by a few
/// fixed-size, possibly overlapping loads from each side instead of a call to `memcmp`: the two
/// loads at the ends of a range of length `n` in `4..=8` or `8..=16` cover it, as do the first,
/// middle and last byte of a range of 1 to 3 (the trick fast string hashes use).
#[inline]
fn same_short(inline: &[u8; INLINE], key: &[u8]) -> bool {
    fn word<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
        let mut out = [0; N];
        out.copy_from_slice(&b[at..at + N]);
        out
    }
    let n = key.len();
    match n {
        0 => true,
        1..=3 => inline[0] == key[0] && inline[n / 2] == key[n / 2] && inline[n - 1] == key[n - 1],
        4..=7 => {
            word::<4>(inline, 0) == word::<4>(key, 0)
                && word::<4>(inline, n - 4) == word::<4>(key, n - 4)
        }
        // 8 to 16 (= `INLINE`).
        _ => {
            word::<8>(inline, 0) == word::<8>(key, 0)
                && word::<8>(inline, n - 8) == word::<8>(key, n - 8)
        }
    }
}

/// One bucket: an [`Entry`] and the [`OnceLock`]'s state, 40 bytes.
#[derive(Debug)]
struct Bucket(OnceLock<Entry>);

const _: () = assert!(size_of::<Entry>() == 32 && size_of::<Bucket>() == 40);

impl std::ops::Deref for Bucket {
    type Target = OnceLock<Entry>;

    #[inline]
    fn deref(&self) -> &OnceLock<Entry> {
        &self.0
    }
}

/// One array of buckets, open addressing with linear probing.
#[derive(Debug)]
struct Buckets {
    buckets: Box<[Bucket]>,
    /// This array's number, never given to another array of any table ([`GENERATIONS`]): with
    /// a bucket's position it names one entry for good, since buckets are written once
    /// ([`Hint`]).
    generation: u64,
}

/// The numbers given to arrays so far, across every table of the process: a [`Hint`] made in
/// one table never matches an array of another.
static GENERATIONS: AtomicU64 = AtomicU64::new(1);

/// Bits of a [`Hint`] that hold the bucket's position; the others hold the array's number.
const POSITION_BITS: u32 = 24;

/// Where a key's entry was last found: the array's number and the bucket's position, packed in
/// one word so that both are read together. A caller that always looks up the same key (the
/// whole-route limit of an HTTP route, whose key is fixed) keeps one and skips the hash and the
/// probe while the array and the entry last (`TableRef::get_hinted`). 0 names nothing.
pub(crate) type Hint = AtomicU64;

impl Buckets {
    fn with_capacity(n: usize) -> Buckets {
        Buckets {
            buckets: (0..n.max(MIN_BUCKETS))
                .map(|_| Bucket(OnceLock::new()))
                .collect(),
            generation: GENERATIONS.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// An array of no buckets: what the scratch key holds.
    fn empty() -> Buckets {
        Buckets {
            buckets: Box::new([]),
            generation: 0,
        }
    }

    /// The hint naming bucket `at` of this array, or 0 when its position does not fit.
    fn hint(&self, at: usize) -> u64 {
        match u64::try_from(at) {
            Ok(at) if at < 1 << POSITION_BITS => self.generation << POSITION_BITS | at,
            _ => 0,
        }
    }

    /// The live entry `hint` names, when it names a bucket of this array.
    #[inline]
    fn at_hint(&self, hint: u64) -> Option<&Entry> {
        if hint == 0 || hint >> POSITION_BITS != self.generation & (u64::MAX >> POSITION_BITS) {
            return None;
        }
        let at = (hint & ((1 << POSITION_BITS) - 1)) as usize;
        self.buckets.get(at)?.get().filter(|e| e.live())
    }

    /// The first bucket to probe for `hash` (multiply-shift, so any array length works).
    #[inline]
    fn home(&self, hash: u64) -> usize {
        ((u128::from(hash) * self.buckets.len() as u128) >> 64) as usize
    }

    /// The entry for `key`, gone or not, or the index of the empty bucket its probe ended at.
    #[inline]
    fn find(&self, hash: u64, key: &str, heads: &Heads) -> Result<&Entry, usize> {
        self.find_at(hash, key, heads).map(|(_, e)| e)
    }

    /// [`find`](Self::find), with the position of the entry found.
    #[inline]
    fn find_at(&self, hash: u64, key: &str, heads: &Heads) -> Result<(usize, &Entry), usize> {
        let n = self.buckets.len();
        let mut i = self.home(hash);
        let tag = tag(hash);
        loop {
            match self.buckets[i].get() {
                None => return Err(i),
                Some(e) if e.is(tag, key, heads) && e.live() => return Ok((i, e)),
                Some(_) => i = if i + 1 == n { 0 } else { i + 1 },
            }
        }
    }

    fn live(&self) -> impl Iterator<Item = &Entry> {
        self.buckets
            .iter()
            .filter_map(|b| b.get().filter(|e| e.live()))
    }
}

/// What only writers touch, behind the writers' mutex.
#[derive(Debug, Default)]
struct Counts {
    /// Filled buckets in the current array (live and gone).
    used: usize,
    /// Gone entries in the current array.
    gone: usize,
    /// The kept heads' numbers (`heads.rs`).
    heads: HeadIndex,
}

/// The publication cell's key of the current array.
const CURRENT: u8 = 0;
/// A second key, replaced after each rebuild to flush the retirement of the old array.
const SCRATCH: u8 = 1;

/// Retirements after a rebuild: more than the threads that may be reading at once.
fn flush_count() -> usize {
    static COUNT: OnceLock<usize> = OnceLock::new();
    *COUNT.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        2 * cores + 8
    })
}

/// The publication cell's hasher: the cell holds two small keys, so the key is the hash.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Unit(u64);

impl BuildHasher for Unit {
    type Hasher = Unit;
    fn build_hasher(&self) -> Unit {
        Unit(0)
    }
}

impl std::hash::Hasher for Unit {
    fn finish(&self) -> u64 {
        // Spread the key over the high bits too (papaya takes a tag from them).
        self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0 << 8 | u64::from(b);
        }
    }
}

/// The lease table. See the [module docs](self).
#[derive(Debug)]
pub(crate) struct Table {
    /// The current array, under the key [`CURRENT`].
    current: papaya::HashMap<u8, Buckets, Unit>,
    /// Where the slots' records live; a bucket holds its record's index.
    slab: Arc<Slab>,
    /// Seeded per process, like `RandomState`; foldhash because SipHash costs more than the rest
    /// of the fast path on short keys.
    hasher: foldhash::fast::RandomState,
    /// Live keys.
    len: AtomicUsize,
    /// Long keys' heads, which buckets name by number.
    heads: Heads,
    /// Serialises writers; readers never take it.
    writers: Mutex<Counts>,
}

impl Table {
    /// An empty table whose slots' records come from `slab`.
    pub(crate) fn new(slab: Arc<Slab>) -> Table {
        // Reclaim a replaced array as soon as no reader holds it, not after a batch of 32.
        let collector = seize::Collector::new().batch_size(1);
        let current = papaya::HashMap::builder()
            .hasher(Unit::default())
            .collector(collector)
            .build();
        current
            .pin()
            .insert(CURRENT, Buckets::with_capacity(MIN_BUCKETS));
        Table {
            current,
            slab,
            hasher: foldhash::fast::RandomState::default(),
            len: AtomicUsize::new(0),
            heads: Heads::default(),
            writers: Mutex::new(Counts::default()),
        }
    }

    /// A reader's view: lookups, and the writers' operations, valid while it lives.
    #[inline]
    pub(crate) fn pin(&self) -> TableRef<'_> {
        TableRef {
            table: self,
            current: self.current.pin(),
            rebuilt: std::cell::Cell::new(false),
        }
    }

    /// Live keys now.
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }
}

/// A pinned view of the [`Table`]: what it returns stays valid until it is dropped.
pub(crate) struct TableRef<'t> {
    table: &'t Table,
    current: papaya::HashMapRef<'t, u8, Buckets, Unit, papaya::LocalGuard<'t>>,
    /// Set once this view rebuilt the array on a removal: the arrays it replaced stay allocated
    /// until it is dropped (it pins them), so a sweep removing many keys rebuilds once, not once
    /// per eighth of the table.
    rebuilt: std::cell::Cell<bool>,
}

impl std::fmt::Debug for TableRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableRef")
            .field("len", &self.len())
            .finish()
    }
}

impl<'t> TableRef<'t> {
    #[inline]
    fn buckets(&self) -> &Buckets {
        // Always present: `Table::new` inserts it and writers only replace it.
        self.current.get(&CURRENT).expect("the lease table's array")
    }

    /// The slot of `key` and its record. No lock, no allocation: a hash, a probe, an acquire
    /// load per bucket, and the record's address (the slot itself is not read).
    #[inline]
    pub(crate) fn get(&self, key: &str) -> Option<(&SlotRef, &Hot)> {
        let hash = self.table.hasher.hash_one(key);
        let entry = self.buckets().find(hash, key, &self.table.heads).ok()?;
        Some((&entry.slot, self.table.slab.get(entry.hot())?))
    }

    /// [`get`](Self::get) through `hint`, which only lookups of this same `key` ever write:
    /// while the array it names is the current one and the entry there is live, that entry,
    /// with neither hash nor probe; else a lookup, which points the hint at the entry found.
    /// (A bucket is written once, and an array's number is never reused, so the entry a hint
    /// names is `key`'s for as long as it is live.)
    #[inline]
    pub(crate) fn get_hinted(&self, key: &str, hint: &Hint) -> Option<(&SlotRef, &Hot)> {
        let buckets = self.buckets();
        // Relaxed: the hint only says where to look; the bucket's own acquire load publishes
        // the entry, and a bucket not yet seen filled is a miss.
        let seen = hint.load(Ordering::Relaxed);
        if let Some(entry) = buckets.at_hint(seen) {
            debug_assert!(entry.is(entry.tag, key, &self.table.heads));
            return Some((&entry.slot, self.table.slab.get(entry.hot())?));
        }
        let hash = self.table.hasher.hash_one(key);
        let (at, entry) = buckets.find_at(hash, key, &self.table.heads).ok()?;
        let found = buckets.hint(at);
        if found != seen {
            hint.store(found, Ordering::Relaxed);
        }
        Some((&entry.slot, self.table.slab.get(entry.hot())?))
    }

    /// The slot of `key`, inserting `make(record)`'s when there is none, over a fresh record from
    /// the slab. `None` when the slab has no record left. Takes the writers' mutex.
    pub(crate) fn get_or_insert_with(
        &self,
        key: &str,
        make: impl FnOnce(HotRef) -> SlotRef,
    ) -> Option<&SlotRef> {
        let hash = self.table.hasher.hash_one(key);
        let mut counts = self.table.writers.lock();
        let mut buckets = self.buckets();
        if (counts.used + 1) * 8 > buckets.buckets.len() * 7 {
            buckets = self.rebuild(&mut counts, 1);
        }
        match buckets.find(hash, key, &self.table.heads) {
            Ok(found) => Some(&found.slot),
            Err(empty) => {
                let slot = make(self.table.slab.alloc()?);
                let head = counts
                    .heads
                    .for_new(&self.table.heads, key, INLINE, &self.table.hasher);
                let bucket = &buckets.buckets[empty];
                // Writers are serialised and the probe ended here, so the bucket is empty.
                let _ = bucket.set(Entry::new(hash, key, slot, head));
                counts.used += 1;
                self.table.len.fetch_add(1, Ordering::Relaxed);
                bucket.get().map(|e| &e.slot)
            }
        }
    }

    /// Removes `key`, returning its slot. Takes the writers' mutex.
    pub(crate) fn remove(&self, key: &str) -> Option<&SlotRef> {
        let hash = self.table.hasher.hash_one(key);
        let mut counts = self.table.writers.lock();
        let buckets = self.buckets();
        let found = buckets.find(hash, key, &self.table.heads).ok()?;
        found.remove();
        counts.gone += 1;
        self.table.len.fetch_sub(1, Ordering::Relaxed);
        let live = counts.used - counts.gone;
        if counts.gone > 256 && counts.gone * 8 > live && !self.rebuilt.replace(true) {
            self.rebuild(&mut counts, 0);
        }
        Some(&found.slot)
    }

    /// Rebuilds the array if tombstones pass the share at which a removal rebuilds (an eighth
    /// of the live keys, and more than 256), even if this view rebuilt already. For the end of
    /// a batch of removals, from a fresh view. Takes the writers' mutex.
    pub(crate) fn compact(&self) {
        let mut counts = self.table.writers.lock();
        let live = counts.used - counts.gone;
        if counts.gone > 256 && counts.gone * 8 > live {
            self.rebuild(&mut counts, 0);
        }
    }

    /// Removes every key.
    pub(crate) fn clear(&self) {
        let mut counts = self.table.writers.lock();
        for entry in self.buckets().live() {
            entry.remove();
        }
        self.table.len.store(0, Ordering::Relaxed);
        counts.gone = counts.used;
        self.rebuild(&mut counts, 0);
    }

    /// Copies the live entries into a new array with room for them and `extra` more, at most
    /// two thirds full, and publishes it. A long key whose head was kept after it came in is
    /// then stored by its head. Under the writers' mutex.
    fn rebuild(&self, counts: &mut Counts, extra: usize) -> &Buckets {
        let old = self.buckets();
        let live = counts.used - counts.gone;
        let fresh = Buckets::with_capacity((live + extra) * 3 / 2 + MIN_BUCKETS);
        for entry in old.live() {
            // The entry keeps only a tag of its hash: hash the key again for its new home.
            let key = entry.key();
            let hash = self.table.hasher.hash_one(key);
            // Keys are unique, so each goes to the first empty bucket of its probe.
            let n = fresh.buckets.len();
            let mut empty = fresh.home(hash);
            while fresh.buckets[empty].get().is_some() {
                empty = if empty + 1 == n { 0 } else { empty + 1 };
            }
            let head = counts.heads.known(key, INLINE);
            let _ =
                fresh.buckets[empty].set(Entry::new(hash, key, SlotRef::clone(&entry.slot), head));
        }
        counts.used = live;
        counts.gone = 0;
        self.current.insert(CURRENT, fresh);
        // `seize` hands a retired batch to the readers active at that moment only once it holds
        // one retired object per such reader; until then the old array, and every slot it holds,
        // stays allocated. So retire a few empty arrays after it: the old one is freed as soon as
        // the readers that might hold it have moved on (E4 measured 100 MiB without this).
        for _ in 0..flush_count() {
            self.current.insert(SCRATCH, Buckets::empty());
        }
        self.buckets()
    }

    /// Live keys and their slots, as of the current array.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&str, &SlotRef)> {
        self.buckets().live().map(|e| (&*e.slot.key, &e.slot))
    }

    /// Live slots.
    pub(crate) fn values(&self) -> impl Iterator<Item = &SlotRef> {
        self.buckets().live().map(|e| &e.slot)
    }

    /// Live keys now.
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::slot::test_slot as slot;

    /// `same_short` agrees with a plain comparison for every length up to [`INLINE`] and a
    /// difference at every position.
    #[test]
    fn same_short_compares_every_byte() {
        for n in 0..=INLINE {
            let key: Vec<u8> = (0..n).map(|i| b'a' + i as u8).collect();
            let mut inline = [0u8; INLINE];
            inline[..n].copy_from_slice(&key);
            assert!(same_short(&inline, &key), "length {n}");
            for at in 0..n {
                let mut other = key.clone();
                other[at] ^= 0x20;
                assert!(!same_short(&inline, &other), "length {n}, byte {at}");
            }
        }
    }

    /// Two keys `make` returns whose hashes share a [`tag`] (two of any 257 do).
    fn same_tag(table: &Table, make: impl Fn(usize) -> String) -> (String, String) {
        let mut seen = std::collections::HashMap::new();
        (0..=256)
            .map(make)
            .find_map(|k| {
                let tag = tag(table.hasher.hash_one(&k));
                seen.insert(tag, k.clone()).map(|first| (first, k))
            })
            .expect("two of 257 keys share a tag")
    }

    /// Keys of every length from 1 to 40 (inline up to [`INLINE`], through the slot beyond),
    /// each a prefix of the next, and pairs of keys sharing a tag (of one length up to and at
    /// [`INLINE`], and long with the same first [`INLINE`] bytes) are each found with their own
    /// slot, keys that differ from them are not, and a rebuild keeps them so.
    #[test]
    fn keys_of_every_length_and_shared_tags_stay_apart() {
        let slab = Slab::new(1024);
        let table = Table::new(Arc::clone(&slab));
        let pairs = [
            same_tag(&table, |i| format!("s{i:05}")),
            same_tag(&table, |i| format!("{}{i:05}", "x".repeat(INLINE - 5))),
            same_tag(&table, |i| format!("{}{i:05}", "p".repeat(INLINE))),
        ];
        for (a, b) in &pairs {
            assert_eq!(a.len(), b.len());
            assert_eq!(a[..INLINE.min(a.len() - 5)], b[..INLINE.min(b.len() - 5)]);
            // The entry of one is not the other, though the tag matches.
            let (ha, hb) = (table.hasher.hash_one(a), table.hasher.hash_one(b));
            assert_eq!(tag(ha), tag(hb));
            let entry = Entry::new(ha, a, slot(&slab, a), None);
            let heads = &table.heads;
            assert!(
                entry.is(tag(ha), a, heads) && !entry.is(tag(hb), b, heads),
                "{a} {b}"
            );
            assert_eq!(entry.key(), a);
        }
        let mut keys: Vec<String> = (1..=40)
            .map(|n| (0..n).map(|i| char::from(b'a' + (i % 26) as u8)).collect())
            .collect();
        keys.extend(pairs.iter().map(|(a, _)| a.clone()));
        let t = table.pin();
        let slots: Vec<SlotRef> = keys.iter().map(|k| slot(&slab, k)).collect();
        for (k, s) in keys.iter().zip(&slots) {
            t.get_or_insert_with(k, |_| SlotRef::clone(s))
                .expect("room");
        }
        // The second of each pair: absent until inserted, then found beside the first.
        for (a, b) in &pairs {
            assert!(t.get(b).is_none(), "{b} is not {a}");
        }
        let seconds: Vec<SlotRef> = pairs.iter().map(|(_, b)| slot(&slab, b)).collect();
        for ((_, b), s) in pairs.iter().zip(&seconds) {
            t.get_or_insert_with(b, |_| SlotRef::clone(s))
                .expect("room");
        }
        keys.extend(pairs.iter().map(|(_, b)| b.clone()));
        let slots: Vec<SlotRef> = slots.into_iter().chain(seconds).collect();
        let check = |t: &TableRef<'_>| {
            assert_eq!(t.len(), keys.len());
            for (k, s) in keys.iter().zip(&slots) {
                let (got, hot) = t.get(k).unwrap_or_else(|| panic!("{k} is found"));
                assert!(SlotRef::ptr_eq(got, s), "{k} has its own slot");
                assert!(std::ptr::eq(hot, s.hot()));
                // The same length with the last byte changed, and one byte more, are not keys.
                let mut other = k.clone().into_bytes();
                *other.last_mut().expect("not empty") ^= 0x20;
                let other = String::from_utf8(other).expect("ascii");
                assert!(t.get(&other).is_none(), "{other}");
                assert!(t.get(&format!("{k}!")).is_none(), "{k}!");
            }
        };
        check(&t);
        t.rebuild(&mut table.writers.lock(), 0);
        check(&t);
        drop(t);
        check(&table.pin());
    }

    /// Long keys stored by their head (`heads.rs`): every key of two heads of one length that
    /// differ in one byte, with ids of 1 to 16 bytes, is found with its own slot, and no key
    /// that differs from one of them in its head, its tail or its length is; two keys of one
    /// head sharing a tag stay apart; the first key of a head, stored before its head was kept,
    /// is stored by it after a rebuild; a key whose id has a colon is stored as before.
    #[test]
    fn long_keys_by_their_head_are_found_exactly() {
        let slab = Slab::new(8192);
        let table = Table::new(Arc::clone(&slab));
        let heads = [
            "ratelimit:entity:GET:/b/{bookingId}:",
            "ratelimit:entity:GET:/b/{bookingIe}:",
        ];
        let ids: Vec<String> = (0..300)
            .map(|i| format!("{i}"))
            .chain((1..=INLINE).map(|n| "z".repeat(n)))
            .chain(["a:b".to_owned()])
            .collect();
        let keys: Vec<String> = heads
            .iter()
            .flat_map(|h| ids.iter().map(move |id| format!("{h}{id}")))
            .collect();
        let t = table.pin();
        let slots: Vec<SlotRef> = keys.iter().map(|k| slot(&slab, k)).collect();
        let by_head = |t: &TableRef<'_>| t.buckets().live().filter(|e| e.head != NO_HEAD).count();
        // The first key of a head is stored before its head is kept, the second by it; after a
        // rebuild both are.
        for (k, s) in keys.iter().zip(&slots).take(2) {
            t.get_or_insert_with(k, |_| SlotRef::clone(s))
                .expect("room");
        }
        assert_eq!(by_head(&t), 1);
        t.rebuild(&mut table.writers.lock(), 0);
        assert_eq!(by_head(&t), 2);
        for (k, s) in keys.iter().zip(&slots).skip(2) {
            t.get_or_insert_with(k, |_| SlotRef::clone(s))
                .expect("room");
        }
        assert_eq!(
            table.writers.lock().heads.len(),
            2,
            "the two heads, not `…:a:`"
        );
        // All but the keys whose id has a colon (the growing array was rebuilt since the first
        // key of the second head came in).
        assert_eq!(by_head(&t), keys.len() - 2);
        let check = |t: &TableRef<'_>| {
            for (k, s) in keys.iter().zip(&slots) {
                let (got, hot) = t.get(k).unwrap_or_else(|| panic!("{k} is found"));
                assert!(SlotRef::ptr_eq(got, s), "{k} has its own slot");
                assert!(std::ptr::eq(hot, s.hot()));
                let mut last = k.clone().into_bytes();
                *last.last_mut().expect("not empty") ^= 0x20;
                let mut first = k.clone().into_bytes();
                first[0] ^= 0x20;
                let others = [
                    String::from_utf8(last).expect("ascii"),
                    String::from_utf8(first).expect("ascii"),
                    format!("{k}7"),
                    format!("x{k}"),
                    k[1..].to_owned(),
                    k.replacen("/b/", "/b//", 1),
                ];
                for other in others {
                    if !keys.contains(&other) {
                        assert!(t.get(&other).is_none(), "{other} is not a key");
                    }
                }
            }
        };
        check(&t);
        // Two keys of one head sharing a tag.
        let (a, b) = same_tag(&table, |i| format!("{}{i}", heads[0]));
        let (ha, hb) = (table.hasher.hash_one(&a), table.hasher.hash_one(&b));
        let at = heads[0].len();
        let entry = Entry::new(ha, &a, slot(&slab, &a), Some((0, at)));
        assert!(entry.is(tag(ha), &a, &table.heads));
        assert!(!entry.is(tag(hb), &b, &table.heads), "{a} {b}");
        assert_eq!(entry.key(), a);
        t.rebuild(&mut table.writers.lock(), 0);
        assert_eq!(by_head(&t), keys.len() - 2);
        check(&t);
        drop(t);
        check(&table.pin());
    }

    /// Writers inserting keys of shared heads (heads kept while they insert, arrays rebuilt as
    /// they grow) beside readers looking up every key already inserted: each reader finds each
    /// such key, with its own slot, whether stored by its head or not yet.
    #[test]
    fn readers_find_keys_while_writers_keep_heads_and_rebuild() {
        use std::sync::atomic::AtomicUsize;
        const WRITERS: usize = 3;
        const PER_WRITER: usize = 1500;
        let slab = Slab::new(8192);
        let table = Table::new(Arc::clone(&slab));
        let key = |w: usize, i: usize| format!("ratelimit:entity:GET:/w{}/{{id}}:{i}", w % 2);
        // Keys of writer `w` are `key(w, i)` for `i` in `w, w + WRITERS, ...`: apart.
        let done: Vec<AtomicUsize> = (0..WRITERS).map(|_| AtomicUsize::new(0)).collect();
        std::thread::scope(|scope| {
            for (w, done) in done.iter().enumerate() {
                let (table, slab) = (&table, &slab);
                scope.spawn(move || {
                    for n in 0..PER_WRITER {
                        let k = key(w, w + n * WRITERS);
                        let t = table.pin();
                        let s = slot(slab, &k);
                        let got = t.get_or_insert_with(&k, |_| SlotRef::clone(&s));
                        assert!(SlotRef::ptr_eq(got.expect("room"), &s), "{k}");
                        done.store(n + 1, Ordering::Release);
                    }
                });
            }
            for _ in 0..2 {
                let (table, done) = (&table, &done);
                scope.spawn(move || {
                    let mut seen = [0usize; WRITERS];
                    while seen.iter().sum::<usize>() < WRITERS * PER_WRITER {
                        for (w, done) in done.iter().enumerate() {
                            let upto = done.load(Ordering::Acquire);
                            let t = table.pin();
                            for n in 0..upto {
                                let k = key(w, w + n * WRITERS);
                                let (found, _) = t.get(&k).unwrap_or_else(|| panic!("{k}"));
                                assert_eq!(&*found.key, k);
                            }
                            seen[w] = upto;
                        }
                    }
                });
            }
        });
        assert_eq!(table.len(), WRITERS * PER_WRITER);
        assert_eq!(table.writers.lock().heads.len(), 2);
    }

    /// A view rebuilds at most once, so a large batch of removals leaves tombstones behind;
    /// `compact` from a fresh view rebuilds them away and releases their slots.
    #[test]
    fn compact_frees_the_tombstones_a_batch_of_removals_left() {
        let slab = Slab::new(8192);
        let table = Table::new(Arc::clone(&slab));
        let slots: Vec<SlotRef> = (0..3000).map(|i| slot(&slab, &key(i))).collect();
        {
            let t = table.pin();
            for (i, s) in slots.iter().enumerate() {
                t.get_or_insert_with(&key(i), |_| SlotRef::clone(s))
                    .expect("room");
            }
            for i in 0..2000 {
                t.remove(&key(i)).expect("present");
            }
        }
        assert!(table.writers.lock().gone > 256, "the batch left tombstones");
        table.pin().compact();
        assert_eq!(table.writers.lock().gone, 0);
        // Only this test's own handles are left on the removed keys' slots.
        assert!(slots[..2000].iter().all(|s| SlotRef::count(s) == 1));
        assert_eq!(table.pin().iter().count(), 1000);
        // Nothing to do: no rebuild.
        table.pin().compact();
        assert_eq!(table.len(), 1000);
    }

    /// A hint names its key's entry while the entry is live in the current array: through a
    /// removal and a re-insert of the key (a new slot), a rebuild of the array, and a hint
    /// made in another table (whose arrays are numbered apart), the lookup still returns the
    /// key's current slot and points the hint at it; a key that is gone is not found.
    #[test]
    fn a_hint_finds_its_keys_current_entry_or_looks_again() {
        let slab = Slab::new(8192);
        let table = Table::new(Arc::clone(&slab));
        let long = "ratelimit:api:GET:/bookings/{bookingId}";
        let hint = Hint::new(0);
        let t = table.pin();
        assert!(t.get_hinted(long, &hint).is_none());
        assert_eq!(hint.load(Ordering::Relaxed), 0, "no entry, no hint");
        let first = slot(&slab, long);
        t.get_or_insert_with(long, |_| SlotRef::clone(&first));
        let found = |t: &TableRef<'_>, hint: &Hint| {
            let (s, hot) = t.get_hinted(long, hint).expect("found");
            assert!(std::ptr::eq(hot, s.hot()));
            SlotRef::clone(s)
        };
        assert!(SlotRef::ptr_eq(&found(&t, &hint), &first));
        let named = hint.load(Ordering::Relaxed);
        assert_ne!(named, 0);
        // Found through the hint: it stays as it is.
        assert!(SlotRef::ptr_eq(&found(&t, &hint), &first));
        assert_eq!(hint.load(Ordering::Relaxed), named);
        // Gone: the entry the hint names is a tombstone, and the key is not found.
        t.remove(long).expect("present");
        assert!(t.get_hinted(long, &hint).is_none());
        // Back with a new slot, in another bucket of the same array.
        let second = slot(&slab, long);
        t.get_or_insert_with(long, |_| SlotRef::clone(&second));
        assert!(SlotRef::ptr_eq(&found(&t, &hint), &second));
        assert_ne!(hint.load(Ordering::Relaxed), named);
        // Thousands of other keys: the array is rebuilt (more than once), the hint's is gone.
        let others: Vec<SlotRef> = (0..3000).map(|i| slot(&slab, &key(i))).collect();
        for (i, s) in others.iter().enumerate() {
            t.get_or_insert_with(&key(i), |_| SlotRef::clone(s));
        }
        let before = hint.load(Ordering::Relaxed);
        assert!(SlotRef::ptr_eq(&found(&t, &hint), &second));
        assert_ne!(
            hint.load(Ordering::Relaxed),
            before,
            "pointed at the new array"
        );
        // Another table with the same key at the same position: its arrays have other numbers.
        let other = Table::new(Arc::clone(&slab));
        let third = slot(&slab, long);
        let o = other.pin();
        o.get_or_insert_with(long, |_| SlotRef::clone(&third));
        let (got, _) = o.get_hinted(long, &hint).expect("found");
        assert!(SlotRef::ptr_eq(got, &third));
        assert!(SlotRef::ptr_eq(&found(&t, &hint), &second));
    }

    fn key(i: usize) -> String {
        // Short keys (inline) and keys longer than `INLINE` (compared through the slot).
        if i.is_multiple_of(3) {
            format!("a-key-long-enough-to-live-outside-the-bucket:{i}")
        } else {
            format!("k{i}")
        }
    }

    /// Inserts, lookups, removals (tombstones and rebuilds), re-inserts and `clear` keep exactly
    /// the live keys, each with the slot it was inserted with.
    #[test]
    fn keeps_exactly_the_live_keys_through_rebuilds() {
        let slab = Slab::new(8192);
        let table = Table::new(Arc::clone(&slab));
        let t = table.pin();
        let slots: Vec<SlotRef> = (0..3000).map(|i| slot(&slab, &key(i))).collect();
        for (i, s) in slots.iter().enumerate() {
            let got = t
                .get_or_insert_with(&key(i), |_| SlotRef::clone(s))
                .expect("room");
            assert!(SlotRef::ptr_eq(got, s));
            // A second insert of the key returns the first slot.
            let again = t
                .get_or_insert_with(&key(i), |_| slot(&slab, "unused"))
                .expect("room");
            assert!(SlotRef::ptr_eq(again, s));
        }
        assert_eq!(t.len(), 3000);
        for i in (0..3000).step_by(2) {
            let removed = t.remove(&key(i)).expect("present");
            assert!(SlotRef::ptr_eq(removed, &slots[i]));
            assert!(t.remove(&key(i)).is_none(), "removed once");
        }
        drop(t);
        let t = table.pin();
        assert_eq!(t.len(), 1500);
        for i in 0..3000 {
            assert_eq!(t.get(&key(i)).is_some(), i % 2 == 1, "key {i}");
        }
        assert!(t.get("k1x").is_none() && t.get("k").is_none());
        let mut seen: Vec<&str> = t.iter().map(|(k, _)| k).collect();
        seen.sort_unstable();
        let mut want: Vec<String> = (1..3000).step_by(2).map(key).collect();
        want.sort_unstable();
        assert_eq!(seen, want);
        // A removed key comes back with a new slot.
        let fresh = slot(&slab, &key(0));
        assert!(SlotRef::ptr_eq(
            t.get_or_insert_with(&key(0), |_| SlotRef::clone(&fresh))
                .expect("room"),
            &fresh
        ));
        let (back, hot) = t.get(&key(0)).expect("back");
        assert!(SlotRef::ptr_eq(back, &fresh));
        // The bucket's record is the slot's own.
        assert!(std::ptr::eq(hot, fresh.hot()));
        t.clear();
        assert_eq!(t.len(), 0);
        assert!(t.get(&key(1)).is_none() && t.iter().next().is_none());
    }
}
