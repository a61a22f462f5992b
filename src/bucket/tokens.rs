//! Fixed-point token amounts and refill rates.
//!
//! One token is [`Tokens::SCALE`] (10¹⁸) units, so amounts carry eighteen decimal places exactly.
//! PostgreSQL's rows keep whole nanotokens and the femtotokens below one, which is this scale
//! divided by 1,000 for every state a statement reaches (the database's clock ticks in whole
//! microseconds). Integer arithmetic keeps the pure bucket and the SQL statement bit-for-bit
//! identical and free of floating-point drift.

use std::fmt;
use std::str::FromStr;

/// An amount of tokens with eighteen exact decimal places (a count of attotokens, 10⁻¹⁸ token).
///
/// The largest amount is `u64::MAX` whole tokens, which keeps every product in the refill
/// arithmetic inside `u128`.
///
/// Printed for people with [`trimmed`](Self::trimmed) (`50`, `0.333333333`) and `Debug`
/// (`Tokens(50)`); `Display` writes all eighteen fraction digits, the text PostgreSQL's
/// `numeric` reads.
#[derive(Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tokens(u128);

impl Tokens {
    /// Units (attotokens) in one whole token.
    pub const SCALE: u128 = 1_000_000_000_000_000_000;
    /// No tokens.
    pub const ZERO: Tokens = Tokens(0);
    /// The largest amount: `u64::MAX` whole tokens.
    pub const MAX: Tokens = Tokens(u64::MAX as u128 * Self::SCALE);

    /// An amount of whole tokens.
    pub const fn whole(n: u64) -> Self {
        Tokens(n as u128 * Self::SCALE)
    }

    /// An amount given in attotokens, saturating at [`Tokens::MAX`].
    pub const fn from_atto(atto: u128) -> Self {
        if atto > Self::MAX.0 {
            Self::MAX
        } else {
            Tokens(atto)
        }
    }

    /// An amount given in nanotokens (10⁻⁹ token), saturating at [`Tokens::MAX`].
    pub const fn from_nanos(nanos: u128) -> Self {
        Self::from_atto(nanos.saturating_mul(1_000_000_000))
    }

    /// The amount in whole nanotokens, rounded down.
    pub const fn as_nanos(self) -> u128 {
        self.0 / 1_000_000_000
    }

    /// The amount in attotokens.
    pub const fn as_atto(self) -> u128 {
        self.0
    }

    /// Converts a floating-point amount: the shortest decimal that reads back as `x` (what
    /// `format!("{x}")` prints, so `1.1` is 1.1 tokens), rounded half up to the nearest
    /// attotoken.
    ///
    /// Not `x × 10¹⁸` in f64: f64 has about 16 significant digits, fewer than the 18 fraction
    /// digits of an amount, so that product lands up to half an f64 step away from the decimal
    /// the caller wrote (`1.1` would become 1.100000000000000128, and a full bucket of 11 tokens
    /// would admit nine takes of it, not ten).
    ///
    /// Returns `None` for NaN, infinities, negative values and values above [`Tokens::MAX`].
    #[inline]
    pub fn from_f64(x: f64) -> Option<Self> {
        if (1.0..=9_007_199_254_740_992.0).contains(&x) && x == (x as u64) as f64 {
            // Whole numbers up to 2⁵³ (the common cost of 1) print as exactly their integer
            // value, so the decimal detour would give the same: skip it on the hot path.
            return Some(Tokens::whole(x as u64));
        }
        Self::from_f64_decimal(x)
    }

    /// [`from_f64`](Self::from_f64) for everything but whole numbers: through the shortest
    /// round-trip decimal. Out of line, so the hot path's frame holds no 400-byte buffer.
    #[cold]
    #[inline(never)]
    fn from_f64_decimal(x: f64) -> Option<Self> {
        // 2⁶⁴ tokens is already above MAX; the bound also keeps the text below short.
        if !(0.0..18_446_744_073_709_551_616.0).contains(&x) {
            return None;
        }
        if x == 0.0 {
            // Also -0.0, which `{x}` would print with a sign.
            return Some(Tokens::ZERO);
        }

        // The shortest round-trip text has no exponent; below 2⁶⁴ it is at most 20 integer
        // digits, and at most 1 + 324 digits for the smallest subnormal.
        let mut buf = DecimalBuf {
            bytes: [0; 400],
            len: 0,
        };
        fmt::Write::write_fmt(&mut buf, format_args!("{x}")).ok()?;
        let text = buf.bytes.get(..buf.len)?;
        let dot = text.iter().position(|&b| b == b'.').unwrap_or(text.len());
        let (int, frac) = (&text[..dot], text.get(dot + 1..).unwrap_or(&[]));
        let digits = |d: &[u8]| {
            d.iter().try_fold(0u128, |n, &b| {
                let digit = char::from(b).to_digit(10)?;
                n.checked_mul(10)?.checked_add(u128::from(digit))
            })
        };
        let kept = &frac[..frac.len().min(18)];
        let mut frac_atto = digits(kept)?;
        for _ in kept.len()..18 {
            frac_atto *= 10;
        }
        // Half up on the first dropped digit.
        let round_up = frac.get(18).is_some_and(|&b| b >= b'5');
        let atto = digits(int)?
            .checked_mul(Self::SCALE)?
            .checked_add(frac_atto + u128::from(round_up))?;
        (atto <= Self::MAX.0).then_some(Tokens(atto))
    }

    /// The amount as a float (rounded to 53 significant bits).
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
        Tokens::from_atto(self.0.saturating_add(rhs.0))
    }

    /// `self - rhs`, saturating at zero.
    pub const fn saturating_sub(self, rhs: Tokens) -> Tokens {
        Tokens(self.0.saturating_sub(rhs.0))
    }

    /// Whether the amount is zero.
    pub const fn is_zero(self) -> bool {
        self.0 == 0
    }

    /// The amount as a person writes it, exactly: the fraction without trailing zeros, and no
    /// decimal point for a whole amount (`50`, `12.5`, `0.333333333`,
    /// `0.000000000000000001`). For messages, command output and logs; `Display` keeps its
    /// eighteen fraction digits for PostgreSQL, and [`FromStr`] reads either.
    ///
    /// ```
    /// use tokenlease::bucket::Tokens;
    /// assert_eq!(Tokens::whole(50).trimmed().to_string(), "50");
    /// assert_eq!(Tokens::from_nanos(333_333_333).trimmed().to_string(), "0.333333333");
    /// assert_eq!(Tokens::whole(50).to_string(), "50.000000000000000000");
    /// ```
    pub const fn trimmed(self) -> TrimmedTokens {
        TrimmedTokens(self)
    }
}

/// An amount of [`Tokens`] printed as a person writes it: see [`Tokens::trimmed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrimmedTokens(Tokens);

impl fmt::Display for TrimmedTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (whole, mut frac) = (self.0.0 / Tokens::SCALE, self.0.0 % Tokens::SCALE);
        if frac == 0 {
            return write!(f, "{whole}");
        }
        let mut digits = 18;
        while frac % 10 == 0 {
            frac /= 10;
            digits -= 1;
        }
        write!(f, "{whole}.{frac:0digits$}")
    }
}

/// `Tokens(50)`, `Tokens(0.333333333)`: the amount in tokens, as [`Tokens::trimmed`].
impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tokens({})", self.trimmed())
    }
}

/// Writes the amount as a decimal with exactly eighteen fraction digits
/// (`"12.500000000000000000"`), the text
/// form PostgreSQL's `numeric` reads and writes.
impl fmt::Display for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:018}", self.0 / Self::SCALE, self.0 % Self::SCALE)
    }
}

/// A fixed buffer for the decimal text of an `f64` in [`Tokens::from_f64`]: no allocation on the
/// request path.
struct DecimalBuf {
    bytes: [u8; 400],
    len: usize,
}

impl fmt::Write for DecimalBuf {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self.len + s.len();
        self.bytes
            .get_mut(self.len..end)
            .ok_or(fmt::Error)?
            .copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
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
/// `numeric`. More than eighteen fraction digits, signs, exponents, `NaN` and `Infinity` are refused.
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
        if frac.len() > 18 {
            return Err(err("more than eighteen fraction digits"));
        }
        let int: u128 = int.parse().map_err(|_| err("too large"))?;
        let mut frac_atto: u128 = if frac.is_empty() {
            0
        } else {
            frac.parse().map_err(|_| err("bad fraction"))?
        };
        for _ in frac.len()..18 {
            frac_atto *= 10;
        }
        let nanos = int
            .checked_mul(Self::SCALE)
            .and_then(|n| n.checked_add(frac_atto))
            .filter(|&n| n <= Self::MAX.0)
            .ok_or_else(|| err("too large"))?;
        Ok(Tokens(nanos))
    }
}

/// A refill rate in nanotokens per second (so 1 token/s is 10⁹).
///
/// The slowest rate is one nanotoken per second (about 0.03 tokens a year); the fastest a policy
/// accepts is 10⁹ tokens/s (one token per nanosecond), as in Bucket4j. `Debug` reads in tokens
/// per second: `Rate(0.333333333/s)`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rate(u64);

impl fmt::Debug for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Rate({}/s)", self.per_second_amount().trimmed())
    }
}

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

    /// A rate of `tokens` whole tokens a minute, rounded to the nearest nanotoken per second;
    /// `None` when zero or above [`Rate::MAX`].
    pub const fn per_minute(tokens: u64) -> Option<Self> {
        Self::per_nanos(tokens, 60 * 1_000_000_000)
    }

    /// A rate of `tokens` whole tokens an hour (rounded as [`per_minute`](Self::per_minute)).
    pub const fn per_hour(tokens: u64) -> Option<Self> {
        Self::per_nanos(tokens, 3_600 * 1_000_000_000)
    }

    /// A rate of `tokens` whole tokens a day of 86,400 seconds (rounded as
    /// [`per_minute`](Self::per_minute)).
    pub const fn per_day(tokens: u64) -> Option<Self> {
        Self::per_nanos(tokens, 86_400 * 1_000_000_000)
    }

    /// A rate of `tokens` whole tokens every `period`, rounded to the nearest nanotoken per
    /// second; `None` when zero, above [`Rate::MAX`], below one nanotoken a second, or the
    /// period is zero.
    pub const fn per(tokens: u64, period: std::time::Duration) -> Option<Self> {
        let nanos = period.as_nanos();
        if nanos == 0 {
            return None;
        }
        Self::per_nanos(tokens, nanos)
    }

    /// `tokens` per `period_ns` nanoseconds, rounded to the nearest nanotoken per second.
    const fn per_nanos(tokens: u64, period_ns: u128) -> Option<Self> {
        // tokens < 2^64 and 10^18 < 2^60: the product fits in u128.
        let scaled = tokens as u128 * 1_000_000_000_000_000_000;
        let n = (scaled + period_ns / 2) / period_ns;
        if n > u64::MAX as u128 {
            return None;
        }
        Self::from_nanos_per_second(n as u64)
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
        Tokens(self.0 as u128 * 1_000_000_000)
    }
}

#[cfg(test)]
mod tests;
