//! The Citus path's SQL: the plain store's statements rewritten for one shard's tables, the
//! functions that run them on a worker (created and distributed by `distribute`), and the calls
//! the store sends.

use std::sync::LazyLock;

use tokio_postgres::types::Type;

use super::super::functions::FunctionFile;
use super::super::sql as files;

/// `s` for `format()`: every `%` doubled.
pub(super) fn for_format(s: &str) -> String {
    s.replace('%', "%%")
}

/// Strict leases on one shard, as migration 0007's `tokenlease_acquire_held` (step 1: insert
/// new keys full, lock existing ones, in key order): `citus/sql/held_insert_shard.sql` on the
/// shard's table `%1$s`, for `format()`. `$1` keys, `$2` capacities, `$3` rates, `$4` the clock
/// in microseconds, `$5` positions.
pub(super) static HELD_INSERT_SHARD: LazyLock<String> =
    LazyLock::new(|| files::HELD_INSERT_SHARD.render_escaped(["%1$s"], for_format));

/// Step 2 of `tokenlease_acquire_held` on one shard (`citus/sql/held_update_shard.sql`, for
/// `format()`): refill and take, joined by key, in tokens. `$1`..`$10` as the function's
/// arguments, `$11` the clock in microseconds, `$12` positions. The join is the planner's
/// choice: `tokenlease_citus_take_held` runs it with `enable_seqscan = off` (a `SET` clause,
/// restored when the function returns), as the plain store's `tokenlease_acquire_held` does, so
/// a shard analysed while empty is still read by its primary key.
pub(super) static HELD_UPDATE_SHARD: LazyLock<String> =
    LazyLock::new(|| files::HELD_UPDATE_SHARD.render_escaped(["%1$s"], for_format));

/// Returns on one shard (`citus/sql/give_back_shard.sql`, for `format()`), as the plain store's
/// return statement (`sql/give_back.sql`, the same credit), with the returns' shard `%2$s` keyed
/// by `(key, id)`. `$1`..`$7` as that statement's, `$8` positions (the part's members,
/// ascending).
///
/// Linear in the keys of the call: the part's requests are the positions `$8` joined once to
/// the arrays unnested with their ordinality (a hash or merge join, not a test of every row
/// against every position), the fresh returns are joined to them once (`todo`, materialised,
/// so that no later join reads a CTE once per row), and the rows are reached by key through
/// the primary key's index: `tokenlease_citus_give_back` runs it with `enable_seqscan = off`,
/// as `tokenlease_citus_take_held` does, so a shard the planner believes small is not read
/// whole. The rows are locked in key order first (`locked`, run once before the update by the
/// uncorrelated subquery of its `WHERE`), so two returns never wait on each other in a cycle.
pub(in crate::store::postgres) static GIVE_BACK_SHARD: LazyLock<String> =
    LazyLock::new(|| files::GIVE_BACK_SHARD.render_escaped(["%1$s", "%2$s"], for_format));

/// Idle cleanup on one shard: `sql/delete_idle.sql` on the shard's tables (`%1$s` buckets,
/// `%2$s` returns), for `format()`. `$1` the limit.
pub(super) static DELETE_IDLE_SHARD: LazyLock<String> =
    LazyLock::new(|| files::DELETE_IDLE.render_escaped(["%1$s", "%2$s"], for_format));

/// Several limits on one shard (`citus/sql/take_limits_shard.sql`, for `format()`): the plain
/// store's `sql/acquire_limits.sql` on the shard's table `%1$s`, for the positions `$11`
/// (integer[]) of the arrays only, its columns cast to their base types for a function's
/// `RETURN QUERY`.
static TAKE_LIMITS_SHARD: LazyLock<String> =
    LazyLock::new(|| files::TAKE_LIMITS_SHARD.render_escaped(["%1$s"], for_format));

/// Returns of several limits on one shard (`citus/sql/give_back_limits_shard.sql`, for
/// `format()`): `sql/give_back_limits.sql` on the shard's tables (`%1$s` buckets, `%2$s`
/// returns, keyed by `(key, id)`), for the positions `$10` (integer[]) of the arrays only,
/// joined once to the arrays unnested with their ordinality.
static GIVE_BACK_LIMITS_SHARD: LazyLock<String> =
    LazyLock::new(|| files::GIVE_BACK_LIMITS_SHARD.render_escaped(["%1$s", "%2$s"], for_format));

/// `'text'` with `'` doubled, for the dollar-free SQL literals of the function bodies.
pub(super) fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The functions of the Citus path, in the order they are created, each its file of
/// `citus/sql/` (`tokenlease_citus_*.sql`) with the shard statements it runs filled in as
/// literals; each is then made a distributed function on its first argument (except the
/// helpers, which run where their caller runs).
///
/// `tokenlease_citus_hold` is the guard of every write on a shard table that bypasses Citus's
/// executor: each of `shards`' distribution metadata lock in share mode, the lock Citus's own
/// executor takes on a shard it modifies (`AcquireMetadataLocks`:
/// `LockShardDistributionMetadata(shard, ShareLock)`), and that a shard move or split blocking
/// writes takes in exclusive mode on every node (`BlockWritesToShardList`, through
/// `lock_shard_metadata(7, ...)` on the workers) before it copies the shard, holding it until
/// it commits the new placement. Then the placements are checked in a snapshot taken after the
/// locks (each SQL statement of a volatile PL/pgSQL function gets its own): a write waits while
/// a move copies, and once the move has committed it fails here (SQLSTATE 55000) instead of
/// landing on the copy Citus no longer reads. A shard a split has removed fails in
/// `lock_shard_metadata` ("could not find valid entry for shard"). `shards` in shard order (the
/// locks are taken in it). Returns `keys`, so that a statement can take its keys through it:
/// the keys' `unnest` then runs it before any row is written. One call per statement, for all
/// its shards: its cost is per statement, not per shard or key.
///
/// It is written for the fewest executor runs, each a measured share of a node's CPU per
/// statement (docs/design/scale-out.md, "What it costs"): the locks are taken in the `IF`'s
/// condition, a simple expression PL/pgSQL evaluates without starting the executor (`PERFORM`
/// is a query of its own); the check reads the placements without an aggregate (`GET
/// DIAGNOSTICS ... ROW_COUNT` counts them: one row per shard and node, `pg_dist_placement`'s
/// unique index on `(shardid, groupid)`). The condition is a statement of its own, evaluated
/// before the check starts, so the check's snapshot is still taken after the locks. `SECURITY
/// DEFINER`, owned by the migrating role (the tables' owner): `lock_shard_metadata` is for the
/// shard's owner, and the store's role need not be; every name in it is schema-qualified.
pub(super) fn functions() -> Vec<(&'static str, String)> {
    vec![
        (
            "tokenlease_citus_hold(bigint[], text[])",
            files::FN_HOLD.render([]),
        ),
        ("tokenlease_citus_parts(text[])", files::FN_PARTS.render([])),
        (
            "tokenlease_citus_take_held(text, text[], bigint[], bigint[], bigint[], bigint[], \
             bigint[], bigint[], bigint[], bigint[], bigint[])",
            files::FN_TAKE_HELD
                .render([&literal(&HELD_INSERT_SHARD), &literal(&HELD_UPDATE_SHARD)]),
        ),
        (
            "tokenlease_citus_give_back(text, bigint[], text[], bigint[], bigint[], bigint[], \
             bigint[], bigint[])",
            files::FN_GIVE_BACK.render([&literal(&GIVE_BACK_SHARD)]),
        ),
        (
            "tokenlease_citus_delete_idle(text, bigint)",
            files::FN_DELETE_IDLE.render([&literal(&DELETE_IDLE_SHARD)]),
        ),
        (
            "tokenlease_citus_take_limits(text, text[], bigint[], bigint[], bigint[], bigint[], \
             bigint[], bigint[], bigint[], integer[], integer[])",
            files::FN_TAKE_LIMITS.render([&literal(&TAKE_LIMITS_SHARD)]),
        ),
        (
            "tokenlease_citus_give_back_limits(text, bigint[], text[], bigint[], bigint[], \
             bigint[], bigint[], bigint[], integer[], integer[])",
            files::FN_GIVE_BACK_LIMITS.render([&literal(&GIVE_BACK_LIMITS_SHARD)]),
        ),
    ]
}

/// The generation of the Citus node functions ([`functions`]), raised by every release that
/// changes their SQL, as a file of `functions/` is (`functions.rs`): a coordinator recording a
/// higher one in `tokenlease_functions` was migrated by a newer release, whose definitions stay
/// on every node. Builds from before generations recorded none (0). `functions.rs`'s `RELEASED`
/// pins each generation's checksum (checked by `the_node_functions_are_pinned`).
pub(in crate::store::postgres) const NODE_FUNCTIONS_GENERATION: i32 = 1;

/// The name the Citus node functions are recorded under in `tokenlease_functions`.
pub(super) const NODE_FUNCTIONS: &str = "citus";

/// The SQL that creates the Citus node functions ([`functions`]) on a coordinator, run as one
/// batch in the migration's transaction: each function created, then made a distributed
/// function on its first argument, co-located with `tokenlease_buckets` (the helpers, which
/// run where their caller runs, on every node with no distribution argument); Citus creates
/// each on every node.
static NODE_FUNCTIONS_SQL: LazyLock<String> = LazyLock::new(|| {
    // Distributing a function in the transaction that created it needs one connection per
    // node throughout.
    let mut sql = String::from("SET LOCAL citus.multi_shard_modify_mode TO 'sequential';\n");
    for (signature, body) in functions() {
        // Each file ends its `CREATE FUNCTION` with `;` and a line break.
        sql.push_str(&body);
        let helper = signature.starts_with("tokenlease_citus_parts")
            || signature.starts_with("tokenlease_citus_hold");
        if helper {
            sql.push_str(&format!(
                "SELECT create_distributed_function({});\n",
                literal(signature)
            ));
        } else {
            sql.push_str(&format!(
                "SELECT create_distributed_function({}, '$1', \
                 colocate_with := 'tokenlease_buckets');\n",
                literal(signature)
            ));
        }
    }
    sql
});

/// The Citus node functions as a function file of this build: applied by generation and
/// checksum as the files of `functions/` are (`functions.rs`), recorded on the coordinator, and
/// checked on every node ([`bodies`]).
pub(in crate::store::postgres) fn node_functions() -> FunctionFile {
    FunctionFile {
        name: NODE_FUNCTIONS,
        sql: NODE_FUNCTIONS_SQL.as_str(),
        generation: NODE_FUNCTIONS_GENERATION,
    }
}

/// Each function `sql` creates, by name, with its body (the text between its `$fn$` quotes:
/// what `pg_proc.prosrc` holds on every node once it is created), in name order.
pub(in crate::store::postgres) fn bodies(sql: &str) -> Vec<(String, String)> {
    const HEAD: &str = "CREATE OR REPLACE FUNCTION ";
    let mut out = Vec::new();
    let mut rest = sql;
    while let Some(at) = rest.find(HEAD) {
        rest = &rest[at + HEAD.len()..];
        let name = rest
            .split('(')
            .next()
            .unwrap_or_default()
            .trim()
            .to_string();
        let Some((_, body)) = rest.split_once("$fn$") else {
            break;
        };
        let Some((body, after)) = body.split_once("$fn$") else {
            break;
        };
        out.push((name, body.to_string()));
        rest = after;
    }
    out.sort();
    out
}

/// `sql` with every parameter `$n` renumbered `$(n + offset)`.
fn renumber(sql: &str, offset: usize) -> String {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let tail = &rest[at + 1..];
        let digits = tail.bytes().take_while(u8::is_ascii_digit).count();
        match tail[..digits].parse::<usize>() {
            Ok(n) => out.push_str(&format!("${}", n + offset)),
            Err(_) => out.push('$'),
        }
        rest = &tail[digits..];
    }
    out.push_str(rest);
    out
}

/// The first line of every [`node_take`].
pub(super) const NODE_TAKE_HEAD: &str =
    "-- tokenlease: refill and take on one Citus node (src/store/postgres/citus/sql.rs)\n";

/// The take of the keys of several shards of one node, as ONE statement run on that node: for each
/// shard (`(shard id, its table)`, in shard order) the plain store's many-key statement
/// (`sql/acquire_many.sql`, `lean.rs`'s `ACQUIRE_MANY`) on the shard's table, its parameters
/// `$(6i+1)`..`$(6i+6)` as `ACQUIRE_MANY`'s `$1`..`$6`; the first part's keys go through
/// `tokenlease_citus_hold` ([`functions`]) for all the statement's shards (their metadata locks and
/// placement check), before any row is written. Several shards are data-modifying `WITH` items read
/// one after the other by a `UNION ALL`: each shard's rows are locked in key order, and the shards
/// in shard order, so two such statements never wait on each other in a cycle. Plain SQL on the
/// node's own tables: no Citus planning, no coordinator, no distributed transaction.
pub(super) fn node_take(shards: &[(i64, &str)]) -> String {
    let ids: Vec<String> = shards.iter().map(|(id, _)| id.to_string()).collect();
    let hold = format!(
        "unnest(tokenlease_citus_hold(ARRAY[{}]::bigint[], $1::text[])",
        ids.join(", ")
    );
    let one = |i: usize, table: &str| -> String {
        let body = files::ACQUIRE_MANY.render([table]);
        let body = body
            .split_once('\n')
            .map_or(body.as_str(), |(_comment, rest)| rest)
            .to_string();
        // The first part takes its keys through the guard of every shard of the statement:
        // the parts run in order, so no row is written before it.
        let body = if i == 0 {
            body.replacen("unnest($1::text[]", &hold, 1)
        } else {
            body
        };
        renumber(&body, 6 * i)
    };
    let head = NODE_TAKE_HEAD;
    if let [(_, table)] = shards {
        return format!("{head}{}", one(0, table));
    }
    let items: Vec<String> = shards
        .iter()
        .enumerate()
        .map(|(i, (_, table))| format!("s{i} AS ({})", one(i, table)))
        .collect();
    let reads: Vec<String> = (0..shards.len())
        .map(|i| format!("SELECT * FROM s{i}"))
        .collect();
    format!(
        "{head}WITH {} {}",
        items.join(", "),
        reads.join(" UNION ALL ")
    )
}

/// The statements [`node_take`] made, by their shards: each made once and kept for the life of
/// the process, so that a session prepares it once (the store's prepared statements are keyed
/// by their `&'static str`). At most [`NODE_TAKES_KEPT`] sets of shards; past that a node's
/// part of a batch goes as one statement per shard, which are always kept (one per shard).
static NODE_TAKES: LazyLock<parking_lot::Mutex<NodeTakes>> = LazyLock::new(Default::default);

/// How many sets of several shards [`NODE_TAKES`] keeps.
const NODE_TAKES_KEPT: usize = 512;

#[derive(Default)]
struct NodeTakes {
    made: std::collections::HashMap<Vec<i64>, (&'static str, &'static [Type])>,
    sets: usize,
}

/// The statement and parameter types of [`node_take`] for `shards`, made once; `None` for a set
/// of several shards once [`NODE_TAKES_KEPT`] sets are kept.
pub(super) fn node_take_statement(
    shards: &[(i64, &str)],
) -> Option<(&'static str, &'static [Type])> {
    let ids: Vec<i64> = shards.iter().map(|s| s.0).collect();
    let mut takes = NODE_TAKES.lock();
    if let Some(made) = takes.made.get(&ids) {
        return Some(*made);
    }
    if ids.len() > 1 {
        if takes.sets >= NODE_TAKES_KEPT {
            return None;
        }
        takes.sets += 1;
    }
    let sql: &'static str = Box::leak(node_take(shards).into_boxed_str());
    let types: Vec<Type> = (0..shards.len())
        .flat_map(|_| super::super::lean::MANY_TYPES)
        .collect();
    let types: &'static [Type] = Box::leak(types.into_boxed_slice());
    takes.made.insert(ids, (sql, types));
    Some((sql, types))
}

/// Strict leases on one Citus worker (committed durably: `tokenlease_citus_take_held` sets
/// `synchronous_commit` itself, as the plain store's strict take does).
pub(super) static TAKE_HELD: LazyLock<String> = LazyLock::new(|| files::CITUS_TAKE_HELD.render([]));

/// Returns on one Citus worker.
pub(super) static GIVE_BACK: LazyLock<String> = LazyLock::new(|| files::CITUS_GIVE_BACK.render([]));

/// The types of [`GIVE_BACK`]'s parameters.
pub(super) const GIVE_BACK_TYPES: [Type; 8] = [
    Type::TEXT,
    Type::INT8_ARRAY,
    Type::TEXT_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
];

/// Idle cleanup on one Citus worker.
pub(super) static DELETE_IDLE: LazyLock<String> =
    LazyLock::new(|| files::CITUS_DELETE_IDLE.render([]));

/// The inspection of one key (`sql/inspect.sql`) on its shard's table `table`, made once per
/// table and kept: read on the node holding the shard, without Citus's planner (which cannot
/// route the generic plan a node's sessions make of a statement on the distributed table).
pub(super) fn inspect_shard(table: &str) -> &'static str {
    static MADE: LazyLock<parking_lot::Mutex<std::collections::HashMap<String, &'static str>>> =
        LazyLock::new(Default::default);
    let mut made = MADE.lock();
    if let Some(sql) = made.get(table) {
        return sql;
    }
    let sql = files::INSPECT.render([table]);
    let sql: &'static str = Box::leak(sql.into_boxed_str());
    made.insert(table.to_string(), sql);
    sql
}

/// The types of [`TAKE_HELD`]'s parameters.
pub(super) const TAKE_HELD_TYPES: [Type; 11] = [
    Type::TEXT,
    Type::TEXT_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
];

/// Every statement of the Citus path as the store makes it, by name, for a sample of shards:
/// the calls the store sends, the shard statements inside the node functions, the node takes
/// of one and of three shards, and the node functions' batch itself.
#[cfg(test)]
pub(in crate::store::postgres) fn statements_for_tests() -> Vec<(&'static str, String)> {
    let three = [
        (102008, "tokenlease_buckets_102008"),
        (102011, "tokenlease_buckets_102011"),
        (102040, "tokenlease_buckets_102040"),
    ];
    vec![
        (
            "citus/take_shard",
            files::ACQUIRE_MANY.render_escaped(["%1$s"], for_format),
        ),
        ("citus/held_insert_shard", HELD_INSERT_SHARD.to_string()),
        ("citus/held_update_shard", HELD_UPDATE_SHARD.clone()),
        ("citus/give_back_shard", GIVE_BACK_SHARD.clone()),
        ("citus/delete_idle_shard", DELETE_IDLE_SHARD.clone()),
        ("citus/node_take, one shard", node_take(&three[..1])),
        ("citus/node_take, three shards", node_take(&three)),
        (
            "citus/inspect_shard",
            inspect_shard("tokenlease_buckets_102008").to_string(),
        ),
        ("citus/take_held", TAKE_HELD.to_string()),
        ("citus/give_back", GIVE_BACK.to_string()),
        ("citus/delete_idle", DELETE_IDLE.to_string()),
        ("citus/node_functions", NODE_FUNCTIONS_SQL.clone()),
    ]
}
