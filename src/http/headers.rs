//! The response header fields and the problem body.
//!
//! - `RateLimit-Policy` and `RateLimit`: draft-ietf-httpapi-ratelimit-headers (-09/-10) syntax,
//!   a structured-field list with one item per layer, named `"api"` and `"entity"`.
//! - `X-RateLimit-Api-Remaining` / `X-RateLimit-Entity-Remaining`: whole tokens left, per layer.
//! - `Retry-After`: whole seconds, rounded up, at least 1 (denials only).

use std::time::Duration;

use axum::http::header::{HeaderName, HeaderValue};
use axum::http::{HeaderMap, StatusCode};

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

/// Which of the two limits a header item or a denial belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LayerKind {
    /// The endpoint's global bucket (`ratelimit:api:...`), policy name `"api"`.
    Api,
    /// The entity's bucket (`ratelimit:entity:...`), policy name `"entity"`.
    Entity,
}

impl LayerKind {
    /// The policy name in the header fields and the problem body: `api` or `entity`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            LayerKind::Api => "api",
            LayerKind::Entity => "entity",
        }
    }
}

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
pub(crate) fn policy_item(layer: LayerKind, plan: &Plan) -> String {
    format!(
        "\"{}\";q={};w={}",
        layer.name(),
        plan.capacity().floor(),
        window_secs(plan)
    )
}

/// What one layer decided, as the headers report it. A layer whose remaining tokens nobody
/// knows (the allow or deny fallback decided) is left out of `RateLimit` and of its
/// `X-RateLimit-*-Remaining` field rather than reported with a made-up count.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Report {
    pub(crate) layer: LayerKind,
    pub(crate) remaining: Option<Tokens>,
    /// Seconds for the `t` parameter.
    pub(crate) t: u64,
}

impl Report {
    /// The report of an allowed (or refunded) take: `t` is the time to refill to full.
    /// `remaining` is reported at most at the plan's capacity (a lease's estimate can add up
    /// to more).
    pub(crate) fn allowed(layer: LayerKind, plan: &Plan, remaining: Option<Tokens>) -> Report {
        let remaining = remaining.map(|r| std::cmp::min(r, plan.capacity()));
        let t = remaining.map_or(0, |remaining| {
            let missing = plan.capacity().saturating_sub(remaining);
            seconds_up(missing.as_f64() / plan.rate().as_f64())
        });
        Report {
            layer,
            remaining,
            t,
        }
    }

    /// The report of a denial: `t` is the `Retry-After` value; `remaining` at most the plan's
    /// capacity, as in [`allowed`](Self::allowed).
    pub(crate) fn denied(
        layer: LayerKind,
        plan: &Plan,
        remaining: Option<Tokens>,
        retry_after: Duration,
    ) -> Report {
        Report {
            layer,
            remaining: remaining.map(|r| std::cmp::min(r, plan.capacity())),
            t: retry_after_secs(retry_after),
        }
    }
}

/// Writes `RateLimit-Policy`, `RateLimit` and the `X-RateLimit-*-Remaining` fields.
pub(crate) fn write(headers: &mut HeaderMap, policy: &HeaderValue, reports: &[Report]) {
    headers.insert(RATELIMIT_POLICY, policy.clone());
    let known: Vec<(LayerKind, Tokens, u64)> = reports
        .iter()
        .filter_map(|r| r.remaining.map(|remaining| (r.layer, remaining, r.t)))
        .collect();
    if known.is_empty() {
        return;
    }
    let items: Vec<String> = known
        .iter()
        .map(|(layer, remaining, t)| format!("\"{}\";r={};t={t}", layer.name(), remaining.floor()))
        .collect();
    if let Ok(v) = HeaderValue::try_from(items.join(", ")) {
        headers.insert(RATELIMIT, v);
    }
    for (layer, remaining, _) in known {
        let name = match layer {
            LayerKind::Api => X_RATELIMIT_API_REMAINING,
            LayerKind::Entity => X_RATELIMIT_ENTITY_REMAINING,
        };
        headers.insert(name, HeaderValue::from(remaining.floor()));
    }
}

/// The status and `application/problem+json` body (RFC 9457) of a denial.
///
/// ```json
/// {"type":"about:blank","title":"Too Many Requests","status":429,
///  "detail":"rate limit of the entity layer exceeded for GET:/bookings/{bookingId}",
///  "layer":"entity","endpoint":"GET:/bookings/{bookingId}","retry_after":12}
/// ```
///
/// A denial by the `deny` fallback (the store could not decide) is `503 Service Unavailable`
/// with the same fields: the client did nothing wrong, the limiter could not answer.
pub(crate) fn problem(
    layer: LayerKind,
    endpoint: &str,
    retry_after: u64,
    unavailable: bool,
) -> (StatusCode, String) {
    let (status, detail) = if unavailable {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the rate limiter could not decide for the {} layer of {endpoint} and its fallback denies",
                layer.name()
            ),
        )
    } else {
        (
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "rate limit of the {} layer exceeded for {endpoint}",
                layer.name()
            ),
        )
    };
    let body = serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("Too Many Requests"),
        "status": status.as_u16(),
        "detail": detail,
        "layer": layer.name(),
        "endpoint": endpoint,
        "retry_after": retry_after,
    });
    (status, body.to_string())
}

/// The `application/problem+json` body of a request refused for a malformed entity id
/// (`400 Bad Request`): `reason` says what is wrong, no bucket was touched.
pub(crate) fn malformed_problem(reason: &dyn std::fmt::Display, endpoint: &str) -> String {
    serde_json::json!({
        "type": "about:blank",
        "title": "Bad Request",
        "status": 400,
        "detail": format!("malformed entity id for {endpoint}: {reason}"),
        "layer": LayerKind::Entity.name(),
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
        assert_eq!(
            policy_item(LayerKind::Api, &plan(100, 50.0)),
            "\"api\";q=100;w=2"
        );
        assert_eq!(
            policy_item(LayerKind::Entity, &plan(150, 2.5)),
            "\"entity\";q=150;w=60"
        );
        assert_eq!(
            policy_item(LayerKind::Api, &plan(1, 1000.0)),
            "\"api\";q=1;w=1"
        );
        assert_eq!(
            policy_item(LayerKind::Api, &plan(5, 5.0 / 60.0)),
            "\"api\";q=5;w=60"
        );
    }

    /// A lease's estimate (its own tokens plus the bucket's count at its last refill) can
    /// exceed the capacity: the fields never report more than the limit.
    #[test]
    fn remaining_is_never_reported_above_the_limit() {
        let p = plan(200, 100.0);
        let mut h = HeaderMap::new();
        let policy = HeaderValue::from_static("\"api\";q=200;w=2");
        let reports = [
            Report::allowed(LayerKind::Api, &p, Some(Tokens::whole(208))),
            Report::denied(
                LayerKind::Entity,
                &p,
                Some(Tokens::whole(201)),
                Duration::from_millis(1500),
            ),
        ];
        write(&mut h, &policy, &reports);
        assert_eq!(h[RATELIMIT], "\"api\";r=200;t=0, \"entity\";r=200;t=2");
        assert_eq!(h[X_RATELIMIT_API_REMAINING], "200");
        assert_eq!(h[X_RATELIMIT_ENTITY_REMAINING], "200");
    }

    #[test]
    fn allowed_report_counts_seconds_to_full() {
        let p = plan(100, 50.0);
        assert_eq!(
            Report::allowed(LayerKind::Api, &p, Some(Tokens::whole(100))).t,
            0
        );
        assert_eq!(
            Report::allowed(LayerKind::Api, &p, Some(Tokens::whole(99))).t,
            1
        );
        assert_eq!(
            Report::allowed(LayerKind::Api, &p, Some(Tokens::whole(0))).t,
            2
        );
    }
}
