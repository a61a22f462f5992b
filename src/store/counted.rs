//! [`CountedStore`]: a store wrapper that counts the calls made to the store.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;

use super::{AcquireRequest, Acquired, BucketRow, GiveBack, Store, StoreError};

/// Forwards every call to the store it wraps and counts the ones that reach it (acquire,
/// acquire_many, acquire_each, give_back, give_back_each, delete_idle; not inspect), for load tests and for checking how many
/// round trips leases save. Several wrappers may share one counter.
#[derive(Debug)]
pub struct CountedStore<S> {
    inner: S,
    calls: Arc<AtomicU64>,
}

impl<S> CountedStore<S> {
    /// Wraps `inner` with a counter of its own.
    pub fn new(inner: S) -> Self {
        Self::with_counter(inner, Arc::default())
    }

    /// Wraps `inner`, counting into `calls` (shared with other wrappers).
    pub fn with_counter(inner: S, calls: Arc<AtomicU64>) -> Self {
        CountedStore { inner, calls }
    }

    /// Calls counted so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// The wrapped store.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped store, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the store.
    pub fn into_inner(self) -> S {
        self.inner
    }

    fn count(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }
}

#[async_trait]
impl<S: Store> Store for CountedStore<S> {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        self.count();
        self.inner.acquire(request).await
    }

    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        self.count();
        self.inner.acquire_many(requests).await
    }

    async fn acquire_each(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Vec<Result<Acquired, StoreError>> {
        self.count();
        self.inner.acquire_each(requests).await
    }

    async fn give_back_each(&self, returns: &[GiveBack<'_>]) -> Vec<Result<(), StoreError>> {
        self.count();
        self.inner.give_back_each(returns).await
    }

    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        self.count();
        self.inner.give_back(returns).await
    }

    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        self.count();
        self.inner.delete_idle(limit).await
    }

    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        self.inner.inspect(key).await
    }

    fn call_timeout(&self) -> Option<std::time::Duration> {
        self.inner.call_timeout()
    }

    fn max_concurrent_calls(&self) -> Option<usize> {
        self.inner.max_concurrent_calls()
    }

    fn partition_calls(&self, part: usize) -> Option<usize> {
        self.inner.partition_calls(part)
    }

    fn partition(&self, key: &str) -> usize {
        self.inner.partition(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::{BucketConfig, Rate, Tokens};
    use crate::store::MemoryStore;

    #[tokio::test]
    async fn counts_the_calls_that_reach_the_store_but_not_inspections() {
        let shared = Arc::new(AtomicU64::new(0));
        let a = CountedStore::with_counter(MemoryStore::new(), Arc::clone(&shared));
        let b = CountedStore::with_counter(MemoryStore::new(), Arc::clone(&shared));
        let bucket = BucketConfig::new(Tokens::whole(10), Rate::per_second(1).expect("rate"))
            .expect("bucket");
        let take = AcquireRequest::take("k", bucket, Tokens::whole(1));
        a.acquire(take).await.expect("acquire");
        b.acquire_many(&[take]).await.expect("acquire_many");
        a.inspect("k").await.expect("inspect");
        assert_eq!(a.calls(), 2);
        assert_eq!(shared.load(Ordering::Relaxed), 2);
    }
}
