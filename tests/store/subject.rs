//! A store under test beside a model of it: a `MemoryStore` on a manual clock, or a store over
//! real PostgreSQL databases whose time moves by shifting every row's `updated_us` back. The
//! property tests that compare stores (`contained`, `limits`) share it.

use std::sync::Arc;
use std::time::Duration;

use tokenlease::bucket::Timestamp;
use tokenlease::clock::ManualClock;
use tokenlease::store::{MemoryStore, Store};

/// A store under test, and how to move its time.
pub(crate) struct Subject {
    pub(crate) name: &'static str,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) clock: Option<ManualClock>,
    /// Sessions on each database holding the store's buckets (not the store's own).
    pub(crate) tables: Vec<tokio_postgres::Client>,
}

impl Subject {
    pub(crate) fn memory() -> Subject {
        let clock = ManualClock::new(Timestamp::from_nanos(1_700_000_000_000_000_000));
        Subject {
            name: "memory",
            store: Arc::new(MemoryStore::with_clock(clock.clone())),
            clock: Some(clock),
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
            clock: None,
            tables,
        }
    }

    pub(crate) async fn advance(&self, by: Duration) {
        if let Some(clock) = &self.clock {
            clock.advance(by.as_nanos() as u64);
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

pub(crate) async fn client(conn: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(conn, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}
