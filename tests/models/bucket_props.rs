//! Property, long-run and edge-table tests of the pure token bucket (A1, A2, A3).
//!
//! Everything runs on a fake clock: time is a number the test advances, so the runs are exact
//! and repeatable, and a simulated year takes seconds. Failing proptest cases are saved in
//! `tests/models/bucket_props.proptest-regressions` and replayed first on every run.

use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use tokenlease::bucket::{
    BucketConfig, BucketState, Grant, InsufficientCapacity, Outcome, Rate, Timestamp, Tokens,
};

/// Nanoseconds in a second.
const NS_PER_S: i128 = 1_000_000_000;
/// Nanotokens in a token (rates are whole nanotokens per second).
const NANOTOKENS: i128 = 1_000_000_000;
/// Attotokens in a token (amounts are whole attotokens).
const ATTOTOKENS: i128 = 1_000_000_000_000_000_000;
/// The largest amount, `u64::MAX` whole tokens, in attotokens (about 1.8e37; i128 holds 1.7e38).
const MAX_ATTO: i128 = u64::MAX as i128 * ATTOTOKENS;
/// The largest capacity, `BucketConfig::MAX_CAPACITY` (8 × 10⁹ tokens, what the table holds),
/// in attotokens; the smallest is one nanotoken.
const MAX_CAPACITY_ATTO: u128 = BucketConfig::MAX_CAPACITY.as_atto();
const MIN_CAPACITY_ATTO: u128 = BucketConfig::MIN_CAPACITY.as_atto();
const SEC: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;
const US: u64 = 1_000;

// ---------------------------------------------------------------------------------------------
// A1: state machine against an exact reference model
// ---------------------------------------------------------------------------------------------

/// The reference bucket: plain `i128` attotokens and nanoseconds, written from the formulas and
/// not from `src/bucket`, so that a shared mistake is unlikely.
#[derive(Clone, Debug)]
struct Model {
    /// Capacity in attotokens (one nanotoken ..= `MAX_CAPACITY_ATTO`).
    capacity: i128,
    /// Refill rate in nanotokens per second (1 ..= 10¹⁸).
    rate: i128,
    /// Tokens stored at `last_refill`, in attotokens.
    tokens: i128,
    /// Last refill time, ns.
    last_refill: i128,
    /// The fake clock, ns, kept within `0 ..= u64::MAX` like a `Timestamp`.
    now: i128,
    /// Whether the capacity changed since the stored tokens were last capped.
    reconfigured: bool,
    /// What the last transition should have returned.
    expect: Expect,
}

/// The answer the reference model predicts for the last transition.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Expect {
    /// No answer to compare (a clock move or a reconfiguration).
    Nothing,
    /// The cost (or `min`) exceeds the capacity.
    TooBig,
    /// `granted` attotokens were taken; `remaining` are left.
    Granted { granted: i128, remaining: i128 },
    /// Nothing taken; `retry_after` is the exact wait, which may exceed `u64::MAX` ns.
    Denied { remaining: i128, retry_after: i128 },
    /// A return was credited.
    Credited,
}

#[derive(Clone, Debug)]
enum Op {
    /// Move the fake clock forward by this many ns.
    Advance(u64),
    /// Move the fake clock backwards by this many ns (stopping at zero).
    ClockBack(u64),
    /// `take(cost)`, attotokens.
    Acquire(u128),
    /// `grant(min, want)`, attotokens (a lease request).
    Lease { min: u128, want: u128 },
    /// `credit(amount)`, attotokens (unused lease tokens coming back).
    Return(u128),
    /// A new capacity (attotokens) and rate (nanotokens per second).
    Reconfigure { capacity: u128, rate: u64 },
}

impl Model {
    /// Tokens and last refill after refilling to `now`.
    fn refilled(&self) -> (i128, i128) {
        let elapsed = (self.now - self.last_refill).max(0);
        // elapsed/NS_PER_S seconds × rate/NANOTOKENS tokens per second, in attotokens:
        // elapsed × rate × ATTOTOKENS / (NS_PER_S × NANOTOKENS), and the fraction is exactly 1.
        // Elapsed is at most a few hundred seconds here (64 moves of ≤ 10 s), so the product
        // stays far inside i128 (< 2^110).
        const { assert!(ATTOTOKENS == NS_PER_S * NANOTOKENS) };
        let added = elapsed * self.rate;
        let tokens = (self.tokens + added).min(self.capacity);
        (tokens, self.last_refill.max(self.now))
    }

    /// The exact wait until `min` attotokens are there, from `tokens` refilled at `last`: the
    /// least whole number of nanoseconds `w` with `w × rate ≥ deficit`.
    fn wait_for(&self, tokens: i128, last: i128, min: i128) -> i128 {
        let ahead = (last - self.now).max(0);
        let deficit = min - tokens;
        assert!(deficit > 0);
        // Ceiling division of positive numbers.
        let wait = (deficit + self.rate - 1) / self.rate;
        debug_assert!(wait * self.rate >= deficit && (wait - 1) * self.rate < deficit);
        ahead + wait
    }

    fn grant(&mut self, min: i128, want: i128) {
        if min > self.capacity {
            self.expect = Expect::TooBig;
            return;
        }
        let (tokens, last) = self.refilled();
        self.last_refill = last;
        self.reconfigured = false;
        if tokens >= min {
            let granted = want.max(min).min(tokens);
            self.tokens = tokens - granted;
            self.expect = Expect::Granted {
                granted,
                remaining: self.tokens,
            };
        } else {
            self.tokens = tokens;
            self.expect = Expect::Denied {
                remaining: tokens,
                retry_after: self.wait_for(tokens, last, min),
            };
        }
    }
}

const ATTO: u128 = ATTOTOKENS as u128;
const NANO_IN_ATTO: u128 = (ATTOTOKENS / NANOTOKENS) as u128;

fn capacity_strategy() -> BoxedStrategy<u128> {
    prop_oneof![
        // Whole tokens, the common case.
        3 => (1u128..=1_000).prop_map(|n| n * ATTO),
        // Fractional capacities in whole nanotokens, down to one nanotoken.
        1 => (1u128..=1_000 * NANOTOKENS as u128).prop_map(|n| n * NANO_IN_ATTO),
        // Fractional capacities in attotokens, down to the smallest, one nanotoken.
        1 => MIN_CAPACITY_ATTO..=1_000 * ATTO,
        // Large buckets.
        1 => (1u128..=1_000_000_000).prop_map(|n| n * ATTO),
        // Up to the largest, 8 × 10⁹ whole tokens.
        1 => ATTO..=MAX_CAPACITY_ATTO,
        1 => Just(MAX_CAPACITY_ATTO),
    ]
    .boxed()
}

fn rate_strategy() -> BoxedStrategy<u64> {
    prop_oneof![
        // Below one token per second, down to one nanotoken per second.
        1u64..=1_000_000_000,
        // Common rates: 1 ..= 1,000 tokens/s, fractional.
        1_000_000_000u64..=1_000_000_000_000,
        // Whole tokens per second.
        (1u64..=1_000).prop_map(|n| n * SEC),
        Just(666_666_667u64),
        // Up to the fastest rate, one token per nanosecond.
        1_000_000_000_000u64..=1_000_000_000_000_000_000,
    ]
    .boxed()
}

fn duration_strategy() -> BoxedStrategy<u64> {
    prop_oneof![
        0u64..=10 * SEC,
        0u64..=2 * US,
        (0u64..=100).prop_map(|n| n * 100 * MS),
    ]
    .boxed()
}

/// An amount in `0 ..= limit` attotokens, biased towards edges, whole tokens and nanotokens.
/// `limit` is capped at the largest amount: `Tokens` saturates there, the model would not.
fn amount_strategy(limit: u128, capacity: u128) -> BoxedStrategy<u128> {
    let limit = limit.min(MAX_ATTO as u128);
    prop_oneof![
        4 => 0..=limit,
        2 => (0..=limit / ATTO).prop_map(|n| n * ATTO),
        1 => (0..=limit / NANO_IN_ATTO).prop_map(|n| n * NANO_IN_ATTO),
        1 => Just(0u128),
        1 => Just(capacity.min(limit)),
        1 => Just((capacity + 1).min(limit)),
        1 => Just(capacity.saturating_sub(1).min(limit)),
        1 => Just(1u128.min(limit)),
    ]
    .boxed()
}

/// The reference state machine: generates operations and predicts their results.
struct BucketMachine;

impl ReferenceStateMachine for BucketMachine {
    type State = Model;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Model> {
        (
            capacity_strategy(),
            rate_strategy(),
            // Start anywhere up to the 2030s in Unix ns, and in some cases at zero.
            prop_oneof![Just(0u64), 0u64..=2_000_000_000 * SEC],
            any::<bool>(),
        )
            .prop_map(|(capacity, rate, now, full)| Model {
                capacity: capacity as i128,
                rate: rate as i128,
                tokens: if full { capacity as i128 } else { 0 },
                last_refill: now as i128,
                now: now as i128,
                reconfigured: false,
                expect: Expect::Nothing,
            })
            .boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<Op> {
        let c = state.capacity as u128;
        prop_oneof![
            3 => duration_strategy().prop_map(Op::Advance),
            1 => duration_strategy().prop_map(Op::ClockBack),
            4 => amount_strategy(2 * c, c).prop_map(Op::Acquire),
            2 => (amount_strategy(c + 1, c), amount_strategy(2 * c, c))
                .prop_map(|(min, want)| Op::Lease { min, want }),
            2 => amount_strategy(c, c).prop_map(Op::Return),
            1 => (capacity_strategy(), rate_strategy())
                .prop_map(|(capacity, rate)| Op::Reconfigure { capacity, rate }),
        ]
        .boxed()
    }

    fn apply(mut state: Model, op: &Op) -> Model {
        state.expect = Expect::Nothing;
        match *op {
            Op::Advance(d) => state.now = (state.now + d as i128).min(u64::MAX as i128),
            Op::ClockBack(d) => state.now = (state.now - d as i128).max(0),
            Op::Acquire(cost) => state.grant(cost as i128, cost as i128),
            Op::Lease { min, want } => state.grant(min as i128, want as i128),
            Op::Return(amount) => {
                let (tokens, last) = state.refilled();
                state.tokens = (tokens + amount as i128).min(state.capacity);
                state.last_refill = last;
                state.reconfigured = false;
                state.expect = Expect::Credited;
            }
            Op::Reconfigure { capacity, rate } => {
                state.capacity = capacity as i128;
                state.rate = rate as i128;
                state.reconfigured = true;
            }
        }
        state
    }
}

/// The system under test: the library's bucket, its config and the same fake clock.
#[derive(Debug)]
struct Sut {
    config: BucketConfig,
    state: BucketState,
    now: Timestamp,
    /// `last_refill` before the last transition, to check that it never decreases.
    previous_last_refill: Timestamp,
}

fn config_of(capacity: u128, rate: u64) -> BucketConfig {
    BucketConfig::new(
        Tokens::from_atto(capacity),
        Rate::from_nanos_per_second(rate).expect("rate in range"),
    )
    .expect("capacity within the bounds")
}

fn atto(t: Tokens) -> i128 {
    i128::try_from(t.as_atto()).expect("every amount fits i128")
}

/// After a denial of `min`, a copy of the bucket is still denied 1 ns and 1 µs before
/// `retry_after`, and allowed at `retry_after` (unless that lies beyond the end of time).
fn check_retry_after(sut: &Sut, min: Tokens, retry_after: u64, exact: i128) {
    assert!(retry_after > 0, "a denial always has a wait");
    let grant_at = |at: u64| {
        let (_, g) = sut
            .state
            .grant(&sut.config, Timestamp::from_nanos(at), min, min)
            .expect("min within capacity");
        g.granted >= min && g.retry_after == 0
    };
    let now = sut.now.as_nanos();
    assert!(!grant_at(now), "still denied at the same instant");
    let Some(deadline) = now.checked_add(retry_after) else {
        // Beyond u64 nanoseconds: nothing to check at the deadline.
        return;
    };
    assert!(
        !grant_at(deadline - 1),
        "allowed 1 ns before retry_after = {retry_after}"
    );
    if retry_after >= US {
        assert!(
            !grant_at(deadline - US),
            "allowed 1 µs before retry_after = {retry_after}"
        );
    }
    if exact <= u64::MAX as i128 {
        assert!(
            grant_at(deadline),
            "still denied at retry_after = {retry_after}"
        );
    }
}

fn check_grant(
    sut: &Sut,
    reference: &Model,
    min: Tokens,
    result: Result<Grant, InsufficientCapacity>,
) {
    match (&reference.expect, result) {
        (Expect::TooBig, Err(e)) => {
            assert_eq!(e.cost, min);
            assert_eq!(e.capacity, sut.config.capacity());
        }
        (
            Expect::Granted { granted, remaining },
            Ok(Grant {
                granted: g,
                remaining: r,
                retry_after: 0,
            }),
        ) => {
            assert_eq!(atto(g), *granted, "granted");
            assert_eq!(atto(r), *remaining, "remaining");
        }
        (
            Expect::Denied {
                remaining,
                retry_after,
            },
            Ok(g),
        ) => {
            assert_eq!(atto(g.granted), 0, "a denial grants nothing");
            assert_eq!(atto(g.remaining), *remaining, "remaining");
            let saturated = (*retry_after).min(u64::MAX as i128) as u64;
            assert_eq!(g.retry_after, saturated, "retry_after");
            check_retry_after(sut, min, g.retry_after, *retry_after);
        }
        (expect, got) => panic!("reference expects {expect:?}, bucket returned {got:?}"),
    }
}

impl StateMachineTest for Sut {
    type SystemUnderTest = Sut;
    type Reference = BucketMachine;

    fn init_test(reference: &Model) -> Sut {
        let state = BucketState {
            tokens: Tokens::from_atto(reference.tokens as u128),
            last_refill: Timestamp::from_nanos(reference.last_refill as u64),
        };
        Sut {
            config: config_of(reference.capacity as u128, reference.rate as u64),
            state,
            now: Timestamp::from_nanos(reference.now as u64),
            previous_last_refill: state.last_refill,
        }
    }

    fn apply(mut sut: Sut, reference: &Model, op: Op) -> Sut {
        sut.previous_last_refill = sut.state.last_refill;
        match op {
            Op::Advance(d) => sut.now = sut.now.saturating_add(d),
            Op::ClockBack(d) => {
                sut.now = Timestamp::from_nanos(sut.now.as_nanos().saturating_sub(d))
            }
            Op::Acquire(cost) => {
                let cost = Tokens::from_atto(cost);
                let before = sut.state;
                let result = sut.state.take(&sut.config, sut.now, cost);
                // take() and grant(cost, cost) must agree.
                let as_grant = before.grant(&sut.config, sut.now, cost, cost);
                match (&result, &as_grant) {
                    (Ok((s1, outcome)), Ok((s2, g))) => {
                        assert_eq!(s1, s2);
                        match *outcome {
                            Outcome::Allowed { remaining } => {
                                assert_eq!(g.granted, cost);
                                assert_eq!(g.remaining, remaining);
                            }
                            Outcome::Denied {
                                remaining,
                                retry_after,
                            } => {
                                assert_eq!(g.granted, Tokens::ZERO);
                                assert_eq!(g.remaining, remaining);
                                assert_eq!(g.retry_after, retry_after);
                            }
                        }
                    }
                    (Err(a), Err(b)) => assert_eq!(a, b),
                    _ => panic!("take {result:?} and grant {as_grant:?} disagree"),
                }
                let grant = as_grant.map(|(state, g)| {
                    sut.state = state;
                    g
                });
                check_grant(&sut, reference, cost, grant);
            }
            Op::Lease { min, want } => {
                let min = Tokens::from_atto(min);
                let result = sut
                    .state
                    .grant(&sut.config, sut.now, min, Tokens::from_atto(want))
                    .map(|(state, g)| {
                        sut.state = state;
                        g
                    });
                check_grant(&sut, reference, min, result);
            }
            Op::Return(amount) => {
                assert_eq!(reference.expect, Expect::Credited);
                sut.state = sut
                    .state
                    .credit(&sut.config, sut.now, Tokens::from_atto(amount));
            }
            Op::Reconfigure { capacity, rate } => sut.config = config_of(capacity, rate),
        }
        sut
    }

    fn check_invariants(sut: &Sut, reference: &Model) {
        // The bucket equals the reference exactly: both are integers.
        assert_eq!(atto(sut.state.tokens), reference.tokens, "tokens");
        assert_eq!(
            sut.state.last_refill.as_nanos() as i128,
            reference.last_refill,
            "last_refill"
        );
        assert_eq!(sut.now.as_nanos() as i128, reference.now, "clock");
        assert_eq!(atto(sut.config.capacity()), reference.capacity, "capacity");
        // last_refill never decreases (tikv/pd#10744).
        assert!(
            sut.state.last_refill >= sut.previous_last_refill,
            "last_refill went back"
        );
        // 0 ≤ tokens ≤ C. Tokens cannot be negative; the reference could, so check it there.
        assert!(reference.tokens >= 0, "reference below zero");
        if !reference.reconfigured {
            assert!(
                sut.state.tokens <= sut.config.capacity(),
                "stored tokens above capacity"
            );
        }
        // What any caller observes now is within [0, C], even right after a lowered capacity.
        let seen = sut.state.refill(&sut.config, sut.now);
        assert!(
            seen.tokens <= sut.config.capacity(),
            "observed tokens above capacity"
        );
        assert!(seen.last_refill >= sut.state.last_refill);
    }
}

/// Failing cases are saved in `bucket_props.proptest-regressions` beside this file and replayed
/// first. Named here because proptest's default (`SourceParallel`) finds the binary's `main.rs`
/// and would use `bucket_props.txt` in a `proptest-regressions` directory under `tests/` instead.
fn regressions_beside_this_file() -> Option<Box<dyn proptest::test_runner::FailurePersistence>> {
    Some(Box::new(
        proptest::test_runner::FileFailurePersistence::WithSource("proptest-regressions"),
    ))
}

prop_state_machine! {
    #![proptest_config(ProptestConfig {
        cases: 2048,
        failure_persistence: regressions_beside_this_file(),
        ..ProptestConfig::default()
    })]

    /// A1: 2,048 random schedules of up to 64 operations; the bucket matches the reference model
    /// exactly after every step.
    #[test]
    fn bucket_matches_reference_model(sequential 1..64 => Sut);
}

// ---------------------------------------------------------------------------------------------
// A1 (companion): random sequences with extreme values never panic
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum WildOp {
    Take(u64, u128),
    Grant(u64, u128, u128),
    Credit(u64, u128),
    Refill(u64),
    TimeToFull(u64),
}

fn extreme_u64() -> BoxedStrategy<u64> {
    prop_oneof![
        any::<u64>(),
        Just(0u64),
        Just(1u64),
        Just(u64::MAX),
        Just(u64::MAX - 1),
    ]
    .boxed()
}

fn extreme_tokens() -> BoxedStrategy<u128> {
    prop_oneof![
        any::<u128>(),
        0u128..=Tokens::MAX.as_atto(),
        // Whole nanotokens, as the previous scale had them.
        (0u128..=Tokens::MAX.as_nanos()).prop_map(|n| n * NANO_IN_ATTO),
        Just(0u128),
        Just(1u128),
        Just(Tokens::MAX.as_atto()),
        Just(Tokens::MAX.as_atto() - 1),
        Just(Tokens::MAX.as_atto() + 1),
        Just(u128::MAX),
    ]
    .boxed()
}

fn wild_op() -> impl Strategy<Value = WildOp> {
    prop_oneof![
        (extreme_u64(), extreme_tokens()).prop_map(|(t, c)| WildOp::Take(t, c)),
        (extreme_u64(), extreme_tokens(), extreme_tokens())
            .prop_map(|(t, m, w)| WildOp::Grant(t, m, w)),
        (extreme_u64(), extreme_tokens()).prop_map(|(t, a)| WildOp::Credit(t, a)),
        extreme_u64().prop_map(WildOp::Refill),
        extreme_u64().prop_map(WildOp::TimeToFull),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 1024,
        failure_persistence: regressions_beside_this_file(),
        ..ProptestConfig::default()
    })]

    /// Arbitrary timestamps (in any order), amounts up to and beyond `Tokens::MAX`, and rates at
    /// both ends: no panic (debug overflow checks are on), and tokens stay within [0, C].
    #[test]
    fn extreme_sequences_never_panic(
        // Every capacity `BucketConfig::new` accepts: the extremes clamped into its bounds.
        capacity in extreme_tokens().prop_map(|c| c.clamp(MIN_CAPACITY_ATTO, MAX_CAPACITY_ATTO)),
        rate in prop_oneof![Just(1u64), Just(Rate::MAX.as_nanos_per_second()),
                            1u64..=Rate::MAX.as_nanos_per_second()],
        start in extreme_tokens(),
        last_refill in extreme_u64(),
        ops in proptest::collection::vec(wild_op(), 1..40),
    ) {
        let config = config_of(capacity, rate);
        let cap = config.capacity();
        let mut state = BucketState {
            tokens: Tokens::from_atto(start).min(cap),
            last_refill: Timestamp::from_nanos(last_refill),
        };
        for op in ops {
            let before = state.last_refill;
            match op {
                WildOp::Take(now, cost) => {
                    let cost = Tokens::from_atto(cost);
                    match state.take(&config, Timestamp::from_nanos(now), cost) {
                        Ok((next, outcome)) => {
                            prop_assert!(cost <= cap);
                            match outcome {
                                Outcome::Allowed { remaining } | Outcome::Denied { remaining, .. } => {
                                    prop_assert!(remaining <= cap);
                                    prop_assert_eq!(remaining, next.tokens);
                                }
                            }
                            state = next;
                        }
                        Err(e) => prop_assert!(e.cost > cap),
                    }
                }
                WildOp::Grant(now, min, want) => {
                    let min = Tokens::from_atto(min);
                    match state.grant(&config, Timestamp::from_nanos(now), min, Tokens::from_atto(want)) {
                        Ok((next, g)) => {
                            prop_assert!(g.granted.is_zero() || g.granted >= min);
                            prop_assert!(g.granted <= cap && g.remaining <= cap);
                            state = next;
                        }
                        Err(e) => prop_assert!(e.cost > cap),
                    }
                }
                WildOp::Credit(now, amount) => {
                    state = state.credit(&config, Timestamp::from_nanos(now), Tokens::from_atto(amount));
                }
                WildOp::Refill(now) => state = state.refill(&config, Timestamp::from_nanos(now)),
                WildOp::TimeToFull(now) => {
                    let _ = state.time_to_full(&config, Timestamp::from_nanos(now));
                }
            }
            prop_assert!(state.tokens <= cap);
            prop_assert!(state.last_refill >= before);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A2: long-run accuracy with a fractional rate (firecracker #3370)
// ---------------------------------------------------------------------------------------------

/// Attempts to take one token at each of `times` (ns) from a full bucket of one token refilling
/// at `per_second` tokens/s (rounded by `Rate::from_f64`); returns how many were admitted.
fn admitted(per_second: f64, times: impl Iterator<Item = u64>) -> u64 {
    let config = BucketConfig::new(Tokens::whole(1), Rate::from_f64(per_second).unwrap()).unwrap();
    let mut state = BucketState::full(&config, Timestamp::from_nanos(0));
    let mut admitted = 0;
    for now in times {
        let (next, outcome) = state
            .take(&config, Timestamp::from_nanos(now), Tokens::whole(1))
            .unwrap();
        admitted += u64::from(outcome.is_allowed());
        state = next;
    }
    admitted
}

fn admitted_at_two_thirds(times: impl Iterator<Item = u64>) -> u64 {
    admitted(2.0 / 3.0, times)
}

/// The exact rational bucket for comparison: C = 1, rate exactly `p / q` tokens per second.
/// Tokens are counted in units of 1 / (q × 10⁹) token, so one nanosecond adds exactly `p` units.
fn exact_admitted(p: i128, q: i128, times: impl Iterator<Item = u64>) -> u64 {
    let one_token = q * NS_PER_S;
    let (mut tokens, mut last, mut admitted) = (one_token, 0i128, 0);
    for now in times {
        let now = i128::from(now);
        tokens = (tokens + p * (now - last).max(0)).min(one_token);
        last = last.max(now);
        if tokens >= one_token {
            tokens -= one_token;
            admitted += 1;
        }
    }
    admitted
}

/// The exact rational bucket at exactly 2/3 token/s.
fn exact_admitted_at_two_thirds(times: impl Iterator<Item = u64>) -> u64 {
    exact_admitted(2, 3, times)
}

/// 10,000 simulated seconds of attempts every 100 ms, t = 0 ..= 10,000 s.
fn every_100_ms() -> impl Iterator<Item = u64> {
    (0..=100_000u64).map(|i| i * 100 * MS)
}

/// The same attempts, each up to 1 ms early (pseudo-random), as a real clock gives.
fn every_100_ms_jittered() -> impl Iterator<Item = u64> {
    // xorshift64: deterministic, no dependency.
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    (0..=100_000u64).map(move |i| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (i * 100 * MS).saturating_sub(seed % MS)
    })
}

/// A2 as docs/testing.md states it: 1 + ⌊r·T⌋ ± 1 = 6,667 ± 1.
///
/// With the exact refill each 100 ms adds 100,000,000 ns × 666,666,667 nanotokens/s =
/// 66,666,666.7 nanotokens with nothing floored away, so 15 calls (exactly 1.5 s) add
/// 1.0000000005 tokens: every token is admitted on the attempt at which the exact 2/3 bucket
/// also has it, and the run admits at 0, 1.5, 3.0, …, 9,999 s: 6,667. (The nanotoken floor
/// used to leave 999,999,990 nanotokens at 1.5 s and admitted 6,251.) That the run lands on
/// the figure also relies on 2/3 rounding *up* to whole nanotokens per second: see
/// `a2_exact_grid_with_a_rate_rounded_down_lags_one_attempt`.
#[test]
fn a2_fractional_rate_long_run_admits_one_plus_floor_rt() {
    let admitted = admitted_at_two_thirds(every_100_ms());
    assert!(
        admitted.abs_diff(6_667) <= 1,
        "admitted {admitted}, expected 6,667 ± 1"
    );
    assert_eq!(admitted, 6_667);
}

/// The bucket is exact for the rate it is configured with: on any schedule it admits what the
/// exact rational bucket at 666,666,667 / 10⁹ token/s admits, attempt for attempt.
#[test]
fn a2_matches_exact_rational_bucket_at_the_configured_rate() {
    let configured = (666_666_667, NANOTOKENS);
    assert_eq!(
        Rate::from_f64(2.0 / 3.0).unwrap().as_nanos_per_second(),
        666_666_667
    );
    for (name, admitted, exact) in [
        (
            "exact grid",
            admitted_at_two_thirds(every_100_ms()),
            exact_admitted(configured.0, configured.1, every_100_ms()),
        ),
        (
            "jittered",
            admitted_at_two_thirds(every_100_ms_jittered()),
            exact_admitted(configured.0, configured.1, every_100_ms_jittered()),
        ),
    ] {
        assert_eq!(admitted, exact, "{name}");
    }
}

/// Attempts every 100 ms minus a pseudo-random offset below 1 ms: within ±1 of the exact
/// rational bucket at exactly 2/3 token/s over 10,000 s. (Both admit fewer than 6,667 here: the
/// cap at C = 1 discards what accrues between the refill reaching one token and the next
/// attempt.)
#[test]
fn a2_jittered_attempts_match_exact_rational_bucket() {
    let admitted = admitted_at_two_thirds(every_100_ms_jittered());
    let exact = exact_admitted_at_two_thirds(every_100_ms_jittered());
    assert!(
        admitted.abs_diff(exact) <= 1,
        "admitted {admitted}, exact rational bucket {exact}"
    );
}

/// The exact rational bucket reaches A2's figure on the exact grid too.
#[test]
fn a2_exact_rational_bucket_admits_6667_on_the_exact_grid() {
    assert_eq!(exact_admitted_at_two_thirds(every_100_ms()), 6_667);
}

/// What is left of the exact-grid effect: the rate itself is whole nanotokens per second. 1/3
/// token/s rounds *down* to 333,333,333, so 30 attempts (exactly 3 s, when the exact 1/3 bucket
/// holds one token) bring 0.99999999900 token, and each token is admitted one attempt late: a
/// 3.1 s cycle, 1 + ⌊10,000 / 3.1⌋ = 3,226 instead of 1 + ⌊r·T⌋ = 3,334. The bucket is still
/// exact for its configured rate; a rate that is not a whole number of nanotokens per second
/// on a clock that ticks in exact steps is the only way to see this.
#[test]
fn a2_exact_grid_with_a_rate_rounded_down_lags_one_attempt() {
    assert_eq!(
        Rate::from_f64(1.0 / 3.0).unwrap().as_nanos_per_second(),
        333_333_333
    );
    assert_eq!(exact_admitted(1, 3, every_100_ms()), 3_334);
    let admitted = admitted(1.0 / 3.0, every_100_ms());
    assert_eq!(admitted, 3_226);
    assert_eq!(
        admitted,
        exact_admitted(333_333_333, NANOTOKENS, every_100_ms())
    );
    // A real clock's jitter hides it: within ±1 of the exact 1/3 bucket.
    let jittered = self::admitted(1.0 / 3.0, every_100_ms_jittered());
    let exact = exact_admitted(1, 3, every_100_ms_jittered());
    assert!(jittered.abs_diff(exact) <= 1, "{jittered} vs {exact}");
}

/// A simulated year at 10 calls/s into a bucket large enough never to cap. Against the
/// configured rate (666,666,667 nanotokens/s) the refill is exact: zero drift after 315,360,000
/// calls. Against the exact 2/3 token/s the only difference is the rate's rounding,
/// +1/3 nanotoken/s × 31,536,000 s = +10,512,000 nanotokens = +0.010512 token, exactly.
/// (The nanotoken floor used to lose 0.7 nanotoken per call: a drift of about −0.21 token.)
#[test]
fn a2_year_at_ten_calls_per_second_is_exact() {
    const YEAR_S: u64 = 365 * 24 * 3600;
    let config = BucketConfig::new(
        Tokens::whole(100_000_000),
        Rate::from_f64(2.0 / 3.0).unwrap(),
    )
    .unwrap();
    let mut state = BucketState {
        tokens: Tokens::ZERO,
        last_refill: Timestamp::from_nanos(0),
    };
    let calls = YEAR_S * 10;
    for i in 1..=calls {
        state = state.refill(&config, Timestamp::from_nanos(i * 100 * MS));
    }
    let tokens = atto(state.tokens);
    // Exact at the configured rate, in attotokens: seconds × nanotokens/s × 10⁹.
    let configured = i128::from(YEAR_S) * 666_666_667 * (ATTOTOKENS / NANOTOKENS);
    assert_eq!(tokens - configured, 0, "drift against the configured rate");
    // Exact at 2/3 token/s: 21,024,000 tokens (31,536,000 is a multiple of 3).
    let exact = i128::from(YEAR_S) * 2 * ATTOTOKENS / 3;
    assert_eq!(i128::from(YEAR_S) * 2 % 3, 0);
    let drift = tokens - exact;
    println!(
        "drift after a year at 10 calls/s: {drift} attotokens ({} token) against 2/3 token/s",
        drift as f64 / ATTOTOKENS as f64
    );
    assert_eq!(drift, i128::from(YEAR_S) * ATTOTOKENS / NANOTOKENS / 3);
    assert_eq!(drift, 10_512_000_000_000_000);
    // And bounded by any rate's rounding: at most half a nanotoken per second.
    assert!(2 * drift.abs() <= i128::from(YEAR_S) * (ATTOTOKENS / NANOTOKENS));
}

// ---------------------------------------------------------------------------------------------
// A3: overflow edge table
// ---------------------------------------------------------------------------------------------

/// Every combination of capacity, rate, elapsed time and cost at the extremes: no panic (debug
/// overflow checks are on in test builds), tokens within [0, C], cost > C refused with
/// `InsufficientCapacity` before any arithmetic. The largest capacity is the table's,
/// `BucketConfig::MAX_CAPACITY` (larger ones, 2⁵³ and `u64::MAX` tokens among them, are refused
/// by `BucketConfig::new`); the costs go up to `u64::MAX` whole tokens, where `Tokens`
/// saturates. Every result is also checked against the exact answer computed in checked `u128`
/// here: with rate up to 10¹⁸ nanotokens/s and 100 years of nanoseconds the refill product
/// (≈ 3.2e36) fits, so nothing saturates on the way to the cap.
#[test]
fn a3_overflow_edge_table() {
    const HUNDRED_YEARS: u64 = 36_525 * 24 * 3600 * SEC; // 3.16e18 ns < u64::MAX
    for refused in [1u64 << 53, u64::MAX] {
        let rate = Rate::per_second(1).unwrap();
        assert!(BucketConfig::new(Tokens::whole(refused), rate).is_err());
    }
    let capacities = [1u64, 1 << 32, BucketConfig::MAX_CAPACITY_TOKENS].map(Tokens::whole);
    let rates = [
        Rate::from_f64(1e-9).unwrap(),
        Rate::per_second(1).unwrap(),
        Rate::per_second(1_000_000_000).unwrap(),
    ];
    assert_eq!(rates[0].as_nanos_per_second(), 1);
    assert_eq!(rates[2], Rate::MAX);
    let elapsed = [0u64, 1, HUNDRED_YEARS];
    let mut rows = 0;
    for capacity in capacities {
        for rate in rates {
            let config = BucketConfig::new(capacity, rate).unwrap();
            let costs = [
                Tokens::ZERO,
                Tokens::whole(1),
                capacity,
                capacity.saturating_add(Tokens::whole(1)),
                capacity.saturating_add(Tokens::from_atto(1)),
                Tokens::whole(u64::MAX),
            ];
            for e in elapsed {
                for cost in costs {
                    // From empty and from full, with last_refill at 0 and at the far end.
                    for (start, last) in [
                        (Tokens::ZERO, 0),
                        (capacity, 0),
                        (Tokens::ZERO, u64::MAX - e),
                    ] {
                        rows += 1;
                        let row = format!(
                            "C={capacity} r={} e={e} cost={cost} start={start} last={last}",
                            rate.as_nanos_per_second()
                        );
                        let state = BucketState {
                            tokens: start,
                            last_refill: Timestamp::from_nanos(last),
                        };
                        let now = Timestamp::from_nanos(last + e);
                        let refilled = state.refill(&config, now);
                        assert!(refilled.tokens <= capacity, "{row}");
                        // The exact refill, in checked u128 (a panic here is an overflow in
                        // the table itself, not in the library).
                        let added = u128::from(e)
                            .checked_mul(u128::from(rate.as_nanos_per_second()))
                            .expect("e × r fits u128");
                        let expected = start
                            .as_atto()
                            .checked_add(added)
                            .expect("start + e × r fits u128")
                            .min(capacity.as_atto());
                        assert_eq!(refilled.tokens.as_atto(), expected, "{row}");
                        let to_full = (capacity.as_atto() - expected)
                            .div_ceil(u128::from(rate.as_nanos_per_second()));
                        assert_eq!(
                            u128::from(state.time_to_full(&config, now)),
                            to_full.min(u128::from(u64::MAX)),
                            "{row}: time_to_full"
                        );
                        let credited = state.credit(&config, now, cost);
                        assert_eq!(
                            credited.tokens.as_atto(),
                            (expected + cost.as_atto()).min(capacity.as_atto()),
                            "{row}: credit"
                        );
                        match state.take(&config, now, cost) {
                            Err(err) => {
                                assert!(cost > capacity, "{row}: refused {err}");
                                assert_eq!(err.capacity, capacity, "{row}");
                            }
                            Ok((next, outcome)) => {
                                assert!(cost <= capacity, "{row}: not refused");
                                assert!(next.tokens <= capacity, "{row}");
                                assert_eq!(next.last_refill, now, "{row}");
                                match outcome {
                                    Outcome::Allowed { remaining } => {
                                        assert!(cost.as_atto() <= expected, "{row}");
                                        assert_eq!(remaining.as_atto(), expected - cost.as_atto());
                                        assert_eq!(next.tokens, remaining, "{row}");
                                    }
                                    Outcome::Denied { retry_after, .. } => {
                                        assert!(cost.as_atto() > expected, "{row}");
                                        assert_eq!(next, refilled, "{row}: a denial takes nothing");
                                        let wait = (cost.as_atto() - expected)
                                            .div_ceil(u128::from(rate.as_nanos_per_second()));
                                        assert_eq!(
                                            u128::from(retry_after),
                                            wait.min(u128::from(u64::MAX)),
                                            "{row}: retry_after"
                                        );
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    assert_eq!(rows, 3 * 3 * 3 * 6 * 3);
}
