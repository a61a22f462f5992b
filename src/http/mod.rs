//! The HTTP layer: every limit a route needs, checked in order, as a tower
//! [`Layer`](tower::Layer) for axum, tonic and hyper services.
//!
//! A policy file's route lists its limits (`limits`: the whole route, per entity, budgets
//! shared by several routes, each named; `docs/policy.md`); the two classic ones, which a
//! route written with `global` and `entity` has, are:
//!
//! - **Global**: one bucket per endpoint, keyed `ratelimit:api:{METHOD}:{route pattern}` with
//!   the matched route pattern (axum's `MatchedPath`), so `/bookings/1` and `/bookings/2`
//!   share it.
//! - **Entity**: one bucket per entity per endpoint, keyed
//!   `ratelimit:entity:{METHOD}:{route pattern}:{id}`, the id from a named path parameter, a
//!   header, the client IP or a closure ([`EntityKey`]). An id the store would refuse (over
//!   1 KiB, NUL) is replaced by `sha256:` and its digest.
//!
//! The entity ids are read first: a malformed one (a path parameter that is not UTF-8 once
//! percent-decoded; a header value that is not UTF-8, has surrounding whitespace or is sent
//! twice) is refused with `400 Bad Request` before any bucket is touched, never decoded
//! lossily or trimmed into another id. A key a limit remembers as refused (until its
//! `Retry-After`) is refused then, before any token is taken. Then each limit takes a token in
//! order, and the first refusal stops there: the limits before it get their tokens back (into
//! the lease in memory, else to the store in batches), so one abusive entity cannot drain the
//! endpoint, nor a refused booking its customer's budget. A request without an entity's id
//! skips that limit.
//!
//! # Example
//!
//! ```no_run
//! use axum::{Router, routing::get};
//! use tokenlease::Limiter;
//! use tokenlease::http::{RateLimitLayer, TrustedProxies};
//! use tokenlease::policy::Policies;
//! use tokenlease::store::MemoryStore;
//!
//! # fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let policies = Policies::from_file("examples/policies/demo.json")?;
//! let limiter = Limiter::builder(MemoryStore::new()).policies(policies.clone()).build();
//! // Every route listed in the file's "routes", by method and pattern:
//! let limits = RateLimitLayer::from_policies(&policies, limiter.clone())?
//!     .trusted_proxies(TrustedProxies::parse(["10.0.0.0/8"])?);
//! let app: Router = Router::new()
//!     .route("/bookings/{bookingId}", get(|| async { "booking" }))
//!     .route_layer(limits);
//!
//! // Or one route at a time, in code:
//! use tokenlease::http::{EntityKey, RouteLimitLayer};
//! let (global, entity) = (policies.plan("bookings-read").unwrap(), policies.plan("booking-read").unwrap());
//! let app: Router = Router::new().route(
//!     "/bookings/{bookingId}",
//!     get(|| async { "booking" }).route_layer(
//!         RouteLimitLayer::new(limiter)
//!             .global(global.clone())
//!             .entity(EntityKey::path_param("bookingId"), entity.clone()),
//!     ),
//! );
//! # Ok(()) }
//! ```
//!
//! Use `route_layer`, not `layer`: the pattern comes from axum's `MatchedPath`, which exists
//! only after routing. A layer from a policy file matches a route by method and shape (the
//! pattern without its parameter names, so the file's `/items/{id}` limits the router's
//! `/items/{itemId}`; keys use the file's pattern). A request the layer cannot match passes
//! unlimited; when its path fits a file route it is counted in
//! [`HTTP_UNMATCHED`](crate::metrics::HTTP_UNMATCHED) and the first one per route logs a
//! `tracing` warning. Patterns in the older `:id` syntax are refused when the file loads, and
//! by [`RouteLimitLayer::route_pattern`] with [`RouteConfigError::InvalidPattern`].
//!
//! `HEAD` is limited as the `GET` whose handler answers it: same buckets, keyed `GET:...`,
//! shared with `GET` (unless a policy file lists a `HEAD` route of its own).
//!
//! The client chooses the method, so it never chooses a bucket: a layer from a policy file
//! limits only the methods the file lists, and a [`RouteLimitLayer`] (say on an axum `any`
//! route) keys the standard methods by name and folds every other method string (`X0`, `get`,
//! `PURGE`) into one `OTHER` bucket per route, so the keys and the `method` metric label take
//! at most nine values.
//!
//! # Responses
//!
//! Every response of a limited route carries (or only the refusals, with
//! [`RateLimitLayer::fields_on`] and [`FieldsOn::Refusals`](crate::policy::FieldsOn::Refusals),
//! or the policy file's `"fields_on": "refusals"`), per limit that was checked (named as the
//! limit; a layer appends its items to an inner layer's):
//!
//! ```text
//! RateLimit-Policy: "api";q=100;w=2, "entity";q=20;w=60
//! RateLimit: "api";r=57;t=1, "entity";r=19;t=3
//! ```
//!
//! and, when asked for ([`RateLimitLayer::x_ratelimit_remaining`], or the policy file's
//! `"x_ratelimit_remaining": true`), the older field per limit with its `r`:
//!
//! ```text
//! X-RateLimit-Api-Remaining: 57
//! X-RateLimit-Entity-Remaining: 19
//! ```
//!
//! `q` is the capacity, `w` the seconds to refill from empty, `r` whole tokens left (never
//! above `q`, as [`Decision::remaining`](crate::Decision::remaining)), `t` the
//! seconds until the bucket is full (or, for the layer that denied, until the next request
//! fits). A layer decided by the `allow` or `deny` fallback, which knows nothing of the bucket
//! ([`Decision::remaining`](crate::Decision::remaining) is `None`), is left out of `RateLimit`
//! and of its `X-RateLimit-*-Remaining` field. A denial is `429 Too Many Requests` with `Retry-After` (whole seconds, rounded up,
//! at least 1) and an `application/problem+json` body naming the layer:
//!
//! ```json
//! {"type":"about:blank","title":"Too Many Requests","status":429,
//!  "detail":"rate limit of the entity layer exceeded for GET:/bookings/{bookingId}",
//!  "layer":"entity","endpoint":"GET:/bookings/{bookingId}","retry_after":24}
//! ```
//!
//! The layer never returns an error and never answers 500. When the store is slow or down the
//! plan's fallback decides; a denial by the `deny` fallback is `503` with the same fields.
//!
//! # Client IP and `X-Forwarded-For`
//!
//! [`EntityKey::client_ip`] uses the peer address unless the peer is one of the
//! [`TrustedProxies`]; only then is `X-Forwarded-For` read, right to left, and the first
//! address that is not a trusted proxy is the client ([`client_ip`]). Trusting the header from
//! anyone lets every client pick its own bucket.
//!
//! # Layout
//!
//! - `layer.rs`: [`RateLimitLayer`] (a policy file's routes), [`RouteLimitLayer`] (one route in
//!   code).
//! - `route.rs`: the configuration they build and the service reads: each route's limits.
//! - `service.rs`: [`RateLimit`], [`ResponseFuture`]; `check.rs`: the checks, in order.
//! - `refused.rs`: the keys a limit refused, answered from memory until their `retry_after`.
//! - `key.rs`: [`EntityKey`], [`TrustedProxies`], [`client_ip`].
//! - `headers.rs`: the header fields' names and values, and the problem body; `fields.rs`:
//!   writing them on a response.
//! - `unmatched.rs`: counting (and logging once) requests that fit a route but missed it.
//! - `refund.rs`: giving back what earlier limits took, into the lease or in batches.

mod check;
mod fields;
mod head;
mod headers;
mod key;
mod layer;
mod memo;
mod patterns;
mod refund;
mod refused;
mod route;
mod service;
mod unmatched;

pub use crate::policy::error::RouteConfigError;
pub use headers::{
    RATELIMIT, RATELIMIT_POLICY, X_RATELIMIT_API_REMAINING, X_RATELIMIT_ENTITY_REMAINING,
};
pub use key::{
    EntityKey, MAX_FORWARDED_BYTES, MAX_FORWARDED_HOPS, TrustedProxies, TrustedProxyError,
    client_ip,
};
pub use layer::{RateLimitLayer, RouteLimitLayer};
pub use service::{RateLimit, ResponseFuture};
