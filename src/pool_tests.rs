//! D6, the pool exhausted by someone else, in each fallback mode (deny, allow, local): a limiter
//! over a `PostgresStore` with a pool of 2, four callers on one key for 3 s, and the test
//! holding both pooled connections from 0.5 s to 2.0 s. While they are held the fallback
//! decides every call, no caller waits longer than a direct call may, every call that reaches
//! the store fails as a timeout (the pool wait's or the call's, within 70 ms), and the coalescer
//! keeps one statement in flight on the key (two with the outage debt's charging task beside
//! it); after the release the store answers again within the breaker's cap plus 200 ms.
//!
//! It lives in the crate because it takes the store's connections through its bb8 pool
//! (`PostgresStore::pool`), which is not public API; it was a fault test in
//! `tests/faults/faults.rs` that reached the pool through a hidden module. It sits at the
//! crate's root, as `assembled_tests` does, because it uses the store and the limiter
//! together: a module below the root naming both would make an arrow between them (L1). The
//! fault tests' settings: call and pool-wait timeouts 50 ms, connect timeout 250 ms, statement
//! and lock timeouts 100 ms, and a [`CircuitBreaker`] with its defaults, under which a
//! recording wrapper logs every call that reached the database, so that store calls and caller
//! waits are measured apart. Against a throwaway cluster of its own (`tokenlease_testkit`);
//! time is read through the crate's clock (L2).
//!
//! Timing-dependent: nextest runs it in its `serial` group (`.config/nextest.toml`), and the
//! three modes take a lock so that `cargo test` runs them one at a time too. Each prints its
//! figures (`--nocapture`).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use tokenlease_testkit::TempPostgres;
use tokio::time::Instant;

use crate::clock::{Clock as _, MonotonicClock};
use crate::debt::tests::{local, plan};
use crate::policy::{FallbackMode, Plan};
use crate::store::{
    AcquireRequest, Acquired, BucketRow, CircuitBreaker, GiveBack, PostgresStore, Store,
    StoreError, TimeoutKind,
};
use crate::{DecidedBy, Limiter};

const C: u64 = 100;
const R: f64 = 50.0;
const KEY: &str = "faults:hot";
/// The longest a direct-mode caller may wait: a caller that arrives while its key's statement
/// is in flight waits for it (up to the 50 ms call timeout), then for its own round (another
/// 50 ms); plus scheduling slack.
const DIRECT_WAIT: Duration = Duration::from_millis(120);

mod d6_pool_exhausted {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deny() {
        d6(FallbackMode::Deny).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn allow() {
        d6(FallbackMode::Allow).await;
    }

    /// Each instance's local bucket holds C/2 and r/2 (N = 2 instances, as in the fault tests).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn local() {
        d6(super::local(2)).await;
    }
}

async fn d6(mode: FallbackMode) {
    // One mode at a time under `cargo test`, which runs a binary's tests on parallel threads.
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _serial = SERIAL.lock().await;
    let clock = MonotonicClock::new();
    let pg = tokio::task::spawn_blocking(TempPostgres::start)
        .await
        .expect("join")
        .expect("a throwaway PostgreSQL (install the server binaries: apt-get install postgresql)");
    let store = fault_store(&pg.connection_string("postgres"), 2).await;
    // The store's own pool: a bb8 pool's clones share its connections.
    let pool = store.pool().clone();
    let log = Log::new(clock);
    let recording = Recording {
        inner: store,
        log: log.clone(),
    };
    let limiter = Limiter::builder(CircuitBreaker::new(recording)).build();
    let plan = Arc::new(plan("test", C, R, mode));
    let origin = clock.instant();
    let run = drive(
        &limiter,
        &plan,
        4,
        clock,
        origin,
        Duration::from_millis(3_000),
    );
    // sleep: the timeline: the callers have the pool to themselves for the first 0.5 s.
    tokio::time::sleep_until(origin + Duration::from_millis(500)).await;
    // Hold both pooled connections for 1.5 s. The callers compete for them, and each `get`
    // gives up after the pool's 50 ms wait: try again until the test holds both.
    let get = || async {
        for _ in 0..100 {
            if let Ok(conn) = pool.get().await {
                return conn;
            }
        }
        panic!("no pooled connection in 100 tries");
    };
    let held = (get().await, get().await);
    let hold_start = clock.instant() - origin;
    log.max_in_flight.store(0, Ordering::SeqCst);
    // sleep: the timeline: the test holds the pool until 2.0 s.
    tokio::time::sleep_until(origin + Duration::from_millis(2_000)).await;
    let in_flight = log.max_in_flight.load(Ordering::SeqCst);
    drop(held);
    let release = clock.instant() - origin;
    let events = run.await.expect("the run");

    let held_calls = log.calls_in(origin, hold_start, release);
    let classes = error_classes(&held_calls);
    let calls = held_calls.len();
    let failed = held_calls.iter().filter(|c| c.error.is_some()).count();
    let slowest = held_calls.iter().map(|c| c.took).max().unwrap_or_default();
    let recovered = log.recovered_at(origin, release).expect("recovered");
    let recovery = recovered.saturating_sub(release);
    let hold: Vec<Event> = events
        .iter()
        .filter(|e| e.at >= hold_start && e.at < release)
        .copied()
        .collect();
    let by_fallback = hold
        .iter()
        .filter(|e| matches!(e.by, DecidedBy::Fallback(_)))
        .count();
    let (p99, max) = waits(&events);
    eprintln!(
        "D6 {}: waits p99 {:.3} ms max {:.1} ms; held 1.5 s: {calls} db calls, {failed} failed \
         {classes:?}, slowest {:.1} ms, at most {in_flight} in flight; {by_fallback} of {} decisions by the \
         fallback; recovery {:.0} ms after release",
        label(mode),
        ms(p99),
        ms(max),
        ms(slowest),
        hold.len(),
        ms(recovery),
    );
    assert!(max <= DIRECT_WAIT, "a caller waited {max:?}");
    assert!(
        slowest <= Duration::from_millis(70),
        "a pool wait took {slowest:?}"
    );
    // The pool wait and the call timeout are both 50 ms: either may fire first.
    assert!(
        classes.iter().all(|(c, _)| c.starts_with("timeout")),
        "{classes:?}"
    );
    assert_eq!(failed, calls);
    // The coalescer sends one statement for the key at a time. With the `allow` and `local`
    // fallbacks the outage debt's charging task may have one of its own in flight beside it
    // (one round at a time, each with the call timeout): it starts when a call finds the store
    // answering, which happens while the test is still taking the connections.
    let bound = if mode == FallbackMode::Deny { 1 } else { 2 };
    assert!(
        in_flight <= bound,
        "{in_flight} statements in flight on one key (at most {bound})"
    );
    assert_eq!(
        by_fallback,
        hold.len(),
        "the fallback decides while the pool is held"
    );
    // The breaker may be open for up to its 500 ms cap when the pool comes back.
    assert!(
        recovery <= Duration::from_millis(700),
        "recovery took {recovery:?}"
    );
}

fn label(mode: FallbackMode) -> &'static str {
    match mode {
        FallbackMode::Deny => "deny",
        FallbackMode::Allow => "allow",
        FallbackMode::Local { .. } => "local",
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A store with the fault tests' settings (those of `tests/common`'s `fault_store`): a pool of
/// `pool`, 50 ms call and pool-wait timeouts, a 250 ms connect timeout, 100 ms statement and
/// lock timeouts. Its first connection must come within the 50 ms pool wait, so building is
/// retried (50 ms apart, for up to 20 s) on a busy machine.
async fn fault_store(connection: &str, pool: u32) -> PostgresStore {
    let builder = PostgresStore::builder(connection)
        .expect("connection string")
        .pool_size(pool)
        .call_timeout(Duration::from_millis(50))
        .pool_wait_timeout(Duration::from_millis(50))
        .connect_timeout(Duration::from_millis(250))
        .statement_timeout(Duration::from_millis(100))
        .lock_timeout(Duration::from_millis(100));
    let (mut store, mut attempts) = (None, 0);
    crate::tests::eventually(
        Duration::from_millis(50),
        Duration::from_secs(20),
        "a fault store built (its first connection within the pool wait)",
        async || {
            attempts += 1;
            match builder.clone().build().await {
                Ok(built) => store = Some(built),
                Err(e) => eprintln!("store build attempt {attempts}: {e}"),
            }
            store.is_some()
        },
    )
    .await;
    store.expect("a fault store built")
}

// ---------------------------------------------------------------------------------------------
// A store wrapper that logs every call reaching the database

/// One store call that reached the database (the breaker let it through).
#[derive(Debug, Clone)]
struct Call {
    start: Instant,
    took: Duration,
    /// `None` on success, else the error's class.
    error: Option<String>,
}

#[derive(Debug, Clone)]
struct Log {
    clock: MonotonicClock,
    calls: Arc<Mutex<Vec<Call>>>,
    in_flight: Arc<AtomicUsize>,
    max_in_flight: Arc<AtomicUsize>,
}

struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn class(e: &StoreError) -> String {
    match e {
        StoreError::Timeout {
            kind: TimeoutKind::Pool,
            ..
        } => "timeout-pool".into(),
        StoreError::Timeout { .. } => "timeout-call".into(),
        StoreError::Connection(_) => "connection".into(),
        StoreError::Database { code, .. } => format!("db-{code}"),
        StoreError::CircuitOpen { .. } => "circuit-open".into(),
        other => format!("other: {other}"),
    }
}

impl Log {
    fn new(clock: MonotonicClock) -> Log {
        Log {
            clock,
            calls: Arc::default(),
            in_flight: Arc::default(),
            max_in_flight: Arc::default(),
        }
    }

    async fn run<T>(
        &self,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(n, Ordering::SeqCst);
        let _guard = InFlight(&self.in_flight);
        let start = self.clock.instant();
        let result = call.await;
        self.calls.lock().push(Call {
            start,
            took: self.clock.instant() - start,
            error: result.as_ref().err().map(class),
        });
        result
    }

    /// The calls that started in `[from, to)` after `origin`.
    fn calls_in(&self, origin: Instant, from: Duration, to: Duration) -> Vec<Call> {
        self.calls
            .lock()
            .iter()
            .filter(|c| c.start - origin >= from && c.start - origin < to)
            .cloned()
            .collect()
    }

    /// When the first successful call that started at or after `after` returned.
    fn recovered_at(&self, origin: Instant, after: Duration) -> Option<Duration> {
        self.calls
            .lock()
            .iter()
            .filter(|c| c.start - origin >= after && c.error.is_none())
            .map(|c| c.start + c.took - origin)
            .min()
    }
}

/// The error classes of `calls`, with counts.
fn error_classes(calls: &[Call]) -> Vec<(String, usize)> {
    let mut classes: Vec<(String, usize)> = Vec::new();
    for e in calls.iter().filter_map(|c| c.error.clone()) {
        match classes.iter_mut().find(|(k, _)| *k == e) {
            Some(entry) => entry.1 += 1,
            None => classes.push((e, 1)),
        }
    }
    classes
}

#[derive(Debug)]
struct Recording {
    inner: PostgresStore,
    log: Log,
}

#[async_trait]
impl Store for Recording {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        self.log.run(self.inner.acquire(request)).await
    }
    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        self.log.run(self.inner.acquire_many(requests)).await
    }
    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        self.log.run(self.inner.give_back(returns)).await
    }
    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        self.log.run(self.inner.delete_idle(limit)).await
    }
    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        self.log.run(self.inner.inspect(key)).await
    }
}

// ---------------------------------------------------------------------------------------------
// Load and measurements

/// One decision.
#[derive(Debug, Clone, Copy)]
struct Event {
    /// When the call started, since the run's origin.
    at: Duration,
    by: DecidedBy,
    /// How long the caller waited.
    took: Duration,
}

/// Runs `tasks` callers on [`KEY`] from now until `origin + until`, each pausing 1 ms between
/// calls (demand well above the refill rate); their decisions, in order of start.
fn drive(
    limiter: &Limiter,
    plan: &Arc<Plan>,
    tasks: usize,
    clock: MonotonicClock,
    origin: Instant,
    until: Duration,
) -> tokio::task::JoinHandle<Vec<Event>> {
    let handles: Vec<_> = (0..tasks)
        .map(|_| {
            let limiter = limiter.clone();
            let plan = Arc::clone(plan);
            tokio::spawn(async move {
                let mut events = Vec::new();
                while clock.instant() - origin < until {
                    let start = clock.instant();
                    let d = limiter
                        .try_acquire_with(&plan, KEY, 1.0)
                        .await
                        .expect("a decision, never an error");
                    events.push(Event {
                        at: start - origin,
                        by: d.decided_by,
                        took: clock.instant() - start,
                    });
                    // sleep: pacing, a call a millisecond per task.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                events
            })
        })
        .collect();
    tokio::spawn(async move {
        let mut all = Vec::new();
        for h in handles {
            all.extend(h.await.expect("no caller panicked"));
        }
        all.sort_by_key(|e| e.at);
        all
    })
}

/// Caller waits: (p99, max).
fn waits(events: &[Event]) -> (Duration, Duration) {
    let mut v: Vec<Duration> = events.iter().map(|e| e.took).collect();
    v.sort();
    let p99 = match v.len() {
        0 => Duration::ZERO,
        n => v[((n as f64 - 1.0) * 0.99).round() as usize],
    };
    (p99, v.last().copied().unwrap_or_default())
}
