//! The store on a Citus cluster: the tables distributed by key, and every call sent straight to
//! the node holding its keys, with the coordinator off the path (docs/design/scale-out.md).
//!
//! # Distribution
//!
//! [`distribute`](distribute::distribute) runs after the file migrations when the database has
//! the `citus` extension (a coordinator): it makes `tokenlease_buckets` a hash-distributed table
//! on `key` over [`SHARDS_PER_NODE`] shards per node unless `citus.shard_count` was set, and
//! `tokenlease_returns` one co-located with it (its primary key becomes `(key, id)`: Citus
//! requires the distribution column in every unique constraint; a return id is unique per key,
//! which is all a retried return needs), then creates the functions of [`sql`]: the shard
//! guard on every node, and the strict take, the return and idle cleanup as *distributed
//! functions* on their first argument. They are applied as a function file of their own
//! (`citus` in `tokenlease_functions`), by generation and checksum and checked on every node,
//! so an older release's `migrate` leaves a newer one's in place. A Citus version outside
//! [`SUPPORTED_CITUS`] is refused
//! with [`MigrateError::UnsupportedCitus`](crate::store::MigrateError::UnsupportedCitus). On
//! plain PostgreSQL nothing here runs.
//!
//! # Routing
//!
//! The store reads the shard map (`pg_dist_shard`, `pg_dist_placement`, `pg_dist_node`) when it
//! connects, hashes each key as Citus does ([`hashtext`]: PostgreSQL's `hashtext`, Bob
//! Jenkins's lookup3, which `worker_hash(text)` returns) to find its shard and the node holding
//! it, and opens a pool per node ([`Citus`]). A batch is split by node, and each node's part is
//! ONE statement on that node ([`sql::node_take`]): the plain store's many-key take on each of
//! its shards' tables, in shard order, after the shard guard (`tokenlease_citus_hold`,
//! [`sql::functions`]: the shards' distribution metadata locks in share mode, as Citus's
//! executor takes them for a write, then their placements checked). No coordinator, no delegation, no distributed transaction.
//! Strict leases, returns and idle cleanup are calls of the distributed functions sent to the
//! node holding their route key, which Citus then runs locally.
//!
//! # Topology changes
//!
//! A node that refuses a shard (it moved, or a split removed it) makes the store read the map
//! again, from any node, open pools to new nodes, and send the refused keys once more
//! ([`Citus::acquire_each`]). Each node's pool is warmed in `build`: its sessions prepare the
//! node's statements and run each take once with no keys.
//!
//! [`hashtext`]: map::hashtext

use std::collections::HashMap;
use std::sync::Arc;

use tokio_postgres::types::{ToSql, Type};

use super::contain::{Path, ShardOf, no_row};
use super::manager::NodeStatements;
use super::{Holds, PostgresStore, Takes, file_rows, nanos_down, shape};
use crate::store::{AcquireRequest, Acquired, GiveBack, StoreError, join_all};

/// The Citus versions the store runs on: from 12.0 up to (not including) 14.0. Tested on 13.2.
pub(crate) const SUPPORTED_CITUS: ((u32, u32), (u32, u32)) = ((12, 0), (14, 0));

/// The shards per node holding shards that `migrate` gives the tables when `citus.shard_count`
/// is left at Citus's default (docs/design/scale-out.md has the measurements): a node's part of
/// a batch is one statement with a part per shard it touches, and every part past the first
/// costs more than half of a one-key statement's instructions, so one shard a node makes the
/// cheapest statements. A node added later takes keys by a split placing one half on it
/// (docs/scale-out.md, "Adding a worker").
pub(crate) const SHARDS_PER_NODE: u32 = 1;

/// The map in use and a store (a pool of its own) for each of its nodes, by the map's node
/// index.
#[derive(Debug)]
pub(super) struct Topology {
    pub(super) map: ShardMap,
    pub(super) lanes: Vec<PostgresStore>,
    /// Counts the maps read: a caller that saw a stale map reloads only if no one else has
    /// since.
    generation: u64,
}

/// How the store opens a pool to a node: a function of the node's address.
pub(super) type OpenNode = Box<dyn Fn(&Node) -> (PostgresStore, NodeStatements) + Send + Sync>;

/// The store's Citus state: the current [`Topology`], the pools by node (kept across
/// reloads), and how to open one for a node the store has not seen.
pub(super) struct Citus {
    topology: parking_lot::RwLock<Arc<Topology>>,
    pools: parking_lot::Mutex<HashMap<Node, (PostgresStore, NodeStatements)>>,
    open: OpenNode,
    /// The coordinator's pool, for reading the map when no node answers.
    coordinator: PostgresStore,
    /// One reload at a time.
    reloading: tokio::sync::Mutex<()>,
    /// Connections each node's pool holds, opened before a node's first call.
    pool_size: u32,
    connect_timeout: std::time::Duration,
}

impl std::fmt::Debug for Citus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Citus")
            .field("topology", &self.topology.read())
            .finish_non_exhaustive()
    }
}

/// Whether `err` says the map the store routed by is stale: a node refused a shard it no
/// longer holds (`tokenlease_citus_hold`, SQLSTATE 55000), or a shard is gone (a split removed
/// it: Citus has no entry for it, or its table or function is missing: 42P01, 42883).
fn stale(err: &StoreError) -> bool {
    match err {
        StoreError::Database { code, message } => {
            (code == "55000" && message.contains("tokenlease: shard"))
                || (code == "XX000" && message.contains("could not find valid entry for shard"))
                || code == "42P01"
                || code == "42883"
        }
        _ => false,
    }
}

impl Citus {
    /// The Citus state for `map`: a pool per node (`open`), each filled with `pool_size`
    /// sessions that have prepared that node's statements, before the first call.
    pub(super) async fn new(
        map: ShardMap,
        open: OpenNode,
        coordinator: PostgresStore,
        pool_size: u32,
        connect_timeout: std::time::Duration,
    ) -> Citus {
        let citus = Citus {
            topology: parking_lot::RwLock::new(Arc::new(Topology {
                map: map.clone(),
                lanes: Vec::new(),
                generation: 0,
            })),
            pools: parking_lot::Mutex::new(HashMap::new()),
            open,
            coordinator,
            reloading: tokio::sync::Mutex::new(()),
            pool_size,
            connect_timeout,
        };
        let topology = citus.topology_for(map, 0).await;
        *citus.topology.write() = Arc::new(topology);
        citus
    }

    /// The topology in use.
    pub(super) fn current(&self) -> Arc<Topology> {
        Arc::clone(&self.topology.read())
    }

    /// A [`Topology`] for `map`: the pools of nodes seen before, new ones opened and warmed
    /// (each node's statements prepared on every session, bounded by the connect timeout), and
    /// every node's statements made for its shards.
    async fn topology_for(&self, map: ShardMap, generation: u64) -> Topology {
        let mut fresh = Vec::new();
        let lanes: Vec<PostgresStore> = {
            let mut pools = self.pools.lock();
            pools.retain(|node, _| map.nodes().contains(node));
            map.nodes()
                .iter()
                .enumerate()
                .map(|(i, node)| {
                    let (lane, statements) = pools.entry(node.clone()).or_insert_with(|| {
                        let opened = (self.open)(node);
                        fresh.push(opened.0.clone());
                        opened
                    });
                    *statements.write() = node_statements(&map, i);
                    lane.clone()
                })
                .collect()
        };
        let warm = fresh.iter().map(|lane| lane.warm(self.pool_size));
        let _ = tokio::time::timeout(self.connect_timeout * 2, join_all(warm)).await;
        Topology {
            map,
            lanes,
            generation,
        }
    }

    /// Reads the map again, unless another caller has since `seen` was current: from the nodes
    /// first (every node has the metadata, and the coordinator may be down), then the
    /// coordinator.
    async fn reload(&self, seen: u64) -> Result<Arc<Topology>, StoreError> {
        let _one = self.reloading.lock().await;
        let current = self.current();
        if current.generation != seen {
            return Ok(current);
        }
        let mut last = None;
        for lane in current
            .lanes
            .iter()
            .chain(std::iter::once(&self.coordinator))
        {
            match lane.read_map().await {
                Ok(Some(map)) => {
                    let next = Arc::new(self.topology_for(map, seen + 1).await);
                    *self.topology.write() = Arc::clone(&next);
                    return Ok(next);
                }
                Ok(None) => {
                    last = Some(StoreError::Protocol(
                        "tokenlease_buckets is no longer distributed".into(),
                    ));
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| StoreError::Protocol("no node to read the map from".into())))
    }

    /// [`Store::acquire_each`](crate::store::Store::acquire_each) on Citus for the requests at
    /// `which` (distinct keys): split by node, one statement per node on that node, all the
    /// nodes' statements side by side, each node's data errors contained to their requests. A
    /// node that says the map is stale makes the store read it again and send those keys once
    /// more, each to the node now holding it. One answer per position of `which`.
    pub(super) async fn acquire_each(
        &self,
        deadline: tokio::time::Instant,
        requests: &[AcquireRequest<'_>],
        which: &[usize],
    ) -> Vec<Result<Acquired, StoreError>> {
        self.with_reload(which, |topology, which| async move {
            per_node(
                &topology,
                &which,
                |i| requests[i].key,
                |lane, group, map| async move {
                    lane.take_contained(deadline, requests, &group, Path::Citus(map))
                        .await
                },
                |i| no_row(requests[i].key),
            )
            .await
        })
        .await
    }

    /// [`Store::give_back_each`](crate::store::Store::give_back_each) on Citus for the returns
    /// at `which` (distinct keys): one call of `tokenlease_citus_give_back` per node, on that
    /// node, data errors contained; a stale map read again and those returns sent once more;
    /// whether each return credited.
    pub(super) async fn give_back_each(
        &self,
        deadline: tokio::time::Instant,
        returns: &[GiveBack<'_>],
        which: &[usize],
    ) -> Vec<Result<bool, StoreError>> {
        self.with_reload(which, |topology, which| async move {
            per_node(
                &topology,
                &which,
                |i| returns[i].key,
                |lane, group, map| async move {
                    lane.give_contained(deadline, returns, &group, Path::Citus(map))
                        .await
                },
                |_| StoreError::Protocol("a return unanswered".into()),
            )
            .await
        })
        .await
    }

    /// `run` on the positions `which` with the map in force; the positions a node refused as
    /// [`stale`] run once more with the map read again. One answer per position of `which`.
    async fn with_reload<T, F, Fut>(&self, which: &[usize], run: F) -> Vec<Result<T, StoreError>>
    where
        F: Fn(Arc<Topology>, Vec<usize>) -> Fut,
        Fut: std::future::Future<Output = Vec<Result<T, StoreError>>>,
    {
        let topology = self.current();
        let generation = topology.generation;
        let mut answers = run(topology, which.to_vec()).await;
        let again: Vec<usize> = (0..which.len())
            .filter(|&n| answers[n].as_ref().is_err_and(stale))
            .collect();
        if again.is_empty() {
            return answers;
        }
        let Ok(next) = self.reload(generation).await else {
            return answers;
        };
        let resend: Vec<usize> = again.iter().map(|&n| which[n]).collect();
        let retried = run(next, resend).await;
        for (n, answer) in again.into_iter().zip(retried) {
            answers[n] = answer;
        }
        answers
    }

    /// [`Store::delete_idle`](crate::store::Store::delete_idle) on Citus: one call of
    /// `tokenlease_citus_delete_idle` per node, on that node, in turn, until `limit` rows are
    /// gone.
    pub(super) async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        let topology = self.current();
        let mut deleted = 0u64;
        for (node, lane) in topology.lanes.iter().enumerate() {
            let left = i64::from(limit) - i64::try_from(deleted).unwrap_or(i64::MAX);
            if left <= 0 {
                break;
            }
            let route = topology.map.probe(node);
            let rows = lane
                .query(
                    DELETE_IDLE.as_str(),
                    &[(&route, Type::TEXT), (&left, Type::INT8)],
                )
                .await?;
            let n: i64 = rows.first().map(|r| r.try_get(0)).transpose()?.unwrap_or(0);
            deleted += u64::try_from(n).unwrap_or(0);
        }
        Ok(deleted)
    }

    /// The store of the node holding `key`'s shard and the inspection statement on the shard's
    /// table: inspection goes there, not through the coordinator.
    pub(super) fn inspect_route(&self, key: &str) -> (PostgresStore, &'static str) {
        let topology = self.current();
        let shard = topology.map.shard_of(key);
        (
            topology.lanes[shard.node].clone(),
            sql::inspect_shard(&shard.table),
        )
    }

    /// How many nodes hold shards (each has a pool).
    pub(super) fn nodes(&self) -> usize {
        self.current().lanes.len()
    }

    /// The node holding `key`'s shard, by its stable id: the store's partition of `key`.
    pub(super) fn partition(&self, key: &str) -> usize {
        let topology = self.topology.read();
        let node = topology.map.node_of(key);
        usize::try_from(topology.map.nodes()[node].id).unwrap_or(node)
    }
}

impl ShardOf for ShardMap {
    fn shard_of(&self, key: &str) -> (i64, &str) {
        let shard = ShardMap::shard_of(self, key);
        (shard.id, shard.table.as_str())
    }
}

/// The statements a new session on node `node` prepares: its takes for every set of its
/// shards when it holds at most three (seven statements), else for each shard alone and for
/// all of them, each also run once with no keys (`true`); and the strict take and the return.
fn node_statements(map: &ShardMap, node: usize) -> Vec<(&'static str, &'static [Type], bool)> {
    let shards: Vec<(i64, &str)> = map
        .shards_on(node)
        .into_iter()
        .map(|s| (s.id, s.table.as_str()))
        .collect();
    let mut sets: Vec<Vec<(i64, &str)>> = Vec::new();
    if shards.len() <= 3 {
        for mask in 1u32..(1 << shards.len()) {
            sets.push(
                (0..shards.len())
                    .filter(|b| mask & (1 << b) != 0)
                    .map(|b| shards[b])
                    .collect(),
            );
        }
    } else {
        sets.extend(shards.iter().map(|s| vec![*s]));
        sets.push(shards.clone());
    }
    let mut out: Vec<(&'static str, &'static [Type], bool)> = sets
        .iter()
        .filter_map(|set| sql::node_take_statement(set))
        .map(|(statement, types)| (statement, types, true))
        .collect();
    out.push((TAKE_HELD.as_str(), &sql::TAKE_HELD_TYPES, false));
    out.push((GIVE_BACK.as_str(), &GIVE_BACK_TYPES, false));
    out
}

impl PostgresStore {
    /// Opens `size` sessions side by side (each preparing its statements) and hands them to
    /// the pool, so that no early call waits for a login or a prepare. A session that does
    /// not come is opened by the first call that needs it.
    pub(super) async fn warm(&self, size: u32) {
        let opens = (0..size).map(|_| self.pool.dedicated_connection());
        for conn in join_all(opens).await.into_iter().flatten() {
            // Refused only when the pool is full already: the connection is dropped.
            let _ = self.pool.add(conn);
        }
    }

    /// The shard map as this store's database says (no hash check: done when the store
    /// connected).
    async fn read_map(&self) -> Result<Option<ShardMap>, StoreError> {
        let deadline = crate::clock::instant() + self.call_timeout.max(self.cancel_timeout);
        let timed_out = || StoreError::Timeout {
            kind: crate::store::TimeoutKind::Call,
            after: self.call_timeout,
        };
        let conn = self.checkout(deadline, timed_out).await?;
        match tokio::time::timeout_at(deadline, shard_map(&conn, false)).await {
            Ok(map) => map,
            Err(_) => Err(timed_out()),
        }
    }

    /// One node's part of a batch: `pending` indexes `requests`, distinct keys on one node.
    /// The plain takes go as one statement on the node's shard tables ([`sql::node_take`]);
    /// what it leaves (strict leases, rows holding them) through `tokenlease_citus_take_held`
    /// on the node. Each answer is filed in `out`; `pending` keeps what is not decided, also
    /// when a statement fails.
    pub(super) async fn citus_decide(
        &self,
        map: &dyn ShardOf,
        deadline: tokio::time::Instant,
        requests: &[AcquireRequest<'_>],
        pending: &mut Vec<usize>,
        out: &mut [Option<Acquired>],
    ) -> Result<(), StoreError> {
        // Buckets of several limits: their own call (`limits.rs`).
        self.citus_take_limits(deadline, requests, pending, out)
            .await?;
        if pending.is_empty() {
            return Ok(());
        }
        if !pending.iter().any(|&i| requests[i].hold.is_some()) {
            // By shard, in shard order.
            let mut by_shard: Vec<((i64, &str), Vec<usize>)> = Vec::new();
            for &i in pending.iter() {
                let shard = map.shard_of(requests[i].key);
                match by_shard.iter_mut().find(|(s, _)| s.0 == shard.0) {
                    Some((_, group)) => group.push(i),
                    None => by_shard.push((shard, vec![i])),
                }
            }
            by_shard.sort_by_key(|(s, _)| s.0);
            let shards: Vec<(i64, &str)> = by_shard.iter().map(|(s, _)| *s).collect();
            match sql::node_take_statement(&shards) {
                Some((statement, _)) => {
                    let takes = by_shard
                        .iter()
                        .map(|(_, group)| Takes::new(requests, group))
                        .collect::<Result<Vec<_>, _>>()?;
                    let params: Vec<(&(dyn ToSql + Sync), Type)> =
                        takes.iter().flat_map(Takes::params).collect();
                    let rows = self.query_by(deadline, statement, &params).await?;
                    file_rows(&rows, requests, pending, out)?;
                }
                None => {
                    // Too many sets of shards kept: one statement per shard.
                    for ((_, group), shard) in by_shard.iter().zip(&shards) {
                        let (statement, _) = sql::node_take_statement(std::slice::from_ref(shard))
                            .ok_or_else(|| {
                                StoreError::Protocol("no statement for a shard".into())
                            })?;
                        let t = Takes::new(requests, group)?;
                        let rows = self.query_by(deadline, statement, &t.params()).await?;
                        file_rows(&rows, requests, pending, out)?;
                    }
                }
            }
        }
        if !pending.is_empty() {
            let t = Takes::new(requests, pending)?;
            let route = t.keys[0];
            let holds = Holds::new(requests, pending);
            let mut params: Vec<(&(dyn ToSql + Sync), Type)> = vec![(&route, Type::TEXT)];
            params.extend(t.params());
            params.extend(holds.params());
            let rows = self.query_by(deadline, TAKE_HELD.as_str(), &params).await?;
            file_rows(&rows, requests, pending, out)?;
        }
        Ok(())
    }
    /// One node's returns; the keys credited.
    pub(super) async fn citus_give_back(
        &self,
        deadline: tokio::time::Instant,
        returns: &[GiveBack<'_>],
        group: &[usize],
    ) -> Result<std::collections::HashSet<String>, StoreError> {
        // Buckets of several limits: their own call (`limits.rs`).
        let mut group = group.to_vec();
        let mut credited = self
            .citus_give_back_limits(deadline, returns, &mut group)
            .await?;
        let Some(&first) = group.first() else {
            return Ok(credited);
        };
        let group = &group[..];
        let route = returns[first].key;
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
        let rows = self.query_by(deadline, GIVE_BACK.as_str(), &params).await?;
        for row in &rows {
            credited.insert(row.try_get::<_, String>(0).map_err(StoreError::from)?);
        }
        Ok(credited)
    }
}

/// The positions `which` by the node of their keys, nodes without keys left out.
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

/// `call` on each node's part of the positions `which` (grouped by the node of `key(i)`), every
/// node side by side, each through its own pool; one answer per position of `which`, and
/// `missing(i)` for a position its node's call did not answer.
async fn per_node<'a, T, F, Fut>(
    topology: &'a Topology,
    which: &[usize],
    key: impl Fn(usize) -> &'a str,
    call: F,
    missing: impl Fn(usize) -> StoreError,
) -> Vec<Result<T, StoreError>>
where
    F: Fn(&'a PostgresStore, Vec<usize>, &'a ShardMap) -> Fut,
    Fut: std::future::Future<Output = Vec<Result<T, StoreError>>>,
{
    let groups = by_node(&topology.map, which, key);
    let calls = groups
        .iter()
        .map(|(node, group)| call(&topology.lanes[*node], group.clone(), &topology.map));
    let mut out: HashMap<usize, Result<T, StoreError>> = HashMap::with_capacity(which.len());
    for ((_, group), answers) in groups.iter().zip(join_all(calls).await) {
        out.extend(group.iter().copied().zip(answers));
    }
    which
        .iter()
        .map(|i| out.remove(i).unwrap_or_else(|| Err(missing(*i))))
        .collect()
}

mod distribute;
mod map;
mod sql;

#[cfg(test)]
pub(super) use self::distribute::distribute_with;
pub(super) use self::distribute::{Distributed, distribute};
pub(super) use self::map::shard_map;
pub(crate) use self::map::{Node, ShardMap};
use self::sql::{DELETE_IDLE, GIVE_BACK, GIVE_BACK_TYPES, TAKE_HELD};
#[cfg(test)]
pub(super) use self::sql::{
    GIVE_BACK_SHARD, NODE_FUNCTIONS_GENERATION, bodies, node_functions, statements_for_tests,
};

#[cfg(test)]
pub(super) mod tests;
