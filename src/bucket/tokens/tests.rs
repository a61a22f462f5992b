//! Unit tests of `tokens.rs`.

use super::*;

const SCALE: u128 = Tokens::SCALE;

fn parse(s: &str) -> Result<Tokens, ParseTokensError> {
    s.parse()
}

/// `Debug` reads as tokens, not attotokens, with the exact fraction and no trailing zeros.
#[test]
fn debug_reads_as_tokens() {
    assert_eq!(format!("{:?}", Tokens::whole(99)), "Tokens(99)");
    assert_eq!(format!("{:?}", Tokens::ZERO), "Tokens(0)");
    assert_eq!(
        format!("{:?}", Tokens::from_nanos(333_333_333)),
        "Tokens(0.333333333)"
    );
    assert_eq!(
        format!("{:?}", Tokens::from_atto(1)),
        "Tokens(0.000000000000000001)"
    );
    assert_eq!(
        format!("{:?}", Some(Tokens::from_atto(12_500_000_000_000_000_000))),
        "Some(Tokens(12.5))"
    );
    assert_eq!(
        format!("{:?}", Rate::from_f64(1.0 / 3.0).unwrap()),
        "Rate(0.333333333/s)"
    );
    assert_eq!(format!("{:?}", Rate::per_second(50).unwrap()), "Rate(50/s)");
}

/// `trimmed` is exact and reads back to the same amount; `Display` is unchanged (it is the
/// text sent to PostgreSQL).
#[test]
fn trimmed_prints_what_a_person_wrote_and_reads_back() {
    for (tokens, text) in [
        (Tokens::whole(50), "50"),
        (Tokens::ZERO, "0"),
        (Tokens::from_atto(12_500_000_000_000_000_000), "12.5"),
        (Tokens::from_nanos(333_333_333), "0.333333333"),
        (Tokens::from_atto(1), "0.000000000000000001"),
        (Tokens::from_atto(SCALE + 10), "1.00000000000000001"),
        (Tokens::MAX, "18446744073709551615"),
    ] {
        assert_eq!(tokens.trimmed().to_string(), text);
        assert_eq!(parse(text), Ok(tokens), "{text}");
    }
    assert_eq!(Tokens::whole(50).to_string(), "50.000000000000000000");
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
fn atto_accessors_and_nanos_conversions() {
    assert_eq!(Tokens::SCALE, 10u128.pow(18));
    assert_eq!(Tokens::whole(1).as_atto(), Tokens::SCALE);
    assert_eq!(Tokens::from_atto(7).as_atto(), 7);
    assert_eq!(Tokens::from_nanos(1).as_atto(), 1_000_000_000);
    assert_eq!(Tokens::from_nanos(1), Tokens::from_atto(1_000_000_000));
    // as_nanos rounds down: a nanotoken less one attotoken is zero nanotokens.
    assert_eq!(Tokens::from_atto(999_999_999).as_nanos(), 0);
    assert_eq!(Tokens::from_atto(1_999_999_999).as_nanos(), 1);
    assert!(!Tokens::from_atto(1).is_zero());
    // MAX is u64::MAX whole tokens, and it fits u128 with room for a sum of two.
    assert_eq!(Tokens::MAX.as_atto(), u64::MAX as u128 * Tokens::SCALE);
    assert!(Tokens::MAX.as_atto().checked_mul(2).is_some());
    // from_atto saturates.
    assert_eq!(Tokens::from_atto(Tokens::MAX.as_atto()), Tokens::MAX);
    assert_eq!(Tokens::from_atto(Tokens::MAX.as_atto() + 1), Tokens::MAX);
    assert_eq!(Tokens::from_atto(u128::MAX), Tokens::MAX);
    assert_eq!(
        Tokens::from_atto(Tokens::MAX.as_atto() - 1).as_atto(),
        Tokens::MAX.as_atto() - 1
    );
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
    // One attotoken is enough to round up, and not enough to reach a whole token.
    assert_eq!(Tokens::from_atto(1).floor(), 0);
    assert_eq!(Tokens::from_atto(1).ceil(), 1);
    let just_over = Tokens::whole(4).saturating_add(Tokens::from_atto(1));
    assert_eq!(just_over.floor(), 4);
    assert_eq!(just_over.ceil(), 5);
    let just_under = Tokens::whole(4).saturating_sub(Tokens::from_atto(1));
    assert_eq!(just_under.floor(), 3);
    assert_eq!(just_under.ceil(), 4);
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
    assert_eq!(
        Tokens::whole(1).saturating_sub(Tokens::from_atto(1)),
        Tokens::from_atto(Tokens::SCALE - 1)
    );
    assert_eq!(
        Tokens::MAX.saturating_add(Tokens::from_atto(1)),
        Tokens::MAX
    );
}

#[test]
fn display_has_eighteen_fraction_digits() {
    assert_eq!(Tokens::ZERO.to_string(), "0.000000000000000000");
    assert_eq!(Tokens::from_atto(1).to_string(), "0.000000000000000001");
    assert_eq!(Tokens::from_nanos(1).to_string(), "0.000000001000000000");
    assert_eq!(
        Tokens::from_nanos(12_500_000_000).to_string(),
        "12.500000000000000000"
    );
    assert_eq!(
        Tokens::from_atto(666_666_666_700_000_000).to_string(),
        "0.666666666700000000"
    );
    assert_eq!(
        Tokens::whole(1)
            .saturating_sub(Tokens::from_atto(1))
            .to_string(),
        "0.999999999999999999"
    );
    assert_eq!(
        Tokens::MAX.to_string(),
        "18446744073709551615.000000000000000000"
    );
    assert_eq!(
        Tokens::from_atto(Tokens::MAX.as_atto() - 1).to_string(),
        "18446744073709551614.999999999999999999"
    );
    // Every amount prints 20 integer digits at most and exactly 18 fraction digits: the
    // shape of numeric(38, 18).
    let text = Tokens::MAX.to_string();
    let (int, frac) = text.split_once('.').unwrap();
    assert_eq!((int.len(), frac.len()), (20, 18));
}

#[test]
fn parse_accepts_plain_decimals() {
    assert_eq!(parse("12").unwrap(), Tokens::whole(12));
    assert_eq!(parse("12.5").unwrap(), Tokens::from_nanos(12_500_000_000));
    assert_eq!(parse("0.000000001").unwrap(), Tokens::from_nanos(1));
    assert_eq!(
        parse("0.0000000001").unwrap(),
        Tokens::from_atto(100_000_000)
    );
    assert_eq!(parse("0.000000000000000001").unwrap(), Tokens::from_atto(1));
    assert_eq!(
        parse("0.999999999999999999").unwrap(),
        Tokens::from_atto(Tokens::SCALE - 1)
    );
    assert_eq!(parse("1.000000000000000000").unwrap(), Tokens::whole(1));
    assert_eq!(parse("0").unwrap(), Tokens::ZERO);
    assert_eq!(parse("007.250").unwrap(), Tokens::from_nanos(7_250_000_000));
    assert_eq!(parse("18446744073709551615").unwrap(), Tokens::MAX);
    assert_eq!(
        parse("18446744073709551615.000000000").unwrap(),
        Tokens::MAX
    );
    assert_eq!(
        parse("18446744073709551615.000000000000000000").unwrap(),
        Tokens::MAX
    );
    assert_eq!(
        parse("18446744073709551614.999999999999999999").unwrap(),
        Tokens::from_atto(Tokens::MAX.as_atto() - 1)
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
    let atto_samples = [
        0,
        1,
        999_999_999,
        1_000_000_001,
        666_666_666_700_000_000,
        Tokens::SCALE - 1,
        Tokens::SCALE + 1,
        123_456_789_012_345_678_901_234_567_890,
        Tokens::MAX.as_atto() - 1,
        Tokens::MAX.as_atto(),
    ];
    for n in atto_samples {
        let t = Tokens::from_atto(n);
        assert_eq!(t.as_atto(), n);
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
        // Nineteen fraction digits: finer than an attotoken, even when the last is zero.
        "1.0000000000000000001",
        "0.0000000000000000000",
        "0.1234567890123456789",
        "18446744073709551615.0000000000000000000",
    ];
    for s in refused {
        assert!(parse(s).is_err(), "{s:?} should be refused");
    }
    assert_eq!(
        parse("1.0000000000000000001").unwrap_err().to_string(),
        "invalid token amount \"1.0000000000000000001\": more than eighteen fraction digits"
    );
    // Eighteen are accepted, however many of them are zeros.
    assert_eq!(
        parse("1.000000000000000001").unwrap(),
        Tokens::from_atto(Tokens::SCALE + 1)
    );
    assert_eq!(parse("0.000000000000000000").unwrap(), Tokens::ZERO);
    assert_eq!(
        parse("0.123456789012345678").unwrap(),
        Tokens::from_atto(123_456_789_012_345_678)
    );
}

#[test]
fn parse_refuses_too_large() {
    // One attotoken above MAX, one nanotoken above, one whole token above, and beyond u128.
    assert!(parse("18446744073709551615.000000000000000001").is_err());
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
fn from_f64_rounds_to_nearest_attotoken() {
    assert_eq!(Tokens::from_f64(0.0), Some(Tokens::ZERO));
    assert_eq!(Tokens::from_f64(-0.0), Some(Tokens::ZERO));
    assert_eq!(Tokens::from_f64(0.5), Some(Tokens::from_nanos(500_000_000)));
    assert_eq!(Tokens::from_f64(1.0), Some(Tokens::whole(1)));
    assert_eq!(Tokens::from_f64(1e-18), Some(Tokens::from_atto(1)));
    // Below half an attotoken rounds to zero; from half up, to one.
    assert_eq!(Tokens::from_f64(1e-19), Some(Tokens::ZERO));
    assert_eq!(Tokens::from_f64(4e-19), Some(Tokens::ZERO));
    assert_eq!(Tokens::from_f64(5e-19), Some(Tokens::from_atto(1)));
    assert_eq!(Tokens::from_f64(6e-19), Some(Tokens::from_atto(1)));
    assert_eq!(Tokens::from_f64(1.4e-18), Some(Tokens::from_atto(1)));
    assert_eq!(Tokens::from_f64(1.6e-18), Some(Tokens::from_atto(2)));
    assert_eq!(Tokens::from_f64(1.234e-16), Some(Tokens::from_atto(123)));
    assert_eq!(Tokens::from_f64(1.235e-16), Some(Tokens::from_atto(124)));
    assert_eq!(Tokens::from_f64(f64::MIN_POSITIVE), Some(Tokens::ZERO));
    assert_eq!(Tokens::from_f64(5e-324), Some(Tokens::ZERO));
    // Decimal fractions that are not binary ones land exactly on the decimal written.
    assert_eq!(Tokens::from_f64(0.1), Some(Tokens::from_atto(SCALE / 10)));
    assert_eq!(
        Tokens::from_f64(1.1),
        Some(Tokens::from_atto(11 * SCALE / 10))
    );
    assert_eq!(
        Tokens::from_f64(2.2),
        Some(Tokens::from_atto(22 * SCALE / 10))
    );
    assert_eq!(Tokens::from_f64(0.000001), Some(Tokens::from_nanos(1_000)));
    assert_eq!(
        Tokens::from_f64(12_345.678),
        Some(parse("12345.678").unwrap())
    );
    // An f64 keeps 17 significant digits of 0.123456789012345678, and the conversion keeps
    // all 17.
    assert_eq!(
        Tokens::from_f64("0.123456789012345678".parse().unwrap()),
        Some(parse("0.12345678901234568").unwrap())
    );
}

/// Regression: `from_f64` computed `x × 10¹⁸` in f64, which put 1.1 at
/// 1.100000000000000128 (f64 steps by 128 attotokens there), so a full bucket of 11 tokens
/// admitted nine takes of cost 1.1, not ten. Every cost of whole hundredths up to 100 must
/// be exact.
#[test]
fn from_f64_keeps_decimal_costs_exact() {
    for cents in 1u32..=10_000 {
        let x = f64::from(cents) / 100.0;
        let t = Tokens::from_f64(x).unwrap();
        assert_eq!(t.as_atto(), u128::from(cents) * SCALE / 100, "{x}");
    }
    let eleven_tenths = Tokens::from_f64(1.1).unwrap();
    let mut bucket = Tokens::whole(11);
    let mut admitted = 0;
    while bucket >= eleven_tenths {
        bucket = bucket.saturating_sub(eleven_tenths);
        admitted += 1;
    }
    assert_eq!((admitted, bucket), (10, Tokens::ZERO));
}

/// f64 carries 53 significant bits (the shortest text that reads back as it has at most 17
/// significant digits), fewer than the 18 fraction digits of an amount near one token, so an
/// f64 cannot name every attotoken: 2/3 becomes what `{2.0 / 3.0}` prints, sixteen sixes.
#[test]
fn from_f64_is_limited_by_f64_precision() {
    let x = 2.0f64 / 3.0;
    assert_eq!(x.to_string(), "0.6666666666666666");
    let two_thirds = Tokens::from_f64(x).unwrap();
    assert_eq!(two_thirds, Tokens::from_atto(666_666_666_666_666_600));
    // Within 10⁻¹⁶ token of the true 2/3, and of the exact binary value of x
    // (0.666666666666666629659…).
    assert!(3 * two_thirds.as_atto().abs_diff(2 * SCALE / 3) < 3 * 100);
    assert!(two_thirds.as_atto().abs_diff(666_666_666_666_666_630) < 100);
    // Not the nanotoken rounding of the previous scale: 0.666666667 is 3.3e-10 away.
    assert_ne!(two_thirds, Tokens::from_nanos(666_666_667));
    assert_eq!(two_thirds.as_nanos(), 666_666_666);
    // Fifteen significant digits always survive, down to the attotoken.
    assert_eq!(
        Tokens::from_f64(123_456_789_012_345e-18).map(Tokens::as_atto),
        Some(123_456_789_012_345)
    );
    // From 0.01 up, where 17 significant digits fit in 18 fraction digits, the amount reads
    // back as the same f64: nothing the f64 says is lost.
    for x in [
        2.0 / 3.0,
        0.1 + 0.2,
        1.0 / 7.0,
        0.1 / 3.0,
        0.01 + 1e-17,
        123_456.789_012_345,
        9e15 + 0.5,
    ] {
        let t = Tokens::from_f64(x).unwrap();
        assert_eq!(t.to_string().parse::<f64>().unwrap(), x, "{x} -> {t}");
    }
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
    // An f64 this large steps by 2¹¹ tokens, so only closeness is exact; the point is that it
    // did not wrap.
    assert!(t.floor() > u64::MAX - (1 << 12), "{t}");
    // It is what `{below}` prints: the shortest text that reads back as `below`.
    assert_eq!(below.to_string(), "18446744073709550000");
    assert_eq!(t, Tokens::whole(18_446_744_073_709_550_000));
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
    // One nanotoken per second is 10⁹ attotokens per second.
    assert_eq!(
        Rate::from_nanos_per_second(666_666_667)
            .unwrap()
            .per_second_amount(),
        Tokens::from_atto(666_666_667_000_000_000)
    );
    assert_eq!(Rate::MAX.per_second_amount(), Tokens::whole(1_000_000_000));
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
