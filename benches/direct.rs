//! Direct mode against a real PostgreSQL, side by side with pgbench running the bare statement
//! on the same server at the same concurrency.
//!
//! `cargo bench --bench direct` starts a throwaway cluster (durable settings), runs the criterion
//! groups, then pgbench, and prints one table with both. Every call is allowed (a bucket far too
//! large to run dry), so the figures are the statement's cost, not denials.
//!
//! - `direct/{1,16}_tasks/{hot,10k_keys}`: `Limiter::try_acquire_with`, one pool per limiter
//!   (as many connections as tasks), concurrent callers of one key coalesced (the default).
//! - `direct/16_tasks/hot_uncoalesced`: one statement per call, as a naive limiter would.
//! - `direct/*/hot_sync_off`: the same with `synchronous_commit = off` on the limiter's sessions.
//! - `direct/16_tasks/10k_keys_pool{P}_inflight{K}`: 10,000 keys through a pool of `P` with at
//!   most `K` statements in flight; callers that arrive while `K` are in flight leave together
//!   in the next statement. `K ≥ 16` (as many as tasks) never batches: one statement per call,
//!   as before statements carried many keys. These size the pool and `K` (docs/design/direct-mode.md).

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use tokenlease::Limiter;
use tokenlease::bucket::{BucketConfig, Rate, Tokens};
use tokenlease::policy::Plan;
use tokenlease::store::{AcquireRequest, PostgresStore, Store, acquire_one_sql};
use tokenlease_testkit::TempPostgres;

const KEYS: u64 = 10_000;
const CAPACITY: u64 = 1_000_000_000;
const RATE: u64 = 1_000_000_000;

fn plan() -> Plan {
    let bucket = BucketConfig::new(
        Tokens::whole(CAPACITY),
        Rate::per_second(RATE).expect("rate"),
    )
    .expect("bucket");
    Plan::new("bench", bucket)
}

struct Setup {
    runtime: tokio::runtime::Runtime,
    server: TempPostgres,
}

fn limiter(setup: &Setup, pool: u32, coalesce: bool, sync_commit: bool) -> Limiter {
    limiter_in_flight(setup, pool, coalesce, sync_commit, None)
}

fn limiter_in_flight(
    setup: &Setup,
    pool: u32,
    coalesce: bool,
    sync_commit: bool,
    in_flight: Option<usize>,
) -> Limiter {
    setup.runtime.block_on(async {
        let store = PostgresStore::builder(&setup.server.connection_string("postgres"))
            .expect("config")
            .pool_size(pool)
            .call_timeout(Duration::from_secs(10))
            .pool_wait_timeout(Duration::from_secs(10))
            .statement_timeout(Duration::from_secs(10))
            .lock_timeout(Duration::from_secs(10))
            .synchronous_commit(sync_commit)
            .build()
            .await
            .expect("store");
        let builder = Limiter::builder(store).coalesce(coalesce);
        match in_flight {
            Some(k) => builder.statements_in_flight(k).build(),
            None => builder.build(),
        }
    })
}

/// Runs `iters` calls spread over `tasks` tasks and returns the wall time they took.
fn run(setup: &Setup, limiter: &Limiter, tasks: u64, iters: u64, many_keys: bool) -> Duration {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let plan = Arc::new(plan());
    setup.runtime.block_on(async {
        let per_task = iters.div_ceil(tasks);
        let started = Instant::now();
        let handles: Vec<_> = (0..tasks)
            .map(|_| {
                let (limiter, plan) = (limiter.clone(), Arc::clone(&plan));
                tokio::spawn(async move {
                    for _ in 0..per_task {
                        let key = if many_keys {
                            format!("k{}", NEXT.fetch_add(1, Ordering::Relaxed) % KEYS)
                        } else {
                            "hot".to_owned()
                        };
                        let d = limiter
                            .try_acquire_with(&plan, &key, 1.0)
                            .await
                            .expect("ok");
                        assert!(d.allowed);
                    }
                })
            })
            .collect();
        for h in handles {
            h.await.expect("task");
        }
        let elapsed = started.elapsed();
        // Scale to exactly `iters` calls.
        elapsed.mul_f64(iters as f64 / (per_task * tasks) as f64)
    })
}

fn bench_direct(c: &mut Criterion, setup: &Setup) {
    let mut group = c.benchmark_group("direct");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(4));
    for tasks in [1u64, 16] {
        for (name, many, coalesce, sync) in [
            ("hot", false, true, true),
            ("10k_keys", true, true, true),
            ("hot_uncoalesced", false, false, true),
            ("hot_sync_off", false, true, false),
        ] {
            if tasks == 1 && name == "hot_uncoalesced" {
                continue; // one task never coalesces
            }
            let limiter = limiter(setup, tasks as u32, coalesce, sync);
            group.bench_function(format!("{tasks}_tasks/{name}"), |b| {
                b.iter_custom(|iters| run(setup, &limiter, tasks, iters, many));
            });
        }
    }
    for (pool, in_flight) in BATCHING {
        let limiter = limiter_in_flight(setup, pool, true, true, Some(in_flight));
        group.bench_function(
            format!("16_tasks/10k_keys_pool{pool}_inflight{in_flight}"),
            |b| b.iter_custom(|iters| run(setup, &limiter, 16, iters, true)),
        );
    }
    group.finish();
}

/// (pool size, statements in flight) for 16 tasks on 10,000 keys.
const BATCHING: [(u32, usize); 6] = [(4, 16), (4, 4), (4, 2), (4, 1), (8, 8), (16, 16)];

/// pgbench on the statement the store sends for a one-key take (the lean UPDATE of
/// `src/store/postgres/lean.rs`): the same SQL, keys and concurrency, prepared once per
/// connection as the store does by default.
fn pgbench(setup: &Setup, clients: u32, many_keys: bool, sync_commit: bool) -> Option<f64> {
    let key = if many_keys { "'pg' || :n" } else { "'pghot'" };
    let nanos = |tokens: u64| (u128::from(tokens) * 1_000_000_000).to_string();
    let sql = acquire_one_sql()
        .replace("$1", key)
        .replace("$2", &nanos(CAPACITY))
        .replace("$3", &nanos(RATE))
        .replace("$4", &nanos(1))
        .replace("$5", &nanos(1))
        .replace("$6", &nanos(1));
    let sql: String = sql
        .lines()
        .filter(|l| !l.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join(" ");
    let script = format!("\\set n random(1, {KEYS})\n{sql};\n");
    let dir = std::env::temp_dir().join(format!("tokenlease-pgbench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).ok()?;
    let file = dir.join("acquire.sql");
    std::fs::write(&file, script).ok()?;
    let options = if sync_commit {
        ""
    } else {
        "-c synchronous_commit=off"
    };
    let out = Command::new(setup.server.bin_dir().join("pgbench"))
        .args([
            "-h",
            setup.server.host(),
            "-p",
            &setup.server.port().to_string(),
        ])
        .args([
            "-U", "postgres", "-n", "-M", "prepared", "-T", "5", "-j", "2",
        ])
        .args(["-c", &clients.to_string(), "-f"])
        .arg(&file)
        .arg("postgres")
        .env("PGOPTIONS", options)
        .output()
        .ok()?;
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8_lossy(&out.stdout);
    let tps = text
        .lines()
        .find(|l| l.starts_with("tps"))
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|v| v.parse().ok());
    if tps.is_none() {
        eprintln!("pgbench failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    tps
}

/// The time of one `acquire_many` statement of `n` distinct keys, alone on the server: the median
/// of 30 (each on fresh keys, so every row is inserted once and then updated), in milliseconds.
fn statement_ms(setup: &Setup, n: usize) -> f64 {
    setup.runtime.block_on(async {
        let store = PostgresStore::builder(&setup.server.connection_string("postgres"))
            .expect("config")
            .pool_size(1)
            .call_timeout(Duration::from_secs(10))
            .pool_wait_timeout(Duration::from_secs(10))
            .statement_timeout(Duration::from_secs(10))
            .lock_timeout(Duration::from_secs(10))
            .build()
            .await
            .expect("store");
        let bucket = *plan().bucket();
        let mut times = Vec::new();
        for round in 0..30 {
            let keys: Vec<String> = (0..n)
                .map(|k| format!("size{n}-{}", k + (round % 2) * n))
                .collect();
            let requests: Vec<AcquireRequest<'_>> = keys
                .iter()
                .map(|k| AcquireRequest::take(k, bucket, Tokens::whole(1)))
                .collect();
            let started = Instant::now();
            store.acquire_many(&requests).await.expect("statement");
            times.push(started.elapsed().as_secs_f64() * 1e3);
        }
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    })
}

/// Reads criterion's mean time per call for one benchmark, as calls per second.
fn criterion_rate(id: &str) -> Option<f64> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/criterion/direct")
        .join(id.replace('/', "_"))
        .join("new/estimates.json");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    let mean_ns = json["mean"]["point_estimate"].as_f64()?;
    Some(1e9 / mean_ns)
}

fn main() {
    let server = TempPostgres::start().expect("throwaway PostgreSQL");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let setup = Setup { runtime, server };
    // No plots: see benches/bucket.rs.
    let mut criterion = Criterion::default().without_plots().configure_from_args();
    bench_direct(&mut criterion, &setup);
    criterion.final_summary();
    // The pgbench side and the table only when really benchmarking (`cargo bench`), not when a
    // test runner lists or smoke-runs the bench target.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }

    println!(
        "\n| concurrency | keys | tokenlease direct (calls/s) | pgbench, bare statement (tx/s) |"
    );
    println!("|---|---|---|---|");
    for tasks in [1u32, 16] {
        for (name, label, many, sync) in [
            ("hot", "1 hot key", false, true),
            ("10k_keys", "10,000 keys", true, true),
            ("hot_uncoalesced", "1 hot key, uncoalesced", false, true),
            (
                "hot_sync_off",
                "1 hot key, synchronous_commit = off",
                false,
                false,
            ),
        ] {
            if tasks == 1 && name == "hot_uncoalesced" {
                continue;
            }
            let ours = criterion_rate(&format!("{tasks}_tasks/{name}"));
            let theirs = if name == "hot_uncoalesced" {
                None
            } else {
                pgbench(&setup, tasks, many, sync)
            };
            let fmt = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.0}"));
            println!("| {tasks} | {label} | {} | {} |", fmt(ours), fmt(theirs));
        }
    }
    println!("\n| 16 tasks, 10,000 keys: pool | statements in flight | calls/s |");
    println!("|---|---|---|");
    for (pool, in_flight) in BATCHING {
        let ours = criterion_rate(&format!("16_tasks/10k_keys_pool{pool}_inflight{in_flight}"));
        let rate = ours.map_or("–".to_owned(), |v| format!("{v:.0}"));
        println!("| {pool} | {in_flight} | {rate} |");
    }
    println!("\n| keys in one statement | median ms | ms per key |");
    println!("|---|---|---|");
    for n in [1usize, 16, 64, 256, 1024] {
        let ms = statement_ms(&setup, n);
        println!("| {n} | {ms:.2} | {:.3} |", ms / n as f64);
    }
}
