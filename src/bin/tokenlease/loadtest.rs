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

use std::io::IsTerminal;
use std::num::NonZeroU32;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use serde::Serialize;
use tokenlease::bucket::{BucketConfig, BucketState, Rate, Timestamp, Tokens};
use tokenlease::policy::{Accounting, FallbackMode, FallbackSettings, LeaseSettings, Plan};
use tokenlease::store::{CircuitBreaker, CountedStore, PostgresStore};
use tokenlease::{DecidedBy, Limiter};

use super::db::{DatabaseError, given_or_throwaway};
use super::reshard::Shard;
use super::server_cpu;

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
    /// With `--citus`: how many shards the tables are distributed over (`citus.shard_count`;
    /// Citus's default is 32).
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
    /// default; see DESIGN.md section 5).
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

/// The result, as printed with `--json`.
#[derive(Debug, Serialize)]
struct Report {
    mode: Mode,
    instances: usize,
    tasks: usize,
    keys: u32,
    dist: &'static str,
    pattern: Pattern,
    capacity: u64,
    refill_per_second: f64,
    cost: f64,
    lease_fraction: Option<f64>,
    accounting: Option<AccountingArg>,
    duration_s: f64,
    rate_per_s: f64,
    requests: u64,
    unsent: u64,
    in_flight_at_end: u64,
    admitted: u64,
    ideal_admitted: u64,
    admitted_vs_ideal: f64,
    overshoot_tokens: f64,
    overshoot_bound: f64,
    db_calls: u64,
    db_calls_per_1k: f64,
    throughput_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    max_us: f64,
    fallback: &'static str,
    fallback_decisions: u64,
    /// `fallback_decisions` answered after the warm-up (`--warmup`): all of them without one.
    fallback_decisions_after_warmup: u64,
    /// Whether plain takes and returns committed durably (`--durable-commits`).
    synchronous_commit: bool,
    /// Whether the store prepared its statements once per session (not `--unprepared`).
    prepared_statements: bool,
    /// The shards' names, in shard order (`shard-0`, … for `--shards`; the names of
    /// `--shard-url`; one entry otherwise).
    shard_names: Vec<String>,
    /// Statements each shard served, in shard order (`--shards`; one entry without it).
    shard_db_calls: Vec<u64>,
    /// Statements per second each shard served over the run, in shard order.
    shard_db_calls_per_s: Vec<f64>,
    /// Statements per second over every shard.
    db_calls_per_s: f64,
    /// Decisions per statement (`requests / db_calls`; 0 when no statement was sent).
    decisions_per_statement: f64,
    /// Decisions per second the shards would carry if each served as many statements a
    /// second as the busiest one did in this run, at this run's decisions per statement
    /// (`shards × max(shard_db_calls_per_s) × decisions_per_statement`): the throughput when
    /// the shards were loaded evenly, more when the busiest shard limited the run.
    fleet_decisions_per_s: f64,
    /// The fault injected (`--fault`), with what happened.
    #[serde(skip_serializing_if = "Option::is_none")]
    fault: Option<crate::fault::Fault>,
    /// CPU seconds the PostgreSQL server spent over the measured window (the window of
    /// `duration_s`, less the first `warmup_s`): the postmaster and every process of the cluster, those that exited
    /// included (`server_cpu` module), summed over the shards' clusters. `None` when the
    /// server is not on this machine or could not be read (`server_cpu_not_measured` says
    /// why).
    server_cpu_s: Option<f64>,
    /// `server_cpu_s` in microseconds per decision served: per request answered (`requests`:
    /// admitted and denied alike, the fallback's decisions included; calls dropped unanswered
    /// at the end are not decisions), after the warm-up. `None` when not measured or when no
    /// request was answered.
    server_cpu_us_per_decision: Option<f64>,
    /// Seconds at the start left out of `server_cpu_s` and `server_cpu_us_per_decision`
    /// (`--warmup`); 0 when the whole run counts.
    warmup_s: f64,
    /// Why the server's CPU time was not measured, when it was not.
    #[serde(skip_serializing_if = "Option::is_none")]
    server_cpu_not_measured: Option<String>,
    /// `--citus`: the cluster's nodes, the coordinator first, then the workers.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    citus_nodes: Vec<String>,
    /// `--citus`: each node's server CPU in microseconds per decision served, in node order
    /// (their sum is `server_cpu_us_per_decision`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    citus_node_cpu_us_per_decision: Vec<f64>,
    /// `--citus`: the store's routed calls each worker ran over the run (top-level statements
    /// naming `tokenlease_citus_`, from the worker's `pg_stat_statements`), in worker order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    citus_worker_calls: Vec<u64>,
    /// `--citus`: those calls per second.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    citus_worker_calls_per_s: Vec<f64>,
    /// `--citus`: two-phase commits the coordinator recorded over the run
    /// (`pg_dist_transaction`): 0 when every call ran on one worker.
    #[serde(skip_serializing_if = "Option::is_none")]
    citus_two_phase_commits: Option<i64>,
    /// Leased mode: the tokens the instances' leases took from the store, gave back, waived
    /// (not given back to a bucket that had refilled to capacity) and still held at the end.
    #[serde(skip_serializing_if = "Option::is_none")]
    lease_tokens: Option<LeaseTokens>,
}

/// Where the leased tokens went (`Report::lease_tokens`), in tokens.
#[derive(Debug, Default, Clone, Copy, Serialize)]
struct LeaseTokens {
    leased: f64,
    returned: f64,
    waived: f64,
    held_at_end: f64,
}

/// One request: when it finished (ns since the start), its key, and whether it was allowed.
#[derive(Clone, Copy)]
struct Request {
    at: u64,
    key: u32,
    allowed: bool,
    /// Decided by the fallback.
    fallback: bool,
}

/// Requests so far over every task, for the progress line, and the run's bounds.
#[derive(Debug, Default)]
struct Counters {
    sent: AtomicU64,
    admitted: AtomicU64,
    fallback: AtomicU64,
    /// `--duration`, when the run has one.
    planned_secs: Option<f64>,
    /// `--requests`, when given.
    planned_requests: Option<u64>,
}

impl Counters {
    /// `loadtest: 3.0 of 5.0 s, 60000 sent (20000/s), 41000 admitted, 0 fallback`; with
    /// `--requests`, `60000 of 100000 sent`.
    fn line(&self, elapsed: f64) -> String {
        let sent = self.sent.load(Ordering::Relaxed);
        let of_secs = self
            .planned_secs
            .map_or(String::new(), |d| format!(" of {d:.1}"));
        let of_requests = self
            .planned_requests
            .map_or(String::new(), |n| format!(" of {n}"));
        format!(
            "loadtest: {elapsed:5.1}{of_secs} s, {sent}{of_requests} sent ({:.0}/s), {} admitted, \
             {} fallback",
            sent as f64 / elapsed.max(1e-9),
            self.admitted.load(Ordering::Relaxed),
            self.fallback.load(Ordering::Relaxed)
        )
    }
}

/// What one task hands back at the end.
struct TaskResult {
    requests: Vec<Request>,
    latency: hdrhistogram::Histogram<u64>,
    fallback: u64,
    unsent: u64,
    in_flight_at_end: u64,
}

/// One task's send times: every `period` from its first slot (or the lull-burst cycle), before
/// `end` and at most `quota` of them.
struct Schedule {
    start: Instant,
    next: Instant,
    period: Duration,
    quiet_period: Duration,
    pattern: Pattern,
    end: Option<Instant>,
    quota: Option<u64>,
}

impl Schedule {
    /// The next slot, or `None` when the schedule is over.
    fn next_slot(&mut self) -> Option<Instant> {
        if self.quota == Some(0) {
            return None;
        }
        loop {
            if self.end.is_some_and(|e| self.next >= e) {
                return None;
            }
            let step = match self.pattern {
                Pattern::Steady => self.period,
                Pattern::LullBurst => {
                    let at = (self.next - self.start).as_secs_f64();
                    let phase = at % CYCLE;
                    if phase < STEADY {
                        self.quiet_period
                    } else if phase < LULL {
                        self.next = self.start + Duration::from_secs_f64(at - phase + LULL);
                        continue;
                    } else {
                        self.period
                    }
                }
            };
            let slot = self.next;
            self.next += step;
            if let Some(q) = &mut self.quota {
                *q -= 1;
            }
            return Some(slot);
        }
    }

    /// How many slots are left (consuming them).
    fn remaining(&mut self) -> u64 {
        let mut n = 0;
        while self.next_slot().is_some() {
            n += 1;
        }
        n
    }
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
            "one" => println!("{}", tokenlease::__private::acquire_one_sql()),
            "many" => println!("{}", tokenlease::__private::acquire_many_sql()),
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
        let mut builder = tokenlease::embedded::TempCitus::builder()
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
            let more = tokenlease::embedded::TempPostgres::start()?;
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
    let server = tokenlease::embedded::TempPostgres::start()?;
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
    let bucket = BucketConfig::new(Tokens::whole(args.capacity), rate).ok_or("--capacity is 0")?;
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

async fn load(
    args: &Args,
    shards: &[Shard],
    injector: Option<crate::fault::Injector>,
    citus: Option<&tokenlease::embedded::TempCitus>,
) -> Result<Report, Box<dyn std::error::Error>> {
    let plan = Arc::new(plan(args)?);
    // Statements per shard (one shard without `--shards` or `--shard-url`).
    let shard_calls: Vec<Arc<AtomicU64>> = shards.iter().map(|_| Arc::default()).collect();
    let mut limiters = Vec::with_capacity(args.instances);
    let url = &shards[0].url;
    let limiter_url = injector
        .as_ref()
        .map_or_else(|| url.to_owned(), |i| i.url());
    let call_timeout = Duration::from_millis(args.call_timeout_ms.max(1));
    let server_timeout = (call_timeout * 2).max(Duration::from_millis(100));
    for _ in 0..args.instances {
        let mut sharded = tokenlease::store::ShardedStore::builder();
        for (i, shard) in shards.iter().enumerate() {
            let shard_url = if i == 0 { &limiter_url } else { &shard.url };
            // Errors name the shard when the caller named it (`--shard-url`).
            let named = |e: DatabaseError| -> Box<dyn std::error::Error> {
                if args.shard_url.is_empty() {
                    e.into()
                } else {
                    format!("shard {}: {e}", shard.name).into()
                }
            };
            // `build` applies the migrations the database lacks.
            let store = PostgresStore::builder(shard_url)
                .map_err(|e| named(DatabaseError::new("use", shard_url, &e)))?
                .pool_size(args.pool)
                .call_timeout(call_timeout)
                .pool_wait_timeout(call_timeout * 4 / 5)
                .statement_timeout(server_timeout)
                .lock_timeout(server_timeout)
                .synchronous_commit(args.durable_commits)
                .prepared_statements(!args.unprepared)
                .build()
                .await
                .map_err(|e| named(DatabaseError::new("connect to and migrate", shard_url, &e)))?;
            let counting = CountedStore::with_counter(store, Arc::clone(&shard_calls[i]));
            if shards.len() == 1 {
                // As the documented set-up: a circuit breaker in front of the store, so that
                // calls during an outage fail at once instead of each waiting for its timeout.
                limiters.push(tuned(Limiter::builder(CircuitBreaker::new(counting)), args).build());
            } else {
                // A breaker per shard, named after it.
                let name = shard.name.clone();
                sharded = sharded.shard(name.clone(), CircuitBreaker::new(counting).name(name));
            }
        }
        if shards.len() > 1 {
            limiters.push(tuned(Limiter::builder(sharded.build()?), args).build());
        }
    }
    // Start every key full, whatever an earlier run left behind; and find each shard's
    // cluster on this machine, for its CPU time.
    let mut clusters = Ok(Vec::with_capacity(shards.len()));
    for Shard { name, url } in shards {
        let conn = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .map_err(|e| DatabaseError::new("connect to", url, &e))?;
        tokio::spawn(conn.1);
        conn.0
            .execute(
                "DELETE FROM tokenlease_buckets WHERE key LIKE 'loadtest:%'",
                &[],
            )
            .await
            .map_err(|e| DatabaseError::new("reset the loadtest keys in", url, &e))?;
        if let Ok(found) = &mut clusters {
            match server_cpu::locate(&conn.0).await {
                Ok(cluster) => found.push(cluster),
                Err(why) if shards.len() > 1 => clusters = Err(format!("{name}: {why}")),
                Err(why) => clusters = Err(why),
            }
        }
    }
    // With --citus: every node is a cluster of its own; the coordinator is the one found
    // above, the workers follow in order.
    let citus_nodes = match citus {
        Some(cluster) => Some(CitusNodes::connect(cluster).await?),
        None => None,
    };
    if let (Some(nodes), Ok(found)) = (&citus_nodes, &mut clusters) {
        for worker in &nodes.workers {
            match server_cpu::locate(worker).await {
                Ok(cluster) => found.push(cluster),
                Err(why) => {
                    clusters = Err(why);
                    break;
                }
            }
        }
    }
    let citus_at_start = match &citus_nodes {
        Some(nodes) => Some(nodes.counts().await?),
        None => None,
    };
    let clusters: Result<Vec<server_cpu::Cluster>, String> = clusters;
    let key_names: Arc<Vec<String>> =
        Arc::new((0..args.keys).map(|k| format!("loadtest:{k}")).collect());
    let keys = Arc::new(Keys::new(args.keys, args.dist));
    let tasks_total = args.instances * args.tasks;
    let period = Duration::from_secs_f64(tasks_total as f64 / args.rate);
    // lull-burst's steady phase: 0.8 × the refill rate of every key, in all.
    let quiet_period =
        Duration::from_secs_f64(tasks_total as f64 / (0.8 * args.refill * f64::from(args.keys)));
    let pattern = args.pattern;
    let duration = match (args.duration, args.requests) {
        (Some(d), _) => Some(Duration::from_secs_f64(d)),
        (None, Some(_)) => None,
        (None, None) => Some(Duration::from_secs_f64(DEFAULT_DURATION)),
    };
    let counters = Arc::new(Counters {
        planned_secs: duration.map(|d| d.as_secs_f64()),
        planned_requests: args.requests,
        ..Counters::default()
    });
    // The server's CPU time is read at the start (or the end of `--warmup`) and the end of the
    // window `duration_s` measures, and nowhere else: not the start-up, the migrations or the
    // shutdown.
    let warmup = Duration::from_secs_f64(args.warmup);
    let clusters = Arc::new(clusters);
    let start = Instant::now();
    let cpu_at_start = {
        let clusters = Arc::clone(&clusters);
        tokio::spawn(async move {
            tokio::time::sleep_until((start + warmup).into()).await;
            sample_clusters(&clusters)
        })
    };
    let fault = injector.map(|i| i.spawn(start));
    let end = duration.map(|d| start + d);
    let hard_end = end.map(|e| e + END_GRACE);
    let mut handles = Vec::with_capacity(tasks_total);
    for (i, limiter) in limiters.iter().enumerate() {
        for t in 0..args.tasks {
            let (limiter, plan, keys, names, counters) = (
                limiter.clone(),
                Arc::clone(&plan),
                Arc::clone(&keys),
                Arc::clone(&key_names),
                Arc::clone(&counters),
            );
            let cost = args.cost;
            let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ ((i as u64) << 32 | t as u64).wrapping_mul(31);
            // `--requests` split over the tasks, the remainder to the first ones.
            let index = (i * args.tasks + t) as u64;
            let quota = args
                .requests
                .map(|n| n / tasks_total as u64 + u64::from(index < n % tasks_total as u64));
            let mut schedule = Schedule {
                start,
                // Tasks start spread over one period so they do not fire in lockstep.
                next: start + period.mul_f64((t as f64 + 0.5) / 16.0 % 1.0),
                period,
                quiet_period,
                pattern,
                end,
                quota,
            };
            let in_flight = args.in_flight;
            handles.push(tokio::spawn(async move {
                let mut out = TaskResult {
                    requests: Vec::new(),
                    latency: hdrhistogram::Histogram::<u64>::new(3).expect("histogram"),
                    fallback: 0,
                    unsent: 0,
                    in_flight_at_end: 0,
                };
                // The calls this task has sent and not yet seen answered (at most `in_flight`).
                let mut calls = FuturesUnordered::new();
                let call = |key: u32| {
                    let (limiter, plan, names) = (&limiter, &plan, &names);
                    async move {
                        let began = Instant::now();
                        let decision = limiter
                            .try_acquire_with(plan, &names[key as usize], cost)
                            .await
                            .expect("a valid request");
                        (key, began, Instant::now(), decision)
                    }
                };
                let record = |out: &mut TaskResult,
                              (key, began, ended, decision): (
                    u32,
                    Instant,
                    Instant,
                    tokenlease::Decision,
                )| {
                    let _ = out.latency.record((ended - began).as_nanos() as u64);
                    if matches!(decision.decided_by, DecidedBy::Fallback(_)) {
                        out.fallback += 1;
                        counters.fallback.fetch_add(1, Ordering::Relaxed);
                    }
                    if decision.allowed {
                        counters.admitted.fetch_add(1, Ordering::Relaxed);
                    }
                    out.requests.push(Request {
                        at: (ended - start).as_nanos() as u64,
                        key,
                        allowed: decision.allowed,
                        fallback: matches!(decision.decided_by, DecidedBy::Fallback(_)),
                    });
                    counters.sent.fetch_add(1, Ordering::Relaxed);
                };
                let mut slot = schedule.next_slot();
                while let Some(at) = slot {
                    if calls.len() >= in_flight {
                        // At the cap: the next slot waits for an answer, at most until the
                        // hard end (then this slot and the rest are not sent).
                        let Some(answer) = before(hard_end, calls.next()).await else {
                            out.unsent = 1 + schedule.remaining();
                            break;
                        };
                        if let Some(answer) = answer {
                            record(&mut out, answer);
                        }
                        continue;
                    }
                    tokio::select! {
                        biased;
                        Some(answer) = calls.next(), if !calls.is_empty() => {
                            record(&mut out, answer);
                            continue;
                        }
                        () = tokio::time::sleep_until(at.into()) => {}
                    }
                    // Behind the pace at the end: this slot and the rest are not sent.
                    if end.is_some_and(|e| Instant::now() >= e) {
                        out.unsent = 1 + schedule.remaining();
                        break;
                    }
                    calls.push(call(keys.pick(&mut rng)));
                    slot = schedule.next_slot();
                }
                // The calls still in flight, each bounded by the hard end: dropping a call is
                // cancel safe (a take already sent counts as spent).
                while !calls.is_empty() {
                    let Some(answer) = before(hard_end, calls.next()).await else {
                        out.in_flight_at_end = calls.len() as u64;
                        break;
                    };
                    if let Some(answer) = answer {
                        record(&mut out, answer);
                    }
                }
                out
            }));
        }
    }
    let progress = {
        let counters = Arc::clone(&counters);
        let terminal = std::io::stderr().is_terminal();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(
                (start + Duration::from_secs(1)).into(),
                Duration::from_secs(1),
            );
            loop {
                tick.tick().await;
                let line = counters.line(start.elapsed().as_secs_f64());
                if terminal {
                    eprint!("\r{line}   ");
                } else {
                    eprintln!("{line}");
                }
            }
        })
    };
    let mut requests = Vec::new();
    let mut latency = hdrhistogram::Histogram::<u64>::new(3)?;
    let (mut fallback, mut unsent, mut in_flight_at_end) = (0, 0, 0);
    for handle in handles {
        let r = handle.await?;
        requests.extend(r.requests);
        latency.add(&r.latency)?;
        fallback += r.fallback;
        unsent += r.unsent;
        in_flight_at_end += r.in_flight_at_end;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let cpu_at_start = cpu_at_start.await?;
    let node_cpu_s: Result<Vec<f64>, String> = cpu_at_start.and_then(|at_start| {
        let at_end = sample_clusters(&clusters)?;
        Ok(at_start
            .into_iter()
            .zip(at_end)
            .map(|(a, b)| server_cpu::seconds_between(a, b))
            .collect())
    });
    let server_cpu_s = node_cpu_s.clone().map(|nodes| nodes.iter().sum::<f64>());
    let citus_at_end = match &citus_nodes {
        Some(nodes) => Some(nodes.counts().await?),
        None => None,
    };
    progress.abort();
    let _ = progress.await;
    if std::io::stderr().is_terminal() {
        eprintln!();
    }
    eprintln!("{} (done)", counters.line(elapsed));
    if unsent > 0 || in_flight_at_end > 0 {
        eprintln!(
            "loadtest: the run fell behind --rate: {unsent} requests not sent by the end, \
             {in_flight_at_end} calls still in flight {} ms after it (dropped)",
            END_GRACE.as_millis()
        );
    }
    // Where the leased tokens went, summed over the instances (leased mode), before shutdown
    // gives the rest back.
    let lease_tokens = limiters.iter().filter_map(Limiter::lease_stats).fold(
        None,
        |sum: Option<LeaseTokens>, s| {
            let sum = sum.unwrap_or_default();
            Some(LeaseTokens {
                leased: sum.leased + s.leased,
                returned: sum.returned + s.returned,
                waived: sum.waived + s.waived,
                held_at_end: sum.held_at_end + s.outstanding,
            })
        },
    );
    let shutdown = async {
        for limiter in &limiters {
            limiter.shutdown().await;
        }
    };
    if tokio::time::timeout(SHUTDOWN_GRACE, shutdown)
        .await
        .is_err()
    {
        eprintln!(
            "loadtest: the instances' shutdown took over {} ms; reporting without waiting for it",
            SHUTDOWN_GRACE.as_millis()
        );
    }
    let fault = match fault {
        Some(handle) => Some(handle.await?),
        None => None,
    };
    requests.sort_unstable_by_key(|r| r.at);
    let shard_db_calls: Vec<u64> = shard_calls
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .collect();
    let db_calls: u64 = shard_db_calls.iter().sum();
    let admitted = requests.iter().filter(|r| r.allowed).count() as u64;
    let bucket = *plan.bucket();
    let cost = Tokens::from_f64(args.cost).ok_or("--cost is out of range")?;
    let ideal = ideal_admitted(&requests, args.keys, &bucket, cost);
    let overshoot = overshoot(
        &requests,
        args.keys,
        args.capacity as f64,
        args.refill,
        args.cost,
    );
    let lease_size = (args.lease_fraction * args.capacity as f64).floor();
    let overshoot_bound = match args.mode {
        // DESIGN.md §8: N instances × one lease of at most B tokens each.
        Mode::Leased if args.accounting == AccountingArg::Relaxed => {
            args.instances as f64 * lease_size
        }
        // DESIGN.md §13: strict leases count against the capacity; none beyond the envelope.
        Mode::Leased => args.cost,
        // DESIGN.md §7: none beyond the envelope, within one request's cost of jitter.
        Mode::Direct => args.cost,
    };
    let n = requests.len() as u64;
    // The decisions the server's CPU is divided by: those answered after the warm-up.
    let warmup_ns = warmup.as_nanos() as u64;
    let measured = requests.iter().filter(|r| r.at >= warmup_ns).count() as u64;
    let per_s = |calls: u64| calls as f64 / elapsed.max(1e-9);
    let shard_db_calls_per_s: Vec<f64> = shard_db_calls.iter().map(|&c| per_s(c)).collect();
    let decisions_per_statement = if db_calls == 0 {
        0.0
    } else {
        n as f64 / db_calls as f64
    };
    let busiest = shard_db_calls_per_s.iter().copied().fold(0.0, f64::max);
    Ok(Report {
        mode: args.mode,
        instances: args.instances,
        tasks: args.tasks,
        keys: args.keys,
        dist: match args.dist {
            Dist::Uniform => "uniform",
            Dist::Zipf => "zipf",
        },
        pattern: args.pattern,
        capacity: args.capacity,
        refill_per_second: args.refill,
        cost: args.cost,
        lease_fraction: (args.mode == Mode::Leased).then_some(args.lease_fraction),
        accounting: (args.mode == Mode::Leased).then_some(args.accounting),
        duration_s: elapsed,
        rate_per_s: args.rate,
        requests: n,
        unsent,
        in_flight_at_end,
        admitted,
        ideal_admitted: ideal,
        admitted_vs_ideal: if ideal == 0 {
            1.0
        } else {
            admitted as f64 / ideal as f64
        },
        overshoot_tokens: overshoot,
        overshoot_bound,
        shard_names: shards.iter().map(|s| s.name.clone()).collect(),
        fleet_decisions_per_s: shards.len() as f64 * busiest * decisions_per_statement,
        decisions_per_statement,
        db_calls_per_s: per_s(db_calls),
        shard_db_calls_per_s,
        shard_db_calls,
        db_calls,
        db_calls_per_1k: if n == 0 {
            0.0
        } else {
            db_calls as f64 * 1000.0 / n as f64
        },
        throughput_per_s: n as f64 / elapsed,
        p50_us: latency.value_at_quantile(0.5) as f64 / 1000.0,
        p99_us: latency.value_at_quantile(0.99) as f64 / 1000.0,
        p999_us: latency.value_at_quantile(0.999) as f64 / 1000.0,
        max_us: latency.max() as f64 / 1000.0,
        fallback: match args.fallback {
            Fallback::Allow => "allow",
            Fallback::Deny => "deny",
            Fallback::Local => "local",
        },
        fallback_decisions: fallback,
        fallback_decisions_after_warmup: requests
            .iter()
            .filter(|r| r.fallback && r.at >= warmup_ns)
            .count() as u64,
        synchronous_commit: args.durable_commits,
        prepared_statements: !args.unprepared,
        fault,
        server_cpu_us_per_decision: server_cpu_s
            .as_ref()
            .ok()
            .filter(|_| measured > 0)
            .map(|s| s * 1e6 / measured as f64),
        warmup_s: args.warmup,
        server_cpu_s: server_cpu_s.as_ref().ok().copied(),
        server_cpu_not_measured: server_cpu_s.err(),
        lease_tokens,
        citus_nodes: citus_nodes
            .as_ref()
            .map(|nodes| nodes.names.clone())
            .unwrap_or_default(),
        citus_node_cpu_us_per_decision: match (&citus_nodes, node_cpu_s) {
            (Some(_), Ok(nodes)) if measured > 0 => {
                nodes.iter().map(|s| s * 1e6 / measured as f64).collect()
            }
            _ => Vec::new(),
        },
        citus_worker_calls: match (&citus_at_start, &citus_at_end) {
            (Some(a), Some(b)) => a.calls.iter().zip(&b.calls).map(|(a, b)| b - a).collect(),
            _ => Vec::new(),
        },
        citus_worker_calls_per_s: match (&citus_at_start, &citus_at_end) {
            (Some(a), Some(b)) => a
                .calls
                .iter()
                .zip(&b.calls)
                .map(|(a, b)| per_s(b - a))
                .collect(),
            _ => Vec::new(),
        },
        citus_two_phase_commits: match (&citus_at_start, &citus_at_end) {
            (Some(a), Some(b)) => Some(b.two_phase - a.two_phase),
            _ => None,
        },
    })
}

/// Sessions on every node of a `--citus` cluster, for its counters.
struct CitusNodes {
    names: Vec<String>,
    coordinator: tokio_postgres::Client,
    workers: Vec<tokio_postgres::Client>,
}

/// The Citus counters at one moment.
struct CitusCounts {
    /// Routed calls each worker has run so far, in worker order.
    calls: Vec<u64>,
    /// `pg_dist_transaction` rows on the coordinator.
    two_phase: i64,
}

impl CitusNodes {
    async fn connect(
        cluster: &tokenlease::embedded::TempCitus,
    ) -> Result<CitusNodes, Box<dyn std::error::Error>> {
        let open = |url: String| async move {
            let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .map_err(|e| DatabaseError::new("connect to", &url, &e))?;
            tokio::spawn(conn);
            Ok::<_, DatabaseError>(client)
        };
        let coordinator = open(cluster.url()).await?;
        // Created on the coordinator, which creates it on the workers.
        coordinator
            .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .await?;
        let mut workers = Vec::new();
        let mut names = vec![format!("coordinator:{}", cluster.coordinator().port())];
        for (i, worker) in cluster.workers().iter().enumerate() {
            workers.push(open(worker.url()).await?);
            names.push(format!("worker-{}:{}", i + 1, worker.port()));
        }
        Ok(CitusNodes {
            names,
            coordinator,
            workers,
        })
    }

    async fn counts(&self) -> Result<CitusCounts, Box<dyn std::error::Error>> {
        let mut calls = Vec::with_capacity(self.workers.len());
        for worker in &self.workers {
            let n: i64 = worker
                .query_one(
                    "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements \
                     WHERE toplevel AND query LIKE '%tokenlease_citus_%' \
                       AND query NOT LIKE '%pg_stat_statements%'",
                    &[],
                )
                .await?
                .get(0);
            calls.push(u64::try_from(n).unwrap_or(0));
        }
        let two_phase: i64 = self
            .coordinator
            .query_one("SELECT count(*) FROM pg_dist_transaction", &[])
            .await?
            .get(0);
        Ok(CitusCounts { calls, two_phase })
    }
}

/// `future`'s output, or `None` if `deadline` (when there is one) comes first.
async fn before<T>(deadline: Option<Instant>, future: impl Future<Output = T>) -> Option<T> {
    match deadline {
        None => Some(future.await),
        Some(d) => tokio::time::timeout_at(d.into(), future).await.ok(),
    }
}

/// Samples the CPU time of every cluster, in shard order; the first reason one cannot be.
fn sample_clusters(
    clusters: &Result<Vec<server_cpu::Cluster>, String>,
) -> Result<Vec<server_cpu::Sample>, String> {
    clusters
        .as_ref()
        .map_err(Clone::clone)?
        .iter()
        .map(server_cpu::Cluster::sample)
        .collect()
}

/// What one ideal bucket per key (starting full) admits for the same request times and costs.
fn ideal_admitted(requests: &[Request], keys: u32, bucket: &BucketConfig, cost: Tokens) -> u64 {
    let mut states: Vec<Option<BucketState>> = vec![None; keys as usize];
    let mut admitted = 0;
    for r in requests {
        let now = Timestamp::from_nanos(r.at);
        let state = states[r.key as usize].unwrap_or(BucketState::full(bucket, now));
        if let Ok((next, outcome)) = state.take(bucket, now, cost) {
            admitted += u64::from(outcome.is_allowed());
            states[r.key as usize] = Some(next);
        }
    }
    admitted
}

/// The largest excess, over every key and every window, of admitted cost over
/// `capacity + rate × window length`; zero when none.
///
/// For a window ending at admission `i` and starting at admission `j`, the excess is
/// `cost·(i − j + 1) − C − r·(t_i − t_j)`. Per key, keeping the running minimum of
/// `cost·j − r·t_j` makes the maximum over all windows one linear pass.
fn overshoot(requests: &[Request], keys: u32, capacity: f64, rate: f64, cost: f64) -> f64 {
    let mut count = vec![0u64; keys as usize];
    let mut best_start = vec![f64::INFINITY; keys as usize];
    let mut worst = 0.0f64;
    for r in requests.iter().filter(|r| r.allowed) {
        let k = r.key as usize;
        let t = r.at as f64 / 1e9;
        // Window start candidate: this admission (with nothing before it in the window).
        let start_term = cost * count[k] as f64 - rate * t;
        best_start[k] = best_start[k].min(start_term);
        count[k] += 1;
        let end_term = cost * count[k] as f64 - rate * t;
        worst = worst.max(end_term - best_start[k] - capacity);
    }
    worst
}

fn print_table(r: &Report) {
    let row = |name: &str, value: String| println!("{name:<22} {value}");
    row("mode", format!("{:?}", r.mode).to_lowercase());
    row(
        "instances × tasks",
        format!("{} × {}", r.instances, r.tasks),
    );
    row("keys", format!("{} ({})", r.keys, r.dist));
    if r.pattern == Pattern::LullBurst {
        row(
            "pattern",
            "lull-burst (3 s under the rate, 2.5 s idle, 0.5 s burst)".into(),
        );
    }
    row(
        "bucket",
        format!(
            "capacity {}, refill {}/s, cost {}",
            r.capacity, r.refill_per_second, r.cost
        ),
    );
    if let Some(f) = r.lease_fraction {
        let accounting = match r.accounting {
            Some(AccountingArg::Strict) => "strict",
            _ => "relaxed",
        };
        row(
            "lease",
            format!("at most {f} × capacity, {accounting} accounting"),
        );
    }
    if let Some(f) = &r.fault {
        let delay = f
            .delay_ms
            .map(|d| format!(", replies {d} ms late"))
            .unwrap_or_default();
        row(
            "fault",
            format!(
                "{} at {} s for {} s{delay}: {}",
                format!("{:?}", f.kind).to_lowercase(),
                f.at_s,
                f.for_s,
                f.outcome
            ),
        );
    }
    row("duration", format!("{:.2} s", r.duration_s));
    row(
        "requests",
        format!("{} (at --rate {}/s)", r.requests, r.rate_per_s),
    );
    if r.unsent > 0 || r.in_flight_at_end > 0 {
        row(
            "fell behind",
            format!(
                "{} not sent by the end, {} in flight at the end (dropped)",
                r.unsent, r.in_flight_at_end
            ),
        );
    }
    row(
        "admitted",
        format!(
            "{} (ideal {}, {:.1}%)",
            r.admitted,
            r.ideal_admitted,
            100.0 * r.admitted_vs_ideal
        ),
    );
    row("overshoot", overshoot_text(r));
    row(
        "database calls",
        format!(
            "{} ({:.2} per 1,000 requests, {:.0}/s)",
            r.db_calls, r.db_calls_per_1k, r.db_calls_per_s
        ),
    );
    if r.shard_db_calls.len() > 1 {
        row(
            "statements per shard",
            r.shard_names
                .iter()
                .zip(r.shard_db_calls.iter().zip(&r.shard_db_calls_per_s))
                .map(|(name, (n, per_s))| format!("{name} {n} ({per_s:.0}/s)"))
                .collect::<Vec<_>>()
                .join(", "),
        );
        row(
            "at the busiest rate",
            format!(
                "{:.0} requests/s ({} shards × the busiest shard's statements/s × {:.2} \
                 requests per statement)",
                r.fleet_decisions_per_s,
                r.shard_db_calls.len(),
                r.decisions_per_statement
            ),
        );
    }
    row(
        "throughput",
        format!("{:.0} requests/s", r.throughput_per_s),
    );
    row(
        "latency",
        format!(
            "p50 {:.1} µs, p99 {:.1} µs, p99.9 {:.1} µs, max {:.1} µs",
            r.p50_us, r.p99_us, r.p999_us, r.max_us
        ),
    );
    if let Some(t) = r.lease_tokens {
        row(
            "lease tokens",
            format!(
                "{:.0} leased, {:.0} given back, {:.0} waived, {:.0} held at the end",
                t.leased, t.returned, t.waived, t.held_at_end
            ),
        );
    }
    row(
        "fallback decisions",
        if r.warmup_s > 0.0 {
            format!(
                "{} (fallback: {}), {} after the warm-up",
                r.fallback_decisions, r.fallback, r.fallback_decisions_after_warmup
            )
        } else {
            format!("{} (fallback: {})", r.fallback_decisions, r.fallback)
        },
    );
    row(
        "server CPU",
        match (
            r.server_cpu_s,
            r.server_cpu_us_per_decision,
            &r.server_cpu_not_measured,
        ) {
            (Some(s), Some(us), _) => format!(
                "{us:.1} µs per decision ({s:.2} CPU s of PostgreSQL over {}{})",
                if r.warmup_s > 0.0 {
                    format!(
                        "the {:.2} s run after a {:.2} s warm-up",
                        r.duration_s - r.warmup_s,
                        r.warmup_s
                    )
                } else {
                    format!("the {:.2} s run", r.duration_s)
                },
                if r.shard_names.len() > 1 {
                    ", every shard's cluster"
                } else {
                    ""
                }
            ),
            (Some(s), None, _) => format!("{s:.2} CPU s of PostgreSQL, no decision served"),
            (_, _, Some(why)) => format!("not measured: {why}"),
            (None, _, None) => "not measured".into(),
        },
    );
    if !r.citus_nodes.is_empty() {
        if !r.citus_node_cpu_us_per_decision.is_empty() {
            row(
                "CPU per node",
                r.citus_nodes
                    .iter()
                    .zip(&r.citus_node_cpu_us_per_decision)
                    .map(|(name, us)| format!("{name} {us:.1} µs/decision"))
                    .collect::<Vec<_>>()
                    .join(", "),
            );
        }
        row(
            "calls per worker",
            r.citus_nodes
                .iter()
                .skip(1)
                .zip(r.citus_worker_calls.iter().zip(&r.citus_worker_calls_per_s))
                .map(|(name, (n, per_s))| format!("{name} {n} ({per_s:.0}/s)"))
                .collect::<Vec<_>>()
                .join(", "),
        );
        if let Some(n) = r.citus_two_phase_commits {
            row("two-phase commits", n.to_string());
        }
    }
}

/// The overshoot row: the measured excess, the bound that applies and what it covers. The
/// bound is on what the store and the leases admit; a fallback that admits (`allow`, `local`)
/// admits outside it while the store cannot answer, and the row says so when it decided.
fn overshoot_text(r: &Report) -> String {
    let bound = match (r.lease_fraction, r.accounting) {
        (Some(f), Some(AccountingArg::Relaxed)) => format!(
            "{} instances × a lease of at most {} tokens (DESIGN.md §8)",
            r.instances,
            (f * r.capacity as f64).floor()
        ),
        (Some(_), _) => "one request's cost: strict leases count against the capacity \
             (DESIGN.md §13)"
            .to_owned(),
        _ => "one request's cost (DESIGN.md §7)".to_owned(),
    };
    let covers = if r.fallback == "deny" {
        "it covers every admission (the deny fallback admits none)".to_owned()
    } else if r.fallback_decisions == 0 {
        format!(
            "it covers every admission (the {} fallback decided nothing)",
            r.fallback
        )
    } else {
        format!(
            "it holds for the store's and the leases' admissions only, and excludes what the {} \
             fallback admitted (of its {} decisions){} while the store could not answer: no \
             bound here covers those",
            r.fallback,
            r.fallback_decisions,
            if r.fault.is_some() {
                " under the fault"
            } else {
                ""
            }
        )
    };
    format!(
        "{:.2} tokens (bound {:.2}: {bound}; {covers})",
        r.overshoot_tokens, r.overshoot_bound
    )
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
