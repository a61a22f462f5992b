//! What an idle limiter's lease actor costs: warms N keys (an in-memory store, so only the
//! process itself is measured), lets the refills settle, then reads this process's CPU time from
//! `/proc/self/stat` over a window with nobody calling.
//!
//! ```text
//! cargo run --release --example idle_lease_actor -- [keys ...] [--secs S]
//! ```
//!
//! Defaults: 100,000 and 1,000,000 keys, 5 s. The leases live an hour, so during the window every
//! key holds a live lease and nothing is due: whatever CPU the process uses is the actor's
//! idle cost (plus the runtime's own, which is nothing measurable).

use std::time::{Duration, Instant};

use tokenlease::Limiter;
use tokenlease::bucket::{BucketConfig, Rate, Tokens};
use tokenlease::policy::{LeaseSettings, Plan};
use tokenlease::store::MemoryStore;

/// This process's CPU time (user + system) so far (Linux).
fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // Fields after the command name, which ends with the last ')': utime and stime are the
    // 12th and 13th of them, in clock ticks (100 a second on Linux).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .expect("stat line")
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 =
        fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    Duration::from_millis(ticks * 10)
}

fn main() {
    let mut keys = Vec::new();
    let mut secs = 5.0;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--secs" {
            secs = args.next().and_then(|s| s.parse().ok()).expect("--secs S");
        } else {
            keys.push(
                arg.replace(['_', ','], "")
                    .parse::<usize>()
                    .expect("a key count"),
            );
        }
    }
    if keys.is_empty() {
        keys = vec![100_000, 1_000_000];
    }
    let plan = Plan::new(
        "idle",
        BucketConfig::new(
            Tokens::whole(1_000_000_000),
            Rate::per_second(1_000_000).expect("rate"),
        )
        .expect("bucket"),
    )
    .with_lease(LeaseSettings::default().with_ttl(Duration::from_secs(3600)));
    for n in keys {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let _entered = runtime.enter();
        let limiter = Limiter::builder(MemoryStore::new())
            .max_lease_keys(n)
            .build();
        let names: Vec<String> = (0..n).map(|i| format!("key:{i}")).collect();
        let warm_started = Instant::now();
        // Each key's first call creates its slot and asks for a lease; the second, once the
        // lease is there, spends from it (and asks for the next one).
        for pass in 0..2 {
            for key in &names {
                let _ = limiter.try_acquire_now_with(&plan, key, 1.0);
            }
            let want = (pass + 1) as f64 * n as f64;
            while limiter.lease_stats().map_or(0.0, |s| s.leased) < want {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        // Settled: no store call for half a second.
        let mut calls = limiter.lease_stats().map_or(0, |s| s.store_calls);
        loop {
            std::thread::sleep(Duration::from_millis(500));
            let now = limiter.lease_stats().map_or(0, |s| s.store_calls);
            if now == calls {
                break;
            }
            calls = now;
        }
        let stats = limiter.lease_stats().expect("leased");
        let warm = warm_started.elapsed();
        let (before, started) = (process_cpu(), Instant::now());
        std::thread::sleep(Duration::from_secs_f64(secs));
        let (after, elapsed) = (process_cpu(), started.elapsed());
        let share = (after - before).as_secs_f64() / elapsed.as_secs_f64();
        println!(
            "idle lease actor, {n} warm keys ({} in the table, {:.0} tokens out, warmed in {:.1} s): {:.1}% of a core over {:.1} s",
            stats.keys,
            stats.outstanding,
            warm.as_secs_f64(),
            share * 100.0,
            elapsed.as_secs_f64()
        );
        runtime.block_on(limiter.shutdown());
    }
}
