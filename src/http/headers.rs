//! The response header fields and the problem body.
//!
//! - `RateLimit-Policy` and `RateLimit`: draft-ietf-httpapi-ratelimit-headers (-09/-10) syntax,
//!   a structured-field list with one item per limit, named as the limit (`"api"`, `"entity"`,
//!   or the name the policy file gives it). A layer appends its items to those an inner layer
//!   wrote, so stacked layers report every limit.
//! - `X-RateLimit-{Name}-Remaining`: whole tokens left, per limit, when asked for.
//! - `Retry-After`: whole seconds, rounded up, at least 1 (denials only): the refusing limit's.

use std::time::Duration;

use axum::http::StatusCode;
use axum::http::header::HeaderName;

use crate::bucket::Tokens;
use crate::limiter::LeaseLeft;
use crate::policy::Plan;

/// `RateLimit-Policy`: each layer's quota (`q`, the capacity) and window (`w`, seconds to refill
/// from empty).
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit`: each layer's remaining quota (`r`) and seconds until it is full again, or, when
/// that layer denied, until the next request fits (`t`).
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// `X-RateLimit-Api-Remaining`: whole tokens left in the endpoint's global bucket.
pub const X_RATELIMIT_API_REMAINING: HeaderName =
    HeaderName::from_static("x-ratelimit-api-remaining");
/// `X-RateLimit-Entity-Remaining`: whole tokens left in the entity's bucket.
pub const X_RATELIMIT_ENTITY_REMAINING: HeaderName =
    HeaderName::from_static("x-ratelimit-entity-remaining");

/// What [`retry_after_secs`] drops before rounding up: rates are stored to 10⁻⁹ token/s, so
/// "5 per minute" is 0.083333333/s and its next token is 12.000000005 s away, not 12.
const ROUNDING_SLACK: Duration = Duration::from_millis(1);

/// Whole seconds for `Retry-After`: rounded up, at least 1. An excess of under 1 ms over a
/// whole second (the trace of the rate's rounding to 10⁻⁹ token/s) is not rounded up.
pub(crate) fn retry_after_secs(d: Duration) -> u64 {
    ceil_secs(d.saturating_sub(ROUNDING_SLACK)).max(1)
}

/// Whole seconds, rounded up (0 stays 0).
fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// Seconds rounded up as [`retry_after_secs`] does, but 0 stays 0.
fn seconds_up(secs: f64) -> u64 {
    if secs.is_finite() && secs > 0.0 {
        ceil_secs(Duration::from_secs_f64(secs.min(1e12)).saturating_sub(ROUNDING_SLACK))
    } else {
        0
    }
}

/// Seconds to refill `missing` tokens, rounded up as [`seconds_up`] does: in whole numbers
/// (attotokens over nanotokens per second is nanoseconds), no floating point per request.
fn refill_secs(missing: Tokens, rate: crate::bucket::Rate) -> u64 {
    let rate = rate.as_nanos_per_second();
    if missing == Tokens::ZERO || rate == 0 {
        return 0;
    }
    // A u64 division where the count fits one (up to 18 tokens missing): a u128 division is
    // a library call.
    let nanos = match u64::try_from(missing.as_atto()) {
        Ok(atto) => u128::from(atto / rate),
        Err(_) => missing.as_atto() / u128::from(rate),
    };
    let secs = u64::try_from(nanos / 1_000_000_000).map_or(MAX_SECS, |s| s.min(MAX_SECS));
    let sub = (nanos % 1_000_000_000) as u32;
    ceil_secs(Duration::new(secs, sub).saturating_sub(ROUNDING_SLACK))
}

/// The most seconds [`refill_secs`] reports, as [`seconds_up`].
const MAX_SECS: u64 = 1_000_000_000_000;

/// A plan of one limit whose capacity is a whole number of nanotokens (any capacity written in
/// tokens or to nine decimals; the largest a plan may have, 8 billion tokens, fits 64 bits
/// there), in the lease's unit: a lease take's report is then worked out in 64-bit integers.
/// [`Report::allowed`]'s arithmetic is in attotokens, where more than 18 tokens missing needs a
/// 128-bit division, a library call: 234 more instructions a request for two limits with
/// fields (`scripts/http-instructions.sh`). Made once per limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NanoScale {
    /// The capacity in nanotokens.
    capacity: u64,
    /// The refill rate in nanotokens a second, not 0.
    rate: u64,
}

impl NanoScale {
    /// `plan`'s scale, when it has one.
    pub(crate) fn of(plan: &Plan) -> Option<NanoScale> {
        if plan.bucket().is_multi() {
            return None;
        }
        let atto = plan.capacity().as_atto();
        if !atto.is_multiple_of(u128::from(NANO)) {
            return None;
        }
        let capacity = u64::try_from(atto / u128::from(NANO)).ok()?;
        let rate = plan.rate().as_nanos_per_second();
        (rate > 0).then_some(NanoScale { capacity, rate })
    }

    /// [`Report::allowed`]'s numbers for a take from a lease that left `left`: the same whole
    /// tokens and seconds (`a_lease_report_is_the_allowed_decisions`).
    fn numbers(self, left: LeaseLeft) -> (Option<u64>, u64) {
        let remaining = left
            .left
            .saturating_add(left.store_remaining)
            .min(self.capacity);
        let missing = self.capacity - remaining;
        // `refill_secs`: `missing / rate` seconds, whole ones and a fraction; rounded up unless
        // the fraction is within the slack, i.e. up when ⌊fraction · 10⁹⌋ ns > the slack's ns,
        // tested as a product (no division).
        let whole = (missing / self.rate).min(MAX_SECS);
        let fraction = missing % self.rate;
        let slack = ROUNDING_SLACK.as_nanos() + 1;
        let up = u128::from(fraction) * u128::from(NANO) >= slack * u128::from(self.rate);
        (Some(remaining / NANO), whole + u64::from(up))
    }
}

/// Nanotokens in a token, attotokens in a nanotoken, nanoseconds in a second.
const NANO: u64 = 1_000_000_000;

/// A limit's window: seconds to refill it from empty, rounded up, at least 1.
fn window_secs(limit: &crate::bucket::BucketConfig) -> u64 {
    seconds_up(limit.capacity().as_f64() / limit.rate().as_f64()).max(1)
}

/// The `RateLimit-Policy` item of a plan, e.g. `"api";q=100;w=2`; for a plan of several limits
/// one item per limit, each with its own window, the first named `name` and the others
/// `name-2`, `name-3`… (`"api";q=10;w=1, "api-2";q=10000;w=86400`).
pub(crate) fn policy_item(name: &str, plan: &Plan) -> String {
    let mut out = String::new();
    for (i, limit) in plan.bucket().limits().enumerate() {
        if i > 0 {
            out.push_str(&format!(", \"{name}-{}\"", i + 1));
        } else {
            out.push_str(&format!("\"{name}\""));
        }
        out.push_str(&format!(
            ";q={};w={}",
            limit.capacity().floor(),
            window_secs(&limit)
        ));
    }
    out
}

/// What one layer decided, as the headers report it. A layer whose remaining tokens nobody
/// knows (the allow or deny fallback decided) is left out of `RateLimit` and of its
/// `X-RateLimit-*-Remaining` field rather than reported with a made-up count.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Report {
    /// The limit's position in its route's [`RouteLimits::limits`].
    ///
    /// [`RouteLimits::limits`]: super::route::RouteLimits::limits
    pub(crate) limit: usize,
    value: Value,
}

/// A report's numbers, or what they are worked out from when written.
#[derive(Clone, Copy, Debug)]
enum Value {
    /// Whole tokens left, at most the capacity, and the seconds for the `t` parameter.
    Known { remaining: Option<u64>, t: u64 },
    /// A take from a lease: reported as [`Report::allowed`] reports the allowed decision the
    /// lease's counts make, when the fields are written (a response without them never works
    /// the numbers out).
    Lease(LeaseLeft),
}

impl Report {
    /// The report of an allowed (or refunded) take: `t` is the time to refill to full.
    /// `remaining` is reported at most at the plan's capacity (a lease's estimate can add up
    /// to more).
    ///
    /// For a plan of several limits `remaining` is the binding limit's (the fewest tokens of
    /// any), so `t` is the time until every limit is full: the store's `reset_after` when it
    /// decided, exact; otherwise (a lease decided) the longest any limit takes to fill from
    /// `remaining`, a bound that may overstate the wait but never reports the fast limit's
    /// second while a daily one is nearly spent.
    pub(crate) fn allowed(
        limit: usize,
        plan: &Plan,
        remaining: Option<Tokens>,
        reset_after: Option<Duration>,
    ) -> Report {
        let remaining = remaining.map(|r| std::cmp::min(r, plan.capacity()));
        let t = remaining.map_or(0, |remaining| {
            if !plan.bucket().is_multi() {
                return refill_secs(plan.capacity().saturating_sub(remaining), plan.rate());
            }
            match reset_after {
                Some(reset) => ceil_secs(reset.saturating_sub(ROUNDING_SLACK)),
                None => plan
                    .bucket()
                    .limits()
                    .map(|l| refill_secs(l.capacity().saturating_sub(remaining), l.rate()))
                    .max()
                    .unwrap_or(0),
            }
        });
        Report {
            limit,
            value: Value::Known {
                remaining: remaining.map(Tokens::floor),
                t,
            },
        }
    }

    /// The report of a take from a lease that left `left`: [`allowed`](Self::allowed)'s, worked
    /// out by [`numbers`](Self::numbers) when written.
    pub(crate) fn leased(limit: usize, left: LeaseLeft) -> Report {
        Report {
            limit,
            value: Value::Lease(left),
        }
    }

    /// Whole tokens left (`None` when nobody knows) and the seconds for the `t` parameter;
    /// `plan` is the limit's, and `scale` its [`NanoScale`] when it has one.
    pub(crate) fn numbers(&self, plan: &Plan, scale: Option<NanoScale>) -> (Option<u64>, u64) {
        match (self.value, scale) {
            (Value::Known { remaining, t }, _) => (remaining, t),
            (Value::Lease(left), Some(scale)) => scale.numbers(left),
            (Value::Lease(left), None) => Report::allowed(
                self.limit,
                plan,
                Some(left.remaining(plan.capacity())),
                None,
            )
            .numbers(plan, None),
        }
    }

    /// The report of a denial: `t` is the `Retry-After` value; `remaining` at most the plan's
    /// capacity, as in [`allowed`](Self::allowed).
    pub(crate) fn denied(
        limit: usize,
        plan: &Plan,
        remaining: Option<Tokens>,
        retry_after: Duration,
    ) -> Report {
        Report {
            limit,
            value: Value::Known {
                remaining: remaining.map(|r| std::cmp::min(r, plan.capacity()).floor()),
                t: retry_after_secs(retry_after),
            },
        }
    }
}

/// The status and `application/problem+json` body (RFC 9457) of a denial.
///
/// ```json
/// {"type":"about:blank","title":"Too Many Requests","status":429,
///  "detail":"rate limit of the entity layer exceeded for GET:/bookings/{bookingId}",
///  "layer":"entity","limit":"entity","endpoint":"GET:/bookings/{bookingId}","retry_after":12}
/// ```
///
/// `limit` names the refusing limit; `layer` is the same name, kept for clients written
/// before routes had named limits.
///
/// A denial by the `deny` fallback (the store could not decide) is `503 Service Unavailable`
/// with the same fields: the client did nothing wrong, the limiter could not answer.
pub(crate) fn problem(
    name: &str,
    endpoint: &str,
    retry_after: u64,
    unavailable: bool,
) -> (StatusCode, String) {
    let (status, detail) = if unavailable {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the rate limiter could not decide for the {name} layer of {endpoint} and its \
                 fallback denies"
            ),
        )
    } else {
        (
            StatusCode::TOO_MANY_REQUESTS,
            format!("rate limit of the {name} layer exceeded for {endpoint}"),
        )
    };
    let body = serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("Too Many Requests"),
        "status": status.as_u16(),
        "detail": detail,
        "layer": name,
        "limit": name,
        "endpoint": endpoint,
        "retry_after": retry_after,
    });
    (status, body.to_string())
}

/// The `application/problem+json` body of a request refused for a malformed entity id
/// (`400 Bad Request`): `reason` says what is wrong, no bucket was touched.
pub(crate) fn malformed_problem(
    reason: &dyn std::fmt::Display,
    name: &str,
    endpoint: &str,
) -> String {
    serde_json::json!({
        "type": "about:blank",
        "title": "Bad Request",
        "status": 400,
        "detail": format!("malformed entity id for {endpoint}: {reason}"),
        "layer": name,
        "limit": name,
        "endpoint": endpoint,
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::{BucketConfig, Rate};

    fn plan(capacity: u64, per_second: f64) -> Plan {
        Plan::new(
            "p",
            BucketConfig::new(Tokens::whole(capacity), Rate::from_f64(per_second).unwrap())
                .unwrap(),
        )
    }

    #[test]
    fn retry_after_rounds_up_to_at_least_one() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1000)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1002)), 2);
        assert_eq!(retry_after_secs(Duration::from_nanos(12_000_000_005)), 12);
        assert_eq!(retry_after_secs(Duration::from_secs(12)), 12);
    }

    #[test]
    fn policy_items_use_capacity_and_refill_window() {
        assert_eq!(policy_item("api", &plan(100, 50.0)), "\"api\";q=100;w=2");
        assert_eq!(
            policy_item("entity", &plan(150, 2.5)),
            "\"entity\";q=150;w=60"
        );
        assert_eq!(policy_item("api", &plan(1, 1000.0)), "\"api\";q=1;w=1");
        assert_eq!(policy_item("api", &plan(5, 5.0 / 60.0)), "\"api\";q=5;w=60");
        let several = Plan::builder("p")
            .per_second(10)
            .per_day(10_000)
            .build()
            .expect("plan");
        assert_eq!(
            policy_item("api", &several),
            "\"api\";q=10;w=1, \"api-2\";q=10000;w=86400"
        );
    }

    #[test]
    fn allowed_report_counts_seconds_to_full() {
        let p = plan(100, 50.0);
        assert_eq!(
            Report::allowed(0, &p, Some(Tokens::whole(100)), None)
                .numbers(&p, None)
                .1,
            0
        );
        assert_eq!(
            Report::allowed(0, &p, Some(Tokens::whole(99)), None)
                .numbers(&p, None)
                .1,
            1
        );
        assert_eq!(
            Report::allowed(0, &p, Some(Tokens::whole(0)), None)
                .numbers(&p, None)
                .1,
            2
        );
    }

    /// A plan of several limits (5 a second, burst 5, and 20 an hour): `t` is the time until
    /// every limit is full, the store's `reset_after` when it gives one, else the longest any
    /// limit takes from the binding limit's `remaining` (the hourly one's 20 tokens in 3,600 s),
    /// never the fast limit's second alone.
    #[test]
    fn allowed_report_of_several_limits_waits_for_the_slowest() {
        let p = Plan::builder("p")
            .per_second(5)
            .per_hour(20)
            .build()
            .expect("plan");
        let from_lease = Report::allowed(0, &p, Some(Tokens::whole(0)), None);
        assert_eq!(from_lease.numbers(&p, None).1, 3_600);
        let from_store = Report::allowed(
            0,
            &p,
            Some(Tokens::whole(3)),
            Some(Duration::from_secs(180)),
        );
        assert_eq!(from_store.numbers(&p, None), (Some(3), 180));
        let full = Report::allowed(0, &p, Some(Tokens::whole(5)), Some(Duration::ZERO));
        assert_eq!(full.numbers(&p, None).1, 0);
    }

    /// A take from a lease is reported, when written, as the allowed decision its counts make:
    /// the lease's tokens and the store's summed, at most the capacity, in whole tokens.
    #[test]
    fn a_lease_report_is_the_allowed_decisions() {
        let nanos = |n: u64| n * 1_000_000_000;
        for p in [
            plan(100, 50.0),
            Plan::builder("p")
                .per_second(5)
                .per_hour(20)
                .build()
                .expect("plan"),
        ] {
            for (left, store) in [
                (0, 0),
                (nanos(3), nanos(4)),
                (nanos(3) + 999_999_999, 0),
                (nanos(90), nanos(90)),
                (u64::MAX, u64::MAX),
            ] {
                let left = LeaseLeft {
                    left,
                    store_remaining: store,
                };
                let eager = Report::allowed(2, &p, Some(left.remaining(p.capacity())), None)
                    .numbers(&p, None);
                let lazy = Report::leased(2, left);
                assert_eq!((lazy.limit, lazy.numbers(&p, None)), (2, eager), "{left:?}");
            }
        }
        let left = LeaseLeft {
            left: nanos(3) + 999_999_999,
            store_remaining: 0,
        };
        assert_eq!(
            Report::leased(0, left).numbers(&plan(100, 50.0), None).0,
            Some(3)
        );
        let over = LeaseLeft {
            left: nanos(90),
            store_remaining: nanos(90),
        };
        assert_eq!(
            Report::leased(0, over).numbers(&plan(100, 50.0), None),
            (Some(100), 0)
        );
    }

    /// A lease take's report worked out in nanotokens ([`NanoScale`]) is the one worked out in
    /// attotokens, for plans from 1 token a minute to a billion a second and lease counts at
    /// the edges (empty, full, within a nanotoken of a whole token or of the rounding slack)
    /// and in between; a plan it cannot scale has none.
    #[test]
    fn a_lease_report_in_nanotokens_is_the_general_one() {
        let plans = [
            plan(1, 1.0 / 60.0),
            plan(5, 5.0 / 60.0),
            plan(100, 50.0),
            plan(600, 10.0),
            plan(7, 3.0),
            plan(10_000, 0.5),
            plan(8_000_000_000, 1_000_000_000.0),
            plan(8_000_000_000, 1.0),
        ];
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for p in plans {
            let scale = NanoScale::of(&p).expect("a plan of one limit in whole tokens");
            let cap = scale.capacity;
            let mut counts = vec![
                (0, 0),
                (cap, 0),
                (cap - 1, 0),
                (0, cap),
                (u64::MAX, u64::MAX),
                (cap / 2, 1),
            ];
            // Where the refill's fraction of a second crosses the slack (1 ms).
            for ms in [0, 1, 2] {
                let missing = scale.rate / 1_000 * ms;
                for d in [0, 1, 2] {
                    let m = (missing + d).min(cap);
                    counts.push((cap - m, 0));
                    let m = missing.saturating_sub(d).min(cap);
                    counts.push((cap - m, 0));
                }
            }
            for _ in 0..2_000 {
                counts.push((next() % (cap + 1), next() % (cap / 4 + 1)));
            }
            for (left, store_remaining) in counts {
                let left = LeaseLeft {
                    left,
                    store_remaining,
                };
                let report = Report::leased(1, left);
                assert_eq!(
                    report.numbers(&p, Some(scale)),
                    report.numbers(&p, None),
                    "{p:?} {left:?}"
                );
            }
        }
        let several = Plan::builder("p")
            .per_second(5)
            .per_hour(20)
            .build()
            .expect("plan");
        assert_eq!(NanoScale::of(&several), None);
        let fraction = Plan::new(
            "p",
            BucketConfig::new(
                Tokens::from_atto(1_000_000_000_000_000_001),
                Rate::from_f64(1.0).unwrap(),
            )
            .unwrap(),
        );
        assert_eq!(NanoScale::of(&fraction), None);
    }
}
