//! Driving limiter instances with paced calls on one key, and what each instance saw.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokenlease::policy::Plan;
use tokenlease::{DecidedBy, Limiter};

/// What one instance saw in [`calls`].
#[derive(Default)]
pub struct Seen {
    /// Admission times (local monotonic clock, shared by all instances in this process).
    pub admitted: Vec<Instant>,
    /// How many of those a lease paid. The rest were store calls: a key's calls go to the store
    /// while it is sparse (its first ones, before the actor has sized it a lease).
    pub by_lease: u64,
    pub denied: u64,
    /// Decisions the fallback made (the store failed, or a refill took longer than max_wait).
    pub fallback: u64,
    pub latencies_ns: Vec<u64>,
}

/// `tasks` tasks per limiter on `key` for `duration` (at most 10,000 calls a task), each call
/// of cost 1 followed by a pause of `every`. One [`Seen`] per limiter, in order.
pub async fn calls(
    limiters: &[Limiter],
    plan: &Arc<Plan>,
    key: &str,
    tasks: usize,
    duration: Duration,
    every: Duration,
) -> Vec<Seen> {
    let mut handles = Vec::new();
    for (i, limiter) in limiters.iter().enumerate() {
        for _ in 0..tasks {
            let (limiter, plan, key) = (limiter.clone(), Arc::clone(plan), key.to_owned());
            handles.push(tokio::spawn(async move {
                let mut seen = Seen::default();
                let deadline = Instant::now() + duration;
                let mut calls = 0;
                while Instant::now() < deadline && calls < 10_000 {
                    calls += 1;
                    let started = Instant::now();
                    let d = limiter
                        .try_acquire_with(&plan, &key, 1.0)
                        .await
                        .expect("decision");
                    let at = Instant::now();
                    seen.latencies_ns.push((at - started).as_nanos() as u64);
                    match d.decided_by {
                        DecidedBy::Fallback(_) => seen.fallback += 1,
                        _ if d.allowed => {
                            seen.admitted.push(at);
                            seen.by_lease += u64::from(d.decided_by == DecidedBy::Lease);
                        }
                        _ => seen.denied += 1,
                    }
                    // sleep: pacing, the offered load's period.
                    tokio::time::sleep(every).await;
                }
                (i, seen)
            }));
        }
    }
    let mut out: Vec<Seen> = (0..limiters.len()).map(|_| Seen::default()).collect();
    for h in handles {
        let (i, seen) = h.await.expect("task");
        out[i].admitted.extend(seen.admitted);
        out[i].by_lease += seen.by_lease;
        out[i].denied += seen.denied;
        out[i].fallback += seen.fallback;
        out[i].latencies_ns.extend(seen.latencies_ns);
    }
    out
}

/// [`calls`] on key "hot", one call every 500 µs per task: C1's load.
pub async fn hammer(
    limiters: &[Limiter],
    plan: &Arc<Plan>,
    tasks: usize,
    duration: Duration,
) -> Vec<Seen> {
    calls(
        limiters,
        plan,
        "hot",
        tasks,
        duration,
        Duration::from_micros(500),
    )
    .await
}
