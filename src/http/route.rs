//! The configuration a layer builds and its services read: which limits apply to a request
//! ([`Routes`]), each route's limits in order with their plans, keys, header names and metric
//! handles ([`RouteLimits`], [`Limit`]), and what every service of one layer shares
//! ([`Config`]). Everything a request needs that does not depend on the request is computed
//! here, once.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::extract::MatchedPath;
use axum::http::{HeaderName, HeaderValue, Method};
use metrics::Counter;
use parking_lot::{Mutex, RwLock};

use super::headers::{NanoScale, policy_item};
use super::key::{EntityKey, TrustedProxies, made_keys_fit};
use super::memo::Memo;
use super::patterns::PerPattern;
use super::refund::GiveBacks;
use super::refused::Refused;
use crate::Limiter;
use crate::lease::Hint;
use crate::metrics::{HTTP_CHECKED, HTTP_DENIED, HTTP_ERRORS, HTTP_UNMATCHED, HTTP_WOULD_DENY};
use crate::policy::{FieldsOn, Plan, route_params};

/// Everything the service needs, shared by all clones.
///
/// Aligned to 128 bytes, so that in its `Arc` the count is alone on its cache lines: axum
/// clones the service for every request, one increment and one decrement of this count, and a
/// field read on one core after another core wrote the count beside it would wait for that
/// line (the adjacent line too: Intel's prefetcher fetches lines in pairs).
#[derive(Clone, Debug)]
#[repr(align(128))]
pub(crate) struct Config {
    pub(crate) limiter: Limiter,
    pub(crate) routes: Routes,
    pub(crate) trusted: TrustedProxies,
    /// Give-backs the lease could not take, sent to the store in batches.
    pub(crate) give_backs: Arc<GiveBacks>,
    /// Whether every route's responses carry `X-RateLimit-{Name}-Remaining` (the layer's
    /// builder asked for them; a policy file asks per [`RouteLimits`]).
    pub(crate) x_ratelimit_remaining: bool,
    /// Which responses carry the fields, when the layer's builder said (else the policy
    /// file's, per [`RouteLimits`]).
    pub(crate) fields_on: Option<FieldsOn>,
}

impl Config {
    /// Whether a response of `limits` carries `X-RateLimit-{Name}-Remaining`.
    pub(crate) fn remaining_fields(&self, limits: &RouteLimits) -> bool {
        self.x_ratelimit_remaining || limits.x_ratelimit_remaining
    }

    /// Whether an admitted response of `limits` carries the fields.
    pub(crate) fn fields_on_admitted(&self, limits: &RouteLimits) -> bool {
        self.fields_on.unwrap_or(limits.fields_on) == FieldsOn::EveryResponse
    }
}

/// Which limits apply to a request.
#[derive(Clone, Debug)]
pub(crate) enum Routes {
    /// From a policy file: by method and route shape (`METHOD:shape`, the shape of the pattern
    /// in axum's `MatchedPath`, so parameter names need not agree), and every route in file
    /// order for finding the route a request that matched none should have matched.
    ///
    /// Swapped whole by [`RateLimitLayer::reload`](super::RateLimitLayer::reload); a request
    /// reads its route without a lock once its pattern has been seen ([`TableCell`]).
    Table(Arc<TableCell>),
    /// One route's limits, for every request the layer sees (a layer built in code).
    One(Box<OneRoute>),
}

/// A code-built layer's route: its limits, and a copy of them for each method and router
/// pattern with what that pattern makes of them ([`CodeRoute`]), made at its first request
/// (`patterns.rs`). A request holds one counted reference, to its pattern's copy: on several
/// cores each count a request takes and drops is a cache line they pass to each other (the
/// limits and the pattern's part, held apart, were two).
#[derive(Clone, Debug)]
pub(crate) struct OneRoute {
    pub(crate) limits: RouteLimits,
    pub(crate) per_pattern: PerPattern<RouteLimits>,
}

impl OneRoute {
    pub(crate) fn new(limits: RouteLimits) -> Self {
        OneRoute {
            limits,
            per_pattern: PerPattern::default(),
        }
    }
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
}

/// The route table a layer reads, and the route found for each router pattern (axum's
/// `MatchedPath`) per standard method ([`method_slot`]), or `None` for a pattern of no route.
///
/// A request whose pattern was seen under the current table reads its route from `seen`
/// alone: no lock (whose count every core would share), no shape, no string built. Each entry
/// carries the generation of the table it was found in; a reload swaps the table and moves to
/// the next generation under the write lock, so an entry of an older table is a miss, looked
/// up again under the read lock (and replaced) like a pattern never seen.
#[derive(Debug)]
pub(crate) struct TableCell {
    /// A number no other cell has, naming it in the threads' memos (`memo.rs`).
    id: u64,
    table: RwLock<Arc<RouteTable>>,
    /// Changed only under `table`'s write lock.
    generation: AtomicU64,
    /// Hashed with foldhash, seeded per process: SipHash cost more than the rest of a hit.
    seen: [papaya::HashMap<Box<str>, Seen, foldhash::fast::RandomState>; 9],
}

thread_local! {
    /// The routes this thread found lately ([`Memo`]).
    static MEMO: RefCell<Memo<RouteLimits>> = const { RefCell::new(Memo::new()) };
}

/// The route this thread found for `path` and the method's `slot` in table cell `cell` under
/// `generation`, while its layer lives ([`Memo::get`]).
fn memo_get(
    cell: u64,
    generation: u64,
    slot: usize,
    path: &MatchedPath,
) -> Option<Arc<RouteLimits>> {
    MEMO.try_with(|memo| memo.try_borrow().ok()?.get(cell, generation, slot, path))
        .ok()
        .flatten()
}

/// Notes in this thread's memo that `found` is the route for `path` and the method's `slot` in
/// table cell `cell` under `generation` ([`Memo::put`]).
fn memo_put(cell: u64, generation: u64, slot: usize, path: &MatchedPath, found: &Arc<RouteLimits>) {
    // The entry replaced drops under the borrow: a `MatchedPath` and a `Weak`, whose drops
    // never reach the memo.
    let _ = MEMO.try_with(|memo| {
        if let Ok(mut memo) = memo.try_borrow_mut() {
            memo.put(cell, generation, slot, path, found);
        }
    });
}

/// A pattern's route as found under one generation of the table.
#[derive(Debug)]
struct Seen {
    generation: u64,
    found: Option<Arc<RouteLimits>>,
}

/// The slot of a standard method in [`TableCell::seen`]; `None` for any other.
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
        RouteTable { by_shape, all }
    }
}

impl TableCell {
    pub(crate) fn new(table: RouteTable) -> Self {
        TableCell {
            id: super::memo::next_cell_id(),
            table: RwLock::new(Arc::new(table)),
            generation: AtomicU64::new(0),
            seen: std::array::from_fn(|_| papaya::HashMap::default()),
        }
    }

    /// Puts `table` in place of the current one, for every request that looks its route up
    /// from now on.
    pub(crate) fn swap(&self, table: RouteTable) {
        let mut current = self.table.write();
        *current = Arc::new(table);
        self.generation.fetch_add(1, Ordering::Release);
    }

    /// Runs `f` on the current table, under the read lock.
    pub(crate) fn with<T>(&self, f: impl FnOnce(&RouteTable) -> T) -> T {
        f(&self.table.read())
    }

    /// The route of a request with `method` that the router matched as `path`: read from what
    /// this thread found last for it under the current table (`memo.rs`), or what any thread
    /// found, or found by shape (`find`) and remembered. When there is none, `none` runs on the
    /// table the lookup used.
    pub(crate) fn lookup(
        &self,
        method: &Method,
        path: &MatchedPath,
        find: impl FnOnce(&RouteTable) -> Option<Arc<RouteLimits>>,
        none: impl FnOnce(&RouteTable),
    ) -> Option<Arc<RouteLimits>> {
        let matched = path.as_str();
        let Some(slot) = method_slot(method) else {
            let table = self.table.read();
            let found = find(&table);
            if found.is_none() {
                none(&table);
            }
            return found;
        };
        let generation = self.generation.load(Ordering::Acquire);
        if let Some(found) = memo_get(self.id, generation, slot, path) {
            return Some(found);
        }
        let seen = self.seen[slot].pin();
        if let Some(s) = seen.get(matched)
            && s.generation == generation
        {
            return match &s.found {
                Some(found) => {
                    memo_put(self.id, generation, slot, path, found);
                    Some(Arc::clone(found))
                }
                None => {
                    none(&self.table.read());
                    None
                }
            };
        }
        let table = self.table.read();
        // Under the read lock the generation is the table's.
        let generation = self.generation.load(Ordering::Acquire);
        let found = find(&table);
        if seen.len() < MAX_SEEN || seen.contains_key(matched) {
            let found = found.clone();
            seen.insert(Box::from(matched), Seen { generation, found });
        }
        match &found {
            Some(found) => memo_put(self.id, generation, slot, path, found),
            None => none(&table),
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

/// A route's `RateLimit-Policy` value, made from a `'static` string: a response clones it
/// for free, where a value made from a `String` costs two atomic operations per response, on
/// a count every core shares. Kept for the life of the process, once each (a reload that
/// changes no plan makes none), up to a bound past which values cost as before.
fn policy_value(items: String) -> HeaderValue {
    const MAX_KEPT_VALUES: usize = 1024;
    static KEPT: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let Ok(valid) = HeaderValue::try_from(items.as_str()) else {
        return HeaderValue::from_static("");
    };
    // Only a valid, ASCII value goes on: `from_static` would panic on any other (a value may
    // hold other UTF-8 bytes, which `try_from` takes).
    if !items.is_ascii() {
        return valid;
    }
    let mut kept = KEPT.lock();
    let value: &'static str = match kept.iter().find(|k| **k == items) {
        Some(k) => k,
        None if kept.len() >= MAX_KEPT_VALUES => return valid,
        None => {
            let k: &'static str = Box::leak(items.into_boxed_str());
            kept.push(k);
            k
        }
    };
    HeaderValue::from_static(value)
}

/// `X-RateLimit-{name}-Remaining`, as a name made from a `'static` string: a response clones
/// it for free (a name made from a `String` costs two atomic operations per response, on a
/// count every core shares). Names other than `api` and `entity` are kept for the life of the
/// process, once each, however often a route naming them is built: a policy file holds a few.
fn remaining_name(name: &str) -> HeaderName {
    const MAX_KEPT_NAMES: usize = 1024;
    static KEPT: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let fallback = || HeaderName::from_static("x-ratelimit-remaining");
    let lower = format!("x-ratelimit-{}-remaining", name.to_ascii_lowercase());
    // Only a valid, lower-case name goes on: `from_static` would panic on any other.
    let valid = match HeaderName::try_from(lower.as_str()) {
        Ok(valid) if valid.as_str() == lower => valid,
        _ => return fallback(),
    };
    let mut kept = KEPT.lock();
    let name: &'static str = match kept.iter().find(|k| **k == lower) {
        Some(k) => k,
        // Bounded all the same, should names keep changing: past it, names cost as before.
        None if kept.len() >= MAX_KEPT_NAMES => return valid,
        None => {
            let k: &'static str = Box::leak(lower.into_boxed_str());
            kept.push(k);
            k
        }
    };
    HeaderName::from_static(name)
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
        segment: Option<Segment>,
    },
}

/// The segment of a route's pattern that a path parameter fills whole: its position among the
/// pattern's segments (past the leading `/`), and whether it is the last one (the path's part
/// after its last `/`, found without counting the others).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Segment {
    pub(crate) at: usize,
    pub(crate) last: bool,
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
    /// The start of its `RateLimit` item, `"name";r=`, made once.
    pub(crate) item: Box<[u8]>,
    /// The plan of its buckets: the limiter's own `Arc` when its policies hold the plan, or a
    /// shadow limit's twin.
    pub(crate) plan: Arc<Plan>,
    /// The plan's registry index, for the lease table's fast path.
    pub(crate) index: Option<u32>,
    /// What a token costs the plan's lease, when its takes may come from one
    /// ([`Limiter::lease_token_nanos`], and every key the limit makes fits the store:
    /// [`leasable`]): worked out here, not per request.
    pub(crate) lease_nanos: Option<u64>,
    /// The plan's counts in the lease's unit, for the reports of its lease takes.
    pub(crate) scale: Option<NanoScale>,
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
    /// Where the lease table last found [`key`](Self::key), for a limit whose key is fixed
    /// (`Hint`): its take skips the hash and the probe.
    pub(crate) hint: KeyHint,
}

/// A [`Limit`]'s [`Hint`]: written only by lookups of the limit's own fixed key. A clone
/// starts with none.
#[derive(Debug, Default)]
pub(crate) struct KeyHint(pub(crate) Hint);

impl Clone for KeyHint {
    fn clone(&self) -> Self {
        KeyHint::default()
    }
}

/// Whether a limit's takes may come from a lease, given the key it makes with its route
/// (`made`: a whole-route key, or an entity key's part before the id; `None` when not made
/// yet): every key it makes must have the shape the store takes (`key::made_keys_fit`). A
/// limit whose keys may not (a route pattern longer than a key may be) takes the full path,
/// which refuses such a key with its error, and the lease table never takes the key in.
fn leasable(scope: &Scope, made: Option<&str>) -> bool {
    let entity = matches!(scope, Scope::Entity { .. });
    made.is_none_or(|made| made_keys_fit(made, entity))
}

/// A code-built layer's route for one method and router pattern.
#[derive(Clone, Debug)]
pub(crate) struct CodeRoute {
    /// `METHOD:pattern`.
    pub(crate) endpoint: String,
    /// The method of the keys and the metric labels.
    pub(crate) method: &'static str,
    /// The route pattern.
    pub(crate) pattern: String,
    /// Per limit: the whole-route key (`ratelimit:api:{endpoint}`), or an entity key's part
    /// before the id, ending in `:`; `None` for a limit whose key is its own ([`Limit::key`]:
    /// a budget).
    pub(crate) keys: Box<[Option<String>]>,
    /// Per limit: the path segment its path parameter fills whole, if it does, in the router's
    /// own pattern (`MatchedPath`, which it matched against the whole path); `None` for every
    /// limit of a layer given its pattern (`route_pattern`), which may not be the whole path's.
    pub(crate) segments: Box<[Option<Segment>]>,
    /// Per limit: where the lease table last found its whole-route key.
    pub(crate) hints: Box<[KeyHint]>,
}

impl CodeRoute {
    /// The route of `limits` for `method` (`check::key_method`'s) and `pattern`: the layer's own
    /// ([`RouteLimits::pattern`]) or else the router's; and whether a limit there reads the
    /// request's parts (an application's key function, a path parameter that is not a whole
    /// segment).
    fn new(limits: &RouteLimits, method: &'static str, pattern: &str) -> (CodeRoute, bool) {
        let from_router = limits.pattern.is_none();
        let endpoint = format!("{method}:{pattern}");
        let mut needs_parts = false;
        let (mut keys, mut segments) = (Vec::new(), Vec::new());
        for limit in &limits.limits {
            let entity = matches!(limit.scope, Scope::Entity { .. });
            let key = limit
                .key
                .is_none()
                .then(|| endpoint_key(&limit.dynamic, &endpoint, entity));
            let segment = match &limit.scope {
                Scope::Entity { key, .. } => {
                    let segment = whole_segment(key, pattern).filter(|_| from_router);
                    needs_parts |= reads_parts(key, segment);
                    segment
                }
                Scope::Route => None,
            };
            keys.push(key);
            segments.push(segment);
        }
        let code = CodeRoute {
            hints: limits.limits.iter().map(|_| KeyHint::default()).collect(),
            endpoint,
            method,
            pattern: pattern.to_owned(),
            keys: keys.into(),
            segments: segments.into(),
        };
        (code, needs_parts)
    }
}

/// A limit's key made from its route's `endpoint` (`METHOD:pattern`) and `dynamic` (its kind and
/// name part, [`Limit::dynamic`]): `ratelimit:{kind}[:{name}]:{endpoint}`, the whole-route key,
/// followed by `:` for an `entity` limit's part before the id.
fn endpoint_key(
    dynamic: &(&'static str, Option<Arc<str>>),
    endpoint: &str,
    entity: bool,
) -> String {
    let (kind, name) = dynamic;
    let mut key = match name {
        None => format!("ratelimit:{kind}:{endpoint}"),
        Some(name) => format!("ratelimit:{kind}:{name}:{endpoint}"),
    };
    if entity {
        key.push(':');
    }
    key
}

/// The segment of `pattern` that `key`'s path parameter fills whole, if it has one and does.
fn whole_segment(key: &EntityKey, pattern: &str) -> Option<Segment> {
    let whole = format!("{{{}}}", key.path_param_name()?);
    let segments = pattern.trim_start_matches('/').split('/');
    let count = segments.clone().count();
    let at = segments.clone().position(|seg| seg == whole)?;
    Some(Segment {
        at,
        last: at + 1 == count,
    })
}

/// Whether `key`'s id is read from the request's parts: an application's key function's, or a
/// path parameter's that fills no whole segment (`segment`), from axum's path parameters.
fn reads_parts(key: &EntityKey, segment: Option<Segment>) -> bool {
    key.needs_parts() || (key.path_param_name().is_some() && segment.is_none())
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
///
/// Aligned to 128 bytes as [`Config`] is: every request of the route takes and drops a count of
/// its `Arc` and reads its fields.
#[derive(Clone, Debug)]
#[repr(align(128))]
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
    /// Whether a limit reads the request's parts themselves (axum's path parameters, an
    /// application's key function): the request is then split into them (`head.rs`). A
    /// code-built layer's is its pattern's ([`for_pattern`](Self::for_pattern)).
    pub(crate) needs_parts: bool,
    /// Whether its responses carry `X-RateLimit-{Name}-Remaining` (the policy file's
    /// `x_ratelimit_remaining`).
    pub(crate) x_ratelimit_remaining: bool,
    /// Which of its responses carry the fields (the policy file's `fields_on`).
    pub(crate) fields_on: FieldsOn,
    /// The limiter of the layer's [`Config`], and its give-backs: what a response's future
    /// needs to give tokens back when an inner layer refused, without holding the `Config`.
    pub(crate) limiter: Limiter,
    pub(crate) give_backs: Arc<GiveBacks>,
    /// A code-built layer's route for one method and router pattern, in that pattern's copy of
    /// the layer's limits ([`OneRoute`]); `None` for a policy file's route and for the layer's
    /// own limits.
    pub(crate) code: Option<CodeRoute>,
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
        give_backs: &Arc<GiveBacks>,
    ) -> RouteLimits {
        // A policy file's routes are checked for it; a layer built in code has two at most.
        debug_assert!(specs.len() <= crate::policy::MAX_ROUTE_LIMITS);
        let mut limits = Vec::with_capacity(specs.len());
        let mut items = Vec::with_capacity(specs.len());
        let mut needs_params = false;
        let mut needs_parts = false;
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
            let (key, dynamic) = match (&spec.budget, &spec.entity) {
                (Some(budget), _) => (
                    Some(format!("ratelimit:budget:{budget}:")),
                    ("entity", None),
                ),
                (None, entity) => {
                    let kind = if entity.is_some() { "entity" } else { "api" };
                    let dynamic = (kind, (spec.name != kind).then(|| Arc::clone(&name)));
                    let key = file
                        .as_ref()
                        .map(|f| endpoint_key(&dynamic, &f.endpoint, entity.is_some()));
                    (key, dynamic)
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
            let remaining = remaining_name(&name);
            let segment = match (&spec.entity, &file) {
                (Some(key), Some(file)) => whole_segment(key, &file.path),
                _ => None,
            };
            // A layer built in code has no pattern yet, so no `segment`: each pattern's copy of
            // its limits says whether they read the parts there (`for_pattern`).
            needs_parts |= spec
                .entity
                .as_ref()
                .is_some_and(|key| reads_parts(key, segment));
            let scope = match spec.entity {
                None => Scope::Route,
                Some(key) => Scope::Entity {
                    key,
                    param,
                    segment,
                },
            };
            let item = format!("\"{name}\";r=").into_bytes().into_boxed_slice();
            limits.push(Limit {
                item,
                name,
                scale: NanoScale::of(&plan),
                lease_nanos: Limiter::lease_token_nanos(&plan)
                    .filter(|_| leasable(&scope, key.as_deref())),
                plan,
                index,
                scope,
                shadow: spec.shadow,
                remaining,
                key,
                dynamic,
                counters,
                refused: Arc::new(Refused::default()),
                hint: KeyHint::default(),
            });
        }
        let policy = policy_value(items.join(", "));
        RouteLimits {
            limits,
            pattern,
            file,
            policy,
            needs_params,
            needs_parts,
            x_ratelimit_remaining: false,
            fields_on: FieldsOn::EveryResponse,
            limiter: limiter.clone(),
            give_backs: Arc::clone(give_backs),
            code: None,
        }
    }

    /// A code-built layer's limits as a request with `method` (`check::key_method`'s) and
    /// `pattern` uses them: a copy with the pattern's [`CodeRoute`], reading the request's
    /// parts only when a limit does there. The copy shares each limit's memory of refused keys;
    /// its hints start empty.
    pub(crate) fn for_pattern(&self, method: &'static str, pattern: &str) -> RouteLimits {
        let (code, needs_parts) = CodeRoute::new(self, method, pattern);
        let mut copy = RouteLimits {
            needs_parts,
            ..self.clone()
        };
        for (limit, made) in copy.limits.iter_mut().zip(code.keys.iter()) {
            if !leasable(&limit.scope, made.as_deref()) {
                limit.lease_nanos = None;
            }
        }
        copy.code = Some(code);
        copy
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.limits.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The objects every request counts (their `Arc`'s strong count, the first 8 bytes of its
    /// allocation) start their fields 128 bytes in, off the count's line and its pair.
    #[test]
    fn a_counted_object_keeps_its_fields_off_its_count_lines() {
        assert!(std::mem::align_of::<Config>() >= 128);
        assert!(std::mem::align_of::<RouteLimits>() >= 128);
    }
}
