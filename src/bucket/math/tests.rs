//! Unit tests of `math.rs`.
use super::*;

const SEC: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;

fn t(n: u64) -> Tokens {
    Tokens::whole(n)
}

fn nanos(n: u128) -> Tokens {
    Tokens::from_nanos(n)
}

fn atto(n: u128) -> Tokens {
    Tokens::from_atto(n)
}

fn config(capacity: u64, per_second: u64) -> BucketConfig {
    BucketConfig::new(t(capacity), Rate::per_second(per_second).unwrap()).unwrap()
}

fn at(tokens: Tokens, last_refill: u64) -> BucketState {
    BucketState {
        tokens,
        last_refill: Timestamp(last_refill),
    }
}

fn allowed(outcome: Outcome) -> Tokens {
    match outcome {
        Outcome::Allowed { remaining } => remaining,
        Outcome::Denied { .. } => panic!("expected Allowed, got {outcome:?}"),
    }
}

fn denied(outcome: Outcome) -> (Tokens, u64) {
    match outcome {
        Outcome::Denied {
            remaining,
            retry_after,
        } => (remaining, retry_after),
        Outcome::Allowed { .. } => panic!("expected Denied, got {outcome:?}"),
    }
}

#[test]
fn zero_capacity_is_refused() {
    assert_eq!(
        BucketConfig::new(Tokens::ZERO, Rate::MAX),
        Err(BucketConfigError::CapacityTooSmall {
            capacity: Tokens::ZERO
        })
    );
    // Below one nanotoken is below what any store counts.
    assert!(BucketConfig::new(atto(999_999_999), Rate::MAX).is_err());
    let c = BucketConfig::new(nanos(1), Rate::MAX).unwrap();
    assert_eq!(c.capacity(), nanos(1));
    assert_eq!(c.rate(), Rate::MAX);
}

#[test]
fn timestamp_helpers_saturate() {
    assert_eq!(Timestamp(5).saturating_since(Timestamp(3)), 2);
    assert_eq!(Timestamp(3).saturating_since(Timestamp(5)), 0);
    assert_eq!(
        Timestamp(u64::MAX - 1).saturating_add(5),
        Timestamp(u64::MAX)
    );
}

#[test]
fn full_bucket_starts_at_capacity() {
    let c = config(10, 1);
    let s = BucketState::full(&c, Timestamp(42));
    assert_eq!(s, at(t(10), 42));
}

#[test]
fn refill_adds_rate_times_elapsed() {
    let c = config(100, 50);
    let s = at(Tokens::ZERO, 0).refill(&c, Timestamp(SEC));
    assert_eq!(s, at(t(50), SEC));
    // 10 ms at 50/s is half a token.
    let s = at(Tokens::ZERO, 0).refill(&c, Timestamp(10 * MS));
    assert_eq!(s.tokens, nanos(500_000_000));
    // Zero elapsed adds nothing but still records the time.
    let s = at(t(3), SEC).refill(&c, Timestamp(SEC));
    assert_eq!(s, at(t(3), SEC));
}

#[test]
fn refill_is_exact_in_attotokens() {
    // 2/3 token/s rounds to 666_666_667 nanotokens/s; each nanosecond adds exactly that
    // many attotokens, with nothing floored away.
    let c = BucketConfig::new(t(1), Rate::from_f64(2.0 / 3.0).unwrap()).unwrap();
    assert_eq!(c.rate().as_nanos_per_second(), 666_666_667);
    assert_eq!(c.refill_amount(0), Tokens::ZERO);
    assert_eq!(c.refill_amount(1), atto(666_666_667));
    assert_eq!(c.refill_amount(2), atto(1_333_333_334));
    assert_eq!(c.refill_amount(3), atto(2_000_000_001));
    assert_eq!(c.refill_amount(SEC), nanos(666_666_667));
    assert_eq!(c.refill_amount(100 * MS), atto(66_666_666_700_000_000));
    // 1.5 s at the rounded rate is a whole token and 0.5 nanotoken.
    assert_eq!(c.refill_amount(1_500 * MS), atto(1_000_000_000_500_000_000));
}

/// The refill of a span equals the sum of the refills of its parts, however it is split:
/// calling often loses nothing (the nanotoken floor lost up to one nanotoken per call).
#[test]
fn refill_in_steps_equals_refill_at_once() {
    let c = BucketConfig::new(t(1_000), Rate::from_f64(2.0 / 3.0).unwrap()).unwrap();
    let empty = at(Tokens::ZERO, 0);
    let once = empty.refill(&c, Timestamp(SEC));
    let mut stepped = empty;
    for now in (1..=3)
        .chain((1..=10).map(|i| i * 100 * MS))
        .chain([SEC - 1, SEC])
    {
        stepped = stepped.refill(&c, Timestamp(now));
    }
    assert_eq!(stepped, once);
    let mut per_ns = empty;
    for now in 1..=1_000 {
        per_ns = per_ns.refill(&c, Timestamp(now));
    }
    assert_eq!(per_ns.tokens, atto(1_000 * 666_666_667));
    // One nanotoken per second adds one attotoken per nanosecond, each one kept.
    let slow = BucketConfig::new(t(1), Rate::from_nanos_per_second(1).unwrap()).unwrap();
    let mut s = empty;
    for now in 1..=1_000 {
        s = s.refill(&slow, Timestamp(now));
    }
    assert_eq!(s.tokens, atto(1_000));
}

#[test]
fn burst_up_to_capacity_then_denied() {
    let c = config(5, 1);
    let now = Timestamp(SEC);
    let mut s = BucketState::full(&c, now);
    for left in (0..5).rev() {
        let (next, outcome) = s.take(&c, now, t(1)).unwrap();
        assert_eq!(allowed(outcome), t(left));
        s = next;
    }
    let (next, outcome) = s.take(&c, now, t(1)).unwrap();
    let (remaining, retry_after) = denied(outcome);
    assert_eq!(remaining, Tokens::ZERO);
    assert_eq!(retry_after, SEC);
    assert_eq!(next, s, "a denial takes nothing");
}

#[test]
fn never_above_capacity() {
    let c = config(10, 1);
    // A long idle period fills to capacity and no further.
    let s = at(t(3), 0).refill(&c, Timestamp(1_000 * SEC));
    assert_eq!(s.tokens, t(10));
    // Returns are capped too.
    let s = s.credit(&c, Timestamp(1_000 * SEC), t(5));
    assert_eq!(s.tokens, t(10));
}

#[test]
fn never_below_zero() {
    let c = config(10, 1);
    let s = at(nanos(1), 0);
    let (s, outcome) = s.take(&c, Timestamp(0), t(1)).unwrap();
    let (remaining, _) = denied(outcome);
    assert_eq!(remaining, nanos(1));
    let (s, outcome) = s.take(&c, Timestamp(0), nanos(1)).unwrap();
    assert_eq!(allowed(outcome), Tokens::ZERO);
    assert_eq!(s.tokens, Tokens::ZERO);
    let (s, outcome) = s.take(&c, Timestamp(0), nanos(1)).unwrap();
    assert!(!outcome.is_allowed());
    assert_eq!(s.tokens, Tokens::ZERO);
}

#[test]
fn fractional_cost_and_rate() {
    // Cost 0.5 at 2/3 token/s, C = 1: two takes empty the bucket, then the third waits
    // ceil(0.5e18 attotokens / 666_666_667 nanotokens/s) ns.
    let c = BucketConfig::new(t(1), Rate::from_f64(2.0 / 3.0).unwrap()).unwrap();
    let half = nanos(500_000_000);
    let now = Timestamp(0);
    let s = BucketState::full(&c, now);
    let (s, o) = s.take(&c, now, half).unwrap();
    assert_eq!(allowed(o), half);
    let (s, o) = s.take(&c, now, half).unwrap();
    assert_eq!(allowed(o), Tokens::ZERO);
    let (s, o) = s.take(&c, now, half).unwrap();
    let (_, retry_after) = denied(o);
    let expected = (500_000_000_000_000_000u128).div_ceil(666_666_667) as u64;
    assert_eq!(retry_after, expected);
    assert_eq!(retry_after, 750_000_000);
    // Denied one nanosecond early: 749_999_999 × 666_666_667 attotokens is short of half.
    let (_, o) = s.take(&c, Timestamp(retry_after - 1), half).unwrap();
    let (remaining, wait) = denied(o);
    assert_eq!(remaining, atto(499_999_999_583_333_333));
    assert_eq!(wait, 1);
    // Allowed on time, and the 0.25 nanotoken refilled beyond the cost is kept.
    let (after, o) = s.take(&c, Timestamp(retry_after), half).unwrap();
    assert_eq!(allowed(o), atto(250_000_000));
    assert_eq!(after.tokens, atto(250_000_000));
}

#[test]
fn retry_after_is_exact_for_whole_tokens() {
    let c = config(100, 50);
    let s = at(Tokens::ZERO, 0);
    let (_, o) = s.take(&c, Timestamp(0), t(1)).unwrap();
    assert_eq!(denied(o), (Tokens::ZERO, 20 * MS));
    let (_, o) = s.take(&c, Timestamp(0), t(100)).unwrap();
    assert_eq!(denied(o).1, 2 * SEC);
}

#[test]
fn clock_backwards_refills_nothing_and_keeps_last_refill() {
    let c = config(10, 1);
    let s = at(t(2), 100 * SEC);
    let back = s.refill(&c, Timestamp(50 * SEC));
    assert_eq!(back, s, "neither tokens nor last_refill move");
    // Taking while the clock is behind still works on the tokens there are.
    let (after, o) = s.take(&c, Timestamp(50 * SEC), t(1)).unwrap();
    assert_eq!(allowed(o), t(1));
    assert_eq!(after.last_refill, Timestamp(100 * SEC));
    // The refill resumes from last_refill, not from the earlier reading.
    let later = after.refill(&c, Timestamp(101 * SEC));
    assert_eq!(later, at(t(2), 101 * SEC));
}

#[test]
fn retry_after_includes_time_that_last_refill_is_ahead() {
    let c = config(10, 1);
    // last_refill 10 s ahead of now; 1 token short.
    let s = at(Tokens::ZERO, 20 * SEC);
    let (same, o) = s.take(&c, Timestamp(10 * SEC), t(1)).unwrap();
    assert_eq!(same, s);
    let (_, retry_after) = denied(o);
    assert_eq!(retry_after, 11 * SEC);
    let (_, o) = s.take(&c, Timestamp(21 * SEC - 1), t(1)).unwrap();
    assert!(!o.is_allowed());
    let (_, o) = s.take(&c, Timestamp(21 * SEC), t(1)).unwrap();
    assert!(o.is_allowed());
}

#[test]
fn cost_zero_is_always_allowed_and_takes_nothing() {
    let c = config(10, 1);
    let s = at(Tokens::ZERO, 0);
    let (after, o) = s.take(&c, Timestamp(0), Tokens::ZERO).unwrap();
    assert_eq!(allowed(o), Tokens::ZERO);
    assert_eq!(after, s);
    let (after, o) = s.take(&c, Timestamp(SEC), Tokens::ZERO).unwrap();
    assert_eq!(allowed(o), t(1), "it still refills");
    assert_eq!(after, at(t(1), SEC));
}

#[test]
fn cost_above_capacity_is_insufficient_capacity() {
    let c = config(10, 1);
    let s = BucketState::full(&c, Timestamp(0));
    let err = s.take(&c, Timestamp(0), nanos(10_000_000_001)).unwrap_err();
    assert_eq!(
        err,
        InsufficientCapacity {
            cost: nanos(10_000_000_001),
            capacity: t(10),
        }
    );
    assert_eq!(
        err.to_string(),
        "cost 10.000000001 is larger than the capacity 10"
    );
    // One attotoken above the capacity is refused too.
    let just_over = t(10).saturating_add(atto(1));
    let err = s.take(&c, Timestamp(0), just_over).unwrap_err();
    assert_eq!(
        err.to_string(),
        "cost 10.000000000000000001 is larger than the capacity 10"
    );
    // Exactly the capacity is fine.
    let (_, o) = s.take(&c, Timestamp(0), t(10)).unwrap();
    assert_eq!(allowed(o), Tokens::ZERO);
    // grant checks `min`, not `want`.
    assert!(s.grant(&c, Timestamp(0), t(11), t(11)).is_err());
    assert!(s.grant(&c, Timestamp(0), just_over, just_over).is_err());
    assert!(s.grant(&c, Timestamp(0), t(1), t(1_000)).is_ok());
}

#[test]
fn grant_takes_up_to_want_if_min_is_there() {
    let c = config(10, 1);
    let now = Timestamp(0);
    let s = at(t(6), 0);
    // Enough for want: all of want.
    let (after, g) = s.grant(&c, now, t(2), t(4)).unwrap();
    assert_eq!(
        g,
        Grant {
            granted: t(4),
            remaining: t(2),
            retry_after: 0
        }
    );
    assert_eq!(after.tokens, t(2));
    // Between min and want: everything there.
    let (after, g) = s.grant(&c, now, t(2), t(9)).unwrap();
    assert_eq!(g.granted, t(6));
    assert_eq!(g.remaining, Tokens::ZERO);
    assert_eq!(after.tokens, Tokens::ZERO);
    // Below min: nothing, with the wait for min.
    let (after, g) = s.grant(&c, now, t(8), t(9)).unwrap();
    assert_eq!(
        g,
        Grant {
            granted: Tokens::ZERO,
            remaining: t(6),
            retry_after: 2 * SEC
        }
    );
    assert_eq!(after, s);
    // want below min is treated as min.
    let (_, g) = s.grant(&c, now, t(3), t(1)).unwrap();
    assert_eq!(g.granted, t(3));
    // min zero on an empty bucket: granted nothing, not a denial.
    let (_, g) = at(Tokens::ZERO, 0)
        .grant(&c, now, Tokens::ZERO, t(5))
        .unwrap();
    assert_eq!(g.granted, Tokens::ZERO);
    assert_eq!(g.retry_after, 0);
}

#[test]
fn credit_refills_then_caps_at_capacity() {
    let c = config(10, 1);
    let s = at(t(4), 0);
    let after = s.credit(&c, Timestamp(2 * SEC), t(3));
    assert_eq!(after, at(t(9), 2 * SEC));
    let after = s.credit(&c, Timestamp(2 * SEC), t(5));
    assert_eq!(after, at(t(10), 2 * SEC));
    let after = s.credit(&c, Timestamp(0), Tokens::MAX);
    assert_eq!(after.tokens, t(10));
    // A credit with the clock behind does not rewind last_refill.
    let after = at(t(4), 5 * SEC).credit(&c, Timestamp(SEC), t(1));
    assert_eq!(after, at(t(5), 5 * SEC));
}

#[test]
fn lowered_capacity_cuts_tokens() {
    let big = config(100, 1);
    let small = config(10, 1);
    let s = BucketState::full(&big, Timestamp(0));
    assert_eq!(s.refill(&small, Timestamp(0)).tokens, t(10));
    let (after, o) = s.take(&small, Timestamp(0), t(1)).unwrap();
    assert_eq!(allowed(o), t(9));
    assert_eq!(after.tokens, t(9));
    assert_eq!(s.credit(&small, Timestamp(0), t(1)).tokens, t(10));
    // Raising the capacity again does not bring back what was cut.
    let cut = s.refill(&small, Timestamp(0));
    assert_eq!(cut.refill(&big, Timestamp(0)).tokens, t(10));
}

#[test]
fn time_to_full() {
    let c = config(10, 2);
    assert_eq!(at(t(10), 0).time_to_full(&c, Timestamp(0)), 0);
    assert_eq!(at(t(4), 0).time_to_full(&c, Timestamp(0)), 3 * SEC);
    assert_eq!(at(t(4), 0).time_to_full(&c, Timestamp(SEC)), 2 * SEC);
    // last_refill 1 s ahead adds that second.
    assert_eq!(at(t(4), 2 * SEC).time_to_full(&c, Timestamp(SEC)), 4 * SEC);
    // A wait beyond u64 nanoseconds saturates.
    let slow = BucketConfig::new(
        BucketConfig::MAX_CAPACITY,
        Rate::from_nanos_per_second(1).unwrap(),
    )
    .unwrap();
    assert_eq!(
        at(Tokens::ZERO, 0).time_to_full(&slow, Timestamp(0)),
        u64::MAX
    );
}

#[test]
fn time_to_refill_rounds_up() {
    let c = BucketConfig::new(t(1), Rate::from_nanos_per_second(3).unwrap()).unwrap();
    // 1 nanotoken (10⁹ attotokens) at 3 nanotokens/s: 333_333_333.3 ns, rounded up.
    assert_eq!(c.time_to_refill(nanos(1)), 333_333_334);
    assert_eq!(c.time_to_refill(Tokens::ZERO), 0);
    // One attotoken still takes a whole nanosecond.
    assert_eq!(c.time_to_refill(atto(1)), 1);
    assert_eq!(c.time_to_refill(atto(3)), 1);
    assert_eq!(c.time_to_refill(atto(4)), 2);
    let fast = BucketConfig::new(t(1), Rate::MAX).unwrap();
    assert_eq!(fast.time_to_refill(t(1)), 1);
    assert_eq!(fast.time_to_refill(nanos(1)), 1);
    assert_eq!(fast.time_to_refill(atto(1)), 1);
    assert_eq!(fast.time_to_refill(t(1).saturating_add(atto(1))), 2);
}

/// `time_to_refill(d)` is the least whole number of nanoseconds whose refill covers `d`.
#[test]
fn time_to_refill_is_the_least_sufficient_wait() {
    let rates = [
        1,
        3,
        7,
        666_666_667,
        SEC,
        1_234_567_891_011,
        Rate::MAX.as_nanos_per_second(),
    ];
    let deficits = [
        1,
        2,
        999_999_999,
        1_000_000_000,
        500_000_000_000_000_000,
        Tokens::SCALE,
        Tokens::SCALE + 1,
        123_456_789_123_456_789_123,
    ];
    for rate in rates {
        let c = BucketConfig::new(
            BucketConfig::MAX_CAPACITY,
            Rate::from_nanos_per_second(rate).unwrap(),
        )
        .unwrap();
        for d in deficits {
            let wait = c.time_to_refill(atto(d));
            if d.div_ceil(u128::from(rate)) > u128::from(u64::MAX) {
                assert_eq!(wait, u64::MAX, "rate {rate}, deficit {d}: saturates");
                continue;
            }
            assert!(c.refill_amount(wait) >= atto(d), "rate {rate}, deficit {d}");
            assert!(
                c.refill_amount(wait - 1) < atto(d),
                "rate {rate}, deficit {d}: {wait} ns is not the least"
            );
        }
    }
}

#[test]
fn extreme_values_do_not_overflow() {
    let max = BucketConfig::MAX_CAPACITY;
    let c = BucketConfig::new(max, Rate::MAX).unwrap();
    let s = at(Tokens::ZERO, 0);
    assert_eq!(c.refill_amount(u64::MAX), Tokens::MAX);
    assert_eq!(s.refill(&c, Timestamp(u64::MAX)).tokens, max);
    assert_eq!(s.credit(&c, Timestamp(0), Tokens::MAX).tokens, max);
    let (_, o) = s.take(&c, Timestamp(0), max).unwrap();
    let (_, retry_after) = denied(o);
    // 8 × 10⁹ tokens at one token per nanosecond.
    assert_eq!(retry_after, 8 * SEC);
    let (_, o) = s.take(&c, Timestamp(u64::MAX), max).unwrap();
    assert_eq!(allowed(o), Tokens::ZERO);
    // (2⁶⁴ − 1) tokens at one token per nanosecond: exactly u64::MAX ns, no overflow.
    assert_eq!(c.time_to_refill(Tokens::MAX), u64::MAX);
}

/// The bounds a bucket holds are the table's (migration 0007: capacity 1 to 8 × 10¹⁸
/// nanotokens) and the policy file's: a capacity above them, `u64::MAX` tokens for
/// "unlimited" among them, is refused here with the bound and the value, not by the store
/// on every call.
#[test]
fn capacity_beyond_the_table_is_refused_where_the_bucket_is_made() {
    let rate = Rate::per_second(1).unwrap();
    for capacity in [Tokens::whole(u64::MAX), Tokens::MAX, max_plus_one()] {
        let err = BucketConfig::new(capacity, rate).unwrap_err();
        assert_eq!(err, BucketConfigError::CapacityTooLarge { capacity });
        let text = err.to_string();
        assert!(text.contains("8000000000 tokens"), "{text}");
        assert!(text.contains(&capacity.trimmed().to_string()), "{text}");
    }
    let c = BucketConfig::new(BucketConfig::MAX_CAPACITY, rate).unwrap();
    assert_eq!(c.capacity().as_nanos(), 8_000_000_000_000_000_000);
    assert_eq!(BucketConfig::MIN_CAPACITY, nanos(1));
}

fn max_plus_one() -> Tokens {
    BucketConfig::MAX_CAPACITY.saturating_add(atto(1))
}
