//! The `tokenlease` command: check policies, run migrations, inspect buckets.
//!
//! Every subcommand that needs PostgreSQL uses `DATABASE_URL` when it is set, and otherwise
//! starts a throwaway cluster from the local server binaries (see `tokenlease_testkit`).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod chart;
mod check;
mod dashboard;
mod db;
mod demo;
mod fault;
mod figures;
mod inspect;
mod loadtest;
mod migrate;
mod reload;
mod reshard;
mod series;
mod serve;
mod server_cpu;
mod trim;

/// Distributed rate limiting with token leases over PostgreSQL.
#[derive(Debug, Parser)]
#[command(name = "tokenlease", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Validate a policy file: print a one-line summary, or the first error and exit 1.
    Check(check::Args),
    /// Apply pending migrations to the database (idempotent).
    Migrate(migrate::Args),
    /// Show a bucket's row as the database sees it now.
    Inspect(inspect::Args),
    /// Run N limiter instances × M tasks against PostgreSQL and report database calls,
    /// accuracy against an ideal bucket, throughput, latency and the server's CPU per decision.
    ///
    /// The server's CPU per decision (`server_cpu_us_per_decision`, with `server_cpu_s`): when
    /// PostgreSQL runs on this machine (the throwaway cluster, `--serve-db`'s server, or any
    /// local one named by DATABASE_URL), the CPU time of its whole cluster (the postmaster,
    /// every backend and background process, those that exited included), read from Linux's
    /// /proc at the start and at the end of the measured run, over the requests answered
    /// (admitted or denied, the fallback's decisions included); with --shards, over every
    /// shard's cluster. Within a clock tick (10 ms) per server process that ran. Not measured,
    /// and the report says why, when the server is on another machine, without /proc, or was
    /// restarted during the run.
    Loadtest(loadtest::Args),
    /// Draw database calls and overshoot against lease size from loadtest JSON lines (PNG), or
    /// with --bands, statements and p99 latency against the per-key request rate.
    Chart(chart::Args),
    /// Before switching to a new list of shards: copy the buckets of the keys that move to
    /// their new shard (in batches, idempotently).
    Reshard(reshard::Args),
    /// Serve a booking API protected by both HTTP layers, with /metrics and a live /dashboard.
    Demo(demo::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check(args) => check::run(args),
        Command::Migrate(args) => migrate::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Loadtest(args) => loadtest::run(args),
        Command::Chart(args) => chart::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Reshard(args) => reshard::run(args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("tokenlease: {err}");
            ExitCode::FAILURE
        }
    }
}

/// What a subcommand returns: its exit code, or an error printed as `tokenlease: {err}`.
type CmdResult = Result<ExitCode, Box<dyn std::error::Error>>;
