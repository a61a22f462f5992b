//! The pure token bucket: state, time and cost in; decision and new state out.
//!
//! Nothing here does I/O, reads a clock or awaits. Time is a [`Timestamp`] passed in by the
//! caller (the database's `now()` for the shared bucket, a monotonic clock for local buckets),
//! and amounts are exact fixed-point [`Tokens`]. The PostgreSQL statement in
//! `store/postgres/sql/acquire.sql` performs the same arithmetic on `numeric`, so for the same
//! timeline both give the same decisions.
//!
//! # The arithmetic
//!
//! With capacity `C`, rate `r` (nanotokens per second) and elapsed time `e` (nanoseconds):
//!
//! ```text
//! refilled = min(C, tokens + floor(e × r / 10⁹))
//! ```
//!
//! and `last_refill` becomes `max(last_refill, now)`, so a clock that goes backwards refills
//! nothing and never removes tokens. Flooring loses less than one nanotoken per call, so a bucket
//! driven ten times a second for a year (3.2 × 10⁸ calls) falls behind by less than 0.32 token
//! (0.21 at 2/3 token/s; `tests/bucket_props.rs`). It only ever loses, never over-grants. On a
//! clock that ticks in exact steps, those lost nanotokens can delay a take by one step.

mod math;
mod tokens;

pub use math::{BucketConfig, BucketState, Grant, InsufficientCapacity, Outcome, Timestamp};
pub use tokens::{ParseTokensError, Rate, Tokens};
