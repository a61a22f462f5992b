//! The synchronisation shim of the lock-free lease core: every atomic, lock and thread-local
//! that `word.rs`, `words.rs` and `slab.rs` use comes from here, so that the loom models
//! (`tests/models/loom_lease_word.rs`, `tests/models/loom_lease_words.rs`) can compile those files, unchanged,
//! against loom's instead.
//!
//! The library's names are std's (and `parking_lot`'s mutex): plain re-exports, so the lease core
//! compiles to exactly what it would without the shim. `model` holds the same names over loom.
//! It is compiled only in test builds, where loom (a dev-dependency) is available, and it is what
//! a model compiles the lease core against: the model includes this file and names `model` as the
//! lease core's `super::sync` (`use shim::model as sync;`). So a normal test binary, built and
//! run by `cargo nextest run` like any other, is the model; no `--cfg loom` rebuild of the whole
//! dependency graph is needed. A name used by the lease core and missing from `model` fails to
//! compile in the models, so the two lists cannot drift apart.
//!
//! Not loom's in the models: `OnceLock` (loom has none; it publishes with its own
//! acquire/release, and the models check what the lease core does around it), and `Arc` in
//! `slab.rs` (an `Arc<Slab>` receiver, which only std's `Arc` can be; it only keeps the slab alive,
//! while the records' hand-over goes through the modelled mutex).

pub(crate) use parking_lot::Mutex;
pub(crate) use std::sync::OnceLock;
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
pub(crate) use std::thread_local;

/// The same names as the library's, over loom: what the models compile the lease core against.
#[cfg(test)]
#[allow(dead_code, unused_imports, unused_macros, unreachable_pub)]
pub(crate) mod model {
    pub(crate) use ::loom::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
    pub(crate) use std::sync::OnceLock;

    /// loom's mutex with `parking_lot`'s interface (`lock` returns the guard: no poisoning).
    #[derive(Debug)]
    pub(crate) struct Mutex<T>(::loom::sync::Mutex<T>);

    impl<T> Mutex<T> {
        /// A mutex holding `value`.
        pub(crate) fn new(value: T) -> Self {
            Mutex(::loom::sync::Mutex::new(value))
        }

        /// Locks it (a model thread that panicked while holding it fails the model anyway).
        pub(crate) fn lock(&self) -> ::loom::sync::MutexGuard<'_, T> {
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }
    }

    /// loom's `thread_local!` (one value per model thread; std's would be one per OS thread,
    /// and loom runs every model thread on one), for the library's `const`-initialised form.
    macro_rules! model_thread_local {
        ($(#[$attr:meta])* $vis:vis static $name:ident: $t:ty = const { $init:expr };) => {
            ::loom::thread_local! { $(#[$attr])* $vis static $name: $t = $init; }
        };
    }
    pub(crate) use model_thread_local as thread_local;
}
