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
//!   decides by its own clock, leases expire by tokio's clock); it is there so an operator sees a
//!   skewed host. The wall clock is read through a [`WallClock`] ([`SystemClock`] unless
//!   [`wall_clock`](CircuitBreaker::wall_clock) says otherwise), so a test can step it.
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
use crate::clock::{SystemClock, WallClock, system_time_from_timestamp};
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
///   decides by its own clock, leases expire by tokio's clock); it is there so an operator sees a
///   skewed host. The wall clock is read through a [`WallClock`] ([`SystemClock`] unless
///   [`wall_clock`](CircuitBreaker::wall_clock) says otherwise), so a test can step it.
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
    wall: Arc<dyn WallClock>,
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
                open_until: crate::clock::instant(),
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
    /// back-off, its failure count and the skew's round trip run on tokio's clock (read once
    /// when a call is let through and once when it returns, so a test that pauses tokio's time
    /// drives them), and no decision depends on the wall clock.
    #[must_use]
    pub fn wall_clock(mut self, clock: impl WallClock) -> Self {
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
                st.open_until = crate::clock::instant();
                self.breaker.transition(&mut st, CircuitState::Open);
            }
        }
    }
}

impl<S> CircuitBreaker<S> {
    /// Lets one call through at `now`, or refuses it at once.
    fn admit(&self, now: Instant) -> Result<Permit<'_, S>, StoreError> {
        let mut st = self.state.lock();
        match st.state {
            CircuitState::Closed => Ok(Permit {
                breaker: self,
                probe: false,
                done: false,
                sent: now,
            }),
            CircuitState::Open => {
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

    /// Records a finished call's outcome, at `now`.
    fn finish(&self, mut permit: Permit<'_, S>, failed: bool, now: Instant) {
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
            (CircuitState::HalfOpen, true, true) => self.open(&mut st, now),
            // Sent before the last counted failure was seen: it failed in the same stall (a
            // checkpoint's slow flush times out every statement in flight at once), which was
            // counted already.
            (CircuitState::Closed, _, true)
                if st.failure_seen.is_some_and(|seen| permit.sent < seen) => {}
            (CircuitState::Closed, _, true) => {
                st.failures = st.failures.saturating_add(1);
                st.failure_seen = Some(now);
                if st.failures >= self.threshold {
                    self.open(&mut st, now);
                }
            }
            // A call admitted before the circuit opened, finishing late: it says nothing new.
            _ => {}
        }
    }

    fn open(&self, st: &mut State, now: Instant) {
        st.failures = 0;
        st.failure_seen = None;
        st.open_until = now + st.next_backoff;
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

    /// Runs `call` if the circuit lets it through at `started`, and learns from its outcome;
    /// returns it with the clock's reading when it returned.
    async fn call_at<T, F>(
        &self,
        started: Instant,
        call: impl FnOnce() -> F,
    ) -> Result<(T, Instant), StoreError>
    where
        F: Future<Output = Result<T, StoreError>>,
    {
        self.series.call_once(|| self.register_series());
        let permit = self.admit(started)?;
        let result = call().await;
        let ended = crate::clock::instant();
        let failed = matches!(&result, Err(e) if e.is_transient());
        self.finish(permit, failed, ended);
        result.map(|t| (t, ended))
    }

    /// [`call_at`](Self::call_at) for a call answering per request: it failed when any
    /// answer is a transient error.
    async fn each_at<T>(
        &self,
        started: Instant,
        call: impl Future<Output = Vec<Result<T, StoreError>>>,
    ) -> Result<(Vec<Result<T, StoreError>>, Instant), StoreError> {
        self.series.call_once(|| self.register_series());
        let permit = self.admit(started)?;
        let answers = call.await;
        let ended = crate::clock::instant();
        let failed = answers
            .iter()
            .any(|a| matches!(a, Err(e) if e.is_transient()));
        self.finish(permit, failed, ended);
        Ok((answers, ended))
    }

    /// [`call_at`](Self::call_at) now, for a call whose duration nothing needs.
    async fn call<T, F>(&self, call: impl FnOnce() -> F) -> Result<T, StoreError>
    where
        F: Future<Output = Result<T, StoreError>>,
    {
        let started = crate::clock::instant();
        self.call_at(started, call).await.map(|(t, _)| t)
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
        let (sent, started) = (self.wall_now(), crate::clock::instant());
        let (acquired, ended) = self
            .call_at(started, || self.inner.acquire(request))
            .await?;
        let rtt = ended.saturating_duration_since(started);
        self.record_skew(sent, rtt, std::slice::from_ref(&acquired));
        Ok(acquired)
    }

    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        let (sent, started) = (self.wall_now(), crate::clock::instant());
        let (acquired, ended) = self
            .call_at(started, || self.inner.acquire_many(requests))
            .await?;
        let rtt = ended.saturating_duration_since(started);
        self.record_skew(sent, rtt, &acquired);
        Ok(acquired)
    }

    /// Forwarded, so that the inner store's per-request answers reach the caller (a request
    /// the store refused alone fails alone). The call counts as failed when any request
    /// failed transiently, as the same batch through `acquire_many` would.
    async fn acquire_each(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Vec<Result<Acquired, StoreError>> {
        let (sent, started) = (self.wall_now(), crate::clock::instant());
        let (answers, ended) = match self
            .each_at(started, self.inner.acquire_each(requests))
            .await
        {
            Ok(done) => done,
            Err(err) => return requests.iter().map(|_| Err(err.clone())).collect(),
        };
        let rtt = ended.saturating_duration_since(started);
        let decided: Vec<Acquired> = answers.iter().filter_map(|a| a.clone().ok()).collect();
        self.record_skew(sent, rtt, &decided);
        answers
    }

    /// Forwarded, as [`acquire_each`](Self::acquire_each).
    async fn give_back_each(&self, returns: &[GiveBack<'_>]) -> Vec<Result<(), StoreError>> {
        let started = crate::clock::instant();
        match self
            .each_at(started, self.inner.give_back_each(returns))
            .await
        {
            Ok((answers, _)) => answers,
            Err(err) => returns.iter().map(|_| Err(err.clone())).collect(),
        }
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

    fn partition_calls(&self, part: usize) -> Option<usize> {
        self.inner.partition_calls(part)
    }

    fn partition(&self, key: &str) -> usize {
        self.inner.partition(key)
    }
}

#[cfg(test)]
mod tests;
