//! Statements as full over a store of two parts as over one (H8–H10, docs/testing.md): the same
//! load through one limiter, first over one PostgreSQL cluster, then over a `ShardedStore` of
//! two clusters, counting the statements that reach the store (`CountedStore`) per decision.
//! Rounds alternate the two set-ups and the check is on the ratio of their sums, so a busy
//! machine slows both alike. Every run also checks each key's admissions against its bucket's
//! envelope. Runs in the nextest `serial` group: it loads the machine.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokenlease::policy::{FallbackMode, FallbackSettings, LeaseSettings, Plan};
use tokenlease::store::{CountedStore, PostgresStore, PostgresStoreBuilder, ShardedStore, Store};
use tokenlease::{DecidedBy, Limiter};
use tokenlease_testkit::TempPostgres;

/// Tasks of the limiter's caller.
const TASKS: usize = 16;
/// Keys in direct mode, picked at random by every call.
const KEYS: usize = 2_000;
/// Keys in leased mode: so many that most calls are a key's first in the run, and wait for
/// its refill (the start of a flood of new keys).
const LEASED_KEYS: usize = 100_000;
/// One set-up's run in a round.
const RUN: Duration = Duration::from_secs(3);
/// Rounds of (one cluster, two shards).
const ROUNDS: usize = 2;
/// The most statements per decision over two shards may be, as a multiple of one cluster's.
const MOST: f64 = 1.5;

/// Generous timeouts: a slow statement on a busy machine is not what is measured here, and no
/// decision should be the fallback's.
fn generous(builder: PostgresStoreBuilder) -> PostgresStoreBuilder {
    builder
        .pool_size(4)
        .call_timeout(Duration::from_secs(5))
        .pool_wait_timeout(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(5))
        .statement_timeout(Duration::from_secs(5))
        .lock_timeout(Duration::from_secs(5))
}

async fn one_cluster(pg: &TempPostgres) -> PostgresStore {
    generous(PostgresStore::builder(&pg.url()).expect("url"))
        .build()
        .await
        .expect("store")
}

async fn two_shards(a: &TempPostgres, b: &TempPostgres) -> ShardedStore {
    ShardedStore::connect_with(&[("pg-a", a.url()), ("pg-b", b.url())], generous)
        .await
        .expect("sharded store")
}

/// What one run did.
#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    decisions: u64,
    statements: u64,
    fallback: u64,
    /// Keys that admitted more than their bucket's envelope over the run.
    over: u64,
}

impl std::ops::AddAssign for Counts {
    fn add_assign(&mut self, other: Counts) {
        self.decisions += other.decisions;
        self.statements += other.statements;
        self.fallback += other.fallback;
        self.over += other.over;
    }
}

impl Counts {
    fn per_decision(&self) -> f64 {
        self.statements as f64 / self.decisions.max(1) as f64
    }
}

/// [`TASKS`] tasks, each with `in_flight` calls at a time, for [`RUN`] on keys `prefix:i`
/// picked at random: the decisions, the statements that reached the store meanwhile, and the
/// keys that admitted more than `capacity + rate × (run + 1 s)` (the second covers the store's
/// clock against this one's).
async fn run(
    store: impl Store,
    plan: &Plan,
    prefix: &str,
    keys: usize,
    in_flight: usize,
) -> Counts {
    let calls = Arc::new(AtomicU64::new(0));
    let limiter = Limiter::builder(CountedStore::with_counter(store, Arc::clone(&calls))).build();
    let keys: Arc<Vec<String>> = Arc::new((0..keys).map(|i| format!("{prefix}:{i}")).collect());
    let plan = Arc::new(plan.clone());
    let origin = Instant::now();
    let mut handles = Vec::new();
    for caller in 0..TASKS * in_flight {
        let (limiter, plan, keys) = (limiter.clone(), Arc::clone(&plan), Arc::clone(&keys));
        handles.push(tokio::spawn(async move {
            let mut counts = Counts::default();
            let mut admitted: HashMap<usize, u64> = HashMap::new();
            // xorshift64, seeded per caller: uniform keys without a generator crate.
            let mut x = 0x9e37_79b9_7f4a_7c15_u64 ^ (caller as u64 + 1).wrapping_mul(0x2545_f491);
            while origin.elapsed() < RUN {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let i = (x % keys.len() as u64) as usize;
                let d = limiter
                    .try_acquire_with(&plan, &keys[i], 1.0)
                    .await
                    .expect("decision");
                counts.decisions += 1;
                if d.allowed {
                    *admitted.entry(i).or_default() += 1;
                }
                if matches!(d.decided_by, DecidedBy::Fallback(_)) {
                    if counts.fallback == 0 {
                        eprintln!("fallback: {d:?}");
                    }
                    counts.fallback += 1;
                }
            }
            (counts, admitted)
        }));
    }
    let mut counts = Counts::default();
    let mut admitted: HashMap<usize, u64> = HashMap::new();
    for h in handles {
        let (c, a) = h.await.expect("task");
        counts += c;
        for (i, n) in a {
            *admitted.entry(i).or_default() += n;
        }
    }
    let bucket = plan.bucket();
    let envelope = bucket.capacity().as_f64() + bucket.rate().as_f64() * (RUN.as_secs_f64() + 1.0);
    counts.over = admitted.values().filter(|&&n| n as f64 > envelope).count() as u64;
    // Before the shutdown's give-backs.
    counts.statements = calls.load(Ordering::Relaxed);
    limiter.shutdown().await;
    counts
}

/// Alternates one cluster and two shards for [`ROUNDS`] rounds; checks the statements per
/// decision over two shards are at most [`MOST`] times one cluster's, and no decision over two
/// shards was the fallback's.
async fn compare(label: &str, plan: Plan, keys: usize, in_flight: usize) {
    let _serial = common::serial().await;
    let clusters = common::clusters(2).await;
    let (mut one, mut two) = (Counts::default(), Counts::default());
    for round in 0..ROUNDS {
        let store = one_cluster(&clusters[0]).await;
        let counts = run(
            store,
            &plan,
            &format!("{label}:one:{round}"),
            keys,
            in_flight,
        )
        .await;
        eprintln!("{label} one cluster, round {round}: {counts:?}");
        one += counts;
        let store = two_shards(&clusters[0], &clusters[1]).await;
        let counts = run(
            store,
            &plan,
            &format!("{label}:two:{round}"),
            keys,
            in_flight,
        )
        .await;
        eprintln!("{label} two shards, round {round}: {counts:?}");
        two += counts;
    }
    let ratio = two.per_decision() / one.per_decision();
    eprintln!(
        "{label}: {:.1} decisions per statement on one cluster, {:.1} on two shards: {ratio:.2}×",
        1.0 / one.per_decision(),
        1.0 / two.per_decision()
    );
    // Over two shards, none. (One cluster alone, under this load, has sent a caller or a
    // few of some runs to the fallback, before this change as after: not what is compared.)
    assert_eq!(two.fallback, 0, "decisions by the fallback over two shards");
    assert_eq!(one.over + two.over, 0, "keys over their bucket's envelope");
    assert!(
        one.decisions >= 1000 && two.decisions >= 1000,
        "too few decisions to compare: {one:?} {two:?}"
    );
    assert!(
        ratio <= MOST,
        "{label}: statements per decision on two shards {ratio:.2}× one cluster's (at most \
         {MOST}×): {two:?} against {one:?}"
    );
}

/// H8: direct mode. 16 tasks with 4 calls in flight each over 2,000 keys: the coalescer fills
/// each shard's statements as one cluster's (per part: its own slots, load, limit and gather
/// window), so statements per decision over two shards stay within 1.5× one cluster's, with
/// no decision by the fallback. (With one call per task, 16 callers in all, the shards take
/// turns: H10.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h8_direct_statements_over_two_shards_are_as_full_as_one_clusters() {
    compare("h8", common::plan(100, 50.0), KEYS, 4).await;
}

/// H9: leased mode, the same comparison with 16 tasks of one call each over 100,000 keys: most
/// calls are their key's first, and wait for its refill. The lanes take turns, so each shard's refill
/// statements carry about what one cluster's lane's do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h9_leased_statements_over_two_shards_are_as_full_as_one_clusters() {
    let plan = common::plan(100, 50.0)
        .with_lease(
            LeaseSettings::default()
                .with_ttl(Duration::from_secs(1))
                .with_max_fraction(0.1)
                .with_low_water(0.5)
                .with_refresh(Duration::from_millis(100))
                .with_max_wait(Duration::from_millis(500)),
        )
        .with_fallback(FallbackSettings::new(FallbackMode::Deny));
    compare("h9", plan, LEASED_KEYS, 1).await;
}

/// H10: direct mode's closed loop, 16 tasks of one call each over 2,000 keys. One cluster's
/// statement carries nearly every caller; two shards each with its own statement in flight
/// would split them (three times one cluster's statements per decision). The shards take
/// turns, a shard's statement held back while the other's runs, so each carries about two
/// thirds of the callers: within 1.5× one cluster's statements per decision, no decision by
/// the fallback, every key within its envelope. A bucket of 4 refilling 2 a second denies
/// about half the calls (each key is called about 4 times a second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h10_direct_single_calls_over_two_shards_take_turns() {
    compare("h10", common::plan(4, 2.0), KEYS, 1).await;
}
