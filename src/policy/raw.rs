//! The policy file exactly as written: serde types with no checks beyond JSON types.
//!
//! [`load`](super::load) turns these into the validated types. Every struct denies unknown
//! fields so a typo is an error, not a silently ignored setting.

use std::collections::HashSet;
use std::fmt;
use std::marker::PhantomData;

use serde::Deserialize;
use serde::de::value::MapAccessDeserializer;
use serde::de::{MapAccess, Visitor};

/// A raw type read from a JSON object, with a name for error messages.
pub(super) trait Object {
    /// What the object is, as in "expected {WHAT}".
    const WHAT: &'static str;
}

/// A `T` that must be written as a JSON object.
///
/// serde's derived structs also accept a JSON array of the field values in order
/// (`[10, 5]` for a plan); this wrapper refuses that, so only the documented form is read.
#[derive(Debug)]
pub(super) struct Obj<T>(pub(super) T);

impl<'de, T: Deserialize<'de> + Object> Deserialize<'de> for Obj<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ObjVisitor<T>(PhantomData<T>);

        impl<'de, T: Deserialize<'de> + Object> Visitor<'de> for ObjVisitor<T> {
            type Value = Obj<T>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(T::WHAT)
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Obj<T>, A::Error> {
                T::deserialize(MapAccessDeserializer::new(map)).map(Obj)
            }
        }

        deserializer.deserialize_map(ObjVisitor(PhantomData))
    }
}

macro_rules! object {
    ($($ty:ty => $what:literal,)*) => {
        $(impl Object for $ty {
            const WHAT: &'static str = $what;
        })*
    };
}

object! {
    RawPolicies => "a policy object",
    RawPlan => "a plan object",
    RawRefill => "a refill object",
    RawBucketLimit => "a limit object (capacity and refill_per_second or refill)",
    RawLease => "a lease object",
    RawFallback => "a fallback object",
    RawKeyRule => "a key rule object",
    RawRoute => "a route object",
    RawEntity => "an entity object",
    RawLimit => "a limit object",
}

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPolicies {
    pub(super) plans: RawPlans,
    #[serde(default)]
    pub(super) default_plan: Option<String>,
    #[serde(default)]
    pub(super) keys: Vec<Obj<RawKeyRule>>,
    #[serde(default)]
    pub(super) routes: Vec<Obj<RawRoute>>,
    /// Limits shared by several routes, by name: each an entity source and a plan.
    #[serde(default)]
    pub(super) budgets: RawMap<RawEntity>,
    /// Whether the HTTP layer also writes an `X-RateLimit-{Name}-Remaining` field per limit.
    #[serde(default)]
    pub(super) x_ratelimit_remaining: bool,
    /// Which responses the HTTP layer writes its fields on: `"every_response"` or `"refusals"`.
    #[serde(default)]
    pub(super) fields_on: Option<String>,
}

/// A raw type kept in a [`RawMap`] by name.
pub(super) trait Many {
    /// What the map holds, as in "expected an object of {MANY} by name".
    const MANY: &'static str;
}

impl Many for RawPlan {
    const MANY: &'static str = "plans";
}

impl Many for RawEntity {
    const MANY: &'static str = "budgets";
}

/// The `plans` object: plans by name.
pub(super) type RawPlans = RawMap<RawPlan>;

/// An object of named objects (`plans`, `budgets`), in document order, remembering names that
/// appear more than once (serde_json would otherwise keep the last one silently).
#[derive(Debug)]
pub(super) struct RawMap<T> {
    pub(super) entries: Vec<(String, T)>,
    pub(super) duplicates: Vec<String>,
}

impl<T> Default for RawMap<T> {
    fn default() -> Self {
        RawMap {
            entries: Vec::new(),
            duplicates: Vec::new(),
        }
    }
}

impl<'de, T: Deserialize<'de> + Object + Many> Deserialize<'de> for RawMap<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MapVisitor<T>(PhantomData<T>);

        impl<'de, T: Deserialize<'de> + Object + Many> Visitor<'de> for MapVisitor<T> {
            type Value = RawMap<T>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "an object of {} by name", T::MANY)
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawMap<T>, A::Error> {
                let mut out = RawMap::default();
                // Names seen so far, so each check is constant time, not a scan of the entries.
                let mut seen: HashSet<String> = HashSet::new();
                let mut repeated: HashSet<String> = HashSet::new();
                while let Some(name) = map.next_key::<String>()? {
                    let Obj(value) = map.next_value::<Obj<T>>()?;
                    if seen.contains(&name) {
                        if repeated.insert(name.clone()) {
                            out.duplicates.push(name);
                        }
                    } else {
                        seen.insert(name.clone());
                        out.entries.push((name, value));
                    }
                }
                Ok(out)
            }
        }

        deserializer.deserialize_map(MapVisitor(PhantomData))
    }
}

/// One plan.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPlan {
    #[serde(default)]
    pub(super) capacity: Option<u64>,
    #[serde(default)]
    pub(super) refill_per_second: Option<f64>,
    #[serde(default)]
    pub(super) refill: Option<Obj<RawRefill>>,
    /// Several limits on one key, instead of `capacity` and a rate.
    #[serde(default)]
    pub(super) limits: Option<Vec<Obj<RawBucketLimit>>>,
    #[serde(default)]
    pub(super) lease: Option<Obj<RawLease>>,
    #[serde(default)]
    pub(super) fallback: Option<Obj<RawFallback>>,
    #[serde(default)]
    pub(super) shadow: Option<bool>,
}

/// One of a plan's `limits`: a capacity and a rate, as a plan of one limit gives them.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBucketLimit {
    pub(super) capacity: u64,
    #[serde(default)]
    pub(super) refill_per_second: Option<f64>,
    #[serde(default)]
    pub(super) refill: Option<Obj<RawRefill>>,
}

/// `refill: { tokens, period_ms }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRefill {
    pub(super) tokens: u64,
    pub(super) period_ms: u64,
}

/// `lease: { ... }`; every field has a default.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLease {
    #[serde(default)]
    pub(super) ttl_ms: Option<u64>,
    #[serde(default)]
    pub(super) max_fraction: Option<f64>,
    #[serde(default)]
    pub(super) low_water: Option<f64>,
    #[serde(default)]
    pub(super) refresh_ms: Option<u64>,
    #[serde(default)]
    pub(super) max_wait_ms: Option<u64>,
    #[serde(default)]
    pub(super) accounting: Option<RawAccounting>,
}

/// `lease.accounting`: `"relaxed"` or `"strict"`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum RawAccounting {
    Relaxed,
    Strict,
}

/// `fallback: { mode, instances, outage_debt }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFallback {
    pub(super) mode: RawFallbackMode,
    #[serde(default)]
    pub(super) instances: Option<u32>,
    #[serde(default)]
    pub(super) outage_debt: Option<bool>,
}

/// `fallback.mode`: a string, `"allow"`, `"deny"` or `"local"`.
#[derive(Debug, Clone, Copy)]
pub(super) enum RawFallbackMode {
    Allow,
    Deny,
    Local,
}

impl<'de> Deserialize<'de> for RawFallbackMode {
    // Hand-written because derived enums also accept `{"local": null}`.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        const MODES: &[&str] = &["allow", "deny", "local"];

        struct ModeVisitor;

        impl Visitor<'_> for ModeVisitor {
            type Value = RawFallbackMode;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("one of \"allow\", \"deny\", \"local\"")
            }

            fn visit_str<E: serde::de::Error>(self, mode: &str) -> Result<RawFallbackMode, E> {
                match mode {
                    "allow" => Ok(RawFallbackMode::Allow),
                    "deny" => Ok(RawFallbackMode::Deny),
                    "local" => Ok(RawFallbackMode::Local),
                    other => Err(E::unknown_variant(other, MODES)),
                }
            }
        }

        deserializer.deserialize_str(ModeVisitor)
    }
}

/// One entry of `keys`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawKeyRule {
    pub(super) prefix: String,
    pub(super) plan: String,
}

/// One entry of `routes`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    pub(super) method: String,
    pub(super) path: String,
    #[serde(default)]
    pub(super) global: Option<String>,
    #[serde(default)]
    pub(super) entity: Option<Obj<RawEntity>>,
    /// `true`, `false`, `"api"` or `"entity"`: checked by `load`, which names the field.
    #[serde(default)]
    pub(super) shadow: Option<serde_json::Value>,
    /// The route's limits in the order they are checked (instead of `global` and `entity`).
    #[serde(default)]
    pub(super) limits: Option<Vec<Obj<RawLimit>>>,
}

/// `routes[i].limits[j]`: a limit of its own (`name`, `plan`, and an entity source or none
/// for the whole route) or a shared budget (`budget`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimit {
    #[serde(default)]
    pub(super) name: Option<String>,
    #[serde(default)]
    pub(super) plan: Option<String>,
    #[serde(default)]
    pub(super) path_param: Option<String>,
    #[serde(default)]
    pub(super) header: Option<String>,
    #[serde(default)]
    pub(super) client_ip: Option<bool>,
    #[serde(default, rename = "type")]
    pub(super) entity_type: Option<String>,
    #[serde(default)]
    pub(super) budget: Option<String>,
    #[serde(default)]
    pub(super) shadow: Option<bool>,
}

/// `routes[i].entity`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEntity {
    #[serde(default)]
    pub(super) path_param: Option<String>,
    #[serde(default)]
    pub(super) header: Option<String>,
    #[serde(default)]
    pub(super) client_ip: Option<bool>,
    #[serde(default, rename = "type")]
    pub(super) entity_type: Option<String>,
    pub(super) plan: String,
}
