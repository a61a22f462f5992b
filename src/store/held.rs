//! Strict lease accounting as arithmetic: the leases out on one bucket, and the refill capped by
//! them. [`MemoryStore`](super::MemoryStore) keeps its buckets with this; the SQL functions of
//! `migrations/0003_add_held_leases.sql` compute the same, term by term.

use std::cmp;

use super::{Hold, LeaseRef};
use crate::bucket::{BucketConfig, BucketState, Timestamp, Tokens};

/// One strict lease out on a bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) holder: i64,
    pub(crate) lease_id: i64,
    pub(crate) amount: Tokens,
    pub(crate) expires_at: Timestamp,
}

/// Tokens the entries live at `at` hold.
pub(crate) fn outstanding(leases: &[Entry], at: Timestamp) -> Tokens {
    leases
        .iter()
        .filter(|l| l.expires_at > at)
        .fold(Tokens::ZERO, |sum, l| sum.saturating_add(l.amount))
}

/// What `holder`'s live entry holds at `at`.
fn held_by(leases: &[Entry], holder: i64, at: Timestamp) -> Tokens {
    leases
        .iter()
        .filter(|l| l.holder == holder && l.expires_at > at)
        .fold(Tokens::ZERO, |sum, l| sum.saturating_add(l.amount))
}

/// The bucket refilled to `now`, never above capacity less the tokens out on live leases; see
/// `tokenlease_refill_held` in the migration for why each term is there.
pub(crate) fn refill(
    state: BucketState,
    config: &BucketConfig,
    leases: &[Entry],
    now: Timestamp,
) -> BucketState {
    let plain = state.refill(config, now);
    if leases.is_empty() {
        return plain;
    }
    let capacity = config.capacity();
    let mut tokens = cmp::min(
        plain.tokens,
        capacity.saturating_sub(outstanding(leases, now)),
    );
    let since = state.last_refill;
    let last_expiry = leases
        .iter()
        .map(|l| l.expires_at)
        .filter(|&e| e > since && e <= now)
        .max();
    if let Some(expiry) = last_expiry {
        let lowest_cap = capacity.saturating_sub(outstanding(leases, since));
        let after = lowest_cap.saturating_add(config.refill_amount(now.saturating_since(expiry)));
        tokens = cmp::min(tokens, after);
    }
    BucketState { tokens, ..plain }
}

/// A grant under `hold` (or a plain take): the tokens available to it, after debiting whatever
/// the holder claims to keep beyond its live entry.
pub(crate) fn available(
    refilled: Tokens,
    leases: &[Entry],
    hold: Option<&Hold>,
    now: Timestamp,
) -> Tokens {
    match hold {
        None => refilled,
        Some(hold) => {
            let excess = hold.kept.saturating_sub(held_by(leases, hold.holder, now));
            refilled.saturating_sub(excess)
        }
    }
}

/// The live entries after a grant of `granted` under `hold`: the holder's entry replaced by one
/// of kept + granted tokens (none when that is zero).
pub(crate) fn hold(leases: &mut Vec<Entry>, hold: Option<&Hold>, granted: Tokens, now: Timestamp) {
    leases.retain(|l| l.expires_at > now && hold.is_none_or(|h| l.holder != h.holder));
    if let Some(h) = hold {
        let amount = h.kept.saturating_add(granted);
        if !amount.is_zero() {
            let lifetime = u64::try_from(h.lifetime.as_nanos()).unwrap_or(u64::MAX);
            leases.push(Entry {
                holder: h.holder,
                lease_id: h.lease_id,
                amount,
                expires_at: now.saturating_add(lifetime),
            });
        }
    }
}

/// Settles lease `lease` with `amount` unspent tokens: its entry leaves (if still live and still
/// that lease) and the credit, at most what the entry held, is returned. Expired entries leave
/// too.
pub(crate) fn release(
    leases: &mut Vec<Entry>,
    lease: &LeaseRef,
    amount: Tokens,
    now: Timestamp,
) -> Tokens {
    let mut credit = Tokens::ZERO;
    leases.retain(|l| {
        let live = l.expires_at > now;
        let settled = live && l.holder == lease.holder && l.lease_id == lease.lease_id;
        if settled {
            credit = cmp::min(amount, l.amount);
        }
        live && !settled
    });
    credit
}
