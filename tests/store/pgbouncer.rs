//! D8: the limiter behind PgBouncer in transaction pooling.
//!
//! Starts Debian's `pgbouncer` (as the `postgres` OS user when run as root, through
//! `runuser -u postgres --`) with `pool_mode = transaction` and `default_pool_size = 2` in front
//! of a throwaway PostgreSQL, on a free loopback port, with trust authentication. Then:
//!
//! - two limiter instances (each with its own pool) × 16 tasks take from one key for 3 s in
//!   direct mode: every decision comes from the store, no store call fails (so none mentions
//!   "prepared statement": the store sends `query_typed`, unnamed statements), and every sliding
//!   window holds the envelope of one ideal bucket, as in `tests/store/concurrency.rs`;
//! - the negative control: plain `tokio_postgres::Client::query` (named prepared statements)
//!   from several clients through the same PgBouncer fails with a prepared-statement error,
//!   which proves the set-up really multiplexes server connections.
//!
//! The store sets `statement_timeout`, `lock_timeout` and `synchronous_commit` through the
//! startup packet's `options`, which PgBouncer refuses unless told to ignore it
//! (`ignore_startup_parameters = options`); ignored, those settings would be lost, so the
//! database entry sets them again with `connect_query` on every server connection, and the test
//! checks that they hold.
//!
//! Without a `pgbouncer` binary the tests fail with the command that installs it.

use crate::common;
use crate::subject::client;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use parking_lot::Mutex;
use tokenlease::bucket::Tokens;
use tokenlease::store::{
    AcquireRequest, Acquired, BucketRow, GiveBack, PostgresStore, Store, StoreError,
};
use tokenlease::{DecidedBy, Limiter};
use tokenlease_testkit::TempPostgres;

const C: f64 = 100.0;
const R: f64 = 50.0;
const SLACK: f64 = 0.02;
const WINDOWS: [f64; 5] = [0.1, 0.5, 1.0, 2.0, 5.0];

/// Where `pgbouncer` is: on `PATH`, or Debian's `/usr/sbin` (not on a normal user's `PATH`).
fn pgbouncer_binary() -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/bin")])
        .map(|dir| dir.join("pgbouncer"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "pgbouncer is not installed: install it with `apt-get install -y pgbouncer` \
                 (Debian/Ubuntu; .ci/run does this) and run the tests again"
            )
        })
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A running PgBouncer; stopped (SIGTERM to the pid in its pidfile, then the child is reaped)
/// and its directory removed on drop.
struct PgBouncer {
    child: Child,
    dir: tempfile::TempDir,
    port: u16,
}

impl PgBouncer {
    fn start(pg: &TempPostgres) -> PgBouncer {
        let binary = pgbouncer_binary();
        let root = running_as_root();
        // The `postgres` user must reach the directory: use /tmp, not a root-only TMPDIR.
        let dir = tempfile::Builder::new()
            .prefix("tokenlease-pgbouncer-")
            .tempdir_in("/tmp")
            .expect("temp dir");
        let port = free_port();
        let path = |name: &str| dir.path().join(name).display().to_string();
        std::fs::write(dir.path().join("userlist.txt"), "\"postgres\" \"\"\n").expect("auth file");
        let config = format!(
            "[databases]\n\
             postgres = host=127.0.0.1 port={pg_port} dbname=postgres user=postgres \
             connect_query='SET statement_timeout = 100; SET lock_timeout = 100; \
                            SET synchronous_commit = off'\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {auth}\n\
             pool_mode = transaction\n\
             default_pool_size = 2\n\
             max_client_conn = 200\n\
             ignore_startup_parameters = options,extra_float_digits\n\
             logfile = {log}\n\
             pidfile = {pid}\n",
            pg_port = pg.port(),
            auth = path("userlist.txt"),
            log = path("pgbouncer.log"),
            pid = path("pgbouncer.pid"),
        );
        let ini = dir.path().join("pgbouncer.ini");
        std::fs::write(&ini, config).expect("config");
        let mut command = if root {
            let status = Command::new("chown")
                .args(["-R", "postgres"])
                .arg(dir.path())
                .status()
                .expect("chown");
            assert!(
                status.success(),
                "chown the PgBouncer directory to postgres"
            );
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&binary);
            c
        } else {
            Command::new(&binary)
        };
        let child = command
            .arg(&ini)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", binary.display()));
        let bouncer = PgBouncer { child, dir, port };
        let listening =
            common::poll_until_blocking(Duration::from_millis(20), Duration::from_secs(10), || {
                std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            });
        assert!(
            listening.is_ok(),
            "PgBouncer did not listen on {port}; its log:\n{}",
            bouncer.log()
        );
        bouncer
    }

    fn connection_string(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port
        )
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pgbouncer.log")).unwrap_or_default()
    }

    fn pid(dir: &Path) -> Option<u32> {
        std::fs::read_to_string(dir.join("pgbouncer.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        // PgBouncer's own pid (the child may be `runuser`, which would not pass on SIGKILL).
        if let Some(pid) = Self::pid(self.dir.path()) {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        let exited =
            common::poll_until_blocking(Duration::from_millis(20), Duration::from_secs(5), || {
                matches!(self.child.try_wait(), Ok(Some(_)))
            });
        if exited.is_ok() {
            return;
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The store's errors, kept for the assertions (the limiter turns them into fallback decisions).
#[derive(Debug)]
struct Errors {
    inner: PostgresStore,
    seen: Arc<Mutex<Vec<String>>>,
}

impl Errors {
    fn keep<T>(&self, r: Result<T, StoreError>) -> Result<T, StoreError> {
        if let Err(e) = &r {
            let source = std::error::Error::source(e)
                .map(|s| format!(": {s}"))
                .unwrap_or_default();
            self.seen.lock().push(format!("{e}{source}"));
        }
        r
    }
}

#[async_trait]
impl Store for Errors {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        self.keep(self.inner.acquire(request).await)
    }
    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        self.keep(self.inner.acquire_many(requests).await)
    }
    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        self.keep(self.inner.give_back(returns).await)
    }
    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        self.keep(self.inner.delete_idle(limit).await)
    }
    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        self.keep(self.inner.inspect(key).await)
    }
}

/// A store through PgBouncer with generous timeouts (this test is about correctness).
async fn store(connection: &str, migrate: bool) -> PostgresStore {
    common::unprepared_store_at(connection, 4, migrate).await
}

fn start_servers() -> (TempPostgres, PgBouncer) {
    let pg = TempPostgres::start()
        .expect("a throwaway PostgreSQL (install the server binaries: apt-get install postgresql)");
    let bouncer = PgBouncer::start(&pg);
    (pg, bouncer)
}

/// A store that prepares its statements, through PgBouncer 1.18 in transaction pooling (which
/// does not carry prepared statements between server sessions): the first refusal turns the
/// setting off, the refused call is sent again unnamed, and every call is answered exactly.
/// 8 tasks take 1 token 40 times each from keys of their own (capacity 1,000, a token a minute);
/// every take is granted, and each row then holds 960 tokens (its refill aside).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preparing_store_falls_back_to_unnamed_statements_behind_pgbouncer() {
    let _serial = common::serial().await;
    let (pg, bouncer) = tokio::task::spawn_blocking(start_servers)
        .await
        .expect("join");
    drop(store(&pg.connection_string("postgres"), true).await);
    let store = Arc::new(common::prepared_store_at(&bouncer.connection_string(), 4).await);
    let config = common::bucket(1000, 1.0 / 60.0);
    let tasks: Vec<_> = (0..8)
        .map(|t| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                let key = format!("prepared:{t}");
                for call in 0..40 {
                    let a = store
                        .acquire(AcquireRequest::take(&key, config, Tokens::whole(1)))
                        .await
                        .unwrap_or_else(|e| panic!("task {t}, call {call}: {e}"));
                    assert_eq!(a.granted.floor(), 1, "task {t}, call {call}");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    let direct = client(&pg.connection_string("postgres")).await;
    let rows = direct
        .query(
            "SELECT key, tokens / 1000000000 FROM tokenlease_buckets WHERE key LIKE 'prepared:%'",
            &[],
        )
        .await
        .expect("rows");
    assert_eq!(rows.len(), 8);
    for row in rows {
        let (key, tokens): (String, i64) = (row.get(0), row.get(1));
        assert_eq!(tokens, 960, "{key}");
    }
}

/// D8: C1 for 3 s through PgBouncer in transaction pooling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_through_pgbouncer_hold_the_envelope() {
    let _serial = common::serial().await;
    let (pg, bouncer) = tokio::task::spawn_blocking(start_servers)
        .await
        .expect("join");
    // Migrations take a session advisory lock: run them straight against the server.
    drop(store(&pg.connection_string("postgres"), true).await);
    // The settings the store's `options` would carry hold through connect_query.
    let via = client(&bouncer.connection_string()).await;
    let shown = via
        .simple_query("SHOW statement_timeout")
        .await
        .expect("SHOW statement_timeout through PgBouncer");
    let statement_timeout = shown
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        })
        .unwrap_or_default();
    assert_eq!(
        statement_timeout, "100ms",
        "connect_query sets statement_timeout"
    );
    let shown = via
        .simple_query("SHOW synchronous_commit")
        .await
        .expect("SHOW synchronous_commit through PgBouncer");
    let commit = shown
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        })
        .unwrap_or_default();
    assert_eq!(commit, "off", "connect_query sets synchronous_commit");

    let plan = Arc::new(common::plan(100, R));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut handles = Vec::new();
    for instance in 0..2 {
        let limiter = Limiter::builder(Errors {
            inner: store(&bouncer.connection_string(), false).await,
            seen: Arc::clone(&seen),
        })
        .build();
        for _ in 0..16 {
            let (limiter, plan) = (limiter.clone(), Arc::clone(&plan));
            handles.push(tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_secs(3);
                let (mut admitted, mut denied, mut other) = (Vec::new(), 0u64, 0u64);
                while Instant::now() < deadline {
                    let d = limiter
                        .try_acquire_with(&plan, "hot", 1.0)
                        .await
                        .expect("decision");
                    match (d.decided_by, d.allowed) {
                        (DecidedBy::Store, true) => {
                            admitted.push(d.store_time.expect("store time"));
                        }
                        (DecidedBy::Store, false) => denied += 1,
                        _ => other += 1,
                    }
                    // sleep: pacing, calls 200 µs apart.
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
                (instance, admitted, denied, other)
            }));
        }
    }
    let mut admissions: Vec<SystemTime> = Vec::new();
    let (mut denied, mut not_store) = ([0u64; 2], 0u64);
    for h in handles {
        let (instance, a, d, o) = h.await.expect("task");
        admissions.extend(a);
        denied[instance] += d;
        not_store += o;
    }
    let errors = seen.lock().clone();
    let prepared = errors
        .iter()
        .filter(|e| e.contains("prepared statement"))
        .count();
    admissions.sort();
    let t0 = *admissions.first().expect("admissions");
    let t = common::secs_between(t0, *admissions.last().expect("admissions"));
    let points: Vec<(f64, f64)> = admissions
        .iter()
        .map(|&a| (common::secs_between(t0, a), 1.0))
        .collect();
    let admitted = points.len() as f64;
    let ideal = C + R * t;
    eprintln!(
        "D8: {admitted} admitted over {t:.3} s (ideal {ideal:.1}), denials {denied:?}, \
         {not_store} not decided by the store, {} store errors ({prepared} prepared-statement)",
        errors.len()
    );
    assert_eq!(prepared, 0, "prepared-statement errors: {errors:?}");
    // The server cancels a statement after the 100 ms its `connect_query` sets: on a loaded
    // machine a statement now and then runs that long (SQLSTATE 57014), and its callers are
    // decided by the fallback. That is the timeout doing its job, not PgBouncer; any other
    // error, or more than a handful of these, fails the test.
    let timeouts = errors.iter().filter(|e| e.contains("57014")).count();
    assert!(
        timeouts == errors.len() && timeouts <= 10,
        "store errors through PgBouncer: {errors:?}"
    );
    // Each cancelled statement hands its callers to the fallback: at most the 32 tasks that can
    // be waiting on it. With no store error, every decision is the store's.
    assert!(
        not_store <= 32 * timeouts as u64,
        "{not_store} decisions not from the store, with {timeouts} cancelled statements"
    );
    for w in WINDOWS {
        let (excess, count) = common::worst_window(&points, w, C, R, SLACK);
        assert!(
            excess <= 1.0 + 1e-6,
            "window {w} s admitted {count}, more than {C} + {R}·({w} + {SLACK}) + 1"
        );
    }
    assert!(
        admitted <= ideal + 1.0,
        "admitted {admitted} > ideal {ideal}"
    );
    assert!(
        admitted >= 0.8 * ideal,
        "liveness: admitted {admitted} < 80% of {ideal}"
    );
    assert!(denied.iter().all(|&d| d > 0), "each instance denies");
    drop(bouncer);
    drop(pg);
}

/// D8's negative control: named prepared statements (plain `Client::query`) from several
/// clients through the same transaction-pooling PgBouncer break, as in rust-postgres#959: the
/// statement is prepared on one server connection and executed on another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_prepared_statements_break_through_pgbouncer() {
    let _serial = common::serial().await;
    let (pg, bouncer) = tokio::task::spawn_blocking(start_servers)
        .await
        .expect("join");
    let mut handles = Vec::new();
    for i in 0..4i32 {
        let connection = bouncer.connection_string();
        handles.push(tokio::spawn(async move {
            let client = client(&connection).await;
            let deadline = Instant::now() + Duration::from_secs(3);
            let mut errors = Vec::new();
            let mut ok = 0u64;
            while Instant::now() < deadline && errors.is_empty() {
                match client.query("SELECT $1::int4 + 1", &[&i]).await {
                    Ok(_) => ok += 1,
                    Err(e) => errors.push(
                        e.as_db_error()
                            .map(|db| db.message().to_owned())
                            .unwrap_or_else(|| e.to_string()),
                    ),
                }
            }
            (ok, errors)
        }));
    }
    let mut all = Vec::new();
    let mut ok = 0;
    for h in handles {
        let (n, errors) = h.await.expect("task");
        ok += n;
        all.extend(errors);
    }
    eprintln!("D8 control: {ok} queries succeeded, errors: {all:?}");
    assert!(
        all.iter().any(|e| e.contains("prepared statement")),
        "named prepared statements through transaction pooling should fail; errors: {all:?}"
    );
    drop(bouncer);
    drop(pg);
}
