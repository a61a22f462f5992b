//! Fixed-point token amounts and refill rates.
//!
//! One token is [`Tokens::SCALE`] (10⁹) units, so amounts carry nine decimal places exactly, the
//! same scale as the `numeric(30, 9)` columns in PostgreSQL. Integer arithmetic keeps the pure
//! bucket and the SQL statement bit-for-bit identical and free of floating-point drift.

use std::fmt;
use std::str::FromStr;

/// An amount of tokens with nine exact decimal places (a count of nanotokens).
///
/// The largest amount is `u64::MAX` whole tokens, which keeps every product in the refill
/// arithmetic inside `u128`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tokens(u128);

impl Tokens {
    /// Units (nanotokens) in one whole token.
    pub const SCALE: u128 = 1_000_000_000;
    /// No tokens.
    pub const ZERO: Tokens = Tokens(0);
    /// The largest amount: `u64::MAX` whole tokens.
    pub const MAX: Tokens = Tokens(u64::MAX as u128 * Self::SCALE);

    /// An amount of whole tokens.
    pub const fn whole(n: u64) -> Self {
        Tokens(n as u128 * Self::SCALE)
    }

    /// An amount given in nanotokens, saturating at [`Tokens::MAX`].
    pub const fn from_nanos(nanos: u128) -> Self {
        if nanos > Self::MAX.0 {
            Self::MAX
        } else {
            Tokens(nanos)
        }
    }

    /// The amount in nanotokens.
    pub const fn as_nanos(self) -> u128 {
        self.0
    }

    /// Converts a floating-point amount, rounding to the nearest nanotoken.
    ///
    /// Returns `None` for NaN, infinities, negative values and values above [`Tokens::MAX`].
    pub fn from_f64(x: f64) -> Option<Self> {
        if !x.is_finite() || x < 0.0 {
            return None;
        }
        let nanos = (x * Self::SCALE as f64).round();
        if nanos > Self::MAX.0 as f64 {
            return None;
        }
        Some(Tokens(nanos as u128))
    }

    /// The amount as a float (exact up to 2⁵³ nanotokens, rounded above).
    pub fn as_f64(self) -> f64 {
        let whole = (self.0 / Self::SCALE) as f64;
        let frac = (self.0 % Self::SCALE) as f64 / Self::SCALE as f64;
        whole + frac
    }

    /// Whole tokens, rounded down.
    pub const fn floor(self) -> u64 {
        (self.0 / Self::SCALE) as u64
    }

    /// Whole tokens, rounded up (saturating at `u64::MAX`).
    pub const fn ceil(self) -> u64 {
        let whole = self.0.div_ceil(Self::SCALE);
        if whole > u64::MAX as u128 {
            u64::MAX
        } else {
            whole as u64
        }
    }

    /// `self + rhs`, saturating at [`Tokens::MAX`].
    pub const fn saturating_add(self, rhs: Tokens) -> Tokens {
        Tokens::from_nanos(self.0.saturating_add(rhs.0))
    }

    /// `self - rhs`, saturating at zero.
    pub const fn saturating_sub(self, rhs: Tokens) -> Tokens {
        Tokens(self.0.saturating_sub(rhs.0))
    }

    /// Whether the amount is zero.
    pub const fn is_zero(self) -> bool {
        self.0 == 0
    }
}

/// Writes the amount as a decimal with exactly nine fraction digits (`"12.500000000"`), the text
/// form PostgreSQL's `numeric` reads and writes.
impl fmt::Display for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:09}", self.0 / Self::SCALE, self.0 % Self::SCALE)
    }
}

/// Why a decimal string is not a [`Tokens`] amount.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid token amount {input:?}: {reason}")]
pub struct ParseTokensError {
    input: String,
    reason: &'static str,
}

/// Parses a plain non-negative decimal (`"12"`, `"12.5"`, `"0.000000001"`), as PostgreSQL prints
/// `numeric`. More than nine fraction digits, signs, exponents, `NaN` and `Infinity` are refused.
impl FromStr for Tokens {
    type Err = ParseTokensError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| ParseTokensError {
            input: s.chars().take(64).collect(),
            reason,
        };
        let (int, frac) = s.split_once('.').unwrap_or((s, ""));
        if int.is_empty() || !int.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err("expected digits before the decimal point"));
        }
        if !frac.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err("expected digits after the decimal point"));
        }
        if frac.len() > 9 {
            return Err(err("more than nine fraction digits"));
        }
        let int: u128 = int.parse().map_err(|_| err("too large"))?;
        let mut frac_nanos: u128 = if frac.is_empty() {
            0
        } else {
            frac.parse().map_err(|_| err("bad fraction"))?
        };
        for _ in frac.len()..9 {
            frac_nanos *= 10;
        }
        let nanos = int
            .checked_mul(Self::SCALE)
            .and_then(|n| n.checked_add(frac_nanos))
            .filter(|&n| n <= Self::MAX.0)
            .ok_or_else(|| err("too large"))?;
        Ok(Tokens(nanos))
    }
}

/// A refill rate in nanotokens per second (so 1 token/s is 10⁹).
///
/// The slowest rate is one nanotoken per second (about 0.03 tokens a year); the fastest a policy
/// accepts is 10⁹ tokens/s (one token per nanosecond), as in Bucket4j.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rate(u64);

impl Rate {
    /// The fastest rate: 10⁹ tokens per second.
    pub const MAX: Rate = Rate(1_000_000_000 * 1_000_000_000);

    /// A rate in nanotokens per second; `None` when zero or above [`Rate::MAX`].
    pub const fn from_nanos_per_second(n: u64) -> Option<Self> {
        if n == 0 || n > Self::MAX.0 {
            None
        } else {
            Some(Rate(n))
        }
    }

    /// A rate in whole tokens per second; `None` when zero or above [`Rate::MAX`].
    pub const fn per_second(tokens: u64) -> Option<Self> {
        if tokens > 1_000_000_000 {
            return None;
        }
        Self::from_nanos_per_second(tokens * 1_000_000_000)
    }

    /// A rate in tokens per second, rounded to the nearest nanotoken per second; `None` for
    /// NaN, infinities, values that round to zero and values above [`Rate::MAX`].
    pub fn from_f64(per_second: f64) -> Option<Self> {
        if !per_second.is_finite() || per_second <= 0.0 {
            return None;
        }
        let n = (per_second * 1e9).round();
        if n < 1.0 || n > Self::MAX.0 as f64 {
            return None;
        }
        Self::from_nanos_per_second(n as u64)
    }

    /// The rate in nanotokens per second.
    pub const fn as_nanos_per_second(self) -> u64 {
        self.0
    }

    /// The rate in tokens per second.
    pub fn as_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }

    /// The rate in tokens per second as a [`Tokens`] amount (its decimal text is what SQL binds).
    pub const fn per_second_amount(self) -> Tokens {
        Tokens(self.0 as u128)
    }
}
