//! Clocks for the parts that keep time locally.
//!
//! The shared bucket never reads a local clock: PostgreSQL decides with `now()`. Local state (the
//! in-memory store, lease expiry, local fallback buckets) reads time through [`Clock`], so tests
//! can drive it by hand with [`ManualClock`].
//!
//! Two kinds of clock implement the trait. [`MonotonicClock`] reads the wall clock once, then
//! advances with tokio's [`Instant`] (the process's monotonic clock, unless a test paused
//! tokio's time: the lease table, its actor, the breaker and the fallback read the same clock,
//! so one paused runtime drives them all): everything that decides (lease expiry, local buckets) uses it, so
//! a wall clock stepped by NTP or by hand changes no decision. [`SystemClock`] is the wall clock
//! itself, which may step either way; only reporting reads it (the circuit breaker's
//! `tokenlease_store_clock_skew_seconds`, see
//! [`CircuitBreaker::wall_clock`](crate::store::CircuitBreaker::wall_clock)).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use crate::bucket::Timestamp;

/// A source of [`Timestamp`]s (nanoseconds since the Unix epoch) and of tokio [`Instant`]s.
///
/// [`MonotonicClock`] never goes backwards on its own; [`SystemClock`] goes wherever the host's
/// wall clock goes; [`ManualClock`] goes where a test sets it.
///
/// The limiter reads time only through the clock given to
/// [`LimiterBuilder::clock`](crate::limiter::LimiterBuilder::clock) (by default a [`MonotonicClock`]),
/// once per call, and passes that reading down (docs/design/time.md).
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;

    /// The current time as a tokio [`Instant`], for deadlines and durations (lease expiry, the
    /// circuit breaker's backoff, a call's deadline). The default reads tokio's clock, which a
    /// test can pause and advance (`tokio::time::pause`); a clock that moves by hand overrides
    /// it so that its instants move with [`now`](Self::now).
    fn instant(&self) -> Instant {
        Instant::now()
    }
}

/// The clock that everything keeping time locally shares: the one given to the builder.
pub(crate) type SharedClock = Arc<dyn Clock>;

/// The clock of a limiter or store built without one: the process's monotonic clock.
pub(crate) fn default_clock() -> SharedClock {
    Arc::new(MonotonicClock::new())
}

/// The process's monotonic clock, reading nanoseconds since the Unix epoch as the wall clock
/// stood when this value was created, then advancing with tokio's [`Instant`] (so it never
/// steps back when the wall clock does, and stands still while a test has paused tokio's time).
#[derive(Clone, Copy, Debug)]
pub struct MonotonicClock {
    origin: Instant,
    origin_wall: Timestamp,
}

impl MonotonicClock {
    /// A clock that reads the wall-clock time now.
    pub fn new() -> Self {
        MonotonicClock {
            origin: Instant::now(),
            origin_wall: timestamp_from_system_time(SystemTime::now()),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now(&self) -> Timestamp {
        let elapsed = u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.origin_wall.saturating_add(elapsed)
    }

    #[inline]
    fn instant(&self) -> Instant {
        Instant::now()
    }
}

/// The host's wall clock ([`SystemTime::now`]), read at every call: it steps when the wall clock
/// is set, backwards included. For reporting only; nothing that decides reads it.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        timestamp_from_system_time(SystemTime::now())
    }
}

/// A clock that moves only when told to; cheap to clone, all clones share one time.
///
/// Its [`instant`](Clock::instant) is tokio's clock as it stood when the clock was made, plus
/// however far the clock was moved since (never before that instant).
#[derive(Clone, Debug)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
    start: u64,
    origin: Instant,
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new(Timestamp::from_nanos(0))
    }
}

impl ManualClock {
    /// A clock that reads `start`.
    pub fn new(start: Timestamp) -> Self {
        ManualClock {
            nanos: Arc::new(AtomicU64::new(start.as_nanos())),
            start: start.as_nanos(),
            origin: Instant::now(),
        }
    }

    /// Moves the clock forward by `nanos`.
    pub fn advance(&self, nanos: u64) {
        self.nanos.fetch_add(nanos, Ordering::SeqCst);
    }

    /// Sets the clock to `to`, which may be earlier than now (to test clocks that step back).
    pub fn set(&self, to: Timestamp) {
        self.nanos.store(to.as_nanos(), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_nanos(self.nanos.load(Ordering::SeqCst))
    }

    fn instant(&self) -> Instant {
        let moved = self.nanos.load(Ordering::SeqCst).saturating_sub(self.start);
        self.origin + std::time::Duration::from_nanos(moved)
    }
}

/// Converts a wall-clock time (as PostgreSQL's `now()` arrives) to nanoseconds since the Unix
/// epoch; times before 1970 read as zero.
pub fn timestamp_from_system_time(t: SystemTime) -> Timestamp {
    let nanos = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    Timestamp::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

/// Converts nanoseconds since the Unix epoch back to a wall-clock time.
pub fn system_time_from_timestamp(t: Timestamp) -> SystemTime {
    UNIX_EPOCH + std::time::Duration::from_nanos(t.as_nanos())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A manual clock's instants move with it, and only with it: forward by what it advanced,
    /// never before the instant it was made at.
    #[tokio::test(start_paused = true)]
    async fn a_manual_clocks_instants_move_with_it() {
        let clock = ManualClock::new(Timestamp::from_nanos(5_000));
        let start = clock.instant();
        tokio::time::advance(std::time::Duration::from_secs(1)).await;
        assert_eq!(clock.instant(), start, "tokio's time does not move it");
        clock.advance(2_000_000);
        assert_eq!(clock.instant() - start, std::time::Duration::from_millis(2));
        clock.set(Timestamp::from_nanos(0));
        assert_eq!(
            clock.instant(),
            start,
            "set before its start: its first instant"
        );
    }

    /// The default clock's instants are tokio's, so a paused runtime drives it.
    #[tokio::test(start_paused = true)]
    async fn the_default_clock_reads_tokios_paused_time() {
        let clock = default_clock();
        let (t0, w0) = (clock.instant(), clock.now());
        tokio::time::advance(std::time::Duration::from_secs(3)).await;
        assert_eq!(clock.instant() - t0, std::time::Duration::from_secs(3));
        assert_eq!(clock.now().as_nanos() - w0.as_nanos(), 3_000_000_000);
    }
}
