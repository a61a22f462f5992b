//! Giving freed heap memory back to the operating system, for the long-running demo.
//!
//! The library frees what a flood of keys made once it is no longer needed (the fallback's local
//! buckets once they have refilled, the maps once a quarter full; DESIGN.md §10), but glibc's
//! allocator keeps freed chunks that lie between live ones, so the process's RSS stays where the
//! flood took it. `malloc_trim(0)` hands every whole free page inside the heap back (it
//! `madvise`s them away, not only the top of the heap), in every arena. The demo calls it every
//! [`TRIM_EVERY`], on a blocking thread because it walks each arena's free chunks under that
//! arena's lock. Other allocators and other C libraries give memory back on their own terms;
//! there this does nothing.
//!
//! The library never calls it: the allocator is the application's to choose and to tune.

use std::time::Duration;

/// How often the demo gives free heap pages back.
pub(crate) const TRIM_EVERY: Duration = Duration::from_secs(5);

/// Gives free heap pages back every [`TRIM_EVERY`], for as long as the runtime runs.
pub(crate) fn spawn_periodic() {
    if !SUPPORTED {
        return;
    }
    tokio::spawn(async {
        let mut every = tokio::time::interval(TRIM_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        every.tick().await;
        loop {
            every.tick().await;
            // It holds each arena's lock while it walks that arena: not on a worker thread.
            let _ = tokio::task::spawn_blocking(trim).await;
        }
    });
}

/// Whether [`trim`] does anything on this platform.
const SUPPORTED: bool = cfg!(all(target_os = "linux", target_env = "gnu"));

/// `malloc_trim(0)`: returns whether glibc gave memory back.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn trim() -> bool {
    // SAFETY: malloc_trim takes no pointer and only works on the allocator's own state, under
    // the allocator's own locks; any thread may call it at any time.
    unsafe { libc::malloc_trim(0) != 0 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() -> bool {
    false
}
