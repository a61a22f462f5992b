//! C11: a cold start of many new keys against a real PostgreSQL whose refills are late, on a
//! healthy store: no fallback decision, every admission paid for in the store's buckets, and
//! no key over the ideal bucket's envelope (`docs/design/leases.md`, "Credit while a new key's refill is
//! late" and "A refill that times out while the store answers"). C12: a key's second chance
//! is given once: refills that time out twice in a row fail, and the actor stops asking.
//!
//! Lateness is made, not waited for: a gate in front of the store holds the refill statements
//! of the cold keys' partition until the test lets them go (or fails them with a timeout), so
//! every first call of a cold key waits out its `max_wait` while its refill is on its way,
//! however fast or slow the machine. The calls' waits are their own deadlines (`max_wait`);
//! the test waits on the gate's counters and the actor, never on a sleep.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokenlease::policy::{LeaseSettings, Plan};
use tokenlease::store::{
    AcquireRequest, Acquired, BucketRow, GiveBack, PostgresStore, Store, StoreError, TimeoutKind,
};
use tokenlease::{DecidedBy, Limiter};
use tokenlease_testkit::TestDatabase;
use tokio::sync::watch;

use crate::common;

/// What the held refill statements do once the test decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Wait,
    Pass,
    TimeOut,
}

/// A real store whose refill statements for keys of partition 0 (the cold keys) wait while
/// `hold` is set, until the verdict says to go on to the store or to fail with a call timeout.
/// Keys starting with `probe` are partition 1 and never held.
#[derive(Debug, Clone)]
struct Gate {
    inner: Arc<PostgresStore>,
    hold: Arc<AtomicBool>,
    verdict: Arc<watch::Sender<Verdict>>,
    /// Refill statements held now.
    held: Arc<watch::Sender<usize>>,
}

impl Gate {
    fn new(inner: PostgresStore) -> Gate {
        Gate {
            inner: Arc::new(inner),
            hold: Arc::new(AtomicBool::new(false)),
            verdict: Arc::new(watch::channel(Verdict::Wait).0),
            held: Arc::new(watch::channel(0).0),
        }
    }

    /// Waits (at most 30 s) until at least `n` refill statements are held.
    async fn until_held(&self, n: usize) {
        let mut rx = self.held.subscribe();
        tokio::time::timeout(Duration::from_secs(30), rx.wait_for(|h| *h >= n))
            .await
            .expect("refill statements held within 30 s")
            .expect("gate");
    }
}

#[async_trait::async_trait]
impl Store for Gate {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        self.inner.acquire(request).await
    }
    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        let cold = requests.iter().any(|r| self.partition(r.key) == 0);
        if cold && self.hold.load(Ordering::SeqCst) {
            let mut verdict = self.verdict.subscribe();
            self.held.send_modify(|h| *h += 1);
            // Bounded: the test gives its verdict, or the test fails at its own timeout.
            let given = tokio::time::timeout(
                Duration::from_secs(60),
                verdict.wait_for(|v| *v != Verdict::Wait),
            )
            .await
            .ok()
            .and_then(Result::ok)
            .map(|v| *v);
            self.held.send_modify(|h| *h -= 1);
            if given != Some(Verdict::Pass) {
                return Err(StoreError::Timeout {
                    kind: TimeoutKind::Call,
                    after: Duration::from_millis(50),
                });
            }
        }
        self.inner.acquire_many(requests).await
    }
    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        self.inner.give_back(returns).await
    }
    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        self.inner.delete_idle(limit).await
    }
    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        self.inner.inspect(key).await
    }
    fn partition(&self, key: &str) -> usize {
        usize::from(key.starts_with("probe"))
    }
}

/// Capacity 20, a token every 1,000 s (so a row shows every take), `B` = 2 tokens.
const CAPACITY: u64 = 20;
const RATE: f64 = 0.001;

fn cold_plan(max_wait: Duration) -> Plan {
    common::plan(CAPACITY, RATE).with_lease(
        LeaseSettings::default()
            .with_ttl(Duration::from_secs(5))
            .with_max_wait(max_wait),
    )
}

/// Probes' plan: they wait for their refills as long as it takes (a busy machine's first
/// statement).
fn probe_plan() -> Plan {
    Plan::new("probe", common::bucket(CAPACITY, RATE)).with_lease(
        LeaseSettings::default()
            .with_ttl(Duration::from_secs(5))
            .with_max_wait(Duration::from_secs(10)),
    )
}

/// A store on `db` behind a gate, and a limiter on it whose actor ticks every 10 ms.
async fn gated_limiter(db: &TestDatabase) -> (Gate, Limiter) {
    let gate = Gate::new(common::store(db, 4).await);
    let limiter = Limiter::builder(gate.clone())
        .lease_tick(Duration::from_millis(10))
        .build();
    (gate, limiter)
}

/// `calls` concurrent calls of each of `keys`, each its own task: (key, when, allowed,
/// decided by).
async fn burst(
    limiter: &Limiter,
    plan: &Plan,
    keys: &[String],
    calls: usize,
    origin: Instant,
) -> Vec<(String, f64, bool, DecidedBy)> {
    let mut tasks = tokio::task::JoinSet::new();
    for key in keys {
        for _ in 0..calls {
            let (limiter, plan, key) = (limiter.clone(), plan.clone(), key.clone());
            tasks.spawn(async move {
                let d = limiter
                    .try_acquire_with(&plan, &key, 1.0)
                    .await
                    .expect("decision");
                (key, origin.elapsed().as_secs_f64(), d.allowed, d.decided_by)
            });
        }
    }
    tasks.join_all().await
}

/// C11, see the module.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c11_a_cold_start_on_a_healthy_store_has_no_fallback_decision() {
    let _serial = common::serial().await;
    let db = common::database().await;
    let (gate, limiter) = gated_limiter(&db).await;
    let origin = Instant::now();
    let plan = cold_plan(Duration::from_millis(20));
    let probe_plan = probe_plan();
    let probe = |name: &str| {
        let limiter = &limiter;
        let probe_plan = &probe_plan;
        let name = name.to_owned();
        async move {
            let d = limiter
                .try_acquire_with(probe_plan, &name, 1.0)
                .await
                .expect("decision");
            assert!(
                d.allowed && d.decided_by == DecidedBy::Lease,
                "{name}: {d:?}"
            );
        }
    };
    // The store has answered a refill.
    probe("probe-0").await;

    // 1. 300 new keys, two calls each at once; their refills are held past max_wait.
    gate.hold.store(true, Ordering::SeqCst);
    let first: Vec<String> = (0..300).map(|i| format!("cold-a:{i}")).collect();
    let mut seen = burst(&limiter, &plan, &first, 2, origin).await;
    gate.until_held(1).await;
    gate.hold.store(false, Ordering::SeqCst);
    gate.verdict.send_replace(Verdict::Pass);
    common::actor_idle(&limiter, Duration::from_secs(30)).await;
    gate.verdict.send_replace(Verdict::Wait);

    // 2. 300 more; their held refills then time out, after a newer refill (a probe's) answered:
    // late, not failed, so the keys are asked for again and their callers are not sent to the
    // fallback.
    probe("probe-1").await;
    gate.hold.store(true, Ordering::SeqCst);
    let second: Vec<String> = (0..300).map(|i| format!("cold-b:{i}")).collect();
    seen.extend(burst(&limiter, &plan, &second, 2, origin).await);
    gate.until_held(1).await;
    gate.hold.store(false, Ordering::SeqCst);
    probe("probe-2").await;
    gate.verdict.send_replace(Verdict::TimeOut);
    gate.held
        .subscribe()
        .wait_for(|h| *h == 0)
        .await
        .expect("gate");
    // Asked for again at once (a failed refill would leave the credit owed until the keys'
    // next calls), and paid.
    common::actor_idle(&limiter, Duration::from_secs(30)).await;
    gate.verdict.send_replace(Verdict::Wait);

    // 3. 300 more; their held refills time out with no newer refill answered (no probe in
    // between): no proof the store works, but no refill has failed since the last answer, so
    // each key gets one second chance: late once, asked for again, answered.
    let late_before = limiter.lease_stats().expect("leased").late_refills;
    gate.hold.store(true, Ordering::SeqCst);
    let third: Vec<String> = (0..300).map(|i| format!("cold-c:{i}")).collect();
    seen.extend(burst(&limiter, &plan, &third, 2, origin).await);
    gate.until_held(1).await;
    gate.hold.store(false, Ordering::SeqCst);
    gate.verdict.send_replace(Verdict::TimeOut);
    gate.held
        .subscribe()
        .wait_for(|h| *h == 0)
        .await
        .expect("gate");
    common::actor_idle(&limiter, Duration::from_secs(30)).await;

    let stats = limiter.lease_stats().expect("leased");
    assert!(
        stats.late_refills > late_before,
        "the third burst's refills were late: {stats:?}"
    );
    assert_eq!(stats.failed_refills, 0, "no refill failed: {stats:?}");
    let fallback = seen
        .iter()
        .filter(|s| matches!(s.3, DecidedBy::Fallback(_)))
        .count();
    assert_eq!(fallback, 0, "fallback decisions: {stats:?}");
    assert!(
        stats.credit > 0.0,
        "late refills admitted on credit: {stats:?}"
    );
    assert_eq!(stats.credit_owed, 0.0, "every credit paid: {stats:?}");
    assert_eq!(stats.credit_unpaid, 0.0, "{stats:?}");

    // Every key within the ideal bucket's envelope, and charged in the store for every token
    // admitted: the credit was paid, so the store's bucket covers the credited calls too.
    let mut by_key: HashMap<&str, Vec<(f64, f64)>> = HashMap::new();
    for (key, at, allowed, _) in &seen {
        if *allowed {
            by_key.entry(key).or_default().push((*at, 1.0));
        }
    }
    assert_eq!(by_key.len(), 900, "every cold key admitted");
    for (key, mut admitted) in by_key {
        admitted.sort_by(|a, b| a.0.total_cmp(&b.0));
        let span = admitted.last().map_or(0.0, |a| a.0);
        let (excess, sum) = common::worst_window(&admitted, span, CAPACITY as f64, RATE, 0.0);
        assert!(excess <= 1e-9, "{key}: {sum} admitted in one window");
        let row = gate
            .inspect(key)
            .await
            .expect("inspect")
            .expect("the key's row");
        let charged = CAPACITY as f64 - row.tokens_now.as_f64() + RATE * span;
        assert!(
            charged + 1e-6 >= admitted.len() as f64,
            "{key}: {} admitted, the store charged {charged}: {row:?}",
            admitted.len()
        );
    }
    limiter.shutdown().await;
}

/// C12: a second chance is given once. The cold keys' refills time out, and so do the
/// statements that ask for them again: the first are late (the store had answered a probe and
/// nothing had failed), the second fail, and the actor stops asking (it goes idle while the
/// store would still time out every statement of these keys).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c12_refills_that_time_out_twice_in_a_row_fail() {
    let _serial = common::serial().await;
    let db = common::database().await;
    let (gate, limiter) = gated_limiter(&db).await;
    let origin = Instant::now();
    let plan = cold_plan(Duration::from_millis(20));
    let probe_plan = probe_plan();
    let d = limiter
        .try_acquire_with(&probe_plan, "probe-0", 1.0)
        .await
        .expect("decision");
    assert!(d.allowed && d.decided_by == DecidedBy::Lease, "{d:?}");

    // Every refill of a cold key times out from now on: the first statements and the ones
    // asking again.
    gate.hold.store(true, Ordering::SeqCst);
    gate.verdict.send_replace(Verdict::TimeOut);
    let keys: Vec<String> = (0..50).map(|i| format!("cold-d:{i}")).collect();
    let seen = burst(&limiter, &plan, &keys, 1, origin).await;
    common::actor_idle(&limiter, Duration::from_secs(30)).await;

    let stats = limiter.lease_stats().expect("leased");
    assert!(
        stats.late_refills >= 1,
        "the first refills were late: {stats:?}"
    );
    assert!(
        stats.failed_refills >= 1,
        "the second ones failed: {stats:?}"
    );
    assert_eq!(seen.len(), 50, "every call decided");
    gate.hold.store(false, Ordering::SeqCst);
    limiter.shutdown().await;
}

/// One instance of E12's shape: a limiter as `tokenlease loadtest` builds one (its own pool of
/// 4, a 50 ms call timeout, a 40 ms pool wait, server timeouts of 100 ms, a circuit breaker in
/// front), with the library's default limiter settings.
async fn loadtest_instance(db: &TestDatabase) -> Limiter {
    let store = PostgresStore::builder(&db.connection_string())
        .expect("store")
        .pool_size(4)
        .call_timeout(Duration::from_millis(50))
        .pool_wait_timeout(Duration::from_millis(40))
        .statement_timeout(Duration::from_millis(100))
        .lock_timeout(Duration::from_millis(100))
        .build()
        .await
        .expect("store");
    Limiter::builder(tokenlease::store::CircuitBreaker::new(store)).build()
}

/// E12: the default leased load test's shape at cold start on a healthy PostgreSQL. Two
/// instances of 16 tasks each, every task a closed loop paced at 625 calls a second (20,000 a
/// second in all) on one hot key new to both, under the load test's plan (capacity 100, 50 a
/// second, the default lease settings: `B` = 10 tokens, `max_wait` 50 ms; the `deny`
/// fallback). For its first two seconds: no call is decided by the fallback, and every window
/// admits at most `C + r·(w + 0.02) + N·B`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e12_the_default_leased_load_test_has_no_fallback_at_cold_start() {
    use tokenlease::policy::{FallbackMode, FallbackSettings};
    const INSTANCES: usize = 2;
    const TASKS: usize = 16;
    const CAPACITY: f64 = 100.0;
    const RATE: f64 = 50.0;
    const RUN: Duration = Duration::from_secs(2);
    let _serial = common::serial().await;
    let db = common::database().await;
    let mut limiters = Vec::new();
    for _ in 0..INSTANCES {
        limiters.push(loadtest_instance(&db).await);
    }
    let plan = Plan::new("loadtest", common::bucket(CAPACITY as u64, RATE))
        .with_fallback(FallbackSettings::new(FallbackMode::Deny))
        .with_lease(LeaseSettings::default());
    let origin = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for limiter in &limiters {
        for task in 0..TASKS {
            let (limiter, plan) = (limiter.clone(), plan.clone());
            tasks.spawn(async move {
                // Each task's slots 1.6 ms apart, the tasks spread over one period, as the
                // load test paces them; a late answer delays the next call (a closed loop).
                let period = Duration::from_micros(1_600);
                let start = origin + period * task as u32 / TASKS as u32;
                let mut pace = tokio::time::interval_at(start, period);
                pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut seen = Vec::new();
                while origin.elapsed() < RUN {
                    pace.tick().await;
                    let d = limiter
                        .try_acquire_with(&plan, "loadtest:0", 1.0)
                        .await
                        .expect("decision");
                    seen.push((origin.elapsed().as_secs_f64(), d.allowed, d.decided_by));
                }
                seen
            });
        }
    }
    let seen: Vec<(f64, bool, DecidedBy)> = tasks.join_all().await.concat();
    let stats: Vec<_> = limiters.iter().map(|l| l.lease_stats()).collect();
    let fallback = seen
        .iter()
        .filter(|s| matches!(s.2, DecidedBy::Fallback(_)))
        .count();
    assert_eq!(
        fallback,
        0,
        "fallback decisions out of {} calls: {stats:#?}",
        seen.len()
    );
    let mut admitted: Vec<(f64, f64)> = seen.iter().filter(|s| s.1).map(|s| (s.0, 1.0)).collect();
    admitted.sort_by(|a, b| a.0.total_cmp(&b.0));
    assert!(
        admitted.len() as f64 >= CAPACITY,
        "{} admitted",
        admitted.len()
    );
    // N·B: each instance's largest lease, a tenth of the capacity.
    let bound = CAPACITY + INSTANCES as f64 * CAPACITY * 0.1;
    for w in [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0] {
        let (excess, sum) = common::worst_window(&admitted, w, bound, RATE, 0.02);
        assert!(excess <= 1e-9, "window {w} s: {sum} admitted");
    }
    for limiter in limiters {
        limiter.shutdown().await;
    }
}
