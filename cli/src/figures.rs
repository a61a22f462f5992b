//! Figures as a reader takes them in: amounts of tokens to a sensible precision, a refill rate
//! in the unit its plan was most likely written in, latencies in µs or ms, durations in ms or
//! s, and long messages wrapped to a terminal's width. The JSON outputs keep the exact values.

/// Tokens per second are stored in whole nanotokens.
const NANOS: u128 = 1_000_000_000;

/// The widest line [`wrap`] writes, unless one word is wider.
pub(crate) const WIDTH: usize = 100;

/// An amount of tokens: two decimals from 1 up (`3.58`, `100`), three significant digits below
/// 1 (`0.0833`, `0.000417`), trailing zeros dropped.
pub(crate) fn tokens(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let decimals = if v.abs() >= 1.0 {
        2
    } else {
        // Three significant digits: 0.0833 has its first at the 2nd decimal, so 4 decimals.
        (2 - v.abs().log10().floor() as i64).clamp(0, 9) as usize
    };
    trim_zeros(format!("{v:.decimals$}"))
}

/// A refill rate given in nanotokens per second: `5 per minute` when a whole number of tokens
/// per second, minute, hour or day is what the stored rate rounds from (the store keeps a rate
/// to the nanotoken per second, so 5 a minute is stored as 0.083333333 a second), else tokens
/// per second to three significant digits.
pub(crate) fn rate(nanos_per_second: u128) -> String {
    const PERIODS: [(u128, &str); 4] = [
        (1, "second"),
        (60, "minute"),
        (3_600, "hour"),
        (86_400, "day"),
    ];
    for (seconds, unit) in PERIODS {
        let per_period = nanos_per_second * seconds;
        let whole = (per_period + NANOS / 2) / NANOS;
        // Rounding to a nanotoken per second is off by at most one per second of the period.
        if whole >= 1 && per_period.abs_diff(whole * NANOS) <= seconds {
            return format!("{whole} per {unit}");
        }
    }
    format!(
        "{} per second",
        tokens(nanos_per_second as f64 / NANOS as f64)
    )
}

/// A latency given in microseconds: `412.3 µs` below a millisecond, `53.8 ms` from there.
pub(crate) fn latency_us(us: f64) -> String {
    if us >= 1_000.0 {
        format!("{:.1} ms", us / 1_000.0)
    } else {
        format!("{us:.1} µs")
    }
}

/// A duration given in seconds: `412 ms` below a second, `12.3 s` from there.
pub(crate) fn seconds(s: f64) -> String {
    if s < 1.0 {
        format!("{:.0} ms", s * 1_000.0)
    } else {
        format!("{s:.1} s")
    }
}

/// `text` broken at spaces into lines of at most [`WIDTH`] characters (a longer word stays
/// whole), every line after the first indented by two spaces. Joining the lines again with
/// `"\n  "` replaced by a space gives `text` back.
pub(crate) fn wrap(text: &str) -> String {
    const INDENT: &str = "  ";
    let mut out = String::with_capacity(text.len() + text.len() / WIDTH * 3);
    let mut line = 0;
    let mut empty = true;
    for word in text.split(' ') {
        let len = word.chars().count();
        if !empty {
            if line + 1 + len > WIDTH {
                out.push('\n');
                out.push_str(INDENT);
                line = INDENT.len();
            } else {
                out.push(' ');
                line += 1;
            }
        }
        out.push_str(word);
        line += len;
        empty = false;
    }
    out
}

fn trim_zeros(s: String) -> String {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// F2: amounts to two decimals from 1 up, three significant digits below.
    #[test]
    fn f2_tokens_to_a_sensible_precision() {
        assert_eq!(tokens(3.576097319028944), "3.58");
        assert_eq!(tokens(5.0), "5");
        assert_eq!(tokens(49.5), "49.5");
        assert_eq!(tokens(100_000.004), "100000");
        assert_eq!(tokens(0.083333333), "0.0833");
        assert_eq!(tokens(0.5), "0.5");
        assert_eq!(tokens(0.000416666), "0.000417");
        assert_eq!(tokens(0.0), "0");
        assert_eq!(tokens(-2.25), "-2.25");
    }

    /// F2: a rate in the unit its plan was written in, from the rate as the store keeps it.
    #[test]
    fn f2_rates_in_the_plans_unit() {
        let stored = |tokens: f64, seconds: f64| (tokens / seconds * 1e9).round() as u128;
        assert_eq!(rate(stored(5.0, 60.0)), "5 per minute");
        assert_eq!(rate(83_333_333), "5 per minute"); // truncated rather than rounded
        assert_eq!(rate(stored(50.0, 1.0)), "50 per second");
        assert_eq!(rate(stored(20.0, 60.0)), "20 per minute");
        assert_eq!(rate(stored(2.0, 60.0)), "2 per minute");
        assert_eq!(rate(stored(7.0, 3_600.0)), "7 per hour");
        assert_eq!(rate(stored(1.0, 86_400.0)), "1 per day");
        assert_eq!(rate(stored(1e9, 1.0)), "1000000000 per second");
        // Not a whole number in any unit: per second, three significant digits.
        assert_eq!(rate(stored(1.0, 7.0)), "0.143 per second");
        assert_eq!(rate(1), "0.000000001 per second");
    }

    /// F2: latencies in µs below a millisecond, in ms above.
    #[test]
    fn f2_latencies_in_ms_above_a_millisecond() {
        assert_eq!(latency_us(0.9), "0.9 µs");
        assert_eq!(latency_us(999.94), "999.9 µs");
        assert_eq!(latency_us(1_000.0), "1.0 ms");
        assert_eq!(latency_us(53_837.8), "53.8 ms");
        assert_eq!(seconds(0.4123), "412 ms");
        assert_eq!(seconds(12.34), "12.3 s");
    }

    /// F2: long messages wrap at spaces, no line wider than WIDTH, nothing lost.
    #[test]
    fn f2_wrap_keeps_lines_short_and_the_text_whole() {
        let text = "plans.unset.fallback: the fallback is a local bucket for 1 instance (the \
                    default when \"fallback\" is unset): while the database is down or slow, \
                    every instance admits the plan's whole limit on its own, so N instances \
                    admit N times it; set \"fallback\": { \"mode\": \"local\", \"instances\": N } \
                    to the number of instances, or \"mode\": \"deny\" to refuse";
        let wrapped = wrap(text);
        assert!(wrapped.lines().count() >= 3, "{wrapped}");
        for line in wrapped.lines() {
            assert!(line.chars().count() <= WIDTH, "{line}");
        }
        for line in wrapped.lines().skip(1) {
            assert!(line.starts_with("  ") && !line.starts_with("   "), "{line}");
        }
        assert_eq!(wrapped.replace("\n  ", " "), text);
        assert_eq!(wrap("short"), "short");
        let long = "x".repeat(WIDTH + 10);
        assert_eq!(wrap(&format!("a {long} b")), format!("a\n  {long}\n  b"));
    }
}
