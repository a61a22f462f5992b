//! [`Policies`]: reading, checking and looking up a policy file.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt::Write as _;
use std::io::Read as _;
use std::num::NonZeroU32;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_path_to_error::Segment;

use super::error::{Kind, PolicyError, number, quote, shorten, shorten_quoted};
use super::raw::{
    Obj, RawAccounting, RawEntity, RawFallback, RawFallbackMode, RawLease, RawPlan, RawPolicies,
    RawRoute,
};
use super::types::{
    Accounting, EntityRule, EntitySource, FallbackMode, FallbackSettings, KeyRule, LeaseSettings,
    Plan, Route, RouteShadow,
};
use crate::bucket::{BucketConfig, Rate, Tokens};

/// The name used in errors for a policy given as a string without a file.
const NO_ORIGIN: &str = "<policy>";

/// The unit of [`Rate`]: nanotokens per token.
const NANOTOKENS_PER_TOKEN: u128 = 1_000_000_000;

/// The longest plan name, in characters.
const MAX_PLAN_NAME: usize = 64;

/// The longest entity type, in characters.
const MAX_ENTITY_TYPE: usize = 64;

/// The largest policy file (or text) read: 16 MiB. A larger one is refused before it is read
/// whole. Real policies are a few kilobytes; the limit only bounds what a mistaken or hostile
/// file costs.
pub const MAX_POLICY_BYTES: u64 = 16 * 1024 * 1024;

/// The most plans a policy may define: what one limiter can hold (its plan registry gives each
/// distinct plan a 16-bit index that a key's record keeps). A file with more is refused with
/// [`PolicyErrorKind::TooManyPlans`](super::PolicyErrorKind::TooManyPlans).
pub const MAX_PLANS: usize = 65_528;

/// Lease `ttl_ms`: from 10 ms to 10 minutes.
const TTL_MS: std::ops::RangeInclusive<u64> = 10..=600_000;

/// The longest lease `max_wait_ms`: one minute (and never longer than `ttl_ms`).
const MAX_WAIT_MS: u64 = 60_000;

/// The most `fallback.instances`.
const MAX_INSTANCES: u32 = 10_000;

/// The largest capacity a plan may have, in whole tokens: what PostgreSQL's bigint columns hold
/// in nanotokens with room for a refill's sum (migration 0007). Governs every store alike, so a
/// policy that works over `MemoryStore` works over `PostgresStore` too.
pub const MAX_CAPACITY: u64 = 8_000_000_000;

/// How many defined plans an "unknown plan" message lists.
const LISTED_PLANS: usize = 10;

/// The HTTP methods a route may name.
const METHODS: [&str; 9] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT",
];

/// A checked policy file: named plans, key prefix rules and HTTP routes.
///
/// Every plan a rule or route names exists, so lookups by those names never fail. See the
/// [module docs](super) for the file format and an example.
#[derive(Debug, Clone)]
pub struct Policies {
    /// Where the policy came from, as errors and [`summary`](Self::summary) name it.
    origin: String,
    /// Plans in file order.
    plans: Vec<Arc<Plan>>,
    /// Plan name → index into `plans`.
    by_name: HashMap<String, usize>,
    /// Index of the default plan, if the file names one.
    default_plan: Option<usize>,
    /// Key rules, longest prefix first (file order among equal lengths).
    keys: Vec<KeyRule>,
    /// Plan index of each rule in `keys`.
    key_plans: Vec<usize>,
    /// Routes in file order.
    routes: Vec<Route>,
}

/// # Loading
impl Policies {
    /// Reads and checks the policy file at `path`.
    ///
    /// # Errors
    ///
    /// A [`PolicyError`] naming the file when it cannot be read, is not UTF-8, or is not a valid
    /// policy (see [`from_json_str`](Self::from_json_str)).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Policies, PolicyError> {
        let path = path.as_ref();
        let file = path.display().to_string();
        let cannot = |e: std::io::Error| {
            PolicyError::new(&file, format!("cannot read the file: {}", lower(&e)))
                .with_kind(Kind::Read)
        };
        let mut reader = std::fs::File::open(path).map_err(cannot)?;
        // The size from the metadata refuses a large file without reading it; reading at most
        // one byte past the limit also catches files that grow or report no size (a pipe).
        let size = reader.metadata().map_err(cannot)?.len();
        if size > MAX_POLICY_BYTES {
            return Err(too_large(&file, Some(size)));
        }
        let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
        (&mut reader)
            .take(MAX_POLICY_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(cannot)?;
        if bytes.len() as u64 > MAX_POLICY_BYTES {
            return Err(too_large(&file, None));
        }
        let text = std::str::from_utf8(&bytes).map_err(|e| {
            let offset = e.valid_up_to();
            PolicyError::new(&file, format!("not valid UTF-8 at byte offset {offset}"))
                .with_line_column(Some(line_column(&bytes, offset)))
                .with_kind(Kind::Read)
        })?;
        Self::from_json_str(text, Some(path))
    }

    /// Parses and checks a policy given as JSON text. `origin` names the file in errors;
    /// `<policy>` when `None`. A leading byte-order mark is ignored.
    ///
    /// Loading takes time linear in the size of the text, which may be at most
    /// [`MAX_POLICY_BYTES`].
    ///
    /// # Errors
    ///
    /// The first problem found, as one [`PolicyError`]: a text over [`MAX_POLICY_BYTES`],
    /// malformed JSON, trailing characters, a wrong type or an unknown field (with line and
    /// column), or a value that is out of range or names a plan that does not exist (see the
    /// [module docs](super) for the full list).
    pub fn from_json_str(json: &str, origin: Option<&Path>) -> Result<Policies, PolicyError> {
        let file = match origin {
            Some(path) => path.display().to_string(),
            None => NO_ORIGIN.to_owned(),
        };
        if json.len() as u64 > MAX_POLICY_BYTES {
            return Err(too_large(&file, Some(json.len() as u64)));
        }
        let json = json.strip_prefix('\u{feff}').unwrap_or(json);
        let mut de = serde_json::Deserializer::from_str(json);
        let Obj(raw) =
            serde_path_to_error::deserialize::<_, Obj<RawPolicies>>(&mut de).map_err(|e| {
                let (field, plan) = path_of(e.path());
                let err = json_error(&file, e.inner()).with_field(field);
                match plan {
                    Some(plan) => err.with_plan(&plan),
                    None => err,
                }
            })?;
        de.end().map_err(|e| json_error(&file, &e))?;
        Checker { file }.check(raw)
    }
}

/// # Lookups
impl Policies {
    /// The plan called `name`.
    pub fn plan(&self, name: &str) -> Option<&Arc<Plan>> {
        self.by_name.get(name).map(|&i| &self.plans[i])
    }

    /// The plan for a store key: the rule with the longest prefix of `key`, else the default
    /// plan, else `None`.
    pub fn plan_for_key(&self, key: &str) -> Option<&Arc<Plan>> {
        self.plan_index_for_key(key).map(|i| &self.plans[i])
    }

    /// The index among [`plans`](Self::plans) of the plan for `key`, as
    /// [`plan_for_key`](Self::plan_for_key) chooses it.
    pub(crate) fn plan_index_for_key(&self, key: &str) -> Option<usize> {
        self.keys
            .iter()
            .position(|rule| key.starts_with(rule.prefix.as_str()))
            .map(|i| self.key_plans[i])
            .or(self.default_plan)
    }

    /// Replaces each plan with `f`'s: a limiter shares one `Arc` per distinct plan across
    /// reloads. `f` must return a plan equal to the one it is given.
    pub(crate) fn intern_plans(&mut self, mut f: impl FnMut(&Arc<Plan>) -> Arc<Plan>) {
        for plan in &mut self.plans {
            let interned = f(plan);
            debug_assert!(*interned == **plan);
            *plan = interned;
        }
    }

    /// The default plan (`default_plan` in the file), if any.
    pub fn default_plan(&self) -> Option<&Arc<Plan>> {
        self.default_plan.map(|i| &self.plans[i])
    }

    /// All plans, in file order.
    pub fn plans(&self) -> impl Iterator<Item = &Arc<Plan>> {
        self.plans.iter()
    }

    /// The key prefix rules, longest prefix first.
    pub fn key_rules(&self) -> &[KeyRule] {
        &self.keys
    }

    /// The HTTP routes, in file order.
    pub fn routes(&self) -> &[Route] {
        &self.routes
    }

    /// One line for humans: `policy.json: 3 plans, 2 routes, 1 key rule`.
    pub fn summary(&self) -> String {
        fn count(n: usize, one: &str) -> String {
            if n == 1 {
                format!("1 {one}")
            } else {
                format!("{n} {one}s")
            }
        }
        format!(
            "{}: {}, {}, {}",
            self.origin,
            count(self.plans.len(), "plan"),
            count(self.routes.len(), "route"),
            count(self.keys.len(), "key rule"),
        )
    }
}

/// The error for a policy over [`MAX_POLICY_BYTES`]; `size` when known.
fn too_large(file: &str, size: Option<u64>) -> PolicyError {
    let size = match size {
        Some(size) => format!("{size} bytes"),
        None => "larger".to_owned(),
    };
    PolicyError::new(
        file,
        format!(
            "the policy is too large: {size}, more than the limit of {MAX_POLICY_BYTES} bytes \
             (16 MiB)"
        ),
    )
    .with_kind(Kind::TooLarge)
}

/// Turns a serde_json error into a [`PolicyError`] with line and column. The values serde
/// quotes (strings, field names, numbers) are cut to 64 characters.
fn json_error(file: &str, err: &serde_json::Error) -> PolicyError {
    let (line, column) = (err.line(), err.column());
    let text = err.to_string();
    let suffix = format!(" at line {line} column {column}");
    let message = shorten_quoted(text.strip_suffix(&suffix).unwrap_or(&text));
    let message = match message.strip_prefix("EOF ") {
        Some(rest) => format!("end of file {rest}"),
        None => message.to_owned(),
    };
    // serde quotes unknown field names and strings as written; keep the message on one line.
    let message = if message.chars().any(char::is_control) {
        message
            .chars()
            .map(|c| {
                if c.is_control() {
                    c.escape_debug().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect()
    } else {
        message
    };
    PolicyError::new(file, message)
        .with_line_column((line > 0).then_some((line, column)))
        .with_kind(Kind::Syntax)
}

/// The dotted field path of a serde path, and the plan it is inside of, if any.
fn path_of(path: &serde_path_to_error::Path) -> (String, Option<String>) {
    let mut field = String::new();
    let mut plan = None;
    for (i, segment) in path.iter().enumerate() {
        match segment {
            Segment::Seq { index } => {
                let _ = write!(field, "[{index}]");
            }
            Segment::Map { key } => {
                if i == 1 && field == "plans" {
                    plan = Some(shorten(key));
                }
                push_key(&mut field, key);
            }
            Segment::Enum { variant } => push_key(&mut field, variant),
            // A key that was never read (a syntax error where a key should be): the path so
            // far is the object the error is in.
            Segment::Unknown => break,
        }
    }
    (field, plan)
}

/// Appends `.key`, or `["key"]` when the key is not a plain word (holds a dot, space, ...)
/// or is longer than 64 characters (then cut as [`quote`] cuts).
fn push_key(field: &mut String, key: &str) {
    let plain = !key.is_empty()
        && key.len() <= super::error::MAX_QUOTED
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if plain {
        if !field.is_empty() {
            field.push('.');
        }
        field.push_str(key);
    } else {
        let _ = write!(field, "[{}]", quote(key));
    }
}

/// An error's text with its first letter in lower case (io errors start upper-case).
fn lower(err: &dyn std::fmt::Display) -> String {
    let text = err.to_string();
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => text,
    }
}

/// One-based line and column of byte `offset`, counted as serde_json counts (bytes).
fn line_column(bytes: &[u8], offset: usize) -> (usize, usize) {
    let before = &bytes[..offset.min(bytes.len())];
    let line = 1 + before.iter().filter(|&&b| b == b'\n').count();
    let column = match before.iter().rposition(|&b| b == b'\n') {
        Some(nl) => offset - nl,
        None => offset + 1,
    };
    (line, column)
}

/// The checks that run after the JSON has been read: ranges, names and references.
struct Checker {
    file: String,
}

impl Checker {
    /// An error at `field`.
    fn err(&self, field: impl Into<String>, message: impl Into<String>) -> PolicyError {
        PolicyError::new(&self.file, message).with_field(field)
    }

    /// An error at `field` inside plan `plan`.
    fn plan_err(&self, plan: &str, field: &str, message: impl Into<String>) -> PolicyError {
        let mut path = String::from("plans");
        push_key(&mut path, plan);
        if !field.is_empty() {
            path.push('.');
            path.push_str(field);
        }
        self.err(path, message).with_plan(plan)
    }

    fn check(self, raw: RawPolicies) -> Result<Policies, PolicyError> {
        if raw.plans.plans.is_empty() {
            return Err(self.err("plans", "no plans: define at least one"));
        }
        let count = raw.plans.plans.len();
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
        let mut plans = Vec::with_capacity(raw.plans.plans.len());
        let mut by_name = HashMap::with_capacity(raw.plans.plans.len());
        for (name, raw_plan) in raw.plans.plans {
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
            if let Err(e) = crate::error::validate_key(&rule.prefix) {
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

        let mut routes: Vec<Route> = Vec::with_capacity(raw.routes.len());
        // Shape (method, path without parameter names) → index of its route.
        let mut shapes: HashMap<(String, String), usize> = HashMap::with_capacity(raw.routes.len());
        for (i, Obj(raw_route)) in raw.routes.into_iter().enumerate() {
            let field = format!("routes[{i}]");
            let (route, shape) = self.route(&field, raw_route, &lookup)?;
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
        })
    }

    fn plan(&self, name: &str, raw: RawPlan) -> Result<Plan, PolicyError> {
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
        if raw.capacity == 0 {
            return Err(self.plan_err(
                name,
                "capacity",
                "must be a whole number of tokens ≥ 1, got 0",
            ));
        }
        if raw.capacity > MAX_CAPACITY {
            return Err(self.plan_err(
                name,
                "capacity",
                format!(
                    "must be at most {MAX_CAPACITY} tokens, got {}",
                    raw.capacity
                ),
            ));
        }
        let capacity = Tokens::whole(raw.capacity);
        let rate = match (raw.refill_per_second, &raw.refill) {
            (Some(_), Some(_)) => {
                return Err(self.plan_err(
                    name,
                    "",
                    "give one of refill_per_second or refill, not both",
                ));
            }
            (None, None) => {
                return Err(self.plan_err(
                    name,
                    "",
                    "missing refill rate: give refill_per_second or refill",
                ));
            }
            (Some(per_second), None) => self.rate_per_second(name, per_second)?,
            (None, Some(Obj(refill))) => {
                if refill.tokens == 0 {
                    return Err(self.plan_err(name, "refill.tokens", "must be ≥ 1, got 0"));
                }
                if refill.period_ms == 0 {
                    return Err(self.plan_err(
                        name,
                        "refill.period_ms",
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
                        "refill",
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
                            "refill",
                            format!(
                                "rate too high: {described} is more than 1000000000 tokens \
                                 per second"
                            ),
                        )
                    })?
            }
        };
        let bucket = BucketConfig::new(capacity, rate)
            .ok_or_else(|| self.plan_err(name, "capacity", "must be ≥ 1"))?;
        let mut plan = Plan::new(name, bucket);
        if let Some(Obj(lease)) = raw.lease {
            plan = plan.with_lease(self.lease(name, lease, raw.capacity)?);
        }
        if let Some(Obj(fallback)) = raw.fallback {
            plan = plan.with_fallback(self.fallback(name, fallback, raw.capacity)?);
        }
        if raw.shadow == Some(true) {
            plan = plan.with_shadow(true);
        }
        Ok(plan)
    }

    fn rate_per_second(&self, name: &str, per_second: f64) -> Result<Rate, PolicyError> {
        let field = "refill_per_second";
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
    fn lease(
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
    fn fallback(
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

    /// A checked route and its shape for duplicate detection (method, path with parameter
    /// names blanked out).
    fn route(
        &self,
        field: &str,
        raw: RawRoute,
        lookup: &dyn Fn(&str, &str) -> Result<usize, PolicyError>,
    ) -> Result<(Route, (String, String)), PolicyError> {
        if !METHODS.contains(&raw.method.as_str()) {
            let upper = raw.method.to_ascii_uppercase();
            let hint = if METHODS.contains(&upper.as_str()) {
                " (methods are upper-case)"
            } else {
                ""
            };
            return Err(self.err(
                format!("{field}.method"),
                format!(
                    "unknown HTTP method {}{hint}; use one of {}",
                    quote(&raw.method),
                    METHODS.join(", ")
                ),
            ));
        }
        let path_field = format!("{field}.path");
        if raw.path.is_empty() {
            return Err(self.err(path_field, "must not be empty; route paths start with '/'"));
        }
        if !raw.path.starts_with('/') {
            return Err(self.err(
                path_field,
                format!("must start with '/', got {}", quote(&raw.path)),
            ));
        }
        let pattern = parse_pattern(&raw.path).map_err(|reason| {
            self.err(
                &path_field,
                format!("invalid route pattern {}: {reason}", quote(&raw.path)),
            )
        })?;
        if let Some(global) = &raw.global {
            lookup(&format!("{field}.global"), global)?;
        }
        let entity = match raw.entity {
            Some(Obj(entity)) => {
                Some(self.entity(field, entity, &raw.path, &pattern.params, lookup)?)
            }
            None => None,
        };
        if raw.global.is_none() && entity.is_none() {
            return Err(self.err(
                field,
                "limits nothing: give global, entity or both".to_owned(),
            ));
        }
        let shadow = match raw.shadow {
            None | Some(serde_json::Value::Bool(false)) => RouteShadow::all(false),
            Some(serde_json::Value::Bool(true)) => RouteShadow::all(true),
            Some(serde_json::Value::String(layer)) if layer == "api" => RouteShadow::api(),
            Some(serde_json::Value::String(layer)) if layer == "entity" => RouteShadow::entity(),
            Some(other) => {
                return Err(self.err(
                    format!("{field}.shadow"),
                    format!(
                        "expected true, false, \"api\" or \"entity\", got {}",
                        shorten(&other.to_string())
                    ),
                ));
            }
        };
        if shadow.api && !shadow.entity && raw.global.is_none() {
            return Err(self.err(
                format!("{field}.shadow"),
                "puts the api layer in shadow mode, but the route has no global plan",
            ));
        }
        if shadow.entity && !shadow.api && entity.is_none() {
            return Err(self.err(
                format!("{field}.shadow"),
                "puts the entity layer in shadow mode, but the route has no entity",
            ));
        }
        let route = Route {
            method: raw.method,
            path: raw.path,
            global: raw.global,
            entity,
            shadow,
        };
        let shape = (route.method.clone(), pattern.shape);
        Ok((route, shape))
    }

    fn entity(
        &self,
        route_field: &str,
        raw: RawEntity,
        path: &str,
        params: &[String],
        lookup: &dyn Fn(&str, &str) -> Result<usize, PolicyError>,
    ) -> Result<EntityRule, PolicyError> {
        let field = format!("{route_field}.entity");
        let client_ip = raw.client_ip == Some(true);
        let given: Vec<&str> = [
            raw.path_param.as_ref().map(|_| "path_param"),
            raw.header.as_ref().map(|_| "header"),
            client_ip.then_some("client_ip"),
        ]
        .into_iter()
        .flatten()
        .collect();
        let source = match given.as_slice() {
            [] => {
                return Err(self.err(
                    field,
                    "no entity source: give one of path_param, header or client_ip: true",
                ));
            }
            [_] => {
                if let Some(param) = raw.path_param {
                    if !params.contains(&param) {
                        let known = if params.is_empty() {
                            "it has none".to_owned()
                        } else {
                            format!("it has {}", shorten(&params.join(", ")))
                        };
                        return Err(self.err(
                            format!("{field}.path_param"),
                            format!(
                                "{} is not a parameter of {}; {known}",
                                quote(&param),
                                quote(path)
                            ),
                        ));
                    }
                    EntitySource::PathParam(param)
                } else if let Some(header) = raw.header {
                    if !is_header_name(&header) {
                        return Err(self.err(
                            format!("{field}.header"),
                            format!("{} is not a valid HTTP header name", quote(&header)),
                        ));
                    }
                    EntitySource::Header(header.to_ascii_lowercase())
                } else {
                    EntitySource::ClientIp
                }
            }
            many => {
                return Err(self.err(
                    field,
                    format!(
                        "more than one entity source ({}): give exactly one",
                        many.join(", ")
                    ),
                ));
            }
        };
        if let Some(kind) = &raw.entity_type {
            let ok = !kind.is_empty()
                && kind.chars().count() <= MAX_ENTITY_TYPE
                && !kind.chars().any(char::is_control);
            if !ok {
                return Err(self.err(
                    format!("{field}.type"),
                    format!(
                        "must be 1 to {MAX_ENTITY_TYPE} characters without control \
                         characters, got {}",
                        quote(kind)
                    ),
                ));
            }
        }
        lookup(&format!("{field}.plan"), &raw.plan)?;
        Ok(EntityRule {
            source,
            entity_type: raw.entity_type,
            plan: raw.plan,
        })
    }
}

/// Whether `name` is an HTTP field name: one or more `tchar`s (RFC 9110 §5.6.2).
fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.bytes().all(|b| {
            b.is_ascii_alphanumeric()
                || matches!(
                    b,
                    b'!' | b'#'
                        | b'$'
                        | b'%'
                        | b'&'
                        | b'\''
                        | b'*'
                        | b'+'
                        | b'-'
                        | b'.'
                        | b'^'
                        | b'_'
                        | b'`'
                        | b'|'
                        | b'~'
                )
        })
}

/// A route pattern taken apart.
#[derive(Debug)]
struct Pattern {
    /// Parameter names in order (without the `*` of a catch-all).
    params: Vec<String>,
    /// The path with every parameter name removed (`/bookings/{}`), so two routes that match
    /// the same requests have the same shape.
    shape: String,
}

/// The shape of an axum 0.8 route pattern: the pattern with its parameter names removed
/// (`/items/{}` for `/items/{itemId}`), so two patterns that match the same requests have the
/// same shape. `None` for a pattern this crate refuses.
#[cfg(feature = "http")]
pub(crate) fn route_shape(path: &str) -> Option<String> {
    parse_pattern(path).ok().map(|p| p.shape)
}

/// Why `path` is not an axum 0.8 route pattern, if it is not one.
#[cfg(feature = "http")]
pub(crate) fn route_pattern_error(path: &str) -> Option<String> {
    parse_pattern(path).err()
}

/// The parameter names of an axum 0.8 route pattern, in order (`None` for a refused pattern).
#[cfg(feature = "http")]
pub(crate) fn route_params(path: &str) -> Option<Vec<String>> {
    parse_pattern(path).ok().map(|p| p.params)
}

/// Checks an axum 0.8 route pattern: `{name}` parameters, a `{*name}` catch-all only at the
/// end, `{{` and `}}` for literal braces, no whitespace, control characters, `?` or `#`, and
/// no segment in the older `:name` / `*name` syntax (axum 0.8 refuses to route those, so such
/// a policy route would never match a request and its limits would silently never apply).
fn parse_pattern(path: &str) -> Result<Pattern, String> {
    for segment in path.split('/') {
        for (mark, written) in [(':', "{name}"), ('*', "{*name}")] {
            if let Some(name) = segment.strip_prefix(mark) {
                let hint = if name.is_empty() {
                    written.to_owned()
                } else if mark == ':' {
                    format!("{{{name}}}")
                } else {
                    format!("{{*{name}}}")
                };
                return Err(format!(
                    "segment {} uses the older {mark}name parameter syntax, which axum 0.8 \
                     does not route; write it as {}",
                    quote(segment),
                    quote(&hint)
                ));
            }
        }
    }
    let mut params: Vec<String> = Vec::new();
    let mut names: std::collections::HashSet<&str> = std::collections::HashSet::new();
    let mut shape = String::with_capacity(path.len());
    let mut chars = path.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        match c {
            '{' if chars.peek().map(|&(_, n)| n) == Some('{') => {
                chars.next();
                shape.push_str("{{");
            }
            '}' if chars.peek().map(|&(_, n)| n) == Some('}') => {
                chars.next();
                shape.push_str("}}");
            }
            '}' => return Err(format!("unmatched '}}' at byte {at}")),
            '{' => {
                let rest = &path[at + 1..];
                let end = rest
                    .find(['}', '{', '/'])
                    .filter(|&e| rest.as_bytes()[e] == b'}')
                    .ok_or_else(|| format!("unclosed '{{' at byte {at}"))?;
                let inner = &rest[..end];
                let (catch_all, name) = match inner.strip_prefix('*') {
                    Some(name) => (true, name),
                    None => (false, inner),
                };
                let name_ok = !name.is_empty()
                    && name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
                if !name_ok {
                    return Err(format!(
                        "parameter name {} must be 1 or more of A-Z a-z 0-9 _ -",
                        quote(name)
                    ));
                }
                if !names.insert(name) {
                    return Err(format!("parameter {} appears twice", quote(name)));
                }
                if catch_all && at + 1 + end + 1 != path.len() {
                    return Err(format!(
                        "catch-all parameter {} must end the path",
                        quote(name)
                    ));
                }
                params.push(name.to_owned());
                shape.push_str(if catch_all { "{*}" } else { "{}" });
                // Skip the name and the closing brace.
                for _ in 0..inner.chars().count() + 1 {
                    chars.next();
                }
            }
            c if c.is_whitespace() || c.is_control() || c == '?' || c == '#' => {
                return Err(format!("{c:?} is not allowed in a route pattern"));
            }
            c => shape.push(c),
        }
    }
    Ok(Pattern { params, shape })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_params_and_shape() {
        let p = parse_pattern("/bookings/{bookingId}/items/{*rest}").unwrap();
        assert_eq!(p.params, ["bookingId", "rest"]);
        assert_eq!(p.shape, "/bookings/{}/items/{*}");
        let p = parse_pattern("/literal/{{braces}}").unwrap();
        assert!(p.params.is_empty());
    }

    #[test]
    fn pattern_refusals() {
        for bad in [
            "/a/{",
            "/a/{}",
            "/a/{b",
            "/a/{b/c}",
            "/a/}",
            "/a/{*rest}/b",
            "/a/{x}/{x}",
            "/a b",
            "/a?b=1",
            "/a/{é}",
            "/items/:id",
            "/files/*rest",
        ] {
            assert!(parse_pattern(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn older_parameter_syntax_is_refused_with_the_new_spelling() {
        let why = parse_pattern("/items/:id/parts").unwrap_err();
        assert!(why.contains(r#"write it as "{id}""#), "{why}");
        let why = parse_pattern("/files/*rest").unwrap_err();
        assert!(why.contains(r#"write it as "{*rest}""#), "{why}");
        // A colon or star inside a segment is literal text in axum 0.8 too.
        assert!(parse_pattern("/items/v1:batch").is_ok());
        let parsed = parse_pattern("/items/{itemId}").unwrap();
        assert_eq!(parsed.shape, "/items/{}");
        assert_eq!(parse_pattern("/a/{x}/b/{*y}").unwrap().params, ["x", "y"]);
    }

    #[test]
    fn header_names() {
        assert!(is_header_name("x-booking-id"));
        assert!(is_header_name("X-Booking-Id"));
        assert!(!is_header_name(""));
        assert!(!is_header_name("x booking"));
        assert!(!is_header_name("x:booking"));
        assert!(!is_header_name("bööking"));
    }

    #[test]
    fn field_paths_quote_unusual_keys() {
        let mut field = String::from("plans");
        push_key(&mut field, "v1.2");
        field.push_str(".capacity");
        assert_eq!(field, r#"plans["v1.2"].capacity"#);
    }

    #[test]
    fn line_column_of_offsets() {
        assert_eq!(line_column(b"ab\ncd", 0), (1, 1));
        assert_eq!(line_column(b"ab\ncd", 4), (2, 2));
    }

    #[test]
    fn longest_prefix_wins() {
        let json = r#"{
            "plans": { "a": { "capacity": 1, "refill_per_second": 1 },
                       "b": { "capacity": 2, "refill_per_second": 1 },
                       "c": { "capacity": 3, "refill_per_second": 1 } },
            "default_plan": "c",
            "keys": [ { "prefix": "x:", "plan": "a" }, { "prefix": "x:y:", "plan": "b" } ]
        }"#;
        let p = Policies::from_json_str(json, None).unwrap();
        assert_eq!(p.plan_for_key("x:y:1").unwrap().name(), "b");
        assert_eq!(p.plan_for_key("x:z").unwrap().name(), "a");
        assert_eq!(p.plan_for_key("other").unwrap().name(), "c");
        assert_eq!(p.summary(), "<policy>: 3 plans, 0 routes, 2 key rules");
    }
}
