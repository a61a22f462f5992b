//! The checks a policy file goes through after its JSON is read: ranges, names and references,
//! for plans, their leases and fallbacks (routes and entities: `routes.rs`).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt::Write as _;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use super::error::{Kind, PolicyError, number, push_key, quote, shorten};
use super::raw::{
    Obj, RawAccounting, RawFallback, RawFallbackMode, RawLease, RawPlan, RawPolicies,
};
use super::types::{
    Accounting, FallbackMode, FallbackSettings, FieldsOn, KeyRule, LeaseSettings, Plan, Policies,
    Route,
};
use crate::bucket::{BucketConfig, Rate, Tokens};

use super::MAX_PLANS;

/// The unit of [`Rate`]: nanotokens per token.
pub(super) const NANOTOKENS_PER_TOKEN: u128 = 1_000_000_000;

/// The longest plan name, in characters.
pub(super) const MAX_PLAN_NAME: usize = 64;

/// The longest entity type, in characters.
pub(super) const MAX_ENTITY_TYPE: usize = 64;

/// Lease `ttl_ms`: from 10 ms to 10 minutes.
pub(super) const TTL_MS: std::ops::RangeInclusive<u64> = 10..=600_000;

/// The longest lease `max_wait_ms`: one minute (and never longer than `ttl_ms`).
pub(super) const MAX_WAIT_MS: u64 = 60_000;

/// The most `fallback.instances`.
pub(super) const MAX_INSTANCES: u32 = 10_000;

/// The largest capacity a plan may have, in whole tokens: [`BucketConfig::MAX_CAPACITY_TOKENS`],
/// what PostgreSQL's bigint columns hold in nanotokens with room for a refill's sum (migration
/// 0007). One constant for the bucket, the policy file and the store, so a policy that works
/// over `MemoryStore` works over `PostgresStore` too.
pub const MAX_CAPACITY: u64 = BucketConfig::MAX_CAPACITY_TOKENS;

/// How many defined plans an "unknown plan" message lists.
pub(super) const LISTED_PLANS: usize = 10;

/// The HTTP methods a route may name.
pub(super) const METHODS: [&str; 9] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT",
];

/// The checks that run after the JSON has been read: ranges, names and references.
pub(super) struct Checker {
    pub(super) file: String,
}

impl Checker {
    /// An error at `field`.
    pub(super) fn err(&self, field: impl Into<String>, message: impl Into<String>) -> PolicyError {
        PolicyError::new(&self.file, message).with_field(field)
    }

    /// An error at `field` inside plan `plan`.
    pub(super) fn plan_err(
        &self,
        plan: &str,
        field: &str,
        message: impl Into<String>,
    ) -> PolicyError {
        let mut path = String::from("plans");
        push_key(&mut path, plan);
        if !field.is_empty() {
            path.push('.');
            path.push_str(field);
        }
        self.err(path, message).with_plan(plan)
    }

    pub(super) fn check(self, raw: RawPolicies) -> Result<Policies, PolicyError> {
        if raw.plans.entries.is_empty() {
            return Err(self.err("plans", "no plans: define at least one"));
        }
        let count = raw.plans.entries.len();
        if count > MAX_PLANS {
            return Err(self
                .err(
                    "plans",
                    format!(
                        "too many plans: {count}, more than the {MAX_PLANS} a limiter can hold"
                    ),
                )
                .with_kind(Kind::TooManyPlans(u32::try_from(count).unwrap_or(u32::MAX))));
        }
        if let Some(name) = raw.plans.duplicates.first() {
            return Err(self.plan_err(
                name,
                "",
                "duplicate plan name: each plan may be defined once",
            ));
        }
        let mut plans = Vec::with_capacity(raw.plans.entries.len());
        let mut by_name = HashMap::with_capacity(raw.plans.entries.len());
        for (name, raw_plan) in raw.plans.entries {
            let plan = self.plan(&name, raw_plan)?;
            by_name.insert(name, plans.len());
            plans.push(Arc::new(plan));
        }
        let lookup = |field: &str, name: &str| -> Result<usize, PolicyError> {
            by_name.get(name).copied().ok_or_else(|| {
                let mut known: Vec<&str> = by_name.keys().map(String::as_str).collect();
                known.sort_unstable();
                let mut listed = known
                    .iter()
                    .take(LISTED_PLANS)
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", ");
                if known.len() > LISTED_PLANS {
                    let _ = write!(listed, ", … ({} in all)", known.len());
                }
                self.err(
                    field,
                    format!("unknown plan {}; defined plans: {listed}", quote(name)),
                )
                .with_plan(name)
            })
        };

        let default_plan = match &raw.default_plan {
            Some(name) => Some(lookup("default_plan", name)?),
            None => None,
        };

        let mut keys: Vec<(KeyRule, usize)> = Vec::with_capacity(raw.keys.len());
        // Prefix → index of its rule, for duplicates in constant time.
        let mut prefixes: HashMap<String, usize> = HashMap::with_capacity(raw.keys.len());
        for (i, Obj(rule)) in raw.keys.into_iter().enumerate() {
            let field = format!("keys[{i}]");
            if rule.prefix.is_empty() {
                return Err(self.err(
                    format!("{field}.prefix"),
                    "must not be empty; use default_plan for keys no prefix matches",
                ));
            }
            if let Err(e) = crate::key::validate_key(&rule.prefix) {
                let reason = e.to_string();
                let reason = reason.strip_prefix("invalid key: ").unwrap_or(&reason);
                return Err(self.err(
                    format!("{field}.prefix"),
                    format!("no key can start with this prefix: {reason}"),
                ));
            }
            match prefixes.entry(rule.prefix.clone()) {
                Entry::Occupied(first) => {
                    return Err(self.err(
                        format!("{field}.prefix"),
                        format!(
                            "duplicate prefix {}: already at keys[{}]",
                            quote(&rule.prefix),
                            first.get()
                        ),
                    ));
                }
                Entry::Vacant(slot) => {
                    slot.insert(i);
                }
            }
            let plan = lookup(&format!("{field}.plan"), &rule.plan)?;
            keys.push((
                KeyRule {
                    prefix: rule.prefix,
                    plan: rule.plan,
                },
                plan,
            ));
        }
        // Longest prefix first; the sort is stable, so file order breaks ties (there are none:
        // prefixes are unique, and equal lengths cannot both match one key).
        keys.sort_by_key(|(rule, _)| std::cmp::Reverse(rule.prefix.len()));
        let (keys, key_plans) = keys.into_iter().unzip();

        let x_ratelimit_remaining = raw.x_ratelimit_remaining;
        let fields_on = match raw.fields_on.as_deref() {
            None => FieldsOn::default(),
            Some(given) => FieldsOn::ALL
                .into_iter()
                .find(|f| f.as_str() == given)
                .ok_or_else(|| {
                    let [default, other] = FieldsOn::ALL.map(FieldsOn::as_str);
                    self.err(
                        "fields_on",
                        format!(
                            "unknown value {}; expected \"{default}\" (the default) or \"{other}\"",
                            quote(given)
                        ),
                    )
                })?,
        };
        let budgets = self.budgets(raw.budgets, &lookup)?;
        let mut routes: Vec<Route> = Vec::with_capacity(raw.routes.len());
        // Shape (method, path without parameter names) → index of its route.
        let mut shapes: HashMap<(String, String), usize> = HashMap::with_capacity(raw.routes.len());
        for (i, Obj(raw_route)) in raw.routes.into_iter().enumerate() {
            let field = format!("routes[{i}]");
            let (route, shape) = self.route(&field, raw_route, &lookup, &budgets)?;
            match shapes.entry(shape) {
                Entry::Occupied(first) => {
                    let first = *first.get();
                    let other = &routes[first];
                    let message = if other.path == route.path {
                        format!(
                            "duplicate route {} {}: already at routes[{first}]",
                            route.method,
                            shorten(&route.path)
                        )
                    } else {
                        format!(
                            "duplicate route {} {}: matches the same requests as \
                             routes[{first}] ({} {})",
                            route.method,
                            shorten(&route.path),
                            other.method,
                            shorten(&other.path)
                        )
                    };
                    return Err(self.err(field, message));
                }
                Entry::Vacant(slot) => {
                    slot.insert(i);
                }
            }
            routes.push(route);
        }

        Ok(Policies {
            origin: self.file,
            plans,
            by_name,
            default_plan,
            keys,
            key_plans,
            routes,
            x_ratelimit_remaining,
            fields_on,
        })
    }

    pub(super) fn plan(&self, name: &str, raw: RawPlan) -> Result<Plan, PolicyError> {
        let name_ok = !name.is_empty()
            && name.chars().count() <= MAX_PLAN_NAME
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
        if !name_ok {
            return Err(self.plan_err(
                name,
                "",
                format!(
                    "invalid plan name {}: use 1 to {MAX_PLAN_NAME} of A-Z a-z 0-9 _ . -",
                    quote(name)
                ),
            ));
        }
        let bucket = self.bucket(name, &raw)?;
        let smallest = bucket.capacity().floor();
        let mut plan = Plan::new(name, bucket);
        if let Some(Obj(lease)) = raw.lease {
            let lease = self.lease(name, lease, smallest)?;
            if bucket.is_multi() && lease.accounting == Accounting::Strict {
                return Err(self.plan_err(
                    name,
                    "lease.accounting",
                    "strict accounting is not available on a plan of several limits: use \
                     \"relaxed\" (unused lease tokens still go back to every limit)",
                ));
            }
            plan = plan.with_lease(lease);
        }
        if let Some(Obj(fallback)) = raw.fallback {
            plan = plan.with_fallback(self.fallback(name, fallback, smallest)?);
        }
        if raw.shadow == Some(true) {
            plan = plan.with_shadow(true);
        }
        Ok(plan)
    }

    /// The bucket of plan `name`: its `capacity` and rate, or its `limits`.
    fn bucket(&self, name: &str, raw: &RawPlan) -> Result<BucketConfig, PolicyError> {
        let Some(limits) = &raw.limits else {
            let Some(capacity) = raw.capacity else {
                return Err(self.plan_err(
                    name,
                    "",
                    "missing capacity: give capacity with refill_per_second or refill, or \
                     limits (a list of such limits)",
                ));
            };
            let (capacity, rate) = self.limit(
                name,
                "",
                capacity,
                raw.refill_per_second,
                raw.refill.as_ref(),
            )?;
            // The range was checked above, in the file's words; this is the same bound.
            return BucketConfig::new(capacity, rate)
                .map_err(|e| self.plan_err(name, "capacity", e.to_string()));
        };
        if raw.capacity.is_some() || raw.refill_per_second.is_some() || raw.refill.is_some() {
            return Err(self.plan_err(
                name,
                "limits",
                "give either limits or capacity with a refill rate, not both: with limits, \
                 each limit has its own capacity and rate",
            ));
        }
        if limits.len() < 2 || limits.len() > BucketConfig::MAX_LIMITS {
            return Err(self.plan_err(
                name,
                "limits",
                format!(
                    "must list 2 to {} limits, got {} (a plan of one limit gives capacity \
                     and refill_per_second or refill instead)",
                    BucketConfig::MAX_LIMITS,
                    limits.len()
                ),
            ));
        }
        let mut bucket: Option<BucketConfig> = None;
        for (i, Obj(limit)) in limits.iter().enumerate() {
            let at = format!("limits[{i}].");
            let (capacity, rate) = self.limit(
                name,
                &at,
                limit.capacity,
                limit.refill_per_second,
                limit.refill.as_ref(),
            )?;
            let next = match bucket {
                None => BucketConfig::new(capacity, rate),
                Some(b) => b.with_limit(capacity, rate),
            };
            bucket = Some(
                next.map_err(|e| self.plan_err(name, &format!("{at}capacity"), e.to_string()))?,
            );
        }
        bucket.ok_or_else(|| self.plan_err(name, "limits", "no limit"))
    }

    /// One limit of plan `name` at `at` (`""` or `"limits[i]."`): its capacity and rate.
    fn limit(
        &self,
        name: &str,
        at: &str,
        capacity_given: u64,
        refill_per_second: Option<f64>,
        refill: Option<&Obj<super::raw::RawRefill>>,
    ) -> Result<(Tokens, Rate), PolicyError> {
        if capacity_given == 0 {
            return Err(self.plan_err(
                name,
                &format!("{at}capacity"),
                "must be a whole number of tokens ≥ 1, got 0",
            ));
        }
        if capacity_given > MAX_CAPACITY {
            return Err(self.plan_err(
                name,
                &format!("{at}capacity"),
                format!(
                    "must be at most {MAX_CAPACITY} tokens, got {}",
                    capacity_given
                ),
            ));
        }
        let capacity = Tokens::whole(capacity_given);
        let rate = match (refill_per_second, refill) {
            (Some(_), Some(_)) => {
                return Err(self.plan_err(
                    name,
                    at.trim_end_matches('.'),
                    "give one of refill_per_second or refill, not both",
                ));
            }
            (None, None) => {
                return Err(self.plan_err(
                    name,
                    at.trim_end_matches('.'),
                    "missing refill rate: give refill_per_second or refill",
                ));
            }
            (Some(per_second), None) => self.rate_per_second(name, at, per_second)?,
            (None, Some(Obj(refill))) => {
                if refill.tokens == 0 {
                    return Err(self.plan_err(
                        name,
                        &format!("{at}refill.tokens"),
                        "must be ≥ 1, got 0",
                    ));
                }
                if refill.period_ms == 0 {
                    return Err(self.plan_err(
                        name,
                        &format!("{at}refill.period_ms"),
                        "must be ≥ 1 millisecond, got 0",
                    ));
                }
                // Rate counts nanotokens per second (its own unit, independent of the finer
                // scale of Tokens): tokens × 10⁹ × 1000 ms/s fits in u128 (< 2⁶⁴ × 2⁴⁰).
                let numerator = u128::from(refill.tokens) * NANOTOKENS_PER_TOKEN * 1000;
                let period = u128::from(refill.period_ms);
                let nanos = (numerator + period / 2) / period;
                let noun = if refill.tokens == 1 {
                    "token"
                } else {
                    "tokens"
                };
                let described = format!("{} {noun} per {} ms", refill.tokens, refill.period_ms);
                if nanos == 0 {
                    return Err(self.plan_err(
                        name,
                        &format!("{at}refill"),
                        format!(
                            "rate rounds to zero: {described} is slower than the slowest \
                             rate, 0.000000001 tokens per second"
                        ),
                    ));
                }
                u64::try_from(nanos)
                    .ok()
                    .and_then(Rate::from_nanos_per_second)
                    .ok_or_else(|| {
                        self.plan_err(
                            name,
                            &format!("{at}refill"),
                            format!(
                                "rate too high: {described} is more than 1000000000 tokens \
                                 per second"
                            ),
                        )
                    })?
            }
        };
        Ok((capacity, rate))
    }

    pub(super) fn rate_per_second(
        &self,
        name: &str,
        at: &str,
        per_second: f64,
    ) -> Result<Rate, PolicyError> {
        let field = &format!("{at}refill_per_second");
        if per_second.is_nan() || per_second <= 0.0 {
            return Err(self.plan_err(
                name,
                field,
                format!(
                    "must be a number of tokens per second > 0, got {}",
                    number(per_second)
                ),
            ));
        }
        if per_second > 1e9 {
            return Err(self.plan_err(
                name,
                field,
                format!(
                    "must be at most 1000000000 tokens per second, got {}",
                    number(per_second)
                ),
            ));
        }
        Rate::from_f64(per_second).ok_or_else(|| {
            self.plan_err(
                name,
                field,
                format!(
                    "rounds to zero: the slowest rate is 0.000000001 tokens per second, \
                     got {}",
                    number(per_second)
                ),
            )
        })
    }

    /// The lease settings of plan `name` with `capacity` whole tokens, each within its
    /// documented range (`docs/policy.md`).
    pub(super) fn lease(
        &self,
        name: &str,
        raw: RawLease,
        capacity: u64,
    ) -> Result<LeaseSettings, PolicyError> {
        let defaults = LeaseSettings::default();
        let fraction = |field: &str, value: Option<f64>, default: f64| match value {
            None => Ok(default),
            Some(x) if x > 0.0 && x <= 1.0 => Ok(x),
            Some(x) => Err(self.plan_err(
                name,
                &format!("lease.{field}"),
                format!("must be a fraction in (0, 1], got {}", number(x)),
            )),
        };
        let ttl_ms = raw.ttl_ms.unwrap_or(defaults.ttl.as_millis() as u64);
        if !TTL_MS.contains(&ttl_ms) {
            return Err(self.plan_err(
                name,
                "lease.ttl_ms",
                format!(
                    "must be from {} to {} milliseconds (10 minutes), got {ttl_ms}",
                    TTL_MS.start(),
                    TTL_MS.end()
                ),
            ));
        }
        let ttl = Duration::from_millis(ttl_ms);
        let max_fraction = fraction("max_fraction", raw.max_fraction, defaults.max_fraction)?;
        // A lease smaller than one token cannot serve a request of one token.
        let largest = max_fraction * capacity as f64;
        if largest < 1.0 - 1e-9 {
            let given = if raw.max_fraction.is_some() {
                "max_fraction"
            } else {
                "the default max_fraction"
            };
            return Err(self.plan_err(
                name,
                "lease.max_fraction",
                format!(
                    "a lease must hold at least one token: {given} {} × capacity {capacity} is \
                     {} tokens; use at least {}",
                    number(max_fraction),
                    number(largest),
                    number(1.0 / capacity as f64)
                ),
            ));
        }
        let low_water = fraction("low_water", raw.low_water, defaults.low_water)?;
        let refresh = match raw.refresh_ms {
            None => defaults.refresh,
            Some(0) => {
                return Err(self.plan_err(
                    name,
                    "lease.refresh_ms",
                    "must be ≥ 1 millisecond, got 0",
                ));
            }
            Some(ms) => Duration::from_millis(ms),
        };
        if refresh > ttl {
            return Err(self.plan_err(
                name,
                "lease.refresh_ms",
                format!(
                    "must not be longer than the lease ttl_ms ({} ms), got {} ms",
                    ttl.as_millis(),
                    refresh.as_millis()
                ),
            ));
        }
        let max_wait = raw
            .max_wait_ms
            .map_or(defaults.max_wait, Duration::from_millis);
        if max_wait > Duration::from_millis(MAX_WAIT_MS) {
            return Err(self.plan_err(
                name,
                "lease.max_wait_ms",
                format!(
                    "must be at most {MAX_WAIT_MS} milliseconds (1 minute), got {}",
                    max_wait.as_millis()
                ),
            ));
        }
        if max_wait > ttl {
            return Err(self.plan_err(
                name,
                "lease.max_wait_ms",
                format!(
                    "must not be longer than the lease ttl_ms ({} ms), got {} ms",
                    ttl.as_millis(),
                    max_wait.as_millis()
                ),
            ));
        }
        let accounting = match raw.accounting {
            None => defaults.accounting,
            Some(RawAccounting::Relaxed) => Accounting::Relaxed,
            Some(RawAccounting::Strict) => Accounting::Strict,
        };
        Ok(LeaseSettings {
            ttl,
            max_fraction,
            low_water,
            refresh,
            max_wait,
            accounting,
        })
    }

    /// The fallback of plan `name` with `capacity` whole tokens: `instances` from 1 to
    /// [`MAX_INSTANCES`] and at most the capacity, so that each instance's local bucket holds
    /// at least one token; `outage_debt` (default `true`) only for `allow` and `local`.
    pub(super) fn fallback(
        &self,
        name: &str,
        raw: RawFallback,
        capacity: u64,
    ) -> Result<FallbackSettings, PolicyError> {
        let mode = match (raw.mode, raw.instances) {
            (RawFallbackMode::Allow, None) => FallbackMode::Allow,
            (RawFallbackMode::Deny, None) => FallbackMode::Deny,
            (RawFallbackMode::Allow | RawFallbackMode::Deny, Some(_)) => {
                return Err(self.plan_err(
                    name,
                    "fallback.instances",
                    "only applies to mode \"local\"",
                ));
            }
            (RawFallbackMode::Local, instances) => {
                let n = instances.unwrap_or(1);
                if n == 0 || n > MAX_INSTANCES {
                    return Err(self.plan_err(
                        name,
                        "fallback.instances",
                        format!("must be from 1 to {MAX_INSTANCES}, got {n}"),
                    ));
                }
                if u64::from(n) > capacity {
                    return Err(self.plan_err(
                        name,
                        "fallback.instances",
                        format!(
                            "must be at most the capacity ({capacity}), so that each \
                             instance's local bucket holds a whole token, got {n}"
                        ),
                    ));
                }
                FallbackMode::Local {
                    instances: NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN),
                }
            }
        };
        let outage_debt = match (mode, raw.outage_debt) {
            (FallbackMode::Deny, Some(_)) => {
                return Err(self.plan_err(
                    name,
                    "fallback.outage_debt",
                    "only applies to modes \"allow\" and \"local\" (a \"deny\" fallback \
                     admits nothing, so it owes nothing)",
                ));
            }
            (_, on) => on.unwrap_or(true),
        };
        Ok(FallbackSettings::new(mode).with_outage_debt(outage_debt))
    }
}
