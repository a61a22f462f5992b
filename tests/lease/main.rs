//! Leased mode: the lease table and its actor against real servers and in memory (C1–C7, C9,
//! C11, E4, E5), the actor's due-queue on tokio's paused clock, strict accounting, refunds into live
//! leases, the actor's supervision, `examples/instances.rs` and `examples/worker.rs` run as
//! modules, costs above what a lease holds (K5), and calls that wait for their tokens (W1–W9). One module per
//! former test binary; docs/testing.md lists each test.
//!
//! `lease` sets the binary's global allocator (E4's live-heap count, of E4's own threads only).

#[path = "../common/mod.rs"]
mod common;

mod bounds;
mod coldstart;
mod examples;
mod lease;
mod lease_timer;
mod limits;
mod refund;
mod strict;
mod supervised;
mod wait;
