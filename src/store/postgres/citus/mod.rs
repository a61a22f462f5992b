//! The store on a Citus cluster: the tables distributed by key, and every call routed to one
//! worker.
//!
//! # Distribution
//!
//! [`distribute`](distribute::distribute) runs after the file migrations when the database has the `citus` extension
//! (a coordinator): it makes `tokenlease_buckets` a hash-distributed table on `key` and
//! `tokenlease_returns` one co-located with it (its primary key becomes `(key, id)`: Citus
//! requires the distribution column in every unique constraint; a return id is unique per key,
//! which is all a retried return needs), then creates the functions below and marks each a
//! *distributed function* whose first argument is the distribution argument, co-located with
//! `tokenlease_buckets`. A Citus version outside [`SUPPORTED_CITUS`] is refused with
//! [`MigrateError::UnsupportedCitus`](crate::store::MigrateError::UnsupportedCitus). On plain PostgreSQL nothing here runs.
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
//! shard's own function (`tokenlease_citus_take_<shardid>`, [`sql::shard_take_function`]), whose
//! statement the worker session plans once; strict leases, returns and a shard without its
//! function (made after the last migrate) go through `EXECUTE`, planned on every call. The
//! rows of each shard are locked in key order, and shards are taken in shard order, so two
//! calls never wait on each other in a cycle. Each worker's calls go through a pool of their
//! own ([`Citus`]), so a worker that stalls holds only its own connections.
//!
//! Idle cleanup runs the same way, one call per worker, on that worker's shards.

use std::collections::HashMap;

use tokio_postgres::types::Type;

use tokio_postgres::types::ToSql;

use super::contain::{Path, no_row};
use super::{Holds, PostgresStore, Takes, file_rows, nanos_down, shape};
use crate::store::{AcquireRequest, Acquired, GiveBack, StoreError, join_all};

/// The Citus versions the store runs on: from 12.0 up to (not including) 14.0. Tested on 13.2.
pub(crate) const SUPPORTED_CITUS: ((u32, u32), (u32, u32)) = ((12, 0), (14, 0));

/// PostgreSQL's `hashtext` for a deterministic collation: `hash_bytes` (Bob Jenkins's lookup3,
/// `hashfn.c`) over the key's UTF-8 bytes, as a signed 32-bit value. Citus hashes a text
/// distribution column with it (`worker_hash(text)`), and a shard holds the keys whose hash is
/// within its `[shardminvalue, shardmaxvalue]`.
pub(crate) fn hashtext(key: &[u8]) -> i32 {
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
    /// [`Store::acquire_each`](crate::store::Store::acquire_each) on Citus for the requests at
    /// `which` (distinct keys): split by worker, one call of `tokenlease_citus_take` per worker
    /// (then `tokenlease_citus_take_held` for what it left: strict leases, rows that hold them),
    /// all the workers' calls side by side, each worker's data errors contained to their
    /// requests. A worker's error goes to its keys only. One answer per position of `which`.
    pub(super) async fn acquire_each(
        &self,
        deadline: tokio::time::Instant,
        requests: &[AcquireRequest<'_>],
        which: &[usize],
    ) -> Vec<Result<Acquired, StoreError>> {
        let groups = by_node(&self.map, which, |i| requests[i].key);
        let calls = groups.iter().map(|(node, group)| {
            self.lanes[*node].take_contained(deadline, requests, group, Path::Citus)
        });
        let mut out: HashMap<usize, Result<Acquired, StoreError>> =
            HashMap::with_capacity(which.len());
        for ((_, group), answers) in groups.iter().zip(join_all(calls).await) {
            out.extend(group.iter().copied().zip(answers));
        }
        which
            .iter()
            .map(|i| {
                out.remove(i)
                    .unwrap_or_else(|| Err(no_row(requests[*i].key)))
            })
            .collect()
    }

    /// [`Store::give_back_each`](crate::store::Store::give_back_each) on Citus for the returns
    /// at `which` (distinct keys): one call of `tokenlease_citus_give_back` per worker, each
    /// through its worker's pool, data errors contained; whether each return credited.
    pub(super) async fn give_back_each(
        &self,
        deadline: tokio::time::Instant,
        returns: &[GiveBack<'_>],
        which: &[usize],
    ) -> Vec<Result<bool, StoreError>> {
        let groups = by_node(&self.map, which, |i| returns[i].key);
        let calls = groups.iter().map(|(node, group)| {
            self.lanes[*node].give_contained(deadline, returns, group, Path::Citus)
        });
        let mut out: HashMap<usize, Result<bool, StoreError>> = HashMap::with_capacity(which.len());
        for ((_, group), answers) in groups.iter().zip(join_all(calls).await) {
            out.extend(group.iter().copied().zip(answers));
        }
        which
            .iter()
            .map(|i| {
                out.remove(i)
                    .unwrap_or_else(|| Err(StoreError::Protocol("a return unanswered".into())))
            })
            .collect()
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
    /// One worker's part of a batch: `pending` indexes `requests`, distinct keys on one
    /// worker. Each answer is filed in `out`; `pending` keeps what is not decided, also when a
    /// call fails.
    pub(super) async fn citus_decide(
        &self,
        deadline: tokio::time::Instant,
        requests: &[AcquireRequest<'_>],
        pending: &mut Vec<usize>,
        out: &mut [Option<Acquired>],
    ) -> Result<(), StoreError> {
        if !pending.iter().any(|&i| requests[i].hold.is_some()) {
            let t = Takes::new(requests, pending)?;
            let route = t.keys[0];
            let mut params: Vec<(&(dyn ToSql + Sync), Type)> = vec![(&route, Type::TEXT)];
            params.extend(t.params());
            let rows = self.query_by(deadline, TAKE, &params).await?;
            file_rows(&rows, requests, pending, out)?;
        }
        if !pending.is_empty() {
            let t = Takes::new(requests, pending)?;
            let route = t.keys[0];
            let holds = Holds::new(requests, pending);
            let mut params: Vec<(&(dyn ToSql + Sync), Type)> = vec![(&route, Type::TEXT)];
            params.extend(t.params());
            params.extend(holds.params());
            let rows = self.query_by(deadline, TAKE_HELD, &params).await?;
            file_rows(&rows, requests, pending, out)?;
        }
        Ok(())
    }

    /// One worker's returns; the keys credited.
    pub(super) async fn citus_give_back(
        &self,
        deadline: tokio::time::Instant,
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
        let rows = self.query_by(deadline, GIVE_BACK, &params).await?;
        rows.iter()
            .map(|row| row.try_get::<_, String>(0).map_err(StoreError::from))
            .collect()
    }
}

/// The positions `which` by the worker of their keys, workers without keys left out.
fn by_node<'a>(
    map: &ShardMap,
    which: &[usize],
    key: impl Fn(usize) -> &'a str,
) -> Vec<(usize, Vec<usize>)> {
    let mut groups: Vec<(usize, Vec<usize>)> =
        (0..map.nodes().len()).map(|n| (n, Vec::new())).collect();
    for &i in which {
        groups[map.node_of(key(i))].1.push(i);
    }
    groups.retain(|(_, g)| !g.is_empty());
    groups
}

mod distribute;
mod sql;

pub(super) use self::distribute::distribute;
pub(super) use self::sql::warm_statements;
use self::sql::{DELETE_IDLE, GIVE_BACK, GIVE_BACK_TYPES, TAKE, TAKE_HELD};

#[cfg(test)]
mod tests;
