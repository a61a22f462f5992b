//! Distributed rate limiting with token leases over PostgreSQL.
//!
//! `tokenlease` keeps one token bucket per key in a PostgreSQL table and decides with the
//! database's own clock, so any number of service instances share one limit. In leased mode each
//! process reserves batches of tokens with one statement and spends them from memory with one
//! compare-and-swap, so the database sees about one statement per lease instead of one per
//! request. See `DESIGN.md` for the algorithm, the SQL, the overshoot bound and the failure
//! behaviour.
//!
//! # Parameters
//!
//! - **capacity**: the most tokens a bucket holds, i.e. the largest burst.
//! - **refill**: tokens added per second, up to the capacity.
//! - **lease** (optional, per plan): leased mode. A lease holds about one refresh interval of the
//!   key's demand, at most `max_fraction × capacity`; with `N` instances, any window of length
//!   `w` admits at most `capacity + refill × w + N × max_fraction × capacity`.
//! - **fallback**: who decides while the database is slow or down: allow, deny, or a local
//!   bucket holding `1 / instances` of the limit.
//!
//! # Features
//!
//! | feature | default | adds |
//! |---|---|---|
//! | `postgres` | yes | `store::PostgresStore`: the shared store, its pool and migrations (tokio-postgres, bb8) |
//! | `http` | no | the `http` module: the tower layer for axum 0.8 |
//!
//! With `default-features = false` the crate is the limiter over [`store::MemoryStore`] alone.
//! The README has the crate counts each set compiles. The repository's two other crates are
//! not needed to use this one: `tokenlease-testkit` (throwaway PostgreSQL and Citus clusters and
//! a fault proxy, for tests) and `tokenlease-cli` (the `tokenlease` command).
//!
//! # Layout
//!
//! `docs/api.md` in the repository (and the package) maps every public item to what it is for
//! and the feature that brings it, in one page. The modules:
//!
//! - [`bucket`]: the pure token bucket (no I/O, no clock, no async).
//! - [`policy`]: the JSON policy file, validated into [`policy::Policies`].
//! - [`store`]: the [`store::Store`] contract, `store::PostgresStore` (feature `postgres`; one
//!   atomic statement per call), [`store::MemoryStore`], and the circuit breaker.
//! - [`limiter`]: [`Limiter::try_acquire`], the entry point, in direct and leased mode; its
//!   answer, [`Decision`], and the lease counters, [`LeaseStats`].
//! - `http` (feature `http`): the tower layer with a global and an entity limit per route.
//! - [`metrics`]: metric names and `describe()`.
//! - [`clock`]: the clocks local state reads.

#![forbid(unsafe_code)]

pub mod bucket;
pub mod clock;
mod debt;
mod decision;
pub mod error;
mod fallback;
#[cfg(feature = "http")]
pub mod http;
mod key;
mod lease;
pub mod limiter;
pub mod metrics;
mod plans;
pub mod policy;
mod report;
pub mod store;

pub use debt::OutageDebt;
pub use error::Error;
pub use lease::LeaseStats;
pub use limiter::{DecidedBy, Decision, Limiter, ReloadError};

/// Not part of the API: no semver promise, may change in any release.
///
/// What the crate's own integration tests and benchmarks reach that a user has no use for:
/// the SQL text the store sends (benchmarks that run it through pgbench), a limiter's plan
/// count (reload tests), the migration list
/// and lock (tests that migrate on their own terms), the store's bb8 pool (tests that run
/// their own SQL on the store's sessions), and the password-hiding and cause-chain text the
/// library's messages use (which the `tokenlease` binary shares). Kept out of the documented
/// modules so that the API's types do not depend on bb8 or on the migration bookkeeping.
#[doc(hidden)]
pub mod __private {
    pub use crate::report::{chain, redact};

    /// How many distinct plans `limiter` has been given over its life (its plan registry).
    pub fn limiter_plans(limiter: &crate::Limiter) -> usize {
        limiter.registered_plans()
    }

    /// Waits until `limiter`'s lease actor is idle (no statement in flight, no give-back to
    /// send again, no refill asked for and not yet sent); at once when no actor runs. Tests
    /// await this rather than sleep.
    pub async fn lease_actor_idle(limiter: &crate::Limiter) {
        limiter.lease_actor_idle().await;
    }
    #[cfg(feature = "postgres")]
    pub use crate::store::postgres::migrate::{
        MIGRATION_LOCK_ID, MIGRATIONS, MIGRATIONS_TABLE, migrate_with,
    };
    #[cfg(feature = "postgres")]
    pub use crate::store::postgres::{
        ConnectionManager, PgConnection, SUPPORTED_CITUS, acquire_held_sql, acquire_many_sql,
        acquire_one_sql, citus_hashtext, pool,
    };
}

/// The README's Rust blocks, compiled as doc tests (`cargo test --doc --all-features`).
#[cfg(all(doctest, feature = "postgres", feature = "http"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
