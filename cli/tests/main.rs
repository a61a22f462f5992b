//! The `tokenlease` binary (the `tokenlease-cli` crate), run as its own process: its commands and their
//! messages, `check` and `migrate`, `chart`, `loadtest` with and without
//! faults (Z6), `reshard` (H7), and `demo` seen from outside: over plain HTTP, reloading its
//! policy (R6), under a flood of ids, in headless Chromium (M2) and scraped by Prometheus (M1).
//! One module per former test binary; docs/testing.md lists each test.
//!
//! `live_demo` is the support of the tests that run the demo: its process, a minimal HTTP
//! client, background traffic, and finding an outside program.

#[path = "../../tests/common/mod.rs"]
mod common;
mod live_demo;

mod chart;
mod cli;
mod commands;
mod dashboard;
mod demo;
mod demo_limits;
mod demo_reload;
mod flood;
mod loadtest;
mod loadtest_faults;
mod prometheus;
mod reshard;
