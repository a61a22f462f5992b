//! The Citus step of the migrations: the version check, the tables distributed by key, and the
//! functions created again when this build's differ.

use super::SUPPORTED_CITUS;
use super::sql::{fingerprint, functions, literal};
use crate::store::MigrateError;

/// The Citus version of `extversion` (`13.2-1`) as (major, minor).
pub(super) fn parse_version(v: &str) -> Option<(u32, u32)> {
    let mut parts = v.split(['.', '-']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next().and_then(|m| m.parse().ok()).unwrap_or(0);
    Some((major, minor))
}

/// The shards of `tokenlease_buckets` with their tables' names, in shard order; none before
/// the table is distributed.
async fn shards(tx: &tokio_postgres::Transaction<'_>) -> Result<Vec<(i64, String)>, MigrateError> {
    let rows = tx
        .query_typed(
            "SELECT shardid, shard_name('tokenlease_buckets'::regclass, shardid) \
             FROM pg_dist_shard WHERE logicalrelid = to_regclass('tokenlease_buckets') \
             ORDER BY shardid",
            &[],
        )
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

/// What the Citus step did: the extension's version, the shards of `tokenlease_buckets`, and
/// whether this call chose their count.
#[derive(Debug)]
pub(in crate::store::postgres) struct Distributed {
    pub(in crate::store::postgres) version: String,
    pub(in crate::store::postgres) shards: u32,
    pub(in crate::store::postgres) chosen: bool,
}

/// The shard count for the tables when `citus.shard_count` is at Citus's default:
/// [`SHARDS_PER_NODE`](super::SHARDS_PER_NODE) per primary node that holds shards, at least two;
/// `None` when the setting was set (it is then used).
async fn shard_count(tx: &tokio_postgres::Transaction<'_>) -> Result<Option<u32>, MigrateError> {
    let row = tx
        .query_one(
            "SELECT (SELECT source FROM pg_settings WHERE name = 'citus.shard_count'), \
                    (SELECT count(*) FROM pg_dist_node \
                     WHERE noderole = 'primary' AND isactive AND shouldhaveshards)",
            &[],
        )
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
    Ok(Some((nodes * super::SHARDS_PER_NODE).max(2)))
}

/// The Citus step of [`migrate`](super::super::migrate::migrate): on a database with the `citus`
/// extension, distributes the tables by key (once) and creates the Citus functions (again when
/// this build's differ). Returns the extension's version, or `None` on plain PostgreSQL (where
/// it does nothing else).
///
/// Runs in one transaction under the migration lock (`lock`, the statement that takes it), so
/// concurrent migrators do it once.
pub(in crate::store::postgres) async fn distribute(
    client: &mut tokio_postgres::Client,
    lock: &str,
) -> Result<Option<Distributed>, MigrateError> {
    let rows = client
        .query_typed(
            "SELECT extversion FROM pg_extension WHERE extname = 'citus'",
            &[],
        )
        .await
        .map_err(MigrateError::database("read pg_extension"))?;
    let Some(row) = rows.first() else {
        return Ok(None);
    };
    let version: String = row
        .try_get(0)
        .map_err(MigrateError::database("read the Citus version"))?;
    let version = check_version(version)?;
    let tx = client
        .transaction()
        .await
        .map_err(MigrateError::database("begin the Citus transaction"))?;
    tx.batch_execute(lock)
        .await
        .map_err(MigrateError::database("take the migration advisory lock"))?;
    // Distributing a table and then a function in one transaction needs one connection per
    // node throughout.
    tx.batch_execute("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
        .await
        .map_err(MigrateError::database("set citus.multi_shard_modify_mode"))?;
    let state = tx
        .query_typed(
            "SELECT EXISTS (SELECT FROM pg_dist_partition \
                            WHERE logicalrelid = 'tokenlease_buckets'::regclass), \
                    EXISTS (SELECT FROM pg_dist_partition \
                            WHERE logicalrelid = 'tokenlease_returns'::regclass), \
                    coalesce(obj_description( \
                        to_regprocedure('tokenlease_citus_delete_idle(text, bigint)'), \
                        'pg_proc'), '')",
            &[],
        )
        .await
        .map_err(MigrateError::database("read the Citus state"))?;
    let row = &state[0];
    let (buckets, returns, comment): (bool, bool, String) = (row.get(0), row.get(1), row.get(2));
    let step = |s: &'static str| MigrateError::database(s);
    let current = format!("tokenlease citus {}", fingerprint());
    if buckets && returns && comment == current {
        let shards = u32::try_from(shards(&tx).await?.len()).unwrap_or(u32::MAX);
        return Ok(Some(Distributed {
            version,
            shards,
            chosen: false,
        }));
    }
    let mut chosen = false;
    if !buckets {
        if let Some(count) = shard_count(&tx).await? {
            tx.batch_execute(&format!("SET LOCAL citus.shard_count = {count}"))
                .await
                .map_err(step("set citus.shard_count"))?;
            chosen = true;
        }
        tx.batch_execute("SELECT create_distributed_table('tokenlease_buckets', 'key', 'hash')")
            .await
            .map_err(step("distribute tokenlease_buckets"))?;
    }
    let shards = shards(&tx).await?;
    let stamp = format!("tokenlease citus {}", fingerprint());
    if !returns {
        tx.batch_execute(
            "ALTER TABLE tokenlease_returns DROP CONSTRAINT IF EXISTS tokenlease_returns_pkey; \
             ALTER TABLE tokenlease_returns ADD CONSTRAINT tokenlease_returns_pkey \
                 PRIMARY KEY (key, id); \
             SELECT create_distributed_table('tokenlease_returns', 'key', 'hash', \
                                             colocate_with := 'tokenlease_buckets');",
        )
        .await
        .map_err(step("distribute tokenlease_returns"))?;
    }
    for (signature, body) in functions() {
        tx.batch_execute(&body)
            .await
            .map_err(step("create a Citus function"))?;
        if signature.starts_with("tokenlease_citus_parts")
            || signature.starts_with("tokenlease_citus_hold")
        {
            // Helpers, run where their caller runs: on every node, no distribution argument.
            tx.batch_execute(&format!(
                "SELECT create_distributed_function({})",
                literal(signature)
            ))
            .await
            .map_err(step("create a Citus helper on every node"))?;
            continue;
        }
        tx.batch_execute(&format!(
            "SELECT create_distributed_function({}, '$1', colocate_with := 'tokenlease_buckets')",
            literal(signature)
        ))
        .await
        .map_err(step("distribute a Citus function"))?;
    }
    tx.batch_execute(&format!(
        "COMMENT ON FUNCTION tokenlease_citus_delete_idle(text, bigint) IS {}",
        literal(&stamp)
    ))
    .await
    .map_err(step("record the Citus functions' fingerprint"))?;
    tx.commit()
        .await
        .map_err(step("commit the Citus distribution"))?;
    Ok(Some(Distributed {
        version,
        shards: u32::try_from(shards.len()).unwrap_or(u32::MAX),
        chosen,
    }))
}
