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

/// The longest key in bytes. PostgreSQL refuses btree index entries above 2704 bytes; the rest
/// of the limit leaves room for the row header and prefixes that the HTTP layer adds.
pub const MAX_KEY_BYTES: usize = 1024;

/// Why a key was refused before it reached the store.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is the empty string.
    #[error("invalid key: the key is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_BYTES`].
    #[error("invalid key: {len} bytes is longer than the limit of {MAX_KEY_BYTES} bytes")]
    TooLong {
        /// The key's length in bytes.
        len: usize,
    },
    /// The key holds a NUL byte, which PostgreSQL text cannot store.
    #[error("invalid key: NUL byte at offset {offset}")]
    Nul {
        /// Byte offset of the first NUL.
        offset: usize,
    },
    /// The key (given as bytes) is not valid UTF-8.
    #[error("invalid key: not UTF-8 at byte offset {offset}")]
    NotUtf8 {
        /// Byte offset where the invalid sequence starts.
        offset: usize,
    },
    /// The key starts with U+0001 ([`RESERVED_KEY_PREFIX`]), which marks the buckets a shadow
    /// plan keeps under keys of its own ([`Plan::store_key`](crate::policy::Plan::store_key)).
    #[error("invalid key: a key starting with U+0001 is reserved for the buckets of shadow plans")]
    Reserved,
}

/// The first character of every key under which a shadow plan keeps its bucket
/// ([`Plan::store_key`](crate::policy::Plan::store_key)), and of no key a caller may use:
/// [`validate_key`] refuses it, so a shadow plan's bucket never shares a row with a caller's
/// key.
pub const RESERVED_KEY_PREFIX: char = '\u{1}';

/// The longest key the limiter sends to the store: [`MAX_KEY_BYTES`] and what a shadow plan's
/// key adds (`Plan::store_key`: U+0001, `shadow:`, at most 64 bytes of plan name and a colon).
pub(crate) const MAX_STORED_KEY_BYTES: usize = MAX_KEY_BYTES + 73;

/// Checks a key for the store: non-empty, at most [`MAX_KEY_BYTES`] bytes, no NUL, not
/// starting with [`RESERVED_KEY_PREFIX`].
///
/// # Errors
///
/// The first [`KeyError`] that applies.
pub fn validate_key(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(KeyError::TooLong { len: key.len() });
    }
    if key.starts_with(RESERVED_KEY_PREFIX) {
        return Err(KeyError::Reserved);
    }
    validate_stored_key(key)
}

/// Checks a key the limiter itself sends to the store: a caller's key that passed
/// [`validate_key`], or a shadow plan's key made from one, which starts with
/// [`RESERVED_KEY_PREFIX`] and may be up to [`MAX_STORED_KEY_BYTES`] long.
pub(crate) fn validate_stored_key(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_STORED_KEY_BYTES {
        return Err(KeyError::TooLong { len: key.len() });
    }
    // `contains` on bytes scans a word at a time (the HTTP layer checks every entity key).
    if key.as_bytes().contains(&0)
        && let Some(offset) = key.bytes().position(|b| b == 0)
    {
        return Err(KeyError::Nul { offset });
    }
    Ok(())
}

/// Checks a key given as bytes: valid UTF-8, then as [`validate_key`].
///
/// # Errors
///
/// The first [`KeyError`] that applies.
pub fn validate_key_bytes(key: &[u8]) -> Result<&str, KeyError> {
    let key = std::str::from_utf8(key).map_err(|e| KeyError::NotUtf8 {
        offset: e.valid_up_to(),
    })?;
    validate_key(key)?;
    Ok(key)
}
