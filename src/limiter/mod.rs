//! [`Limiter::try_acquire`]: the entry point.
//!
//! In direct mode every decision is one store call, and concurrent callers of one key share one
//! statement (see `coalesce.rs`). When the store fails or times out, the plan's fallback
//! decides, and the [`Decision`] says so.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::bucket::Tokens;
use crate::error::{Error, validate_key};
use crate::fallback::Fallback;
use crate::policy::{FallbackMode, Plan, Policies};
use crate::store::{AcquireRequest, Acquired, Store};

mod coalesce;

use coalesce::Coalescer;

/// Who made a [`Decision`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecidedBy {
    /// The shared store (one statement in PostgreSQL).
    Store,
    /// The plan's fallback, because the store failed or timed out.
    Fallback(FallbackMode),
}

/// The answer to one [`Limiter::try_acquire`]. A denial is a decision, not an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Whether the cost was taken and the request may go ahead.
    pub allowed: bool,
    /// Tokens left in the bucket after this decision.
    pub remaining: Tokens,
    /// The bucket's capacity.
    pub limit: Tokens,
    /// When denied: how long until the cost would be allowed if nobody else takes tokens.
    /// Zero when allowed.
    pub retry_after: Duration,
    /// How long until the bucket is full again if nobody takes tokens.
    pub reset_after: Duration,
    /// Who decided.
    pub decided_by: DecidedBy,
    /// The store's clock when it decided (PostgreSQL's `now()`); `None` when the store did not
    /// decide.
    pub store_time: Option<SystemTime>,
}

impl Decision {
    fn from_store(plan: &Plan, acquired: &Acquired) -> Decision {
        Decision {
            allowed: !acquired.granted.is_zero(),
            remaining: acquired.remaining,
            limit: plan.capacity(),
            retry_after: acquired.retry_after,
            reset_after: acquired.reset_after,
            decided_by: DecidedBy::Store,
            store_time: Some(acquired.store_now),
        }
    }
}

/// A rate limiter over a [`Store`]. Cheap to clone: clones share everything.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use tokenlease::Limiter;
/// use tokenlease::policy::Policies;
/// use tokenlease::store::PostgresStore;
///
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1/app").await?;
/// let policies = Policies::from_file("policies.json")?;
/// let limiter = Limiter::builder(store).policies(policies).build();
/// let decision = limiter.try_acquire("ratelimit:api:GET:/bookings/{bookingId}", 1.0).await?;
/// if !decision.allowed {
///     println!("retry in {:?}", decision.retry_after);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Limiter {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    store: Arc<dyn Store>,
    policies: Option<Policies>,
    coalescer: Option<Arc<Coalescer>>,
    fallback: Fallback,
}

/// Settings for a [`Limiter`].
#[derive(Debug)]
pub struct LimiterBuilder {
    store: Arc<dyn Store>,
    policies: Option<Policies>,
    coalesce: bool,
}

impl LimiterBuilder {
    /// The policies that map keys to plans for [`Limiter::try_acquire`]. Without them only
    /// [`Limiter::try_acquire_with`] can be used.
    pub fn policies(mut self, policies: Policies) -> Self {
        self.policies = Some(policies);
        self
    }

    /// Whether concurrent callers of one key share one store statement. Defaults to `true`;
    /// `false` sends one statement per call (for measuring the difference).
    pub fn coalesce(mut self, on: bool) -> Self {
        self.coalesce = on;
        self
    }

    /// The limiter.
    pub fn build(self) -> Limiter {
        Limiter {
            inner: Arc::new(Inner {
                store: self.store,
                policies: self.policies,
                coalescer: self.coalesce.then(Coalescer::new),
                fallback: Fallback::default(),
            }),
        }
    }
}

impl Limiter {
    /// Settings for a limiter over `store`.
    pub fn builder(store: impl Store) -> LimiterBuilder {
        Self::builder_shared(Arc::new(store))
    }

    /// Settings for a limiter over a store that is shared with other code.
    pub fn builder_shared(store: Arc<dyn Store>) -> LimiterBuilder {
        LimiterBuilder {
            store,
            policies: None,
            coalesce: true,
        }
    }

    /// The policies given to the builder.
    pub fn policies(&self) -> Option<&Policies> {
        self.inner.policies.as_ref()
    }

    /// The store the limiter decides with.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// Takes `cost` tokens from `key`'s bucket under the plan the policies give the key.
    ///
    /// # Errors
    ///
    /// [`Error::NoPlanForKey`] when no plan matches, and as [`try_acquire_with`](Self::try_acquire_with).
    pub async fn try_acquire(&self, key: &str, cost: f64) -> Result<Decision, Error> {
        let plan = self
            .inner
            .policies
            .as_ref()
            .and_then(|p| p.plan_for_key(key))
            .ok_or_else(|| Error::NoPlanForKey {
                key: key.chars().take(64).collect(),
            })?;
        let plan = Arc::clone(plan);
        self.try_acquire_with(&plan, key, cost).await
    }

    /// Takes `cost` tokens from `key`'s bucket under `plan`.
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
    pub async fn try_acquire_with(
        &self,
        plan: &Plan,
        key: &str,
        cost: f64,
    ) -> Result<Decision, Error> {
        validate_key(key)?;
        let cost = validate_cost(plan, cost)?;
        let bucket = *plan.bucket();
        let result = match &self.inner.coalescer {
            Some(coalescer) => coalescer.take(&self.inner.store, key, bucket, cost).await,
            None => {
                self.inner
                    .store
                    .acquire(AcquireRequest::take(key, bucket, cost))
                    .await
            }
        };
        match result {
            Ok(acquired) => Ok(Decision::from_store(plan, &acquired)),
            Err(_) => Ok(self.inner.fallback.decide(plan, key, cost).await),
        }
    }
}

/// Converts a cost to tokens, refusing what can never be allowed.
fn validate_cost(plan: &Plan, cost: f64) -> Result<Tokens, Error> {
    let invalid = |reason| Error::InvalidCost {
        cost,
        plan: plan.name().to_owned(),
        reason,
    };
    if !cost.is_finite() {
        return Err(invalid("the cost must be a finite number"));
    }
    if cost <= 0.0 {
        return Err(invalid("the cost must be greater than zero"));
    }
    let tokens = Tokens::from_f64(cost).ok_or_else(|| invalid("the cost is too large"))?;
    if tokens.is_zero() {
        return Err(invalid("the cost is below one attotoken (10⁻¹⁸ token)"));
    }
    if tokens > plan.capacity() {
        return Err(invalid("the cost is larger than the plan's capacity"));
    }
    Ok(tokens)
}
