//! The pure token bucket: state, time and cost in; decision and new state out.
//!
//! Nothing here does I/O, reads a clock or awaits. Time is a [`Timestamp`] passed in by the
//! caller (the database's `now()` for the shared bucket, a monotonic clock for local buckets),
//! and amounts are exact fixed-point [`Tokens`]. The store's statements
//! (`src/store/postgres/lean.rs`) perform the same arithmetic on integer nanotokens and
//! femtotokens, so for the same timeline both give the same decisions.
//!
//! # The arithmetic
//!
//! With capacity `C`, rate `r` (nanotokens per second) and elapsed time `e` (nanoseconds), in
//! attotokens (10⁻¹⁸ token):
//!
//! ```text
//! refilled = min(C, tokens + e × r)
//! ```
//!
//! and `last_refill` becomes `max(last_refill, now)`, so a clock that goes backwards refills
//! nothing and never removes tokens. A nanosecond times a nanotoken per second is exactly one
//! attotoken, so the refill is an exact integer product: no rounding, no drift, however often the
//! bucket is called. The only rounding is of the rate itself to whole nanotokens per second
//! (2/3 token/s becomes 0.666666667), which is under 10⁻⁹ token per second.

mod limits;
mod math;
mod more;
mod tokens;

pub(crate) use limits::LimitsState;
pub use math::{
    BucketConfig, BucketConfigError, BucketState, Grant, InsufficientCapacity, Outcome, Timestamp,
};
pub use tokens::{ParseTokensError, Rate, Tokens, TrimmedTokens};
