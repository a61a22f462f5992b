//! The examples' logic against a real PostgreSQL: `examples/instances.rs` runs here as a
//! module (its `main` unused), on a fresh database from [`TestDatabase`].

use tokenlease_testkit::TestDatabase;

#[path = "../../examples/instances.rs"]
#[allow(dead_code)]
mod instances;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_with_their_own_pools_share_one_limit() {
    let db = TestDatabase::create().await.expect("test database");
    let report = instances::run(&db.connection_string(), 100)
        .await
        .expect("the example runs");
    let total = report.admitted[0] + report.admitted[1];
    assert!(
        total as f64 <= report.bound,
        "{total} admitted, more than one bucket allows ({:.1}): {report:?}",
        report.bound
    );
    // Both spent from the one bucket, each through its own leases.
    assert!(report.admitted.iter().all(|&n| n > 0), "{report:?}");
    assert!(report.store_calls.iter().all(|&n| n > 0), "{report:?}");
}
