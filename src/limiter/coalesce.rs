//! At most one statement per key in flight per process: concurrent takes on one key share it.
//!
//! A hot row gets slower with every concurrent writer (each holds the row lock through its
//! commit), so the direct-mode limiter never sends a second statement for a key while one is in
//! flight. The first caller on an idle key runs its take alone. Callers that arrive while it is
//! in flight queue up; when it finishes, one background task takes the whole queue to the store
//! as one request (`min = step = cost`, `want = n × cost`), hands the granted tokens out in
//! arrival order, and repeats until the queue stays empty.
//!
//! Only callers of one cost share a statement, so a grant is always a whole number of their
//! takes and no token is ever left over; callers of another cost wait for the next round.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::bucket::{BucketConfig, Tokens};
use crate::store::{AcquireRequest, Acquired, Store, StoreError, nanos};

/// Shards of the in-flight table; a power of two.
const SHARDS: usize = 32;

type Reply = oneshot::Sender<Result<Acquired, StoreError>>;

/// One queued caller.
struct Waiter {
    cost: Tokens,
    reply: Reply,
}

/// A key with a statement in flight, and the callers that arrived since.
#[derive(Default)]
struct InFlight {
    queue: Vec<Waiter>,
}

/// The in-flight table. Each lock is held only to look at or change one entry; nothing awaits
/// while holding it.
pub(crate) struct Coalescer {
    shards: Box<[Mutex<HashMap<String, InFlight>>]>,
    hasher: RandomState,
}

impl std::fmt::Debug for Coalescer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coalescer").finish_non_exhaustive()
    }
}

impl Coalescer {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Coalescer {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
        })
    }

    fn shard(&self, key: &str) -> &Mutex<HashMap<String, InFlight>> {
        &self.shards[self.hasher.hash_one(key) as usize & (SHARDS - 1)]
    }

    /// Takes `cost` from `key`'s bucket, sharing the statement with concurrent callers.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in the sense that matters: dropping the future never leaves the key stuck.
    /// A dropped leader hands the queue on as if it had finished; a dropped waiter's share of a
    /// grant is counted as spent.
    pub(crate) async fn take(
        self: &Arc<Self>,
        store: &Arc<dyn Store>,
        key: &str,
        bucket: BucketConfig,
        cost: Tokens,
    ) -> Result<Acquired, StoreError> {
        let queued = {
            let mut shard = self.shard(key).lock();
            match shard.get_mut(key) {
                Some(in_flight) => {
                    let (reply, rx) = oneshot::channel();
                    in_flight.queue.push(Waiter { cost, reply });
                    Some(rx)
                }
                None => {
                    shard.insert(key.to_owned(), InFlight::default());
                    None
                }
            }
        };
        if let Some(rx) = queued {
            return rx.await.unwrap_or_else(|_| {
                Err(StoreError::Protocol(
                    "the shared statement was abandoned".into(),
                ))
            });
        }
        let mut guard = HandOff {
            coalescer: Arc::clone(self),
            store: Arc::clone(store),
            key: key.to_owned(),
            bucket,
            failed: None,
        };
        metrics::counter!(crate::metrics::DB_CALLS, "kind" => "take").increment(1);
        let result = store.acquire(AcquireRequest::take(key, bucket, cost)).await;
        if let Err(err) = &result {
            metrics::counter!(crate::metrics::DB_ERRORS, "kind" => "take").increment(1);
            // Callers that queued behind a failed statement share its failure at once, instead
            // of waiting for another round (and another timeout): no caller waits longer than
            // one call timeout.
            guard.failed = Some(err.clone());
        }
        drop(guard);
        result
    }

    /// Called when a statement for `key` finished (or its caller went away): serve the queue in
    /// a background task, or mark the key idle. After a failed statement, the queued callers
    /// get its error.
    fn hand_off(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        key: String,
        bucket: BucketConfig,
        failed: Option<StoreError>,
    ) {
        {
            let mut shard = self.shard(&key).lock();
            let Some(in_flight) = shard.get(&key) else {
                return;
            };
            if let Some(err) = failed {
                let waiters = shard.remove(&key).map(|f| f.queue).unwrap_or_default();
                drop(shard);
                for waiter in waiters {
                    let _ = waiter.reply.send(Err(err.clone()));
                }
                return;
            }
            if in_flight.queue.is_empty() {
                shard.remove(&key);
                return;
            }
        }
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move { self.drain(store, key, bucket).await });
            }
            Err(_) => {
                // No runtime (shutting down): drop the waiters' senders; they see an error.
                self.shard(&key).lock().remove(&key);
            }
        }
    }

    /// Serves queued callers, one statement per round, until the queue is empty.
    async fn drain(self: Arc<Self>, store: Arc<dyn Store>, key: String, bucket: BucketConfig) {
        loop {
            let batch = {
                let mut shard = self.shard(&key).lock();
                let Some(in_flight) = shard.get_mut(&key) else {
                    return;
                };
                if in_flight.queue.is_empty() {
                    shard.remove(&key);
                    return;
                }
                take_batch(&mut in_flight.queue, bucket.capacity())
            };
            let cost = batch[0].cost;
            let want = Tokens::from_atto(cost.as_atto() * batch.len() as u128);
            let request = AcquireRequest {
                key: &key,
                bucket,
                min: cost,
                want,
                step: cost,
                hold: None,
            };
            metrics::counter!(crate::metrics::DB_CALLS, "kind" => "take").increment(1);
            match store.acquire(request).await {
                Ok(acquired) => share_out(batch, &acquired, &bucket),
                Err(err) => {
                    metrics::counter!(crate::metrics::DB_ERRORS, "kind" => "take").increment(1);
                    // Everyone queued now shares the failure: no caller waits another round.
                    let rest = self
                        .shard(&key)
                        .lock()
                        .remove(&key)
                        .map(|f| f.queue)
                        .unwrap_or_default();
                    for waiter in batch.into_iter().chain(rest) {
                        let _ = waiter.reply.send(Err(err.clone()));
                    }
                    return;
                }
            }
        }
    }
}

/// Takes from the front of the queue the waiters of the first waiter's cost, as many as fit in
/// one bucket; the others keep their places.
fn take_batch(queue: &mut Vec<Waiter>, capacity: Tokens) -> Vec<Waiter> {
    let cost = queue[0].cost;
    let max = std::cmp::max(1, capacity.as_atto() / std::cmp::max(cost.as_atto(), 1)) as usize;
    let mut batch = Vec::new();
    let mut rest = Vec::new();
    for waiter in queue.drain(..) {
        if waiter.cost == cost && batch.len() < max {
            batch.push(waiter);
        } else {
            rest.push(waiter);
        }
    }
    *queue = rest;
    batch
}

/// Hands a grant of `k × cost` to the first `k` waiters; the rest are denied.
fn share_out(batch: Vec<Waiter>, acquired: &Acquired, bucket: &BucketConfig) {
    let cost = batch[0].cost.as_atto().max(1);
    let admitted = (acquired.granted.as_atto() / cost) as usize;
    let denied_retry =
        nanos(bucket.time_to_refill(Tokens::from_atto(cost).saturating_sub(acquired.remaining)));
    for (i, waiter) in batch.into_iter().enumerate() {
        let reply = if i < admitted {
            // What this caller would have seen had the takes after it not happened yet.
            let later = (admitted - 1 - i) as u128 * cost;
            Acquired {
                granted: waiter.cost,
                remaining: acquired.remaining.saturating_add(Tokens::from_atto(later)),
                retry_after: std::time::Duration::ZERO,
                ..*acquired
            }
        } else {
            Acquired {
                granted: Tokens::ZERO,
                retry_after: std::cmp::max(acquired.retry_after, denied_retry),
                ..*acquired
            }
        };
        // A caller that went away has its share counted as spent.
        let _ = waiter.reply.send(Ok(reply));
    }
}

/// Hands the key on when the leader's statement ends, even if the leader's future is dropped.
struct HandOff {
    coalescer: Arc<Coalescer>,
    store: Arc<dyn Store>,
    key: String,
    bucket: BucketConfig,
    /// The leader's statement failed with this: the queue shares the failure.
    failed: Option<StoreError>,
}

impl Drop for HandOff {
    fn drop(&mut self) {
        let key = std::mem::take(&mut self.key);
        let failed = self.failed.take();
        Arc::clone(&self.coalescer).hand_off(Arc::clone(&self.store), key, self.bucket, failed);
    }
}
