//! The policy file: named plans (bucket shapes), key prefix rules and HTTP routes, read from
//! JSON and checked into [`Policies`].
//!
//! The full reference of every field, its default and the errors is in `docs/policy.md`; this
//! is the short version.
//!
//! # Parameters
//!
//! - **capacity**: the most tokens a bucket holds, so the largest burst. A whole number ≥ 1.
//! - **refill**: how fast tokens come back, either `refill_per_second` (a number, up to 10⁹,
//!   exact to 10⁻⁹) or `refill: { "tokens": N, "period_ms": P }` (N tokens every P ms, as in
//!   "150 per minute"). Exactly one of the two.
//! - **lease**: absent means direct mode, one SQL statement per call. Present (even `{}`) means
//!   leased mode: each process reserves batches of at most `max_fraction × capacity` tokens (at
//!   least one) for at most `ttl_ms` (10 ms to 10 minutes), and spends them from memory. See
//!   [`LeaseSettings`].
//! - **fallback**: what decides while the database is slow or down: `allow`, `deny`, or a
//!   `local` bucket sized for `instances` processes. See [`FallbackMode`].
//!
//! # Example
//!
//! ```
//! use tokenlease::policy::{EntitySource, Policies};
//!
//! let json = r#"{
//!   "plans": {
//!     "per-route":   { "capacity": 100, "refill_per_second": 50, "lease": {} },
//!     "per-booking": { "capacity": 150, "refill": { "tokens": 150, "period_ms": 60000 } }
//!   },
//!   "default_plan": "per-route",
//!   "keys": [ { "prefix": "ratelimit:entity:", "plan": "per-booking" } ],
//!   "routes": [ { "method": "GET", "path": "/bookings/{bookingId}", "global": "per-route",
//!                 "entity": { "path_param": "bookingId", "type": "booking",
//!                             "plan": "per-booking" } } ]
//! }"#;
//! let policies = Policies::from_json_str(json, None)?;
//! assert_eq!(policies.summary(), "<policy>: 2 plans, 1 route, 1 key rule");
//! let plan = policies.plan_for_key("ratelimit:entity:GET:/bookings/{bookingId}:123").unwrap();
//! assert_eq!(plan.name(), "per-booking");
//! assert_eq!(plan.rate().as_f64(), 2.5);
//! let route = &policies.routes()[0];
//! assert_eq!(route.endpoint(), "GET:/bookings/{bookingId}");
//! assert_eq!(route.entity.as_ref().unwrap().source, EntitySource::PathParam("bookingId".into()));
//! # Ok::<(), tokenlease::policy::PolicyError>(())
//! ```
//!
//! # Errors
//!
//! A file is refused with one [`PolicyError`] naming the file, the field (a JSON path such as
//! `plans.standard.capacity`) and, for syntax and type errors, the line and column:
//!
//! ```text
//! policy.json:3:17: plans.standard.capacity: invalid type: string "100", expected u64
//! policy.json: plans.standard.capacity: must be a whole number of tokens ≥ 1, got 0
//! ```
//!
//! Unknown fields are errors, not ignored settings, and so is a plan name defined twice (which
//! serde_json would otherwise resolve silently by keeping the last one).
//!
//! Values outside their documented ranges are refused too: a lease `ttl_ms` of 10 ms to 10
//! minutes, `max_wait_ms` up to a minute and never past `ttl_ms`, `max_fraction × capacity`
//! of at least one token, `instances` from 1 to 10,000 and at most the capacity (the table is
//! in `docs/policy.md`). Values quoted in messages are cut to 64 characters plus their length.
//! A policy is at most [`MAX_POLICY_BYTES`] (16 MiB) and defines at most [`MAX_PLANS`]
//! (65,528) plans, what one limiter can hold; loading is linear in its size.
//!
//! # Layout
//!
//! - `types.rs`: the validated [`Policies`], [`Plan`], [`LeaseSettings`], [`FallbackSettings`],
//!   [`Route`].
//! - `raw.rs`: the file as written (serde types).
//! - `load.rs`: reading and parsing a file into [`Policies`], and their lookups.
//! - `check.rs`: the checks of plans, leases and fallbacks, and the ranges they hold values to
//!   ([`MAX_CAPACITY`] among them); `routes.rs`: the checks of routes and their patterns.
//! - `error.rs`: [`PolicyError`] and the helpers that write its messages, and the HTTP layer's
//!   `RouteConfigError`.
//!
//! The limits the loader, the checks and the errors all quote, [`MAX_POLICY_BYTES`] and
//! [`MAX_PLANS`], are defined here.

mod check;
pub(crate) mod error;
mod limits;
mod load;
mod raw;
mod routes;
mod types;

pub use check::MAX_CAPACITY;
pub use error::{PolicyError, PolicyErrorKind};
pub use limits::MAX_ROUTE_LIMITS;
#[cfg(feature = "http")]
pub(crate) use routes::{route_params, route_pattern_error, route_shape};
pub use types::{
    Accounting, EntityRule, EntitySource, FallbackMode, FallbackSettings, FieldsOn, KeyRule,
    LeaseSettings, Plan, PlanBuilder, Policies, Route, RouteLimit, RouteShadow,
};

/// The largest policy file (or text) read: 16 MiB. A larger one is refused before it is read
/// whole. Real policies are a few kilobytes; the limit only bounds what a mistaken or hostile
/// file costs.
pub const MAX_POLICY_BYTES: u64 = 16 * 1024 * 1024;

/// The most plans a policy may define: what one limiter can hold at once (its plan registry
/// gives each distinct plan in force a 16-bit index that a key's record keeps). A file with more is refused with
/// [`PolicyErrorKind::TooManyPlans`].
pub const MAX_PLANS: usize = 65_528;
