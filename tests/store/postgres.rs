//! SQL correctness on the real server (B2, B4, B5, B6, B7, and "the database decides as
//! the pure bucket does").

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use tokenlease::bucket::{BucketState, Timestamp, Tokens};
use tokenlease::clock::timestamp_from_system_time;
use tokenlease::error::{Error, KeyError, MAX_KEY_BYTES};
use tokenlease::store::{AcquireRequest, GiveBack, PostgresStore, Store};
use tokenlease::{DecidedBy, Limiter};
use tokenlease_testkit::TestDatabase;

/// Runs `sql` on a session of its own (not one of the store's).
async fn exec(db: &TestDatabase, sql: &str) {
    let conn = db.client().await.expect("connection");
    conn.batch_execute(sql).await.expect(sql);
}

/// `k` callers take one token each from `key` at the same moment; the whole tokens granted.
async fn take_at_once(
    store: &Arc<PostgresStore>,
    key: &str,
    config: tokenlease::bucket::BucketConfig,
    k: usize,
) -> u64 {
    let barrier = Arc::new(tokio::sync::Barrier::new(k));
    let tasks: Vec<_> = (0..k)
        .map(|_| {
            let (store, key, barrier) = (Arc::clone(store), key.to_owned(), Arc::clone(&barrier));
            tokio::spawn(async move {
                barrier.wait().await;
                store
                    .acquire(AcquireRequest::take(&key, config, Tokens::whole(1)))
                    .await
                    .expect("acquire")
                    .granted
                    .floor()
            })
        })
        .collect();
    let mut granted = 0;
    for task in tasks {
        granted += task.await.expect("task");
    }
    granted
}

/// How many rows `key` has, and the tokens of the one with fewest.
async fn rows_of(db: &TestDatabase, key: &str) -> (i64, Tokens) {
    let conn = db.client().await.expect("connection");
    let row = conn
        .query_one(
            "SELECT count(*), min(tokenlease_amount(tokens, frac))::numeric(38, 18)::text \
             FROM tokenlease_buckets WHERE key = $1",
            &[&key],
        )
        .await
        .expect("count");
    let tokens = row
        .get::<_, Option<String>>(1)
        .map_or(Tokens::ZERO, |t| t.parse().expect("tokens"));
    (row.get(0), tokens)
}

/// For the same timeline, the database's decisions equal the pure bucket's, to the nanotoken.
/// The timeline is the database's own: each step first ages the row by a chosen amount, then
/// takes; the model is driven with the `now()` the statement returns.
#[tokio::test]
async fn database_decides_exactly_as_the_pure_bucket() {
    let db = common::database().await;
    let store = common::store(&db, 1).await;
    let config = common::bucket(100, 2.0 / 3.0);
    let mut model: Option<BucketState> = None;
    // A fixed pseudo-random walk: ages in ms and costs in thousandths of a token.
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |m: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % m
    };
    let (mut allowed, mut denied) = (0, 0);
    for step in 0..400 {
        let age_ms = next(4_000);
        let cost = Tokens::from_atto(u128::from(1 + next(20_000)) * 1_000_000_000_000_000);
        if model.is_some() {
            exec(
                &db,
                &format!("UPDATE tokenlease_buckets SET updated_us = updated_us - {age_ms} * 1000"),
            )
            .await;
            if let Some(m) = model.as_mut() {
                m.last_refill =
                    Timestamp::from_nanos(m.last_refill.as_nanos() - age_ms * 1_000_000);
            }
        }
        let got = store
            .acquire(AcquireRequest::take("model", config, cost))
            .await
            .expect("acquire");
        let now = timestamp_from_system_time(got.store_now);
        let state = model.unwrap_or(BucketState::full(&config, now));
        let (next_state, outcome) = state.take(&config, now, cost).expect("cost fits");
        assert_eq!(
            got.granted.is_zero(),
            !outcome.is_allowed(),
            "step {step}: decision differs (cost {cost}, model {state:?})"
        );
        assert_eq!(
            got.remaining, next_state.tokens,
            "step {step}: remaining differs"
        );
        if outcome.is_allowed() {
            allowed += 1;
        } else {
            denied += 1;
        }
        model = Some(next_state);
    }
    assert!(
        allowed > 50 && denied > 50,
        "the walk exercises both: {allowed} allowed, {denied} denied"
    );
}

/// B2: the first touch of a new key by k concurrent callers (Bucket4j's parallel
/// initialisation bug): exactly min(k, C) granted, one row, holding C − granted.
#[tokio::test]
async fn first_touch_race_creates_one_row_and_grants_exactly() {
    let db = common::database().await;
    for k in [4usize, 64] {
        let store = Arc::new(common::store(&db, k as u32).await);
        let config = common::bucket(10, 1.0 / 60.0);
        let key = format!("first-touch-{k}");
        let granted = take_at_once(&store, &key, config, k).await;
        let expected = k.min(10) as u64;
        assert_eq!(granted, expected, "k = {k}");
        let (rows, tokens) = rows_of(&db, &key).await;
        assert_eq!(rows, 1, "exactly one row");
        // At 1 token/minute, the few milliseconds of the race add well under a token.
        assert_eq!(tokens.floor(), 10 - expected, "k = {k}");
    }
}

/// B7: a call of one key updates its row first and skips the locking step (migration 0006); a row
/// that is not there (deleted as full by the idle cleanup, or never made) goes through the
/// locking step and comes back full less the take. 32 callers at once on one key whose row was
/// just deleted, five rounds: each round grants exactly the capacity (refill is one token a
/// minute), once, and leaves one row holding what is left.
#[tokio::test]
async fn one_key_calls_whose_row_comes_and_goes_grant_exactly() {
    let db = common::database().await;
    let store = Arc::new(common::store(&db, 8).await);
    let config = common::bucket(10, 1.0 / 60.0);
    let key = "one-key-path";
    for round in 0..5 {
        exec(
            &db,
            "DELETE FROM tokenlease_buckets WHERE key = 'one-key-path'",
        )
        .await;
        let granted = take_at_once(&store, key, config, 32).await;
        assert_eq!(granted, 10, "round {round}: a full bucket of 10, once");
        let (rows, tokens) = rows_of(&db, key).await;
        assert_eq!(rows, 1, "round {round}: one row");
        assert_eq!(
            tokens.floor(),
            0,
            "round {round}: the row holds what is left"
        );
        // The row exists now: a lone call takes the one-key path and is denied.
        let denied = store
            .acquire(AcquireRequest::take(key, config, Tokens::whole(1)))
            .await
            .expect("acquire");
        assert!(
            denied.granted.is_zero(),
            "round {round}: empty until refilled"
        );
    }
}

/// B4: a stored refill time in the future (another writer's clock ahead, or a failover to a
/// host whose clock lags) refills nothing and is not rewound; one in 1970 gives a full bucket.
#[tokio::test]
async fn refill_time_in_the_future_or_in_1970() {
    let db = common::database().await;
    let store = common::store(&db, 1).await;
    let config = common::bucket(100, 50.0);
    let take = |cost| AcquireRequest::take("skew", config, Tokens::whole(cost));
    store.acquire(take(100)).await.expect("drain");
    exec(
        &db,
        "UPDATE tokenlease_buckets \
         SET updated_us = (extract(epoch FROM now() + interval '10 seconds') * 1000000)::bigint, \
             tokens = 5000000000",
    )
    .await;
    let before = store.inspect("skew").await.expect("inspect").expect("row");
    let a = store.acquire(take(1)).await.expect("acquire");
    assert_eq!(a.granted, Tokens::whole(1));
    assert_eq!(
        a.remaining,
        Tokens::whole(4),
        "no refill while the refill time is ahead"
    );
    let after = store.inspect("skew").await.expect("inspect").expect("row");
    assert_eq!(
        after.updated_at, before.updated_at,
        "the refill time is not rewound"
    );
    let denied = store.acquire(take(10)).await.expect("acquire");
    assert!(denied.granted.is_zero());
    // 6 tokens at 50/s take 120 ms, after the ~10 s that the refill time is ahead.
    assert!(
        denied.retry_after > Duration::from_secs(9),
        "{:?}",
        denied.retry_after
    );
    assert!(
        denied.retry_after < Duration::from_secs(11),
        "{:?}",
        denied.retry_after
    );

    exec(
        &db,
        "UPDATE tokenlease_buckets SET updated_us = 0, tokens = 0",
    )
    .await;
    let a = store.acquire(take(1)).await.expect("acquire");
    assert_eq!(a.granted, Tokens::whole(1));
    assert_eq!(
        a.remaining,
        Tokens::whole(99),
        "56 years refill to exactly the capacity"
    );
    let row = store.inspect("skew").await.expect("inspect").expect("row");
    assert!(row.updated_at > std::time::UNIX_EPOCH + Duration::from_secs(1_000_000_000));
}

/// B5: the table is logged, and the domains of its columns refuse NaN, infinities and
/// out-of-range values (SQLSTATE 23514, or 22P02 and 22003 before a value is a bigint at all).
#[tokio::test]
async fn schema_refuses_nan_infinity_and_out_of_range_values() {
    let db = common::database().await;
    let conn = db.client().await.expect("connection");
    let persistence: String = conn
        .query_one(
            "SELECT relpersistence::text FROM pg_class WHERE relname = 'tokenlease_buckets'",
            &[],
        )
        .await
        .expect("relpersistence")
        .get(0);
    assert_eq!(persistence, "p", "permanent (logged), not UNLOGGED");
    // Integer columns: NaN and infinities are not bigint values at all (22P02), out-of-range
    // numbers (22003) and values outside the bounds of the columns' domains (23514) are refused
    // too. (A row's tokens above its capacity is a full bucket to every statement.)
    let bad = [
        ("tokens", "'NaN'"),
        ("tokens", "-1"),
        ("tokens", "8000000000000000001"),
        ("tokens", "'Infinity'"),
        ("frac", "-1"),
        ("frac", "1000000"),
        ("capacity", "'NaN'"),
        ("capacity", "0"),
        ("capacity", "-5"),
        ("capacity", "8000000000000000001"),
        ("capacity", "'Infinity'"),
        ("refill_per_second", "'NaN'"),
        ("refill_per_second", "0"),
        ("refill_per_second", "'-Infinity'"),
        ("refill_per_second", "'Infinity'"),
        ("refill_per_second", "1000000000000000001"),
        ("refill_per_second", "99999999999999999999"),
        ("refilled", "-1"),
        ("refilled", "8000000000000000001"),
        ("updated_us", "'infinity'"),
    ];
    for (column, value) in bad {
        let mut values = [
            ("tokens", "1000000000"),
            ("frac", "0"),
            ("capacity", "10000000000"),
            ("refill_per_second", "1000000000"),
            ("refilled", "0"),
            ("updated_us", "0"),
        ];
        for v in values.iter_mut() {
            if v.0 == column {
                v.1 = value;
            }
        }
        let sql = format!(
            "INSERT INTO tokenlease_buckets \
             (key, tokens, frac, capacity, refill_per_second, refilled, updated_us) \
             VALUES ('bad', {}, {}, {}, {}, {}, {})",
            values[0].1, values[1].1, values[2].1, values[3].1, values[4].1, values[5].1
        );
        let err = conn.batch_execute(&sql).await.expect_err(&sql);
        let code = err.code().map(|c| c.code().to_owned());
        assert!(
            matches!(
                code.as_deref(),
                Some("23514") | Some("22003") | Some("22P02")
            ),
            "{column} = {value}: {err:?}"
        );
    }
}

/// B6: hostile keys. SQL in a key is stored verbatim (bind parameters only); NUL bytes, invalid
/// UTF-8 and overlong keys are refused before the database, so its log shows no 22021 or 54000.
#[tokio::test]
async fn hostile_keys_never_reach_sql_as_text() {
    let db = common::database().await;
    let store = common::store(&db, 2).await;
    let limiter = Limiter::builder(store.clone()).build();
    let plan = common::plan(10, 1.0);
    let injection = "'; DROP TABLE tokenlease_buckets; --";
    let d = limiter
        .try_acquire_with(&plan, injection, 1.0)
        .await
        .expect("decision");
    assert!(d.allowed);
    assert_eq!(d.decided_by, DecidedBy::Store);
    let row = store
        .inspect(injection)
        .await
        .expect("inspect")
        .expect("row stored verbatim");
    assert_eq!(row.key, injection);

    let nul = "a\0b";
    assert!(matches!(
        limiter.try_acquire_with(&plan, nul, 1.0).await,
        Err(Error::InvalidKey(KeyError::Nul { offset: 1 }))
    ));
    assert!(matches!(
        tokenlease::error::validate_key_bytes(b"ok\xff\xfe"),
        Err(KeyError::NotUtf8 { offset: 2 })
    ));
    // Incompressible: a 2,705-byte key and a 1 MiB key.
    let mut x: u32 = 12345;
    let random: String = (0..(1 << 20))
        .map(|_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            char::from(b'!' + (x >> 16) as u8 % 90)
        })
        .collect();
    for len in [MAX_KEY_BYTES + 1, 2705, 1 << 20] {
        let key = &random[..len];
        assert!(
            matches!(
                limiter.try_acquire_with(&plan, key, 1.0).await,
                Err(Error::InvalidKey(KeyError::TooLong { .. }))
            ),
            "a {len}-byte key is refused"
        );
    }
    let at_limit = &random[..MAX_KEY_BYTES];
    assert!(
        limiter
            .try_acquire_with(&plan, at_limit, 1.0)
            .await
            .expect("decision")
            .allowed
    );

    let conn = db.client().await.expect("connection");
    let n: i64 = conn
        .query_one("SELECT count(*) FROM tokenlease_buckets", &[])
        .await
        .expect("table intact")
        .get(0);
    assert_eq!(n, 2);
    if let Some(server) = db.server() {
        let log = server.log_contents();
        assert!(
            !log.contains("22021") && !log.contains("invalid byte sequence"),
            "{log}"
        );
        assert!(
            !log.contains("54000") && !log.contains("index row size"),
            "{log}"
        );
    }
}

/// Costs that can never fit are typed errors and make no store call.
#[tokio::test]
async fn impossible_costs_are_errors_without_a_store_call() {
    let db = common::database().await;
    let store = common::store(&db, 1).await;
    let limiter = Limiter::builder(store.clone()).build();
    let plan = common::plan(100, 50.0);
    for cost in [
        0.0,
        -1.0,
        f64::NAN,
        f64::INFINITY,
        100.000_001,
        101.0,
        1e300,
    ] {
        let err = limiter
            .try_acquire_with(&plan, "k", cost)
            .await
            .expect_err("refused");
        assert!(matches!(err, Error::InvalidCost { .. }), "{cost}: {err}");
        assert!(
            err.to_string().contains("\"test\""),
            "names the plan: {err}"
        );
    }
    assert!(
        store.inspect("k").await.expect("inspect").is_none(),
        "no row: no call"
    );
}

/// The idle-row task deletes buckets that refilled to full, and keeps busy ones.
#[tokio::test]
async fn the_idle_cleanup_task_deletes_full_rows_in_batches() {
    let db = common::database().await;
    let store = common::store(&db, 2).await;
    let config = common::bucket(10, 1.0);
    for i in 0..25 {
        let key = format!("idle-{i}");
        store
            .acquire(AcquireRequest::take(&key, config, Tokens::whole(1)))
            .await
            .expect("acquire");
    }
    store
        .acquire(AcquireRequest::take("busy", config, Tokens::whole(10)))
        .await
        .expect("acquire");
    // The idle rows refilled long ago; "busy" is still 10 tokens short.
    exec(
        &db,
        "UPDATE tokenlease_buckets SET updated_us = updated_us - 60000000 WHERE key <> 'busy'",
    )
    .await;
    let cleanup = tokenlease::store::IdleCleanup::spawn(
        Arc::new(store.clone()),
        Duration::from_millis(20),
        10,
    );
    let conn = db.client().await.expect("connection");
    common::eventually(
        Duration::from_millis(20),
        Duration::from_secs(5),
        "one row left (rows left)",
        async || {
            let n: i64 = conn
                .query_one("SELECT count(*) FROM tokenlease_buckets", &[])
                .await
                .expect("count")
                .get(0);
            if n == 1 { Ok(()) } else { Err(n) }
        },
    )
    .await;
    drop(cleanup);
    assert!(store.inspect("busy").await.expect("inspect").is_some());
}

/// A refund puts back what a decision took: into the row in direct mode, capped at capacity.
#[tokio::test]
async fn a_refund_puts_tokens_back_into_the_bucket() {
    let db = common::database().await;
    let store = common::store(&db, 2).await;
    let limiter = Limiter::builder(store.clone()).build();
    let plan = common::plan(10, 0.001);
    for _ in 0..10 {
        assert!(
            limiter
                .try_acquire_with(&plan, "refund", 1.0)
                .await
                .expect("decision")
                .allowed
        );
    }
    assert!(
        !limiter
            .try_acquire_with(&plan, "refund", 1.0)
            .await
            .expect("decision")
            .allowed
    );
    limiter.refund(&plan, "refund", 3.0).await.expect("refund");
    let row = store
        .inspect("refund")
        .await
        .expect("inspect")
        .expect("row");
    assert_eq!(row.tokens_now.floor(), 3, "{row:?}");
    limiter.refund(&plan, "refund", 10.0).await.expect("refund");
    let row = store
        .inspect("refund")
        .await
        .expect("inspect")
        .expect("row");
    assert_eq!(row.tokens_now, Tokens::whole(10), "capped at capacity");
    assert!(
        limiter.refund(&plan, "refund", 11.0).await.is_err(),
        "above capacity"
    );
}

/// B9 at every scale: the one-key statement (one request a call) and the many-key statement
/// (every key in one call), round after round on the same rows, decide as the pure bucket to
/// the attotoken for capacities from one nanotoken's worth of tokens to `MAX_CAPACITY`, rates from
/// one nanotoken a second to `Rate::MAX`, rows aged by up to ten years (a refill product far
/// beyond 64 bits before its cap), a few ahead of the clock, capacities changed between rounds
/// (rows above their new capacity), plain takes, coalesced takes and leases of random costs.
#[tokio::test]
async fn both_take_statements_answer_as_the_pure_bucket_at_every_scale() {
    use tokenlease::bucket::{BucketConfig, Rate};
    use tokenlease::policy::MAX_CAPACITY;
    const N: usize = 160;
    const NANO: u128 = 1_000_000_000;
    let db = common::database().await;
    let store = common::store(&db, 1).await;
    let keys: Vec<String> = (0..N).map(|i| format!("scale:{i:03}")).collect();
    // A fixed sequence of pseudo-random numbers (PCG's multiplier), the same on every run.
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |bound: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed ^ (seed >> 29)) % bound.max(1)
    };
    let capacities = [1, 3, 100, 9_999, 1_000_000, 123_456_789, MAX_CAPACITY];
    let rates = [
        1,
        3,
        666_666_667,
        50_000_000_000,
        1_000_000_000_000_007,
        Rate::MAX.as_nanos_per_second(),
    ];
    let mut model: Vec<Option<BucketState>> = vec![None; N];
    let (mut granted, mut denied) = (0, 0);
    for round in 0..6 {
        if round > 0 {
            // Age each stored row by its own amount: up to ten years, up to a minute or up to
            // 4 s back, or up to 0.5 s ahead.
            let (aged, micros): (Vec<&str>, Vec<i64>) = (0..N)
                .filter_map(|i| {
                    let state = model[i].as_mut()?;
                    let us = match next(4) {
                        0 => next(315_360_000_000_000) as i64,
                        1 => next(60_000_000) as i64,
                        2 => next(4_000_000) as i64,
                        _ => -(next(500_000) as i64),
                    };
                    state.last_refill = Timestamp::from_nanos(
                        state
                            .last_refill
                            .as_nanos()
                            .checked_add_signed(-us * 1_000)?,
                    );
                    Some((keys[i].as_str(), us))
                })
                .unzip();
            let conn = db.client().await.expect("connection");
            conn.execute(
                "UPDATE tokenlease_buckets AS b
                 SET updated_us = b.updated_us - a.us
                 FROM unnest($1::text[], $2::int8[]) AS a(key, us) WHERE b.key = a.key",
                &[&aged, &micros],
            )
            .await
            .expect("age the rows");
        }
        let requests: Vec<AcquireRequest<'_>> = (0..N)
            .map(|i| {
                let capacity = capacities[next(capacities.len() as u64) as usize];
                let rate = match next(4) {
                    0 => 1 + next(1_000_000_000_000_000_000),
                    _ => rates[next(rates.len() as u64) as usize],
                };
                let config = BucketConfig::new(
                    Tokens::whole(capacity),
                    Rate::from_nanos_per_second(rate).expect("rate"),
                )
                .expect("bucket");
                // A cost of whole nanotokens, at most the capacity; sometimes a small one.
                let cap_nanos = capacity.saturating_mul(1_000_000_000);
                let cost_nanos = match next(3) {
                    0 => 1 + next(1_000),
                    _ => 1 + next(cap_nanos),
                };
                let cost = Tokens::from_atto(u128::from(cost_nanos) * NANO);
                match next(3) {
                    0 => AcquireRequest::take(&keys[i], config, cost),
                    1 => AcquireRequest {
                        want: Tokens::from_atto(
                            u128::from(cost_nanos * (cap_nanos / cost_nanos).min(3)) * NANO,
                        ),
                        ..AcquireRequest::take(&keys[i], config, cost)
                    },
                    _ => AcquireRequest::lease(
                        &keys[i],
                        config,
                        cost,
                        Tokens::from_atto(
                            u128::from(cost_nanos.saturating_mul(4).min(cap_nanos)) * NANO,
                        ),
                    ),
                }
            })
            .collect();
        // Even rounds one request a call (the one-key statement), odd rounds all in one call.
        let got = if round % 2 == 0 {
            let mut got = Vec::with_capacity(N);
            for request in &requests {
                got.extend(
                    store
                        .acquire_many(std::slice::from_ref(request))
                        .await
                        .expect("acquire"),
                );
            }
            got
        } else {
            store.acquire_many(&requests).await.expect("acquire_many")
        };
        assert_eq!(got.len(), N);
        for (i, (request, got)) in requests.iter().zip(&got).enumerate() {
            let now = timestamp_from_system_time(got.store_now);
            let config = request.bucket;
            let refilled = model[i]
                .unwrap_or(BucketState::full(&config, now))
                .refill(&config, now);
            let expected = request.grantable(refilled.tokens);
            assert_eq!(got.granted, expected, "round {round}, key {i}: granted");
            let remaining = refilled.tokens.saturating_sub(expected);
            assert_eq!(
                got.remaining, remaining,
                "round {round}, key {i}: remaining ({request:?})"
            );
            if expected.is_zero() {
                denied += 1;
            } else {
                granted += 1;
            }
            model[i] = Some(BucketState {
                tokens: remaining,
                ..refilled
            });
        }
    }
    assert!(
        granted > 200 && denied > 50,
        "the statements exercise both: {granted} granted, {denied} denied"
    );
}

/// One statement of 1,024 keys answers every key exactly as the pure bucket would: half the keys
/// new, half stored and aged by a different amount each (a few with a refill time in the
/// future), under plain takes, coalesced takes and leases, some with a capacity other than the
/// stored one, keys sent in no particular order. Twice, so the second statement runs on the plan
/// the session cached from the first.
#[tokio::test]
async fn a_statement_of_1024_keys_answers_each_key_as_the_pure_bucket() {
    const N: usize = 1024;
    let db = common::database().await;
    let store = common::store(&db, 1).await;
    // Keys in a scrambled order (the function sorts them itself).
    let keys: Vec<String> = (0..N)
        .map(|i| format!("many:{:04}", (i * 389) % N))
        .collect();
    let config = |i: usize, round: usize| {
        let capacity = 8 + (i as u64 * 13 + round as u64 * 7) % 40;
        common::bucket(capacity, 0.05 + (i % 7) as f64 * 0.2)
    };
    let request = |i: usize, round: usize| {
        let config = config(i, round);
        let cost = Tokens::from_atto(
            u128::from(1 + (i as u64 * 31 + round as u64) % 8_000) * 1_000_000_000_000_000,
        );
        match (i + round) % 3 {
            0 => AcquireRequest::take(&keys[i], config, cost),
            1 => AcquireRequest {
                // Three coalesced takes of one cost.
                want: Tokens::from_atto(cost.as_atto() * 3),
                ..AcquireRequest::take(&keys[i], config, cost)
            },
            _ => AcquireRequest::lease(&keys[i], config, cost, Tokens::whole(4 + (i as u64 % 9))),
        }
    };
    let mut model: Vec<Option<BucketState>> = vec![None; N];
    let (mut granted, mut denied) = (0, 0);
    for round in 0..3 {
        // Round 0 touches the even keys only; later rounds every key, so round 1 has new keys
        // and stored keys side by side.
        let chosen: Vec<usize> = (0..N).filter(|i| round > 0 || i % 2 == 0).collect();
        if round > 0 {
            // Age each stored row by its own amount: up to 4 s back, or up to 0.5 s ahead.
            let (aged, micros): (Vec<&str>, Vec<i64>) = (0..N)
                .filter_map(|i| {
                    let state = model[i].as_mut()?;
                    let us = ((i as i64 * 7_919 + round as i64 * 104_729) % 4_500_000) - 500_000;
                    let ns = us * 1_000;
                    state.last_refill = Timestamp::from_nanos(
                        state.last_refill.as_nanos().checked_add_signed(-ns)?,
                    );
                    Some((keys[i].as_str(), us))
                })
                .unzip();
            let conn = db.client().await.expect("connection");
            conn.execute(
                "UPDATE tokenlease_buckets AS b
                 SET updated_us = b.updated_us - a.us
                 FROM unnest($1::text[], $2::int8[]) AS a(key, us) WHERE b.key = a.key",
                &[&aged, &micros],
            )
            .await
            .expect("age the rows");
        }
        let requests: Vec<AcquireRequest<'_>> = chosen.iter().map(|&i| request(i, round)).collect();
        let got = store.acquire_many(&requests).await.expect("acquire_many");
        assert_eq!(got.len(), requests.len());
        for ((&i, request), got) in chosen.iter().zip(&requests).zip(&got) {
            let now = timestamp_from_system_time(got.store_now);
            let config = request.bucket;
            let refilled = model[i]
                .unwrap_or(BucketState::full(&config, now))
                .refill(&config, now);
            let expected = request.grantable(refilled.tokens);
            if request.min == request.want {
                // A plain take: the pure bucket's own take agrees.
                let (_, outcome) = model[i]
                    .unwrap_or(BucketState::full(&config, now))
                    .take(&config, now, request.min)
                    .expect("cost fits");
                assert_eq!(
                    outcome.is_allowed(),
                    !expected.is_zero(),
                    "round {round}, key {i}"
                );
            }
            assert_eq!(got.granted, expected, "round {round}, key {i}: granted");
            let remaining = refilled.tokens.saturating_sub(expected);
            assert_eq!(
                got.remaining, remaining,
                "round {round}, key {i}: remaining"
            );
            if expected.is_zero() {
                denied += 1;
            } else {
                granted += 1;
            }
            model[i] = Some(BucketState {
                tokens: remaining,
                ..refilled
            });
        }
    }
    assert!(
        granted > 500 && denied > 100,
        "the statements exercise both: {granted} granted, {denied} denied"
    );

    // One give-back of all 1,024 keys credits each as the pure bucket's credit does (refilled to
    // the statement's now(), which the row's refill time then is, unless it was ahead); its
    // retry, with half the keys, credits nothing.
    let backs: Vec<GiveBack<'_>> = (0..N)
        .map(|i| GiveBack {
            id: 1_000 + i as i64,
            key: &keys[i],
            bucket: config(i, 2),
            amount: Tokens::from_atto(
                u128::from(1 + (i as u64 * 17) % 5_000) * 1_000_000_000_000_000,
            ),
            lease: None,
        })
        .collect();
    assert_eq!(store.give_back(&backs).await.expect("give back"), N as u64);
    let retry: Vec<GiveBack<'_>> = backs.iter().copied().step_by(2).collect();
    assert_eq!(store.give_back(&retry).await.expect("retry"), 0);
    let conn = db.client().await.expect("connection");
    let rows = conn
        .query(
            "SELECT key, tokenlease_amount(tokens, frac)::numeric(38, 18)::text, \
                    timestamptz 'epoch' + updated_us * interval '1 microsecond' \
             FROM tokenlease_buckets WHERE key LIKE 'many:%'",
            &[],
        )
        .await
        .expect("rows");
    assert_eq!(rows.len(), N);
    let by_key: std::collections::HashMap<String, (Tokens, std::time::SystemTime)> = rows
        .iter()
        .map(|r| {
            let tokens: String = r.get(1);
            (r.get(0), (tokens.parse().expect("tokens"), r.get(2)))
        })
        .collect();
    for (i, back) in backs.iter().enumerate() {
        let (tokens, updated_at) = by_key[back.key];
        let at = timestamp_from_system_time(updated_at);
        let state = model[i]
            .expect("stored")
            .credit(&back.bucket, at, back.amount);
        assert_eq!(tokens, state.tokens, "key {i}: credited");
    }
}

/// The strict-lease function pins its search_path: a session whose search_path puts another
/// `tokenlease_buckets` first still takes from the limiter's table, and the decoy is untouched.
#[tokio::test]
async fn the_acquire_function_ignores_the_callers_search_path() {
    let db = common::database().await;
    let conn = db.client().await.expect("connection");
    conn.batch_execute(
        "CREATE SCHEMA decoy;
         CREATE TABLE decoy.tokenlease_buckets (LIKE public.tokenlease_buckets INCLUDING ALL);
         SET search_path = decoy, public;",
    )
    .await
    .expect("decoy");
    let row = conn
        .query_one(
            "SELECT granted FROM tokenlease_acquire_held(ARRAY['pinned'], \
             ARRAY[10000000000]::bigint[], ARRAY[1000000000]::bigint[], \
             ARRAY[3000000000]::bigint[], ARRAY[3000000000]::bigint[], \
             ARRAY[3000000000]::bigint[])",
            &[],
        )
        .await
        .expect("call");
    assert_eq!(row.get::<_, i64>(0), 3_000_000_000);
    let counts = conn
        .query_one(
            "SELECT (SELECT count(*) FROM decoy.tokenlease_buckets), \
                    (SELECT tokens FROM public.tokenlease_buckets WHERE key = 'pinned')",
            &[],
        )
        .await
        .expect("counts");
    assert_eq!(counts.get::<_, i64>(0), 0, "the decoy table is untouched");
    assert_eq!(counts.get::<_, i64>(1), 7_000_000_000);
    conn.batch_execute("RESET search_path; DROP SCHEMA decoy CASCADE")
        .await
        .expect("reset");
}

/// The server's `lock_timeout` bounds a call of the function like any statement: with another
/// session holding the row's lock, the call (given a 5 s client timeout) fails after the 150 ms
/// lock timeout with the server's lock-timeout error, and succeeds once the lock is gone.
#[tokio::test]
async fn the_lock_timeout_ends_a_call_waiting_inside_the_function() {
    use std::time::Instant;
    let db = common::database().await;
    let store = PostgresStore::builder(&db.connection_string())
        .expect("connection string")
        .pool_size(1)
        .call_timeout(Duration::from_secs(5))
        .pool_wait_timeout(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(5))
        .statement_timeout(Duration::from_secs(5))
        .lock_timeout(Duration::from_millis(150))
        .build()
        .await
        .expect("store");
    let config = common::bucket(10, 1.0);
    let take = AcquireRequest::take("locked", config, Tokens::whole(1));
    store.acquire(take).await.expect("first take");
    let mut holder = db.client().await.expect("connect");
    let tx = holder.transaction().await.expect("begin");
    tx.batch_execute("SELECT 1 FROM tokenlease_buckets WHERE key = 'locked' FOR UPDATE")
        .await
        .expect("lock the row");
    let started = Instant::now();
    let err = store.acquire(take).await.expect_err("the row is locked");
    let waited = started.elapsed();
    assert!(err.to_string().contains("lock timeout"), "{err}");
    assert!(
        waited >= Duration::from_millis(150) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    tx.rollback().await.expect("release");
    let got = store
        .acquire(take)
        .await
        .expect("take after the lock is gone");
    assert_eq!(got.granted, Tokens::whole(1));
}
