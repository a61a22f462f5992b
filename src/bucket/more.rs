//! The limits of a bucket beyond its first, as [`BucketConfig`](super::BucketConfig) holds
//! them inline (`limits.rs` has what they mean).

use super::tokens::{Rate, Tokens};

/// One limit beyond a bucket's first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Limit {
    pub(super) capacity: Tokens,
    pub(super) rate: Rate,
}

/// How many limits a bucket holds beyond its first.
pub(crate) const MAX_MORE: usize = 3;

/// What the unused places of a bucket's other limits hold (all alike, so equal shapes are
/// equal and hash alike).
pub(crate) const UNUSED: Limit = Limit {
    capacity: Tokens::ZERO,
    rate: Rate::MAX,
};
