//! Distributed safety and liveness in direct mode (B1, C1, C2, C3, C7, C9): several
//! limiter instances, each with its own pool, and many tasks on one real server, checked against
//! the envelope of one ideal bucket. Runs in the nextest `serial` group: timing-dependent.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokenlease::Limiter;
use tokenlease::bucket::Tokens;
use tokenlease::error::Error;
use tokenlease::store::{AcquireRequest, Store};

const C: f64 = 100.0;
const R: f64 = 50.0;
/// Clock slack for window checks: statements of one instant may commit in another order.
const SLACK: f64 = 0.02;
const WINDOWS: [f64; 5] = [0.1, 0.5, 1.0, 2.0, 5.0];

/// One admission: (instance, the database's now() when it was decided, cost).
type Admission = (usize, SystemTime, f64);

/// Checks every sliding window of every length in [`WINDOWS`] against `C + R·(w + SLACK)` plus
/// `extra`, on database time.
fn assert_envelope(admissions: &[Admission], capacity: f64, rate: f64, extra: f64) {
    let Some(t0) = admissions.iter().map(|a| a.1).min() else {
        return;
    };
    let mut points: Vec<(f64, f64)> = admissions
        .iter()
        .map(|&(_, t, cost)| (common::secs_between(t0, t), cost))
        .collect();
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    for w in WINDOWS {
        let (excess, count) = common::worst_window(&points, w, capacity, rate, SLACK);
        assert!(
            excess <= extra + 1e-6,
            "window {w} s admitted {count}, more than {capacity} + {rate}·({w} + {SLACK}) + {extra}"
        );
    }
}

/// What [`hammer`] saw.
struct Run {
    admissions: Vec<(usize, String, SystemTime, f64)>,
    denials: Vec<u64>,
    calls: u64,
}

/// Runs `instances` limiters (each with its own pool) × `tasks` tasks for `duration`; call `i`
/// of a task takes `cost(i)` from the key `key(i)`.
async fn hammer(
    db: &tokenlease_testkit::TestDatabase,
    instances: usize,
    tasks: usize,
    duration: Duration,
    plan: tokenlease::policy::Plan,
    key: fn(usize) -> String,
    cost: fn(usize) -> f64,
) -> Run {
    let plan = Arc::new(plan);
    let mut handles = Vec::new();
    for instance in 0..instances {
        let limiter = Limiter::builder(common::store(db, 4).await).build();
        for task in 0..tasks {
            let (limiter, plan) = (limiter.clone(), Arc::clone(&plan));
            handles.push(tokio::spawn(async move {
                let deadline = Instant::now() + duration;
                let (mut admitted, mut denied, mut calls) = (Vec::new(), 0u64, 0u64);
                let mut i = task.wrapping_mul(7919).wrapping_add(instance * 104_729);
                while Instant::now() < deadline && calls < 10_000 {
                    i = i.wrapping_add(1);
                    let (k, c) = (key(i), cost(i));
                    let d = limiter
                        .try_acquire_with(&plan, &k, c)
                        .await
                        .expect("decision");
                    calls += 1;
                    assert_eq!(
                        d.decided_by,
                        tokenlease::DecidedBy::Store,
                        "no fallback here"
                    );
                    if d.allowed {
                        admitted.push((instance, k, d.store_time.expect("store time"), c));
                    } else {
                        denied += 1;
                    }
                    // sleep: pacing. A real caller does some work between requests.
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
                (instance, admitted, denied, calls)
            }));
        }
    }
    let mut run = Run {
        admissions: Vec::new(),
        denials: vec![0; instances],
        calls: 0,
    };
    for handle in handles {
        let (instance, admitted, denied, n) = handle.await.expect("task");
        run.denials[instance] += denied;
        run.calls += n;
        run.admissions.extend(admitted);
    }
    run
}

/// Seconds of database time the admissions span.
fn span(admissions: &[(usize, String, SystemTime, f64)]) -> f64 {
    let first = admissions.iter().map(|a| a.2).min();
    let last = admissions.iter().map(|a| a.2).max();
    match (first, last) {
        (Some(a), Some(b)) => common::secs_between(a, b),
        _ => 0.0,
    }
}

fn points(admissions: &[(usize, String, SystemTime, f64)]) -> Vec<Admission> {
    admissions.iter().map(|a| (a.0, a.2, a.3)).collect()
}

fn one_key(_: usize) -> String {
    "hot".to_owned()
}

fn cost_one(_: usize) -> f64 {
    1.0
}

/// C1 and C9 in direct mode: 2 instances × 16 tasks on one key for 5 s. Every window holds the
/// envelope within one token; admissions reach at least 95% of it; each instance sees denials.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_key_hold_the_envelope() {
    let db = common::database().await;
    let run = hammer(
        &db,
        2,
        16,
        Duration::from_secs(5),
        common::plan(100, R),
        one_key,
        cost_one,
    )
    .await;
    let admitted = run.admissions.len() as f64;
    let t = span(&run.admissions);
    assert_envelope(&points(&run.admissions), C, R, 1.0);
    let ideal = C + R * t;
    assert!(
        admitted <= ideal + 1.0,
        "admitted {admitted} > ideal {ideal}"
    );
    assert!(
        admitted >= 0.95 * ideal,
        "liveness: admitted {admitted} < 95% of {ideal}"
    );
    for (instance, denied) in run.denials.iter().enumerate() {
        assert!(
            *denied >= 1,
            "instance {instance} never denied (Gubernator #208)"
        );
    }
    eprintln!(
        "C1 direct: {} calls, {admitted} admitted over {t:.3} s (ideal {ideal:.1}), denials {:?}",
        run.calls, run.denials
    );
}

/// B1: the statement alone is atomic. 2 pools × 16 connections run it with cost 1 on one key for
/// 3 s: the sum granted stays within C + r·(t_last − t_first) of database time, and reaches 95%.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bare_statement_is_atomic_under_32_connections() {
    let db = common::database().await;
    let config = common::bucket(100, R);
    let mut handles = Vec::new();
    for _ in 0..2 {
        let store = Arc::new(common::store(&db, 16).await);
        for _ in 0..16 {
            let store = Arc::clone(&store);
            handles.push(tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_secs(3);
                let mut grants = Vec::new();
                while Instant::now() < deadline {
                    let a = store
                        .acquire(AcquireRequest::take("bare", config, Tokens::whole(1)))
                        .await
                        .expect("acquire");
                    grants.push((a.store_now, a.granted));
                }
                grants
            }));
        }
    }
    let mut grants = Vec::new();
    for h in handles {
        grants.extend(h.await.expect("task"));
    }
    let first = grants.iter().map(|g| g.0).min().expect("calls");
    let last = grants.iter().map(|g| g.0).max().expect("calls");
    let granted: f64 = grants.iter().map(|g| g.1.as_f64()).sum();
    let bound = C + R * common::secs_between(first, last) + 1e-6 * C;
    assert!(granted <= bound, "granted {granted} > {bound}");
    assert!(
        granted >= 0.95 * bound,
        "granted {granted} < 95% of {bound}"
    );
    eprintln!(
        "B1: {} statements, granted {granted} of bound {bound:.1}",
        grants.len()
    );
}

/// C2: a bucket that starts empty admits no more than the refill rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_bucket_admits_only_the_refill_rate() {
    let db = common::database().await;
    let store = common::store(&db, 1).await;
    let config = common::bucket(100, R);
    store
        .acquire(AcquireRequest::take("hot", config, Tokens::whole(100)))
        .await
        .expect("drain");
    let started = store
        .inspect("hot")
        .await
        .expect("inspect")
        .expect("row")
        .updated_at;
    let run = hammer(
        &db,
        2,
        16,
        Duration::from_secs(5),
        common::plan(100, R),
        one_key,
        cost_one,
    )
    .await;
    let last = run
        .admissions
        .iter()
        .map(|a| a.2)
        .max()
        .expect("admissions");
    let t = common::secs_between(started, last);
    let admitted = run.admissions.len() as f64;
    assert!(
        admitted <= R * t + 1.0,
        "admitted {admitted} in {t:.3} s from empty"
    );
    assert!(
        admitted >= 0.95 * R * t - 1.0,
        "liveness: {admitted} in {t:.3} s"
    );
}

fn mixed_cost(i: usize) -> f64 {
    (1 + i % 10) as f64
}

/// C3: mixed costs 1..10 obey the same envelope in cost; a cost above the capacity is refused
/// at once, without a store call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_costs_hold_the_envelope_and_impossible_costs_are_refused() {
    let db = common::database().await;
    let run = hammer(
        &db,
        2,
        16,
        Duration::from_secs(5),
        common::plan(100, R),
        one_key,
        mixed_cost,
    )
    .await;
    let t = span(&run.admissions);
    let admitted: f64 = run.admissions.iter().map(|a| a.3).sum();
    assert_envelope(&points(&run.admissions), C, R, 1.0);
    // Whole costs of up to 10 can leave up to 9 tokens unused at the end of a window.
    assert!(
        admitted >= 0.9 * (C + R * t),
        "liveness: {admitted} of {}",
        C + R * t
    );

    let limiter = Limiter::builder(common::store(&db, 1).await).build();
    let started = Instant::now();
    let err = limiter
        .try_acquire_with(&common::plan(100, R), "never", 101.0)
        .await
        .expect_err("cost above capacity");
    assert!(
        started.elapsed() < Duration::from_millis(1),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(err, Error::InvalidCost { .. }));
    assert!(
        limiter
            .store()
            .inspect("never")
            .await
            .expect("inspect")
            .is_none()
    );
}

fn thousand_keys(i: usize) -> String {
    // A multiplicative hash spreads consecutive calls over the keys.
    format!("key-{}", i.wrapping_mul(2_654_435_761) % 1000)
}

/// C7: 1,000 keys, uniform traffic from 2 instances: the envelope holds for every key, and the
/// table has one row per key touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_of_a_thousand_holds_its_envelope() {
    let db = common::database().await;
    let (c, r) = (2.0, 1.0);
    let run = hammer(
        &db,
        2,
        16,
        Duration::from_secs(5),
        common::plan(2, r),
        thousand_keys,
        cost_one,
    )
    .await;
    let mut by_key: HashMap<&str, Vec<Admission>> = HashMap::new();
    for a in &run.admissions {
        by_key
            .entry(a.1.as_str())
            .or_default()
            .push((a.0, a.2, a.3));
    }
    for (key, admissions) in &by_key {
        let _ = key;
        assert_envelope(admissions, c, r, 1.0);
    }
    assert!(
        run.denials.iter().sum::<u64>() > 0,
        "the per-key limit bites"
    );
    let touched: HashSet<&str> = by_key.keys().copied().collect();
    let conn = db.client().await.expect("connection");
    let rows: i64 = conn
        .query_one("SELECT count(*) FROM tokenlease_buckets", &[])
        .await
        .expect("count")
        .get(0);
    // Every key is called many times in 5 s, so every key has exactly one row.
    assert_eq!(rows, 1000, "{} keys admitted", touched.len());
}

/// Multi-key statements on overlapping keys, each listing its keys in its own order and some
/// keys touched for the first time, never deadlock: the function locks (or inserts) rows in key
/// order. 2 pools × 4 connections, 40 statements each of 48 of 64 keys; every statement must
/// succeed (a lock cycle would end one of them with a deadlock error), and each key's bucket ends
/// exactly `statements containing it` tokens below capacity (the refill at 1 token a minute adds
/// under a token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_multi_key_statements_never_deadlock() {
    const KEYS: usize = 64;
    let db = common::database().await;
    let config = common::bucket(1_000, 1.0 / 60.0);
    let keys: Arc<Vec<String>> = Arc::new((0..KEYS).map(|i| format!("overlap:{i:02}")).collect());
    let mut handles = Vec::new();
    for pool in 0..2u64 {
        let store = Arc::new(common::store(&db, 4).await);
        for task in 0..4u64 {
            let (store, keys) = (Arc::clone(&store), Arc::clone(&keys));
            handles.push(tokio::spawn(async move {
                let mut seed = 0x9e37_79b9_7f4a_7c15 ^ (pool * 4 + task + 1);
                let mut counts = vec![0u64; KEYS];
                for _ in 0..40 {
                    // 48 distinct keys in a pseudo-random order: a shuffle, cut.
                    let mut order: Vec<usize> = (0..KEYS).collect();
                    for i in (1..KEYS).rev() {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        order.swap(i, (seed % (i as u64 + 1)) as usize);
                    }
                    order.truncate(48);
                    let requests: Vec<AcquireRequest<'_>> = order
                        .iter()
                        .map(|&i| AcquireRequest::take(&keys[i], config, Tokens::whole(1)))
                        .collect();
                    let got = store.acquire_many(&requests).await.expect("no deadlock");
                    for (&i, a) in order.iter().zip(&got) {
                        assert_eq!(a.granted, Tokens::whole(1), "key {i}");
                        counts[i] += 1;
                    }
                }
                counts
            }));
        }
    }
    let mut counts = vec![0u64; KEYS];
    for h in handles {
        for (total, n) in counts.iter_mut().zip(h.await.expect("task")) {
            *total += n;
        }
    }
    let store = common::store(&db, 1).await;
    for (i, key) in keys.iter().enumerate() {
        let row = store.inspect(key).await.expect("inspect").expect("row");
        assert_eq!(row.tokens.floor(), 1_000 - counts[i], "key {key}");
    }
    if let Some(server) = db.server() {
        assert!(
            !server.log_contents().contains("deadlock"),
            "a deadlock was detected"
        );
    }
}
