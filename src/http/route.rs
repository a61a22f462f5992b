//! The configuration a layer builds and its services read: which limits apply to a request
//! ([`Routes`]), each route's plans, header values and metric handles ([`RouteLimits`],
//! [`FileRoute`]), and what every service of one layer shares ([`Config`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use axum::http::HeaderValue;
use metrics::Counter;
use parking_lot::RwLock;

use super::headers::{LayerKind, policy_item};
use super::key::{EntityKey, TrustedProxies};
use crate::Limiter;
use crate::metrics::{HTTP_CHECKED, HTTP_DENIED, HTTP_ERRORS, HTTP_UNMATCHED, HTTP_WOULD_DENY};
use crate::policy::{Plan, RouteShadow, route_params};

/// Everything the service needs, shared by all clones.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) limiter: Limiter,
    pub(crate) routes: Routes,
    pub(crate) trusted: TrustedProxies,
}

/// Which limits apply to a request.
#[derive(Clone, Debug)]
pub(crate) enum Routes {
    /// From a policy file: by method and route shape (`METHOD:shape`, the shape of the pattern
    /// in axum's `MatchedPath`, so parameter names need not agree), and every route in file
    /// order for finding the route a request that matched none should have matched.
    ///
    /// Behind a lock so that [`RateLimitLayer::reload`](super::RateLimitLayer::reload) swaps the whole table at once: a
    /// request reads the table it started with (a read lock and a reference count, then no
    /// lock while it awaits its decisions).
    Table(Arc<RwLock<Arc<RouteTable>>>),
    /// One route's limits, for every request the layer sees.
    One(Arc<RouteLimits>),
}

/// A policy file's routes as the layer looks them up.
#[derive(Debug)]
pub(crate) struct RouteTable {
    /// By `METHOD:shape`.
    pub(crate) by_shape: HashMap<String, Arc<RouteLimits>>,
    /// In file order.
    pub(crate) all: Vec<Arc<RouteLimits>>,
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
    /// Its parameter names, in order: a router pattern of the same shape may name them
    /// differently, and they are renamed by position.
    pub(crate) params: Vec<String>,
    /// `tokenlease_http_checked_total` of this route.
    pub(crate) checked: Counter,
    /// `tokenlease_http_unmatched_total` of this route.
    pub(crate) unmatched: Counter,
    /// `tokenlease_http_denied_total`, api then entity layer (a no-op handle for a layer the
    /// route does not have, so it has no series).
    pub(crate) denied: [Counter; 2],
    /// `tokenlease_http_errors_total`, as `denied`.
    pub(crate) errors: [Counter; 2],
    /// `tokenlease_http_would_deny_total`, as `denied`.
    pub(crate) would_deny: [Counter; 2],
    /// Whether the warning about a request that should have matched this route was logged.
    pub(crate) warned: AtomicBool,
}

impl FileRoute {
    pub(crate) fn new(method: &str, path: &str, api: bool, entity: bool) -> FileRoute {
        let labels = |extra: Option<&'static str>| {
            let mut l = vec![
                metrics::Label::new("method", method.to_owned()),
                metrics::Label::new("route", path.to_owned()),
            ];
            if let Some(layer) = extra {
                l.push(metrics::Label::new("layer", layer));
            }
            l
        };
        let zero = |c: Counter| {
            // Present at zero from the start, before any request.
            c.increment(0);
            c
        };
        let layer = |name: &'static str, kind: &'static str, present: bool| {
            if present {
                zero(metrics::counter!(name, labels(Some(kind))))
            } else {
                Counter::noop()
            }
        };
        FileRoute {
            method: method.to_owned(),
            path: path.to_owned(),
            params: route_params(path).unwrap_or_default(),
            checked: zero(metrics::counter!(HTTP_CHECKED, labels(None))),
            unmatched: zero(metrics::counter!(HTTP_UNMATCHED, labels(None))),
            denied: [
                layer(HTTP_DENIED, "api", api),
                layer(HTTP_DENIED, "entity", entity),
            ],
            errors: [
                layer(HTTP_ERRORS, "api", api),
                layer(HTTP_ERRORS, "entity", entity),
            ],
            would_deny: [
                layer(HTTP_WOULD_DENY, "api", api),
                layer(HTTP_WOULD_DENY, "entity", entity),
            ],
            warned: AtomicBool::new(false),
        }
    }
}

/// The limits of one route.
#[derive(Clone, Debug)]
pub(crate) struct RouteLimits {
    pub(crate) global: Option<Arc<Plan>>,
    pub(crate) entity: Option<(EntityKey, Arc<Plan>)>,
    /// For an entity layer shared across routes ([`RouteLimitLayer::entity_budget`](super::RouteLimitLayer::entity_budget)): the
    /// budget's name, keyed `ratelimit:budget:{name}:{id}` instead of per endpoint.
    pub(crate) budget: Option<Arc<str>>,
    /// The route pattern when not taken from axum's `MatchedPath`.
    pub(crate) pattern: Option<String>,
    /// The policy file's route, for a layer built from one.
    pub(crate) file: Option<Arc<FileRoute>>,
    /// `RateLimit-Policy`, precomputed.
    pub(crate) policy: HeaderValue,
    /// The layers in shadow mode.
    pub(crate) shadow: RouteShadow,
}

impl RouteLimits {
    /// The limits of a route with `global` and `entity`, the layers named in `shadow` in
    /// shadow mode.
    ///
    /// A shadow layer decides with its plan's shadow twin (`plan.clone().with_shadow(true)`):
    /// its refusals let the request through as the layer's do, are counted as
    /// `outcome="would_deny"` in `tokenlease_decisions_total` (registered at zero now in
    /// `limiter`'s plan registry, with the recorder installed now), never as `denied`, and its
    /// buckets are the twin's own ([`Plan::store_key`]).
    pub(crate) fn new(
        global: Option<Arc<Plan>>,
        entity: Option<(EntityKey, Arc<Plan>)>,
        pattern: Option<String>,
        shadow: RouteShadow,
        limiter: &Limiter,
    ) -> RouteLimits {
        let twin = |plan: Arc<Plan>, on: bool| {
            if on && !plan.shadow() {
                let twin = Arc::new((*plan).clone().with_shadow(true));
                limiter.register_plan(&twin);
                twin
            } else {
                plan
            }
        };
        let global = global.map(|plan| twin(plan, shadow.api));
        let entity = entity.map(|(key, plan)| (key, twin(plan, shadow.entity)));
        let mut items = Vec::new();
        if let Some(plan) = &global {
            items.push(policy_item(LayerKind::Api, plan));
        }
        if let Some((_, plan)) = &entity {
            items.push(policy_item(LayerKind::Entity, plan));
        }
        let policy = HeaderValue::try_from(items.join(", "))
            .unwrap_or_else(|_| HeaderValue::from_static(""));
        RouteLimits {
            global,
            entity,
            budget: None,
            pattern,
            file: None,
            policy,
            shadow,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.global.is_none() && self.entity.is_none()
    }
}
