//! `tokenlease loadtest`: N limiter instances × M tasks in one process against PostgreSQL, and
//! what they admitted against one ideal bucket per key.
//!
//! Each instance has its own pool and its own lease actor, as separate service processes would.
//! Tasks send requests at a paced rate (open loop, `--rate` in total) for `--duration` seconds
//! (or `--requests` in all), on one hot key or on `--keys` keys chosen uniformly or by a Zipf
//! law. No request is sent after the end: slots the tasks could not keep are counted as
//! `unsent`, so a run lasts about `--duration` whatever the limiter does. Every request's time,
//! key, cost and outcome is kept, so the run can be replayed through one ideal token bucket per
//! key (`ideal_admitted`) and every sliding window checked against the envelope
//! `capacity + rate × window` (`overshoot_tokens`). A progress line goes to stderr once a second
//! (rewritten in place on a terminal, one line a second when piped), with the planned length
//! (`--duration`) and count (`--requests`) beside the figures so far.
//!
//! When the PostgreSQL server runs on this machine (the throwaway cluster, `--serve-db`'s, or
//! any local one), its CPU time over the measured window is read from `/proc` (the
//! `server_cpu` module) and reported per decision served (`server_cpu_us_per_decision`).

use std::num::NonZeroU32;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokenlease::bucket::{BucketConfig, Rate, Tokens};
use tokenlease::policy::{Accounting, FallbackMode, FallbackSettings, LeaseSettings, Plan};

use super::db::{DatabaseError, given_or_throwaway};
use super::reshard::Shard;

mod drive;
mod report;

use self::drive::*;
use self::report::*;

/// Arguments of `tokenlease loadtest`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// `direct`: one statement per request (coalesced per key); `leased`: token leases.
    #[arg(long, value_enum, default_value_t = Mode::Leased)]
    mode: Mode,
    /// Limiter instances, each with its own connection pool and lease actor.
    #[arg(long, default_value_t = 2)]
    instances: usize,
    /// Tasks per instance.
    #[arg(long, default_value_t = 16)]
    tasks: usize,
    /// Number of keys: 1 is one hot key.
    #[arg(long, default_value_t = 1)]
    keys: u32,
    /// How requests pick among the keys.
    #[arg(long, value_enum, default_value_t = Dist::Uniform)]
    dist: Dist,
    /// Bucket capacity per key, in tokens.
    #[arg(long, default_value_t = 100)]
    capacity: u64,
    /// Refill per key, in tokens per second.
    #[arg(long, default_value_t = 50.0)]
    refill: f64,
    /// Cost of each request, in tokens.
    #[arg(long, default_value_t = 1.0)]
    cost: f64,
    /// Seconds to run: no request is sent after this, and requests the pace called for but the
    /// tasks could not send by then are counted as unsent. 5 by default; unbounded with
    /// `--requests` alone.
    #[arg(long)]
    duration: Option<f64>,
    /// Send this many requests in all (paced at `--rate`), then stop; with `--duration` too,
    /// whichever comes first.
    #[arg(long)]
    requests: Option<u64>,
    /// Requests per second, in total over all tasks (paced, open loop).
    #[arg(long, default_value_t = 20_000.0)]
    rate: f64,
    /// Calls each task may have in flight. With 1 (the default) a task waits for each answer
    /// before its next slot, so `tasks × instances` bound the concurrency and a slow answer
    /// delays the next request (a closed loop once the pace is out of reach). With more, a
    /// task sends at its slots whether or not earlier calls have answered, up to this many at
    /// once: the offered rate is kept while calls wait for the store, as when every request of
    /// a service is its own task.
    #[arg(long, default_value_t = 1)]
    in_flight: usize,
    /// Seconds at the start of the run left out of the server's CPU per decision: its CPU is
    /// read at the end of the warm-up instead of the start, and divided by the decisions
    /// answered after it. For the steady state of many keys, whose first calls each write a
    /// row a long run would write once. Every other figure covers the whole run.
    #[arg(long, default_value_t = 0.0)]
    warmup: f64,
    /// `steady`: `--rate` throughout. `lull-burst`: cycles of 6 s: 3 s of demand below the
    /// refill rate (0.8 × refill × keys in all), 2.5 s of nothing, 0.5 s at `--rate`. The lull
    /// lets buckets refill while leases are still out (with `--lease-ttl-ms` above 2.5 s): the
    /// case where relaxed leases overshoot and strict ones do not.
    #[arg(long, value_enum, default_value_t = Pattern::Steady)]
    pattern: Pattern,
    /// Lease lifetime in milliseconds (leased mode).
    #[arg(long, default_value_t = 1000)]
    lease_ttl_ms: u64,
    /// Largest lease as a fraction of the capacity (leased mode).
    #[arg(long, default_value_t = 0.1)]
    lease_fraction: f64,
    /// Refill a lease below this fraction of its size (leased mode).
    #[arg(long, default_value_t = 0.5)]
    low_water: f64,
    /// Lease refresh interval in milliseconds: leases hold about this long's demand.
    #[arg(long, default_value_t = 100)]
    refresh_ms: u64,
    /// Longest wait for an in-flight refill, in milliseconds, before the fallback decides.
    #[arg(long, default_value_t = 50)]
    max_wait_ms: u64,
    /// The store's bound on a whole call, in milliseconds (`PostgresStoreBuilder::call_timeout`;
    /// the library's default is 50). The pool wait is set to four fifths of it, and the
    /// server's statement and lock timeouts to twice it, at least their 100 ms defaults.
    #[arg(long, default_value_t = 50)]
    call_timeout_ms: u64,
    /// Lease accounting (leased mode): `relaxed` (the bucket forgets a lease once granted) or
    /// `strict` (the bucket counts live leases against its capacity: no overshoot).
    #[arg(long, value_enum, default_value_t = AccountingArg::Relaxed)]
    accounting: AccountingArg,
    /// What decides when the store is slow or failing: `deny` (the default here, so that every
    /// admission is the store's or a lease's and the overshoot measures them alone), `allow`, or
    /// `local` (each instance a bucket of capacity / instances).
    #[arg(long, value_enum, default_value_t = Fallback::Deny)]
    fallback: Fallback,
    /// Spread the keys over this many throwaway PostgreSQL clusters (`store::ShardedStore`,
    /// a circuit breaker per shard); the report gives each shard's statements. Not with
    /// `DATABASE_URL`, `--shard-url` or `--fault`.
    #[arg(long, default_value_t = 1)]
    shards: usize,
    /// Run against a throwaway Citus cluster of a coordinator and N workers (the extension
    /// must be installed): the store distributes its tables and routes each worker's keys to
    /// it; the report gives each worker's calls and each node's server CPU per decision. Not
    /// with `DATABASE_URL`, `--shards`, `--shard-url` or `--fault`.
    #[arg(long, value_name = "N", default_value_t = 0)]
    citus: usize,
    /// With `--citus`: how many shards the tables are distributed over (`citus.shard_count`);
    /// without it `migrate` chooses one per worker.
    #[arg(long, value_name = "N")]
    citus_shards: Option<u32>,
    /// A shard of your own, as NAME=URL (URL or key=value connection string); repeat for each
    /// shard. The keys are spread over these primaries by the names, as a service's
    /// `ShardedStore` with the same names would (a circuit breaker per shard); each is
    /// migrated first. Instead of `--shards`; not with `DATABASE_URL` or `--fault`.
    #[arg(long = "shard-url", value_name = "NAME=URL")]
    shard_url: Vec<String>,
    /// Connections per instance (per shard with `--shards` or `--shard-url`).
    #[arg(long, default_value_t = 4)]
    pool: u32,
    /// Commit the limiter's plain takes and returns durably, each waiting for its WAL flush
    /// (`PostgresStoreBuilder::synchronous_commit(true)`), instead of asynchronously (the
    /// default; see docs/design/statements.md).
    #[arg(long)]
    durable_commits: bool,
    /// Send every statement unnamed, parsed and planned on each call
    /// (`PostgresStoreBuilder::prepared_statements(false)`), instead of preparing the store's
    /// statements once per session (the default): what PgBouncer before 1.21 in transaction
    /// mode needs.
    #[arg(long)]
    unprepared: bool,
    /// Leased mode: a sparse key's call goes to the direct-mode coalescer while the lease actor
    /// is busy (`LimiterBuilder::sparse_keys_direct`).
    #[arg(long)]
    sparse_keys_direct: bool,
    /// Direct-mode statements in flight per instance (`LimiterBuilder::statements_in_flight`);
    /// by default the pool size.
    #[arg(long, value_name = "N")]
    statements_in_flight: Option<usize>,
    /// The database; without it a throwaway cluster is started.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Inject a fault into the throwaway PostgreSQL during the run (not with `DATABASE_URL`):
    /// `sigstop` (the server hung), `slow` (every reply `--fault-delay-ms` late, through a
    /// proxy), `down` (crashed, then started again), `restart` (a fast restart). The report's
    /// `max_us` is the slowest decision, under the fault included.
    #[arg(long, value_enum)]
    fault: Option<crate::fault::Kind>,
    /// Seconds into the run when the fault starts.
    #[arg(long, default_value_t = 1.0)]
    fault_at: f64,
    /// Seconds the fault lasts (not for `restart`).
    #[arg(long, default_value_t = 2.0)]
    fault_for: f64,
    /// Reply delay of `--fault slow`, in milliseconds.
    #[arg(long, default_value_t = 30)]
    fault_delay_ms: u64,
    /// Run no load: start the throwaway PostgreSQL, apply the migrations, print its URL on
    /// stdout and keep it up until interrupted (SIGINT or SIGTERM). For running other clients
    /// (scripts/peer-compare.sh) against the same server.
    #[arg(long)]
    serve_db: bool,
    /// Run no load: print the SQL of the store's take for one key (`one`) or many keys
    /// (`many`) and exit, for benchmarks that run it themselves (scripts/peer-compare.sh).
    #[arg(long, value_name = "one|many", hide = true)]
    print_statement: Option<String>,
}

/// Seconds of `--duration` when neither it nor `--requests` is given.
const DEFAULT_DURATION: f64 = 5.0;

/// How long a call in flight at the end may take to answer before it is dropped and counted as
/// `in_flight_at_end` (calls are bounded by the store's call timeout and `--max-wait-ms`
/// anyway; this bounds the run when the machine is starved).
const END_GRACE: Duration = Duration::from_millis(500);

/// How long the instances' shutdown (leases given back) may take before the report goes ahead.
const SHUTDOWN_GRACE: Duration = Duration::from_millis(500);

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Mode {
    Direct,
    Leased,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum AccountingArg {
    Relaxed,
    Strict,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Fallback {
    Allow,
    Deny,
    Local,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Pattern {
    Steady,
    LullBurst,
}

/// The `lull-burst` cycle, in seconds: steady demand until `STEADY`, nothing until `LULL`, then
/// a burst until `CYCLE`.
const CYCLE: f64 = 6.0;
const STEADY: f64 = 3.0;
const LULL: f64 = 5.5;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Dist {
    Uniform,
    Zipf,
}

/// Runs the subcommand.
pub(crate) fn run(args: Args) -> super::CmdResult {
    validate(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if args.serve_db {
        return serve_db(&runtime);
    }
    if let Some(which) = &args.print_statement {
        match which.as_str() {
            "one" => println!("{}", tokenlease::store::acquire_one_sql()),
            "many" => println!("{}", tokenlease::store::acquire_many_sql()),
            other => {
                eprintln!(
                    "tokenlease loadtest: --print-statement takes one or many, not {other:?}"
                );
                return Ok(ExitCode::from(2));
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    let mut others = Vec::new();
    let mut citus = None;
    let (server, shards) = if args.citus > 0 {
        let mut builder = tokenlease_testkit::TempCitus::builder()
            .workers(args.citus)
            .setting("shared_preload_libraries", "citus,pg_stat_statements");
        if let Some(n) = args.citus_shards {
            builder = builder.setting("citus.shard_count", n.to_string());
        }
        let cluster = builder.start()?;
        let shards = vec![Shard {
            name: "citus".into(),
            url: cluster.url(),
        }];
        citus = Some(cluster);
        (None, shards)
    } else if args.shard_url.is_empty() {
        let (server, url) = given_or_throwaway(args.database_url.as_deref())?;
        // More throwaway clusters for `--shards`: the first shard is the one above.
        let mut shards = vec![Shard {
            name: "shard-0".into(),
            url,
        }];
        for i in 1..args.shards {
            let more = tokenlease_testkit::TempPostgres::start()?;
            shards.push(Shard {
                name: format!("shard-{i}"),
                url: more.url(),
            });
            others.push(more);
        }
        (server.map(Arc::new), shards)
    } else {
        (None, crate::reshard::parse("shard-url", &args.shard_url)?)
    };
    let report = runtime.block_on(async {
        let injector = match (args.fault, &server) {
            (None, _) => None,
            (Some(kind), Some(server)) => Some(
                crate::fault::Injector::new(
                    kind,
                    args.fault_at,
                    args.fault_for,
                    args.fault_delay_ms,
                    Arc::clone(server),
                )
                .await?,
            ),
            (Some(_), None) => {
                return Err("--fault needs the throwaway PostgreSQL: unset DATABASE_URL".into());
            }
        };
        load(&args, &shards, injector, citus.as_ref()).await
    })?;
    drop(others);
    drop(citus);
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    Ok(ExitCode::SUCCESS)
}

/// `--serve-db`: a migrated throwaway PostgreSQL whose URL goes to stdout, up until SIGINT or
/// SIGTERM, then stopped and removed.
fn serve_db(runtime: &tokio::runtime::Runtime) -> super::CmdResult {
    let server = tokenlease_testkit::TempPostgres::start()?;
    let url = server.url();
    runtime.block_on(async {
        let (mut client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .map_err(|e| DatabaseError::new("connect to", &url, &e))?;
        let connection = tokio::spawn(connection);
        tokenlease::store::migrate(&mut client).await?;
        drop(client);
        let _ = connection.await;
        println!("{url}");
        eprintln!(
            "serving a throwaway PostgreSQL {} at {url} (migrated): stop it with Ctrl-C or SIGTERM",
            server.version()
        );
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r?,
            _ = term.recv() => {}
        }
        Ok::<_, Box<dyn std::error::Error>>(())
    })?;
    eprintln!("stopping the throwaway PostgreSQL");
    drop(server);
    Ok(ExitCode::SUCCESS)
}

fn validate(args: &Args) -> Result<(), String> {
    if !args.shard_url.is_empty()
        && (args.shards > 1 || args.database_url.is_some() || args.fault.is_some() || args.serve_db)
    {
        return Err(
            "--shard-url names every shard: unset DATABASE_URL, and drop --database-url, \
             --shards, --fault and --serve-db"
                .into(),
        );
    }
    if args.in_flight == 0 {
        return Err("--in-flight must be at least 1".into());
    }
    let run_s = args.duration.unwrap_or(if args.requests.is_some() {
        f64::INFINITY
    } else {
        DEFAULT_DURATION
    });
    if !(args.warmup.is_finite() && args.warmup >= 0.0 && args.warmup < run_s) {
        return Err(format!(
            "--warmup {} must be at least 0 and shorter than the run ({run_s} s)",
            args.warmup
        ));
    }
    let positive = |name: &str, v: f64| {
        if v.is_finite() && v > 0.0 {
            Ok(())
        } else {
            Err(format!("--{name} must be a positive number, got {v}"))
        }
    };
    positive("refill", args.refill)?;
    positive("cost", args.cost)?;
    if let Some(d) = args.duration {
        positive("duration", d)?;
    }
    if args.serve_db && args.database_url.is_some() {
        return Err(
            "--serve-db starts its own throwaway PostgreSQL: unset DATABASE_URL and \
                    drop --database-url"
                .into(),
        );
    }
    if !(args.fault_at.is_finite() && args.fault_at >= 0.0) {
        return Err(format!(
            "--fault-at must be 0 or more seconds, got {}",
            args.fault_at
        ));
    }
    positive("fault-for", args.fault_for)?;
    if args.requests == Some(0) {
        return Err("--requests must be at least 1".into());
    }
    positive("rate", args.rate)?;
    positive("lease-fraction", args.lease_fraction)?;
    if args.lease_fraction > 1.0 {
        return Err("--lease-fraction must be at most 1".into());
    }
    if args.shards == 0 {
        return Err("--shards must be at least 1".into());
    }
    if args.citus > 0
        && (args.shards > 1
            || !args.shard_url.is_empty()
            || args.database_url.is_some()
            || args.fault.is_some()
            || args.serve_db)
    {
        return Err(
            "--citus starts its own throwaway Citus cluster: unset DATABASE_URL, and drop \
             --database-url, --shards, --shard-url, --fault and --serve-db"
                .into(),
        );
    }
    if args.shards > 1 && (args.database_url.is_some() || args.fault.is_some() || args.serve_db) {
        return Err(
            "--shards starts its own throwaway clusters: unset DATABASE_URL, and drop \
             --database-url, --fault and --serve-db"
                .into(),
        );
    }
    if args.instances == 0 || args.tasks == 0 || args.keys == 0 || args.capacity == 0 {
        return Err("--instances, --tasks, --keys and --capacity must be at least 1".into());
    }
    if args.cost > args.capacity as f64 {
        return Err(format!(
            "--cost {} is larger than --capacity {}",
            args.cost, args.capacity
        ));
    }
    Ok(())
}

fn plan(args: &Args) -> Result<Plan, String> {
    let rate = Rate::from_f64(args.refill).ok_or("--refill is out of range (1e-9 to 1e9)")?;
    let bucket = BucketConfig::new(Tokens::whole(args.capacity), rate)
        .map_err(|e| format!("--capacity: {e}"))?;
    let mode = match args.fallback {
        Fallback::Allow => FallbackMode::Allow,
        Fallback::Deny => FallbackMode::Deny,
        Fallback::Local => FallbackMode::Local {
            instances: NonZeroU32::new(args.instances as u32).unwrap_or(NonZeroU32::MIN),
        },
    };
    let plan = Plan::new("loadtest", bucket).with_fallback(FallbackSettings::new(mode));
    Ok(match args.mode {
        Mode::Direct => plan,
        Mode::Leased => plan.with_lease(
            LeaseSettings::default()
                .with_ttl(Duration::from_millis(args.lease_ttl_ms.max(1)))
                .with_max_fraction(args.lease_fraction)
                .with_low_water(args.low_water)
                .with_refresh(Duration::from_millis(args.refresh_ms.max(1)))
                .with_max_wait(Duration::from_millis(args.max_wait_ms))
                .with_accounting(match args.accounting {
                    AccountingArg::Relaxed => Accounting::Relaxed,
                    AccountingArg::Strict => Accounting::Strict,
                }),
        ),
    })
}

/// Picks keys: uniform, or Zipf (s = 1) through a precomputed CDF.
struct Keys {
    cdf: Option<Vec<f64>>,
    n: u32,
}

impl Keys {
    fn new(n: u32, dist: Dist) -> Keys {
        let cdf = (dist == Dist::Zipf && n > 1).then(|| {
            let weights: Vec<f64> = (1..=n).map(|k| 1.0 / f64::from(k)).collect();
            let total: f64 = weights.iter().sum();
            let mut acc = 0.0;
            weights
                .iter()
                .map(|w| {
                    acc += w / total;
                    acc
                })
                .collect()
        });
        Keys { cdf, n }
    }

    fn pick(&self, rng: &mut u64) -> u32 {
        // xorshift64*
        *rng ^= *rng >> 12;
        *rng ^= *rng << 25;
        *rng ^= *rng >> 27;
        let x = rng.wrapping_mul(0x2545_f491_4f6c_dd1d);
        let unit = (x >> 11) as f64 / (1u64 << 53) as f64;
        match &self.cdf {
            Some(cdf) => cdf.partition_point(|&c| c < unit).min(cdf.len() - 1) as u32,
            None => (unit * f64::from(self.n)) as u32 % self.n,
        }
    }
}

/// The limiter settings the command line chooses.
fn tuned(
    builder: tokenlease::limiter::LimiterBuilder,
    args: &Args,
) -> tokenlease::limiter::LimiterBuilder {
    let builder = builder.sparse_keys_direct(args.sparse_keys_direct);
    match args.statements_in_flight {
        Some(n) => builder.statements_in_flight(n),
        None => builder,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    fn schedule(period_ms: u64, end_ms: Option<u64>, quota: Option<u64>) -> Schedule {
        let start = Instant::now();
        Schedule {
            start,
            next: start,
            period: Duration::from_millis(period_ms),
            quiet_period: Duration::from_millis(period_ms),
            pattern: Pattern::Steady,
            end: end_ms.map(|ms| start + Duration::from_millis(ms)),
            quota,
        }
    }

    #[test]
    fn a_steady_schedule_ends_before_the_end() {
        // Slots at 0, 10, …, 990 ms: 100 before an end at 1 s.
        let mut s = schedule(10, Some(1000), None);
        assert_eq!(s.remaining(), 100);
        assert_eq!(s.next_slot(), None);
    }

    #[test]
    fn a_quota_stops_the_schedule_first() {
        let mut s = schedule(10, Some(1000), Some(7));
        let first = s.next_slot().expect("a first slot");
        assert_eq!(first, s.start);
        assert_eq!(s.remaining(), 6);
        // Without an end, the quota alone bounds it.
        assert_eq!(schedule(10, None, Some(42)).remaining(), 42);
    }

    #[test]
    fn lull_burst_skips_the_lull() {
        // 1 slot per 100 ms: 30 in the steady 3 s, none in the 2.5 s lull, 5 in the 0.5 s burst.
        let mut s = schedule(100, Some(6000), None);
        s.pattern = Pattern::LullBurst;
        assert_eq!(s.remaining(), 35);
    }
}
