//! Leased mode: the fast path beside `governor`, on one and two threads, and leased against
//! direct mode on a real PostgreSQL.
//!
//! `cargo bench --bench lease` runs the criterion groups, then (only under `--bench`) the
//! PostgreSQL comparison, and prints the summary tables that `benches/README.md` quotes.
//!
//! - `fast_path/*`: ns per call of `Limiter::try_acquire_now_with` on keys with a live lease
//!   (an in-memory store; a bucket far too large to run dry, and leases sized for an hour of the
//!   key's demand, so they never run dry either), with 1 key and with 100,000 keys round-robin,
//!   beside governor's direct `check()` and its keyed `check_key()` with 1 and 100,000 `String`
//!   keys, on quotas too large to deny. Also `Limiter::try_acquire_with` (the async wrapper,
//!   polled inside a current-thread runtime's `block_on`).
//! - `fast_path/parts/*`: pieces of that call measured alone (the cost's conversion, the key
//!   check, a bare atomic decrement), to show where the time goes.
//! - `hot_key_threads/*`: one hot key on 1 and on 2 threads (std threads, each doing half the
//!   iterations), ours against governor's direct limiter. Time is wall time, so a figure below
//!   the 1-thread one means more total throughput.
//! - Memory per key (printed table, `lease/memory.rs`): tokenlease's lease table and
//!   `MemoryStore` against governor's keyed limiter, each side in a fresh process (the bench
//!   re-executes itself), RSS and live heap per key at 10,000, 100,000 and 1,000,000 keys.
//!   `TOKENLEASE_BENCH_ONLY=memory` prints it alone.
//! - `TOKENLEASE_BENCH_CRITERION_ONLY=1` skips the printed tables and the PostgreSQL runs (what
//!   `benches/fast_path_processes.sh` uses to repeat the fast-path pairs in many processes).
//! - Idle actors (printed line): the process's CPU over 3 s with nobody calling, when the only
//!   work left is the two limiters' lease actors sweeping their 100,000 warm keys each tick.
//! - PostgreSQL (printed table): 16 tasks on one hot key and on 10,000 keys, leased and direct,
//!   for 3 s after a 1 s warm-up: calls per second and store calls per 1,000 calls.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use governor::{Quota, RateLimiter};
use tokenlease::bucket::{BucketConfig, Rate, Tokens};
use tokenlease::error::validate_key;
use tokenlease::policy::{LeaseSettings, Plan};
use tokenlease::store::{CountedStore, MemoryStore, PostgresStore};
use tokenlease::{DecidedBy, Limiter};
use tokenlease_testkit::TempPostgres;

/// The largest capacity a bucket may have (8 × 10⁹ tokens), refilled at a billion a second.
const CAPACITY: u64 = BucketConfig::MAX_CAPACITY_TOKENS;
const RATE: u64 = 1_000_000_000;
const MANY_KEYS: usize = 100_000;
const PG_KEYS: u64 = 10_000;

/// A bucket that never runs dry at benchmark speeds.
fn huge_bucket() -> BucketConfig {
    BucketConfig::new(
        Tokens::whole(CAPACITY),
        Rate::per_second(RATE).expect("rate"),
    )
    .expect("bucket")
}

/// The fast-path plan: leases live an hour and hold an hour of the key's demand (capped at
/// the lease word's 7.2 × 10⁷ tokens), so once warm they are refilled in the background long
/// before they run dry, and the benchmark measures the lookup and CAS alone.
fn fast_plan() -> Plan {
    Plan::new("fast", huge_bucket()).with_lease(
        LeaseSettings::default()
            .with_ttl(Duration::from_secs(3600))
            .with_max_fraction(1.0)
            .with_low_water(0.5)
            .with_refresh(Duration::from_secs(3600))
            .with_max_wait(Duration::from_secs(1)),
    )
}

/// A fast-path call that found no live lease (counted, never expected once warm).
static MISSES: AtomicU64 = AtomicU64::new(0);

#[inline]
fn ours(limiter: &Limiter, plan: &Plan, key: &str) {
    match limiter.try_acquire_now_with(plan, key, 1.0) {
        Ok(Some(d)) => {
            black_box(d.allowed);
        }
        _ => {
            MISSES.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Runs leased calls until every key answers from a live lease on the fast path.
fn warm(runtime: &tokio::runtime::Runtime, limiter: &Limiter, plan: &Arc<Plan>, keys: &[String]) {
    for round in 0..10 {
        let keys = Arc::new(keys.to_vec());
        runtime.block_on(async {
            let tasks = 64.min(keys.len());
            let handles: Vec<_> = (0..tasks)
                .map(|t| {
                    let (limiter, plan, keys) =
                        (limiter.clone(), Arc::clone(plan), Arc::clone(&keys));
                    tokio::spawn(async move {
                        for key in keys.iter().skip(t).step_by(tasks) {
                            for _ in 0..2 {
                                let d = limiter.try_acquire_with(&plan, key, 1.0).await;
                                assert!(d.expect("decision").allowed);
                            }
                        }
                    })
                })
                .collect();
            for h in handles {
                h.await.expect("warm task");
            }
            // Let the actor land the refills the last calls asked for.
            tokio::time::sleep(Duration::from_millis(100)).await;
        });
        let misses = keys
            .iter()
            .filter(|k| !matches!(limiter.try_acquire_now_with(plan, k, 1.0), Ok(Some(_))))
            .count();
        // Every key answers from its lease, and the leases are sized from measured demand
        // (a key's first leases hold a token or two until its demand has been sampled).
        let outstanding = limiter.lease_stats().map_or(0.0, |s| s.outstanding);
        if misses == 0 && outstanding >= 100.0 * keys.len() as f64 {
            return;
        }
        eprintln!(
            "warm-up round {round}: {misses} keys without a live lease, {outstanding:.0} tokens leased"
        );
    }
    panic!("leases still not warm after 10 rounds");
}

struct Fast {
    /// Runs the lease actor (refills in the background); kept alive for the whole run.
    _runtime: tokio::runtime::Runtime,
    limiter: Limiter,
    /// The same, with a 10 s actor tick.
    slow_tick: Limiter,
    plan: Arc<Plan>,
    keys: Vec<String>,
}

fn fast_setup() -> Fast {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let limiter = |tick: Duration| {
        runtime.block_on(async {
            Limiter::builder(MemoryStore::new())
                .max_lease_keys(2 * MANY_KEYS)
                .lease_tick(tick)
                .build()
        })
    };
    // The default tick (50 ms), and a slow one: the actor's tick scans the whole table, so the
    // pair shows what that scan costs callers with 100,000 keys on 2 cores.
    let (default_tick, slow_tick) = (
        limiter(Duration::from_millis(50)),
        limiter(Duration::from_secs(10)),
    );
    let plan = Arc::new(fast_plan());
    let keys: Vec<String> = (0..MANY_KEYS).map(|i| format!("key:{i}")).collect();
    for limiter in [&default_tick, &slow_tick] {
        warm(&runtime, limiter, &plan, &keys[..1]);
        warm(&runtime, limiter, &plan, &keys);
        // The hot key's lease is sized from the demand the warm-up showed, a few hundred calls:
        // at tens of millions of calls a second it would run dry a few times before its demand
        // estimate caught up, inside the first benchmark. Half a second at full speed first.
        let started = Instant::now();
        while started.elapsed() < Duration::from_millis(500) {
            let _ = limiter.try_acquire_now_with(&plan, &keys[0], 1.0);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Fast {
        _runtime: runtime,
        limiter: default_tick,
        slow_tick,
        plan,
        keys,
    }
}

fn governor_quota() -> Quota {
    Quota::per_second(NonZeroU32::MAX)
}

fn bench_fast_path(c: &mut Criterion, fast: &Fast) {
    let mut group = c.benchmark_group("fast_path");
    group.throughput(Throughput::Elements(1));
    let (limiter, plan, keys) = (&fast.limiter, &*fast.plan, &fast.keys);

    group.bench_function("tokenlease/1_key", |b| {
        b.iter(|| ours(limiter, plan, &keys[0]));
    });
    let mut i = 0;
    group.bench_function("tokenlease/100k_keys", |b| {
        b.iter(|| {
            i = if i + 1 == keys.len() { 0 } else { i + 1 };
            ours(limiter, plan, &keys[i]);
        });
    });
    let mut i = 0;
    group.bench_function("tokenlease/100k_keys_tick_10s", |b| {
        b.iter(|| {
            i = if i + 1 == keys.len() { 0 } else { i + 1 };
            ours(&fast.slow_tick, plan, &keys[i]);
        });
    });
    let async_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    group.bench_function("tokenlease_async/1_key", |b| {
        b.iter_custom(|iters| {
            async_rt.block_on(async {
                let started = Instant::now();
                for _ in 0..iters {
                    let d = limiter.try_acquire_with(plan, &keys[0], 1.0).await;
                    black_box(d.expect("decision").allowed);
                }
                started.elapsed()
            })
        });
    });

    // What the fast path does before the lease lookup: the cost's conversion to tokens
    // (`validate_cost` calls `Tokens::from_f64`, which prints the float to read its shortest
    // decimal) and the key check; and a bare atomic decrement for scale.
    group.bench_function("parts/tokens_from_f64", |b| {
        b.iter(|| black_box(Tokens::from_f64(black_box(1.0))));
    });
    group.bench_function("parts/validate_key", |b| {
        b.iter(|| black_box(validate_key(black_box(&keys[0])).is_ok()));
    });
    let word = AtomicU64::new(u64::MAX);
    group.bench_function("parts/atomic_fetch_sub", |b| {
        b.iter(|| black_box(word.fetch_sub(1, Ordering::AcqRel)));
    });

    let direct = RateLimiter::direct(governor_quota());
    group.bench_function("governor_direct", |b| {
        b.iter(|| black_box(direct.check().is_ok()));
    });
    let keyed = RateLimiter::keyed(governor_quota());
    for key in keys {
        assert!(keyed.check_key(key).is_ok());
    }
    group.bench_function("governor_keyed/1_key", |b| {
        b.iter(|| black_box(keyed.check_key(&keys[0]).is_ok()));
    });
    let mut i = 0;
    group.bench_function("governor_keyed/100k_keys", |b| {
        b.iter(|| {
            i = if i + 1 == keys.len() { 0 } else { i + 1 };
            black_box(keyed.check_key(&keys[i]).is_ok())
        });
    });
    group.finish();
}

/// `iters` calls of `call` split over `threads` std threads started together; wall time.
fn threaded(threads: u64, iters: u64, call: &(dyn Fn() + Sync)) -> Duration {
    let per_thread = iters.div_ceil(threads);
    let barrier = Barrier::new(threads as usize + 1);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    for _ in 0..per_thread {
                        call();
                    }
                })
            })
            .collect();
        barrier.wait();
        let started = Instant::now();
        for h in handles {
            h.join().expect("thread");
        }
        started
            .elapsed()
            .mul_f64(iters as f64 / (per_thread * threads) as f64)
    })
}

fn bench_hot_key_threads(c: &mut Criterion, fast: &Fast) {
    let mut group = c.benchmark_group("hot_key_threads");
    group.throughput(Throughput::Elements(1));
    let (limiter, plan, key) = (&fast.limiter, &*fast.plan, fast.keys[0].as_str());
    let direct = RateLimiter::direct(governor_quota());
    for threads in [1u64, 2] {
        group.bench_function(format!("tokenlease/{threads}_threads"), |b| {
            b.iter_custom(|iters| threaded(threads, iters, &|| ours(limiter, plan, key)));
        });
        group.bench_function(format!("governor_direct/{threads}_threads"), |b| {
            b.iter_custom(|iters| {
                threaded(threads, iters, &|| {
                    black_box(direct.check().is_ok());
                })
            });
        });
    }
    group.finish();
}

/// Reads criterion's mean time per element (ns) for one benchmark of this file.
fn criterion_ns(group: &str, id: &str) -> Option<f64> {
    // Where criterion writes: `CARGO_TARGET_DIR` when set, else the package's `target`.
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target"),
        std::path::PathBuf::from,
    );
    let path = target
        .join("criterion")
        .join(group)
        .join(id.replace('/', "_"))
        .join("new/estimates.json");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    json["mean"]["point_estimate"].as_f64()
}

fn print_fast_tables() {
    let fmt = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.1}"));
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.2}×", b / a),
        _ => "–".to_owned(),
    };
    println!(
        "\n| fast path, 1 thread | tokenlease (ns/call) | governor (ns/call) | governor ÷ tokenlease |"
    );
    println!("|---|---|---|---|");
    for (label, ours, theirs) in [
        ("1 key (keyed)", "tokenlease/1_key", "governor_keyed/1_key"),
        (
            "100,000 keys (keyed)",
            "tokenlease/100k_keys",
            "governor_keyed/100k_keys",
        ),
        (
            "100,000 keys, actor tick 10 s (keyed)",
            "tokenlease/100k_keys_tick_10s",
            "governor_keyed/100k_keys",
        ),
        (
            "1 key vs governor direct",
            "tokenlease/1_key",
            "governor_direct",
        ),
        (
            "async `try_acquire_with`, 1 key, vs governor keyed",
            "tokenlease_async/1_key",
            "governor_keyed/1_key",
        ),
    ] {
        let (a, b) = (
            criterion_ns("fast_path", ours),
            criterion_ns("fast_path", theirs),
        );
        println!("| {label} | {} | {} | {} |", fmt(a), fmt(b), ratio(a, b));
    }
    println!("\n| part of the fast path | ns/call |");
    println!("|---|---|");
    for (label, id) in [
        (
            "`Tokens::from_f64(1.0)` (in `validate_cost`)",
            "parts/tokens_from_f64",
        ),
        ("`validate_key`", "parts/validate_key"),
        ("bare `AtomicU64::fetch_sub`", "parts/atomic_fetch_sub"),
    ] {
        println!("| {label} | {} |", fmt(criterion_ns("fast_path", id)));
    }
    println!(
        "\n| one hot key | 1 thread (M calls/s) | 2 threads, total (M calls/s) | 2 threads ÷ 1 thread |"
    );
    println!("|---|---|---|---|");
    for (label, id) in [
        ("tokenlease", "tokenlease"),
        ("governor direct", "governor_direct"),
    ] {
        let one = criterion_ns("hot_key_threads", &format!("{id}/1_threads")).map(|n| 1e3 / n);
        let two = criterion_ns("hot_key_threads", &format!("{id}/2_threads")).map(|n| 1e3 / n);
        let rate = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.1}"));
        let scale = match (one, two) {
            (Some(a), Some(b)) => format!("{:.2}", b / a),
            _ => "–".to_owned(),
        };
        println!("| {label} | {} | {} | {scale} |", rate(one), rate(two));
    }
    println!(
        "\nfast-path calls that found no live lease: {}",
        MISSES.load(Ordering::Relaxed)
    );
}

/// What one PostgreSQL run measured.
#[derive(Debug, Default, Clone, Copy)]
struct PgRun {
    calls: u64,
    allowed: u64,
    fallback: u64,
    store_calls: u64,
    lease_store_calls: Option<u64>,
    secs: f64,
}

const PG_TASKS: usize = 16;

/// 16 tasks call `try_acquire_with` as fast as they can: 1 s of warm-up, then 3 s measured.
fn pg_run(
    runtime: &tokio::runtime::Runtime,
    server: &TempPostgres,
    leased: bool,
    many: bool,
) -> PgRun {
    runtime.block_on(async {
        let calls = Arc::new(AtomicU64::new(0));
        let store = PostgresStore::builder(&server.connection_string("postgres"))
            .expect("config")
            .pool_size(4)
            .call_timeout(Duration::from_secs(5))
            .pool_wait_timeout(Duration::from_secs(5))
            .statement_timeout(Duration::from_secs(5))
            .lock_timeout(Duration::from_secs(5))
            .build()
            .await
            .expect("store");
        let limiter =
            Limiter::builder(CountedStore::with_counter(store, Arc::clone(&calls))).build();
        let name = format!("pg_{}_{}", leased, many);
        let mut plan = Plan::new(name, huge_bucket());
        if leased {
            plan = plan.with_lease(LeaseSettings::default());
        }
        let plan = Arc::new(plan);
        let next = Arc::new(AtomicU64::new(0));
        let measuring = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let counts = Arc::new([AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)]);
        let handles: Vec<_> = (0..PG_TASKS)
            .map(|_| {
                let (limiter, plan, next, measuring, stop, counts) = (
                    limiter.clone(),
                    Arc::clone(&plan),
                    Arc::clone(&next),
                    Arc::clone(&measuring),
                    Arc::clone(&stop),
                    Arc::clone(&counts),
                );
                tokio::spawn(async move {
                    let mut key = String::new();
                    let mut n = 0u32;
                    while !stop.load(Ordering::Relaxed) {
                        key.clear();
                        if many {
                            use std::fmt::Write;
                            let i = next.fetch_add(1, Ordering::Relaxed) % PG_KEYS;
                            let _ = write!(key, "pgk:{i}");
                        } else {
                            key.push_str("pghot");
                        }
                        let d = limiter
                            .try_acquire_with(&plan, &key, 1.0)
                            .await
                            .expect("decision");
                        if measuring.load(Ordering::Relaxed) {
                            counts[0].fetch_add(1, Ordering::Relaxed);
                            counts[1].fetch_add(u64::from(d.allowed), Ordering::Relaxed);
                            if matches!(d.decided_by, DecidedBy::Fallback(_)) {
                                counts[2].fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        // The fast path never yields: let the actor and other tasks run.
                        n = n.wrapping_add(1);
                        if n.is_multiple_of(64) {
                            tokio::task::yield_now().await;
                        }
                    }
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let store_before = calls.load(Ordering::Relaxed);
        let lease_before = limiter.lease_stats().map(|s| s.store_calls);
        measuring.store(true, Ordering::Relaxed);
        let started = Instant::now();
        tokio::time::sleep(Duration::from_secs(3)).await;
        measuring.store(false, Ordering::Relaxed);
        let secs = started.elapsed().as_secs_f64();
        let store_calls = calls.load(Ordering::Relaxed) - store_before;
        let lease_after = limiter.lease_stats().map(|s| s.store_calls);
        stop.store(true, Ordering::Relaxed);
        for h in handles {
            h.await.expect("task");
        }
        limiter.shutdown().await;
        PgRun {
            calls: counts[0].load(Ordering::Relaxed),
            allowed: counts[1].load(Ordering::Relaxed),
            fallback: counts[2].load(Ordering::Relaxed),
            store_calls,
            lease_store_calls: lease_after.zip(lease_before).map(|(a, b)| a - b),
            secs,
        }
    })
}

fn print_pg_table() {
    let server = TempPostgres::start().expect("throwaway PostgreSQL");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "\n| PostgreSQL, {PG_TASKS} tasks, 3 s | mode | calls/s | store calls per 1,000 calls | allowed | fallback decisions | lease_stats store calls |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut per_1k = Vec::new();
    for (label, many) in [("1 hot key", false), ("10,000 keys", true)] {
        for leased in [false, true] {
            let r = pg_run(&runtime, &server, leased, many);
            let per = 1000.0 * r.store_calls as f64 / r.calls.max(1) as f64;
            per_1k.push((label, leased, per));
            println!(
                "| {label} | {} | {:.0} | {:.4} | {} / {} | {} | {} |",
                if leased { "leased" } else { "direct" },
                r.calls as f64 / r.secs,
                per,
                r.allowed,
                r.calls,
                r.fallback,
                r.lease_store_calls
                    .map_or("–".to_owned(), |n| n.to_string()),
            );
        }
    }
    for pair in per_1k.chunks(2) {
        if let [(label, _, direct), (_, _, leased)] = pair {
            println!(
                "{label}: direct makes {:.0}× the store calls of leased",
                direct / leased.max(1e-9)
            );
        }
    }
}

#[path = "lease/memory.rs"]
mod memory;
#[path = "lease/readme.rs"]
mod readme;

/// Counts live heap bytes in the memory children (`memory.rs`); elsewhere the system allocator.
#[global_allocator]
static ALLOCATOR: memory::Counting = memory::Counting;

fn main() {
    // A child of the memory table: measure one side at one key count and exit.
    if let Ok(spec) = std::env::var(memory::CHILD_ENV) {
        memory::child(&spec);
        return;
    }
    let only = std::env::var("TOKENLEASE_BENCH_ONLY").ok();
    // `TOKENLEASE_BENCH_ONLY=memory` prints the memory table alone.
    if only.as_deref() == Some("memory") {
        memory::print_table();
        return;
    }
    // `TOKENLEASE_BENCH_ONLY=readme` runs the README-API group alone.
    let readme_only = only.as_deref() == Some("readme");
    // No plots: the tables below are the report. (With plotters' `ab_glyph` feature on, as the
    // crate's own charts enable it, criterion's plotting panics with `FontUnavailable`.)
    let mut criterion = Criterion::default()
        .without_plots()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let readme_seen = readme::bench(&mut criterion);
    if readme_only {
        criterion.final_summary();
        readme::print_table(&readme_seen, &criterion_ns);
        memory::print_table();
        return;
    }
    let fast = fast_setup();
    bench_fast_path(&mut criterion, &fast);
    bench_hot_key_threads(&mut criterion, &fast);
    criterion.final_summary();
    // The tables and the PostgreSQL runs only when really benchmarking (`cargo bench`), not
    // when a test runner lists or smoke-runs the bench target.
    if !std::env::args().any(|a| a == "--bench")
        || std::env::var_os("TOKENLEASE_BENCH_CRITERION_ONLY").is_some()
    {
        return;
    }
    readme::print_table(&readme_seen, &criterion_ns);
    memory::print_table();
    print_fast_tables();
    print_idle_actor_cpu();
    print_pg_table();
    drop(fast);
}

/// This process's CPU time (user + system) so far, from `/proc/self/stat` (Linux).
fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which ends with the last ')': utime and stime are the
    // 12th and 13th of them, in clock ticks (100 a second on Linux).
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

/// What the two benchmark limiters' lease actors cost with nobody calling: each still sweeps its
/// 100,000 warm keys on every tick (50 ms and 10 s), so this is the sweep's CPU.
fn print_idle_actor_cpu() {
    let window = Duration::from_secs(3);
    let (Some(before), started) = (process_cpu(), Instant::now()) else {
        return;
    };
    std::thread::sleep(window);
    let (Some(after), elapsed) = (process_cpu(), started.elapsed()) else {
        return;
    };
    let share = (after - before).as_secs_f64() / elapsed.as_secs_f64();
    println!(
        "
idle lease actors (100,000 warm keys at a 50 ms tick, 100,000 at 10 s): {:.1}% of a core over {:.1} s",
        share * 100.0,
        elapsed.as_secs_f64()
    );
}
