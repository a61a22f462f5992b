//! What decides when the store cannot: allow, deny, or a local bucket per key.
//!
//! What the `allow` and `local` fallbacks admit is recorded as outage debt and charged to the
//! shared bucket once the store answers again (see `debt.rs`).
//!
//! The plan's [`FallbackMode`] is applied to one request whenever its store call fails or times
//! out. `Local` keeps an in-process bucket per key holding `1 / instances` of the plan's capacity
//! and rate, so `instances` processes deciding alone together stay near the shared limit.
//!
//! Besides the decisions (`tokenlease_fallback_decisions_total{plan, mode, outcome}`, counted by the
//! limiter), the time spent in fallback is exported as `tokenlease_fallback_active_seconds{mode}`:
//! a gauge that only grows, the total seconds during which fallback decisions of that mode kept
//! coming no more than [`ACTIVE_GAP`] apart. The fallback does not see the store come back, so an
//! episode ends at its last fallback decision (the time to the next request is not counted).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use parking_lot::Mutex;

use crate::bucket::{BucketConfig, Rate, Tokens};
use crate::debt::{ACTIVE_GAP, Debt, OutageDebt};
use crate::decision::{DecidedBy, Decision};
use crate::metrics::{FALLBACK_ACTIVE_SECONDS, PlanCounters};
use crate::policy::{FallbackMode, Plan};
use crate::store::{AcquireRequest, GiveBack, MemoryStore, Store};

/// Time in fallback, per mode (allow, deny, local), across every limiter in the process: the
/// last fallback decision and the total so far. The lock is held for a few instructions and
/// nothing awaits under it.
static ACTIVE: Active = Mutex::new([(None, Duration::ZERO); 3]);

/// Per mode: the last fallback decision and the total time in fallback.
type Active = Mutex<[(Option<Instant>, Duration); 3]>;

/// Adds the time since the previous fallback decision of `mode` (if within [`ACTIVE_GAP`]) to
/// the mode's total, and publishes it.
fn record_active(mode: FallbackMode, now: Instant) {
    let total = add_active(&ACTIVE, mode, now);
    metrics::gauge!(FALLBACK_ACTIVE_SECONDS, "mode" => crate::metrics::mode_label(mode))
        .set(total.as_secs_f64());
}

/// The bookkeeping of [`record_active`]; returns the mode's new total.
fn add_active(active: &Active, mode: FallbackMode, now: Instant) -> Duration {
    let index = match mode {
        FallbackMode::Allow => 0,
        FallbackMode::Deny => 1,
        FallbackMode::Local { .. } => 2,
    };
    let mut active = active.lock();
    let (last, total) = &mut active[index];
    if let Some(previous) = *last {
        let gap = now.saturating_duration_since(previous);
        if gap <= ACTIVE_GAP {
            *total += gap;
        }
    }
    *last = Some(std::cmp::max(now, last.unwrap_or(now)));
    *total
}

/// The most local buckets one limiter's fallback keeps (about 100 MB at most, counting the
/// hash map and the key strings). Full buckets are deleted; at the bound with none full, a new
/// key is denied (see [`MemoryStore`]'s bounded memory): evicting a bucket that is not full
/// would refill it and admit more than the key's share.
pub(crate) const FALLBACK_MAX_KEYS: usize = 100_000;

/// The local buckets of [`FallbackMode::Local`], shared by every plan of one limiter, and the
/// limiter's outage debt.
#[derive(Debug, Clone)]
pub(crate) struct Fallback {
    local: MemoryStore,
    /// The count last added to the [`FALLBACK_LOCAL_BUCKETS`](crate::metrics) gauge, which
    /// every limiter of the process adds its own change to.
    reported: Arc<AtomicUsize>,
    /// What the `allow` and `local` fallbacks admitted, charged to the store after recovery.
    debt: Debt,
}

#[cfg(test)]
impl Default for Fallback {
    /// A fallback without outage debt.
    fn default() -> Self {
        Fallback::new()
    }
}

impl Fallback {
    /// A fallback without outage debt.
    pub(crate) fn new() -> Self {
        Fallback {
            local: MemoryStore::new().with_max_keys(FALLBACK_MAX_KEYS),
            reported: Arc::new(AtomicUsize::new(0)),
            debt: Debt::default(),
        }
    }

    /// A fallback whose admissions are recorded in `debt`.
    pub(crate) fn with_debt(debt: Debt) -> Self {
        Fallback {
            debt,
            ..Fallback::new()
        }
    }

    /// [`decide`](Self::decide) at tokio's time now (tests).
    #[cfg(test)]
    pub(crate) async fn decide_now(
        &self,
        plan: &Plan,
        counters: &Arc<PlanCounters>,
        key: &str,
        cost: Tokens,
    ) -> Decision {
        self.decide(plan, counters, key, cost, crate::clock::instant())
            .await
    }

    /// The outage debt's figures now.
    pub(crate) fn debt(&self) -> OutageDebt {
        self.debt.stats()
    }

    /// Adds the change in this fallback's local buckets since the last report to the gauge.
    fn report(&self) {
        let now = self.local.stored();
        let before = self.reported.swap(now, Ordering::Relaxed);
        if now != before {
            metrics::gauge!(crate::metrics::FALLBACK_LOCAL_BUCKETS)
                .increment(now as f64 - before as f64);
        }
    }

    /// Deletes the local buckets that have refilled to full, at most once a second (one atomic
    /// load when there are none), and tells the outage debt's charging task, if it stopped
    /// after a failed round, that the store answers (one more atomic load). Called when the
    /// store has answered, so that the buckets an outage made are given back after it, not
    /// only at the next outage, and its debt is charged. No decision changes: an absent bucket
    /// is a full one.
    pub(crate) fn tidy(&self) {
        if self.local.tidy() {
            self.report();
        }
        self.debt.store_answered();
    }

    /// Decides `cost` on `key` under `plan`'s fallback mode, at `now` (the call's reading of
    /// tokio's clock); what it admits goes into the outage debt (for plans that keep it),
    /// counted on the plan's `counters`.
    pub(crate) async fn decide(
        &self,
        plan: &Plan,
        counters: &Arc<PlanCounters>,
        key: &str,
        cost: Tokens,
        now: Instant,
    ) -> Decision {
        let decision = self.decide_alone(plan, key, cost, now).await;
        self.debt.fallback_decided(now);
        if decision.allowed {
            self.debt.record(plan, counters, key, cost, now);
        }
        decision
    }

    /// Gives back what [`decide`](Self::decide) admitted of `cost` on `key` and its caller
    /// never used: the token of the local bucket (`local`) and the debt recorded for it
    /// (`allow` and `local`). Nothing to give back for `deny`.
    pub(crate) async fn give_back(&self, plan: &Plan, key: &str, cost: Tokens) {
        if let FallbackMode::Local { instances } = plan.fallback().mode {
            let give = GiveBack {
                id: GiveBack::fresh_id(key),
                key,
                bucket: local_share(plan.bucket(), instances.get()),
                amount: cost,
                lease: None,
            };
            // A memory store's give-back does not fail.
            let _ = self.local.give_back(&[give]).await;
        }
        self.debt.forgive(plan, key, cost);
    }

    /// The decision of [`decide`](Self::decide), before any debt is recorded.
    async fn decide_alone(&self, plan: &Plan, key: &str, cost: Tokens, now: Instant) -> Decision {
        record_active(plan.fallback().mode, now);
        let limit = plan.capacity();
        // Allow and deny decide without any bucket: what the shared bucket holds, and when it is
        // full, nobody here knows (`None`), rather than a made-up count such as the capacity.
        let decision = |allowed: bool, remaining: Option<Tokens>, retry_after: Duration| Decision {
            allowed,
            would_deny: false,
            remaining,
            limit,
            retry_after,
            reset_after: None,
            decided_by: DecidedBy::Fallback(plan.fallback().mode),
            store_time: None,
        };
        match plan.fallback().mode {
            FallbackMode::Allow => decision(true, None, Duration::ZERO),
            // Nothing says when the store is back: a short retry hint, not a promise.
            FallbackMode::Deny => decision(false, None, Duration::from_secs(1)),
            FallbackMode::Local { instances } => {
                let share = local_share(plan.bucket(), instances.get());
                if cost > share.capacity() {
                    return decision(false, None, Duration::from_secs(1));
                }
                let taken = self
                    .local
                    .acquire(AcquireRequest::take(key, share, cost))
                    .await;
                self.report();
                match taken {
                    Ok(a) => Decision {
                        reset_after: Some(a.reset_after),
                        ..decision(!a.granted.is_zero(), Some(a.remaining), a.retry_after)
                    },
                    // At the key bound with no full bucket to delete (the only error of a
                    // memory store): a new key is denied until buckets refill.
                    Err(_) => decision(false, None, Duration::from_secs(1)),
                }
            }
        }
    }
}

/// One instance's share of a bucket: capacity and rate divided by `instances` (at least one
/// attotoken of capacity and one nanotoken per second of rate), each limit of a bucket of
/// several.
pub(crate) fn local_share(bucket: &BucketConfig, instances: u32) -> BucketConfig {
    let n = u128::from(instances.max(1));
    let share = |limit: &BucketConfig| {
        let capacity = Tokens::from_atto((limit.capacity().as_atto() / n).max(1));
        let rate = Rate::from_nanos_per_second(
            (limit.rate().as_nanos_per_second() / instances.max(1) as u64).max(1),
        )
        .unwrap_or(limit.rate());
        (capacity, rate)
    };
    let mut limits = bucket.limits();
    let Some(first) = limits.next() else {
        return *bucket;
    };
    let (capacity, rate) = share(&first);
    let mut out = match BucketConfig::new(capacity, rate) {
        Ok(b) => b,
        Err(_) => return *bucket,
    };
    for limit in limits {
        let (capacity, rate) = share(&limit);
        out = match out.with_limit(capacity, rate) {
            Ok(b) => b,
            Err(_) => return *bucket,
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use crate::debt::tests::counters;
    use crate::policy::FallbackSettings;

    fn plan(mode: FallbackMode) -> Plan {
        let bucket = BucketConfig::new(Tokens::whole(100), Rate::from_f64(50.0).unwrap()).unwrap();
        Plan::new("p", bucket).with_fallback(FallbackSettings::new(mode))
    }

    #[test]
    fn local_share_divides_capacity_and_rate() {
        let bucket = BucketConfig::new(Tokens::whole(100), Rate::from_f64(50.0).unwrap()).unwrap();
        let share = local_share(&bucket, 2);
        assert_eq!(share.capacity(), Tokens::whole(50));
        assert_eq!(share.rate(), Rate::from_f64(25.0).unwrap());
        assert_eq!(local_share(&bucket, 1), bucket);
    }

    /// Local mode with N = 2 admits C/N at once, then about r/N per second.
    #[tokio::test]
    async fn local_mode_admits_one_share() {
        let fallback = Fallback::default();
        let plan = plan(FallbackMode::Local {
            instances: NonZeroU32::new(2).unwrap(),
        });
        let one = Tokens::whole(1);
        let mut admitted = 0;
        for _ in 0..200 {
            let d = fallback.decide_now(&plan, &counters(&plan), "k", one).await;
            assert_eq!(d.decided_by, DecidedBy::Fallback(plan.fallback().mode));
            admitted += u32::from(d.allowed);
        }
        // 50 at once; a slow test machine may add a token or two of refill at 25/s.
        assert!((50..=53).contains(&admitted), "admitted {admitted}");
        let d = fallback
            .decide_now(&plan, &counters(&plan), "k", Tokens::whole(51))
            .await;
        assert!(!d.allowed, "a cost above the local share is denied");
    }

    #[tokio::test]
    async fn allow_and_deny() {
        let fallback = Fallback::default();
        let one = Tokens::whole(1);
        let allow = fallback
            .decide_now(
                &plan(FallbackMode::Allow),
                &counters(&plan(FallbackMode::Allow)),
                "k",
                one,
            )
            .await;
        assert!(allow.allowed);
        let deny = fallback
            .decide_now(
                &plan(FallbackMode::Deny),
                &counters(&plan(FallbackMode::Deny)),
                "k",
                one,
            )
            .await;
        assert!(!deny.allowed);
        assert_eq!(deny.retry_after, Duration::from_secs(1));
    }

    /// Allow and deny decide without a bucket: they claim no remaining tokens (the allow
    /// fallback once reported the full capacity) and no time to full.
    #[tokio::test]
    async fn allow_and_deny_claim_no_bucket_state() {
        let fallback = Fallback::default();
        let one = Tokens::whole(1);
        for mode in [FallbackMode::Allow, FallbackMode::Deny] {
            let d = fallback
                .decide_now(&plan(mode), &counters(&plan(mode)), "k", one)
                .await;
            assert_eq!(d.remaining, None, "{mode:?}");
            assert_eq!(d.reset_after, None, "{mode:?}");
            assert_eq!(d.limit, Tokens::whole(100), "{mode:?}");
        }
        // The local fallback has a bucket of its own: 50 of this instance's share, 49 left,
        // full again after 1 token at 25/s.
        let local = plan(FallbackMode::Local {
            instances: NonZeroU32::new(2).unwrap(),
        });
        let d = fallback
            .decide_now(&local, &counters(&local), "k", one)
            .await;
        assert_eq!(d.remaining, Some(Tokens::whole(49)));
        assert_eq!(d.reset_after, Some(Duration::from_millis(40)));
    }

    /// The database is down and a million distinct ids arrive, faster than their local buckets
    /// refill: at most `FALLBACK_MAX_KEYS` buckets are kept (ids beyond them are denied, never
    /// admitted by evicting a bucket that is not full), and once the buckets have refilled the
    /// next calls delete them.
    #[tokio::test(start_paused = true)]
    async fn local_buckets_stay_bounded_under_a_flood_of_ids() {
        let fallback = Fallback::default();
        let plan = plan(FallbackMode::Local {
            instances: NonZeroU32::new(2).unwrap(),
        });
        let one = Tokens::whole(1);
        let mut admitted = 0;
        for i in 0..1_000_000 {
            let d = fallback
                .decide_now(&plan, &counters(&plan), &format!("id:{i}"), one)
                .await;
            admitted += usize::from(d.allowed);
            if i % 10_000 == 0 {
                assert!(fallback.local.len() <= FALLBACK_MAX_KEYS);
            }
        }
        assert_eq!(admitted, FALLBACK_MAX_KEYS);
        assert_eq!(fallback.local.len(), FALLBACK_MAX_KEYS);
        // A stored id still decides by its bucket: 49 of its 50 tokens left.
        let d = fallback
            .decide_now(&plan, &counters(&plan), "id:0", one)
            .await;
        assert!(d.allowed);
        assert_eq!(d.remaining, Some(Tokens::whole(48)));

        // A share of 50 refilling at 25/s is full again after 2 s: the next call deletes them.
        tokio::time::advance(Duration::from_secs(3)).await;
        let d = fallback
            .decide_now(&plan, &counters(&plan), "later", one)
            .await;
        assert!(d.allowed);
        assert_eq!(fallback.local.len(), 1);
    }

    #[test]
    fn active_time_adds_gaps_within_an_episode() {
        let active: Active = Mutex::new([(None, Duration::ZERO); 3]);
        let t0 = crate::clock::instant();
        let at = |ms| add_active(&active, FallbackMode::Deny, t0 + Duration::from_millis(ms));
        at(0);
        at(300);
        assert_eq!(at(700), Duration::from_millis(700));
        // A gap longer than ACTIVE_GAP starts a new episode: not counted.
        at(2_700);
        assert_eq!(at(2_800), Duration::from_millis(800));
        // Other modes keep their own time.
        assert_eq!(add_active(&active, FallbackMode::Allow, t0), Duration::ZERO);
    }

    /// The fallback over an outage-debt ledger: the ledger's own tests are in `debt/tests.rs`,
    /// whose failing store and helpers these share.
    mod with_debt {
        use std::sync::Arc;
        use std::sync::atomic::Ordering;
        use std::time::Duration;

        use crate::debt::OutageDebt;
        use crate::debt::tests::{LOOK, Switch, counters, ledger, local, plan, settings, whole};
        use crate::fallback::Fallback;
        use crate::policy::{FallbackMode, FallbackSettings, Plan};
        use crate::tests::eventually;

        /// While the limiter's callers keep falling back the task sends no probe (the store is still
        /// failing them); once they stop, it probes on its own, and charges when the store answers.
        #[tokio::test(start_paused = true)]
        async fn no_probe_while_callers_fall_back() {
            let store = Arc::new(Switch::default());
            store.failing.store(true, Ordering::SeqCst);
            let fallback = Fallback::with_debt(ledger(&store, settings()));
            let p = plan("p", 100, 1.0, FallbackMode::Allow);
            for _ in 0..100 {
                assert!(
                    fallback
                        .decide_now(&p, &counters(&p), "k", whole(1))
                        .await
                        .allowed
                );
                // sleep: pacing (paused clock), a fallback decision every 100 ms for 10 s.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            assert_eq!(store.calls(), 0, "no probe in 10 s of fallback decisions");
            // The callers stop; the store is back, and nobody says so: a probe finds it.
            store.failing.store(false, Ordering::SeqCst);
            eventually(
                LOOK,
                Duration::from_secs(6),
                "the debt charged after a probe",
                async || fallback.debt().keys == 0,
            )
            .await;
            assert_eq!(store.calls(), 1);
            assert_eq!(fallback.debt().charged, whole(100));
        }

        /// Through the fallback: `allow` and `local` admissions are recorded, a `local` denial and a
        /// `deny` fallback are not, and a plan with `outage_debt` off records nothing.
        #[tokio::test(start_paused = true)]
        async fn the_fallback_records_what_it_admits() {
            let store = Arc::new(Switch::default());
            store.failing.store(true, Ordering::SeqCst);
            let fallback = Fallback::with_debt(ledger(&store, settings()));
            let one = whole(1);
            let allow = plan("allow", 100, 1.0, FallbackMode::Allow);
            for _ in 0..3 {
                assert!(
                    fallback
                        .decide_now(&allow, &counters(&allow), "a", one)
                        .await
                        .allowed
                );
            }
            assert_eq!(fallback.debt().outstanding, whole(3));
            // A local share of 10 / 2 = 5: five admitted, the rest denied, only the five recorded.
            let local = plan("local", 10, 1.0, local(2));
            let mut admitted = 0;
            for _ in 0..8 {
                admitted += u64::from(
                    fallback
                        .decide_now(&local, &counters(&local), "l", one)
                        .await
                        .allowed,
                );
            }
            assert_eq!(admitted, 5);
            assert_eq!(fallback.debt().outstanding, whole(8));
            let deny = plan("deny", 10, 1.0, FallbackMode::Deny);
            assert!(
                !fallback
                    .decide_now(&deny, &counters(&deny), "d", one)
                    .await
                    .allowed
            );
            let off = Plan::new("off", *allow.bucket())
                .with_fallback(FallbackSettings::new(FallbackMode::Allow).with_outage_debt(false));
            assert!(
                fallback
                    .decide_now(&off, &counters(&off), "o", one)
                    .await
                    .allowed
            );
            assert_eq!(fallback.debt().outstanding, whole(8));
            assert_eq!(fallback.debt().keys, 2);
            // A fallback built without debt (the limiter's switch off) records nothing.
            let plain = Fallback::default();
            assert!(
                plain
                    .decide_now(&allow, &counters(&allow), "a", one)
                    .await
                    .allowed
            );
            assert_eq!(plain.debt(), OutageDebt::default());
        }
    }
}
