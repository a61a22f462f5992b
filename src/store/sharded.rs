//! [`ShardedStore`]: keys spread over several stores (several PostgreSQL primaries) by
//! rendezvous hashing.
//!
//! Each key lives on exactly one shard, chosen by *highest random weight*: every shard's
//! stable name is hashed with the key, and the shard with the highest score holds the key. The
//! hash ([`rendezvous_score`]) is written out here (64-bit FNV-1a over the length-prefixed name
//! and the key, then the `fmix64` finaliser), so every process, platform and version of the
//! crate puts a key on the same shard. Adding a shard moves only the keys whose new highest
//! score is the new shard's: about `1/(N+1)` of them, and only to the new shard. See
//! `docs/design/scale-out.md` and `docs/scale-out.md`.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::{AcquireRequest, Acquired, BucketRow, GiveBack, Store, StoreError, join_all};

/// FNV-1a's 64-bit offset basis.
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a's 64-bit prime.
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv1a(mut state: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        state ^= u64::from(b);
        state = state.wrapping_mul(FNV_PRIME);
    }
    state
}

/// MurmurHash3's 64-bit finaliser: every input bit affects every output bit, which FNV-1a's
/// last multiplication alone does not do for the high bits of keys that differ in their last
/// byte.
const fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    h
}

/// The hash state after a shard's name: the name's length (8 bytes, little-endian) and bytes,
/// so that no (name, key) pair hashes the same bytes as another.
fn name_state(name: &str) -> u64 {
    let len = name.len() as u64;
    fnv1a(fnv1a(FNV_OFFSET, &len.to_le_bytes()), name.as_bytes())
}

/// The rendezvous score of `key` on the shard named `name`: `fmix64(FNV-1a-64(len(name) as
/// u64 little-endian ‖ name ‖ key))`. The shard with the highest score holds the key (ties,
/// which need a 64-bit collision, go to the name that sorts first).
///
/// Stable by construction: no random seed, no dependency on the platform's hasher or on a
/// library version, so every process that knows the same shard names places every key alike.
///
/// ```
/// use tokenlease::store::rendezvous_score;
///
/// // Fixed for ever: a test pins these values.
/// assert_eq!(rendezvous_score("a", "k"), rendezvous_score("a", "k"));
/// assert_ne!(rendezvous_score("a", "k"), rendezvous_score("b", "k"));
/// ```
pub fn rendezvous_score(name: &str, key: &str) -> u64 {
    fmix64(fnv1a(name_state(name), key.as_bytes()))
}

/// Which of the shards named `names` holds `key` (an index into `names`), or `None` when
/// `names` is empty. The same function [`ShardedStore`] uses, for tools that place keys
/// without a store (`tokenlease reshard`, a load test choosing keys per shard).
///
/// ```
/// use tokenlease::store::shard_of;
///
/// let names = ["pg-a", "pg-b", "pg-c"];
/// let i = shard_of(&names, "ratelimit:api:GET:/bookings").expect("three shards");
/// assert!(i < 3);
/// assert_eq!(shard_of(&[] as &[&str], "k"), None);
/// ```
pub fn shard_of<S: AsRef<str>>(names: &[S], key: &str) -> Option<usize> {
    pick(names.iter().map(AsRef::as_ref), key)
}

/// The index of the highest-scoring name for `key` (ties to the name that sorts first).
fn pick<'n>(names: impl Iterator<Item = &'n str>, key: &str) -> Option<usize> {
    let mut best: Option<(usize, u64, &str)> = None;
    for (i, name) in names.enumerate() {
        let score = rendezvous_score(name, key);
        let better = match best {
            None => true,
            Some((_, s, n)) => score > s || (score == s && name < n),
        };
        if better {
            best = Some((i, score, name));
        }
    }
    best.map(|(i, ..)| i)
}

/// Why a [`ShardedStore`] could not be built.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ShardError {
    /// No shard was given.
    #[error("a sharded store needs at least one shard")]
    NoShards,
    /// A shard's name is empty (or only white space).
    #[error("shard {index} has an empty name")]
    EmptyName {
        /// The shard's position in the list, from 0.
        index: usize,
    },
    /// Two shards have the same name: their keys could not be told apart.
    #[error("two shards are named {name:?}")]
    DuplicateName {
        /// The name given twice.
        name: String,
    },
    /// Building a shard's store failed (connecting or migrating). The error never holds the
    /// connection string's password.
    #[error("shard {shard:?}: {error}")]
    Store {
        /// The shard's name.
        shard: String,
        /// What failed.
        #[source]
        error: StoreError,
    },
}

struct Shard {
    name: String,
    store: Arc<dyn Store>,
}

/// A [`Store`] over several stores: each key on one of them, by rendezvous hashing of the key
/// with each shard's name ([`shard_of`]).
///
/// - **One key, one shard.** Every guarantee of the shard's store holds per key: exact
///   decisions, idempotent returns, strict accounting (a key's leases live on its bucket row,
///   on its shard).
/// - **Multi-key calls** ([`acquire_many`](Store::acquire_many),
///   [`acquire_each`](Store::acquire_each), [`give_back`](Store::give_back),
///   [`give_back_each`](Store::give_back_each)) are split per shard and the parts sent
///   concurrently; answers come back in the caller's order. `acquire_each` and
///   `give_back_each` answer per request, so a failing shard fails only its own keys: the
///   limiter uses them, and a healthy shard's keys keep the store's real decisions while
///   another shard is down. A key named more than once goes to its shard in one part, in
///   request order, and the shard decides its requests as consecutive calls; a request a shard
///   refuses alone ([`StoreError::Unstorable`], a contained data error) fails alone here too.
/// - [`delete_idle`](Store::delete_idle) runs on every shard (up to `limit` rows each);
///   [`inspect`](Store::inspect) asks the key's shard; [`call_timeout`](Store::call_timeout) is
///   the shards' largest, [`max_concurrent_calls`](Store::max_concurrent_calls) their sum and
///   [`partition_calls`](Store::partition_calls) the key's shard's.
///
/// Give each shard its own [`CircuitBreaker`](crate::store::CircuitBreaker) (as
/// [`connect`](ShardedStore::connect) does), not one around the whole `ShardedStore`: one
/// breaker around it would open for every key when one shard fails.
///
/// # Example
///
/// ```
/// use tokenlease::store::{MemoryStore, ShardedStore, Store};
///
/// let store = ShardedStore::builder()
///     .shard("pg-a", MemoryStore::new())
///     .shard("pg-b", MemoryStore::new())
///     .build()
///     .expect("two shards with distinct names");
/// assert_eq!(store.len(), 2);
/// let name = store.shard_name("ratelimit:api:GET:/bookings");
/// assert!(name == "pg-a" || name == "pg-b");
/// let limiter = tokenlease::Limiter::builder(store).build();
/// # drop(limiter);
/// ```
///
/// Against PostgreSQL, one store per primary, each migrated and behind its own breaker
/// (`tokenlease_circuit_state{store="pg-a"}`):
///
/// ```no_run
/// # async fn f() -> Result<(), tokenlease::store::ShardError> {
/// use tokenlease::store::ShardedStore;
///
/// let store = ShardedStore::connect(&[
///     ("pg-a", "postgres://limiter@pg-a.internal/limits"),
///     ("pg-b", "postgres://limiter@pg-b.internal/limits"),
/// ])
/// .await?;
/// # Ok(()) }
/// ```
pub struct ShardedStore {
    shards: Vec<Shard>,
}

impl fmt::Debug for ShardedStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut list = f.debug_map();
        for shard in &self.shards {
            list.entry(&shard.name, &shard.store);
        }
        list.finish()
    }
}

/// Shards for a [`ShardedStore`], checked by [`build`](Self::build).
#[must_use = "a builder does nothing until `build` is called"]
#[derive(Default)]
pub struct ShardedStoreBuilder {
    shards: Vec<(String, Arc<dyn Store>)>,
}

impl fmt::Debug for ShardedStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.shards.iter().map(|(name, _)| name))
            .finish()
    }
}

impl ShardedStoreBuilder {
    /// Adds a shard: `store` holds the keys whose highest score is `name`'s. The name is the
    /// shard's identity for placement: keep it when the shard's server moves (a new URL moves
    /// no key); a new name moves keys.
    pub fn shard(self, name: impl Into<String>, store: impl Store) -> Self {
        self.shard_shared(name, Arc::new(store))
    }

    /// Adds a shard whose store is already shared.
    pub fn shard_shared(mut self, name: impl Into<String>, store: Arc<dyn Store>) -> Self {
        self.shards.push((name.into(), store));
        self
    }

    /// The store.
    ///
    /// # Errors
    ///
    /// [`ShardError::NoShards`], [`ShardError::EmptyName`] or [`ShardError::DuplicateName`].
    pub fn build(self) -> Result<ShardedStore, ShardError> {
        if self.shards.is_empty() {
            return Err(ShardError::NoShards);
        }
        let mut seen = std::collections::HashSet::new();
        for (index, (name, _)) in self.shards.iter().enumerate() {
            if name.trim().is_empty() {
                return Err(ShardError::EmptyName { index });
            }
            if !seen.insert(name.as_str()) {
                return Err(ShardError::DuplicateName { name: name.clone() });
            }
        }
        Ok(ShardedStore {
            shards: self
                .shards
                .into_iter()
                .map(|(name, store)| Shard { name, store })
                .collect(),
        })
    }
}

#[cfg(feature = "postgres")]
impl ShardedStore {
    /// A store over one PostgreSQL primary per `(name, connection string)`, each with the
    /// default [`PostgresStore`](crate::store::PostgresStore) settings; see
    /// [`connect_with`](Self::connect_with).
    ///
    /// # Errors
    ///
    /// As [`connect_with`](Self::connect_with).
    pub async fn connect<N, U>(shards: &[(N, U)]) -> Result<ShardedStore, ShardError>
    where
        N: AsRef<str>,
        U: AsRef<str>,
    {
        Self::connect_with(shards, |b| b).await
    }

    /// A store over one PostgreSQL primary per `(name, connection string)`. Each shard's
    /// [`PostgresStoreBuilder`](crate::store::PostgresStoreBuilder) is passed through
    /// `configure` (pool size, timeouts) and built (connecting and applying the migrations),
    /// all shards concurrently; each store is wrapped in its own
    /// [`CircuitBreaker`](crate::store::CircuitBreaker) named after the shard, so
    /// `tokenlease_circuit_state{store="NAME"}` reports each shard.
    ///
    /// # Errors
    ///
    /// [`ShardError::NoShards`], [`ShardError::EmptyName`], [`ShardError::DuplicateName`]
    /// before connecting anywhere; [`ShardError::Store`] naming the first shard (in the list's
    /// order) whose connection string did not parse or whose store could not be built. No
    /// error holds a password.
    pub async fn connect_with<N, U>(
        shards: &[(N, U)],
        configure: impl Fn(crate::store::PostgresStoreBuilder) -> crate::store::PostgresStoreBuilder,
    ) -> Result<ShardedStore, ShardError>
    where
        N: AsRef<str>,
        U: AsRef<str>,
    {
        use crate::store::{CircuitBreaker, PostgresStore};

        // Check the names before connecting anywhere.
        let mut check = ShardedStore::builder();
        for (name, _) in shards {
            check = check.shard(name.as_ref(), super::MemoryStore::new());
        }
        check.build()?;
        let mut builders = Vec::with_capacity(shards.len());
        for (name, url) in shards {
            let builder =
                PostgresStore::builder(url.as_ref()).map_err(|error| ShardError::Store {
                    shard: name.as_ref().to_owned(),
                    error,
                })?;
            builders.push((name.as_ref().to_owned(), configure(builder)));
        }
        let mut tasks = tokio::task::JoinSet::new();
        for (index, (name, builder)) in builders.into_iter().enumerate() {
            tasks.spawn(async move { (index, name, builder.build().await) });
        }
        let mut built: Vec<Option<(String, Result<PostgresStore, StoreError>)>> =
            (0..shards.len()).map(|_| None).collect();
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok((index, name, result)) => built[index] = Some((name, result)),
                Err(join) => {
                    return Err(ShardError::Store {
                        shard: String::new(),
                        error: StoreError::Protocol(format!("building a shard failed: {join}")),
                    });
                }
            }
        }
        let mut builder = ShardedStore::builder();
        for (name, result) in built.into_iter().flatten() {
            let store = result.map_err(|error| ShardError::Store {
                shard: name.clone(),
                error,
            })?;
            let breaker = CircuitBreaker::new(store).name(name.clone());
            builder = builder.shard(name, breaker);
        }
        builder.build()
    }
}

impl ShardedStore {
    /// Shards to check and build.
    pub fn builder() -> ShardedStoreBuilder {
        ShardedStoreBuilder::default()
    }

    /// How many shards.
    pub fn len(&self) -> usize {
        self.shards.len()
    }

    /// Always `false`: a sharded store has at least one shard.
    pub fn is_empty(&self) -> bool {
        self.shards.is_empty()
    }

    /// The shards' names, in the order they were given.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.shards.iter().map(|s| s.name.as_str())
    }

    /// The shard named `name`, if any.
    pub fn shard(&self, name: &str) -> Option<&Arc<dyn Store>> {
        self.shards
            .iter()
            .find(|s| s.name == name)
            .map(|s| &s.store)
    }

    /// The index (in the order given) of the shard holding `key`.
    pub fn shard_index(&self, key: &str) -> usize {
        pick(self.shards.iter().map(|s| s.name.as_str()), key).unwrap_or(0)
    }

    /// The name of the shard holding `key`.
    pub fn shard_name(&self, key: &str) -> &str {
        &self.shards[self.shard_index(key)].name
    }

    /// `items` grouped by shard: for each shard that holds any, its index and the positions
    /// of its items in `items`, in their order.
    fn split<T>(&self, items: &[T], key: impl Fn(&T) -> &str) -> Vec<(usize, Vec<usize>)> {
        let mut parts: Vec<Vec<usize>> = vec![Vec::new(); self.shards.len()];
        for (i, item) in items.iter().enumerate() {
            parts[self.shard_index(key(item))].push(i);
        }
        parts
            .into_iter()
            .enumerate()
            .filter(|(_, p)| !p.is_empty())
            .collect()
    }
}

type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

#[async_trait]
impl Store for ShardedStore {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        self.shards[self.shard_index(request.key)]
            .store
            .acquire(request)
            .await
    }

    /// Every request's answer, or the first failing shard's error. On error the parts sent to
    /// the other shards may have taken effect (their tokens count as spent: under-admission,
    /// never over-admission); [`acquire_each`](Store::acquire_each) says which.
    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        self.acquire_each(requests).await.into_iter().collect()
    }

    async fn acquire_each(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Vec<Result<Acquired, StoreError>> {
        let parts = self.split(requests, |r| r.key);
        if let [(shard, _)] = parts.as_slice() {
            return self.shards[*shard].store.acquire_each(requests).await;
        }
        let sent: Vec<Vec<AcquireRequest<'_>>> = parts
            .iter()
            .map(|(_, positions)| positions.iter().map(|&i| requests[i]).collect())
            .collect();
        let calls: Vec<Boxed<'_, Vec<Result<Acquired, StoreError>>>> = parts
            .iter()
            .zip(&sent)
            .map(|((shard, _), part)| self.shards[*shard].store.acquire_each(part))
            .collect();
        let answers = join_all(calls).await;
        let mut out: Vec<Option<Result<Acquired, StoreError>>> =
            requests.iter().map(|_| None).collect();
        for ((_, positions), answer) in parts.iter().zip(answers) {
            let mismatch = answer.len() != positions.len();
            let count = answer.len();
            for (k, &i) in positions.iter().enumerate() {
                out[i] = Some(if mismatch {
                    Err(StoreError::Protocol(format!(
                        "{count} answers for {} requests",
                        positions.len()
                    )))
                } else {
                    answer[k].clone()
                });
            }
        }
        out.into_iter().flatten().collect()
    }

    /// Sends every shard its part and sums the credits; the first failing shard's error if
    /// any failed. The other shards' returns were credited then, and a retry with the same ids
    /// credits them nothing more.
    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        let parts = self.split(returns, |r| r.key);
        let sent: Vec<Vec<GiveBack<'_>>> = parts
            .iter()
            .map(|(_, positions)| positions.iter().map(|&i| returns[i]).collect())
            .collect();
        let calls: Vec<Boxed<'_, Result<u64, StoreError>>> = parts
            .iter()
            .zip(&sent)
            .map(|((shard, _), part)| self.shards[*shard].store.give_back(part))
            .collect();
        let mut credited = 0u64;
        let mut failure = None;
        for answer in join_all(calls).await {
            match answer {
                Ok(n) => credited = credited.saturating_add(n),
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(credited),
        }
    }

    async fn give_back_each(&self, returns: &[GiveBack<'_>]) -> Vec<Result<(), StoreError>> {
        let parts = self.split(returns, |r| r.key);
        let sent: Vec<Vec<GiveBack<'_>>> = parts
            .iter()
            .map(|(_, positions)| positions.iter().map(|&i| returns[i]).collect())
            .collect();
        let calls: Vec<Boxed<'_, Vec<Result<(), StoreError>>>> = parts
            .iter()
            .zip(&sent)
            .map(|((shard, _), part)| self.shards[*shard].store.give_back_each(part))
            .collect();
        let answers = join_all(calls).await;
        let mut out: Vec<Option<Result<(), StoreError>>> = returns.iter().map(|_| None).collect();
        for ((_, positions), answer) in parts.iter().zip(answers) {
            let mismatch = answer.len() != positions.len();
            for (k, &i) in positions.iter().enumerate() {
                out[i] = Some(if mismatch {
                    Err(StoreError::Protocol(format!(
                        "{} answers for {} returns",
                        answer.len(),
                        positions.len()
                    )))
                } else {
                    answer[k].clone()
                });
            }
        }
        out.into_iter().flatten().collect()
    }

    /// Runs on every shard concurrently, up to `limit` rows each; the total deleted, or the
    /// first failing shard's error (the others deleted theirs).
    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        let calls: Vec<Boxed<'_, Result<u64, StoreError>>> = self
            .shards
            .iter()
            .map(|s| s.store.delete_idle(limit))
            .collect();
        let mut deleted = 0u64;
        let mut failure = None;
        for answer in join_all(calls).await {
            match answer {
                Ok(n) => deleted = deleted.saturating_add(n),
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(deleted),
        }
    }

    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        self.shards[self.shard_index(key)].store.inspect(key).await
    }

    fn call_timeout(&self) -> Option<Duration> {
        self.shards
            .iter()
            .filter_map(|s| s.store.call_timeout())
            .max()
    }

    /// The key's shard, so that the direct-mode limiter batches only keys of one shard
    /// together and a stalled shard delays no other shard's callers.
    fn partition(&self, key: &str) -> usize {
        self.shard_index(key)
    }

    fn max_concurrent_calls(&self) -> Option<usize> {
        let mut total = 0usize;
        for shard in &self.shards {
            total = total.saturating_add(shard.store.max_concurrent_calls()?);
        }
        Some(total)
    }

    /// The shard's own pool: the direct-mode limiter fills each shard's statements as it would
    /// a single store's.
    fn partition_calls(&self, part: usize) -> Option<usize> {
        self.shards.get(part)?.store.max_concurrent_calls()
    }
}

#[cfg(test)]
mod tests;
