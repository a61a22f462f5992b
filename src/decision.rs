//! [`Decision`]: the answer to one call of the limiter, and [`DecidedBy`], who made it.
//!
//! Only the limiter and its fallback make decisions; the metrics count them and the HTTP layer
//! turns them into responses. Kept apart from `limiter` so that everything that reads a decision
//! can depend on it without depending on the limiter.

use std::time::{Duration, SystemTime};

use crate::bucket::Tokens;
use crate::policy::FallbackMode;

/// Who made a [`Decision`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecidedBy {
    /// The shared store (one statement in PostgreSQL).
    Store,
    /// This process's lease on the key: tokens reserved from the store earlier, or the store's
    /// last word that the bucket is empty until `retry_after`.
    Lease,
    /// The plan's fallback, because the store failed or timed out.
    Fallback(FallbackMode),
}

/// The answer to one [`Limiter::try_acquire`](crate::Limiter::try_acquire). A denial is a
/// decision, not an error.
///
/// Only the limiter makes decisions; read the fields. What each one holds depends on who
/// decided ([`decided_by`](Self::decided_by)):
///
/// | decided by | `remaining` | `reset_after` |
/// |---|---|---|
/// | [`DecidedBy::Store`] | the bucket after this take | until the bucket is full |
/// | [`DecidedBy::Lease`] | an estimate (below) | `None` |
/// | `Fallback(Local)` | this instance's share of the bucket (`None` when it keeps none for the key) | until that share is full (ditto) |
/// | `Fallback(Allow)`, `Fallback(Deny)` | `None` | `None` |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
#[must_use = "a decision says whether the request may go ahead"]
pub struct Decision {
    /// Whether the request may go ahead: the cost was taken, or a shadow plan denied it and
    /// lets it through ([`would_deny`](Self::would_deny)).
    pub allowed: bool,
    /// A plan in shadow mode ([`Plan::with_shadow`](crate::policy::Plan::with_shadow)) denied the cost and lets the request
    /// through: `allowed` is `true`, no token was taken, and the other fields are the denial's
    /// (`retry_after` included). Always `false` for an enforcing plan.
    pub would_deny: bool,
    /// Tokens left in the bucket after this decision, as far as the decider knows; never more
    /// than [`limit`](Self::limit).
    ///
    /// From the store, exact at its clock. From a lease, an estimate: the tokens left in this
    /// process's lease plus what the store had left when it granted the lease (other
    /// instances may have taken some since, and the refill may have added some), at most the
    /// capacity; zero when the lease's last word is that the bucket is empty. From the `local` fallback, what this
    /// instance's share of the bucket holds (`None` when it keeps no share for the key: the
    /// cost exceeds the share, or the local buckets are at their bound). `None` when the `allow` or `deny` fallback
    /// decided: the store did not answer, and nothing knows what the shared bucket holds.
    pub remaining: Option<Tokens>,
    /// The bucket's capacity.
    pub limit: Tokens,
    /// When denied: how long until the cost would be allowed if nobody else takes tokens.
    /// Zero when allowed. From the `allow` or `deny` fallback, a retry hint (1 s for a
    /// denial), not a promise.
    pub retry_after: Duration,
    /// How long until the bucket is full again if nobody takes tokens. `None` when the decider
    /// cannot know it: a lease (this process spends tokens the store granted earlier without
    /// reading the bucket again), and the `allow` and `deny` fallbacks.
    pub reset_after: Option<Duration>,
    /// Who decided.
    pub decided_by: DecidedBy,
    /// The store's clock when it decided (PostgreSQL's `now()`); `None` when the store did not
    /// decide.
    pub store_time: Option<SystemTime>,
}
