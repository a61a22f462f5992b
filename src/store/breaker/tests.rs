//! Unit tests of `breaker.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32};

use super::*;
use crate::bucket::{BucketConfig, Rate, Tokens};
use crate::store::{MemoryStore, TimeoutKind};

/// A store that fails with a timeout (or a non-transient error) while told to, and counts
/// the calls that reach it.
#[derive(Debug, Default, Clone)]
struct Flaky {
    inner: MemoryStore,
    failing: Arc<AtomicBool>,
    permanent: Arc<AtomicBool>,
    calls: Arc<AtomicU32>,
}

impl Flaky {
    fn check(&self) -> Result<(), StoreError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.permanent.load(Ordering::SeqCst) {
            return Err(StoreError::Protocol("schema mismatch".into()));
        }
        if self.failing.load(Ordering::SeqCst) {
            return Err(StoreError::Timeout {
                kind: TimeoutKind::Call,
                after: Duration::from_millis(50),
            });
        }
        Ok(())
    }
}

#[async_trait]
impl Store for Flaky {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        self.check()?;
        self.inner.acquire(request).await
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

fn bucket() -> BucketConfig {
    BucketConfig::new(Tokens::whole(100), Rate::from_f64(50.0).unwrap()).unwrap()
}

async fn take(b: &CircuitBreaker<Flaky>) -> Result<Acquired, StoreError> {
    b.acquire(AcquireRequest::take("k", bucket(), Tokens::whole(1)))
        .await
}

/// Back-offs of 100 ms doubling to 400 ms: long enough that "fails at once" checks made
/// right after opening cannot race the back-off, short enough to keep the tests quick.
fn breaker(flaky: &Flaky) -> CircuitBreaker<Flaky> {
    CircuitBreaker::new(flaky.clone())
        .failure_threshold(3)
        .backoff(Duration::from_millis(100), Duration::from_millis(400))
}

fn is_open_error(r: &Result<Acquired, StoreError>) -> bool {
    matches!(r, Err(StoreError::CircuitOpen { .. }))
}

fn is_timeout(r: &Result<Acquired, StoreError>) -> bool {
    matches!(r, Err(StoreError::Timeout { .. }))
}

#[tokio::test(start_paused = true)]
async fn opens_after_threshold_probes_and_closes() {
    let flaky = Flaky::default();
    let b = breaker(&flaky);
    assert!(take(&b).await.is_ok());
    flaky.failing.store(true, Ordering::SeqCst);
    for _ in 0..3 {
        assert!(is_timeout(&take(&b).await));
    }
    assert_eq!(b.state(), CircuitState::Open);
    let calls = flaky.calls.load(Ordering::SeqCst);
    // Open: fails at once without calling the store.
    let err = take(&b).await.unwrap_err();
    assert!(
        matches!(err, StoreError::CircuitOpen { retry_in } if retry_in <= Duration::from_millis(100))
    );
    assert!(err.is_transient());
    assert_eq!(flaky.calls.load(Ordering::SeqCst), calls);
    // After the back-off, one probe: it fails, and the back-off doubles to 200 ms.
    // sleep: the 100 ms back-off passes: the next call probes.
    tokio::time::sleep(Duration::from_millis(110)).await;
    assert!(is_timeout(&take(&b).await));
    assert_eq!(b.state(), CircuitState::Open);
    assert_eq!(flaky.calls.load(Ordering::SeqCst), calls + 1);
    // sleep: 110 ms into the 200 ms back-off: still open.
    tokio::time::sleep(Duration::from_millis(110)).await;
    assert!(is_open_error(&take(&b).await), "200 ms back-off");
    // sleep: the rest of the 200 ms back-off passes: the next call probes.
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The store is back: the probe succeeds and closes the circuit.
    flaky.failing.store(false, Ordering::SeqCst);
    assert!(take(&b).await.is_ok());
    assert_eq!(b.state(), CircuitState::Closed);
    assert!(take(&b).await.is_ok());
    assert!(b.clock_skew().is_some());
}

#[tokio::test(start_paused = true)]
async fn backoff_is_capped_and_reset_on_close() {
    let flaky = Flaky::default();
    let b = breaker(&flaky);
    flaky.failing.store(true, Ordering::SeqCst);
    for _ in 0..3 {
        let _ = take(&b).await;
    }
    // Probes fail after 100, 200, 400, 400 ms back-offs (cap 400).
    for wait in [100, 200, 400, 400] {
        // sleep: half the back-off: still open.
        tokio::time::sleep(Duration::from_millis(wait / 2)).await;
        assert!(is_open_error(&take(&b).await), "back-off {wait} ms");
        // sleep: the rest of the back-off passes: the next call probes.
        tokio::time::sleep(Duration::from_millis(wait / 2 + 10)).await;
        assert!(is_timeout(&take(&b).await), "probe after {wait} ms");
    }
    // sleep: the capped 400 ms back-off passes: the next call probes.
    tokio::time::sleep(Duration::from_millis(410)).await;
    flaky.failing.store(false, Ordering::SeqCst);
    assert!(take(&b).await.is_ok());
    // Closed again; the next opening starts from the minimum back-off.
    flaky.failing.store(true, Ordering::SeqCst);
    for _ in 0..3 {
        let _ = take(&b).await;
    }
    // sleep: the minimum back-off (100 ms) passes, not the 400 ms of before: the call probes.
    tokio::time::sleep(Duration::from_millis(110)).await;
    assert!(is_timeout(&take(&b).await));
}

#[tokio::test]
async fn a_success_or_a_permanent_error_resets_the_count() {
    let flaky = Flaky::default();
    let b = breaker(&flaky);
    for round in 0..10 {
        flaky.failing.store(true, Ordering::SeqCst);
        let _ = take(&b).await;
        let _ = take(&b).await;
        flaky.failing.store(false, Ordering::SeqCst);
        if round % 2 == 0 {
            assert!(take(&b).await.is_ok());
        } else {
            flaky.permanent.store(true, Ordering::SeqCst);
            assert!(matches!(take(&b).await, Err(StoreError::Protocol(_))));
            flaky.permanent.store(false, Ordering::SeqCst);
        }
    }
    assert_eq!(b.state(), CircuitState::Closed);
}

#[tokio::test(start_paused = true)]
async fn only_one_probe_at_a_time_and_a_cancelled_probe_reopens() {
    let flaky = Flaky::default();
    let b = breaker(&flaky);
    flaky.failing.store(true, Ordering::SeqCst);
    for _ in 0..3 {
        let _ = take(&b).await;
    }
    // sleep: the 100 ms back-off passes: the half-open slot is free.
    tokio::time::sleep(Duration::from_millis(110)).await;
    // Take the half-open slot by hand, as a probe in flight would.
    let permit = b.admit(crate::clock::instant()).expect("probe admitted");
    assert!(permit.probe);
    assert_eq!(b.state(), CircuitState::HalfOpen);
    assert!(is_open_error(&take(&b).await));
    // Dropped without an outcome (cancelled): open, and the next call probes at once.
    drop(permit);
    assert_eq!(b.state(), CircuitState::Open);
    flaky.failing.store(false, Ordering::SeqCst);
    assert!(take(&b).await.is_ok());
    assert_eq!(b.state(), CircuitState::Closed);
}

/// A wall clock a test sets by hand.
#[derive(Debug, Clone, Default)]
struct SetWall(Arc<std::sync::atomic::AtomicU64>);

impl WallClock for SetWall {
    fn now(&self) -> crate::bucket::Timestamp {
        crate::bucket::Timestamp::from_nanos(self.0.load(Ordering::SeqCst))
    }
}

/// The skew is the store's clock minus the injected wall clock: a wall clock an hour behind
/// reads +1 h, an hour ahead −1 h; the breaker's back-off (on tokio's clock) is unaffected.
#[tokio::test]
async fn skew_follows_the_injected_wall_clock() {
    let hour = 3_600_000_000_000u64;
    let real = || SystemClock.now().as_nanos();
    let wall = SetWall::default();
    wall.0.store(real(), Ordering::SeqCst);
    let b = breaker(&Flaky::default()).wall_clock(wall.clone());
    assert!(take(&b).await.is_ok());
    let same = b.clock_skew().expect("a skew");
    assert!(same.abs() < 0.05, "skew {same} s against the right time");
    for (set, expected) in [(real() - hour, 3600.0), (real() + hour, -3600.0)] {
        wall.0.store(set, Ordering::SeqCst);
        assert!(take(&b).await.is_ok());
        let skew = b.clock_skew().expect("a skew");
        assert!(
            (skew - expected).abs() < 0.05,
            "skew {skew} s, expected {expected}"
        );
    }
    assert_eq!(b.state(), CircuitState::Closed);
}

#[test]
fn records_metrics() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let b = CircuitBreaker::new(()).name("m");
        let mut st = b.state.lock();
        b.transition(&mut st, CircuitState::Open);
        b.transition(&mut st, CircuitState::HalfOpen);
    });
    let snapshot = snapshotter.snapshot().into_vec();
    let gauge = snapshot
        .iter()
        .find(|(k, ..)| k.key().name() == CIRCUIT_STATE)
        .map(|(.., v)| v);
    assert_eq!(gauge, Some(&DebugValue::Gauge(2.0.into())));
    let transitions: u64 = snapshot
        .iter()
        .filter(|(k, ..)| k.key().name() == CIRCUIT_TRANSITIONS)
        .map(|(.., v)| match v {
            DebugValue::Counter(n) => *n,
            _ => 0,
        })
        .sum();
    assert_eq!(transitions, 2);
}

/// The first call registers the state gauge (closed, 0) and every transition counter at
/// zero, under the name the breaker was given, so a dashboard's queries have series before
/// any transition.
#[test]
fn the_first_call_registers_its_series_at_zero() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let b = breaker(&Flaky::default()).name("z");
        runtime.block_on(async { assert!(take(&b).await.is_ok()) });
    });
    let snapshot = snapshotter.snapshot().into_vec();
    let series = |name: &str| -> Vec<(Vec<String>, String)> {
        let mut found: Vec<_> = snapshot
            .iter()
            .filter(|(k, ..)| k.key().name() == name)
            .map(|(k, .., v)| {
                let labels = k
                    .key()
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()));
                (labels.collect::<Vec<_>>(), format!("{v:?}"))
            })
            .collect();
        found.sort_by(|a, b| a.0.cmp(&b.0));
        found
    };
    assert_eq!(
        series(CIRCUIT_STATE),
        vec![(
            vec!["store=z".to_owned()],
            format!("{:?}", DebugValue::Gauge(0.0.into()))
        )]
    );
    let transitions = series(CIRCUIT_TRANSITIONS);
    let tos: Vec<_> = transitions.iter().map(|(l, _)| l[1].clone()).collect();
    assert_eq!(tos, ["to=closed", "to=half_open", "to=open"]);
    assert!(
        transitions
            .iter()
            .all(|(l, v)| l[0] == "store=z" && *v == format!("{:?}", DebugValue::Counter(0)))
    );
}

/// A store whose calls all take 50 ms and then time out: one stall of the database.
#[derive(Debug, Default, Clone)]
struct Stalled(Flaky);

#[async_trait]
impl Store for Stalled {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        // sleep: the stalled store's latency (paused clock), 50 ms before it times out.
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.0.acquire(request).await
    }
    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        self.0.give_back(returns).await
    }
    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        self.0.delete_idle(limit).await
    }
    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        self.0.inspect(key).await
    }
}

/// Calls in flight together that all time out in one stall count as one failure: sixteen
/// of them leave the circuit closed, and four more rounds failing one after another (five
/// in all) open it.
#[tokio::test(start_paused = true)]
async fn one_stall_of_many_calls_in_flight_counts_once() {
    let store = Stalled::default();
    store.0.failing.store(true, Ordering::SeqCst);
    let b = CircuitBreaker::new(store.clone()).failure_threshold(5);
    let request = || AcquireRequest::take("k", bucket(), Tokens::whole(1));
    let calls: Vec<_> = (0..16).map(|_| b.acquire(request())).collect();
    for result in futures_join_all(calls).await {
        assert!(result.is_err());
    }
    assert_eq!(b.state(), CircuitState::Closed, "one stall");
    for round in 1..=4 {
        let calls: Vec<_> = (0..4).map(|_| b.acquire(request())).collect();
        for result in futures_join_all(calls).await {
            assert!(
                !matches!(result, Err(StoreError::CircuitOpen { .. })),
                "round {round}"
            );
        }
    }
    assert_eq!(
        b.state(),
        CircuitState::Open,
        "five rounds failing one after another"
    );
}

use crate::store::join_all as futures_join_all;

/// The back-off runs on tokio's clock: paused, the circuit stays open however long the test
/// takes until the clock passes the back-off, and then lets one probe through. No sleep:
/// nothing but the clock, moved by hand, decides.
#[tokio::test(start_paused = true)]
async fn the_back_off_follows_tokios_clock() {
    let flaky = Flaky::default();
    let b = breaker(&flaky);
    flaky.failing.store(true, Ordering::SeqCst);
    for _ in 0..3 {
        assert!(is_timeout(&take(&b).await));
    }
    assert_eq!(b.state(), CircuitState::Open);
    let calls = flaky.calls.load(Ordering::SeqCst);
    tokio::time::advance(Duration::from_millis(99)).await;
    let err = take(&b).await.unwrap_err();
    assert!(
        matches!(err, StoreError::CircuitOpen { retry_in } if retry_in == Duration::from_millis(1)),
        "{err:?}"
    );
    assert_eq!(flaky.calls.load(Ordering::SeqCst), calls);
    tokio::time::advance(Duration::from_millis(1)).await;
    flaky.failing.store(false, Ordering::SeqCst);
    assert!(take(&b).await.is_ok(), "the probe at 100 ms");
    assert_eq!(b.state(), CircuitState::Closed);
    assert_eq!(flaky.calls.load(Ordering::SeqCst), calls + 1);
}
