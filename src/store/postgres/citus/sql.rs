//! The Citus path's SQL: the plain store's statements rewritten for one shard's tables, the
//! functions that run them on a worker (created and distributed by `distribute`), and the calls
//! the store sends.

use std::sync::LazyLock;

use tokio_postgres::types::Type;

use super::super::functions::FunctionFile;

use super::super::lean::{NOW_US, credit_set};

/// `s` for `format()`: every `%` doubled.
pub(super) fn for_format(s: &str) -> String {
    s.replace('%', "%%")
}

/// The refill-and-take of many keys on one shard: the plain store's many-key statement
/// (`lean.rs`'s `ACQUIRE_MANY`, the same text) on the shard's table `%1$s`, for `format()`. `$1`
/// text[] keys (all of them in this shard), `$2`..`$6` bigint[] capacities, rates, mins, wants,
/// steps. Like that statement it reaches the shard's rows only through the conflict check of
/// its insert (the primary key's index), so no plan of it scans the shard, whatever the size
/// the planner believes the shard has.
pub(super) static TAKE_SHARD: LazyLock<String> = LazyLock::new(|| {
    for_format(&super::super::lean::ACQUIRE_MANY).replace("tokenlease_buckets", "%1$s")
});

/// Strict leases on one shard, as migration 0007's `tokenlease_acquire_held` (step 1: insert
/// new keys full, lock existing ones, in key order). `$1` keys, `$2` capacities, `$3` rates,
/// `$4` the clock in microseconds, `$5` positions.
pub(super) const HELD_INSERT_SHARD: &str = "\
INSERT INTO %1$s AS b (key, tokens, frac, capacity, refill_per_second, updated_us, refilled) \
SELECT r.key, r.capacity, 0, r.capacity, r.rate, $4, r.capacity \
FROM unnest($1::text[], $2::bigint[], $3::bigint[]) WITH ORDINALITY AS r(key, capacity, rate, n) \
WHERE r.n = ANY ($5::integer[]) \
ORDER BY r.key \
ON CONFLICT (key) DO UPDATE SET tokens = b.tokens WHERE false";

/// Step 2 of `tokenlease_acquire_held` on one shard: refill and take, joined by key, in
/// tokens. `$1`..`$10` as the function's arguments, `$11` the clock in microseconds, `$12`
/// positions. The join is the planner's choice: `tokenlease_citus_take_held` runs it with
/// `enable_seqscan = off` (a `SET` clause, restored when the function returns), as the plain
/// store's `tokenlease_acquire_held` does, so a shard analysed while empty is still read by
/// its primary key.
pub(super) static HELD_UPDATE_SHARD: LazyLock<String> = LazyLock::new(|| {
    for_format(
        "UPDATE @buckets@ AS b \
    SET (tokens, frac, capacity, refill_per_second, updated_us, refilled, leases) = ( \
            SELECT floor((a.available - g.granted) * 1000000000)::bigint, \
                   (floor((a.available - g.granted) * 1000000000000000) % 1000000)::integer, \
                   req.capacity, req.rate, greatest(b.updated_us, $11), \
                   floor(a.available * 1000000000)::bigint, \
                   CASE WHEN s.plain THEN b.leases \
                        ELSE tokenlease_hold(b.leases, now(), req.holder, req.lease_id, \
                                             req.kept / 1000000000.0 + g.granted, \
                                             req.lifetime_us) \
                   END \
            FROM (SELECT req.holder IS NULL AND cardinality(b.leases) = 0 AS plain, \
                         tokenlease_amount(b.tokens, b.frac) AS tokens, \
                         req.capacity / 1000000000.0 AS capacity, \
                         req.rate / 1000000000.0 AS rate, \
                         timestamptz 'epoch' + b.updated_us * interval '1 microsecond' \
                             AS updated_at) AS s \
            CROSS JOIN LATERAL ( \
                SELECT CASE WHEN s.plain \
                            THEN tokenlease_refill(s.tokens, s.capacity, s.rate, s.updated_at, \
                                                   now()) \
                            WHEN req.holder IS NULL \
                            THEN tokenlease_refill_held(s.tokens, s.capacity, s.rate, \
                                                        s.updated_at, b.leases, now()) \
                            ELSE tokenlease_available_held(s.tokens, s.capacity, s.rate, \
                                                           s.updated_at, b.leases, now(), \
                                                           req.holder, \
                                                           req.kept / 1000000000.0) \
                       END AS available \
            ) AS a \
            CROSS JOIN LATERAL ( \
                SELECT tokenlease_grantable(a.available, req.min_take / 1000000000.0, \
                                            req.want / 1000000000.0, \
                                            req.step / 1000000000.0) AS granted \
            ) AS g \
        ) \
    FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::bigint[], $5::bigint[], $6::bigint[], \
                $7::bigint[], $8::bigint[], $9::bigint[], $10::bigint[]) WITH ORDINALITY \
        AS req(key, capacity, rate, min_take, want, step, holder, lease_id, kept, lifetime_us, n) \
    WHERE b.key = req.key AND req.n = ANY ($12::integer[]) \
    RETURNING b.key, b.tokens::bigint, b.frac::integer, (b.refilled - b.tokens)::bigint, \
              b.updated_us, $11::bigint",
    )
    .replace("@buckets@", "%1$s")
});

/// Returns on one shard, as the plain store's return statement (`lean.rs`), with the returns'
/// shard `%2$s` keyed by `(key, id)`. `$1`..`$7` as that statement's, `$8` positions (the
/// part's members, ascending).
///
/// Linear in the keys of the call: the part's requests are the positions `$8` joined once to
/// the arrays unnested with their ordinality (a hash or merge join, not a test of every row
/// against every position), the fresh returns are joined to them once (`todo`, materialised,
/// so that no later join reads a CTE once per row), and the rows are reached by key through
/// the primary key's index: `tokenlease_citus_give_back` runs it with `enable_seqscan = off`,
/// as `tokenlease_citus_take_held` does, so a shard the planner believes small is not read
/// whole. The rows are locked in key order first (`locked`, run once before the update by the
/// uncorrelated subquery of its `WHERE`), so two returns never wait on each other in a cycle.
pub(in crate::store::postgres) static GIVE_BACK_SHARD: LazyLock<String> = LazyLock::new(|| {
    let credit = credit_set();
    for_format(&format!(
        "WITH r AS MATERIALIZED ( \
             SELECT q.id, q.key, q.amount, q.capacity, q.rate, q.holder, q.lease_id, \
                    {NOW_US} AS now_us \
             FROM unnest($8::integer[]) AS m(n) \
             JOIN unnest($1::bigint[], $2::text[], $3::bigint[], $4::bigint[], $5::bigint[], \
                         $6::bigint[], $7::bigint[]) WITH ORDINALITY \
                 AS q(id, key, amount, capacity, rate, holder, lease_id, n) ON q.n = m.n), \
         fresh AS ( \
             INSERT INTO @returns@ AS t (id, key, amount) \
             SELECT r.id, r.key, r.amount FROM r \
             ORDER BY r.key, r.id \
             ON CONFLICT (key, id) DO NOTHING \
             RETURNING t.key, t.id), \
         todo AS MATERIALIZED ( \
             SELECT r.* FROM r JOIN fresh ON fresh.key = r.key AND fresh.id = r.id), \
         locked AS ( \
             SELECT l.key FROM @buckets@ AS l \
             WHERE l.key IN (SELECT todo.key FROM todo) \
             ORDER BY l.key FOR UPDATE) \
         UPDATE @buckets@ AS b \
         SET {credit} \
         FROM todo AS r \
         WHERE b.key = r.key AND (SELECT count(*) FROM locked) >= 0 \
         RETURNING b.key"
    ))
    .replace("@buckets@", "%1$s")
    .replace("@returns@", "%2$s")
});

/// Idle cleanup on one shard: `sql/delete_idle.sql` on the shard's tables (`%1$s` buckets,
/// `%2$s` returns). `$1` the limit.
pub(super) static DELETE_IDLE_SHARD: LazyLock<String> = LazyLock::new(|| {
    for_format(super::super::sql::DELETE_IDLE)
        .replace("tokenlease_buckets", "%1$s")
        .replace("tokenlease_returns", "%2$s")
});

/// `'text'` with `'` doubled, for the dollar-free SQL literals of the function bodies.
pub(super) fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The guard of every write on a shard table that bypasses Citus's executor: each of `shards`'
/// distribution metadata lock in share mode, the lock Citus's own executor takes on a shard it
/// modifies (`AcquireMetadataLocks`: `LockShardDistributionMetadata(shard, ShareLock)`), and
/// that a shard move or split blocking writes takes in exclusive mode on every node
/// (`BlockWritesToShardList`, through `lock_shard_metadata(7, ...)` on the workers) before it
/// copies the shard, holding it until it commits the new placement. Then the placements are
/// checked in a snapshot taken after the locks (each SQL statement of a volatile PL/pgSQL
/// function gets its own): a write waits while a move copies, and once the move has committed
/// it fails here (SQLSTATE 55000) instead of landing on the copy Citus no longer reads. A shard
/// a split has removed fails in `lock_shard_metadata` ("could not find valid entry for shard").
/// `shards` in shard order (the locks are taken in it). Returns `keys`, so that a statement can
/// take its keys through it: the keys' `unnest` then runs it before any row is written. One
/// call per statement, for all its shards: its cost is per statement, not per shard or key.
///
/// Written for the fewest executor runs, each a measured share of a node's CPU per statement
/// (docs/design/scale-out.md, "What it costs"): the locks are taken in the `IF`'s condition, a simple
/// expression PL/pgSQL evaluates without starting the executor (`PERFORM` is a query of its
/// own); the check reads the placements without an aggregate (`GET DIAGNOSTICS ... ROW_COUNT`
/// counts them: one row per shard and node, `pg_dist_placement`'s unique index on
/// `(shardid, groupid)`). The condition is a statement of its own, evaluated before the check
/// starts, so the check's snapshot is still taken after the locks.
/// `SECURITY DEFINER`, owned by the migrating role (the tables' owner): `lock_shard_metadata`
/// is for the shard's owner, and the store's role need not be; every name in it is
/// schema-qualified.
pub(super) const HOLD: &str = "\
CREATE OR REPLACE FUNCTION tokenlease_citus_hold(shards bigint[], keys text[])
RETURNS text[]
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $fn$
DECLARE
    placed bigint;
BEGIN
    -- lock_shard_metadata returns void, never NULL: the condition only takes the locks.
    IF pg_catalog.lock_shard_metadata(5, shards) IS NULL THEN
        NULL;
    END IF;
    PERFORM FROM pg_catalog.pg_dist_placement AS p
    WHERE p.shardid OPERATOR(pg_catalog.=) ANY (shards)
      AND p.groupid OPERATOR(pg_catalog.=)
          (SELECT l.groupid FROM pg_catalog.pg_dist_local_group AS l);
    GET DIAGNOSTICS placed = ROW_COUNT;
    IF placed OPERATOR(pg_catalog.<) pg_catalog.cardinality(shards) THEN
        RAISE EXCEPTION 'tokenlease: shard of % has no placement on this node', shards
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'the shard map changed (a move, a split, a rebalance): the store reads it again';
    END IF;
    RETURN keys;
END
$fn$";

/// The functions of the Citus path, in the order they are created; each is then made a
/// distributed function on its first argument (except the helper, which runs where its caller
/// runs).
pub(super) fn functions() -> Vec<(&'static str, String)> {
    let parts = "\
CREATE OR REPLACE FUNCTION tokenlease_citus_parts(keys text[])
RETURNS TABLE (shard bigint, buckets text, returns text, members integer[])
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT s.shard, min(s.k) AS probe, array_agg(s.n::integer ORDER BY s.n) AS members
        FROM (SELECT get_shard_id_for_distribution_column('tokenlease_buckets', u.k) AS shard,
                     u.k, u.n
              FROM unnest(keys) WITH ORDINALITY AS u(k, n)) AS s
        GROUP BY s.shard
        ORDER BY s.shard
    LOOP
        -- The shard's metadata lock (as Citus's executor takes it for a write), then its
        -- placement checked in a snapshot taken after it (tokenlease_citus_hold).
        PERFORM tokenlease_citus_hold(ARRAY[g.shard], NULL);
        shard := g.shard;
        buckets := shard_name('tokenlease_buckets'::regclass, g.shard);
        returns := shard_name('tokenlease_returns'::regclass,
                              get_shard_id_for_distribution_column('tokenlease_returns', g.probe));
        members := g.members;
        RETURN NEXT;
    END LOOP;
END
$fn$"
        .to_string();
    let held = format!(
        "\
CREATE OR REPLACE FUNCTION tokenlease_citus_take_held(
    route text, keys text[], capacities bigint[], rates bigint[], mins bigint[], wants bigint[],
    steps bigint[], holders bigint[], lease_ids bigint[], kept bigint[], lifetimes bigint[])
RETURNS TABLE (key text, tokens bigint, frac integer, granted bigint, updated_us bigint,
               now_us bigint)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $fn$
DECLARE
    p record;
    at_us bigint := (extract(epoch FROM now()) * 1000000)::bigint;
BEGIN
    -- A strict lease a crash forgot would let its holder spend tokens the bucket no longer
    -- counts: this transaction commits durably even on the store's asynchronous sessions.
    IF current_setting('synchronous_commit') = 'off' THEN
        PERFORM set_config('synchronous_commit', 'on', true);
    END IF;
    FOR p IN SELECT * FROM tokenlease_citus_parts(keys) LOOP
        EXECUTE format({}, p.buckets) USING keys, capacities, rates, at_us, p.members;
        RETURN QUERY EXECUTE format({}, p.buckets)
            USING keys, capacities, rates, mins, wants, steps, holders, lease_ids, kept,
                  lifetimes, at_us, p.members;
    END LOOP;
END
$fn$",
        literal(HELD_INSERT_SHARD),
        literal(&HELD_UPDATE_SHARD)
    );
    let give_back = format!(
        "\
CREATE OR REPLACE FUNCTION tokenlease_citus_give_back(
    route text, ids bigint[], keys text[], amounts bigint[], capacities bigint[], rates bigint[],
    holders bigint[], lease_ids bigint[])
RETURNS TABLE (key text)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $fn$
DECLARE
    p record;
BEGIN
    FOR p IN SELECT * FROM tokenlease_citus_parts(keys) LOOP
        RETURN QUERY EXECUTE format({}, p.buckets, p.returns)
            USING ids, keys, amounts, capacities, rates, holders, lease_ids, p.members;
    END LOOP;
END
$fn$",
        literal(&GIVE_BACK_SHARD)
    );
    let delete_idle = format!(
        "\
CREATE OR REPLACE FUNCTION tokenlease_citus_delete_idle(route text, max_rows bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    s record;
    deleted bigint := 0;
    n bigint;
BEGIN
    FOR s IN
        SELECT shard_name('tokenlease_buckets'::regclass, b.shardid) AS buckets,
               shard_name('tokenlease_returns'::regclass, r.shardid) AS returns
        FROM pg_dist_shard AS b
        JOIN pg_dist_shard AS r ON r.logicalrelid = 'tokenlease_returns'::regclass
                                AND r.shardminvalue = b.shardminvalue
        JOIN pg_dist_placement AS p ON p.shardid = b.shardid
        WHERE b.logicalrelid = 'tokenlease_buckets'::regclass
          AND p.groupid = (SELECT l.groupid FROM pg_dist_local_group AS l)
        ORDER BY b.shardid
    LOOP
        EXIT WHEN deleted >= max_rows;
        EXECUTE format({}, s.buckets, s.returns) USING max_rows - deleted;
        GET DIAGNOSTICS n = ROW_COUNT;
        deleted := deleted + n;
    END LOOP;
    RETURN deleted;
END
$fn$",
        literal(&DELETE_IDLE_SHARD)
    );
    let take_limits = format!(
        "\
CREATE OR REPLACE FUNCTION tokenlease_citus_take_limits(
    route text, keys text[], capacities bigint[], rates bigint[], mins bigint[], wants bigint[],
    steps bigint[], more_caps bigint[], more_rates bigint[], firsts integer[], counts integer[])
RETURNS TABLE (key text, tokens bigint, frac integer, granted bigint, updated_us bigint,
               now_us bigint, more_tokens bigint[], more_frac integer[])
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    p record;
BEGIN
    FOR p IN SELECT * FROM tokenlease_citus_parts(keys) LOOP
        RETURN QUERY EXECUTE format({}, p.buckets)
            USING keys, capacities, rates, mins, wants, steps, more_caps, more_rates, firsts,
                  counts, p.members;
    END LOOP;
END
$fn$",
        literal(&for_format(&super::super::limits::acquire_limits(true)).replace("%%1$s", "%1$s"))
    );
    let give_back_limits = format!(
        "\
CREATE OR REPLACE FUNCTION tokenlease_citus_give_back_limits(
    route text, ids bigint[], keys text[], amounts bigint[], capacities bigint[], rates bigint[],
    more_caps bigint[], more_rates bigint[], firsts integer[], counts integer[])
RETURNS TABLE (key text)
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    p record;
BEGIN
    FOR p IN SELECT * FROM tokenlease_citus_parts(keys) LOOP
        RETURN QUERY EXECUTE format({}, p.buckets, p.returns)
            USING ids, keys, amounts, capacities, rates, more_caps, more_rates, firsts, counts,
                  p.members;
    END LOOP;
END
$fn$",
        literal(
            &for_format(&super::super::limits::give_back_limits(true))
                .replace("%%1$s", "%1$s")
                .replace("%%2$s", "%2$s")
        )
    );
    vec![
        ("tokenlease_citus_hold(bigint[], text[])", HOLD.to_string()),
        ("tokenlease_citus_parts(text[])", parts),
        (
            "tokenlease_citus_take_held(text, text[], bigint[], bigint[], bigint[], bigint[], \
             bigint[], bigint[], bigint[], bigint[], bigint[])",
            held,
        ),
        (
            "tokenlease_citus_give_back(text, bigint[], text[], bigint[], bigint[], bigint[], \
             bigint[], bigint[])",
            give_back,
        ),
        ("tokenlease_citus_delete_idle(text, bigint)", delete_idle),
        (
            "tokenlease_citus_take_limits(text, text[], bigint[], bigint[], bigint[], bigint[], \
             bigint[], bigint[], bigint[], integer[], integer[])",
            take_limits,
        ),
        (
            "tokenlease_citus_give_back_limits(text, bigint[], text[], bigint[], bigint[], \
             bigint[], bigint[], bigint[], integer[], integer[])",
            give_back_limits,
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
        sql.push_str(&body);
        sql.push_str(";\n");
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

/// The take of the keys of several shards of one node, as ONE statement run on that node: for
/// each shard (`(shard id, its table)`, in shard order) the plain store's many-key statement
/// (`lean.rs`'s `ACQUIRE_MANY`, [`TAKE_SHARD`]) on the shard's table, its parameters
/// `$(6i+1)`..`$(6i+6)` as `ACQUIRE_MANY`'s `$1`..`$6`; the first part's keys go through
/// [`HOLD`] for all the statement's shards (their metadata locks and placement check), before
/// any row is written. Several shards are
/// data-modifying `WITH` items read one after the other by a `UNION ALL`: each shard's rows are
/// locked in key order, and the shards in shard order, so two such statements never wait on
/// each other in a cycle. Plain SQL on the node's own tables: no Citus planning, no
/// coordinator, no distributed transaction.
pub(super) fn node_take(shards: &[(i64, &str)]) -> String {
    let ids: Vec<String> = shards.iter().map(|(id, _)| id.to_string()).collect();
    let hold = format!(
        "unnest(tokenlease_citus_hold(ARRAY[{}]::bigint[], $1::text[])",
        ids.join(", ")
    );
    let one = |i: usize, table: &str| -> String {
        let body = TAKE_SHARD.replace("%1$s", table).replace("%%", "%");
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
pub(super) const TAKE_HELD: &str = "\
-- tokenlease: refill and take with strict leases on one Citus worker (src/store/postgres/citus/sql.rs)
SELECT key, tokens, frac, granted, updated_us, now_us
FROM tokenlease_citus_take_held($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";

/// Returns on one Citus worker.
pub(super) const GIVE_BACK: &str = "\
-- tokenlease: return of unused lease tokens on one Citus worker (src/store/postgres/citus/sql.rs)
SELECT key FROM tokenlease_citus_give_back($1, $2, $3, $4, $5, $6, $7, $8)";

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
pub(super) const DELETE_IDLE: &str = "\
-- tokenlease: idle cleanup on one Citus worker (src/store/postgres/citus/sql.rs)
SELECT tokenlease_citus_delete_idle($1, $2)";

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
    let sql =
        super::super::sql::INSPECT.replace("FROM tokenlease_buckets\n", &format!("FROM {table}\n"));
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
