//! Refill, take, grant and credit on one bucket.

use std::cmp;

use super::tokens::{Rate, Tokens};

/// A point in time, in nanoseconds since an epoch the caller chooses (the Unix epoch for
/// database time, process start for a monotonic clock). Only differences matter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The instant `nanos` nanoseconds after the epoch.
    pub const fn from_nanos(nanos: u64) -> Timestamp {
        Timestamp(nanos)
    }

    /// Nanoseconds since the epoch.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Nanoseconds from `earlier` to `self`, or zero when `earlier` is later.
    pub const fn saturating_since(self, earlier: Timestamp) -> u64 {
        self.0.saturating_sub(earlier.0)
    }

    /// `self + nanos`, saturating at `u64::MAX`.
    pub const fn saturating_add(self, nanos: u64) -> Timestamp {
        Timestamp(self.0.saturating_add(nanos))
    }
}

/// A bucket's shape: how many tokens it holds at most and how fast it refills; or several
/// such limits on one key, taken from together ([`with_limit`](Self::with_limit), like
/// "10 a second and 10,000 a day").
///
/// [`capacity`](Self::capacity) and [`rate`](Self::rate) are the first limit's, the one of the
/// smallest capacity (limits are kept in order of capacity, then rate); [`limits`](Self::limits)
/// lists them all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BucketConfig {
    pub(super) capacity: Tokens,
    pub(super) rate: Rate,
    /// The other limits, in order (`more[..n_more]`; the rest hold [`super::more::UNUSED`]).
    pub(super) more: [super::more::Limit; super::more::MAX_MORE],
    /// How many of `more` are limits.
    pub(super) n_more: u8,
}

/// The request can never be satisfied: it asks for more than the bucket's capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cost {} is larger than the capacity {}", cost.trimmed(), capacity.trimmed())]
pub struct InsufficientCapacity {
    /// What was asked for.
    pub cost: Tokens,
    /// What the bucket can hold at most.
    pub capacity: Tokens,
}

/// Why [`BucketConfig::new`] refused a capacity: it names the bound and the value given.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BucketConfigError {
    /// More limits than [`BucketConfig::MAX_LIMITS`] on one bucket.
    #[error(
        "a bucket holds at most {} limits, got {count}",
        BucketConfig::MAX_LIMITS
    )]
    TooManyLimits {
        /// How many limits were given.
        count: usize,
    },
    /// A rate given as `tokens` per `period` that is zero, or faster than [`Rate::MAX`], or
    /// slower than one nanotoken a second ([`PlanBuilder`](crate::policy::PlanBuilder)).
    #[error(
        "rate {tokens} tokens per {period:?} is out of range (one nanotoken a second to 10^9 \
         tokens a second)"
    )]
    RateOutOfRange {
        /// The tokens given.
        tokens: u64,
        /// The period given.
        period: std::time::Duration,
    },
    /// Strict lease accounting asked of a plan of several limits, which holds only relaxed
    /// leases ([`PlanBuilder`](crate::policy::PlanBuilder)).
    #[error("strict lease accounting is not available on a plan of several limits")]
    StrictOnSeveralLimits,
    /// A plan built with no limit at all ([`PlanBuilder`](crate::policy::PlanBuilder)).
    #[error("no limit given: add one with per_second, per_minute, per_hour, per_day or per")]
    NoLimit,
    /// Below [`BucketConfig::MIN_CAPACITY`] (zero, or less than one nanotoken).
    #[error(
        "bucket capacity {} is below the smallest, one nanotoken (0.000000001 token)",
        capacity.trimmed()
    )]
    CapacityTooSmall {
        /// The capacity given.
        capacity: Tokens,
    },
    /// Above [`BucketConfig::MAX_CAPACITY`].
    #[error(
        "bucket capacity {} is above the largest, {} tokens (what the PostgreSQL table holds, \
         in nanotokens)",
        capacity.trimmed(),
        BucketConfig::MAX_CAPACITY_TOKENS
    )]
    CapacityTooLarge {
        /// The capacity given.
        capacity: Tokens,
    },
}

impl BucketConfig {
    /// The largest capacity, in whole tokens: 8 × 10⁹, what PostgreSQL's `bigint` capacity
    /// column holds in nanotokens (8 × 10¹⁸) with room for a refill's sum (migration 0007).
    /// Every store, the policy file (`policy::MAX_CAPACITY`) and `tokenlease check` hold to it,
    /// so a bucket that works over `MemoryStore` works over `PostgresStore` too.
    pub const MAX_CAPACITY_TOKENS: u64 = 8_000_000_000;
    /// The largest capacity: [`MAX_CAPACITY_TOKENS`](Self::MAX_CAPACITY_TOKENS) tokens.
    pub const MAX_CAPACITY: Tokens = Tokens::whole(Self::MAX_CAPACITY_TOKENS);
    /// The smallest capacity: one nanotoken, the unit every store counts in.
    pub const MIN_CAPACITY: Tokens = Tokens::from_nanos(1);

    /// A bucket of `capacity` tokens refilling at `rate` ([`Rate`] holds its own bounds: one
    /// nanotoken a second to [`Rate::MAX`]).
    ///
    /// # Errors
    ///
    /// [`BucketConfigError`] for a capacity below [`MIN_CAPACITY`](Self::MIN_CAPACITY) (zero)
    /// or above [`MAX_CAPACITY`](Self::MAX_CAPACITY): a bucket no store holds. Refused here,
    /// where the value is made, rather than by the store on every call (where a plan of
    /// capacity `u64::MAX`, a natural way to write "unlimited", failed each of its statements
    /// and the good keys batched with them).
    pub const fn new(capacity: Tokens, rate: Rate) -> Result<Self, BucketConfigError> {
        if capacity.as_atto() < Self::MIN_CAPACITY.as_atto() {
            Err(BucketConfigError::CapacityTooSmall { capacity })
        } else if capacity.as_atto() > Self::MAX_CAPACITY.as_atto() {
            Err(BucketConfigError::CapacityTooLarge { capacity })
        } else {
            Ok(BucketConfig {
                capacity,
                rate,
                more: [super::more::UNUSED; super::more::MAX_MORE],
                n_more: 0,
            })
        }
    }

    /// The most tokens the bucket holds.
    pub const fn capacity(&self) -> Tokens {
        self.capacity
    }

    /// How fast the bucket refills.
    pub const fn rate(&self) -> Rate {
        self.rate
    }

    /// Tokens that `elapsed` nanoseconds add, before the capacity cap: exactly `elapsed × rate`
    /// attotokens (nanoseconds × nanotokens per second).
    pub fn refill_amount(&self, elapsed: u64) -> Tokens {
        // elapsed < 2^64 and rate <= 10^18 < 2^60: the product fits in u128.
        Tokens::from_atto(elapsed as u128 * self.rate.as_nanos_per_second() as u128)
    }

    /// Nanoseconds until `deficit` more tokens have been refilled (rounded up), saturating at
    /// `u64::MAX`.
    pub fn time_to_refill(&self, deficit: Tokens) -> u64 {
        let rate = self.rate.as_nanos_per_second() as u128;
        // Attotokens over nanotokens per second: nanoseconds.
        let nanos = deficit.as_atto().div_ceil(rate);
        u64::try_from(nanos).unwrap_or(u64::MAX)
    }
}

/// What one bucket stores: exactly one database row, or one local bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BucketState {
    /// Tokens in the bucket at `last_refill`; never above the capacity.
    pub tokens: Tokens,
    /// When the bucket was last refilled; never moves backwards.
    pub last_refill: Timestamp,
}

/// The result of [`BucketState::take`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The cost was taken.
    Allowed {
        /// Tokens left after taking the cost.
        remaining: Tokens,
    },
    /// Not enough tokens; nothing was taken.
    Denied {
        /// Tokens in the bucket now.
        remaining: Tokens,
        /// Nanoseconds until the cost would be allowed, if nobody else takes tokens.
        retry_after: u64,
    },
}

impl Outcome {
    /// Whether the cost was taken.
    pub const fn is_allowed(&self) -> bool {
        matches!(self, Outcome::Allowed { .. })
    }
}

/// The result of [`BucketState::grant`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    /// Tokens granted: zero, or between the minimum and the wanted amount.
    pub granted: Tokens,
    /// Tokens left in the bucket after the grant.
    pub remaining: Tokens,
    /// Nanoseconds until the minimum could be granted; zero when it was granted.
    pub retry_after: u64,
}

impl BucketState {
    /// A full bucket at `now`: what an absent database row means.
    pub const fn full(config: &BucketConfig, now: Timestamp) -> Self {
        BucketState {
            tokens: config.capacity,
            last_refill: now,
        }
    }

    /// The state after refilling up to `now`. A `now` before `last_refill` refills nothing and
    /// leaves `last_refill` where it was. Tokens above the capacity (after the capacity was
    /// lowered) are cut to it.
    pub fn refill(self, config: &BucketConfig, now: Timestamp) -> BucketState {
        let elapsed = now.saturating_since(self.last_refill);
        let tokens = cmp::min(
            config.capacity,
            self.tokens.saturating_add(config.refill_amount(elapsed)),
        );
        BucketState {
            tokens,
            last_refill: cmp::max(self.last_refill, now),
        }
    }

    /// Refills up to `now`, then takes `cost` if that many tokens are there.
    ///
    /// A cost of zero is always allowed and takes nothing.
    ///
    /// # Errors
    ///
    /// [`InsufficientCapacity`] when `cost` exceeds the capacity: no wait would ever allow it.
    pub fn take(
        self,
        config: &BucketConfig,
        now: Timestamp,
        cost: Tokens,
    ) -> Result<(BucketState, Outcome), InsufficientCapacity> {
        let (state, grant) = self.grant(config, now, cost, cost)?;
        let outcome = if grant.granted == cost {
            Outcome::Allowed {
                remaining: grant.remaining,
            }
        } else {
            Outcome::Denied {
                remaining: grant.remaining,
                retry_after: grant.retry_after,
            }
        };
        Ok((state, outcome))
    }

    /// Refills up to `now`, then takes as many tokens as are there up to `want`, but only if at
    /// least `min` are there (a lease request). `want` below `min` is treated as `min`.
    ///
    /// # Errors
    ///
    /// [`InsufficientCapacity`] when `min` exceeds the capacity.
    pub fn grant(
        self,
        config: &BucketConfig,
        now: Timestamp,
        min: Tokens,
        want: Tokens,
    ) -> Result<(BucketState, Grant), InsufficientCapacity> {
        if min > config.capacity {
            return Err(InsufficientCapacity {
                cost: min,
                capacity: config.capacity,
            });
        }
        let want = cmp::max(min, want);
        let refilled = self.refill(config, now);
        if refilled.tokens >= min {
            let granted = cmp::min(want, refilled.tokens);
            let remaining = refilled.tokens.saturating_sub(granted);
            let state = BucketState {
                tokens: remaining,
                ..refilled
            };
            Ok((
                state,
                Grant {
                    granted,
                    remaining,
                    retry_after: 0,
                },
            ))
        } else {
            // A last_refill in the future (another writer's clock ran ahead) delays the refill.
            let ahead = refilled.last_refill.saturating_since(now);
            let wait = config.time_to_refill(min.saturating_sub(refilled.tokens));
            Ok((
                refilled,
                Grant {
                    granted: Tokens::ZERO,
                    remaining: refilled.tokens,
                    retry_after: ahead.saturating_add(wait),
                },
            ))
        }
    }

    /// Refills up to `now`, then puts `amount` back (unused lease tokens), capped at capacity.
    pub fn credit(self, config: &BucketConfig, now: Timestamp, amount: Tokens) -> BucketState {
        let refilled = self.refill(config, now);
        BucketState {
            tokens: cmp::min(config.capacity, refilled.tokens.saturating_add(amount)),
            ..refilled
        }
    }

    /// Nanoseconds from `now` until the bucket is full again, if nothing is taken.
    pub fn time_to_full(&self, config: &BucketConfig, now: Timestamp) -> u64 {
        let refilled = self.refill(config, now);
        let ahead = refilled.last_refill.saturating_since(now);
        ahead.saturating_add(config.time_to_refill(config.capacity.saturating_sub(refilled.tokens)))
    }
}

#[cfg(test)]
mod tests;
