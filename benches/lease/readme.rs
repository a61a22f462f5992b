//! `readme_api/*`: the README's own call, `limiter.try_acquire(key, 1.0).await`, on a limiter
//! built the README's way from a policy file whose plan says `"lease": {}` (every lease setting
//! at its default) and the builder's defaults, over an in-memory store, beside governor's keyed
//! limiter in the same process, at 1, 10,000, 100,000 and 1,000,000 keys called round robin.
//!
//! Each key count gets a fresh limiter, warmed by calling every key from 64 tasks until every key
//! answers from a live lease. The plan's bucket is far larger than the bench can spend (as
//! governor's quota is), so both sides measure the allowed path. After the criterion run the
//! table prints, per key count, the store calls the limiter made per 1,000 calls while measured
//! (refills and give-backs, counted by `CountedStore`) and the share of calls its leases
//! answered. `TOKENLEASE_BENCH_ONLY=readme` runs this group alone, and
//! `TOKENLEASE_BENCH_KEYS=100000` only the listed key counts. Memory per key is measured apart,
//! each side in a fresh process (`memory.rs`), and printed after this table.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use governor::{Quota, RateLimiter};
use tokenlease::policy::Policies;
use tokenlease::store::{CountedStore, MemoryStore};
use tokenlease::{DecidedBy, Limiter};

/// The key counts measured.
pub(crate) const KEY_COUNTS: [usize; 4] = [1, 10_000, 100_000, 1_000_000];

/// The policy file: one plan with the default lease settings, large enough never to deny.
pub(crate) const POLICY: &str = r#"{
  "plans": {
    "per-customer": { "capacity": 1000000000, "refill_per_second": 1000000000, "lease": {} }
  },
  "default_plan": "per-customer"
}"#;

/// What one key count's run saw, for the printed table.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Seen {
    /// Keys.
    pub(crate) keys: usize,
    /// Calls made while criterion measured (warm-up included).
    pub(crate) calls: u64,
    /// Store calls over the same calls.
    pub(crate) store_calls: u64,
    /// Calls a lease did not answer (decided by the store, the fallback, or denied).
    pub(crate) off_lease: u64,
}

/// This process's resident set size, from `/proc/self/statm` (Linux; 0 elsewhere).
pub(crate) fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

pub(crate) fn key_name(i: usize) -> String {
    format!("customer:{i}")
}

/// Brings every key to the state the measurement keeps it in: called about as often as the
/// round robin will call it, holding a live lease sized from that demand.
///
/// A lease is sized from the demand the actor measured, and a key called less than once per
/// lease lifetime gets none (docs/design/leases.md), so warming a million keys by calling each once and
/// waiting would never warm them: a pass of calls that each wait for a refill takes seconds, and
/// each key would look quiet. So the keys are brought in a block at a time: each round makes one
/// pass over the keys already warm with calls that never wait (`try_acquire_now_with`; they keep
/// spending, so their leases live on as they will while measured), then passes over the next
/// block of 10,000 from 64 tasks with the README's call, which waits for a refill where it must,
/// until a whole pass over the block waits for nothing (at most four passes a round, so that a
/// round stays well inside a lease lifetime and the warm keys' leases live on).
fn warm(
    runtime: &tokio::runtime::Runtime,
    limiter: &Limiter,
    policies: &Policies,
    keys: &Arc<Vec<String>>,
) {
    const BLOCK: usize = 10_000;
    let plan = policies.default_plan().expect("default plan").clone();
    let mut warm = 0usize;
    for round in 0..1_000 {
        let missed = keys[..warm]
            .iter()
            .filter(|key| !matches!(limiter.try_acquire_now_with(&plan, key, 1.0), Ok(Some(_))))
            .count();
        if warm == keys.len() {
            if missed == 0 {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        let block = Arc::new(keys[warm..(warm + BLOCK).min(keys.len())].to_vec());
        // Passes over the block until one waits for nothing: its keys are then called a few
        // times a second, as the measurement will call them.
        if (0..4).any(|_| pass(runtime, limiter, &plan, &block) == 0) {
            warm += block.len();
        }
        if round % 20 == 19 {
            eprintln!(
                "readme_api warm-up round {round}: {warm} keys warm, {missed} of them missed"
            );
        }
    }
    eprintln!(
        "readme_api: {warm} of {} keys warm after 1,000 rounds",
        keys.len()
    );
}

/// One pass over `block` from 64 tasks: a call a live lease answers without waiting, else the
/// README's call, which waits for the refill. Returns how many calls had to wait.
fn pass(
    runtime: &tokio::runtime::Runtime,
    limiter: &Limiter,
    plan: &tokenlease::policy::Plan,
    block: &Arc<Vec<String>>,
) -> usize {
    runtime.block_on(async {
        let tasks = 64.min(block.len());
        let handles: Vec<_> = (0..tasks)
            .map(|t| {
                let (limiter, block, plan) = (limiter.clone(), Arc::clone(block), plan.clone());
                tokio::spawn(async move {
                    let mut waited = 0usize;
                    for key in block.iter().skip(t).step_by(tasks) {
                        if let Ok(Some(d)) = limiter.try_acquire_now_with(&plan, key, 1.0) {
                            assert!(d.allowed);
                            continue;
                        }
                        waited += 1;
                        let d = limiter.try_acquire(key, 1.0).await.expect("decision");
                        assert!(d.allowed);
                    }
                    waited
                })
            })
            .collect();
        let mut waited = 0;
        for h in handles {
            waited += h.await.expect("warm task");
        }
        waited
    })
}

/// Runs the `readme_api` group; returns what each key count saw.
pub(crate) fn bench(c: &mut Criterion) -> Vec<Seen> {
    let policies = Policies::from_json_str(POLICY, None).expect("policy");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let caller = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut seen = Vec::new();
    let mut group = c.benchmark_group("readme_api");
    group.throughput(Throughput::Elements(1));
    // `TOKENLEASE_BENCH_KEYS=100000,1000000` measures only those key counts.
    let counts: Vec<usize> = std::env::var("TOKENLEASE_BENCH_KEYS").map_or_else(
        |_| KEY_COUNTS.to_vec(),
        |v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect(),
    );
    for n in counts {
        let keys: Arc<Vec<String>> = Arc::new((0..n).map(key_name).collect());
        let calls = Arc::new(AtomicU64::new(0));
        let store = CountedStore::with_counter(MemoryStore::new(), Arc::clone(&calls));
        let limiter =
            runtime.block_on(async { Limiter::builder(store).policies(policies.clone()).build() });
        warm(&runtime, &limiter, &policies, &keys);
        if let Some(stats) = limiter.lease_stats() {
            eprintln!(
                "readme_api/{n}_keys warm: {} keys in the table, {:.1} tokens a lease on average",
                stats.keys,
                stats.outstanding / stats.keys.max(1) as f64
            );
        }
        let mut run = Seen {
            keys: n,
            ..Seen::default()
        };
        let store_before = calls.load(Ordering::Relaxed);
        let mut i = 0usize;
        group.bench_function(format!("tokenlease/{n}_keys"), |b| {
            b.iter_custom(|iters| {
                caller.block_on(async {
                    let started = Instant::now();
                    for _ in 0..iters {
                        i = if i + 1 >= n { 0 } else { i + 1 };
                        let d = limiter.try_acquire(&keys[i], 1.0).await;
                        let d = d.expect("decision");
                        if d.decided_by != DecidedBy::Lease {
                            run.off_lease += 1;
                        }
                        black_box(d.allowed);
                    }
                    run.calls += iters;
                    started.elapsed()
                })
            });
        });
        run.store_calls = calls.load(Ordering::Relaxed) - store_before;
        seen.push(run);
        runtime.block_on(limiter.shutdown());
        drop(limiter);

        let keyed = RateLimiter::keyed(Quota::per_second(NonZeroU32::MAX));
        for key in keys.iter() {
            assert!(keyed.check_key(key).is_ok());
        }
        let mut i = 0usize;
        group.bench_function(format!("governor_keyed/{n}_keys"), |b| {
            b.iter(|| {
                i = if i + 1 >= n { 0 } else { i + 1 };
                black_box(keyed.check_key(&keys[i]).is_ok())
            });
        });
        // Give the memory back before the next key count.
        drop(keyed);
        std::thread::sleep(Duration::from_millis(100));
    }
    group.finish();
    seen
}

/// Prints the table of the `readme_api` group from criterion's estimates.
pub(crate) fn print_table(seen: &[Seen], criterion_ns: &dyn Fn(&str, &str) -> Option<f64>) {
    let fmt = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.1}"));
    println!(
        "\n| README API, `try_acquire(key, 1.0).await`, lease {{}} | tokenlease (ns/call) | governor keyed (ns/call) | governor ÷ tokenlease | store calls / 1,000 calls | calls off the lease |"
    );
    println!("|---|---|---|---|---|---|");
    for run in seen {
        let ours = criterion_ns("readme_api", &format!("tokenlease/{}_keys", run.keys));
        let theirs = criterion_ns("readme_api", &format!("governor_keyed/{}_keys", run.keys));
        let ratio = match (ours, theirs) {
            (Some(a), Some(b)) => format!("{:.2}×", b / a),
            _ => "–".to_owned(),
        };
        let per_thousand = if run.calls == 0 {
            "–".to_owned()
        } else {
            format!("{:.3}", run.store_calls as f64 * 1000.0 / run.calls as f64)
        };
        println!(
            "| {} keys | {} | {} | {} | {} | {} of {} |",
            run.keys,
            fmt(ours),
            fmt(theirs),
            ratio,
            per_thousand,
            run.off_lease,
            run.calls,
        );
    }
}
