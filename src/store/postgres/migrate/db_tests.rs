//! Migrations against a real server: idempotence, checksums, failures, concurrent migrators.
//! `tokenlease migrate` is tested with the binary, in cli/tests/commands.rs.
//!
//! Unit tests because they migrate with lists of their own through `migrate_with`, which is
//! not part of the API. The databases come from `tokenlease_testkit`, which links its own copy
//! of this crate: only connection strings and `tokio_postgres` clients cross over.

use tokenlease_testkit::TestDatabase;
use tokio_postgres::Client;

use super::{MIGRATIONS, migrate, migrate_with};
use crate::store::{MigrateError, Migration};

/// Now, on the library's clock (tokio's): the tests' deadlines read time as the code does.
fn now() -> tokio::time::Instant {
    crate::clock::instant()
}

/// A migration list of our own, for tests that need more than one version.
const LONGER: &[Migration] = &[
    Migration {
        version: 1,
        description: "one",
        sql: "CREATE TABLE m_one (n int);",
    },
    Migration {
        version: 2,
        description: "two",
        sql: "CREATE TABLE m_two (n int); INSERT INTO m_two VALUES (2);",
    },
    Migration {
        version: 3,
        description: "three",
        sql: "ALTER TABLE m_two ADD COLUMN note text;",
    },
    Migration {
        version: 10,
        description: "ten",
        sql: "CREATE INDEX m_two_n ON m_two (n);",
    },
];

/// A client whose session works in a schema of its own (created if missing; not concurrently),
/// so lists other than MIGRATIONS get their own `tokenlease_migrations` table.
async fn client_in_schema(db: &TestDatabase, schema: &str) -> Client {
    let client = db.client().await.expect("connect");
    client
        .batch_execute(&format!(
            "CREATE SCHEMA IF NOT EXISTS {schema}; SET search_path = {schema}"
        ))
        .await
        .expect("schema");
    client
}

#[tokio::test]
async fn test_database_is_migrated_and_a_second_run_is_a_noop() {
    let db = TestDatabase::create().await.expect("create");
    let mut client = db.client().await.expect("connect");
    let report = migrate(&mut client).await.expect("migrate");
    assert!(report.is_noop());
    assert_eq!(report.already_present, MIGRATIONS.to_vec());
    assert!(report.unknown_versions.is_empty());

    let rows = client
        .query_typed(
            "SELECT version, description, checksum FROM tokenlease_migrations ORDER BY version",
            &[],
        )
        .await
        .expect("select");
    assert_eq!(rows.len(), MIGRATIONS.len());
    for (row, m) in rows.iter().zip(MIGRATIONS) {
        assert_eq!(row.get::<_, i64>(0), m.version);
        assert_eq!(row.get::<_, String>(1), m.description);
        assert_eq!(row.get::<_, String>(2), m.checksum());
    }
}

#[tokio::test]
async fn edited_migration_is_a_checksum_error_naming_the_version() {
    let db = TestDatabase::create().await.expect("create");
    let mut client = db.client().await.expect("connect");
    client
        .batch_execute("UPDATE tokenlease_migrations SET checksum = 'edited' WHERE version = 1")
        .await
        .expect("update");
    let err = migrate(&mut client).await.expect_err("checksum mismatch");
    assert!(
        matches!(err, MigrateError::ChecksumMismatch { version: 1, .. }),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains("migration 1 (create_buckets)") && message.contains("edited"),
        "{message}"
    );
}

#[tokio::test]
async fn versions_from_a_newer_build_are_reported_not_fatal() {
    let db = TestDatabase::create().await.expect("create");
    let mut client = db.client().await.expect("connect");
    client
        .batch_execute(
            "INSERT INTO tokenlease_migrations (version, description, checksum)
             VALUES (9999, 'from_the_future', 'x')",
        )
        .await
        .expect("insert");
    let report = migrate(&mut client).await.expect("migrate");
    assert_eq!(report.unknown_versions, vec![9999]);
    assert!(report.to_string().contains("9999"));
}

#[tokio::test]
async fn failing_migration_rolls_back_and_keeps_the_ones_before() {
    let db = TestDatabase::create().await.expect("create");
    let mut client = client_in_schema(&db, "failing").await;
    let list = [
        LONGER[0],
        Migration {
            version: 2,
            description: "broken",
            sql: "CREATE TABLE m_half (n int); SELECT no_such_function();",
        },
    ];
    let err = migrate_with(&mut client, &list)
        .await
        .expect_err("broken migration");
    match &err {
        MigrateError::Apply {
            version, detail, ..
        } => {
            assert_eq!(*version, 2);
            assert!(detail.contains("42883"), "{detail}"); // undefined_function
        }
        other => panic!("expected Apply, got {other:?}"),
    }
    assert!(err.to_string().contains("migration 2 (broken)"));
    let tables = client
        .query_typed(
            "SELECT table_name::text FROM information_schema.tables
             WHERE table_schema = 'failing' ORDER BY 1",
            &[],
        )
        .await
        .expect("tables");
    let names: Vec<String> = tables.iter().map(|r| r.get(0)).collect();
    assert_eq!(names, ["m_one", "tokenlease_migrations"]);

    // The connection is usable afterwards and a fixed list continues from version 2.
    let report = migrate_with(&mut client, &LONGER[..2])
        .await
        .expect("retry");
    assert_eq!(report.applied, vec![LONGER[1]]);
    assert_eq!(report.already_present, vec![LONGER[0]]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_concurrent_migrators_apply_each_of_four_versions_exactly_once() {
    let db = std::sync::Arc::new(TestDatabase::create().await.expect("create"));
    drop(client_in_schema(&db, "racing").await); // concurrent CREATE SCHEMA IF NOT EXISTS races
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let db = db.clone();
        tasks.push(tokio::spawn(async move {
            let mut client = client_in_schema(&db, "racing").await;
            migrate_with(&mut client, LONGER).await.expect("migrate")
        }));
    }
    let mut reports = Vec::new();
    for task in tasks {
        reports.push(task.await.expect("task"));
    }
    for m in LONGER {
        let appliers = reports.iter().filter(|r| r.applied.contains(m)).count();
        assert_eq!(appliers, 1, "{m} applied {appliers} times");
    }
    for r in &reports {
        assert_eq!(r.applied.len() + r.already_present.len(), LONGER.len());
    }
    let client = db.client().await.expect("connect");
    let n: i64 = client
        .query_typed_one("SELECT count(*) FROM racing.m_two", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(n, 1, "migration 2's INSERT ran more than once");
}

/// A new, empty database `name` on the test database's server; returns its connection string
/// (key=value or URL, as the test database's).
async fn unmigrated(db: &TestDatabase, name: &str) -> String {
    let client = db.client().await.expect("connect");
    client
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create database");
    let cs = db.connection_string();
    if cs.contains("://") {
        let (base, query) = cs
            .split_once('?')
            .map_or((cs.as_str(), None), |(b, q)| (b, Some(q)));
        let base = &base[..base.rfind('/').expect("a URL path")];
        match query {
            Some(q) => format!("{base}/{name}?{q}"),
            None => format!("{base}/{name}"),
        }
    } else {
        format!("{cs} dbname={name}")
    }
}

/// A database of its own on `db`'s server (named after `db` and `suffix`) migrated to the
/// first `upto` migrations, as an older version of the library left it: its URL and a client.
async fn older_database(db: &TestDatabase, suffix: &str, upto: usize) -> (String, Client) {
    let url = unmigrated(db, &format!("{}_{suffix}", db.name())).await;
    let (mut admin, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connect to the new database");
    tokio::spawn(connection);
    let before = migrate_with(&mut admin, &MIGRATIONS[..upto])
        .await
        .expect("the older version's migrations");
    assert_eq!(before.applied.len(), upto);
    (url, admin)
}

/// A store on `url` with generous timeouts (these tests are about the schema, not about
/// failure behaviour); building it applies the pending migrations.
async fn patient_store(url: &str) -> Result<crate::store::PostgresStore, crate::store::StoreError> {
    use std::time::Duration;
    crate::store::PostgresStore::builder(url)
        .expect("connection string")
        .connect_timeout(Duration::from_secs(5))
        .call_timeout(Duration::from_secs(5))
        .pool_wait_timeout(Duration::from_secs(5))
        .build()
        .await
}

/// Migrations run under the builder's migrate timeout, not the limiter's statement and lock
/// timeouts: with both at 1 ms, and another session holding the migration lock until the
/// store's session waits for it, the build still migrates.
#[tokio::test]
async fn build_migrates_under_its_own_timeout_not_the_statement_timeout() {
    use super::MIGRATION_LOCK_ID;
    use crate::store::PostgresStore;
    use std::time::Duration;

    let db = TestDatabase::create().await.expect("create");
    let fresh = unmigrated(&db, &format!("{}_fresh", db.name())).await;
    let holder = db.client().await.expect("connect");
    holder
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK_ID])
        .await
        .expect("take the migration lock");
    let builder = PostgresStore::builder(&fresh)
        .expect("connection string")
        .statement_timeout(Duration::from_millis(1))
        .lock_timeout(Duration::from_millis(1))
        .connect_timeout(Duration::from_secs(5));
    let mut build = tokio::spawn(builder.build());
    // Release the lock once the store's session waits for it (or the build has ended).
    crate::tests::eventually(
        Duration::from_millis(5),
        Duration::from_secs(10),
        "the build waited for the lock",
        async || {
            let waiting: i64 = holder
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = \
                     'tokenlease' AND wait_event_type = 'Lock'",
                    &[],
                )
                .await
                .expect("pg_stat_activity")
                .get(0);
            waiting > 0 || build.is_finished()
        },
    )
    .await;
    holder
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK_ID])
        .await
        .expect("release the migration lock");
    let store = tokio::time::timeout(Duration::from_secs(30), &mut build)
        .await
        .expect("the build ends")
        .expect("the build task")
        .expect("the build migrates under the 1 ms statement timeout");
    drop(store);
    let (check, connection) = tokio_postgres::connect(&fresh, tokio_postgres::NoTls)
        .await
        .expect("connect to the new database");
    tokio::spawn(connection);
    let versions: i64 = check
        .query_one("SELECT count(*) FROM tokenlease_migrations", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(versions, MIGRATIONS.len() as i64);
}

/// A migration that fails makes the build fail with a typed error naming that migration; a
/// migration lock held past the migrate timeout names the bookkeeping step that waited.
#[tokio::test]
async fn build_errors_name_the_failing_migration_step() {
    use super::MIGRATION_LOCK_ID;
    use crate::store::{PostgresStore, StoreError};
    use std::time::Duration;

    let db = TestDatabase::create().await.expect("create");
    let broken = unmigrated(&db, &format!("{}_broken", db.name())).await;
    let (admin, connection) = tokio_postgres::connect(&broken, tokio_postgres::NoTls)
        .await
        .expect("connect to the new database");
    tokio::spawn(connection);
    // A table of that name without the columns: 0001 skips creating it, then fails commenting
    // on a column it lacks.
    admin
        .batch_execute("CREATE TABLE tokenlease_buckets (key text)")
        .await
        .expect("the conflicting table");
    let err = PostgresStore::builder(&broken)
        .expect("connection string")
        .connect_timeout(Duration::from_secs(5))
        .build()
        .await
        .expect_err("the first migration fails");
    match &err {
        StoreError::Migrate(e) => {
            assert!(
                matches!(**e, MigrateError::Apply { version: 1, .. }),
                "{e:?}"
            );
        }
        other => panic!("expected StoreError::Migrate, got {other:?}"),
    }
    let message = err.to_string();
    assert!(
        message.contains("migrating the database failed")
            && message.contains("migration 1 (create_buckets)"),
        "{message}"
    );
    assert!(!err.is_transient());

    // The lock held for longer than the migrate timeout: the server's lock timeout (the migrate
    // timeout) ends the wait, and the error says which step waited.
    admin
        .batch_execute("DROP TABLE tokenlease_buckets")
        .await
        .expect("drop");
    admin
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK_ID])
        .await
        .expect("take the migration lock");
    let err = PostgresStore::builder(&broken)
        .expect("connection string")
        .connect_timeout(Duration::from_secs(5))
        .migrate_timeout(Duration::from_millis(300))
        .build()
        .await
        .expect_err("the lock is held");
    let message = err.to_string();
    match &err {
        StoreError::Migrate(e) => assert!(
            matches!(**e, MigrateError::Database { .. }) && message.contains("could not "),
            "{message}"
        ),
        StoreError::Timeout {
            kind: crate::store::TimeoutKind::Migrate,
            ..
        } => {}
        other => panic!("expected a migrate error, got {other:?}"),
    }
    assert!(message.contains("migrat"), "{message}");
}

/// A database migrated by an older version (0001 to 0003: bare statements, no functions) is
/// brought to the newest schema when a store of this version is built on it: the integer
/// columns of 0007, `tokenlease_acquire_held` with its settings and a search_path pinned to the
/// schema of the buckets, and none of the functions 0007 dropped. Plain takes and returns run as
/// plain statements (they work with the function gone); a strict lease goes through the
/// function, and with it dropped its call is an error naming it.
#[tokio::test]
async fn an_older_database_gets_the_newest_schema_and_the_store_uses_it() {
    use crate::bucket::Tokens;
    use crate::store::{AcquireRequest, Hold, Store};
    use std::time::Duration;

    let db = TestDatabase::create().await.expect("create");
    let (old, admin) = older_database(&db, "old", 3).await;
    async fn functions(admin: &Client) -> Vec<String> {
        admin
            .query_typed(
                "SELECT proname || ': ' || coalesce(array_to_string(proconfig, ';'), '') \
                 FROM pg_proc WHERE proname IN ('tokenlease_acquire', 'tokenlease_give_back', \
                                                'tokenlease_acquire_held') \
                 ORDER BY proname",
                &[],
            )
            .await
            .expect("pg_proc")
            .iter()
            .map(|r| r.get::<_, String>(0))
            .collect()
    }
    assert!(
        functions(&admin).await.is_empty(),
        "0003 has no such functions"
    );

    let store = patient_store(&old)
        .await
        .expect("build migrates to the newest version");
    let settings =
        "plan_cache_mode=force_generic_plan;enable_seqscan=off;search_path=public, pg_temp";
    assert_eq!(
        functions(&admin).await,
        vec![format!("tokenlease_acquire_held: {settings}")]
    );
    let version: i64 = admin
        .query_typed_one("SELECT max(version) FROM tokenlease_migrations", &[])
        .await
        .expect("versions")
        .get(0);
    assert_eq!(version, MIGRATIONS.len() as i64);
    let types: Vec<String> = admin
        .query_typed(
            "SELECT column_name || ' ' || data_type FROM information_schema.columns \
             WHERE table_name = 'tokenlease_buckets' AND column_name <> 'leases' \
             ORDER BY column_name",
            &[],
        )
        .await
        .expect("columns")
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect();
    assert_eq!(
        types,
        [
            "capacity bigint",
            "frac integer",
            "key text",
            "more_capacity ARRAY",
            "more_frac ARRAY",
            "more_rate ARRAY",
            "more_tokens ARRAY",
            "refill_per_second bigint",
            "refilled bigint",
            "tokens bigint",
            "updated_us bigint",
        ]
    );

    let bucket = crate::bucket::BucketConfig::new(
        Tokens::whole(10),
        crate::bucket::Rate::per_second(1).expect("rate"),
    )
    .expect("bucket");
    let take = AcquireRequest::take("old-db", bucket, Tokens::whole(4));
    let got = store.acquire(take).await.expect("acquire");
    assert_eq!(got.granted, Tokens::whole(4));
    assert_eq!(got.remaining, Tokens::whole(6));

    let back = crate::store::GiveBack {
        id: 42,
        key: "old-db",
        amount: Tokens::whole(2),
        bucket,
        lease: None,
    };
    assert_eq!(store.give_back(&[back]).await.expect("give back"), 1);

    admin
        .batch_execute(
            "DROP FUNCTION tokenlease_acquire_held(text[], bigint[], bigint[], bigint[], \
             bigint[], bigint[], bigint[], bigint[], bigint[], bigint[])",
        )
        .await
        .expect("drop the function");
    let got = store
        .acquire(take)
        .await
        .expect("a plain take needs no function");
    assert!(got.granted <= Tokens::whole(4));
    let strict = take.held(Hold {
        holder: 7,
        lease_id: 1,
        kept: Tokens::ZERO,
        lifetime: Duration::from_secs(1),
    });
    let err = store
        .acquire(strict)
        .await
        .expect_err("no function, no strict lease");
    assert!(err.to_string().contains("tokenlease_acquire_held"), "{err}");
}

/// Migration 0007 on a populated table under load, as a deploy meets it: 20,000 rows written
/// by the previous version (numeric amounts, a few with strict leases), the previous version's
/// function taking from them in a loop on another connection while the migration runs. The
/// migration completes; every row keeps its tokens rounded down to the nanotoken (never more),
/// its capacity, rate and refill time; the old version's calls fail with a clear error once its
/// function is gone (its instances then decide by their fallback); and the new store takes from
/// the migrated rows exactly as the pure bucket does from what was stored.
#[tokio::test]
async fn a_populated_table_migrates_under_load() {
    use crate::bucket::Tokens;
    use crate::store::{AcquireRequest, Store};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::time::Duration;

    let db = TestDatabase::create().await.expect("create");
    let (url, mut admin) = older_database(&db, "load", 6).await;
    // 20,000 rows as the previous version wrote them: 1/3 token steps, a 2/3 token/s rate.
    admin
        .batch_execute(
            "INSERT INTO tokenlease_buckets (key, tokens, capacity, refill_per_second, updated_at)
             SELECT 'k' || g, (g % 30) / 3.0, 10, 0.666666667, now() - interval '5 minutes'
             FROM generate_series(1, 20000) g;
             UPDATE tokenlease_buckets
             SET leases = ARRAY[ROW(1, 1, 1.5, now() + interval '1 hour')::tokenlease_lease]
             WHERE key IN ('k1', 'k2');",
        )
        .await
        .expect("populate");
    let before: Vec<(String, String)> = admin
        .query(
            "SELECT key, tokens::text FROM tokenlease_buckets WHERE key IN ('k1', 'k19999', 'k20000')
             ORDER BY key",
            &[],
        )
        .await
        .expect("before")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();

    // The previous version, still running: its function on its own connection, in a loop.
    let (old_client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(connection);
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let load = {
        let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
        tokio::spawn(async move {
            let mut last_error = String::new();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let key = format!("k{}", 3 + i % 19_990);
                let result = old_client
                    .query(
                        "SELECT granted FROM tokenlease_acquire(ARRAY[$1]::text[], \
                         ARRAY['10']::numeric[], ARRAY['0.666666667']::numeric[], \
                         ARRAY['1']::numeric[], ARRAY['1']::numeric[], ARRAY['1']::numeric[])",
                        &[&key],
                    )
                    .await;
                match result {
                    Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        last_error = e
                            .as_db_error()
                            .map_or_else(|| e.to_string(), |db| db.message().to_owned());
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
                tokio::task::yield_now().await;
            }
            last_error
        })
    };
    // Let the old version run before the migration starts (bounded: 5 s at most).
    let deadline = now() + Duration::from_secs(5);
    while ok.load(Ordering::Relaxed) < 20 && now() < deadline {
        tokio::task::yield_now().await;
    }
    assert!(
        ok.load(Ordering::Relaxed) >= 20,
        "the old version was taking"
    );
    let report = migrate(&mut admin).await.expect("migrate under load");
    let versions: Vec<i64> = report.applied.iter().map(|m| m.version).collect();
    let newer: Vec<i64> = (7..=MIGRATIONS.len() as i64).collect();
    assert_eq!(versions, newer, "{report}");
    // The old version now fails at once: wait (bounded) until it has seen that.
    let seen = failed.load(Ordering::Relaxed);
    let deadline = now() + Duration::from_secs(5);
    while failed.load(Ordering::Relaxed) < seen + 5 && now() < deadline {
        tokio::task::yield_now().await;
    }
    stop.store(true, Ordering::Relaxed);
    let last_error = load.await.expect("load task");
    assert!(
        last_error.contains("tokenlease_acquire"),
        "the old version's calls name the missing function: {last_error}"
    );

    // Every row is there, its amounts rounded down to the nanotoken.
    let rows: i64 = admin
        .query_one("SELECT count(*) FROM tokenlease_buckets", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(rows, 20_000);
    let shapes: i64 = admin
        .query_one(
            "SELECT count(*) FROM tokenlease_buckets
             WHERE capacity = 10000000000 AND refill_per_second = 666666667 AND frac = 0",
            &[],
        )
        .await
        .expect("shapes")
        .get(0);
    assert_eq!(shapes, 20_000, "capacity and rate in nanotokens");
    let after: Vec<(String, i64)> = admin
        .query(
            "SELECT key, tokens FROM tokenlease_buckets WHERE key IN ('k1', 'k19999', 'k20000')
             ORDER BY key",
            &[],
        )
        .await
        .expect("after")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    for ((key, old), (key_after, nanos)) in before.iter().zip(&after) {
        assert_eq!(key, key_after);
        let old: Tokens = old.parse().expect("old tokens");
        let floor = old.as_atto() / 1_000_000_000;
        assert_eq!(
            *nanos as u128, floor,
            "{key}: {old} rounded down to the nanotoken"
        );
    }

    // The new store decides on the migrated rows as the pure bucket does.
    let store = patient_store(&url).await.expect("store");
    let bucket = crate::bucket::BucketConfig::new(
        Tokens::whole(10),
        crate::bucket::Rate::from_nanos_per_second(666_666_667).expect("rate"),
    )
    .expect("bucket");
    // k20000 held 20000 % 30 / 3 = 6.666… tokens five minutes ago: full by now.
    let got = store
        .acquire(AcquireRequest::take("k20000", bucket, Tokens::whole(10)))
        .await
        .expect("take");
    assert_eq!(got.granted, Tokens::whole(10));
    assert_eq!(got.remaining, Tokens::ZERO);
    // k1 has a strict lease of 1.5 tokens out: it refills to 10 - 1.5 at most.
    let got = store
        .acquire(AcquireRequest::take("k1", bucket, Tokens::whole(9)))
        .await
        .expect("take");
    assert!(got.granted.is_zero(), "the lease still counts: {got:?}");
    assert_eq!(got.remaining, Tokens::from_nanos(8_500_000_000));
}

/// Every `tokenlease_` function in `schema`: its signature, full definition and comment.
async fn functions_in(client: &Client, schema: &str) -> Vec<(String, String, Option<String>)> {
    client
        .query(
            "SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid), \
                    obj_description(p.oid, 'pg_proc') \
             FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace \
             WHERE n.nspname = $1 AND p.proname LIKE 'tokenlease%' \
             ORDER BY 1",
            &[&schema],
        )
        .await
        .expect("functions")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

/// The function files (`functions/`) define exactly what the migrations left: on a new schema,
/// the migrations alone, then `migrate`, which applies every file (none is recorded yet), leave
/// the same functions with the same definitions, settings and comments. So moving the current
/// definitions out of the migrations changed no function.
#[tokio::test]
async fn the_function_files_define_what_the_migrations_left() {
    let db = TestDatabase::create().await.expect("create");
    // A database of its own, empty (not from the migrated template): a second schema would
    // find migration 0003's type in the first one.
    let name = format!("{}_fn_files", db.name());
    let admin = db.client().await.expect("connect");
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create the empty database");
    let mut config: tokio_postgres::Config = db.connection_string().parse().expect("config");
    config.dbname(&name);
    let (mut client, connection) = config
        .connect(tokio_postgres::NoTls)
        .await
        .expect("connect");
    let driver = tokio::spawn(connection);
    migrate_with(&mut client, MIGRATIONS)
        .await
        .expect("the migrations alone");
    let by_migrations = functions_in(&client, "public").await;
    assert!(
        by_migrations.len() >= 10,
        "the migrations' functions: {by_migrations:?}"
    );
    let report = migrate(&mut client).await.expect("migrate");
    assert_eq!(
        report.functions_applied,
        ["bucket", "held_leases", "acquire_held"]
    );
    assert!(!report.is_noop());
    let by_files = functions_in(&client, "public").await;
    assert_eq!(by_files, by_migrations);
    drop(client);
    let _ = driver.await;
    admin
        .batch_execute(&format!("DROP DATABASE {name}"))
        .await
        .expect("drop the database");
}

/// Whether `tokenlease_amount(1, 500000)` equals `expected` (numeric, compared by the server).
async fn amount_is(client: &Client, expected: &str) -> bool {
    let sql = format!("SELECT tokenlease_amount(1, 500000) = {expected}");
    client.query_one(&sql, &[]).await.expect("amount").get(0)
}

/// A function file whose checksum the database does not have is applied again: a function
/// edited by hand, with its file's recorded checksum changed, is restored by the next
/// `migrate`, which names the file; the one after applies nothing.
#[tokio::test]
async fn a_function_file_with_another_checksum_is_applied_again() {
    let db = TestDatabase::create().await.expect("create");
    let mut client = db.client().await.expect("connect");
    let report = migrate(&mut client).await.expect("migrate");
    assert!(report.functions_applied.is_empty(), "{report}");
    client
        .batch_execute(
            "CREATE OR REPLACE FUNCTION tokenlease_amount(nanotokens bigint, femtotokens integer) \
             RETURNS numeric LANGUAGE sql IMMUTABLE RETURN 0; \
             UPDATE tokenlease_functions SET checksum = 'edited' WHERE file = 'bucket'",
        )
        .await
        .expect("edit");
    assert!(amount_is(&client, "0").await, "edited by hand");
    let report = migrate(&mut client).await.expect("migrate");
    assert_eq!(report.functions_applied, ["bucket"]);
    assert!(
        report
            .to_string()
            .contains("function file(s) applied: bucket")
    );
    assert!(
        amount_is(&client, "0.0000000015").await,
        "restored: 1 nanotoken and 500,000 femtotokens"
    );
    let again = migrate(&mut client).await.expect("migrate");
    assert!(
        again.functions_applied.is_empty() && again.is_noop(),
        "{again}"
    );
}
