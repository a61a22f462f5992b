//! What decides when the store cannot: allow, deny, or a local bucket per key.
//!
//! The plan's [`FallbackMode`] is applied to one request whenever its store call fails or times
//! out. `Local` keeps an in-process bucket per key holding `1 / instances` of the plan's capacity
//! and rate, so `instances` processes deciding alone together stay near the shared limit.

use std::time::Duration;

use crate::bucket::{BucketConfig, Rate, Tokens};
use crate::limiter::{DecidedBy, Decision};
use crate::policy::{FallbackMode, Plan};
use crate::store::{AcquireRequest, MemoryStore, Store};

/// The local buckets of [`FallbackMode::Local`], shared by every plan of one limiter.
#[derive(Debug, Default, Clone)]
pub(crate) struct Fallback {
    local: MemoryStore,
}

impl Fallback {
    /// Decides `cost` on `key` under `plan`'s fallback mode.
    pub(crate) async fn decide(&self, plan: &Plan, key: &str, cost: Tokens) -> Decision {
        let limit = plan.capacity();
        let decision = |allowed: bool, remaining: Tokens, retry_after: Duration| Decision {
            allowed,
            remaining,
            limit,
            retry_after,
            reset_after: Duration::ZERO,
            decided_by: DecidedBy::Fallback(plan.fallback().mode),
            store_time: None,
        };
        match plan.fallback().mode {
            FallbackMode::Allow => decision(true, limit, Duration::ZERO),
            // Nothing says when the store is back: a short retry hint, not a promise.
            FallbackMode::Deny => decision(false, Tokens::ZERO, Duration::from_secs(1)),
            FallbackMode::Local { instances } => {
                let share = local_share(plan.bucket(), instances.get());
                if cost > share.capacity() {
                    return decision(false, Tokens::ZERO, Duration::from_secs(1));
                }
                match self
                    .local
                    .acquire(AcquireRequest::take(key, share, cost))
                    .await
                {
                    Ok(a) => Decision {
                        reset_after: a.reset_after,
                        ..decision(!a.granted.is_zero(), a.remaining, a.retry_after)
                    },
                    Err(_) => decision(false, Tokens::ZERO, Duration::from_secs(1)),
                }
            }
        }
    }
}

/// One instance's share of a bucket: capacity and rate divided by `instances` (at least one
/// attotoken of capacity and one nanotoken per second of rate).
pub(crate) fn local_share(bucket: &BucketConfig, instances: u32) -> BucketConfig {
    let n = u128::from(instances.max(1));
    let capacity = Tokens::from_atto((bucket.capacity().as_atto() / n).max(1));
    let rate = Rate::from_nanos_per_second(
        (bucket.rate().as_nanos_per_second() / instances.max(1) as u64).max(1),
    )
    .unwrap_or(bucket.rate());
    BucketConfig::new(capacity, rate).unwrap_or(*bucket)
}
