//! Several limits on one bucket ("10 a second and 10,000 a day"), taken from together.
//!
//! A [`BucketConfig`] holds one to [`BucketConfig::MAX_LIMITS`] limits, each a capacity and a
//! rate, kept in order of capacity (then rate), so the first is the one of the smallest
//! capacity: [`BucketConfig::capacity`] is the largest cost any take can have. A take is granted
//! only when every limit holds the tokens, and then takes from each ([`LimitsState::grant`]);
//! all limits of a key are refilled to the same instant. A limit whose tokens are unknown (a
//! bucket stored before the limit was added) is full, as an absent bucket is.

use std::cmp;

use super::math::{BucketConfig, BucketConfigError, BucketState, Timestamp};
use super::more::{Limit, MAX_MORE, UNUSED};
use super::tokens::{Rate, Tokens};

impl BucketConfig {
    /// The most limits one bucket holds: 4.
    pub const MAX_LIMITS: usize = MAX_MORE + 1;

    /// The same bucket with one more limit of `capacity` tokens refilling at `rate`: a take
    /// then succeeds only when every limit holds its cost, and takes it from each. Limits are
    /// kept in order of capacity, then rate, whatever order they are added in.
    ///
    /// # Errors
    ///
    /// [`BucketConfigError`] for a capacity out of bounds (as [`BucketConfig::new`]) or a
    /// fifth limit ([`BucketConfigError::TooManyLimits`]).
    pub fn with_limit(
        self,
        capacity: Tokens,
        rate: Rate,
    ) -> Result<BucketConfig, BucketConfigError> {
        let added = BucketConfig::new(capacity, rate)?;
        let count = self.limit_count() + 1;
        if count > Self::MAX_LIMITS {
            return Err(BucketConfigError::TooManyLimits { count });
        }
        let mut all: Vec<(Tokens, Rate)> = self.limits().map(|l| (l.capacity, l.rate)).collect();
        all.push((added.capacity, added.rate));
        all.sort();
        let mut out = BucketConfig::new(all[0].0, all[0].1)?;
        for (i, &(capacity, rate)) in all[1..].iter().enumerate() {
            out.more[i] = Limit { capacity, rate };
        }
        out.n_more = (count - 1) as u8;
        Ok(out)
    }

    /// Every limit of the bucket as a one-limit bucket, the first (this one's
    /// [`capacity`](Self::capacity) and [`rate`](Self::rate)) first.
    pub fn limits(&self) -> impl ExactSizeIterator<Item = BucketConfig> + '_ {
        (0..self.limit_count()).map(|i| self.limit(i))
    }

    /// How many limits the bucket has (1 for a plain bucket).
    pub(crate) const fn limit_count(&self) -> usize {
        self.n_more as usize + 1
    }

    /// Whether the bucket has several limits.
    pub(crate) const fn is_multi(&self) -> bool {
        self.n_more > 0
    }

    /// Limit `i` (0 is the first) as a one-limit bucket.
    pub(crate) fn limit(&self, i: usize) -> BucketConfig {
        if i == 0 {
            BucketConfig {
                n_more: 0,
                more: [UNUSED; MAX_MORE],
                ..*self
            }
        } else {
            let l = self.more[i - 1];
            BucketConfig {
                capacity: l.capacity,
                rate: l.rate,
                more: [UNUSED; MAX_MORE],
                n_more: 0,
            }
        }
    }

    /// Nanoseconds until every limit holds `need`, its tokens now being `remaining` (one per
    /// limit, in order): the longest of the limits' waits. A limit missing from `remaining`
    /// is full.
    pub(crate) fn time_until_all(&self, remaining: &[Tokens], need: Tokens) -> u64 {
        self.limits()
            .enumerate()
            .map(|(i, l)| {
                let have = remaining.get(i).copied().unwrap_or(l.capacity);
                l.time_to_refill(need.saturating_sub(have))
            })
            .max()
            .unwrap_or(0)
    }

    /// Nanoseconds until every limit is full, its tokens now being `remaining`.
    pub(crate) fn time_until_full(&self, remaining: &[Tokens]) -> u64 {
        self.limits()
            .enumerate()
            .map(|(i, l)| {
                let have = remaining.get(i).copied().unwrap_or(l.capacity);
                l.time_to_refill(l.capacity.saturating_sub(have))
            })
            .max()
            .unwrap_or(0)
    }
}

/// The state of a bucket of several limits: each limit's tokens, all as of one instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LimitsState {
    /// Tokens of each limit, in the config's order (the first limit's first); the places
    /// beyond the config's limits are unused.
    pub(crate) tokens: [Tokens; BucketConfig::MAX_LIMITS],
    /// When every limit was last refilled.
    pub(crate) last_refill: Timestamp,
}

/// What [`LimitsState::grant`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MultiGrant {
    /// Tokens taken from every limit.
    pub(crate) granted: Tokens,
    /// The tokens of the limit that holds fewest after the take.
    pub(crate) remaining: Tokens,
    /// Nanoseconds until every limit holds `min` (zero when granted).
    pub(crate) retry_after: u64,
    /// Nanoseconds until every limit is full.
    pub(crate) reset_after: u64,
}

impl LimitsState {
    /// Every limit full at `now`.
    pub(crate) fn full(config: &BucketConfig, now: Timestamp) -> LimitsState {
        let mut tokens = [Tokens::ZERO; BucketConfig::MAX_LIMITS];
        for (i, l) in config.limits().enumerate() {
            tokens[i] = l.capacity();
        }
        LimitsState {
            tokens,
            last_refill: now,
        }
    }

    /// Limit `i`'s state.
    fn one(&self, i: usize) -> BucketState {
        BucketState {
            tokens: self.tokens[i],
            last_refill: self.last_refill,
        }
    }

    /// Every limit refilled to `now` (each as [`BucketState::refill`]).
    pub(crate) fn refill(self, config: &BucketConfig, now: Timestamp) -> LimitsState {
        let mut out = self;
        for (i, l) in config.limits().enumerate() {
            let s = self.one(i).refill(&l, now);
            out.tokens[i] = s.tokens;
            out.last_refill = s.last_refill;
        }
        out
    }

    /// Refills to `now`, then takes `grantable(least of the limits' tokens)` from every limit,
    /// where `grantable` is the request's rule (a multiple of its step, between its min and
    /// want, or zero). `min` is what the retry waits for.
    pub(crate) fn grant(
        self,
        config: &BucketConfig,
        now: Timestamp,
        min: Tokens,
        grantable: impl Fn(Tokens) -> Tokens,
    ) -> (LimitsState, MultiGrant) {
        let n = config.limit_count();
        let mut state = self.refill(config, now);
        let least = state.tokens[..n]
            .iter()
            .copied()
            .min()
            .unwrap_or(Tokens::ZERO);
        let granted = grantable(least);
        for t in &mut state.tokens[..n] {
            *t = t.saturating_sub(granted);
        }
        let remaining = state.tokens[..n]
            .iter()
            .copied()
            .min()
            .unwrap_or(Tokens::ZERO);
        let ahead = state.last_refill.saturating_since(now);
        let retry_after = if granted.is_zero() && !min.is_zero() {
            ahead.saturating_add(config.time_until_all(&state.tokens[..n], min))
        } else {
            0
        };
        let reset_after = ahead.saturating_add(config.time_until_full(&state.tokens[..n]));
        (
            state,
            MultiGrant {
                granted,
                remaining,
                retry_after,
                reset_after,
            },
        )
    }

    /// Refills to `now`, then credits `amount` to every limit, each capped at its capacity.
    pub(crate) fn credit(self, config: &BucketConfig, now: Timestamp, amount: Tokens) -> Self {
        let mut state = self.refill(config, now);
        for (i, l) in config.limits().enumerate() {
            state.tokens[i] = cmp::min(l.capacity(), state.tokens[i].saturating_add(amount));
        }
        state
    }

    /// Whether every limit is full at `now`.
    pub(crate) fn is_full(&self, config: &BucketConfig, now: Timestamp) -> bool {
        let state = self.refill(config, now);
        config
            .limits()
            .enumerate()
            .all(|(i, l)| state.tokens[i] >= l.capacity())
    }
}

/// Grants `want` (at most) to one request on several limits at once: the pure model of the
/// store's statement for buckets of several limits, for tests.
#[cfg(test)]
pub(crate) fn grant_all(
    state: LimitsState,
    config: &BucketConfig,
    now: Timestamp,
    cost: Tokens,
) -> (LimitsState, MultiGrant) {
    state.grant(config, now, cost, |least| {
        if least >= cost { cost } else { Tokens::ZERO }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    fn rate(per_second: u64) -> Rate {
        Rate::per_second(per_second).unwrap()
    }

    #[test]
    fn limits_are_kept_in_order_of_capacity() {
        let a = BucketConfig::new(Tokens::whole(100), rate(1))
            .unwrap()
            .with_limit(Tokens::whole(10), rate(10))
            .unwrap();
        let b = BucketConfig::new(Tokens::whole(10), rate(10))
            .unwrap()
            .with_limit(Tokens::whole(100), rate(1))
            .unwrap();
        assert_eq!(a, b);
        assert_eq!(a.capacity(), Tokens::whole(10));
        assert_eq!(a.limit_count(), 2);
        let caps: Vec<Tokens> = a.limits().map(|l| l.capacity()).collect();
        assert_eq!(caps, [Tokens::whole(10), Tokens::whole(100)]);
        let mut c = a;
        for _ in 0..2 {
            c = c.with_limit(Tokens::whole(5), rate(5)).unwrap();
        }
        assert_eq!(
            c.with_limit(Tokens::whole(5), rate(5)),
            Err(BucketConfigError::TooManyLimits { count: 5 })
        );
        assert!(
            !BucketConfig::new(Tokens::whole(1), rate(1))
                .unwrap()
                .is_multi()
        );
    }

    #[test]
    fn rates_per_minute_hour_day_and_period() {
        use std::time::Duration;
        assert_eq!(Rate::per_minute(60), Rate::per_second(1));
        assert_eq!(Rate::per_hour(3_600), Rate::per_second(1));
        assert_eq!(Rate::per_day(86_400), Rate::per_second(1));
        // 10,000 a day: 0.115740741 tokens a second, rounded to the nanotoken.
        assert_eq!(
            Rate::per_day(10_000).map(Rate::as_nanos_per_second),
            Some(115_740_741)
        );
        assert_eq!(
            Rate::per(3, Duration::from_millis(250)),
            Rate::per_second(12)
        );
        assert_eq!(Rate::per(1, Duration::ZERO), None);
        assert_eq!(Rate::per_minute(0), None);
        assert_eq!(Rate::per(u64::MAX, Duration::from_nanos(1)), None);
        // Below one nanotoken a second rounds to zero: refused.
        assert_eq!(Rate::per(1, Duration::from_secs(3_000_000_000)), None);
    }

    #[test]
    fn a_take_needs_every_limit_and_takes_from_each() {
        // 5 a second (burst 5) and 20 an hour.
        let hour = Rate::from_nanos_per_second(20 * SEC / 3600).unwrap();
        let config = BucketConfig::new(Tokens::whole(5), rate(5))
            .unwrap()
            .with_limit(Tokens::whole(20), hour)
            .unwrap();
        let mut s = LimitsState::full(&config, Timestamp::from_nanos(0));
        let mut admitted = 0;
        for ms in (0..8_000).step_by(10) {
            let (next, g) = grant_all(
                s,
                &config,
                Timestamp::from_nanos(ms * 1_000_000),
                Tokens::whole(1),
            );
            s = next;
            if !g.granted.is_zero() {
                admitted += 1;
            } else {
                assert!(g.retry_after > 0);
            }
        }
        assert_eq!(admitted, 20);
        let (_, g) = grant_all(s, &config, Timestamp::from_nanos(8 * SEC), Tokens::whole(1));
        assert!(g.granted.is_zero());
        assert!(g.retry_after >= 60 * SEC, "{}", g.retry_after);
        assert!(
            g.remaining < Tokens::whole(1),
            "the hour binds: {:?}",
            g.remaining
        );
    }
}
