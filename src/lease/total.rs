//! [`Total`]: a running total of nanotokens for the lease counters, apart so that the actor,
//! the credit rules and the stats all name it without naming each other.

use parking_lot::Mutex;

/// A running total of nanotokens that never wraps and never goes backwards: a `u128` behind a
/// lock. A `u64` of nanotokens wraps after about 1.8 × 10¹⁰ tokens, which a limiter leasing a
/// million tokens a second reaches in five hours (and a plan of 10⁹ tokens in minutes), and
/// `LeaseStats::leased` then fell from 1.69 × 10¹⁰ to 6.0 × 10⁹. Added to off the fast path
/// only (grants, returns, expiries, credit), so the lock costs nothing a call waits on.
#[derive(Debug, Default)]
pub(crate) struct Total(Mutex<u128>);

impl Total {
    /// Adds `nanos`.
    pub(crate) fn add(&self, nanos: u64) {
        *self.0.lock() += u128::from(nanos);
    }

    /// The total, in nanotokens.
    pub(crate) fn nanos(&self) -> u128 {
        *self.0.lock()
    }

    /// The total in tokens, as `LeaseStats` reports it.
    pub(crate) fn tokens(&self) -> f64 {
        self.nanos() as f64 / 1e9
    }
}

#[cfg(test)]
mod tests {
    use super::Total;

    /// K5: a total passes `u64::MAX` nanotokens (1.8 × 10¹⁰ tokens) without wrapping, so
    /// `LeaseStats::leased` and the rest never go backwards.
    #[test]
    fn totals_never_wrap() {
        let t = Total::default();
        t.add(u64::MAX);
        let before = t.tokens();
        t.add(72_057_594_037_927_935);
        assert_eq!(t.nanos(), u128::from(u64::MAX) + 72_057_594_037_927_935);
        assert!(t.tokens() > before);
    }
}
