//! A lost connection: a pooled connection whose backend is terminated while idle is counted,
//! and the next call still works.

use crate::common;
use crate::rig::{counter_delta, snapshot};

use std::time::Duration;

use tokenlease::store::{AcquireRequest, Store};

/// A pooled connection whose backend is terminated while idle: its driver's error is counted
/// (`tokenlease_store_connection_errors_total`), not dropped, and the next call still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_in_the_background_is_counted() {
    let _serial = common::serial().await;
    let db = common::database().await;
    let store = common::store(&db, 1).await;
    let bucket = common::bucket(10, 1.0);
    let one = tokenlease::bucket::Tokens::whole(1);
    store
        .acquire(AcquireRequest::take("k", bucket, one))
        .await
        .expect("take");
    let _ = snapshot();
    let admin = db.client().await.expect("admin");
    let terminated: i64 = admin
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = 'tokenlease'",
            &[],
        )
        .await
        .expect("terminate")
        .get(0);
    assert_eq!(terminated, 1);
    let mut counted = 0;
    let _ = common::poll_until(
        Duration::from_millis(5),
        Duration::from_secs(5),
        async || {
            counted += counter_delta(&snapshot(), "tokenlease_store_connection_errors_total", &[]);
            counted != 0
        },
    )
    .await;
    assert_eq!(counted, 1, "the lost connection is counted once");
}
