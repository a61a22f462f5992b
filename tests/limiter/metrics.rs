//! The metrics of `src/metrics.rs`, asserted with `metrics_util`'s `DebuggingRecorder`.
//!
//! Each test installs a recorder with `metrics::with_local_recorder` around a current-thread
//! runtime's `block_on`: the limiter's lease actor is spawned on that runtime, so it runs on the
//! same thread and records into the same recorder. A snapshot swaps every counter to zero and
//! drains every histogram, so the tests snapshot between phases and check each phase's deltas.
//! Gauges and the `absolute` token counters are set by the actor on its ticks and at shutdown.
//! The phases wait for the actor's ticks (`settle`), so the file runs in the nextest `serial`
//! group: one failure was seen (once in about 25 runs) with it running beside three other test
//! binaries on 2 cores.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::time::Duration;

use async_trait::async_trait;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::{CompositeKey, MetricKind};
use tokenlease::bucket::{BucketConfig, Rate, Tokens};
use tokenlease::metrics as m;
use tokenlease::policy::{FallbackMode, FallbackSettings, LeaseSettings, Plan};
use tokenlease::store::{
    AcquireRequest, Acquired, BucketRow, GiveBack, MemoryStore, Store, StoreError, TimeoutKind,
};
use tokenlease::{DecidedBy, Limiter};

/// A bucket of `capacity` whole tokens refilling at `per_second` tokens a second.
fn bucket(capacity: u64, per_second: f64) -> BucketConfig {
    BucketConfig::new(
        Tokens::whole(capacity),
        Rate::from_f64(per_second).expect("rate"),
    )
    .expect("bucket")
}

/// A leased plan whose leases outlive the test (no expiry), refilled every 100 ms of demand.
fn leased_plan(name: &str, capacity: u64, per_second: f64) -> Plan {
    Plan::new(name, bucket(capacity, per_second)).with_lease(
        LeaseSettings::default()
            .with_ttl(Duration::from_secs(60))
            .with_max_fraction(1.0)
            .with_low_water(0.5)
            .with_refresh(Duration::from_millis(100))
            .with_max_wait(Duration::from_millis(500)),
    )
}

/// Label (key, value) pairs, sorted.
type Labels = Vec<(String, String)>;

/// One snapshot, by metric kind, name and sorted labels.
#[derive(Debug, Default)]
struct Seen {
    values: HashMap<(MetricKind, String, Labels), DebugValue>,
}

impl Seen {
    fn take(snapshotter: &Snapshotter) -> Seen {
        let mut values = HashMap::new();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let key: CompositeKey = key;
            let (kind, key) = key.into_parts();
            let mut labels: Labels = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            values.insert((kind, key.name().to_owned(), labels), value);
        }
        Seen { values }
    }

    fn get(&self, kind: MetricKind, name: &str, labels: &[(&str, &str)]) -> Option<&DebugValue> {
        let mut labels: Labels = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        labels.sort();
        self.values.get(&(kind, name.to_owned(), labels))
    }

    /// A counter's value since the last snapshot; 0 when it was never touched.
    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        match self.get(MetricKind::Counter, name, labels) {
            Some(DebugValue::Counter(n)) => *n,
            None => 0,
            Some(other) => panic!("{name} is not a counter: {other:?}"),
        }
    }

    /// A gauge's value; `None` when it was never set.
    fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        match self.get(MetricKind::Gauge, name, labels) {
            Some(DebugValue::Gauge(v)) => Some(v.0),
            None => None,
            Some(other) => panic!("{name} is not a gauge: {other:?}"),
        }
    }

    /// A histogram's samples since the last snapshot.
    fn histogram(&self, name: &str) -> Vec<f64> {
        match self.get(MetricKind::Histogram, name, &[]) {
            Some(DebugValue::Histogram(v)) => v.iter().map(|x| x.0).collect(),
            None => Vec::new(),
            Some(other) => panic!("{name} is not a histogram: {other:?}"),
        }
    }

    /// The sum of a counter over every label set.
    fn counter_total(&self, name: &str) -> u64 {
        self.values
            .iter()
            .filter(|((kind, n, _), _)| *kind == MetricKind::Counter && n == name)
            .map(|(_, v)| match v {
                DebugValue::Counter(n) => *n,
                _ => 0,
            })
            .sum()
    }

    /// Every label set a counter moved with since the last snapshot.
    fn nonzero_label_sets(&self, name: &str) -> Vec<Labels> {
        let mut sets: Vec<_> = self
            .values
            .iter()
            .filter(|((_, n, _), v)| n == name && !matches!(v, DebugValue::Counter(0)))
            .map(|((_, _, labels), _)| labels.clone())
            .collect();
        sets.sort();
        sets
    }

    /// Every label set a counter was recorded with.
    fn label_sets(&self, name: &str) -> Vec<Labels> {
        let mut sets: Vec<_> = self
            .values
            .keys()
            .filter(|(_, n, _)| n == name)
            .map(|(_, _, labels)| labels.clone())
            .collect();
        sets.sort();
        sets
    }
}

/// Runs `body` on a current-thread runtime with a fresh debugging recorder installed for this
/// thread, and returns the recorder's snapshotter (for a final snapshot) with the body's value.
/// The runtime's clock is paused (every store here is in process), so the lease actor's ticks
/// and the refills they send happen at exact instants of tokio's clock, not of the machine's.
fn recorded<T>(body: impl AsyncFnOnce(&Snapshotter) -> T) -> (Snapshotter, T) {
    // Anything this thread batched before belongs to no test.
    tokenlease::metrics::flush_thread();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime");
    let out = metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let out = body(&snapshotter).await;
            tokenlease::metrics::flush_thread();
            out
        })
    });
    (snapshotter, out)
}

/// Awaits `limiter`'s lease actor idle (every refill asked for has been answered, its counters
/// published), then lets two of its ticks pass on the paused clock (5 ms each in these tests):
/// the gauges' pass falls due a tick after the actor's last work, so they were published after
/// the answers too.
async fn settle(limiter: &Limiter) {
    crate::common::actor_idle(limiter, Duration::from_secs(5)).await;
    // sleep: paused clock, the gauges' pass is due a tick after the actor's last work.
    tokio::time::sleep(Duration::from_millis(10)).await;
}

#[test]
fn leased_and_direct_decisions_store_calls_and_lease_gauges() {
    let store_calls_seen = std::cell::Cell::new(0u64);
    let (snapshotter, stats) = recorded(async |snapshotter: &Snapshotter| {
        let limiter = Limiter::builder(MemoryStore::new())
            .lease_tick(Duration::from_millis(5))
            .build();
        let hot = leased_plan("hot", 1_000_000, 1_000.0);

        // Phase 1, warm-up: leased calls until the key holds a lease of at least 500 tokens.
        // Which of these waited for a refill and which were answered from the lease depends on
        // timing, so this phase only checks the store-call bookkeeping.
        let mut warm_calls = 0u64;
        while limiter.lease_stats().map_or(0.0, |s| s.outstanding) < 500.0 {
            warm_calls += 1;
            assert!(
                warm_calls < 100_000,
                "no lease of 500 tokens after 100,000 calls"
            );
            let d = limiter
                .try_acquire_with(&hot, "hot", 1.0)
                .await
                .expect("decision");
            // The key's first calls are store calls (a new key is sparse until the actor has
            // sized it a lease), the rest lease decisions. A store call that was in flight when
            // the first lease took the bucket (leases here may take all of it) finds it empty.
            assert!(
                matches!(
                    (d.allowed, d.decided_by),
                    (true, DecidedBy::Lease) | (_, DecidedBy::Store)
                ),
                "{d:?}"
            );
            if warm_calls.is_multiple_of(64) {
                // sleep: pacing (paused clock). Time passes: the actor measures the key's
                // demand over it, and sizes its lease from that.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        settle(&limiter).await;
        tokenlease::metrics::flush_thread();
        let warm = Seen::take(snapshotter);
        let stats = limiter.lease_stats().expect("lease stats");
        assert!(
            warm.counter(m::DB_CALLS, &[("kind", "lease")]) >= 1,
            "the warm-up refilled the lease"
        );
        assert_eq!(
            warm.counter(m::DB_CALLS, &[("kind", "lease")])
                + warm.counter(m::DB_CALLS, &[("kind", "return")]),
            stats.store_calls,
            "db_calls{{lease, return}} count exactly the actor's store calls"
        );
        // The key's calls while it was sparse were store calls: one `take` each at most (the
        // calls of one key that wait together share one).
        let by_store = ["allowed", "denied"]
            .into_iter()
            .map(|outcome| {
                warm.counter(
                    m::DECISIONS,
                    &[
                        ("plan", "hot"),
                        ("outcome", outcome),
                        ("decided_by", "store"),
                    ],
                )
            })
            .sum::<u64>();
        let takes = warm.counter(m::DB_CALLS, &[("kind", "take")]);
        assert!(
            takes <= by_store,
            "{takes} takes for {by_store} store decisions"
        );
        assert_eq!(
            warm.histogram(m::REFILL_SECONDS).len() as u64,
            warm.counter(m::DB_CALLS, &[("kind", "lease")]),
            "one refill latency sample per refill statement"
        );
        assert!(
            warm.histogram(m::REFILL_SECONDS)
                .iter()
                .all(|s| (0.0..1.0).contains(s)),
            "refill latencies are seconds, and an in-memory refill takes well under one"
        );
        // Published on the actor's last tick, after its last refill.
        assert_eq!(
            warm.gauge(m::OUTSTANDING, &[]),
            Some(stats.outstanding),
            "outstanding gauge"
        );
        assert_eq!(
            warm.gauge(m::TABLE_KEYS, &[]),
            Some(1.0),
            "one key in the table"
        );
        assert_eq!(
            warm.counter(m::TOKENS_LEASED, &[]),
            stats.leased as u64,
            "tokens leased"
        );
        assert_eq!(
            warm.counter(m::TOKENS_RETURNED, &[]),
            0,
            "nothing returned yet"
        );
        assert_eq!(
            warm.counter(m::DB_CALLS_SAVED, &[]),
            warm.counter(
                m::DECISIONS,
                &[
                    ("plan", "hot"),
                    ("outcome", "allowed"),
                    ("decided_by", "lease")
                ]
            ),
            "every lease admission on the fast path is a saved store call"
        );
        // At most one decision per call (the calls that waited for a refill are not counted:
        // see `every_lease_admission_is_counted_as_a_decision`).
        assert!(
            warm.counter(
                m::DECISIONS,
                &[
                    ("plan", "hot"),
                    ("outcome", "allowed"),
                    ("decided_by", "lease")
                ]
            ) <= warm_calls
        );
        store_calls_seen.set(stats.store_calls);

        // Phase 2, the fast path alone: 300 calls on the live lease, no await in between (so
        // the actor cannot run). Every one is allowed from the lease: 300 decisions, 300 store
        // calls saved, no store call.
        for _ in 0..300 {
            let d = limiter
                .try_acquire_now_with(&hot, "hot", 1.0)
                .expect("valid")
                .expect("answered from the live lease");
            assert!(d.allowed && d.decided_by == DecidedBy::Lease);
        }
        tokenlease::metrics::flush_thread();
        let fast = Seen::take(snapshotter);
        assert_eq!(
            fast.counter(
                m::DECISIONS,
                &[
                    ("plan", "hot"),
                    ("outcome", "allowed"),
                    ("decided_by", "lease")
                ]
            ),
            300
        );
        assert_eq!(fast.counter(m::DB_CALLS_SAVED, &[]), 300);
        assert_eq!(
            fast.counter_total(m::DB_CALLS),
            0,
            "the fast path makes no store call"
        );
        // Every series of the plan exists (registered at zero); only one moved.
        assert_eq!(fast.label_sets(m::DECISIONS).len(), 6);
        assert_eq!(
            fast.nonzero_label_sets(m::DECISIONS),
            vec![vec![
                ("decided_by".to_owned(), "lease".to_owned()),
                ("outcome".to_owned(), "allowed".to_owned()),
                ("plan".to_owned(), "hot".to_owned()),
            ]]
        );

        // Phase 3, direct mode: a 5-token bucket, 8 calls: 5 allowed and 3 denied by the
        // store, one `take` call each.
        let direct = Plan::new("direct", bucket(5, 0.001));
        let mut allowed = 0;
        for _ in 0..8 {
            let d = limiter
                .try_acquire_with(&direct, "direct", 1.0)
                .await
                .expect("decision");
            assert_eq!(d.decided_by, DecidedBy::Store);
            allowed += u64::from(d.allowed);
        }
        assert_eq!(allowed, 5);
        // Phase 4, a new leased key whose bucket runs dry: 3 tokens, next one in 1,000 s. Its
        // calls are store calls (a new key is sparse, and no time passes here for the actor to
        // see demand). The store's "empty" is remembered in the slot: the calls after it are
        // denied by the lease.
        let scarce = leased_plan("scarce", 3, 0.001);
        let mut denied_by_lease = 0;
        let mut admitted_scarce = 0;
        let mut scarce_by_store = 0;
        for _ in 0..10 {
            let d = limiter
                .try_acquire_with(&scarce, "scarce", 1.0)
                .await
                .expect("decision");
            match (d.allowed, d.decided_by) {
                (true, DecidedBy::Lease | DecidedBy::Store) => admitted_scarce += 1,
                (false, DecidedBy::Lease) => denied_by_lease += 1,
                (false, DecidedBy::Store) => {}
                _ => panic!("{d:?}"),
            }
            scarce_by_store += u64::from(d.decided_by == DecidedBy::Store);
        }
        assert_eq!(admitted_scarce, 3, "the whole bucket and nothing more");
        assert!(
            denied_by_lease >= 6,
            "one store denial, then the slot's: {denied_by_lease} of 7 denied by the lease"
        );
        settle(&limiter).await;
        tokenlease::metrics::flush_thread();
        let mixed = Seen::take(snapshotter);
        let stats = limiter.lease_stats().expect("lease stats");
        assert_eq!(
            mixed.counter(m::DB_CALLS, &[("kind", "take")]),
            8 + scarce_by_store
        );
        assert_eq!(
            mixed.counter(
                m::DECISIONS,
                &[
                    ("plan", "direct"),
                    ("outcome", "allowed"),
                    ("decided_by", "store")
                ]
            ),
            5
        );
        assert_eq!(
            mixed.counter(
                m::DECISIONS,
                &[
                    ("plan", "direct"),
                    ("outcome", "denied"),
                    ("decided_by", "store")
                ]
            ),
            3
        );
        assert_eq!(
            mixed.counter(
                m::DECISIONS,
                &[
                    ("plan", "scarce"),
                    ("outcome", "denied"),
                    ("decided_by", "lease")
                ]
            ),
            denied_by_lease,
            "lease denials"
        );
        assert_eq!(
            mixed.counter(m::DB_CALLS, &[("kind", "lease")])
                + mixed.counter(m::DB_CALLS, &[("kind", "return")]),
            stats.store_calls - store_calls_seen.get(),
        );
        assert_eq!(
            mixed.histogram(m::REFILL_SECONDS).len() as u64,
            mixed.counter(m::DB_CALLS, &[("kind", "lease")])
        );
        assert_eq!(mixed.gauge(m::TABLE_KEYS, &[]), Some(2.0), "hot and scarce");
        assert_eq!(mixed.gauge(m::OUTSTANDING, &[]), Some(stats.outstanding));
        // Each key's largest lease: the whole capacity (max_fraction 1).
        assert_eq!(
            mixed.gauge(m::OUTSTANDING_BOUND, &[]),
            Some(stats.outstanding_bound)
        );
        assert_eq!(
            stats.outstanding_bound, 1_000_003.0,
            "hot's 1,000,000 and scarce's 3"
        );
        assert!(stats.outstanding <= stats.outstanding_bound, "{stats:?}");
        assert_eq!(mixed.counter(m::TOKENS_LEASED, &[]), stats.leased as u64);
        assert_eq!(mixed.counter_total(m::FALLBACK_DECISIONS), 0);
        assert_eq!(mixed.counter_total(m::DB_ERRORS), 0);
        store_calls_seen.set(stats.store_calls);

        // Phase 5, shutdown: every lease goes back, the gauges drop to zero and the token
        // counters are final.
        limiter.shutdown().await;
        let stats = limiter.lease_stats().expect("lease stats");
        assert!(stats.returned > 0.0, "the hot lease had tokens left");
        assert_eq!(stats.outstanding, 0.0);
        assert_eq!(stats.stranded, 0.0);
        stats
    });
    let last = Seen::take(&snapshotter);
    assert!(
        last.counter(m::DB_CALLS, &[("kind", "return")]) >= 1,
        "the give-back"
    );
    assert_eq!(
        last.counter(m::DB_CALLS, &[("kind", "lease")])
            + last.counter(m::DB_CALLS, &[("kind", "return")]),
        stats.store_calls - store_calls_seen.get(),
    );
    assert_eq!(last.counter(m::TOKENS_LEASED, &[]), stats.leased as u64);
    assert_eq!(last.counter(m::TOKENS_RETURNED, &[]), stats.returned as u64);
    assert!(last.counter(m::TOKENS_RETURNED, &[]) > 0);
    assert_eq!(last.counter(m::TOKENS_STRANDED, &[]), 0);
    assert_eq!(last.gauge(m::OUTSTANDING, &[]), Some(0.0));
    assert_eq!(last.gauge(m::TABLE_KEYS, &[]), Some(0.0));
}

/// A store that fails every call, as a store behind a dead server does.
#[derive(Debug, Default)]
struct FailingStore;

fn failure() -> StoreError {
    StoreError::Timeout {
        kind: TimeoutKind::Call,
        after: Duration::from_millis(50),
    }
}

#[async_trait]
impl Store for FailingStore {
    async fn acquire(&self, _: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        Err(failure())
    }

    async fn give_back(&self, _: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        Err(failure())
    }

    async fn delete_idle(&self, _: u32) -> Result<u64, StoreError> {
        Err(failure())
    }

    async fn inspect(&self, _: &str) -> Result<Option<BucketRow>, StoreError> {
        Err(failure())
    }
}

/// A memory store that fails while `down` is set.
#[derive(Debug, Default)]
struct Toggle {
    inner: MemoryStore,
    down: std::sync::atomic::AtomicBool,
}

impl Toggle {
    fn check(&self) -> Result<(), StoreError> {
        if self.down.load(std::sync::atomic::Ordering::SeqCst) {
            Err(failure())
        } else {
            Ok(())
        }
    }
}

#[async_trait]
impl Store for Toggle {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        self.check()?;
        self.inner.acquire(request).await
    }

    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        self.check()?;
        self.inner.acquire_many(requests).await
    }

    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        self.check()?;
        self.inner.give_back(returns).await
    }

    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        self.check()?;
        self.inner.delete_idle(limit).await
    }

    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        self.check()?;
        self.inner.inspect(key).await
    }
}

/// The outage-debt series of every plan exist at zero once a limiter is built with the
/// policies; what the allow fallback admits raises the plan's gauge, and once the store answers
/// again the charge moves it to the charged counter.
#[test]
fn outage_debt_series_from_the_start_and_through_an_outage() {
    let (snapshotter, ()) = recorded(async |snapshotter: &Snapshotter| {
        let policies = tokenlease::policy::Policies::from_json_str(
            r#"{"plans": {
                    "open": {"capacity": 10, "refill_per_second": 1, "fallback": {"mode": "allow"}},
                    "closed": {"capacity": 5, "refill_per_second": 1, "fallback": {"mode": "deny"}}}}"#,
            None,
        )
        .expect("policies");
        let open = policies.plan("open").expect("plan").clone();
        let store = std::sync::Arc::new(Toggle::default());
        let limiter = Limiter::builder_shared(store.clone())
            .policies(policies)
            .build();
        let seen = Seen::take(snapshotter);
        for plan in ["open", "closed"] {
            let labels = [("plan", plan)];
            assert_eq!(seen.gauge(m::OUTAGE_DEBT, &labels), Some(0.0), "{plan}");
            for counter in [m::OUTAGE_DEBT_CHARGED, m::OUTAGE_DEBT_DROPPED] {
                assert!(
                    seen.get(MetricKind::Counter, counter, &labels).is_some(),
                    "{counter} {plan} registered at build"
                );
            }
        }
        store.down.store(true, std::sync::atomic::Ordering::SeqCst);
        for _ in 0..3 {
            let d = limiter
                .try_acquire_with(&open, "k", 1.0)
                .await
                .expect("valid");
            assert!(d.allowed && matches!(d.decided_by, DecidedBy::Fallback(_)));
        }
        let seen = Seen::take(snapshotter);
        assert_eq!(seen.gauge(m::OUTAGE_DEBT, &[("plan", "open")]), Some(3.0));
        store.down.store(false, std::sync::atomic::Ordering::SeqCst);
        let d = limiter
            .try_acquire_with(&open, "k", 1.0)
            .await
            .expect("valid");
        assert_eq!(d.decided_by, DecidedBy::Store);
        let _ = crate::common::poll_until(
            Duration::from_millis(10),
            Duration::from_secs(1),
            async || limiter.outage_debt().keys == 0,
        )
        .await;
        assert_eq!(limiter.outage_debt().charged, Tokens::whole(3));
    });
    let seen = Seen::take(&snapshotter);
    // This recorder's snapshots reset gauges as well as counters: what is seen is the change
    // since the snapshot that read 3, all of it charged.
    assert_eq!(seen.gauge(m::OUTAGE_DEBT, &[("plan", "open")]), Some(-3.0));
    assert_eq!(seen.counter(m::OUTAGE_DEBT_CHARGED, &[("plan", "open")]), 3);
    assert_eq!(seen.counter(m::OUTAGE_DEBT_DROPPED, &[("plan", "open")]), 0);
    assert_eq!(
        seen.counter(m::DB_CALLS, &[("kind", "debt")]),
        1,
        "one charging call for the whole debt"
    );
}

/// With a failing store, each fallback mode decides and is counted by mode and outcome, in
/// direct mode (one failed `take` per call) and in leased mode (one failed refill, then the
/// slot sends callers straight to the fallback for a while).
/// `tokenlease_fallback_decisions_total` carries the plan, like `tokenlease_decisions_total`:
/// both of each plan's series (its fallback's mode, each outcome) exist at zero once a limiter
/// is built with the policies, before any decision, and no other mode appears.
#[test]
fn fallback_decisions_by_plan_exist_from_the_start() {
    let (snapshotter, ()) = recorded(async |_: &Snapshotter| {
        let policies = tokenlease::policy::Policies::from_json_str(
            r#"{"plans": {
                    "open": {"capacity": 5, "refill_per_second": 1, "fallback": {"mode": "allow"}},
                    "closed": {"capacity": 5, "refill_per_second": 1, "fallback": {"mode": "deny"}}}}"#,
            None,
        )
        .expect("policies");
        let _limiter = Limiter::builder(FailingStore).policies(policies).build();
    });
    let seen = Seen::take(&snapshotter);
    for (plan, mode) in [("open", "allow"), ("closed", "deny")] {
        for outcome in ["allowed", "denied"] {
            let labels = [("plan", plan), ("mode", mode), ("outcome", outcome)];
            assert!(
                seen.get(MetricKind::Counter, m::FALLBACK_DECISIONS, &labels)
                    .is_some(),
                "{labels:?} registered at build"
            );
            assert_eq!(seen.counter(m::FALLBACK_DECISIONS, &labels), 0);
        }
    }
    let series = seen
        .values
        .keys()
        .filter(|(_, name, _)| name == m::FALLBACK_DECISIONS)
        .count();
    assert_eq!(series, 4, "two per plan, for its own mode only");
}

#[test]
fn fallback_decisions_by_mode_and_outcome() {
    let local = FallbackMode::Local {
        instances: NonZeroU32::new(1).expect("one"),
    };
    // (mode, its label, what 4 calls on a 2-token bucket give: allowed, denied)
    let modes = [
        (FallbackMode::Allow, "allow", 4, 0),
        (FallbackMode::Deny, "deny", 0, 4),
        (local, "local", 2, 2),
    ];
    for leased in [false, true] {
        for (mode, label, want_allowed, want_denied) in modes {
            let (snapshotter, ()) = recorded(async |_: &Snapshotter| {
                let limiter = Limiter::builder(FailingStore)
                    .lease_tick(Duration::from_millis(5))
                    .build();
                let base = if leased {
                    leased_plan(label, 2, 0.001)
                } else {
                    Plan::new(label, bucket(2, 0.001))
                };
                let plan = base.with_fallback(FallbackSettings::new(mode));
                for _ in 0..4 {
                    let d = limiter
                        .try_acquire_with(&plan, "k", 1.0)
                        .await
                        .expect("a decision, not an error");
                    assert_eq!(d.decided_by, DecidedBy::Fallback(mode), "{d:?}");
                }
            });
            let seen = Seen::take(&snapshotter);
            let what = format!("{label} fallback, leased = {leased}");
            // The plan is named after its mode: the label says which plan fell back.
            let by_outcome = |outcome| {
                seen.counter(
                    m::FALLBACK_DECISIONS,
                    &[("plan", label), ("mode", label), ("outcome", outcome)],
                )
            };
            assert_eq!(by_outcome("allowed"), want_allowed, "{what}: allowed");
            assert_eq!(by_outcome("denied"), want_denied, "{what}: denied");
            assert_eq!(
                seen.counter_total(m::FALLBACK_DECISIONS),
                4,
                "{what}: only this mode"
            );
            assert_eq!(
                seen.counter(
                    m::DECISIONS,
                    &[
                        ("plan", label),
                        ("outcome", "allowed"),
                        ("decided_by", "fallback")
                    ]
                ),
                want_allowed,
                "{what}"
            );
            assert_eq!(
                seen.counter(
                    m::DECISIONS,
                    &[
                        ("plan", label),
                        ("outcome", "denied"),
                        ("decided_by", "fallback")
                    ]
                ),
                want_denied,
                "{what}"
            );
            if leased {
                // The first call's refill fails; the slot then sends callers to the fallback
                // for 100 ms without asking the store again.
                assert_eq!(seen.counter(m::DB_CALLS, &[("kind", "lease")]), 1, "{what}");
                assert_eq!(
                    seen.counter(m::DB_ERRORS, &[("kind", "lease")]),
                    1,
                    "{what}"
                );
                assert_eq!(seen.counter(m::DB_CALLS, &[("kind", "take")]), 0, "{what}");
            } else {
                assert_eq!(seen.counter(m::DB_CALLS, &[("kind", "take")]), 4, "{what}");
                assert_eq!(seen.counter(m::DB_ERRORS, &[("kind", "take")]), 4, "{what}");
            }
        }
    }
}

/// A lease admission made after waiting for a refill counts as a decision, once, as one made
/// on the first poll does: the first call on a key, and a call that found its lease empty
/// (`Leases::wait` counts what it admits, `Leases::try_take` what it admits at once).
#[test]
fn every_lease_admission_is_counted_as_a_decision() {
    let (snapshotter, calls) = recorded(async |_: &Snapshotter| {
        let limiter = Limiter::builder(MemoryStore::new())
            .lease_tick(Duration::from_millis(5))
            .build();
        let plan = leased_plan("p", 1_000, 100.0);
        // A new key, the actor idle: the call waits for the key's first refill, then spends
        // from it.
        let d = limiter
            .try_acquire_with(&plan, "new-key", 1.0)
            .await
            .expect("decision");
        assert!(d.allowed && d.decided_by == DecidedBy::Lease, "{d:?}");
        // Its lease, asked for without waiting, then a call that waits for the next refill
        // once that lease is spent: every one counted once.
        let mut calls = 1u64;
        assert!(
            limiter
                .try_acquire_now_with(&plan, "waiting-key", 1.0)
                .expect("valid")
                .is_none(),
            "no lease yet, and no decision to count"
        );
        for _ in 0..50 {
            let d = limiter
                .try_acquire_with(&plan, "waiting-key", 1.0)
                .await
                .expect("decision");
            assert!(d.allowed, "{d:?}");
            calls += 1;
        }
        calls
    });
    let seen = Seen::take(&snapshotter);
    assert_eq!(
        seen.counter_total(m::DECISIONS),
        calls,
        "one decision, counted once"
    );
}

/// `tokenlease_decisions_total` carries the plan's name: every series of every plan in the
/// policies exists at zero once the limiter is built, before any call, and decisions count under
/// their own plan, also when one thread alternates between plans on the batched fast path.
#[test]
fn decisions_by_plan_exist_from_the_start_and_count_under_their_plan() {
    let (snapshotter, ()) = recorded(async |snapshotter: &Snapshotter| {
        let policies = tokenlease::policy::Policies::from_json_str(
            r#"{
              "plans": {
                "red":  { "capacity": 1000000, "refill_per_second": 1000,
                          "lease": { "ttl_ms": 60000, "max_fraction": 1.0, "max_wait_ms": 500 } },
                "blue": { "capacity": 1000000, "refill_per_second": 1000,
                          "lease": { "ttl_ms": 60000, "max_fraction": 1.0, "max_wait_ms": 500 } },
                "flat": { "capacity": 2, "refill_per_second": 0.001 }
              },
              "keys": [ { "prefix": "red:", "plan": "red" }, { "prefix": "blue:", "plan": "blue" },
                        { "prefix": "flat:", "plan": "flat" } ]
            }"#,
            None,
        )
        .unwrap();
        let limiter = Limiter::builder(MemoryStore::new())
            .policies(policies)
            .lease_tick(Duration::from_millis(5))
            .build();
        let start = Seen::take(snapshotter);
        for plan in ["red", "blue", "flat"] {
            for outcome in ["allowed", "denied"] {
                for by in ["store", "lease", "fallback"] {
                    let labels = [("plan", plan), ("outcome", outcome), ("decided_by", by)];
                    assert_eq!(
                        start.get(MetricKind::Counter, m::DECISIONS, &labels),
                        Some(&DebugValue::Counter(0)),
                        "{labels:?} at start-up"
                    );
                }
            }
        }

        // Direct mode: two allowed and one denied by the store, all under "flat".
        for _ in 0..3 {
            let _ = limiter.try_acquire("flat:1", 1.0).await.unwrap();
        }
        let direct = Seen::take(snapshotter);
        let flat = |seen: &Seen, outcome| {
            seen.counter(
                m::DECISIONS,
                &[
                    ("plan", "flat"),
                    ("outcome", outcome),
                    ("decided_by", "store"),
                ],
            )
        };
        assert_eq!((flat(&direct, "allowed"), flat(&direct, "denied")), (2, 1));
        assert_eq!(direct.counter_total(m::DECISIONS), 3);

        // Warm one key of each leased plan, then alternate between them on the fast path.
        for key in ["red:1", "blue:1"] {
            for _ in 0..5 {
                let _ = limiter.try_acquire(key, 1.0).await.unwrap();
                settle(&limiter).await;
            }
        }
        tokenlease::metrics::flush_thread();
        let _ = Seen::take(snapshotter);
        for _ in 0..700 {
            for key in ["red:1", "blue:1", "blue:1"] {
                let d = limiter.try_acquire(key, 1.0).await.unwrap();
                assert!(d.allowed && d.decided_by == DecidedBy::Lease, "{d:?}");
            }
        }
        tokenlease::metrics::flush_thread();
        let fast = Seen::take(snapshotter);
        let lease = |seen: &Seen, plan| {
            seen.counter(
                m::DECISIONS,
                &[
                    ("plan", plan),
                    ("outcome", "allowed"),
                    ("decided_by", "lease"),
                ],
            )
        };
        assert_eq!(lease(&fast, "red"), 700);
        assert_eq!(lease(&fast, "blue"), 1400);
        assert_eq!(fast.counter(m::DB_CALLS_SAVED, &[]), 2100);
        limiter.shutdown().await;
    });
    drop(snapshotter);
}

/// S6: a shadow plan's denials count as `outcome="would_deny"` (registered at zero with the
/// plan), never as `denied`; its fallback's denials count in the fallback series as denials.
#[test]
fn a_shadow_plans_denials_count_as_would_deny() {
    let (snapshotter, ()) = recorded(async |_: &Snapshotter| {
        let limiter = Limiter::builder(MemoryStore::new()).build();
        let plan = Plan::new("shadowed", bucket(3, 0.001)).with_shadow(true);
        for _ in 0..10 {
            let d = limiter
                .try_acquire_with(&plan, "k", 1.0)
                .await
                .expect("decision");
            assert!(d.allowed);
        }
    });
    let seen = Seen::take(&snapshotter);
    let count = |outcome: &str| {
        seen.counter(
            m::DECISIONS,
            &[
                ("plan", "shadowed"),
                ("outcome", outcome),
                ("decided_by", "store"),
            ],
        )
    };
    assert_eq!(count("allowed"), 3);
    assert_eq!(count("would_deny"), 7);
    assert_eq!(count("denied"), 0);
    assert!(
        seen.label_sets(m::DECISIONS).iter().any(|l| l
            .contains(&("outcome".to_owned(), "would_deny".to_owned()))
            && l.contains(&("decided_by".to_owned(), "lease".to_owned()))),
        "every would_deny series exists"
    );
}

/// M4: on a quiet service, a handful of lease decisions reach the recorder within a second (the
/// lease actor adds the threads' counts every 250 ms while decisions come, and once more
/// after), with no `flush_thread`; and the plans' decisions add up to the route's requests.
/// Through the HTTP layer: `GET /items/{id}`, the endpoint's plan leased, each item's in
/// direct mode. On the paused clock.
#[test]
fn m4_a_few_lease_decisions_reach_the_recorder_within_a_second() {
    use axum::Router;
    use axum::body::Body;
    use axum::extract::connect_info::MockConnectInfo;
    use axum::http::{Request, StatusCode};
    use axum::routing::get;
    use tower::ServiceExt;

    const POLICY: &str = r#"{
      "plans": {
        "items": { "capacity": 1000, "refill_per_second": 100,
                   "lease": { "ttl_ms": 60000, "max_fraction": 0.5 } },
        "item": { "capacity": 5, "refill_per_second": 1 }
      },
      "routes": [
        { "method": "GET", "path": "/items/{id}", "global": "items",
          "entity": { "path_param": "id", "plan": "item" } }
      ]
    }"#;
    recorded(async |snapshotter: &Snapshotter| {
        let policies = tokenlease::policy::Policies::from_json_str(POLICY, None).expect("policy");
        let limiter = Limiter::builder(MemoryStore::new())
            .policies(policies.clone())
            .lease_tick(Duration::from_millis(5))
            .build();
        let layer =
            tokenlease::http::RateLimitLayer::from_policies(&policies, limiter.clone()).unwrap();
        let app = Router::new()
            .route("/items/{id}", get(|| async { "item" }))
            .route_layer(layer)
            .layer(MockConnectInfo(std::net::SocketAddr::from((
                [127, 0, 0, 1],
                1,
            ))));
        let get_item = async |id: u32| {
            let request = Request::get(format!("/items/{id}")).body(Body::empty());
            let r = app.clone().oneshot(request.unwrap()).await.unwrap();
            assert_eq!(r.status(), StatusCode::OK);
        };
        // The endpoint's key gets its lease (its first calls wait for it, or are store calls).
        for id in 0..3 {
            get_item(id).await;
        }
        settle(&limiter).await;
        // sleep: paused clock; the counts of the warm-up are due within a second.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let warm = Seen::take(snapshotter);
        assert_eq!(warm.counter_total(m::DECISIONS), 6, "3 requests, 2 plans");

        // A quiet second: five requests, each answered from the endpoint's lease.
        for id in 10..15 {
            get_item(id).await;
        }
        // sleep: paused clock; within a second of the decisions, nothing else happening.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let seen = Seen::take(snapshotter);
        let plan = |name: &str| -> u64 {
            ["allowed", "denied"]
                .into_iter()
                .flat_map(|outcome| {
                    ["store", "lease", "fallback"].map(|by| {
                        seen.counter(
                            m::DECISIONS,
                            &[("plan", name), ("outcome", outcome), ("decided_by", by)],
                        )
                    })
                })
                .sum()
        };
        let lease = seen.counter(
            m::DECISIONS,
            &[
                ("plan", "items"),
                ("outcome", "allowed"),
                ("decided_by", "lease"),
            ],
        );
        assert_eq!(lease, 5, "the lease decisions, within a second");
        assert_eq!(seen.counter_total(m::DB_CALLS_SAVED), 5);
        let checked = seen.counter(
            m::HTTP_CHECKED,
            &[("method", "GET"), ("route", "/items/{id}")],
        );
        assert_eq!(checked, 5, "the route's requests");
        assert_eq!(
            plan("items"),
            checked,
            "by plan as by route: the endpoint's plan"
        );
        assert_eq!(
            plan("item"),
            checked,
            "by plan as by route: the items' plan"
        );
        limiter.shutdown().await;
    });
}
