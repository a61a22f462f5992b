//! Buckets of several limits on one key (P1–P3 in docs/testing.md): one statement takes from
//! every limit or from none, as a pure model of several buckets does; a table migrated with
//! rows in it takes correctly after migration 0010.
//!
//! Time is moved as in `contained.rs`: the memory store's paused clock is advanced; for
//! PostgreSQL every stored refill time is shifted back. The rates are low (a token per 100, 500, 200 and
//! 1,000 s) and every amount a whole token, so a limit's fraction of a token after whole
//! moves of 100 s is at least 0.1 from the next whole token, and the real time one generated
//! case takes on a store (well under 20 s, where 100 s would be needed) never changes a
//! whole-token outcome.

use crate::common;
use crate::subject::{Subject, client};

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, RngAlgorithm, TestRng, TestRunner};
use tokenlease::bucket::{BucketConfig, BucketState, Rate, Timestamp, Tokens};
use tokenlease::store::{AcquireRequest, GiveBack, MemoryStore, ShardedStore, Store};
use tokenlease_testkit::TestDatabase;

/// The limits' rates, in tokens a second, by the limit's place in a generated shape: a whole
/// token per 100 s, 500 s, 200 s and 1,000 s of moved time.
const RATES: [f64; 4] = [0.01, 0.002, 0.005, 0.001];

/// Moved time per step of a case: 100 s.
const TICK: Duration = Duration::from_secs(100);

fn t(n: u64) -> Tokens {
    Tokens::whole(n)
}

/// A bucket of one limit per capacity of `caps`, limit `i` refilling at `RATES[i]`.
fn limits(caps: &[u64]) -> BucketConfig {
    let rate = |i: usize| Rate::from_f64(RATES[i]).expect("rate");
    let mut config = BucketConfig::new(t(caps[0]), rate(0)).expect("bucket");
    for (i, &c) in caps.iter().enumerate().skip(1) {
        config = config.with_limit(t(c), rate(i)).expect("a limit");
    }
    config
}

async fn sibling(db: &TestDatabase, name: &str) -> String {
    let name = format!("{}_{name}", db.name());
    let admin = db.client().await.expect("connect");
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .expect("CREATE DATABASE");
    db.connection_string().replace(db.name(), &name)
}

/// The pure model of several buckets: per key, each limit a [`BucketState`], all refilled to
/// the same instant; a take grants its amount only when every limit holds it.
#[derive(Default)]
struct Model {
    now: u64,
    keys: HashMap<usize, Vec<BucketState>>,
}

impl Model {
    fn states(&mut self, key: usize, config: &BucketConfig) -> Vec<BucketState> {
        let now = Timestamp::from_nanos(self.now);
        let states = self.keys.remove(&key).unwrap_or_else(|| {
            config
                .limits()
                .map(|l| BucketState::full(&l, now))
                .collect()
        });
        states
            .into_iter()
            .zip(config.limits())
            .map(|(s, l)| s.refill(&l, now))
            .collect()
    }

    /// Grants `want` whole tokens down to `min` (whole-token steps) if every limit holds `min`.
    fn take(&mut self, key: usize, config: &BucketConfig, min: u64, want: u64) -> (u64, u64) {
        let mut states = self.states(key, config);
        let least = states.iter().map(|s| s.tokens.floor()).min().unwrap_or(0);
        let granted = if least >= min { want.min(least) } else { 0 };
        for s in &mut states {
            s.tokens = s.tokens.saturating_sub(t(granted));
        }
        let remaining = states.iter().map(|s| s.tokens.floor()).min().unwrap_or(0);
        self.keys.insert(key, states);
        (granted, remaining)
    }

    /// Credits `amount` to every limit of a stored key, each capped at its capacity.
    fn give(&mut self, key: usize, config: &BucketConfig, amount: u64) {
        if !self.keys.contains_key(&key) {
            return;
        }
        let now = Timestamp::from_nanos(self.now);
        let states = self.keys.remove(&key).unwrap_or_default();
        let states = states
            .into_iter()
            .zip(config.limits())
            .map(|(s, l)| s.credit(&l, now, t(amount)))
            .collect();
        self.keys.insert(key, states);
    }
}

#[derive(Clone, Debug)]
enum Step {
    /// One `acquire_each` of (key, min, want).
    Take(Vec<(usize, u64, u64)>),
    /// One `give_back_each` of (key, amount), each a fresh return.
    Give(Vec<(usize, u64)>),
    /// Time moves by this many ticks.
    Advance(u64),
}

#[derive(Clone, Debug)]
struct Case {
    /// Each key's capacities, one per limit (1 to 4 limits), the smallest first.
    shapes: Vec<Vec<u64>>,
    steps: Vec<Step>,
}

const KEYS: usize = 6;

fn case() -> impl Strategy<Value = Case> {
    // Mostly two limits; some keys of one (a batch then mixes both kinds of statement) or of
    // three and four.
    let count = prop_oneof![1 => Just(1usize), 4 => Just(2), 1 => Just(3), 1 => Just(4)];
    let shape = (1u64..6, count).prop_flat_map(|(a, n)| {
        prop::collection::vec(0u64..8, n - 1).prop_map(move |more| {
            std::iter::once(a)
                .chain(more.into_iter().map(|m| a + m))
                .collect::<Vec<u64>>()
        })
    });
    prop::collection::vec(shape, KEYS).prop_flat_map(|shapes| {
        let caps = shapes.clone();
        let take = (0usize..KEYS).prop_flat_map(move |k| {
            let c = caps[k][0];
            (Just(k), 1u64..=c, 1u64..=c).prop_map(|(k, a, b)| (k, a.min(b), a.max(b)))
        });
        let give = (0usize..KEYS, 1u64..4);
        let step = prop_oneof![
            5 => prop::collection::vec(take, 1..10).prop_map(Step::Take),
            1 => prop::collection::vec(give, 1..3).prop_map(Step::Give),
            2 => (1u64..6).prop_map(Step::Advance),
        ];
        (Just(shapes), prop::collection::vec(step, 1..12))
            .prop_map(|(shapes, steps)| Case { shapes, steps })
    })
}

/// Runs `case` (run number `n`, which names its keys) on `s` and on the model, and says where
/// an answer differs from the model's.
async fn run(s: &Subject, n: usize, case: &Case) -> Result<(), String> {
    let keys: Vec<String> = (0..KEYS).map(|k| format!("p1-{n}-{k}")).collect();
    let configs: Vec<BucketConfig> = case.shapes.iter().map(|caps| limits(caps)).collect();
    let mut model = Model::default();
    let mut id = 1_000_000 * (n as i64 + 1);
    for (i, step) in case.steps.iter().enumerate() {
        match step {
            Step::Take(takes) => {
                let requests: Vec<AcquireRequest<'_>> = takes
                    .iter()
                    .map(|&(k, min, want)| AcquireRequest {
                        key: &keys[k],
                        bucket: configs[k],
                        min: t(min),
                        want: t(want),
                        step: t(1),
                        hold: None,
                    })
                    .collect();
                let out = s.store.acquire_each(&requests).await;
                if out.len() != takes.len() {
                    return Err(format!(
                        "{}: {} answers to {}",
                        s.name,
                        out.len(),
                        takes.len()
                    ));
                }
                for (&(k, min, want), got) in takes.iter().zip(out) {
                    let got = got.map_err(|e| format!("{} step {i}: {e}", s.name))?;
                    let expected = model.take(k, &configs[k], min, want);
                    let answered = (got.granted.floor(), got.remaining.floor());
                    if answered != expected {
                        return Err(format!(
                            "{} step {i}: key {k} ({min}..{want}) got (granted, remaining) \
                             {answered:?}, the model {expected:?}",
                            s.name
                        ));
                    }
                    if got.granted.is_zero() && got.retry_after.is_zero() {
                        return Err(format!("{} step {i}: key {k} refused, no wait", s.name));
                    }
                }
            }
            Step::Give(gives) => {
                let returns: Vec<GiveBack<'_>> = gives
                    .iter()
                    .map(|&(k, amount)| {
                        id += 1;
                        GiveBack {
                            id,
                            key: &keys[k],
                            bucket: configs[k],
                            amount: t(amount),
                            lease: None,
                        }
                    })
                    .collect();
                for answer in s.store.give_back_each(&returns).await {
                    answer.map_err(|e| format!("{} step {i}: {e}", s.name))?;
                }
                for &(k, amount) in gives {
                    model.give(k, &configs[k], amount);
                }
            }
            Step::Advance(ticks) => {
                s.advance(TICK * *ticks as u32).await;
                model.now += TICK.as_nanos() as u64 * ticks;
            }
        }
    }
    Ok(())
}

/// Runs `cases` generated cases on every subject, as a proptest property: a case on which a
/// subject differs from the model is shrunk (each try on fresh keys) and the smallest one
/// reported. Deterministic, so a failure repeats.
fn agree(subjects: &[Subject], cases: u32) {
    let handle = tokio::runtime::Handle::current();
    let runs = AtomicUsize::new(0);
    let config = ProptestConfig {
        cases,
        max_shrink_iters: 200,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let outcome = tokio::task::block_in_place(|| {
        runner.run(&case(), |case| {
            let n = runs.fetch_add(1, Ordering::Relaxed);
            for s in subjects {
                handle
                    .block_on(run(s, n, &case))
                    .map_err(TestCaseError::fail)?;
            }
            Ok(())
        })
    });
    if let Err(e) = outcome {
        panic!("several limits differ from the model: {e}");
    }
}

/// P1: on every store (memory, PostgreSQL, a `ShardedStore` over two databases), one call of
/// several keys of one to four limits each (keys repeated in the call, keys of one limit beside
/// keys of several, mixed costs, keys without a row, returns, time moving) answers each request
/// as the pure model of several buckets does: a grant only when every limit holds it, taken
/// from each; `remaining` the least limit's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p1_several_limits_decide_as_the_model_of_several_buckets() {
    let db = common::database().await;
    let pg = Subject::postgres(
        "postgres",
        Arc::new(common::store_at(&db.connection_string(), 2, true).await),
        &[db.connection_string()],
    )
    .await;
    let conns = [sibling(&db, "p1_a").await, sibling(&db, "p1_b").await];
    let mut builder = ShardedStore::builder();
    for (i, conn) in conns.iter().enumerate() {
        builder = builder.shard(format!("s{i}"), common::store_at(conn, 2, true).await);
    }
    let sharded = Subject::postgres(
        "sharded",
        Arc::new(builder.build().expect("sharded")),
        &conns,
    )
    .await;
    agree(&[Subject::memory(), pg, sharded], 40);
}

/// P1 on a Citus cluster (a coordinator and two workers): the node function runs the same
/// statement on each shard's table, and answers as the model does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p1_on_citus() {
    let citus = tokio::task::spawn_blocking(|| tokenlease_testkit::TempCitus::start(2))
        .await
        .expect("start task")
        .expect("a Citus cluster (install the Citus extension; .ci/run builds it when missing)");
    let conn = citus.connection_string("postgres");
    let store = common::store_at(&conn, 2, true).await;
    let s = Subject::postgres("citus", Arc::new(store), &[conn]).await;
    agree(&[Subject::memory(), s], 12);
    // The table is distributed, so the store took the Citus path, through the node function.
    let admin = &Subject::postgres(
        "admin",
        Arc::new(MemoryStore::new()),
        &[citus.connection_string("postgres")],
    )
    .await
    .tables[0];
    let distributed: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_dist_partition \
             WHERE logicalrelid = 'tokenlease_buckets'::regclass",
            &[],
        )
        .await
        .expect("pg_dist_partition")
        .get(0);
    assert_eq!(distributed, 1);
    let on_shards: i64 = admin
        .query_one(
            "SELECT count(*) FROM tokenlease_buckets WHERE more_tokens IS NOT NULL",
            &[],
        )
        .await
        .expect("rows")
        .get(0);
    assert!(on_shards > 0, "rows of two limits on the shards");
}

/// P2: the retry of a denial is the longest wait of the limits, and the answer's `remaining` the
/// binding limit's: 5 a second (burst 5) and 20 an hour, after 20 takes the hour binds.
#[tokio::test]
async fn p2_retry_after_is_the_binding_limits() {
    let db = common::database().await;
    let store = common::store(&db, 1).await;
    let config = BucketConfig::new(t(5), Rate::per_second(5).expect("rate"))
        .expect("bucket")
        .with_limit(t(20), Rate::per_hour(20).expect("rate"))
        .expect("two limits");
    let mut granted = 0;
    for _ in 0..5 {
        granted += store
            .acquire(AcquireRequest::take("p2", config, t(1)))
            .await
            .expect("acquire")
            .granted
            .floor();
    }
    assert_eq!(granted, 5);
    let denied = store
        .acquire(AcquireRequest::take("p2", config, t(1)))
        .await
        .expect("acquire");
    assert!(denied.granted.is_zero());
    assert!(
        denied.retry_after <= Duration::from_millis(200),
        "{denied:?}"
    );
    // Three more seconds, one at a time, of the first limit: 15 more, then the hour's 20
    // are gone.
    let admin = db.client().await.expect("connect");
    let mut more = 0;
    for _ in 0..3 {
        admin
            .batch_execute("UPDATE tokenlease_buckets SET updated_us = updated_us - 1000000")
            .await
            .expect("shift");
        for _ in 0..6 {
            more += store
                .acquire(AcquireRequest::take("p2", config, t(1)))
                .await
                .expect("acquire")
                .granted
                .floor();
        }
    }
    assert_eq!(more, 15, "the second limit holds 15 of its 20");
    let denied = store
        .acquire(AcquireRequest::take("p2", config, t(1)))
        .await
        .expect("acquire");
    assert!(denied.granted.is_zero());
    assert_eq!(denied.remaining.floor(), 0);
    // One token of 20 an hour takes 180 s (less the few seconds moved).
    assert!(denied.retry_after >= Duration::from_secs(170), "{denied:?}");
    assert!(denied.retry_after <= Duration::from_secs(180), "{denied:?}");
}

/// P3: migration 0010 on a populated table. Rows written by the statements of migration 0009's
/// schema (one limit) take as buckets of one limit afterwards, and as the first limit of a
/// plan of several when their plan gains a second limit (the second starting full).
#[tokio::test]
async fn p3_migration_0010_keeps_the_rows_of_a_populated_table() {
    let db = common::database().await;
    let admin = db.client().await.expect("connect");
    // Back to the schema of 0009 (what the previous release ran), with its rows in it.
    admin
        .batch_execute(
            "ALTER TABLE tokenlease_buckets DROP COLUMN more_tokens, DROP COLUMN more_frac, \
                 DROP COLUMN more_capacity, DROP COLUMN more_rate; \
             DELETE FROM tokenlease_migrations WHERE version = 10;",
        )
        .await
        .expect("back to 0009");
    let one = BucketConfig::new(t(10), Rate::from_f64(RATES[0]).expect("rate")).expect("bucket");
    // The previous release's statement, as it ran before this migration (the one-key take is
    // unchanged), fills the table.
    let old = common::store_at(&db.connection_string(), 2, false).await;
    let keys: Vec<String> = (0..2_000).map(|i| format!("old-{i}")).collect();
    for chunk in keys.chunks(500) {
        let requests: Vec<AcquireRequest<'_>> = chunk
            .iter()
            .map(|k| AcquireRequest::take(k, one, t(4)))
            .collect();
        for a in old.acquire_many(&requests).await.expect("fill") {
            assert_eq!(a.granted.floor(), 4);
        }
    }
    drop(old);
    let report = tokenlease::store::migrate(&mut admin_client(&db).await)
        .await
        .expect("migrate");
    assert!(!report.is_noop(), "migration 0010 applied: {report:?}");
    let store = common::store_at(&db.connection_string(), 2, false).await;
    // As one limit: 6 left of 10.
    let a = store
        .acquire(AcquireRequest::take("old-1", one, t(6)))
        .await
        .expect("take");
    assert_eq!((a.granted.floor(), a.remaining.floor()), (6, 0));
    // As the first of two limits: the first holds 6, the new second is full (30).
    let both = BucketConfig::new(t(10), Rate::from_f64(RATES[0]).expect("rate"))
        .expect("bucket")
        .with_limit(t(30), Rate::from_f64(RATES[1]).expect("rate"))
        .expect("two");
    let requests: Vec<AcquireRequest<'_>> = (2..6)
        .map(|i| AcquireRequest::take(&keys[i], both, t(6)))
        .chain(std::iter::once(AcquireRequest::take(&keys[6], both, t(7))))
        .collect();
    let out = store
        .acquire_many(&requests)
        .await
        .expect("take two limits");
    for a in &out[..4] {
        assert_eq!((a.granted.floor(), a.remaining.floor()), (6, 0));
    }
    assert!(
        out[4].granted.is_zero(),
        "7 is more than the first limit's 6"
    );
    assert_eq!(out[4].remaining.floor(), 6);
    let conn = db.client().await.expect("connect");
    let row = conn
        .query_one(
            "SELECT more_tokens::bigint[], more_capacity::bigint[] FROM tokenlease_buckets \
             WHERE key = $1",
            &[&keys[2]],
        )
        .await
        .expect("row");
    let more: Vec<i64> = row.get(0);
    assert_eq!(more.len(), 1);
    assert_eq!(more[0] / 1_000_000_000, 24, "the second limit: 30 less 6");
    let untouched = conn
        .query_one(
            "SELECT count(*) FROM tokenlease_buckets WHERE more_tokens IS NULL",
            &[],
        )
        .await
        .expect("count");
    assert_eq!(
        untouched.get::<_, i64>(0),
        2_000 - 5,
        "only the rows taken as two limits"
    );
}

async fn admin_client(db: &TestDatabase) -> tokio_postgres::Client {
    client(&db.connection_string()).await
}
