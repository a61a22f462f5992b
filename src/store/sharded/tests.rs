use std::sync::atomic::{AtomicBool, Ordering};

use super::*;
use crate::bucket::{BucketConfig, Rate, Tokens};
use crate::store::{MemoryStore, TimeoutKind};

fn bucket() -> BucketConfig {
    BucketConfig::new(Tokens::whole(10), Rate::per_second(1).expect("rate")).expect("bucket")
}

/// The hash is part of the placement contract: these values must never change (a change would
/// move keys between shards on upgrade). FNV-1a's published test vectors pin the first step;
/// the scores were computed by an independent implementation (Python) of the same definition.
#[test]
fn the_hash_is_pinned() {
    assert_eq!(fnv1a(FNV_OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(fnv1a(FNV_OFFSET, b"foobar"), 0x8594_4171_f739_67e8);
    assert_eq!(rendezvous_score("pg-a", "k"), PINNED[0]);
    assert_eq!(rendezvous_score("pg-b", "k"), PINNED[1]);
    assert_eq!(rendezvous_score("", ""), PINNED[2]);
    assert_eq!(
        rendezvous_score("shard-1", "ratelimit:api:GET:/bookings/{bookingId}"),
        PINNED[3]
    );
    // The name's length is hashed first: moving a byte between name and key changes the score.
    assert_ne!(rendezvous_score("ab", "c"), rendezvous_score("a", "bc"));
}

const PINNED: [u64; 4] = [
    0xb80d_a5bd_c74b_9498,
    0x82d3_5826_c520_03f2,
    0x7bd3_144f_29c0_cc9e,
    0xb6b8_0b99_c73e_689d,
];

fn names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("shard-{i}")).collect()
}

fn key(i: usize) -> String {
    format!("ratelimit:api:user:{i}")
}

/// H1: over 100,000 keys, each shard holds about 1/N of them, and adding a shard moves keys
/// only to the new shard, about 1/(N+1) of them.
#[test]
fn adding_a_shard_moves_about_one_in_n_plus_one_keys_and_only_to_it() {
    const KEYS: usize = 100_000;
    for n in 1..=6 {
        let old = names(n);
        let new = names(n + 1);
        let mut per_shard = vec![0usize; n];
        let mut moved = 0usize;
        for i in 0..KEYS {
            let k = key(i);
            let before = shard_of(&old, &k).expect("shards");
            let after = shard_of(&new, &k).expect("shards");
            per_shard[before] += 1;
            if after != before {
                assert_eq!(
                    after, n,
                    "key {k} moved from shard {before} to an old shard {after}"
                );
                moved += 1;
            }
        }
        let share = moved as f64 / KEYS as f64;
        let expected = 1.0 / (n + 1) as f64;
        assert!(
            (share - expected).abs() < 0.01,
            "{n} → {} shards moved {share:.4} of the keys, expected {expected:.4}",
            n + 1
        );
        for (i, &count) in per_shard.iter().enumerate() {
            let share = count as f64 / KEYS as f64;
            assert!(
                (share - 1.0 / n as f64).abs() < 0.01,
                "shard {i} of {n} holds {share:.4} of the keys"
            );
        }
    }
}

/// Placement depends on the names, not on their order in the list.
#[test]
fn placement_does_not_depend_on_the_order_of_the_shards() {
    let forward = names(5);
    let mut backward = forward.clone();
    backward.reverse();
    for i in 0..10_000 {
        let k = key(i);
        let a = &forward[shard_of(&forward, &k).expect("shards")];
        let b = &backward[shard_of(&backward, &k).expect("shards")];
        assert_eq!(a, b, "{k}");
    }
}

#[test]
fn the_builder_refuses_no_shards_empty_and_duplicate_names() {
    assert!(matches!(
        ShardedStore::builder().build(),
        Err(ShardError::NoShards)
    ));
    assert!(matches!(
        ShardedStore::builder()
            .shard("a", MemoryStore::new())
            .shard(" ", MemoryStore::new())
            .build(),
        Err(ShardError::EmptyName { index: 1 })
    ));
    match ShardedStore::builder()
        .shard("a", MemoryStore::new())
        .shard("a", MemoryStore::new())
        .build()
    {
        Err(ShardError::DuplicateName { name }) => assert_eq!(name, "a"),
        other => panic!("{other:?}"),
    }
}

/// A memory store that fails every call while told to.
#[derive(Debug, Default, Clone)]
struct Failing {
    inner: MemoryStore,
    failing: Arc<AtomicBool>,
}

impl Failing {
    fn check(&self) -> Result<(), StoreError> {
        if self.failing.load(Ordering::SeqCst) {
            Err(StoreError::Timeout {
                kind: TimeoutKind::Call,
                after: Duration::from_millis(50),
            })
        } else {
            Ok(())
        }
    }
}

#[async_trait]
impl Store for Failing {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        self.check()?;
        self.inner.acquire(request).await
    }
    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        self.check()?;
        self.inner.acquire_many(requests).await
    }
    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        self.check()?;
        self.inner.give_back(returns).await
    }
    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        self.check()?;
        self.inner.delete_idle(limit).await
    }
    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        self.check()?;
        self.inner.inspect(key).await
    }
    fn call_timeout(&self) -> Option<Duration> {
        Some(Duration::from_millis(
            if self.failing.load(Ordering::SeqCst) {
                80
            } else {
                50
            },
        ))
    }
    fn max_concurrent_calls(&self) -> Option<usize> {
        Some(4)
    }
}

fn three() -> (ShardedStore, [Failing; 3]) {
    let shards = [Failing::default(), Failing::default(), Failing::default()];
    let store = ShardedStore::builder()
        .shard("a", shards[0].clone())
        .shard("b", shards[1].clone())
        .shard("c", shards[2].clone())
        .build()
        .expect("store");
    (store, shards)
}

/// `count` keys on shard `shard` of `store`.
fn keys_on(store: &ShardedStore, shard: usize, count: usize) -> Vec<String> {
    (0..)
        .map(key)
        .filter(|k| store.shard_index(k) == shard)
        .take(count)
        .collect()
}

/// H2 (unit): a multi-key call spanning a failing and two healthy shards gives the healthy
/// keys their real answers, in the caller's order, and an error only to the failing shard's.
#[tokio::test]
async fn a_failing_shard_fails_only_its_own_keys() {
    let (store, shards) = three();
    let mut keys = Vec::new();
    for shard in 0..3 {
        keys.extend(keys_on(&store, shard, 3));
    }
    // Interleave the shards in the request.
    keys.sort();
    // Shard 1's keys hold buckets, so that their returns below have a bucket to credit (a
    // return to a key without one, a full bucket, credits nothing).
    for k in keys.iter().filter(|k| store.shard_index(k) == 1) {
        let take = AcquireRequest::take(k, bucket(), Tokens::whole(1));
        store.acquire(take).await.expect("take");
    }
    shards[1].failing.store(true, Ordering::SeqCst);
    let requests: Vec<AcquireRequest<'_>> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| AcquireRequest::take(k, bucket(), Tokens::whole(1 + i as u64 % 3)))
        .collect();
    let answers = store.acquire_each(&requests).await;
    assert_eq!(answers.len(), keys.len());
    for ((k, request), answer) in keys.iter().zip(&requests).zip(&answers) {
        if store.shard_index(k) == 1 {
            assert!(answer.is_err(), "{k}: {answer:?}");
        } else {
            let answer = answer.as_ref().expect("healthy shard");
            assert_eq!(answer.granted, request.want, "{k}");
            assert_eq!(
                answer.remaining,
                Tokens::whole(10).saturating_sub(request.want),
                "{k}"
            );
            // The take happened on the key's shard, and only there.
            let owner = &shards[store.shard_index(k)].inner;
            assert!(owner.inspect(k).await.expect("inspect").is_some());
            for (i, other) in shards.iter().enumerate() {
                if i != store.shard_index(k) {
                    assert!(other.inner.inspect(k).await.expect("inspect").is_none());
                }
            }
        }
    }
    // acquire_many fails as a whole, with the failing shard's error.
    assert!(store.acquire_many(&requests).await.is_err());
    // Returns: the failing shard's fail, the others credit once (ids are idempotent).
    let returns: Vec<GiveBack<'_>> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| GiveBack {
            id: i as i64 + 1,
            key: k,
            bucket: bucket(),
            amount: Tokens::whole(1),
            lease: None,
        })
        .collect();
    let outcomes = store.give_back_each(&returns).await;
    for (k, outcome) in keys.iter().zip(&outcomes) {
        assert_eq!(outcome.is_err(), store.shard_index(k) == 1, "{k}");
    }
    assert!(store.give_back(&returns).await.is_err());
    shards[1].failing.store(false, Ordering::SeqCst);
    // Only shard 1's three returns credit now: the others were credited above.
    assert_eq!(store.give_back(&returns).await.expect("all healthy"), 3);
    assert!(
        store
            .acquire_each(&requests)
            .await
            .iter()
            .all(Result::is_ok)
    );
}

#[tokio::test]
async fn single_key_calls_go_to_the_keys_shard() {
    let (store, shards) = three();
    for (shard, owner) in shards.iter().enumerate() {
        for k in keys_on(&store, shard, 5) {
            let a = store
                .acquire(AcquireRequest::take(&k, bucket(), Tokens::whole(4)))
                .await
                .expect("acquire");
            assert_eq!(a.granted, Tokens::whole(4));
            let row = store.inspect(&k).await.expect("inspect").expect("row");
            assert_eq!(row.tokens, Tokens::whole(6));
            assert!(owner.inner.inspect(&k).await.expect("i").is_some());
        }
    }
    assert_eq!(store.len(), 3);
    assert!(!store.is_empty());
    assert_eq!(store.names().collect::<Vec<_>>(), ["a", "b", "c"]);
    assert!(store.shard("b").is_some());
    assert!(store.shard("d").is_none());
}

#[test]
fn timeouts_and_concurrency_come_from_the_shards() {
    let (store, shards) = three();
    assert_eq!(store.call_timeout(), Some(Duration::from_millis(50)));
    shards[2].failing.store(true, Ordering::SeqCst);
    assert_eq!(store.call_timeout(), Some(Duration::from_millis(80)));
    assert_eq!(store.max_concurrent_calls(), Some(12));
    let unbounded = ShardedStore::builder()
        .shard("a", shards[0].clone())
        .shard("m", MemoryStore::new())
        .build()
        .expect("store");
    assert_eq!(unbounded.max_concurrent_calls(), None);
}

#[tokio::test]
async fn delete_idle_runs_on_every_shard() {
    let (store, shards) = three();
    let full = BucketConfig::new(Tokens::whole(1), Rate::per_second(1_000_000).expect("rate"))
        .expect("bucket");
    for shard in 0..3 {
        for k in keys_on(&store, shard, 2) {
            store
                .acquire(AcquireRequest::take(&k, full, Tokens::whole(1)))
                .await
                .expect("acquire");
        }
    }
    // sleep: the stores' clock refills the buckets (a token in 1 µs) so their rows are idle.
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(store.delete_idle(100).await.expect("delete"), 6);
    shards[0].failing.store(true, Ordering::SeqCst);
    assert!(store.delete_idle(100).await.is_err());
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn no_error_shows_a_password() {
    let err = ShardedStore::connect(&[
        ("a", "postgres://app:s3cret-Pa55@db.internal:notaport/app"),
        ("b", "postgres://app:s3cret-Pa55@db.internal/app"),
    ])
    .await
    .expect_err("a bad port");
    let shown = format!("{err} {err:?}");
    assert!(shown.contains("\"a\""), "{shown}");
    assert!(!shown.contains("s3cret"), "{shown}");
    assert!(matches!(
        ShardedStore::connect(&[("a", "postgres://x/y"), ("a", "postgres://x/z")]).await,
        Err(ShardError::DuplicateName { .. })
    ));
    assert!(matches!(
        ShardedStore::connect::<&str, &str>(&[]).await,
        Err(ShardError::NoShards)
    ));
}
