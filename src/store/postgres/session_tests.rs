//! Tests that read the store's own sessions (its pool): which statements a session has
//! prepared, its `synchronous_commit` and `statement_timeout`, the strict take's commit on it,
//! (the pool a built store opens is checked with a limiter over it, in `src/assembled_tests.rs`). Against a real throwaway PostgreSQL
//! (`tokenlease_testkit`, which links its own copy of this crate: only connection strings
//! cross over). They were integration tests in `tests/store/postgres.rs` when the pool was
//! reachable from outside the crate; it is not part of the API.

use std::time::Duration;

use bb8::Pool;
use tokenlease_testkit::TestDatabase;

use super::{ConnectionManager, PostgresStore};
use crate::bucket::{BucketConfig, Rate, Tokens};
use crate::store::{AcquireRequest, Store};

fn pool_of(store: &PostgresStore) -> &Pool<ConnectionManager> {
    store.pool()
}

/// A fresh database with migrations applied (DATABASE_URL's server, or a throwaway cluster).
async fn database() -> TestDatabase {
    TestDatabase::create()
        .await
        .expect("a test database (install PostgreSQL server binaries or set DATABASE_URL)")
}

/// A store on `connection` without migrations, preparing its statements once per session or
/// sending them unnamed, with generous timeouts (as `tests/common`'s stores).
async fn store_at(connection: &str, pool: u32, prepared: bool) -> PostgresStore {
    PostgresStore::builder(connection)
        .expect("connection string")
        .pool_size(pool)
        .migrate(false)
        .prepared_statements(prepared)
        .call_timeout(Duration::from_secs(5))
        .pool_wait_timeout(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(5))
        .statement_timeout(Duration::from_secs(5))
        .lock_timeout(Duration::from_secs(5))
        .build()
        .await
        .expect("store")
}

/// A bucket of `capacity` whole tokens refilling at `per_second` tokens a second.
fn bucket(capacity: u64, per_second: f64) -> BucketConfig {
    BucketConfig::new(
        Tokens::whole(capacity),
        Rate::from_f64(per_second).expect("rate"),
    )
    .expect("bucket")
}

/// B8: a store that prepares its statements once per session decides as one that sends them
/// unnamed. The same takes, of one key and of several keys with mixed costs, on keys of their
/// own with the same bucket (a token a minute), get the same grants and leave the same tokens;
/// the preparing store's session holds its prepared statement, the other's none.
#[tokio::test]
async fn prepared_statements_decide_as_unnamed_ones() {
    let db = database().await;
    let unnamed = store_at(&db.connection_string(), 1, false).await;
    let prepared = store_at(&db.connection_string(), 1, true).await;
    let config = bucket(10, 1.0 / 60.0);
    let mut seen: Vec<Vec<(u64, u64)>> = Vec::new();
    for (store, side) in [(&unnamed, "unnamed"), (&prepared, "prepared")] {
        let mut answers = Vec::new();
        for cost in [3, 4, 5, 1, 2] {
            let one = format!("{side}:one");
            let a = store
                .acquire(AcquireRequest::take(&one, config, Tokens::whole(cost)))
                .await
                .expect("acquire");
            answers.push((a.granted.floor(), a.remaining.floor()));
            let keys: Vec<String> = (0..3).map(|i| format!("{side}:many:{i}")).collect();
            let requests: Vec<AcquireRequest<'_>> = keys
                .iter()
                .zip([cost, 1, 2 * cost])
                .map(|(key, c)| AcquireRequest::take(key, config, Tokens::whole(c)))
                .collect();
            for a in store.acquire_many(&requests).await.expect("acquire_many") {
                answers.push((a.granted.floor(), a.remaining.floor()));
            }
        }
        seen.push(answers);
    }
    assert_eq!(seen[0], seen[1], "unnamed then prepared");
    assert!(
        seen[0].iter().any(|&(granted, _)| granted == 0),
        "some takes were denied"
    );
    let count = |store: &PostgresStore| {
        let pool = pool_of(store).clone();
        async move {
            let conn = pool.get().await.expect("connection");
            // Unnamed, so that the count does not see itself.
            let rows = conn
                .query_typed("SELECT count(*) FROM pg_prepared_statements", &[])
                .await
                .expect("pg_prepared_statements");
            rows[0].get::<_, i64>(0)
        }
    };
    assert_eq!(count(&unnamed).await, 0);
    // The statements of every decision (one key, many keys, returns), prepared once each when
    // the session opened.
    assert_eq!(
        count(&prepared).await,
        3,
        "three statements, prepared once each"
    );
}

/// `synchronous_commit = off` (the default) is applied to the limiter's own sessions only, and
/// `synchronous_commit(true)` leaves the server's own setting.
#[tokio::test]
async fn synchronous_commit_off_applies_to_the_limiter_sessions() {
    let db = database().await;
    let durable = PostgresStore::builder(&db.connection_string())
        .expect("config")
        .synchronous_commit(true)
        .build()
        .await
        .expect("store");
    let conn = pool_of(&durable).get().await.expect("connection");
    let setting: String = conn
        .query_one("SHOW synchronous_commit", &[])
        .await
        .expect("show")
        .get(0);
    assert_eq!(setting, "on", "the server's own setting");
    drop(conn);
    let store = PostgresStore::connect(&db.connection_string())
        .await
        .expect("store");
    let conn = pool_of(&store).get().await.expect("connection");
    let setting: String = conn
        .query_one("SHOW synchronous_commit", &[])
        .await
        .expect("show")
        .get(0);
    assert_eq!(setting, "off", "asynchronous by default");
    let timeout: String = conn
        .query_one("SHOW statement_timeout", &[])
        .await
        .expect("show")
        .get(0);
    assert_eq!(timeout, "100ms");
}

/// The strict take commits durably on the store's asynchronous sessions: its statement sets
/// `synchronous_commit` to `on` for its own transaction, its commit included, and the session
/// keeps `off` for the next one.
#[tokio::test]
async fn the_strict_take_commits_durably_on_asynchronous_sessions() {
    let db = database().await;
    let store = PostgresStore::connect(&db.connection_string())
        .await
        .expect("store");
    let conn = pool_of(&store).get().await.expect("connection");
    let show = || async {
        conn.query_one("SHOW synchronous_commit", &[])
            .await
            .expect("show")
            .get::<_, String>(0)
    };
    assert_eq!(show().await, "off");
    let (keys, nanos) = (vec!["strict-durable"], vec![100_000_000_000_i64]);
    let (rate, one) = (vec![50_000_000_000_i64], vec![1_000_000_000_i64]);
    let (holders, leases, kept, lifetimes) =
        (vec![7_i64], vec![1_i64], vec![0_i64], vec![1_000_000_i64]);
    conn.batch_execute("BEGIN").await.expect("begin");
    let rows = conn
        .query(
            super::acquire_held_sql(),
            &[
                &keys, &nanos, &rate, &one, &one, &one, &holders, &leases, &kept, &lifetimes,
            ],
        )
        .await
        .expect("the strict take");
    assert_eq!(rows.len(), 1);
    let granted: i64 = rows[0].get(3);
    assert_eq!(granted, 1_000_000_000, "one token leased");
    assert_eq!(show().await, "on", "within the strict take's transaction");
    conn.batch_execute("COMMIT").await.expect("commit");
    assert_eq!(
        show().await,
        "off",
        "the next transaction is asynchronous again"
    );
}
