//! Live policy reload (R1–R4) against a real server: a changed plan applies to the next
//! decision, live leases of a changed plan go back, a removed rule falls to the default plan,
//! and thousands of reloads under load from two instances keep every window inside the
//! envelope of the larger plan. Runs in the nextest `serial` group: timing-dependent.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokenlease::policy::Policies;
use tokenlease::{DecidedBy, Error, Limiter, ReloadError};

fn policies(json: &str) -> Policies {
    Policies::from_json_str(json, None).expect("a valid policy")
}

/// A policy whose rule `k:` names plan `p` with this capacity and rate, leased or not, and
/// with a default plan `d` (capacity 7) when asked.
fn file(capacity: u64, rate: f64, lease: Option<f64>, default: bool) -> Policies {
    let lease = lease.map_or(String::new(), |f| {
        format!(r#", "lease": {{ "max_fraction": {f}, "max_wait_ms": 1000 }}"#)
    });
    let default = if default {
        r#", "d": { "capacity": 7, "refill_per_second": 1 } }, "default_plan": "d""#
    } else {
        "}"
    };
    policies(&format!(
        r#"{{
          "plans": {{ "p": {{ "capacity": {capacity}, "refill_per_second": {rate},
                             "fallback": {{ "mode": "deny" }} {lease} }} {default},
          "keys": [ {{ "prefix": "k:", "plan": "p" }} ]
        }}"#
    ))
}

/// R1: direct mode. A reload that raises the refill rate lets the next call through at once; a
/// reload that drops the key's rule sends it to the default plan; one without a default refuses
/// the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r1_a_reload_applies_to_the_next_decision_in_direct_mode() {
    let db = common::database().await;
    let limiter = Limiter::builder(common::store(&db, 4).await)
        .policies(file(5, 0.001, None, false))
        .build();
    for i in 0..5 {
        let d = limiter.try_acquire("k:a", 1.0).await.expect("decision");
        assert!(d.allowed, "call {i}");
    }
    let d = limiter.try_acquire("k:a", 1.0).await.expect("decision");
    assert!(!d.allowed, "the bucket is empty: {d:?}");
    assert!(d.retry_after > Duration::from_secs(100), "{d:?}");

    // 1,000 tokens a second: the next statement refills with the new rate.
    limiter
        .reload(file(5, 1000.0, None, false))
        .expect("reload");
    // sleep: 20 ms of the server's clock, 20 tokens at the new rate.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let d = limiter.try_acquire("k:a", 1.0).await.expect("decision");
    assert!(d.allowed, "the new rate refilled the bucket: {d:?}");
    assert_eq!(d.decided_by, DecidedBy::Store);

    // The rule is gone: the default plan `d` (capacity 7) decides.
    limiter
        .reload(policies(
            r#"{ "plans": { "d": { "capacity": 7, "refill_per_second": 1 } },
                 "default_plan": "d" }"#,
        ))
        .expect("reload");
    let d = limiter.try_acquire("k:a", 1.0).await.expect("decision");
    assert_eq!(d.limit, tokenlease::bucket::Tokens::whole(7), "{d:?}");

    // No rule and no default: the key is refused, as for a key no policy ever matched.
    limiter
        .reload(policies(
            r#"{ "plans": { "x": { "capacity": 1, "refill_per_second": 1 } },
                 "keys": [ { "prefix": "x:", "plan": "x" } ] }"#,
        ))
        .expect("reload");
    match limiter.try_acquire("k:a", 1.0).await {
        Err(Error::NoPlanForKey { key }) => assert_eq!(key, "k:a"),
        other => panic!("expected NoPlanForKey, got {other:?}"),
    }
    assert_eq!(
        limiter.policies().expect("policies").plans().count(),
        1,
        "policies() shows what is in force"
    );
}

/// R2: leased mode. A live lease of a changed plan goes back to the store within the actor's
/// next round (its unspent tokens counted as returned), the key's next decision is the new
/// plan's, and an unchanged plan's lease is left alone. Leases live a minute here, so that
/// nothing but the reload closes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r2_a_reload_closes_the_leases_of_a_changed_plan() {
    let db = common::database().await;
    let both = |capacity: u64| {
        let lease = r#""lease": { "ttl_ms": 60000, "max_fraction": 0.5, "max_wait_ms": 1000 }"#;
        policies(&format!(
            r#"{{
              "plans": {{
                "p": {{ "capacity": {capacity}, "refill_per_second": 0.001, {lease} }},
                "q": {{ "capacity": 100, "refill_per_second": 0.001, {lease} }}
              }},
              "keys": [ {{ "prefix": "k:", "plan": "p" }}, {{ "prefix": "q:", "plan": "q" }} ]
            }}"#
        ))
    };
    let first = both(100);
    let (p, q) = (
        Arc::clone(first.plan("p").expect("p")),
        Arc::clone(first.plan("q").expect("q")),
    );
    let limiter = Limiter::builder(common::store(&db, 4).await)
        .policies(first)
        .build();
    // Calls until both keys hold a lease with a token to spare.
    let live = |plan: &Arc<tokenlease::policy::Plan>, key: &str| {
        limiter
            .try_acquire_now_with(plan, key, 1.0)
            .expect("decision")
            .is_some()
    };
    let until = Instant::now() + Duration::from_secs(10);
    while !(live(&p, "k:a") && live(&q, "q:a")) {
        assert!(Instant::now() < until, "no leases after 10 s");
        for key in ["k:a", "q:a"] {
            assert!(
                limiter
                    .try_acquire(key, 1.0)
                    .await
                    .expect("decision")
                    .allowed
            );
        }
        // sleep: pacing, calls 5 ms apart build the demand a lease needs.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = limiter.lease_stats().expect("stats");
    assert_eq!(before.keys, 2);

    let second = both(20);
    let p2 = Arc::clone(second.plan("p").expect("p"));
    limiter.reload(second).expect("reload");
    // The actor's next round closes `k:a`'s lease: it leaves the table and its tokens go back.
    common::eventually(
        Duration::from_millis(5),
        Duration::from_secs(5),
        "k:a's lease closed",
        async || {
            let now = limiter.lease_stats().expect("stats");
            if now.keys == 1 && now.returned > before.returned {
                Ok(())
            } else {
                Err(now)
            }
        },
    )
    .await;
    assert!(live(&q, "q:a"), "q's lease outlived the reload");
    assert!(
        !live(&p2, "k:a"),
        "k:a holds no lease until its next refill"
    );
    let d = limiter.try_acquire("k:a", 1.0).await.expect("decision");
    assert_eq!(d.limit, tokenlease::bucket::Tokens::whole(20), "{d:?}");
    limiter.shutdown().await;
    let stats = limiter.lease_stats().expect("stats");
    assert_eq!(stats.outstanding, 0.0);
}

/// R3 under load: two instances (their own pools and actors) × 8 tasks on one key for 3 s,
/// while another task reloads both instances' policies every millisecond, flipping the key's
/// plan between C = 100, r = 50/s (leases of at most 10) and C = 60, r = 30/s (leases of at
/// most 6). No call fails, and every window holds the larger plan's envelope
/// `100 + 50·(w + ε)` plus the lease bound `N · 10`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r3_thousands_of_reloads_under_load_keep_the_envelope() {
    const N: usize = 2;
    const TASKS: usize = 8;
    let db = common::database().await;
    let plan = |capacity: u64, rate: u64| {
        policies(&format!(
            r#"{{
              "plans": {{ "p": {{ "capacity": {capacity}, "refill_per_second": {rate},
                "lease": {{ "max_fraction": 0.1, "max_wait_ms": 50 }},
                "fallback": {{ "mode": "deny" }} }} }},
              "keys": [ {{ "prefix": "k:", "plan": "p" }} ]
            }}"#
        ))
    };
    let versions = [plan(100, 50), plan(60, 30)];
    let mut limiters = Vec::new();
    for _ in 0..N {
        limiters.push(
            Limiter::builder(common::store(&db, 4).await)
                .policies(versions[0].clone())
                .build(),
        );
    }
    let origin = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let reloads = Arc::new(AtomicU64::new(0));
    let reloader = {
        let (limiters, stop, reloads) = (limiters.clone(), Arc::clone(&stop), Arc::clone(&reloads));
        let versions = versions.clone();
        tokio::spawn(async move {
            let mut i = 0usize;
            // One reload a millisecond; ticks a loaded machine delays are caught up in a burst.
            let mut every = tokio::time::interval(Duration::from_millis(1));
            while !stop.load(Ordering::Relaxed) {
                every.tick().await;
                i += 1;
                for limiter in &limiters {
                    limiter.reload(versions[i % 2].clone()).expect("reload");
                }
                reloads.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let mut tasks = Vec::new();
    for limiter in &limiters {
        for _ in 0..TASKS {
            let limiter = limiter.clone();
            tasks.push(tokio::spawn(async move {
                let mut admitted = Vec::new();
                let (mut calls, mut fallback) = (0u64, 0u64);
                while origin.elapsed() < Duration::from_secs(3) {
                    calls += 1;
                    let d = limiter
                        .try_acquire("k:x", 1.0)
                        .await
                        .expect("no call fails");
                    if let DecidedBy::Fallback(_) = d.decided_by {
                        fallback += 1;
                    } else if d.allowed {
                        admitted.push(origin.elapsed().as_secs_f64());
                    }
                    // sleep: pacing, calls 2 ms apart.
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                (admitted, calls, fallback)
            }));
        }
    }
    let mut points = Vec::new();
    let (mut calls, mut fallback) = (0, 0);
    for t in tasks {
        let (a, c, f) = t.await.expect("task");
        points.extend(a.into_iter().map(|t| (t, 1.0)));
        calls += c;
        fallback += f;
    }
    stop.store(true, Ordering::Relaxed);
    reloader.await.expect("reloader");
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    let reloads = reloads.load(Ordering::Relaxed);
    eprintln!(
        "R3: {reloads} reloads of {N} instances; {calls} calls, {} admitted, {fallback} by the \
         (deny) fallback",
        points.len()
    );
    assert!(reloads >= 1000, "only {reloads} reloads");
    // A call whose lease a reload closed starts over on the key's new lease; only a refill
    // slower than the 50 ms `max_wait` (a loaded machine) goes to the fallback. (Before calls
    // started over, about half of them did.)
    assert!(
        fallback * 4 <= calls,
        "{fallback} of {calls} calls decided by the fallback"
    );
    let held = N as f64 * 10.0;
    for w in [0.1, 0.5, 1.0, 2.0] {
        let (excess, count) = common::worst_window(&points, w, 100.0, 50.0, 0.02);
        assert!(
            excess <= held + 1e-9,
            "a {w} s window admitted {count} > 100 + 50·({w} + 0.02) + {held}"
        );
    }
    // Liveness: the run admitted most of what the smaller plan alone would have.
    assert!(
        points.len() as f64 >= 0.5 * (60.0 + 30.0 * 3.0),
        "only {} admitted",
        points.len()
    );
    for limiter in &limiters {
        limiter.shutdown().await;
    }
}

/// R4: the registry of plans is bounded and shared: reloading the same two versions over and
/// over leaves it holding the plans in force, so the thousands of reloads of R3 cost no memory.
#[tokio::test]
async fn r4_reloading_the_same_versions_adds_no_plans() {
    let limiter = Limiter::builder(tokenlease::store::MemoryStore::new())
        .policies(file(5, 1.0, None, true))
        .build();
    for i in 0..10_000 {
        let v = if i % 2 == 0 {
            file(6, 1.0, None, true)
        } else {
            file(5, 1.0, None, true)
        };
        let r: Result<_, ReloadError> = limiter.reload(v);
        r.expect("reload");
    }
    // In force: p with capacity 5, and d; the version with capacity 6 was let go.
    assert_eq!(limiter.plans_held(), 2);
}

/// R7: a reload that changes a plan closes the leases of its shadow twin too (the plan an HTTP
/// route's shadow layer decides with, `plan.clone().with_shadow(true)`), as it closes the
/// plan's own: the twin's key leaves the lease table at the actor's next round instead of
/// spending the old plan's lease for its whole lifetime (a minute here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r7_a_reload_closes_the_leases_of_a_changed_plans_shadow_twin() {
    let db = common::database().await;
    let file = |capacity: u64| {
        policies(&format!(
            r#"{{ "plans": {{ "p": {{ "capacity": {capacity}, "refill_per_second": 0.001,
                 "lease": {{ "ttl_ms": 60000, "max_fraction": 0.5, "max_wait_ms": 1000 }} }} }} }}"#
        ))
    };
    let first = file(100);
    let twin = first
        .plan("p")
        .expect("p")
        .as_ref()
        .clone()
        .with_shadow(true);
    let limiter = Limiter::builder(common::store(&db, 4).await)
        .policies(first)
        .build();
    let until = Instant::now() + Duration::from_secs(10);
    while limiter
        .try_acquire_now_with(&twin, "k", 1.0)
        .expect("decision")
        .is_none()
    {
        assert!(Instant::now() < until, "no lease after 10 s");
        let d = limiter.try_acquire_with(&twin, "k", 1.0).await;
        assert!(d.expect("decision").allowed);
        // sleep: pacing, calls 5 ms apart build the demand a lease needs.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(limiter.lease_stats().expect("stats").keys, 1);
    limiter.reload(file(20)).expect("reload");
    common::eventually(
        Duration::from_millis(5),
        Duration::from_secs(5),
        "the twin's lease closed",
        async || {
            let now = limiter.lease_stats().expect("stats");
            if now.keys == 0 { Ok(()) } else { Err(now) }
        },
    )
    .await;
    limiter.shutdown().await;
}

/// A policy of `n` plans `p0`, `p1`, … of this capacity, the rule `k:` naming the last one.
fn numbered(n: usize, capacity: u64) -> Policies {
    let mut json = String::from(r#"{ "plans": {"#);
    for i in 0..n {
        let comma = if i == 0 { "" } else { "," };
        json.push_str(&format!(
            r#"{comma}"p{i}":{{"capacity":{capacity},"refill_per_second":1}}"#
        ));
    }
    json.push_str(&format!(
        r#"}}, "keys": [ {{ "prefix": "k:", "plan": "p{}" }} ] }}"#,
        n - 1
    ));
    policies(&json)
}

/// R8: a reload refused for too many plans leaves the plan registry as it was: with 30,000
/// plans in force, 40,000 new ones are refused (a reload takes its new plans in before it lets
/// go of the old: 30,000 + 40,000 > 65,528), and then 30,000 new ones, which fit beside the
/// 30,000, are put in force, and the 30,000 they replaced are let go. So the next 30,000 new
/// ones fit too, and 40,000 are refused again, with a message that says what is held, what
/// the reload adds, and what to do.
#[tokio::test]
async fn r8_a_refused_reload_leaves_the_registry_as_it_was() {
    let limiter = Limiter::builder(tokenlease::store::MemoryStore::new())
        .policies(numbered(30_000, 1))
        .build();
    assert_eq!(limiter.plans_held(), 30_000);

    let err = limiter.reload(numbered(40_000, 2)).unwrap_err();
    assert!(matches!(err, ReloadError::TooManyPlans { .. }), "{err}");
    assert_eq!(limiter.plans_held(), 30_000);
    // The old policies stay in force: capacity 1.
    assert!(limiter.try_acquire("k:a", 1.0).await.unwrap().allowed);
    assert!(!limiter.try_acquire("k:a", 1.0).await.unwrap().allowed);

    limiter
        .reload(numbered(30_000, 3))
        .expect("30,000 new plans fit beside 30,000");
    assert_eq!(limiter.plans_held(), 30_000);
    assert_eq!(limiter.policies().unwrap().plans().count(), 30_000);
    assert!(limiter.try_acquire("k:b", 3.0).await.unwrap().allowed);

    limiter
        .reload(numbered(30_000, 4))
        .expect("the plans replaced were let go");
    assert_eq!(limiter.plans_held(), 30_000);
    let err = limiter.reload(numbered(40_000, 5)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "too many distinct plans: this reload adds 40000 to the 30000 the limiter holds, \
         more than the 65528 it can hold at once (a reload takes in its new plans before it \
         lets go of those it replaces); reload a policy that changes fewer plans first"
    );
    assert_eq!(limiter.plans_held(), 30_000);
    // Reloading the versions in force adds nothing and is not refused.
    limiter.reload(numbered(30_000, 4)).expect("held already");
    assert_eq!(limiter.plans_held(), 30_000);
    assert!(limiter.try_acquire("k:c", 4.0).await.unwrap().allowed);
}

/// R9: a limiter built from a policy of 65,528 plans (the most a file may hold) holds them
/// all and decides under the last one; reloading the same file again adds none.
#[tokio::test]
async fn r9_a_limiter_holds_a_policy_of_the_most_plans() {
    let limiter = Limiter::builder(tokenlease::store::MemoryStore::new())
        .policies(numbered(65_528, 2))
        .build();
    assert_eq!(limiter.policies().unwrap().plans().count(), 65_528);
    assert_eq!(limiter.plans_held(), 65_528);
    let d = limiter.try_acquire("k:x", 2.0).await.expect("a plan");
    assert!(d.allowed);
    limiter.reload(numbered(65_528, 2)).expect("the same plans");
    assert_eq!(limiter.plans_held(), 65_528);
}

/// A recorder that keeps each counter's and gauge's value behind a reference count, as a
/// recorder that forgets unheld series does (the demo's): a series whose count is above one is
/// held by someone else, here the limiter.
#[derive(Default)]
struct Holding {
    series: parking_lot::Mutex<std::collections::HashMap<metrics::Key, Arc<AtomicU64>>>,
}

impl Holding {
    fn add(&self, key: &metrics::Key) -> Arc<AtomicU64> {
        Arc::clone(self.series.lock().entry(key.clone()).or_default())
    }

    /// The plans some of whose series the limiter holds, and how many series of a plan it
    /// holds.
    fn held_plans(&self) -> (std::collections::BTreeSet<String>, usize) {
        let series = self.series.lock();
        let held: Vec<String> = series
            .iter()
            .filter(|(_, v)| Arc::strong_count(v) > 1)
            .filter_map(|(k, _)| k.labels().find(|l| l.key() == "plan"))
            .map(|l| l.value().to_owned())
            .collect();
        let count = held.len();
        (held.into_iter().collect(), count)
    }

    /// The plans some of whose series the recorder has.
    fn plans(&self) -> std::collections::BTreeSet<String> {
        let series = self.series.lock();
        series
            .keys()
            .filter_map(|k| k.labels().find(|l| l.key() == "plan"))
            .map(|l| l.value().to_owned())
            .collect()
    }

    /// Forgets the series nobody else holds, as the demo's recorder does after a reload.
    fn forget_unheld(&self) {
        self.series.lock().retain(|_, v| Arc::strong_count(v) > 1);
    }

    /// The value of `tokenlease_decisions_total{plan, outcome, decided_by}`.
    fn decisions(&self, plan: &str, outcome: &str, by: &str) -> Option<u64> {
        let wanted = [("plan", plan), ("outcome", outcome), ("decided_by", by)];
        let series = self.series.lock();
        series
            .iter()
            .find(|(k, _)| {
                k.name() == tokenlease::metrics::DECISIONS
                    && wanted
                        .iter()
                        .all(|(n, v)| k.labels().any(|l| l.key() == *n && l.value() == *v))
            })
            .map(|(_, v)| v.load(Ordering::Relaxed))
    }
}

impl metrics::Recorder for Holding {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::from_arc(self.add(key))
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::from_arc(self.add(key))
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// K9, the library's part: after a reload from 65,000 plans back to one, the limiter holds the
/// metric handles of that one plan only (its 11 series: 6 decision counters, 2 fallback
/// counters, 3 outage-debt series), so a recorder that forgets unheld series keeps no series
/// of the 64,999 removed plans; the plan that stayed counts on as before. A removed plan that
/// comes back takes its handles again, from zero once its series were forgotten. The plan
/// registry holds the plans in force only (`plans_held`).
#[test]
fn k9_a_reload_releases_the_metric_handles_of_the_plans_it_removed() {
    let recorder = Holding::default();
    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(async {
            let one = || numbered(1, 1);
            let limiter = Limiter::builder(tokenlease::store::MemoryStore::new())
                .policies(one())
                .build();
            let (plans, series) = recorder.held_plans();
            assert_eq!(plans.len(), 1);
            assert_eq!(series, 11, "{plans:?}");
            assert!(limiter.try_acquire("k:a", 1.0).await.unwrap().allowed);

            let many = numbered(65_000, 1);
            limiter.reload(many.clone()).expect("65,000 plans");
            let (plans, _) = recorder.held_plans();
            assert_eq!(plans.len(), 65_000);

            limiter.reload(one()).expect("back to one plan");
            let (plans, series) = recorder.held_plans();
            assert_eq!((plans.len(), plans.first()), (1, Some(&"p0".to_owned())));
            assert_eq!(series, 11);
            assert_eq!(
                recorder.plans().len(),
                65_000,
                "before the recorder forgets"
            );
            recorder.forget_unheld();
            let plans = recorder.plans();
            assert_eq!((plans.len(), plans.first()), (1, Some(&"p0".to_owned())));
            // p0 stayed in force throughout: it counts on where it was.
            assert!(limiter.try_acquire("k:b", 1.0).await.unwrap().allowed);
            assert_eq!(recorder.decisions("p0", "allowed", "store"), Some(2));

            // The removed plans come back: their series again, at zero.
            limiter.reload(many).expect("the same 65,000 plans");
            let (plans, series) = recorder.held_plans();
            assert_eq!((plans.len(), series), (65_000, 65_000 * 11));
            assert_eq!(recorder.decisions("p7", "allowed", "store"), Some(0));
            assert_eq!(limiter.plans_held(), 65_000);
        });
    });
}

/// K9, the plan registry's part: 20 reloads alternating between 65,000 plans and one leave the
/// registry holding the plans in force only, after each of them: the entries of the plans a
/// reload removed are let go (and their indices taken again by the next 65,000), so the bound
/// of 65,528 is never reached however often the two files alternate.
#[tokio::test]
async fn k9_reloads_between_65000_plans_and_one_hold_only_the_plans_in_force() {
    let many = numbered(65_000, 1);
    let one = || numbered(1, 1);
    let limiter = Limiter::builder(tokenlease::store::MemoryStore::new())
        .policies(one())
        .build();
    for round in 0..10 {
        limiter.reload(many.clone()).expect("65,000 plans");
        assert_eq!(limiter.plans_held(), 65_000, "round {round}");
        limiter.reload(one()).expect("back to one plan");
        assert_eq!(limiter.plans_held(), 1, "round {round}");
    }
    // The plan that stayed in force throughout decides as before.
    assert!(limiter.try_acquire("k:a", 1.0).await.unwrap().allowed);
    assert!(!limiter.try_acquire("k:a", 1.0).await.unwrap().allowed);
}

/// K9, an index given to another plan: a key's lease-table record names its plan by index, and
/// a reload may release that plan and give its index to another. The key's next call must not
/// read the other plan there: `k:a` leases under `p` (index 0); 65,527 other plans fill every
/// other index and `p` is removed; then one of them changes, and its new version takes index 0.
/// Before the actor's next round (which retires `k:a`'s stale lease) the call on `k:a` is
/// decided under the plan the policies give it now (`q0`, capacity 1,000), not under the plan
/// now at its record's index (`x`'s new version, capacity 5).
#[tokio::test(flavor = "current_thread")]
async fn k9_a_record_never_reads_another_plan_at_its_index() {
    let lease = r#""lease": { "ttl_ms": 60000, "max_fraction": 0.5, "max_wait_ms": 1000 }"#;
    let filled = |changed: bool| {
        let mut json = String::from(r#"{ "plans": {"#);
        for i in 0..65_526 {
            json.push_str(&format!(
                r#""q{i}":{{"capacity":1000,"refill_per_second":1,{lease}}},"#
            ));
        }
        let x = if changed { 5 } else { 1000 };
        json.push_str(&format!(
            r#""x":{{"capacity":{x},"refill_per_second":1,{lease}}}"#
        ));
        json.push_str(r#"}, "keys": [ { "prefix": "k:", "plan": "q0" } ] }"#);
        policies(&json)
    };
    let first = policies(&format!(
        r#"{{ "plans": {{ "p": {{ "capacity": 1000, "refill_per_second": 1, {lease} }} }},
             "keys": [ {{ "prefix": "k:", "plan": "p" }} ] }}"#
    ));
    let limiter = Limiter::builder(tokenlease::store::MemoryStore::new())
        .policies(first)
        .build();
    // A live lease for `k:a` under `p`.
    assert!(limiter.try_acquire("k:a", 1.0).await.unwrap().allowed);
    limiter.leases_idle().await;
    let d = limiter.try_acquire("k:a", 1.0).await.unwrap();
    assert_eq!(
        (d.decided_by, d.limit),
        (DecidedBy::Lease, tokenlease::bucket::Tokens::whole(1000))
    );
    // A sparse key's lease holds what its callers waited for: tokens given back go into it.
    let p = Arc::clone(limiter.policies().unwrap().plan("p").expect("p"));
    assert!(limiter.refund(&p, "k:a", 10.0).await.unwrap());
    assert!(
        limiter
            .try_acquire_now_with(&p, "k:a", 1.0)
            .unwrap()
            .is_some(),
        "k:a's lease holds tokens"
    );

    // No await from here on: the actor does not run, and `k:a`'s record still names index 0.
    limiter
        .reload(filled(false))
        .expect("65,527 plans beside p");
    assert_eq!(limiter.plans_held(), 65_527);
    // `x` changes: its new version takes the only free index, p's.
    limiter.reload(filled(true)).expect("one new plan");
    assert_eq!(limiter.plans_held(), 65_527);
    let d = limiter.try_acquire("k:a", 1.0).await.unwrap();
    assert_eq!(d.decided_by, DecidedBy::Lease, "{d:?}");
    assert_eq!(d.limit, tokenlease::bucket::Tokens::whole(1000), "{d:?}");
}
