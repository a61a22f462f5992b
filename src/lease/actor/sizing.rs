//! How large a key's lease is and how long a quiet one lives on: the key's demand, sampled
//! from what its callers spent, the lease size that demand calls for, the bound `B` no lease
//! exceeds, and whether a key that has gone silent is still expected to call.
//!
//! Apart because both the refill (which sizes a lease) and the expiry (which decides whether a
//! lease lives on) read these, and they are pure arithmetic over a slot's book.

use std::time::Duration;

use super::lease_settings;
use crate::lease::slot::{Book, Slot};
use crate::lease::word::TOKENS;
use crate::policy::{Accounting, LeaseSettings};

/// A relaxed lease is sized for this many lifetimes of demand (at most `B`): it lives on while
/// it is spent from, so this sets how often a quiet key is refilled (every 16 lifetimes, at the
/// low-water mark), which is what a million quiet keys cost the actor. Its unspent tokens are
/// out of the shared bucket whatever its size, so the overshoot bound (`N·B`) does not change.
const QUIET_LIFETIMES: f64 = 32.0;
/// A strict lease closes at its lifetime and is counted against the bucket until then, so it
/// holds only a few lifetimes of demand.
const QUIET_LIFETIMES_STRICT: f64 = 4.0;
/// A relaxed lease nobody spent from in its last lifetime lives on while its key has been
/// silent for fewer than this many of its expected gaps between calls (`expects_a_call`)...
const SILENT_CALLS: f64 = 4.0;
/// ... and for fewer than this many lifetimes ...
const SILENT_LIFETIMES: f64 = 8.0;
/// ... but at least this many, for any key that has been called since its first call (its demand
/// is above zero): demand is sampled at refills, whose windows end at the call that asked for
/// them, and reads high for a quiet key (a key called once a second, asked 0.3 s after the last
/// sample, reads 3.3 calls a second); gaps of three lifetimes come once in twenty calls of a
/// key called once a lifetime.
const FEWEST_SILENT_LIFETIMES: f64 = 3.0;
/// A relaxed key is sparse (sized no lease) when fewer than this many calls are expected over
/// the longest a relaxed lease lives without a call (`SILENT_LIFETIMES` lifetimes).
const SPARSE_CALLS: f64 = 2.0;

/// Whether a relaxed lease nobody spent from during its last lifetime is still expected to be
/// called soon: its key's demand says a call comes every `1 / rate`, and it has been silent
/// (since the actor last saw it spend) for less than [`SILENT_CALLS`] such gaps, kept between
/// [`FEWEST_SILENT_LIFETIMES`] and [`SILENT_LIFETIMES`] lifetimes. A key with no demand (never
/// called since its first call) closes at its lifetime. A key called about once a lifetime misses a whole lifetime
/// about a third of the time; closing its lease then sent its next call to wait for a refill,
/// and cost the store a statement to take a new lease (and, before `waives`, one to give the
/// old one back) about every third call. A key whose demand was high and stopped is silent for
/// many of its gaps within a lifetime and closes at its expiry as before.
pub(super) fn expects_a_call(book: &Book, settings: &LeaseSettings, now: u64) -> bool {
    let cost = book.max_cost.get().max(1) as f64;
    let calls_per_ns = f64::from(book.demand) / cost / 1e9;
    if calls_per_ns <= 0.0 {
        return false;
    }
    let silent = now.saturating_sub(book.active_at.near(now)) as f64;
    let ttl = settings.ttl.as_nanos() as f64;
    let allowed =
        (SILENT_CALLS / calls_per_ns).clamp(ttl * FEWEST_SILENT_LIFETIMES, ttl * SILENT_LIFETIMES);
    silent < allowed
}

/// Samples a slot's demand (nanotokens a second) if the last sample is at least `least` ns old:
/// what was spent since, over the time since, averaged with the estimate so far. Refills
/// sample (at least a millisecond apart), and so does a relaxed lease's expiry when a whole
/// lifetime has passed since, so a lease nobody spends from sees its key's estimate fall.
pub(super) fn sample_demand(
    book: &mut Book,
    available: u64,
    now: u64,
    least: u64,
    settings: &LeaseSettings,
) {
    let elapsed = now.saturating_sub(book.sampled_at.get());
    if elapsed >= least.max(1) {
        let spent = book.spent(available);
        let rate = (spent - book.spent_at_sample.get().min(spent)) as f64 * 1e9 / elapsed as f64;
        book.demand = if book.demand == 0.0 {
            rate as f32
        } else {
            (0.5 * f64::from(book.demand) + 0.5 * rate) as f32
        };
        book.watched |= elapsed >= settings.ttl.as_nanos() as u64;
        book.sampled_at.set(now);
        book.spent_at_sample.set(spent);
    }
}

/// The most a lease of `slot` holds (nanotokens): `B = max_fraction × capacity`, or the largest
/// cost a caller of the key waited for (`max_cost`) when that is more, since a lease must hold
/// one call's cost. This is the `B` of the overshoot bound (docs/design/leases.md); refunds and top-ups
/// never lift a lease above it.
pub(in crate::lease) fn largest_lease(slot: &Slot, max_cost: u64) -> u64 {
    let settings = lease_settings(slot);
    let capacity = u64::try_from(slot.plan.capacity().as_nanos()).unwrap_or(TOKENS);
    ((capacity as f64 * settings.max_fraction) as u64)
        .clamp(1, TOKENS)
        .max(max_cost.min(TOKENS))
}

/// The lease size (nanotokens) for a key spending `demand` nanotokens a second in calls of at
/// most `max_cost`, before the cap of `max_fraction × capacity`:
///
/// - **Sparse** (fewer than one call's cost expected over a strict lease's lifetime, or fewer
///   than [`SPARSE_CALLS`] over the [`SILENT_LIFETIMES`] a relaxed one may live): zero. The key gets
///   exactly what its waiting callers need, one batched refill per call, and nothing sits
///   leased for a lifetime only to be given back.
/// - Otherwise the largest of: a refresh interval of demand (what a hot key is sized by); a few
///   lifetimes of demand ([`QUIET_LIFETIMES`]), so that a quiet key is refilled every couple of
///   lifetimes instead of twice per refresh interval (a quiet key's lease sized to the refresh interval alone was a
///   fraction of one call, and every call waited for a refill); and enough that the part left at
///   the low-water mark serves the calls expected until a refill lands (`landing`), plus one.
pub(super) fn target_size(
    demand: f64,
    max_cost: u64,
    settings: &LeaseSettings,
    landing: Duration,
) -> u64 {
    let cost = max_cost.max(1) as f64;
    let lifetime = demand * settings.ttl.as_secs_f64();
    // What a lease may serve before it closes: a relaxed one lives on through up to
    // `SILENT_LIFETIMES` silent lifetimes of a key still expected to call (`expects_a_call`),
    // and its unspent tokens are mostly waived, not returned (`waives`).
    let longest = match settings.accounting {
        Accounting::Relaxed => lifetime * SILENT_LIFETIMES / SPARSE_CALLS,
        Accounting::Strict => lifetime,
    };
    if longest < cost {
        return 0;
    }
    let refresh = demand * settings.refresh.as_secs_f64();
    // A lease spent from during its lifetime lives on (`renew_if_spent`), so a quiet key's lease
    // is sized for a few lifetimes: its refills come every couple of lifetimes, and a million
    // quiet keys cost the actor hundreds of thousands of refills a second, not millions.
    let lifetime = lifetime
        * match settings.accounting {
            Accounting::Relaxed => QUIET_LIFETIMES,
            Accounting::Strict => QUIET_LIFETIMES_STRICT,
        };
    let until_landed = (demand * landing.as_secs_f64() + cost) / settings.low_water.max(0.01);
    refresh.max(lifetime).max(until_landed) as u64
}
