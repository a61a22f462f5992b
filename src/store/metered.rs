//! [`Metered`]: the limiter's own calls to its store, each counted once, where it is made.
//!
//! Every statement the limiter sends goes through here, whichever part sends it (a direct-mode
//! take alone or coalesced, a lease refill, a give-back from a lease, from the HTTP layer or
//! from a caller's refund, a charge of outage debt): `tokenlease_db_calls_total{kind}` counts
//! the call as it is sent, and `tokenlease_db_errors_total{kind}` counts it once more when it
//! failed: an error, an error for any of its keys, an answer short of its requests, or (told
//! by its caller through [`Metered::timed_out`]) a deadline that passed first. So the two
//! counters have one home, and a new call site cannot send a statement uncounted.

use std::time::Duration;

use crate::metrics::{DB_CALLS, DB_ERRORS};

use super::{AcquireRequest, Acquired, GiveBack, Store, StoreError};

/// What a store call is for: its `kind` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// Tokens for one decision (direct mode), alone or coalesced with other keys'.
    Take,
    /// A lease refill.
    Lease,
    /// Tokens going back: a lease's unused ones, a refused request's, a refund.
    Return,
    /// A charge of outage debt.
    Debt,
}

impl Purpose {
    /// The `kind` label of the store-call counters.
    const fn label(self) -> &'static str {
        match self {
            Purpose::Take => "take",
            Purpose::Lease => "lease",
            Purpose::Return => "return",
            Purpose::Debt => "debt",
        }
    }
}

/// A store as the limiter calls it for one [`Purpose`]; see the [module docs](self).
pub(crate) struct Metered<'a> {
    store: &'a dyn Store,
    purpose: Purpose,
}

impl<'a> Metered<'a> {
    /// `store`'s calls for `purpose`.
    pub(crate) fn new(store: &'a dyn Store, purpose: Purpose) -> Self {
        Metered { store, purpose }
    }

    fn sent(&self) {
        metrics::counter!(DB_CALLS, "kind" => self.purpose.label()).increment(1);
    }

    fn failed(&self) {
        metrics::counter!(DB_ERRORS, "kind" => self.purpose.label()).increment(1);
    }

    /// The call's deadline passed before it answered: it counts as failed. (A call the store
    /// answered is counted by the method that made it.)
    pub(crate) fn timed_out(&self) {
        self.failed();
    }

    /// [`Store::acquire`], counted.
    pub(crate) async fn acquire(
        &self,
        request: AcquireRequest<'_>,
    ) -> Result<Acquired, StoreError> {
        self.sent();
        let answer = self.store.acquire(request).await;
        if answer.is_err() {
            self.failed();
        }
        answer
    }

    /// [`Store::acquire_each`], counted: failed when any key's answer is an error or an
    /// answer is missing.
    pub(crate) async fn acquire_each(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Vec<Result<Acquired, StoreError>> {
        self.sent();
        let answers = self.store.acquire_each(requests).await;
        if answers.len() != requests.len() || answers.iter().any(Result::is_err) {
            self.failed();
        }
        answers
    }

    /// [`Store::acquire_each`] with a deadline, counted as [`acquire_each`](Self::acquire_each)
    /// is, and as failed when the deadline passes first (`None`).
    pub(crate) async fn acquire_each_within(
        &self,
        deadline: Duration,
        requests: &[AcquireRequest<'_>],
    ) -> Option<Vec<Result<Acquired, StoreError>>> {
        let answers = tokio::time::timeout(deadline, self.acquire_each(requests)).await;
        if answers.is_err() {
            self.timed_out();
        }
        answers.ok()
    }

    /// [`Store::give_back`], counted.
    pub(crate) async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        self.sent();
        let answer = self.store.give_back(returns).await;
        if answer.is_err() {
            self.failed();
        }
        answer
    }

    /// [`Store::give_back_each`], counted: failed when any return's outcome is an error or
    /// an outcome is missing.
    pub(crate) async fn give_back_each(
        &self,
        returns: &[GiveBack<'_>],
    ) -> Vec<Result<(), StoreError>> {
        self.sent();
        let outcomes = self.store.give_back_each(returns).await;
        if outcomes.len() != returns.len() || outcomes.iter().any(Result::is_err) {
            self.failed();
        }
        outcomes
    }
}
