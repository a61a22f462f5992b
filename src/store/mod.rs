//! Where buckets live: the [`Store`] contract and its two implementations.
//!
//! - `PostgresStore` (feature `postgres`): the shared store. Every call is one atomic SQL
//!   statement that refills by the database's `now()` and takes tokens; many service instances
//!   share its buckets.
//! - [`MemoryStore`]: the same contract inside one process, for single-instance services, tests,
//!   and as the embedded default where no database is wanted.
//!
//! Both pass the one contract suite in `tests/store/store_contract.rs`. [`ShardedStore`] spreads
//! keys over several stores (several PostgreSQL primaries) by rendezvous hashing.

use std::fmt;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::bucket::{BucketConfig, Tokens};

mod breaker;
mod cleanup;
mod counted;
mod error;
pub(crate) mod held;
mod memory;
pub(crate) mod metered;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
mod sharded;

pub use self::breaker::{CircuitBreaker, CircuitState};
pub use self::cleanup::IdleCleanup;
pub use self::counted::CountedStore;
#[cfg(feature = "postgres")]
pub use self::error::MigrateError;
pub use self::error::{StoreError, TimeoutKind, Unstorable};
pub use self::memory::{DEFAULT_MAX_KEYS, DEFAULT_MAX_RETURN_IDS, MemoryStore, RETURN_ID_TTL};
#[cfg(feature = "postgres")]
pub use self::postgres::migrate::{
    MIGRATION_LOCK_ID, MIGRATIONS, Migration, MigrationReport, migrate,
};
#[cfg(feature = "postgres")]
pub use self::postgres::{PostgresStore, PostgresStoreBuilder, acquire_many_sql, acquire_one_sql};
pub use self::sharded::{
    ShardError, ShardedStore, ShardedStoreBuilder, rendezvous_score, shard_of,
};

/// One request to take tokens from a key's bucket.
///
/// The store grants the largest multiple of `step` that is at most `want` and at most the
/// tokens there, if that is at least `min`; otherwise nothing. A plain take is
/// [`AcquireRequest::take`] (`min == want == step == cost`); `n` coalesced takes of one cost are
/// `min = step = cost, want = n × cost`; a lease accepts any amount from `min` to `want`
/// ([`AcquireRequest::lease`], `step` one nanotoken).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AcquireRequest<'a> {
    /// The bucket's key; already validated (see [`crate::key::validate_key`]).
    pub key: &'a str,
    /// The bucket's shape under the key's plan. A row stored with another shape takes this one.
    pub bucket: BucketConfig,
    /// Take nothing unless at least this many tokens are there. At most the capacity, and a
    /// multiple of `step`.
    pub min: Tokens,
    /// Take up to this many tokens.
    pub want: Tokens,
    /// Grant in multiples of this amount (not zero).
    pub step: Tokens,
    /// For a strict lease: the holder's entry this grant renews. `None` for plain takes and
    /// relaxed leases.
    pub hold: Option<Hold>,
}

/// A strict lease as the grant that renews it describes it (see `docs/design/strict-accounting.md`).
///
/// The store keeps one entry per holder and key: `kept + granted` tokens under `lease_id` until
/// `lifetime` after the store's now. The grant settles the holder's previous entry in the same
/// step: what it spent is gone, what it keeps carries on. While live, entries count against the
/// bucket's capacity: `tokens + outstanding ≤ capacity`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hold {
    /// Who holds the lease: random per lease slot of one process, never reused.
    pub holder: i64,
    /// Names this grant; a [`GiveBack`] settling the lease must name it.
    pub lease_id: i64,
    /// Tokens the holder still has from its previous lease (at most what that entry holds):
    /// an upper bound, read before the request is sent.
    pub kept: Tokens,
    /// How long the store counts the lease. The holder stops spending it earlier, on its own
    /// monotonic clock, measured from before it sent the request.
    pub lifetime: Duration,
}

/// The strict lease a [`GiveBack`] settles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseRef {
    /// The lease's holder.
    pub holder: i64,
    /// The id of the grant that made the lease what it is now.
    pub lease_id: i64,
}

impl<'a> AcquireRequest<'a> {
    /// Take exactly `cost`, or nothing.
    pub const fn take(key: &'a str, bucket: BucketConfig, cost: Tokens) -> Self {
        AcquireRequest {
            key,
            bucket,
            min: cost,
            want: cost,
            step: cost,
            hold: None,
        }
    }

    /// Take anything from `min` to `want`, to the nanotoken (the unit every store counts in).
    pub const fn lease(key: &'a str, bucket: BucketConfig, min: Tokens, want: Tokens) -> Self {
        AcquireRequest {
            key,
            bucket,
            min,
            want,
            step: Tokens::from_atto(1_000_000_000),
            hold: None,
        }
    }

    /// The same request, as a strict lease under `hold`.
    pub const fn held(self, hold: Hold) -> Self {
        AcquireRequest {
            hold: Some(hold),
            ..self
        }
    }

    /// What a bucket holding `available` tokens grants: the largest multiple of `step` up to
    /// `want` and `available`, if at least `min`; else zero. The SQL statement computes the same.
    pub fn grantable(&self, available: Tokens) -> Tokens {
        let step = std::cmp::max(self.step.as_atto(), 1);
        let whole_steps = Tokens::from_atto(available.as_atto() / step * step);
        let candidate = std::cmp::min(self.want, whole_steps);
        if candidate >= self.min && !candidate.is_zero() {
            candidate
        } else {
            Tokens::ZERO
        }
    }
}

/// What the store did with one [`AcquireRequest`].
///
/// A store of your own builds it with [`Acquired::new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Acquired {
    /// Tokens taken: zero, or between the request's `min` and `want`.
    pub granted: Tokens,
    /// Tokens left in the bucket after the take.
    pub remaining: Tokens,
    /// How long until `min` tokens will be there, if nobody else takes any; zero when granted.
    pub retry_after: Duration,
    /// How long until the bucket is full again, if nobody takes any.
    pub reset_after: Duration,
    /// The store's clock when it decided (PostgreSQL's `now()`).
    pub store_now: SystemTime,
}

impl Acquired {
    /// A store's answer: `granted` tokens taken (zero for a denial), `remaining` left after
    /// the take, `retry_after` until the request's `min` would be there (zero when granted),
    /// `reset_after` until the bucket is full, all as of `store_now`.
    pub const fn new(
        granted: Tokens,
        remaining: Tokens,
        retry_after: Duration,
        reset_after: Duration,
        store_now: SystemTime,
    ) -> Acquired {
        Acquired {
            granted,
            remaining,
            retry_after,
            reset_after,
            store_now,
        }
    }
}

/// Unused lease tokens going back to a bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GiveBack<'a> {
    /// Names this return: a retry of the same return must reuse it, so it credits once.
    pub id: i64,
    /// The bucket's key.
    pub key: &'a str,
    /// The bucket's shape under the key's plan.
    pub bucket: BucketConfig,
    /// Tokens to credit; the bucket is capped at its capacity (less the tokens still out on
    /// strict leases).
    pub amount: Tokens,
    /// For a strict lease: the lease this return settles. Its entry leaves the bucket, and the
    /// credit is at most what the entry held; nothing when the entry is already gone (settled,
    /// renewed under another id, or expired, when its tokens came back through the refill).
    pub lease: Option<LeaseRef>,
}

impl GiveBack<'_> {
    /// A new return's id for `key`: random (a hash of the key under fresh keys), non-negative,
    /// so that two returns of one key are credited as two.
    pub(crate) fn fresh_id(key: &str) -> i64 {
        (std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), key) >> 1) as i64
    }
}

/// A bucket as the store holds it, for `tokenlease inspect` and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketRow {
    /// The key.
    pub key: String,
    /// Tokens as of `updated_at`.
    pub tokens: Tokens,
    /// The bucket's capacity when it was last written.
    pub capacity: Tokens,
    /// The refill rate when it was last written, in tokens per second.
    pub refill_per_second: Tokens,
    /// When the bucket was last refilled (store time).
    pub updated_at: SystemTime,
    /// The store's clock now.
    pub store_now: SystemTime,
    /// Tokens the bucket holds at `store_now`, refilled.
    pub tokens_now: Tokens,
    /// Strict leases out on the bucket and still counted at `store_now`.
    pub leases: Vec<HeldLease>,
}

/// A strict lease as the store counts it (see [`Hold`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldLease {
    /// Who holds it.
    pub holder: i64,
    /// The grant that made it what it is.
    pub lease_id: i64,
    /// Tokens it counts against the capacity.
    pub amount: Tokens,
    /// When the store stops counting it (store time).
    pub expires_at: SystemTime,
}

/// The contract every bucket store keeps.
///
/// - **Atomic.** [`acquire`](Store::acquire) refills a bucket by the store's own clock and takes
///   tokens in one indivisible step: two callers never both take the same tokens, whatever
///   number of processes share the store.
/// - **Same arithmetic as the pure bucket.** For the same timeline a store decides exactly as
///   [`BucketState::grant`](crate::bucket::BucketState::grant) does, with the store's clock as
///   `now`.
/// - **An absent bucket is full.** The first request for a key sees `capacity` tokens, even when
///   many callers race to create it; and a bucket that has refilled to full may be deleted
///   ([`delete_idle`](Store::delete_idle)) without changing any later decision.
/// - **Time never rewinds.** A bucket's refill time never moves backwards, so a store clock that
///   steps back refills nothing and removes nothing.
/// - **Failures are errors, not decisions.** A store that cannot answer returns a [`StoreError`];
///   the limiter, not the store, decides what a failure means (the plan's fallback).
/// - **Timeouts are the store's job.** Every call returns within the store's configured call
///   timeout (plus scheduling), with [`StoreError::Timeout`] if it had to give up.
/// - **A key named twice is two calls.** Requests (or returns) of one multi-key call that name
///   the same key are decided as consecutive calls on that key, in request order: sixteen
///   takes of 1 on a bucket of 5 grant five. `PostgresStore` sends the second request of a key
///   in a second statement after the first (a call whose keys are distinct stays one).
/// - **One bad request fails alone.** In [`acquire_each`](Store::acquire_each) and
///   [`give_back_each`](Store::give_back_each), a request the store cannot hold (a key with a
///   character the database's encoding lacks, an amount beyond the table's bounds) gets its own
///   error ([`StoreError::Unstorable`], not sent), and a data error the database raises for a
///   many-key statement ([`StoreError::is_data_error`]) is narrowed down to the requests it
///   belongs to: every other request gets its real answer. Timeouts and connection failures
///   still fail the whole statement's requests.
///
/// # A store of your own
///
/// The trait is public so that a limiter can run over another database, and so that a store
/// can be wrapped ([`CircuitBreaker`], [`CountedStore`], a wrapper that injects faults in your
/// tests). [`MemoryStore`] is the reference: `tests/store/store_contract.rs` runs one suite against
/// it and `PostgresStore`, and a new store should pass it too.
/// Answer with [`Acquired::new`]. [`acquire_each`](Store::acquire_each),
/// [`give_back_each`](Store::give_back_each) and [`partition`](Store::partition) have default
/// bodies that suit a store whose calls succeed or fail as a whole; override them only for a
/// store whose keys can fail separately (as [`ShardedStore`] does), and forward them in a
/// wrapper.
///
/// The request types ([`AcquireRequest`], [`GiveBack`]) and the rows ([`BucketRow`],
/// [`HeldLease`]) are plain data with public fields, built by both sides. Their strict-lease
/// parts ([`AcquireRequest::hold`], [`GiveBack::lease`], [`BucketRow::leases`]: see [`Hold`])
/// are used only for plans with `accounting: strict`; for every other plan they are `None` and
/// empty. A store that does not keep strict leases must refuse a request with a `hold` (return
/// an error, which the plan's fallback then decides) rather than grant it as a plain take:
/// that would silently drop the bound strict accounting promises.
#[async_trait]
pub trait Store: Send + Sync + fmt::Debug + 'static {
    /// Refills the bucket and takes between `min` and `want` tokens if `min` are there.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the store could not decide (timeout, connection, database error).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: dropping the future after the store received the request may leave the
    /// tokens taken in the store without telling anyone (they count as spent).
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError>;

    /// Does [`acquire`](Store::acquire) for several keys at once (one statement in PostgreSQL
    /// when the keys are distinct). Results come in request order. Requests naming the same key
    /// are decided as consecutive calls, in request order (see the trait's contract).
    ///
    /// # Errors
    ///
    /// As [`acquire`](Store::acquire): the first failed request's error. The other requests
    /// may have taken effect; [`acquire_each`](Store::acquire_each) says which.
    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        let mut out = Vec::with_capacity(requests.len());
        for request in requests {
            out.push(self.acquire(*request).await?);
        }
        Ok(out)
    }

    /// Does [`acquire_many`](Store::acquire_many) and answers each request on its own: a
    /// store whose requests can fail separately (a [`ShardedStore`], where each key's shard
    /// answers or fails alone) gives every request that was decided its real answer, and an
    /// error only to those that were not. One answer per request, in request order.
    ///
    /// The limiter's multi-key callers (the direct-mode coalescer, the lease actor, the outage
    /// debt) call this method. The default calls `acquire_many` and gives its error to every
    /// request, which is right for a store whose calls take effect for all keys or for none
    /// ([`MemoryStore`]); a store of your own need not override it. `PostgresStore` overrides
    /// it to answer a request it cannot store, or one a data error belongs to, alone.
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](Store::acquire).
    async fn acquire_each(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Vec<Result<Acquired, StoreError>> {
        match self.acquire_many(requests).await {
            Ok(answers) if answers.len() == requests.len() => answers.into_iter().map(Ok).collect(),
            Ok(answers) => {
                let err = StoreError::Protocol(format!(
                    "{} answers for {} requests",
                    answers.len(),
                    requests.len()
                ));
                requests.iter().map(|_| Err(err.clone())).collect()
            }
            Err(err) => requests.iter().map(|_| Err(err.clone())).collect(),
        }
    }

    /// Does [`give_back`](Store::give_back) and says for each return whether it reached the
    /// store (`Ok`: credited, or known and credited before) or not (`Err`: retry it with the
    /// same id). One answer per return, in order. The default calls `give_back` and gives its
    /// outcome to every return; [`ShardedStore`] answers per shard.
    async fn give_back_each(&self, returns: &[GiveBack<'_>]) -> Vec<Result<(), StoreError>> {
        match self.give_back(returns).await {
            Ok(_) => returns.iter().map(|_| Ok(())).collect(),
            Err(err) => returns.iter().map(|_| Err(err.clone())).collect(),
        }
    }

    /// Credits unused lease tokens back to their buckets (refilled first, capped at capacity).
    /// A return whose id was already credited credits nothing: retrying after a timeout is
    /// safe. Returns naming the same key credit one after another, in order. Returns how many
    /// returns credited (a return to a key without a bucket, a full one, credits nothing).
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the store could not answer, or the first return it refused; the
    /// caller may retry with the same ids.
    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError>;

    /// Deletes up to `limit` buckets that have refilled to full (an absent bucket is a full
    /// bucket, so no decision changes). Returns how many were deleted.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the store could not answer.
    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError>;

    /// The bucket as stored now, or `None` when no row exists (the bucket is full).
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the store could not answer.
    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError>;

    /// The bound this store puts on one call, if it has one (see "Timeouts are the store's job"
    /// above). The direct-mode limiter gives each caller the same deadline by default. `None`
    /// unless the store says.
    fn call_timeout(&self) -> Option<Duration> {
        None
    }

    /// Which independent part of the store holds `key`: calls on keys of different parts may
    /// fail or stall separately (a [`ShardedStore`]'s shards), so the direct-mode limiter puts
    /// only keys of one part into one [`acquire_each`](Store::acquire_each), and a stalled
    /// part never delays another part's callers. `0` for every key unless the store says;
    /// wrappers forward it.
    fn partition(&self, key: &str) -> usize {
        let _ = key;
        0
    }

    /// How many calls the store runs at once (its connection pool), if that is bounded. The
    /// direct-mode limiter keeps at most this many statements in flight by default. `None`
    /// unless the store says.
    fn max_concurrent_calls(&self) -> Option<usize> {
        None
    }

    /// How many calls the part `part` of the store ([`partition`](Store::partition)) runs at
    /// once, if that is bounded: the direct-mode limiter keeps at most this many statements to
    /// that part in flight by default, and chooses how many within it from that part's own
    /// load. The default, [`max_concurrent_calls`](Store::max_concurrent_calls), suits a store
    /// of one part; a store of several parts with a pool each (a [`ShardedStore`]) says each
    /// part's; wrappers forward it.
    fn partition_calls(&self, part: usize) -> Option<usize> {
        let _ = part;
        self.max_concurrent_calls()
    }
}

/// Awaits every future of `futures`, polled together in the calling task, and returns their
/// outputs in order: a new session's prepares go out back to back and are answered in one
/// round trip, a pool's connections are opened side by side, and a sharded store's calls go to
/// every shard at once.
pub(crate) async fn join_all<F: std::future::Future>(
    futures: impl IntoIterator<Item = F>,
) -> Vec<F::Output> {
    let mut pinned: Vec<std::pin::Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = (0..pinned.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (slot, fut) in out.iter_mut().zip(pinned.iter_mut()) {
            if slot.is_none() {
                match fut.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *slot = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

/// Converts nanoseconds to a [`Duration`].
pub(crate) const fn nanos(n: u64) -> Duration {
    Duration::from_nanos(n)
}
