//! [`MemoryStore`]: the store contract inside one process.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::Mutex;

use super::held::{self, Entry};
use super::{AcquireRequest, Acquired, BucketRow, GiveBack, HeldLease, Store, StoreError, nanos};
use crate::bucket::{BucketConfig, BucketState, Timestamp};
use crate::clock::{Clock, MonotonicClock, system_time_from_timestamp};

/// Shards of the key map; a power of two so a hash picks one with a mask.
const SHARDS: usize = 64;

/// One shard: the buckets whose key hashes here.
///
/// The lock is held only for the arithmetic on one bucket; nothing awaits while holding it.
type Shard = Mutex<HashMap<String, Stored>>;

/// One bucket: the shape it was last written with, its state, and its strict leases.
#[derive(Debug, Clone)]
struct Stored {
    config: BucketConfig,
    state: BucketState,
    leases: Vec<Entry>,
}

/// Buckets in process memory, behind sharded mutexes.
///
/// Keeps the [`Store`] contract for one process: use it for a single-instance service, in tests,
/// or wherever no database is wanted. Time comes from a [`Clock`] (by default the process's
/// monotonic clock), so a wall clock that steps back changes nothing.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    shards: Arc<[Shard]>,
    /// Return ids already credited, with when; forgotten by `delete_idle` after a day.
    returned: Arc<Mutex<HashMap<i64, Timestamp>>>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store on the process's monotonic clock.
    pub fn new() -> Self {
        Self::with_clock(MonotonicClock::new())
    }

    /// An empty store reading time from `clock` (a [`ManualClock`](crate::clock::ManualClock) in
    /// tests).
    pub fn with_clock(clock: impl Clock) -> Self {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            returned: Arc::default(),
            hasher: RandomState::new(),
            clock: Arc::new(clock),
        }
    }

    /// How many buckets are stored (full buckets deleted by
    /// [`delete_idle`](Store::delete_idle) are not).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// Whether no bucket is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, key: &str) -> &Shard {
        let hash = self.hasher.hash_one(key) as usize;
        &self.shards[hash & (SHARDS - 1)]
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        let now = self.clock.now();
        let config = request.bucket;
        let mut shard = self.shard(request.key).lock();
        let (state, mut leases) = shard.get(request.key).map_or_else(
            || (BucketState::full(&config, now), Vec::new()),
            |stored| (stored.state, stored.leases.clone()),
        );
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
        let (state, grant) = state
            .grant(&config, now, amount, amount)
            .map_err(|e| StoreError::Protocol(e.to_string()))?;
        held::hold(&mut leases, request.hold.as_ref(), grant.granted, now);
        let stored = Stored {
            config,
            state,
            leases,
        };
        match shard.get_mut(request.key) {
            Some(slot) => *slot = stored,
            None => {
                shard.insert(request.key.to_owned(), stored);
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
        let now = self.clock.now();
        let mut credited = 0;
        for ret in returns {
            if self.returned.lock().insert(ret.id, now).is_some() {
                continue;
            }
            credited += 1;
            let mut shard = self.shard(ret.key).lock();
            if let Some(stored) = shard.get_mut(ret.key) {
                stored.config = ret.bucket;
                let refilled = held::refill(stored.state, &stored.config, &stored.leases, now);
                let credit = match &ret.lease {
                    None => {
                        stored.leases.retain(|l| l.expires_at > now);
                        ret.amount
                    }
                    Some(lease) => held::release(&mut stored.leases, lease, ret.amount, now),
                };
                let room = stored
                    .config
                    .capacity()
                    .saturating_sub(held::outstanding(&stored.leases, now));
                stored.state = BucketState {
                    tokens: std::cmp::min(room, refilled.tokens.saturating_add(credit)),
                    ..refilled
                };
            }
        }
        Ok(credited)
    }

    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        let now = self.clock.now();
        let day = 86_400_000_000_000;
        self.returned
            .lock()
            .retain(|_, at| now.saturating_since(*at) < day);
        let mut left = limit as usize;
        let mut deleted = 0;
        for shard in self.shards.iter() {
            if left == 0 {
                break;
            }
            let mut shard = shard.lock();
            shard.retain(|_, stored| {
                let config = &stored.config;
                let full = left > 0
                    && held::refill(stored.state, config, &stored.leases, now).tokens
                        >= config.capacity();
                if full {
                    left -= 1;
                    deleted += 1;
                }
                !full
            });
        }
        Ok(deleted)
    }

    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        let now = self.clock.now();
        let shard = self.shard(key).lock();
        Ok(shard.get(key).map(|stored| BucketRow {
            key: key.to_owned(),
            tokens: stored.state.tokens,
            capacity: stored.config.capacity(),
            refill_per_second: stored.config.rate().per_second_amount(),
            updated_at: system_time_from_timestamp(stored.state.last_refill),
            store_now: system_time_from_timestamp(now),
            tokens_now: held::refill(stored.state, &stored.config, &stored.leases, now).tokens,
            leases: stored
                .leases
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
