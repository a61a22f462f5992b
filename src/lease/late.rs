//! A refill that timed out while the store answered a newer one: late, not failed (`DESIGN.md`
//! §8, "A refill that times out while newer ones answer").
//!
//! The first calls of a flood of new keys fill the actor's lanes with refill statements of
//! [`CHUNK`](super::actor) keys each, several in flight at once. Now and then one of them takes
//! longer than the store's call timeout while the statements sent after it answer: the store
//! works, that statement was slow. Counted as a failure it sent each of its keys' callers to the
//! fallback for `FAILURE_BACKOFF`, and it stopped all credit until the next answer. So a refill
//! that timed out is *late* when a refill statement sent no earlier than it has answered: its
//! relaxed keys are asked for again at once (their callers go on waiting, within `max_wait`,
//! and then may be admitted on credit), and nothing is recorded as failed. A store that stalls
//! answers nothing sent after the stall began, so its refills fail as before; so do errors
//! other than a timeout (a refused connection, an open circuit breaker, a database error).

use std::sync::atomic::Ordering;

use crate::store::{Acquired, StoreError};

use super::Leases;

impl Leases {
    /// Records a refill statement's outcome, at `now`: it was sent at `sent` (local monotonic
    /// ns), and `result` holds one answer per key (`short` when the store returned fewer).
    /// Returns whether its failed keys are *late* rather than failed (see the module).
    pub(super) fn refill_outcome(
        &self,
        sent: u64,
        short: bool,
        result: &[Result<Acquired, StoreError>],
        now: u64,
    ) -> bool {
        let at = now.max(1);
        let failed = short || result.iter().any(Result::is_err);
        if !failed {
            self.refill_ok_at.store(at, Ordering::Release);
            self.refill_ok_sent.fetch_max(sent.max(1), Ordering::AcqRel);
            return false;
        }
        let late = !short
            && result
                .iter()
                .all(|r| matches!(r, Ok(_) | Err(StoreError::Timeout { .. })))
            && self.refill_ok_sent.load(Ordering::Acquire) >= sent.max(1);
        if !late {
            self.refill_failed_at.store(at, Ordering::Release);
        }
        late
    }
}
