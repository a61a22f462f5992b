//! Contained failures (K1–K4, K10 in docs/testing.md): a multi-key call that names a key twice
//! is decided as consecutive calls on every store; a request the database cannot store (a key
//! its encoding lacks, an amount its table cannot hold) or a data error the server raises for
//! one key fails that request alone, and its neighbours get their real answers; a return that
//! would overflow a full bucket is capped; and the four stores give the same answers to the
//! same request sequences (K2, a property test).
//!
//! Time is moved as in `store_contract.rs`: the memory store reads tokio's clock, on a paused
//! runtime of its own (`subject.rs`), which is advanced; for PostgreSQL every stored refill
//! time is shifted back. The rate is low (0.01 token/s) and every
//! amount a whole token, so the real time that passes between statements (well under 100 s)
//! never changes a whole-token outcome.

use crate::common;
use crate::subject::Subject;

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use tokenlease::bucket::{BucketConfig, Rate, Tokens};
use tokenlease::policy::{FallbackMode, FallbackSettings};
use tokenlease::store::{
    AcquireRequest, GiveBack, PostgresStore, ShardedStore, Store, StoreError, Unstorable,
};
use tokenlease::{DecidedBy, Limiter};
use tokenlease_testkit::{TempCitus, TestDatabase};

/// Tokens a second: one whole token per 100 s of moved time.
const RATE: f64 = 0.01;

/// The largest capacity the PostgreSQL table holds.
const MAX: u64 = 8_000_000_000;

fn cfg(capacity: u64) -> BucketConfig {
    BucketConfig::new(Tokens::whole(capacity), Rate::from_f64(RATE).expect("rate")).expect("bucket")
}

fn t(n: u64) -> Tokens {
    Tokens::whole(n)
}

/// A new database on `db`'s server, named after `db` and `name` (created with `options`), and
/// its connection string.
async fn sibling(db: &TestDatabase, name: &str, options: &str) -> String {
    let name = format!("{}_{name}", db.name());
    let admin = db.client().await.expect("connect");
    admin
        .batch_execute(&format!("CREATE DATABASE {name} {options}"))
        .await
        .expect("CREATE DATABASE");
    db.connection_string().replace(db.name(), &name)
}

/// A store on `conn` with generous timeouts, migrating.
async fn store(conn: &str) -> PostgresStore {
    common::store_at(conn, 2, true).await
}

/// The whole tokens a bucket holds now (absent: its capacity).
async fn whole_tokens(store: &dyn Store, key: &str, capacity: u64) -> u64 {
    match store.inspect(key).await.expect("inspect") {
        Some(row) => row.tokens_now.floor(),
        None => capacity,
    }
}

/// K1 on one store: one key sixteen times in one call is sixteen calls in a row.
async fn duplicates_are_consecutive_calls(s: &Subject) {
    let store = &*s.store;
    let five = cfg(5);
    let requests = vec![AcquireRequest::take("dup", five, t(1)); 16];
    let out = store.acquire_many(&requests).await.expect("acquire_many");
    let granted: u64 = out.iter().map(|a| a.granted.floor()).sum();
    assert_eq!(
        granted, 5,
        "{}: sixteen takes of 1 from a bucket of 5",
        s.name
    );
    let left: Vec<u64> = out.iter().map(|a| a.remaining.floor()).collect();
    assert_eq!(&left[..6], &[4, 3, 2, 1, 0, 0], "{}", s.name);
    let again = store.acquire_each(&requests).await;
    let granted: u64 = again
        .iter()
        .map(|a| a.as_ref().expect("acquire_each").granted.floor())
        .sum();
    assert_eq!(granted, 0, "{}: the bucket is empty", s.name);
    assert_eq!(whole_tokens(store, "dup", 5).await, 0, "{}", s.name);

    // Interleaved keys and costs: each request as if it came alone, in order.
    let requests = [
        AcquireRequest::take("i-a", five, t(2)),
        AcquireRequest::take("i-b", five, t(5)),
        AcquireRequest::take("i-a", five, t(2)),
        AcquireRequest::take("i-b", five, t(1)),
        AcquireRequest::take("i-a", five, t(2)),
        AcquireRequest {
            step: t(1),
            ..AcquireRequest::lease("i-a", five, t(1), t(5))
        },
    ];
    let out = store.acquire_many(&requests).await.expect("acquire_many");
    let seen: Vec<(u64, u64)> = out
        .iter()
        .map(|a| (a.granted.floor(), a.remaining.floor()))
        .collect();
    assert_eq!(
        seen,
        [(2, 3), (5, 0), (2, 1), (0, 0), (0, 1), (1, 0)],
        "{}",
        s.name
    );

    // Returns to one key credit one after another, capped at the capacity.
    let gives: Vec<GiveBack<'_>> = (0..3)
        .map(|i| GiveBack {
            id: 9_000 + i,
            key: "dup",
            bucket: five,
            amount: t(2),
            lease: None,
        })
        .collect();
    assert_eq!(
        store.give_back(&gives).await.expect("give_back"),
        3,
        "{}",
        s.name
    );
    assert_eq!(
        whole_tokens(store, "dup", 5).await,
        5,
        "{}: 2 + 2 + 1",
        s.name
    );
    assert_eq!(
        store.give_back(&gives).await.expect("retry"),
        0,
        "{}",
        s.name
    );
}

/// K1: PostgreSQL, two PostgreSQL databases behind a `ShardedStore` (each shard behind its
/// circuit breaker, as `connect` builds it) and the memory store decide a key named twice as
/// two calls in a row.
#[tokio::test]
async fn k1_duplicate_keys_are_consecutive_calls_on_every_store() {
    let db = common::database().await;
    let pg = Subject::postgres(
        "postgres",
        Arc::new(store(&db.connection_string()).await),
        &[db.connection_string()],
    )
    .await;
    let conns = [
        sibling(&db, "k1_a", "").await,
        sibling(&db, "k1_b", "").await,
    ];
    let sharded = sharded(&conns).await;
    let sharded = Subject::postgres("sharded", Arc::new(sharded), &conns).await;
    for s in [Subject::memory(), pg, sharded] {
        duplicates_are_consecutive_calls(&s).await;
    }
}

async fn sharded(conns: &[String]) -> ShardedStore {
    let shards = [("pg-a", conns[0].as_str()), ("pg-b", conns[1].as_str())];
    ShardedStore::connect_with(&shards, |b| {
        b.pool_size(2)
            .call_timeout(Duration::from_secs(5))
            .pool_wait_timeout(Duration::from_secs(5))
            .connect_timeout(Duration::from_secs(5))
            .statement_timeout(Duration::from_secs(5))
            .lock_timeout(Duration::from_secs(5))
    })
    .await
    .expect("sharded store")
}

/// Fifteen plain keys and `bad` at position 7, each a take of 1 from a bucket of 10.
fn sixteen<'a>(good: &'a [String], bad: &'a str) -> Vec<AcquireRequest<'a>> {
    let mut keys: Vec<&str> = good.iter().map(String::as_str).collect();
    keys.insert(7, bad);
    keys.into_iter()
        .map(|k| AcquireRequest::take(k, cfg(10), t(1)))
        .collect()
}

fn good_keys(prefix: &str) -> Vec<String> {
    (0..15).map(|i| format!("{prefix}-{i}")).collect()
}

/// K3: in a LATIN1 database, a key with a character LATIN1 lacks is refused alone, by a typed
/// error naming the character, before it is sent; its fifteen neighbours (one of them with a
/// LATIN1 letter) are decided, takes and returns.
#[tokio::test]
async fn k3_a_key_the_encoding_lacks_fails_alone() {
    let db = common::database().await;
    let conn = sibling(
        &db,
        "k3_latin1",
        "ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0",
    )
    .await;
    let store = store(&conn).await;
    let mut good = good_keys("k3");
    good[3] = "k3-café".into();
    for bad in ["k3-€", "k3-日本"] {
        let out = store.acquire_each(&sixteen(&good, bad)).await;
        for (i, answer) in out.iter().enumerate() {
            if i == 7 {
                match answer {
                    Err(StoreError::Unstorable {
                        key,
                        why:
                            Unstorable::Character {
                                encoding, offset, ..
                            },
                    }) => {
                        assert_eq!(
                            (key.as_str(), encoding.as_str(), *offset),
                            (bad, "LATIN1", 3)
                        )
                    }
                    other => panic!("{bad}: {other:?}"),
                }
            } else {
                let a = answer.as_ref().expect("a neighbour is decided");
                assert_eq!(a.granted, t(1), "{i}");
            }
        }
        assert!(out[7].as_ref().unwrap_err().to_string().contains("LATIN1"));
    }
    assert_eq!(whole_tokens(&store, "k3-café", 10).await, 8);
    let returns: Vec<GiveBack<'_>> = ["k3-0", "k3-€", "k3-café"]
        .into_iter()
        .enumerate()
        .map(|(i, key)| GiveBack {
            id: i as i64,
            key,
            bucket: cfg(10),
            amount: t(1),
            lease: None,
        })
        .collect();
    let out = store.give_back_each(&returns).await;
    assert!(out[0].is_ok() && out[2].is_ok(), "{out:?}");
    assert!(
        matches!(out[1], Err(StoreError::Unstorable { .. })),
        "{out:?}"
    );
    assert_eq!(whole_tokens(&store, "k3-café", 10).await, 9);
}

/// K3 through the limiter: direct mode over the LATIN1 database, fifteen keys and one the
/// encoding lacks asked together in every batch. The bad key is decided by its fallback; the
/// good keys never are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k3_the_limiter_gives_the_good_keys_no_fallback() {
    let db = common::database().await;
    let conn = sibling(
        &db,
        "k3_limiter",
        "ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0",
    )
    .await;
    let recording = Arc::new(Batches::new(store(&conn).await));
    let limiter = Limiter::builder_shared(Arc::clone(&recording) as _)
        .statements_in_flight(1)
        .build();
    let plan = Arc::new(
        common::plan(1_000_000, 1000.0).with_fallback(FallbackSettings::new(FallbackMode::Allow)),
    );
    let mut keys = good_keys("k3l");
    keys.push("k3l-€".into());
    let mut tasks = Vec::new();
    for key in keys {
        let (limiter, plan) = (limiter.clone(), Arc::clone(&plan));
        tasks.push(tokio::spawn(async move {
            let mut fallback = 0u32;
            for _ in 0..200 {
                let d = limiter
                    .try_acquire_with(&plan, &key, 1.0)
                    .await
                    .expect("decision");
                fallback += u32::from(matches!(d.decided_by, DecidedBy::Fallback(_)));
            }
            (key, fallback)
        }));
    }
    let mut good_fallback = 0;
    let mut bad_fallback = 0;
    for task in tasks {
        let (key, fallback) = task.await.expect("join");
        if key.contains('€') {
            bad_fallback += fallback;
        } else {
            good_fallback += fallback;
        }
    }
    let (batches, mixed) = recording.seen();
    eprintln!("{batches} store calls, {mixed} with the bad key and others");
    assert!(mixed > 0, "the bad key shared a batch with good keys");
    assert_eq!(bad_fallback, 200, "the bad key is the fallback's");
    assert_eq!(good_fallback, 0, "no good key went to the fallback");
}

/// A store that counts its multi-key batches, and those holding the key with '€' and others.
#[derive(Debug)]
struct Batches {
    inner: PostgresStore,
    seen: std::sync::Mutex<(u32, u32)>,
}

impl Batches {
    fn new(inner: PostgresStore) -> Batches {
        Batches {
            inner,
            seen: std::sync::Mutex::new((0, 0)),
        }
    }

    fn seen(&self) -> (u32, u32) {
        *self.seen.lock().expect("lock")
    }
}

#[async_trait::async_trait]
impl Store for Batches {
    async fn acquire(
        &self,
        request: AcquireRequest<'_>,
    ) -> Result<tokenlease::store::Acquired, StoreError> {
        self.inner.acquire(request).await
    }
    async fn acquire_each(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Vec<Result<tokenlease::store::Acquired, StoreError>> {
        {
            let mut seen = self.seen.lock().expect("lock");
            seen.0 += 1;
            if requests.len() > 1 && requests.iter().any(|r| r.key.contains('€')) {
                seen.1 += 1;
            }
        }
        self.inner.acquire_each(requests).await
    }
    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        self.inner.give_back(returns).await
    }
    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        self.inner.delete_idle(limit).await
    }
    async fn inspect(&self, key: &str) -> Result<Option<tokenlease::store::BucketRow>, StoreError> {
        self.inner.inspect(key).await
    }
    fn call_timeout(&self) -> Option<Duration> {
        self.inner.call_timeout()
    }
}

/// K4: a return of 4e9 tokens into a full bucket of the largest capacity (8e9), sent with
/// fifteen returns to other keys, is capped at the capacity and the fifteen are credited; a
/// retry credits nothing more. A return larger than any bucket is refused alone.
#[tokio::test]
async fn k4_a_return_that_would_overflow_is_capped() {
    let db = common::database().await;
    let store = store(&db.connection_string()).await;
    let s = Subject::postgres(
        "postgres",
        Arc::new(store.clone()),
        &[db.connection_string()],
    )
    .await;
    let good = good_keys("k4");
    let mut takes: Vec<AcquireRequest<'_>> = good
        .iter()
        .map(|k| AcquireRequest::take(k, cfg(10), t(5)))
        .collect();
    takes.push(AcquireRequest::take("k4-big", cfg(MAX), t(1)));
    for a in store.acquire_many(&takes).await.expect("takes") {
        assert!(!a.granted.is_zero());
    }
    s.advance(Duration::from_secs(100)).await; // the big bucket is full again; the others 6
    let mut returns: Vec<GiveBack<'_>> = good
        .iter()
        .enumerate()
        .map(|(i, key)| GiveBack {
            id: i as i64,
            key,
            bucket: cfg(10),
            amount: t(2),
            lease: None,
        })
        .collect();
    returns.insert(
        7,
        GiveBack {
            id: 100,
            key: "k4-big",
            bucket: cfg(MAX),
            amount: t(MAX / 2),
            lease: None,
        },
    );
    for attempt in 0..2 {
        let out = store.give_back_each(&returns).await;
        assert!(out.iter().all(Result::is_ok), "attempt {attempt}: {out:?}");
        assert_eq!(whole_tokens(&store, "k4-big", MAX).await, MAX, "capped");
        for key in &good {
            assert_eq!(
                whole_tokens(&store, key, 10).await,
                8,
                "{key}, attempt {attempt}"
            );
        }
    }
    assert_eq!(store.give_back(&returns).await.expect("retry"), 0);

    // A return of more than the largest bucket holds is refused alone, not sent.
    let mut huge = returns.clone();
    for (i, r) in huge.iter_mut().enumerate() {
        r.id = 200 + i as i64;
    }
    huge[7].amount = t(MAX + 1);
    let out = store.give_back_each(&huge).await;
    assert!(
        matches!(
            &out[7],
            Err(StoreError::Unstorable {
                why: Unstorable::Amount { .. },
                ..
            })
        ),
        "{:?}",
        out[7]
    );
    assert_eq!(out.iter().filter(|r| r.is_ok()).count(), 15);
    for key in &good {
        assert_eq!(whole_tokens(&store, key, 10).await, 10, "{key}");
    }
    // A return up to the request's bounds, into a bucket one token short of the largest.
    let a = store
        .acquire(AcquireRequest::take("k4-big", cfg(MAX), t(1)))
        .await
        .expect("take");
    assert_eq!(a.granted, t(1));
    let max_return = GiveBack {
        id: 300,
        key: "k4-big",
        bucket: cfg(MAX),
        amount: t(MAX),
        lease: None,
    };
    assert_eq!(store.give_back(&[max_return]).await.expect("give_back"), 1);
    assert_eq!(whole_tokens(&store, "k4-big", MAX).await, MAX);
}

/// K10 on one store whose databases refuse the key `poison` (a CHECK constraint): sixteen
/// takes and sixteen returns with `poison` among them; only `poison` fails, with the server's
/// error, and the neighbours are decided once (a retry of their returns credits nothing more).
async fn a_data_error_fails_only_its_key(s: &Subject, prefix: &str) {
    for c in &s.tables {
        c.batch_execute(
            "ALTER TABLE tokenlease_buckets ADD CONSTRAINT poisoned CHECK (key <> 'poison')",
        )
        .await
        .expect("constraint");
    }
    let good = good_keys(prefix);
    let out = s.store.acquire_each(&sixteen(&good, "poison")).await;
    for (i, answer) in out.iter().enumerate() {
        if i == 7 {
            let err = answer.as_ref().expect_err("poison fails");
            assert_eq!(err.code(), Some("23514"), "{}: {err}", s.name);
            assert!(err.is_data_error());
        } else {
            assert_eq!(
                answer.as_ref().expect("decided").granted,
                t(1),
                "{}",
                s.name
            );
        }
    }
    for key in &good {
        assert_eq!(
            whole_tokens(&*s.store, key, 10).await,
            9,
            "{}: taken once",
            s.name
        );
    }
    // The poison row cannot exist, so its return finds no row; poison the returns' table too.
    for c in &s.tables {
        c.batch_execute(
            "ALTER TABLE tokenlease_returns ADD CONSTRAINT poisoned CHECK (key <> 'poison')",
        )
        .await
        .expect("constraint");
    }
    let mut keys: Vec<&str> = good.iter().map(String::as_str).collect();
    keys.insert(3, "poison");
    let returns: Vec<GiveBack<'_>> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| GiveBack {
            id: 500 + i as i64,
            key,
            bucket: cfg(10),
            amount: t(1),
            lease: None,
        })
        .collect();
    for attempt in 0..2 {
        let out = s.store.give_back_each(&returns).await;
        for (i, answer) in out.iter().enumerate() {
            assert_eq!(answer.is_err(), i == 3, "{}: {i}: {answer:?}", s.name);
        }
        for key in &good {
            let n = whole_tokens(&*s.store, key, 10).await;
            assert_eq!(n, 10, "{}: credited once, attempt {attempt}", s.name);
        }
    }
}

/// K10: a CHECK constraint refuses one key of a batch; PostgreSQL and a `ShardedStore` over two
/// databases answer every other key.
#[tokio::test]
async fn k10_a_data_error_fails_only_its_key() {
    let db = common::database().await;
    let pg = Subject::postgres(
        "postgres",
        Arc::new(store(&db.connection_string()).await),
        &[db.connection_string()],
    )
    .await;
    a_data_error_fails_only_its_key(&pg, "k10").await;
    let conns = [
        sibling(&db, "k10_a", "").await,
        sibling(&db, "k10_b", "").await,
    ];
    let sharded = Subject::postgres("sharded", Arc::new(sharded(&conns).await), &conns).await;
    a_data_error_fails_only_its_key(&sharded, "k10s").await;
}

/// K10's bound: one bad key among 64 costs the halving's failed statements only, one per
/// level (64, 32, 16, 8, 4, 2, 1: seven), counted as the database's rolled-back transactions
/// once the store's sessions have ended (a session reports its counts when it ends).
#[tokio::test]
async fn k10_containment_sends_one_failed_statement_per_halving() {
    let db = common::database().await;
    let admin = db.client().await.expect("connect");
    admin
        .batch_execute(
            "ALTER TABLE tokenlease_buckets ADD CONSTRAINT poisoned CHECK (key <> 'poison')",
        )
        .await
        .expect("constraint");
    let rollbacks = async || -> i64 {
        admin
            .query_one(
                "SELECT xact_rollback FROM pg_stat_database WHERE datname = current_database()",
                &[],
            )
            .await
            .expect("pg_stat_database")
            .get(0)
    };
    let store = store(&db.connection_string()).await;
    let mut keys: Vec<String> = (0..63).map(|i| format!("k10b-{i}")).collect();
    keys.insert(41, "poison".into());
    let requests: Vec<AcquireRequest<'_>> = keys
        .iter()
        .map(|k| AcquireRequest::take(k, cfg(10), t(1)))
        .collect();
    let before = rollbacks().await;
    let out = store.acquire_each(&requests).await;
    assert_eq!(out.iter().filter(|a| a.is_ok()).count(), 63);
    drop(store);
    let failed = common::eventually(
        Duration::from_millis(50),
        Duration::from_secs(10),
        "the store's sessions report their rolled-back statements",
        async || {
            let n = rollbacks().await - before;
            if n >= 7 { Ok(n) } else { Err(n) }
        },
    )
    .await;
    assert_eq!(failed, 7, "one failed statement per level of the halving");
}

/// One step of a K2 sequence. Keys are indices into the case's keys (few, so that calls name
/// a key more than once); amounts are whole tokens.
#[derive(Clone, Debug)]
enum Step {
    /// One `acquire_each` of (key, min, want) takes in whole-token steps.
    Take(Vec<(usize, u64, u64)>),
    /// One `give_back_each` of (key, amount, a fresh return or a retry of an earlier one).
    Give(Vec<(usize, u64, Option<usize>)>),
    /// Time moves by this many whole tokens' worth.
    Advance(u64),
}

#[derive(Clone, Debug)]
struct Case {
    capacities: Vec<u64>,
    steps: Vec<Step>,
}

fn case() -> impl Strategy<Value = Case> {
    let capacities = prop::collection::vec(prop_oneof![Just(1u64), Just(5), Just(MAX)], 3);
    capacities.prop_flat_map(|capacities| {
        let caps = capacities.clone();
        let amount = move |key: usize| {
            let c = caps[key];
            // A take's `min` is at most the capacity (the request's contract).
            prop_oneof![Just(1u64), Just(2.min(c)), Just(c.div_ceil(2)), Just(c)]
        };
        let amount2 = amount.clone();
        let take = (0usize..3).prop_flat_map(move |k| {
            (Just(k), amount(k), amount(k)).prop_map(|(k, a, b)| (k, a.min(b), a.max(b)))
        });
        let give = (0usize..3)
            .prop_flat_map(move |k| (Just(k), amount2(k), prop::option::weighted(0.2, 0usize..8)));
        let step = prop_oneof![
            4 => prop::collection::vec(take, 1..6).prop_map(Step::Take),
            2 => prop::collection::vec(give, 1..4).prop_map(Step::Give),
            1 => (1u64..4).prop_map(Step::Advance),
        ];
        (Just(capacities), prop::collection::vec(step, 1..8))
            .prop_map(|(capacities, steps)| Case { capacities, steps })
    })
}

/// What a store answered for one step, in whole tokens.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    Takes(Vec<(u64, u64)>),
    /// Whether each return reached the store, and every key's whole tokens after.
    Gave(Vec<bool>, Vec<u64>),
    Moved,
}

/// Runs `case` (case number `n`, for fresh keys and ids) on `s`: every answer, then every
/// key's whole tokens.
async fn run(s: &Subject, n: usize, case: &Case) -> (Vec<Answer>, Vec<u64>) {
    let keys: Vec<String> = (0..3).map(|k| format!("k2-{n}-{k}")).collect();
    let mut ids: Vec<(i64, usize, u64)> = Vec::new();
    let mut answers = Vec::new();
    for step in &case.steps {
        answers.push(match step {
            Step::Take(takes) => {
                let requests: Vec<AcquireRequest<'_>> = takes
                    .iter()
                    .map(|&(k, min, want)| AcquireRequest {
                        key: &keys[k],
                        bucket: cfg(case.capacities[k]),
                        min: t(min),
                        want: t(want),
                        step: t(1),
                        hold: None,
                    })
                    .collect();
                let out = s.store.acquire_each(&requests).await;
                Answer::Takes(
                    out.into_iter()
                        .map(|a| {
                            let a = a.unwrap_or_else(|e| panic!("{}: {e}", s.name));
                            (a.granted.floor(), a.remaining.floor())
                        })
                        .collect(),
                )
            }
            Step::Give(gives) => {
                let returns: Vec<GiveBack<'_>> = gives
                    .iter()
                    .map(|&(k, amount, again)| {
                        // A retry is the same return again: its id, key and amount.
                        let (id, k, amount) = match again {
                            Some(i) if !ids.is_empty() => ids[i % ids.len()],
                            _ => {
                                let id = 1_000_000 + (n * 100 + ids.len()) as i64;
                                ids.push((id, k, amount));
                                (id, k, amount)
                            }
                        };
                        GiveBack {
                            id,
                            key: &keys[k],
                            bucket: cfg(case.capacities[k]),
                            amount: t(amount),
                            lease: None,
                        }
                    })
                    .collect();
                let out = s.store.give_back_each(&returns).await;
                let reached = out.iter().map(Result::is_ok).collect();
                let mut left = Vec::new();
                for (k, key) in keys.iter().enumerate() {
                    left.push(whole_tokens(&*s.store, key, case.capacities[k]).await);
                }
                Answer::Gave(reached, left)
            }
            Step::Advance(tokens) => {
                s.advance(Duration::from_secs_f64(*tokens as f64 / RATE))
                    .await;
                Answer::Moved
            }
        });
    }
    let mut left = Vec::new();
    for (k, key) in keys.iter().enumerate() {
        left.push(whole_tokens(&*s.store, key, case.capacities[k]).await);
    }
    (answers, left)
}

/// Runs `cases` generated cases on every subject and compares each one's answers with the
/// memory store's (the first subject).
async fn agree(subjects: &[Subject], cases: usize) {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = case();
    for n in 0..cases {
        let case = strategy.new_tree(&mut runner).expect("case").current();
        let reference = run(&subjects[0], n, &case).await;
        for s in &subjects[1..] {
            let got = run(s, n, &case).await;
            assert_eq!(
                got, reference,
                "case {n}: {} against {}: {case:?}",
                s.name, subjects[0].name
            );
        }
    }
}

/// K2: the memory store, PostgreSQL and a `ShardedStore` over two databases give the same
/// answers to the same request sequences: duplicates, the largest capacity, mixed costs,
/// missing rows, returns (retried ids among them), time moving.
#[tokio::test]
async fn k2_the_stores_agree() {
    let db = common::database().await;
    let pg = Subject::postgres(
        "postgres",
        Arc::new(store(&db.connection_string()).await),
        &[db.connection_string()],
    )
    .await;
    let conns = [
        sibling(&db, "k2_a", "").await,
        sibling(&db, "k2_b", "").await,
    ];
    let sharded = Subject::postgres("sharded", Arc::new(sharded(&conns).await), &conns).await;
    agree(&[Subject::memory(), pg, sharded], 48).await;
}

/// K1, K2 and K10 on a Citus cluster (a coordinator and two workers): duplicates in one call
/// are consecutive calls, a data error fails only its key, and a few K2 sequences give the
/// memory store's answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k1_k2_k10_on_citus() {
    let citus = tokio::task::spawn_blocking(|| TempCitus::start(2))
        .await
        .expect("start task")
        .expect("a Citus cluster (install the Citus extension; .ci/run builds it when missing)");
    let conn = citus.connection_string("postgres");
    let s = Subject::postgres("citus", Arc::new(store(&conn).await), &[conn]).await;
    duplicates_are_consecutive_calls(&s).await;
    let subjects = [Subject::memory(), s];
    agree(&subjects, 10).await;
    a_data_error_fails_only_its_key(&subjects[1], "k10c").await;
}
