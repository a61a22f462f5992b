//! Giving freed heap memory back to the operating system, for the long-running demo.
//!
//! The library frees what a flood of keys made once it is no longer needed (the fallback's local
//! buckets once they have refilled, the maps once a quarter full; docs/design/memory.md), but glibc's
//! allocator keeps freed chunks that lie between live ones, so the process's RSS stays where the
//! flood took it. `malloc_trim(0)` hands every whole free page inside the heap back (it
//! `madvise`s them away, not only the top of the heap), in every arena. The demo calls it every
//! [`TRIM_EVERY`], on a blocking thread because it walks each arena's free chunks under that
//! arena's lock. Other allocators and other C libraries give memory back on their own terms;
//! there this does nothing.
//!
//! Allocations of 128 KiB and more always get pages of their own (`mmap`), handed back whole
//! when freed: glibc raises that threshold, by default, to the largest such block freed (up to
//! 32 MiB), after which the large tables and buffers of a reload to 65,000 plans came from the
//! heap, and the small allocations that outlived them held its pages (the demo kept 18 to 40 MB
//! after such a reload and the return to one plan, against 12 to 15 MB with the threshold kept,
//! from 9 MB at start; release build).
//!
//! The library never calls either: the allocator is the application's to choose and to tune.

use std::time::Duration;

/// How often the demo gives free heap pages back.
pub(crate) const TRIM_EVERY: Duration = Duration::from_secs(5);

/// Gives free heap pages back every [`TRIM_EVERY`], for as long as the runtime runs, and keeps
/// large allocations on pages of their own.
pub(crate) fn spawn_periodic() {
    if !SUPPORTED {
        return;
    }
    keep_mmap_threshold();
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

/// The `mmap` threshold of glibc's allocator, fixed (module docs).
const MMAP_THRESHOLD: i32 = 128 * 1024;

/// `mallopt(M_MMAP_THRESHOLD, 128 KiB)`: fixing it also stops glibc from raising it.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn keep_mmap_threshold() {
    // SAFETY: mallopt takes no pointer and only sets the allocator's own parameter, under its
    // own lock; any thread may call it at any time.
    let _ = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) };
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_mmap_threshold() {}
