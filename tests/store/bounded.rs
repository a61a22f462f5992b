//! Bounded memory of the in-process store: floods of a million distinct keys and of a million
//! return ids stay within the bounds and shrink back once the buckets have refilled. Time is
//! tokio's paused clock, moved by hand; nothing sleeps.

use std::time::Duration;

use tokenlease::bucket::{BucketConfig, Rate, Tokens};
use tokenlease::store::{AcquireRequest, GiveBack, MemoryStore, RETURN_ID_TTL, Store, StoreError};

const FLOOD: usize = 1_000_000;
const BOUND: usize = 100_000;
const MS: Duration = Duration::from_millis(1);

fn bucket(capacity: u64, per_second: f64) -> BucketConfig {
    BucketConfig::new(
        Tokens::whole(capacity),
        Rate::from_f64(per_second).expect("rate"),
    )
    .expect("bucket")
}

/// Resident set size of this process in MiB (Linux), for the printed figures only.
fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map_or(f64::NAN, |pages| pages * 4096.0 / (1024.0 * 1024.0))
}

/// Buckets that refill within 10 ms, a thousand new keys per millisecond: the store reaches its
/// bound, deletes the full buckets and keeps admitting; never more than the bound stored.
#[tokio::test(start_paused = true)]
async fn a_flood_of_keys_whose_buckets_refill_stays_within_the_bound() {
    let store = MemoryStore::new().with_max_keys(BOUND);
    let shape = bucket(10, 100.0);
    let one = Tokens::whole(1);
    let mut most = 0;
    for i in 0..FLOOD {
        if i % 1_000 == 0 {
            tokio::time::advance(MS).await;
            most = most.max(store.len());
        }
        let key = format!("flood:{i}");
        let got = store
            .acquire(AcquireRequest::take(&key, shape, one))
            .await
            .expect("a full bucket is always deletable here");
        assert_eq!(got.granted, one);
    }
    most = most.max(store.len());
    eprintln!("refilling flood: at most {most} keys stored (bound {BOUND})");
    assert!(most <= BOUND, "{most} keys stored");
}

/// Buckets that stay below full for the whole flood (the clock does not move): the first
/// `BOUND` keys are decided, every later new key is refused with `TooManyKeys` (no bucket that
/// is not full is evicted), stored keys keep being decided, and once the buckets have refilled
/// the next new key empties the store of them.
#[tokio::test(start_paused = true)]
async fn at_the_bound_new_keys_are_refused_and_the_store_shrinks_after_the_flood() {
    let store = MemoryStore::new().with_max_keys(BOUND);
    let shape = bucket(10, 1.0);
    let one = Tokens::whole(1);
    let before = rss_mib();
    let (mut granted, mut refused) = (0, 0);
    for i in 0..FLOOD {
        let key = format!("flood:{i}");
        match store.acquire(AcquireRequest::take(&key, shape, one)).await {
            Ok(a) => {
                assert_eq!(a.granted, one);
                granted += 1;
            }
            Err(StoreError::TooManyKeys { max_keys }) => {
                assert_eq!(max_keys, BOUND);
                refused += 1;
            }
            Err(e) => panic!("unexpected error {e}"),
        }
        if i % 10_000 == 0 {
            assert!(store.len() <= BOUND);
        }
    }
    let peak = rss_mib();
    assert_eq!((granted, refused), (BOUND, FLOOD - BOUND));
    assert_eq!(store.len(), BOUND);
    assert!(StoreError::TooManyKeys { max_keys: 1 }.is_transient());
    // A stored key is still decided: 9 tokens left, take another.
    let again = store
        .acquire(AcquireRequest::take("flood:0", shape, one))
        .await
        .expect("a stored key");
    assert_eq!(again.remaining, Tokens::whole(8));

    // Two seconds later every bucket is full again: the next new key sweeps them all.
    tokio::time::advance(2_000 * MS).await;
    store
        .acquire(AcquireRequest::take("after", shape, one))
        .await
        .expect("room again");
    let after = rss_mib();
    eprintln!(
        "frozen flood: {granted} decided, {refused} refused; RSS {before:.0} MiB before, \
         {peak:.0} at the bound, {after:.0} after; {} keys stored after",
        store.len()
    );
    assert_eq!(store.len(), 1);
}

/// A million give-backs with distinct ids: at most the bound of ids is remembered, a retry of a
/// recent one still credits nothing, and after `RETURN_ID_TTL` they are forgotten.
#[tokio::test(start_paused = true)]
async fn return_ids_are_bounded_in_count_and_time() {
    let store = MemoryStore::new().with_max_return_ids(BOUND);
    let shape = bucket(10, 1.0);
    let one = Tokens::whole(1);
    store
        .acquire(AcquireRequest::take("k", shape, Tokens::whole(5)))
        .await
        .expect("take");
    let give = |id: i64| GiveBack {
        id,
        key: "k",
        bucket: shape,
        amount: one,
        lease: None,
    };
    let mut most = 0;
    for id in 0..FLOOD as i64 {
        assert_eq!(store.give_back(&[give(id)]).await.expect("give back"), 1);
        if id % 10_000 == 0 {
            most = most.max(store.return_ids());
        }
    }
    most = most.max(store.return_ids());
    eprintln!("return-id flood: at most {most} ids remembered (bound {BOUND})");
    assert!(most <= BOUND, "{most} ids remembered");
    // The newest ids are remembered: a retry credits nothing.
    assert_eq!(
        store
            .give_back(&[give(FLOOD as i64 - 1)])
            .await
            .expect("retry"),
        0
    );

    tokio::time::advance(RETURN_ID_TTL + MS).await;
    assert_eq!(store.give_back(&[give(-1)]).await.expect("one more"), 1);
    assert_eq!(store.return_ids(), 1);
}
