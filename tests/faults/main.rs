//! The limiter under faults and load: the server stopped, slow, reset, restarted, hung and the
//! wall clock stepped, in every fallback mode (D1–D5, D7, D9; D6, the pool exhausted, is a unit
//! test in `src/pool_tests.rs`); outage debt (D10, D11); 200 callers on a healthy server. One module per former test binary;
//! docs/testing.md lists each test, docs/failure.md their figures.
//!
//! Timing-dependent: nextest runs them in its `serial` group, and the tests of `faults` and
//! `debt` hold the serial lock of `common` so that `cargo test` runs them one at a time too.

#[path = "../common/mod.rs"]
mod common;

mod debt;
mod faults;
mod overload;
