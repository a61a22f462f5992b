//! The limiter as an application meets it: the policy file (A6–A8), live reload (R1–R5,
//! R7–R9), shadow mode (S1–S5, S7, S8), the HTTP layer and its routes (E1–E3, E6, E7), and
//! every metric (S6). One module per former test binary; docs/testing.md lists each test.
//!
//! `metrics` and `http_routes` record into recorders of their own
//! (`metrics::with_local_recorder`), so no global recorder is installed here. The `tokenlease
//! check` cases are in the binary's crate (cli/tests/commands.rs). `policy`'s proptest regressions are in `policy.proptest-regressions` beside it.

#[path = "../common/mod.rs"]
mod common;

mod http;
mod http_limits;
mod http_routes;
mod metrics;
mod policy;
mod reload;
mod shadow;
