//! Plans that hold at any table size (K8): the statements the store sends for a decision reach
//! the rows through the primary key's index whatever the planner believes of the table's size.
//! A session prepares its statements once and keeps the plan it made for them, so a plan made
//! while the table was empty (never analysed, or analysed while empty or tiny) is the plan the
//! session runs once the table holds hundreds of thousands of rows. Each test serves decisions
//! on a table in one such state, fills it to 200,000 rows without `ANALYZE`, serves again from
//! the same sessions, and then reads how often the table was scanned sequentially.

use crate::common;

use std::time::Duration;

use tokenlease::bucket::Tokens;
use tokenlease::store::{AcquireRequest, GiveBack, Hold, LeaseRef, PostgresStore, Store};
use tokenlease_testkit::TestDatabase;

/// Rows the table is filled to between the two rounds of decisions.
const FILLED: i64 = 200_000;

/// Decisions served on each side of the fill, per kind: enough for a session to move from
/// custom plans to its generic plan (PostgreSQL plans the first five executions of a prepared
/// statement for their parameters, then compares a generic plan, and keeps it when it is no
/// dearer).
const ROUNDS: usize = 12;

/// How many times `tokenlease_buckets` was scanned sequentially, once every other session on
/// this database has ended: a backend flushes its pending statistics to shared memory when it
/// exits, before its entry leaves `pg_stat_activity`, so the count then includes all of theirs.
async fn seq_scans(db: &TestDatabase) -> i64 {
    let conn = db.client().await.expect("connection");
    common::eventually(
        Duration::from_millis(20),
        Duration::from_secs(30),
        "the other sessions on the test database ended",
        async || {
            let others: i64 = conn
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE datname = current_database() AND pid <> pg_backend_pid() \
                       AND backend_type = 'client backend'",
                    &[],
                )
                .await
                .expect("pg_stat_activity")
                .get(0);
            if others == 0 { Ok(()) } else { Err(others) }
        },
    )
    .await;
    conn.batch_execute("SELECT pg_stat_clear_snapshot()")
        .await
        .expect("clear the statistics snapshot");
    conn.query_one(
        "SELECT seq_scan FROM pg_stat_user_tables WHERE relid = 'tokenlease_buckets'::regclass",
        &[],
    )
    .await
    .expect("pg_stat_user_tables")
    .get(0)
}

/// One round of decisions on `keys`: a take of one token on each (the many-key statement),
/// a take on the first alone (the one-key statement), a strict lease on the last
/// (`tokenlease_acquire_held`), each of which must be granted; then the returns: half a token
/// to each key of the many-key take and the strict lease settled, in one return statement,
/// each return credited.
async fn decide(store: &PostgresStore, keys: &[String], round: usize) {
    let config = common::bucket(1_000_000, 1.0);
    let requests: Vec<_> = keys
        .iter()
        .map(|k| AcquireRequest::take(k, config, Tokens::whole(1)))
        .collect();
    for got in store.acquire_many(&requests).await.expect("many-key take") {
        assert_eq!(
            got.granted,
            Tokens::whole(1),
            "many-key take, round {round}"
        );
    }
    let one = store
        .acquire(AcquireRequest::take(&keys[0], config, Tokens::whole(1)))
        .await
        .expect("one-key take");
    assert_eq!(one.granted, Tokens::whole(1), "one-key take, round {round}");
    let hold = Hold {
        holder: 7,
        lease_id: i64::try_from(round).expect("round"),
        kept: Tokens::ZERO,
        lifetime: Duration::from_secs(60),
    };
    let last = keys.last().expect("a key");
    let lease = AcquireRequest::lease(last, config, Tokens::whole(1), Tokens::whole(1)).held(hold);
    let strict = store.acquire(lease).await.expect("strict lease");
    assert_eq!(
        strict.granted,
        Tokens::whole(1),
        "strict lease, round {round}"
    );
    let base = i64::try_from(round).expect("round") * 1_000;
    let half = Tokens::from_nanos(500_000_000);
    let mut returns: Vec<GiveBack<'_>> = keys[..keys.len() - 1]
        .iter()
        .zip(base..)
        .map(|(key, id)| GiveBack {
            id,
            key,
            bucket: config,
            amount: half,
            lease: None,
        })
        .collect();
    returns.push(GiveBack {
        id: base + 999,
        key: last,
        bucket: config,
        amount: half,
        lease: Some(LeaseRef {
            holder: hold.holder,
            lease_id: hold.lease_id,
        }),
    });
    let credited = store.give_back(&returns).await.expect("returns");
    assert_eq!(credited, returns.len() as u64, "returns, round {round}");
}

/// Serves decisions from one prepared session on the table as `before` leaves it, fills the
/// table to [`FILLED`] rows without `ANALYZE`, serves again from the same session, and asserts
/// that nothing scanned the table sequentially. Autovacuum is off for the table (its `ANALYZE`
/// would invalidate the session's plans and hide what it keeps).
async fn keeps_to_the_index(before: &str) {
    let db = common::database().await;
    let admin = db.client().await.expect("connection");
    admin
        .batch_execute(&format!(
            "ALTER TABLE tokenlease_buckets SET (autovacuum_enabled = false); {before}"
        ))
        .await
        .expect("prepare the table");
    drop(admin);
    let scans = seq_scans(&db).await;

    // One session, prepared (the default), so every call runs on the plans it keeps.
    let store = common::prepared_store_at(&db.connection_string(), 1).await;
    let small: Vec<String> = (0..3).map(|i| format!("plans:{i}")).collect();
    for round in 0..ROUNDS {
        decide(&store, &small, round).await;
    }

    let admin = db.client().await.expect("connection");
    admin
        .execute(
            "INSERT INTO tokenlease_buckets \
                 (key, tokens, frac, capacity, refill_per_second, updated_us, refilled) \
             SELECT 'fill:' || i, 1000000000000000, 0, 1000000000000000, 1000000000, \
                    (extract(epoch FROM now()) * 1000000)::bigint, 0 \
             FROM generate_series(1, $1::bigint) AS i",
            &[&FILLED],
        )
        .await
        .expect("fill the table");
    drop(admin);

    for round in 0..ROUNDS {
        // Keys that have rows among the fill, and one new key each round.
        let mut keys: Vec<String> = (0..3)
            .map(|i| format!("fill:{}", 1 + (round * 7_919 + i * 104_729) % 200_000))
            .collect();
        keys.push(format!("plans:new:{round}"));
        keys.sort();
        decide(&store, &keys, ROUNDS + round).await;
    }
    drop(store);

    assert_eq!(
        seq_scans(&db).await - scans,
        0,
        "the store's decisions scanned tokenlease_buckets sequentially"
    );
}

/// K8: a freshly migrated table, never analysed (the planner assumes ten pages), then filled.
#[tokio::test]
async fn decisions_keep_to_the_index_on_a_fresh_table_that_grows() {
    keeps_to_the_index("").await;
}

/// K8: a table analysed while empty (the planner knows it has no rows), then filled.
#[tokio::test]
async fn decisions_keep_to_the_index_on_a_table_analysed_empty_that_grows() {
    keeps_to_the_index("ANALYZE tokenlease_buckets").await;
}

/// K8: a table analysed at 50 rows, one page (where a sequential scan is the cheaper plan),
/// then filled.
#[tokio::test]
async fn decisions_keep_to_the_index_on_a_table_analysed_tiny_that_grows() {
    keeps_to_the_index(
        "INSERT INTO tokenlease_buckets \
             (key, tokens, frac, capacity, refill_per_second, updated_us, refilled) \
         SELECT 'tiny:' || i, 1000000000000000, 0, 1000000000000000, 1000000000, \
                (extract(epoch FROM now()) * 1000000)::bigint, 0 \
         FROM generate_series(1, 50) AS i; \
         ANALYZE tokenlease_buckets",
    )
    .await;
}
