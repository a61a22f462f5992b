//! The lease table's counters as [`LeaseStats`]: what `Limiter::lease_stats` reports.

use std::sync::atomic::Ordering;

use super::{FallbackCause, LeaseStats, Leases, actor};

impl Leases {
    /// Counters now.
    pub(crate) fn stats(&self) -> LeaseStats {
        let table = self.table.pin();
        let (outstanding, bound) = table.values().fold((0u64, 0u64), |(held, bound), s| {
            (
                held + s.words().available(),
                bound.saturating_add(actor::largest_lease(s, 0)),
            )
        });
        let tokens = |n: u64| n as f64 / 1e9;
        let fallback =
            |cause: FallbackCause| self.counters.fallback[cause as usize].load(Ordering::Relaxed);
        LeaseStats {
            leased: tokens(self.counters.leased.load(Ordering::Acquire)),
            returned: tokens(self.counters.returned.load(Ordering::Acquire)),
            stranded: tokens(self.counters.stranded.load(Ordering::Acquire)),
            waived: tokens(self.counters.waived.load(Ordering::Acquire)),
            outstanding: tokens(outstanding),
            outstanding_bound: tokens(bound),
            keys: table.len(),
            store_calls: self.counters.store_calls.load(Ordering::Acquire),
            actor_rounds: self.counters.actor_rounds.load(Ordering::Acquire),
            actor_restarts: self.counters.actor_restarts.load(Ordering::Acquire),
            actor_visits: self.counters.actor_visits.load(Ordering::Acquire),
            credit: tokens(self.counters.credit.load(Ordering::Acquire)),
            credit_owed: tokens(self.credit.total()),
            credit_unpaid: tokens(self.counters.credit_unpaid.load(Ordering::Acquire)),
            late_refills: self.counters.late_refills.load(Ordering::Relaxed),
            failed_refills: self.counters.failed_refills.load(Ordering::Relaxed),
            fallback_failing: fallback(FallbackCause::Failing),
            fallback_unanswered: fallback(FallbackCause::Unanswered),
            fallback_returning: fallback(FallbackCause::Returning),
            fallback_at_bound: fallback(FallbackCause::AtBound),
            fallback_other: fallback(FallbackCause::Other),
        }
    }
}
