//! `tokenlease reshard`: before a new list of shards is switched on, copy the rows of the
//! keys that move to their new shard, so that a moved key keeps its bucket instead of starting
//! full there (docs/design/scale-out.md, docs/scale-out.md).
//!
//! Each old shard's rows are read in key order, `--batch-size` at a time (keyset pagination,
//! bound parameters only). A row moves when the new list places its key on a shard of another
//! name than the old list did; rows of keys the old list does not place on the shard they are
//! on (left over from an earlier reshard) are skipped. A moved row is written to its new shard
//! refilled to the old shard's `now()` and dated by the new shard's `now()` (so the two
//! servers' clocks need not agree; the time between the read and the write refills nothing:
//! under-admission, never over-admission), with its strict leases. A row already there is
//! replaced only when the copy holds fewer tokens than it does now, so running the command
//! again changes nothing, and running it again after the switch carries over what the old
//! shard granted between the first run and the switch.

use std::collections::HashSet;
use std::process::ExitCode;

use tokenlease::store::{migrate, shard_of};
use tokio_postgres::types::Type;
use tokio_postgres::{Client, NoTls};

use super::db::DatabaseError;

/// Arguments of `tokenlease reshard`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// A shard of the list in force now, as NAME=URL (URL or key=value connection string);
    /// repeat for each shard. The names are what places keys: the same names as the service's.
    #[arg(long = "from", value_name = "NAME=URL", required = true)]
    from: Vec<String>,
    /// A shard of the new list, as NAME=URL; repeat for each shard. New shards are migrated
    /// first.
    #[arg(long = "to", value_name = "NAME=URL", required = true)]
    to: Vec<String>,
    /// Rows read and written per statement.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    batch_size: u32,
    /// Count what would move without writing anything.
    #[arg(long)]
    dry_run: bool,
}

/// A shard list the command cannot use.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ShardListError {
    /// An argument is not NAME=URL.
    #[error("--{flag} {shown}: expected NAME=URL")]
    NotNameUrl {
        /// `from` or `to`.
        flag: &'static str,
        /// The argument, password hidden.
        shown: String,
    },
    /// Two shards of one list have one name.
    #[error("--{flag}: two shards are named {name:?}")]
    Duplicate {
        /// `from` or `to`.
        flag: &'static str,
        /// The name.
        name: String,
    },
}

/// One shard: its name and connection string.
#[derive(Debug)]
pub(crate) struct Shard {
    /// The shard's name, which places keys (`store::shard_of`).
    pub(crate) name: String,
    /// Its connection string (URL or key=value), password included: show it only through
    /// `db::redact`.
    pub(crate) url: String,
}

/// A list of `NAME=URL` arguments of `--flag` (`tokenlease reshard --from/--to`,
/// `tokenlease loadtest --shard-url`): every name non-empty and used once, every URL
/// non-empty. An error shows the argument with its password hidden.
pub(crate) fn parse(flag: &'static str, args: &[String]) -> Result<Vec<Shard>, ShardListError> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for arg in args {
        let Some((name, url)) = arg.split_once('=') else {
            return Err(ShardListError::NotNameUrl {
                flag,
                shown: super::db::redact(arg),
            });
        };
        let name = name.trim();
        if name.is_empty() || url.trim().is_empty() {
            return Err(ShardListError::NotNameUrl {
                flag,
                shown: super::db::redact(arg),
            });
        }
        if !seen.insert(name.to_owned()) {
            return Err(ShardListError::Duplicate {
                flag,
                name: name.to_owned(),
            });
        }
        out.push(Shard {
            name: name.to_owned(),
            url: url.to_owned(),
        });
    }
    Ok(out)
}

/// One page of an old shard's rows: key, tokens refilled to now (strict leases counted, in
/// tokens as decimal text), the plan's capacity and rate (nanotokens), the refilled amount
/// before the last take (nanotokens), and the leases, all as text.
// language=SQL
const READ_PAGE: &str = "\
SELECT key,
       tokenlease_refill_held(tokenlease_amount(tokens, frac), capacity / 1000000000.0,
                              refill_per_second / 1000000000.0,
                              timestamptz 'epoch' + updated_us * interval '1 microsecond',
                              leases, now())::numeric(38, 18)::text,
       capacity::text, refill_per_second::text, refilled::text, leases::text
FROM tokenlease_buckets
WHERE key > $1
ORDER BY key
LIMIT $2";

/// Writes moved rows, dated by this server's now(); a row already there is replaced only by a
/// copy holding fewer tokens than it holds now.
// language=SQL
const WRITE_ROWS: &str = "\
INSERT INTO tokenlease_buckets AS b
    (key, tokens, frac, capacity, refill_per_second, updated_us, refilled, leases)
SELECT r.key, floor(r.tokens::numeric * 1000000000)::bigint,
       (floor(r.tokens::numeric * 1000000000000000) % 1000000)::integer,
       r.capacity::bigint, r.rate::bigint, (extract(epoch FROM now()) * 1000000)::bigint,
       r.last_granted::bigint, r.leases::tokenlease_lease[]
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[])
    AS r(key, tokens, capacity, rate, last_granted, leases)
ORDER BY r.key
ON CONFLICT (key) DO UPDATE
SET (tokens, frac, capacity, refill_per_second, updated_us, refilled, leases) =
    (EXCLUDED.tokens, EXCLUDED.frac, EXCLUDED.capacity, EXCLUDED.refill_per_second,
     EXCLUDED.updated_us, EXCLUDED.refilled, EXCLUDED.leases)
WHERE tokenlease_amount(EXCLUDED.tokens, EXCLUDED.frac)
      < tokenlease_refill_held(tokenlease_amount(b.tokens, b.frac), b.capacity / 1000000000.0,
                               b.refill_per_second / 1000000000.0,
                               timestamptz 'epoch' + b.updated_us * interval '1 microsecond',
                               b.leases, now())
RETURNING b.key";

async fn connect(shard: &Shard) -> Result<Client, Box<dyn std::error::Error>> {
    let (client, connection) = tokio_postgres::connect(&shard.url, NoTls)
        .await
        .map_err(|err| DatabaseError::new("connect to", &shard.url, &err))?;
    tokio::spawn(connection);
    Ok(client)
}

/// Rows of one batch bound for one new shard, column by column.
#[derive(Default)]
struct Batch {
    keys: Vec<String>,
    tokens: Vec<String>,
    capacities: Vec<String>,
    rates: Vec<String>,
    last_granted: Vec<String>,
    leases: Vec<String>,
}

/// Runs the subcommand on a tokio runtime of its own.
pub(crate) fn run(args: Args) -> super::CmdResult {
    let from = parse("from", &args.from)?;
    let to = parse("to", &args.to)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(reshard(&from, &to, args.batch_size, args.dry_run))?;
    Ok(ExitCode::SUCCESS)
}

async fn reshard(
    from: &[Shard],
    to: &[Shard],
    batch_size: u32,
    dry_run: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let old_names: Vec<&str> = from.iter().map(|s| s.name.as_str()).collect();
    let new_names: Vec<&str> = to.iter().map(|s| s.name.as_str()).collect();
    // The new shards, migrated (a new one has no table yet).
    let mut targets = Vec::with_capacity(to.len());
    for shard in to {
        let mut client = connect(shard).await?;
        if !dry_run {
            migrate(&mut client)
                .await
                .map_err(|err| DatabaseError::new("migrate", &shard.url, &err))?;
        }
        targets.push(client);
    }
    let page = i64::from(batch_size);
    let (mut total_scanned, mut total_moved, mut total_written) = (0u64, 0u64, 0u64);
    for (index, shard) in from.iter().enumerate() {
        let source = connect(shard).await?;
        let (mut scanned, mut moved, mut written) = (0u64, 0u64, 0u64);
        let mut after = String::new();
        loop {
            let rows = source
                .query_typed(READ_PAGE, &[(&after, Type::TEXT), (&page, Type::INT8)])
                .await
                .map_err(|err| DatabaseError::new("read the buckets of", &shard.url, &err))?;
            let Some(last) = rows.last() else {
                break;
            };
            after = last.try_get(0)?;
            let mut batches: Vec<Batch> = to.iter().map(|_| Batch::default()).collect();
            for row in &rows {
                scanned += 1;
                let key: String = row.try_get(0)?;
                // A row this shard does not own under the old list (left over) is not copied.
                if shard_of(&old_names, &key) != Some(index) {
                    continue;
                }
                let Some(target) = shard_of(&new_names, &key) else {
                    continue;
                };
                if new_names[target] == shard.name {
                    continue;
                }
                moved += 1;
                let batch = &mut batches[target];
                batch.keys.push(key);
                batch.tokens.push(row.try_get(1)?);
                batch.capacities.push(row.try_get(2)?);
                batch.rates.push(row.try_get(3)?);
                batch.last_granted.push(row.try_get(4)?);
                batch.leases.push(row.try_get(5)?);
            }
            if !dry_run {
                for (target, batch) in batches.iter().enumerate() {
                    if batch.keys.is_empty() {
                        continue;
                    }
                    let rows = targets[target]
                        .query_typed(
                            WRITE_ROWS,
                            &[
                                (&batch.keys, Type::TEXT_ARRAY),
                                (&batch.tokens, Type::TEXT_ARRAY),
                                (&batch.capacities, Type::TEXT_ARRAY),
                                (&batch.rates, Type::TEXT_ARRAY),
                                (&batch.last_granted, Type::TEXT_ARRAY),
                                (&batch.leases, Type::TEXT_ARRAY),
                            ],
                        )
                        .await
                        .map_err(|err| {
                            DatabaseError::new("write moved buckets to", &to[target].url, &err)
                        })?;
                    written += rows.len() as u64;
                }
            }
            if rows.len() < batch_size as usize {
                break;
            }
        }
        println!(
            "{}: {scanned} rows, {moved} of them moving{}",
            shard.name,
            if dry_run {
                String::new()
            } else {
                format!(", {written} written")
            }
        );
        total_scanned += scanned;
        total_moved += moved;
        total_written += written;
    }
    if dry_run {
        println!("{total_scanned} rows, {total_moved} moving (dry run: nothing written)");
    } else {
        println!(
            "{total_scanned} rows, {total_moved} moving, {total_written} written \
             (a row already on its new shard with fewer tokens is kept)"
        );
    }
    Ok(())
}
