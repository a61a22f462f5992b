//! [`CircuitBreaker`]: stop calling a failing store for a while, then probe.
//!
//! A rate limiter sits in front of every request. When its database is down, each call would
//! still wait for its timeout (or for a connection refusal) before the fallback decides. The
//! breaker counts consecutive transient failures ([`StoreError::is_transient`]); after
//! [`failure_threshold`](CircuitBreaker::failure_threshold) of them it *opens* and fails every
//! call at once with [`StoreError::CircuitOpen`], so the fallback decides in microseconds and the
//! database gets no load while it recovers. When the back-off has passed, exactly one call goes
//! through (*half-open*); its success closes the circuit, its failure opens it again for twice
//! as long, up to the maximum back-off.
//!
//! ```text
//!            N consecutive transient failures
//!  Closed ───────────────────────────────────────► Open ◄──────────┐
//!    ▲                                               │ back-off     │ probe failed
//!    │ probe succeeded                               ▼ elapsed      │ (back-off × 2, capped)
//!    └────────────────────────────────────────── Half-open ─────────┘
//! ```
//!
//! A non-transient error (a constraint violation, a schema mismatch) means the store answered:
//! it counts as a success for the breaker. A probe whose future is dropped (cancelled) leaves the
//! circuit open with no back-off, so the next call probes.
//!
//! # Metrics
//!
//! - `tokenlease_circuit_state{store}`: gauge, 0 closed, 1 open, 2 half-open.
//! - `tokenlease_circuit_transitions_total{store, to}`: counter of state changes, `to` one of
//!   `closed`, `open`, `half_open`.
//!
//!   Both are registered with the breaker's first store call (the state at 0, every `to` at
//!   zero), with the recorder installed then and under the breaker's final
//!   [`name`](CircuitBreaker::name), so a dashboard has a series before the first transition.
//! - `tokenlease_store_clock_skew_seconds{store}`: gauge, the store's clock (PostgreSQL's
//!   `now()` returned by every acquire) minus this process's wall clock at the middle of the
//!   round trip. Positive when the store is ahead. The limiter never depends on it (the store
//!   decides by its own clock, leases expire by the local monotonic clock); it is there so an
//!   operator sees a skewed host. The wall clock is read through [`Clock`]
//!   ([`SystemClock`] unless [`wall_clock`](CircuitBreaker::wall_clock) says otherwise), so a
//!   test can step it.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use tokenlease::Limiter;
//! use tokenlease::store::{CircuitBreaker, PostgresStore};
//!
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1/app").await?;
//! let store = CircuitBreaker::new(store)
//!     .failure_threshold(5)
//!     .backoff(Duration::from_millis(50), Duration::from_millis(500));
//! let limiter = Limiter::builder(store).build();
//! # let _ = limiter;
//! # Ok(()) }
//! ```

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Once};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use async_trait::async_trait;
use parking_lot::Mutex;

use super::{AcquireRequest, Acquired, BucketRow, GiveBack, Store, StoreError};
use crate::clock::{Clock, SystemClock, system_time_from_timestamp};
use crate::metrics::{CIRCUIT_STATE, CIRCUIT_TRANSITIONS, STORE_CLOCK_SKEW};

/// Where a [`CircuitBreaker`] stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CircuitState {
    /// Calls go to the store; consecutive transient failures are counted.
    Closed,
    /// Calls fail at once with [`StoreError::CircuitOpen`] until the back-off has passed.
    Open,
    /// One probe call is in flight; other calls fail at once.
    HalfOpen,
}

impl CircuitState {
    /// The gauge value: 0 closed, 1 open, 2 half-open.
    pub const fn as_gauge(self) -> f64 {
        match self {
            CircuitState::Closed => 0.0,
            CircuitState::Open => 1.0,
            CircuitState::HalfOpen => 2.0,
        }
    }

    const fn label(self) -> &'static str {
        match self {
            CircuitState::Closed => "closed",
            CircuitState::Open => "open",
            CircuitState::HalfOpen => "half_open",
        }
    }
}

/// The mutable part, behind a mutex that is never held across an `.await`.
#[derive(Debug)]
struct State {
    state: CircuitState,
    /// Consecutive transient failures while closed, counted once per stall: see
    /// [`CircuitBreaker::failure_threshold`].
    failures: u32,
    /// When the last counted failure was seen; a failed call sent before it failed in the same
    /// stall and counts no more. `None` after a success.
    failure_seen: Option<Instant>,
    /// While open: when a probe may go through.
    open_until: Instant,
    /// How long the next opening lasts; doubles after each failed probe, reset on close.
    next_backoff: Duration,
}

/// A [`Store`] wrapper that stops calling a failing store for a back-off, then probes.
///
/// A rate limiter sits in front of every request. When its database is down, each call would
/// still wait for its timeout (or for a connection refusal) before the fallback decides. The
/// breaker counts consecutive transient failures ([`StoreError::is_transient`]); after
/// [`failure_threshold`](CircuitBreaker::failure_threshold) of them it *opens* and fails every
/// call at once with [`StoreError::CircuitOpen`], so the fallback decides in microseconds and the
/// database gets no load while it recovers. When the back-off has passed, exactly one call goes
/// through (*half-open*); its success closes the circuit, its failure opens it again for twice
/// as long, up to the maximum back-off.
///
/// ```text
///            N consecutive transient failures
///  Closed ───────────────────────────────────────► Open ◄──────────┐
///    ▲                                               │ back-off     │ probe failed
///    │ probe succeeded                               ▼ elapsed      │ (back-off × 2, capped)
///    └────────────────────────────────────────── Half-open ─────────┘
/// ```
///
/// A non-transient error (a constraint violation, a schema mismatch) means the store answered:
/// it counts as a success for the breaker. A probe whose future is dropped (cancelled) leaves the
/// circuit open with no back-off, so the next call probes.
///
/// # Metrics
///
/// - `tokenlease_circuit_state{store}`: gauge, 0 closed, 1 open, 2 half-open.
/// - `tokenlease_circuit_transitions_total{store, to}`: counter of state changes, `to` one of
///   `closed`, `open`, `half_open`.
/// - `tokenlease_store_clock_skew_seconds{store}`: gauge, the store's clock (PostgreSQL's
///   `now()` returned by every acquire) minus this process's wall clock at the middle of the
///   round trip. Positive when the store is ahead. The limiter never depends on it (the store
///   decides by its own clock, leases expire by the local monotonic clock); it is there so an
///   operator sees a skewed host. The wall clock is read through [`Clock`]
///   ([`SystemClock`] unless [`wall_clock`](CircuitBreaker::wall_clock) says otherwise), so a
///   test can step it.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tokenlease::Limiter;
/// use tokenlease::store::{CircuitBreaker, PostgresStore};
///
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1/app").await?;
/// let store = CircuitBreaker::new(store)
///     .failure_threshold(5)
///     .backoff(Duration::from_millis(50), Duration::from_millis(500));
/// let limiter = Limiter::builder(store).build();
/// # let _ = limiter;
/// # Ok(()) }
/// ```
///
/// Defaults: opens after 5 consecutive transient failures, backs off 50 ms, doubling after
/// each failed probe up to 500 ms.
pub struct CircuitBreaker<S> {
    inner: S,
    name: String,
    threshold: u32,
    min_backoff: Duration,
    max_backoff: Duration,
    state: Mutex<State>,
    /// The local wall clock the skew is measured against.
    wall: Arc<dyn Clock>,
    /// The last skew measured, in nanoseconds (store minus local); `i64::MIN` before any.
    skew_nanos: AtomicI64,
    /// Registers the state gauge and the transition counters, once, at the first call.
    series: Once,
}

impl<S: fmt::Debug> fmt::Debug for CircuitBreaker<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreaker")
            .field("inner", &self.inner)
            .field("name", &self.name)
            .field("state", &self.state())
            .field("threshold", &self.threshold)
            .field("backoff", &(self.min_backoff..=self.max_backoff))
            .field("wall", &self.wall)
            .finish()
    }
}

/// # Construction
impl<S> CircuitBreaker<S> {
    /// A closed breaker around `inner` with the default settings.
    pub fn new(inner: S) -> Self {
        let min_backoff = Duration::from_millis(50);
        CircuitBreaker {
            inner,
            name: "default".to_owned(),
            threshold: 5,
            min_backoff,
            max_backoff: Duration::from_millis(500),
            state: Mutex::new(State {
                state: CircuitState::Closed,
                failures: 0,
                failure_seen: None,
                open_until: Instant::now(),
                next_backoff: min_backoff,
            }),
            wall: Arc::new(SystemClock),
            skew_nanos: AtomicI64::new(i64::MIN),
            series: Once::new(),
        }
    }

    /// Consecutive transient failures that open the circuit. Defaults to 5; at least 1.
    ///
    /// Failures are counted once per stall: a failed call that was sent before the last counted
    /// failure came back failed in the same stall and adds nothing. So `n` failures are `n`
    /// rounds of calls failing one after another, however many calls each round had in flight:
    /// a down or hung database opens the circuit after `n` rounds (each as long as a connection
    /// refusal or a call timeout), while one slow flush that times out every statement in flight
    /// at once (a checkpoint on a busy disk) does not.
    #[must_use]
    pub fn failure_threshold(mut self, n: u32) -> Self {
        self.threshold = n.max(1);
        self
    }

    /// The first back-off and its cap: each failed probe doubles the back-off up to `max`.
    /// Defaults to 50 ms and 500 ms, so the database is probed at least twice a second and a
    /// recovered database is used again within about `max` plus one call.
    ///
    /// `max` below `min` is raised to `min`; a zero `min` becomes 1 ms.
    #[must_use]
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.min_backoff = min.max(Duration::from_millis(1));
        self.max_backoff = max.max(self.min_backoff);
        self.state.get_mut().next_backoff = self.min_backoff;
        self
    }

    /// The local wall clock that [`clock_skew`](Self::clock_skew) and
    /// `tokenlease_store_clock_skew_seconds` compare the store's `now()` with. Defaults to
    /// [`SystemClock`]; a test passes a clock it can step. Only the skew reads it: the breaker's
    /// back-off runs on [`Instant`], and no decision depends on the wall clock.
    #[must_use]
    pub fn wall_clock(mut self, clock: impl Clock) -> Self {
        self.wall = Arc::new(clock);
        self
    }

    /// The `store` label on this breaker's metrics, to tell several breakers apart. Defaults
    /// to `default`.
    #[must_use]
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }
}

/// # Inspection
impl<S> CircuitBreaker<S> {
    /// The state now. An open circuit whose back-off has passed reads `Open` until a call probes.
    pub fn state(&self) -> CircuitState {
        self.state.lock().state
    }

    /// The store's clock minus this process's wall clock at the middle of the last acquire's
    /// round trip, in seconds (positive: the store is ahead). `None` before the first acquire.
    pub fn clock_skew(&self) -> Option<f64> {
        match self.skew_nanos.load(Ordering::Relaxed) {
            i64::MIN => None,
            n => Some(n as f64 / 1e9),
        }
    }

    /// The wrapped store.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped store, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped store, consuming the breaker.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// Permission to make one call; reports its outcome when finished or dropped.
struct Permit<'a, S> {
    breaker: &'a CircuitBreaker<S>,
    probe: bool,
    done: bool,
    /// When the call was let through.
    sent: Instant,
}

impl<S> Drop for Permit<'_, S> {
    fn drop(&mut self) {
        if self.probe && !self.done {
            // The probe was cancelled: stay open, but let the next call probe at once.
            let mut st = self.breaker.state.lock();
            if st.state == CircuitState::HalfOpen {
                st.open_until = Instant::now();
                self.breaker.transition(&mut st, CircuitState::Open);
            }
        }
    }
}

impl<S> CircuitBreaker<S> {
    /// Lets one call through, or refuses it at once.
    fn admit(&self) -> Result<Permit<'_, S>, StoreError> {
        let mut st = self.state.lock();
        match st.state {
            CircuitState::Closed => Ok(Permit {
                breaker: self,
                probe: false,
                done: false,
                sent: Instant::now(),
            }),
            CircuitState::Open => {
                let now = Instant::now();
                if now < st.open_until {
                    return Err(StoreError::CircuitOpen {
                        retry_in: st.open_until - now,
                    });
                }
                self.transition(&mut st, CircuitState::HalfOpen);
                Ok(Permit {
                    breaker: self,
                    probe: true,
                    done: false,
                    sent: now,
                })
            }
            CircuitState::HalfOpen => Err(StoreError::CircuitOpen {
                retry_in: self.min_backoff,
            }),
        }
    }

    /// Records a finished call's outcome.
    fn finish(&self, mut permit: Permit<'_, S>, failed: bool) {
        permit.done = true;
        let mut st = self.state.lock();
        match (st.state, permit.probe, failed) {
            // The store answered: close (from a probe) or reset the count.
            (CircuitState::HalfOpen, true, false) => {
                st.failures = 0;
                st.failure_seen = None;
                st.next_backoff = self.min_backoff;
                self.transition(&mut st, CircuitState::Closed);
            }
            (CircuitState::Closed, _, false) => {
                st.failures = 0;
                st.failure_seen = None;
            }
            (CircuitState::HalfOpen, true, true) => self.open(&mut st),
            // Sent before the last counted failure was seen: it failed in the same stall (a
            // checkpoint's slow flush times out every statement in flight at once), which was
            // counted already.
            (CircuitState::Closed, _, true)
                if st.failure_seen.is_some_and(|seen| permit.sent < seen) => {}
            (CircuitState::Closed, _, true) => {
                st.failures = st.failures.saturating_add(1);
                st.failure_seen = Some(Instant::now());
                if st.failures >= self.threshold {
                    self.open(&mut st);
                }
            }
            // A call admitted before the circuit opened, finishing late: it says nothing new.
            _ => {}
        }
    }

    fn open(&self, st: &mut State) {
        st.failures = 0;
        st.failure_seen = None;
        st.open_until = Instant::now() + st.next_backoff;
        st.next_backoff = std::cmp::min(st.next_backoff.saturating_mul(2), self.max_backoff);
        self.transition(st, CircuitState::Open);
    }

    fn transition(&self, st: &mut State, to: CircuitState) {
        if st.state == to {
            return;
        }
        st.state = to;
        metrics::gauge!(CIRCUIT_STATE, "store" => self.name.clone()).set(to.as_gauge());
        metrics::counter!(CIRCUIT_TRANSITIONS, "store" => self.name.clone(), "to" => to.label())
            .increment(1);
    }

    /// The state gauge (at the state now) and the transition counters (at zero).
    #[cold]
    fn register_series(&self) {
        let now = self.state();
        metrics::gauge!(CIRCUIT_STATE, "store" => self.name.clone()).set(now.as_gauge());
        for to in [
            CircuitState::Closed,
            CircuitState::Open,
            CircuitState::HalfOpen,
        ] {
            metrics::counter!(CIRCUIT_TRANSITIONS, "store" => self.name.clone(), "to" => to.label())
                .increment(0);
        }
    }

    /// Runs `call` if the circuit lets it through, and learns from its outcome.
    async fn call<T, F>(&self, call: impl FnOnce() -> F) -> Result<T, StoreError>
    where
        F: Future<Output = Result<T, StoreError>>,
    {
        self.series.call_once(|| self.register_series());
        let permit = self.admit()?;
        let result = call().await;
        let failed = matches!(&result, Err(e) if e.is_transient());
        self.finish(permit, failed);
        result
    }

    /// The local wall clock now.
    fn wall_now(&self) -> SystemTime {
        system_time_from_timestamp(self.wall.now())
    }

    /// Records the skew seen by one acquire that was sent at `sent` (wall clock) and took
    /// `rtt`.
    fn record_skew(&self, sent: SystemTime, rtt: Duration, answers: &[Acquired]) {
        let Some(last) = answers.last() else {
            return;
        };
        let middle = sent + rtt / 2;
        let skew = match last.store_now.duration_since(middle) {
            Ok(ahead) => i64::try_from(ahead.as_nanos()).unwrap_or(i64::MAX),
            Err(behind) => -i64::try_from(behind.duration().as_nanos()).unwrap_or(i64::MAX),
        };
        self.skew_nanos.store(skew, Ordering::Relaxed);
        metrics::gauge!(STORE_CLOCK_SKEW, "store" => self.name.clone()).set(skew as f64 / 1e9);
    }
}

#[async_trait]
impl<S: Store> Store for CircuitBreaker<S> {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        let (sent, started) = (self.wall_now(), Instant::now());
        let acquired = self.call(|| self.inner.acquire(request)).await?;
        self.record_skew(sent, started.elapsed(), std::slice::from_ref(&acquired));
        Ok(acquired)
    }

    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        let (sent, started) = (self.wall_now(), Instant::now());
        let acquired = self.call(|| self.inner.acquire_many(requests)).await?;
        self.record_skew(sent, started.elapsed(), &acquired);
        Ok(acquired)
    }

    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        self.call(|| self.inner.give_back(returns)).await
    }

    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        self.call(|| self.inner.delete_idle(limit)).await
    }

    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        self.call(|| self.inner.inspect(key)).await
    }

    fn call_timeout(&self) -> Option<Duration> {
        self.inner.call_timeout()
    }

    fn max_concurrent_calls(&self) -> Option<usize> {
        self.inner.max_concurrent_calls()
    }

    fn partition(&self, key: &str) -> usize {
        self.inner.partition(key)
    }
}

#[cfg(test)]
mod tests {
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

    async fn sleep_ms(ms: u64) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    fn is_open_error(r: &Result<Acquired, StoreError>) -> bool {
        matches!(r, Err(StoreError::CircuitOpen { .. }))
    }

    fn is_timeout(r: &Result<Acquired, StoreError>) -> bool {
        matches!(r, Err(StoreError::Timeout { .. }))
    }

    #[tokio::test]
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
        sleep_ms(110).await;
        assert!(is_timeout(&take(&b).await));
        assert_eq!(b.state(), CircuitState::Open);
        assert_eq!(flaky.calls.load(Ordering::SeqCst), calls + 1);
        sleep_ms(110).await;
        assert!(is_open_error(&take(&b).await), "200 ms back-off");
        sleep_ms(100).await;
        // The store is back: the probe succeeds and closes the circuit.
        flaky.failing.store(false, Ordering::SeqCst);
        assert!(take(&b).await.is_ok());
        assert_eq!(b.state(), CircuitState::Closed);
        assert!(take(&b).await.is_ok());
        assert!(b.clock_skew().is_some());
    }

    #[tokio::test]
    async fn backoff_is_capped_and_reset_on_close() {
        let flaky = Flaky::default();
        let b = breaker(&flaky);
        flaky.failing.store(true, Ordering::SeqCst);
        for _ in 0..3 {
            let _ = take(&b).await;
        }
        // Probes fail after 100, 200, 400, 400 ms back-offs (cap 400).
        for wait in [100, 200, 400, 400] {
            sleep_ms(wait / 2).await;
            assert!(is_open_error(&take(&b).await), "back-off {wait} ms");
            sleep_ms(wait / 2 + 10).await;
            assert!(is_timeout(&take(&b).await), "probe after {wait} ms");
        }
        sleep_ms(410).await;
        flaky.failing.store(false, Ordering::SeqCst);
        assert!(take(&b).await.is_ok());
        // Closed again; the next opening starts from the minimum back-off.
        flaky.failing.store(true, Ordering::SeqCst);
        for _ in 0..3 {
            let _ = take(&b).await;
        }
        sleep_ms(110).await;
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

    #[tokio::test]
    async fn only_one_probe_at_a_time_and_a_cancelled_probe_reopens() {
        let flaky = Flaky::default();
        let b = breaker(&flaky);
        flaky.failing.store(true, Ordering::SeqCst);
        for _ in 0..3 {
            let _ = take(&b).await;
        }
        sleep_ms(110).await;
        // Take the half-open slot by hand, as a probe in flight would.
        let permit = b.admit().expect("probe admitted");
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

    /// The skew is the store's clock minus the injected wall clock: a wall clock an hour behind
    /// reads +1 h, an hour ahead −1 h; the breaker's back-off (on `Instant`) is unaffected.
    #[tokio::test]
    async fn skew_follows_the_injected_wall_clock() {
        use crate::clock::{ManualClock, timestamp_from_system_time};
        let hour = 3_600_000_000_000u64;
        let real = || timestamp_from_system_time(SystemTime::now());
        let wall = ManualClock::new(real());
        let b = breaker(&Flaky::default()).wall_clock(wall.clone());
        assert!(take(&b).await.is_ok());
        let same = b.clock_skew().expect("a skew");
        assert!(same.abs() < 0.05, "skew {same} s against the right time");
        for (set, expected) in [
            (real().as_nanos() - hour, 3600.0),
            (real().as_nanos() + hour, -3600.0),
        ] {
            wall.set(crate::bucket::Timestamp::from_nanos(set));
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
}
