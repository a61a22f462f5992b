//! Giving a global token back when the entity layer denies.
//!
//! [`Limiter::refund`] puts the token back into this process's lease for a leased plan (no
//! statement at all), and into the shared row otherwise (idempotent by return id, capped at
//! capacity).

use crate::bucket::Tokens;
use crate::metrics::HTTP_REFUNDS;
use crate::policy::Plan;
use crate::{DecidedBy, Decision, Limiter};

/// Registers `tokenlease_http_refunds_total` of every `result` at zero.
pub(crate) fn register_at_zero() {
    for result in ["credited", "failed", "skipped"] {
        metrics::counter!(HTTP_REFUNDS, "result" => result).increment(0);
    }
}

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
    match limiter.refund(plan, key, cost.as_f64()).await {
        Ok(true) => {
            metrics::counter!(HTTP_REFUNDS, "result" => "credited").increment(1);
            true
        }
        Ok(false) | Err(_) => {
            metrics::counter!(HTTP_REFUNDS, "result" => "failed").increment(1);
            false
        }
    }
}
