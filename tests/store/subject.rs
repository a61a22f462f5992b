//! A store under test beside a model of it: a `MemoryStore` on a paused tokio clock of its own,
//! or a store over real PostgreSQL databases whose time moves by shifting every row's
//! `updated_us` back. The property tests that compare stores (`contained`, `limits`) share it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokenlease::store::{
    AcquireRequest, Acquired, BucketRow, GiveBack, MemoryStore, Store, StoreError,
};
use tokio::runtime::Runtime;

/// A store under test, and how to move its time.
pub(crate) struct Subject {
    pub(crate) name: &'static str,
    pub(crate) store: Arc<dyn Store>,
    /// The memory store's runtime, whose clock [`advance`](Self::advance) moves.
    memory: Option<Arc<PausedMemory>>,
    /// Sessions on each database holding the store's buckets (not the store's own).
    pub(crate) tables: Vec<tokio_postgres::Client>,
}

impl Subject {
    pub(crate) fn memory() -> Subject {
        let memory = Arc::new(PausedMemory::new());
        Subject {
            name: "memory",
            store: Arc::clone(&memory) as Arc<dyn Store>,
            memory: Some(memory),
            tables: Vec::new(),
        }
    }

    pub(crate) async fn postgres(
        name: &'static str,
        store: Arc<dyn Store>,
        conns: &[String],
    ) -> Subject {
        let mut tables = Vec::new();
        for conn in conns {
            tables.push(client(conn).await);
        }
        Subject {
            name,
            store,
            memory: None,
            tables,
        }
    }

    pub(crate) async fn advance(&self, by: Duration) {
        if let Some(memory) = &self.memory {
            memory.run(tokio::time::advance(by));
        }
        for c in &self.tables {
            c.batch_execute(&format!(
                "UPDATE tokenlease_buckets SET updated_us = updated_us - {}",
                by.as_micros()
            ))
            .await
            .expect("shift updated_us");
        }
    }
}

/// A `MemoryStore` on a runtime of its own (current-thread, started paused): the store reads
/// tokio's clock, and the tests that compare it with PostgreSQL run on a runtime that must not be
/// paused (a paused runtime jumps its clock while a statement is on the wire, and the store's
/// calls time out). So each of the memory store's calls runs to its end on this runtime, on a
/// thread of its own (a runtime cannot block on another from within), and its time stands
/// still until [`Subject::advance`] moves it.
#[derive(Debug)]
struct PausedMemory {
    store: MemoryStore,
    /// Always `Some` but in `drop`, which shuts it down without waiting (a runtime may not be
    /// dropped, waiting, inside the test's).
    runtime: Option<Runtime>,
}

impl PausedMemory {
    fn new() -> PausedMemory {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("a paused runtime");
        PausedMemory {
            store: MemoryStore::new(),
            runtime: Some(runtime),
        }
    }

    /// Runs `call` to its end on the paused runtime.
    fn run<T: Send>(&self, call: impl Future<Output = T> + Send) -> T {
        let runtime = self.runtime.as_ref().expect("the runtime");
        std::thread::scope(
            |scope| match scope.spawn(|| runtime.block_on(call)).join() {
                Ok(out) => out,
                Err(panic) => std::panic::resume_unwind(panic),
            },
        )
    }
}

impl Drop for PausedMemory {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

#[async_trait]
impl Store for PausedMemory {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        self.run(self.store.acquire(request))
    }
    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        self.run(self.store.acquire_many(requests))
    }
    async fn acquire_each(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Vec<Result<Acquired, StoreError>> {
        self.run(self.store.acquire_each(requests))
    }
    async fn give_back_each(&self, returns: &[GiveBack<'_>]) -> Vec<Result<(), StoreError>> {
        self.run(self.store.give_back_each(returns))
    }
    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        self.run(self.store.give_back(returns))
    }
    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        self.run(self.store.delete_idle(limit))
    }
    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        self.run(self.store.inspect(key))
    }
    fn call_timeout(&self) -> Option<Duration> {
        self.store.call_timeout()
    }
    fn partition(&self, key: &str) -> usize {
        self.store.partition(key)
    }
    fn max_concurrent_calls(&self) -> Option<usize> {
        self.store.max_concurrent_calls()
    }
    fn partition_calls(&self, part: usize) -> Option<usize> {
        self.store.partition_calls(part)
    }
}

pub(crate) async fn client(conn: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(conn, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}
