//! Distributed rate limiting with token leases over PostgreSQL.
//!
//! `tokenlease` keeps one token bucket per key in a PostgreSQL table and decides with the
//! database's own clock, so any number of service instances share one limit. In leased mode each
//! process reserves batches of tokens with one statement and spends them from memory with one
//! compare-and-swap, so the database sees about one statement per lease instead of one per
//! request. [DESIGN.md] maps the design (the layers, the invariants, the dependencies) and
//! indexes its documents under `docs/design/`: the algorithm, the SQL, the overshoot bound and
//! the failure behaviour.
//!
//! # Example
//!
//! A limit of 2 requests at once, refilled at 1 a second, per key. [`store::MemoryStore`] keeps
//! the buckets in this process; a service shares them across its instances with
//! `store::PostgresStore` instead (feature `postgres`, on by default), built with
//! `PostgresStore::connect(url).await?` and given to the same builder.
//!
//! ```
//! use tokenlease::Limiter;
//! use tokenlease::policy::Policies;
//! use tokenlease::store::MemoryStore;
//!
//! #[tokio::main(flavor = "current_thread")]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let policies = Policies::from_json_str(
//!         r#"{ "plans": { "api": { "capacity": 2, "refill_per_second": 1 } },
//!              "default_plan": "api" }"#,
//!         None,
//!     )?;
//!     let limiter = Limiter::builder(MemoryStore::new()).policies(policies).build();
//!
//!     assert!(limiter.try_acquire("customer:42", 1.0).await?.allowed);
//!     assert!(limiter.try_acquire("customer:42", 1.0).await?.allowed);
//!     let third = limiter.try_acquire("customer:42", 1.0).await?;
//!     assert!(!third.allowed); // the burst of 2 is spent: answer 429
//!     println!("retry after {:?}", third.retry_after);
//!     assert!(limiter.try_acquire("customer:7", 1.0).await?.allowed); // its own bucket
//!
//!     limiter.shutdown().await;
//!     Ok(())
//! }
//! ```
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
//! The policy file's every field, default and refusal: [docs/policy.md].
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
//! # Database roles
//!
//! A store built with migration on (the default) needs `CREATE` on the schema. A service that
//! runs as a role with only the grants it needs to decide builds its store with
//! `PostgresStoreBuilder::migrate(false)` and leaves migrating to the owner: [docs/roles.md]
//! has both roles' SQL.
//!
//! # Layout
//!
//! [docs/api.md] maps every public item to what it is for and the feature that brings it, in
//! one page. The modules:
//!
//! - [`bucket`]: the pure token bucket (no I/O, no clock, no async).
//! - [`policy`]: the JSON policy file, validated into [`policy::Policies`].
//! - [`store`]: the [`store::Store`] contract, `store::PostgresStore` (feature `postgres`; one
//!   atomic statement per call), [`store::MemoryStore`], and the circuit breaker.
//! - [`limiter`]: [`Limiter::try_acquire`], the entry point, in direct and leased mode; its
//!   answer, [`Decision`], and the lease counters, [`LeaseStats`].
//! - `http` (feature `http`): the tower layer with a global and an entity limit per route.
//! - [`metrics`]: metric names and `describe()`.
//! - [`clock`]: the wall clock the skew gauge reads, and the conversions of store times (the
//!   library times everything else on tokio's clock).
//!
//! The pages named here are in the package, and docs.rs shows them with its source:
//!
//! [DESIGN.md]: https://docs.rs/crate/tokenlease/latest/source/DESIGN.md
//! [docs/policy.md]: https://docs.rs/crate/tokenlease/latest/source/docs/policy.md
//! [docs/roles.md]: https://docs.rs/crate/tokenlease/latest/source/docs/roles.md
//! [docs/api.md]: https://docs.rs/crate/tokenlease/latest/source/docs/api.md

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
pub use limiter::{DecidedBy, Decision, Limiter, ReloadError, WaitError};

/// The README's Rust blocks, compiled as doc tests (`cargo test --doc --all-features`) from the
/// very text a reader sees: they hide no lines, so each one compiles when pasted.
#[cfg(all(doctest, feature = "postgres", feature = "http"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// docs/roles.md's Rust block, compiled as a doc test like the README's.
#[cfg(all(doctest, feature = "postgres"))]
#[doc = include_str!("../docs/roles.md")]
struct RolesDoctests;
