//! [`Limiter::acquire_until`]: a call that waits for its tokens, up to a deadline the caller
//! gives, in arrival order per key, and [`WaitError`], why such a call ended without them.
//!
//! Apart because it is a loop around the other calls ([`Limiter::try_acquire`] and the lease's
//! fast path), with state of its own: each key's line of waiting calls. docs/design/leases.md, "Waiting
//! for tokens", has the design and its reasons.
//!
//! How a call waits, in short. The call takes its place at the back of its key's line when it
//! is made (not when first polled), and only the call at the front tries to take. A refusal
//! says when to try again (`retry_after`); the front call sleeps until then, and in leased mode
//! it is also woken by a refill of the key's lease or tokens refunded into it (the `Notify`
//! the lease actor wakes after each answer), on which it looks at the lease alone, with no
//! store call. So a waiting key costs one try per refusal's retry time, never a poll of the
//! database.
//!
//! Cancel safety. A try that may await (a store call, a wait for a refill) runs in a task of
//! its own, which holds the call's place in line until it ends: a waiter dropped meanwhile
//! takes nothing, since a take that completes after the drop is refunded (as
//! [`Limiter::refund`] does; a fallback's admission into its local bucket and outage debt)
//! before the next call in line is woken. A try the lease answers at
//! once runs in place, with nothing to cancel.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use super::cost::{lease_cost, validate_cost};
use super::decisions::lease_allowed_at;
use super::{DecidedBy, Decision, Limiter};
use crate::error::Error;
use crate::key::validate_key;

/// How many calls may wait on one key at once in one limiter, unless the builder says
/// otherwise ([`LimiterBuilder::max_waiters_per_key`](super::LimiterBuilder::max_waiters_per_key)).
pub(super) const DEFAULT_MAX_WAITERS: usize = 1_000;

/// The shortest sleep between two tries of one waiting call: a refusal whose retry time is zero
/// (a fallback's hint, rounding) must not make the call try again at once, in a loop.
const MIN_RETRY: Duration = Duration::from_millis(1);

/// Why [`Limiter::acquire_until`] ended without the tokens.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WaitError {
    /// The call can never be decided as written (a bad key, a cost that is not valid or is
    /// larger than the plan's capacity, no plan for the key): returned at once, before any
    /// wait, as [`Limiter::try_acquire`] returns it.
    #[error(transparent)]
    Invalid(#[from] Error),
    /// The key already has `limit` calls waiting in this limiter
    /// ([`LimiterBuilder::max_waiters_per_key`](super::LimiterBuilder::max_waiters_per_key)):
    /// returned at once, without a try.
    #[error(
        "{limit} calls already wait for key {key:?} in this limiter (LimiterBuilder::max_waiters_per_key)"
    )]
    TooManyWaiters {
        /// The first 64 characters of the key.
        key: String,
        /// The most calls that may wait on one key at once.
        limit: usize,
    },
    /// The deadline came before the tokens. Nothing was taken.
    #[error("the deadline passed before the tokens were there{}", refused(last))]
    DeadlinePassed {
        /// The last refusal this call got, which says when to try again
        /// ([`Decision::retry_after`]) and who refused ([`Decision::decided_by`]: the plan's
        /// fallback, when the store is down); `None` when no try of the call had answered:
        /// earlier calls of the key were still ahead of it, its first try was still in flight,
        /// or the deadline had passed when it reached the front.
        last: Option<Decision>,
    },
}

/// The end of [`WaitError::DeadlinePassed`]'s message: the last refusal, if there was one.
fn refused(last: &Option<Decision>) -> String {
    match last {
        Some(d) => format!(
            " (last refused by {:?}, retry after {:?})",
            d.decided_by, d.retry_after
        ),
        None => " (no try of this call had answered)".to_owned(),
    }
}

/// The lines of waiting calls, one per key, of one limiter.
#[derive(Debug)]
pub(super) struct Waiters {
    max_per_key: usize,
    lines: Mutex<Lines>,
}

#[derive(Debug, Default)]
struct Lines {
    /// The next call's number: numbers are never reused, so a call finds itself by its own.
    next: u64,
    /// Each key with calls waiting, and those calls in the order they were made; a key's entry
    /// goes with its last call.
    by_key: HashMap<Arc<str>, VecDeque<Turn>>,
}

/// One call in its key's line.
#[derive(Debug)]
struct Turn {
    id: u64,
    /// Woken when the call reaches the front (a permit is kept if it does not wait yet).
    wake: Arc<Notify>,
}

impl Waiters {
    /// No calls waiting; at most `max_per_key` (at least 1) on one key at once.
    pub(super) fn new(max_per_key: usize) -> Self {
        Waiters {
            max_per_key: max_per_key.max(1),
            lines: Mutex::new(Lines::default()),
        }
    }

    /// Whether call `id` is at the front of `key`'s line.
    fn at_front(&self, key: &str, id: u64) -> bool {
        let lines = self.lines.lock();
        lines
            .by_key
            .get(key)
            .and_then(VecDeque::front)
            .is_some_and(|t| t.id == id)
    }

    /// Takes call `id` out of `key`'s line, and wakes the next call when it was at the front.
    fn leave(&self, key: &str, id: u64) {
        let mut lines = self.lines.lock();
        let Some(line) = lines.by_key.get_mut(key) else {
            return;
        };
        let Some(at) = line.iter().position(|t| t.id == id) else {
            return;
        };
        line.remove(at);
        match line.front() {
            None => {
                lines.by_key.remove(key);
            }
            Some(next) if at == 0 => next.wake.notify_one(),
            Some(_) => {}
        }
    }

    /// How many calls wait on `key` now; `None` when the key has no line. For tests.
    #[cfg(test)]
    fn waiting(&self, key: &str) -> Option<usize> {
        self.lines.lock().by_key.get(key).map(VecDeque::len)
    }
}

/// A call's place in its key's line: leaving it (dropping the last share) wakes the next call.
/// Shared by the waiting call and a try of its in flight, so the next call's turn starts only
/// once both have ended.
struct Place {
    limiter: Limiter,
    key: Arc<str>,
    id: u64,
    wake: Arc<Notify>,
    /// The call's cost in nanotokens, as a lease spends it.
    nanos: u64,
}

impl Drop for Place {
    fn drop(&mut self) {
        self.limiter.inner.waiters.leave(&self.key, self.id);
    }
}

impl Limiter {
    /// Takes `cost` tokens from `key`'s bucket under the plan the policies give the key,
    /// waiting for them until `deadline` if they are not there yet.
    ///
    /// Calls of one key wait in line, in the order they were made (when this method is called,
    /// not when the future is first polled, so futures spawned in a loop keep the loop's
    /// order): only the first in line tries to take, and a later call never overtakes an
    /// earlier one, whatever their costs. Calls of [`try_acquire`](Self::try_acquire) do not
    /// wait in line. The line is this limiter's: other processes' calls are not in it.
    ///
    /// A refused try is tried again once its [`retry_after`](Decision::retry_after) has
    /// passed; in leased mode a refill of the key's lease, or tokens refunded into it, wakes
    /// the first call in line early, and it looks at the lease without a store call. No try
    /// starts after the deadline (by tokio's clock), and a try in flight at the deadline
    /// is given up. When the store is down, the plan's fallback decides each try as it does
    /// for [`try_acquire`](Self::try_acquire): an admission is returned, and a refusal waits for its
    /// retry time, within the deadline. Must be polled inside a tokio runtime (with timers),
    /// as the limiter's other calls; outside one it tries once and does not wait.
    ///
    /// ```no_run
    /// # async fn demo(limiter: tokenlease::Limiter) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use tokenlease::limiter::WaitError;
    ///
    /// let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    /// match limiter.acquire_until("jobs:customer:acme", 1, deadline).await {
    ///     Ok(_decision) => { /* run the job */ }
    ///     Err(WaitError::DeadlinePassed { .. }) => { /* put it back on the queue */ }
    ///     Err(e) => return Err(e.into()),
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`WaitError::Invalid`] at once for what [`try_acquire`](Self::try_acquire) refuses
    /// (a cost larger than the plan's capacity among them); [`WaitError::TooManyWaiters`] at
    /// once when the key already has as many calls waiting as
    /// [`LimiterBuilder::max_waiters_per_key`](super::LimiterBuilder::max_waiters_per_key)
    /// allows; [`WaitError::DeadlinePassed`] when the deadline comes first.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future takes nothing: a try that was in flight completes in a task of its
    /// own, and tokens it took from the store or a lease are given back as
    /// [`refund`](Self::refund) gives them back, before the next call in line is woken; an
    /// admission by the plan's `allow` or `local` fallback gives back its local tokens and
    /// the outage debt it recorded.
    pub fn acquire_until(
        &self,
        key: &str,
        cost: impl Into<f64>,
        deadline: Instant,
    ) -> impl Future<Output = Result<Decision, WaitError>> + Send + 'static {
        let cost = cost.into();
        let place = self.join_line(key, cost);
        async move { place?.wait(cost, deadline).await }
    }

    /// Checks the call and puts it at the back of `key`'s line.
    fn join_line(&self, key: &str, cost: f64) -> Result<Place, WaitError> {
        // The checks of `try_acquire`, in its order: what can never be allowed fails now.
        let (plan, _) = self.plan_for_key(key)?;
        validate_key(key).map_err(Error::from)?;
        let nanos = lease_cost(validate_cost(&plan, cost)?);
        let waiters = &self.inner.waiters;
        let mut lines = waiters.lines.lock();
        let lines = &mut *lines;
        let shared = match lines.by_key.get_key_value(key) {
            Some((shared, line)) if line.len() >= waiters.max_per_key => {
                return Err(WaitError::TooManyWaiters {
                    key: shared.chars().take(64).collect(),
                    limit: waiters.max_per_key,
                });
            }
            Some((shared, _)) => Arc::clone(shared),
            None => Arc::from(key),
        };
        let id = lines.next;
        lines.next += 1;
        let wake = Arc::new(Notify::new());
        lines
            .by_key
            .entry(Arc::clone(&shared))
            .or_default()
            .push_back(Turn {
                id,
                wake: Arc::clone(&wake),
            });
        Ok(Place {
            limiter: self.clone(),
            key: shared,
            id,
            wake,
            nanos,
        })
    }

    /// What wakes a wait for `key`'s refill: the `Notify` the lease actor wakes after every
    /// answer for the key's slot and a refund into its lease. `None` when the key has no lease
    /// (direct mode, or not yet seen).
    fn refill_signal(&self, key: &str) -> Option<&'static Notify> {
        self.inner.leases.get()?.refill_signal(key)
    }

    /// `cost` from `key`'s live lease, in place (no await): `None` when the lease cannot pay it.
    fn take_from_lease(&self, key: &str, cost: f64) -> Option<Result<Decision, Error>> {
        self.known(key, cost)
            .map(|k| k.map(|k| lease_allowed_at(k.capacity, k.left, k.store_remaining)))
    }
}

impl Place {
    /// The call's wait: for its turn, then for its tokens, until `deadline`.
    async fn wait(self, cost: f64, deadline: Instant) -> Result<Decision, WaitError> {
        // First in line at once, and the lease pays: served in place, before any timer is made
        // (the common case costs a line's entry and nothing more).
        if self.limiter.inner.waiters.at_front(&self.key, self.id)
            && crate::clock::instant() < deadline
            && let Some(taken) = self.limiter.take_from_lease(&self.key, cost)
        {
            return taken.map_err(WaitError::from);
        }
        let place = Arc::new(self);
        let limiter = &place.limiter;
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No timers to wait with: one try, in place, as `try_acquire` would.
            let d = limiter.try_acquire(&place.key, cost).await?;
            return if d.allowed {
                Ok(d)
            } else {
                Err(WaitError::DeadlinePassed { last: Some(d) })
            };
        };
        let mut deadline_sleep = pin!(tokio::time::sleep_until(deadline));
        // Its turn: woken by the call before it leaving the front.
        loop {
            let turn = place.wake.notified();
            if limiter.inner.waiters.at_front(&place.key, place.id) {
                break;
            }
            tokio::select! {
                biased;
                () = &mut deadline_sleep => return Err(WaitError::DeadlinePassed { last: None }),
                () = turn => {}
            }
        }
        let mut last: Option<Decision> = None;
        let mut retry = pin!(tokio::time::sleep(Duration::ZERO));
        let mut due = true;
        loop {
            if due {
                if crate::clock::instant() >= deadline {
                    return Err(WaitError::DeadlinePassed { last });
                }
                let tried = tokio::select! {
                    biased;
                    tried = place.try_once(&runtime, cost) => tried,
                    () = &mut deadline_sleep => return Err(WaitError::DeadlinePassed { last }),
                };
                // No answer: the try's task ended without one (its runtime is shutting down).
                let Some(tried) = tried else {
                    return Err(WaitError::DeadlinePassed { last });
                };
                let d = tried?;
                if d.allowed {
                    return Ok(d);
                }
                retry.set(tokio::time::sleep(d.retry_after.max(MIN_RETRY)));
                last = Some(d);
                due = false;
            }
            // A refill of the key wakes the call early. Armed before the lease is looked at,
            // so a refill that lands in between is seen by one or the other.
            let mut refilled = pin!(limiter.refill_signal(&place.key).map(Notify::notified));
            if let Some(notified) = refilled.as_mut().as_pin_mut() {
                notified.enable();
            }
            if let Some(taken) = limiter.take_from_lease(&place.key, cost) {
                return taken.map_err(WaitError::from);
            }
            tokio::select! {
                biased;
                () = &mut deadline_sleep => return Err(WaitError::DeadlinePassed { last }),
                () = &mut retry => due = true,
                () = async {
                    match refilled.as_mut().as_pin_mut() {
                        Some(notified) => notified.await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
    }

    /// One try: from the lease in place when it can pay, otherwise [`Limiter::try_acquire`] in a
    /// task of its own, which holds this place in line until it ends and gives back what it
    /// took if nobody is left to receive it. `None` when that task ended without an answer.
    async fn try_once(
        self: &Arc<Self>,
        runtime: &tokio::runtime::Handle,
        cost: f64,
    ) -> Option<Result<Decision, Error>> {
        if let Some(taken) = self.limiter.take_from_lease(&self.key, cost) {
            return Some(taken);
        }
        // The lease cannot pay: a refill of a dry bucket asks for this call's cost, not a whole
        // lease, so the call is served when the bucket holds its tokens.
        if let Some(leases) = self.limiter.inner.leases.get() {
            leases.mark_waiting(&self.key, self.nanos);
        }
        let (tx, rx) = oneshot::channel();
        let place = Arc::clone(self);
        runtime.spawn(async move {
            let out = place.limiter.try_acquire(&place.key, cost).await;
            if let Err(Ok(decision)) = tx.send(out) {
                place.give_back(cost, &decision).await;
            }
            // `place` goes here: the next call's turn starts once this try has ended.
        });
        let mut answer = Answer {
            rx,
            place: Arc::clone(self),
            cost,
        };
        (&mut answer.rx).await.ok()
    }

    /// Gives back what `decision` took: from the store or a lease, as [`Limiter::refund`]
    /// does, within the limiter's call deadline; from the fallback, the local bucket's tokens
    /// and the outage debt recorded for them. A shadow plan's let-through took nothing.
    async fn give_back(&self, cost: f64, decision: &Decision) {
        if !decision.allowed || decision.would_deny {
            return;
        }
        // The plan in force now, as the try had it a moment ago; a plan reloaded away keeps
        // the tokens (under-admission only).
        let Ok((plan, _)) = self.limiter.plan_for_key(&self.key) else {
            return;
        };
        match decision.decided_by {
            DecidedBy::Store | DecidedBy::Lease => {
                let within = self.limiter.inner.call_deadline;
                let refund = self.limiter.refund(&plan, &self.key, cost);
                let _ = tokio::time::timeout(within, refund).await;
            }
            DecidedBy::Fallback(_) => {
                if let Ok(cost) = super::cost::validate_cost(&plan, cost) {
                    let key = plan.store_key(&self.key);
                    self.limiter
                        .inner
                        .fallback
                        .give_back(&plan, &key, cost)
                        .await;
                }
            }
        }
    }
}

/// The answer of a try in its own task, awaited by the waiting call. Dropped before it was
/// received (the call was dropped, or its deadline came), it closes the channel: the task then
/// gives back what it takes, and an answer already sent is given back here.
struct Answer {
    rx: oneshot::Receiver<Result<Decision, Error>>,
    place: Arc<Place>,
    cost: f64,
}

impl Drop for Answer {
    fn drop(&mut self) {
        self.rx.close();
        if let Ok(Ok(decision)) = self.rx.try_recv()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let (place, cost) = (Arc::clone(&self.place), self.cost);
            runtime.spawn(async move { place.give_back(cost, &decision).await });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Policies;
    use crate::store::MemoryStore;

    /// A key's line goes with its last call, however its calls leave (dropped behind the front,
    /// dropped at the front, served), so a key once waited on costs nothing afterwards; a call
    /// leaving the front wakes the next, which is then served. The calls are never polled
    /// before they are dropped: the place is taken when the call is made.
    #[tokio::test(start_paused = true)]
    async fn a_keys_line_goes_with_its_last_call() {
        let policies = Policies::from_json_str(
            r#"{"plans": {"p": {"capacity": 1, "refill_per_second": 1}}, "default_plan": "p"}"#,
            None,
        )
        .expect("policy");
        let limiter = Limiter::builder(MemoryStore::new())
            .policies(policies)
            .build();
        assert!(limiter.try_acquire("k", 1.0).await.expect("valid").allowed);
        let waiters = &limiter.inner.waiters;
        let deadline = crate::clock::instant() + Duration::from_secs(10);
        let a = limiter.acquire_until("k", 1.0, deadline);
        let b = limiter.acquire_until("k", 1.0, deadline);
        let c = limiter.acquire_until("k", 1.0, deadline);
        assert_eq!(waiters.waiting("k"), Some(3));
        drop(b);
        assert_eq!(waiters.waiting("k"), Some(2));
        drop(a);
        assert_eq!(waiters.waiting("k"), Some(1));
        let d = c.await.expect("served");
        assert!(d.allowed, "{d:?}");
        assert_eq!(waiters.waiting("k"), None);
    }
}
