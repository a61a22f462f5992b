//! Giving a global token back when the entity layer denies.
//!
//! The [`Limiter`] has no refund call yet, so this credits the token straight into the shared
//! bucket with [`Store::give_back`](crate::store::Store::give_back) (idempotent by return id,
//! capped at capacity). That is exact for direct-mode plans. For a leased plan the token was
//! spent from this process's lease; crediting the shared row instead gives the same total back
//! to the endpoint, at the price of one statement. A `Limiter::refund` that credits the lease
//! word for leased plans would make it free; see the HTTP layer's docs.

use std::hash::{BuildHasher, RandomState};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::bucket::Tokens;
use crate::policy::Plan;
use crate::store::GiveBack;
use crate::{DecidedBy, Decision, Limiter};

/// Counter of refunds by result (`credited`, `failed`, `skipped`).
pub const HTTP_REFUNDS: &str = "tokenlease_http_refunds_total";

/// Gives back `cost` tokens that `decision` took from `key`. Returns whether they were credited.
///
/// Tokens granted by a fallback are not given back: the store did not hand them out, and while
/// it is failing a give-back would only wait for its timeout.
pub(crate) async fn refund(
    limiter: &Limiter,
    plan: &Plan,
    key: &str,
    cost: Tokens,
    decision: &Decision,
) -> bool {
    if !decision.allowed || matches!(decision.decided_by, DecidedBy::Fallback(_)) {
        metrics::counter!(HTTP_REFUNDS, "result" => "skipped").increment(1);
        return false;
    }
    let ret = GiveBack {
        id: next_id(),
        key,
        bucket: *plan.bucket(),
        amount: cost,
    };
    match limiter.store().give_back(&[ret]).await {
        Ok(_) => {
            metrics::counter!(HTTP_REFUNDS, "result" => "credited").increment(1);
            true
        }
        Err(_) => {
            metrics::counter!(HTTP_REFUNDS, "result" => "failed").increment(1);
            false
        }
    }
}

/// A fresh return id: 63 bits from a per-process random hasher over a counter, so ids from
/// different processes sharing a database do not collide in practice.
fn next_id() -> i64 {
    static STATE: OnceLock<RandomState> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let h = STATE.get_or_init(RandomState::new).hash_one(n);
    (h >> 1) as i64
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_are_non_negative_and_distinct() {
        let ids: std::collections::HashSet<i64> = (0..10_000).map(|_| super::next_id()).collect();
        assert_eq!(ids.len(), 10_000);
        assert!(ids.iter().all(|id| *id >= 0));
    }
}
