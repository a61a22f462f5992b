//! What the HTTP layer asks of the limiter without awaiting: a take from a live lease under a
//! plan resolved once (its registry index, so the lease table records it and counts on its
//! counters without a lookup by name), a give-back into the lease, and tokio's clock now.
//!
//! Apart from `call.rs` because these never reach the store: each answers from memory or says
//! that it cannot, and the caller takes the full path then.

use std::sync::Arc;

use super::Limiter;
use super::cost::{check_leased_call, lease_cost, validate_cost};
use super::decisions::LeaseLeft;
use crate::lease::{Fast, Hint, MAX_LEASE_NANOS, Pinned};
use crate::policy::Plan;

impl Limiter {
    /// The limiter's own `Arc` of `plan` and its index in the plan registry, when the policies
    /// in force hold a plan equal to it: a caller that keeps them takes the lease table's
    /// fast path ([`take_now`](Self::take_now)). `None` for a plan the policies do not hold.
    pub(crate) fn resolve_plan(&self, plan: &Plan) -> Option<(Arc<Plan>, u32)> {
        let loaded = self.inner.policies.read();
        let loaded = loaded.as_ref()?;
        let (shared, index) = loaded.find(plan)?;
        Some((Arc::clone(shared), index))
    }

    /// What one token of `plan` costs a lease, in nanotokens, when [`take_now`](Self::take_now)
    /// can answer for the plan at all: a leased plan, not in shadow mode, whose capacity holds a
    /// token. Worked out once, where the plan is chosen (the HTTP layer's limits), so that a
    /// take does not check the plan and convert the cost again.
    pub(crate) fn lease_token_nanos(plan: &Plan) -> Option<u64> {
        if plan.lease().is_none() || plan.shadow() {
            return None;
        }
        let nanos = lease_cost(validate_cost(plan, 1.0).ok()?);
        (nanos <= MAX_LEASE_NANOS).then_some(nanos)
    }

    /// Takes one token of `key` under `plan` from its live lease, never waiting: what the
    /// lease holds now and what the store had when it granted the lease, in nanotokens (the
    /// allowed decision's `remaining` is their sum, at most the capacity: `lease_allowed`, which
    /// the caller computes only if it reports it). `None` when the take needs the store, the
    /// actor or the fallback (no live lease holding a token), and nothing was taken. `nanos` is
    /// [`lease_token_nanos`](Self::lease_token_nanos) of `plan`, and `index` the plan's registry
    /// index from [`resolve_plan`](Self::resolve_plan), with the `Arc` it gave.
    ///
    /// `key` has the shape the store takes (the HTTP layer takes this path only for limits
    /// whose keys do: `route::leasable`); the scan for NUL bytes is left to a key new to the
    /// lease table, which is checked in full before it goes in.
    ///
    /// `pinned` is the lease table as pinned by an earlier take of the same request, or `None`,
    /// pinned here then (and left for the next take): a request checked against several limits
    /// pins the table once. `hint` is where `key` was last found, for a caller that always
    /// takes the same key with it (`Hint`).
    #[inline]
    pub(crate) fn take_now<'a>(
        &'a self,
        pinned: &mut Option<Pinned<'a>>,
        plan: &Arc<Plan>,
        nanos: u64,
        index: Option<u32>,
        key: &str,
        hint: Option<&Hint>,
    ) -> Option<LeaseLeft> {
        let chosen = index.map(|i| (plan, i));
        let table = pinned.get_or_insert_with(|| self.leases().pin());
        match table.try_take(plan, chosen, key, nanos, &self.inner.plans, hint) {
            Fast::Taken {
                left,
                store_remaining,
            } => Some(LeaseLeft {
                left,
                store_remaining,
            }),
            _ => None,
        }
    }

    /// Gives one token of `key` back into this process's live lease under `plan` (a relaxed
    /// lease only, as [`refund`](Self::refund) does first), never waiting: whether it went in.
    /// When it did not, the token goes to the store ([`refund`](Self::refund)) or is counted
    /// as spent.
    pub(crate) fn refund_now(&self, plan: &Plan, key: &str) -> bool {
        let relaxed = plan
            .lease()
            .is_some_and(|l| l.accounting == crate::policy::Accounting::Relaxed);
        if !relaxed || plan.shadow() {
            return false;
        }
        let Ok(cost) = check_leased_call(plan, key, 1.0) else {
            return false;
        };
        self.inner
            .leases
            .get()
            .is_some_and(|leases| leases.refund(key, lease_cost(cost)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::{BucketConfig, Rate, Tokens};
    use crate::policy::LeaseSettings;

    fn plan(capacity_nanos: u128) -> Plan {
        let bucket = BucketConfig::new(
            Tokens::from_nanos(capacity_nanos),
            Rate::per_second(1).expect("rate"),
        )
        .expect("bucket");
        Plan::new("p", bucket)
    }

    /// A token's lease cost is worked out for a leased plan alone: a direct-mode plan, a shadow
    /// plan and a plan whose capacity holds less than a token take the full path.
    #[test]
    fn a_token_costs_a_lease_of_a_leased_plan_a_billion_nanotokens() {
        let leased = plan(5_000_000_000).with_lease(LeaseSettings::default());
        assert_eq!(Limiter::lease_token_nanos(&leased), Some(1_000_000_000));
        assert_eq!(Limiter::lease_token_nanos(&plan(5_000_000_000)), None);
        let shadow = leased.clone().with_shadow(true);
        assert_eq!(Limiter::lease_token_nanos(&shadow), None);
        let small = plan(500_000_000).with_lease(LeaseSettings::default());
        assert_eq!(Limiter::lease_token_nanos(&small), None);
    }
}
