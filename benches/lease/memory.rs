//! Memory per key, each side in a fresh process: tokenlease's lease table and `MemoryStore`
//! built the README's way, and governor's keyed limiter, at 10,000, 100,000 and 1,000,000 keys.
//!
//! Measuring both sides in one process is unfair to neither on purpose but wrong all the same:
//! the side measured second reuses the memory the first one freed, and its RSS barely grows. So
//! the bench re-executes itself once per (side, key count) with [`CHILD_ENV`] set to
//! `tokenlease:N` or `governor:N`; the child builds its limiter, warms N keys and prints one line
//! (`memory SIDE N RSS HEAP CHUNKS STORE_KEYS LIVE TABLE_KEYS`), and the parent prints the table.
//!
//! - **RSS per key**: growth of `/proc/self/statm`'s resident pages from just before the limiter
//!   is built to when every key answers from a live lease, over N. The key strings the bench
//!   calls with are made before the first reading, so they are not counted (governor's map keeps
//!   its own copy of each key, and that is counted).
//! - **Heap per key**: growth of the bytes live on the heap over the same span, counted by
//!   [`Counting`] (this bench binary's global allocator, counting only in a child): what was
//!   asked for, and what glibc's `malloc` hands out for it (8 bytes of header, rounded up to 16,
//!   at least 32: "chunks").
//! - **Keys at the end**: keys in the lease table, keys answering from a live lease, and
//!   buckets `MemoryStore` held (it deletes buckets that refilled to
//!   full, and the bench's bucket refills within microseconds, so most are gone by then).
//!
//! `TOKENLEASE_BENCH_ONLY=memory` prints this table alone; `TOKENLEASE_BENCH_KEYS` picks the key
//! counts as for the other groups.

use std::alloc::{GlobalAlloc, Layout, System};
use std::num::NonZeroU32;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

use governor::{Quota, RateLimiter};
use tokenlease::Limiter;
use tokenlease::policy::Policies;
use tokenlease::store::MemoryStore;

use super::readme::{POLICY, key_name, rss_bytes};

/// Set in a child: `tokenlease:N` or `governor:N`.
pub(crate) const CHILD_ENV: &str = "TOKENLEASE_BENCH_MEMORY_CHILD";

/// The key counts measured.
pub(crate) const KEY_COUNTS: [usize; 3] = [10_000, 100_000, 1_000_000];

/// Whether [`Counting`] counts (only in a child: the criterion runs pay one predictable branch).
static COUNTING: AtomicBool = AtomicBool::new(false);
/// Bytes live on the heap, as asked for.
static LIVE: AtomicI64 = AtomicI64::new(0);
/// The same in glibc's chunk sizes.
static CHUNKS: AtomicI64 = AtomicI64::new(0);

/// The size of the chunk glibc's `malloc` hands out for `size` bytes (below its mmap threshold):
/// 8 bytes of header, rounded up to 16, at least 32.
fn chunk(size: usize) -> i64 {
    ((size + 8 + 15) & !15).max(32) as i64
}

/// Live chunk bytes by chunk size (16-byte classes below 4 KiB, then one class per power of two),
/// for `TOKENLEASE_BENCH_MEMORY_SIZES=1`: where the bytes per key go.
static BY_SIZE: [AtomicI64; SIZE_CLASSES] = [const { AtomicI64::new(0) }; SIZE_CLASSES];
const SMALL_CLASSES: usize = 4096 / 16;
const SIZE_CLASSES: usize = SMALL_CLASSES + 40;

/// The class of a chunk of `chunk` bytes, and the smallest size in it.
fn class(chunk: usize) -> usize {
    if chunk < 4096 {
        chunk / 16
    } else {
        (SMALL_CLASSES + chunk.ilog2() as usize - 12).min(SIZE_CLASSES - 1)
    }
}

fn class_label(class: usize) -> String {
    if class < SMALL_CLASSES {
        format!("{} B", class * 16)
    } else {
        format!(
            "{}-{} KiB",
            4 << (class - SMALL_CLASSES),
            8 << (class - SMALL_CLASSES)
        )
    }
}

fn count(size: usize, sign: i64) {
    if COUNTING.load(Ordering::Relaxed) {
        LIVE.fetch_add(sign * size as i64, Ordering::Relaxed);
        let chunk = chunk(size);
        CHUNKS.fetch_add(sign * chunk, Ordering::Relaxed);
        BY_SIZE[class(chunk as usize)].fetch_add(sign * chunk, Ordering::Relaxed);
    }
}

/// Prints, to stderr, the chunk sizes holding the most live bytes per key.
fn print_sizes(n: usize) {
    let mut classes: Vec<(usize, i64)> = BY_SIZE
        .iter()
        .enumerate()
        .map(|(c, b)| (c, b.load(Ordering::Relaxed)))
        .filter(|&(_, b)| b != 0)
        .collect();
    classes.sort_by_key(|&(_, b)| -b.abs());
    for (class, bytes) in classes.into_iter().take(12) {
        let label = class_label(class);
        eprintln!(
            "  chunks of {label}: {:.1} B per key",
            bytes as f64 / n as f64
        );
    }
}

/// The system allocator, counting live bytes while [`COUNTING`] is set.
#[derive(Debug)]
pub(crate) struct Counting;

// SAFETY: every call is forwarded unchanged to `System`; the counters are plain atomics.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size(), 1);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size(), 1);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(layout.size(), -1);
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded with the caller's pointer, layout and size.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(layout.size(), -1);
            count(new_size, 1);
        }
        p
    }
}

/// What one child measured.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Measured {
    rss: f64,
    heap: f64,
    chunks: f64,
    store_keys: usize,
    live: usize,
    table_keys: usize,
}

/// Calls every key three times from 64 tasks (the first call of a key waits for its first
/// lease), then checks each with `try_acquire_now_with` (which never waits) until all answer from
/// a live lease or three passes have gone by; returns how many keys did at the last pass.
///
/// Not the README bench's warm-up: that one insists on every key at once, and at
/// 1,000,000 keys on a busy machine leases expire during its passes, so it takes minutes. A
/// key's memory does not depend on whether its lease is live at the moment of the reading.
fn warm(
    runtime: &tokio::runtime::Runtime,
    limiter: &Limiter,
    policies: &Policies,
    keys: &Arc<Vec<String>>,
) -> usize {
    let plan = policies.default_plan().expect("default plan");
    runtime.block_on(async {
        let tasks = 64.min(keys.len());
        let handles: Vec<_> = (0..tasks)
            .map(|t| {
                let (limiter, keys) = (limiter.clone(), Arc::clone(keys));
                tokio::spawn(async move {
                    for key in keys.iter().skip(t).step_by(tasks) {
                        for _ in 0..3 {
                            let d = limiter.try_acquire(key, 1.0).await;
                            assert!(d.expect("decision").allowed);
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.await.expect("warm task");
        }
    });
    let mut live = 0;
    for _ in 0..3 {
        live = keys
            .iter()
            .filter(|key| matches!(limiter.try_acquire_now_with(plan, key, 1.0), Ok(Some(_))))
            .count();
        if live == keys.len() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    live
}

/// Runs the child's measurement (`spec` is `tokenlease:N` or `governor:N`) and prints its line.
pub(crate) fn child(spec: &str) {
    let (side, n) = spec.split_once(':').expect("SIDE:N");
    let n: usize = n.parse().expect("key count");
    let keys: Arc<Vec<String>> = Arc::new((0..n).map(key_name).collect());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let policies = Policies::from_json_str(POLICY, None).expect("policy");
    COUNTING.store(true, Ordering::Relaxed);
    let (rss0, live0, chunks0) = (
        rss_bytes(),
        LIVE.load(Ordering::Relaxed),
        CHUNKS.load(Ordering::Relaxed),
    );
    let mut store_keys = 0;
    let mut live = n;
    let mut table_keys = n;
    // Kept alive until the last reading.
    let _keep: Box<dyn std::any::Any> = match side {
        "tokenlease" => {
            let store = MemoryStore::new();
            let probe = store.clone();
            let limiter = runtime
                .block_on(async { Limiter::builder(store).policies(policies.clone()).build() });
            live = warm(&runtime, &limiter, &policies, &keys);
            store_keys = probe.len();
            table_keys = limiter.lease_stats().map_or(0, |s| s.keys);
            Box::new(limiter)
        }
        "governor" => {
            let keyed = RateLimiter::keyed(Quota::per_second(NonZeroU32::MAX));
            for key in keys.iter() {
                for _ in 0..3 {
                    assert!(keyed.check_key(key).is_ok());
                }
            }
            Box::new(keyed)
        }
        other => panic!("unknown side {other}"),
    };
    let per_key = |bytes: i64| bytes as f64 / n as f64;
    if std::env::var_os("TOKENLEASE_BENCH_MEMORY_SIZES").is_some() {
        eprintln!("memory {side} {n}, live heap by chunk size:");
        print_sizes(n);
    }
    println!(
        "memory {side} {n} {:.1} {:.1} {:.1} {store_keys} {live} {table_keys}",
        per_key(rss_bytes() as i64 - rss0 as i64),
        per_key(LIVE.load(Ordering::Relaxed) - live0),
        per_key(CHUNKS.load(Ordering::Relaxed) - chunks0),
    );
}

/// Measures `side` at `n` keys in a fresh process (this binary, re-executed).
fn measure(side: &str, n: usize) -> Option<Measured> {
    let exe = std::env::current_exe().ok()?;
    let out = Command::new(exe)
        .env(CHILD_ENV, format!("{side}:{n}"))
        .stderr(std::process::Stdio::inherit())
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!("memory child {side}:{n} failed: {}", out.status);
        return None;
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().rev().find(|l| l.starts_with("memory "))?;
    let f: Vec<&str> = line.split_whitespace().collect();
    Some(Measured {
        rss: f.get(3)?.parse().ok()?,
        heap: f.get(4)?.parse().ok()?,
        chunks: f.get(5)?.parse().ok()?,
        store_keys: f.get(6)?.parse().ok()?,
        live: f.get(7)?.parse().ok()?,
        table_keys: f.get(8)?.parse().ok()?,
    })
}

/// The key counts to measure: [`KEY_COUNTS`], or those `TOKENLEASE_BENCH_KEYS` lists.
fn counts() -> Vec<usize> {
    std::env::var("TOKENLEASE_BENCH_KEYS").map_or_else(
        |_| KEY_COUNTS.to_vec(),
        |v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect(),
    )
}

/// Measures every key count on both sides, each in its own process, and prints the table.
pub(crate) fn print_table() {
    let fmt = |m: Option<Measured>, f: fn(&Measured) -> f64| {
        m.map_or("–".to_owned(), |m| format!("{:.0}", f(&m)))
    };
    println!(
        "\n| memory per key, each side in a fresh process | tokenlease RSS (B) | tokenlease heap, asked / malloc chunks (B) | at the end: keys in the lease table / with a live lease / MemoryStore buckets | governor keyed RSS (B) | governor heap, asked / malloc chunks (B) |"
    );
    println!("|---|---|---|---|---|---|");
    for n in counts() {
        let ours = measure("tokenlease", n);
        let theirs = measure("governor", n);
        println!(
            "| {n} keys | {} | {} / {} | {} | {} | {} / {} |",
            fmt(ours, |m| m.rss),
            fmt(ours, |m| m.heap),
            fmt(ours, |m| m.chunks),
            ours.map_or("–".to_owned(), |m| format!(
                "{} / {} / {}",
                m.table_keys, m.live, m.store_keys
            )),
            fmt(theirs, |m| m.rss),
            fmt(theirs, |m| m.heap),
            fmt(theirs, |m| m.chunks),
        );
    }
}
