//! Plans of several limits through the limiter over PostgreSQL, in direct and leased mode
//! (P4, P5 in docs/testing.md): the limit that binds decides, and several instances holding
//! leases keep every limit's envelope.
//!
//! The database's clock is real, so these run in real time (the `serial` group): one call
//! every 10 ms for 8 s, and a few seconds of load on one key.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::traffic::hammer;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use tokenlease::policy::{FallbackMode, FallbackSettings, LeaseSettings, Plan};
use tokenlease::{DecidedBy, Limiter};

/// What P4 saw.
#[derive(Debug)]
struct Run {
    first_second: u32,
    admitted: u32,
    last_refusal: Option<Duration>,
}

/// 5 a second (burst 5) and 20 an hour on one key; one call every 10 ms for 8 s. The
/// fallback denies, so a decision it made would show (and fail the test).
async fn five_a_second_and_twenty_an_hour(leased: bool) -> Run {
    let db = common::database().await;
    let mut plan = Plan::builder("several")
        .per_second(5)
        .per_hour(20)
        .fallback(FallbackSettings::new(FallbackMode::Deny));
    if leased {
        plan = plan.lease(LeaseSettings::default());
    }
    let plan = plan.build().expect("plan");
    let limiter = Limiter::builder(common::store(&db, 2).await).build();
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut run = Run {
        first_second: 0,
        admitted: 0,
        last_refusal: None,
    };
    let started = Instant::now();
    for call in 0..800 {
        tick.tick().await;
        let d = limiter
            .try_acquire_with(&plan, "several", 1.0)
            .await
            .expect("decision");
        assert!(
            !matches!(d.decided_by, DecidedBy::Fallback(_)),
            "call {call}: decided by the fallback: {d:?}"
        );
        if d.allowed {
            run.admitted += 1;
            if started.elapsed() < Duration::from_secs(1) {
                run.first_second += 1;
            }
        } else {
            run.last_refusal = Some(d.retry_after);
        }
    }
    limiter.shutdown().await;
    eprintln!("P4 leased={leased}: {run:?}");
    run
}

fn check(run: &Run) {
    assert!(run.first_second <= 10, "{run:?}: burst 5 and 5 a second");
    assert!(
        (18..=20).contains(&run.admitted),
        "{run:?}: 20 an hour binds"
    );
    let retry = run.last_refusal.expect("refused");
    assert!(retry >= Duration::from_secs(60), "{run:?}: the hour's wait");
}

/// P4, direct mode: at most 10 admitted in the first second, 18 to 20 in the 8 s, no
/// fallback decision, and the last refusal waits for the hour's limit (≥ 60 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p4_the_binding_limit_decides_in_direct_mode() {
    check(&five_a_second_and_twenty_an_hour(false).await);
}

/// P4 in leased mode: the same bounds, the leases never holding more than every limit allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p4_the_binding_limit_decides_in_leased_mode() {
    check(&five_a_second_and_twenty_an_hour(true).await);
}

/// P4 with callers at once: 40 concurrent calls a round, five rounds 1.1 s apart, direct mode
/// (the limiter gathers a round's callers of the key into few statements). In the first three
/// rounds 5 a round are admitted and every refusal waits at most a second (the second's limit
/// binds); the fourth spends the hour's last 5, and in the fifth every refusal waits at least
/// 60 s (the hour's), however the callers were gathered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p4_callers_at_once_are_told_the_binding_limits_wait() {
    let db = common::database().await;
    let plan = Arc::new(
        Plan::builder("several")
            .per_second(5)
            .per_hour(20)
            .fallback(FallbackSettings::new(FallbackMode::Deny))
            .build()
            .expect("plan"),
    );
    let limiter = Limiter::builder(common::store(&db, 4).await).build();
    let mut tick = tokio::time::interval(Duration::from_millis(1_100));
    let mut total = 0;
    for round in 0..5 {
        tick.tick().await;
        let calls: Vec<_> = (0..40)
            .map(|_| {
                let (limiter, plan) = (limiter.clone(), Arc::clone(&plan));
                tokio::spawn(async move {
                    limiter
                        .try_acquire_with(&plan, "at-once", 1)
                        .await
                        .expect("decision")
                })
            })
            .collect();
        let mut admitted = 0;
        for call in calls {
            let d = call.await.expect("task");
            assert!(!matches!(d.decided_by, DecidedBy::Fallback(_)), "{d:?}");
            if d.allowed {
                admitted += 1;
            } else if round < 3 {
                assert!(
                    d.retry_after <= Duration::from_secs(1),
                    "round {round}: {d:?}"
                );
            } else if round == 4 {
                assert!(
                    d.retry_after >= Duration::from_secs(60),
                    "round {round}: {d:?}"
                );
            }
        }
        total += admitted;
        if round < 4 {
            assert!(
                (4..=6).contains(&admitted),
                "round {round}: {admitted} admitted"
            );
        }
    }
    assert!((18..=20).contains(&total), "{total} admitted");
    limiter.shutdown().await;
}

/// One P5 case: two limits (capacity, tokens a second), the tighter burst first.
fn shapes() -> impl Strategy<Value = [(u64, u64); 2]> {
    (20u64..60, 100u64..300, 2u64..5, 1u64..4)
        .prop_map(|(c, r, k, s)| [(c, r), (c * k, r / (s + 1))])
}

/// P5: three instances (their own pools and actors) on one key of a plan of two limits, for
/// 2 s per generated shape: every sliding window holds each limit's envelope
/// `C_i + r_i·(w + ε) + N·B` (B the largest lease, a tenth of the smaller capacity), and each
/// instance's leases are conserved exactly (admitted + returned + waived + stranded +
/// outstanding = leased).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p5_several_instances_keep_every_limits_envelope() {
    const N: f64 = 3.0;
    const SLACK: f64 = 0.02;
    let db = common::database().await;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    for case in 0..3 {
        let limits = shapes().new_tree(&mut runner).expect("case").current();
        let plan = Plan::builder(format!("p5-{case}"))
            .per_second(limits[0].1)
            .burst(limits[0].0)
            .per_second(limits[1].1)
            .burst(limits[1].0)
            .lease(
                LeaseSettings::default()
                    .with_ttl(Duration::from_secs(1))
                    .with_max_fraction(0.1)
                    .with_refresh(Duration::from_millis(100))
                    .with_max_wait(Duration::from_millis(50)),
            )
            .fallback(FallbackSettings::new(FallbackMode::Deny))
            .build()
            .expect("plan");
        let b = (plan.capacity().floor() as f64 * 0.1).max(1.0);
        let plan = Arc::new(plan);
        let mut limiters = Vec::new();
        for _ in 0..N as usize {
            limiters.push(Limiter::builder(common::store(&db, 2).await).build());
        }
        let seen = hammer(&limiters, &plan, 2, Duration::from_secs(2)).await;
        let mut all = Vec::new();
        for (i, (limiter, s)) in limiters.iter().zip(&seen).enumerate() {
            limiter.shutdown().await;
            let stats = limiter.lease_stats().expect("leased");
            common::assert_conserved(
                &format!("case {case} instance {i}"),
                s.by_lease as f64,
                &stats,
            );
            all.extend(s.admitted.iter().copied());
        }
        all.sort();
        let t0 = all[0];
        let points: Vec<(f64, f64)> = all.iter().map(|t| ((*t - t0).as_secs_f64(), 1.0)).collect();
        for (c, r) in limits {
            for w in [0.05, 0.2, 0.5, 1.0, 2.0] {
                let (excess, count) = common::worst_window(&points, w, c as f64, r as f64, SLACK);
                assert!(
                    excess <= N * b,
                    "case {case} {limits:?}: window {w} s admitted {count} > {c} + {r}·({w} + \
                     {SLACK}) + {N}·{b}"
                );
            }
        }
        eprintln!("P5 case {case} {limits:?}: {} admitted in 2 s", all.len());
        // The load reached the limits: the windows above were not checked on a trickle.
        let least = limits
            .iter()
            .map(|&(c, r)| (c + 2 * r) as f64)
            .fold(f64::INFINITY, f64::min);
        assert!(
            all.len() as f64 >= least / 3.0,
            "case {case} {limits:?}: {} admitted, under a third of the 2 s envelope {least}",
            all.len()
        );
    }
}
