//! Returns on a Citus cluster against the same returns on plain PostgreSQL (Z13 in
//! docs/testing.md): the node functions' statement on each shard credits every key as the plain
//! store's statement does.

use crate::citus::shard_count;
use crate::common;

use tokenlease::bucket::{BucketConfig, Rate, Tokens};
use tokenlease::store::{AcquireRequest, GiveBack, Hold, LeaseRef, PostgresStore, Store as _};

/// How many keys: a few hundred, over every shard of both workers.
const KEYS: usize = 320;

/// Keys from this one on get no take: their returns find no row.
const WITHOUT_ROW: usize = 280;

/// The refill: a token every 10⁶ s, so that the seconds between the two stores' calls move no
/// key by more than [`CLOSE`].
fn slow() -> Rate {
    Rate::from_f64(1e-6).expect("rate")
}

/// How far apart the two stores' tokens of a key may be: the refill of a minute.
const CLOSE: f64 = 1e-4;

/// Key `i`'s bucket: every fourth of two limits (100 and 60 tokens), the others of one.
fn bucket(i: usize) -> BucketConfig {
    let one = BucketConfig::new(Tokens::whole(100), slow()).expect("bucket");
    if i % 4 == 3 {
        one.with_limit(Tokens::whole(60), slow()).expect("a limit")
    } else {
        one
    }
}

/// Whether key `i` holds a strict lease (a bucket of one limit, with a row).
fn strict(i: usize) -> bool {
    i.is_multiple_of(10) && i < WITHOUT_ROW
}

/// What `store` ends with after the same calls on the keys: takes, strict leases, returns of
/// every key (whole and fractional amounts, some past the capacity, the strict ones settling
/// their lease), a retry of the first hundred returns, then a second round on every third key
/// with a row.
/// Per key: the tokens a take of nothing reports (the least limit's), and its strict leases
/// left; and the returns credited in each call.
async fn returned(store: &PostgresStore, keys: &[String]) -> (Vec<(f64, usize)>, [u64; 3]) {
    let takes: Vec<AcquireRequest<'_>> = keys[..WITHOUT_ROW]
        .iter()
        .enumerate()
        .filter(|(i, _)| !strict(*i))
        .map(|(i, k)| AcquireRequest::take(k, bucket(i), Tokens::whole(10 + (i % 50) as u64)))
        .collect();
    for answer in store.acquire_each(&takes).await {
        assert!(!answer.expect("take").granted.is_zero());
    }
    let leases: Vec<AcquireRequest<'_>> = keys
        .iter()
        .enumerate()
        .filter(|(i, _)| strict(*i))
        .map(|(i, k)| {
            AcquireRequest::lease(k, bucket(i), Tokens::whole(1), Tokens::whole(30)).held(Hold {
                holder: 7,
                lease_id: i as i64,
                kept: Tokens::ZERO,
                lifetime: std::time::Duration::from_secs(600),
            })
        })
        .collect();
    for answer in store.acquire_each(&leases).await {
        assert_eq!(answer.expect("strict lease").granted, Tokens::whole(30));
    }
    let amount = |i: usize| Tokens::from_f64((i % 37) as f64 * 2.25).expect("amount");
    let returns: Vec<GiveBack<'_>> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| GiveBack {
            id: 10_000 + i as i64,
            key: k,
            bucket: bucket(i),
            amount: if strict(i) {
                Tokens::whole(12)
            } else {
                amount(i)
            },
            lease: strict(i).then_some(LeaseRef {
                holder: 7,
                lease_id: i as i64,
            }),
        })
        .collect();
    let first = store.give_back(&returns).await.expect("returns");
    let retried = store.give_back(&returns[..100]).await.expect("retry");
    let again: Vec<GiveBack<'_>> = returns
        .iter()
        .enumerate()
        .filter(|(i, _)| i.is_multiple_of(3) && *i < WITHOUT_ROW)
        .map(|(i, r)| GiveBack {
            id: 20_000 + i as i64,
            lease: None,
            amount: Tokens::whole(15),
            ..*r
        })
        .collect();
    let second = store.give_back(&again).await.expect("second round");
    let reads: Vec<AcquireRequest<'_>> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| AcquireRequest::take(k, bucket(i), Tokens::ZERO))
        .collect();
    let mut out = Vec::with_capacity(keys.len());
    for (k, answer) in keys.iter().zip(store.acquire_each(&reads).await) {
        let tokens = answer.expect("read").remaining.as_f64();
        let held = store
            .inspect(k)
            .await
            .expect("inspect")
            .map_or(0, |row| row.leases.len());
        out.push((tokens, held));
    }
    (out, [first, retried, second])
}

/// Z13: returns of 320 keys over every shard of a two-worker cluster of four shards (two a
/// worker, so that a node function's call spans several shards), through the node functions
/// (`tokenlease_citus_give_back`, `..._give_back_limits`), leave every key as the same returns
/// leave it on plain PostgreSQL: buckets of one and of two limits, keys without a row, strict
/// leases settled by their return, amounts past the capacity, a retry that credits nothing,
/// and a second round of new returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returns_on_every_shard_credit_as_on_plain_postgres() {
    let citus = super::citus::cluster_with_shards(2, 4).await;
    let conn = citus.connection_string("postgres");
    let on_citus = common::store_at(&conn, 2, true).await;
    let db = common::database().await;
    let plain = common::store(&db, 2).await;
    let keys: Vec<String> = (0..KEYS).map(|i| format!("z13-{i}")).collect();

    // The keys are on every shard.
    let (c, connection) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(connection);
    let spread: i64 = c
        .query_one(
            "SELECT count(DISTINCT get_shard_id_for_distribution_column('tokenlease_buckets', k)) \
             FROM unnest($1::text[]) AS k",
            &[&keys],
        )
        .await
        .expect("shards of the keys")
        .get(0);
    let shards = shard_count(&c).await;
    assert_eq!(spread, shards, "a key on every shard");

    let (cluster, counts) = returned(&on_citus, &keys).await;
    let (single, plain_counts) = returned(&plain, &keys).await;
    assert_eq!(
        counts, plain_counts,
        "returns credited (first, retry, second)"
    );
    assert_eq!(counts[1], 0, "a retry credits nothing");
    assert!(counts[0] >= WITHOUT_ROW as u64, "{counts:?}");
    let mut below_capacity = 0;
    for (i, ((t, held), (p, plain_held))) in cluster.iter().zip(&single).enumerate() {
        assert!(
            (t - p).abs() <= CLOSE,
            "key {}: {t} tokens on Citus, {p} on PostgreSQL",
            keys[i]
        );
        assert_eq!(held, plain_held, "key {}: strict leases left", keys[i]);
        let capacity = if i % 4 == 3 { 60.0 } else { 100.0 };
        if *t < capacity - 1.0 {
            below_capacity += 1;
        }
    }
    // Not every bucket full: many credits were partial (126 of the 320 keys below capacity).
    assert!(below_capacity > KEYS / 4, "{below_capacity} of {KEYS}");
    // The Citus rows are on the shards (the tables are distributed), and every key with a take
    // has one.
    let rows: i64 = c
        .query_one(
            "SELECT count(*) FROM tokenlease_buckets WHERE key = ANY ($1::text[])",
            &[&keys],
        )
        .await
        .expect("rows")
        .get(0);
    assert!(rows >= WITHOUT_ROW as i64, "{rows}");
}
