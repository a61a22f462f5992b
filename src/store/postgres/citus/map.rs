//! The shard map: where each key of a distributed `tokenlease_buckets` lives (its shard, the
//! shard's table and the node holding it), the hash that finds a key's shard, and reading the
//! map from any node.

use super::super::sql as files;
use std::collections::HashMap;

use tokio_postgres::types::Type;

use crate::store::StoreError;

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

/// One shard of `tokenlease_buckets`: its hash range, its table on the node holding it, and
/// that node (index into [`ShardMap::nodes`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Shard {
    pub(crate) id: i64,
    pub(crate) min: i32,
    pub(crate) max: i32,
    pub(crate) node: usize,
    /// The shard's table, as `shard_name` gives it (quoted where it must be).
    pub(crate) table: String,
}

/// A node holding shards, as `pg_dist_node` names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Node {
    /// `pg_dist_node.nodeid`: stable while the node is in the cluster.
    pub(crate) id: i32,
    pub(crate) host: String,
    pub(crate) port: u16,
}

impl Node {
    /// `host:port`, as the builder's address map names a node.
    pub(crate) fn name(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }
}

/// Where each key of a distributed `tokenlease_buckets` lives: read when the store connects,
/// and again when a node says the map is stale.
#[derive(Clone, Debug)]
pub(crate) struct ShardMap {
    /// By `min`, covering the whole 32-bit hash range.
    shards: Vec<Shard>,
    /// The nodes holding shards, in Citus's group order.
    nodes: Vec<Node>,
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

    /// The node (index into the node list) holding `key`'s shard.
    pub(crate) fn node_of(&self, key: &str) -> usize {
        self.shard_of(key).node
    }

    /// The nodes holding shards.
    pub(crate) fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The shards held by node `node`, in shard order.
    pub(crate) fn shards_on(&self, node: usize) -> Vec<&Shard> {
        let mut on: Vec<&Shard> = self.shards.iter().filter(|s| s.node == node).collect();
        on.sort_by_key(|s| s.id);
        on
    }

    /// A key whose shard is on `node`.
    pub(crate) fn probe(&self, node: usize) -> &str {
        &self.probes[node]
    }

    pub(super) fn new(shards: Vec<Shard>, nodes: Vec<Node>) -> Result<Self, String> {
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

/// Whether `client`'s database (the coordinator, or any node: every node has the metadata) is
/// on Citus with `tokenlease_buckets` distributed, and if so its shard map. With `check_hash`,
/// checks [`hashtext`] against the server's `worker_hash` first: a key hashed differently (a
/// non-deterministic collation, say) would be sent to the wrong node, so a mismatch is an
/// error.
pub(in crate::store::postgres) async fn shard_map(
    client: &tokio_postgres::Client,
    check_hash: bool,
) -> Result<Option<ShardMap>, StoreError> {
    let distributed = client.query_typed(files::CITUS_IS_CITUS.text, &[]).await?;
    if !distributed.first().is_some_and(|r| r.get::<_, bool>(0)) {
        return Ok(None);
    }
    let rows = client
        .query_typed(files::CITUS_IS_DISTRIBUTED.text, &[])
        .await?;
    if !rows.first().is_some_and(|r| r.get::<_, bool>(0)) {
        return Ok(None);
    }
    let rows = client.query_typed(files::CITUS_SHARD_MAP.text, &[]).await?;
    type Placed = (i64, i32, i32, i32, Node, String);
    let mut placed: Vec<Placed> = Vec::with_capacity(rows.len());
    for row in &rows {
        let port: i32 = row.try_get(6)?;
        placed.push((
            row.try_get(0)?,
            row.try_get(1)?,
            row.try_get(2)?,
            row.try_get(3)?,
            Node {
                id: row.try_get(4)?,
                host: row.try_get(5)?,
                port: u16::try_from(port).unwrap_or(0),
            },
            row.try_get(7)?,
        ));
    }
    let mut groups: Vec<(i32, Node)> = placed.iter().map(|p| (p.3, p.4.clone())).collect();
    groups.sort_by_key(|(g, n)| (*g, n.id));
    groups.dedup_by_key(|(g, _)| *g);
    let by_group: HashMap<i32, usize> = groups
        .iter()
        .enumerate()
        .map(|(i, (g, _))| (*g, i))
        .collect();
    let nodes: Vec<Node> = groups.into_iter().map(|(_, n)| n).collect();
    let shards = placed
        .into_iter()
        .map(|(id, min, max, group, _, table)| Shard {
            id,
            min,
            max,
            node: by_group[&group],
            table,
        })
        .collect();
    let map = ShardMap::new(shards, nodes).map_err(StoreError::Protocol)?;
    if !check_hash {
        return Ok(Some(map));
    }
    // The client's hash must be the server's.
    let probes: Vec<String> = (0..64)
        .map(|i| format!("tokenlease-hash-check-{i}"))
        .collect();
    let rows = client
        .query_typed(
            files::CITUS_WORKER_HASH.text,
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
