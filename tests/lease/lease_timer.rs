//! The lease actor's due-queue, in memory: strict leases still close inside the store's margin,
//! quiet keys are still evicted, a dropped nudge is not lost, and an idle table costs the actor
//! nothing however many keys it has seen.
//!
//! Time is tokio's paused clock, which the lease table, the actor and the in-memory store all
//! read: nothing sleeps through real time, and each lease closes, expires and leaves the table
//! at the instant its rule says, which the tests check exactly.

use crate::common;

use std::time::Duration;

use tokio::time::Instant;

use tokenlease::LeaseStats;
use tokenlease::Limiter;
use tokenlease::policy::{Accounting, LeaseSettings, Plan};
use tokenlease::store::{MemoryStore, Store};

fn leased(ttl: Duration, accounting: Accounting) -> Plan {
    common::plan(1_000_000, 1_000.0).with_lease(
        LeaseSettings::default()
            .with_ttl(ttl)
            .with_accounting(accounting),
    )
}

fn stats(limiter: &Limiter) -> LeaseStats {
    limiter.lease_stats().expect("leased")
}

/// Polls `done` every millisecond of tokio's (paused) clock until it holds; panics with `what`
/// after `limit`.
async fn until(limit: Duration, what: &str, done: impl FnMut() -> bool) {
    until_every(Duration::from_millis(1), limit, what, done).await;
}

/// [`until`], polling every `step`: `lease_stats` sums every slot, so a test with a hundred
/// thousand keys polls less often, or its polls would be most of its work.
async fn until_every(step: Duration, limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    common::eventually(step, limit, what, async || done()).await;
}

/// A strict lease is closed locally one lifetime after its request was sent (the actor's entry
/// fires at that time, or up to a tick before it), so while the store still counts it: the
/// store counts it for `2·ttl + 2 ticks` after granting it.
#[tokio::test(start_paused = true)]
async fn a_strict_lease_closes_while_the_store_still_counts_it() {
    let store = MemoryStore::new();
    let tick = Duration::from_millis(50);
    let ttl = Duration::from_millis(300);
    let limiter = Limiter::builder(store.clone()).lease_tick(tick).build();
    let plan = leased(ttl, Accounting::Strict);
    let asked = Instant::now();
    // A new key: the call asks for a lease and does not wait; nobody spends what it brings.
    let d = limiter
        .try_acquire_now_with(&plan, "strict", 1.0)
        .expect("valid key");
    assert!(d.is_none(), "no lease yet: {d:?}");
    until(Duration::from_secs(2), "the lease", || {
        stats(&limiter).outstanding > 0.0
    })
    .await;
    let row = store
        .inspect("strict")
        .await
        .expect("inspect")
        .expect("row");
    let [held] = &row.leases[..] else {
        panic!("one strict lease on the row: {row:?}");
    };
    let store_stops_counting = held.expires_at;
    until(ttl * 3, "the lease closed", || {
        stats(&limiter).outstanding == 0.0
    })
    .await;
    let closed_after = asked.elapsed();
    let row = store
        .inspect("strict")
        .await
        .expect("inspect")
        .expect("row");
    assert!(
        row.store_now < store_stops_counting,
        "closed at store time {:?}, after the store stopped counting the lease at {:?}",
        row.store_now,
        store_stops_counting
    );
    // At its time on the paused clock: the entry fires at the expiry, seen by the next 1 ms
    // polls (not a tick late, not early).
    assert!(
        closed_after >= ttl && closed_after <= ttl + Duration::from_millis(2),
        "closed {closed_after:?} after asking, lifetime {ttl:?}, tick {tick:?}"
    );
    // Its give-back settled the entry: the row holds no lease and the token is back.
    until(Duration::from_secs(1), "the give-back", || {
        stats(&limiter).returned == 1.0
    })
    .await;
    let row = store
        .inspect("strict")
        .await
        .expect("inspect")
        .expect("row");
    assert!(row.leases.is_empty(), "{row:?}");
}

/// A key whose lease nobody spends closes at the end of its lifetime, gives its tokens back and
/// leaves the table (idle since its one refill). Its bucket refills a token a second, so at the
/// close it has not refilled what the lease took, and the tokens go back (not waived).
#[tokio::test(start_paused = true)]
async fn a_key_that_was_never_spent_is_evicted() {
    let limiter = Limiter::builder(MemoryStore::new())
        .lease_tick(Duration::from_millis(10))
        .build();
    let ttl = Duration::from_millis(200);
    let plan = common::plan(1_000_000, 1.0).with_lease(LeaseSettings::default().with_ttl(ttl));
    let d = limiter
        .try_acquire_now_with(&plan, "never", 1.0)
        .expect("valid key");
    assert!(d.is_none(), "no lease yet: {d:?}");
    until(Duration::from_secs(2), "the lease", || {
        stats(&limiter).outstanding == 1.0
    })
    .await;
    let granted = Instant::now();
    until(Duration::from_secs(3), "evicted", || {
        let s = stats(&limiter);
        s.keys == 0 && s.outstanding == 0.0
    })
    .await;
    let evicted_after = granted.elapsed();
    // At the lease's expiry on the paused clock (idle since its one refill), seen by the next
    // 1 ms polls.
    assert!(
        evicted_after >= ttl - Duration::from_millis(1)
            && evicted_after <= ttl + Duration::from_millis(2),
        "evicted {evicted_after:?} after its lease came, lifetime {ttl:?}"
    );
    let s = stats(&limiter);
    assert_eq!((s.leased, s.returned, s.stranded), (1.0, 1.0, 0.0), "{s:?}");
}

/// A full nudge queue drops nudges; the actor then finds the slots by their `PENDING` bit.
/// Seventy thousand new keys asked for without a yield (the actor cannot run on this one-thread
/// runtime until the test awaits) overflow the 8,192-entry queue, and every key still gets its
/// lease.
#[tokio::test(start_paused = true)]
async fn a_full_nudge_queue_still_refills_every_key() {
    const KEYS: usize = 70_000;
    let limiter = Limiter::builder(MemoryStore::new()).build();
    let plan = leased(Duration::from_secs(60), Accounting::Relaxed);
    let keys: Vec<String> = (0..KEYS).map(|i| format!("k{i}")).collect();
    for key in &keys {
        let d = limiter
            .try_acquire_now_with(&plan, key, 1.0)
            .expect("valid");
        assert!(d.is_none(), "no lease yet for {key}");
    }
    until(Duration::from_secs(10), "a lease for every key", || {
        stats(&limiter).leased >= KEYS as f64
    })
    .await;
    for key in &keys {
        let d = limiter
            .try_acquire_now_with(&plan, key, 1.0)
            .expect("valid")
            .unwrap_or_else(|| panic!("{key} has no live lease"));
        assert!(d.allowed, "{key}: {d:?}");
    }
    let s = stats(&limiter);
    assert_eq!(s.keys, KEYS);
    // The scan after the overflow looked at the table, once or a few times, not per tick.
    assert!(s.actor_visits >= KEYS as u64, "{s:?}");
}

/// An idle limiter's actor does nothing, however many keys it has seen: with 50,000 live leases
/// that expire in an hour and 50,000 keys whose leases expired and were evicted, it does not
/// wake (the sweep it replaced visited every slot every 50 ms).
#[tokio::test(start_paused = true)]
async fn an_idle_table_costs_the_actor_nothing() {
    const KEYS: usize = 50_000;
    let step = Duration::from_millis(100);
    let limiter = Limiter::builder(MemoryStore::new())
        .max_lease_keys(4 * KEYS)
        .build();
    let long = leased(Duration::from_secs(3600), Accounting::Relaxed);
    let short = leased(Duration::from_millis(300), Accounting::Relaxed);
    let live: Vec<String> = (0..KEYS).map(|i| format!("live:{i}")).collect();
    let short_lived: Vec<String> = (0..KEYS).map(|i| format!("short:{i}")).collect();
    // Each key's first call asks for its lease; the second spends from it (and asks for the
    // next one, which may be small: these keys show little demand).
    for round in 0..2 {
        for (plan, keys) in [(&long, &live), (&short, &short_lived)] {
            for key in keys {
                let _ = limiter.try_acquire_now_with(plan, key, 1.0).expect("valid");
            }
        }
        if round == 0 {
            until_every(step, Duration::from_secs(30), "the leases", || {
                stats(&limiter).leased >= (2 * KEYS) as f64
            })
            .await;
        }
    }
    // The short leases expire and their keys leave the table; then (within a second) the
    // actor sums the outstanding gauge one last time and has nothing left to do for an hour.
    until_every(
        step,
        Duration::from_secs(30),
        "the short-lived keys evicted",
        || stats(&limiter).keys == KEYS,
    )
    .await;
    // sleep: paused clock, the actor's last gauge pass (due within a second) falls due.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = stats(&limiter);
    // sleep: paused clock, 2 s in which an idle table must cost nothing.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = stats(&limiter);
    assert_eq!(after.keys, KEYS);
    assert_eq!(
        (after.actor_rounds, after.actor_visits, after.store_calls),
        (before.actor_rounds, before.actor_visits, before.store_calls),
        "an idle actor woke: {before:?} → {after:?}"
    );
    // The live keys' leases stay open (what they hold is unchanged: each key's second call
    // spent the one token its first asked for, and one call after the call that made a key
    // shows no demand, so no refill followed).
    assert_eq!(after.outstanding, before.outstanding);
}

/// Leases that cross their low-water mark while they still pay their callers are gathered and
/// refilled together: 2,000 keys crossing within a moment cost the actor a handful of rounds
/// and about one statement per 256 keys, not a wake-up and a statement each.
#[tokio::test(start_paused = true)]
async fn low_water_refills_of_many_keys_are_gathered() {
    const KEYS: usize = 2_000;
    let limiter = Limiter::builder(MemoryStore::new()).build();
    // B = 100 tokens; an hour's lifetime, so nothing expires while the test runs.
    let plan = common::plan(1_000, 1_000.0).with_lease(
        LeaseSettings::default()
            .with_ttl(Duration::from_secs(3600))
            .with_max_fraction(0.1),
    );
    let keys: Vec<String> = (0..KEYS).map(|i| format!("quiet:{i}")).collect();
    // Two passes: the first call of a key gets exactly its cost (no demand seen yet), the
    // second, a pass later, a whole lease of B sized from the demand the first showed.
    for _ in 0..2 {
        for key in &keys {
            let d = limiter
                .try_acquire_with(&plan, key, 1.0)
                .await
                .expect("valid");
            assert!(d.allowed, "{d:?}");
        }
    }
    let full = |limiter: &Limiter| {
        keys.iter().all(|key| {
            matches!(limiter.try_acquire_now_with(&plan, key, 0.0001), Ok(Some(d)) if d.allowed)
        })
    };
    until(Duration::from_secs(10), "every key leased", || {
        full(&limiter)
    })
    .await;
    let before = stats(&limiter);
    assert!(
        before.outstanding >= 90.0 * KEYS as f64,
        "leases of about B = 100 each: {before:?}"
    );
    // Each call takes a lease of about 99 below its low-water mark (50) and is paid at once.
    for key in &keys {
        let d = limiter
            .try_acquire_now_with(&plan, key, 60.0)
            .expect("valid")
            .expect("paid from the lease");
        assert!(d.allowed);
    }
    until(Duration::from_secs(10), "the refills", || {
        stats(&limiter).leased - before.leased >= 50.0 * KEYS as f64
    })
    .await;
    let after = stats(&limiter);
    let (rounds, statements) = (
        after.actor_rounds - before.actor_rounds,
        after.store_calls - before.store_calls,
    );
    // Gathered: one round and 8 statements (2,000 / 256, rounded up) on an idle machine; a round
    // or two more when the calling loop is preempted for longer than a gathering. Each nudge
    // waking the actor, as before, took 25–38 rounds and 31–45 statements.
    assert!(
        rounds <= 5 && statements <= 14,
        "{rounds} actor rounds and {statements} statements for {KEYS} low-water refills"
    );
}

/// A task that retries in a tight loop on a key whose bucket the store called empty (denied at
/// once, from the lease table, without a store call) still yields to the other tasks of its
/// worker (tokio's cooperative budget): on a one-thread runtime, a task spawned before the loop
/// runs within a few hundred calls. Before, such a loop never yielded, and kept the lease actor
/// and every other task of its thread from running.
#[tokio::test(flavor = "current_thread")]
async fn a_caller_retrying_a_denied_key_in_a_tight_loop_lets_other_tasks_run() {
    let limiter = Limiter::builder(MemoryStore::new()).build();
    // Ten tokens, refilled at one every 1,000 s: spent at once, then denied for a long while.
    let plan = common::plan(10, 0.001)
        .with_lease(LeaseSettings::default().with_ttl(Duration::from_secs(60)));
    let mut denied = false;
    for _ in 0..1_000 {
        let d = limiter
            .try_acquire_with(&plan, "dry", 1.0)
            .await
            .expect("valid");
        if !d.allowed {
            denied = true;
            break;
        }
    }
    assert!(
        denied,
        "ten tokens and no refill: a denial within 1,000 calls"
    );
    let ran = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = std::sync::Arc::clone(&ran);
    tokio::spawn(async move { flag.store(true, std::sync::atomic::Ordering::SeqCst) });
    let mut calls = 0u32;
    while !ran.load(std::sync::atomic::Ordering::SeqCst) {
        let d = limiter
            .try_acquire_with(&plan, "dry", 1.0)
            .await
            .expect("valid");
        assert!(!d.allowed, "{d:?}");
        calls += 1;
        assert!(
            calls < 100_000,
            "the loop never yielded to the spawned task"
        );
    }
    assert!(calls <= 1_000, "yielded only after {calls} calls");
}

/// A store over a `MemoryStore` for the actor's statements: those that carry the key `held` wait
/// until `release` is set (it holds the lease actor in one refill statement for as long as a
/// test needs it busy), every one is answered `delay` late (on tokio's clock), and the keys they
/// carry are noted in `asked`, with when. Single-key calls (the direct-mode coalescer's) are
/// noted and delayed too, but never held.
#[derive(Debug, Clone, Default)]
struct Gate {
    inner: MemoryStore,
    release: std::sync::Arc<Hold>,
    delay: Duration,
    asked: std::sync::Arc<parking_lot::Mutex<Vec<(String, Instant)>>>,
    /// Many-key statements in flight now, and the most at once.
    in_flight: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    most_in_flight: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Gate {
    async fn note_and_wait(&self, requests: &[tokenlease::store::AcquireRequest<'_>]) {
        let now = Instant::now();
        self.asked
            .lock()
            .extend(requests.iter().map(|r| (r.key.to_owned(), now)));
        if !self.delay.is_zero() {
            // sleep: a slow store's latency.
            tokio::time::sleep(self.delay).await;
        }
    }
}

#[async_trait::async_trait]
impl Store for Gate {
    async fn acquire(
        &self,
        request: tokenlease::store::AcquireRequest<'_>,
    ) -> Result<tokenlease::store::Acquired, tokenlease::store::StoreError> {
        self.note_and_wait(std::slice::from_ref(&request)).await;
        self.inner.acquire(request).await
    }
    async fn acquire_many(
        &self,
        requests: &[tokenlease::store::AcquireRequest<'_>],
    ) -> Result<Vec<tokenlease::store::Acquired>, tokenlease::store::StoreError> {
        if requests.iter().any(|r| r.key == "held") {
            self.release.until(true).await;
        }
        use std::sync::atomic::Ordering::SeqCst;
        let now = self.in_flight.fetch_add(1, SeqCst) + 1;
        self.most_in_flight.fetch_max(now, SeqCst);
        self.note_and_wait(requests).await;
        self.in_flight.fetch_sub(1, SeqCst);
        self.inner.acquire_many(requests).await
    }
    async fn give_back(
        &self,
        returns: &[tokenlease::store::GiveBack<'_>],
    ) -> Result<u64, tokenlease::store::StoreError> {
        self.inner.give_back(returns).await
    }
    async fn delete_idle(&self, limit: u32) -> Result<u64, tokenlease::store::StoreError> {
        self.inner.delete_idle(limit).await
    }
    async fn inspect(
        &self,
        key: &str,
    ) -> Result<Option<tokenlease::store::BucketRow>, tokenlease::store::StoreError> {
        self.inner.inspect(key).await
    }
}

/// Holds `limiter`'s lease actor in a refill statement (key `held`, through `gate`) until the
/// gate is released: returns once the statement is on its way.
async fn hold_the_actor(limiter: &Limiter, plan: &Plan) {
    let (limiter_, plan_) = (limiter.clone(), plan.clone());
    tokio::spawn(async move {
        let _ = limiter_.try_acquire_now_with(&plan_, "held", 1.0);
    });
    until(Duration::from_secs(1), "the actor's held refill", || {
        limiter.lease_stats().is_some_and(|s| s.store_calls == 1)
    })
    .await;
}

/// With `sparse_keys_direct`, a key called less often than once per lease lifetime (any key the
/// limiter has not seen) is sparse: while the lease actor is busy with a statement, a call its
/// lease cannot pay is one store call through the direct-mode coalescer (decided by the store:
/// no refill statement, no lease, no wait behind the actor). Once the actor is idle again, its
/// calls wait for the actor's refills; as they speed up, leases pay them.
#[tokio::test(start_paused = true)]
async fn a_sparse_key_is_decided_by_store_calls_while_the_actor_is_busy() {
    use tokenlease::DecidedBy;
    let gate = Gate::default();
    let ttl = Duration::from_millis(100);
    let limiter = Limiter::builder(gate.clone())
        .lease_tick(Duration::from_millis(10))
        .sparse_keys_direct(true)
        .build();
    // A bucket that refills too slowly to hide a take (1,000 tokens, one back every 1,000 s).
    let plan = common::plan(1_000, 0.001).with_lease(LeaseSettings::default().with_ttl(ttl));
    let call = async || {
        limiter
            .try_acquire_with(&plan, "quiet", 1.0)
            .await
            .expect("decision")
    };
    hold_the_actor(&limiter, &plan).await;
    // A call every 300 ms, three lifetimes: one store call each, however long the actor is
    // busy.
    for _ in 0..7 {
        let d = call().await;
        assert!(d.allowed && d.decided_by == DecidedBy::Store, "{d:?}");
        // sleep: pacing (paused clock), a call every 300 ms.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let quiet = stats(&limiter);
    assert_eq!(
        quiet.store_calls, 1,
        "the sparse key's calls sent no refill: {quiet:?}"
    );
    let row = gate
        .inner
        .inspect("quiet")
        .await
        .expect("inspect")
        .expect("row");
    assert!(
        (row.tokens_now.as_f64() - (1_000.0 - 7.0)).abs() < 0.01,
        "every call took its token from the bucket: {row:?}"
    );
    // The actor idle again: a call a millisecond waits for the key's first refills, and once
    // the actor has seen the demand, leases pay the calls.
    gate.release.set(true);
    let mut by = (0u32, 0u32);
    for _ in 0..200 {
        let d = call().await;
        assert!(d.allowed, "{d:?}");
        match d.decided_by {
            DecidedBy::Lease => by.0 += 1,
            DecidedBy::Store => by.1 += 1,
            _ => panic!("{d:?}"),
        }
        // sleep: pacing (paused clock), a call every millisecond.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        by.1 <= 20 && by.0 >= 180,
        "leased once it sped up: {} by leases, {} by the store",
        by.0,
        by.1
    );
    limiter.shutdown().await;
}

/// With `sparse_keys_direct`, a sparse key whose bucket is empty is denied by the store once,
/// then here until the store's retry time, without a store call per denial.
#[tokio::test(start_paused = true)]
async fn a_sparse_keys_denial_stands_until_its_retry_time() {
    use tokenlease::DecidedBy;
    let gate = Gate::default();
    let limiter = Limiter::builder(gate.clone())
        .lease_tick(Duration::from_millis(10))
        .sparse_keys_direct(true)
        .build();
    // Two tokens, one back every 10 s; leases of the default lifetime (1 s).
    let plan = common::plan(2, 0.1).with_lease(LeaseSettings::default());
    hold_the_actor(
        &limiter,
        &common::plan(1_000, 1.0).with_lease(LeaseSettings::default()),
    )
    .await;
    let mut store_denials = 0;
    let mut allowed = 0;
    for i in 0..20 {
        let d = limiter
            .try_acquire_with(&plan, "dry", 1.0)
            .await
            .expect("decision");
        if d.allowed {
            allowed += 1;
            assert!(i < 2, "only the two tokens are admitted: call {i}, {d:?}");
            assert_eq!(d.decided_by, DecidedBy::Store, "{d:?}");
        } else {
            assert!(
                d.retry_after > Duration::from_secs(8),
                "the store's retry time: {d:?}"
            );
            match d.decided_by {
                DecidedBy::Store => store_denials += 1,
                DecidedBy::Lease => {}
                _ => panic!("{d:?}"),
            }
        }
        // sleep: pacing (paused clock), calls 40 ms apart.
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    assert_eq!(allowed, 2);
    assert_eq!(
        store_denials, 1,
        "one store call denied; the slot denied the rest until the store's retry time"
    );
    gate.release.set(true);
    limiter.shutdown().await;
}

/// By default a sparse key's call waits for the actor, busy or not: held in a statement, the
/// actor answers nothing, and the call is decided by the fallback after its `max_wait`.
#[tokio::test(start_paused = true)]
async fn by_default_a_sparse_keys_call_waits_for_the_actor() {
    use tokenlease::DecidedBy;
    let gate = Gate::default();
    let limiter = Limiter::builder(gate.clone())
        .lease_tick(Duration::from_millis(10))
        .build();
    let plan = common::plan(1_000, 0.001).with_lease(LeaseSettings::default());
    hold_the_actor(&limiter, &plan).await;
    let started = Instant::now();
    let d = limiter
        .try_acquire_with(&plan, "quiet", 1.0)
        .await
        .expect("decision");
    assert!(matches!(d.decided_by, DecidedBy::Fallback(_)), "{d:?}");
    assert_eq!(started.elapsed(), Duration::from_millis(50), "its max_wait");
    gate.release.set(true);
    limiter.shutdown().await;
}

/// A key called once is leased exactly its call: the call that made the key is not counted in
/// its demand, so the actor's next look (the low-water nudge of that call) sizes no lease for
/// it. Before, the one call divided by the moment until that look made the key look hot: a
/// whole lease was granted, sat out its lifetime and went back, two statements for nothing.
#[tokio::test(start_paused = true)]
async fn a_key_called_once_is_not_sized_a_lease() {
    let limiter = Limiter::builder(MemoryStore::new())
        .lease_tick(Duration::from_millis(10))
        .build();
    let plan = common::plan(1_000, 1.0)
        .with_lease(LeaseSettings::default().with_ttl(Duration::from_millis(100)));
    let d = limiter
        .try_acquire_with(&plan, "once", 1.0)
        .await
        .expect("decision");
    assert!(d.allowed, "{d:?}");
    // sleep: paused clock, ten lease lifetimes pass with no call.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let s = stats(&limiter);
    assert_eq!(
        (s.leased, s.returned, s.store_calls, s.keys),
        (1.0, 0.0, 1, 0),
        "one refill of one token, nothing given back, the key gone: {s:?}"
    );
}

/// A relaxed lease that closes unspent on a bucket that has since refilled to its capacity
/// waives its return: the store would cap it away, so no statement is sent, and the tokens are
/// counted as waived (conservation holds). On a bucket that has not refilled yet the same
/// close gives the tokens back, and a strict lease always does (its entry must be settled).
#[tokio::test(start_paused = true)]
async fn a_lease_on_a_refilled_bucket_waives_its_return() {
    let ttl = Duration::from_millis(200);
    // (refill per second, accounting, waived?): 1,000/s refills a token in a millisecond; one
    // a second does not within the lifetime.
    for (rate, accounting, waives) in [
        (1_000.0, Accounting::Relaxed, true),
        (1.0, Accounting::Relaxed, false),
        (1_000.0, Accounting::Strict, false),
    ] {
        let store = MemoryStore::new();
        let limiter = Limiter::builder(store.clone())
            .lease_tick(Duration::from_millis(10))
            .build();
        let plan = common::plan(1_000_000, rate).with_lease(
            LeaseSettings::default()
                .with_ttl(ttl)
                .with_accounting(accounting),
        );
        let case = format!("{rate}/s {accounting:?}");
        let d = limiter
            .try_acquire_now_with(&plan, "quiet", 1.0)
            .expect("valid key");
        assert!(d.is_none(), "{case}: no lease yet: {d:?}");
        until(Duration::from_secs(2), "the lease", || {
            stats(&limiter).outstanding == 1.0
        })
        .await;
        until(Duration::from_secs(3), "closed and evicted", || {
            let s = stats(&limiter);
            s.keys == 0 && s.outstanding == 0.0 && s.leased == s.returned + s.waived
        })
        .await;
        let s = stats(&limiter);
        let expected = if waives {
            (1.0, 0.0, 1.0, 1)
        } else {
            (1.0, 1.0, 0.0, 2)
        };
        assert_eq!(
            (s.leased, s.returned, s.waived, s.store_calls),
            expected,
            "{case}: (leased, returned, waived, store calls): {s:?}"
        );
        // The row either way: the bucket is at its capacity once the token's refill time passed.
        // sleep: paused clock, the token's refill time.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let row = store.inspect("quiet").await.expect("inspect").expect("row");
        assert!(row.leases.is_empty(), "{case}: {row:?}");
    }
}

/// A key called about once a lifetime keeps its lease through the lifetimes that happen to
/// pass without a call: its demand says a call is due, so the lease lives on (up to a few
/// expected gaps, at most eight lifetimes) instead of closing and costing a statement for the
/// next call's new lease. Once the calls stop for good, the lease closes within those eight
/// lifetimes and the key leaves the table.
#[tokio::test(start_paused = true)]
async fn a_key_called_about_once_a_lifetime_keeps_its_lease() {
    let ttl = Duration::from_millis(200);
    let limiter = Limiter::builder(MemoryStore::new())
        .lease_tick(Duration::from_millis(10))
        .build();
    let plan = common::plan(1_000, 1_000.0).with_lease(LeaseSettings::default().with_ttl(ttl));
    // Calls every 250 ms against lifetimes of 200 ms: some lifetimes pass with no call. Two
    // seconds first, for the demand estimate to settle; then count.
    let call = || async {
        let d = limiter
            .try_acquire_with(&plan, "steady", 1.0)
            .await
            .expect("decision");
        assert!(d.allowed, "{d:?}");
        d
    };
    for _ in 0..8 {
        let _ = call().await;
        // sleep: pacing (paused clock), calls 250 ms apart.
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let before = stats(&limiter);
    let mut by_lease = 0;
    for _ in 0..16 {
        by_lease += u32::from(call().await.decided_by == tokenlease::DecidedBy::Lease);
        // sleep: pacing (paused clock), calls 250 ms apart.
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let after = stats(&limiter);
    assert_eq!(by_lease, 16, "every call paid by the lease: {after:?}");
    assert!(
        after.store_calls - before.store_calls <= 2,
        "at most a top-up or two in 16 calls over 4 s: {before:?} -> {after:?}"
    );
    assert_eq!(
        after.waived + after.returned,
        before.waived + before.returned,
        "no close"
    );
    // The calls stop: closed within eight lifetimes (plus a tick), the key evicted a lifetime
    // after that.
    let stopped = Instant::now();
    until(ttl * 12, "closed and evicted", || stats(&limiter).keys == 0).await;
    assert!(
        stopped.elapsed() <= ttl * 10 + Duration::from_millis(20),
        "closed after {:?}",
        stopped.elapsed()
    );
}

/// A store of two partitions (`Store::partition`), as a `ShardedStore` of two shards answers:
/// the key `held` alone on partition 1, whose refills wait while `hold_refills` is set and
/// whose give-backs wait while `hold_returns` is set; every other key on partition 0, answered
/// at once.
#[derive(Debug, Clone, Default)]
struct TwoShards {
    inner: MemoryStore,
    hold_refills: std::sync::Arc<Hold>,
    hold_returns: std::sync::Arc<Hold>,
    /// Give-back statements of `held` waiting now.
    returns_waiting: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

/// A flag that statements wait on, woken when it changes.
#[derive(Debug, Default)]
struct Hold {
    on: std::sync::atomic::AtomicBool,
    changed: tokio::sync::Notify,
}

impl Hold {
    fn set(&self, on: bool) {
        self.on.store(on, std::sync::atomic::Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// Returns once the flag is `on`.
    async fn until(&self, on: bool) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.on.load(std::sync::atomic::Ordering::SeqCst) == on {
                return;
            }
            changed.await;
        }
    }
}

#[async_trait::async_trait]
impl Store for TwoShards {
    async fn acquire(
        &self,
        request: tokenlease::store::AcquireRequest<'_>,
    ) -> Result<tokenlease::store::Acquired, tokenlease::store::StoreError> {
        self.inner.acquire(request).await
    }
    async fn acquire_many(
        &self,
        requests: &[tokenlease::store::AcquireRequest<'_>],
    ) -> Result<Vec<tokenlease::store::Acquired>, tokenlease::store::StoreError> {
        if requests.iter().any(|r| r.key == "held") {
            self.hold_refills.until(false).await;
        }
        self.inner.acquire_many(requests).await
    }
    async fn give_back(
        &self,
        returns: &[tokenlease::store::GiveBack<'_>],
    ) -> Result<u64, tokenlease::store::StoreError> {
        if returns.iter().any(|r| r.key == "held") {
            use std::sync::atomic::Ordering::Relaxed;
            self.returns_waiting.fetch_add(1, Relaxed);
            self.hold_returns.until(false).await;
            self.returns_waiting.fetch_sub(1, Relaxed);
        }
        self.inner.give_back(returns).await
    }
    async fn delete_idle(&self, limit: u32) -> Result<u64, tokenlease::store::StoreError> {
        self.inner.delete_idle(limit).await
    }
    async fn inspect(
        &self,
        key: &str,
    ) -> Result<Option<tokenlease::store::BucketRow>, tokenlease::store::StoreError> {
        self.inner.inspect(key).await
    }
    fn partition(&self, key: &str) -> usize {
        usize::from(key == "held")
    }
}

/// `calls` calls of `key`, a millisecond apart: none may wait out `max_wait` (the fallback's
/// decision), and the leases pay most of them.
async fn decided_without_the_fallback(limiter: &Limiter, plan: &Plan, key: &str, calls: u32) {
    use tokenlease::DecidedBy;
    let mut leased = 0;
    for i in 0..calls {
        let d = limiter
            .try_acquire_with(plan, key, 1.0)
            .await
            .expect("decision");
        assert!(
            d.allowed && !matches!(d.decided_by, DecidedBy::Fallback(_)),
            "call {i} of {key}: {d:?}"
        );
        leased += u32::from(d.decided_by == DecidedBy::Lease);
        // sleep: pacing (paused clock), a call every millisecond.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(leased >= calls / 2, "{leased} of {calls} calls by a lease");
}

/// One partition's statement that does not answer (a shard down, its calls waiting out their
/// pool wait, or hung) holds up only its own keys: the lease actor sends each partition's
/// refills and give-backs as their own statements and applies each answer as it comes, so the
/// other partition's keys are refilled meanwhile. Before, the actor waited for every statement
/// of a round, and another key's callers waited out `max_wait` behind it.
#[tokio::test(start_paused = true)]
async fn a_partition_that_does_not_answer_holds_up_only_its_own_keys() {
    use std::sync::atomic::Ordering::Relaxed;
    let store = TwoShards::default();
    let limiter = Limiter::builder(store.clone())
        .lease_tick(Duration::from_millis(10))
        .build();
    let ttl = Duration::from_millis(100);
    // Refilling 10 tokens a second, a bucket takes far longer than a lifetime to refill what a
    // lease took, so an expired lease's tokens go back (not waived).
    let plan = common::plan(1_000, 10.0).with_lease(LeaseSettings::default().with_ttl(ttl));
    // A refill of `held` in flight, not answering.
    store.hold_refills.set(true);
    hold_the_actor(&limiter, &plan).await;
    decided_without_the_fallback(&limiter, &plan, "free", 200).await;
    // `held` leased, then its lease expires with its give-back not answering.
    store.hold_refills.set(false);
    until(
        Duration::from_secs(1),
        "held leased",
        || matches!(limiter.try_acquire_now_with(&plan, "held", 1.0), Ok(Some(d)) if d.allowed),
    )
    .await;
    store.hold_returns.set(true);
    until(ttl * 3, "held's give-back sent", || {
        store.returns_waiting.load(Relaxed) == 1
    })
    .await;
    decided_without_the_fallback(&limiter, &plan, "free", 200).await;
    assert_eq!(
        store.returns_waiting.load(Relaxed),
        1,
        "held's give-back waited all along"
    );
    // Once it answers, `held`'s tokens are back and nothing is stranded.
    store.hold_returns.set(false);
    limiter.shutdown().await;
    let end = stats(&limiter);
    assert_eq!(end.outstanding, 0.0, "{end:?}");
    assert_eq!(end.stranded, 0.0, "{end:?}");
}

/// Callers waiting for a refill park on `Notify`s that slots share (1,024 for the process), so
/// an answer for one key also wakes callers of others, and a caller is woken only through its
/// slot's shared `Notify`. 3,000 first calls on distinct keys, all waiting at once behind refills
/// answered 20 ms late, 256 keys a statement (about three callers per `Notify`): each is allowed
/// from its key's lease (none waits out its 10 s `max_wait` into the fallback: no wake-up is
/// lost), and each key's refill was sent to the store once before its caller was answered (a
/// caller woken for another key's answer finds its own refill pending and waits again). A key
/// may be asked for again after its caller spent from the new lease: a low-water refill. With
/// more than a statement's 256 keys waiting, the actor sends up to four refill statements at
/// once (of distinct keys), not one after another.
#[tokio::test(start_paused = true)]
async fn callers_waiting_on_shared_notifys_are_each_answered_from_their_lease() {
    const KEYS: usize = 3_000;
    let store = Gate {
        delay: Duration::from_millis(20),
        ..Gate::default()
    };
    let asked = std::sync::Arc::clone(&store.asked);
    let most_in_flight = std::sync::Arc::clone(&store.most_in_flight);
    let limiter = Limiter::builder(store).build();
    let plan = common::plan(1_000_000, 1_000.0).with_lease(
        LeaseSettings::default()
            .with_ttl(Duration::from_secs(60))
            .with_max_wait(Duration::from_secs(10)),
    );
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(KEYS));
    let calls: Vec<_> = (0..KEYS)
        .map(|i| {
            let (limiter, plan, barrier) = (limiter.clone(), plan.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let key = format!("waiter:{i}");
                let d = limiter
                    .try_acquire_with(&plan, &key, 1.0)
                    .await
                    .expect("decision");
                (key, d, Instant::now())
            })
        })
        .collect();
    let mut answered = std::collections::HashMap::new();
    for call in calls {
        let (key, d, at) = call.await.expect("call");
        assert!(d.allowed, "{key}: {d:?}");
        assert_eq!(d.decided_by, tokenlease::DecidedBy::Lease, "{key}: {d:?}");
        answered.insert(key, at);
    }
    let mut before: std::collections::HashMap<&str, u32> = std::collections::HashMap::new();
    let asked = asked.lock();
    for (key, at) in asked.iter() {
        if *at < answered[key] {
            *before.entry(key).or_default() += 1;
        }
    }
    assert_eq!(before.len(), KEYS, "every key's refill was asked for");
    let again: Vec<_> = before.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        again.is_empty(),
        "asked again while its caller waited: {again:?}"
    );
    let most = most_in_flight.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        (2..=4).contains(&most),
        "{most} refill statements in flight at most"
    );
}

/// `calls` calls of `key`, one after another (each waits out `max_wait` while the key's refill
/// is held): how many the lease decided (on credit) and how many the fallback did.
async fn lease_and_fallback(limiter: &Limiter, plan: &Plan, key: &str, calls: u32) -> (u32, u32) {
    use tokenlease::DecidedBy;
    let mut by = (0, 0);
    for _ in 0..calls {
        let d = limiter
            .try_acquire_with(plan, key, 1.0)
            .await
            .expect("decision");
        match d.decided_by {
            DecidedBy::Lease => {
                assert!(d.allowed, "{d:?}");
                by.0 += 1;
            }
            DecidedBy::Fallback(_) => by.1 += 1,
            _ => panic!("{d:?}"),
        }
    }
    by
}

/// C10: a new key's calls that wait out `max_wait` for its first refill, late but on its way,
/// are admitted on credit instead of by the fallback: at most `B` of them (the slot's grants so
/// far, its unpaid credit and the call's cost within the largest lease, here 10 tokens), and
/// the refill, when it lands, pays the credit first, so the store's bucket is charged every
/// admitted token. A strict lease gets no credit, and neither does any call before the actor's
/// first refill answered or after a refill failed.
#[tokio::test(start_paused = true)]
async fn c10_a_late_first_refill_admits_on_credit_within_the_bound() {
    let store = TwoShards::default();
    let limiter = Limiter::builder(store.clone())
        .lease_tick(Duration::from_millis(10))
        .build();
    // B = 10 tokens; a bucket refilling a token every 1,000 s, so the row shows every take.
    let plan = common::plan(100, 0.001).with_lease(
        LeaseSettings::default()
            .with_ttl(Duration::from_secs(1))
            .with_max_wait(Duration::from_millis(50)),
    );
    store.hold_refills.set(true);
    // No refill has answered yet: no credit, the fallback decides.
    assert_eq!(
        lease_and_fallback(&limiter, &plan, "held", 1).await,
        (0, 1),
        "no credit before the store answered"
    );
    assert_eq!(stats(&limiter).fallback_unanswered, 1, "counted by cause");
    // Another key's refill answers at once (its own partition); then `held`'s calls, each
    // waiting 50 ms for the held refill, are admitted on credit until B is used, then the
    // fallback decides.
    assert_eq!(lease_and_fallback(&limiter, &plan, "free", 1).await, (1, 0));
    assert_eq!(
        lease_and_fallback(&limiter, &plan, "held", 12).await,
        (10, 2),
        "credit within B"
    );
    let owing = stats(&limiter);
    assert_eq!(owing.credit, 10.0, "{owing:?}");
    assert_eq!(owing.fallback_at_bound, 2, "{owing:?}");
    assert_eq!(owing.fallback_unanswered, 1, "{owing:?}");
    assert_eq!(owing.credit_owed, 10.0, "{owing:?}");
    // The refill lands: it pays the credit before the lease gets anything.
    store.hold_refills.set(false);
    until(Duration::from_secs(1), "credit paid", || {
        stats(&limiter).credit_owed == 0.0
    })
    .await;
    let row = store
        .inner
        .inspect("held")
        .await
        .expect("inspect")
        .expect("row");
    let paid = stats(&limiter);
    assert!(
        100.0 - row.tokens_now.as_f64() >= 10.0 - 1e-6,
        "the bucket was charged the credit: {row:?} {paid:?}"
    );
    assert_eq!(paid.credit_unpaid, 0.0, "{paid:?}");
    limiter.shutdown().await;
    let end = stats(&limiter);
    assert_eq!(end.credit_unpaid, 0.0, "{end:?}");

    // Strict accounting: no credit.
    let store = TwoShards::default();
    let limiter = Limiter::builder(store.clone())
        .lease_tick(Duration::from_millis(10))
        .build();
    let strict = common::plan(100, 0.001).with_lease(
        LeaseSettings::default()
            .with_ttl(Duration::from_secs(1))
            .with_max_wait(Duration::from_millis(50))
            .with_accounting(Accounting::Strict),
    );
    store.hold_refills.set(true);
    assert_eq!(
        lease_and_fallback(&limiter, &strict, "free", 1).await,
        (1, 0)
    );
    assert_eq!(
        lease_and_fallback(&limiter, &strict, "held", 3).await,
        (0, 3),
        "no credit for a strict lease"
    );
    assert_eq!(stats(&limiter).credit, 0.0);
    assert_eq!(stats(&limiter).fallback_other, 3, "{:?}", stats(&limiter));
    store.hold_refills.set(false);
    limiter.shutdown().await;
}

/// A store whose refill statements fail while `fail` is set, and otherwise answer after
/// `delay` (tokio's clock).
#[derive(Debug, Clone, Default)]
struct Flaky {
    inner: MemoryStore,
    fail: std::sync::Arc<std::sync::atomic::AtomicBool>,
    delay: Duration,
    /// Refill statements failed and answered so far.
    failed: std::sync::Arc<std::sync::atomic::AtomicU32>,
    answered: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

#[async_trait::async_trait]
impl Store for Flaky {
    async fn acquire(
        &self,
        request: tokenlease::store::AcquireRequest<'_>,
    ) -> Result<tokenlease::store::Acquired, tokenlease::store::StoreError> {
        self.inner.acquire(request).await
    }
    async fn acquire_many(
        &self,
        requests: &[tokenlease::store::AcquireRequest<'_>],
    ) -> Result<Vec<tokenlease::store::Acquired>, tokenlease::store::StoreError> {
        use std::sync::atomic::Ordering::Relaxed;
        // sleep: the stand-in store's latency (paused clock), after which it fails or answers.
        tokio::time::sleep(self.delay).await;
        if self.fail.load(Relaxed) {
            self.failed.fetch_add(1, Relaxed);
            return Err(tokenlease::store::StoreError::Timeout {
                kind: tokenlease::store::TimeoutKind::Call,
                after: self.delay,
            });
        }
        let answer = self.inner.acquire_many(requests).await;
        self.answered.fetch_add(1, Relaxed);
        answer
    }
    async fn give_back(
        &self,
        returns: &[tokenlease::store::GiveBack<'_>],
    ) -> Result<u64, tokenlease::store::StoreError> {
        self.inner.give_back(returns).await
    }
    async fn delete_idle(&self, limit: u32) -> Result<u64, tokenlease::store::StoreError> {
        self.inner.delete_idle(limit).await
    }
    async fn inspect(
        &self,
        key: &str,
    ) -> Result<Option<tokenlease::store::BucketRow>, tokenlease::store::StoreError> {
        self.inner.inspect(key).await
    }
}

/// C10: credit stands in for a store that answers late, never for one that fails, nor for a
/// key the table has removed before. Refills answered 80 ms late against a 50 ms `max_wait`:
/// once one has answered, new keys' first calls are admitted on credit and paid by their
/// refills; after a refill failed, the fallback decides them until a refill answers again; the
/// credit of a key whose refill failed is asked for again before the key leaves the table, and
/// paid; a key the table removed gets no credit when it comes back.
#[tokio::test(start_paused = true)]
async fn c10_credit_stops_when_refills_fail_and_for_keys_the_table_removed() {
    let started = tokio::time::Instant::now();
    use std::sync::atomic::Ordering::Relaxed;
    let store = Flaky {
        delay: Duration::from_millis(80),
        ..Flaky::default()
    };
    let limiter = Limiter::builder(store.clone())
        .lease_tick(Duration::from_millis(10))
        .build();
    let plan = common::plan(100, 0.001).with_lease(
        LeaseSettings::default()
            .with_ttl(Duration::from_secs(1))
            .with_max_wait(Duration::from_millis(50)),
    );
    // The first call waits out max_wait before any refill answered: the fallback.
    assert_eq!(lease_and_fallback(&limiter, &plan, "k0", 1).await, (0, 1));
    assert_eq!(stats(&limiter).fallback_unanswered, 1);
    until(Duration::from_secs(1), "k0 refilled", || {
        store.answered.load(Relaxed) == 1
    })
    .await;
    // Late refills now: credit, paid when each lands.
    for i in 1..=5 {
        let key = format!("k{i}");
        assert_eq!(
            lease_and_fallback(&limiter, &plan, &key, 1).await,
            (1, 0),
            "{key}"
        );
    }
    until(Duration::from_secs(1), "credit paid", || {
        stats(&limiter).credit_owed == 0.0
    })
    .await;
    assert_eq!(stats(&limiter).credit, 5.0);
    // Refills fail: f0's call is admitted on credit before the failure is known, and none after.
    // The first timeout of f0's refill is late (the store was answering), the second fails.
    store.fail.store(true, Relaxed);
    assert_eq!(lease_and_fallback(&limiter, &plan, "f0", 1).await, (1, 0));
    until(Duration::from_secs(1), "a refill failed", || {
        stats(&limiter).failed_refills >= 1
    })
    .await;
    assert!(stats(&limiter).late_refills >= 1, "late once first");
    for i in 1..=3 {
        let key = format!("f{i}");
        assert_eq!(
            lease_and_fallback(&limiter, &plan, &key, 1).await,
            (0, 1),
            "{key}"
        );
    }
    assert_eq!(stats(&limiter).credit_owed, 1.0, "f0's credit");
    assert_eq!(
        stats(&limiter).fallback_unanswered,
        4,
        "{:?}",
        stats(&limiter)
    );
    // f3 again until a call finds its refill failed (within 100 ms of a failure): that call
    // is counted as failing, the others as unanswered.
    let mut again = 0u64;
    while stats(&limiter).fallback_failing == 0 {
        assert!(again < 20, "f3 never found failing: {:?}", stats(&limiter));
        assert_eq!(lease_and_fallback(&limiter, &plan, "f3", 1).await, (0, 1));
        again += 1;
    }
    assert_eq!(stats(&limiter).fallback_failing, 1, "{:?}", stats(&limiter));
    // Refills answer again (the one in flight for f3 may be the first): credit again once one
    // has answered.
    store.fail.store(false, Relaxed);
    let answered = store.answered.load(Relaxed);
    let (g1, _) = lease_and_fallback(&limiter, &plan, "g1", 1).await;
    until(Duration::from_secs(1), "a refill answered", || {
        store.answered.load(Relaxed) > answered
    })
    .await;
    assert_eq!(lease_and_fallback(&limiter, &plan, "g2", 1).await, (1, 0));
    let credited = 7.0 + f64::from(g1);
    // Every key idle: they leave the table, f0 once its credit is paid.
    until(Duration::from_secs(30), "every key evicted", || {
        stats(&limiter).keys == 0
    })
    .await;
    let gone = stats(&limiter);
    assert_eq!(gone.credit, credited, "{gone:?}");
    assert_eq!(gone.credit_owed, 0.0, "{gone:?}");
    assert_eq!(gone.credit_unpaid, 0.0, "f0's credit was paid: {gone:?}");
    let f0 = store
        .inner
        .inspect("f0")
        .await
        .expect("inspect")
        .expect("row");
    // The row as of its last write: the credit taken, plus what the bucket refilled since (a
    // give-back of a later lease writes it again, seconds later).
    let refilled = 0.001 * started.elapsed().as_secs_f64();
    assert!(
        f0.tokens.as_f64() <= 99.0 + refilled + 1e-6,
        "f0 charged its credit: {f0:?}"
    );
    // k1 comes back: no credit, the fallback decides its first call again.
    assert_eq!(lease_and_fallback(&limiter, &plan, "k1", 1).await, (0, 1));
    let end = stats(&limiter);
    assert_eq!(end.credit, credited, "no credit for k1");
    // Every fallback decision counted once, under its cause.
    assert_eq!(
        (
            end.fallback_unanswered,
            end.fallback_failing,
            end.fallback_returning,
            end.fallback_at_bound,
            end.fallback_other
        ),
        (3 + again + u64::from(1 - g1), 1, 1, 0, 0),
        "{end:?}"
    );
    limiter.shutdown().await;
}
