//! `tokenlease loadtest`: N limiter instances × M tasks in one process against PostgreSQL, and
//! what they admitted against one ideal bucket per key.
//!
//! Each instance has its own pool and its own lease actor, as separate service processes would.
//! Tasks send requests at a paced rate (open loop, `--rate` in total) for `--duration` seconds,
//! on one hot key or on `--keys` keys chosen uniformly or by a Zipf law. Every request's time,
//! key, cost and outcome is kept, so the run can be replayed through one ideal token bucket per
//! key (`ideal_admitted`) and every sliding window checked against the envelope
//! `capacity + rate × window` (`overshoot_tokens`).

use std::io::IsTerminal;
use std::num::NonZeroU32;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokenlease::bucket::{BucketConfig, BucketState, Rate, Timestamp, Tokens};
use tokenlease::policy::{Accounting, FallbackMode, FallbackSettings, LeaseSettings, Plan};
use tokenlease::store::{CountedStore, PostgresStore};
use tokenlease::{DecidedBy, Limiter};

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
    /// Seconds to run.
    #[arg(long, default_value_t = 5.0)]
    duration: f64,
    /// Requests per second, in total over all tasks (paced, open loop).
    #[arg(long, default_value_t = 20_000.0)]
    rate: f64,
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
    /// Lease accounting (leased mode): `relaxed` (the bucket forgets a lease once granted) or
    /// `strict` (the bucket counts live leases against its capacity: no overshoot).
    #[arg(long, value_enum, default_value_t = AccountingArg::Relaxed)]
    accounting: AccountingArg,
    /// What decides when the store is slow or failing: `deny` (the default here, so that every
    /// admission is the store's or a lease's and the overshoot measures them alone), `allow`, or
    /// `local` (each instance a bucket of capacity / instances).
    #[arg(long, value_enum, default_value_t = Fallback::Deny)]
    fallback: Fallback,
    /// Connections per instance.
    #[arg(long, default_value_t = 4)]
    pool: u32,
    /// Run the limiter's statements with `synchronous_commit = off` (see DESIGN.md).
    #[arg(long)]
    sync_commit_off: bool,
    /// The database; without it a throwaway cluster is started.
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

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
    requests: u64,
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
    fallback: &'static str,
    fallback_decisions: u64,
    synchronous_commit: bool,
}

/// One request: when it finished (ns since the start), its key, and whether it was allowed.
#[derive(Clone, Copy)]
struct Request {
    at: u64,
    key: u32,
    allowed: bool,
}

/// Runs the subcommand.
pub(crate) fn run(args: Args) -> super::CmdResult {
    validate(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let (_server, url) = match &args.database_url {
        Some(url) => (None, url.clone()),
        None => {
            eprintln!("DATABASE_URL is not set: starting a throwaway PostgreSQL");
            let server = tokenlease::embedded::TempPostgres::start()?;
            let url = server.url();
            (Some(server), url)
        }
    };
    let report = runtime.block_on(load(&args, &url))?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    Ok(ExitCode::SUCCESS)
}

fn validate(args: &Args) -> Result<(), String> {
    let positive = |name: &str, v: f64| {
        if v.is_finite() && v > 0.0 {
            Ok(())
        } else {
            Err(format!("--{name} must be a positive number, got {v}"))
        }
    };
    positive("refill", args.refill)?;
    positive("cost", args.cost)?;
    positive("duration", args.duration)?;
    positive("rate", args.rate)?;
    positive("lease-fraction", args.lease_fraction)?;
    if args.lease_fraction > 1.0 {
        return Err("--lease-fraction must be at most 1".into());
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
    let plan = Plan::new("loadtest", bucket).with_fallback(FallbackSettings { mode });
    Ok(match args.mode {
        Mode::Direct => plan,
        Mode::Leased => plan.with_lease(LeaseSettings {
            ttl: Duration::from_millis(args.lease_ttl_ms.max(1)),
            max_fraction: args.lease_fraction,
            low_water: args.low_water,
            refresh: Duration::from_millis(args.refresh_ms.max(1)),
            max_wait: Duration::from_millis(args.max_wait_ms),
            accounting: match args.accounting {
                AccountingArg::Relaxed => Accounting::Relaxed,
                AccountingArg::Strict => Accounting::Strict,
            },
        }),
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

async fn load(args: &Args, url: &str) -> Result<Report, Box<dyn std::error::Error>> {
    let plan = Arc::new(plan(args)?);
    let calls = Arc::new(AtomicU64::new(0));
    let mut limiters = Vec::with_capacity(args.instances);
    for _ in 0..args.instances {
        let store = PostgresStore::builder(url)?
            .pool_size(args.pool)
            .synchronous_commit(!args.sync_commit_off)
            .build()
            .await?;
        let counting = CountedStore::with_counter(store, Arc::clone(&calls));
        limiters.push(Limiter::builder(counting).build());
    }
    // Start every key full, whatever an earlier run left behind.
    {
        let conn = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
        tokio::spawn(conn.1);
        conn.0
            .execute(
                "DELETE FROM tokenlease_buckets WHERE key LIKE 'loadtest:%'",
                &[],
            )
            .await?;
    }
    let key_names: Arc<Vec<String>> =
        Arc::new((0..args.keys).map(|k| format!("loadtest:{k}")).collect());
    let keys = Arc::new(Keys::new(args.keys, args.dist));
    let tasks_total = args.instances * args.tasks;
    let period = Duration::from_secs_f64(tasks_total as f64 / args.rate);
    // lull-burst's steady phase: 0.8 × the refill rate of every key, in all.
    let quiet_period =
        Duration::from_secs_f64(tasks_total as f64 / (0.8 * args.refill * f64::from(args.keys)));
    let pattern = args.pattern;
    let duration = Duration::from_secs_f64(args.duration);
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut handles = Vec::with_capacity(tasks_total);
    for (i, limiter) in limiters.iter().enumerate() {
        for t in 0..args.tasks {
            let (limiter, plan, keys, names, done) = (
                limiter.clone(),
                Arc::clone(&plan),
                Arc::clone(&keys),
                Arc::clone(&key_names),
                Arc::clone(&done),
            );
            let cost = args.cost;
            let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ ((i as u64) << 32 | t as u64).wrapping_mul(31);
            handles.push(tokio::spawn(async move {
                let mut requests = Vec::new();
                let mut latency = hdrhistogram::Histogram::<u64>::new(3).expect("histogram");
                let mut fallback = 0u64;
                // Tasks start spread over one period so they do not fire in lockstep.
                let mut next = start + period.mul_f64((t as f64 + 0.5) / 16.0 % 1.0);
                while next < start + duration {
                    let step = match pattern {
                        Pattern::Steady => period,
                        Pattern::LullBurst => {
                            let at = (next - start).as_secs_f64();
                            let phase = at % CYCLE;
                            if phase < STEADY {
                                quiet_period
                            } else if phase < LULL {
                                next = start + Duration::from_secs_f64(at - phase + LULL);
                                continue;
                            } else {
                                period
                            }
                        }
                    };
                    tokio::time::sleep_until(next.into()).await;
                    next += step;
                    let key = keys.pick(&mut rng);
                    let began = Instant::now();
                    let decision = limiter
                        .try_acquire_with(&plan, &names[key as usize], cost)
                        .await
                        .expect("a valid request");
                    let ended = Instant::now();
                    let _ = latency.record((ended - began).as_nanos() as u64);
                    if matches!(decision.decided_by, DecidedBy::Fallback(_)) {
                        fallback += 1;
                    }
                    requests.push(Request {
                        at: (ended - start).as_nanos() as u64,
                        key,
                        allowed: decision.allowed,
                    });
                    done.fetch_add(1, Ordering::Relaxed);
                }
                (requests, latency, fallback)
            }));
        }
    }
    let progress = std::io::stderr().is_terminal().then(|| {
        let done = Arc::clone(&done);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let elapsed = start.elapsed().as_secs_f64();
                eprint!(
                    "\r{elapsed:5.1} s  {} requests  {:.0}/s   ",
                    done.load(Ordering::Relaxed),
                    done.load(Ordering::Relaxed) as f64 / elapsed
                );
            }
        })
    });
    let mut requests = Vec::new();
    let mut latency = hdrhistogram::Histogram::<u64>::new(3)?;
    let mut fallback = 0;
    for handle in handles {
        let (r, l, f) = handle.await?;
        requests.extend(r);
        latency.add(&l)?;
        fallback += f;
    }
    let elapsed = start.elapsed().as_secs_f64();
    if let Some(p) = progress {
        p.abort();
        eprintln!();
    }
    for limiter in &limiters {
        limiter.shutdown().await;
    }
    requests.sort_unstable_by_key(|r| r.at);
    let db_calls = calls.load(Ordering::Relaxed);
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
        requests: n,
        admitted,
        ideal_admitted: ideal,
        admitted_vs_ideal: if ideal == 0 {
            1.0
        } else {
            admitted as f64 / ideal as f64
        },
        overshoot_tokens: overshoot,
        overshoot_bound,
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
        fallback: match args.fallback {
            Fallback::Allow => "allow",
            Fallback::Deny => "deny",
            Fallback::Local => "local",
        },
        fallback_decisions: fallback,
        synchronous_commit: !args.sync_commit_off,
    })
}

/// What one ideal bucket per key (starting full) admits for the same request times and costs.
fn ideal_admitted(requests: &[Request], keys: u32, bucket: &BucketConfig, cost: Tokens) -> u64 {
    let mut states: Vec<Option<BucketState>> = vec![None; keys as usize];
    let mut admitted = 0;
    for r in requests {
        let now = Timestamp(r.at);
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
    row("duration", format!("{:.2} s", r.duration_s));
    row("requests", r.requests.to_string());
    row(
        "admitted",
        format!(
            "{} (ideal {}, {:.1}%)",
            r.admitted,
            r.ideal_admitted,
            100.0 * r.admitted_vs_ideal
        ),
    );
    row(
        "overshoot",
        format!(
            "{:.2} tokens (bound {:.2})",
            r.overshoot_tokens, r.overshoot_bound
        ),
    );
    row(
        "database calls",
        format!(
            "{} ({:.2} per 1,000 requests)",
            r.db_calls, r.db_calls_per_1k
        ),
    );
    row(
        "throughput",
        format!("{:.0} requests/s", r.throughput_per_s),
    );
    row(
        "latency",
        format!(
            "p50 {:.1} µs, p99 {:.1} µs, p99.9 {:.1} µs",
            r.p50_us, r.p99_us, r.p999_us
        ),
    );
    row(
        "fallback decisions",
        format!("{} (fallback: {})", r.fallback_decisions, r.fallback),
    );
}
