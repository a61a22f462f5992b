//! Migrations against a real server: idempotence, checksums, failures, concurrent migrators,
//! and the `tokenlease migrate` command.

use std::process::Command;

use tokenlease::embedded::TestDatabase;
// The migration list and `migrate_with` are not API: the crate reaches them out to its own
// tests through `__private`, so that these tests can migrate with lists of their own.
use tokenlease::__private::{MIGRATIONS, migrate_with};
use tokenlease::store::{MigrateError, Migration, migrate};
use tokio_postgres::Client;

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

#[tokio::test]
async fn cli_migrate_uses_database_url() {
    let db = TestDatabase::create().await.expect("create");
    let output = Command::new(env!("CARGO_BIN_EXE_tokenlease"))
        .arg("migrate")
        .env("DATABASE_URL", db.connection_string())
        .output()
        .expect("run tokenlease");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stdout.contains("already present 0001_create_buckets"),
        "{stdout}"
    );
    assert!(stdout.contains("no migrations applied"), "{stdout}");
    assert!(!stderr.contains("throwaway"), "{stderr}");
}

#[test]
fn cli_migrate_without_database_url_starts_a_throwaway_server() {
    let output = Command::new(env!("CARGO_BIN_EXE_tokenlease"))
        .arg("migrate")
        .env_remove("DATABASE_URL")
        .output()
        .expect("run tokenlease");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stderr.contains("throwaway PostgreSQL"), "{stderr}");
    assert!(stdout.contains("applied 0001_create_buckets"), "{stdout}");
}

#[test]
fn cli_migrate_reports_an_unreachable_database() {
    let output = Command::new(env!("CARGO_BIN_EXE_tokenlease"))
        .args([
            "migrate",
            "--database-url",
            "host=127.0.0.1 port=1 user=x connect_timeout=2",
        ])
        .output()
        .expect("run tokenlease");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("could not connect to the database"),
        "{stderr}"
    );
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

/// Migrations run under the builder's migrate timeout, not the limiter's statement and lock
/// timeouts: with both at 1 ms, and another session holding the migration lock until the
/// store's session waits for it, the build still migrates.
#[tokio::test]
async fn build_migrates_under_its_own_timeout_not_the_statement_timeout() {
    use std::time::{Duration, Instant};
    use tokenlease::__private::MIGRATION_LOCK_ID;
    use tokenlease::store::PostgresStore;

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
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = holder
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'tokenlease' \
                 AND wait_event_type = 'Lock'",
                &[],
            )
            .await
            .expect("pg_stat_activity")
            .get(0);
        if waiting > 0 || build.is_finished() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the build never waited for the lock"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
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
    use std::time::Duration;
    use tokenlease::__private::MIGRATION_LOCK_ID;
    use tokenlease::store::{PostgresStore, StoreError};

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
            kind: tokenlease::store::TimeoutKind::Migrate,
            ..
        } => {}
        other => panic!("expected a migrate error, got {other:?}"),
    }
    assert!(message.contains("migrat"), "{message}");
}

/// A database migrated by an older version (0001 to 0003: bare statements, no functions) gets
/// `tokenlease_acquire` and `tokenlease_give_back` from 0004 when a store of this version is
/// built on it, with their settings and a search_path pinned to the schema of the buckets; and
/// the store's takes and returns go through the functions: with one dropped, its call is an error
/// naming it. It also gets 0005's PL/pgSQL `tokenlease_grantable`.
#[tokio::test]
async fn an_older_database_gets_the_acquire_function_and_the_store_uses_it() {
    use std::time::Duration;
    use tokenlease::bucket::Tokens;
    use tokenlease::store::{AcquireRequest, PostgresStore, Store};

    let db = TestDatabase::create().await.expect("create");
    let old = unmigrated(&db, &format!("{}_old", db.name())).await;
    let (mut admin, connection) = tokio_postgres::connect(&old, tokio_postgres::NoTls)
        .await
        .expect("connect to the new database");
    tokio::spawn(connection);
    let before = migrate_with(&mut admin, &MIGRATIONS[..3])
        .await
        .expect("the older version's migrations");
    assert_eq!(before.applied.len(), 3);
    async fn functions(admin: &Client) -> Vec<String> {
        admin
            .query_typed(
                "SELECT proname || ': ' || array_to_string(proconfig, ';') FROM pg_proc
                 WHERE proname IN ('tokenlease_acquire', 'tokenlease_give_back')
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

    let store = PostgresStore::builder(&old)
        .expect("connection string")
        .connect_timeout(Duration::from_secs(5))
        .call_timeout(Duration::from_secs(5))
        .pool_wait_timeout(Duration::from_secs(5))
        .build()
        .await
        .expect("build migrates to the newest version");
    let settings =
        "plan_cache_mode=force_generic_plan;enable_seqscan=off;search_path=public, pg_temp";
    assert_eq!(
        functions(&admin).await,
        vec![
            format!("tokenlease_acquire: {settings}"),
            format!("tokenlease_give_back: {settings}"),
        ]
    );
    let version: i64 = admin
        .query_typed_one("SELECT max(version) FROM tokenlease_migrations", &[])
        .await
        .expect("versions")
        .get(0);
    assert_eq!(version, MIGRATIONS.len() as i64);
    // 0005: the grant's arithmetic runs as PL/pgSQL, planned once per session, not as a SQL
    // function whose body is planned again in every statement.
    let language: String = admin
        .query_typed_one(
            "SELECT l.lanname::text FROM pg_proc AS p JOIN pg_language AS l ON l.oid = p.prolang
             WHERE p.proname = 'tokenlease_grantable'",
            &[],
        )
        .await
        .expect("tokenlease_grantable")
        .get(0);
    assert_eq!(language, "plpgsql");

    let bucket = tokenlease::bucket::BucketConfig::new(
        Tokens::whole(10),
        tokenlease::bucket::Rate::per_second(1).expect("rate"),
    )
    .expect("bucket");
    let take = AcquireRequest::take("old-db", bucket, Tokens::whole(4));
    let got = store.acquire(take).await.expect("acquire");
    assert_eq!(got.granted, Tokens::whole(4));
    assert_eq!(got.remaining, Tokens::whole(6));

    let back = tokenlease::store::GiveBack {
        id: 42,
        key: "old-db",
        amount: Tokens::whole(2),
        bucket,
        lease: None,
    };
    assert_eq!(store.give_back(&[back]).await.expect("give back"), 1);

    admin
        .batch_execute(
            "DROP FUNCTION tokenlease_acquire(text[], numeric[], numeric[], numeric[], \
             numeric[], numeric[], bigint[], bigint[], numeric[], bigint[]);
             DROP FUNCTION tokenlease_give_back(bigint[], text[], numeric[], numeric[], \
             numeric[], bigint[], bigint[]);",
        )
        .await
        .expect("drop the functions");
    let err = store.acquire(take).await.expect_err("no function, no take");
    assert!(err.to_string().contains("tokenlease_acquire"), "{err}");
    let back = tokenlease::store::GiveBack { id: 43, ..back };
    let err = store
        .give_back(&[back])
        .await
        .expect_err("no function, no return");
    assert!(err.to_string().contains("tokenlease_give_back"), "{err}");
}
