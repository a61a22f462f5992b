//! Unit tests of `memory.rs`.
use super::*;

/// A stored bucket's map entry (key and bucket) is 56 bytes.
#[test]
fn a_bucket_entry_is_56_bytes() {
    assert_eq!(size_of::<Stored>(), 32);
    assert_eq!(size_of::<(SlotKey, Stored)>(), 56);
}

/// Side entries across the shards, and whether any side map still holds memory.
fn strict_entries(store: &MemoryStore) -> (usize, bool) {
    let shards = store.shards.iter().map(|s| s.lock());
    shards.fold((0, false), |(n, held), s| {
        (n + s.strict.0.len(), held || s.strict.0.capacity() > 0)
    })
}

/// Strict leases sit in the shard's side map only while their bucket is stored and has
/// some: a bucket with a live lease out is not deleted as full, settling the lease drops
/// its entry, a deleted bucket takes its expired leases with it, and the side maps give
/// their memory back once empty.
#[tokio::test(start_paused = true)]
async fn strict_leases_stay_beside_their_buckets() {
    use crate::bucket::{Rate, Tokens};
    use crate::store::{Hold, LeaseRef};

    let store = MemoryStore::new();
    let config =
        BucketConfig::new(Tokens::whole(10), Rate::per_second(1).expect("rate")).expect("b");
    let keys: Vec<String> = (0..200).map(|i| format!("strict:{i}")).collect();
    let hold = |holder: i64, lifetime: u64| Hold {
        holder,
        lease_id: 1,
        kept: Tokens::ZERO,
        lifetime: Duration::from_secs(lifetime),
    };
    for (i, key) in keys.iter().enumerate() {
        let request = AcquireRequest::lease(key, config, Tokens::whole(1), Tokens::whole(10));
        // The first half for a minute, the second for a second.
        let lifetime = if i < 100 { 60 } else { 1 };
        let got = store
            .acquire(request.held(hold(i as i64, lifetime)))
            .await
            .expect("acquire");
        assert_eq!(got.granted, Tokens::whole(10));
    }
    // A plain take leaves no side entry.
    let plain = AcquireRequest::take("plain", config, Tokens::whole(1));
    store.acquire(plain).await.expect("acquire");
    assert_eq!(strict_entries(&store), (200, true));
    // Nothing is full while its lease is out.
    assert_eq!(store.delete_idle(u32::MAX).await.expect("delete"), 0);
    assert_eq!(store.len(), 201);
    // Settling the first half's leases drops their entries.
    let returns: Vec<GiveBack<'_>> = keys[..100]
        .iter()
        .enumerate()
        .map(|(i, key)| GiveBack {
            id: i as i64,
            key,
            bucket: config,
            amount: Tokens::whole(10),
            lease: Some(LeaseRef {
                holder: i as i64,
                lease_id: 1,
            }),
        })
        .collect();
    assert_eq!(store.give_back(&returns).await.expect("give back"), 100);
    assert_eq!(strict_entries(&store).0, 100);
    let row = store
        .inspect(&keys[0])
        .await
        .expect("inspect")
        .expect("row");
    assert!(row.leases.is_empty() && row.tokens == Tokens::whole(10));
    let row = store
        .inspect(&keys[100])
        .await
        .expect("inspect")
        .expect("row");
    assert_eq!(row.leases.len(), 1);
    // Later the second half's leases have expired and their buckets refilled: every bucket
    // is full and goes, with its leases, and the side maps let their memory go.
    tokio::time::advance(Duration::from_secs(30)).await;
    assert_eq!(store.delete_idle(u32::MAX).await.expect("delete"), 201);
    assert_eq!(store.len(), 0);
    assert_eq!(strict_entries(&store), (0, false));
    assert!(store.inspect(&keys[100]).await.expect("inspect").is_none());
}

/// Buckets written with the same shape share it; a new shape gets its own.
#[test]
fn buckets_share_their_shape() {
    let a = BucketConfig::new(
        crate::bucket::Tokens::whole(10),
        crate::bucket::Rate::per_second(1).expect("rate"),
    )
    .expect("bucket");
    let b = BucketConfig::new(
        crate::bucket::Tokens::whole(20),
        crate::bucket::Rate::per_second(1).expect("rate"),
    )
    .expect("bucket");
    let mut shard = ShardMap::default();
    let first = shard.shape(a, None);
    assert!(Arc::ptr_eq(&first, &shard.shape(a, None)));
    assert!(Arc::ptr_eq(&first, &shard.shape(a, Some(&first))));
    let other = shard.shape(b, Some(&first));
    assert_eq!(*other, b);
    assert!(!Arc::ptr_eq(&first, &other));
}
