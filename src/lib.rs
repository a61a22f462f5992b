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

#[cfg(all(test, feature = "postgres"))]
mod assembled_tests;
#[cfg(all(test, feature = "postgres"))]
mod pool_tests;
#[cfg(test)]
mod tests;

pub use debt::OutageDebt;
pub use error::Error;
pub use lease::LeaseStats;
pub use limiter::{DecidedBy, Decision, Limiter, ReloadError};

/// The README's Rust blocks, compiled as doc tests (`cargo test --doc --all-features`).
#[cfg(all(doctest, feature = "postgres", feature = "http"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
