//! The examples' logic against a real PostgreSQL: `examples/instances.rs` and
//! `examples/worker.rs` run here as modules (their `main`s unused), each on a fresh database
//! from [`TestDatabase`].

use tokenlease_testkit::TestDatabase;

#[path = "../../examples/instances.rs"]
#[allow(dead_code)]
mod instances;

#[path = "../../examples/worker.rs"]
#[allow(dead_code)]
mod worker;

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

/// W9: the worker example, whose jobs wait for their customer's token with
/// `Limiter::acquire_until`: every job runs, none past its deadline; the two small customers'
/// jobs are not held up behind the big one's burst (both finish before it), whose 30 jobs take
/// at least the second the bucket needs for them (10 at once and 10 a second, less what a lease
/// and the plan's local fallback may add), with fewer store calls than jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn w9_the_worker_runs_each_customers_jobs_at_its_rate() {
    let db = TestDatabase::create().await.expect("test database");
    let report = worker::run(&db.connection_string())
        .await
        .expect("the example runs");
    let queued = worker::QUEUED.map(|(_, n)| n);
    assert_eq!(report.done, queued, "{report:?}");
    assert_eq!(report.late, [0; 3], "{report:?}");
    let [acme, globex, initech] = report.finished_at;
    assert!(globex < acme && initech < acme, "{report:?}");
    assert!(acme >= std::time::Duration::from_secs(1), "{report:?}");
    let jobs: u32 = queued.iter().sum();
    assert!(report.store_calls < u64::from(jobs), "{report:?}");
}
