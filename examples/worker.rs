//! A background worker whose jobs are limited per customer: each job waits for its customer's
//! token with `acquire_until("jobs:customer:<id>", 1, deadline)` before it runs. A customer
//! who queues a burst is slowed to its plan's rate, its jobs in the order they were queued; the
//! other customers' jobs keep running in between, and no job waits past its deadline.
//!
//! ```text
//! cargo run --example worker
//! DATABASE_URL=postgres://app@localhost/app cargo run --example worker
//! ```
//!
//! With `DATABASE_URL` set it uses that server (its buckets stay behind as rows under
//! `jobs:customer:`); otherwise it starts a throwaway PostgreSQL cluster (the `embedded`
//! feature) and removes it on exit. `tests/lease/examples.rs` runs it (W9).

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokenlease::Limiter;
use tokenlease::limiter::WaitError;
use tokenlease::policy::Policies;
use tokenlease::store::PostgresStore;
use tokenlease_testkit::TempPostgres;
use tokio::time::Instant;

/// Each customer may start a burst of 10 jobs, then 10 a second. Leased: the worker asks the
/// database about once per lease, not once per job.
const POLICY: &str = r#"{
  "plans": {
    "per-customer": {
      "capacity": 10,
      "refill_per_second": 10,
      "lease": { "max_fraction": 0.2 },
      "fallback": { "mode": "local", "instances": 1 }
    }
  },
  "keys": [ { "prefix": "jobs:customer:", "plan": "per-customer" } ]
}"#;

/// The queue: which customers queued how many jobs.
pub(crate) const QUEUED: [(&str, u32); 3] = [("acme", 30), ("globex", 8), ("initech", 3)];

/// The longest a job waits for its customer's token before it is given up (a real worker
/// would put it back on the queue).
const JOB_DEADLINE: Duration = Duration::from_secs(10);

/// What a run did, per customer in the order of [`QUEUED`].
#[derive(Debug, Default)]
pub(crate) struct Report {
    /// Jobs run.
    pub(crate) done: [u32; QUEUED.len()],
    /// Jobs given up at their deadline.
    pub(crate) late: [u32; QUEUED.len()],
    /// When the customer's last job ran, from the start.
    pub(crate) finished_at: [Duration; QUEUED.len()],
    /// Store calls for the leases.
    pub(crate) store_calls: u64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    // Keep the cluster (if any) alive until the end of main: dropping it removes it.
    let (_cluster, url) = match std::env::var("DATABASE_URL") {
        Ok(url) if !url.trim().is_empty() => {
            println!("using DATABASE_URL");
            (None, url)
        }
        _ => {
            println!("DATABASE_URL is not set: starting a throwaway PostgreSQL cluster");
            let cluster = tokio::task::spawn_blocking(TempPostgres::start).await??;
            let url = cluster.url();
            (Some(cluster), url)
        }
    };
    let report = run(&url).await?;
    for (i, (name, jobs)) in QUEUED.iter().enumerate() {
        println!(
            "{name:>8}: {} of {jobs:>2} jobs done by {:.2} s, {} given up",
            report.done[i],
            report.finished_at[i].as_secs_f64(),
            report.late[i]
        );
    }
    let jobs: u32 = QUEUED.iter().map(|(_, n)| n).sum();
    println!(
        "{jobs} jobs, {} store calls for their leases",
        report.store_calls
    );
    Ok(())
}

/// Runs the queue against the database at `url`.
pub(crate) async fn run(url: &str) -> Result<Report, Box<dyn std::error::Error + Send + Sync>> {
    let store = PostgresStore::connect(url).await?;
    let limiter = Limiter::builder(store)
        .policies(Policies::from_json_str(POLICY, None)?)
        .build();

    let started = Instant::now();
    let report = Arc::new(Mutex::new(Report::default()));
    let mut jobs = tokio::task::JoinSet::new();
    for (customer, &(name, queued)) in QUEUED.iter().enumerate() {
        let key = format!("jobs:customer:{name}");
        for _ in 0..queued {
            // The job's place in its customer's line is taken here, in queue order, whenever
            // its task first runs.
            let turn = limiter.acquire_until(&key, 1, Instant::now() + JOB_DEADLINE);
            let report = Arc::clone(&report);
            jobs.spawn(async move {
                match turn.await {
                    Ok(_) => {
                        // The job's own work would go here.
                        let mut report = report.lock();
                        report.done[customer] += 1;
                        report.finished_at[customer] = started.elapsed();
                        Ok(())
                    }
                    Err(WaitError::DeadlinePassed { .. }) => {
                        report.lock().late[customer] += 1;
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            });
        }
    }
    while let Some(job) = jobs.join_next().await {
        job??;
    }

    let mut report = std::mem::take(&mut *report.lock());
    report.store_calls = limiter.lease_stats().map_or(0, |s| s.store_calls);
    limiter.shutdown().await;
    Ok(report)
}
