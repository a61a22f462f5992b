//! The load itself: the instances, their tasks on a paced schedule, the requests they record,
//! and the ideal bucket and the envelope the run is checked against.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokenlease::bucket::{BucketConfig, BucketState, Timestamp, Tokens};
use tokenlease::store::{CircuitBreaker, CountedStore, PostgresStore};
use tokenlease::{DecidedBy, Limiter};

use super::super::db::DatabaseError;
use super::super::reshard::Shard;
use super::super::server_cpu;

use super::*;

/// One request: when it finished (ns since the start), its key, and whether it was allowed.
#[derive(Clone, Copy)]
pub(super) struct Request {
    pub(super) at: u64,
    pub(super) key: u32,
    pub(super) allowed: bool,
    /// Decided by the fallback.
    pub(super) fallback: bool,
}

/// Requests so far over every task, for the progress line, and the run's bounds.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) sent: AtomicU64,
    pub(super) admitted: AtomicU64,
    pub(super) fallback: AtomicU64,
    /// `--duration`, when the run has one.
    pub(super) planned_secs: Option<f64>,
    /// `--requests`, when given.
    pub(super) planned_requests: Option<u64>,
}

impl Counters {
    /// `loadtest: 3.0 of 5.0 s, 60000 sent (20000/s), 41000 admitted, 0 fallback`; with
    /// `--requests`, `60000 of 100000 sent`.
    pub(super) fn line(&self, elapsed: f64) -> String {
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
pub(super) struct TaskResult {
    pub(super) requests: Vec<Request>,
    pub(super) latency: hdrhistogram::Histogram<u64>,
    pub(super) fallback: u64,
    pub(super) unsent: u64,
    pub(super) in_flight_at_end: u64,
}

/// One task's send times: every `period` from its first slot (or the lull-burst cycle), before
/// `end` and at most `quota` of them.
pub(super) struct Schedule {
    pub(super) start: Instant,
    pub(super) next: Instant,
    pub(super) period: Duration,
    pub(super) quiet_period: Duration,
    pub(super) pattern: Pattern,
    pub(super) end: Option<Instant>,
    pub(super) quota: Option<u64>,
}

impl Schedule {
    /// The next slot, or `None` when the schedule is over.
    pub(super) fn next_slot(&mut self) -> Option<Instant> {
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
    pub(super) fn remaining(&mut self) -> u64 {
        let mut n = 0;
        while self.next_slot().is_some() {
            n += 1;
        }
        n
    }
}

pub(super) async fn load(
    args: &Args,
    shards: &[Shard],
    injector: Option<crate::fault::Injector>,
    citus: Option<&tokenlease_testkit::TempCitus>,
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
                credit: sum.credit + s.credit,
                late_refills: sum.late_refills + s.late_refills,
                failed_refills: sum.failed_refills + s.failed_refills,
                fallback: FallbackCauses {
                    failing: sum.fallback.failing + s.fallback_failing,
                    unanswered: sum.fallback.unanswered + s.fallback_unanswered,
                    returning: sum.fallback.returning + s.fallback_returning,
                    at_bound: sum.fallback.at_bound + s.fallback_at_bound,
                    other: sum.fallback.other + s.fallback_other,
                },
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
        // docs/design/leases.md: N instances × one lease of at most B tokens each.
        Mode::Leased if args.accounting == AccountingArg::Relaxed => {
            args.instances as f64 * lease_size
        }
        // docs/design/strict-accounting.md: strict leases count against the capacity; none beyond the envelope.
        Mode::Leased => args.cost,
        // docs/design/direct-mode.md: none beyond the envelope, within one request's cost of jitter.
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
pub(super) struct CitusNodes {
    pub(super) names: Vec<String>,
    pub(super) coordinator: tokio_postgres::Client,
    pub(super) workers: Vec<tokio_postgres::Client>,
}

/// The Citus counters at one moment.
pub(super) struct CitusCounts {
    /// Routed calls each worker has run so far, in worker order.
    pub(super) calls: Vec<u64>,
    /// `pg_dist_transaction` rows on the coordinator.
    pub(super) two_phase: i64,
}

impl CitusNodes {
    async fn connect(
        cluster: &tokenlease_testkit::TempCitus,
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
pub(super) async fn before<T>(
    deadline: Option<Instant>,
    future: impl Future<Output = T>,
) -> Option<T> {
    match deadline {
        None => Some(future.await),
        Some(d) => tokio::time::timeout_at(d.into(), future).await.ok(),
    }
}

/// Samples the CPU time of every cluster, in shard order; the first reason one cannot be.
pub(super) fn sample_clusters(
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
pub(super) fn ideal_admitted(
    requests: &[Request],
    keys: u32,
    bucket: &BucketConfig,
    cost: Tokens,
) -> u64 {
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
pub(super) fn overshoot(
    requests: &[Request],
    keys: u32,
    capacity: f64,
    rate: f64,
    cost: f64,
) -> f64 {
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
