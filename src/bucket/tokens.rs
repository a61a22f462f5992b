//! Fixed-point token amounts and refill rates.
//!
//! One token is [`Tokens::SCALE`] (10¹⁸) units, so amounts carry eighteen decimal places exactly, the
//! same scale as the `numeric(38, 18)` columns in PostgreSQL. Integer arithmetic keeps the pure
//! bucket and the SQL statement bit-for-bit identical and free of floating-point drift.

use std::fmt;
use std::str::FromStr;

/// An amount of tokens with eighteen exact decimal places (a count of attotokens, 10⁻¹⁸ token).
///
/// The largest amount is `u64::MAX` whole tokens, which keeps every product in the refill
/// arithmetic inside `u128`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
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
    pub const fn from_atto(nanos: u128) -> Self {
        if nanos > Self::MAX.0 {
            Self::MAX
        } else {
            Tokens(nanos)
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

    /// Converts a floating-point amount, rounding to the nearest attotoken.
    ///
    /// Returns `None` for NaN, infinities, negative values and values above [`Tokens::MAX`].
    pub fn from_f64(x: f64) -> Option<Self> {
        if !x.is_finite() || x < 0.0 {
            return None;
        }
        let nanos = (x * Self::SCALE as f64).round();
        // `MAX.0 as f64` rounds up to MAX + 1 token, so `>` would let that value through
        // (and `floor()` would then wrap to 0). Everything below it is at most MAX.
        if nanos >= Self::MAX.0 as f64 {
            return None;
        }
        Some(Tokens(nanos as u128))
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
}

/// Writes the amount as a decimal with exactly eighteen fraction digits
/// (`"12.500000000000000000"`), the text
/// form PostgreSQL's `numeric` reads and writes.
impl fmt::Display for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:018}", self.0 / Self::SCALE, self.0 % Self::SCALE)
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
        Tokens(self.0 as u128 * 1_000_000_000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Tokens, ParseTokensError> {
        s.parse()
    }

    #[test]
    fn whole_and_nanos_constructors() {
        assert_eq!(Tokens::whole(3).as_nanos(), 3_000_000_000);
        assert_eq!(Tokens::from_nanos(7).as_nanos(), 7);
        assert_eq!(Tokens::whole(u64::MAX), Tokens::MAX);
        assert_eq!(Tokens::from_nanos(u128::MAX), Tokens::MAX);
        assert_eq!(Tokens::from_nanos(Tokens::MAX.as_nanos() + 1), Tokens::MAX);
        assert!(Tokens::ZERO.is_zero());
        assert!(!Tokens::from_nanos(1).is_zero());
    }

    #[test]
    fn floor_and_ceil() {
        let t = Tokens::from_nanos(2_500_000_000);
        assert_eq!(t.floor(), 2);
        assert_eq!(t.ceil(), 3);
        assert_eq!(Tokens::whole(4).floor(), 4);
        assert_eq!(Tokens::whole(4).ceil(), 4);
        assert_eq!(Tokens::from_nanos(1).floor(), 0);
        assert_eq!(Tokens::from_nanos(1).ceil(), 1);
        assert_eq!(Tokens::MAX.floor(), u64::MAX);
        assert_eq!(Tokens::MAX.ceil(), u64::MAX);
    }

    #[test]
    fn saturating_arithmetic_stays_in_range() {
        assert_eq!(Tokens::MAX.saturating_add(Tokens::whole(1)), Tokens::MAX);
        assert_eq!(Tokens::MAX.saturating_add(Tokens::MAX), Tokens::MAX);
        assert_eq!(
            Tokens::whole(1).saturating_sub(Tokens::whole(2)),
            Tokens::ZERO
        );
        assert_eq!(
            Tokens::whole(2).saturating_sub(Tokens::from_nanos(1)),
            Tokens::from_nanos(1_999_999_999)
        );
    }

    #[test]
    fn display_has_nine_fraction_digits() {
        assert_eq!(Tokens::ZERO.to_string(), "0.000000000");
        assert_eq!(Tokens::from_nanos(1).to_string(), "0.000000001");
        assert_eq!(
            Tokens::from_nanos(12_500_000_000).to_string(),
            "12.500000000"
        );
        assert_eq!(Tokens::MAX.to_string(), "18446744073709551615.000000000");
    }

    #[test]
    fn parse_accepts_plain_decimals() {
        assert_eq!(parse("12").unwrap(), Tokens::whole(12));
        assert_eq!(parse("12.5").unwrap(), Tokens::from_nanos(12_500_000_000));
        assert_eq!(parse("0.000000001").unwrap(), Tokens::from_nanos(1));
        assert_eq!(parse("0").unwrap(), Tokens::ZERO);
        assert_eq!(parse("007.250").unwrap(), Tokens::from_nanos(7_250_000_000));
        assert_eq!(parse("18446744073709551615").unwrap(), Tokens::MAX);
        assert_eq!(
            parse("18446744073709551615.000000000").unwrap(),
            Tokens::MAX
        );
    }

    #[test]
    fn display_parse_round_trip() {
        let samples = [
            0,
            1,
            999_999_999,
            1_000_000_000,
            1_000_000_001,
            666_666_667,
            123_456_789_012_345_678,
            Tokens::MAX.as_nanos() - 1,
            Tokens::MAX.as_nanos(),
        ];
        for n in samples {
            let t = Tokens::from_nanos(n);
            let text = t.to_string();
            assert_eq!(parse(&text).unwrap(), t, "round trip of {text}");
        }
    }

    #[test]
    fn parse_refuses_non_plain_decimals() {
        let refused = [
            "",
            ".",
            ".5",
            "NaN",
            "nan",
            "Infinity",
            "inf",
            "-1",
            "+1",
            "-0",
            "1e5",
            "1E5",
            "1.0e2",
            " 1",
            "1 ",
            "1,5",
            "1.2.3",
            "1.-5",
            "0x10",
            "١",
            "1.0000000001",
            "0.0000000000",
        ];
        for s in refused {
            assert!(parse(s).is_err(), "{s:?} should be refused");
        }
    }

    #[test]
    fn parse_refuses_too_large() {
        // One nanotoken above MAX, one whole token above, and beyond u128.
        assert!(parse("18446744073709551615.000000001").is_err());
        assert!(parse("18446744073709551616").is_err());
        assert!(parse("340282366920938463463374607431768211456").is_err());
        assert!(parse(&"9".repeat(200)).is_err());
        // Leading zeros do not count towards the size.
        let padded = format!("{}1.5", "0".repeat(100));
        assert_eq!(parse(&padded).unwrap(), Tokens::from_nanos(1_500_000_000));
    }

    #[test]
    fn parse_error_names_the_input_and_truncates_it() {
        let err = parse("abc").unwrap_err();
        assert!(err.to_string().contains("\"abc\""), "{err}");
        let long = "x".repeat(1000);
        let err = parse(&long).unwrap_err();
        assert!(err.to_string().len() < 200, "{err}");
    }

    #[test]
    fn from_f64_rounds_to_nearest_nanotoken() {
        assert_eq!(Tokens::from_f64(0.0), Some(Tokens::ZERO));
        assert_eq!(Tokens::from_f64(0.5), Some(Tokens::from_nanos(500_000_000)));
        assert_eq!(
            Tokens::from_f64(2.0 / 3.0),
            Some(Tokens::from_nanos(666_666_667))
        );
        assert_eq!(Tokens::from_f64(1e-10), Some(Tokens::ZERO));
        assert_eq!(Tokens::from_f64(6e-10), Some(Tokens::from_nanos(1)));
    }

    #[test]
    fn from_f64_refuses_nan_infinite_negative_and_too_large() {
        for x in [
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            -1.0,
            -1e-12,
            1e20,
            f64::MAX,
        ] {
            assert_eq!(Tokens::from_f64(x), None, "{x}");
        }
    }

    /// Regression: `u64::MAX as f64` is 2⁶⁴, and `from_f64` used to accept it as MAX + 1 token,
    /// an amount whose `floor()` wrapped to 0.
    #[test]
    fn from_f64_never_exceeds_max() {
        assert_eq!(Tokens::from_f64(u64::MAX as f64), None);
        assert_eq!(Tokens::from_f64(18_446_744_073_709_551_616.0), None);
        // The largest float below 2⁶⁴ is accepted and stays within MAX.
        let below = f64::from_bits((u64::MAX as f64).to_bits() - 1);
        let t = Tokens::from_f64(below).expect("below 2^64 tokens");
        assert!(t <= Tokens::MAX);
        // x × 10⁹ rounds in f64, so only closeness is exact; the point is that it did not wrap.
        assert!(t.floor() > u64::MAX - (1 << 12), "{t}");
    }

    #[test]
    fn as_f64_matches_value() {
        assert_eq!(Tokens::from_nanos(2_500_000_000).as_f64(), 2.5);
        assert_eq!(Tokens::ZERO.as_f64(), 0.0);
        assert_eq!(Tokens::MAX.as_f64(), u64::MAX as f64);
    }

    #[test]
    fn rate_constructors() {
        assert_eq!(
            Rate::per_second(1).unwrap().as_nanos_per_second(),
            1_000_000_000
        );
        assert_eq!(Rate::per_second(1_000_000_000), Some(Rate::MAX));
        assert_eq!(Rate::per_second(1_000_000_001), None);
        assert_eq!(Rate::per_second(0), None);
        assert_eq!(Rate::from_nanos_per_second(0), None);
        assert_eq!(
            Rate::from_nanos_per_second(1)
                .unwrap()
                .as_nanos_per_second(),
            1
        );
        assert_eq!(
            Rate::from_nanos_per_second(Rate::MAX.as_nanos_per_second()),
            Some(Rate::MAX)
        );
        assert_eq!(
            Rate::from_nanos_per_second(Rate::MAX.as_nanos_per_second() + 1),
            None
        );
        assert_eq!(Rate::from_nanos_per_second(u64::MAX), None);
        assert_eq!(Rate::per_second(50).unwrap().as_f64(), 50.0);
        assert_eq!(
            Rate::per_second(3).unwrap().per_second_amount(),
            Tokens::whole(3)
        );
    }

    #[test]
    fn rate_from_f64_accepts_and_rounds() {
        assert_eq!(Rate::from_f64(1.0), Rate::per_second(1));
        assert_eq!(Rate::from_f64(1e9), Some(Rate::MAX));
        assert_eq!(Rate::from_f64(1e-9), Rate::from_nanos_per_second(1));
        // 2/3 token/s rounds to the nearest nanotoken per second.
        assert_eq!(
            Rate::from_f64(2.0 / 3.0),
            Rate::from_nanos_per_second(666_666_667)
        );
        // 0.6 nanotoken/s rounds up to one.
        assert_eq!(Rate::from_f64(6e-10), Rate::from_nanos_per_second(1));
    }

    #[test]
    fn rate_from_f64_refusals() {
        let refused = [
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            0.0,
            -0.0,
            -1.0,
            -1e-9,
            1e9 + 1.0,
            1e10,
            f64::MAX,
            // Below half a nanotoken per second: rounds to zero.
            4e-10,
            1e-10,
            f64::MIN_POSITIVE,
        ];
        for x in refused {
            assert_eq!(Rate::from_f64(x), None, "{x}");
        }
    }
}
