//! The store on a Citus cluster: the tables distributed by key, and every call routed to one
//! worker.
//!
//! # Distribution
//!
//! [`distribute`] runs after the file migrations when the database has the `citus` extension
//! (a coordinator): it makes `tokenlease_buckets` a hash-distributed table on `key` and
//! `tokenlease_returns` one co-located with it (its primary key becomes `(key, id)`: Citus
//! requires the distribution column in every unique constraint; a return id is unique per key,
//! which is all a retried return needs), then creates the functions below and marks each a
//! *distributed function* whose first argument is the distribution argument, co-located with
//! `tokenlease_buckets`. A Citus version outside [`SUPPORTED_CITUS`] is refused with
//! [`MigrateError::UnsupportedCitus`]. On plain PostgreSQL nothing here runs.
//!
//! # Routing
//!
//! The store reads the shard map (`pg_dist_shard` and `pg_dist_placement`) when it connects,
//! and hashes each key as Citus does ([`hashtext`]: PostgreSQL's `hashtext`, Bob Jenkins's
//! lookup3, which `worker_hash(text)` returns) to find its shard and the worker holding it. A
//! batch is split by worker, and each worker's part is one call of a distributed function
//! whose first argument (the *route*) is one of that part's keys: the coordinator sees the
//! distribution argument, and pushes the whole call down to the worker that holds the route's
//! shard, where it runs as one local transaction. No call opens a distributed transaction, so
//! no two-phase commit (`pg_dist_transaction` stays empty).
//!
//! On the worker, the function groups its keys by shard (`get_shard_id_for_distribution_column`),
//! checks that each shard has its placement on this node (a stale map, say after a rebalance,
//! fails the call instead of writing to a copy Citus no longer reads), and runs, shard by shard
//! in shard order, the same refill-and-take as the plain store's statements on the shard's own
//! table (`tokenlease_buckets_<shardid>`): plain PostgreSQL with no Citus planning in the way
//! (Citus cannot plan the many-key statement on the distributed table as a one-shard query: it
//! splits its CTEs into sub-plans and broadcasts intermediate results). A take goes through the
//! shard's own function (`tokenlease_citus_take_<shardid>`, [`shard_take_function`]), whose
//! statement the worker session plans once; strict leases, returns and a shard without its
//! function (made after the last migrate) go through `EXECUTE`, planned on every call. The
//! rows of each shard are locked in key order, and shards are taken in shard order, so two
//! calls never wait on each other in a cycle. Each worker's calls go through a pool of their
//! own ([`Citus`]), so a worker that stalls holds only its own connections.
//!
//! Idle cleanup runs the same way, one call per worker, on that worker's shards.

use std::collections::HashMap;
use std::sync::LazyLock;

use tokio_postgres::types::Type;

use tokio_postgres::types::ToSql;

use super::lean::{NOW_US, available, refilled_frac};
use super::migrate::MigrateError;
use super::{Holds, PostgresStore, Takes, file_rows, nanos_down, shape};
use crate::store::{AcquireRequest, Acquired, GiveBack, StoreError, join_all};

/// The Citus versions the store runs on: from 12.0 up to (not including) 14.0. Tested on 13.2.
pub const SUPPORTED_CITUS: ((u32, u32), (u32, u32)) = ((12, 0), (14, 0));

/// PostgreSQL's `hashtext` for a deterministic collation: `hash_bytes` (Bob Jenkins's lookup3,
/// `hashfn.c`) over the key's UTF-8 bytes, as a signed 32-bit value. Citus hashes a text
/// distribution column with it (`worker_hash(text)`), and a shard holds the keys whose hash is
/// within its `[shardminvalue, shardmaxvalue]`.
pub fn hashtext(key: &[u8]) -> i32 {
    #[inline]
    fn mix(a: &mut u32, b: &mut u32, c: &mut u32) {
        *a = a.wrapping_sub(*c);
        *a ^= c.rotate_left(4);
        *c = c.wrapping_add(*b);
        *b = b.wrapping_sub(*a);
        *b ^= a.rotate_left(6);
        *a = a.wrapping_add(*c);
        *c = c.wrapping_sub(*b);
        *c ^= b.rotate_left(8);
        *b = b.wrapping_add(*a);
        *a = a.wrapping_sub(*c);
        *a ^= c.rotate_left(16);
        *c = c.wrapping_add(*b);
        *b = b.wrapping_sub(*a);
        *b ^= a.rotate_left(19);
        *a = a.wrapping_add(*c);
        *c = c.wrapping_sub(*b);
        *c ^= b.rotate_left(4);
        *b = b.wrapping_add(*a);
    }
    #[inline]
    fn finish(a: &mut u32, b: &mut u32, c: &mut u32) {
        *c ^= *b;
        *c = c.wrapping_sub(b.rotate_left(14));
        *a ^= *c;
        *a = a.wrapping_sub(c.rotate_left(11));
        *b ^= *a;
        *b = b.wrapping_sub(a.rotate_left(25));
        *c ^= *b;
        *c = c.wrapping_sub(b.rotate_left(16));
        *a ^= *c;
        *a = a.wrapping_sub(c.rotate_left(4));
        *b ^= *a;
        *b = b.wrapping_sub(a.rotate_left(14));
        *c ^= *b;
        *c = c.wrapping_sub(b.rotate_left(24));
    }
    let word = |bytes: &[u8]| -> u32 {
        // Little-endian, as PostgreSQL reads the words on the platforms it runs on here; the
        // result is the same for the aligned and unaligned paths of hashfn.c.
        let mut w = 0u32;
        for (i, &b) in bytes.iter().enumerate() {
            w |= u32::from(b) << (8 * i);
        }
        w
    };
    let len = u32::try_from(key.len()).unwrap_or(u32::MAX);
    let init = 0x9e37_79b9u32.wrapping_add(len).wrapping_add(3_923_095);
    let (mut a, mut b, mut c) = (init, init, init);
    let mut rest = key;
    while rest.len() >= 12 {
        a = a.wrapping_add(word(&rest[0..4]));
        b = b.wrapping_add(word(&rest[4..8]));
        c = c.wrapping_add(word(&rest[8..12]));
        mix(&mut a, &mut b, &mut c);
        rest = &rest[12..];
    }
    // The last 0..11 bytes: a takes bytes 0-3, b 4-7, c 8-10 shifted up by a byte (its lowest
    // byte is reserved for the length in lookup3).
    let n = rest.len();
    a = a.wrapping_add(word(&rest[..n.min(4)]));
    if n > 4 {
        b = b.wrapping_add(word(&rest[4..n.min(8)]));
    }
    if n > 8 {
        c = c.wrapping_add(word(&rest[8..n]) << 8);
    }
    finish(&mut a, &mut b, &mut c);
    c as i32
}

/// One shard of `tokenlease_buckets`: its hash range and the worker (index into
/// [`ShardMap::nodes`]) holding its placement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Shard {
    pub(crate) id: i64,
    pub(crate) min: i32,
    pub(crate) max: i32,
    pub(crate) node: usize,
}

/// Where each key of a distributed `tokenlease_buckets` lives, read when the store connects.
#[derive(Clone, Debug)]
pub(crate) struct ShardMap {
    /// By `min`, covering the whole 32-bit hash range.
    shards: Vec<Shard>,
    /// The workers holding shards, as `host:port`, in Citus's group order.
    nodes: Vec<String>,
    /// For each node, a key whose shard lives there: the route of calls that name no key
    /// (idle cleanup).
    probes: Vec<String>,
}

impl ShardMap {
    /// The shard holding `key`.
    pub(crate) fn shard_of(&self, key: &str) -> &Shard {
        let h = hashtext(key.as_bytes());
        let i = self.shards.partition_point(|s| s.min <= h);
        &self.shards[i.saturating_sub(1)]
    }

    /// The worker (index into the node list) holding `key`'s shard.
    pub(crate) fn node_of(&self, key: &str) -> usize {
        self.shard_of(key).node
    }

    /// The workers, as `host:port`.
    pub(crate) fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// A key whose shard is on `node`.
    pub(crate) fn probe(&self, node: usize) -> &str {
        &self.probes[node]
    }

    fn new(shards: Vec<Shard>, nodes: Vec<String>) -> Result<Self, String> {
        if shards.is_empty() {
            return Err("tokenlease_buckets has no shards".into());
        }
        if shards[0].min != i32::MIN || shards.last().map(|s| s.max) != Some(i32::MAX) {
            return Err("the shards of tokenlease_buckets do not cover the hash range".into());
        }
        for pair in shards.windows(2) {
            if i64::from(pair[0].max) + 1 != i64::from(pair[1].min) {
                return Err(format!(
                    "the shards of tokenlease_buckets leave a gap or overlap after shard {}",
                    pair[0].id
                ));
            }
        }
        let mut map = ShardMap {
            shards,
            nodes,
            probes: Vec::new(),
        };
        let mut probes: Vec<Option<String>> = vec![None; map.nodes.len()];
        for i in 0..1_000_000u32 {
            if probes.iter().all(Option::is_some) {
                break;
            }
            let key = format!("tokenlease-probe-{i}");
            let node = map.node_of(&key);
            if probes[node].is_none() {
                probes[node] = Some(key);
            }
        }
        map.probes = probes
            .into_iter()
            .enumerate()
            .map(|(node, p)| p.unwrap_or_else(|| format!("tokenlease-no-probe-{node}")))
            .collect();
        Ok(map)
    }
}

/// Whether `client`'s database is a Citus coordinator with `tokenlease_buckets` distributed,
/// and if so its shard map. Checks [`hashtext`] against the server's `worker_hash` first: a
/// key hashed differently (a non-deterministic collation, say) would be sent to the wrong
/// worker, so a mismatch is an error.
pub(super) async fn shard_map(
    client: &tokio_postgres::Client,
) -> Result<Option<ShardMap>, StoreError> {
    let distributed = client
        .query_typed(
            "SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus') \
               AND to_regclass('pg_dist_partition') IS NOT NULL",
            &[],
        )
        .await?;
    if !distributed.first().is_some_and(|r| r.get::<_, bool>(0)) {
        return Ok(None);
    }
    let rows = client
        .query_typed(
            "SELECT EXISTS (SELECT FROM pg_dist_partition \
                            WHERE logicalrelid = to_regclass('tokenlease_buckets'))",
            &[],
        )
        .await?;
    if !rows.first().is_some_and(|r| r.get::<_, bool>(0)) {
        return Ok(None);
    }
    let rows = client
        .query_typed(
            "SELECT s.shardid, s.shardminvalue::integer, s.shardmaxvalue::integer, \
                    n.groupid, n.nodename || ':' || n.nodeport \
             FROM pg_dist_shard AS s \
             JOIN pg_dist_placement AS p ON p.shardid = s.shardid \
             JOIN pg_dist_node AS n ON n.groupid = p.groupid AND n.noderole = 'primary' \
             WHERE s.logicalrelid = 'tokenlease_buckets'::regclass \
             ORDER BY s.shardminvalue::integer",
            &[],
        )
        .await?;
    let mut groups: Vec<i32> = Vec::new();
    let mut nodes: Vec<String> = Vec::new();
    let mut shards = Vec::with_capacity(rows.len());
    let mut by_group: HashMap<i32, usize> = HashMap::new();
    let mut group_rows: Vec<(i64, i32, i32, i32, String)> = Vec::with_capacity(rows.len());
    for row in &rows {
        group_rows.push((
            row.try_get(0)?,
            row.try_get(1)?,
            row.try_get(2)?,
            row.try_get(3)?,
            row.try_get(4)?,
        ));
    }
    let mut sorted_groups: Vec<(i32, String)> = group_rows
        .iter()
        .map(|(_, _, _, g, name)| (*g, name.clone()))
        .collect();
    sorted_groups.sort();
    sorted_groups.dedup();
    for (group, name) in sorted_groups {
        by_group.insert(group, nodes.len());
        groups.push(group);
        nodes.push(name);
    }
    for (id, min, max, group, _) in group_rows {
        shards.push(Shard {
            id,
            min,
            max,
            node: by_group[&group],
        });
    }
    let map = ShardMap::new(shards, nodes).map_err(StoreError::Protocol)?;
    // The client's hash must be the server's.
    let probes: Vec<String> = (0..64)
        .map(|i| format!("tokenlease-hash-check-{i}"))
        .collect();
    let rows = client
        .query_typed(
            "SELECT k, worker_hash(k) FROM unnest($1::text[]) AS k",
            &[(&probes, Type::TEXT_ARRAY)],
        )
        .await?;
    for row in rows {
        let key: String = row.try_get(0)?;
        let server: i32 = row.try_get(1)?;
        if hashtext(key.as_bytes()) != server {
            return Err(StoreError::Protocol(format!(
                "Citus hashes key {key:?} to {server}, this client to {}: the key column's \
                 collation or hash function is not PostgreSQL's default one",
                hashtext(key.as_bytes())
            )));
        }
    }
    Ok(Some(map))
}

/// The store's Citus state: the shard map, and for each worker a store of its own (a pool of
/// its own to the coordinator) that sends that worker's calls, so that a worker that stalls
/// holds only its own pool's connections.
#[derive(Debug)]
pub(super) struct Citus {
    pub(super) map: ShardMap,
    pub(super) lanes: Vec<PostgresStore>,
}

impl Citus {
    /// [`Store::acquire_each`](crate::store::Store::acquire_each) on Citus: the batch split by
    /// worker, one call of `tokenlease_citus_take` per worker (then `tokenlease_citus_take_held`
    /// for what it left: strict leases, rows that hold them), all the workers' calls side by side.
    /// A worker's error goes to its keys only.
    pub(super) async fn acquire_each(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Vec<Result<Acquired, StoreError>> {
        let groups = by_node(&self.map, requests.iter().map(|r| r.key));
        let calls = groups.iter().map(|(node, group)| {
            let lane = &self.lanes[*node];
            let deadline = tokio::time::Instant::now() + lane.call_timeout;
            lane.citus_take(deadline, requests, group)
        });
        let mut out: Vec<Option<Result<Acquired, StoreError>>> = vec![None; requests.len()];
        for ((_, group), result) in groups.iter().zip(join_all(calls).await) {
            match result {
                Ok(answers) => {
                    for (&i, answer) in group.iter().zip(answers) {
                        out[i] = Some(Ok(answer));
                    }
                }
                Err(err) => {
                    for &i in group {
                        out[i] = Some(Err(err.clone()));
                    }
                }
            }
        }
        out.into_iter()
            .zip(requests)
            .map(|(got, request)| {
                got.unwrap_or_else(|| {
                    Err(StoreError::Protocol(format!(
                        "no row returned for key {:?}",
                        request.key
                    )))
                })
            })
            .collect()
    }

    /// [`Store::give_back_each`](crate::store::Store::give_back_each) on Citus: one call of
    /// `tokenlease_citus_give_back` per worker, each through its worker's pool; how many each
    /// return credited (0 or 1).
    pub(super) async fn give_back_each(
        &self,
        returns: &[GiveBack<'_>],
    ) -> Vec<Result<u64, StoreError>> {
        let groups = by_node(&self.map, returns.iter().map(|r| r.key));
        let calls = groups
            .iter()
            .map(|(node, group)| self.lanes[*node].citus_give_back(returns, group));
        let mut out: Vec<Result<u64, StoreError>> = (0..returns.len()).map(|_| Ok(0)).collect();
        for ((_, group), result) in groups.iter().zip(join_all(calls).await) {
            for &i in group {
                out[i] = match &result {
                    Ok(credited) => Ok(u64::from(credited.contains(returns[i].key))),
                    Err(err) => Err(err.clone()),
                };
            }
        }
        out
    }

    /// [`Store::delete_idle`](crate::store::Store::delete_idle) on Citus: one call of
    /// `tokenlease_citus_delete_idle` per worker, in turn, until `limit` rows are gone.
    pub(super) async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        let mut deleted = 0u64;
        for (node, lane) in self.lanes.iter().enumerate() {
            let left = i64::from(limit) - i64::try_from(deleted).unwrap_or(i64::MAX);
            if left <= 0 {
                break;
            }
            let route = self.map.probe(node);
            let rows = lane
                .query(DELETE_IDLE, &[(&route, Type::TEXT), (&left, Type::INT8)])
                .await?;
            let n: i64 = rows.first().map(|r| r.try_get(0)).transpose()?.unwrap_or(0);
            deleted += u64::try_from(n).unwrap_or(0);
        }
        Ok(deleted)
    }
}

impl PostgresStore {
    /// One worker's part of a batch: `group` indexes `requests`, every key on one worker.
    async fn citus_take(
        &self,
        deadline: tokio::time::Instant,
        requests: &[AcquireRequest<'_>],
        group: &[usize],
    ) -> Result<Vec<Acquired>, StoreError> {
        let mut out: Vec<Option<Acquired>> = vec![None; requests.len()];
        let mut pending = group.to_vec();
        if !group.iter().any(|&i| requests[i].hold.is_some()) {
            let t = Takes::new(requests, &pending)?;
            let route = t.keys[0];
            let mut params: Vec<(&(dyn ToSql + Sync), Type)> = vec![(&route, Type::TEXT)];
            params.extend(t.params());
            let rows = self.query_by(deadline, TAKE, &params).await?;
            file_rows(&rows, requests, &mut pending, &mut out)?;
        }
        if !pending.is_empty() {
            let t = Takes::new(requests, &pending)?;
            let route = t.keys[0];
            let holds = Holds::new(requests, &pending);
            let mut params: Vec<(&(dyn ToSql + Sync), Type)> = vec![(&route, Type::TEXT)];
            params.extend(t.params());
            params.extend(holds.params());
            let rows = self.query_by(deadline, TAKE_HELD, &params).await?;
            file_rows(&rows, requests, &mut pending, &mut out)?;
        }
        group
            .iter()
            .map(|&i| {
                out[i].take().ok_or_else(|| {
                    StoreError::Protocol(format!("no row returned for key {:?}", requests[i].key))
                })
            })
            .collect()
    }

    /// One worker's returns; the keys credited.
    async fn citus_give_back(
        &self,
        returns: &[GiveBack<'_>],
        group: &[usize],
    ) -> Result<std::collections::HashSet<String>, StoreError> {
        let route = returns[group[0]].key;
        let ids: Vec<i64> = group.iter().map(|&i| returns[i].id).collect();
        let keys: Vec<&str> = group.iter().map(|&i| returns[i].key).collect();
        let amounts: Vec<i64> = group
            .iter()
            .map(|&i| nanos_down(returns[i].amount))
            .collect();
        let mut capacities = Vec::with_capacity(group.len());
        let mut rates = Vec::with_capacity(group.len());
        for &i in group {
            let (capacity, rate) = shape(returns[i].key, &returns[i].bucket)?;
            capacities.push(capacity);
            rates.push(rate);
        }
        let holders: Vec<Option<i64>> = group
            .iter()
            .map(|&i| returns[i].lease.map(|l| l.holder))
            .collect();
        let lease_ids: Vec<Option<i64>> = group
            .iter()
            .map(|&i| returns[i].lease.map(|l| l.lease_id))
            .collect();
        let values: [&(dyn ToSql + Sync); 8] = [
            &route,
            &ids,
            &keys,
            &amounts,
            &capacities,
            &rates,
            &holders,
            &lease_ids,
        ];
        let params: Vec<(&(dyn ToSql + Sync), Type)> =
            values.into_iter().zip(GIVE_BACK_TYPES).collect();
        let rows = self.query(GIVE_BACK, &params).await?;
        rows.iter()
            .map(|row| row.try_get::<_, String>(0).map_err(StoreError::from))
            .collect()
    }
}

/// The indices of `keys` by worker, workers without keys left out.
fn by_node<'a>(map: &ShardMap, keys: impl Iterator<Item = &'a str>) -> Vec<(usize, Vec<usize>)> {
    let mut groups: Vec<(usize, Vec<usize>)> =
        (0..map.nodes().len()).map(|n| (n, Vec::new())).collect();
    for (i, key) in keys.enumerate() {
        groups[map.node_of(key)].1.push(i);
    }
    groups.retain(|(_, g)| !g.is_empty());
    groups
}

/// `s` for `format()`: every `%` doubled.
fn for_format(s: &str) -> String {
    s.replace('%', "%%")
}

/// The refill-and-take of many keys on one shard: the plain store's many-key statement
/// (`lean.rs`'s `ACQUIRE_MANY`, the same text) on the shard's table `%1$s`, for `format()`. `$1`
/// text[] keys (all of them in this shard), `$2`..`$6` bigint[] capacities, rates, mins, wants,
/// steps.
static TAKE_SHARD: LazyLock<String> =
    LazyLock::new(|| for_format(&super::lean::ACQUIRE_MANY).replace("tokenlease_buckets", "%1$s"));

/// Strict leases on one shard, as migration 0007's `tokenlease_acquire_held` (step 1: insert
/// new keys full, lock existing ones, in key order). `$1` keys, `$2` capacities, `$3` rates,
/// `$4` the clock in microseconds, `$5` positions.
const HELD_INSERT_SHARD: &str = "\
INSERT INTO %1$s AS b (key, tokens, frac, capacity, refill_per_second, updated_us, refilled) \
SELECT r.key, r.capacity, 0, r.capacity, r.rate, $4, r.capacity \
FROM unnest($1::text[], $2::bigint[], $3::bigint[]) WITH ORDINALITY AS r(key, capacity, rate, n) \
WHERE r.n = ANY ($5::integer[]) \
ORDER BY r.key \
ON CONFLICT (key) DO UPDATE SET tokens = b.tokens WHERE false";

/// Step 2 of `tokenlease_acquire_held` on one shard: refill and take, joined by key, in
/// tokens. `$1`..`$10` as the function's arguments, `$11` the clock in microseconds, `$12`
/// positions.
static HELD_UPDATE_SHARD: LazyLock<String> = LazyLock::new(|| {
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
/// shard `%2$s` keyed by `(key, id)`. `$1`..`$7` as that statement's, `$8` positions.
static GIVE_BACK_SHARD: LazyLock<String> = LazyLock::new(|| {
    let avail = available("b", "r.capacity", "r.rate", "r.now_us");
    let credited_raw = format!("({avail}) + r.amount");
    let frac = refilled_frac("b", "r.capacity", "r.rate", "r.now_us");
    let leases = "CASE WHEN r.holder IS NULL THEN tokenlease_hold(b.leases, now(), NULL, NULL, 0, 0) \
                  ELSE tokenlease_release(b.leases, now(), r.holder, r.lease_id) END";
    let held = format!(
        "least(greatest(0, r.capacity / 1000000000.0 - tokenlease_outstanding({leases}, now())), \
               tokenlease_refill_held(tokenlease_amount(b.tokens, b.frac), \
                                      r.capacity / 1000000000.0, r.rate / 1000000000.0, \
                                      timestamptz 'epoch' + b.updated_us * interval '1 microsecond', \
                                      b.leases, now()) \
               + CASE WHEN r.holder IS NULL THEN r.amount / 1000000000.0 \
                      ELSE tokenlease_release_credit(b.leases, now(), r.holder, r.lease_id, \
                                                     r.amount / 1000000000.0) END)"
    );
    for_format(&format!(
        "WITH r AS ( \
             SELECT q.id, q.key, q.amount, q.capacity, q.rate, q.holder, q.lease_id, \
                    {NOW_US} AS now_us \
             FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::bigint[], $5::bigint[], \
                         $6::bigint[], $7::bigint[]) WITH ORDINALITY \
                 AS q(id, key, amount, capacity, rate, holder, lease_id, n) \
             WHERE q.n = ANY ($8::integer[]) \
             OFFSET 0), \
         fresh AS ( \
             INSERT INTO @returns@ AS t (id, key, amount) \
             SELECT r.id, r.key, r.amount FROM r \
             ORDER BY r.key, r.id \
             ON CONFLICT (key, id) DO NOTHING \
             RETURNING t.key, t.id), \
         locked AS ( \
             SELECT l.key FROM @buckets@ AS l \
             WHERE l.key IN (SELECT r.key FROM r) \
             ORDER BY l.key FOR UPDATE) \
         UPDATE @buckets@ AS b \
         SET tokens = CASE WHEN cardinality(b.leases) = 0 \
                           THEN least(r.capacity, {credited_raw}) \
                           ELSE floor({held} * 1000000000)::bigint END, \
             frac = CASE WHEN cardinality(b.leases) = 0 \
                         THEN CASE WHEN {credited_raw} >= r.capacity THEN 0 ELSE {frac} END \
                         ELSE (floor({held} * 1000000000000000) % 1000000)::integer END, \
             capacity = r.capacity, refill_per_second = r.rate, \
             updated_us = greatest(b.updated_us, r.now_us), refilled = 0, \
             leases = CASE WHEN cardinality(b.leases) = 0 THEN b.leases ELSE {leases} END \
         FROM r \
         WHERE b.key = r.key AND b.key IN (SELECT locked.key FROM locked) \
           AND (r.key, r.id) IN (SELECT fresh.key, fresh.id FROM fresh) \
         RETURNING b.key"
    ))
    .replace("@buckets@", "%1$s")
    .replace("@returns@", "%2$s")
});

/// Idle cleanup on one shard: `sql/delete_idle.sql` on the shard's tables (`%1$s` buckets,
/// `%2$s` returns). `$1` the limit.
static DELETE_IDLE_SHARD: LazyLock<String> = LazyLock::new(|| {
    for_format(super::sql::DELETE_IDLE)
        .replace("tokenlease_buckets", "%1$s")
        .replace("tokenlease_returns", "%2$s")
});

/// `'text'` with `'` doubled, for the dollar-free SQL literals of the function bodies.
fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The functions of the Citus path, in the order they are created; each is then made a
/// distributed function on its first argument (except the helper, which runs where its caller
/// runs).
fn functions() -> Vec<(&'static str, String)> {
    let parts = "\
CREATE OR REPLACE FUNCTION tokenlease_citus_parts(keys text[])
RETURNS TABLE (shard bigint, buckets text, returns text, members integer[])
LANGUAGE plpgsql STABLE
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
        IF NOT EXISTS (SELECT FROM pg_dist_placement AS p
                       WHERE p.shardid = g.shard
                         AND p.groupid = (SELECT l.groupid FROM pg_dist_local_group AS l)) THEN
            RAISE EXCEPTION 'tokenlease: shard % (key %) has no placement on this node', g.shard,
                g.probe USING ERRCODE = 'object_not_in_prerequisite_state',
                HINT = 'the shard map changed (a rebalance?): the store reads it again';
        END IF;
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
    let take = format!(
        "\
CREATE OR REPLACE FUNCTION tokenlease_citus_take(
    route text, keys text[], capacities bigint[], rates bigint[], mins bigint[], wants bigint[],
    steps bigint[])
RETURNS TABLE (key text, tokens tokenlease_nanotokens, frac tokenlease_femtotokens,
               granted bigint, updated_us bigint, now_us bigint)
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    p record;
    k text[];
    c bigint[];
    r bigint[];
    lo bigint[];
    hi bigint[];
    st bigint[];
BEGIN
    FOR p IN SELECT * FROM tokenlease_citus_parts(keys) LOOP
        -- This shard's keys and their takes.
        IF cardinality(p.members) = cardinality(keys) THEN
            k := keys; c := capacities; r := rates; lo := mins; hi := wants; st := steps;
        ELSE
            k := ARRAY(SELECT keys[i] FROM unnest(p.members) AS i);
            c := ARRAY(SELECT capacities[i] FROM unnest(p.members) AS i);
            r := ARRAY(SELECT rates[i] FROM unnest(p.members) AS i);
            lo := ARRAY(SELECT mins[i] FROM unnest(p.members) AS i);
            hi := ARRAY(SELECT wants[i] FROM unnest(p.members) AS i);
            st := ARRAY(SELECT steps[i] FROM unnest(p.members) AS i);
        END IF;
        IF to_regprocedure(format('tokenlease_citus_take_%s(text[], bigint[], bigint[], '
                                  'bigint[], bigint[], bigint[])', p.shard))
           IS NOT NULL THEN
            -- The shard's own function: its statement planned once per session.
            RETURN QUERY EXECUTE format('SELECT * FROM tokenlease_citus_take_%s($1, $2, $3, '
                                        '$4, $5, $6)', p.shard)
                USING k, c, r, lo, hi, st;
        ELSE
            -- A shard newer than the last migrate (a split): planned on every call.
            RETURN QUERY EXECUTE format({}, p.buckets) USING k, c, r, lo, hi, st;
        END IF;
    END LOOP;
END
$fn$",
        literal(&TAKE_SHARD)
    );
    let held = format!(
        "\
CREATE OR REPLACE FUNCTION tokenlease_citus_take_held(
    route text, keys text[], capacities bigint[], rates bigint[], mins bigint[], wants bigint[],
    steps bigint[], holders bigint[], lease_ids bigint[], kept bigint[], lifetimes bigint[])
RETURNS TABLE (key text, tokens bigint, frac integer, granted bigint, updated_us bigint,
               now_us bigint)
LANGUAGE plpgsql VOLATILE
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
    vec![
        ("tokenlease_citus_parts(text[])", parts),
        (
            "tokenlease_citus_take(text, text[], bigint[], bigint[], bigint[], bigint[], bigint[])",
            take,
        ),
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
    ]
}

/// The take of one shard as a function of its own, `tokenlease_citus_take_<shardid>`: the same
/// statement as [`TAKE_SHARD`] on that shard's table, but static, so each worker session plans
/// it once (a generic plan) instead of on every call, which is most of what a routed call cost
/// the worker when every call planned it. Created for every shard by [`distribute`], on every
/// node (a worker calls only its own shards'); a shard made later (a split) has none until the
/// next migrate, and is taken through `EXECUTE` meanwhile.
fn shard_take_function(shard: i64, table: &str) -> String {
    let statement = TAKE_SHARD.replace("%1$s", table).replace("%%", "%");
    format!(
        "CREATE OR REPLACE FUNCTION tokenlease_citus_take_{shard}(
    text[], bigint[], bigint[], bigint[], bigint[], bigint[])
RETURNS TABLE (key text, tokens tokenlease_nanotokens, frac tokenlease_femtotokens,
               granted bigint, updated_us bigint, now_us bigint)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY {statement};
END
$fn$"
    )
}

/// A fingerprint of the Citus step's SQL and the shards it made functions for: the functions
/// are created again when it changes.
fn fingerprint(shards: &[(i64, String)]) -> String {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    for (signature, body) in functions() {
        hasher.update(signature.as_bytes());
        hasher.update(body.as_bytes());
    }
    for (shard, table) in shards {
        hasher.update(shard_take_function(*shard, table).as_bytes());
    }
    hasher
        .finalize()
        .iter()
        .take(12)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The calls the store sends on Citus: each a distributed function whose first argument routes
/// it to one worker.
pub(super) const TAKE: &str = "\
-- tokenlease: refill and take on one Citus worker (src/store/postgres/citus.rs)
SELECT key, tokens, frac, granted, updated_us, now_us
FROM tokenlease_citus_take($1, $2, $3, $4, $5, $6, $7)";

/// The types of [`TAKE`]'s parameters.
pub(super) const TAKE_TYPES: [Type; 7] = [
    Type::TEXT,
    Type::TEXT_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
];

/// Strict leases on one Citus worker (committed durably: `tokenlease_citus_take_held` sets
/// `synchronous_commit` itself, as the plain store's strict take does).
pub(super) const TAKE_HELD: &str = "\
-- tokenlease: refill and take with strict leases on one Citus worker (src/store/postgres/citus.rs)
SELECT key, tokens, frac, granted, updated_us, now_us
FROM tokenlease_citus_take_held($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";

/// Returns on one Citus worker.
pub(super) const GIVE_BACK: &str = "\
-- tokenlease: return of unused lease tokens on one Citus worker (src/store/postgres/citus.rs)
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
-- tokenlease: idle cleanup on one Citus worker (src/store/postgres/citus.rs)
SELECT tokenlease_citus_delete_idle($1, $2)";

/// The statements a new session on a Citus coordinator prepares.
pub(super) fn warm_statements() -> [(&'static str, &'static [Type]); 2] {
    [(TAKE, &TAKE_TYPES), (GIVE_BACK, &GIVE_BACK_TYPES)]
}

/// The Citus version of `extversion` (`13.2-1`) as (major, minor).
fn parse_version(v: &str) -> Option<(u32, u32)> {
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
fn check_version(version: String) -> Result<String, MigrateError> {
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

/// The Citus step of [`migrate`](super::migrate::migrate): on a database with the `citus`
/// extension, distributes the tables by key (once) and creates the Citus functions (again when
/// this build's differ). Returns the extension's version, or `None` on plain PostgreSQL (where
/// it does nothing else).
///
/// Runs in one transaction under the migration lock, so concurrent migrators do it once.
pub(super) async fn distribute(
    client: &mut tokio_postgres::Client,
) -> Result<Option<String>, MigrateError> {
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
    tx.batch_execute(super::migrate::LOCK)
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
    let current = format!("tokenlease citus {}", fingerprint(&shards(&tx).await?));
    if buckets && returns && comment == current {
        return Ok(Some(version));
    }
    if !buckets {
        tx.batch_execute("SELECT create_distributed_table('tokenlease_buckets', 'key', 'hash')")
            .await
            .map_err(step("distribute tokenlease_buckets"))?;
    }
    let shards = shards(&tx).await?;
    let stamp = format!("tokenlease citus {}", fingerprint(&shards));
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
        if signature.starts_with("tokenlease_citus_parts") {
            continue;
        }
        tx.batch_execute(&format!(
            "SELECT create_distributed_function({}, '$1', colocate_with := 'tokenlease_buckets')",
            literal(signature)
        ))
        .await
        .map_err(step("distribute a Citus function"))?;
    }
    for (shard, table) in &shards {
        tx.batch_execute(&shard_take_function(*shard, table))
            .await
            .map_err(step("create a shard's take function"))?;
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
    Ok(Some(version))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values from `SELECT worker_hash(k::text)` on PostgreSQL 15 with Citus 13.2.
    #[test]
    fn hashtext_matches_postgres() {
        assert_eq!(hashtext(b"a"), 1_075_015_857);
        assert_eq!(hashtext(b"tokenlease"), 404_391_352);
        assert_eq!(hashtext(b""), -1_477_818_771);
        assert_eq!(hashtext(b"abcdefghijklmnopqrstuvwxyz"), 167_831_483);
    }

    #[test]
    fn unsupported_versions_are_refused_by_name() {
        assert!(check_version("13.2-1".into()).is_ok());
        assert!(check_version("12.1-1".into()).is_ok());
        for old in ["11.3-1", "10.2-4", "14.0-1", "garbage"] {
            let err = check_version(old.into()).expect_err(old);
            assert!(
                matches!(err, MigrateError::UnsupportedCitus { .. }),
                "{err:?}"
            );
            assert!(err.to_string().contains(old), "{err}");
        }
    }

    #[test]
    fn versions_parse() {
        assert_eq!(parse_version("13.2-1"), Some((13, 2)));
        assert_eq!(parse_version("12.1"), Some((12, 1)));
        assert_eq!(parse_version("x"), None);
    }

    #[test]
    fn shard_statements_name_no_distributed_table() {
        for sql in [
            TAKE_SHARD.as_str(),
            HELD_UPDATE_SHARD.as_str(),
            GIVE_BACK_SHARD.as_str(),
            DELETE_IDLE_SHARD.as_str(),
            HELD_INSERT_SHARD,
        ] {
            assert!(!sql.contains("tokenlease_buckets"), "{sql}");
            assert!(!sql.contains("tokenlease_returns "), "{sql}");
            assert!(sql.contains("%1$s"), "{sql}");
        }
    }

    #[test]
    fn a_map_finds_every_key_a_shard() {
        let step = (1i64 << 32) / 4;
        let shards: Vec<Shard> = (0..4)
            .map(|i| Shard {
                id: 100 + i,
                min: (i64::from(i32::MIN) + i * step) as i32,
                max: (i64::from(i32::MIN) + (i + 1) * step - 1) as i32,
                node: usize::try_from(i % 2).unwrap(),
            })
            .collect();
        let map = ShardMap::new(shards, vec!["a".into(), "b".into()]).expect("valid map");
        for k in ["a", "b", "tokenlease", ""] {
            let h = hashtext(k.as_bytes());
            let s = map.shard_of(k);
            assert!(s.min <= h && h <= s.max);
        }
        assert_eq!(map.node_of(map.probe(0)), 0);
        assert_eq!(map.node_of(map.probe(1)), 1);
    }
}
