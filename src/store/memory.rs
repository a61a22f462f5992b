//! [`MemoryStore`]: the store contract inside one process, in bounded memory.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;

use super::held::{self, Entry};
use super::{AcquireRequest, Acquired, BucketRow, GiveBack, HeldLease, Store, StoreError, nanos};
use crate::bucket::{BucketConfig, BucketState, LimitsState, Timestamp, Tokens};
use crate::clock::system_time_from_timestamp;
use crate::key::SlotKey;

/// Shards of the key map; a power of two so a hash picks one with a mask.
const SHARDS: usize = 64;

/// The default bound on keys of [`MemoryStore::new`].
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// The default bound on the return ids a [`MemoryStore`] remembers.
pub const DEFAULT_MAX_RETURN_IDS: usize = 100_000;

/// How long a [`MemoryStore`] remembers a credited return id (unless [`DEFAULT_MAX_RETURN_IDS`]
/// newer ones push it out first). A retried give-back comes within seconds: the lease actor
/// retries a failed return on its next few ticks.
pub const RETURN_ID_TTL: Duration = Duration::from_secs(600);

/// The store deletes its full buckets on a call when it has not done so for this long (by tokio's
/// clock).
const TIDY_EVERY: u64 = 1_000_000_000;

/// At the key bound, the store is swept for full buckets again once this long has passed since
/// the last sweep, or once a sixteenth of the bound was inserted since (so a sweep costs at most
/// 16 bucket checks per inserted key, and a sweep that finds nothing is not repeated per call).
const SWEEP_EVERY: u64 = 100_000_000;

/// One shard: the buckets whose key hashes here, and when it last deleted its full ones.
///
/// The lock is held only for the arithmetic on one bucket (or one sweep of the shard); nothing
/// awaits while holding it.
type Shard = Mutex<ShardMap>;

#[derive(Debug, Default)]
struct ShardMap {
    /// Keys of at most 22 bytes are held in the entry itself (`SlotKey`).
    buckets: HashMap<SlotKey, Stored>,
    /// The strict leases out on this shard's buckets, for the buckets that have any.
    strict: Strict,
    /// The tokens of the limits beyond the first, for the buckets of several limits (as of
    /// their bucket's `last_refill`; a limit missing here is full).
    more: HashMap<SlotKey, [Tokens; MORE]>,
    /// The bucket shapes this shard stored last, shared by the buckets written with them: most
    /// keys of a store share a handful of plans, so each bucket holds a pointer, not a copy.
    shapes: [Option<Arc<BucketConfig>>; SHAPES],
    /// The entry of `shapes` the next new shape replaces.
    next_shape: usize,
}

/// Bucket shapes remembered per shard (see [`ShardMap::shapes`]).
const SHAPES: usize = 4;

impl ShardMap {
    /// `config` as a shared shape: `current` when it is the same (the bucket's own), else one
    /// this shard already holds, else a new one (replacing the oldest remembered). Buckets
    /// written with a forgotten shape keep their own pointer, so this bounds nothing but saves
    /// a copy per bucket.
    fn shape(
        &mut self,
        config: BucketConfig,
        current: Option<&Arc<BucketConfig>>,
    ) -> Arc<BucketConfig> {
        if let Some(current) = current.filter(|c| ***c == config) {
            return Arc::clone(current);
        }
        if let Some(known) = self.shapes.iter().flatten().find(|c| ***c == config) {
            return Arc::clone(known);
        }
        let shape = Arc::new(config);
        self.shapes[self.next_shape] = Some(Arc::clone(&shape));
        self.next_shape = (self.next_shape + 1) % SHAPES;
        shape
    }

    /// Deletes the buckets that have refilled to full at `now` (an absent bucket is a full one,
    /// so no decision changes), at most `limit`, and their strict leases; gives unused memory
    /// back. Returns how many.
    fn delete_full(&mut self, now: Timestamp, limit: usize) -> usize {
        let mut left = limit;
        let strict = &self.strict;
        let more = &self.more;
        self.buckets.retain(|key, stored| {
            let full = left > 0
                && is_full(stored, strict.get(key), now)
                && (!stored.config.is_multi()
                    || limits_state(stored.state(), more.get(&**key)).is_full(&stored.config, now));
            if full {
                left -= 1;
            }
            !full
        });
        let deleted = limit - left;
        if deleted > 0 {
            self.strict.keep_stored(&self.buckets);
            if !self.more.is_empty() {
                let buckets = &self.buckets;
                self.more.retain(|key, _| buckets.contains_key(&**key));
            }
        }
        let len = self.buckets.len();
        if self.buckets.capacity() > 64 && len * 4 < self.buckets.capacity() {
            self.buckets.shrink_to(len * 2);
        }
        self.strict.shrink();
        deleted
    }
}

/// Places for the tokens of the limits beyond a bucket's first.
const MORE: usize = BucketConfig::MAX_LIMITS - 1;

/// A bucket of several limits: the first limit's `state` and the others' tokens (`None`, or a
/// limit beyond those stored: full, as an absent bucket is; a capacity lowered since is cut
/// by the refill).
fn limits_state(state: BucketState, more: Option<&[Tokens; MORE]>) -> LimitsState {
    let mut tokens = [Tokens::MAX; BucketConfig::MAX_LIMITS];
    tokens[0] = state.tokens;
    if let Some(more) = more {
        tokens[1..].copy_from_slice(more);
    }
    LimitsState {
        tokens,
        last_refill: state.last_refill,
    }
}

/// The tokens of the limits beyond the first of `state`, to keep beside its bucket.
fn more_of(state: &LimitsState) -> [Tokens; MORE] {
    let mut more = [Tokens::MAX; MORE];
    more.copy_from_slice(&state.tokens[1..]);
    more
}

/// Whether the bucket, with `leases` out on it, holds its capacity at `now` (so no strict
/// lease is live on it).
fn is_full(stored: &Stored, leases: &[Entry], now: Timestamp) -> bool {
    held::refill(stored.state(), &stored.config, leases, now).tokens >= stored.config.capacity()
}

/// The strict leases out on one shard's buckets (live or expired, until pruned), by key, for
/// the buckets that have any: few of them, so they are kept beside the buckets rather than in
/// each (`Stored`). A key has an entry only while its bucket is stored and its list is not
/// empty.
#[derive(Debug, Default)]
struct Strict(HashMap<SlotKey, Vec<Entry>>);

impl Strict {
    /// The leases out on `key`'s bucket. A shard with none (most) answers without hashing the
    /// key, so a bucket without strict leases pays nothing for this map on its calls.
    fn get(&self, key: &str) -> &[Entry] {
        if self.0.is_empty() {
            return &[];
        }
        self.0.get(key).map_or(&[], Vec::as_slice)
    }

    /// The leases out on `key`'s bucket, taken out to edit; put back with [`Strict::set`].
    fn take(&mut self, key: &str) -> Vec<Entry> {
        if self.0.is_empty() {
            return Vec::new();
        }
        self.0.remove(key).unwrap_or_default()
    }

    /// Makes `leases` those out on `key`'s bucket (none: no entry).
    fn set(&mut self, key: &str, leases: Vec<Entry>) {
        if leases.is_empty() {
            if !self.0.is_empty() {
                self.0.remove(key);
            }
        } else if let Some(held) = self.0.get_mut(key) {
            *held = leases;
        } else {
            self.0.insert(SlotKey::new(key), leases);
        }
    }

    /// Drops the leases of buckets no longer in `buckets`.
    fn keep_stored(&mut self, buckets: &HashMap<SlotKey, Stored>) {
        self.0.retain(|key, _| buckets.contains_key(&**key));
    }

    /// Gives memory back: all of it once no lease is out, most of it after a burst.
    fn shrink(&mut self) {
        let (len, capacity) = (self.0.len(), self.0.capacity());
        if capacity > 0 && (len == 0 || (capacity > 64 && len * 4 < capacity)) {
            self.0.shrink_to(len * 2);
        }
    }
}

/// Return ids already credited: a set, and the ids in the order they came, with when.
#[derive(Debug, Default)]
struct Returned {
    ids: HashSet<i64>,
    order: VecDeque<(Timestamp, i64)>,
}

impl Returned {
    /// Forgets ids older than [`RETURN_ID_TTL`], and the oldest beyond `room` fewer than `max`.
    fn prune(&mut self, now: Timestamp, max: usize, room: usize) {
        let ttl = RETURN_ID_TTL.as_nanos() as u64;
        while let Some(&(at, id)) = self.order.front() {
            if now.saturating_since(at) < ttl && self.order.len() + room <= max {
                break;
            }
            self.order.pop_front();
            self.ids.remove(&id);
        }
        let len = self.ids.len();
        if self.ids.capacity() > 64 && len * 4 < self.ids.capacity() {
            self.ids.shrink_to(len * 2);
            self.order.shrink_to(len * 2);
        }
    }
}

/// One bucket: the shape it was last written with and its state.
///
/// 32 bytes, where the plain fields took 96 (`docs/design/memory.md`): the shape is shared
/// ([`ShardMap::shape`]), the state is packed to 8-byte alignment (its `u128` tokens would
/// align it, and so the map's entry, to 16), and the strict leases (none, for most buckets) are
/// not here but in the shard's side map ([`Strict`]), so a bucket without them spends nothing
/// on them.
#[derive(Debug, Clone)]
struct Stored {
    config: Arc<BucketConfig>,
    state: Packed,
}

const _: () = assert!(size_of::<Stored>() == 32);

/// A [`BucketState`]'s fields at 8-byte alignment (24 bytes, where the state takes 32): read
/// and written by value.
#[derive(Debug, Clone, Copy)]
#[repr(C, packed(8))]
struct Packed {
    tokens: crate::bucket::Tokens,
    last_refill: Timestamp,
}

impl Packed {
    fn new(state: BucketState) -> Packed {
        Packed {
            tokens: state.tokens,
            last_refill: state.last_refill,
        }
    }
}

impl Stored {
    fn state(&self) -> BucketState {
        let Packed {
            tokens,
            last_refill,
        } = self.state;
        BucketState {
            tokens,
            last_refill,
        }
    }

    fn set_state(&mut self, state: BucketState) {
        self.state = Packed::new(state);
    }
}

/// Buckets in process memory, behind sharded mutexes.
///
/// Keeps the [`Store`] contract for one process: use it for a single-instance service, in tests,
/// or wherever no database is wanted. Time is tokio's clock ([`crate::clock`]): a wall clock that
/// steps back changes nothing, and a test that pauses tokio's time moves the buckets' time with
/// `tokio::time::advance`.
///
/// # Bounded memory
///
/// - **Keys.** At most [`max_keys`](Self::max_keys) buckets ([`DEFAULT_MAX_KEYS`] unless
///   [`with_max_keys`](Self::with_max_keys) says otherwise). Buckets that have refilled to full
///   are deleted (an absent bucket is a full one, so that changes no decision) by a sweep of
///   the whole store: on a call when the last sweep is a second old (by tokio's clock), and
///   when a new key finds the store at its bound and the last sweep is 100 ms old or a
///   sixteenth of the bound was inserted since. A
///   bucket that is not full is never evicted, since that would refill it and admit more than
///   its limit: when the store is at its bound and no bucket is full, a request for a *new*
///   key is refused with [`StoreError::TooManyKeys`] (the limiter's fallback then decides; the
///   fallback's own local buckets deny). Keys already stored keep being decided.
/// - **Return ids.** A credited give-back's id is remembered so a retry credits once, for
///   [`RETURN_ID_TTL`] and at most [`DEFAULT_MAX_RETURN_IDS`] ids
///   ([`with_max_return_ids`](Self::with_max_return_ids)); a retry of a forgotten id would
///   credit again. Retries come within seconds.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    shards: Arc<[Shard]>,
    /// Buckets stored, across the shards; at most `max_keys`.
    keys: Arc<AtomicUsize>,
    max_keys: usize,
    /// When the store was last swept for full buckets (0: never).
    swept_at: Arc<AtomicU64>,
    /// Keys inserted since that sweep.
    inserted: Arc<AtomicUsize>,
    /// Return ids already credited, with when.
    returned: Arc<Mutex<Returned>>,
    max_return_ids: usize,
    hasher: RandomState,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store on tokio's clock.
    pub fn new() -> Self {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            keys: Arc::default(),
            max_keys: DEFAULT_MAX_KEYS,
            swept_at: Arc::default(),
            inserted: Arc::default(),
            returned: Arc::default(),
            max_return_ids: DEFAULT_MAX_RETURN_IDS,
            hasher: RandomState::new(),
        }
    }

    /// The same store with at most `n` keys (at least one); see [Bounded
    /// memory](Self#bounded-memory). Set it before the store is shared.
    #[must_use]
    pub fn with_max_keys(mut self, n: usize) -> Self {
        self.max_keys = n.max(1);
        self
    }

    /// The same store remembering at most `n` return ids (at least one); see [Bounded
    /// memory](Self#bounded-memory).
    #[must_use]
    pub fn with_max_return_ids(mut self, n: usize) -> Self {
        self.max_return_ids = n.max(1);
        self
    }

    /// The bound on stored buckets.
    pub fn max_keys(&self) -> usize {
        self.max_keys
    }

    /// How many buckets are stored (full buckets already deleted are not).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().buckets.len()).sum()
    }

    /// How many credited return ids are remembered now.
    pub fn return_ids(&self) -> usize {
        self.returned.lock().ids.len()
    }

    /// Deletes every full bucket when the last sweep is a second old or more (as a call does
    /// before deciding), so that a store nobody calls any more still gives its memory back: the
    /// limiter calls this for its fallback's local buckets once the shared store answers again.
    /// Costs one atomic load when the store holds nothing. Returns whether it swept.
    pub fn tidy(&self) -> bool {
        if self.keys.load(Ordering::Relaxed) == 0 {
            return false;
        }
        self.sweep_if_due(crate::clock::now(), false)
    }

    /// How many buckets are stored, from the bound's counter (no lock; [`len`](Self::len)
    /// counts the shards).
    pub(crate) fn stored(&self) -> usize {
        self.keys.load(Ordering::Relaxed)
    }

    /// Whether no bucket is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, key: &str) -> &Shard {
        let hash = self.hasher.hash_one(key) as usize;
        &self.shards[hash & (SHARDS - 1)]
    }

    /// Takes one of the `max_keys` places for a new bucket.
    fn reserve(&self) -> bool {
        let reserved = self
            .keys
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_keys).then_some(n + 1)
            })
            .is_ok();
        if reserved {
            self.inserted.fetch_add(1, Ordering::Relaxed);
        }
        reserved
    }

    /// Deletes every full bucket if [`TIDY_EVERY`] has passed since the last sweep, or, when
    /// `at_bound`, [`SWEEP_EVERY`] or a sixteenth of the bound in insertions. Returns whether it
    /// swept. Call without holding a shard lock.
    fn sweep_if_due(&self, now: Timestamp, at_bound: bool) -> bool {
        let last = self.swept_at.load(Ordering::Acquire);
        let since = now.as_nanos().saturating_sub(last);
        let due = since >= TIDY_EVERY
            || (at_bound
                && (since >= SWEEP_EVERY
                    || self.inserted.load(Ordering::Relaxed) >= (self.max_keys / 16).max(1)));
        if !due
            || self
                .swept_at
                .compare_exchange(
                    last,
                    now.as_nanos().max(1),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_err()
        {
            return false;
        }
        self.inserted.store(0, Ordering::Relaxed);
        for shard in self.shards.iter() {
            let deleted = shard.lock().delete_full(now, usize::MAX);
            self.keys.fetch_sub(deleted, Ordering::AcqRel);
        }
        true
    }
}

/// Keeps `more` as the tokens of `key`'s limits beyond the first.
fn set_more(map: &mut HashMap<SlotKey, [Tokens; MORE]>, key: &str, more: [Tokens; MORE]) {
    match map.get_mut(key) {
        Some(slot) => *slot = more,
        None => {
            map.insert(SlotKey::new(key), more);
        }
    }
}

impl MemoryStore {
    /// [`Store::acquire`] on a bucket of several limits: granted only when every limit holds
    /// the grant, taken from each. Strict leases are refused on such a bucket (the policy
    /// refuses them too). The shard is locked, and a new key's place reserved.
    fn acquire_limits(
        &self,
        shard: &mut ShardMap,
        request: &AcquireRequest<'_>,
        state: BucketState,
        leases: &[Entry],
        current: Option<Arc<BucketConfig>>,
        now: Timestamp,
    ) -> Result<Acquired, StoreError> {
        let config = request.bucket;
        let refuse = |why: String| {
            if current.is_none() {
                self.keys.fetch_sub(1, Ordering::AcqRel);
            }
            Err(StoreError::Protocol(why))
        };
        if request.hold.is_some() || !leases.is_empty() {
            return refuse(format!(
                "key {:?}: strict leases on a bucket of several limits are not supported",
                request.key
            ));
        }
        if request.min > config.capacity() {
            let e = crate::bucket::InsufficientCapacity {
                cost: request.min,
                capacity: config.capacity(),
            };
            return refuse(e.to_string());
        }
        let start = match &current {
            None => LimitsState::full(&config, now),
            Some(_) => limits_state(state, shard.more.get(request.key)),
        };
        let (state, grant) =
            start.grant(&config, now, request.min, |least| request.grantable(least));
        let shape = shard.shape(config, current.as_ref());
        let stored = Stored {
            config: shape,
            state: Packed::new(BucketState {
                tokens: state.tokens[0],
                last_refill: state.last_refill,
            }),
        };
        match shard.buckets.get_mut(request.key) {
            Some(slot) => *slot = stored,
            None => {
                shard.buckets.insert(SlotKey::new(request.key), stored);
            }
        }
        set_more(&mut shard.more, request.key, more_of(&state));
        Ok(Acquired {
            granted: grant.granted,
            remaining: grant.remaining,
            retry_after: nanos(grant.retry_after),
            reset_after: nanos(grant.reset_after),
            store_now: system_time_from_timestamp(now),
        })
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        let now = crate::clock::now();
        let config = request.bucket;
        let mut swept = self.sweep_if_due(now, false);
        let mut shard = loop {
            let shard = self.shard(request.key).lock();
            if shard.buckets.contains_key(request.key) || self.reserve() {
                break shard;
            }
            drop(shard);
            if swept || !self.sweep_if_due(now, true) {
                return Err(StoreError::TooManyKeys {
                    max_keys: self.max_keys,
                });
            }
            swept = true;
        };
        // One lookup: the bucket's state, its strict leases and its shape (`None` for a new key).
        let (state, mut leases, current) = match shard.buckets.get(request.key) {
            None => (BucketState::full(&config, now), Vec::new(), None),
            Some(stored) => (
                stored.state(),
                shard.strict.get(request.key).to_vec(),
                Some(Arc::clone(&stored.config)),
            ),
        };
        if config.is_multi() {
            return self.acquire_limits(&mut shard, &request, state, &leases, current, now);
        }
        if !shard.more.is_empty() {
            shard.more.remove(request.key);
        }
        let refilled = held::refill(state, &config, &leases, now);
        let available = held::available(refilled.tokens, &leases, request.hold.as_ref(), now);
        let state = BucketState {
            tokens: available,
            ..refilled
        };
        let amount = match request.grantable(state.tokens) {
            zero if zero.is_zero() => request.min,
            amount => amount,
        };
        let (state, grant) = match state.grant(&config, now, amount, amount) {
            Ok(granted) => granted,
            Err(e) => {
                if current.is_none() {
                    self.keys.fetch_sub(1, Ordering::AcqRel);
                }
                return Err(StoreError::Protocol(e.to_string()));
            }
        };
        held::hold(&mut leases, request.hold.as_ref(), grant.granted, now);
        let shape = shard.shape(config, current.as_ref());
        let stored = Stored {
            config: shape,
            state: Packed::new(state),
        };
        shard.strict.set(request.key, leases);
        // A new key has its place reserved above.
        match shard.buckets.get_mut(request.key) {
            Some(slot) => *slot = stored,
            None => {
                shard.buckets.insert(SlotKey::new(request.key), stored);
            }
        }
        drop(shard);
        Ok(Acquired {
            granted: grant.granted,
            remaining: grant.remaining,
            retry_after: nanos(grant.retry_after),
            reset_after: nanos(state.time_to_full(&config, now)),
            store_now: system_time_from_timestamp(now),
        })
    }

    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        let now = crate::clock::now();
        let mut credited = 0;
        for ret in returns {
            {
                let mut returned = self.returned.lock();
                if returned.ids.contains(&ret.id) {
                    continue;
                }
                returned.prune(now, self.max_return_ids, 1);
                returned.ids.insert(ret.id);
                returned.order.push_back((now, ret.id));
            }
            let mut shard = self.shard(ret.key).lock();
            let shard = &mut *shard;
            let Some(current) = shard.buckets.get(ret.key).map(|s| Arc::clone(&s.config)) else {
                continue;
            };
            let shape = shard.shape(ret.bucket, Some(&current));
            if ret.bucket.is_multi() {
                if let Some(stored) = shard.buckets.get_mut(ret.key) {
                    credited += 1;
                    stored.config = shape;
                    let state = limits_state(stored.state(), shard.more.get(ret.key)).credit(
                        &ret.bucket,
                        now,
                        ret.amount,
                    );
                    stored.set_state(BucketState {
                        tokens: state.tokens[0],
                        last_refill: state.last_refill,
                    });
                    set_more(&mut shard.more, ret.key, more_of(&state));
                }
                continue;
            }
            if let Some(stored) = shard.buckets.get_mut(ret.key) {
                // Counted as PostgreSQL counts it: a return to a stored bucket (one with no
                // bucket, a full one, is recorded and credits nothing).
                credited += 1;
                stored.config = shape;
                let mut leases = shard.strict.take(ret.key);
                let refilled = held::refill(stored.state(), &stored.config, &leases, now);
                let credit = match &ret.lease {
                    None => {
                        leases.retain(|l| l.expires_at > now);
                        ret.amount
                    }
                    Some(lease) => held::release(&mut leases, lease, ret.amount, now),
                };
                let room = stored
                    .config
                    .capacity()
                    .saturating_sub(held::outstanding(&leases, now));
                shard.strict.set(ret.key, leases);
                stored.set_state(BucketState {
                    tokens: std::cmp::min(room, refilled.tokens.saturating_add(credit)),
                    ..refilled
                });
            }
        }
        Ok(credited)
    }

    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        let now = crate::clock::now();
        self.returned.lock().prune(now, self.max_return_ids, 0);
        let mut left = limit as usize;
        let mut deleted = 0;
        for shard in self.shards.iter() {
            if left == 0 {
                break;
            }
            let n = shard.lock().delete_full(now, left);
            self.keys.fetch_sub(n, Ordering::AcqRel);
            left -= n;
            deleted += n as u64;
        }
        Ok(deleted)
    }

    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        let now = crate::clock::now();
        let shard = self.shard(key).lock();
        Ok(shard.buckets.get(key).map(|stored| BucketRow {
            key: key.to_owned(),
            tokens: stored.state().tokens,
            capacity: stored.config.capacity(),
            refill_per_second: stored.config.rate().per_second_amount(),
            updated_at: system_time_from_timestamp(stored.state().last_refill),
            store_now: system_time_from_timestamp(now),
            tokens_now: held::refill(stored.state(), &stored.config, shard.strict.get(key), now)
                .tokens,
            leases: shard
                .strict
                .get(key)
                .iter()
                .filter(|l| l.expires_at > now)
                .map(|l| HeldLease {
                    holder: l.holder,
                    lease_id: l.lease_id,
                    amount: l.amount,
                    expires_at: system_time_from_timestamp(l.expires_at),
                })
                .collect(),
        }))
    }
}

#[cfg(test)]
mod tests;
