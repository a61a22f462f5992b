//! The response header fields and the problem body.
//!
//! - `RateLimit-Policy` and `RateLimit`: draft-ietf-httpapi-ratelimit-headers (-09/-10) syntax,
//!   a structured-field list with one item per limit, named as the limit (`"api"`, `"entity"`,
//!   or the name the policy file gives it). A layer appends its items to those an inner layer
//!   wrote, so stacked layers report every limit.
//! - `X-RateLimit-{Name}-Remaining`: whole tokens left, per limit.
//! - `Retry-After`: whole seconds, rounded up, at least 1 (denials only): the refusing limit's.

use std::time::Duration;

use axum::http::header::{HeaderName, HeaderValue};
use axum::http::{HeaderMap, StatusCode};

use super::route::RouteLimits;
use crate::bucket::Tokens;
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

/// The policy's window: seconds to refill the bucket from empty, rounded up, at least 1.
fn window_secs(plan: &Plan) -> u64 {
    seconds_up(plan.capacity().as_f64() / plan.rate().as_f64()).max(1)
}

/// One `RateLimit-Policy` item, e.g. `"api";q=100;w=2`.
pub(crate) fn policy_item(name: &str, plan: &Plan) -> String {
    format!(
        "\"{name}\";q={};w={}",
        plan.capacity().floor(),
        window_secs(plan)
    )
}

/// What one layer decided, as the headers report it. A layer whose remaining tokens nobody
/// knows (the allow or deny fallback decided) is left out of `RateLimit` and of its
/// `X-RateLimit-*-Remaining` field rather than reported with a made-up count.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Report {
    /// The limit's position in its route's [`RouteLimits::limits`].
    pub(crate) limit: usize,
    /// Whole tokens left, at most the capacity.
    pub(crate) remaining: Option<u64>,
    /// Seconds for the `t` parameter.
    pub(crate) t: u64,
}

impl Report {
    /// The report of an allowed (or refunded) take: `t` is the time to refill to full.
    /// `remaining` is reported at most at the plan's capacity (a lease's estimate can add up
    /// to more).
    pub(crate) fn allowed(limit: usize, plan: &Plan, remaining: Option<Tokens>) -> Report {
        let remaining = remaining.map(|r| std::cmp::min(r, plan.capacity()));
        let t = remaining.map_or(0, |remaining| {
            let missing = plan.capacity().saturating_sub(remaining);
            seconds_up(missing.as_f64() / plan.rate().as_f64())
        });
        Report {
            limit,
            remaining: remaining.map(Tokens::floor),
            t,
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
            remaining: remaining.map(|r| std::cmp::min(r, plan.capacity()).floor()),
            t: retry_after_secs(retry_after),
        }
    }
}

/// Writes `RateLimit-Policy`, `RateLimit` and the `X-RateLimit-*-Remaining` fields of
/// `limits` and `reports`. The two lists go after those an inner layer already wrote: stacked
/// layers add their limits, never overwrite each other's.
pub(crate) fn write(headers: &mut HeaderMap, limits: &RouteLimits, reports: &[Report]) {
    // Room for every field at once, rather than growing the map field by field.
    headers.reserve(2 + reports.len());
    append(headers, RATELIMIT_POLICY, &limits.policy);
    // Written into a buffer on the stack (a route's items rarely need more), one allocation
    // for the value.
    let mut items = Buf::default();
    for r in reports {
        let Some(remaining) = r.remaining else {
            continue;
        };
        let Some(limit) = limits.limits.get(r.limit) else {
            continue;
        };
        if items.len > 0 {
            items.push(b", ");
        }
        items.push(b"\"");
        items.push(limit.name.as_bytes());
        items.push(b"\";r=");
        items.number(remaining);
        items.push(b";t=");
        items.number(r.t);
        headers.insert(limit.remaining.clone(), number_value(remaining));
    }
    if items.len > 0
        && let Some(bytes) = items.bytes()
        && let Ok(v) = HeaderValue::from_bytes(bytes)
    {
        append(headers, RATELIMIT, &v);
    }
}

/// A header value's bytes, on the stack up to 256 bytes, then on the heap.
#[derive(Default)]
struct Buf {
    stack: Option<[u8; 256]>,
    len: usize,
    heap: Vec<u8>,
}

impl Buf {
    fn push(&mut self, bytes: &[u8]) {
        let stack = self.stack.get_or_insert([0; 256]);
        if self.heap.is_empty() && self.len + bytes.len() <= stack.len() {
            stack[self.len..self.len + bytes.len()].copy_from_slice(bytes);
        } else {
            if self.heap.is_empty() {
                self.heap.extend_from_slice(&stack[..self.len]);
            }
            self.heap.extend_from_slice(bytes);
        }
        self.len += bytes.len();
    }

    fn number(&mut self, mut n: u64) {
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        loop {
            at -= 1;
            digits[at] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        self.push(&digits[at..]);
    }

    fn bytes(&self) -> Option<&[u8]> {
        if !self.heap.is_empty() {
            Some(&self.heap)
        } else {
            self.stack.as_ref().map(|s| &s[..self.len])
        }
    }
}

/// The values of small numbers, made once: a remaining count below this is a clone of a
/// static value, not an allocation.
const SMALL_NUMBERS: u64 = 4096;

/// `n` as a header value.
fn number_value(n: u64) -> HeaderValue {
    static SMALL: std::sync::OnceLock<Vec<HeaderValue>> = std::sync::OnceLock::new();
    if n >= SMALL_NUMBERS {
        return HeaderValue::from(n);
    }
    let small = SMALL.get_or_init(|| {
        // One string of every number, kept for the life of the process (about 16 KiB).
        let all: &'static str = Box::leak(
            (0..SMALL_NUMBERS)
                .map(|i| i.to_string())
                .collect::<String>()
                .into_boxed_str(),
        );
        let mut at = 0;
        (0..SMALL_NUMBERS)
            .map(|i| {
                let len = i.to_string().len();
                let v = HeaderValue::from_static(&all[at..at + len]);
                at += len;
                v
            })
            .collect()
    });
    small[n as usize].clone()
}

/// Sets `name` to `value`, or to its value, `, ` and `value` when it has one.
fn append(headers: &mut HeaderMap, name: HeaderName, value: &HeaderValue) {
    match headers.get(&name) {
        Some(old) if !old.is_empty() => {
            let mut joined = Vec::with_capacity(old.len() + 2 + value.len());
            joined.extend_from_slice(old.as_bytes());
            joined.extend_from_slice(b", ");
            joined.extend_from_slice(value.as_bytes());
            if let Ok(v) = HeaderValue::from_bytes(&joined) {
                headers.insert(name, v);
            }
        }
        _ => {
            headers.insert(name, value.clone());
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
    }

    /// A lease's estimate (its own tokens plus the bucket's count at its last refill) can
    /// exceed the capacity: the fields never report more than the limit.
    #[test]
    fn remaining_is_never_reported_above_the_limit() {
        let p = std::sync::Arc::new(plan(200, 100.0));
        let limits = two_limits(&p);
        let mut h = HeaderMap::new();
        let reports = [
            Report::allowed(0, &p, Some(Tokens::whole(208))),
            Report::denied(1, &p, Some(Tokens::whole(201)), Duration::from_millis(1500)),
        ];
        write(&mut h, &limits, &reports);
        assert_eq!(
            h[RATELIMIT_POLICY],
            "\"api\";q=200;w=2, \"entity\";q=200;w=2"
        );
        assert_eq!(h[RATELIMIT], "\"api\";r=200;t=0, \"entity\";r=200;t=2");
        assert_eq!(h[X_RATELIMIT_API_REMAINING], "200");
        assert_eq!(h[X_RATELIMIT_ENTITY_REMAINING], "200");
    }

    /// A second layer's fields go after the first's: neither overwrites the other.
    #[test]
    fn a_second_layer_appends_its_items() {
        let p = std::sync::Arc::new(plan(200, 100.0));
        let limits = two_limits(&p);
        let mut h = HeaderMap::new();
        h.insert(
            RATELIMIT_POLICY,
            HeaderValue::from_static("\"customer\";q=30;w=60"),
        );
        h.insert(RATELIMIT, HeaderValue::from_static("\"customer\";r=0;t=2"));
        write(
            &mut h,
            &limits,
            &[Report::allowed(0, &p, Some(Tokens::whole(5)))],
        );
        assert_eq!(
            h[RATELIMIT_POLICY],
            "\"customer\";q=30;w=60, \"api\";q=200;w=2, \"entity\";q=200;w=2"
        );
        assert_eq!(h[RATELIMIT], "\"customer\";r=0;t=2, \"api\";r=5;t=2");
    }

    /// A route with the limits `api` (whole route) and `entity`, both under `p`.
    fn two_limits(p: &std::sync::Arc<Plan>) -> RouteLimits {
        use super::super::route::LimitSpec;
        let limiter = crate::Limiter::builder(crate::store::MemoryStore::new()).build();
        let spec = |name: &str, entity: bool| LimitSpec {
            name: name.to_owned(),
            plan: std::sync::Arc::clone(p),
            entity: entity.then(|| super::super::EntityKey::path_param("id")),
            budget: None,
            shadow: false,
        };
        RouteLimits::new(
            vec![spec("api", false), spec("entity", true)],
            Some("/x/{id}".to_owned()),
            None,
            &limiter,
        )
    }

    #[test]
    fn allowed_report_counts_seconds_to_full() {
        let p = plan(100, 50.0);
        assert_eq!(Report::allowed(0, &p, Some(Tokens::whole(100))).t, 0);
        assert_eq!(Report::allowed(0, &p, Some(Tokens::whole(99))).t, 1);
        assert_eq!(Report::allowed(0, &p, Some(Tokens::whole(0))).t, 2);
    }
}
