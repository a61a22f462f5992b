//! `tokenlease inspect KEY`: a bucket's row as the database sees it now.

use std::process::ExitCode;
use std::time::SystemTime;

use tokenlease::store::{PostgresStore, Store};

/// Arguments of `tokenlease inspect`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The bucket's key, exactly as the limiter uses it (quote it in the shell).
    key: String,
    /// The database; without it a throwaway cluster is started (and holds no buckets).
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
    /// Print the row as one JSON object.
    #[arg(long)]
    json: bool,
}

/// Runs the subcommand.
pub(crate) fn run(args: Args) -> super::CmdResult {
    tokenlease::error::validate_key(&args.key)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (_server, url) = match args.database_url {
        Some(url) => (None, url),
        None => {
            eprintln!(
                "DATABASE_URL is not set: starting a throwaway PostgreSQL (it holds no buckets)"
            );
            let server = tokenlease::embedded::TempPostgres::start()?;
            let url = server.url();
            (Some(server), url)
        }
    };
    runtime.block_on(async {
        let store = PostgresStore::connect(&url).await?;
        let Some(row) = store.inspect(&args.key).await? else {
            if args.json {
                println!("{}", serde_json::json!({ "key": args.key, "row": null }));
            } else {
                println!("{:?}: no row (a full bucket)", args.key);
            }
            return Ok(ExitCode::SUCCESS);
        };
        let ago = |t: SystemTime| {
            row.store_now
                .duration_since(t)
                .map(|d| format!("{:.3} s ago", d.as_secs_f64()))
                .unwrap_or_else(|e| format!("{:.3} s in the future", e.duration().as_secs_f64()))
        };
        if args.json {
            let json = serde_json::json!({
                "key": row.key,
                "tokens": row.tokens.to_string(),
                "tokens_now": row.tokens_now.to_string(),
                "capacity": row.capacity.to_string(),
                "refill_per_second": row.refill_per_second.to_string(),
                "updated_at_unix_s": unix(row.updated_at),
                "db_now_unix_s": unix(row.store_now),
                "strict_leases": row.leases.iter().map(|l| serde_json::json!({
                    "holder": l.holder,
                    "lease_id": l.lease_id,
                    "amount": l.amount.to_string(),
                    "expires_at_unix_s": unix(l.expires_at),
                })).collect::<Vec<_>>(),
            });
            println!("{json}");
        } else {
            println!("key                {:?}", row.key);
            println!("tokens now         {} of {}", row.tokens_now, row.capacity);
            println!("tokens stored      {} (as of updated_at)", row.tokens);
            println!("refill per second  {}", row.refill_per_second);
            println!("updated_at         {}", ago(row.updated_at));
            for l in &row.leases {
                let left = l
                    .expires_at
                    .duration_since(row.store_now)
                    .map_or(0.0, |d| d.as_secs_f64());
                println!(
                    "strict lease       holder {:x}: {} tokens, counted {left:.3} s more",
                    l.holder, l.amount
                );
            }
        }
        Ok(ExitCode::SUCCESS)
    })
}

fn unix(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
