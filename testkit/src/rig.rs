//! What the fault tests measure with, whatever they measure: a log of the store calls that
//! reached the database, callers driven at a steady pace until a deadline, and the figures read
//! from both (percentiles of the callers' waits, the calls and errors in a window, when the
//! store answered again).
//!
//! Nothing here names a type of `tokenlease` itself: the fault tests of the `faults` binary
//! use the library as a dependency, and its unit test of an exhausted pool
//! (`src/pool_tests.rs`) uses the library's own build, whose types are not the ones this
//! crate's dependency sees. What must name them (the store wrapper that logs calls, which
//! implements the library's `Store` trait, with the classes of the library's errors; the store
//! with the fault tests' settings) is one definition each, a macro expanded on each side over
//! the path of the store module there: [`recording_store!`](crate::recording_store) and
//! [`fault_store!`](crate::fault_store). Each side keeps its own record of a decision. Time is
//! read through the function each caller passes (`Instant::now`, or the library's clock), and
//! the instant type is the caller's (std's or tokio's): anything that can be copied, ordered,
//! moved by a [`Duration`] and subtracted from another.

use std::fmt;
use std::future::Future;
use std::ops::{Add, Sub};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::task::JoinHandle;

/// A point in time as the rig needs it: [`std::time::Instant`] and [`tokio::time::Instant`]
/// both are one.
pub trait Moment:
    Copy + Ord + Send + Sync + Sub<Output = Duration> + Add<Duration, Output = Self> + 'static
{
}

impl<I> Moment for I where
    I: Copy + Ord + Send + Sync + Sub<Output = Duration> + Add<Duration, Output = I> + 'static
{
}

/// One store call that reached the database (the breaker let it through).
#[derive(Debug, Clone)]
pub struct Call<I> {
    /// When the call started.
    pub start: I,
    /// How long it took.
    pub took: Duration,
    /// `None` on success, else the error's class.
    pub error: Option<String>,
}

/// The calls a store wrapper made, and how many were in flight at once. Clones share the log.
pub struct CallLog<I, E> {
    now: Arc<dyn Fn() -> I + Send + Sync>,
    class: fn(&E) -> String,
    calls: Arc<Mutex<Vec<Call<I>>>>,
    in_flight: Arc<AtomicUsize>,
    max_in_flight: Arc<AtomicUsize>,
}

impl<I, E> Clone for CallLog<I, E> {
    fn clone(&self) -> Self {
        CallLog {
            now: Arc::clone(&self.now),
            class: self.class,
            calls: Arc::clone(&self.calls),
            in_flight: Arc::clone(&self.in_flight),
            max_in_flight: Arc::clone(&self.max_in_flight),
        }
    }
}

impl<I, E> fmt::Debug for CallLog<I, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CallLog")
            .field("calls", &self.calls.lock().len())
            .field("in_flight", &self.in_flight.load(Ordering::SeqCst))
            .field("max_in_flight", &self.max_in_flight.load(Ordering::SeqCst))
            .finish_non_exhaustive()
    }
}

/// Takes one call off the in-flight count when the call ends, however it ends.
struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<I: Moment, E> CallLog<I, E> {
    /// An empty log that reads the time with `now` and names each error by `class`.
    pub fn new(now: impl Fn() -> I + Send + Sync + 'static, class: fn(&E) -> String) -> Self {
        CallLog {
            now: Arc::new(now),
            class,
            calls: Arc::default(),
            in_flight: Arc::default(),
            max_in_flight: Arc::default(),
        }
    }

    /// Runs `call`, logging when it started, how long it took and its error's class.
    pub async fn run<T>(&self, call: impl Future<Output = Result<T, E>>) -> Result<T, E> {
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(n, Ordering::SeqCst);
        let _guard = InFlight(&self.in_flight);
        let start = (self.now)();
        let result = call.await;
        self.calls.lock().push(Call {
            start,
            took: (self.now)() - start,
            error: result.as_ref().err().map(self.class),
        });
        result
    }

    /// Every call logged so far, in the order they ended.
    pub fn calls(&self) -> Vec<Call<I>> {
        self.calls.lock().clone()
    }

    /// The calls that started in `[from, to)` after `origin`.
    pub fn calls_in(&self, origin: I, from: Duration, to: Duration) -> Vec<Call<I>> {
        self.calls
            .lock()
            .iter()
            .filter(|c| c.start - origin >= from && c.start - origin < to)
            .cloned()
            .collect()
    }

    /// When (after `origin`) the first successful call that started at or after `after`
    /// returned.
    pub fn recovered_at(&self, origin: I, after: Duration) -> Option<Duration> {
        self.calls
            .lock()
            .iter()
            .filter(|c| c.start - origin >= after && c.error.is_none())
            .map(|c| c.start + c.took - origin)
            .min()
    }

    /// The most calls in flight at once since the log began or the last
    /// [`reset_max_in_flight`](Self::reset_max_in_flight).
    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight.load(Ordering::SeqCst)
    }

    /// Starts counting the most calls in flight at once afresh.
    pub fn reset_max_in_flight(&self) {
        self.max_in_flight.store(0, Ordering::SeqCst);
    }
}

/// `calls` counted: (how many, how many failed, the slowest).
pub fn outcome<I>(calls: &[Call<I>]) -> (usize, usize, Duration) {
    let failed = calls.iter().filter(|c| c.error.is_some()).count();
    let slowest = calls.iter().map(|c| c.took).max().unwrap_or_default();
    (calls.len(), failed, slowest)
}

/// The error classes of `calls`, with counts, in the order each class first appears.
pub fn error_classes<I>(calls: &[Call<I>]) -> Vec<(String, usize)> {
    let mut classes: Vec<(String, usize)> = Vec::new();
    for e in calls.iter().filter_map(|c| c.error.clone()) {
        match classes.iter_mut().find(|(k, _)| *k == e) {
            Some(entry) => entry.1 += 1,
            None => classes.push((e, 1)),
        }
    }
    classes
}

/// The `p` quantile of `v` (0 to 1, nearest rank), zero for none.
pub fn percentile(mut v: Vec<Duration>, p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

/// Callers' waits: (p50, p99, max).
pub fn waits(took: impl IntoIterator<Item = Duration>) -> (Duration, Duration, Duration) {
    let v: Vec<Duration> = took.into_iter().collect();
    let max = v.iter().copied().max().unwrap_or_default();
    (percentile(v.clone(), 0.5), percentile(v, 0.99), max)
}

/// A duration in milliseconds, for the figures the tests print.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Runs each of `callers` in a task of its own: it calls, pauses a millisecond, and calls
/// again, until `now() - origin` reaches `until` (milliseconds after `origin`, which the test
/// may move while they run). Returns every caller's records together, sorted by `at` (stable:
/// one caller's records keep their order).
pub fn drive<I, T, F, Fut>(
    callers: Vec<F>,
    now: impl Fn() -> I + Clone + Send + 'static,
    origin: I,
    until: &Arc<AtomicU64>,
    at: fn(&T) -> Duration,
) -> JoinHandle<Vec<T>>
where
    I: Moment,
    T: Send + 'static,
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = T> + Send,
{
    let handles: Vec<JoinHandle<Vec<T>>> = callers
        .into_iter()
        .map(|mut call| {
            let now = now.clone();
            let until = Arc::clone(until);
            tokio::spawn(async move {
                let mut records = Vec::new();
                while now() - origin < Duration::from_millis(until.load(Ordering::Relaxed)) {
                    records.push(call().await);
                    // sleep: pacing, a call a millisecond per task.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                records
            })
        })
        .collect();
    tokio::spawn(async move {
        let mut all = Vec::new();
        for h in handles {
            all.extend(h.await.expect("no caller panicked"));
        }
        all.sort_by_key(at);
        all
    })
}

/// Defines, where it is called, the store wrapper the fault tests log calls with: `Recording`
/// (a `PostgresStore` that passes every call on and logs it in a [`CallLog`]), `Log` (that log,
/// timed in `$instant`) and `class` (the class a store error is logged under: `timeout-pool`,
/// `timeout-call`, `connection`, `db-<SQLSTATE>`, `circuit-open`, or `other: <message>`).
///
/// `$store` is the path of `tokenlease`'s store module as the caller sees it:
/// `tokenlease::store` in the integration tests, `crate::store` in the library's own unit tests,
/// whose types are not the ones this crate's dependency sees (so a type defined here could not
/// implement their `Store`). One definition, expanded in each. The caller depends on
/// `async-trait`, as `tokenlease` does.
///
/// ```ignore
/// tokenlease_testkit::recording_store!(tokenlease::store, std::time::Instant);
/// let log = Log::new(std::time::Instant::now, class);
/// let store = Recording { inner: postgres_store, log: log.clone() };
/// ```
#[macro_export]
macro_rules! recording_store {
    ($($store:ident)::+, $instant:ty) => {
        /// The calls that reached the database.
        pub(crate) type Log = $crate::rig::CallLog<$instant, $($store)::+::StoreError>;

        /// The class a store error is logged under.
        pub(crate) fn class(e: &$($store)::+::StoreError) -> String {
            use $($store)::+::{StoreError, TimeoutKind};
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

        /// A store that logs every call it passes on: under a breaker, every call that reached
        /// the database.
        #[derive(Debug)]
        pub(crate) struct Recording {
            pub(crate) inner: $($store)::+::PostgresStore,
            pub(crate) log: Log,
        }

        #[::async_trait::async_trait]
        impl $($store)::+::Store for Recording {
            async fn acquire(
                &self,
                request: $($store)::+::AcquireRequest<'_>,
            ) -> Result<$($store)::+::Acquired, $($store)::+::StoreError> {
                self.log.run(self.inner.acquire(request)).await
            }
            async fn acquire_many(
                &self,
                requests: &[$($store)::+::AcquireRequest<'_>],
            ) -> Result<Vec<$($store)::+::Acquired>, $($store)::+::StoreError> {
                self.log.run(self.inner.acquire_many(requests)).await
            }
            async fn give_back(
                &self,
                returns: &[$($store)::+::GiveBack<'_>],
            ) -> Result<u64, $($store)::+::StoreError> {
                self.log.run(self.inner.give_back(returns)).await
            }
            async fn delete_idle(&self, limit: u32) -> Result<u64, $($store)::+::StoreError> {
                self.log.run(self.inner.delete_idle(limit)).await
            }
            async fn inspect(
                &self,
                key: &str,
            ) -> Result<Option<$($store)::+::BucketRow>, $($store)::+::StoreError> {
                self.log.run(self.inner.inspect(key)).await
            }
        }
    };
}

/// Defines, where it is called, `fault_store(connection, pool)`: a `PostgresStore` with the
/// fault tests' settings, a pool of `pool`, 50 ms call and pool-wait timeouts, a 250 ms connect
/// timeout, 100 ms statement and lock timeouts. Its first connection must come within the 50 ms
/// pool wait, so building is retried (50 ms apart, for up to 20 s) on a busy machine, each
/// failed attempt printed.
///
/// `$store` is the path of `tokenlease`'s store module as the caller sees it (as for
/// [`recording_store!`](crate::recording_store)), and `$eventually` the caller's poll helper, called as
/// `$eventually(step, within, what, check)` with a `check` that returns whether the store is
/// built: `tests/common`'s `eventually` in the integration tests, `crate::tests::eventually` in
/// the library's unit tests (neither can reach the other's).
#[macro_export]
macro_rules! fault_store {
    ($($store:ident)::+, $eventually:path) => {
        /// A store with the fault tests' settings (`tokenlease_testkit::fault_store!`).
        pub(crate) async fn fault_store(
            connection: &str,
            pool: u32,
        ) -> $($store)::+::PostgresStore {
            let builder = $($store)::+::PostgresStore::builder(connection)
                .expect("connection string")
                .pool_size(pool)
                .call_timeout(::std::time::Duration::from_millis(50))
                .pool_wait_timeout(::std::time::Duration::from_millis(50))
                .connect_timeout(::std::time::Duration::from_millis(250))
                .statement_timeout(::std::time::Duration::from_millis(100))
                .lock_timeout(::std::time::Duration::from_millis(100));
            let (mut store, mut attempts) = (None, 0);
            $eventually(
                ::std::time::Duration::from_millis(50),
                ::std::time::Duration::from_secs(20),
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
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_waits() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(Vec::new(), 0.99), Duration::ZERO);
        assert_eq!(percentile(v.clone(), 0.5), Duration::from_millis(51));
        assert_eq!(percentile(v.clone(), 0.99), Duration::from_millis(99));
        let (p50, p99, max) = waits(v.into_iter().rev());
        assert_eq!(
            (p50, p99, max),
            (
                Duration::from_millis(51),
                Duration::from_millis(99),
                Duration::from_millis(100)
            )
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_log_counts_windows_classes_and_recovery() {
        let log: CallLog<tokio::time::Instant, String> =
            CallLog::new(tokio::time::Instant::now, Clone::clone);
        let origin = tokio::time::Instant::now();
        let call = |ok: bool, took: u64| async move {
            // sleep: a store call's latency, on the paused clock.
            tokio::time::sleep(Duration::from_millis(took)).await;
            if ok {
                Ok(())
            } else {
                Err("timeout".to_owned())
            }
        };
        let _ = log.run(call(false, 10)).await;
        let _ = log.run(call(false, 30)).await;
        let _ = log.run(call(true, 5)).await;
        let calls = log.calls();
        assert_eq!(outcome(&calls), (3, 2, Duration::from_millis(30)));
        assert_eq!(error_classes(&calls), vec![("timeout".to_owned(), 2)]);
        let late = log.calls_in(origin, Duration::from_millis(10), Duration::from_secs(1));
        assert_eq!(late.len(), 2);
        assert_eq!(
            log.recovered_at(origin, Duration::from_millis(10)),
            Some(Duration::from_millis(45))
        );
        assert_eq!(log.recovered_at(origin, Duration::from_millis(41)), None);
        assert_eq!(log.max_in_flight(), 1);
        log.reset_max_in_flight();
        assert_eq!(log.max_in_flight(), 0);
    }
}
