//! A call's cost checked and converted: to tokens (refusing what can never be allowed), to a
//! lease word's whole nanotokens, and with the key's cheap checks for a call a lease may pay.
//!
//! Apart because every way into the limiter checks a cost the same way, and these run inline
//! on the fast path, their rare cases kept out of line.

use crate::bucket::Tokens;
use crate::error::Error;
use crate::key::validate_key;
use crate::policy::Plan;

/// A cost in whole nanotokens, the lease word's unit (rounded up).
/// Checks a call's cost and its key's length and first byte (the one reserved for shadow
/// plans' keys), leaving the key's scan for NUL bytes to the caller: a key the lease table holds was scanned when it went in (`Leases::try_take` refuses
/// one with a NUL), so a call answered from a lease needs no scan, and every other answer runs
/// [`validate_key`] in full before it is given. Errors come in [`validate_key`]'s order, key
/// before cost.
#[inline]
pub(super) fn check_leased_call(plan: &Plan, key: &str, cost: f64) -> Result<Tokens, Error> {
    if key.is_empty()
        || key.len() > crate::key::MAX_KEY_BYTES
        || key.as_bytes()[0] == crate::key::RESERVED_KEY_PREFIX as u8
    {
        validate_key(key)?;
    }
    match validate_cost(plan, cost) {
        Ok(tokens) => Ok(tokens),
        Err(bad_cost) => {
            validate_key(key)?;
            Err(bad_cost)
        }
    }
}

/// `cost` in nanotokens, rounded up: what a lease word spends.
#[inline]
pub(super) fn lease_cost(cost: Tokens) -> u64 {
    let atto = cost.as_atto();
    // Costs up to 18 tokens fit in a u64 of attotokens, where a division by a constant is a
    // multiply; a u128 division is a library call (about a tenth of the 1-key fast path).
    match u64::try_from(atto) {
        Ok(atto) => atto.div_ceil(1_000_000_000),
        Err(_) => u64::try_from(atto.div_ceil(1_000_000_000)).unwrap_or(u64::MAX),
    }
}

/// Converts a cost to tokens, refusing what can never be allowed. A whole cost within the
/// capacity (the common case) is answered inline; the rest, errors included, out of line.
#[inline]
pub(super) fn validate_cost(plan: &Plan, cost: f64) -> Result<Tokens, Error> {
    if (1.0..=9_007_199_254_740_992.0).contains(&cost) && cost == (cost as u64) as f64 {
        let tokens = Tokens::whole(cost as u64);
        if tokens <= plan.capacity() {
            return Ok(tokens);
        }
    }
    validate_cost_slow(plan, cost)
}

/// [`validate_cost`] for a fractional, invalid or too large cost.
#[cold]
#[inline(never)]
fn validate_cost_slow(plan: &Plan, cost: f64) -> Result<Tokens, Error> {
    let invalid = |reason| Error::InvalidCost {
        cost,
        plan: plan.name().to_owned(),
        reason,
    };
    if !cost.is_finite() {
        return Err(invalid("the cost must be a finite number"));
    }
    if cost <= 0.0 {
        return Err(invalid("the cost must be greater than zero"));
    }
    let tokens = Tokens::from_f64(cost).ok_or_else(|| invalid("the cost is too large"))?;
    // Every store counts in whole nanotokens (10⁻⁹ token; PostgreSQL's bigint columns): a
    // finer cost is rounded up to the next one, so it is never charged less than asked.
    let tokens = Tokens::from_nanos(tokens.as_atto().div_ceil(1_000_000_000));
    if tokens.is_zero() {
        return Err(invalid("the cost is below one nanotoken (10⁻⁹ token)"));
    }
    if tokens > plan.capacity() {
        return Err(invalid("the cost is larger than the plan's capacity"));
    }
    Ok(tokens)
}
