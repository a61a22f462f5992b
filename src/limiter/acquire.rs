//! [`Limiter::try_acquire`] and its future, [`Acquire`]: the entry point, and the first poll
//! that answers a key with a live lease in place.
//!
//! Apart because this is the fast path, measured to the nanosecond (docs/design/leases.md, "The fast
//! path"): what it does before any other code runs is all here, and the rest of a call
//! (`call.rs`) starts only when it cannot answer.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::time::Instant;

use super::call::Step;
use super::cost::{lease_cost, validate_cost};
use super::decisions::lease_allowed_at;
use super::{Decision, Limiter};
use crate::error::Error;
use crate::policy::Plan;

impl Limiter {
    /// Takes `cost` tokens from `key`'s bucket under the plan the policies give the key. A
    /// whole-token cost is written as it is (`try_acquire("k", 1)`); a fraction as a float.
    ///
    /// A key already in the lease table is answered from its lease on the first poll, with its
    /// plan read from the table (no prefix match, no allocation, no reference count); anything
    /// else takes the full path of [`try_acquire_with`](Self::try_acquire_with).
    ///
    /// # Errors
    ///
    /// [`Error::NoPlanForKey`] when no plan matches, and as [`try_acquire_with`](Self::try_acquire_with).
    pub fn try_acquire<'a>(&'a self, key: &'a str, cost: impl Into<f64>) -> Acquire<'a> {
        let cost = cost.into();
        Acquire {
            state: State::Start {
                limiter: self,
                plan: None,
                key,
                cost,
            },
        }
    }

    /// Takes `cost` tokens from `key`'s bucket under `plan` (a whole number of tokens as it is,
    /// `try_acquire_with(&plan, "k", 2)`, or a float).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`] for an empty or overlong key or one with a NUL byte, and
    /// [`Error::InvalidCost`] for a cost that is not finite, not above zero, or above the plan's
    /// capacity. Neither reaches the store. Store failures are decided by the plan's fallback.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future never leaves the key stuck; a take already sent to the store counts
    /// as spent.
    pub fn try_acquire_with<'a>(
        &'a self,
        plan: &'a Plan,
        key: &'a str,
        cost: impl Into<f64>,
    ) -> Acquire<'a> {
        let cost = cost.into();
        Acquire {
            state: State::Start {
                limiter: self,
                plan: Some(plan),
                key,
                cost,
            },
        }
    }

    /// `try_acquire`'s fast path for a key already in the lease table under the plan the
    /// policies chose for it: the decision from its live lease, with the plan read from the
    /// key's record (no prefix match, no allocation, no reference count). `None` when that
    /// cannot answer (no such key, a named plan, a short lease): nothing was changed, and
    /// [`start`](Self::start) takes the call. Kept apart from `start` so that `Acquire::poll`
    /// builds this decision in place.
    #[inline(always)]
    pub(super) fn known(&self, key: &str, cost: f64) -> Option<Result<crate::lease::Known, Error>> {
        let leases = self.inner.leases.get()?;
        // A key in the table passed `validate_key` when it went in: only the cost is checked.
        leases.try_take_known(key, &self.inner.plans, |plan| {
            validate_cost(plan, cost).map(lease_cost)
        })
    }
}

/// The future of [`Limiter::try_acquire`] and [`Limiter::try_acquire_with`].
///
/// Its first poll runs the lease's fast path in place: a key with a live lease holding the cost
/// is answered then, without allocating. Only a call that must wait (for a refill, the store or
/// the fallback) boxes the rest of its work.
#[must_use = "futures do nothing unless polled"]
pub struct Acquire<'a> {
    state: State<'a>,
}

enum State<'a> {
    Start {
        limiter: &'a Limiter,
        plan: Option<&'a Plan>,
        key: &'a str,
        cost: f64,
    },
    /// The rest of the call, and when it started waiting.
    Waiting(
        Pin<Box<dyn Future<Output = Result<Decision, Error>> + Send + 'a>>,
        Instant,
    ),
    /// Decided, and handed over on the next poll (the task yielded for tokio's budget). Boxed:
    /// rare, and a `Decision` inline would make every `Acquire` as large as one.
    Decided(Box<Decision>),
    Done,
}

impl std::fmt::Debug for Acquire<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Start { .. } => "start",
            State::Waiting(..) => "waiting",
            State::Decided(..) => "decided",
            State::Done => "done",
        };
        f.debug_struct("Acquire").field("state", &state).finish()
    }
}

impl Future for Acquire<'_> {
    type Output = Result<Decision, Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // `try_acquire` on a key with a live lease: decided in place, with no more work than
        // `try_acquire_now_with`; the state is only marked done.
        // The decision is built in the return value itself: built first and then moved, its
        // fields went through the stack, where the 16-byte copies of 8-byte stores stalled
        // store-to-load forwarding (docs/design/leases.md, "The fast path").
        if let State::Start {
            limiter,
            plan: None,
            key,
            cost,
        } = self.state
            && let Some(known) = limiter.known(key, cost)
        {
            self.state = State::Done;
            return Poll::Ready(match known {
                Ok(k) => Ok(lease_allowed_at(k.capacity, k.left, k.store_remaining)),
                Err(e) => Err(e),
            });
        }
        let (mut waiting, since) = match std::mem::replace(&mut self.state, State::Done) {
            State::Start {
                limiter,
                plan,
                key,
                cost,
            } => match limiter.start(plan, key, cost) {
                // Allowed from a live lease: done on this poll.
                Ok(Step::Done(decision)) if decision.allowed => return Poll::Ready(Ok(decision)),
                // Denied without waiting (the store called the bucket empty): this is what a
                // caller retrying in a loop sees again and again, so it takes part in tokio's
                // cooperative budget as tokio's own resources do. Without budget the task
                // yields, and the decision (which changed nothing) is given on the next poll;
                // otherwise the loop would never yield, and starve the other tasks of its
                // worker, the lease actor among them.
                Ok(Step::Done(decision)) => {
                    return match tokio::task::coop::poll_proceed(cx) {
                        Poll::Ready(coop) => {
                            coop.made_progress();
                            Poll::Ready(Ok(decision))
                        }
                        Poll::Pending => {
                            self.state = State::Decided(Box::new(decision));
                            Poll::Pending
                        }
                    };
                }
                Err(e) => return Poll::Ready(Err(e)),
                Ok(step) => {
                    // The call's one reading of the clock: its deadlines, the fallback's and
                    // the debt's time, and its latency all count from here.
                    let now = crate::clock::instant();
                    (
                        Box::pin(limiter.finish(step, now, plan, key, cost))
                            as Pin<Box<dyn Future<Output = _> + Send + '_>>,
                        now,
                    )
                }
            },
            State::Decided(decision) => return Poll::Ready(Ok(*decision)),
            State::Waiting(waiting, since) => (waiting, since),
            State::Done => panic!("`Acquire` polled after it completed"),
        };
        match waiting.as_mut().poll(cx) {
            Poll::Ready(out) => {
                if let Ok(decision) = &out {
                    let took = crate::clock::instant().saturating_duration_since(since);
                    crate::metrics::record_latency(decision.decided_by, took);
                }
                Poll::Ready(out)
            }
            Poll::Pending => {
                self.state = State::Waiting(waiting, since);
                Poll::Pending
            }
        }
    }
}
