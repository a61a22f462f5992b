//! The rig the fault scenarios share (D1–D5, D7, D9 and the abandoned statement and lost
//! connection tests, one module each): each scenario runs in every fallback mode (deny, allow,
//! and local: C/N, r/N per instance with N = 2), through [`per_mode!`]. D6, the pool
//! exhausted, takes the store's pooled connections, which are not public API: it is a unit test
//! of the crate, `src/pool_tests.rs`; it measures with the same kit (`tokenlease_testkit::rig`).
//!
//! Each test starts its own throwaway cluster ([`Rig`]). Limiters reach it either directly (to
//! stop the real server) or through the fault proxy (`tokenlease_testkit::FaultProxy`), with
//! the plan's settings: call timeout 50 ms, connect timeout 250 ms, server-side
//! `statement_timeout` 100 ms, a pool of 4, and a [`CircuitBreaker`] with its defaults (opens
//! after 5 transient failures, back-off 50 ms doubling to 500 ms). Under the breaker a
//! recording wrapper ([`Recording`]) logs every call that reached the database, so the tests
//! measure store calls and caller waits separately. Here too: the metric snapshots and their
//! deltas, the plans of each mode, the callers driven on the hot key ([`drive`]) and the
//! figures read from their decisions and the logs.
//!
//! Timing-dependent: the scenario modules run in the nextest `serial` group, and their tests
//! take a lock so `cargo test` runs them one at a time too. Each prints its figures
//! (`--nocapture`).

use crate::common;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant, SystemTime};

use metrics_util::debugging::DebugValue;
use tokenlease::clock::{SystemClock, WallClock};
use tokenlease::policy::{FallbackMode, FallbackSettings, LeaseSettings, Plan};
use tokenlease::store::{BucketRow, CircuitBreaker, PostgresStore, Store};
use tokenlease::{DecidedBy, Limiter};
use tokenlease_testkit::TempPostgres;
use tokenlease_testkit::rig as kit;
use tokio_postgres::NoTls;

pub(crate) use tokenlease_testkit::FaultProxy as Proxy;
pub(crate) use tokenlease_testkit::rig::{ms, percentile};

pub(crate) const C: u64 = 100;
pub(crate) const R: f64 = 50.0;
/// Limiter instances.
pub(crate) const N: usize = 2;
/// Lease batch: the default lease is at most 0.1 × C.
pub(crate) const B: f64 = 10.0;
pub(crate) const EPS: f64 = 0.02;
pub(crate) const KEY: &str = "faults:hot";
/// The longest a direct-mode caller may wait: a caller that arrives while its key's statement
/// is in flight waits for it (up to the 50 ms call timeout), then for its own round (another
/// 50 ms); plus scheduling slack.
pub(crate) const DIRECT_WAIT: Duration = Duration::from_millis(120);

/// A metric as read from a snapshot: name, labels, value.
pub(crate) type Metric = (String, Vec<(String, String)>, DebugValue);

/// Sum of the counter `name` with all of `labels`, since the previous snapshot.
pub(crate) fn counter_delta(snapshot: &[Metric], name: &str, labels: &[(&str, &str)]) -> u64 {
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

/// The metrics since the previous snapshot (`common::metrics`).
pub(crate) fn snapshot() -> Vec<Metric> {
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
pub(crate) enum Mode {
    Deny,
    Allow,
    Local,
}

impl Mode {
    pub(crate) fn fallback(self) -> FallbackMode {
        match self {
            Mode::Deny => FallbackMode::Deny,
            Mode::Allow => FallbackMode::Allow,
            Mode::Local => FallbackMode::Local {
                instances: NonZeroU32::new(N as u32).expect("N > 0"),
            },
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Mode::Deny => "deny",
            Mode::Allow => "allow",
            Mode::Local => "local",
        }
    }
}

pub(crate) fn direct_plan(mode: Mode, capacity: u64, rate: f64) -> Arc<Plan> {
    Arc::new(common::plan(capacity, rate).with_fallback(FallbackSettings::new(mode.fallback())))
}

pub(crate) fn leased_plan(mode: Mode) -> Arc<Plan> {
    Arc::new(
        common::plan(C, R)
            .with_lease(LeaseSettings::default())
            .with_fallback(FallbackSettings::new(mode.fallback())),
    )
}

// ---------------------------------------------------------------------------------------------
// A store wrapper that logs every call reaching the database

// `Recording`, `Log` and `class`, over the library's store types, the calls timed in std's
// `Instant`.
tokenlease_testkit::recording_store!(tokenlease::store, Instant);

/// One store call that reached the database (the breaker let it through).
pub(crate) type Call = kit::Call<Instant>;

// ---------------------------------------------------------------------------------------------
// The rig: a cluster, a proxy in front of it, limiter instances

pub(crate) struct Rig {
    pub(crate) pg: Arc<TempPostgres>,
    pub(crate) proxy: Proxy,
}

/// One limiter instance: its own pool, breaker and log.
#[derive(Clone)]
pub(crate) struct Instance {
    pub(crate) limiter: Limiter,
    pub(crate) breaker: Arc<CircuitBreaker<Recording>>,
    pub(crate) log: Log,
}

impl Rig {
    pub(crate) async fn start() -> Rig {
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

    pub(crate) fn direct(&self) -> String {
        self.pg.connection_string("postgres")
    }

    pub(crate) fn proxied(&self) -> String {
        Self::via(&self.proxy)
    }

    /// The connection string through `proxy`.
    pub(crate) fn via(proxy: &Proxy) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            proxy.port()
        )
    }

    /// A limiter instance on `connection` with the plan's failure settings and `pool`
    /// connections.
    pub(crate) async fn instance(&self, connection: &str, pool: u32) -> Instance {
        self.instance_with(connection, pool, "default", SystemClock)
            .await
    }

    /// As [`instance`](Self::instance), with the breaker named `name` (the `store` label of its
    /// metrics) and measuring the clock skew against `wall`.
    pub(crate) async fn instance_with(
        &self,
        connection: &str,
        pool: u32,
        name: &str,
        wall: impl WallClock,
    ) -> Instance {
        let store = common::fault_store(connection, pool).await;
        let log = Log::new(Instant::now, class);
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
    pub(crate) async fn admin(&self) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(&self.direct(), NoTls)
            .await
            .expect("admin connection");
        tokio::spawn(async move {
            let _ = connection.await;
        });
        client
    }

    /// The bucket row, read straight from the server.
    pub(crate) async fn row(&self, key: &str) -> Option<BucketRow> {
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
    pub(crate) async fn row_until(
        &self,
        key: &str,
        done: impl Fn(f64) -> bool,
    ) -> Result<f64, f64> {
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
    pub(crate) async fn limiter_connections(admin: &tokio_postgres::Client) -> i64 {
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
    pub(crate) async fn server(&self, op: impl FnOnce(&TempPostgres) + Send + 'static) {
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
pub(crate) struct Event {
    /// When the call started, since the run's origin.
    pub(crate) at: Duration,
    pub(crate) instance: usize,
    pub(crate) allowed: bool,
    pub(crate) by: DecidedBy,
    /// How long the caller waited.
    pub(crate) took: Duration,
    /// The store's clock when it decided (store decisions only).
    pub(crate) store_time: Option<SystemTime>,
}

/// Runs `tasks` callers per instance on [`KEY`] from now until `origin + until`, each pausing
/// `pace` between calls (demand well above the refill rate).
pub(crate) fn drive(
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
pub(crate) fn drive_until(
    instances: &[Instance],
    plan: &Arc<Plan>,
    tasks: usize,
    origin: Instant,
    until: &Arc<AtomicU64>,
) -> tokio::task::JoinHandle<Vec<Event>> {
    let mut callers = Vec::new();
    for (i, instance) in instances.iter().enumerate() {
        for _ in 0..tasks {
            let limiter = instance.limiter.clone();
            let plan = Arc::clone(plan);
            callers.push(move || {
                let (limiter, plan) = (limiter.clone(), Arc::clone(&plan));
                async move {
                    let start = Instant::now();
                    let d = limiter
                        .try_acquire_with(&plan, KEY, 1.0)
                        .await
                        .expect("a decision, never an error");
                    Event {
                        at: start - origin,
                        instance: i,
                        allowed: d.allowed,
                        by: d.decided_by,
                        took: start.elapsed(),
                        store_time: d.store_time,
                    }
                }
            });
        }
    }
    kit::drive(callers, Instant::now, origin, until, |e: &Event| e.at)
}

/// Caller waits: (p50, p99, max).
pub(crate) fn waits(events: &[Event]) -> (Duration, Duration, Duration) {
    kit::waits(events.iter().map(|e| e.took))
}

/// Whether `e` started in `[from, to)`.
pub(crate) fn in_window(e: &Event, from: Duration, to: Duration) -> bool {
    e.at >= from && e.at < to
}

/// The first successful database call at or after `after`, per instance; the latest of them.
pub(crate) fn recovered_at(
    instances: &[Instance],
    origin: Instant,
    after: Duration,
) -> Option<Duration> {
    instances
        .iter()
        .map(|i| i.log.recovered_at(origin, after))
        .collect::<Option<Vec<_>>>()
        .and_then(|v| v.into_iter().max())
}

/// Database calls that started in the window: (count, failed, slowest).
pub(crate) fn calls_in(
    instances: &[Instance],
    origin: Instant,
    from: Duration,
    to: Duration,
) -> (usize, usize, Duration) {
    kit::outcome(&window(instances, origin, from, to))
}

/// The database calls of `instances` that started in the window, instance by instance.
fn window(instances: &[Instance], origin: Instant, from: Duration, to: Duration) -> Vec<Call> {
    instances
        .iter()
        .flat_map(|i| i.log.calls_in(origin, from, to))
        .collect()
}

/// Error classes of the database calls in the window, with counts.
pub(crate) fn error_classes(
    instances: &[Instance],
    origin: Instant,
    from: Duration,
    to: Duration,
) -> Vec<(String, usize)> {
    kit::error_classes(&window(instances, origin, from, to))
}

/// The worst excess over `C + R·(w + EPS) + extra` of admissions in `[from, to)` (local time),
/// for windows of 0.1, 0.5 and 1 s.
pub(crate) fn assert_windows(
    events: &[Event],
    from: Duration,
    to: Duration,
    extra: f64,
    what: &str,
) {
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

/// Per scenario, a module of three tests, one per fallback mode (`deny`, `allow`, `local`),
/// each holding the serial lock while it runs the scenario's function.
macro_rules! per_mode {
    ($($(#[$doc:meta])* $name:ident => $body:ident;)*) => {$(
        $(#[$doc])*
        mod $name {
            use super::*;
            use crate::common;
            use crate::rig::Mode;

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

pub(crate) use per_mode;

/// Whether a decision is the store's.
pub(crate) trait ByStore {
    fn by_store(&self) -> bool;
}

impl ByStore for tokenlease::Decision {
    fn by_store(&self) -> bool {
        self.decided_by == DecidedBy::Store
    }
}

/// A token count as a float, for comparing readings.
pub(crate) trait TokensF64 {
    fn to_f64(&self) -> f64;
}

impl TokensF64 for tokenlease::bucket::Tokens {
    fn to_f64(&self) -> f64 {
        self.to_string().parse().expect("tokens print as a decimal")
    }
}
