//! Helpers shared by the integration tests: databases, plans, and the ideal-bucket envelope.
#![allow(dead_code, unreachable_pub)]

pub mod traffic;

use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use tokenlease::bucket::{BucketConfig, Rate, Tokens};
use tokenlease::policy::Plan;
use tokenlease::store::{PostgresStore, Store as _};
use tokenlease_testkit::TestDatabase;

/// One test at a time within a test binary, whatever the harness does: the timing-dependent
/// tests that must not share the machine with another test of their binary hold this guard
/// while they run. nextest runs every test in a process of its own (and the `serial` group one
/// at a time, `.config/nextest.toml`); `cargo test` runs a binary's tests on parallel threads of
/// one process, and there this lock keeps them apart. A tokio lock: a test that fails holding it
/// does not poison it for the next.
pub async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    SERIAL.lock().await
}

/// The process's metrics recorder, installed on first use (a process has one global recorder,
/// so every test of a binary shares it). A snapshot returns the counters since the previous
/// snapshot and drains the histograms, so a test that reads it holds [`serial`]: under
/// `cargo test` another test's snapshot would take its counts. Tests that want a recorder of
/// their own install it with `metrics::with_local_recorder` (as `metrics` and `http_routes` do).
pub fn metrics() -> &'static metrics_util::debugging::Snapshotter {
    static SNAPSHOTTER: std::sync::OnceLock<metrics_util::debugging::Snapshotter> =
        std::sync::OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().expect("install the metrics recorder");
        snapshotter
    })
}

/// A fresh database with migrations applied (DATABASE_URL's server, or a throwaway cluster).
pub async fn database() -> TestDatabase {
    TestDatabase::create()
        .await
        .expect("a test database (install PostgreSQL server binaries or set DATABASE_URL)")
}

/// A store on `db` with its own pool of `pool` connections and generous timeouts (these tests
/// are about correctness, not about failure behaviour).
pub async fn store(db: &TestDatabase, pool: u32) -> PostgresStore {
    store_at(&db.connection_string(), pool, true).await
}

/// A store on `connection` (a proxy), as [`store`], migrating first when asked. It prepares
/// its statements once per session, the default.
pub async fn store_at(connection: &str, pool: u32, migrate: bool) -> PostgresStore {
    store_with(connection, pool, migrate, true).await
}

/// A store on `connection` as [`store_at`] (no migrations) that prepares its statements once
/// per session (`PostgresStoreBuilder::prepared_statements`, the default).
pub async fn prepared_store_at(connection: &str, pool: u32) -> PostgresStore {
    store_with(connection, pool, false, true).await
}

/// A store on `connection` as [`store_at`] that sends every statement unnamed, parsed and
/// planned on each call (`prepared_statements(false)`): what a transaction pooler without
/// prepared-statement support needs.
pub async fn unprepared_store_at(connection: &str, pool: u32, migrate: bool) -> PostgresStore {
    store_with(connection, pool, migrate, false).await
}

async fn store_with(connection: &str, pool: u32, migrate: bool, prepared: bool) -> PostgresStore {
    PostgresStore::builder(connection)
        .expect("connection string")
        .pool_size(pool)
        .migrate(migrate)
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

// `fault_store(connection, pool)`: a store with the fault tests' settings (50 ms call and
// pool-wait timeouts, a 250 ms connect timeout, 100 ms statement and lock timeouts), built
// again until its first connection comes within the pool wait. One definition with the
// library's pool test (`src/pool_tests.rs`), in the test kit.
tokenlease_testkit::fault_store!(tokenlease::store, eventually);

/// What one look at a condition saw: done (with what it yields), or not yet (with what was seen
/// instead, for the failure message). `true`/`false`, `Some`/`None`, `Ok`/`Err(seen)`.
pub trait Polled {
    type Done;
    type Seen: std::fmt::Debug;
    fn outcome(self) -> Result<Self::Done, Self::Seen>;
}

impl Polled for bool {
    type Done = ();
    type Seen = bool;
    fn outcome(self) -> Result<(), bool> {
        if self { Ok(()) } else { Err(false) }
    }
}

impl<T> Polled for Option<T> {
    type Done = T;
    type Seen = &'static str;
    fn outcome(self) -> Result<T, &'static str> {
        self.ok_or("None")
    }
}

impl<T, S: std::fmt::Debug> Polled for Result<T, S> {
    type Done = T;
    type Seen = S;
    fn outcome(self) -> Self {
        self
    }
}

/// The one place where a test waits for something by looking again (L4): looks at `check`
/// at once, then every `step` of tokio's clock (real time, or the paused clock of a test that
/// paused it), the last look at the deadline, `within` from now. What it yielded once done, or
/// what the last look saw.
pub async fn poll_until<P: Polled>(
    step: Duration,
    within: Duration,
    mut check: impl AsyncFnMut() -> P,
) -> Result<P::Done, P::Seen> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let seen = match check().await.outcome() {
            Ok(done) => return Ok(done),
            Err(seen) => seen,
        };
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Err(seen);
        }
        tokio::time::sleep(step.min(deadline - now)).await;
    }
}

/// [`poll_until`], failing the test naming `what` never happened, and what the last look saw.
pub async fn eventually<P: Polled>(
    step: Duration,
    within: Duration,
    what: &str,
    check: impl AsyncFnMut() -> P,
) -> P::Done {
    match poll_until(step, within, check).await {
        Ok(done) => done,
        Err(seen) => panic!("{what}: not within {within:?}; last seen: {seen:?}"),
    }
}

/// [`poll_until`] for a thread outside any runtime (a `Drop`, a blocking test): the thread
/// sleeps between looks, on the real clock.
pub fn poll_until_blocking<P: Polled>(
    step: Duration,
    within: Duration,
    mut check: impl FnMut() -> P,
) -> Result<P::Done, P::Seen> {
    let deadline = std::time::Instant::now() + within;
    loop {
        let seen = match check().outcome() {
            Ok(done) => return Ok(done),
            Err(seen) => seen,
        };
        let now = std::time::Instant::now();
        if now >= deadline {
            return Err(seen);
        }
        std::thread::sleep(step.min(deadline - now));
    }
}

/// [`poll_until_blocking`], failing the test naming `what` never happened.
pub fn eventually_blocking<P: Polled>(
    step: Duration,
    within: Duration,
    what: &str,
    check: impl FnMut() -> P,
) -> P::Done {
    match poll_until_blocking(step, within, check) {
        Ok(done) => done,
        Err(seen) => panic!("{what}: not within {within:?}; last seen: {seen:?}"),
    }
}

/// A bucket of `capacity` whole tokens refilling at `per_second` tokens a second.
pub fn bucket(capacity: u64, per_second: f64) -> BucketConfig {
    BucketConfig::new(
        Tokens::whole(capacity),
        Rate::from_f64(per_second).expect("rate"),
    )
    .expect("bucket")
}

/// A direct-mode plan named "test" over [`bucket`].
pub fn plan(capacity: u64, per_second: f64) -> Plan {
    Plan::new("test", bucket(capacity, per_second))
}

/// Seconds between two store timestamps.
pub fn secs_between(earlier: SystemTime, later: SystemTime) -> f64 {
    later
        .duration_since(earlier)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The largest excess over the envelope `capacity + rate × (w + slack)` of the admitted cost in
/// any window of length `w`, over admissions given as (seconds, cost) sorted by time. Two
/// pointers, linear time. Returns (worst excess, the window's admitted cost).
pub fn worst_window(
    admissions: &[(f64, f64)],
    w: f64,
    capacity: f64,
    rate: f64,
    slack: f64,
) -> (f64, f64) {
    let mut worst = (f64::NEG_INFINITY, 0.0);
    let mut start = 0;
    let mut sum = 0.0;
    for end in 0..admissions.len() {
        sum += admissions[end].1;
        while admissions[end].0 - admissions[start].0 > w {
            sum -= admissions[start].1;
            start += 1;
        }
        let excess = sum - (capacity + rate * (w + slack));
        if excess > worst.0 {
            worst = (excess, sum);
        }
    }
    worst
}

/// Lease conservation, exact: every token `who` was granted was admitted (`admitted`, whole
/// tokens), given back, stranded, waived, or is still held.
pub fn assert_conserved(who: &str, admitted: f64, stats: &tokenlease::LeaseStats) {
    assert!(
        (admitted + stats.returned + stats.stranded + stats.waived + stats.outstanding
            - stats.leased)
            .abs()
            < 1e-9,
        "{who}: admitted {admitted} + returned {} + stranded {} + waived {} + outstanding {} \
         != leased {}",
        stats.returned,
        stats.stranded,
        stats.waived,
        stats.outstanding,
        stats.leased
    );
}

/// `n` throwaway clusters, started concurrently (each start blocks: `spawn_blocking`).
pub async fn clusters(n: usize) -> Vec<std::sync::Arc<tokenlease_testkit::TempPostgres>> {
    let starts: Vec<_> = (0..n)
        .map(|_| tokio::task::spawn_blocking(tokenlease_testkit::TempPostgres::start))
        .collect();
    let mut out = Vec::with_capacity(n);
    for start in starts {
        let pg = start
            .await
            .expect("start task")
            .expect("a throwaway cluster (install PostgreSQL server binaries)");
        out.push(std::sync::Arc::new(pg));
    }
    out
}

/// The first `count` keys `prefix:0`, `prefix:1`, … that the shards named `names` place on
/// shard `shard`.
pub fn keys_on(names: &[&str], shard: usize, prefix: &str, count: usize) -> Vec<String> {
    (0..)
        .map(|i| format!("{prefix}:{i}"))
        .filter(|k| tokenlease::store::shard_of(names, k) == Some(shard))
        .take(count)
        .collect()
}

/// Takes whatever `key`'s bucket holds (at least one token, up to its capacity), every 2 ms
/// for a second; what was granted and the database time of the last grant. Greedy takes, so
/// that a slow machine's fewer calls still take everything there is.
pub async fn take_for_a_second(
    store: &tokenlease::store::ShardedStore,
    key: &str,
    bucket: tokenlease::bucket::BucketConfig,
) -> (f64, std::time::SystemTime) {
    let started = std::time::Instant::now();
    let mut granted = 0.0;
    let mut last = std::time::SystemTime::UNIX_EPOCH;
    while started.elapsed() < std::time::Duration::from_secs(1) {
        let a = store
            .acquire(tokenlease::store::AcquireRequest::lease(
                key,
                bucket,
                tokenlease::bucket::Tokens::whole(1),
                tokenlease::bucket::Tokens::whole(100),
            ))
            .await
            .expect("acquire");
        granted += a.granted.as_f64();
        if !a.granted.is_zero() {
            last = a.store_now;
        }
        // sleep: pacing, a take every 2 ms.
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    (granted, last)
}

/// Waits until `limiter`'s lease actor is idle (no statement in flight, no give-back to send
/// again, no refill asked for and not yet sent), at most `limit`: the refills that earlier calls
/// asked for have landed. Panics past `limit`, naming the lease counters.
pub async fn actor_idle(limiter: &tokenlease::Limiter, limit: Duration) {
    if tokio::time::timeout(limit, limiter.leases_idle())
        .await
        .is_err()
    {
        panic!(
            "the lease actor not idle within {limit:?}: {:?}",
            limiter.lease_stats()
        );
    }
}

/// A policy of `n` plans `p0`, `p1`, … and a rule `k{i}:` for the last one.
pub fn many_plans(n: usize) -> String {
    let mut json = String::from(r#"{ "plans": {"#);
    for i in 0..n {
        let comma = if i == 0 { "" } else { "," };
        let _ = write!(
            json,
            r#"{comma}"p{i}":{{"capacity":1,"refill_per_second":1}}"#
        );
    }
    let _ = write!(
        json,
        r#"}}, "keys": [ {{ "prefix": "k:", "plan": "p{}" }} ] }}"#,
        n - 1
    );
    json
}
