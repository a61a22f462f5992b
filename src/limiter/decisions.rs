//! The [`Decision`]s a call returns, built from what decided it: the store's answer, a lease
//! (allowed or denied), and a shadow plan's denial turned into an admission.
//!
//! Apart because each decider's decision says only what that decider knows, and the fast path
//! builds a lease's in place: the fields are set here once for every caller.

use std::time::Duration;

use super::{DecidedBy, Decision};
use crate::bucket::Tokens;
use crate::policy::Plan;
use crate::store::Acquired;

/// A shadow plan's denial becomes an admission marked [`Decision::would_deny`]; every other
/// decision is returned as it is. Nothing else changes: no token was taken for it.
#[inline]
pub(super) fn shadowed(plan: &Plan, mut decision: Decision) -> Decision {
    if plan.shadow() && !decision.allowed {
        decision.allowed = true;
        decision.would_deny = true;
    }
    decision
}

/// The store's answer as a decision.
pub(super) fn from_store(plan: &Plan, acquired: &Acquired) -> Decision {
    Decision {
        allowed: !acquired.granted.is_zero(),
        would_deny: false,
        remaining: Some(std::cmp::min(acquired.remaining, plan.capacity())),
        limit: plan.capacity(),
        retry_after: acquired.retry_after,
        reset_after: Some(acquired.reset_after),
        decided_by: DecidedBy::Store,
        store_time: Some(acquired.store_now),
    }
}

/// What a take from a live lease left ([`Limiter::take_now`](super::Limiter::take_now)), in nanotokens: the lease's own
/// tokens and what the store had when it granted the lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LeaseLeft {
    /// Left in the lease.
    pub(crate) left: u64,
    /// The store's count when it granted the lease.
    pub(crate) store_remaining: u64,
}

impl LeaseLeft {
    /// Whole tokens an allowed decision reports: the two counts' sum, at most `capacity`
    /// ([`lease_allowed`]'s `remaining`).
    pub(crate) fn remaining(self, capacity: Tokens) -> Tokens {
        std::cmp::min(
            Tokens::from_nanos(u128::from(self.left) + u128::from(self.store_remaining)),
            capacity,
        )
    }
}

pub(super) fn lease_allowed(plan: &Plan, left: u64, store_remaining: u64) -> Decision {
    lease_allowed_at(plan.capacity(), left, store_remaining)
}

/// [`lease_allowed`] for a plan of this `capacity`.
pub(super) fn lease_allowed_at(capacity: Tokens, left: u64, store_remaining: u64) -> Decision {
    Decision {
        allowed: true,
        would_deny: false,
        // The lease's tokens were taken from the bucket: beside what the bucket held then,
        // they can add up to more than it ever holds.
        remaining: Some(
            LeaseLeft {
                left,
                store_remaining,
            }
            .remaining(capacity),
        ),
        limit: capacity,
        retry_after: Duration::ZERO,
        // The lease spends tokens granted earlier: the bucket's fill is not known here.
        reset_after: None,
        decided_by: DecidedBy::Lease,
        store_time: None,
    }
}

pub(super) fn lease_denied(plan: &Plan, retry_after: u64) -> Decision {
    Decision {
        allowed: false,
        would_deny: false,
        remaining: Some(Tokens::ZERO),
        limit: plan.capacity(),
        retry_after: Duration::from_nanos(retry_after),
        // The store's last word says when the cost is back, not when the bucket is full.
        reset_after: None,
        decided_by: DecidedBy::Lease,
        store_time: None,
    }
}
