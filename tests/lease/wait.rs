//! W1–W8, W10, P9: `Limiter::acquire_until`, the call that waits for its tokens until a
//! deadline (docs/design/waiting.md). W1–W6, W10 and P9 on tokio's paused clock
//! over a `MemoryStore` (or a store in front of one that holds, fails or never answers calls),
//! so every time below is exact; W7 and W8 end to end over a real PostgreSQL, in direct and in leased mode.
//! W12: a leased call's own wait for a refill (`try_acquire` under a plan's `max_wait`), whose
//! slot a reload retires.
//!
//! Every wait of these tests is bounded by the call's own deadline, and the few sleeps pace the
//! paused clock to the moment a test acts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use tokenlease::bucket::Tokens;
use tokenlease::limiter::WaitError;
use tokenlease::policy::{FallbackMode, Policies};
use tokenlease::store::{
    AcquireRequest, Acquired, BucketRow, CountedStore, GiveBack, MemoryStore, Store, StoreError,
};
use tokenlease::{DecidedBy, Error, Limiter};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::common;

/// One plan `p`, the default, from its JSON.
fn policies(plan: &str) -> Policies {
    Policies::from_json_str(
        &format!(r#"{{"plans": {{"p": {plan}}}, "default_plan": "p"}}"#),
        None,
    )
    .expect("policy")
}

/// A limiter over `store` with the one plan `p`.
fn limiter_over(store: impl Store, plan: &str) -> Limiter {
    Limiter::builder(store).policies(policies(plan)).build()
}

/// Takes every token of `key`'s bucket under plan `p` in the store itself, past the limiter.
async fn drain(limiter: &Limiter, key: &str) {
    let policies = limiter.policies().expect("policies");
    let bucket = *policies.plan("p").expect("plan p").bucket();
    let all = AcquireRequest::take(key, bucket, bucket.capacity());
    let taken = limiter.store().acquire(all).await.expect("drained");
    assert_eq!(taken.granted, bucket.capacity(), "{taken:?}");
}

/// Tokens `key`'s bucket holds now.
async fn tokens_now(limiter: &Limiter, key: &str) -> f64 {
    let row = limiter.store().inspect(key).await.expect("inspect");
    row.map_or(f64::NAN, |r| r.tokens_now.as_f64())
}

/// How long since `start`, in whole milliseconds (the paused clock's times are exact).
fn ms_since(start: Instant) -> u128 {
    start.elapsed().as_millis()
}

/// W1: calls of one key are served in the order they were made, whatever their costs: a
/// cheaper call made later never overtakes a dearer one made earlier, in direct mode (each
/// served at the moment the bucket holds its cost: 3 s, 4 s, 6 s) and in leased mode. The
/// futures are spawned in the opposite order: the place in line is taken by the call, not the
/// first poll.
#[tokio::test(start_paused = true)]
async fn w1_calls_of_one_key_are_served_in_the_order_they_were_made() {
    let leased = r#"{"capacity": 3, "refill_per_second": 1,
                     "lease": {"max_fraction": 1.0, "ttl_ms": 60000}}"#;
    for (mode, plan) in [
        ("direct", r#"{"capacity": 3, "refill_per_second": 1}"#),
        ("leased", leased),
    ] {
        let limiter = limiter_over(MemoryStore::new(), plan);
        drain(&limiter, "k").await;
        let start = Instant::now();
        let deadline = start + Duration::from_secs(60);
        let served = Arc::new(Mutex::new(Vec::new()));
        let calls: Vec<_> = [3.0, 1.0, 2.0]
            .into_iter()
            .map(|cost| limiter.acquire_until("k", cost, deadline))
            .collect();
        let mut tasks = Vec::new();
        for (i, call) in calls.into_iter().enumerate().rev() {
            let served = Arc::clone(&served);
            tasks.push(tokio::spawn(async move {
                let d = call.await.expect("served before the deadline");
                assert!(d.allowed, "{d:?}");
                served.lock().push((i, ms_since(start)));
            }));
        }
        for task in tasks {
            task.await.expect("task");
        }
        let served = served.lock().clone();
        let order: Vec<usize> = served.iter().map(|&(i, _)| i).collect();
        assert_eq!(order, [0, 1, 2], "{mode}: {served:?}");
        if mode == "direct" {
            let at: Vec<u128> = served.iter().map(|&(_, at)| at).collect();
            assert_eq!(at, [3_000, 4_000, 6_000], "{mode}: {served:?}");
        }
    }
}

/// W2: the deadline ends a wait with `DeadlinePassed` at the deadline, to the millisecond,
/// taking nothing: the first call in line with the store's refusal (when to try again), the
/// call behind it with none (it never reached the front), and a call whose deadline has
/// passed at once. The next call gets the token the bucket refills 10 s after the drain, so the
/// calls that gave up took none.
#[tokio::test(start_paused = true)]
async fn w2_the_deadline_ends_the_wait_and_takes_nothing() {
    let limiter = limiter_over(
        MemoryStore::new(),
        r#"{"capacity": 1, "refill_per_second": 0.1}"#,
    );
    drain(&limiter, "k").await;
    let start = Instant::now();
    let first = tokio::spawn(limiter.acquire_until("k", 1.0, start + Duration::from_millis(300)));
    let behind = tokio::spawn(limiter.acquire_until("k", 1.0, start + Duration::from_millis(200)));
    match behind.await.expect("task") {
        Err(WaitError::DeadlinePassed { last: None }) => {}
        other => panic!("the call behind: {other:?}"),
    }
    assert_eq!(ms_since(start), 200);
    match first.await.expect("task") {
        Err(WaitError::DeadlinePassed { last: Some(d) }) => {
            assert!(!d.allowed && d.decided_by == DecidedBy::Store, "{d:?}");
            assert_eq!(d.retry_after, Duration::from_secs(10), "{d:?}");
        }
        other => panic!("the first call: {other:?}"),
    }
    assert_eq!(ms_since(start), 300);
    let past = limiter.acquire_until("k", 1.0, start).await;
    assert!(
        matches!(past, Err(WaitError::DeadlinePassed { last: None })),
        "{past:?}"
    );
    assert_eq!(ms_since(start), 300);
    let d = limiter
        .acquire_until("k", 1.0, start + Duration::from_secs(60))
        .await
        .expect("served");
    assert!(d.allowed, "{d:?}");
    assert_eq!(
        ms_since(start),
        10_000,
        "the token the drain left to refill"
    );
}

/// A store in front of a `MemoryStore` whose takes take effect and then, while `hold` is set,
/// hold their answer (until `go` is notified), as a server that applied a statement whose
/// client has not read the answer yet; `held` counts the answers held now. Each take is
/// answered `delay` late (on tokio's clock).
#[derive(Debug, Clone, Default)]
struct Gate {
    inner: MemoryStore,
    hold: Arc<AtomicBool>,
    go: Arc<Notify>,
    held: Arc<AtomicU64>,
    delay: Duration,
}

impl Gate {
    async fn pass(&self) {
        if !self.delay.is_zero() {
            // sleep: a store's round trip (paused clock).
            tokio::time::sleep(self.delay).await;
        }
        if self.hold.load(Ordering::SeqCst) {
            self.held.fetch_add(1, Ordering::SeqCst);
            self.go.notified().await;
            self.held.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

#[async_trait]
impl Store for Gate {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        let answer = self.inner.acquire(request).await;
        self.pass().await;
        answer
    }
    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        let answer = self.inner.acquire_many(requests).await;
        self.pass().await;
        answer
    }
    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        self.inner.give_back(returns).await
    }
    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        self.inner.delete_idle(limit).await
    }
    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        self.inner.inspect(key).await
    }
}

/// W3: a waiter dropped takes nothing, and the next one is served. (a) Dropped while it sleeps
/// for its retry time: the call behind it gets the one token at 1 s, when the bucket has it.
/// (b) Dropped after the store took the bucket's only token and before its answer came back:
/// the token is given back before the call behind it is woken, and that call is served at once
/// (the bucket refills one token in 1,000 s, past its deadline; a try run in place and dropped
/// with the waiter loses the token). (c) A take whose answer is held past the deadline (the
/// call deadline is a minute): the call ends at its deadline, and the take, once answered, is
/// given back.
#[tokio::test(start_paused = true)]
async fn w3_a_dropped_waiter_takes_nothing_and_the_next_is_served() {
    // (a)
    let limiter = limiter_over(
        MemoryStore::new(),
        r#"{"capacity": 1, "refill_per_second": 1}"#,
    );
    drain(&limiter, "k").await;
    let start = Instant::now();
    let deadline = start + Duration::from_secs(10);
    let first = tokio::spawn(limiter.acquire_until("k", 1.0, deadline));
    let next = tokio::spawn(limiter.acquire_until("k", 1.0, deadline));
    // sleep: pacing (paused clock), the first call sleeps for its retry time (1 s) now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    first.abort();
    let d = next.await.expect("task").expect("served");
    assert!(d.allowed, "{d:?}");
    assert_eq!(ms_since(start), 1_000);
    assert!(tokens_now(&limiter, "k").await < 0.01);

    // (b)
    let gate = Gate::default();
    let plan = r#"{"capacity": 1, "refill_per_second": 0.001}"#;
    let limiter = Limiter::builder(gate.clone())
        .policies(policies(plan))
        .call_deadline(Duration::from_secs(60))
        .build();
    gate.hold.store(true, Ordering::SeqCst);
    let start = Instant::now();
    let deadline = start + Duration::from_secs(10);
    let first = tokio::spawn(limiter.acquire_until("k", 1.0, deadline));
    let next = tokio::spawn(limiter.acquire_until("k", 1.0, deadline));
    common::eventually(
        Duration::from_millis(1),
        Duration::from_secs(1),
        "a held take",
        async || gate.held.load(Ordering::SeqCst) == 1,
    )
    .await;
    first.abort();
    assert!(first.await.expect_err("aborted").is_cancelled());
    gate.hold.store(false, Ordering::SeqCst);
    gate.go.notify_waiters();
    let d = next.await.expect("task").expect("served");
    assert!(d.allowed && d.decided_by == DecidedBy::Store, "{d:?}");
    assert!(ms_since(start) < 1_000, "{} ms", ms_since(start));
    assert!(
        tokens_now(&limiter, "k").await < 0.01,
        "one token taken, by the call served"
    );

    // (c)
    gate.hold.store(true, Ordering::SeqCst);
    let start = Instant::now();
    let late = limiter
        .acquire_until("c", 1.0, start + Duration::from_millis(300))
        .await;
    assert!(
        matches!(late, Err(WaitError::DeadlinePassed { last: None })),
        "{late:?}"
    );
    assert_eq!(ms_since(start), 300);
    gate.hold.store(false, Ordering::SeqCst);
    gate.go.notify_waiters();
    common::eventually(
        Duration::from_millis(1),
        Duration::from_secs(5),
        "the late take given back",
        async || (tokens_now(&limiter, "c").await - 1.0).abs() < 0.01,
    )
    .await;
}

/// W4: what can never be served fails at once, without a store call: a cost above the plan's
/// capacity, a key no plan matches, a bad key, and a call beyond the bound of waiters per key
/// (`TooManyWaiters`, naming the key and the bound; another key is not affected, and a place
/// freed is taken again).
#[tokio::test(start_paused = true)]
async fn w4_bounds_fail_at_once() {
    let counted = CountedStore::new(MemoryStore::new());
    let calls = Arc::new(AtomicU64::new(0));
    let counted = CountedStore::with_counter(counted.into_inner(), Arc::clone(&calls));
    let json = r#"{"plans": {"p": {"capacity": 3, "refill_per_second": 1}},
                   "keys": [{"prefix": "k", "plan": "p"}]}"#;
    let limiter = Limiter::builder(counted)
        .policies(Policies::from_json_str(json, None).expect("policy"))
        .max_waiters_per_key(2)
        .build();
    let start = Instant::now();
    let deadline = start + Duration::from_secs(60);
    match limiter.acquire_until("k", 4.0, deadline).await {
        Err(WaitError::Invalid(Error::InvalidCost { plan, .. })) => assert_eq!(plan, "p"),
        other => panic!("{other:?}"),
    }
    match limiter.acquire_until("x", 1.0, deadline).await {
        Err(WaitError::Invalid(Error::NoPlanForKey { key })) => assert_eq!(key, "x"),
        other => panic!("{other:?}"),
    }
    let bad = limiter.acquire_until("k\0", 1.0, deadline).await;
    assert!(
        matches!(bad, Err(WaitError::Invalid(Error::InvalidKey(_)))),
        "{bad:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0, "no store call");

    let d = limiter.try_acquire("k", 3.0).await.expect("valid");
    assert!(d.allowed);
    let a = tokio::spawn(limiter.acquire_until("k", 3.0, deadline));
    let b = tokio::spawn(limiter.acquire_until("k", 1.0, deadline));
    let before = calls.load(Ordering::SeqCst);
    let refused = limiter.acquire_until("k", 1.0, deadline).await;
    match &refused {
        Err(WaitError::TooManyWaiters { key, limit: 2 }) => assert_eq!(key, "k"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        before,
        "refused without a store call"
    );
    let message = refused.unwrap_err().to_string();
    assert!(
        message.contains("max_waiters_per_key") && message.contains("\"k\""),
        "{message}"
    );
    assert_eq!(ms_since(start), 0);
    let other = limiter
        .acquire_until("k2", 1.0, deadline)
        .await
        .expect("another key");
    assert!(other.allowed);
    assert!(a.await.expect("task").expect("a").allowed);
    assert_eq!(ms_since(start), 3_000);
    let c = limiter
        .acquire_until("k", 1.0, deadline)
        .await
        .expect("a place again");
    assert!(c.allowed);
    assert!(b.await.expect("task").expect("b").allowed);
}

/// W5: in leased mode the first call in line is woken by its key's lease getting tokens, not
/// only by its retry time. (a) A refill: with the bucket emptied in the store (which answers
/// 20 ms late), the key's lease is refused until the store's retry time (100 ms in, one token
/// at 10 a second), and then, its bucket called empty, for a tick (500 ms here) while a refill
/// is on its way; the refill lands 20 ms later and the call is served then, at 120 ms, not at
/// 600. (b) A refund into the key's live lease while the call waits out a refusal of 100 s:
/// served at the refund, 1 s in.
#[tokio::test(start_paused = true)]
async fn w5_a_refill_or_a_refund_wakes_the_waiting_call() {
    // (a)
    let plan = r#"{"capacity": 10, "refill_per_second": 10, "lease": {"ttl_ms": 60000}}"#;
    let gate = Gate {
        delay: Duration::from_millis(20),
        ..Gate::default()
    };
    let limiter = Limiter::builder(gate)
        .policies(policies(plan))
        .lease_tick(Duration::from_millis(500))
        .build();
    drain(&limiter, "k").await;
    let start = Instant::now();
    let d = limiter
        .acquire_until("k", 1.0, start + Duration::from_secs(5))
        .await
        .expect("served");
    assert!(d.allowed && d.decided_by == DecidedBy::Lease, "{d:?}");
    let took = ms_since(start);
    println!("W5 (a): served {took} ms in");
    assert!((100..300).contains(&took), "served {took} ms in");

    // (b)
    let plan = r#"{"capacity": 10, "refill_per_second": 0.01,
                   "lease": {"max_fraction": 0.5, "ttl_ms": 600000}}"#;
    let limiter = limiter_over(MemoryStore::new(), plan);
    let mut spent = 0;
    for _ in 0..40 {
        let d = limiter.try_acquire("k", 1.0).await.expect("valid");
        if d.allowed {
            spent += 1;
        } else if d.decided_by == DecidedBy::Lease && d.retry_after > Duration::from_secs(60) {
            break;
        }
    }
    assert_eq!(spent, 10, "the bucket spent through leases");
    let start = Instant::now();
    let waiting = tokio::spawn(limiter.acquire_until("k", 1.0, start + Duration::from_secs(30)));
    // sleep: pacing (paused clock), the call is waiting out its refusal when the refund comes.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let plan = Arc::clone(limiter.policies().expect("policies").plan("p").expect("p"));
    assert!(limiter.refund(&plan, "k", 1.0).await.expect("valid"));
    let d = waiting.await.expect("task").expect("served");
    assert!(d.allowed && d.decided_by == DecidedBy::Lease, "{d:?}");
    assert_eq!(ms_since(start), 1_000);
}

/// A store whose every call fails (`stuck`: never answers), counting the takes.
#[derive(Debug, Default)]
struct Down {
    takes: Arc<AtomicU64>,
    stuck: bool,
}

#[async_trait]
impl Store for Down {
    async fn acquire(&self, _: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        self.takes.fetch_add(1, Ordering::SeqCst);
        if self.stuck {
            std::future::pending::<()>().await;
        }
        Err(StoreError::Protocol("down".into()))
    }
    async fn give_back(&self, _: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        Err(StoreError::Protocol("down".into()))
    }
    async fn delete_idle(&self, _: u32) -> Result<u64, StoreError> {
        Err(StoreError::Protocol("down".into()))
    }
    async fn inspect(&self, _: &str) -> Result<Option<BucketRow>, StoreError> {
        Err(StoreError::Protocol("down".into()))
    }
}

/// A call of `plan` (its fallback `deny`) over a store whose every call fails, with a
/// deadline 2.5 s away: it ends at the deadline with the fallback's refusal. The store calls
/// it made.
async fn denied_until_the_deadline(plan: &str) -> u64 {
    let takes = Arc::new(AtomicU64::new(0));
    let down = Down {
        takes: Arc::clone(&takes),
        stuck: false,
    };
    let start = Instant::now();
    let deny = limiter_over(down, plan)
        .acquire_until("k", 1.0, start + Duration::from_millis(2_500))
        .await;
    match deny {
        Err(WaitError::DeadlinePassed { last: Some(d) }) => {
            assert_eq!(
                d.decided_by,
                DecidedBy::Fallback(FallbackMode::Deny),
                "{d:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(ms_since(start), 2_500);
    takes.load(Ordering::SeqCst)
}

/// W6: with the store down the plan's fallback decides each try. `allow`: served at once by the
/// fallback. `deny`: refused with its 1 s hint, tried again each second (three takes in 2.5 s,
/// no polling) and ended at the deadline with the fallback's refusal; in leased mode likewise,
/// with at most six refills asked of the store in the 2.5 s. A store that never
/// answers, with a call deadline of a minute: the call ends at its own deadline, 300 ms.
#[tokio::test(start_paused = true)]
async fn w6_with_the_store_down_the_fallback_decides_within_the_deadline() {
    let plan = |mode: &str| {
        format!(r#"{{"capacity": 5, "refill_per_second": 1, "fallback": {{"mode": "{mode}"}}}}"#)
    };
    let start = Instant::now();
    let allow = limiter_over(Down::default(), &plan("allow"))
        .acquire_until("k", 1.0, start + Duration::from_secs(5))
        .await
        .expect("allowed by the fallback");
    assert!(allow.allowed && allow.decided_by == DecidedBy::Fallback(FallbackMode::Allow));
    assert_eq!(ms_since(start), 0);

    let takes = denied_until_the_deadline(&plan("deny")).await;
    assert_eq!(takes, 3, "a try at 0, 1 and 2 s");

    // Leased: the key's refills fail, and the fallback decides as in direct mode.
    let leased = r#"{"capacity": 5, "refill_per_second": 1, "lease": {"max_fraction": 0.2},
                     "fallback": {"mode": "deny"}}"#;
    let takes = denied_until_the_deadline(leased).await;
    assert!((1..=6).contains(&takes), "{takes} refills in 2.5 s");

    let stuck = Down {
        takes: Arc::default(),
        stuck: true,
    };
    let limiter = Limiter::builder(stuck)
        .policies(policies(&plan("deny")))
        .call_deadline(Duration::from_secs(60))
        .build();
    let start = Instant::now();
    let hung = limiter
        .acquire_until("k", 1.0, start + Duration::from_millis(300))
        .await;
    assert!(
        matches!(hung, Err(WaitError::DeadlinePassed { last: None })),
        "{hung:?}"
    );
    assert_eq!(ms_since(start), 300);
}

/// W7, W8: over a real PostgreSQL, 20 calls of one key made at once on a bucket of 5 refilling
/// 20 a second, in direct and in leased mode: every call served, in the order made, none by the
/// fallback, no sooner than the bucket allows (15 tokens past the burst at 20 a second, less a
/// lease), and with at most three store calls per call (a call sleeps until its retry time).
/// The plan's fallback is `deny`, so a store call slower than its timeout on a busy machine is
/// a refusal the call waits out, never an admission the bucket did not make.
async fn served_in_order_over_postgres(plan: &str) {
    let db = common::database().await;
    let calls = Arc::new(AtomicU64::new(0));
    let store = CountedStore::with_counter(common::store(&db, 4).await, Arc::clone(&calls));
    let limiter = Limiter::builder(store).policies(policies(plan)).build();
    let start = Instant::now();
    let deadline = start + Duration::from_secs(20);
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..20 {
        let call = limiter.acquire_until("pg", 1.0, deadline);
        let served = Arc::clone(&served);
        tasks.push(tokio::spawn(async move {
            let d = call.await.expect("served before the deadline");
            served.lock().push((i, d.decided_by));
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    let took = start.elapsed();
    let served = served.lock().clone();
    let order: Vec<usize> = served.iter().map(|&(i, _)| i).collect();
    assert_eq!(order, (0..20).collect::<Vec<_>>(), "{served:?}");
    assert!(
        served
            .iter()
            .all(|(_, by)| matches!(by, DecidedBy::Store | DecidedBy::Lease)),
        "{served:?}"
    );
    assert!(took >= Duration::from_millis(650), "{took:?}");
    let calls = calls.load(Ordering::SeqCst);
    assert!(calls <= 60, "{calls} store calls");
    println!("{plan}: 20 calls served in {took:?} with {calls} store calls");
    limiter.shutdown().await;
}

#[tokio::test]
async fn w7_served_in_order_over_postgres_in_direct_mode() {
    served_in_order_over_postgres(
        r#"{"capacity": 5, "refill_per_second": 20, "fallback": {"mode": "deny"}}"#,
    )
    .await;
}

#[tokio::test]
async fn w8_served_in_order_over_postgres_in_leased_mode() {
    served_in_order_over_postgres(
        r#"{"capacity": 5, "refill_per_second": 20, "lease": {"max_fraction": 0.2},
            "fallback": {"mode": "deny"}}"#,
    )
    .await;
}

/// P9: waiting on a plan of several limits (2 a second, burst 2, and a burst of 4 refilling
/// 0.1 a second). Six calls of one token, made at once, are served in order when every limit
/// holds a token: at 0, 0, 0.5 and 1 s (the second's limit binds), then at 10 s and 20 s (the
/// slower limit's, whose refusals say so: no try in between), in direct and in leased mode. A cost of 3, above the smaller capacity though the other
/// limit holds 4, fails at once.
#[tokio::test(start_paused = true)]
async fn p9_a_wait_on_several_limits_ends_when_every_limit_holds_the_cost() {
    let limits = r#""limits": [{"capacity": 2, "refill_per_second": 2},
                               {"capacity": 4, "refill_per_second": 0.1}]"#;
    let direct = format!("{{{limits}}}");
    let leased = format!(r#"{{{limits}, "lease": {{"max_fraction": 1.0, "ttl_ms": 60000}}}}"#);
    const EARLIEST: [u128; 6] = [0, 0, 500, 1_000, 10_000, 20_000];
    for (mode, plan) in [("direct", direct), ("leased", leased)] {
        let calls_made = Arc::new(AtomicU64::new(0));
        let store = CountedStore::with_counter(MemoryStore::new(), Arc::clone(&calls_made));
        let limiter = limiter_over(store, &plan);
        let start = Instant::now();
        let deadline = start + Duration::from_secs(60);
        match limiter.acquire_until("k", 3.0, deadline).await {
            Err(WaitError::Invalid(Error::InvalidCost { plan, .. })) => assert_eq!(plan, "p"),
            other => panic!("{mode}: a cost of 3: {other:?}"),
        }
        let calls: Vec<_> = (0..6)
            .map(|_| limiter.acquire_until("k", 1.0, deadline))
            .collect();
        let served = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (i, call) in calls.into_iter().enumerate() {
            let served = Arc::clone(&served);
            tasks.push(tokio::spawn(async move {
                let d = call.await.expect("served before the deadline");
                assert!(d.allowed, "{d:?}");
                assert!(!matches!(d.decided_by, DecidedBy::Fallback(_)), "{d:?}");
                served.lock().push((i, ms_since(start)));
            }));
        }
        for task in tasks {
            task.await.expect("task");
        }
        let served = served.lock().clone();
        let order: Vec<usize> = served.iter().map(|&(i, _)| i).collect();
        assert_eq!(order, [0, 1, 2, 3, 4, 5], "{mode}: {served:?}");
        let at: Vec<u128> = served.iter().map(|&(_, at)| at).collect();
        // In leased mode too: the first call in line asks a dry bucket for its own token,
        // not a whole lease, so it is served when the bucket holds it.
        assert_eq!(at, EARLIEST, "{mode}: {served:?}");
        // Six takes and the four refusals that sent the next call to sleep (at 0, 0.5, 1 and
        // 10 s): no try while a limit is short.
        let calls = calls_made.load(Ordering::Relaxed);
        assert!(calls <= 10, "{mode}: {calls} store calls");
        let calls = calls_made.load(Ordering::Relaxed);
        eprintln!("P9 {mode}: served at {at:?} ms, {calls} store calls");
    }
}

/// W11: in leased mode a call waiting on a dry bucket is served when the bucket holds its
/// cost, as in direct mode: a bucket of 4 refilling 0.1 a second whose lease may hold all of
/// it (`max_fraction` 1, a lease lifetime of a minute), and six calls of one token made at
/// once are served at 0, 0, 0, 0, 10 and 20 s, with at most three store calls a call. Without
/// the waiting call's own ask, a dry bucket is asked for a whole lease or nothing, and the
/// last two calls wait longer.
#[tokio::test(start_paused = true)]
async fn w11_a_waiting_call_is_served_when_the_bucket_holds_its_cost_in_leased_mode() {
    let plan = r#"{"capacity": 4, "refill_per_second": 0.1,
                   "lease": {"max_fraction": 1.0, "ttl_ms": 60000}}"#;
    let calls_made = Arc::new(AtomicU64::new(0));
    let store = CountedStore::with_counter(MemoryStore::new(), Arc::clone(&calls_made));
    let limiter = limiter_over(store, plan);
    let start = Instant::now();
    let deadline = start + Duration::from_secs(200);
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..6 {
        let (served, call) = (Arc::clone(&served), limiter.acquire_until("k", 1, deadline));
        tasks.push(tokio::spawn(async move {
            let d = call.await.expect("served before the deadline");
            assert!(!matches!(d.decided_by, DecidedBy::Fallback(_)), "{d:?}");
            served.lock().push((i, ms_since(start)));
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    let served = served.lock().clone();
    let at: Vec<u128> = served.iter().map(|&(_, at)| at).collect();
    let calls = calls_made.load(Ordering::Relaxed);
    eprintln!("W11: served at {at:?} ms, {calls} store calls");
    assert_eq!(at, [0, 0, 0, 0, 10_000, 20_000], "{served:?}");
    assert!(calls <= 18, "{calls} store calls for six calls");
}

/// W10: a waiter dropped while the plan's fallback decides its try takes nothing there either.
/// The store never answers; the try's store call ends at the call deadline (500 ms), after the
/// waiting call ended at its own (300 ms), and the `local` fallback then admits it from the
/// key's local bucket (one token, refilling in 1,000 s) and records the token as outage debt.
/// The answer nobody awaits gives both back: the debt is forgiven, and the next call the
/// fallback decides finds the local token there. Without the give-back the debt stays at one
/// token and the next call is refused.
#[tokio::test(start_paused = true)]
async fn w10_a_waiter_dropped_while_the_fallback_decides_takes_nothing() {
    let stuck = Down {
        takes: Arc::default(),
        stuck: true,
    };
    let plan = r#"{"capacity": 1, "refill_per_second": 0.001,
                   "fallback": {"mode": "local", "instances": 1}}"#;
    let limiter = Limiter::builder(stuck)
        .policies(policies(plan))
        .call_deadline(Duration::from_millis(500))
        .build();
    let start = Instant::now();
    let gone = limiter
        .acquire_until("k", 1.0, start + Duration::from_millis(300))
        .await;
    assert!(
        matches!(gone, Err(WaitError::DeadlinePassed { last: None })),
        "{gone:?}"
    );
    assert_eq!(ms_since(start), 300);
    // sleep: pacing (paused clock) past the try's call deadline, when the fallback decides it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    common::eventually(
        Duration::from_millis(1),
        Duration::from_secs(1),
        "the fallback's admission given back",
        async || limiter.outage_debt().outstanding == Tokens::ZERO,
    )
    .await;
    let next = limiter.try_acquire("k", 1.0).await.expect("valid");
    assert!(
        next.allowed
            && matches!(
                next.decided_by,
                DecidedBy::Fallback(FallbackMode::Local { .. })
            ),
        "the local token was given back: {next:?}"
    );
    assert_eq!(limiter.outage_debt().outstanding, Tokens::whole(1));
}

/// W12: a leased call waiting for its key's first refill (`try_acquire`, the plan's
/// `max_wait`) when a reload changes its plan starts over under the new plan: the reload
/// retires the slot it waits on, and the call is decided from a lease of the plan in force
/// (its `limit` is the new capacity), not by a store call under the plan it started with.
#[tokio::test(start_paused = true)]
async fn w12_a_waiting_call_whose_slot_a_reload_retires_starts_over_under_the_new_plan() {
    let plan = |capacity: u64| {
        format!(
            r#"{{"capacity": {capacity}, "refill_per_second": 0.001,
                 "lease": {{"max_wait_ms": 5000, "ttl_ms": 60000}}}}"#
        )
    };
    let gate = Gate::default();
    let limiter = limiter_over(gate.clone(), &plan(10));
    gate.hold.store(true, Ordering::SeqCst);
    let start = Instant::now();
    let call = tokio::spawn({
        let limiter = limiter.clone();
        async move { limiter.try_acquire("k", 1.0).await }
    });
    // The key's first refill is held: the call waits for it.
    common::eventually(
        Duration::from_millis(1),
        Duration::from_secs(1),
        "a held refill",
        async || gate.held.load(Ordering::SeqCst) == 1,
    )
    .await;
    assert!(!call.is_finished(), "the call waits for its refill");
    let rounds = |l: &Limiter| l.lease_stats().expect("leased").actor_rounds;
    let before = rounds(&limiter);
    limiter.reload(policies(&plan(20))).expect("reload");
    // The actor retires the slot; the call starts over on a new one, whose refill waits for
    // the lane's statement in flight (the held one).
    common::eventually(
        Duration::from_millis(1),
        Duration::from_secs(1),
        "the actor's round after the reload",
        async || rounds(&limiter) > before,
    )
    .await;
    assert!(!call.is_finished(), "the call waits on its new slot");
    gate.hold.store(false, Ordering::SeqCst);
    gate.go.notify_waiters();
    let d = call.await.expect("task").expect("decision");
    assert!(d.allowed && d.decided_by == DecidedBy::Lease, "{d:?}");
    assert_eq!(
        d.limit,
        Tokens::whole(20),
        "decided under the new plan: {d:?}"
    );
    assert!(ms_since(start) < 5_000, "{} ms", ms_since(start));
}
