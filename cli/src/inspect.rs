//! `tokenlease inspect KEY`: a bucket's row as the database sees it now.

use std::process::ExitCode;
use std::time::SystemTime;

use tokenlease::store::{PostgresStore, Store};

use super::db::{DatabaseError, redact};
use super::figures;

/// Arguments of `tokenlease inspect`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The bucket's key, exactly as the limiter uses it (quote it in the shell).
    key: String,
    /// The database of the running service (or demo) whose bucket to read. Required: a
    /// throwaway PostgreSQL would hold no buckets.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// Print the row as one JSON object.
    #[arg(long)]
    json: bool,
}

/// `inspect` was not told which database to read.
#[derive(Debug, thiserror::Error)]
#[error(
    "inspect reads the buckets of a running service: set DATABASE_URL (or pass --database-url) \
     to its database, e.g. the URL `tokenlease demo` prints; a throwaway PostgreSQL would hold \
     no buckets"
)]
pub(crate) struct NoDatabase;

/// The most characters of a key quoted back in the "no row" message.
const MAX_QUOTED_KEY: usize = 120;

/// Runs the subcommand.
pub(crate) fn run(args: Args) -> super::CmdResult {
    tokenlease::error::validate_key(&args.key)?;
    let url = args
        .database_url
        .filter(|u| !u.trim().is_empty())
        .ok_or(NoDatabase)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        // Reading never migrates: a service's least-privilege role can inspect (docs/roles.md).
        let store = PostgresStore::builder(&url)
            .map_err(|e| DatabaseError::new("use", &url, &e))?
            .migrate(false)
            .build()
            .await
            .map_err(|e| DatabaseError::new("connect to", &url, &e))?;
        let Some(row) = store
            .inspect(&args.key)
            .await
            .map_err(|e| DatabaseError::new("read", &url, &e))?
        else {
            if args.json {
                println!("{}", serde_json::json!({ "key": args.key, "row": null }));
            } else {
                println!(
                    "{}: no row in {}. No limiter has taken from this key yet (a full \
                     bucket has no row until its first take, and idle full rows are deleted), \
                     or the key is mistyped: keys are case-sensitive, and the HTTP layer's \
                     look like 'ratelimit:api:GET:/bookings/{{bookingId}}' and \
                     'ratelimit:entity:GET:/bookings/{{bookingId}}:123'",
                    quote_key(&args.key),
                    redact(&url)
                );
            }
            return Ok(ExitCode::SUCCESS);
        };
        let ago = |t: SystemTime| {
            row.store_now
                .duration_since(t)
                .map(|d| format!("{} ago", figures::seconds(d.as_secs_f64())))
                .unwrap_or_else(|e| {
                    format!(
                        "{} in the future",
                        figures::seconds(e.duration().as_secs_f64())
                    )
                })
        };
        if args.json {
            let json = serde_json::json!({
                "key": row.key,
                "tokens": row.tokens.trimmed().to_string(),
                "tokens_now": row.tokens_now.trimmed().to_string(),
                "capacity": row.capacity.trimmed().to_string(),
                "refill_per_second": row.refill_per_second.trimmed().to_string(),
                "updated_at_unix_s": unix(row.updated_at),
                "db_now_unix_s": unix(row.store_now),
                "strict_leases": row.leases.iter().map(|l| serde_json::json!({
                    "holder": l.holder,
                    "lease_id": l.lease_id,
                    "amount": l.amount.trimmed().to_string(),
                    "expires_at_unix_s": unix(l.expires_at),
                })).collect::<Vec<_>>(),
            });
            println!("{json}");
        } else {
            println!("key                {:?}", row.key);
            println!(
                "tokens now         {} of {}",
                figures::tokens(row.tokens_now.as_f64()),
                figures::tokens(row.capacity.as_f64())
            );
            println!(
                "tokens stored      {} (as of updated_at)",
                figures::tokens(row.tokens.as_f64())
            );
            let nanos = row.refill_per_second.as_nanos();
            let per_second = row.refill_per_second.as_f64();
            let rate = figures::rate(nanos);
            if rate.ends_with("per second") {
                println!("refill             {rate}");
            } else {
                println!(
                    "refill             {rate} ({} per second)",
                    figures::tokens(per_second)
                );
            }
            println!("updated_at         {}", ago(row.updated_at));
            for l in &row.leases {
                let left = l
                    .expires_at
                    .duration_since(row.store_now)
                    .map_or(0.0, |d| d.as_secs_f64());
                println!(
                    "strict lease       holder {:x}: {} tokens, counted {} more",
                    l.holder,
                    figures::tokens(l.amount.as_f64()),
                    figures::seconds(left)
                );
            }
        }
        Ok(ExitCode::SUCCESS)
    })
}

/// `key` in double quotes with escapes, cut to [`MAX_QUOTED_KEY`] characters.
fn quote_key(key: &str) -> String {
    let count = key.chars().count();
    if count <= MAX_QUOTED_KEY {
        format!("{key:?}")
    } else {
        let cut: String = key.chars().take(MAX_QUOTED_KEY).collect();
        format!("{cut:?}… ({count} characters)")
    }
}

fn unix(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
