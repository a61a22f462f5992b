//! The lease table's counters as [`LeaseStats`]: what `Limiter::lease_stats` reports.

use std::sync::atomic::Ordering;

use super::{FallbackCause, Leases, actor};

/// Lease counters, in tokens, since the limiter started. Exact: every nanotoken leased is spent
/// by a caller, given back, stranded (a give-back that failed for good), waived (not sent back
/// to a bucket that had refilled to its capacity), or still held.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[non_exhaustive]
pub struct LeaseStats {
    /// Tokens granted to this process's leases by the store.
    pub leased: f64,
    /// Tokens given back to the store (expiry, eviction, shutdown).
    pub returned: f64,
    /// Tokens whose give-back failed for good (they count as spent in the store).
    pub stranded: f64,
    /// Tokens of relaxed leases that closed unspent after their bucket had refilled to its
    /// capacity since their grant (as far as this process knows): not sent back, since the
    /// store would cap the return away (docs/design/leases.md, "Waived returns").
    pub waived: f64,
    /// Tokens held in live leases now: how far this process can exceed its share right now.
    pub outstanding: f64,
    /// The most the keys in the table may hold in leases at once: for each key, its plan's
    /// largest lease (`max_fraction × capacity`, at least one token and at most
    /// `LeaseSettings::MAX_LEASE`). `outstanding` never
    /// exceeds it but for a call whose cost alone is larger (leased its whole cost); it is this
    /// process's term in the overshoot bound (`docs/design/leases.md`).
    pub outstanding_bound: f64,
    /// Keys in the lease table now.
    pub keys: usize,
    /// Store calls the actor made (refills and give-backs).
    pub store_calls: u64,
    /// Times the actor woke and went through its round (nudges, due leases, gauges). Not a
    /// stable interface: for tests and benchmarks of the actor's idle cost.
    #[doc(hidden)]
    pub actor_rounds: u64,
    /// Slots the actor looked at one by one: due-queue entries handled, slots visited by a scan
    /// for dropped nudges or by a pass for the outstanding gauge. Not a stable interface.
    #[doc(hidden)]
    pub actor_visits: u64,
    /// Lease actors started again after the previous one ended early (its tokio runtime was
    /// dropped, or it panicked).
    pub actor_restarts: u64,
    /// Tokens admitted on credit: calls of a new key that waited out `max_wait` for the key's
    /// refill and were admitted against it instead of going to the fallback (`docs/design/leases.md`,
    /// "Credit while a new key's refill is late").
    pub credit: f64,
    /// Tokens admitted on credit that no grant has paid yet: the next refill of the key asks
    /// for them on top of what it wants.
    pub credit_owed: f64,
    /// Tokens admitted on credit that were never paid (the key left the table first): admitted
    /// without the store, within the key's `B` (`outstanding_bound`).
    pub credit_unpaid: f64,
    /// Refill statements that timed out while the store was answering and were asked for
    /// again instead of failing (`docs/design/lease-credit.md`, "A refill that times out while the store
    /// answers"). Many of them mean the call timeout is short for this machine or database.
    pub late_refills: u64,
    /// Refill statements that failed: a database error, a refused connection, an open circuit
    /// breaker, or a timeout that was not late. Each sent its keys' callers to the fallback for
    /// 100 ms.
    pub failed_refills: u64,
    /// Calls of leased keys that the fallback decided because the key's last refill (or store
    /// call) failed less than 100 ms before.
    pub fallback_failing: u64,
    /// Calls that waited out their plan's `max_wait` for the key's refill and were not admitted
    /// on credit because no refill had answered in the last second, or one had failed since the
    /// last answer: the store is slow or failing, or this limiter's refills were quiet for a
    /// second (credit is given only on a recent answer).
    pub fallback_unanswered: u64,
    /// Calls that waited out `max_wait` and were not admitted on credit because the table had
    /// removed their key before (evicted idle or retired by a reload; a returning key gets no
    /// second credit, `docs/design/leases.md`), or a key sharing its bit in the filter of removed keys.
    pub fallback_returning: u64,
    /// Calls that waited out `max_wait` and were not admitted on credit because the key's
    /// grants and credit had reached its largest lease `B`.
    pub fallback_at_bound: u64,
    /// Calls of leased keys that the fallback decided for another reason: a plan that waits for
    /// nothing (`max_wait` zero), strict accounting (never on credit), a key the store had just
    /// called empty, the limiter stopping. Calls sent to the fallback because no lease actor
    /// could run are counted by the metric `tokenlease_lease_actor_unavailable_total` instead.
    pub fallback_other: u64,
}

impl Leases {
    /// Counters now.
    pub(crate) fn stats(&self) -> LeaseStats {
        let table = self.table.pin();
        // In u128: a table of leases of up to 2⁵⁶ nanotokens each passes u64 at 256 keys.
        let (outstanding, bound) = table.values().fold((0u128, 0u128), |(held, bound), s| {
            (
                held + u128::from(s.words().available()),
                bound + u128::from(actor::largest_lease(s, 0)),
            )
        });
        let tokens = |n: u128| n as f64 / 1e9;
        let fallback =
            |cause: FallbackCause| self.counters.fallback[cause as usize].load(Ordering::Relaxed);
        LeaseStats {
            leased: self.counters.leased.tokens(),
            returned: self.counters.returned.tokens(),
            stranded: self.counters.stranded.tokens(),
            waived: self.counters.waived.tokens(),
            outstanding: tokens(outstanding),
            outstanding_bound: tokens(bound),
            keys: table.len(),
            store_calls: self.counters.store_calls.load(Ordering::Acquire),
            actor_rounds: self.counters.actor_rounds.load(Ordering::Acquire),
            actor_restarts: self.counters.actor_restarts.load(Ordering::Acquire),
            actor_visits: self.counters.actor_visits.load(Ordering::Acquire),
            credit: self.counters.credit.tokens(),
            credit_owed: tokens(u128::from(self.credit.total())),
            credit_unpaid: self.counters.credit_unpaid.tokens(),
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
