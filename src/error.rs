//! The crate's error types.
//!
//! A denial is a [`Decision`](crate::Decision), never an error. Errors are for requests that can
//! never succeed as written (a bad key, a cost that cannot fit, an unknown plan). A store that
//! fails or times out is not an error of [`Limiter::try_acquire`](crate::Limiter::try_acquire):
//! every plan has a fallback, and the [`Decision`](crate::Decision) says it decided
//! ([`DecidedBy::Fallback`](crate::DecidedBy::Fallback)). Store errors
//! ([`StoreError`](crate::store::StoreError)) reach the caller only from the calls that talk to
//! the store itself: building a store and [`Store`](crate::store::Store)'s own methods.

pub use crate::report::{chain, redact};

/// Why [`Limiter::try_acquire`](crate::Limiter::try_acquire) could not decide.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key is not usable: empty, too long, holding a NUL byte, or starting with the byte
    /// reserved for shadow plans' buckets.
    #[error(transparent)]
    InvalidKey(#[from] KeyError),
    /// The cost is zero, negative, not finite, or larger than the plan's capacity.
    #[error("invalid cost {cost} for plan {plan:?}: {reason}")]
    InvalidCost {
        /// The cost as given.
        cost: f64,
        /// The plan whose bucket was asked.
        plan: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// No plan matches the key, and the policy names no default plan.
    #[error("no plan matches key {key:?} and the policy has no default_plan")]
    NoPlanForKey {
        /// The first 64 characters of the key.
        key: String,
    },
}

pub use crate::key::{
    KeyError, MAX_KEY_BYTES, RESERVED_KEY_PREFIX, validate_key, validate_key_bytes,
};
