//! Two instances of a service share one limit: two limiters, each with its own `PostgresStore`
//! and connection pool (as two processes would have), spend from one bucket in the database.
//!
//! ```text
//! cargo run --example instances
//! DATABASE_URL=postgres://app@localhost/app cargo run --example instances
//! ```
//!
//! With `DATABASE_URL` set it uses that server (and leaves one row behind under the key
//! `ratelimit:example:instances:<pid>`); otherwise it starts a throwaway PostgreSQL cluster
//! (the `tokenlease-testkit` crate) and removes it on exit.
//!
//! The plan is leased with strict accounting: each instance spends from a lease held in memory,
//! and the bucket row counts every live lease against the capacity, so both together never
//! admit more than one bucket would (capacity plus what refills meanwhile).

use std::time::{Duration, Instant};

use tokenlease::Limiter;
use tokenlease::policy::Policies;
use tokenlease::store::PostgresStore;
use tokenlease_testkit::TempPostgres;

/// The policy both instances load, as a service would from its file.
const POLICY: &str = r#"{
  "plans": {
    "shared": {
      "capacity": 50,
      "refill": { "tokens": 1, "period_ms": 60000 },
      "lease": { "accounting": "strict" },
      "fallback": { "mode": "deny" }
    }
  },
  "default_plan": "shared"
}"#;

/// What one run of [`run`] saw.
#[derive(Debug)]
pub(crate) struct Report {
    /// Requests each instance admitted.
    pub(crate) admitted: [u64; 2],
    /// Requests each instance made.
    pub(crate) requests: u64,
    /// Store calls (SQL statements) each instance made for them.
    pub(crate) store_calls: [u64; 2],
    /// The most both together may admit: the capacity plus what refilled during the run.
    pub(crate) bound: f64,
}

/// Makes `requests` calls on each of two limiters over separate pools of `database_url`,
/// interleaved, all for one key, and reports what each admitted.
pub(crate) async fn run(
    database_url: &str,
    requests: u64,
) -> Result<Report, Box<dyn std::error::Error>> {
    let policies = Policies::from_json_str(POLICY, None)?;
    let plan = policies
        .default_plan()
        .expect("the policy names one")
        .clone();
    let key = format!("ratelimit:example:instances:{}", std::process::id());

    let started = Instant::now();
    // Two stores, two pools: nothing is shared in the process but the database. Each one
    // applies the migrations on connect (serialised by an advisory lock).
    let (a, b) = tokio::try_join!(
        PostgresStore::connect(database_url),
        PostgresStore::connect(database_url)
    )?;
    let instances = [
        Limiter::builder(a).policies(policies.clone()).build(),
        Limiter::builder(b).policies(policies).build(),
    ];

    let mut admitted = [0u64; 2];
    for _ in 0..requests {
        for (i, limiter) in instances.iter().enumerate() {
            if limiter.try_acquire(&key, 1.0).await?.allowed {
                admitted[i] += 1;
            }
        }
    }
    let store_calls = [0, 1].map(|i| instances[i].lease_stats().map_or(0, |s| s.store_calls));
    for limiter in &instances {
        limiter.shutdown().await; // gives unspent lease tokens back to the bucket
    }

    let refill_per_second = plan.rate().as_f64();
    let elapsed = started.elapsed().as_secs_f64();
    Ok(Report {
        admitted,
        requests,
        store_calls,
        bound: plan.capacity().as_f64() + refill_per_second * elapsed,
    })
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

    let report = run(&url, 100).await?;
    let total = report.admitted[0] + report.admitted[1];
    for (i, name) in ["a", "b"].iter().enumerate() {
        println!(
            "instance {name}: {} of {} requests admitted, {} store calls",
            report.admitted[i], report.requests, report.store_calls[i]
        );
    }
    println!(
        "together: {total} admitted; one bucket would have admitted at most {:.1}",
        report.bound
    );
    assert!(
        total as f64 <= report.bound,
        "the shared limit was exceeded"
    );
    // Give the throwaway cluster a moment to see the pools close before it stops.
    tokio::time::sleep(Duration::from_millis(50)).await;
    Ok(())
}
