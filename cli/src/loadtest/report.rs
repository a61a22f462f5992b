//! The report of `tokenlease loadtest`: its JSON and its table.

use serde::Serialize;

use super::*;
use crate::figures::latency_us;

/// The result, as printed with `--json`.
#[derive(Debug, Serialize)]
pub(super) struct Report {
    pub(super) mode: Mode,
    pub(super) instances: usize,
    pub(super) tasks: usize,
    pub(super) keys: u32,
    pub(super) dist: &'static str,
    pub(super) pattern: Pattern,
    pub(super) capacity: u64,
    pub(super) refill_per_second: f64,
    pub(super) cost: f64,
    pub(super) lease_fraction: Option<f64>,
    pub(super) accounting: Option<AccountingArg>,
    pub(super) duration_s: f64,
    pub(super) rate_per_s: f64,
    pub(super) requests: u64,
    pub(super) unsent: u64,
    pub(super) in_flight_at_end: u64,
    pub(super) admitted: u64,
    pub(super) ideal_admitted: u64,
    pub(super) admitted_vs_ideal: f64,
    pub(super) overshoot_tokens: f64,
    pub(super) overshoot_bound: f64,
    pub(super) db_calls: u64,
    pub(super) db_calls_per_1k: f64,
    pub(super) throughput_per_s: f64,
    pub(super) p50_us: f64,
    pub(super) p99_us: f64,
    pub(super) p999_us: f64,
    pub(super) max_us: f64,
    pub(super) fallback: &'static str,
    pub(super) fallback_decisions: u64,
    /// `fallback_decisions` answered after the warm-up (`--warmup`): all of them without one.
    pub(super) fallback_decisions_after_warmup: u64,
    /// Whether plain takes and returns committed durably (`--durable-commits`).
    pub(super) synchronous_commit: bool,
    /// Whether the store prepared its statements once per session (not `--unprepared`).
    pub(super) prepared_statements: bool,
    /// The shards' names, in shard order (`shard-0`, … for `--shards`; the names of
    /// `--shard-url`; one entry otherwise).
    pub(super) shard_names: Vec<String>,
    /// Statements each shard served, in shard order (`--shards`; one entry without it).
    pub(super) shard_db_calls: Vec<u64>,
    /// Statements per second each shard served over the run, in shard order.
    pub(super) shard_db_calls_per_s: Vec<f64>,
    /// Statements per second over every shard.
    pub(super) db_calls_per_s: f64,
    /// Decisions per statement (`requests / db_calls`; 0 when no statement was sent).
    pub(super) decisions_per_statement: f64,
    /// Decisions per second the shards would carry if each served as many statements a
    /// second as the busiest one did in this run, at this run's decisions per statement
    /// (`shards × max(shard_db_calls_per_s) × decisions_per_statement`): the throughput when
    /// the shards were loaded evenly, more when the busiest shard limited the run.
    pub(super) fleet_decisions_per_s: f64,
    /// The fault injected (`--fault`), with what happened.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) fault: Option<crate::fault::Fault>,
    /// CPU seconds the PostgreSQL server spent over the measured window (the window of
    /// `duration_s`, less the first `warmup_s`): the postmaster and every process of the cluster, those that exited
    /// included (`server_cpu` module), summed over the shards' clusters. `None` when the
    /// server is not on this machine or could not be read (`server_cpu_not_measured` says
    /// why).
    pub(super) server_cpu_s: Option<f64>,
    /// `server_cpu_s` in microseconds per decision served: per request answered (`requests`:
    /// admitted and denied alike, the fallback's decisions included; calls dropped unanswered
    /// at the end are not decisions), after the warm-up. `None` when not measured or when no
    /// request was answered.
    pub(super) server_cpu_us_per_decision: Option<f64>,
    /// Seconds at the start left out of `server_cpu_s` and `server_cpu_us_per_decision`
    /// (`--warmup`); 0 when the whole run counts.
    pub(super) warmup_s: f64,
    /// Why the server's CPU time was not measured, when it was not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) server_cpu_not_measured: Option<String>,
    /// `--citus`: the cluster's nodes, the coordinator first, then the workers.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(super) citus_nodes: Vec<String>,
    /// `--citus`: each node's server CPU in microseconds per decision served, in node order
    /// (their sum is `server_cpu_us_per_decision`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(super) citus_node_cpu_us_per_decision: Vec<f64>,
    /// `--citus`: the store's routed calls each worker ran over the run (top-level statements
    /// naming `tokenlease_citus_`, from the worker's `pg_stat_statements`), in worker order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(super) citus_worker_calls: Vec<u64>,
    /// `--citus`: those calls per second.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(super) citus_worker_calls_per_s: Vec<f64>,
    /// `--citus`: two-phase commits the coordinator recorded over the run
    /// (`pg_dist_transaction`): 0 when every call ran on one worker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) citus_two_phase_commits: Option<i64>,
    /// Leased mode: the tokens the instances' leases took from the store, gave back, waived
    /// (not given back to a bucket that had refilled to capacity) and still held at the end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) lease_tokens: Option<LeaseTokens>,
}

/// Where the leased tokens went (`Report::lease_tokens`), in tokens, and how the refills fared.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub(super) struct LeaseTokens {
    pub(super) leased: f64,
    pub(super) returned: f64,
    pub(super) waived: f64,
    pub(super) held_at_end: f64,
    /// Tokens admitted on credit while a new key's refill was late.
    pub(super) credit: f64,
    /// Refill statements that timed out while the store answered and were asked for again.
    pub(super) late_refills: u64,
    /// Refill statements that failed (their keys' callers went to the fallback for 100 ms).
    pub(super) failed_refills: u64,
    /// The leased keys' calls the fallback decided, by cause (`LeaseStats::fallback_*`).
    pub(super) fallback: FallbackCauses,
}

/// Calls of leased keys sent to the fallback, by cause (`LeaseTokens::fallback`).
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub(super) struct FallbackCauses {
    /// The key's last refill failed within 100 ms.
    pub(super) failing: u64,
    /// Waited out `max_wait`; no credit: no refill had answered lately, or one had failed.
    pub(super) unanswered: u64,
    /// Waited out `max_wait`; no credit: the table had removed the key before.
    pub(super) returning: u64,
    /// Waited out `max_wait`; no credit: the key's credit reached its largest lease.
    pub(super) at_bound: u64,
    /// Any other cause (a plan that waits for nothing, strict accounting, a dry key).
    pub(super) other: u64,
}

pub(super) fn print_table(r: &Report) {
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
            "p50 {}, p99 {}, p99.9 {}, max {}",
            latency_us(r.p50_us),
            latency_us(r.p99_us),
            latency_us(r.p999_us),
            latency_us(r.max_us)
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
        row(
            "lease refills",
            format!(
                "{} late (asked again), {} failed; {:.0} tokens admitted on credit",
                t.late_refills, t.failed_refills, t.credit
            ),
        );
        let f = t.fallback;
        row(
            "lease fallback causes",
            format!(
                "{} failing key, {} store unanswered, {} returning key, {} at the lease bound, \
                 {} other",
                f.failing, f.unanswered, f.returning, f.at_bound, f.other
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
pub(super) fn overshoot_text(r: &Report) -> String {
    let bound = match (r.lease_fraction, r.accounting) {
        (Some(f), Some(AccountingArg::Relaxed)) => format!(
            "{} instances × a lease of at most {} tokens (docs/design/leases.md)",
            r.instances,
            (f * r.capacity as f64).floor()
        ),
        (Some(_), _) => "one request's cost: strict leases count against the capacity \
             (docs/design/strict-accounting.md)"
            .to_owned(),
        _ => "one request's cost (docs/design/direct-mode.md)".to_owned(),
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
