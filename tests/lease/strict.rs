//! Strict lease accounting: the store counts every live lease against the bucket's
//! capacity, so leased mode admits no more in any window than one ideal bucket, with no lease
//! term in the bound. Here: C5 in strict mode, the lull-then-burst case strict
//! accounting exists for (relaxed as its negative control), and refunds. C1 strict sits beside
//! relaxed C1 in `tests/lease/lease.rs`. Several limiter instances (each with its own pool and actor)
//! on one real server; runs in the nextest `serial` group.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use common::traffic::{calls, hammer};
use tokenlease::Limiter;
use tokenlease::policy::{Accounting, FallbackMode, FallbackSettings, LeaseSettings, Plan};
use tokenlease::store::Store;

const C: f64 = 100.0;
const R: f64 = 50.0;
/// The largest lease: max_fraction 0.1 of C.
const B: f64 = 10.0;
/// Clock slack for window checks, in seconds: admissions are stamped when the caller hears the
/// answer, a little after the token left the bucket.
const SLACK: f64 = 0.02;
const WINDOWS: [f64; 6] = [0.05, 0.1, 0.5, 1.0, 2.0, 5.0];

/// C1's leased defaults (docs/testing.md) with strict accounting. The fallback denies, so every
/// admission is a lease's.
fn strict_plan() -> Plan {
    common::plan(C as u64, R)
        .with_lease(
            LeaseSettings::default()
                .with_ttl(Duration::from_secs(1))
                .with_max_fraction(B / C)
                .with_refresh(Duration::from_millis(100))
                .with_accounting(Accounting::Strict),
        )
        .with_fallback(FallbackSettings::new(FallbackMode::Deny))
}

/// The worst excess over `C + R·(w + SLACK)` in any window of each length in [`WINDOWS`], over
/// all admissions (any instance), with the window's admitted count.
fn worst_excess(admitted: &[Instant]) -> Vec<(f64, f64, f64)> {
    let mut all = admitted.to_vec();
    all.sort();
    let t0 = all[0];
    let points: Vec<(f64, f64)> = all.iter().map(|t| ((*t - t0).as_secs_f64(), 1.0)).collect();
    WINDOWS
        .iter()
        .map(|&w| {
            let (excess, count) = common::worst_window(&points, w, C, R, SLACK);
            (w, excess, count)
        })
        .collect()
}

/// C5 strict: an instance dies holding a lease (its runtime is dropped: no shutdown, no
/// give-back). Its entry stays on the row and counts until its expiry, then stops counting
/// without anyone settling it; the survivor's windows hold the envelope with no lease term, and
/// it keeps at least 0.8·r·T − B over the next 3 s.
#[test]
fn a_dead_strict_holder_stops_counting_at_its_expiry() {
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let db = main.block_on(common::database());
    let store = main.block_on(common::store(&db, 2));
    let plan = Arc::new(strict_plan());
    let doomed_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let (held, doomed_admitted) = doomed_rt.block_on(async {
        let limiter = Limiter::builder(common::store(&db, 2).await).build();
        // 100 calls/s for 1 s: the bucket (100 + 50/s) never runs dry, so the lease is
        // healthy, about demand × refresh = 10 tokens, when the process dies. (Under overload
        // the last renewal may grant nothing and keep nothing, leaving no entry to test.)
        let seen = calls(
            std::slice::from_ref(&limiter),
            &plan,
            "hot",
            1,
            Duration::from_secs(1),
            Duration::from_millis(10),
        )
        .await;
        let stats = limiter.lease_stats().expect("leased");
        std::mem::forget(limiter); // no Drop, no shutdown: the process "dies"
        (
            stats.outstanding,
            seen.into_iter().next().expect("seen").admitted,
        )
    });
    drop(doomed_rt); // kills the actor mid-flight
    let died = SystemTime::now();
    assert!(held <= B, "a lease holds at most B = {B} tokens ({held})");
    let row = main
        .block_on(store.inspect("hot"))
        .expect("inspect")
        .expect("row");
    assert_eq!(
        row.leases.len(),
        1,
        "the dead holder's lease is on the row: {row:?}"
    );
    let dead = row.leases[0].clone();
    assert!(
        dead.amount.as_f64() >= held - 1e-9 && dead.amount.as_f64() <= B + 1e-9,
        "{dead:?}"
    );
    // Counted for 2 ttl + 2 ticks (50 ms) after its last grant, never longer.
    let left = dead
        .expires_at
        .duration_since(row.store_now)
        .unwrap_or_default();
    assert!(left <= Duration::from_millis(2100), "counted {left:?} more");
    main.block_on(async {
        let survivor = Limiter::builder(common::store(&db, 2).await).build();
        let seen = hammer(std::slice::from_ref(&survivor), &plan, 4, Duration::from_secs(3)).await;
        survivor.shutdown().await;
        let admitted = seen[0].admitted.len() as f64;
        eprintln!(
            "C5 strict: the dead holder held {held:.2} (entry {}), survivor admitted {admitted} in 3 s",
            dead.amount
        );
        assert!(admitted >= 0.8 * R * 3.0 - B, "survivor admitted {admitted} in 3 s");
        let mut all = doomed_admitted.clone();
        all.extend(seen[0].admitted.iter().copied());
        for (w, excess, count) in worst_excess(&all) {
            assert!(
                excess <= 1e-9,
                "window {w} s admitted {count}: the dead lease was counted twice"
            );
        }
    });
    let row = main
        .block_on(store.inspect("hot"))
        .expect("inspect")
        .expect("row");
    assert!(
        row.leases.iter().all(|l| l.holder != dead.holder),
        "{:?} after its expiry ({:?} after the death): {row:?}",
        dead,
        died.elapsed()
    );
}

/// The case strict accounting exists for, with relaxed leases as the negative control: two
/// instances build up leases with steady demand below the rate, pause while their leases are
/// still live and the bucket refills, then burst. A relaxed bucket refills behind its leases,
/// so the burst spends a full bucket plus the leases in one short window; a strict bucket
/// counted the leases, so the burst spends at most one bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_after_a_lull_spends_no_more_than_one_bucket() {
    let db = common::database().await;
    let mut excess = Vec::new();
    for accounting in [Accounting::Relaxed, Accounting::Strict] {
        let plan = Arc::new(
            common::plan(C as u64, R)
                .with_lease(
                    LeaseSettings::default()
                        .with_ttl(Duration::from_secs(5))
                        .with_max_fraction(B / C)
                        .with_refresh(Duration::from_millis(500))
                        // A refill on a busy machine can take more than the default wait; the
                        // fallback (deny) would then decide the burst and hide the overshoot
                        // this test compares.
                        .with_max_wait(Duration::from_secs(1))
                        .with_accounting(accounting),
                )
                .with_fallback(FallbackSettings::new(FallbackMode::Deny)),
        );
        let key = format!("lull-{accounting:?}");
        let mut limiters = Vec::new();
        for _ in 0..2 {
            limiters.push(Limiter::builder(common::store(&db, 4).await).build());
        }
        let mut admitted = Vec::new();
        // 2 s of 20 calls/s per instance (40/s in all, under the 50/s rate): leases grow to
        // about demand × refresh = 10 tokens each.
        let steady = calls(
            &limiters,
            &plan,
            &key,
            1,
            Duration::from_secs(2),
            Duration::from_millis(50),
        )
        .await;
        admitted.extend(steady.into_iter().flat_map(|s| s.admitted));
        let held: f64 = limiters
            .iter()
            .map(|l| l.lease_stats().expect("leased").outstanding)
            .sum();
        // sleep: the lull, 2.5 s of the server's clock, enough for the bucket to refill
        // completely; the leases live on.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        // The burst: 16 tasks per instance for 0.5 s.
        let burst = calls(
            &limiters,
            &plan,
            &key,
            16,
            Duration::from_millis(500),
            Duration::from_micros(500),
        )
        .await;
        admitted.extend(burst.into_iter().flat_map(|s| s.admitted));
        for limiter in &limiters {
            limiter.shutdown().await;
        }
        let worst = worst_excess(&admitted)
            .into_iter()
            .map(|(_, e, _)| e)
            .fold(f64::NEG_INFINITY, f64::max);
        eprintln!(
            "lull then burst, {accounting:?}: {} admitted, {held:.1} tokens on lease at the lull, worst window excess {worst:.2}",
            admitted.len()
        );
        excess.push((accounting, held, worst));
    }
    let (_, relaxed_held, relaxed) = excess[0];
    let (_, _, strict) = excess[1];
    assert!(
        relaxed_held >= 5.0 && relaxed >= 5.0,
        "negative control: relaxed leases ({relaxed_held:.1} held) should overshoot the envelope here, excess {relaxed:.2}"
    );
    assert!(strict <= 1e-9, "strict leases overshot by {strict:.2}");
}

/// A refund of a strict lease's token goes to the store, not back into the lease word: the
/// store's entry covers only what the holder kept at its last renewal, so a token put back into
/// the word could be one the store no longer counts. The store caps the credit at the capacity
/// less the leases out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strict_refund_goes_to_the_store() {
    let db = common::database().await;
    let store = common::store(&db, 2).await;
    let limiter = Limiter::builder(store.clone()).build();
    let plan = common::plan(10, 0.001)
        .with_lease(LeaseSettings::default().with_accounting(Accounting::Strict));
    let mut by_lease = 0.0;
    for _ in 0..3 {
        let d = limiter
            .try_acquire_with(&plan, "refund", 1.0)
            .await
            .expect("decision");
        assert!(d.allowed);
        by_lease += f64::from(u8::from(d.decided_by == tokenlease::DecidedBy::Lease));
    }
    assert!(limiter.refund(&plan, "refund", 1.0).await.expect("refund"));
    // Had the token gone back into the lease word, the lease would hold one token more than it
    // was granted less what was admitted. (A background top-up may come at any time; it adds to
    // leased and outstanding alike, so this holds whenever it is read.)
    let stats = limiter.lease_stats().expect("leased");
    common::assert_conserved("the strict limiter", by_lease, &stats);
    let row = store
        .inspect("refund")
        .await
        .expect("inspect")
        .expect("row");
    let out: f64 = row.leases.iter().map(|l| l.amount.as_f64()).sum();
    assert!(
        row.tokens_now.as_f64() + out <= 10.0 + 1e-9,
        "tokens {} + leases {out} within the capacity",
        row.tokens_now
    );
    limiter.shutdown().await;
}
