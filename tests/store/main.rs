//! The stores against real servers: SQL correctness (B2–B11), the store contract for
//! `PostgresStore` and `MemoryStore` and the memory store's bounds, PgBouncer (D8),
//! keys over several primaries (H3–H6, H8, H9) and Citus (Z1–Z5), direct mode's multi-key statements and
//! its bounds over several instances (B1, C1–C3, C7, C9), and contained failures: one bad request
//! fails alone (K1–K4, K10), rolling deploys (K6, K7) and plans that hold at any table size
//! (K8), and the owner and service roles of docs/roles.md (F1). One module per former test
//! binary; docs/testing.md lists each test.
//!
//! The `cli` cases of `migrate` (the `tokenlease migrate` command) need the binary, so they are
//! compiled with that feature only.

#[path = "../common/mod.rs"]
mod common;

mod batch;
mod bounded;
mod citus;
mod citus_returns;
mod concurrency;
mod contained;
mod deploy;
mod limits;
mod pgbouncer;
mod plans;
mod postgres;
mod roles;
mod sharded;
mod spread;
mod store_contract;
mod subject;
