//! The limiter under faults and load: the server stopped, slow, reset, restarted, hung and the
//! wall clock stepped, in every fallback mode (D1–D5, D7, D9, a module each; D6, the pool
//! exhausted, is a unit test in `src/pool_tests.rs`), an abandoned statement and a lost
//! connection, over the rig they share (`rig`); outage debt (D10, D11); 200 callers on a
//! healthy server. docs/testing.md lists each test, docs/failure.md their figures.
//!
//! Timing-dependent: nextest runs them in its `serial` group, and the fault tests and those of
//! `debt` hold the serial lock of `common` so that `cargo test` runs them one at a time too.

#[path = "../common/mod.rs"]
mod common;
mod rig;

mod abandoned_statement;
mod committed_but_timed_out;
mod connection_resets;
mod debt;
mod hung_server;
mod lost_connection;
mod overload;
mod restart_keeps_buckets;
mod server_stopped;
mod slow_server;
mod wall_clock_steps;
