//! Direct mode's multi-key statements and its per-call deadline, against a real PostgreSQL
//! behind the fault-injecting proxy: callers of many keys share a statement and each gets the
//! pure bucket's answer; every call is answered within the call deadline however long the queue;
//! a caller alone costs one statement. Runs in the nextest `serial` group: timing-dependent.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokenlease::bucket::{BucketState, Outcome, Tokens};
use tokenlease::clock::timestamp_from_system_time;
use tokenlease::policy::{FallbackMode, FallbackSettings, Plan};
use tokenlease::store::{CountedStore, PostgresStore};
use tokenlease::{DecidedBy, Decision, Limiter};
use tokenlease_testkit::FaultProxy as Proxy;
use tokenlease_testkit::TempPostgres;

/// A throwaway cluster and a proxy in front of it.
struct Rig {
    _pg: TempPostgres,
    proxy: Proxy,
    direct: String,
}

impl Rig {
    async fn start() -> Rig {
        let pg = tokio::task::spawn_blocking(TempPostgres::start)
            .await
            .expect("join")
            .expect("a throwaway PostgreSQL (install the PostgreSQL server binaries)");
        let upstream = format!("127.0.0.1:{}", pg.port()).parse().expect("address");
        let proxy = Proxy::start(upstream).await.expect("proxy");
        let direct = pg.connection_string("postgres");
        Rig {
            _pg: pg,
            proxy,
            direct,
        }
    }

    fn proxied(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.proxy.port()
        )
    }

    /// A store through the proxy with `call_timeout` (pool wait a little below it), migrated.
    async fn store(&self, pool: u32, call_timeout: Duration) -> PostgresStore {
        // Migrate on the direct connection, so the proxied store needs no long setup.
        common::store_at(&self.direct, 1, true).await;
        PostgresStore::builder(&self.proxied())
            .expect("connection string")
            .pool_size(pool)
            .migrate(false)
            .call_timeout(call_timeout)
            .pool_wait_timeout(call_timeout.mul_f64(0.8))
            .connect_timeout(Duration::from_secs(2))
            .statement_timeout(Duration::from_secs(5))
            .lock_timeout(Duration::from_secs(5))
            .build()
            .await
            .expect("store")
    }
}

fn deny_fallback(plan: Plan) -> Plan {
    plan.with_fallback(FallbackSettings::new(FallbackMode::Deny))
}

/// One caller's answer: its key, cost, and the decision.
type Answer = (String, f64, Decision);

/// (a) Callers of many keys, with repeats and mixed costs, queue behind a statement that holds
/// the only slot; they leave in a few multi-key statements, and every caller's answer is the
/// pure bucket's, driven through the store times the decisions carry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_of_many_keys_answers_each_caller_as_the_pure_bucket() {
    let rig = Rig::start().await;
    let store = CountedStore::new(rig.store(1, Duration::from_secs(5)).await);
    let counted = Arc::new(store);
    let limiter = Limiter::builder_shared(Arc::clone(&counted) as _)
        .statements_in_flight(1)
        .build();
    let plan = Arc::new(deny_fallback(common::plan(5, 0.5)));
    let keys: Vec<String> = (0..8).map(|k| format!("batch-{k}")).collect();
    // Warm the one connection before the proxy slows every reply down.
    let _ = limiter
        .try_acquire_with(&plan, "warm", 1.0)
        .await
        .expect("warm");
    rig.proxy.delay(Duration::ZERO, Duration::from_millis(100));

    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move |m: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % m
    };
    let mut answers: Vec<Answer> = Vec::new();
    let mut statements = Vec::new();
    for round in 0..4 {
        let before = counted.calls();
        // The blocker holds the only slot for one delayed round trip; everything after queues.
        let blocker = {
            let (limiter, plan) = (limiter.clone(), Arc::clone(&plan));
            tokio::spawn(async move { limiter.try_acquire_with(&plan, "blocker", 1.0).await })
        };
        while counted.calls() == before {
            tokio::task::yield_now().await;
        }
        let callers: Vec<_> = (0..48)
            .map(|_| {
                let key = keys[next(keys.len() as u64) as usize].clone();
                let cost = (1 + next(3)) as f64;
                let (limiter, plan) = (limiter.clone(), Arc::clone(&plan));
                tokio::spawn(async move {
                    let d = limiter
                        .try_acquire_with(&plan, &key, cost)
                        .await
                        .expect("decision");
                    (key, cost, d)
                })
            })
            .collect();
        let _ = blocker.await.expect("join").expect("decision");
        for caller in callers {
            answers.push(caller.await.expect("join"));
        }
        statements.push(counted.calls() - before);
        eprintln!("round {round}: {} statements", counted.calls() - before);
    }
    rig.proxy.pass();

    // 48 callers over 8 keys and 3 costs: one statement per cost group at most, besides the
    // blocker's; the first carries every key.
    for (round, n) in statements.iter().enumerate() {
        assert!(*n <= 4, "round {round}: {n} statements for 48 callers");
    }
    let by_store = answers
        .iter()
        .filter(|a| a.2.decided_by == DecidedBy::Store)
        .count();
    assert_eq!(by_store, answers.len(), "every answer is the store's");

    // Per key, replay the answers on the pure bucket in store time; within one store time the
    // grants come first, in the order of what they left (most first), then the denials, which
    // change nothing.
    let config = *plan.bucket();
    let mut per_key: HashMap<&str, Vec<&Answer>> = HashMap::new();
    for a in &answers {
        per_key.entry(a.0.as_str()).or_default().push(a);
    }
    let (mut allowed, mut denied) = (0, 0);
    for (key, mut list) in per_key {
        list.sort_by(|a, b| {
            let (da, db) = (&a.2, &b.2);
            da.store_time
                .cmp(&db.store_time)
                .then(db.allowed.cmp(&da.allowed))
                .then(db.remaining.cmp(&da.remaining))
        });
        let mut model: Option<BucketState> = None;
        for (key_cost_decision, step) in list.iter().zip(0..) {
            let (_, cost, d) = key_cost_decision;
            let now = timestamp_from_system_time(d.store_time.expect("store time"));
            let state = model.unwrap_or(BucketState::full(&config, now));
            let cost = Tokens::from_f64(*cost).expect("cost");
            let (next_state, outcome) = state.take(&config, now, cost).expect("cost fits");
            match outcome {
                Outcome::Allowed { remaining } => {
                    assert!(d.allowed, "{key} step {step}: the pure bucket allows {d:?}");
                    assert_eq!(d.remaining, Some(remaining), "{key} step {step}: remaining");
                    allowed += 1;
                }
                Outcome::Denied {
                    remaining,
                    retry_after,
                } => {
                    assert!(
                        !d.allowed,
                        "{key} step {step}: the pure bucket denies {d:?}"
                    );
                    assert_eq!(d.remaining, Some(remaining), "{key} step {step}: remaining");
                    assert_eq!(
                        d.retry_after,
                        Duration::from_nanos(retry_after),
                        "{key} step {step}: retry_after"
                    );
                    denied += 1;
                }
            }
            model = Some(next_state);
        }
    }
    assert!(
        allowed > 10 && denied > 10,
        "both kinds of answer: {allowed} allowed, {denied} denied"
    );
}

/// (b) 512 tasks on one key (capacity 5) with every reply 20 ms late and a 50 ms call timeout:
/// no call waits much longer than the call timeout, however long the queue in front of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_is_answered_within_the_call_deadline() {
    const TIMEOUT: Duration = Duration::from_millis(50);
    let rig = Rig::start().await;
    let limiter = Limiter::builder(rig.store(4, TIMEOUT).await).build();
    let plan = Arc::new(deny_fallback(common::plan(5, 5.0)));
    // Open the pool's four connections before the replies slow down: this test is about the
    // queue in front of the statements. (A connection opened through the slowed proxy takes
    // about as long as the call timeout, and one that a timed-out statement leaves is closed,
    // so on a busy machine a first slow statement could otherwise leave every later call to
    // the fallback.)
    let warm: Vec<_> = (0..16)
        .map(|i| {
            let (limiter, plan) = (limiter.clone(), Arc::clone(&plan));
            tokio::spawn(async move {
                limiter
                    .try_acquire_with(&plan, &format!("warm-{i}"), 1.0)
                    .await
                    .expect("warm")
            })
        })
        .collect();
    for w in warm {
        let _ = w.await.expect("join");
    }
    rig.proxy.delay(Duration::ZERO, Duration::from_millis(20));

    let start = Instant::now();
    // How late the runtime itself runs a timer while the test runs: on a shared 2-core machine
    // the process is sometimes not scheduled at all, and no limiter can answer then.
    let probe = tokio::spawn(async move {
        let mut worst = Duration::ZERO;
        while start.elapsed() < Duration::from_secs(1) {
            let began = Instant::now();
            // sleep: the probe measures how late a 5 ms timer fires.
            tokio::time::sleep(Duration::from_millis(5)).await;
            worst = worst.max(began.elapsed().saturating_sub(Duration::from_millis(5)));
        }
        worst
    });
    let tasks: Vec<_> = (0..512)
        .map(|_| {
            let (limiter, plan) = (limiter.clone(), Arc::clone(&plan));
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while start.elapsed() < Duration::from_secs(1) {
                    let began = Instant::now();
                    let d = limiter
                        .try_acquire_with(&plan, "hot", 1.0)
                        .await
                        .expect("decision");
                    seen.push((began.elapsed(), d.decided_by, d.allowed));
                    // sleep: pacing. A client does some work between requests (and this test
                    // must not take the machine's two cores for itself).
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                seen
            })
        })
        .collect();
    let mut seen = Vec::new();
    for task in tasks {
        seen.extend(task.await.expect("join"));
    }
    let lag = probe.await.expect("join");
    rig.proxy.pass();
    let mut times: Vec<Duration> = seen.iter().map(|s| s.0).collect();
    times.sort();
    let at = |q: f64| times[((times.len() - 1) as f64 * q) as usize];
    let by_store = seen.iter().filter(|s| s.1 == DecidedBy::Store).count();
    let admitted = seen.iter().filter(|s| s.2).count();
    eprintln!(
        "{} calls: p50 {:?}, p99 {:?}, max {:?}; {by_store} decided by the store, {admitted} \
         admitted; timer lag up to {lag:?}",
        times.len(),
        at(0.5),
        at(0.99),
        at(1.0)
    );
    // The fallback's own decision (deny) is immediate; the margin is for a busy 2-core machine,
    // plus however long the runtime itself was not running.
    let bound = 2 * TIMEOUT + Duration::from_millis(50) + lag;
    assert!(at(1.0) <= bound, "slowest call {:?} > {bound:?}", at(1.0));
    assert!(by_store > 0, "the store decided some calls");
}

/// (c) One caller alone costs exactly one statement, every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_alone_costs_one_statement() {
    let db = common::database().await;
    let counted = Arc::new(CountedStore::new(common::store(&db, 4).await));
    let limiter = Limiter::builder_shared(Arc::clone(&counted) as _).build();
    let plan = common::plan(10, 1.0);
    for i in 1..=5u64 {
        let d = limiter
            .try_acquire_with(&plan, &format!("alone-{}", i % 2), 1.0)
            .await
            .expect("decision");
        assert_eq!(d.decided_by, DecidedBy::Store);
        assert_eq!(counted.calls(), i, "call {i}");
    }
}

/// Beyond the queue bound, a caller goes to the fallback at once instead of waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_sends_callers_to_the_fallback_at_once() {
    let rig = Rig::start().await;
    let counted = Arc::new(CountedStore::new(
        rig.store(1, Duration::from_secs(5)).await,
    ));
    // One statement in flight and one key per statement: the queue holds one caller.
    let limiter = Limiter::builder_shared(Arc::clone(&counted) as _)
        .statements_in_flight(1)
        .batch_keys(1)
        .build();
    let plan = Arc::new(deny_fallback(common::plan(5, 1.0)));
    let _ = limiter
        .try_acquire_with(&plan, "warm", 1.0)
        .await
        .expect("warm");
    rig.proxy.delay(Duration::ZERO, Duration::from_millis(300));
    let spawn = |key: &'static str| {
        let (limiter, plan) = (limiter.clone(), Arc::clone(&plan));
        tokio::spawn(async move {
            let began = Instant::now();
            let d = limiter
                .try_acquire_with(&plan, key, 1.0)
                .await
                .expect("decision");
            (d.decided_by, began.elapsed())
        })
    };
    let in_flight = spawn("first");
    while counted.calls() < 2 {
        tokio::task::yield_now().await;
    }
    // The slot is taken: of the next two callers one queues and the other finds the queue full.
    let (a, b) = (spawn("second"), spawn("third"));
    let (a, b) = (a.await.expect("join"), b.await.expect("join"));
    let (shed, queued) = if a.0 == DecidedBy::Store {
        (b, a)
    } else {
        (a, b)
    };
    assert_eq!(shed.0, DecidedBy::Fallback(FallbackMode::Deny));
    assert!(shed.1 < Duration::from_millis(150), "waited {:?}", shed.1);
    assert_eq!(queued.0, DecidedBy::Store);
    assert_eq!(in_flight.await.expect("join").0, DecidedBy::Store);
    rig.proxy.pass();
}

/// A slow link keeps its connections: every reply 30 ms late against a 50 ms call timeout,
/// 8 callers on a pool of 2 with 4 statements in flight, for 2 s. Calls that waited for a
/// connection time out with their statement on the wire; the statement then finishes within the
/// abandon grace, and its connection goes back to the pool instead of being closed. (Closing it made the next caller
/// open a connection over the same link, whose start-up and first statement together took
/// longer than a call, and so on: a run like this one opened 81 connections.)
///
/// Counted through `tokenlease_store_cancels_total`: `none` when the abandoned statement
/// finished within the grace and its connection was kept, `sent` or `failed` when it was
/// cancelled and its connection closed. A busy machine can hold a statement's reply past the
/// grace now and then; on a link that answers in 30 ms most must be kept, and every connection
/// opened must replace one that was closed. (The counts are the process's: nextest runs each
/// test in a process of its own; under `cargo test` the serial lock keeps out the tests of the
/// binary that read the same recorder.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_link_keeps_its_connections() {
    let _serial = common::serial().await;
    let rig = Rig::start().await;
    let pool = 2;
    let store = rig.store(pool, Duration::from_millis(50)).await;
    // Twice as many statements in flight as connections: the store opens its pool's connections
    // before `build` returns, so it is statements waiting for a pooled connection that make a
    // call reach its timeout with its statement on the wire.
    let limiter = Limiter::builder(store)
        .statements_in_flight(2 * pool as usize)
        .build();
    let plan = Arc::new(deny_fallback(common::plan(1_000_000, 1_000.0)));
    // Open the pool's connections before the link slows down.
    for i in 0..pool {
        let d = limiter
            .try_acquire_with(&plan, &format!("warm:{i}"), 1.0)
            .await;
        assert_eq!(d.expect("decision").decided_by, DecidedBy::Store);
    }
    let opened_before = rig.proxy.accepted();
    let mut cancels = Cancels::default();
    cancels.add();
    let (kept_before, closed_before) = (cancels.kept, cancels.closed);
    rig.proxy.delay(Duration::ZERO, Duration::from_millis(30));
    let end = Instant::now() + Duration::from_secs(2);
    let mut callers = Vec::new();
    for c in 0..8 {
        let (limiter, plan) = (limiter.clone(), Arc::clone(&plan));
        callers.push(tokio::spawn(async move {
            let (mut store, mut other) = (0u32, 0u32);
            let mut i = 0;
            while Instant::now() < end {
                let d = limiter
                    .try_acquire_with(&plan, &format!("slow:{c}:{i}"), 1.0)
                    .await
                    .expect("decision");
                i += 1;
                if d.decided_by == DecidedBy::Store {
                    store += 1;
                } else {
                    other += 1;
                }
            }
            (store, other)
        }));
    }
    let (mut by_store, mut by_fallback) = (0, 0);
    for caller in callers {
        let (s, o) = caller.await.expect("caller");
        by_store += s;
        by_fallback += o;
    }
    // The abandoned statements of the last calls settle within the grace plus one cancel
    // (bounded by the 50 ms call timeout) and one idle query: 2 s at most.
    // Quiet: nothing more counted over one 20 ms step, and no more connections than the pool.
    let mut counted = None;
    let _ = common::poll_until(
        Duration::from_millis(20),
        Duration::from_secs(2),
        async || {
            if counted.is_some() {
                cancels.add();
            }
            let now = (cancels.kept, cancels.closed);
            let quiet = counted.replace(now) == Some(now);
            quiet && rig.proxy.active() <= pool as usize
        },
    )
    .await;
    let (kept, closed) = (cancels.kept - kept_before, cancels.closed - closed_before);
    let opened = rig.proxy.accepted() - opened_before;
    println!(
        "slow link (replies 30 ms late, 50 ms calls, pool {pool}, 8 callers, 2 s): \
         {by_store} decided by the store, {by_fallback} by the fallback; abandoned statements: \
         {kept} connections kept, {closed} closed; {opened} connections opened"
    );
    // Quiet: 1 connection opened. Closing every abandoned statement's connection opened 81
    // (and kept none).
    assert!(
        kept + closed > 0,
        "no call timed out with its statement on the wire: nothing was tried"
    );
    // Most are kept: a loaded machine holds a few replies past the grace (seen: 4 closed, 3
    // kept, with the whole suite running), while closing every one (the behaviour this guards
    // against) closed dozens and kept none.
    assert!(
        closed <= 2 * kept + 4,
        "{closed} connections closed after an abandoned statement, {kept} kept"
    );
    // A connection is opened to replace one closed; over the slow link its start-up can itself
    // take longer than the pool's wait, so a few attempts each.
    assert!(
        opened <= pool as u64 + 4 * closed,
        "{opened} connections opened over the slow link, {closed} closed, for {} calls",
        by_store + by_fallback
    );
    assert!(by_store > 0, "the store decided nothing");
}

/// `tokenlease_store_cancels_total` so far: abandoned statements whose connection was kept
/// (`result="none"`) and those cancelled and closed (`sent`, `failed`).
#[derive(Debug, Default)]
struct Cancels {
    kept: u64,
    closed: u64,
}

impl Cancels {
    /// Adds what was counted since the last snapshot (a snapshot returns counters since the
    /// previous one).
    fn add(&mut self) {
        for (key, _, _, value) in common::metrics().snapshot().into_vec() {
            let metrics_util::debugging::DebugValue::Counter(n) = value else {
                continue;
            };
            if key.key().name() != "tokenlease_store_cancels_total" {
                continue;
            }
            match key.key().labels().find(|l| l.key() == "result") {
                Some(l) if l.value() == "none" => self.kept += n,
                Some(_) => self.closed += n,
                None => {}
            }
        }
    }
}
