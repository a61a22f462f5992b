//! A refill that timed out while the store was answering: late, not failed (`docs/design/lease-credit.md`, "A
//! refill that times out while the store answers").
//!
//! The first calls of a flood of new keys fill the actor's lanes with refill statements of
//! [`CHUNK`](super::actor) keys each, several in flight at once; on a busy machine one of them
//! now and then takes longer than the store's call timeout while the store is answering. Counted
//! as a failure it sent each of its keys' callers to the fallback for `FAILURE_BACKOFF`, and it
//! stopped all credit until the next answer. So a refill that timed out (every error a call
//! timeout) is *late*, not failed, in either of two cases:
//!
//! 1. *Proof*: a refill statement sent no earlier than it has answered. The store works; this
//!    statement was slow.
//! 2. *Once*: no refill has failed since the last answer (the store was answering as far as the
//!    actor knows), and none of the statement's keys had its previous refill judged late this
//!    way (`retried`). A key is given one second chance, not more.
//!
//! A late refill's relaxed keys are asked for again at once (their callers go on waiting,
//! within `max_wait`, and then may be admitted on credit), and nothing is recorded as failed.
//! A store that stalls answers nothing sent after the stall began: the statements in flight
//! when it stalled, and those sent before its first timeout, are asked for again once; those
//! second statements time out with their keys marked, which records the failure, and from then
//! on every timeout fails at once until the store answers again. So a stall sends a key's
//! callers to the fallback after at most two call timeouts instead of one. Errors other than a
//! timeout (a refused connection, an open circuit breaker, a database error) fail as before.

use std::sync::atomic::Ordering;

use crate::store::{Acquired, StoreError};

use super::Leases;

impl Leases {
    /// Records a refill statement's outcome, at `now`: it was sent at `sent` (local monotonic
    /// ns), and `result` holds one answer per key (`short` when the store returned fewer).
    /// `retried` says the statement may not be judged late on the store's record alone (one of
    /// its keys was, last time, or the actor has no room to remember more such keys). Returns
    /// whether its failed keys are *late* rather than failed (see the module).
    pub(super) fn refill_outcome(
        &self,
        sent: u64,
        short: bool,
        result: &[Result<Acquired, StoreError>],
        now: u64,
        retried: bool,
    ) -> Outcome {
        let at = now.max(1);
        let failed = short || result.iter().any(Result::is_err);
        if !failed {
            self.refill_ok_at.store(at, Ordering::Release);
            self.refill_ok_sent.fetch_max(sent.max(1), Ordering::AcqRel);
            return Outcome::Answered;
        }
        let timed_out = !short
            && result
                .iter()
                .all(|r| matches!(r, Ok(_) | Err(StoreError::Timeout { .. })));
        let proof = self.refill_ok_sent.load(Ordering::Acquire) >= sent.max(1);
        let outcome = match (timed_out, proof, self.refills_answer() && !retried) {
            (true, true, _) => Outcome::Late,
            (true, false, true) => Outcome::LateOnce,
            _ => Outcome::Failed,
        };
        if outcome == Outcome::Failed {
            self.refill_failed_at.store(at, Ordering::Release);
            self.counters.failed_refills.fetch_add(1, Ordering::Relaxed);
        } else {
            self.counters.late_refills.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(crate::metrics::LATE_REFILLS).increment(1);
        }
        outcome
    }
}

/// What a refill statement's answer says about the store (see the module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// Every key answered.
    Answered,
    /// Timed out, and a statement sent no earlier answered: its keys are asked for again.
    Late,
    /// Timed out while the store was answering, and none of its keys had a second chance yet:
    /// its keys are asked for again, and marked, so that their next timeout fails.
    LateOnce,
    /// Failed: its keys' callers go to the fallback for `FAILURE_BACKOFF`.
    Failed,
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::lease::{Leases, TableSettings};
    use crate::store::{MemoryStore, TimeoutKind};

    fn answer() -> Result<Acquired, StoreError> {
        Ok(Acquired::new(
            crate::bucket::Tokens::from_nanos(1),
            crate::bucket::Tokens::from_nanos(1),
            Duration::ZERO,
            Duration::ZERO,
            std::time::SystemTime::UNIX_EPOCH,
        ))
    }

    fn timeout() -> Result<Acquired, StoreError> {
        Err(StoreError::Timeout {
            kind: TimeoutKind::Call,
            after: Duration::from_millis(50),
        })
    }

    /// Each rule of the module, in the order a stall meets them: no second chance before the
    /// store ever answered; proof (a newer statement answered) without limit; once per key
    /// while no refill has failed since the last answer; and after a failure, none until the
    /// store answers again. Errors other than a timeout, and short answers, always fail.
    #[tokio::test(start_paused = true)]
    async fn a_timed_out_refill_is_late_by_proof_or_once_while_the_store_answers() {
        let settings = TableSettings {
            max_entries: 16,
            tick: Duration::from_millis(50),
            sparse_direct: false,
        };
        let leases = Leases::start(Arc::new(MemoryStore::new()), settings);
        let t = [timeout()];
        // The store never answered: a timeout fails.
        assert_eq!(
            leases.refill_outcome(10, false, &t, 60, false),
            Outcome::Failed
        );
        // It answers a statement sent at 20; one sent at 30 times out: no proof, but the store
        // was answering, so it is late once...
        assert_eq!(
            leases.refill_outcome(20, false, &[answer()], 70, false),
            Outcome::Answered
        );
        assert_eq!(
            leases.refill_outcome(30, false, &t, 80, false),
            Outcome::LateOnce
        );
        // ...and not twice: its keys' next statement fails.
        assert_eq!(
            leases.refill_outcome(81, false, &t, 131, true),
            Outcome::Failed
        );
        // After that failure no statement gets a second chance until the store answers again,
        // but a statement sent before one that answered is late whatever its keys' history.
        assert_eq!(
            leases.refill_outcome(90, false, &t, 140, false),
            Outcome::Failed
        );
        assert_eq!(
            leases.refill_outcome(100, false, &[answer()], 150, false),
            Outcome::Answered
        );
        assert_eq!(
            leases.refill_outcome(95, false, &t, 155, true),
            Outcome::Late
        );
        assert_eq!(
            leases.refill_outcome(160, false, &t, 210, false),
            Outcome::LateOnce
        );
        // Other errors, and short answers, fail even with proof.
        let refused = [Err(StoreError::Protocol("refused".into()))];
        assert_eq!(
            leases.refill_outcome(99, false, &refused, 215, false),
            Outcome::Failed
        );
        assert_eq!(
            leases.refill_outcome(99, true, &[], 216, false),
            Outcome::Failed
        );
        let stats = leases.stats();
        assert_eq!(
            (stats.late_refills, stats.failed_refills),
            (3, 5),
            "{stats:?}"
        );
        leases.shutdown().await;
    }
}
