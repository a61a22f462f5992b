//! The Citus step of the migrations: the version check, the tables distributed by key, and the
//! node functions applied by generation and checksum, checked on every node.

use sha2::{Digest, Sha256};
use tokio_postgres::types::Type;

use super::super::sql as files;
use super::SUPPORTED_CITUS;
use super::sql::{bodies, literal, node_functions};
use crate::store::MigrateError;
use crate::store::postgres::functions::{FunctionFile, apply_with};

/// The Citus version of `extversion` (`13.2-1`) as (major, minor).
pub(super) fn parse_version(v: &str) -> Option<(u32, u32)> {
    let mut parts = v.split(['.', '-']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next().and_then(|m| m.parse().ok()).unwrap_or(0);
    Some((major, minor))
}

/// The shards of `tokenlease_buckets` with their tables' names, in shard order; none before
/// the table is distributed.
async fn shards(
    client: &impl tokio_postgres::GenericClient,
) -> Result<Vec<(i64, String)>, MigrateError> {
    let rows = client
        .query_typed(files::CITUS_SHARDS.text, &[])
        .await
        .map_err(MigrateError::database(
            "read the shards of tokenlease_buckets",
        ))?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// `version` when this build supports it, else [`MigrateError::UnsupportedCitus`].
pub(super) fn check_version(version: String) -> Result<String, MigrateError> {
    let (low, high) = SUPPORTED_CITUS;
    if parse_version(&version).is_some_and(|v| v >= low && v < high) {
        return Ok(version);
    }
    Err(MigrateError::UnsupportedCitus {
        version,
        supported: format!(
            "{}.{} up to (not including) {}.{}",
            low.0, low.1, high.0, high.1
        ),
    })
}

/// What the Citus step did: the extension's version, the shards of `tokenlease_buckets`, whether
/// this call chose their count, and whether it applied the node functions or left a newer
/// release's.
#[derive(Debug)]
pub(in crate::store::postgres) struct Distributed {
    pub(in crate::store::postgres) version: String,
    pub(in crate::store::postgres) shards: u32,
    pub(in crate::store::postgres) chosen: bool,
    /// The node functions' name when this call applied them.
    pub(in crate::store::postgres) applied: Vec<&'static str>,
    /// Their name when a newer release's are recorded, left alone.
    pub(in crate::store::postgres) newer: Vec<&'static str>,
}

/// The shard count for the tables when `citus.shard_count` is at Citus's default:
/// [`SHARDS_PER_NODE`](super::SHARDS_PER_NODE) per primary node that holds shards (at least
/// one node); `None` when the setting was set (it is then used).
async fn shard_count(tx: &tokio_postgres::Transaction<'_>) -> Result<Option<u32>, MigrateError> {
    let row = tx
        .query_one(files::CITUS_SHARD_COUNT.text, &[])
        .await
        .map_err(MigrateError::database(
            "read citus.shard_count and the nodes",
        ))?;
    let source: Option<String> = row.get(0);
    if source.as_deref() != Some("default") {
        return Ok(None);
    }
    let nodes: i64 = row.get(1);
    let nodes = u32::try_from(nodes).unwrap_or(1).max(1);
    Ok(Some(nodes * super::SHARDS_PER_NODE))
}

/// The Citus step of [`migrate`](super::super::migrate::migrate): on a database with the `citus`
/// extension, distributes the tables by key (once) and applies this build's node functions
/// ([`node_functions`]) by generation and checksum. Returns what it did, or `None` on plain
/// PostgreSQL (where it does nothing else).
pub(in crate::store::postgres) async fn distribute(
    client: &mut tokio_postgres::Client,
    lock: &str,
) -> Result<Option<Distributed>, MigrateError> {
    distribute_with(client, lock, &node_functions()).await
}

/// [`distribute`] with `file` as the node functions: another build's, for tests of the rule
/// between releases.
///
/// The tables are distributed in one transaction under the migration lock (`lock`, the
/// statement that takes it), so concurrent migrators do it once. Then the node functions are
/// applied as a file of `functions/` is (`functions.rs`, the same code and the same record in
/// `tokenlease_functions` on the coordinator): when the coordinator records none, an older
/// generation, or the same generation with another checksum, or when some node's definitions
/// are not the ones the record says ([`edited_on_nodes`]: a definition edited by hand on a
/// node, or put back by a build from before generations) and the record is at this build's
/// generation. A newer generation is left alone on every node: Citus creates and replaces a
/// distributed function on every node from the coordinator, so an older build's `migrate`
/// during a rolling deploy does not put its definitions back over the newer ones.
pub(in crate::store::postgres) async fn distribute_with(
    client: &mut tokio_postgres::Client,
    lock: &str,
    file: &FunctionFile,
) -> Result<Option<Distributed>, MigrateError> {
    let rows = client
        .query_typed(files::CITUS_CITUS_VERSION.text, &[])
        .await
        .map_err(MigrateError::database("read pg_extension"))?;
    let Some(row) = rows.first() else {
        return Ok(None);
    };
    let version: String = row
        .try_get(0)
        .map_err(MigrateError::database("read the Citus version"))?;
    let version = check_version(version)?;
    let (shards, chosen) = distribute_tables(client, lock).await?;
    let edited = edited_on_nodes(client, file).await?;
    let (applied, newer) = apply_with(client, std::slice::from_ref(file), lock, &edited).await?;
    Ok(Some(Distributed {
        version,
        shards,
        chosen,
        applied,
        newer,
    }))
}

/// Distributes `tokenlease_buckets` and `tokenlease_returns` by key, co-located, unless they
/// are: the shard count, and whether this call chose it.
async fn distribute_tables(
    client: &mut tokio_postgres::Client,
    lock: &str,
) -> Result<(u32, bool), MigrateError> {
    let step = |s: &'static str| MigrateError::database(s);
    let distributed = files::CITUS_DISTRIBUTED_TABLES.text;
    let state = client
        .query_typed(distributed, &[])
        .await
        .map_err(step("read the Citus state"))?;
    if state.first().is_some_and(|row| row.get(0) && row.get(1)) {
        let n = shards(&*client).await?.len();
        return Ok((u32::try_from(n).unwrap_or(u32::MAX), false));
    }
    let tx = client
        .transaction()
        .await
        .map_err(step("begin the Citus transaction"))?;
    tx.batch_execute(lock)
        .await
        .map_err(step("take the migration advisory lock"))?;
    // Distributing a table needs one connection per node throughout the transaction.
    tx.batch_execute(files::CITUS_SEQUENTIAL.text)
        .await
        .map_err(step("set citus.multi_shard_modify_mode"))?;
    let state = tx
        .query_typed(distributed, &[])
        .await
        .map_err(step("read the Citus state"))?;
    let (buckets, returns): (bool, bool) = state
        .first()
        .map_or((false, false), |row| (row.get(0), row.get(1)));
    let mut chosen = false;
    if !buckets {
        if let Some(count) = shard_count(&tx).await? {
            tx.batch_execute(&files::CITUS_SET_SHARD_COUNT.render([&count.to_string()]))
                .await
                .map_err(step("set citus.shard_count"))?;
            chosen = true;
        }
        tx.batch_execute(files::CITUS_DISTRIBUTE_BUCKETS.text)
            .await
            .map_err(step("distribute tokenlease_buckets"))?;
    }
    if !returns {
        tx.batch_execute(files::CITUS_DISTRIBUTE_RETURNS.text)
            .await
            .map_err(step("distribute tokenlease_returns"))?;
    }
    let n = shards(&tx).await?.len();
    tx.commit()
        .await
        .map_err(step("commit the Citus distribution"))?;
    Ok((u32::try_from(n).unwrap_or(u32::MAX), chosen))
}

/// What a node's definitions of `file`'s functions read as: `name:sha256(body)` for each, in
/// name order, joined by `,` (the bodies as `pg_proc.prosrc` holds them).
fn digest(functions: &[(String, String)]) -> String {
    functions
        .iter()
        .map(|(name, body)| {
            let hash = Sha256::digest(body.as_bytes())
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>();
            format!("{name}:{hash}")
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// `[file.name]` when some node's definitions of `file`'s functions are not `file`'s (a body
/// edited, or a function missing), else none. Every node is read, the coordinator and each
/// worker (`run_command_on_all_nodes`); a node that does not answer is not counted (its
/// definitions cannot be told, and a `migrate` that replaced them would fail on it).
async fn edited_on_nodes(
    client: &tokio_postgres::Client,
    file: &FunctionFile,
) -> Result<Vec<&'static str>, MigrateError> {
    let step = |s: &'static str| MigrateError::database(s);
    let ours = bodies(file.sql);
    let expected = digest(&ours);
    let names: Vec<String> = ours.iter().map(|(name, _)| literal(name)).collect();
    let schema: String = client
        .query_typed(files::CITUS_CURRENT_SCHEMA.text, &[])
        .await
        .map_err(step("read the current schema"))?
        .first()
        .map(|row| row.get(0))
        .unwrap_or_default();
    let read = files::CITUS_FUNCTION_DIGESTS.render([&literal(&schema), &names.join(", ")]);
    let here: Option<String> = client
        .query_typed(read.as_str(), &[])
        .await
        .map_err(step("read the Citus functions"))?
        .first()
        .map(|row| row.get(0));
    let nodes = client
        .query_typed(files::CITUS_ON_ALL_NODES.text, &[(&read, Type::TEXT)])
        .await
        .map_err(step("read the Citus functions on every node"))?;
    let differs = here.as_deref() != Some(expected.as_str())
        || nodes.iter().any(|row| {
            let (success, result): (bool, Option<String>) = (row.get(0), row.get(1));
            success && result.as_deref() != Some(expected.as_str())
        });
    Ok(if differs { vec![file.name] } else { Vec::new() })
}
