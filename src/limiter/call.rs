//! The rest of a call once its first poll could not answer it: the lease's slow path (a wait
//! for a refill, a sparse key's store call), direct mode through the coalescer, and the
//! fallback; beside them, the never-waiting [`Limiter::try_acquire_now_with`] and
//! [`Limiter::refund`].
//!
//! Apart from `acquire.rs` because none of this is on the fast path: it may await the store,
//! the actor or the fallback, and counts what it decides on the plan's counters.

use crate::store::metered::{Metered, Purpose};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::cost::{check_leased_call, lease_cost, validate_cost};
use super::decisions::{from_store, lease_allowed, lease_denied, shadowed};
use super::{DecidedBy, Decision, Limiter};
use crate::bucket::Tokens;
use crate::error::Error;
use crate::key::{validate_key, validate_stored_key};
use crate::lease::{FallbackCause, Fast, MAX_LEASE_NANOS};
use crate::policy::Plan;
use crate::store::{AcquireRequest, GiveBack};

impl Limiter {
    /// The part of a call that never awaits: the lease's fast path, or what the rest of the
    /// call needs to go on.
    #[inline]
    pub(super) fn start<'a>(
        &'a self,
        plan: Option<&'a Plan>,
        key: &'a str,
        cost: f64,
    ) -> Result<Step<'a>, Error> {
        let (plan, index) = match plan {
            Some(plan) => (PlanRef::Named(plan), None),
            None => {
                let (plan, index) = self.plan_for_key(key)?;
                (PlanRef::Chosen(plan), Some(index))
            }
        };
        let cost_tokens = check_leased_call(&plan, key, cost)?;
        if plan.shadow() {
            // The rest runs on the shadow plan's own key, made once the caller's is checked.
            validate_key(key)?;
            return Ok(Step::Shadow {
                plan,
                cost: cost_tokens,
            });
        }
        self.start_at(plan, index, key, cost_tokens)
    }

    /// [`start`](Self::start) once the plan is known and the cost checked, on `key`, the key
    /// under which the store keeps the plan's bucket ([`Plan::store_key`]): the caller's key
    /// checked in full but for its NUL bytes, or a shadow plan's key.
    #[inline]
    fn start_at<'a>(
        &'a self,
        plan: PlanRef<'a>,
        index: Option<u32>,
        key: &str,
        cost_tokens: Tokens,
    ) -> Result<Step<'a>, Error> {
        let Some(settings) = plan.lease().copied() else {
            validate_stored_key(key)?;
            return Ok(Step::Direct {
                plan,
                cost: cost_tokens,
            });
        };
        let nanos = lease_cost(cost_tokens);
        if nanos > MAX_LEASE_NANOS {
            // No lease can ever hold this cost (a plan of more than 7.2 × 10⁷ tokens): one
            // store call decides it, as in direct mode. Waiting for a refill would wait out
            // `max_wait` while the actor leased and gave back a lease the word cannot hold.
            return Self::beyond_a_lease(plan, key, cost_tokens);
        }
        let leases = self.leases();
        let chosen = match (&plan, index) {
            (PlanRef::Chosen(shared), Some(index)) => Some((shared, index)),
            _ => None,
        };
        let fast = leases.try_take(&plan, chosen, key, nanos, &self.inner.plans);
        if let Fast::Taken {
            left,
            store_remaining,
        } = fast
        {
            return Ok(Step::Done(lease_allowed(&plan, left, store_remaining)));
        }
        // Only a key already in the table (checked when it went in) is spent from a lease.
        validate_stored_key(key)?;
        // A refill needs the actor: start it again if its task ended (its runtime was dropped,
        // or it panicked). Without one (no tokio runtime here), the fallback decides, counted
        // in `tokenlease_lease_actor_unavailable_total`.
        if !leases.ensure_actor() && !matches!(fast, Fast::Dry { .. } | Fast::NoRoom) {
            return Ok(Step::Fallback {
                plan,
                cost: cost_tokens,
            });
        }
        Ok(self.next_step(
            plan,
            cost_tokens,
            fast,
            Answered::AtStart,
            settings.max_wait,
        ))
    }

    /// What a leased call does next, from the lease table's answer `fast`, at the call's start
    /// or after it waited for a refill (`when`): the one place an answer of the table becomes a
    /// [`Step`]. `max_wait`: how long the plan lets a call wait.
    fn next_step<'a>(
        &self,
        plan: PlanRef<'a>,
        cost: Tokens,
        fast: Fast,
        when: Answered,
        max_wait: Duration,
    ) -> Step<'a> {
        let waited = when == Answered::AfterWait;
        match fast {
            Fast::Taken {
                left,
                store_remaining,
            } => {
                if waited {
                    // A refill landed: the store answers.
                    self.inner.fallback.tidy();
                }
                Step::Done(lease_allowed(&plan, left, store_remaining))
            }
            Fast::Dry { retry_after } => {
                Step::Done(self.recorded(&plan, lease_denied(&plan, retry_after)))
            }
            Fast::Short(slot) if !waited && !max_wait.is_zero() => Step::Wait {
                plan,
                cost,
                slot,
                max_wait,
            },
            Fast::Failing | Fast::Short(_) => {
                // The key's refill failed lately, or its plan waits for nothing, or the wait
                // ended without tokens (counted by its cause where the wait ended).
                if !waited {
                    self.leases()
                        .count_fallback(if matches!(fast, Fast::Failing) {
                            FallbackCause::Failing
                        } else {
                            FallbackCause::Other
                        });
                }
                Step::Fallback { plan, cost }
            }
            // One store call decides: a sparse key's, or a call that waited out `max_wait` with
            // no credit while the store answers; the lease table hears of it.
            Fast::Sparse(slot) => Step::Sparse { plan, cost, slot },
            // A reload retired the slot the call waited on (its plan changed): the call starts
            // over, so that it is decided under the plan in force now.
            Fast::Gone if waited => Step::Restart { plan, cost },
            Fast::NoRoom | Fast::Gone => Step::Direct { plan, cost },
        }
    }

    /// A leased plan's call whose cost is above [`LeaseSettings::MAX_LEASE`]: a store call
    /// decides it ([`Step::Direct`]). Out of line: only plans of more than 7.2 × 10⁷ tokens
    /// reach it.
    ///
    /// [`LeaseSettings::MAX_LEASE`]: crate::policy::LeaseSettings::MAX_LEASE
    #[cold]
    #[inline(never)]
    fn beyond_a_lease<'a>(plan: PlanRef<'a>, key: &str, cost: Tokens) -> Result<Step<'a>, Error> {
        validate_stored_key(key)?;
        Ok(Step::Direct { plan, cost })
    }

    /// Counts a decision made off the fast path under `plan` (on its counters in the plan
    /// registry), after [`shadowed`] let a shadow plan's denial through.
    fn recorded(&self, plan: &PlanRef<'_>, decision: Decision) -> Decision {
        let decision = shadowed(plan, decision);
        crate::metrics::record(&self.counters(plan), &decision);
        decision
    }

    /// The counters `plan`'s decisions count on. A plan the policies chose that a reload has
    /// removed since counts on none (`PlanRegistry::counters_of_given`): its series are gone.
    fn counters(&self, plan: &PlanRef<'_>) -> Arc<crate::metrics::PlanCounters> {
        match plan {
            PlanRef::Named(plan) => self.inner.plans.counters_of(plan),
            PlanRef::Chosen(plan) => self.inner.plans.counters_of_given(plan),
        }
    }

    /// The plan's fallback decides `cost` on `key` at `now`: the store failed, timed out, or
    /// cannot be asked.
    async fn decide_by_fallback(
        &self,
        plan: &PlanRef<'_>,
        key: &str,
        cost: Tokens,
        now: Instant,
    ) -> Decision {
        let counters = self.counters(plan);
        self.inner
            .fallback
            .decide(plan, &counters, key, cost, now)
            .await
    }

    /// The rest of a call that [`start`](Self::start) could not finish without waiting, one
    /// step after another until one decides. `named`, `key` and `asked` are the call's own
    /// plan, key and cost: a call whose slot was retired while it waited starts over with them,
    /// once. `now`: tokio's clock when this part of the call began, read once and passed
    /// down, and read again after a wait.
    pub(super) async fn finish(
        &self,
        mut step: Step<'_>,
        mut now: Instant,
        named: Option<&Plan>,
        key: &str,
        asked: f64,
    ) -> Result<Decision, Error> {
        // The key under which the store keeps the plan's bucket (`Plan::store_key`): the
        // caller's, or a shadow plan's own.
        let mut stored = std::borrow::Cow::Borrowed(key);
        let mut started_over = false;
        loop {
            step = match step {
                Step::Done(decision) => return Ok(decision),
                // A shadow plan's call runs on its own key, from the start.
                Step::Shadow { plan, cost } => {
                    stored = std::borrow::Cow::Owned(plan.store_key(key).into_owned());
                    self.start_at(plan, None, &stored, cost)?
                }
                Step::Wait {
                    plan,
                    cost,
                    slot,
                    max_wait,
                } => {
                    let waited = self
                        .leases()
                        .wait(
                            slot,
                            lease_cost(cost),
                            now + max_wait,
                            &self.inner.plans,
                            matches!(plan, PlanRef::Chosen(_)),
                        )
                        .await;
                    // The call waited: what decides it next reads the clock once more.
                    now = crate::clock::instant();
                    self.next_step(plan, cost, waited, Answered::AfterWait, max_wait)
                }
                Step::Restart { plan, cost } => {
                    if started_over {
                        // Retired twice: one store call decides.
                        Step::Direct { plan, cost }
                    } else {
                        started_over = true;
                        stored = std::borrow::Cow::Borrowed(key);
                        self.start(named, key, asked)?
                    }
                }
                Step::Fallback { plan, cost } => {
                    let decision = self.decide_by_fallback(&plan, &stored, cost, now).await;
                    return Ok(self.recorded(&plan, decision));
                }
                Step::Direct { plan, cost } => {
                    return self
                        .direct(&plan, &stored, cost, now)
                        .await
                        .map(|d| self.recorded(&plan, d));
                }
                Step::Sparse { plan, cost, slot } => {
                    return self.sparse(&plan, &stored, cost, now, &slot).await;
                }
            };
        }
    }

    /// One store call decides a leased key's call ([`Step::Sparse`], or a wait that ended
    /// without credit while the store answers), and the lease table hears of it.
    async fn sparse(
        &self,
        plan: &PlanRef<'_>,
        stored: &str,
        cost: Tokens,
        now: Instant,
        slot: &crate::lease::SlotRef,
    ) -> Result<Decision, Error> {
        let decision = self.direct(plan, stored, cost, now).await?;
        let by_store = decision.decided_by == DecidedBy::Store;
        let spent = if decision.allowed && by_store {
            lease_cost(cost)
        } else {
            0
        };
        let denied_for = (!decision.allowed && by_store)
            .then(|| u64::try_from(decision.retry_after.as_nanos()).unwrap_or(u64::MAX));
        let failed = matches!(decision.decided_by, DecidedBy::Fallback(_));
        self.leases().record_direct(slot, spent, denied_for, failed);
        Ok(self.recorded(plan, decision))
    }

    /// Decides from the lease alone, never waiting: `Ok(None)` when that would need the store
    /// (no live lease with enough tokens, or a direct-mode plan). A refill is asked for in the
    /// background, so a later call may find the tokens.
    ///
    /// This is the fast path with nothing around it: a table lookup and a CAS.
    ///
    /// # Errors
    ///
    /// As [`try_acquire_with`](Self::try_acquire_with).
    ///
    /// Outside a tokio runtime it never panics: with no lease actor running (none can start
    /// there), a key without a live lease keeps answering `Ok(None)`.
    pub fn try_acquire_now_with(
        &self,
        plan: &Plan,
        key: &str,
        cost: f64,
    ) -> Result<Option<Decision>, Error> {
        let cost = check_leased_call(plan, key, cost)?;
        if plan.lease().is_none() {
            validate_key(key)?;
            return Ok(None);
        }
        if plan.shadow() {
            validate_key(key)?;
        }
        if lease_cost(cost) > MAX_LEASE_NANOS {
            // No lease can hold this cost: only a store call decides it.
            validate_key(key)?;
            return Ok(None);
        }
        // A shadow plan's bucket (and lease) is under a key of its own.
        let key = &*plan.store_key(key);
        let leases = self.leases();
        match leases.try_take(plan, None, key, lease_cost(cost), &self.inner.plans) {
            Fast::Taken {
                left,
                store_remaining,
            } => Ok(Some(lease_allowed(plan, left, store_remaining))),
            other => {
                // The refill asked for needs an actor; outside a runtime none can start, and the
                // answer stays `None`.
                leases.ensure_actor();
                // Only a key already in the table (checked when it went in) is spent from a
                // lease; any other answer checks the key in full first.
                validate_stored_key(key)?;
                // This call never waits, so a sparse key gets no store call here: a refill is
                // asked for instead, for a later call to find.
                if let Fast::Sparse(slot) = &other {
                    leases.ask_refill_now(slot, lease_cost(cost));
                }
                Ok(match other {
                    Fast::Dry { retry_after } => {
                        Some(shadowed(plan, lease_denied(plan, retry_after)))
                    }
                    _ => None,
                })
            }
        }
    }

    /// Gives back `cost` tokens that a decision of this limiter allowed, because the request was
    /// refused further on (the HTTP layer refunds the endpoint's token when the entity's bucket
    /// denies). With a live relaxed lease the tokens go back into it; otherwise (and always for
    /// strict accounting) to the store, capped at the capacity less the strict leases out. Returns whether they were credited: a refund the store cannot take (it is
    /// failing) is dropped, and those tokens count as spent, which under-admits and never
    /// over-admits.
    ///
    /// Refund only what was allowed: the limiter cannot tell, and a refund of tokens never taken
    /// lets the bucket admit more than its limit.
    ///
    /// # Errors
    ///
    /// As [`try_acquire_with`](Self::try_acquire_with), for an invalid key or cost.
    pub async fn refund(&self, plan: &Plan, key: &str, cost: f64) -> Result<bool, Error> {
        validate_key(key)?;
        let cost = validate_cost(plan, cost)?;
        // A shadow plan's tokens go back to its own bucket.
        let key = &*plan.store_key(key);
        // A strict lease's entry in the store covers only what its holder kept at the last
        // renewal: a refund into the word could leave the holder more than the store counts.
        // Strict refunds go to the store, which caps them under its lease accounting.
        if plan
            .lease()
            .is_some_and(|l| l.accounting == crate::policy::Accounting::Relaxed)
            && let Some(leases) = self.inner.leases.get()
            && leases.refund(key, lease_cost(cost))
        {
            return Ok(true);
        }
        let give = GiveBack {
            id: GiveBack::fresh_id(key),
            key,
            bucket: *plan.bucket(),
            amount: cost,
            lease: None,
        };
        let credited = Metered::new(&*self.inner.store, Purpose::Return)
            .give_back(&[give])
            .await
            .is_ok();
        Ok(credited)
    }

    /// Direct mode: one store statement (shared with concurrent callers), answered by the call
    /// deadline (from `now`, the call's reading of the clock); the fallback decides whatever
    /// the store did not answer in time.
    async fn direct(
        &self,
        plan: &PlanRef<'_>,
        key: &str,
        cost: Tokens,
        now: Instant,
    ) -> Result<Decision, Error> {
        let bucket = *plan.bucket();
        let deadline = now + self.inner.call_deadline;
        let result = match &self.inner.coalescer {
            Some(coalescer) => coalescer
                .take(&self.inner.store, key, bucket, cost, now, deadline)
                .await
                .map_err(drop),
            None => {
                let store = Metered::new(&*self.inner.store, Purpose::Take);
                let call = store.acquire(AcquireRequest::take(key, bucket, cost));
                match tokio::time::timeout_at(deadline, call).await {
                    Ok(Ok(acquired)) => Ok(acquired),
                    Ok(Err(_)) => Err(()),
                    Err(_) => {
                        store.timed_out();
                        Err(())
                    }
                }
            }
        };
        match result {
            Ok(acquired) => {
                self.inner.fallback.tidy();
                Ok(from_store(plan, &acquired))
            }
            Err(_) => {
                // Past the deadline (or a failed statement): the fallback decides at the
                // clock's reading now, not the call's start.
                let now = crate::clock::instant();
                Ok(self.decide_by_fallback(plan, key, cost, now).await)
            }
        }
    }
}

/// A call's plan: the caller's, or the one the policies chose, which the call holds (a reload
/// may release the plan registry's entry while the call waits).
#[derive(Debug, Clone)]
pub(super) enum PlanRef<'a> {
    /// Named by the caller.
    Named(&'a Plan),
    /// Chosen by the policies in force when the call started.
    Chosen(Arc<Plan>),
}

impl std::ops::Deref for PlanRef<'_> {
    type Target = Plan;

    fn deref(&self) -> &Plan {
        match self {
            PlanRef::Named(plan) => plan,
            PlanRef::Chosen(plan) => plan,
        }
    }
}

/// When the lease table answered a call: [`Limiter::next_step`] maps its answer either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answered {
    /// On the call's first poll.
    AtStart,
    /// After the call waited for a refill.
    AfterWait,
}

/// Where [`Limiter::start`] left a call.
pub(super) enum Step<'a> {
    /// Decided.
    Done(Decision),
    /// A shadow plan's call: the rest runs on the plan's own key ([`Plan::store_key`]), made
    /// in [`Limiter::finish`] (`start` borrows the caller's key and cannot hold a new one).
    Shadow { plan: PlanRef<'a>, cost: Tokens },
    /// Wait for the slot's refill for at most `max_wait` (from the call's reading of the clock,
    /// taken when it leaves [`Limiter::start`]).
    Wait {
        plan: PlanRef<'a>,
        cost: Tokens,
        slot: crate::lease::SlotRef,
        max_wait: Duration,
    },
    /// The slot the call waited on was retired (a reload changed its plan): the call starts
    /// over, once; a second time, one store call decides.
    Restart { plan: PlanRef<'a>, cost: Tokens },
    /// The fallback decides.
    Fallback { plan: PlanRef<'a>, cost: Tokens },
    /// One store call decides (direct mode, or no room in the lease table).
    Direct { plan: PlanRef<'a>, cost: Tokens },
    /// One store call decides a sparse key's call (`Fast::Sparse`), and the lease table hears
    /// of it.
    Sparse {
        plan: PlanRef<'a>,
        cost: Tokens,
        slot: crate::lease::SlotRef,
    },
}
