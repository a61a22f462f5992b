//! Keys spread over three PostgreSQL primaries (H3–H6, docs/testing.md): a `ShardedStore` per
//! limiter instance over its own pools to three throwaway clusters. The envelope holds for
//! every key across shards in direct and leased mode (H3, H4); one cluster stopped mid-run
//! sends only its own keys to the fallback (H5); adding a shard without copying rows admits
//! at most one capacity per moved key, once (H6). Runs in the nextest `serial` group:
//! timing-dependent.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use metrics_util::debugging::DebugValue;
use tokenlease::bucket::Tokens;
use tokenlease::policy::{Accounting, FallbackMode, FallbackSettings, LeaseSettings, Plan};
use tokenlease::store::{AcquireRequest, PostgresStoreBuilder, ShardedStore, Store};
use tokenlease::{DecidedBy, Limiter};
use tokenlease_testkit::{StopMode, TempPostgres};

const C: f64 = 100.0;
const R: f64 = 50.0;
const B: f64 = 10.0;
const SLACK: f64 = 0.02;
const NAMES: [&str; 3] = ["pg-a", "pg-b", "pg-c"];
const WINDOWS: [f64; 6] = [0.05, 0.1, 0.5, 1.0, 2.0, 4.0];
/// Limiter instances.
const N: usize = 2;
/// Tasks per instance.
const TASKS: usize = 8;

/// `tokenlease_circuit_state` per `store` label, as the recorder holds it now.
fn circuit_states() -> HashMap<String, f64> {
    common::metrics()
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(k, ..)| k.key().name() == "tokenlease_circuit_state")
        .filter_map(|(k, _, _, v)| {
            let store = k
                .key()
                .labels()
                .find(|l| l.key() == "store")?
                .value()
                .to_owned();
            match v {
                DebugValue::Gauge(g) => Some((store, g.into_inner())),
                _ => None,
            }
        })
        .collect()
}

/// Generous timeouts: these runs are about correctness, not failure behaviour.
fn generous(builder: PostgresStoreBuilder) -> PostgresStoreBuilder {
    builder
        .pool_size(4)
        .call_timeout(Duration::from_secs(5))
        .pool_wait_timeout(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(5))
        .statement_timeout(Duration::from_secs(5))
        .lock_timeout(Duration::from_secs(5))
}

fn shard_list(clusters: &[Arc<TempPostgres>]) -> Vec<(&'static str, String)> {
    NAMES
        .iter()
        .copied()
        .zip(clusters.iter().map(|pg| pg.url()))
        .collect()
}

/// One instance's store: its own pools to every cluster, through `ShardedStore::connect_with`.
async fn sharded(clusters: &[Arc<TempPostgres>]) -> ShardedStore {
    ShardedStore::connect_with(&shard_list(clusters), generous)
        .await
        .expect("sharded store")
}

/// Two keys per shard, named `prefix:i`, in shard order; asserts each shard holds two.
fn keys(prefix: &str) -> Vec<String> {
    let mut keys = Vec::new();
    for shard in 0..NAMES.len() {
        let on = common::keys_on(&NAMES, shard, prefix, 2);
        assert_eq!(on.len(), 2);
        keys.extend(on);
    }
    let per_shard = |s: usize| {
        keys.iter()
            .filter(|k| tokenlease::store::shard_of(&NAMES, k) == Some(s))
            .count()
    };
    assert!((0..NAMES.len()).all(|s| per_shard(s) == 2));
    keys
}

/// One decision.
#[derive(Debug, Clone)]
struct Event {
    instance: usize,
    /// When the decision came back, since the run's origin (local monotonic clock).
    at: Duration,
    key: usize,
    allowed: bool,
    by: DecidedBy,
    /// The database's now() for store decisions.
    store_time: Option<SystemTime>,
    /// How long the caller waited.
    took: Duration,
}

/// `N` limiters × `TASKS` tasks for `duration`, task `t` of instance `i` cycling through
/// `keys` from its own offset, a 500 µs pause after each call.
fn drive(
    limiters: &[Limiter],
    plan: &Arc<Plan>,
    keys: &Arc<Vec<String>>,
    origin: Instant,
    duration: Duration,
) -> tokio::task::JoinHandle<Vec<Event>> {
    let mut handles = Vec::new();
    for (i, limiter) in limiters.iter().enumerate() {
        for t in 0..TASKS {
            let (limiter, plan, keys) = (limiter.clone(), Arc::clone(plan), Arc::clone(keys));
            handles.push(tokio::spawn(async move {
                let mut events = Vec::new();
                let mut n = t * 7 + i * 3;
                while origin.elapsed() < duration {
                    n += 1;
                    let key = n % keys.len();
                    let started = Instant::now();
                    let d = limiter
                        .try_acquire_with(&plan, &keys[key], 1.0)
                        .await
                        .expect("decision");
                    events.push(Event {
                        instance: i,
                        at: origin.elapsed(),
                        key,
                        allowed: d.allowed,
                        by: d.decided_by,
                        store_time: d.store_time,
                        took: started.elapsed(),
                    });
                    // sleep: pacing, calls 500 µs apart.
                    tokio::time::sleep(Duration::from_micros(500)).await;
                }
                events
            }));
        }
    }
    tokio::spawn(async move {
        let mut all = Vec::new();
        for h in handles {
            all.extend(h.await.expect("task"));
        }
        all
    })
}

/// Every window of every key within `C + R·(w + SLACK) + extra`; returns the admissions per
/// key. Times: the database's for direct mode (`by_store`), the local clock for leases.
fn assert_envelope(events: &[Event], keys: &[String], extra: f64, by_store: bool) -> Vec<f64> {
    let mut admitted = vec![0.0; keys.len()];
    for (k, key) in keys.iter().enumerate() {
        let mut points: Vec<f64> = Vec::new();
        let t0 = events
            .iter()
            .filter_map(|e| e.store_time)
            .min()
            .unwrap_or(SystemTime::UNIX_EPOCH);
        for e in events.iter().filter(|e| e.key == k && e.allowed) {
            let t = if by_store {
                common::secs_between(t0, e.store_time.expect("store time"))
            } else {
                e.at.as_secs_f64()
            };
            points.push(t);
        }
        points.sort_by(f64::total_cmp);
        let points: Vec<(f64, f64)> = points.into_iter().map(|t| (t, 1.0)).collect();
        admitted[k] = points.len() as f64;
        for w in WINDOWS {
            let (excess, count) = common::worst_window(&points, w, C, R, SLACK);
            assert!(
                excess <= extra + 1e-9,
                "{key} (shard {:?}): window {w} s admitted {count} > {C} + {R}·({w} + {SLACK}) + {extra}",
                tokenlease::store::shard_of(&NAMES, key)
            );
        }
    }
    admitted
}

/// H3: C1 across shards in direct mode. Two instances, each a `ShardedStore` over its own
/// pools to the three clusters, × 8 tasks on six keys (two per shard) for 4 s: every decision
/// is the store's, every sliding window of every key holds `C + r·(w + ε)` within one token
/// (as C1), and every key reaches 80% of its ideal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_mode_holds_the_envelope_on_every_shard() {
    let _serial = common::serial().await;
    let clusters = common::clusters(3).await;
    let keys = Arc::new(keys("h3"));
    let mut limiters = Vec::new();
    for _ in 0..N {
        limiters.push(Limiter::builder(sharded(&clusters).await).build());
    }
    let plan = Arc::new(common::plan(100, R));
    let origin = Instant::now();
    let events = drive(&limiters, &plan, &keys, origin, Duration::from_secs(4))
        .await
        .expect("run");
    let t = origin.elapsed().as_secs_f64();
    assert!(
        events.iter().all(|e| e.by == DecidedBy::Store),
        "a decision not by the store"
    );
    let admitted = assert_envelope(&events, &keys, 1.0, true);
    for (k, n) in admitted.iter().enumerate() {
        assert!(
            *n >= 0.8 * (C + R * t) - 5.0,
            "liveness: {} admitted {n} in {t:.2} s",
            keys[k]
        );
    }
    eprintln!(
        "H3 direct: {} calls over {t:.2} s, admitted per key {admitted:?} (ideal {:.0})",
        events.len(),
        C + R * t
    );
    for limiter in &limiters {
        limiter.shutdown().await;
    }
}

fn leased_plan(accounting: Accounting) -> Plan {
    common::plan(100, R)
        .with_lease(
            LeaseSettings::default()
                .with_ttl(Duration::from_secs(1))
                .with_max_fraction(0.1)
                .with_low_water(0.5)
                .with_refresh(Duration::from_millis(100))
                .with_max_wait(Duration::from_millis(50))
                .with_accounting(accounting),
        )
        .with_fallback(FallbackSettings::new(FallbackMode::Deny))
}

/// H4: C1 across shards in leased mode, relaxed and strict: the same run with leases of at
/// most B = 10. Every window of every key holds `C + r·(w + ε) + N·B` (relaxed) or
/// `C + r·(w + ε)` (strict); lease accounting is exact per instance; at most 1% of calls wait
/// out `max_wait` (denied by the fallback: under-admission only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_mode_holds_the_envelope_on_every_shard() {
    let _serial = common::serial().await;
    let clusters = common::clusters(3).await;
    for accounting in [Accounting::Relaxed, Accounting::Strict] {
        // Fresh keys for each run: the first run leaves its keys' buckets drained.
        let keys = Arc::new(keys(&format!("h4:{accounting:?}")));
        let mut limiters = Vec::new();
        for _ in 0..N {
            limiters.push(Limiter::builder(sharded(&clusters).await).build());
        }
        let plan = Arc::new(leased_plan(accounting));
        let origin = Instant::now();
        let events = drive(&limiters, &plan, &keys, origin, Duration::from_secs(4))
            .await
            .expect("run");
        let t = origin.elapsed().as_secs_f64();
        let fallback = events
            .iter()
            .filter(|e| matches!(e.by, DecidedBy::Fallback(_)))
            .count();
        assert!(
            fallback * 100 <= events.len(),
            "{accounting:?}: {fallback} of {} calls waited out max_wait",
            events.len()
        );
        let extra = match accounting {
            Accounting::Relaxed => N as f64 * B,
            _ => 0.0,
        };
        let admitted = assert_envelope(&events, &keys, extra, false);
        for (k, n) in admitted.iter().enumerate() {
            assert!(
                *n >= 0.7 * (C + R * t) - extra,
                "liveness {accounting:?}: {} admitted {n} in {t:.2} s",
                keys[k]
            );
        }
        for (i, limiter) in limiters.iter().enumerate() {
            limiter.shutdown().await;
            let stats = limiter.lease_stats().expect("leased");
            let by_lease = events
                .iter()
                .filter(|e| e.instance == i && e.allowed && e.by == DecidedBy::Lease)
                .count();
            assert_eq!(
                stats.outstanding, 0.0,
                "instance {i}: shutdown gave all back"
            );
            common::assert_conserved(&format!("instance {i}"), by_lease as f64, &stats);
        }
        eprintln!(
            "H4 {accounting:?}: {} calls over {t:.2} s, admitted per key {admitted:?} (ideal {:.0}), {fallback} by the fallback",
            events.len(),
            C + R * t
        );
    }
}

/// H5: one cluster stopped mid-run (`pg_ctl stop -m fast` at 1.5 s, started again at 3.5 s of
/// a 6 s run), direct mode, fallback `deny`, each shard behind its own breaker. The stopped
/// shard's keys are decided by the fallback while it is down and by the store again after it
/// is back; the other shards' keys get no fallback decision at all; the stopped shard's
/// breaker opens and the others stay closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_shard_sends_only_its_own_keys_to_the_fallback() {
    h5(false).await;
}

/// H5 in leased mode (relaxed, fallback `deny`, `max_wait` 100 ms, the pools' wait 250 ms):
/// the stopped shard's keys spend their leases and then go to the fallback, never to the store,
/// while it is down, and are leased again after; the other shards' keys go to the fallback in
/// the fault no more often than in the same run's time without it, plus one stall of every
/// caller (a loaded machine's refill slower than `max_wait`): the lease actor does not wait for
/// the stopped shard's statements to refill the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_a_stopped_shard_sends_only_its_own_keys_to_the_fallback() {
    h5(true).await;
}

async fn h5(leased: bool) {
    let _serial = common::serial().await;
    let _ = common::metrics();
    let clusters = common::clusters(3).await;
    let keys = Arc::new(keys(if leased { "h5:leased" } else { "h5" }));
    let label = if leased { "H5 leased" } else { "H5" };
    let down = 1; // pg-b
    let mut limiters = Vec::new();
    for _ in 0..N {
        // A pool wait a little above the default (40 ms), and a call timeout (the direct-mode
        // caller's deadline) long enough that a loaded 2-core machine does not time out a
        // healthy shard's statement: the test is about which keys the stopped shard affects.
        // A pool whose server is down waits out its pool wait (bb8 retries the connection), so
        // until the breaker opens a call on the stopped shard takes about that long. Leased,
        // 250 ms: well over the callers' `max_wait` (below), so that a caller waiting behind
        // such a call is seen to (a healthy shard's pool, one statement in flight per instance,
        // never waits).
        let pool_wait = Duration::from_millis(if leased { 250 } else { 150 });
        let list = shard_list(&clusters);
        let store = ShardedStore::connect_with(&list, |b| {
            b.pool_size(4)
                .call_timeout(Duration::from_secs(1))
                .pool_wait_timeout(pool_wait)
                .connect_timeout(Duration::from_millis(250))
                .statement_timeout(Duration::from_millis(500))
                .lock_timeout(Duration::from_millis(500))
        })
        .await
        .expect("sharded store");
        limiters.push(Limiter::builder(store).build());
    }
    let plan = Arc::new(if leased {
        // A caller waits up to 100 ms for a refill: longer than a healthy shard's refill takes
        // on a loaded 2-core machine (up to 73 ms seen), shorter than the stopped shard's pool
        // wait, so a caller that falls back on a healthy key waited behind the stopped shard.
        let plan = leased_plan(Accounting::Relaxed);
        let lease = plan
            .lease()
            .copied()
            .expect("leased")
            .with_max_wait(Duration::from_millis(100));
        plan.with_lease(lease)
    } else {
        common::plan(100, R).with_fallback(FallbackSettings::new(FallbackMode::Deny))
    });
    let origin = Instant::now();
    let run = drive(&limiters, &plan, &keys, origin, Duration::from_secs(6));

    // sleep: the fault timeline, the shard stopped at 1.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(1500)).into()).await;
    let stopping = origin.elapsed();
    let pg = Arc::clone(&clusters[down]);
    tokio::task::spawn_blocking(move || pg.stop(StopMode::Fast).expect("stop"))
        .await
        .expect("stop task");
    let stopped = origin.elapsed();
    // The stopped shard's breaker opens (polled, with a deadline); the others stay closed.
    let states = common::poll_until(
        Duration::from_millis(10),
        Duration::from_secs(2),
        async || {
            let states = circuit_states();
            if states.get(NAMES[down]).copied() == Some(1.0) {
                Ok(states)
            } else {
                Err(states)
            }
        },
    )
    .await
    .unwrap_or_else(|states| states);
    assert_eq!(states.get(NAMES[down]), Some(&1.0), "{states:?}");
    for (i, name) in NAMES.iter().enumerate() {
        if i != down {
            assert_eq!(states.get(*name), Some(&0.0), "{name}: {states:?}");
        }
    }
    // sleep: the fault timeline, the shard down until 3.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(3500)).into()).await;
    let starting = origin.elapsed();
    let pg = Arc::clone(&clusters[down]);
    tokio::task::spawn_blocking(move || pg.start_again().expect("start again"))
        .await
        .expect("start task");
    let up = origin.elapsed();
    let events = run.await.expect("run");

    let on = |e: &Event| tokenlease::store::shard_of(&NAMES, &keys[e.key]) == Some(down);
    let healthy_fallback = events
        .iter()
        .filter(|e| !on(e) && matches!(e.by, DecidedBy::Fallback(_)))
        .count();
    let healthy = events.iter().filter(|e| !on(e)).count();
    if leased {
        // The fault: from `pg_ctl stop` until 0.5 s after the server is up again (the breaker's
        // probe closes it). Without a fault, a leased key goes to the fallback only when a
        // loaded machine makes a refill slower than `max_wait` (H4). What this run produced
        // so outside the fault, from 0.5 s in (the pools' first statements) to the stop and
        // from the fault's end to the run's, is what the healthy keys may have in the fault,
        // per second, plus one such stall of every caller (`N × TASKS`, each falling back
        // about once). Waiting for the stopped shard's statements, as the lease actor did when
        // it sent a round's refills as one call, cost them 32–69 here.
        let warm = Duration::from_millis(500);
        let fault_end = up + Duration::from_millis(500);
        let end = events.iter().map(|e| e.at).max().unwrap_or_default();
        let in_fault = |e: &Event| e.at >= stopping && e.at < fault_end;
        let healthy_fallback_in = |fault: bool| {
            events
                .iter()
                .filter(|e| {
                    !on(e)
                        && e.at >= warm
                        && in_fault(e) == fault
                        && matches!(e.by, DecidedBy::Fallback(_))
                })
                .count()
        };
        let (during, quiet) = (healthy_fallback_in(true), healthy_fallback_in(false));
        let fault_secs = (fault_end - stopping).as_secs_f64();
        let quiet_secs = ((stopping - warm) + end.saturating_sub(fault_end)).as_secs_f64();
        let allowed = (quiet as f64 * fault_secs / quiet_secs).ceil() as usize + N * TASKS;
        eprintln!(
            "{label}: healthy keys' fallback decisions: {during} in the {fault_secs:.2} s of the fault, {quiet} in the {quiet_secs:.2} s without (allowed in the fault: {allowed})"
        );
        assert!(
            during <= allowed,
            "{during} decisions on the healthy shards' keys by the fallback in the {fault_secs:.2} s of the fault, {quiet} in {quiet_secs:.2} s without it"
        );
    } else {
        assert_eq!(
            healthy_fallback, 0,
            "{healthy_fallback} of {healthy} decisions on the healthy shards' keys by the fallback"
        );
    }
    let outage: Vec<&Event> = events
        .iter()
        .filter(|e| on(e) && e.at > stopped + Duration::from_millis(100) && e.at < starting)
        .collect();
    assert!(!outage.is_empty(), "calls on the stopped shard's keys");
    if leased {
        // Leases are spent from memory; nothing is decided by the store.
        assert!(outage.iter().all(|e| e.by != DecidedBy::Store));
        assert!(
            outage
                .iter()
                .any(|e| matches!(e.by, DecidedBy::Fallback(FallbackMode::Deny))),
            "the stopped shard's keys reach the fallback while it is down"
        );
    } else {
        assert!(
            outage
                .iter()
                .all(|e| matches!(e.by, DecidedBy::Fallback(FallbackMode::Deny)) && !e.allowed),
            "the stopped shard's keys are denied by the fallback while it is down"
        );
    }
    // Back after start_again: every key of the stopped shard has store decisions, and from
    // 1.5 s after the server was up, no more fallback decisions.
    for (k, key) in keys.iter().enumerate() {
        if tokenlease::store::shard_of(&NAMES, key) != Some(down) {
            continue;
        }
        let first_store = events
            .iter()
            .filter(|e| e.key == k && e.at > starting && !matches!(e.by, DecidedBy::Fallback(_)))
            .map(|e| e.at)
            .min()
            .unwrap_or_else(|| panic!("{key}: no store or lease decision after start_again"));
        let late_fallback = events
            .iter()
            .filter(|e| {
                e.key == k
                    && e.at > up + Duration::from_millis(1500)
                    && matches!(e.by, DecidedBy::Fallback(_))
            })
            .count();
        let late = events
            .iter()
            .filter(|e| e.key == k && e.at > up + Duration::from_millis(1500))
            .count();
        if leased {
            // A refill slower than max_wait goes to the fallback with no fault at all (H4):
            // at most 1%, or one stall of every caller (a loaded machine made one refill of
            // each instance slow: 16 of 693 calls in a run beside two busy loops). A shard not
            // back has all its calls there.
            assert!(
                late_fallback <= late / 100 + N * TASKS,
                "{key}: {late_fallback} of {late} decisions by the fallback long after recovery"
            );
        } else {
            assert_eq!(
                late_fallback, 0,
                "{key}: fallback decisions long after recovery"
            );
        }
        eprintln!(
            "{label} {key}: first decision by the store or a lease {:.0} ms after pg_ctl start began (it took {:.0} ms)",
            (first_store - starting).as_secs_f64() * 1e3,
            (up - starting).as_secs_f64() * 1e3
        );
    }
    // The envelope still holds on every key for what the store and the leases decided.
    if leased {
        let decided: Vec<Event> = events
            .iter()
            .filter(|e| !matches!(e.by, DecidedBy::Fallback(_)))
            .cloned()
            .collect();
        assert_envelope(&decided, &keys, N as f64 * B, false);
    } else {
        let stored: Vec<Event> = events
            .iter()
            .filter(|e| e.by == DecidedBy::Store)
            .cloned()
            .collect();
        assert_envelope(&stored, &keys, 1.0, true);
    }
    let healthy_max = events
        .iter()
        .filter(|e| !on(e))
        .map(|e| e.took)
        .max()
        .unwrap_or_default();
    let healthy_outage_slow = events
        .iter()
        .filter(|e| {
            !on(e) && e.at > stopped && e.at < starting && e.took > Duration::from_millis(50)
        })
        .count();
    let healthy_outage = events
        .iter()
        .filter(|e| !on(e) && e.at > stopped && e.at < starting)
        .count();
    let healthy_outage_fallback = events
        .iter()
        .filter(|e| {
            !on(e) && e.at > stopped && e.at < starting && matches!(e.by, DecidedBy::Fallback(_))
        })
        .count();
    if !leased {
        assert!(
            healthy_max <= Duration::from_millis(500),
            "a healthy shard's key waited {healthy_max:?}"
        );
        // The direct-mode limiter batches keys of one shard only (`Store::partition`): a
        // healthy key never waits for the stopped shard's part.
        assert!(
            healthy_outage_slow * 100 <= healthy_outage,
            "{healthy_outage_slow} of {healthy_outage} healthy calls in the outage took over 50 ms"
        );
    }
    eprintln!(
        "{label}: {} calls, {healthy} on healthy shards' keys ({healthy_fallback} by the fallback, {healthy_outage_fallback} of them in the outage; slowest {:.0} ms; {healthy_outage_slow} of {healthy_outage} over 50 ms in the outage), {} on the stopped shard's keys in the outage",
        events.len(),
        healthy_max.as_secs_f64() * 1e3,
        outage.len()
    );
    for limiter in &limiters {
        limiter.shutdown().await;
    }
}

/// H6: adding a shard without copying rows. With two shards, a key that will move to the third
/// is drained; with the third shard added its bucket is absent there, so it starts full: the
/// next second admits up to `C` more than the drained bucket would have (`C + r·t` instead of
/// `r·t`), once, and then the key is back to `r` a second. A key that does not move keeps its
/// drained bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_key_starts_full_on_its_new_shard_once() {
    let _serial = common::serial().await;
    let clusters = common::clusters(3).await;
    let bucket = common::bucket(100, R);
    let two: Vec<(&str, String)> = shard_list(&clusters).into_iter().take(2).collect();
    let moved = moving_key(&NAMES[..2], &NAMES, "h6:moved");
    let stays = (0..)
        .map(|i| format!("h6:stays:{i}"))
        .find(|k| {
            tokenlease::store::shard_of(&NAMES[..2], k) == tokenlease::store::shard_of(&NAMES, k)
        })
        .expect("a key that stays");
    let before = ShardedStore::connect_with(&two, generous)
        .await
        .expect("two");
    let mut drained_at = Vec::new();
    for key in [&moved, &stays] {
        let drained = before
            .acquire(AcquireRequest::take(key, bucket, Tokens::whole(100)))
            .await
            .expect("drain");
        assert_eq!(drained.granted.as_f64(), C);
        drained_at.push(drained.store_now);
    }
    let after = ShardedStore::connect_with(&shard_list(&clusters), generous)
        .await
        .expect("three");
    assert_eq!(after.shard_name(&moved), NAMES[2]);
    assert_ne!(before.shard_name(&moved), NAMES[2]);
    assert_eq!(after.shard_name(&stays), before.shard_name(&stays));
    // Take everything there is, for one second on each key.
    for ((key, extra), drained) in [(&moved, C), (&stays, 0.0)].into_iter().zip(drained_at) {
        let (granted, last) = common::take_for_a_second(&after, key, bucket).await;
        // What the drained bucket could give since the drain: its refill, r × the database
        // time from the drain to the last grant (the clusters share this machine's clock).
        let refill = R * common::secs_between(drained, last);
        eprintln!(
            "H6 {key}: granted {granted} after the switch, refill since the drain {refill:.1}"
        );
        assert!(
            granted <= extra + refill + 1.0,
            "{key}: {granted} > {extra} + {refill:.1}"
        );
        if extra > 0.0 {
            assert!(
                granted >= C,
                "{key} moved: its new bucket starts full, {granted} granted"
            );
        }
    }
}

/// A key that `old` places on one of its shards and `new` places on the shard `new` adds.
fn moving_key(old: &[&str], new: &[&str], prefix: &str) -> String {
    (0..)
        .map(|i| format!("{prefix}:{i}"))
        .find(|k| {
            tokenlease::store::shard_of(new, k) == Some(new.len() - 1)
                && tokenlease::store::shard_of(old, k).is_some()
        })
        .expect("a moving key")
}
