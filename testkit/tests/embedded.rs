//! The throwaway PostgreSQL (`tokenlease_testkit`) against a real server: start, connect,
//! migrate, stop, start again, crash-restart, drop. Each test starts its own cluster.

use std::time::Instant;

use tokenlease::store::{MIGRATIONS, migrate};
use tokenlease_testkit::{StopMode, TempPostgres, TestDatabase};
use tokio_postgres::{Client, NoTls};

async fn connect(conn: &str) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(conn, NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

async fn count_rows(client: &Client, table: &str) -> i64 {
    let rows = client
        .simple_query(&format!("SELECT count(*) FROM {table}"))
        .await
        .expect("count");
    rows.iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(|v| v.parse().unwrap()),
            _ => None,
        })
        .expect("one row")
}

#[tokio::test]
async fn starts_and_migrations_apply_once_and_buckets_table_is_logged() {
    let started = Instant::now();
    let pg = TempPostgres::start().expect("start");
    eprintln!("cluster started in {:?}", started.elapsed());
    assert_eq!(pg.host(), "127.0.0.1");
    assert_eq!(
        pg.url(),
        format!("postgres://postgres@127.0.0.1:{}/postgres", pg.port())
    );
    assert_eq!(
        pg.connection_string("postgres"),
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            pg.port()
        )
    );
    assert!(pg.bin_dir().join("pg_ctl").is_file());
    assert!(pg.data_dir().join("PG_VERSION").is_file());

    let mut client = connect(&pg.connection_string("postgres"))
        .await
        .expect("connect");
    let first = migrate(&mut client).await.expect("first migrate");
    assert_eq!(first.applied, MIGRATIONS.to_vec());
    assert!(first.already_present.is_empty());
    let second = migrate(&mut client).await.expect("second migrate");
    assert!(second.is_noop(), "second run applied {:?}", second.applied);
    assert_eq!(second.already_present, MIGRATIONS.to_vec());
    assert!(second.to_string().starts_with("no migrations applied"));

    // B5: buckets must survive a crash, so the table must be logged.
    let row = client
        .query_typed_one(
            "SELECT relpersistence::text FROM pg_class WHERE relname = 'tokenlease_buckets'",
            &[],
        )
        .await
        .expect("pg_class row");
    assert_eq!(row.get::<_, String>(0), "p");
}

#[tokio::test]
async fn settings_are_durable_and_builder_settings_apply() {
    let pg = TempPostgres::builder()
        .setting("max_connections", "50")
        .setting("application_name", "it's embedded")
        .start()
        .expect("start");
    let client = connect(&pg.connection_string("postgres"))
        .await
        .expect("connect");
    for (name, want) in [
        ("fsync", "on"),
        ("synchronous_commit", "on"),
        ("full_page_writes", "on"),
        ("listen_addresses", "127.0.0.1"),
        ("max_connections", "50"),
        ("logging_collector", "off"),
    ] {
        let row = client
            .query_typed_one(&format!("SHOW {name}"), &[])
            .await
            .expect("SHOW");
        assert_eq!(row.get::<_, String>(0), want, "setting {name}");
    }
    assert!(
        TempPostgres::builder()
            .setting("bad name", "1")
            .start()
            .is_err()
    );
    // A setting the server refuses: the error carries the server's own words from its log.
    let err = TempPostgres::builder()
        .setting("max_connections", "lots")
        .start()
        .expect_err("the server refuses max_connections = lots");
    let message = err.to_string();
    assert!(
        message.contains("could not start PostgreSQL") && message.contains("max_connections"),
        "{message}"
    );
}

#[tokio::test]
async fn server_log_records_errors_with_sqlstate() {
    let pg = TempPostgres::start().expect("start");
    let client = connect(&pg.connection_string("postgres"))
        .await
        .expect("connect");
    let err = client
        .batch_execute("SELECT 1 / 0")
        .await
        .expect_err("division by zero");
    assert_eq!(err.code().map(|c| c.code()), Some("22012"));
    // The server writes the log line before it answers; the file is read afterwards.
    let log = pg.log_contents();
    assert!(
        log.contains("22012") && log.contains("division by zero"),
        "log at {} lacks the error:\n{log}",
        pg.log_path().display()
    );
}

#[tokio::test]
async fn stop_fast_refuses_connections_and_start_again_keeps_data() {
    let pg = TempPostgres::start().expect("start");
    let conn = pg.connection_string("postgres");
    let client = connect(&conn).await.expect("connect");
    client
        .batch_execute("CREATE TABLE kept (n int); INSERT INTO kept VALUES (1), (2)")
        .await
        .expect("write");
    let pid = pg.postmaster_pid().expect("running server has a pid");

    pg.stop(StopMode::Fast).expect("stop fast");
    assert_eq!(pg.postmaster_pid(), None, "postmaster {pid} still listed");
    assert!(
        connect(&conn).await.is_err(),
        "connected to a stopped server"
    );
    assert!(
        pg.stop(StopMode::Fast).is_err(),
        "stopping twice should fail"
    );

    let port = pg.port();
    pg.start_again().expect("start again");
    assert_eq!(pg.port(), port);
    assert!(pg.postmaster_pid().is_some());
    let client = connect(&conn).await.expect("reconnect");
    assert_eq!(count_rows(&client, "kept").await, 2);
}

#[tokio::test]
async fn immediate_restart_keeps_committed_rows() {
    let pg = TempPostgres::start().expect("start");
    let conn = pg.connection_string("postgres");
    let mut client = connect(&conn).await.expect("connect");
    migrate(&mut client).await.expect("migrate");
    client
        .batch_execute(
            "INSERT INTO tokenlease_buckets (key, tokens, capacity, refill_per_second, updated_us)
             SELECT 'k' || g, 1000000000, 100000000000, 50000000000, 0
             FROM generate_series(1, 100) g",
        )
        .await
        .expect("insert");
    drop(client);

    let started = Instant::now();
    pg.restart(StopMode::Immediate).expect("crash restart");
    eprintln!("immediate restart took {:?}", started.elapsed());
    let client = connect(&conn).await.expect("reconnect");
    assert_eq!(count_rows(&client, "tokenlease_buckets").await, 100);
    assert!(
        pg.log_contents().contains("not properly shut down"),
        "expected crash recovery in the log"
    );
}

#[test]
fn two_servers_at_once_get_different_ports_and_drop_removes_them() {
    let a = TempPostgres::start().expect("start a");
    let b = TempPostgres::start().expect("start b");
    assert_ne!(a.port(), b.port());
    assert_ne!(a.data_dir(), b.data_dir());

    let data = a.data_dir().to_path_buf();
    let root = data.parent().expect("data dir has a parent").to_path_buf();
    let pid = a.postmaster_pid().expect("pid");
    let started = Instant::now();
    drop(a);
    eprintln!("drop took {:?}", started.elapsed());
    assert!(!data.exists(), "{} still exists", data.display());
    assert!(!root.exists(), "{} still exists", root.display());
    // Gone, or a zombie waiting for its new parent (pid 1) to reap it.
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().chars().next())
        })
        .flatten();
    assert!(
        state.is_none() || state == Some('Z'),
        "postmaster {pid} still running (state {state:?})"
    );
    // The other one is untouched.
    assert!(b.postmaster_pid().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrators_apply_each_version_exactly_once() {
    let pg = TempPostgres::start().expect("start");
    let conn = pg.connection_string("postgres");
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let conn = conn.clone();
        tasks.push(tokio::spawn(async move {
            let mut client = connect(&conn).await.expect("connect");
            migrate(&mut client).await.expect("migrate")
        }));
    }
    let mut reports = Vec::new();
    for task in tasks {
        reports.push(task.await.expect("task"));
    }
    for migration in MIGRATIONS {
        let appliers = reports
            .iter()
            .filter(|r| r.applied.contains(migration))
            .count();
        assert_eq!(appliers, 1, "{migration} applied by {appliers} migrators");
        let present = reports
            .iter()
            .filter(|r| r.already_present.contains(migration))
            .count();
        assert_eq!(present, 3);
    }
    let client = connect(&conn).await.expect("connect");
    assert_eq!(
        count_rows(&client, "tokenlease_migrations").await,
        MIGRATIONS.len() as i64
    );
}

#[tokio::test]
async fn test_database_create_gives_two_separate_migrated_databases() {
    let a = TestDatabase::create().await.expect("create a");
    let b = TestDatabase::create().await.expect("create b");
    assert_ne!(a.name(), b.name());
    if std::env::var_os("DATABASE_URL").is_none() {
        assert!(a.server().is_some() && b.server().is_some());
    }
    let ca = a.client().await.expect("connect a");
    let cb = b.client().await.expect("connect b");
    // Connection strings parse as tokio-postgres configs and name the fresh databases.
    let config: tokio_postgres::Config = a.connection_string().parse().expect("parse");
    assert_eq!(config.get_dbname(), Some(a.name()));

    ca.batch_execute(
        "INSERT INTO tokenlease_buckets (key, tokens, capacity, refill_per_second, updated_us)
         VALUES ('only-in-a', 1000000000, 10000000000, 1000000000, 0)",
    )
    .await
    .expect("insert into a");
    assert_eq!(count_rows(&ca, "tokenlease_buckets").await, 1);
    assert_eq!(count_rows(&cb, "tokenlease_buckets").await, 0);
    assert_eq!(
        count_rows(&cb, "tokenlease_migrations").await,
        MIGRATIONS.len() as i64
    );
}

/// Runs the ignored test `name` of this module in a child process with `env` set; the helpers
/// below do nothing unless `TOKENLEASE_TEST_HELPER` is set, so `--ignored` runs stay quick.
fn helper(name: &str, env: &[(&str, &str)]) -> std::process::Command {
    // The test's full name in the binary: this module's path without the crate's name.
    let name = match module_path!().split_once("::") {
        Some((_, module)) => format!("{module}::{name}"),
        None => name.to_owned(),
    };
    let mut cmd = std::process::Command::new(std::env::current_exe().expect("current exe"));
    cmd.args([
        name.as_str(),
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("TOKENLEASE_TEST_HELPER", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

fn is_helper() -> bool {
    std::env::var_os("TOKENLEASE_TEST_HELPER").is_some()
}

#[test]
#[ignore = "helper: run by leftovers_of_a_killed_process_are_removed"]
fn helper_hold_a_cluster_until_killed() {
    if !is_helper() {
        return;
    }
    let pg = TempPostgres::start().expect("start");
    println!(
        "HOLDING {} {}",
        pg.postmaster_pid().expect("pid"),
        pg.data_dir().display()
    );
    // sleep: the helper holds its cluster until the test kills it; 60 s bounds an orphan.
    std::thread::sleep(std::time::Duration::from_secs(60));
}

/// A test process killed by a timeout (nextest's terminate-after) cannot run Drop: the next
/// cluster started on the machine removes what it left, and kills its server.
#[test]
fn leftovers_of_a_killed_process_are_removed() {
    use std::io::BufRead;
    let mut child = helper("helper_hold_a_cluster_until_killed", &[])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn helper");
    let stdout = child.stdout.take().expect("stdout");
    let line = std::io::BufReader::new(stdout)
        .lines()
        .map(|l| l.expect("line"))
        .find_map(|l| l.split_once("HOLDING ").map(|(_, rest)| rest.to_string()))
        .expect("helper reports its cluster");
    // libtest prints "test name ... " before the test runs, on the same line.
    let mut words = line.split_whitespace();
    let pid: u32 = words.next().unwrap().parse().unwrap();
    let data = std::path::PathBuf::from(words.next().unwrap());
    child.kill().expect("kill helper");
    child.wait().expect("reap helper");
    assert!(data.exists(), "nothing left to clean up?");

    let _next = TempPostgres::start().expect("start");
    assert!(!data.exists(), "{} left behind", data.display());
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().chars().next())
        })
        .flatten();
    assert!(
        state.is_none() || state == Some('Z'),
        "orphaned postmaster {pid} still running"
    );
}

#[tokio::test]
#[ignore = "helper: run by test_database_uses_database_url_when_set"]
async fn helper_test_databases_on_database_url() {
    if !is_helper() {
        return;
    }
    let a = TestDatabase::create().await.expect("create a");
    let b = TestDatabase::create().await.expect("create b");
    assert!(a.server().is_none() && b.server().is_none());
    assert_ne!(a.name(), b.name());
    let client = a.client().await.expect("connect a");
    assert_eq!(
        count_rows(&client, "tokenlease_migrations").await,
        MIGRATIONS.len() as i64
    );
    println!("CREATED {} {}", a.name(), b.name());
}

/// With DATABASE_URL set, TestDatabase makes databases on that server (no cluster of its own)
/// and drops them again. The variable is process-wide, so the check runs in a child process.
#[tokio::test]
async fn test_database_uses_database_url_when_set() {
    let pg = TempPostgres::start().expect("start");
    let output = helper(
        "helper_test_databases_on_database_url",
        &[("DATABASE_URL", &pg.url())],
    )
    .output()
    .expect("run helper");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("CREATED "),
        "helper failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let client = connect(&pg.connection_string("postgres"))
        .await
        .expect("connect");
    let left = client
        .query_typed_one(
            "SELECT count(*) FROM pg_database WHERE datname LIKE 'tokenlease_test_%'",
            &[],
        )
        .await
        .expect("count")
        .get::<_, i64>(0);
    assert_eq!(left, 0, "test databases were not dropped");
}

/// Not a check: prints how long a cluster takes to start with and without the template cache.
/// `cargo test -p tokenlease-testkit --test testkit start_times -- --ignored --nocapture`
#[test]
#[ignore = "timing report, run by hand"]
fn start_times_with_and_without_the_template_cache() {
    let _warm = TempPostgres::start().expect("warm the cache");
    for _ in 0..3 {
        let t = Instant::now();
        let pg = TempPostgres::start().expect("cached");
        let cached = t.elapsed();
        let t = Instant::now();
        drop(pg);
        let dropped = t.elapsed();
        let t = Instant::now();
        let pg = TempPostgres::builder()
            .template_cache(false)
            .start()
            .expect("uncached");
        let uncached = t.elapsed();
        drop(pg);
        println!("start cached {cached:?}, uncached (initdb) {uncached:?}; drop {dropped:?}");
    }
}

/// D7 freezes the server with SIGSTOP; a test that fails before resuming it must still not
/// leave a frozen server behind.
#[test]
fn drop_stops_a_server_frozen_with_sigstop() {
    let pg = TempPostgres::start().expect("start");
    let pid = pg.postmaster_pid().expect("pid");
    let data = pg.data_dir().to_path_buf();
    let status = std::process::Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .expect("kill -STOP");
    assert!(status.success());
    let started = Instant::now();
    drop(pg);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "drop took {:?}",
        started.elapsed()
    );
    assert!(!data.exists());
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().chars().next())
        })
        .flatten();
    assert!(
        state.is_none() || state == Some('Z'),
        "postmaster {pid}: {state:?}"
    );
}
