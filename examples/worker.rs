//! A background worker whose jobs are limited per customer: each job asks
//! `try_acquire("jobs:customer:<id>", 1.0)` first, and a denied job goes back on the queue until
//! its `retry_after` has passed. A customer who queues a burst is slowed to its plan's rate;
//! the other customers' jobs keep running in between.
//!
//! ```text
//! cargo run --example worker
//! DATABASE_URL=postgres://app@localhost/app cargo run --example worker
//! ```
//!
//! With `DATABASE_URL` set it uses that server (its buckets stay behind as rows under
//! `jobs:customer:`); otherwise it starts a throwaway PostgreSQL cluster (the `embedded`
//! feature) and removes it on exit.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use tokenlease::Limiter;
use tokenlease::policy::Policies;
use tokenlease::store::PostgresStore;
use tokenlease_testkit::TempPostgres;

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
const QUEUED: [(&str, u32); 3] = [("acme", 30), ("globex", 8), ("initech", 3)];

/// One queued job.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Job {
    /// Not to be tried before this instant.
    ready_at: Instant,
    /// Its place in the queue, so jobs ready at once keep their order.
    seq: u64,
    /// Index into [`QUEUED`].
    customer: usize,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
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
    let store = PostgresStore::connect(&url).await?;
    let limiter = Limiter::builder(store)
        .policies(Policies::from_json_str(POLICY, None)?)
        .build();

    let started = Instant::now();
    let mut queue = BinaryHeap::new();
    let mut seq = 0;
    for (customer, &(_, jobs)) in QUEUED.iter().enumerate() {
        for _ in 0..jobs {
            queue.push(Reverse(Job {
                ready_at: started,
                seq,
                customer,
            }));
            seq += 1;
        }
    }

    let mut done = [0u32; QUEUED.len()];
    let mut deferred = [0u32; QUEUED.len()];
    let mut finished_at = [Duration::ZERO; QUEUED.len()];
    while let Some(Reverse(job)) = queue.pop() {
        tokio::time::sleep_until(job.ready_at.into()).await;
        let (name, jobs) = QUEUED[job.customer];
        let key = format!("jobs:customer:{name}");
        let decision = limiter.try_acquire(&key, 1.0).await?;
        if decision.allowed {
            // The job's own work would go here.
            done[job.customer] += 1;
            if done[job.customer] == jobs {
                finished_at[job.customer] = started.elapsed();
            }
        } else {
            deferred[job.customer] += 1;
            seq += 1;
            queue.push(Reverse(Job {
                ready_at: Instant::now() + decision.retry_after,
                seq,
                customer: job.customer,
            }));
        }
    }

    for (i, (name, jobs)) in QUEUED.iter().enumerate() {
        println!(
            "{name:>8}: {jobs:>2} jobs done by {:.2} s, {} times deferred",
            finished_at[i].as_secs_f64(),
            deferred[i]
        );
    }
    let stats = limiter.lease_stats().map_or(0, |s| s.store_calls);
    let jobs: u32 = QUEUED.iter().map(|(_, n)| n).sum();
    println!("{jobs} jobs, {stats} store calls for their leases");
    limiter.shutdown().await;
    Ok(())
}
