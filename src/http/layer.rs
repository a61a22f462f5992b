//! [`RateLimitLayer`]: the configuration, built from a policy file or route by route.

use std::collections::HashMap;
use std::sync::Arc;

use tower::Layer;

use super::key::{EntityKey, TrustedProxies};
use super::refund::GiveBacks;
use super::route::{
    Config, FileRoute, LimitSpec, OneRoute, RouteLimits, RouteTable, Routes, TableCell,
};
use super::service::RateLimit;
use crate::policy::error::RouteConfigError;
use crate::policy::{
    EntitySource, FieldsOn, Plan, Policies, RouteShadow, route_pattern_error, route_shape,
};
use crate::{Limiter, ReloadError};

/// A tower [`Layer`] that rate-limits every route of a policy file with the limits the route
/// lists, checked in order: buckets for the whole endpoint, per entity of the endpoint, and
/// per entity across the routes sharing a budget.
///
/// Build it from the `routes` of a policy file with [`from_policies`](Self::from_policies) and
/// apply it once with axum's `Router::route_layer`. For one route's limits set in code, use
/// [`RouteLimitLayer`] on that route instead. See the [module docs](super) for the keys, the
/// order of the checks and the response header fields.
#[derive(Clone, Debug)]
#[must_use = "a layer limits nothing until it is applied to a router or service"]
pub struct RateLimitLayer {
    config: Arc<Config>,
}

/// A tower [`Layer`] with the limits of one route, set in code: a global bucket
/// ([`global`](Self::global)), a bucket per entity ([`entity`](Self::entity)), or both.
///
/// Apply it to that route only (in axum, on its `MethodRouter` or with `route_layer` on a
/// router holding just that route). The keys, the order of the checks and the response header
/// fields are those of [`RateLimitLayer`] (see the [module docs](super)).
#[derive(Clone, Debug)]
#[must_use = "a layer limits nothing until it is applied to a router or service"]
pub struct RouteLimitLayer {
    config: Arc<Config>,
    /// The route's limits as the builder methods gave them; the route's [`RouteLimits`] are
    /// built from them again at each change.
    given: Given,
}

/// A [`RouteLimitLayer`]'s limits as given.
#[derive(Clone, Debug, Default)]
struct Given {
    global: Option<Arc<Plan>>,
    entity: Option<(EntityKey, Arc<Plan>)>,
    /// The budget the entity layer's buckets are shared under ([`RouteLimitLayer::entity_budget`]).
    budget: Option<Arc<str>>,
    pattern: Option<String>,
    shadow: RouteShadow,
}

impl RateLimitLayer {
    /// A layer for every route of `policies` (its `routes` list), matched by method and the
    /// shape of the route pattern axum matched (`MatchedPath`): the pattern with its parameter
    /// names left out, so a file's `/items/{id}` limits a router's `/items/{itemId}` (the bucket
    /// keys and metric labels use the file's pattern, and the file's parameter names find the
    /// router's parameters by position). Apply it once with `Router::route_layer`; requests to
    /// routes not in the file pass untouched.
    ///
    /// A request that matched no file route although its path fits one of its method (the
    /// router matched it under another pattern, say a nested router's full path, or the layer
    /// sits where axum gives no `MatchedPath`) passes unlimited too, but is counted in
    /// `tokenlease_http_unmatched_total` under that route, and the first such request of each
    /// route logs a `tracing` warning.
    ///
    /// Call it after installing the `metrics` recorder: it registers every route's series
    /// (at zero) with the recorder installed then.
    ///
    /// # Errors
    ///
    /// [`RouteConfigError`] for a route naming an unknown plan or an invalid header name.
    pub fn from_policies(policies: &Policies, limiter: Limiter) -> Result<Self, RouteConfigError> {
        let give_backs = Arc::default();
        let table = route_table(policies, &limiter, &give_backs)?;
        Ok(RateLimitLayer {
            config: Arc::new(Config {
                limiter,
                routes: Routes::Table(Arc::new(TableCell::new(table))),
                trusted: TrustedProxies::none(),
                give_backs,
                x_ratelimit_remaining: false,
                fields_on: None,
            }),
        })
    }

    /// Swaps in `policies` while requests are in flight: the limiter's plans
    /// ([`Limiter::reload`]) and then this layer's routes (and those of every service made
    /// from it or its clones). A request already past its route lookup finishes under the
    /// routes it found; no request fails or waits because of a reload.
    ///
    /// Check the file first (`tokenlease check`, or [`Policies::from_file`], which refuses
    /// an invalid one): this refuses only what the layer or the limiter cannot use, and then
    /// changes nothing.
    ///
    /// # Errors
    ///
    /// [`ReloadError::Route`] for routes [`from_policies`](Self::from_policies) would refuse,
    /// and as [`Limiter::reload`]; the old routes and plans stay.
    pub fn reload(&self, policies: Policies) -> Result<(), ReloadError> {
        let Routes::Table(cell) = &self.config.routes else {
            // Only `from_policies` makes a `RateLimitLayer`.
            return Ok(());
        };
        // Checked before anything changes; built again from the limiter's copy, whose plans
        // are the ones its lease table knows.
        let config = &self.config;
        if let Err(e) = route_table(&policies, &config.limiter, &config.give_backs) {
            crate::metrics::record_reload(false);
            return Err(e.into());
        }
        let policies = self.config.limiter.reload(policies)?;
        cell.swap(route_table(&policies, &config.limiter, &config.give_backs)?);
        Ok(())
    }
}

/// The route table of `policies`, for a layer deciding with `limiter`.
fn route_table(
    policies: &Policies,
    limiter: &Limiter,
    give_backs: &Arc<GiveBacks>,
) -> Result<RouteTable, RouteConfigError> {
    let mut by_shape = HashMap::new();
    let mut all = Vec::new();
    let mut gives_back = false;
    for route in policies.routes() {
        let endpoint = route.endpoint();
        let mut specs = Vec::with_capacity(route.limits.len());
        for limit in &route.limits {
            let plan = policies.plan(&limit.plan).cloned().ok_or_else(|| {
                RouteConfigError::UnknownPlan {
                    endpoint: endpoint.clone(),
                    plan: limit.plan.clone(),
                }
            })?;
            let entity = match &limit.source {
                None => None,
                Some(EntitySource::PathParam(name)) => Some(EntityKey::path_param(name.clone())),
                Some(EntitySource::Header(name)) => {
                    match axum::http::HeaderName::try_from(name.as_str()) {
                        Ok(header) => Some(EntityKey::header(header)),
                        Err(_) => {
                            return Err(RouteConfigError::InvalidHeader {
                                endpoint,
                                header: name.clone(),
                            });
                        }
                    }
                }
                Some(EntitySource::ClientIp) => Some(EntityKey::client_ip()),
            };
            specs.push(LimitSpec {
                name: limit.name.clone(),
                plan,
                entity,
                budget: limit.budget.clone(),
                shadow: limit.shadow,
            });
        }
        gives_back |= specs.len() > 1;
        let file = Arc::new(FileRoute::new(&route.method, &route.path));
        let mut limits = RouteLimits::new(specs, None, Some(file), limiter, give_backs);
        limits.x_ratelimit_remaining = policies.x_ratelimit_remaining();
        limits.fields_on = policies.fields_on();
        let limits = Arc::new(limits);
        // The file refuses two routes of one method and shape, and patterns it cannot parse.
        let shape = route_shape(&route.path).unwrap_or_else(|| route.path.clone());
        by_shape.insert(format!("{}:{shape}", route.method), Arc::clone(&limits));
        all.push(limits);
    }
    // A route with more than one limit gives tokens back on a later limit's refusal: each
    // result's series at zero from the start, with the recorder installed now.
    if gives_back {
        super::refund::register_at_zero();
    }
    Ok(RouteTable::new(by_shape, all))
}

impl RateLimitLayer {
    /// The proxies whose `X-Forwarded-For` is believed for [`EntityKey::client_ip`]. By default
    /// none: the peer address is the client.
    pub fn trusted_proxies(mut self, trusted: TrustedProxies) -> Self {
        Arc::make_mut(&mut self.config).trusted = trusted;
        self
    }

    /// Also writes the legacy `X-RateLimit-{Name}-Remaining` field of each limit on every
    /// response (`RateLimit` carries the same counts), on every route whatever the policy
    /// file says; without it, on the routes of a file with `"x_ratelimit_remaining": true`
    /// only. Off by default: two more fields per response cost about as much as a limit's
    /// check.
    pub fn x_ratelimit_remaining(mut self, on: bool) -> Self {
        Arc::make_mut(&mut self.config).x_ratelimit_remaining = on;
        self
    }

    /// Which responses carry the layer's header fields, on every route whatever the policy
    /// file says; without it, what the file's `fields_on` says (every response unless given).
    /// [`FieldsOn::Refusals`] leaves admitted responses as the inner service made them, as
    /// `tower_governor` does by default: about a quarter of the layer's time per admitted
    /// request (benches/README.md).
    pub fn fields_on(mut self, on: FieldsOn) -> Self {
        Arc::make_mut(&mut self.config).fields_on = Some(on);
        self
    }

    /// The limiter the layer decides with.
    pub fn limiter(&self) -> &Limiter {
        &self.config.limiter
    }
}

impl RouteLimitLayer {
    /// A layer for one route with no limits yet: add them with [`global`](Self::global) and
    /// [`entity`](Self::entity).
    pub fn new(limiter: Limiter) -> Self {
        let give_backs = Arc::default();
        let limits = RouteLimits::new(Vec::new(), None, None, &limiter, &give_backs);
        RouteLimitLayer {
            config: Arc::new(Config {
                limiter,
                routes: Routes::One(Box::new(OneRoute::new(limits))),
                trusted: TrustedProxies::none(),
                give_backs,
                x_ratelimit_remaining: false,
                fields_on: None,
            }),
            given: Given::default(),
        }
    }

    /// Limits the whole route (all callers together) with one bucket under `plan`, keyed
    /// `ratelimit:api:{METHOD}:{route pattern}`.
    ///
    /// `{METHOD}` is one of a fixed set, whatever the client sends: `GET` (for `HEAD` too),
    /// `POST`, `PUT`, `DELETE`, `PATCH`, `OPTIONS`, `TRACE`, `CONNECT`, and `OTHER` for every
    /// other method string, so a client cannot get a fresh bucket by inventing a method.
    pub fn global(self, plan: Arc<Plan>) -> Self {
        self.edit_route(|given| given.global = Some(plan))
    }

    /// Limits each entity of the route with its own bucket under `plan`, keyed
    /// `ratelimit:entity:{METHOD}:{route pattern}:{id}`, the id found by `key`.
    pub fn entity(self, key: EntityKey, plan: Arc<Plan>) -> Self {
        self.edit_route(|given| {
            given.entity = Some((key, plan));
            given.budget = None;
        })
    }

    /// Limits each entity with one bucket under `plan` for every route whose layer names the
    /// same `budget`, keyed `ratelimit:budget:{budget}:{id}` (no method, no route pattern): one
    /// budget per customer across all endpoints. Instead of [`entity`](Self::entity) (the
    /// last of the two called is the route's entity layer).
    ///
    /// Give the same layer (or layers with the same budget name and plan) to every route the
    /// budget covers, for example with axum's `Router::route_layer` on a router holding them
    /// all. Everything else is the entity layer's: the id is read first (a malformed one is
    /// refused with `400`), the global layer, when the route has one, is checked before it and
    /// gets its token back on a denial, the header fields name it `"entity"`, and a denial is a
    /// `429` whose body names the route's endpoint.
    ///
    /// ```no_run
    /// # fn demo(limiter: tokenlease::Limiter, per_customer: std::sync::Arc<tokenlease::policy::Plan>)
    /// # -> Result<(), tokenlease::http::RouteConfigError> {
    /// use axum::{Router, http::HeaderName, routing::{get, post}};
    /// use tokenlease::http::{EntityKey, RouteLimitLayer};
    ///
    /// let api_key = EntityKey::header(HeaderName::from_static("x-api-key"));
    /// let app: Router = Router::new()
    ///     .route("/bookings", get(|| async { "list" }))
    ///     .route("/bookings/{bookingId}", get(|| async { "one" }).post(|| async { "changed" }))
    ///     .route_layer(
    ///         RouteLimitLayer::new(limiter).entity_budget("customer", api_key, per_customer)?,
    ///     );
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`RouteConfigError::InvalidBudget`] for a name that is not 1 to 64 of `A-Z a-z 0-9 _ .
    /// -`: a colon in it could make two budgets' keys the same.
    pub fn entity_budget(
        self,
        budget: &str,
        key: EntityKey,
        plan: Arc<Plan>,
    ) -> Result<Self, RouteConfigError> {
        let plain = (1..=64).contains(&budget.len())
            && budget
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if !plain {
            return Err(RouteConfigError::InvalidBudget {
                budget: budget.chars().take(100).collect(),
            });
        }
        let budget: Arc<str> = Arc::from(budget);
        Ok(self.edit_route(|given| {
            given.entity = Some((key, plan));
            given.budget = Some(budget);
        }))
    }

    /// Puts the route's layers named in `shadow` in shadow mode: they decide and count as
    /// usual, and a denial lets the request through with the rate-limit header fields it would
    /// have carried (no `Retry-After`, no problem body), counted in
    /// `tokenlease_http_would_deny_total`, and as `outcome="would_deny"` (never `denied`) in
    /// the plan's `tokenlease_decisions_total`. A shadow layer decides with its plan's shadow
    /// twin, whose buckets are its own ([`Plan::with_shadow`]).
    pub fn shadow(self, shadow: RouteShadow) -> Self {
        self.edit_route(|given| given.shadow = shadow)
    }

    /// The route pattern for the keys (and for finding path parameters), for services without
    /// axum's router (plain hyper, tonic). Without it the pattern is axum's `MatchedPath`, and a
    /// request without one passes unlimited.
    ///
    /// # Errors
    ///
    /// [`RouteConfigError::InvalidPattern`] for a pattern in the older `:name` / `*name` syntax
    /// (or otherwise not an axum 0.8 pattern), which would never match as meant: axum itself
    /// refuses such a route when it is added. The reason names the segment and how to write it.
    pub fn route_pattern(self, pattern: impl Into<String>) -> Result<Self, RouteConfigError> {
        let pattern = pattern.into();
        if let Some(reason) = route_pattern_error(&pattern) {
            return Err(RouteConfigError::InvalidPattern {
                pattern: pattern.chars().take(100).collect(),
                reason,
            });
        }
        Ok(self.edit_route(|given| given.pattern = Some(pattern)))
    }

    /// The proxies whose `X-Forwarded-For` is believed for [`EntityKey::client_ip`]. By default
    /// none: the peer address is the client.
    pub fn trusted_proxies(mut self, trusted: TrustedProxies) -> Self {
        Arc::make_mut(&mut self.config).trusted = trusted;
        self
    }

    /// The limiter the layer decides with.
    pub fn limiter(&self) -> &Limiter {
        &self.config.limiter
    }

    /// Also writes the legacy `X-RateLimit-{Name}-Remaining` field of each limit on every
    /// response (`RateLimit` carries the same counts). Off by default.
    pub fn x_ratelimit_remaining(mut self, on: bool) -> Self {
        Arc::make_mut(&mut self.config).x_ratelimit_remaining = on;
        self
    }

    /// Which responses carry the layer's header fields: every response (the default) or
    /// only the refusals ([`FieldsOn::Refusals`], as `tower_governor` does by default).
    pub fn fields_on(mut self, on: FieldsOn) -> Self {
        Arc::make_mut(&mut self.config).fields_on = Some(on);
        self
    }

    /// Changes the limits as given with `f`, and builds the route's limits from them again.
    fn edit_route(mut self, f: impl FnOnce(&mut Given)) -> Self {
        f(&mut self.given);
        let g = &self.given;
        let mut specs = Vec::with_capacity(2);
        if let Some(plan) = &g.global {
            specs.push(LimitSpec {
                name: "api".to_owned(),
                plan: Arc::clone(plan),
                entity: None,
                budget: None,
                shadow: g.shadow.api,
            });
        }
        if let Some((key, plan)) = &g.entity {
            specs.push(LimitSpec {
                name: g.budget.as_deref().unwrap_or("entity").to_owned(),
                plan: Arc::clone(plan),
                entity: Some(key.clone()),
                budget: g.budget.as_deref().map(str::to_owned),
                shadow: g.shadow.entity,
            });
        }
        if specs.len() > 1 {
            super::refund::register_at_zero();
        }
        let config = &self.config;
        let limits = RouteLimits::new(
            specs,
            g.pattern.clone(),
            None,
            &config.limiter,
            &config.give_backs,
        );
        // Only `new` makes a `RouteLimitLayer`, always with one route.
        if let Routes::One(route) = &mut Arc::make_mut(&mut self.config).routes {
            **route = OneRoute::new(limits);
        }
        self
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, Arc::clone(&self.config))
    }
}

impl<S> Layer<S> for RouteLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, Arc::clone(&self.config))
    }
}
