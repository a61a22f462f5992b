//! [`Limiter::try_acquire`]: the entry point.
//!
//! In direct mode every decision is one store call, and concurrent callers of one key share one
//! statement (see `coalesce.rs`). When the store fails or times out, the plan's fallback
//! decides, and the [`Decision`] says so.
//!
//! This file holds the [`Limiter`] itself, the state its clones share, and what reads or ends
//! that state as a whole (stats, shutdown). The limiter's other files, their roles and which
//! way they depend on each other are in DESIGN.md, "The layers".

use std::sync::Arc;
use std::sync::OnceLock;
use std::time::Duration;

use parking_lot::RwLock;

use crate::debt::OutageDebt;
pub use crate::decision::{DecidedBy, Decision};
use crate::fallback::Fallback;
use crate::lease::{LeaseStats, Leases, TableSettings};
use crate::plans::PlanRegistry;
use crate::store::Store;

mod acquire;
mod builder;
mod call;
mod coalesce;
mod cost;
mod decisions;
#[cfg(feature = "http")]
mod now;
mod policies;
mod wait;

pub use acquire::Acquire;
pub use builder::LimiterBuilder;
use coalesce::Coalescer;
#[cfg(feature = "http")]
pub(crate) use decisions::LeaseLeft;
use policies::Loaded;
pub use policies::ReloadError;
pub use wait::WaitError;

/// A rate limiter over a [`Store`]. Cheap to clone: clones share everything.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use tokenlease::Limiter;
/// use tokenlease::policy::Policies;
/// use tokenlease::store::PostgresStore;
///
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1/app").await?;
/// let policies = Policies::from_file("policies.json")?;
/// let limiter = Limiter::builder(store).policies(policies).build();
/// let decision = limiter.try_acquire("ratelimit:api:GET:/bookings/{bookingId}", 1.0).await?;
/// if !decision.allowed {
///     println!("retry in {:?}", decision.retry_after);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Limiter {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    store: Arc<dyn Store>,
    /// The policies in force ([`Limiter::reload`] swaps them).
    policies: RwLock<Option<Loaded>>,
    /// Every plan the policies have held, each once: a key's record in the lease table holds
    /// its plan's index here.
    plans: PlanRegistry,
    coalescer: Option<Arc<Coalescer>>,
    /// How long a direct-mode call waits for the store before the fallback decides.
    call_deadline: Duration,
    fallback: Fallback,
    /// The lease table and its actor, started by the first call on a leased plan.
    leases: OnceLock<Arc<Leases>>,
    table: TableSettings,
    /// Each key's line of calls waiting in [`Limiter::acquire_until`].
    waiters: wait::Waiters,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The actor gives every lease back and stops.
        if let Some(leases) = self.leases.get() {
            leases.stop();
        }
    }
}

impl Limiter {
    /// The outage debt now: what the `allow` and `local` fallbacks admitted and is not yet
    /// charged to the shared bucket, and what was charged and dropped so far (see
    /// [`LimiterBuilder::outage_debt`]).
    pub fn outage_debt(&self) -> OutageDebt {
        self.inner.fallback.debt()
    }

    /// The store the limiter decides with: the one given to the builder, as given (no wrapper
    /// of the limiter's own), for reading a bucket with [`Store::inspect`]. Taking tokens from
    /// it directly bypasses the limiter's leases, fallback and metrics.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// Counters of the lease table: tokens leased, returned, stranded and outstanding. `None`
    /// before the first call on a leased plan.
    pub fn lease_stats(&self) -> Option<LeaseStats> {
        self.inner.leases.get().map(|l| l.stats())
    }

    /// Gives every lease back to the store and stops the lease actor; waits until done. Later
    /// calls on leased plans are decided without leases (one store call each).
    pub async fn shutdown(&self) {
        if let Some(leases) = self.inner.leases.get() {
            leases.shutdown().await;
        }
    }

    /// Completes once the lease actor is idle: no statement in flight, no give-back waiting to
    /// be sent again, no refill asked for and not yet sent. Completes at once when no lease
    /// actor runs (no leased plan has been used).
    ///
    /// For tests that check the store or [`lease_stats`](Limiter::lease_stats) after leased
    /// calls, and for a graceful stop that wants the counters settled before reading them:
    /// await this instead of sleeping. New calls may make the actor busy again; under steady
    /// traffic it may not complete, so bound it with a timeout.
    pub async fn leases_idle(&self) {
        if let Some(leases) = self.inner.leases.get() {
            leases.until_idle().await;
        }
    }

    fn leases(&self) -> &Arc<Leases> {
        self.inner.leases.get_or_init(|| {
            if let Some(coalescer) = &self.inner.coalescer {
                coalescer.share_with_leases();
            }
            Leases::start(Arc::clone(&self.inner.store), self.inner.table)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::cost::lease_cost;
    use super::decisions::lease_allowed;
    use super::*;
    use crate::bucket::Tokens;
    use crate::policy::{Plan, Policies};

    /// The u64 path and the u128 path round up alike, on both sides of the boundary between them.
    #[test]
    fn lease_cost_rounds_up_to_whole_nanotokens() {
        let atto = |n: u128| lease_cost(Tokens::from_atto(n));
        assert_eq!(atto(1), 1);
        assert_eq!(atto(1_000_000_000), 1);
        assert_eq!(atto(1_000_000_001), 2);
        assert_eq!(lease_cost(Tokens::whole(1)), 1_000_000_000);
        let edge = u128::from(u64::MAX);
        for n in [edge - 1, edge, edge + 1, edge + 1_000_000_000] {
            assert_eq!(u128::from(atto(n)), n.div_ceil(1_000_000_000), "{n}");
        }
        assert_eq!(
            lease_cost(Tokens::whole(1_000_000)),
            1_000_000 * 1_000_000_000
        );
    }

    /// A lease's estimate of what is left (its own tokens plus the bucket's count at its last
    /// refill) never says more than the capacity.
    #[test]
    fn a_lease_decision_never_reports_more_than_the_capacity() {
        let plan = Plan::new(
            "p",
            crate::bucket::BucketConfig::new(
                Tokens::whole(200),
                crate::bucket::Rate::per_second(100).expect("rate"),
            )
            .expect("bucket"),
        );
        let nanos = |n: u64| n * 1_000_000_000;
        let d = lease_allowed(&plan, nanos(28), nanos(180));
        assert_eq!(d.remaining, Some(Tokens::whole(200)), "{d:?}");
        assert_eq!(d.limit, Tokens::whole(200));
        let d = lease_allowed(&plan, nanos(8), nanos(180));
        assert_eq!(d.remaining, Some(Tokens::whole(188)), "{d:?}");
    }

    /// A decision states only what its decider knows: the store says when the bucket is full
    /// again, a lease (which spends tokens granted earlier without reading the bucket) does
    /// not, and says so with `None` rather than a zero that would claim a full bucket.
    #[test]
    fn lease_decisions_do_not_claim_a_time_to_full() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let policies = Policies::from_json_str(
                r#"{"plans": {
                        "leased": {"capacity": 1000, "refill_per_second": 10, "lease": {}},
                        "direct": {"capacity": 1000, "refill_per_second": 10}},
                    "keys": [{"prefix": "d:", "plan": "direct"}],
                    "default_plan": "leased"}"#,
                None,
            )
            .expect("policy");
            let limiter = Limiter::builder(crate::store::MemoryStore::new())
                .policies(policies)
                .build();
            let d = limiter.try_acquire("d:1", 1.0).await.expect("valid");
            assert_eq!(d.decided_by, DecidedBy::Store);
            assert_eq!(d.remaining, Some(Tokens::whole(999)));
            // One token short of 1000 at 10 per second: 100 ms to full.
            assert_eq!(d.reset_after, Some(Duration::from_millis(100)));
            let mut leased = 0;
            for _ in 0..50 {
                let d = limiter.try_acquire("k", 1.0).await.expect("valid");
                assert!(d.allowed);
                if d.decided_by == DecidedBy::Lease {
                    leased += 1;
                    assert_eq!(d.reset_after, None, "{d:?}");
                    assert!(d.remaining.is_some(), "{d:?}");
                }
                // The key's first calls are store calls until the actor has seen its demand,
                // which takes time to pass (the clock is paused: this advances it).
                // sleep: pacing (paused clock), calls 1 ms apart build the key's demand.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            assert!(leased > 0, "no decision came from a lease");
        });
    }

    /// A key first spent from through its plan by name (`try_acquire_now_with`) and then
    /// through `try_acquire` gets its policy index in the lease table's record on that call,
    /// so later `try_acquire` calls find the plan there instead of matching the key's prefixes.
    #[test]
    fn try_acquire_records_the_plan_of_a_key_first_seen_by_name() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let policies = Policies::from_json_str(
                r#"{"plans": {"p": {"capacity": 1000, "refill_per_second": 1000, "lease": {}}},
                    "default_plan": "p"}"#,
                None,
            )
            .expect("policy");
            let plan = policies.default_plan().expect("plan").clone();
            let limiter = Limiter::builder(crate::store::MemoryStore::new())
                .policies(policies)
                .build();
            let d = limiter
                .try_acquire_with(&plan, "k", 1.0)
                .await
                .expect("valid");
            assert!(d.allowed);
            let leases = limiter.inner.leases.get().expect("leased");
            assert_eq!(leases.plan_index("k"), Some(crate::lease::NO_PLAN));
            let d = limiter.try_acquire("k", 1.0).await.expect("valid");
            assert!(d.allowed);
            assert_eq!(leases.plan_index("k"), Some(0));
        });
    }

    /// The limiter's outage-debt switch, on by default: the ledger's own tests are in
    /// `debt/tests.rs`, whose failing store this shares.
    #[tokio::test(start_paused = true)]
    async fn the_builder_switch() {
        use std::sync::atomic::Ordering;

        use crate::debt::tests::{Switch, plan, whole};
        use crate::policy::FallbackMode;

        let p = Arc::new(plan("p", 10, 1.0, FallbackMode::Allow));
        for on in [true, false] {
            let store = Switch::default();
            store.failing.store(true, Ordering::SeqCst);
            let mut builder = Limiter::builder(store);
            if !on {
                builder = builder.outage_debt(false);
            }
            let limiter = builder.build();
            let d = limiter.try_acquire_with(&p, "k", 2.0).await.unwrap();
            assert!(d.allowed);
            let expect = if on { whole(2) } else { Tokens::ZERO };
            assert_eq!(limiter.outage_debt().outstanding, expect, "switch {on}");
        }
    }
}
