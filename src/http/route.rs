//! The configuration a layer builds and its services read: which limits apply to a request
//! ([`Routes`]), each route's limits in order with their plans, keys, header names and metric
//! handles ([`RouteLimits`], [`Limit`]), and what every service of one layer shares
//! ([`Config`]). Everything a request needs that does not depend on the request is computed
//! here, once.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use axum::http::{HeaderName, HeaderValue, Method};
use metrics::Counter;
use parking_lot::RwLock;

use super::headers::policy_item;
use super::key::{EntityKey, TrustedProxies};
use super::refund::GiveBacks;
use super::refused::Refused;
use crate::Limiter;
use crate::metrics::{HTTP_CHECKED, HTTP_DENIED, HTTP_ERRORS, HTTP_UNMATCHED, HTTP_WOULD_DENY};
use crate::policy::{Plan, route_params};

/// Everything the service needs, shared by all clones.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) limiter: Limiter,
    pub(crate) routes: Routes,
    pub(crate) trusted: TrustedProxies,
    /// Give-backs the lease could not take, sent to the store in batches.
    pub(crate) give_backs: Arc<GiveBacks>,
}

/// Which limits apply to a request.
#[derive(Clone, Debug)]
pub(crate) enum Routes {
    /// From a policy file: by method and route shape (`METHOD:shape`, the shape of the pattern
    /// in axum's `MatchedPath`, so parameter names need not agree), and every route in file
    /// order for finding the route a request that matched none should have matched.
    ///
    /// Behind a lock so that [`RateLimitLayer::reload`](super::RateLimitLayer::reload) swaps
    /// the whole table at once: a request holds the read lock only while it looks its route up.
    Table(Arc<RwLock<Arc<RouteTable>>>),
    /// One route's limits, for every request the layer sees.
    One(Arc<RouteLimits>),
}

/// The most router patterns a table remembers per method: a router has as many patterns as
/// routes, so this bound is never reached by a real one.
const MAX_SEEN: usize = 10_000;

/// A policy file's routes as the layer looks them up.
#[derive(Debug)]
pub(crate) struct RouteTable {
    /// By `METHOD:shape`.
    pub(crate) by_shape: HashMap<String, Arc<RouteLimits>>,
    /// In file order.
    pub(crate) all: Vec<Arc<RouteLimits>>,
    /// The route found for each router pattern (axum's `MatchedPath`) per standard method
    /// ([`method_slot`]), or `None` for a pattern of no route: a request's lookup after the
    /// first of its pattern reads no shape and builds no string.
    seen: [papaya::HashMap<Box<str>, Option<Arc<RouteLimits>>>; 9],
}

/// The slot of a standard method in [`RouteTable::seen`]; `None` for any other.
fn method_slot(method: &Method) -> Option<usize> {
    Some(match *method {
        Method::GET => 0,
        Method::HEAD => 1,
        Method::POST => 2,
        Method::PUT => 3,
        Method::DELETE => 4,
        Method::PATCH => 5,
        Method::OPTIONS => 6,
        Method::TRACE => 7,
        Method::CONNECT => 8,
        _ => return None,
    })
}

impl RouteTable {
    pub(crate) fn new(
        by_shape: HashMap<String, Arc<RouteLimits>>,
        all: Vec<Arc<RouteLimits>>,
    ) -> Self {
        RouteTable {
            by_shape,
            all,
            seen: std::array::from_fn(|_| papaya::HashMap::new()),
        }
    }

    /// The route of a request with `method` that the router matched as `matched`: read from
    /// what earlier requests found, or found by shape (`find`) and remembered.
    pub(crate) fn lookup(
        &self,
        method: &Method,
        matched: &str,
        find: impl FnOnce(&Self) -> Option<Arc<RouteLimits>>,
    ) -> Option<Arc<RouteLimits>> {
        let Some(slot) = method_slot(method) else {
            return find(self);
        };
        let seen = self.seen[slot].pin();
        if let Some(found) = seen.get(matched) {
            return found.clone();
        }
        let found = find(self);
        if seen.len() < MAX_SEEN {
            seen.insert(Box::from(matched), found.clone());
        }
        found
    }
}

/// A policy file's route as the layer uses it: its own pattern (for the bucket keys and the
/// metric labels), its parameter names, and its metric handles, registered when the layer was
/// built so every series exists from start-up.
#[derive(Debug)]
pub(crate) struct FileRoute {
    /// The method the file names.
    pub(crate) method: String,
    /// The pattern the file names, e.g. `/bookings/{bookingId}`.
    pub(crate) path: String,
    /// `METHOD:pattern`.
    pub(crate) endpoint: String,
    /// Its parameter names, in order: a router pattern of the same shape may name them
    /// differently, and they are found by position.
    pub(crate) params: Vec<String>,
    /// `tokenlease_http_checked_total` of this route.
    pub(crate) checked: Counter,
    /// `tokenlease_http_unmatched_total` of this route.
    pub(crate) unmatched: Counter,
    /// Whether the warning about a request that should have matched this route was logged.
    pub(crate) warned: AtomicBool,
}

/// The labels of a file route's series, with `layer` when given.
fn labels(method: &str, path: &str, layer: Option<&str>) -> Vec<metrics::Label> {
    let mut l = vec![
        metrics::Label::new("method", method.to_owned()),
        metrics::Label::new("route", path.to_owned()),
    ];
    if let Some(layer) = layer {
        l.push(metrics::Label::new("layer", layer.to_owned()));
    }
    l
}

/// A counter present at zero from the start, before any request.
fn zero(c: Counter) -> Counter {
    c.increment(0);
    c
}

impl FileRoute {
    pub(crate) fn new(method: &str, path: &str) -> FileRoute {
        FileRoute {
            method: method.to_owned(),
            path: path.to_owned(),
            endpoint: format!("{method}:{path}"),
            params: route_params(path).unwrap_or_default(),
            checked: zero(metrics::counter!(HTTP_CHECKED, labels(method, path, None))),
            unmatched: zero(metrics::counter!(
                HTTP_UNMATCHED,
                labels(method, path, None)
            )),
            warned: AtomicBool::new(false),
        }
    }
}

/// What a limit keeps one bucket per.
#[derive(Clone, Debug)]
pub(crate) enum Scope {
    /// The route as a whole.
    Route,
    /// Each entity, its id found by `key`; `param` is the position of its path parameter
    /// among a file route's.
    Entity {
        key: EntityKey,
        param: Option<usize>,
        /// For a file route whose parameter is a whole segment of its pattern (`/{id}/`), the
        /// segment's position in the path: the id is read from the request's path there,
        /// without collecting the request's parameters.
        segment: Option<usize>,
    },
}

/// A limit's metric handles on a file route: denied, errors, would deny.
#[derive(Clone, Debug)]
pub(crate) struct LimitCounters {
    pub(crate) denied: Counter,
    pub(crate) errors: Counter,
    pub(crate) would_deny: Counter,
}

/// One limit of a route, as a request uses it.
#[derive(Clone, Debug)]
pub(crate) struct Limit {
    /// Its name in the header fields, the problem body and the metrics.
    pub(crate) name: Arc<str>,
    /// The plan of its buckets: the limiter's own `Arc` when its policies hold the plan, or a
    /// shadow limit's twin.
    pub(crate) plan: Arc<Plan>,
    /// The plan's registry index, for the lease table's fast path.
    pub(crate) index: Option<u32>,
    pub(crate) scope: Scope,
    /// Shadow mode: a denial is reported and counted, and the request goes on.
    pub(crate) shadow: bool,
    /// `X-RateLimit-{name}-Remaining`.
    pub(crate) remaining: HeaderName,
    /// The bucket key when it does not depend on the request (a file route's whole-route
    /// limit), or the key's part before the entity id (a file route's entity limit, any
    /// budget), ending in `:`. `None`: made from the request's endpoint.
    pub(crate) key: Option<String>,
    /// The key's kind for a key made per request: `api`, or `entity`, and the name part.
    pub(crate) dynamic: (&'static str, Option<Arc<str>>),
    /// A file route's metric handles.
    pub(crate) counters: Option<LimitCounters>,
    /// Keys this limit refused, answered from memory until their `retry_after`.
    pub(crate) refused: Arc<Refused>,
}

/// How a limit is written: its name, plan, scope, budget and shadow mode.
pub(crate) struct LimitSpec {
    pub(crate) name: String,
    pub(crate) plan: Arc<Plan>,
    /// `None`: the whole route.
    pub(crate) entity: Option<EntityKey>,
    pub(crate) budget: Option<String>,
    pub(crate) shadow: bool,
}

/// The limits of one route, in the order they are checked.
#[derive(Clone, Debug)]
pub(crate) struct RouteLimits {
    pub(crate) limits: Vec<Limit>,
    /// The route pattern when not taken from axum's `MatchedPath`.
    pub(crate) pattern: Option<String>,
    /// The policy file's route, for a layer built from one.
    pub(crate) file: Option<Arc<FileRoute>>,
    /// `RateLimit-Policy`, precomputed.
    pub(crate) policy: HeaderValue,
    /// Whether any limit reads a path parameter.
    pub(crate) needs_params: bool,
}

impl RouteLimits {
    /// The limits `specs`, in order, of a route from a policy file (`file`) or set in code.
    ///
    /// A shadow limit decides with its plan's shadow twin (`plan.clone().with_shadow(true)`):
    /// its refusals let the request through, are counted as `outcome="would_deny"` in
    /// `tokenlease_decisions_total` (registered at zero now in `limiter`'s plan registry, with
    /// the recorder installed now), never as `denied`, and its buckets are the twin's own
    /// ([`Plan::store_key`]). Any other limit decides with the limiter's own `Arc` of its plan
    /// and its registry index, when the limiter's policies hold it: the lease table's fast
    /// path, with no lookup of the plan per request.
    pub(crate) fn new(
        specs: Vec<LimitSpec>,
        pattern: Option<String>,
        file: Option<Arc<FileRoute>>,
        limiter: &Limiter,
    ) -> RouteLimits {
        let mut limits = Vec::with_capacity(specs.len());
        let mut items = Vec::with_capacity(specs.len());
        let mut needs_params = false;
        for spec in specs {
            let (plan, index) = if spec.shadow && !spec.plan.shadow() {
                let twin = Arc::new((*spec.plan).clone().with_shadow(true));
                limiter.register_plan(&twin);
                (twin, None)
            } else {
                match limiter.resolve_plan(&spec.plan) {
                    Some((shared, index)) => (shared, Some(index)),
                    None => (spec.plan, None),
                }
            };
            let name: Arc<str> = Arc::from(spec.name.as_str());
            items.push(policy_item(&name, &plan));
            let param = match (&spec.entity, &file) {
                (Some(key), Some(file)) => key
                    .path_param_name()
                    .and_then(|p| file.params.iter().position(|n| n == p)),
                _ => None,
            };
            needs_params |= spec
                .entity
                .as_ref()
                .is_some_and(EntityKey::needs_path_params)
                && file.is_none();
            let (key, dynamic) = match (&spec.budget, &spec.entity, &file) {
                (Some(budget), _, _) => (
                    Some(format!("ratelimit:budget:{budget}:")),
                    ("entity", None),
                ),
                (None, None, _) => {
                    let part = (spec.name != "api").then(|| Arc::clone(&name));
                    let key = file.as_ref().map(|f| match &part {
                        None => format!("ratelimit:api:{}", f.endpoint),
                        Some(n) => format!("ratelimit:api:{n}:{}", f.endpoint),
                    });
                    (key, ("api", part))
                }
                (None, Some(_), _) => {
                    let part = (spec.name != "entity").then(|| Arc::clone(&name));
                    let key = file.as_ref().map(|f| match &part {
                        None => format!("ratelimit:entity:{}:", f.endpoint),
                        Some(n) => format!("ratelimit:entity:{n}:{}:", f.endpoint),
                    });
                    (key, ("entity", part))
                }
            };
            let counters = file.as_ref().map(|f| LimitCounters {
                denied: zero(metrics::counter!(
                    HTTP_DENIED,
                    labels(&f.method, &f.path, Some(&name))
                )),
                errors: zero(metrics::counter!(
                    HTTP_ERRORS,
                    labels(&f.method, &f.path, Some(&name))
                )),
                would_deny: zero(metrics::counter!(
                    HTTP_WOULD_DENY,
                    labels(&f.method, &f.path, Some(&name))
                )),
            });
            let remaining = HeaderName::try_from(format!(
                "x-ratelimit-{}-remaining",
                name.to_ascii_lowercase()
            ))
            .unwrap_or(HeaderName::from_static("x-ratelimit-remaining"));
            let segment = match (&spec.entity, &file) {
                (Some(key), Some(file)) => key.path_param_name().and_then(|name| {
                    let whole = format!("{{{name}}}");
                    file.path
                        .trim_start_matches('/')
                        .split('/')
                        .position(|seg| seg == whole)
                }),
                _ => None,
            };
            let scope = match spec.entity {
                None => Scope::Route,
                Some(key) => Scope::Entity {
                    key,
                    param,
                    segment,
                },
            };
            limits.push(Limit {
                name,
                plan,
                index,
                scope,
                shadow: spec.shadow,
                remaining,
                key,
                dynamic,
                counters,
                refused: Arc::new(Refused::default()),
            });
        }
        let policy = HeaderValue::try_from(items.join(", "))
            .unwrap_or_else(|_| HeaderValue::from_static(""));
        RouteLimits {
            limits,
            pattern,
            file,
            policy,
            needs_params,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.limits.is_empty()
    }
}
