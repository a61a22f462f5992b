//! The validated policy types: the checked policy file ([`Policies`], read in `load.rs`), its
//! plans, lease and fallback settings, routes and key rules.
//!
//! Everything here is built by [`Policies`] from a checked file, or by hand
//! with [`Plan::new`] for tests and embedders. See the [module docs](super) for the file format.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;

use std::time::Duration;

use crate::bucket::{BucketConfig, Rate, Tokens};

/// A checked policy file: named plans, key prefix rules and HTTP routes.
///
/// Every plan a rule or route names exists, so lookups by those names never fail. See the
/// [module docs](super) for the file format and an example.
#[derive(Debug, Clone)]
pub struct Policies {
    /// Where the policy came from, as errors and [`summary`](Self::summary) name it.
    pub(super) origin: String,
    /// Plans in file order.
    pub(super) plans: Vec<Arc<Plan>>,
    /// Plan name → index into `plans`.
    pub(super) by_name: HashMap<String, usize>,
    /// Index of the default plan, if the file names one.
    pub(super) default_plan: Option<usize>,
    /// Key rules, longest prefix first (file order among equal lengths).
    pub(super) keys: Vec<KeyRule>,
    /// Plan index of each rule in `keys`.
    pub(super) key_plans: Vec<usize>,
    /// Routes in file order.
    pub(super) routes: Vec<Route>,
    /// The file's `x_ratelimit_remaining`.
    pub(super) x_ratelimit_remaining: bool,
    /// The file's `fields_on`.
    pub(super) fields_on: FieldsOn,
}

/// Which responses the HTTP layer writes its rate-limit header fields on (`RateLimit-Policy`,
/// `RateLimit` and, when asked for, `X-RateLimit-{Name}-Remaining`). A refusal always carries
/// them, with `Retry-After`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FieldsOn {
    /// Every response of a limited route: a client sees how close it is to a limit before it is
    /// refused. The default.
    #[default]
    EveryResponse,
    /// Only the responses the layer refuses (`429`, and `503` when the fallback denies), as
    /// `tower_governor` and Envoy do by default: an admitted request pays nothing for the
    /// fields, and its response carries no limit names.
    Refusals,
}

impl FieldsOn {
    /// Every value, the default first.
    pub(super) const ALL: [FieldsOn; 2] = [FieldsOn::EveryResponse, FieldsOn::Refusals];

    /// The policy file's spelling: `"every_response"` or `"refusals"`.
    pub fn as_str(self) -> &'static str {
        match self {
            FieldsOn::EveryResponse => "every_response",
            FieldsOn::Refusals => "refusals",
        }
    }
}

/// One named bucket shape with its lease and fallback settings.
///
/// A plan says how big a bucket is ([`capacity`](Plan::capacity)), how fast it refills
/// ([`rate`](Plan::rate)), whether callers hold in-process leases on it
/// ([`lease`](Plan::lease), `None` = direct mode, one SQL statement per call) and what decides
/// while the database cannot ([`fallback`](Plan::fallback)). Plans are shared as `Arc<Plan>` by
/// [`Policies`].
///
/// Two plans are equal when their name, bucket, lease, fallback and shadow mode are. A plan
/// holds no state: its decision counters are the limiter's (registered with the `metrics`
/// recorder when a limiter is built with it, or at its first decision).
#[derive(Debug, Clone)]
pub struct Plan {
    /// The plan's name, unique within one policy file. Shared by the plan's clones: see
    /// [`shared_name`](Plan::shared_name).
    name: Arc<str>,
    /// Capacity and refill rate.
    bucket: BucketConfig,
    /// Lease settings; `None` for direct mode.
    lease: Option<LeaseSettings>,
    /// What decides while the store is slow or down.
    fallback: FallbackSettings,
    /// Shadow mode: decide and count as usual, but let a denial through.
    shadow: bool,
}

impl PartialEq for Plan {
    fn eq(&self, other: &Plan) -> bool {
        self.same_but_shadow(other) && self.shadow == other.shadow
    }
}

impl Plan {
    /// Whether the two plans are equal but perhaps for their shadow mode: one may be the
    /// other's shadow twin (the HTTP layer's shadow layers decide with one).
    pub(crate) fn same_but_shadow(&self, other: &Plan) -> bool {
        self.name == other.name
            && self.bucket == other.bucket
            && self.lease == other.lease
            && self.fallback == other.fallback
    }
}

/// # Construction
impl Plan {
    /// A direct-mode plan (no lease) with the default fallback, a local bucket for one instance.
    ///
    /// The name is not checked here; names read from a policy file are (see the
    /// [module docs](super)).
    pub fn new(name: impl Into<String>, bucket: BucketConfig) -> Plan {
        Plan {
            name: name.into().into(),
            bucket,
            lease: None,
            fallback: FallbackSettings::default(),
            shadow: false,
        }
    }

    /// The same plan in leased mode with `lease`.
    #[must_use]
    pub fn with_lease(mut self, lease: LeaseSettings) -> Plan {
        self.lease = Some(lease);
        self
    }

    /// The same plan with `fallback`.
    #[must_use]
    pub fn with_fallback(mut self, fallback: FallbackSettings) -> Plan {
        self.fallback = fallback;
        self
    }

    /// The same plan in shadow mode (`true`) or enforcing (`false`, the default).
    ///
    /// A shadow plan makes every decision exactly as an enforcing one would (store, leases,
    /// fallback, the same tokens taken) and counts it, but a denial comes back with
    /// [`allowed`](crate::Decision::allowed) `true` and
    /// [`would_deny`](crate::Decision::would_deny) `true`, counted as `outcome="would_deny"`
    /// in `tokenlease_decisions_total`. This is how a new limit is rolled out: watch what it
    /// would refuse, then switch it on.
    ///
    /// A shadow plan keeps its bucket under a key of its own ([`store_key`](Self::store_key)),
    /// never the caller's key: checked on the same key as an enforcing plan (its own
    /// `plan.clone().with_shadow(true)` included), it takes nothing from the enforcing plan's
    /// bucket, which admits exactly what it admits alone. Switched on, the plan starts from a
    /// full bucket under the caller's key.
    #[must_use]
    pub fn with_shadow(mut self, shadow: bool) -> Plan {
        self.shadow = shadow;
        self
    }
}

/// A [`Plan`] written in code: one or more limits, each a rate per second, minute, hour, day
/// or any period, with a burst (its capacity) that defaults to one period's tokens. Errors
/// wait for [`build`](Self::build), so a plan is one expression and one `?`:
///
/// ```
/// use std::time::Duration;
/// use tokenlease::policy::Plan;
///
/// # fn main() -> Result<(), tokenlease::bucket::BucketConfigError> {
/// // 10 a second and 10,000 a day on the same key.
/// let api = Plan::builder("api").per_second(10).per_day(10_000).build()?;
/// assert_eq!(api.bucket().limits().len(), 2);
/// // 1 a second with bursts of 8; 3 every 250 ms.
/// let customer = Plan::builder("per-customer").per_second(1).burst(8).build()?;
/// assert_eq!(customer.capacity().floor(), 8);
/// let fast = Plan::builder("fast").per(3, Duration::from_millis(250)).build()?;
/// assert_eq!(fast.rate().as_f64(), 12.0);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct PlanBuilder {
    name: String,
    /// Each limit: its burst (whole tokens), its tokens per period and the period.
    limits: Vec<(u64, u64, Duration)>,
    lease: Option<LeaseSettings>,
    fallback: FallbackSettings,
}

impl PlanBuilder {
    /// Adds a limit of `tokens` every `period`, with a burst of `tokens`.
    pub fn per(mut self, tokens: u64, period: Duration) -> Self {
        self.limits.push((tokens, tokens, period));
        self
    }

    /// Adds a limit of `tokens` a second, with a burst of `tokens`.
    pub fn per_second(self, tokens: u64) -> Self {
        self.per(tokens, Duration::from_secs(1))
    }

    /// Adds a limit of `tokens` a minute, with a burst of `tokens`.
    pub fn per_minute(self, tokens: u64) -> Self {
        self.per(tokens, Duration::from_secs(60))
    }

    /// Adds a limit of `tokens` an hour, with a burst of `tokens`.
    pub fn per_hour(self, tokens: u64) -> Self {
        self.per(tokens, Duration::from_secs(3_600))
    }

    /// Adds a limit of `tokens` a day (86,400 seconds), with a burst of `tokens`.
    pub fn per_day(self, tokens: u64) -> Self {
        self.per(tokens, Duration::from_secs(86_400))
    }

    /// Sets the burst (the capacity, in whole tokens) of the limit added last. Before any
    /// limit it does nothing, and [`build`](Self::build) reports the missing limit.
    pub fn burst(mut self, tokens: u64) -> Self {
        if let Some(last) = self.limits.last_mut() {
            last.0 = tokens;
        }
        self
    }

    /// Leased mode with `lease` ([`Plan::with_lease`]).
    pub fn lease(mut self, lease: LeaseSettings) -> Self {
        self.lease = Some(lease);
        self
    }

    /// What decides while the store cannot ([`Plan::with_fallback`]).
    pub fn fallback(mut self, fallback: FallbackSettings) -> Self {
        self.fallback = fallback;
        self
    }

    /// The plan.
    ///
    /// # Errors
    ///
    /// [`BucketConfigError`](crate::bucket::BucketConfigError): no limit, more than
    /// [`BucketConfig::MAX_LIMITS`], a rate of zero or out of range, a burst of zero or above
    /// [`BucketConfig::MAX_CAPACITY_TOKENS`].
    pub fn build(self) -> Result<Plan, crate::bucket::BucketConfigError> {
        use crate::bucket::BucketConfigError;
        let mut bucket: Option<BucketConfig> = None;
        if self.limits.len() > BucketConfig::MAX_LIMITS {
            return Err(BucketConfigError::TooManyLimits {
                count: self.limits.len(),
            });
        }
        for &(burst, tokens, period) in &self.limits {
            let rate = Rate::per(tokens, period)
                .ok_or(BucketConfigError::RateOutOfRange { tokens, period })?;
            let capacity = Tokens::whole(burst);
            bucket = Some(match bucket {
                None => BucketConfig::new(capacity, rate)?,
                Some(b) => b.with_limit(capacity, rate)?,
            });
        }
        let bucket = bucket.ok_or(BucketConfigError::NoLimit)?;
        if bucket.is_multi()
            && self
                .lease
                .is_some_and(|l| l.accounting == Accounting::Strict)
        {
            return Err(BucketConfigError::StrictOnSeveralLimits);
        }
        let mut plan = Plan::new(self.name, bucket).with_fallback(self.fallback);
        plan.lease = self.lease;
        Ok(plan)
    }
}

impl Plan {
    /// A plan to write in code ([`PlanBuilder`]): `Plan::builder("api").per_second(10)
    /// .per_day(10_000).build()?`.
    pub fn builder(name: impl Into<String>) -> PlanBuilder {
        PlanBuilder {
            name: name.into(),
            limits: Vec::new(),
            lease: None,
            fallback: FallbackSettings::default(),
        }
    }
}

/// # Accessors
impl Plan {
    /// The plan's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The plan's name as the plan keeps it, shared by its clones: whoever holds a clone of it
    /// knows that its address names no other string meanwhile (the metrics' per-thread batches of
    /// lease decisions are keyed so, for plans their callers name).
    pub(crate) fn shared_name(&self) -> &Arc<str> {
        &self.name
    }

    /// The bucket's capacity and refill rate.
    pub fn bucket(&self) -> &BucketConfig {
        &self.bucket
    }

    /// The most tokens the bucket holds (the largest burst).
    pub fn capacity(&self) -> Tokens {
        self.bucket.capacity()
    }

    /// How fast the bucket refills.
    pub fn rate(&self) -> Rate {
        self.bucket.rate()
    }

    /// Lease settings, or `None` when the plan runs in direct mode.
    pub fn lease(&self) -> Option<&LeaseSettings> {
        self.lease.as_ref()
    }

    /// What decides while the store is slow or down.
    pub fn fallback(&self) -> &FallbackSettings {
        &self.fallback
    }

    /// Whether the plan is in shadow mode ([`with_shadow`](Self::with_shadow)).
    pub fn shadow(&self) -> bool {
        self.shadow
    }

    /// The key under which the store keeps this plan's bucket for the caller's `key`: `key`
    /// itself for an enforcing plan; for a shadow plan, a key of its own made from the plan's
    /// name and `key`, `"\u{1}shadow:{name}:{key}"`. A name that is not a policy file's plan
    /// name (1 to 64 of `A-Z a-z 0-9 _ . -`) is replaced by `~` and 32 hex digits of its hash.
    ///
    /// The leading U+0001 ([`RESERVED_KEY_PREFIX`](crate::key::RESERVED_KEY_PREFIX)) is
    /// refused in a caller's key ([`KeyError::Reserved`](crate::key::KeyError::Reserved)), so
    /// a shadow plan's bucket can never be a caller's, and two shadow plans of different names
    /// never share one. Pass the result to [`Store::inspect`](crate::store::Store::inspect) to
    /// read a shadow plan's bucket.
    pub fn store_key<'k>(&self, key: &'k str) -> std::borrow::Cow<'k, str> {
        if self.shadow {
            std::borrow::Cow::Owned(shadow_store_key(&self.name, key))
        } else {
            std::borrow::Cow::Borrowed(key)
        }
    }
}

/// A shadow plan's key for the caller's `key` ([`Plan::store_key`]).
fn shadow_store_key(name: &str, key: &str) -> String {
    let plain = (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    let mut out = String::with_capacity(key.len() + 73);
    out.push(crate::key::RESERVED_KEY_PREFIX);
    out.push_str("shadow:");
    if plain {
        out.push_str(name);
    } else {
        // FNV-1a, 128 bits: `~` is not in a plain name, so no plain name is taken for a hash.
        let hash = name
            .bytes()
            .fold(0x6c62_272e_07bb_0142_62b8_2175_6295_c58d_u128, |h, b| {
                (h ^ u128::from(b)).wrapping_mul(0x0000_0000_0100_0000_0000_0000_0000_013b)
            });
        out.push_str(&format!("~{hash:032x}"));
    }
    out.push(':');
    out.push_str(key);
    out
}

/// How a process holds tokens of a leased plan in memory.
///
/// A lease is a batch of tokens reserved from the shared bucket and spent locally. It lives for
/// at most [`ttl`](Self::ttl); unspent tokens go back when it expires. The actor refills it in
/// the background once it falls below [`low_water`](Self::low_water) of its size.
///
/// Built from [`LeaseSettings::default`] and the `with_` methods, or read from a policy file.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct LeaseSettings {
    /// How long a lease lives before its unspent tokens go back. Defaults to 1 s. File field
    /// `ttl_ms`, from 10 ms to 10 minutes.
    pub ttl: Duration,
    /// The largest lease as a fraction of the plan's capacity, in (0, 1]. Defaults to 0.1. A
    /// policy file requires `max_fraction × capacity ≥ 1` token.
    /// Together with `ttl` this bounds the overshoot: see `DESIGN.md`.
    pub max_fraction: f64,
    /// Refill the lease when what is left falls below this fraction of its size, in (0, 1].
    /// Defaults to 0.5.
    pub low_water: f64,
    /// How often the actor looks at its leases (refills, expiries). Defaults to 100 ms. File
    /// field `refresh_ms`, at least 1 and at most `ttl_ms`.
    pub refresh: Duration,
    /// The longest a caller waits for an in-flight refill when its lease is empty; then the
    /// fallback decides. Defaults to 50 ms. File field `max_wait_ms`, from 0 (never wait) to a
    /// minute, and at most `ttl_ms`.
    pub max_wait: Duration,
    /// Whether the store counts this plan's leases against the bucket's capacity. Defaults to
    /// [`Accounting::Relaxed`]. File field `accounting`, `"relaxed"` or `"strict"`.
    pub accounting: Accounting,
}

/// How the store accounts for tokens out on lease (see `docs/design/leases.md` and `docs/design/strict-accounting.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Accounting {
    /// A lease is taken from the bucket and forgotten: the bucket refills behind it, so tokens
    /// leased before a window opens and spent inside it can exceed what one bucket would admit
    /// by the leases out (the bound in `docs/design/leases.md`). Fewest statements, simplest rows.
    #[default]
    Relaxed,
    /// The bucket row records every live lease, and `tokens + outstanding ≤ capacity`: no
    /// window admits more than one bucket would. Costs a small array on the row, a little more
    /// work per statement, and tokens that sit idle in a lease until it is renewed or expires.
    Strict,
}

impl LeaseSettings {
    /// The most one lease holds: 2⁵⁶ − 1 nanotokens (about 7.2 × 10⁷ tokens), the token field
    /// of the in-process lease word. A plan's largest lease, `max_fraction × capacity`, is
    /// clamped to it (only plans of more than 7.2 × 10⁷ tokens reach it), and a call whose cost
    /// is above it is decided by the store directly, one statement for that call as in direct
    /// mode, through the same deadline and fallback: no lease could ever hold it.
    /// `tokenlease check` warns about a leased plan whose capacity is above it.
    pub const MAX_LEASE: Tokens = Tokens::from_nanos((1 << 56) - 1);

    /// With [`ttl`](Self::ttl).
    #[must_use]
    pub const fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// With [`max_fraction`](Self::max_fraction).
    #[must_use]
    pub const fn with_max_fraction(mut self, max_fraction: f64) -> Self {
        self.max_fraction = max_fraction;
        self
    }

    /// With [`low_water`](Self::low_water).
    #[must_use]
    pub const fn with_low_water(mut self, low_water: f64) -> Self {
        self.low_water = low_water;
        self
    }

    /// With [`refresh`](Self::refresh).
    #[must_use]
    pub const fn with_refresh(mut self, refresh: Duration) -> Self {
        self.refresh = refresh;
        self
    }

    /// With [`max_wait`](Self::max_wait).
    #[must_use]
    pub const fn with_max_wait(mut self, max_wait: Duration) -> Self {
        self.max_wait = max_wait;
        self
    }

    /// With [`accounting`](Self::accounting).
    #[must_use]
    pub const fn with_accounting(mut self, accounting: Accounting) -> Self {
        self.accounting = accounting;
        self
    }
}

impl Default for LeaseSettings {
    fn default() -> Self {
        LeaseSettings {
            ttl: Duration::from_secs(1),
            max_fraction: 0.1,
            low_water: 0.5,
            refresh: Duration::from_millis(100),
            max_wait: Duration::from_millis(50),
            accounting: Accounting::Relaxed,
        }
    }
}

/// What decides while the store is slow, failing or behind an open circuit breaker.
///
/// Defaults to [`FallbackMode::Local`] with one instance, with outage debt on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct FallbackSettings {
    /// The fallback decision.
    pub mode: FallbackMode,
    /// Whether what the `allow` and `local` fallbacks admit is recorded as outage debt and
    /// charged to the shared bucket once the store answers again (`docs/design/outage-debt.md`). Defaults
    /// to `true`; a `deny` fallback admits nothing, so it has no debt either way. File field
    /// `fallback.outage_debt`. The limiter's own switch,
    /// [`LimiterBuilder::outage_debt`](crate::limiter::LimiterBuilder::outage_debt), must be
    /// on too.
    pub outage_debt: bool,
}

impl Default for FallbackSettings {
    fn default() -> Self {
        FallbackSettings::new(FallbackMode::default())
    }
}

impl FallbackSettings {
    /// Settings deciding with `mode`, outage debt on.
    pub const fn new(mode: FallbackMode) -> Self {
        FallbackSettings {
            mode,
            outage_debt: true,
        }
    }

    /// The same settings with outage debt on or off.
    pub const fn with_outage_debt(mut self, on: bool) -> Self {
        self.outage_debt = on;
        self
    }
}

impl From<FallbackMode> for FallbackSettings {
    fn from(mode: FallbackMode) -> Self {
        FallbackSettings::new(mode)
    }
}

/// The decision made in place of the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackMode {
    /// Admit every request (fail open).
    Allow,
    /// Deny every request (fail closed).
    Deny,
    /// Decide with an in-process bucket holding `1 / instances` of the plan's capacity and
    /// rate, so that `instances` processes together stay near the shared limit.
    Local {
        /// How many processes share the plan; each takes its share of the limit. A policy
        /// file allows 1 to 10,000, and at most the plan's capacity.
        instances: NonZeroU32,
    },
}

impl Default for FallbackMode {
    fn default() -> Self {
        FallbackMode::Local {
            instances: NonZeroU32::MIN,
        }
    }
}

/// One protected HTTP endpoint: its global bucket and its entity bucket.
///
/// The endpoint key is `METHOD:path` with the route pattern, not the request path
/// ([`Route::endpoint`]), so `/bookings/1` and `/bookings/2` share the global bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Route {
    /// The HTTP method, upper-case (`GET`, `POST`, ...).
    pub method: String,
    /// The route pattern as axum writes it, e.g. `/bookings/{bookingId}`.
    pub path: String,
    /// The plan of the endpoint's one global bucket, if it has one.
    pub global: Option<String>,
    /// The per-entity bucket, if the endpoint has one.
    pub entity: Option<EntityRule>,
    /// Which of the route's layers run in shadow mode: they decide and count as usual, and a
    /// denial lets the request through with the rate-limit fields it would have carried.
    pub shadow: RouteShadow,
    /// Every limit of the route, in the order the HTTP layer checks them: the file's `limits`
    /// as written, or, for a route written with `global` and `entity`, the limit `api` (its
    /// `global`) and then the limit `entity`.
    pub limits: Vec<RouteLimit>,
}

/// One limit of a [`Route`]: a bucket for the whole route, one per entity of the route, or
/// one per entity shared by every route that names the same budget.
///
/// | `source` | `budget` | one bucket per | key |
/// |---|---|---|---|
/// | `None` | `None` | route | `ratelimit:api:{endpoint}` (`ratelimit:api:{name}:{endpoint}` unless named `api`) |
/// | `Some` | `None` | entity per route | `ratelimit:entity:{endpoint}:{id}` (`ratelimit:entity:{name}:{endpoint}:{id}` unless named `entity`) |
/// | `Some` | `Some` | entity across routes | `ratelimit:budget:{budget}:{id}` |
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RouteLimit {
    /// The limit's name, unique within its route: the item's name in `RateLimit-Policy` and
    /// `RateLimit`, the `layer` of the problem body and of the HTTP metrics. A budget's limit is
    /// named by the budget.
    pub name: String,
    /// The plan of its buckets.
    pub plan: String,
    /// Where the entity id comes from; `None` for a limit on the whole route.
    pub source: Option<EntitySource>,
    /// What kind of entity this is, for metrics and logs (`"booking"`); free text.
    pub entity_type: Option<String>,
    /// The budget it belongs to (file field `budgets`), shared with every route naming it.
    pub budget: Option<String>,
    /// Shadow mode: it decides and counts as usual, and a denial lets the request through.
    pub shadow: bool,
}

/// The layers of a [`Route`] in shadow mode (file field `shadow`: `true` for both, `"api"`
/// or `"entity"` for one). A layer whose plan is itself in shadow mode
/// ([`Plan::shadow`]) lets its denials through too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RouteShadow {
    /// The endpoint's global (`api`) layer.
    pub api: bool,
    /// The entity layer.
    pub entity: bool,
}

impl RouteShadow {
    /// Both layers in shadow mode (`true`) or neither (`false`).
    pub const fn all(on: bool) -> RouteShadow {
        RouteShadow {
            api: on,
            entity: on,
        }
    }

    /// The global (`api`) layer only.
    pub const fn api() -> RouteShadow {
        RouteShadow {
            api: true,
            entity: false,
        }
    }

    /// The entity layer only.
    pub const fn entity() -> RouteShadow {
        RouteShadow {
            api: false,
            entity: true,
        }
    }
}

impl Route {
    /// The endpoint key, `METHOD:path` (for example `GET:/bookings/{bookingId}`).
    pub fn endpoint(&self) -> String {
        format!("{}:{}", self.method, self.path)
    }
}

/// Where a route finds the entity (booking, customer, vendor, ...) a request is about, and the
/// plan of each entity's bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EntityRule {
    /// Where the entity id comes from.
    pub source: EntitySource,
    /// What kind of entity this is, for metrics and logs (`"booking"`); free text.
    pub entity_type: Option<String>,
    /// The plan of each entity's bucket.
    pub plan: String,
}

/// Where the entity id of a request comes from. A request without one skips the entity check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntitySource {
    /// A path parameter of the route, named as in the pattern (`bookingId` for
    /// `/bookings/{bookingId}`).
    PathParam(String),
    /// A request header, by its lower-case name.
    Header(String),
    /// The client's IP address as the server sees it (the peer address).
    ///
    /// Behind a reverse proxy or load balancer this is the proxy's address, so every client
    /// shares one bucket. Use [`EntitySource::Header`] with the header your proxy sets instead.
    ClientIp,
}

/// A key prefix rule: keys starting with `prefix` use `plan`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyRule {
    /// The key prefix, non-empty.
    pub prefix: String,
    /// The plan for matching keys.
    pub plan: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(name: &str) -> Plan {
        Plan::new(
            name,
            BucketConfig::new(Tokens::whole(5), Rate::per_second(1).expect("rate"))
                .expect("bucket"),
        )
    }

    /// An enforcing plan's bucket is the caller's key; a shadow plan's is a key of its own,
    /// reserved (no caller may use it) and distinct per plan name, however the name is written.
    #[test]
    fn a_shadow_plan_keeps_its_bucket_under_a_reserved_key_of_its_own() {
        assert_eq!(plan("p").store_key("k"), "k");
        let shadow =
            |name: &str, key: &str| plan(name).with_shadow(true).store_key(key).into_owned();
        assert_eq!(shadow("p", "k"), "\u{1}shadow:p:k");
        for key in [
            shadow("p", "k"),
            shadow("a:b", "c"),
            shadow(&"n".repeat(65), "k"),
        ] {
            assert_eq!(
                crate::key::validate_key(&key),
                Err(crate::key::KeyError::Reserved),
                "{key:?}"
            );
            assert_eq!(crate::key::validate_stored_key(&key), Ok(()), "{key:?}");
        }
        // A name that is not a file's plan name is hashed, so a colon in it cannot shift the
        // boundary between name and key, and a NUL never reaches the store.
        assert_ne!(shadow("a:b", "c"), shadow("a", "b:c"));
        let hashed = shadow("a\0b", "k");
        assert!(
            hashed.starts_with("\u{1}shadow:~") && !hashed.contains('\0'),
            "{hashed:?}"
        );
        assert_eq!(hashed.len(), "\u{1}shadow:~".len() + 32 + ":k".len());
        // The longest caller's key still fits what the store is sent.
        let longest = "k".repeat(crate::key::MAX_KEY_BYTES);
        assert_eq!(
            crate::key::validate_stored_key(&shadow(&"n".repeat(64), &longest)),
            Ok(())
        );
    }
}

#[cfg(test)]
mod builder_tests {
    use std::time::Duration;

    use super::*;
    use crate::bucket::BucketConfigError;

    #[test]
    fn the_builder_reports_what_is_wrong() {
        assert_eq!(
            Plan::builder("p").build().unwrap_err(),
            BucketConfigError::NoLimit
        );
        assert_eq!(
            Plan::builder("p").per_second(0).build().unwrap_err(),
            BucketConfigError::RateOutOfRange {
                tokens: 0,
                period: Duration::from_secs(1)
            }
        );
        assert!(matches!(
            Plan::builder("p").per_second(1).burst(0).build(),
            Err(BucketConfigError::CapacityTooSmall { .. })
        ));
        let five = (0..5).fold(Plan::builder("p"), |b, i| b.per_minute(10 + i));
        assert_eq!(
            five.build().unwrap_err(),
            BucketConfigError::TooManyLimits { count: 5 }
        );
        let strict = Plan::builder("p")
            .per_second(1)
            .per_hour(100)
            .lease(LeaseSettings::default().with_accounting(Accounting::Strict))
            .build();
        assert_eq!(
            strict.unwrap_err(),
            BucketConfigError::StrictOnSeveralLimits
        );
        // One limit in the builder is Plan::new's plan.
        let one = Plan::builder("p")
            .per_second(1)
            .burst(8)
            .build()
            .expect("plan");
        let new = Plan::new(
            "p",
            BucketConfig::new(Tokens::whole(8), Rate::per_second(1).expect("rate"))
                .expect("bucket"),
        );
        assert_eq!(one, new);
    }
}
