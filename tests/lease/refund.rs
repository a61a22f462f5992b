//! Refunds into a live lease never lift it above its bound.
//!
//! The HTTP layer refunds the endpoint's token when the entity layer denies. Refunds went into
//! the live lease word while the actor kept topping the lease up (in-flight takes had dragged it
//! under its low-water mark), so a lease of at most `B` = 10 tokens grew to 38–40 and the burst
//! that followed spent them: the worst window exceeded `C + r·w` by up to 39.6 tokens against a
//! stated bound of `N·B` = 10. A refund now goes into the lease only while the lease stays within
//! `B`, and a top-up never lifts it above `B`; the rest goes back to the store.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokenlease::policy::{FallbackMode, FallbackSettings, LeaseSettings, Plan};
use tokenlease::store::{MemoryStore, Store};
use tokenlease::{DecidedBy, Limiter};

const C: f64 = 100.0;
const R: f64 = 50.0;
const B: f64 = 10.0;
/// Clock slack of the window check (seconds of refill).
const SLACK: f64 = 0.02;

fn plan(max_fraction: f64) -> Plan {
    common::plan(C as u64, R)
        .with_lease(LeaseSettings::default().with_max_fraction(max_fraction))
        .with_fallback(FallbackSettings::new(FallbackMode::Deny))
}

/// 32 tasks take and refund every token for 1.5 s (every request refused further on), then
/// take without refunding for 1 s: every window of the second phase holds `C + r·w + B`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refunds_do_not_grow_a_lease_past_its_bound() {
    let db = common::database().await;
    let limiter = Limiter::builder(common::store(&db, 4).await).build();
    let plan = Arc::new(plan(0.1));
    let phase = |refund: bool, duration: Duration| {
        let handles: Vec<_> = (0..32)
            .map(|_| {
                let (limiter, plan) = (limiter.clone(), Arc::clone(&plan));
                tokio::spawn(async move {
                    let mut admitted = Vec::new();
                    let deadline = Instant::now() + duration;
                    while Instant::now() < deadline {
                        let d = limiter
                            .try_acquire_with(&plan, "booking", 1.0)
                            .await
                            .expect("decision");
                        if d.allowed && d.decided_by != DecidedBy::Fallback(FallbackMode::Deny) {
                            if refund {
                                limiter.refund(&plan, "booking", 1.0).await.expect("refund");
                            } else {
                                admitted.push(Instant::now());
                            }
                        }
                        // sleep: pacing, calls 500 µs apart.
                        tokio::time::sleep(Duration::from_micros(500)).await;
                    }
                    admitted
                })
            })
            .collect();
        async move {
            let mut all = Vec::new();
            for h in handles {
                all.extend(h.await.expect("task"));
            }
            all.sort();
            all
        }
    };
    phase(true, Duration::from_millis(1500)).await;
    let burst = phase(false, Duration::from_secs(1)).await;
    assert!(!burst.is_empty(), "the burst admitted nothing");
    let t0 = burst[0];
    let points: Vec<(f64, f64)> = burst
        .iter()
        .map(|t| ((*t - t0).as_secs_f64(), 1.0))
        .collect();
    for w in [0.1, 0.5, 1.0] {
        let (excess, count) = common::worst_window(&points, w, C, R, SLACK);
        assert!(
            excess <= B + 1e-9,
            "window {w} s admitted {count}: {excess:.1} over C + r·w against a bound of B = {B}"
        );
    }
    limiter.shutdown().await;
}

/// A refund that fits goes into the live lease; one that would lift the lease above `B` goes
/// to the store, and the lease stays within `B`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_that_would_exceed_the_bound_goes_to_the_store() {
    let memory = MemoryStore::new();
    let limiter = Limiter::builder(memory.clone()).build();
    let plan = plan(0.1);
    for _ in 0..30 {
        let d = limiter
            .try_acquire_with(&plan, "r", 1.0)
            .await
            .expect("decision");
        assert!(d.allowed);
        // sleep: pacing. Calls a few milliseconds apart: the actor measures the key's demand
        // (hundreds of tokens a second) and leases it the bound, `B`.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // Wait (bounded) until the refills the calls asked for have landed: nothing asks for more.
    common::actor_idle(&limiter, Duration::from_secs(5)).await;
    let held = limiter.lease_stats().expect("leased").outstanding;
    assert!(held > 0.0 && held <= B, "lease {held}");
    let row = |m: &MemoryStore| {
        let m = m.clone();
        async move { m.inspect("r").await.expect("inspect").expect("row").tokens }
    };
    let store_before = row(&memory).await;
    // B tokens cannot fit on top of a lease holding some: they go to the store.
    assert!(limiter.refund(&plan, "r", B).await.expect("refund"));
    let after = limiter.lease_stats().expect("leased").outstanding;
    assert!((after - held).abs() < 1e-9, "lease {held} -> {after}");
    let store_after = row(&memory).await;
    assert!(
        store_after > store_before,
        "{store_before:?} -> {store_after:?}"
    );
    assert!(after <= B);
}
