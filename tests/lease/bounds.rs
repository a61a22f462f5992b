//! K5: a leased plan larger than a lease can hold. The lease word holds at most 2⁵⁶ − 1
//! nanotokens (about 7.2 × 10⁷ tokens); a policy may give a plan 8 × 10⁹. A call costing more
//! than a lease holds was never admitted from a lease: it waited out `max_wait` while the actor
//! leased its cost and gave back what the word could not hold, over and over (1,160 to 1,800
//! statements a second), and then the fallback decided (an `allow` fallback admitted all 20 of
//! 20 such calls against an ideal of 10). Such a call is now decided by one store statement,
//! as in direct mode.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokenlease::policy::{Accounting, FallbackMode, FallbackSettings, LeaseSettings, Plan};
use tokenlease::store::{CountedStore, Store};
use tokenlease::{DecidedBy, Limiter};

/// The largest capacity a plan may have (tokens).
const CAPACITY: u64 = 8_000_000_000;
/// Above what one lease holds (7.2 × 10⁷ tokens).
const COST: f64 = 1e8;
/// What a call waiting for a lease would wait: long beside a store call, so that a call that
/// waited cannot pass for one that did not, even on a loaded machine.
const MAX_WAIT: Duration = Duration::from_secs(5);

fn plan(mode: FallbackMode, accounting: Accounting) -> Plan {
    // One token a second: over the test's few seconds the refill is a few tokens, far below
    // one call's cost, so the ideal bucket admits exactly CAPACITY / COST = 80 calls.
    common::plan(CAPACITY, 1.0)
        .with_lease(
            LeaseSettings::default()
                .with_ttl(Duration::from_secs(10))
                .with_max_wait(MAX_WAIT)
                .with_accounting(accounting),
        )
        .with_fallback(FallbackSettings::new(mode))
}

/// K5: 100 calls of cost 10⁸ on a full bucket of 8 × 10⁹ tokens, with an `allow` and with a
/// `deny` fallback, and with strict accounting: each is decided by the store (none by the
/// fallback), promptly (in under half of `max_wait`, 5 s), with one statement a call; exactly 80
/// are admitted, as the ideal bucket would; the actor leases nothing. `try_acquire_now_with`
/// says such a call needs the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_no_lease_holds_is_decided_by_one_store_call() {
    assert!(COST > LeaseSettings::MAX_LEASE.as_nanos() as f64 / 1e9);
    let db = common::database().await;
    let runs = [
        (FallbackMode::Allow, Accounting::Relaxed),
        (FallbackMode::Deny, Accounting::Relaxed),
        (FallbackMode::Deny, Accounting::Strict),
    ];
    for (i, (mode, accounting)) in runs.into_iter().enumerate() {
        let store = Arc::new(CountedStore::new(common::store(&db, 2).await));
        // A call deadline as long as the wait: a slow machine's store call is still the store's.
        let limiter = Limiter::builder_shared(Arc::clone(&store) as Arc<dyn Store>)
            .call_deadline(MAX_WAIT)
            .build();
        let plan = plan(mode, accounting);
        let key = format!("huge:{i}");
        assert!(
            limiter
                .try_acquire_now_with(&plan, &key, COST)
                .expect("valid")
                .is_none(),
            "a call no lease holds needs the store"
        );
        let mut admitted = 0;
        for call in 0..100 {
            let started = Instant::now();
            let d = limiter
                .try_acquire_with(&plan, &key, COST)
                .await
                .expect("decision");
            let took = started.elapsed();
            assert!(
                took < MAX_WAIT / 2,
                "{mode:?} {accounting:?}: call {call} took {took:?}: it waited for a lease that cannot hold it"
            );
            assert_eq!(
                d.decided_by,
                DecidedBy::Store,
                "{mode:?} {accounting:?}: call {call}"
            );
            admitted += u32::from(d.allowed);
        }
        assert_eq!(
            admitted, 80,
            "{mode:?} {accounting:?}: the ideal bucket admits 80"
        );
        let calls = store.calls();
        assert!(
            calls <= 105,
            "{mode:?} {accounting:?}: {calls} store calls for 100 calls: about one each"
        );
        let stats = limiter.lease_stats().unwrap_or_default();
        assert_eq!(
            stats.leased, 0.0,
            "{mode:?} {accounting:?}: nothing leased: {stats:?}"
        );
        limiter.shutdown().await;
    }
}
