//! Distributed rate limiting with token leases over PostgreSQL.
//!
//! `tokenlease` keeps one token bucket per key in a PostgreSQL table and decides with the
//! database's own clock, so any number of service instances share one limit. See `DESIGN.md` for
//! the algorithm, the SQL and the failure behaviour.
//!
//! # Layout
//!
//! - [`bucket`]: the pure token bucket (no I/O, no clock, no async).
//! - [`policy`]: the JSON policy file, validated into [`policy::Policies`].
//! - [`store`]: the [`store::Store`] contract, [`store::PostgresStore`] (one atomic statement per
//!   call) and [`store::MemoryStore`].
//! - [`limiter`]: [`Limiter::try_acquire`], the entry point.
//! - [`embedded`]: a throwaway PostgreSQL cluster for tests, the demo and the load test.

#![forbid(unsafe_code)]

pub mod bucket;
pub mod clock;
pub mod embedded;
pub mod error;
mod fallback;
pub mod http;
pub mod lease;
pub mod limiter;
pub mod metrics;
pub mod policy;
pub mod store;

pub use error::Error;
pub use limiter::{DecidedBy, Decision, Limiter};
