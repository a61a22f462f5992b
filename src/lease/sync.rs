//! The atomics the lease word uses. `tests/loom_lease_word.rs` compiles `word.rs` against a
//! module of the same name that re-exports loom's atomics instead, to model-check the protocol.

pub(crate) use std::sync::atomic::{AtomicU64, Ordering};
