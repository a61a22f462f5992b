//! An abandoned statement: a call that times out leaves no statement running on the server,
//! takes nothing, and the next call is not queued behind it.

use crate::common;
use crate::rig::{counter_delta, ms, snapshot};

use std::time::{Duration, Instant};

use tokenlease::store::{AcquireRequest, PostgresStore, Store, StoreError, TimeoutKind};

/// Statements of the store's sessions (application `tokenlease`) running now.
async fn running_limiter_statements(admin: &tokio_postgres::Client) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'tokenlease' \
             AND state = 'active'",
            &[],
        )
        .await
        .map(|row| row.get(0))
        .unwrap_or(-1)
}

/// A call that times out leaves no statement running on the server, takes nothing, and the next
/// call (a fresh key, on a pool of one connection) is not queued behind it.
///
/// Another session holds the key's row lock, so the store's statement blocks; the server-side
/// `statement_timeout` and `lock_timeout` are a minute, so only the store can stop it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timed_out_statement_is_cancelled_and_the_next_call_is_not_queued_behind_it() {
    let _serial = common::serial().await;
    let db = common::database().await;
    let call_timeout = Duration::from_millis(1_000);
    let store = PostgresStore::builder(&db.connection_string())
        .expect("connection string")
        .pool_size(1)
        .call_timeout(call_timeout)
        .pool_wait_timeout(Duration::from_millis(900))
        .connect_timeout(Duration::from_secs(2))
        .statement_timeout(Duration::from_secs(60))
        .lock_timeout(Duration::from_secs(60))
        .build()
        .await
        .expect("store");
    let bucket = common::bucket(10, 0.001);
    let one = tokenlease::bucket::Tokens::whole(1);
    let taken = store
        .acquire(AcquireRequest::take("held", bucket, one))
        .await
        .expect("first take");
    assert_eq!(taken.remaining, tokenlease::bucket::Tokens::whole(9));
    let _ = snapshot();

    let mut locker = db.client().await.expect("locker");
    let tx = locker.transaction().await.expect("begin");
    tx.execute(
        "SELECT 1 FROM tokenlease_buckets WHERE key = 'held' FOR UPDATE",
        &[],
    )
    .await
    .expect("lock the row");
    let admin = db.client().await.expect("admin");

    let err = store
        .acquire(AcquireRequest::take("held", bucket, one))
        .await
        .expect_err("the blocked call times out");
    assert!(
        matches!(
            err,
            StoreError::Timeout {
                kind: TimeoutKind::Call,
                ..
            }
        ),
        "{err:?}"
    );
    // At once, on the pool's only connection: not behind the blocked statement.
    let started = Instant::now();
    let fresh = store
        .acquire(AcquireRequest::take("fresh", bucket, one))
        .await;
    let fresh_took = started.elapsed();
    // The abandoned statement is gone from the server while the lock is still held.
    let running = common::poll_until(
        Duration::from_millis(5),
        Duration::from_secs(5),
        async || match running_limiter_statements(&admin).await {
            0 => Ok(0),
            running => Err(running),
        },
    )
    .await
    .unwrap_or_else(|running| running);
    let gone_after = started.elapsed();
    tx.rollback().await.expect("release the row");
    let held = store
        .inspect("held")
        .await
        .expect("inspect")
        .expect("the row");
    let cancels = snapshot();
    eprintln!(
        "abandoned statement: next call took {:.1} ms ({:?}); no statement running after \
         {:.1} ms; cancels sent {}",
        ms(fresh_took),
        fresh.as_ref().map(|a| a.granted),
        ms(gone_after),
        counter_delta(
            &cancels,
            "tokenlease_store_cancels_total",
            &[("result", "sent")]
        ),
    );
    assert_eq!(running, 0, "a limiter statement still runs on the server");
    let fresh = fresh.expect("the next call is decided, not queued behind the abandoned one");
    assert_eq!(fresh.granted, one);
    assert!(
        fresh_took < call_timeout,
        "the next call took {fresh_took:?}"
    );
    // Nothing ran after the lock was released: the abandoned take took nothing.
    assert_eq!(held.tokens, tokenlease::bucket::Tokens::whole(9));
    assert_eq!(
        counter_delta(
            &cancels,
            "tokenlease_store_cancels_total",
            &[("result", "sent")]
        ),
        1
    );
}
