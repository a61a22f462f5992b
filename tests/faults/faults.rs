//! Fault injection (D1–D5, D7, D9), each test in every fallback mode: deny, allow, and
//! local (C/N, r/N per instance with N = 2). D6, the pool exhausted, takes the store's pooled
//! connections, which are not public API: it is a unit test of the crate, `src/pool_tests.rs`.
//!
//! Each test starts its own throwaway cluster. Limiters reach it either directly (to stop the
//! real server) or through the fault proxy (`tokenlease_testkit::FaultProxy`), with the
//! plan's settings: call timeout 50 ms, connect timeout 250 ms, server-side `statement_timeout`
//! 100 ms, a pool of 4, and a [`CircuitBreaker`] with its defaults (opens after 5 transient
//! failures, back-off 50 ms doubling to 500 ms). Under the breaker a recording wrapper logs
//! every call that reached the database, so the tests measure store calls and caller waits
//! separately.
//!
//! Timing-dependent: runs in the nextest `serial` group, and the tests of this file take a lock
//! so `cargo test` runs them one at a time too. Each prints its figures (`--nocapture`).

use crate::common;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use metrics_util::debugging::DebugValue;
use parking_lot::Mutex;
use tokenlease::bucket::Timestamp;
use tokenlease::clock::{Clock, SystemClock, timestamp_from_system_time};
use tokenlease::policy::{FallbackMode, FallbackSettings, LeaseSettings, Plan};
use tokenlease::store::{
    AcquireRequest, Acquired, BucketRow, CircuitBreaker, GiveBack, PostgresStore, Store,
    StoreError, TimeoutKind,
};
use tokenlease::{DecidedBy, Limiter};
use tokenlease_testkit::{StopMode, TempPostgres};
use tokio_postgres::NoTls;

use tokenlease_testkit::FaultProxy as Proxy;

const C: u64 = 100;
const R: f64 = 50.0;
/// Limiter instances.
const N: usize = 2;
/// Lease batch: the default lease is at most 0.1 × C.
const B: f64 = 10.0;
const EPS: f64 = 0.02;
const KEY: &str = "faults:hot";
/// The longest a direct-mode caller may wait: a caller that arrives while its key's statement
/// is in flight waits for it (up to the 50 ms call timeout), then for its own round (another
/// 50 ms); plus scheduling slack.
const DIRECT_WAIT: Duration = Duration::from_millis(120);

/// A metric as read from a snapshot: name, labels, value.
type Metric = (String, Vec<(String, String)>, DebugValue);

/// Sum of the counter `name` with all of `labels`, since the previous snapshot.
fn counter_delta(snapshot: &[Metric], name: &str, labels: &[(&str, &str)]) -> u64 {
    snapshot
        .iter()
        .filter(|(n, l, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
        })
        .map(|(.., v)| match v {
            DebugValue::Counter(n) => *n,
            _ => 0,
        })
        .sum()
}

fn snapshot() -> Vec<Metric> {
    common::metrics()
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(k, _, _, v)| {
            let key = k.key();
            let labels = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            (key.name().to_owned(), labels, v)
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Modes and plans

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Deny,
    Allow,
    Local,
}

impl Mode {
    fn fallback(self) -> FallbackMode {
        match self {
            Mode::Deny => FallbackMode::Deny,
            Mode::Allow => FallbackMode::Allow,
            Mode::Local => FallbackMode::Local {
                instances: NonZeroU32::new(N as u32).expect("N > 0"),
            },
        }
    }

    fn label(self) -> &'static str {
        match self {
            Mode::Deny => "deny",
            Mode::Allow => "allow",
            Mode::Local => "local",
        }
    }
}

fn direct_plan(mode: Mode, capacity: u64, rate: f64) -> Arc<Plan> {
    Arc::new(common::plan(capacity, rate).with_fallback(FallbackSettings::new(mode.fallback())))
}

fn leased_plan(mode: Mode) -> Arc<Plan> {
    Arc::new(
        common::plan(C, R)
            .with_lease(LeaseSettings::default())
            .with_fallback(FallbackSettings::new(mode.fallback())),
    )
}

// ---------------------------------------------------------------------------------------------
// A store wrapper that logs every call reaching the database

/// One store call that reached the database (the breaker let it through).
#[derive(Debug, Clone)]
struct Call {
    start: Instant,
    took: Duration,
    /// `None` on success, else the error's class.
    error: Option<String>,
}

#[derive(Debug, Default, Clone)]
struct Log {
    calls: Arc<Mutex<Vec<Call>>>,
    in_flight: Arc<AtomicUsize>,
    max_in_flight: Arc<AtomicUsize>,
}

struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn class(e: &StoreError) -> String {
    match e {
        StoreError::Timeout {
            kind: TimeoutKind::Pool,
            ..
        } => "timeout-pool".into(),
        StoreError::Timeout { .. } => "timeout-call".into(),
        StoreError::Connection(_) => "connection".into(),
        StoreError::Database { code, .. } => format!("db-{code}"),
        StoreError::CircuitOpen { .. } => "circuit-open".into(),
        other => format!("other: {other}"),
    }
}

impl Log {
    async fn run<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(n, Ordering::SeqCst);
        let _guard = InFlight(&self.in_flight);
        let start = Instant::now();
        let result = call.await;
        self.calls.lock().push(Call {
            start,
            took: start.elapsed(),
            error: result.as_ref().err().map(class),
        });
        result
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().clone()
    }
}

#[derive(Debug)]
struct Recording {
    inner: PostgresStore,
    log: Log,
}

#[async_trait]
impl Store for Recording {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        self.log.run(self.inner.acquire(request)).await
    }
    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        self.log.run(self.inner.acquire_many(requests)).await
    }
    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        self.log.run(self.inner.give_back(returns)).await
    }
    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        self.log.run(self.inner.delete_idle(limit)).await
    }
    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        self.log.run(self.inner.inspect(key)).await
    }
}

// ---------------------------------------------------------------------------------------------
// The rig: a cluster, a proxy in front of it, limiter instances

struct Rig {
    pg: Arc<TempPostgres>,
    proxy: Proxy,
}

/// One limiter instance: its own pool, breaker and log.
#[derive(Clone)]
struct Instance {
    limiter: Limiter,
    breaker: Arc<CircuitBreaker<Recording>>,
    log: Log,
}

impl Rig {
    async fn start() -> Rig {
        let pg = tokio::task::spawn_blocking(TempPostgres::start)
            .await
            .expect("join")
            .expect(
                "a throwaway PostgreSQL (install the server binaries: apt-get install postgresql)",
            );
        let upstream = format!("127.0.0.1:{}", pg.port()).parse().expect("address");
        let proxy = Proxy::start(upstream).await.expect("proxy");
        Rig {
            pg: Arc::new(pg),
            proxy,
        }
    }

    fn direct(&self) -> String {
        self.pg.connection_string("postgres")
    }

    fn proxied(&self) -> String {
        Self::via(&self.proxy)
    }

    /// The connection string through `proxy`.
    fn via(proxy: &Proxy) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            proxy.port()
        )
    }

    /// A limiter instance on `connection` with the plan's failure settings and `pool`
    /// connections.
    async fn instance(&self, connection: &str, pool: u32) -> Instance {
        self.instance_with(connection, pool, "default", SystemClock)
            .await
    }

    /// As [`instance`](Self::instance), with the breaker named `name` (the `store` label of its
    /// metrics) and measuring the clock skew against `wall`.
    async fn instance_with(
        &self,
        connection: &str,
        pool: u32,
        name: &str,
        wall: impl Clock,
    ) -> Instance {
        let store = common::fault_store(connection, pool).await;
        let log = Log::default();
        let breaker = Arc::new(
            CircuitBreaker::new(Recording {
                inner: store,
                log: log.clone(),
            })
            .name(name)
            .wall_clock(wall),
        );
        let limiter = Limiter::builder_shared(Arc::clone(&breaker) as Arc<dyn Store>).build();
        Instance {
            limiter,
            breaker,
            log,
        }
    }

    /// A plain session straight to the server, for the test's own queries.
    async fn admin(&self) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(&self.direct(), NoTls)
            .await
            .expect("admin connection");
        tokio::spawn(async move {
            let _ = connection.await;
        });
        client
    }

    /// The bucket row, read straight from the server.
    async fn row(&self, key: &str) -> Option<BucketRow> {
        let store = PostgresStore::builder(&self.direct())
            .expect("connection string")
            .pool_size(1)
            .migrate(false)
            .call_timeout(Duration::from_secs(5))
            .pool_wait_timeout(Duration::from_secs(5))
            .build()
            .await
            .expect("inspect store");
        store.inspect(key).await.expect("inspect")
    }

    /// The key's tokens now, read again every 20 ms until `done` holds of them (5 s at most:
    /// `Err` with the last reading).
    async fn row_until(&self, key: &str, done: impl Fn(f64) -> bool) -> Result<f64, f64> {
        common::poll_until(
            Duration::from_millis(20),
            Duration::from_secs(5),
            async || {
                let tokens = self.row(key).await.expect("row").tokens_now.to_f64();
                if done(tokens) {
                    Ok(tokens)
                } else {
                    Err(tokens)
                }
            },
        )
        .await
    }

    /// Limiter connections open on the server now.
    async fn limiter_connections(admin: &tokio_postgres::Client) -> i64 {
        admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'tokenlease'",
                &[],
            )
            .await
            .map(|row| row.get(0))
            .unwrap_or(-1)
    }

    /// Runs a blocking server operation off the runtime's workers, returning how long it took.
    async fn server(&self, op: impl FnOnce(&TempPostgres) + Send + 'static) {
        let pg = Arc::clone(&self.pg);
        tokio::task::spawn_blocking(move || op(&pg))
            .await
            .expect("server operation");
    }
}

// ---------------------------------------------------------------------------------------------
// Load and measurements

/// One decision.
#[derive(Debug, Clone, Copy)]
struct Event {
    /// When the call started, since the run's origin.
    at: Duration,
    instance: usize,
    allowed: bool,
    by: DecidedBy,
    /// How long the caller waited.
    took: Duration,
    /// The store's clock when it decided (store decisions only).
    store_time: Option<SystemTime>,
}

/// Runs `tasks` callers per instance on [`KEY`] from now until `origin + until`, each pausing
/// `pace` between calls (demand well above the refill rate).
fn drive(
    instances: &[Instance],
    plan: &Arc<Plan>,
    tasks: usize,
    origin: Instant,
    until: Duration,
) -> tokio::task::JoinHandle<Vec<Event>> {
    let until = Arc::new(AtomicU64::new(until.as_millis() as u64));
    drive_until(instances, plan, tasks, origin, &until)
}

/// As [`drive`], until the time in `until` (ms after `origin`), which the test may move.
fn drive_until(
    instances: &[Instance],
    plan: &Arc<Plan>,
    tasks: usize,
    origin: Instant,
    until: &Arc<AtomicU64>,
) -> tokio::task::JoinHandle<Vec<Event>> {
    let mut handles = Vec::new();
    for (i, instance) in instances.iter().enumerate() {
        for _ in 0..tasks {
            let limiter = instance.limiter.clone();
            let plan = Arc::clone(plan);
            let until = Arc::clone(until);
            handles.push(tokio::spawn(async move {
                let mut events = Vec::new();
                while origin.elapsed() < Duration::from_millis(until.load(Ordering::Relaxed)) {
                    let start = Instant::now();
                    let d = limiter
                        .try_acquire_with(&plan, KEY, 1.0)
                        .await
                        .expect("a decision, never an error");
                    events.push(Event {
                        at: start - origin,
                        instance: i,
                        allowed: d.allowed,
                        by: d.decided_by,
                        took: start.elapsed(),
                        store_time: d.store_time,
                    });
                    // sleep: pacing, a call a millisecond per task.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                events
            }));
        }
    }
    tokio::spawn(async move {
        let mut all = Vec::new();
        for h in handles {
            all.extend(h.await.expect("no caller panicked"));
        }
        all.sort_by_key(|e| e.at);
        all
    })
}

fn percentile(mut v: Vec<Duration>, p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

/// Caller waits: (p50, p99, max).
fn waits(events: &[Event]) -> (Duration, Duration, Duration) {
    let v: Vec<Duration> = events.iter().map(|e| e.took).collect();
    let max = v.iter().copied().max().unwrap_or_default();
    (percentile(v.clone(), 0.5), percentile(v, 0.99), max)
}

fn in_window(e: &Event, from: Duration, to: Duration) -> bool {
    e.at >= from && e.at < to
}

/// The first successful database call at or after `after`, per instance; the latest of them.
fn recovered_at(instances: &[Instance], origin: Instant, after: Duration) -> Option<Duration> {
    instances
        .iter()
        .map(|i| {
            i.log
                .calls()
                .iter()
                .filter(|c| c.start - origin >= after && c.error.is_none())
                .map(|c| c.start + c.took - origin)
                .min()
        })
        .collect::<Option<Vec<_>>>()
        .and_then(|v| v.into_iter().max())
}

/// Database calls that started in the window: (count, failed, slowest).
fn calls_in(
    instances: &[Instance],
    origin: Instant,
    from: Duration,
    to: Duration,
) -> (usize, usize, Duration) {
    let calls: Vec<Call> = instances
        .iter()
        .flat_map(|i| i.log.calls())
        .filter(|c| c.start - origin >= from && c.start - origin < to)
        .collect();
    let failed = calls.iter().filter(|c| c.error.is_some()).count();
    let slowest = calls.iter().map(|c| c.took).max().unwrap_or_default();
    (calls.len(), failed, slowest)
}

/// Error classes of the database calls in the window, with counts.
fn error_classes(
    instances: &[Instance],
    origin: Instant,
    from: Duration,
    to: Duration,
) -> Vec<(String, usize)> {
    let mut classes: Vec<(String, usize)> = Vec::new();
    for c in instances.iter().flat_map(|i| i.log.calls()) {
        let t = c.start - origin;
        if let (Some(e), true) = (c.error, t >= from && t < to) {
            match classes.iter_mut().find(|(k, _)| *k == e) {
                Some(entry) => entry.1 += 1,
                None => classes.push((e, 1)),
            }
        }
    }
    classes
}

/// The worst excess over `C + R·(w + EPS) + extra` of admissions in `[from, to)` (local time),
/// for windows of 0.1, 0.5 and 1 s.
fn assert_windows(events: &[Event], from: Duration, to: Duration, extra: f64, what: &str) {
    let points: Vec<(f64, f64)> = events
        .iter()
        .filter(|e| e.allowed && in_window(e, from, to))
        .map(|e| (e.at.as_secs_f64(), 1.0))
        .collect();
    for w in [0.1, 0.5, 1.0] {
        let (excess, count) = common::worst_window(&points, w, C as f64, R, EPS);
        assert!(
            excess <= extra + 1e-9,
            "{what}: a {w} s window admitted {count} > {C} + {R}·({w} + {EPS}) + {extra}"
        );
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

macro_rules! per_mode {
    ($($(#[$doc:meta])* $name:ident => $body:ident;)*) => {$(
        $(#[$doc])*
        mod $name {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn deny() {
                let _serial = common::serial().await;
                $body(Mode::Deny).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn allow() {
                let _serial = common::serial().await;
                $body(Mode::Allow).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn local() {
                let _serial = common::serial().await;
                $body(Mode::Local).await;
            }
        }
    )*};
}

per_mode! {
    /// D1: the database stopped for real mid-run (`pg_ctl stop -m fast` at 2 s, started again
    /// at 4 s of a 6 s run), two leased instances.
    d1_database_stopped => d1;
    /// D2: 2 s of latency on every reply against a 50 ms call timeout, then a session holding
    /// the bucket row `FOR UPDATE` for 2 s.
    d2_latency => d2;
    /// D3: the statement commits but its reply comes after the call timed out; a retried
    /// return credits once.
    d3_committed_but_timed_out => d3;
    /// D4: connections reset by the proxies, then backends terminated by the server; two
    /// instances on one key.
    d4_connection_resets => d4;
    /// D5: a restart, fast and immediate, keeps the buckets.
    d5_restart_keeps_buckets => d5;
    /// D7: a hung database: the proxy black-holes every byte for 2 s.
    d7_hung_database => d7;
    /// D7: a hung database: the postmaster and its backends stopped with SIGSTOP for 2 s.
    d7_hung_database_sigstop => d7_sigstop;
    /// D9: the wall clock stepped +1 h and −1 h mid-run changes no count; the skew gauge shows
    /// the step.
    d9_wall_clock_steps => d9;
}

// ---------------------------------------------------------------------------------------------
// D1

async fn d1(mode: Mode) {
    let rig = Rig::start().await;
    let mut instances = Vec::new();
    for _ in 0..N {
        instances.push(rig.instance(&rig.direct(), 4).await);
    }
    let plan = leased_plan(mode);
    let _ = snapshot();
    let origin = Instant::now();
    let run = drive(&instances, &plan, 4, origin, Duration::from_secs(6));

    // sleep: the fault timeline, 2 s of traffic before the stop.
    tokio::time::sleep_until((origin + Duration::from_secs(2)).into()).await;
    let stop_begin = origin.elapsed();
    rig.server(|pg| pg.stop(StopMode::Fast).expect("stop"))
        .await;
    let stop_end = origin.elapsed();
    // sleep: the fault timeline, the server stopped until 4 s.
    tokio::time::sleep_until((origin + Duration::from_secs(4)).into()).await;
    // The server accepts connections somewhere between `starting` and `up` (pg_ctl -w polls):
    // the outage ends at `starting`, and recovery is timed from it (conservative).
    let starting = origin.elapsed();
    rig.server(|pg| pg.start_again().expect("start again"))
        .await;
    let up = origin.elapsed();
    let events = run.await.expect("the run");
    let snap = snapshot();

    let recovered = recovered_at(&instances, origin, starting).expect("recovered");
    let recovery = recovered.saturating_sub(starting);
    let (outage_calls, outage_failed, slowest_call) =
        calls_in(&instances, origin, stop_end, starting);
    let (p50, p99, max) = waits(&events);
    let (_, outage_p99, outage_max) = waits(
        &events
            .iter()
            .filter(|e| in_window(e, stop_end, starting))
            .copied()
            .collect::<Vec<_>>(),
    );
    let lease_admitted = events
        .iter()
        .filter(|e| e.allowed && e.by == DecidedBy::Lease && in_window(e, stop_end, starting))
        .count();
    let fallback_admitted = events
        .iter()
        .filter(|e| e.allowed && matches!(e.by, DecidedBy::Fallback(_)))
        .count();
    let fallback_denied = events
        .iter()
        .filter(|e| !e.allowed && matches!(e.by, DecidedBy::Fallback(_)))
        .count();
    let outage = recovered.saturating_sub(stop_begin).as_secs_f64();
    let counted_allowed = counter_delta(
        &snap,
        "tokenlease_fallback_decisions_total",
        &[("mode", mode.label()), ("outcome", "allowed")],
    );
    let counted_denied = counter_delta(
        &snap,
        "tokenlease_fallback_decisions_total",
        &[("mode", mode.label()), ("outcome", "denied")],
    );
    eprintln!(
        "D1 {}: {} calls; waits p50 {:.3} ms p99 {:.3} ms max {:.1} ms (outage p99 {:.3} ms, max {:.1} ms); \
         outage {:.2} s: {outage_calls} db calls, {outage_failed} failed, slowest {:.1} ms; \
         admitted in outage: lease {lease_admitted}, fallback {fallback_admitted} (denied {fallback_denied}); \
         recovery {:.0} ms after pg_ctl start began (it took {:.0} ms)",
        mode.label(),
        events.len(),
        ms(p50),
        ms(p99),
        ms(max),
        ms(outage_p99),
        ms(outage_max),
        outage,
        ms(slowest_call),
        ms(recovery),
        ms(up - starting),
    );

    // No caller waits longer than the lease's max wait plus a call (and scheduling).
    assert!(max <= Duration::from_millis(150), "a caller waited {max:?}");
    assert!(
        slowest_call <= Duration::from_millis(270),
        "a database call in the outage took {slowest_call:?}"
    );
    assert_eq!(
        outage_failed, outage_calls,
        "no call succeeds while the server is down"
    );
    assert_eq!(
        counted_allowed as usize, fallback_admitted,
        "fallback admissions counted"
    );
    assert_eq!(
        counted_denied as usize, fallback_denied,
        "fallback denials counted"
    );
    let held = N as f64 * B;
    match mode {
        Mode::Deny => {
            assert_eq!(fallback_admitted, 0);
            assert!(
                lease_admitted as f64 <= held,
                "deny: {lease_admitted} admitted from leases > N·B = {held}"
            );
        }
        Mode::Local => {
            // The bound is the outage's, from `stop_begin` to `recovered`: what each instance's
            // local bucket (at most C/N at the start) admits in it. A refill that outlasts its
            // `max_wait` on a loaded machine has the fallback decide outside the outage too;
            // those admissions spend the same local bucket but fall outside this window.
            let in_outage = |e: &&Event| {
                e.allowed
                    && matches!(e.by, DecidedBy::Fallback(_))
                    && in_window(e, stop_begin, recovered)
            };
            let fallback_in_outage = events.iter().filter(in_outage).count();
            let bound = C as f64 + R * outage + held;
            let admitted = (lease_admitted + fallback_in_outage) as f64;
            assert!(
                admitted <= bound,
                "local: {admitted} admitted in the outage > {bound:.0} \
                 ({fallback_admitted} by the fallback in the whole run)"
            );
            assert!(
                fallback_in_outage > 0,
                "the local fallback admitted nothing"
            );
            for i in 0..N {
                let share = C as f64 / N as f64 + R / N as f64 * outage;
                let mine = events
                    .iter()
                    .filter(in_outage)
                    .filter(|e| e.instance == i)
                    .count() as f64;
                assert!(
                    mine <= share,
                    "instance {i}: local fallback admitted {mine} > C/N + r/N·t = {share:.0}"
                );
            }
        }
        Mode::Allow => {
            let outage_events: Vec<&Event> = events
                .iter()
                .filter(|e| in_window(e, stop_end + Duration::from_millis(100), starting))
                .collect();
            assert!(!outage_events.is_empty());
            // Every call is admitted by the fallback; a lease may still deny on the store's
            // last word before the outage (the bucket was empty until then).
            // The store's last answer to each instance, before the server went away.
            let last_answer: Vec<Duration> = instances
                .iter()
                .map(|i| {
                    i.log
                        .calls()
                        .iter()
                        .filter(|c| c.error.is_none() && c.start - origin < starting)
                        .map(|c| c.start + c.took - origin)
                        .max()
                        .unwrap_or_default()
                })
                .collect();
            // Not asserted on timing: how long after the store's last answer a dry lease
            // keeps denying belongs to the lease actor (reported, see the D1 line above).
            let mut latest_denial = None;
            for e in &outage_events {
                assert!(
                    e.allowed || e.by == DecidedBy::Lease,
                    "allow: the fallback denied a call in the outage: {e:?}"
                );
                if !e.allowed {
                    let after = e.at.saturating_sub(last_answer[e.instance]);
                    latest_denial = latest_denial.max(Some(after));
                }
            }
            eprintln!(
                "D1 allow: lease denials in the outage: {}, the latest {:?} ms after the store's \
                 last answer to that instance",
                outage_events.iter().filter(|e| !e.allowed).count(),
                latest_denial.map(ms)
            );
        }
    }
    // The limiter's part of the recovery runs from when the server is back (`pg_ctl start -w`
    // returned): the server's own start-up, slower on a loaded machine, is not the limiter's.
    // The bound: the breaker may be up to its longest back-off (500 ms) from its next probe
    // when the server comes back, that probe may meet a pooled connection the restart broke
    // (one more failure, one more back-off), and the next one succeeds; with a loaded machine's
    // scheduling on top, 1.5 s (quiet runs here: 200–450 ms).
    let since_up = recovered.saturating_sub(up);
    assert!(
        since_up <= Duration::from_millis(1500),
        "recovery took {since_up:?} after the server was up ({recovery:?} after its start began)"
    );
    // After recovery the envelope holds for what the store and the leases decide. The allow
    // fallback admits everything by design, so a call that still fails after recovery (a
    // loaded machine can push a statement past the 50 ms call timeout, and a restarted server
    // checkpoints) lets calls through that no bucket counted: those are left out here, and
    // each must follow a database call of its instance that failed.
    let settled = recovered + Duration::from_secs(1);
    let after: Vec<Event> = events
        .iter()
        .filter(|e| mode != Mode::Allow || !matches!(e.by, DecidedBy::Fallback(_)))
        .copied()
        .collect();
    let allowed_by_fallback: Vec<&Event> = events
        .iter()
        .filter(|e| {
            e.allowed
                && matches!(e.by, DecidedBy::Fallback(_))
                && in_window(e, settled, Duration::from_secs(6))
        })
        .collect();
    if !allowed_by_fallback.is_empty() {
        let (calls, failed, slowest) =
            calls_in(&instances, origin, settled, Duration::from_secs(6));
        eprintln!(
            "D1 {}: after recovery the fallback admitted {} calls; {calls} database calls, \
             {failed} failed ({:?}), slowest {:.1} ms",
            mode.label(),
            allowed_by_fallback.len(),
            error_classes(&instances, origin, settled, Duration::from_secs(6)),
            ms(slowest)
        );
        // Each one was decided after a call of its instance began that failed or outlasted
        // the lease's 50 ms `max_wait`, and within a second (the breaker's longest back-off
        // and a call) of that call's end.
        let max_wait = LeaseSettings::default().max_wait;
        for e in &allowed_by_fallback {
            let cause = instances[e.instance].log.calls().iter().any(|c| {
                let start = c.start - origin;
                (c.error.is_some() || c.took > max_wait)
                    && start <= e.at + e.took
                    && e.at <= start + c.took + Duration::from_secs(1)
            });
            assert!(
                cause,
                "a fallback admission after recovery with no failed or slow call before it: {e:?}"
            );
        }
    }
    assert_windows(
        &after,
        settled,
        Duration::from_secs(6),
        held,
        "after recovery",
    );
    let admin = rig.admin().await;
    let connections = Rig::limiter_connections(&admin).await;
    assert!(
        connections <= (N * 4) as i64,
        "{connections} limiter connections for {N} pools of 4"
    );
}

// ---------------------------------------------------------------------------------------------
// D2

async fn d2(mode: Mode) {
    let rig = Rig::start().await;
    let instance = rig.instance(&rig.proxied(), 4).await;
    let instances = [instance.clone()];
    let plan = direct_plan(mode, C, R);
    let origin = Instant::now();
    let run = drive(&instances, &plan, 4, origin, Duration::from_millis(7_500));
    let admin = rig.admin().await;

    // Phase A: every reply 2 s late, from 0.5 s to 2.5 s.
    // sleep: the fault timeline, the replies delayed from 0.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(500)).into()).await;
    rig.proxy.delay(Duration::ZERO, Duration::from_secs(2));
    let a_start = origin.elapsed();
    // sleep: the fault timeline, every reply 2 s late until 2.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(2_500)).into()).await;
    rig.proxy.pass();
    let a_end = origin.elapsed();
    // Replies already in the pipe still arrive 2 s late.
    // sleep: the fault timeline, 0.5 s into the 2 s delay of the replies in the pipe.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stuck_a = old_limiter_statements(&admin).await;
    // sleep: the fault timeline, phase B at 4.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(4_500)).into()).await;
    let a_recovered = recovered_at(&instances, origin, a_end);

    // Phase B: a session holds the row lock for 2 s, from 4.5 s to 6.5 s.
    let b_start = origin.elapsed();
    let mut locker = rig.admin().await;
    let tx = locker.transaction().await.expect("begin");
    tx.execute(
        "SELECT 1 FROM tokenlease_buckets WHERE key = $1 FOR UPDATE",
        &[&KEY],
    )
    .await
    .expect("lock the row");
    // sleep: the fault timeline, the row's lock held 1 s before the count.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let stuck_b = old_limiter_statements(&admin).await;
    // sleep: the fault timeline, the row's lock held until 6.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(6_500)).into()).await;
    tx.rollback().await.expect("release the row");
    let b_end = origin.elapsed();
    let events = run.await.expect("the run");
    let b_recovered = recovered_at(&instances, origin, b_end);

    let (a_calls, a_failed, a_slowest) = calls_in(&instances, origin, a_start, a_end);
    let a_timeouts: Vec<Duration> = instance
        .log
        .calls()
        .iter()
        .filter(|c| {
            let t = c.start - origin;
            t >= a_start && t < a_end && c.error.is_some()
        })
        .map(|c| c.took)
        .collect();
    let (b_calls, b_failed, b_slowest) = calls_in(&instances, origin, b_start, b_end);
    let (_, p99, max) = waits(&events);
    let phase = |from, to| {
        let e: Vec<Event> = events
            .iter()
            .filter(|e| in_window(e, from, to))
            .copied()
            .collect();
        let admitted = e.iter().filter(|e| e.allowed).count();
        (e.len(), admitted, waits(&e).2)
    };
    let (a_n, a_admitted, a_max) = phase(a_start, a_end);
    let (b_n, b_admitted, b_max) = phase(b_start, b_end);
    eprintln!(
        "D2 {}: waits p99 {:.3} ms max {:.1} ms. Delay phase: {a_n} decisions ({a_admitted} admitted), \
         caller max {:.1} ms; {a_calls} db calls, {a_failed} failed, p99 {:.1} ms, slowest {:.1} ms; \
         stuck statements {stuck_a}; recovered {:?} ms after. Lock phase: {b_n} decisions \
         ({b_admitted} admitted), caller max {:.1} ms; {b_calls} db calls, {b_failed} failed, slowest \
         {:.1} ms; stuck statements {stuck_b}; recovered {:?} ms after",
        mode.label(),
        ms(p99),
        ms(max),
        ms(a_max),
        ms(percentile(a_timeouts.clone(), 0.99)),
        ms(a_slowest),
        a_recovered.map(|t| ms(t.saturating_sub(a_end))),
        ms(b_max),
        ms(b_slowest),
        b_recovered.map(|t| ms(t.saturating_sub(b_end))),
    );
    assert!(max <= DIRECT_WAIT, "a caller waited {max:?}");
    assert!(
        a_failed > 0 && a_failed == a_calls,
        "every delayed call times out"
    );
    assert!(
        percentile(a_timeouts, 0.99) <= Duration::from_millis(70),
        "delayed calls give up within 70 ms"
    );
    assert!(
        a_slowest <= Duration::from_millis(100),
        "a call took {a_slowest:?}"
    );
    assert!(
        b_slowest <= Duration::from_millis(100),
        "a call took {b_slowest:?}"
    );
    assert!(b_failed > 0, "the locked row makes calls fail");
    assert_eq!(
        stuck_a, 0,
        "limiter statements older than 500 ms (delay phase)"
    );
    assert_eq!(
        stuck_b, 0,
        "limiter statements older than 500 ms (lock phase)"
    );
    if mode == Mode::Deny {
        let fallback_admitted = events
            .iter()
            .filter(|e| e.allowed && matches!(e.by, DecidedBy::Fallback(_)))
            .count();
        assert_eq!(fallback_admitted, 0, "the deny fallback admits nothing");
    }
    // The bound: whatever the store admitted plus what the fallback admitted in allow mode.
    let store_admitted: Vec<Event> = events
        .iter()
        .filter(|e| e.allowed && e.by == DecidedBy::Store)
        .copied()
        .collect();
    assert_windows(
        &store_admitted,
        Duration::ZERO,
        Duration::from_secs(8),
        1.0,
        "store",
    );
    assert!(
        a_recovered.is_some() && b_recovered.is_some(),
        "recovered after each phase"
    );
}

/// Limiter statements running for more than 500 ms.
async fn old_limiter_statements(admin: &tokio_postgres::Client) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'tokenlease' \
             AND state = 'active' AND now() - query_start > interval '500 milliseconds'",
            &[],
        )
        .await
        .map(|row| row.get(0))
        .unwrap_or(-1)
}

// ---------------------------------------------------------------------------------------------
// D3

async fn d3(mode: Mode) {
    let rig = Rig::start().await;
    let instance = rig.instance(&rig.proxied(), 4).await;
    // A slow refill, so the row's tokens can be compared exactly. Without outage debt: the
    // timed-out take committed and the fallback then admitted the call as well, so with debt
    // on its charge would take the cost from the row a second time (under-admission,
    // docs/design/outage-debt.md), and the row would not show the take and the return alone.
    let plan = Arc::new(
        common::plan(C, 0.001)
            .with_fallback(FallbackSettings::new(mode.fallback()).with_outage_debt(false)),
    );
    // The first take waits for the pool's first connection, which a busy machine can make
    // later than the 50 ms call (then the fallback decides): three attempts at most.
    for attempt in 1.. {
        let d = instance
            .limiter
            .try_acquire_with(&plan, KEY, 10.0)
            .await
            .expect("decision");
        if d.by_store() {
            break;
        }
        assert!(attempt < 3, "first take decided by the store: {d:?}");
    }
    let before = rig.row(KEY).await.expect("row").tokens_now.to_f64();

    // Replies 200 ms late: the take commits, the client gives up at 50 ms.
    rig.proxy.delay(Duration::ZERO, Duration::from_millis(200));
    let started = Instant::now();
    let d = instance
        .limiter
        .try_acquire_with(&plan, KEY, 10.0)
        .await
        .expect("decision");
    let waited = started.elapsed();
    let last = instance.log.calls().last().cloned().expect("a call");
    assert_eq!(
        last.error.as_deref(),
        Some("timeout-call"),
        "the client reports a timeout"
    );
    assert_eq!(
        d.decided_by,
        DecidedBy::Fallback(mode.fallback()),
        "the fallback decided"
    );
    // The statement committed on the server before its reply was late (the proxy delays
    // replies only): wait for the row to show it, 5 s at most.
    let after = rig
        .row_until(KEY, |tokens| before - tokens > 5.0)
        .await
        .unwrap_or_else(|tokens| panic!("the timed-out take never reached the row: {tokens}"));
    assert!(
        (before - after - 10.0).abs() < 0.01,
        "the timed-out take is in the row: {before} → {after}"
    );

    // A return whose reply is late: the client retries with the same id; it credits once. The
    // timed-out take's connection was closed (its statement abandoned), so first put a pooled
    // connection back while the proxy passes: the return must reach the server at once, not
    // wait for a new connection through the delaying proxy.
    // (The timed-out take's connection may still be in its cancel: then the pool opens another,
    // which a busy machine can make later than one 50 ms call. 5 s at most.)
    rig.proxy.pass();
    common::eventually(
        Duration::from_millis(20),
        Duration::from_secs(5),
        "a pooled connection",
        async || {
            instance
                .breaker
                .inspect(KEY)
                .await
                .map_err(|e| e.to_string())
        },
    )
    .await;
    rig.proxy.delay(Duration::ZERO, Duration::from_millis(200));
    let key_bucket = *plan.bucket();
    let give = [GiveBack {
        id: 4242,
        key: KEY,
        bucket: key_bucket,
        amount: tokenlease::bucket::Tokens::whole(5),
        lease: None,
    }];
    let first = instance.breaker.give_back(&give).await;
    assert!(
        matches!(first, Err(StoreError::Timeout { .. })),
        "the first return times out: {first:?}"
    );
    // The return committed on the server; only its reply is late.
    rig.row_until(KEY, |tokens| tokens - after > 2.5)
        .await
        .unwrap_or_else(|tokens| panic!("the timed-out return never reached the row: {tokens}"));
    rig.proxy.pass();
    let retried = instance.breaker.give_back(&give).await.expect("the retry");
    let credited = rig.row(KEY).await.expect("row").tokens_now.to_f64();
    eprintln!(
        "D3 {}: timed-out take waited {:.1} ms, decided by {:?} (allowed {}); row {before:.3} → {after:.3} \
         (taken though timed out); return of 5 timed out then retried: retry credited {retried}, row {credited:.3}",
        mode.label(),
        ms(waited),
        d.decided_by,
        d.allowed,
    );
    assert!(
        waited <= Duration::from_millis(100),
        "the caller waited {waited:?}"
    );
    assert_eq!(retried, 0, "the retry finds the return already credited");
    assert!(
        (credited - after - 5.0).abs() < 0.01,
        "credited once: {after} → {credited}"
    );
}

trait ByStore {
    fn by_store(&self) -> bool;
}

impl ByStore for tokenlease::Decision {
    fn by_store(&self) -> bool {
        self.decided_by == DecidedBy::Store
    }
}

// ---------------------------------------------------------------------------------------------
// D4

/// Limiter sessions on the server whose connection came through `proxy`: the sessions of the
/// one instance behind it.
async fn sessions_behind(admin: &tokio_postgres::Client, proxy: &Proxy) -> i64 {
    let ports: Vec<i32> = proxy.upstream_ports().into_iter().map(i32::from).collect();
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'tokenlease' \
             AND client_port = ANY($1)",
            &[&ports],
        )
        .await
        .map(|row| row.get(0))
        .unwrap_or(-1)
}

/// Connection samples: the most sessions seen per instance, and in all.
#[derive(Debug, Default)]
struct Sessions {
    per_instance: [i64; N],
    total: i64,
}

impl Sessions {
    async fn sample(&mut self, admin: &tokio_postgres::Client, proxies: &[Proxy; N]) {
        for (most, proxy) in self.per_instance.iter_mut().zip(proxies) {
            *most = (*most).max(sessions_behind(admin, proxy).await);
        }
        self.total = self.total.max(Rig::limiter_connections(admin).await);
    }
}

/// D4 with two limiter instances on one key, each with its own pool of 4 behind its own proxy
/// (so the server's sessions can be told apart by `client_port`).
async fn d4(mode: Mode) {
    let rig = Rig::start().await;
    let upstream = format!("127.0.0.1:{}", rig.pg.port())
        .parse()
        .expect("address");
    let proxies = [
        rig.proxy.clone(),
        Proxy::start(upstream).await.expect("proxy"),
    ];
    let mut instances = Vec::new();
    for proxy in &proxies {
        instances.push(rig.instance(&Rig::via(proxy), 4).await);
    }
    let plan = direct_plan(mode, C, R);
    let admin = rig.admin().await;
    let origin = Instant::now();
    // The callers run until the last phase's end, which moves with how late the faults end.
    let until = Arc::new(AtomicU64::new(60_000));
    let run = drive_until(&instances, &plan, 4, origin, &until);
    let mut sessions = Sessions::default();
    // Each phase is judged by the calls of the 1.5 s that start 1 s after its last fault,
    // measured from when its fault loop really ended: on a busy machine a loop's last round
    // can end hundreds of milliseconds late, which with fixed times left as few as no calls.
    let (settle, judged) = (Duration::from_secs(1), Duration::from_millis(1_500));

    // (a) 30% of each proxy's connections reset every 100 ms, from 0.5 s to 3.5 s.
    // sleep: the fault timeline, the resets start at 0.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(500)).into()).await;
    let a_start = origin.elapsed();
    while origin.elapsed() < Duration::from_millis(3_500) {
        for proxy in &proxies {
            proxy.reset_fraction(0.3);
        }
        sessions.sample(&admin, &proxies).await;
        // sleep: pacing, the resets' period (100 ms).
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let a_end = origin.elapsed();
    // (b) pg_terminate_backend on the limiters' sessions every 200 ms, for 2 s once (a)'s
    // judged calls are over.
    while origin.elapsed() < a_end + settle + judged {
        sessions.sample(&admin, &proxies).await;
        // sleep: pacing, the sessions sampled every 50 ms.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let b_start = origin.elapsed();
    let mut terminated = 0i64;
    while origin.elapsed() < b_start + Duration::from_secs(2) {
        let row = admin
            .query_one(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE application_name = 'tokenlease'",
                &[],
            )
            .await
            .expect("terminate");
        terminated += row.get::<_, i64>(0);
        sessions.sample(&admin, &proxies).await;
        // sleep: pacing, the terminations' period (200 ms).
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let b_end = origin.elapsed();
    let stop = b_end + settle + judged;
    until.store(stop.as_millis() as u64, Ordering::Relaxed);
    while origin.elapsed() < stop {
        sessions.sample(&admin, &proxies).await;
        // sleep: pacing, the sessions sampled every 50 ms.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let events = run.await.expect("the run");

    let a_classes = error_classes(
        &instances,
        origin,
        a_start,
        a_end + Duration::from_millis(200),
    );
    let b_classes = error_classes(
        &instances,
        origin,
        b_start,
        b_end + Duration::from_millis(200),
    );
    let after = |end: Duration| {
        let (from, to) = (end + settle, end + settle + judged);
        let (n, failed, _) = calls_in(&instances, origin, from, to);
        let ok = if n == 0 {
            0.0
        } else {
            1.0 - failed as f64 / n as f64
        };
        (n, ok, error_classes(&instances, origin, from, to))
    };
    let (a_n, a_ok, a_late) = after(a_end);
    let (b_n, b_ok, b_late) = after(b_end);
    let (_, p99, max) = waits(&events);
    let resets: u64 = proxies.iter().map(Proxy::resets).sum();
    // The store's admissions across both instances, by the store's own clock: any window of
    // length w holds at most C + r·w of them (+ 1 for the whole-token edge).
    let store_admitted: Vec<SystemTime> = events
        .iter()
        .filter(|e| e.allowed && e.by == DecidedBy::Store)
        .map(|e| {
            e.store_time
                .expect("a store decision carries the store's time")
        })
        .collect();
    let first = store_admitted
        .iter()
        .min()
        .copied()
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let mut points: Vec<(f64, f64)> = store_admitted
        .iter()
        .map(|t| (common::secs_between(first, *t), 1.0))
        .collect();
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    let worst: Vec<(f64, f64, f64)> = [0.1, 0.5, 1.0]
        .iter()
        .map(|&w| {
            let (excess, count) = common::worst_window(&points, w, C as f64, R, 0.0);
            (w, count, excess)
        })
        .collect();
    let per_instance: Vec<(usize, usize)> = (0..N)
        .map(|i| {
            let mine = events.iter().filter(|e| e.instance == i && e.allowed);
            let by_store = mine.clone().filter(|e| e.by == DecidedBy::Store).count();
            (by_store, mine.count() - by_store)
        })
        .collect();
    eprintln!(
        "D4 {} (2 instances): waits p99 {:.3} ms max {:.1} ms; resets by the proxies {resets}; \
         backends terminated {terminated}; most sessions per instance {:?} (all limiters {}); \
         errors (a) {a_classes:?}, (b) {b_classes:?}; success 1 s after (a) {:.1}% of {a_n} \
         (errors {a_late:?}), after (b) {:.1}% of {b_n} (errors {b_late:?}); phases ended at \
         {a_end:?} and {b_end:?}; admitted per instance (store, fallback) {per_instance:?}; \
         store windows by db time (w, admitted, excess over C + r·w) {worst:?}",
        mode.label(),
        ms(p99),
        ms(max),
        sessions.per_instance,
        sessions.total,
        a_ok * 100.0,
        b_ok * 100.0,
    );
    assert!(max <= DIRECT_WAIT, "a caller waited {max:?}");
    assert!(
        proxies.iter().all(|p| p.resets() > 0) && terminated > 0,
        "the faults happened"
    );
    for (class, _) in a_classes.iter().chain(&b_classes) {
        assert!(
            class == "connection"
                || class.starts_with("timeout")
                || class.starts_with("db-57P01")
                || class.starts_with("db-08"),
            "unexpected error class {class}"
        );
    }
    assert!(a_n > 0 && a_ok >= 0.95, "after resets: {a_ok}");
    assert!(b_n > 0 && b_ok >= 0.95, "after terminations: {b_ok}");
    for (i, most) in sessions.per_instance.iter().enumerate() {
        assert!(*most <= 4, "instance {i}: {most} sessions for a pool of 4");
    }
    assert!(
        sessions.total <= (N * 4) as i64,
        "{} limiter sessions for {N} pools of 4",
        sessions.total
    );
    for (w, count, excess) in &worst {
        assert!(
            *excess <= 1.0 + 1e-9,
            "the store admitted {count} in a {w} s window > {C} + {R}·{w} + 1"
        );
    }
    // The fallback's own terms: nothing under deny; under local at most C/N + (r/N)·w per
    // instance in any window (local time, + 1 for the edge).
    for i in 0..N {
        let fallback: Vec<(f64, f64)> = events
            .iter()
            .filter(|e| e.instance == i && e.allowed && matches!(e.by, DecidedBy::Fallback(_)))
            .map(|e| (e.at.as_secs_f64(), 1.0))
            .collect();
        match mode {
            Mode::Deny => assert!(fallback.is_empty(), "deny: the fallback admitted"),
            Mode::Local => {
                let (c, r) = (C as f64 / N as f64, R / N as f64);
                for w in [0.1, 0.5, 1.0] {
                    let (excess, count) = common::worst_window(&fallback, w, c, r, EPS);
                    assert!(
                        excess <= 1.0 + 1e-9,
                        "instance {i}: the local fallback admitted {count} in a {w} s window"
                    );
                }
            }
            Mode::Allow => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// D5

async fn d5(mode: Mode) {
    let rig = Rig::start().await;
    let instance = rig.instance(&rig.direct(), 4).await;
    let plan = direct_plan(mode, C, R);
    let mut report = Vec::new();
    for stop in [StopMode::Fast, StopMode::Immediate] {
        // Drain the bucket.
        for _ in 0..200 {
            let d = instance
                .limiter
                .try_acquire_with(&plan, KEY, 1.0)
                .await
                .expect("decision");
            if !d.allowed && d.by_store() {
                break;
            }
        }
        let before = rig.row(KEY).await.expect("row");
        if stop == StopMode::Immediate {
            // The store commits takes asynchronously by default: a crash forgets those whose
            // commit record the WAL writer has not yet flushed (at most 3 × wal_writer_delay
            // old). Await the flush of everything written so far, as the server reports it.
            await_wal_flush(&rig.admin().await).await;
        }
        let down = Instant::now();
        rig.server(move |pg| pg.restart(stop).expect("restart"))
            .await;
        let downtime = down.elapsed();
        let after = rig.row(KEY).await.expect("row after the restart");
        let elapsed = common::secs_between(before.store_now, after.store_now);
        let expected = (before.tokens_now.to_f64() + R * elapsed).min(C as f64);
        let got = after.tokens_now.to_f64();
        // The limiter finds the server again.
        let back = Instant::now();
        let recovered = common::poll_until(
            Duration::from_millis(5),
            Duration::from_secs(2),
            async || {
                let d = instance
                    .limiter
                    .try_acquire_with(&plan, KEY, 1.0)
                    .await
                    .expect("decision");
                if d.by_store() {
                    Ok(back.elapsed())
                } else {
                    Err(d)
                }
            },
        )
        .await
        .ok();
        report.push(format!(
            "{stop:?}: T0 {:.2}, down {:.0} ms, {elapsed:.3} s of db time → expected {expected:.2}, \
             row {got:.2}; limiter back after {:?} ms",
            before.tokens_now.to_f64(),
            ms(downtime),
            recovered.map(ms),
        ));
        assert!(
            (got - expected).abs() <= 1.0,
            "{stop:?}: row {got}, expected {expected}"
        );
        let recovered = recovered.expect("the limiter recovers");
        assert!(
            recovered <= Duration::from_secs(1),
            "recovery took {recovered:?}"
        );
    }
    eprintln!("D5 {}: {}", mode.label(), report.join("; "));
}

/// Waits until the server has flushed the WAL written so far (`pg_current_wal_flush_lsn()` at
/// or past the insert position read first): then a crash forgets no commit made before. The
/// WAL writer flushes within 3 × `wal_writer_delay` (600 ms by default); 5 s at most here.
async fn await_wal_flush(admin: &tokio_postgres::Client) {
    let written: String = admin
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .expect("insert lsn")
        .get(0);
    common::eventually(
        Duration::from_millis(10),
        Duration::from_secs(5),
        &format!("the WAL flushed past {written}"),
        async || -> bool {
            admin
                .query_one(
                    "SELECT pg_current_wal_flush_lsn() >= $1::text::pg_lsn",
                    &[&written],
                )
                .await
                .expect("flush lsn")
                .get(0)
        },
    )
    .await;
}

trait TokensF64 {
    fn to_f64(&self) -> f64;
}

impl TokensF64 for tokenlease::bucket::Tokens {
    fn to_f64(&self) -> f64 {
        self.to_string().parse().expect("tokens print as a decimal")
    }
}

// ---------------------------------------------------------------------------------------------
// D7

async fn d7(mode: Mode) {
    let rig = Rig::start().await;
    let instance = rig.instance(&rig.proxied(), 4).await;
    let instances = [instance.clone()];
    let plan = direct_plan(mode, C, R);
    let origin = Instant::now();
    let run = drive(&instances, &plan, 4, origin, Duration::from_millis(4_000));
    // sleep: the fault timeline, the black hole from 0.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(500)).into()).await;
    rig.proxy.black_hole(true);
    let hole_start = origin.elapsed();
    // sleep: the fault timeline, every byte black-holed until 2.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(2_500)).into()).await;
    rig.proxy.black_hole(false);
    let hole_end = origin.elapsed();
    let events = run.await.expect("the run");

    let (calls, failed, slowest) = calls_in(&instances, origin, hole_start, hole_end);
    let classes = error_classes(&instances, origin, hole_start, hole_end);
    let recovered = recovered_at(&instances, origin, hole_end).expect("recovered");
    let recovery = recovered.saturating_sub(hole_end);
    let (_, p99, max) = waits(&events);
    eprintln!(
        "D7 {}: waits p99 {:.3} ms max {:.1} ms; black hole 2 s: {calls} db calls, {failed} failed \
         {classes:?}, slowest {:.1} ms; recovery {:.0} ms after unblocking; proxy connections {}",
        mode.label(),
        ms(p99),
        ms(max),
        ms(slowest),
        ms(recovery),
        rig.proxy.active(),
    );
    assert!(max <= DIRECT_WAIT, "a caller waited {max:?}");
    assert_eq!(failed, calls, "no call succeeds through the black hole");
    assert!(
        slowest <= Duration::from_millis(100),
        "a call took {slowest:?}"
    );
    assert!(
        recovery <= Duration::from_secs(1),
        "recovery took {recovery:?}"
    );
}

/// D7, SIGSTOP variant: the postmaster (from `postmaster.pid`) and every process it forked
/// (`TempPostgres::suspend`, by pid, never by name) stopped for 2 s, then continued. One instance is
/// busy when the server stops (its statements are in flight); a second instance, built before
/// the stop with an empty pool, calls only during it, so each of its calls needs a new
/// connection; and a store built during the stop must give up at its 250 ms connect timeout.
async fn d7_sigstop(mode: Mode) {
    let rig = Rig::start().await;
    let busy = rig.instance(&rig.direct(), 4).await;
    let fresh = rig.instance(&rig.direct(), 4).await;
    let plan = direct_plan(mode, C, R);
    let origin = Instant::now();
    let run = drive(
        std::slice::from_ref(&busy),
        &plan,
        4,
        origin,
        Duration::from_millis(4_000),
    );

    // sleep: the fault timeline, the server stopped (SIGSTOP) at 0.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(500)).into()).await;
    let stopped = rig.pg.suspend().expect("SIGSTOP the server");
    let processes = stopped.processes();
    let stop_at = origin.elapsed();

    // New connections while stopped: the fresh instance's callers, and a bare connect.
    // sleep: the fault timeline, new connections from 0.7 s, while the server is stopped.
    tokio::time::sleep_until((origin + Duration::from_millis(700)).into()).await;
    let fresh_run = drive(
        std::slice::from_ref(&fresh),
        &plan,
        1,
        origin,
        Duration::from_millis(4_000),
    );
    // A store built while the server is stopped: its first connection (TCP accepted by the
    // stopped postmaster's kernel, then no startup answer) must end at the connect timeout.
    let direct = rig.direct();
    let bare = tokio::spawn(async move {
        let start = Instant::now();
        let built = tokenlease::store::PostgresStore::builder(&direct)
            .expect("connection string")
            .connect_timeout(Duration::from_millis(250))
            .migrate(false)
            .build()
            .await;
        let outcome = match built {
            Ok(_) => "connected".to_owned(),
            Err(e) => format!("error: {e}"),
        };
        (start.elapsed(), outcome)
    });

    // sleep: the fault timeline, the server stopped until 2.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(2_500)).into()).await;
    stopped.resume();
    let cont_at = origin.elapsed();
    let events = run.await.expect("the run");
    let fresh_events = fresh_run.await.expect("the fresh run");
    let (bare_took, bare_outcome) = bare.await.expect("the bare connect");

    // Statements in flight when the server stopped: they end at the call timeout.
    let in_flight: Vec<Call> = busy
        .log
        .calls()
        .into_iter()
        .filter(|c| c.start - origin < stop_at && c.start + c.took - origin > stop_at)
        .collect();
    let in_flight_slowest = in_flight.iter().map(|c| c.took).max().unwrap_or_default();
    let (calls, failed, slowest) = calls_in(std::slice::from_ref(&busy), origin, stop_at, cont_at);
    let classes = error_classes(std::slice::from_ref(&busy), origin, stop_at, cont_at);
    let (f_calls, f_failed, f_slowest) =
        calls_in(std::slice::from_ref(&fresh), origin, stop_at, cont_at);
    let f_classes = error_classes(std::slice::from_ref(&fresh), origin, stop_at, cont_at);
    let first_fresh = fresh.log.calls().first().cloned().expect("a fresh call");
    let recovery = |i: &Instance| {
        recovered_at(std::slice::from_ref(i), origin, cont_at).map(|t| t.saturating_sub(cont_at))
    };
    let (busy_recovery, fresh_recovery) = (recovery(&busy), recovery(&fresh));
    let (_, p99, max) = waits(&events);
    let (_, f_p99, f_max) = waits(&fresh_events);
    eprintln!(
        "D7 SIGSTOP {}: {processes} processes stopped 2 s. Busy instance: {} statements in \
         flight at the stop, ended after at most {:.1} ms; {calls} db calls in the stop, {failed} \
         failed {classes:?}, slowest {:.1} ms; waits p99 {:.3} ms max {:.1} ms; recovery \
         {:?} ms after SIGCONT. Fresh instance (new connections): first call {:?} after {:.1} ms; \
         {f_calls} db calls, {f_failed} failed {f_classes:?}, slowest {:.1} ms; waits p99 {:.3} \
         ms max {:.1} ms; recovery {:?} ms. A store built during the stop (connect_timeout \
         250 ms): {bare_outcome} after {:.0} ms",
        mode.label(),
        in_flight.len(),
        ms(in_flight_slowest),
        ms(slowest),
        ms(p99),
        ms(max),
        busy_recovery.map(ms),
        first_fresh.error,
        ms(first_fresh.took),
        ms(f_slowest),
        ms(f_p99),
        ms(f_max),
        fresh_recovery.map(ms),
        ms(bare_took),
    );
    assert!(max <= DIRECT_WAIT, "a busy caller waited {max:?}");
    assert!(f_max <= DIRECT_WAIT, "a fresh caller waited {f_max:?}");
    assert!(
        bare_outcome.contains("connecting to the database"),
        "new connections time out at the connect timeout: {bare_outcome}"
    );
    assert!(
        bare_took <= Duration::from_millis(400),
        "new connections end at the 250 ms connect timeout, took {bare_took:?}"
    );
    // Often one statement is in flight at the stop, sometimes none (the callers pause 1 ms
    // between calls); the calls sent during the stop meet the same stopped backends.
    assert!(
        in_flight_slowest <= Duration::from_millis(100),
        "an in-flight statement ended after {in_flight_slowest:?}"
    );
    assert_eq!(
        failed, calls,
        "no call succeeds while the server is stopped"
    );
    assert_eq!(
        f_failed, f_calls,
        "no new connection while the server is stopped"
    );
    assert!(
        slowest <= Duration::from_millis(100) && f_slowest <= Duration::from_millis(100),
        "a call took {slowest:?} (busy), {f_slowest:?} (fresh)"
    );
    assert!(
        first_fresh
            .error
            .as_deref()
            .is_some_and(|e| e.starts_with("timeout")),
        "the first new connection times out: {:?}",
        first_fresh.error
    );
    for (class, _) in classes.iter().chain(&f_classes) {
        assert!(
            class.starts_with("timeout") || class == "circuit-open",
            "unexpected error class {class}"
        );
    }
    for (what, recovery) in [("busy", busy_recovery), ("fresh", fresh_recovery)] {
        let recovery = recovery.unwrap_or_else(|| panic!("the {what} instance recovers"));
        assert!(
            recovery <= Duration::from_secs(1),
            "{what}: recovery took {recovery:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// D9

/// A wall clock for one limiter instance: the host's, plus an offset the test steps, as an
/// administrator or NTP setting the clock would. Clones share the offset.
#[derive(Debug, Clone, Default)]
struct SteppedClock {
    offset_nanos: Arc<AtomicI64>,
}

impl SteppedClock {
    fn step(&self, by_secs: i64) {
        self.offset_nanos
            .fetch_add(by_secs * 1_000_000_000, Ordering::SeqCst);
    }
}

impl Clock for SteppedClock {
    fn now(&self) -> Timestamp {
        let real = timestamp_from_system_time(SystemTime::now()).as_nanos();
        Timestamp::from_nanos(real.saturating_add_signed(self.offset_nanos.load(Ordering::SeqCst)))
    }
}

const HOUR: i64 = 3_600;
/// D9's bucket: small, so that a mis-timed lease or refill would show in the count.
const D9_C: u64 = 20;
const D9_R: f64 = 10.0;
/// One call every 20 ms (50/s, five times the refill rate) for 3 s.
const D9_EVERY: Duration = Duration::from_millis(20);
const D9_CALLS: u32 = 150;
/// The wall clocks step at 1 s; the store becomes unreachable at 2 s.
const D9_STEP_AT: Duration = Duration::from_secs(1);
const D9_OUTAGE_AT: Duration = Duration::from_secs(2);

/// Calls `limiter` on `key` once every [`D9_EVERY`] from `origin`, one call at a time,
/// [`D9_CALLS`] times: a fixed schedule, so two runs make the same calls at the same moments.
fn paced(
    limiter: Limiter,
    plan: Arc<Plan>,
    key: String,
    run: usize,
    origin: Instant,
) -> tokio::task::JoinHandle<Vec<Event>> {
    tokio::spawn(async move {
        let mut events = Vec::new();
        for k in 0..D9_CALLS {
            // sleep: pacing, a call every 20 ms on a fixed schedule from `origin`.
            tokio::time::sleep_until((origin + D9_EVERY * k).into()).await;
            let start = Instant::now();
            let d = limiter
                .try_acquire_with(&plan, &key, 1.0)
                .await
                .expect("a decision, never an error");
            events.push(Event {
                at: start - origin,
                instance: run,
                allowed: d.allowed,
                by: d.decided_by,
                took: start.elapsed(),
                store_time: d.store_time,
            });
        }
        events
    })
}

/// One D9 run: a limiter instance with its own wall clock, pool and key.
struct ClockRun {
    leased: bool,
    /// The wall clock's step at [`D9_STEP_AT`], in seconds.
    step: i64,
    clock: SteppedClock,
    instance: Instance,
    name: String,
}

/// D9: three runs of one workload at once for each of direct and leased mode, with the wall
/// clock left alone, stepped +1 h and stepped −1 h mid-run. Each run has its own limiter
/// instance (pool, breaker, wall clock) and its own key with the same plan, so the three see
/// the same machine load and the same outage at the same moments. For 2 s the store decides
/// (the step comes at 1 s), then the proxy resets and refuses every connection, and the
/// fallback (and any lease) decides for the last second. Every stepped run admits the
/// undisturbed run's count ± 1, widened by one for each call the machine's load sent to the
/// fallback (counted, not guessed); a leased run's outage keeps its mode's own bound; and the
/// skew gauge shows each step.
async fn d9(mode: Mode) {
    let rig = Rig::start().await;
    let direct = direct_plan(mode, D9_C, D9_R);
    let leased = Arc::new(
        common::plan(D9_C, D9_R)
            .with_lease(LeaseSettings::default())
            .with_fallback(FallbackSettings::new(mode.fallback())),
    );
    let mut runs = Vec::new();
    for leased in [false, true] {
        for step in [0, HOUR, -HOUR] {
            let name = format!(
                "d9-{}-{}",
                if leased { "leased" } else { "direct" },
                match step {
                    0 => "none",
                    HOUR => "plus1h",
                    _ => "minus1h",
                }
            );
            let clock = SteppedClock::default();
            let instance = rig
                .instance_with(&rig.proxied(), 4, &name, clock.clone())
                .await;
            runs.push(ClockRun {
                leased,
                step,
                clock,
                instance,
                name,
            });
        }
    }
    let _ = snapshot();
    let origin = Instant::now() + Duration::from_millis(50);
    let handles: Vec<_> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let plan = Arc::clone(if r.leased { &leased } else { &direct });
            paced(
                r.instance.limiter.clone(),
                plan,
                format!("{KEY}:{}", r.name),
                i,
                origin,
            )
        })
        .collect();

    // sleep: the fault timeline, the wall clocks step at 1 s.
    tokio::time::sleep_until((origin + D9_STEP_AT).into()).await;
    for r in &runs {
        r.clock.step(r.step);
    }
    // Just before the outage: the skew each breaker measured after the step.
    // sleep: the fault timeline, 0.9 s after the step, in which each breaker measures the skew.
    tokio::time::sleep_until((origin + D9_OUTAGE_AT - Duration::from_millis(100)).into()).await;
    let skews: Vec<Option<f64>> = runs
        .iter()
        .map(|r| r.instance.breaker.clock_skew())
        .collect();
    let snap = snapshot();
    let gauges: Vec<Option<f64>> = runs
        .iter()
        .map(|r| {
            snap.iter()
                .find(|(n, l, _)| {
                    n == "tokenlease_store_clock_skew_seconds"
                        && l.iter().any(|(k, v)| k == "store" && *v == r.name)
                })
                .and_then(|(.., v)| match v {
                    DebugValue::Gauge(g) => Some(g.into_inner()),
                    _ => None,
                })
        })
        .collect();
    // sleep: the fault timeline, the store unreachable from 2 s.
    tokio::time::sleep_until((origin + D9_OUTAGE_AT).into()).await;
    rig.proxy.refuse(true);
    rig.proxy.reset_all();
    let outage = origin.elapsed();
    let mut events = Vec::new();
    for h in handles {
        events.push(h.await.expect("no caller panicked"));
    }

    let admitted = |events: &[Event], from: Duration, to: Duration| {
        events
            .iter()
            .filter(|e| e.allowed && in_window(e, from, to))
            .count()
    };
    let mut lines = Vec::new();
    let mut counts = Vec::new();
    for (r, ev) in runs.iter().zip(&events) {
        let store = admitted(ev, Duration::ZERO, outage);
        let after = admitted(ev, outage, Duration::MAX);
        let by_fallback = ev
            .iter()
            .filter(|e| e.at < outage && matches!(e.by, DecidedBy::Fallback(_)))
            .count();
        let (_, _, max) = waits(ev);
        counts.push(store + after);
        lines.push(format!(
            "{}: admitted {} ({store} before the outage, {after} in it), {by_fallback} fallback \
             decisions before the outage, caller max {:.1} ms",
            r.name,
            store + after,
            ms(max),
        ));
    }
    let i = |leased: bool, step: i64| {
        runs.iter()
            .position(|r| r.leased == leased && r.step == step)
            .expect("run")
    };
    eprintln!(
        "D9 {}: {}; skews measured (s) {:?}, gauges {:?}",
        mode.label(),
        lines.join("; "),
        skews,
        gauges,
    );
    for (r, (skew, gauge)) in runs.iter().zip(skews.iter().zip(&gauges)) {
        // The store's clock minus a local clock stepped by `step`: −step, to within a round
        // trip (same host).
        let expected = -r.step as f64;
        let skew = skew.expect("a skew measured");
        assert!(
            (skew - expected).abs() < 0.05,
            "{}: skew {skew} s, expected {expected}",
            r.name
        );
        let gauge = gauge.expect("the skew gauge is exported");
        assert!(
            (gauge - expected).abs() < 0.05,
            "{}: gauge {gauge} s, expected {expected}",
            r.name
        );
    }
    // What a loaded machine changes, counted per run: a call that waited longer than its bound
    // for the store (the direct call timeout, or a refill slower than the lease's `max_wait`)
    // is decided by the fallback. In direct mode each such call moves the store's admissions by
    // one at most (the call it did not decide, or a take that committed after its caller gave
    // up). In leased mode by two at most: the call, and the token its refill still brings into
    // the lease (a waiter that gives up leaves its cost in the refill it asked for), which can
    // sit there unspent when the outage begins. Under `local` the local bucket's count in the
    // outage moves by one more. So stepped and undisturbed runs are compared within 1 + those
    // calls of both (twice them for leased runs; ± 1 on an idle machine, where there are none),
    // and a wall clock that reached a refill or a lease would move a count by up to C (a +1 h
    // step refills the bucket) or R per second (a −1 h step stops it).
    let b = (D9_C as f64 * LeaseSettings::default().max_fraction).floor() as usize;
    let dry_window_calls = (4.0 * b as f64 / D9_R / D9_EVERY.as_secs_f64()).ceil() as usize + 1;
    let fallback_before = |run: usize| {
        events[run]
            .iter()
            .filter(|e| e.at < outage && matches!(e.by, DecidedBy::Fallback(_)))
            .count()
    };
    let decided_before = |run: usize| {
        events[run]
            .iter()
            .filter(|e| e.allowed && e.at < outage && !matches!(e.by, DecidedBy::Fallback(_)))
            .count()
    };
    // And on its own, whatever the load: what the store and the leases admitted before the
    // outage came out of one bucket in that time, at most C + R·t (to the end of the last call
    // that started before it), as a +1 h step that refilled the bucket would break.
    let envelope = D9_C as f64 + D9_R * (outage + Duration::from_millis(50)).as_secs_f64();
    for (run, r) in runs.iter().enumerate() {
        let decided = decided_before(run);
        assert!(
            decided as f64 <= envelope + 1.0,
            "{}: the store and leases admitted {decided} before the outage, the bucket held \
             {envelope:.1}",
            r.name
        );
    }
    for leased in [false, true] {
        let none = i(leased, 0);
        for step in [HOUR, -HOUR] {
            let stepped = i(leased, step);
            let load = fallback_before(none) + fallback_before(stepped);
            let per_call = if leased { 2 } else { 1 };
            let (d_none, d_stepped) = (decided_before(none), decided_before(stepped));
            assert!(
                d_stepped.abs_diff(d_none) <= 1 + per_call * load,
                "{}: the store and leases admitted {d_stepped} before the outage, undisturbed \
                 {d_none} ({load} fallback decisions before it in the two runs)",
                runs[stepped].name
            );
            if !leased {
                // Direct: in the outage the fallback decides every call the same way in each
                // run; whole runs compared.
                let (c_none, c_stepped) = (counts[none], counts[stepped]);
                assert!(
                    c_stepped.abs_diff(c_none) <= 1 + 2 * load,
                    "{}: admitted {c_stepped}, undisturbed {c_none} ({load} fallback decisions \
                     before the outage in the two runs)",
                    runs[stepped].name
                );
            }
        }
    }
    // Leased, in the outage: whether a run's last refill before it answered (and with what:
    // some tokens, or "empty") or failed at the cut is a race of milliseconds, not of the wall
    // clock, so each run is checked against its mode's own bound. The lease admits what it
    // held, at most B; in `allow` a dry lease keeps denying until the store's last "empty" runs
    // out (docs/design/leases.md), at most one stretched dry window (4 × B / r of calls), and the
    // fallback admits the rest; in `deny` the fallback denies; under `local` it admits at most
    // its share of the bucket (C / N, refilling at R / N) over the outage.
    for step in [0, HOUR, -HOUR] {
        let run = i(true, step);
        let name = &runs[run].name;
        let in_outage: Vec<_> = events[run].iter().filter(|e| e.at >= outage).collect();
        let outage_len = in_outage
            .iter()
            .map(|e| (e.at + e.took).saturating_sub(outage))
            .max()
            .unwrap_or_default()
            .as_secs_f64();
        let local_share = (D9_C as f64 / N as f64 + D9_R / N as f64 * outage_len).floor() as usize;
        let count = |allowed: bool, lease: bool| {
            in_outage
                .iter()
                .filter(|e| e.allowed == allowed && (e.by == DecidedBy::Lease) == lease)
                .count()
        };
        let (lease_admitted, lease_denied) = (count(true, true), count(false, true));
        let (fallback_admitted, fallback_denied) = (count(true, false), count(false, false));
        assert!(
            lease_admitted <= b,
            "{name}: the lease admitted {lease_admitted} in the outage, more than B = {b}"
        );
        match mode {
            Mode::Allow => {
                assert_eq!(fallback_denied, 0, "{name}: denied in the outage");
                assert!(
                    lease_denied <= dry_window_calls,
                    "{name}: {lease_denied} lease denials in the outage, one dry window holds \
                     {dry_window_calls} calls"
                );
            }
            Mode::Deny => {
                assert_eq!(fallback_admitted, 0, "{name}: admitted by the fallback");
            }
            Mode::Local => {
                assert!(
                    fallback_admitted <= local_share,
                    "{name}: the local fallback admitted {fallback_admitted} in the outage, \
                     its share is {local_share}"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Abandoned statements

/// Statements of the store's sessions (application `tokenlease`) running now.
async fn running_limiter_statements(admin: &tokio_postgres::Client) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'tokenlease' \
             AND state = 'active'",
            &[],
        )
        .await
        .map(|row| row.get(0))
        .unwrap_or(-1)
}

/// A call that times out leaves no statement running on the server, takes nothing, and the next
/// call (a fresh key, on a pool of one connection) is not queued behind it.
///
/// Another session holds the key's row lock, so the store's statement blocks; the server-side
/// `statement_timeout` and `lock_timeout` are a minute, so only the store can stop it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timed_out_statement_is_cancelled_and_the_next_call_is_not_queued_behind_it() {
    let _serial = common::serial().await;
    let db = common::database().await;
    let call_timeout = Duration::from_millis(1_000);
    let store = PostgresStore::builder(&db.connection_string())
        .expect("connection string")
        .pool_size(1)
        .call_timeout(call_timeout)
        .pool_wait_timeout(Duration::from_millis(900))
        .connect_timeout(Duration::from_secs(2))
        .statement_timeout(Duration::from_secs(60))
        .lock_timeout(Duration::from_secs(60))
        .build()
        .await
        .expect("store");
    let bucket = common::bucket(10, 0.001);
    let one = tokenlease::bucket::Tokens::whole(1);
    let taken = store
        .acquire(AcquireRequest::take("held", bucket, one))
        .await
        .expect("first take");
    assert_eq!(taken.remaining, tokenlease::bucket::Tokens::whole(9));
    let _ = snapshot();

    let mut locker = db.client().await.expect("locker");
    let tx = locker.transaction().await.expect("begin");
    tx.execute(
        "SELECT 1 FROM tokenlease_buckets WHERE key = 'held' FOR UPDATE",
        &[],
    )
    .await
    .expect("lock the row");
    let admin = db.client().await.expect("admin");

    let err = store
        .acquire(AcquireRequest::take("held", bucket, one))
        .await
        .expect_err("the blocked call times out");
    assert!(
        matches!(
            err,
            StoreError::Timeout {
                kind: TimeoutKind::Call,
                ..
            }
        ),
        "{err:?}"
    );
    // At once, on the pool's only connection: not behind the blocked statement.
    let started = Instant::now();
    let fresh = store
        .acquire(AcquireRequest::take("fresh", bucket, one))
        .await;
    let fresh_took = started.elapsed();
    // The abandoned statement is gone from the server while the lock is still held.
    let running = common::poll_until(
        Duration::from_millis(5),
        Duration::from_secs(5),
        async || match running_limiter_statements(&admin).await {
            0 => Ok(0),
            running => Err(running),
        },
    )
    .await
    .unwrap_or_else(|running| running);
    let gone_after = started.elapsed();
    tx.rollback().await.expect("release the row");
    let held = store
        .inspect("held")
        .await
        .expect("inspect")
        .expect("the row");
    let cancels = snapshot();
    eprintln!(
        "abandoned statement: next call took {:.1} ms ({:?}); no statement running after \
         {:.1} ms; cancels sent {}",
        ms(fresh_took),
        fresh.as_ref().map(|a| a.granted),
        ms(gone_after),
        counter_delta(
            &cancels,
            "tokenlease_store_cancels_total",
            &[("result", "sent")]
        ),
    );
    assert_eq!(running, 0, "a limiter statement still runs on the server");
    let fresh = fresh.expect("the next call is decided, not queued behind the abandoned one");
    assert_eq!(fresh.granted, one);
    assert!(
        fresh_took < call_timeout,
        "the next call took {fresh_took:?}"
    );
    // Nothing ran after the lock was released: the abandoned take took nothing.
    assert_eq!(held.tokens, tokenlease::bucket::Tokens::whole(9));
    assert_eq!(
        counter_delta(
            &cancels,
            "tokenlease_store_cancels_total",
            &[("result", "sent")]
        ),
        1
    );
}

/// A pooled connection whose backend is terminated while idle: its driver's error is counted
/// (`tokenlease_store_connection_errors_total`), not dropped, and the next call still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_in_the_background_is_counted() {
    let _serial = common::serial().await;
    let db = common::database().await;
    let store = common::store(&db, 1).await;
    let bucket = common::bucket(10, 1.0);
    let one = tokenlease::bucket::Tokens::whole(1);
    store
        .acquire(AcquireRequest::take("k", bucket, one))
        .await
        .expect("take");
    let _ = snapshot();
    let admin = db.client().await.expect("admin");
    let terminated: i64 = admin
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = 'tokenlease'",
            &[],
        )
        .await
        .expect("terminate")
        .get(0);
    assert_eq!(terminated, 1);
    let mut counted = 0;
    let _ = common::poll_until(
        Duration::from_millis(5),
        Duration::from_secs(5),
        async || {
            counted += counter_delta(&snapshot(), "tokenlease_store_connection_errors_total", &[]);
            counted != 0
        },
    )
    .await;
    assert_eq!(counted, 1, "the lost connection is counted once");
}
