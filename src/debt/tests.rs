//! The ledger on tokio's paused clock, over a `MemoryStore` (whose clock is tokio's `Instant`
//! too), behind a wrapper that fails on demand and logs the keys of every call.

use std::num::NonZeroU32;
use std::sync::atomic::AtomicUsize;

use async_trait::async_trait;

use super::*;
use crate::bucket::Rate;
use crate::policy::FallbackSettings;
use crate::store::{Acquired, BucketRow, GiveBack, MemoryStore, StoreError};
use crate::tests::eventually;

/// A memory store that fails while `failing` is set, and logs each call's keys.
#[derive(Debug, Default)]
pub(crate) struct Switch {
    inner: MemoryStore,
    pub(crate) failing: AtomicBool,
    calls: Mutex<Vec<Vec<String>>>,
    failed: AtomicUsize,
}

#[async_trait]
impl Store for Switch {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        self.acquire_many(&[request]).await.map(|mut v| v.remove(0))
    }
    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        let keys: Vec<String> = requests.iter().map(|r| r.key.to_owned()).collect();
        let distinct: HashSet<&String> = keys.iter().collect();
        assert_eq!(
            distinct.len(),
            keys.len(),
            "a key twice in one call: {keys:?}"
        );
        self.calls.lock().push(keys);
        if self.failing.load(Ordering::SeqCst) {
            self.failed.fetch_add(1, Ordering::SeqCst);
            return Err(StoreError::Protocol("down".into()));
        }
        self.inner.acquire_many(requests).await
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

impl Switch {
    pub(crate) fn calls(&self) -> usize {
        self.calls.lock().len()
    }
}

pub(crate) fn plan(name: &str, capacity: u64, per_second: f64, mode: FallbackMode) -> Plan {
    let bucket =
        BucketConfig::new(Tokens::whole(capacity), Rate::from_f64(per_second).unwrap()).unwrap();
    Plan::new(name, bucket).with_fallback(FallbackSettings::new(mode))
}

pub(crate) fn local(instances: u32) -> FallbackMode {
    FallbackMode::Local {
        instances: NonZeroU32::new(instances).unwrap(),
    }
}

pub(crate) fn settings() -> Settings {
    Settings::new(Duration::from_millis(50))
}

pub(crate) fn ledger(store: &Arc<Switch>, settings: Settings) -> Debt {
    Debt::new(Arc::clone(store) as Arc<dyn Store>, settings)
}

/// The tokens the store's bucket for `key` holds now (`None`: no row, a full bucket).
async fn tokens(store: &Switch, key: &str) -> Option<f64> {
    store
        .inspect(key)
        .await
        .unwrap()
        .map(|row| row.tokens_now.as_f64())
}

/// How often the tests look at the ledger while they wait for it: every 10 ms of the paused
/// clock.
pub(crate) const LOOK: Duration = Duration::from_millis(10);

/// Counters for `plan`, as a limiter's plan registry holds them.
pub(crate) fn counters(plan: &Plan) -> Arc<PlanCounters> {
    Arc::new(PlanCounters::of(plan))
}

pub(crate) fn whole(n: u64) -> Tokens {
    Tokens::whole(n)
}

/// Word that the store answers, once the task (started by a record) waits for it: word sent
/// before it waits is not kept.
async fn recovered(debt: &Debt) {
    let shared = debt.shared.as_ref().expect("a ledger");
    eventually(
        Duration::from_millis(1),
        Duration::from_secs(1),
        "the charging task waits for word",
        async || shared.parked.load(Ordering::Acquire),
    )
    .await;
    debt.store_answered();
}

/// Debt of 600 keys is charged in calls of at most 256 keys, each key's from its own bucket,
/// and the task ends with the ledger empty.
#[tokio::test(start_paused = true)]
async fn charges_in_batched_calls_and_ends_when_paid() {
    let store = Arc::new(Switch::default());
    let debt = ledger(&store, settings());
    let p = plan("p", 10, 1.0, FallbackMode::Allow);
    for i in 0..600 {
        debt.record_now(&p, &counters(&p), &format!("k{i}"), whole(1));
    }
    assert_eq!(debt.stats().outstanding, whole(600));
    assert_eq!(debt.stats().keys, 600);
    recovered(&debt).await;
    eventually(
        LOOK,
        Duration::from_secs(2),
        "the ledger empty",
        async || debt.stats().keys == 0,
    )
    .await;
    let stats = debt.stats();
    assert_eq!(stats.charged, whole(600));
    assert_eq!(stats.outstanding, Tokens::ZERO);
    assert_eq!(stats.dropped, Tokens::ZERO);
    let sizes: Vec<usize> = store.calls.lock().iter().map(Vec::len).collect();
    assert_eq!(sizes, vec![256, 256, 88]);
    // Each key's bucket gave its one token (and the paused clock refilled little since).
    for key in ["k0", "k300", "k599"] {
        let left = tokens(&store, key).await.expect("a row");
        assert!((9.0..9.5).contains(&left), "{key}: {left}");
    }
    // The task ends at its next round, after the pace.
    let shared = debt.shared.as_ref().unwrap();
    eventually(LOOK, PACE * 2, "the task ended", async || {
        !shared.running.load(Ordering::SeqCst)
    })
    .await;
    // New debt starts it again.
    debt.record_now(&p, &counters(&p), "k0", whole(2));
    assert!(shared.running.load(Ordering::SeqCst));
    recovered(&debt).await;
    eventually(
        LOOK,
        Duration::from_secs(1),
        "the ledger empty",
        async || debt.stats().keys == 0,
    )
    .await;
    assert_eq!(debt.stats().charged, whole(602));
}

/// At the key bound a new key's debt is counted as dropped and not kept; keys already in the
/// ledger keep adding.
#[tokio::test(start_paused = true)]
async fn the_key_bound_drops_and_counts_new_keys() {
    let store = Arc::new(Switch::default());
    store.failing.store(true, Ordering::SeqCst);
    let debt = ledger(
        &store,
        Settings {
            max_keys: 3,
            ..settings()
        },
    );
    let p = plan("p", 100, 1.0, local(2));
    for i in 0..5 {
        debt.record_now(&p, &counters(&p), &format!("k{i}"), whole(2));
    }
    debt.record_now(&p, &counters(&p), "k0", whole(1));
    let stats = debt.stats();
    assert_eq!(stats.keys, 3);
    assert_eq!(stats.outstanding, whole(7));
    assert_eq!(stats.dropped, whole(4));
    let ledger = debt.shared.as_ref().unwrap().ledger.lock();
    assert!(ledger.entries.len() <= 3 && ledger.queue.len() <= 3);
}

/// Debt unpaid for the maximum age after it was last added to is dropped and counted, while the
/// store stays down; then the task ends. Charging stopped at the first failure and only probed
/// after that, with growing waits.
#[tokio::test(start_paused = true)]
async fn unpaid_debt_ages_out() {
    let store = Arc::new(Switch::default());
    store.failing.store(true, Ordering::SeqCst);
    let debt = ledger(
        &store,
        Settings {
            max_age: Duration::from_secs(30),
            ..settings()
        },
    );
    let p = plan("p", 100, 1.0, FallbackMode::Allow);
    debt.record_now(&p, &counters(&p), "old", whole(5));
    // sleep: paused clock, "old" ages 20 s before "new" is recorded.
    tokio::time::sleep(Duration::from_secs(20)).await;
    debt.record_now(&p, &counters(&p), "new", whole(3));
    // 31 s after the first record: "old" has aged out, "new" (11 s old) has not.
    // sleep: paused clock, "old" past its 30 s maximum age.
    tokio::time::sleep(Duration::from_secs(11)).await;
    eventually(
        LOOK,
        Duration::from_secs(2),
        "one key left in the ledger",
        async || debt.stats().keys == 1,
    )
    .await;
    let stats = debt.stats();
    assert_eq!(stats.dropped, whole(5));
    assert_eq!(stats.outstanding, whole(3));
    // Probes 0.25, 0.5, 1, 2, 4, then every 5 s: about ten calls in 32 s, not one per pace.
    let failed = store.failed.load(Ordering::SeqCst);
    assert!((5..=14).contains(&failed), "{failed} failed rounds");
    eventually(
        LOOK,
        Duration::from_secs(40),
        "the ledger empty",
        async || debt.stats().keys == 0,
    )
    .await;
    assert_eq!(debt.stats().dropped, whole(8));
    assert_eq!(debt.stats().charged, Tokens::ZERO);
    let shared = debt.shared.as_ref().unwrap();
    eventually(
        LOOK,
        Duration::from_secs(10),
        "the task ended",
        async || !shared.running.load(Ordering::SeqCst),
    )
    .await;
}

/// What the bucket cannot give stays as debt and is charged on later rounds: the refill pays
/// it off at the bucket's rate, and the bucket stays empty until it is paid.
#[tokio::test(start_paused = true)]
async fn partial_payment_is_carried_over() {
    let store = Arc::new(Switch::default());
    let p = plan("p", 10, 2.0, local(1));
    // The bucket holds 2 of its 10.
    let taken = store
        .acquire(AcquireRequest::take("k", *p.bucket(), whole(8)))
        .await
        .unwrap();
    assert_eq!(taken.granted, whole(8));
    let debt = ledger(&store, settings());
    debt.record_now(&p, &counters(&p), "k", whole(7));
    recovered(&debt).await;
    // The first round takes the 2 there: 5 left, carried.
    // sleep: paused clock, half a pace: the first round is done, the next not yet due.
    tokio::time::sleep(Duration::from_millis(25)).await;
    let owed = debt.stats().outstanding.as_f64();
    assert!((4.9..=5.0).contains(&owed), "owed {owed}");
    // At 2 tokens a second, 5 more take 2.5 s; each round takes what refilled since the last.
    // sleep: paused clock, 1 s of the bucket's refill, charged round by round.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let owed = debt.stats().outstanding.as_f64();
    assert!((2.8..=3.1).contains(&owed), "owed {owed} after 1 s");
    let left = tokens(&store, "k").await.unwrap();
    assert!(
        left < 0.11,
        "the bucket is spent while debt remains: {left}"
    );
    eventually(
        LOOK,
        Duration::from_secs(3),
        "the ledger empty",
        async || debt.stats().keys == 0,
    )
    .await;
    assert_eq!(debt.stats().charged, whole(7));
    assert_eq!(debt.stats().outstanding, Tokens::ZERO);
}

/// Each plan's debt is charged to that plan's bucket (its capacity and rate), and one key under
/// two plans never appears twice in one call.
#[tokio::test(start_paused = true)]
async fn a_plans_debt_goes_to_that_plans_bucket() {
    let store = Arc::new(Switch::default());
    let big = plan("big", 100, 1.0, FallbackMode::Allow);
    let small = plan("small", 20, 1.0, local(2));
    let debt = ledger(&store, settings());
    debt.record_now(&big, &counters(&big), "a", whole(30));
    debt.record_now(&small, &counters(&small), "b", whole(50));
    debt.record_now(&big, &counters(&big), "shared", whole(1));
    debt.record_now(&small, &counters(&small), "shared", whole(1));
    recovered(&debt).await;
    // sleep: paused clock, half a pace: the first round is done, the next not yet due.
    tokio::time::sleep(Duration::from_millis(25)).await;
    // "a" paid in full from a bucket of 100; "b" took the 20 its plan's bucket holds.
    let a = tokens(&store, "a").await.unwrap();
    assert!((70.0..70.1).contains(&a), "a: {a}");
    let b = tokens(&store, "b").await.unwrap();
    assert!(b < 0.1, "b: {b}");
    let stats = debt.stats();
    let owed = stats.outstanding.as_f64();
    // 30 of b's left (less a trickle of refill), and one "shared" waits for the next round.
    assert!((30.0..=31.0).contains(&owed), "owed {owed}");
    eventually(
        LOOK,
        Duration::from_secs(1),
        "one key left in the ledger",
        async || debt.stats().keys == 1,
    )
    .await;
    let row = store.inspect("b").await.unwrap().unwrap();
    assert_eq!(
        row.capacity,
        whole(20),
        "charged with the small plan's shape"
    );
    assert!(store.calls.lock().iter().all(|c| c.len() <= 3));
}

/// New debt waits for word that the store answers before any call; a failed round stops
/// charging until the next word (or probe), and word of recovery resumes it at once.
#[tokio::test(start_paused = true)]
async fn charging_waits_for_the_store_to_answer() {
    let store = Arc::new(Switch::default());
    store.failing.store(true, Ordering::SeqCst);
    let debt = ledger(&store, settings());
    let p = plan("p", 100, 1.0, FallbackMode::Allow);
    debt.record_now(&p, &counters(&p), "k", whole(4));
    // More debt while the store is down does not send calls.
    for _ in 0..10 {
        debt.record_now(&p, &counters(&p), "k", whole(1));
    }
    // sleep: paused clock, 200 ms, short of the first probe wait (250 ms): no call may go.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        store.calls(),
        0,
        "no call before word of recovery or the first probe"
    );
    store.failing.store(false, Ordering::SeqCst);
    debt.store_answered();
    // sleep: paused clock, 1 ms: word of recovery charges at once, not a probe wait later.
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(store.calls(), 1, "charged on word of recovery");
    assert_eq!(debt.stats().charged, whole(14));
    assert_eq!(debt.stats().keys, 0);
    // The store fails again while the task still runs: its round fails, the debt stays, and
    // it waits again.
    store.failing.store(true, Ordering::SeqCst);
    debt.record_now(&p, &counters(&p), "k", whole(1));
    // sleep: paused clock, past the pace (50 ms) after which the task's next round goes.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(store.calls(), 2, "one failed round");
    assert_eq!(debt.stats().outstanding, whole(1));
    // sleep: paused clock, 100 ms more, within the first probe wait (250 ms): no call may go.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(store.calls(), 2, "then no call within the first probe wait");
    store.failing.store(false, Ordering::SeqCst);
    recovered(&debt).await;
    // sleep: paused clock, 1 ms: word of recovery charges at once, not a probe wait later.
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(debt.stats().keys, 0);
    assert_eq!(debt.stats().charged, whole(15));
}

/// A charging call that outlasts its deadline counts as failed, and the debt stays.
#[tokio::test(start_paused = true)]
async fn a_call_past_its_deadline_fails_the_round() {
    #[derive(Debug, Default)]
    struct Hung(AtomicUsize);
    #[async_trait]
    impl Store for Hung {
        async fn acquire(&self, _: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            std::future::pending().await
        }
        async fn give_back(&self, _: &[GiveBack<'_>]) -> Result<u64, StoreError> {
            std::future::pending().await
        }
        async fn delete_idle(&self, _: u32) -> Result<u64, StoreError> {
            std::future::pending().await
        }
        async fn inspect(&self, _: &str) -> Result<Option<BucketRow>, StoreError> {
            std::future::pending().await
        }
    }
    let hung = Arc::new(Hung::default());
    let debt = Debt::new(Arc::clone(&hung) as Arc<dyn Store>, settings());
    let p = plan("p", 100, 1.0, FallbackMode::Allow);
    debt.record_now(&p, &counters(&p), "k", whole(3));
    recovered(&debt).await;
    // sleep: paused clock, past the charging call's 50 ms deadline.
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(
        hung.0.load(Ordering::SeqCst),
        1,
        "one call, given up at its deadline"
    );
    let shared = debt.shared.as_ref().unwrap();
    assert!(
        shared.parked.load(Ordering::SeqCst),
        "waiting again after the deadline"
    );
    assert_eq!(debt.stats().outstanding, whole(3));
    // Not another call until word of recovery or the probe wait.
    // sleep: paused clock, 100 ms, within the first probe wait (250 ms): no call may go.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(hung.0.load(Ordering::SeqCst), 1);
}

/// A flood of keys paid off gives the ledger's memory back: the map and the queue shrink to a
/// small size once they are mostly empty, instead of keeping the flood's capacity.
#[tokio::test(start_paused = true)]
async fn a_paid_off_flood_gives_the_ledgers_memory_back() {
    let store = Arc::new(Switch::default());
    let debt = ledger(&store, settings());
    let p = plan("p", 10, 1.0, FallbackMode::Allow);
    for i in 0..MAX_KEYS {
        debt.record_now(&p, &counters(&p), &format!("k{i}"), whole(1));
    }
    let shared = debt.shared.as_ref().unwrap();
    let capacity = || {
        let ledger = shared.ledger.lock();
        (ledger.entries.capacity(), ledger.queue.capacity())
    };
    let (map, queue) = capacity();
    assert!(map >= MAX_KEYS && queue >= MAX_KEYS, "{map} {queue}");
    recovered(&debt).await;
    eventually(
        LOOK,
        Duration::from_secs(30),
        "the ledger empty",
        async || debt.stats().keys == 0,
    )
    .await;
    let (map, queue) = capacity();
    assert!(map <= KEEP_SLOTS && queue <= KEEP_SLOTS, "{map} {queue}");
}
