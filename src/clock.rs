//! The library's one local clock, tokio's, and the wall clock it reports with.
//!
//! The shared bucket never reads a local clock: PostgreSQL decides with `now()`. Everything the
//! library times locally (lease expiry, the lease actor's refill timing, the direct-mode
//! coalescer, the fallback and its local buckets, the outage-debt ledger, the circuit breaker's
//! back-off, the store's call deadlines, the in-memory store) reads tokio's clock through
//! `instant()` and `now()` (crate-private), the only two functions of the library that read it,
//! and its timers (`sleep_until`, `timeout_at`, `interval`) run on the same clock. So a reading
//! and a timer never disagree, and a test that pauses tokio's time (`start_paused`,
//! `tokio::time::pause`, `tokio::time::advance`) drives all of it (docs/design/time.md).
//!
//! `now()` is that clock as a [`Timestamp`]: the wall clock as it stood when the process first
//! read the time, advanced by tokio's clock since, so a wall clock stepped by NTP or by hand
//! changes no decision. The wall clock itself, which may step either way, is read only for
//! reporting, through a [`WallClock`] ([`SystemClock`] unless a test steps one): the circuit
//! breaker's `tokenlease_store_clock_skew_seconds`, see
//! [`CircuitBreaker::wall_clock`](crate::store::CircuitBreaker::wall_clock).

use std::fmt;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use crate::bucket::Timestamp;

/// Now on tokio's clock: what deadlines, lifetimes, back-offs and latencies count from. A test
/// that pauses tokio's time moves it with `tokio::time::advance`.
///
/// The limiter reads it once per call and passes that reading down (docs/design/time.md).
#[inline]
pub(crate) fn instant() -> Instant {
    Instant::now()
}

/// Now on tokio's clock as a [`Timestamp`] (nanoseconds since the Unix epoch): what the
/// in-memory store's and the fallback's local buckets refill by.
///
/// The wall clock is read once per process, with the monotonic clock beside it; every reading
/// after that is that wall-clock time moved by how far tokio's clock stands from that
/// monotonic reading (backwards too: a paused runtime may stand before it). So it never steps
/// when the wall clock does, stands still while a test has paused tokio's time, and moves
/// exactly as far as the test advances it.
pub(crate) fn now() -> Timestamp {
    timestamp_at(instant())
}

/// The [`Timestamp`] that [`now`] reads at tokio instant `at`.
fn timestamp_at(at: Instant) -> Timestamp {
    /// The wall clock and the monotonic clock, read together once per process.
    static ORIGIN: OnceLock<(std::time::Instant, Timestamp)> = OnceLock::new();
    let (origin, wall) = *ORIGIN.get_or_init(|| {
        (
            std::time::Instant::now(),
            timestamp_from_system_time(SystemTime::now()),
        )
    });
    let at = at.into_std();
    match at.checked_duration_since(origin) {
        Some(after) => wall.saturating_add(nanos(after)),
        None => Timestamp::from_nanos(wall.as_nanos().saturating_sub(nanos(origin - at))),
    }
}

/// A duration in nanoseconds, saturating at `u64::MAX` (584 years).
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A wall clock: what the circuit breaker's skew gauge compares the store's `now()` with
/// ([`CircuitBreaker::wall_clock`](crate::store::CircuitBreaker::wall_clock)).
///
/// Nothing that decides reads it: decisions run on tokio's clock (`instant()`, `now()`), which
/// a test drives by pausing tokio's time. A wall clock is a trait of its own because a test of
/// the gauge must step it, by an hour either way, while tokio's clock runs on: [`SystemClock`]
/// goes wherever the host's wall clock goes; a test passes one it sets by hand.
pub trait WallClock: Send + Sync + fmt::Debug + 'static {
    /// The wall-clock time now, in nanoseconds since the Unix epoch.
    fn now(&self) -> Timestamp;
}

/// The host's wall clock ([`SystemTime::now`]), read at every call: it steps when the wall clock
/// is set, backwards included. For reporting only; nothing that decides reads it.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl WallClock for SystemClock {
    fn now(&self) -> Timestamp {
        timestamp_from_system_time(SystemTime::now())
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
    UNIX_EPOCH + Duration::from_nanos(t.as_nanos())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The local clock is tokio's, so a paused runtime drives both readings, by exactly what
    /// the test advances.
    #[tokio::test(start_paused = true)]
    async fn the_clock_reads_tokios_paused_time() {
        let (t0, w0) = (instant(), now());
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(instant() - t0, Duration::from_secs(3));
        assert_eq!(now().as_nanos() - w0.as_nanos(), 3_000_000_000);
    }

    /// Tokio instants before the process's first reading map before its wall-clock time, by
    /// as much: the timestamps keep the instants' order and distances whichever side they are
    /// on.
    #[tokio::test(start_paused = true)]
    async fn instants_on_either_side_of_the_origin_keep_their_distance() {
        let t = instant();
        let at = now();
        let early = t - Duration::from_secs(5);
        let late = t + Duration::from_secs(7);
        assert_eq!(
            at.as_nanos() - timestamp_at(early).as_nanos(),
            5_000_000_000
        );
        assert_eq!(timestamp_at(late).as_nanos() - at.as_nanos(), 7_000_000_000);
    }
}
