//! [`Limiter::try_acquire`]: the entry point.
//!
//! In direct mode every decision is one store call, and concurrent callers of one key share one
//! statement (see `coalesce.rs`). When the store fails or times out, the plan's fallback
//! decides, and the [`Decision`] says so.

use std::sync::Arc;
use std::time::Duration;

use std::future::Future;
use std::pin::Pin;
use std::sync::OnceLock;

use parking_lot::RwLock;
use std::task::{Context, Poll};
use tokio::time::Instant;

use crate::bucket::Tokens;
use crate::clock::{Clock, SharedClock};
use crate::debt::{Debt, OutageDebt};
pub use crate::decision::{DecidedBy, Decision};
use crate::error::{Error, validate_key, validate_stored_key};
use crate::fallback::Fallback;
use crate::lease::{Fast, LeaseStats, Leases, TableSettings};
use crate::plans::{self, PlanRegistry};
use crate::policy::{Plan, Policies};
use crate::store::{AcquireRequest, Acquired, GiveBack, Store};

mod coalesce;

use coalesce::Coalescer;

/// The direct-mode deadline when the store does not say what its call timeout is.
const DEFAULT_CALL_DEADLINE: Duration = Duration::from_secs(1);
/// Direct-mode statements in flight when the store does not say how many calls it runs at once.
const DEFAULT_STATEMENTS_IN_FLIGHT: usize = 4;
/// Keys in one direct-mode statement; `DESIGN.md` §7 explains the figure.
const DEFAULT_BATCH_KEYS: usize = 256;

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
    /// The policies in force ([`Limiter::reload`] swaps them).
    policies: RwLock<Option<Loaded>>,
    /// Every plan the policies have held, each once: a key's record in the lease table holds
    /// its plan's index here.
    plans: PlanRegistry,
    coalescer: Option<Arc<Coalescer>>,
    /// How long a direct-mode call waits for the store before the fallback decides.
    call_deadline: Duration,
    fallback: Fallback,
    /// The lease table and its actor, started by the first call on a leased plan.
    leases: OnceLock<Arc<Leases>>,
    table: TableSettings,
    /// The one clock everything here reads (DESIGN.md §11, "One clock").
    clock: SharedClock,
}

/// Policies as the limiter holds them: their plans interned in [`Inner::plans`].
#[derive(Debug)]
struct Loaded {
    policies: Arc<Policies>,
    /// The registry index of each of `policies`' plans, in their order.
    index: Box<[u32]>,
}

impl Loaded {
    /// Interns `policies`' plans into `registry`, all or none: [`plans::Full`] when they would
    /// take it past its bound, and then the registry is as it was.
    fn new(mut policies: Policies, registry: &PlanRegistry) -> Result<Loaded, plans::Full> {
        let given: Vec<Arc<Plan>> = policies.plans().cloned().collect();
        let entries = registry.intern_all(&given)?;
        let index = entries.iter().map(|&(i, _)| i).collect();
        let mut shared = entries.into_iter().map(|(_, plan)| Arc::clone(plan));
        policies.intern_plans(|_| shared.next().expect("an entry for each plan"));
        Ok(Loaded {
            policies: Arc::new(policies),
            index,
        })
    }
}

/// Why [`Limiter::reload`] refused new policies. The old ones stay in force.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReloadError {
    /// The limiter keeps every distinct plan it has been given until it is dropped (so that a
    /// key's record can name its plan without a lock), each once however often it is
    /// reloaded, up to `max` ([`policy::MAX_PLANS`](crate::policy::MAX_PLANS), 65,528):
    /// this reload's new plans do not fit beside those it holds. A refused reload adds none.
    /// A new limiter (a restart) starts afresh.
    #[error(
        "too many distinct plans: this reload adds {adding} to the {held} the limiter holds, \
         more than the {max} it can hold over its life (a plan is kept until the process \
         exits, once however often it is reloaded); restart the process to start afresh"
    )]
    #[non_exhaustive]
    TooManyPlans {
        /// The bound.
        max: usize,
        /// The distinct plans the limiter holds.
        held: usize,
        /// The plans of the refused policies that it does not hold.
        adding: usize,
    },
    /// The HTTP layer cannot use the policies' routes.
    #[cfg(feature = "http")]
    #[error(transparent)]
    Route(#[from] crate::policy::error::RouteConfigError),
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The actor gives every lease back and stops.
        if let Some(leases) = self.leases.get() {
            leases.stop();
        }
    }
}

/// Settings for a [`Limiter`].
#[derive(Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct LimiterBuilder {
    store: Arc<dyn Store>,
    policies: Option<Policies>,
    coalesce: bool,
    call_deadline: Option<Duration>,
    statements_in_flight: Option<usize>,
    batch_keys: usize,
    table: TableSettings,
    outage_debt: bool,
    clock: SharedClock,
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

    /// The longest a direct-mode call waits for the store; past it, the plan's fallback decides
    /// the call at once. Defaults to the store's call timeout ([`Store::call_timeout`]), or 1 s
    /// for a store that does not say.
    pub fn call_deadline(mut self, d: Duration) -> Self {
        self.call_deadline = Some(d);
        self
    }

    /// The most direct-mode statements in flight at once. Callers that arrive while this many
    /// are in flight wait, and the next statement carries all their keys.
    ///
    /// Unset (the default), the limiter chooses it as it runs, at most the store's
    /// [`Store::max_concurrent_calls`] (the pool size, or 4): from the callers that arrive while
    /// a statement is in flight, as many statements as keep about 16 keys in each when callers
    /// wait, and one statement sent at once for a lone caller. Fewer, larger statements cost
    /// the database less per decision (DESIGN.md §7); the choice is the gauge
    /// `tokenlease_statements_in_flight_limit`. Set, it is the fixed number. With
    /// [`sparse_keys_direct`](Self::sparse_keys_direct) on, one less (at least one) once a
    /// leased call has started the lease actor, since these statements then also carry sparse
    /// keys' calls, and the actor's refills must always find a connection.
    pub fn statements_in_flight(mut self, n: usize) -> Self {
        self.statements_in_flight = Some(n.max(1));
        self
    }

    /// The most keys one direct-mode statement carries. Defaults to 256 (`DESIGN.md` §7).
    pub fn batch_keys(mut self, n: usize) -> Self {
        self.batch_keys = n.max(1);
        self
    }

    /// The most keys the lease table holds. Beyond it, new keys are decided without a lease (one
    /// store call each) while the actor evicts idle keys, so memory stays bounded however many
    /// distinct keys arrive. Defaults to 1,000,000: a service with a limit per customer or per
    /// booking has that many active keys, and the table costs nothing for keys it does not
    /// hold (its memory per held key is in `DESIGN.md` §8).
    pub fn max_lease_keys(mut self, n: usize) -> Self {
        self.table.max_entries = n.max(1);
        self
    }

    /// Whether a sparse key's call (a key called less than once per lease lifetime, or one not
    /// seen yet) that its lease cannot pay goes to the direct-mode coalescer while the lease
    /// actor has a statement in flight, instead of waiting for the actor's next refill.
    /// Defaults to `false`.
    ///
    /// Measured on 2 cores (DESIGN.md §8, "Sparse keys"): with 16 callers on 100,000 quiet keys
    /// in a closed loop, where the database is the limit, it serves about a third more; at a
    /// moderate load of quiet keys it sends a quarter more statements and doubles the p99 (the
    /// coalescer sends each waiting call at once, several statements in flight, where the
    /// actor gathers every due key into one). Turn it on for a fleet whose database runs near
    /// its limit on keys called about once a second or less. With it on, the coalescer leaves
    /// the actor one connection of the pool unless
    /// [`statements_in_flight`](Self::statements_in_flight) is set.
    pub fn sparse_keys_direct(mut self, on: bool) -> Self {
        self.table.sparse_direct = on;
        self
    }

    /// How often the lease actor looks for expired and idle leases. Defaults to 50 ms; lease
    /// lifetimes are kept to within about this much.
    pub fn lease_tick(mut self, every: Duration) -> Self {
        self.table.tick = every.max(Duration::from_millis(1));
        self
    }

    /// Whether what the `allow` and `local` fallbacks admit while the store cannot answer is
    /// recorded per plan and key and charged to the shared bucket once the store answers again
    /// (`DESIGN.md` §14), for plans whose fallback keeps it on (`fallback.outage_debt`, on by
    /// default). Defaults to `true`.
    ///
    /// The ledger holds at most 100,000 keys (a new key's debt beyond them is counted in
    /// `tokenlease_outage_debt_dropped_tokens_total`, not kept), and debt unpaid 5 minutes after
    /// it was last added to is dropped and counted there too. A background task charges it once
    /// a call finds the store answering again, one store call of up to 256 keys at a time,
    /// 50 ms apart, each bounded by the call deadline.
    pub fn outage_debt(mut self, on: bool) -> Self {
        self.outage_debt = on;
        self
    }

    /// The clock the limiter reads time from: lease expiry and refill timing, call deadlines,
    /// the fallback's local buckets and the outage debt's pacing. Defaults to a
    /// [`MonotonicClock`](crate::clock::MonotonicClock), whose instants are tokio's (so a test
    /// that pauses tokio's time drives the limiter too). A call reads it once when it leaves
    /// the lease's fast path (which reads no time) and passes that reading down. The store keeps
    /// its own time (PostgreSQL's `now()`), and a [`CircuitBreaker`](crate::store::CircuitBreaker)
    /// around it its own clock ([`CircuitBreaker::clock`](crate::store::CircuitBreaker::clock)).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The limiter.
    pub fn build(self) -> Limiter {
        let call_deadline = self
            .call_deadline
            .or_else(|| self.store.call_timeout())
            .unwrap_or(DEFAULT_CALL_DEADLINE);
        let max_in_flight = self
            .statements_in_flight
            .or_else(|| self.store.max_concurrent_calls())
            .unwrap_or(DEFAULT_STATEMENTS_IN_FLIGHT)
            .max(1);
        let settings = coalesce::Settings {
            max_in_flight,
            // With sparse keys' calls beside the actor's refills on the same pool, the coalescer
            // leaves the actor one connection once it runs, unless the caller chose the number.
            leased_in_flight: if self.table.sparse_direct && self.statements_in_flight.is_none() {
                max_in_flight.saturating_sub(1).max(1)
            } else {
                max_in_flight
            },
            max_batch: self.batch_keys,
            // What the next round of statements could carry, one key per caller.
            max_queued: max_in_flight.saturating_mul(self.batch_keys),
            adaptive: self.statements_in_flight.is_none(),
        };
        // The store-call counters, and (as the registry takes them in) every plan's decision
        // counters, with the recorder installed now, at zero.
        crate::metrics::register_store_calls();
        crate::metrics::register_reloads();
        let plans = PlanRegistry::default();
        // A policy defines at most `policy::MAX_PLANS` plans (`Policies` refuses more), and a
        // new registry holds that many: never refused.
        let loaded = self
            .policies
            .map(|p| Loaded::new(p, &plans).expect("a policy's plans fit in a new plan registry"));
        let fallback = if self.outage_debt {
            let settings = crate::debt::Settings::new(call_deadline);
            let debt = Debt::new(Arc::clone(&self.store), settings, Arc::clone(&self.clock));
            Fallback::with_debt(debt, Arc::clone(&self.clock))
        } else {
            Fallback::new(Arc::clone(&self.clock))
        };
        Limiter {
            inner: Arc::new(Inner {
                store: self.store,
                plans,
                policies: RwLock::new(loaded),
                coalescer: self
                    .coalesce
                    .then(|| Coalescer::new(settings, Arc::clone(&self.clock))),
                call_deadline,
                fallback,
                leases: OnceLock::new(),
                table: self.table,
                clock: self.clock,
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
            call_deadline: None,
            statements_in_flight: None,
            batch_keys: DEFAULT_BATCH_KEYS,
            table: TableSettings {
                max_entries: 1_000_000,
                tick: Duration::from_millis(50),
                sparse_direct: false,
            },
            outage_debt: true,
            clock: crate::clock::default_clock(),
        }
    }

    /// The outage debt now: what the `allow` and `local` fallbacks admitted and is not yet
    /// charged to the shared bucket, and what was charged and dropped so far (see
    /// [`LimiterBuilder::outage_debt`]).
    pub fn outage_debt(&self) -> OutageDebt {
        self.inner.fallback.debt()
    }

    /// The policies in force: those given to the builder, or to the latest
    /// [`reload`](Self::reload).
    pub fn policies(&self) -> Option<Arc<Policies>> {
        self.inner
            .policies
            .read()
            .as_ref()
            .map(|l| Arc::clone(&l.policies))
    }

    /// Swaps in new policies while calls are in flight. No call fails or waits because of it;
    /// the next decision uses them.
    ///
    /// - A key is matched to its plan by the new key rules from now on.
    /// - A changed plan's capacity and rate take effect in the store's next statement for the
    ///   key (every statement carries the plan's bucket); a call already past its plan lookup
    ///   finishes under the plan it found.
    /// - Live leases of a changed or removed plan (and of keys whose rule now names another
    ///   plan) are closed by the lease actor in its next round, their unspent tokens given
    ///   back as at expiry; the key's next call takes a lease sized for the new plan. Until
    ///   that round (one actor wake-up) callers may still spend what such a lease holds, so
    ///   an instance can exceed the new plan's envelope by at most one old lease per key: the
    ///   same bound a lease always has (`DESIGN.md` §15).
    /// - A key whose rule is gone falls to the new default plan, or is refused with
    ///   [`Error::NoPlanForKey`] when there is none.
    ///
    /// Unchanged plans keep their leases and counters. Check a policy file before reloading it
    /// (`tokenlease check`, [`Policies::from_file`]).
    ///
    /// # Errors
    ///
    /// [`ReloadError::TooManyPlans`] when the new policies' plans that the limiter does not
    /// hold yet would take it past the distinct plans it keeps over its life
    /// ([`policy::MAX_PLANS`](crate::policy::MAX_PLANS)); nothing changes then. Plans are
    /// never forgotten while the limiter lives: reloading versions it holds costs nothing, and
    /// a reload that changes `k` plans uses `k` of the 65,528.
    pub fn reload(&self, policies: Policies) -> Result<Arc<Policies>, ReloadError> {
        let loaded = Loaded::new(policies, &self.inner.plans).map_err(|full| {
            crate::metrics::record_reload(false);
            ReloadError::TooManyPlans {
                max: plans::MAX_PLANS,
                held: full.held,
                adding: full.adding,
            }
        })?;
        crate::metrics::record_reload(true);
        let new = Arc::clone(&loaded.policies);
        *self.inner.policies.write() = Some(loaded);
        if let Some(leases) = self.inner.leases.get() {
            // Plans any policies have held, by name (not a reference to the limiter: the actor
            // holds this until its next round), so that each lease costs a look-up, not a scan.
            let mut given: std::collections::HashMap<String, Vec<Arc<Plan>>> =
                std::collections::HashMap::new();
            for plan in (0..self.inner.plans.len()).filter_map(|i| self.inner.plans.get(i)) {
                let versions = given.entry(plan.name().to_owned()).or_default();
                versions.push(Arc::clone(plan));
            }
            let policies = Arc::clone(&new);
            leases.reload(crate::lease::Stale(Box::new(
                move |key: &str, plan: &Plan, by_key: bool| {
                    // A policy plan changed or removed (a plan the limiter was never given, passed
                    // to `try_acquire_with`, is the caller's to change). A given plan's shadow
                    // twin (an HTTP shadow layer's) goes with it; a change of the shadow mode
                    // alone moves the plan's buckets to other keys, and these leases just
                    // expire.
                    let named = policies.plan(plan.name());
                    if named.is_none_or(|p| !p.same_but_shadow(plan))
                        && given
                            .get(plan.name())
                            .is_some_and(|v| v.iter().any(|p| p.same_but_shadow(plan)))
                    {
                        return true;
                    }
                    // A key reached through its prefix now names another plan.
                    by_key && policies.plan_for_key(key).is_none_or(|p| **p != *plan)
                },
            )));
        }
        Ok(new)
    }

    /// The store the limiter decides with: the one given to the builder, as given (no wrapper
    /// of the limiter's own), for reading a bucket with [`Store::inspect`]. Taking tokens from
    /// it directly bypasses the limiter's leases, fallback and metrics.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// Takes `cost` tokens from `key`'s bucket under the plan the policies give the key.
    ///
    /// A key already in the lease table is answered from its lease on the first poll, with its
    /// plan read from the table (no prefix match, no allocation, no reference count); anything
    /// else takes the full path of [`try_acquire_with`](Self::try_acquire_with).
    ///
    /// # Errors
    ///
    /// [`Error::NoPlanForKey`] when no plan matches, and as [`try_acquire_with`](Self::try_acquire_with).
    pub fn try_acquire<'a>(&'a self, key: &'a str, cost: f64) -> Acquire<'a> {
        Acquire {
            state: State::Start {
                limiter: self,
                plan: None,
                key,
                cost,
            },
        }
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
    pub fn try_acquire_with<'a>(&'a self, plan: &'a Plan, key: &'a str, cost: f64) -> Acquire<'a> {
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
    fn known(&self, key: &str, cost: f64) -> Option<Result<crate::lease::Known<'_>, Error>> {
        let leases = self.inner.leases.get()?;
        // A key in the table passed `validate_key` when it went in: only the cost is checked.
        leases.try_take_known(key, &self.inner.plans, |plan| {
            validate_cost(plan, cost).map(lease_cost)
        })
    }

    /// The part of a call that never awaits: the lease's fast path, or what the rest of the
    /// call needs to go on.
    #[inline]
    fn start<'a>(
        &'a self,
        plan: Option<&'a Plan>,
        key: &'a str,
        cost: f64,
    ) -> Result<Step<'a>, Error> {
        let (plan, chosen) = match plan {
            Some(plan) => (plan, None),
            None => {
                let (plan, index) = self.plan_for_key(key)?;
                (&**plan, Some((plan, index)))
            }
        };
        let cost_tokens = check_leased_call(plan, key, cost)?;
        if plan.shadow() {
            // The rest runs on the shadow plan's own key, made once the caller's is checked.
            validate_key(key)?;
            return Ok(Step::Shadow {
                plan,
                cost: cost_tokens,
            });
        }
        self.start_at(plan, chosen, key, cost_tokens)
    }

    /// [`start`](Self::start) once the plan is known and the cost checked, on `key`, the key
    /// under which the store keeps the plan's bucket ([`Plan::store_key`]): the caller's key
    /// checked in full but for its NUL bytes, or a shadow plan's key.
    #[inline]
    fn start_at<'a>(
        &'a self,
        plan: &'a Plan,
        chosen: Option<(&'a Arc<Plan>, u32)>,
        key: &str,
        cost_tokens: Tokens,
    ) -> Result<Step<'a>, Error> {
        let Some(settings) = plan.lease() else {
            validate_stored_key(key)?;
            return Ok(Step::Direct {
                plan,
                cost: cost_tokens,
            });
        };
        let nanos = lease_cost(cost_tokens);
        let leases = self.leases();
        let fast = leases.try_take(plan, chosen, key, nanos, &self.inner.plans);
        if let Fast::Taken {
            left,
            store_remaining,
        } = fast
        {
            return Ok(Step::Done(lease_allowed(plan, left, store_remaining)));
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
        Ok(match fast {
            Fast::Short(slot) if !settings.max_wait.is_zero() => Step::Wait {
                plan,
                cost: cost_tokens,
                slot,
                max_wait: settings.max_wait,
            },
            Fast::Dry { retry_after } => {
                Step::Done(self.recorded(plan, lease_denied(plan, retry_after)))
            }
            Fast::Failing | Fast::Short(_) => Step::Fallback {
                plan,
                cost: cost_tokens,
            },
            Fast::Sparse(slot) => Step::Sparse {
                plan,
                cost: cost_tokens,
                slot,
            },
            Fast::NoRoom | Fast::Taken { .. } | Fast::Gone => Step::Direct {
                plan,
                cost: cost_tokens,
            },
        })
    }

    /// Counts a decision made off the fast path under `plan` (on its counters in the plan
    /// registry), after [`shadowed`] let a shadow plan's denial through.
    fn recorded(&self, plan: &Plan, decision: Decision) -> Decision {
        let decision = shadowed(plan, decision);
        crate::metrics::record(&self.inner.plans.counters_of(plan), &decision);
        decision
    }

    /// The plan's fallback decides `cost` on `key` at `now`: the store failed, timed out, or
    /// cannot be asked.
    async fn decide_by_fallback(
        &self,
        plan: &Plan,
        key: &str,
        cost: Tokens,
        now: Instant,
    ) -> Decision {
        let counters = self.inner.plans.counters_of(plan);
        self.inner
            .fallback
            .decide(plan, &counters, key, cost, now)
            .await
    }

    /// Registers `plan`'s decision counters now (at zero, with the recorder installed now), for
    /// a plan that callers will name ([`try_acquire_with`](Self::try_acquire_with)): the HTTP
    /// layer's shadow twins, whose series exist from the layer's build.
    #[cfg(feature = "http")]
    pub(crate) fn register_plan(&self, plan: &Plan) {
        self.inner.plans.counters_of(plan);
    }

    /// Distinct plans given to the limiter over its life.
    pub(crate) fn registered_plans(&self) -> usize {
        self.inner.plans.len()
    }

    /// The plan the policies give `key`, and its index among them.
    fn plan_for_key(&self, key: &str) -> Result<(&Arc<Plan>, u32), Error> {
        let no_plan = || Error::NoPlanForKey {
            key: key.chars().take(64).collect(),
        };
        let index = {
            let loaded = self.inner.policies.read();
            loaded
                .as_ref()
                .and_then(|l| Some(l.index[l.policies.plan_index_for_key(key)?]))
                .ok_or_else(no_plan)?
        };
        let plan = self.inner.plans.get(index as usize).ok_or_else(no_plan)?;
        Ok((plan, index))
    }

    /// The rest of a call that [`start`](Self::start) could not finish without waiting.
    /// `named`, `key` and `asked` are the call's own plan, key and cost: a call whose slot was
    /// retired while it waited starts over with them, once (`again`). `now`: the limiter's
    /// clock when this part of the call began, read once and passed down.
    async fn finish(
        &self,
        step: Step<'_>,
        now: Instant,
        named: Option<&Plan>,
        key: &str,
        asked: f64,
        again: bool,
    ) -> Result<Decision, Error> {
        match step {
            // A shadow plan's call runs on its own key (`Plan::store_key`), from the start.
            Step::Shadow { plan, cost } => {
                let stored = plan.store_key(key);
                let step = self.start_at(plan, None, &stored, cost)?;
                self.finish_at(step, now, named, key, &stored, asked, again)
                    .await
            }
            step => {
                self.finish_at(step, now, named, key, key, asked, again)
                    .await
            }
        }
    }

    /// [`finish`](Self::finish) on `stored`, the key under which the store keeps the plan's
    /// bucket ([`Plan::store_key`]).
    #[allow(clippy::too_many_arguments)]
    async fn finish_at(
        &self,
        step: Step<'_>,
        now: Instant,
        named: Option<&Plan>,
        key: &str,
        stored: &str,
        asked: f64,
        again: bool,
    ) -> Result<Decision, Error> {
        match step {
            Step::Done(decision) => Ok(decision),
            // Made by `start` alone, and answered by `finish`; `start_at` never makes it.
            Step::Shadow { .. } => Box::pin(self.finish(step, now, named, key, asked, again)).await,
            Step::Wait {
                plan,
                cost,
                slot,
                max_wait,
            } => {
                let leases = self.leases();
                let waited = leases
                    .wait(slot, lease_cost(cost), now + max_wait, &self.inner.plans)
                    .await;
                // The call waited: what decides it next reads the clock once more.
                let now = self.inner.clock.instant();
                match waited {
                    Fast::Taken {
                        left,
                        store_remaining,
                    } => {
                        // A refill landed: the store answers.
                        self.inner.fallback.tidy();
                        Ok(lease_allowed(plan, left, store_remaining))
                    }
                    Fast::Dry { retry_after } => {
                        Ok(self.recorded(plan, lease_denied(plan, retry_after)))
                    }
                    Fast::Failing | Fast::Short(_) => {
                        Ok(self
                            .recorded(plan, self.decide_by_fallback(plan, stored, cost, now).await))
                    }
                    // A reload retired the slot (its plan changed): start over, so the call
                    // is decided under the plan in force now, on the key's new slot.
                    Fast::Gone if again => {
                        let step = self.start(named, key, asked)?;
                        Box::pin(self.finish(step, now, named, key, asked, false)).await
                    }
                    Fast::NoRoom | Fast::Sparse(..) | Fast::Gone => self
                        .direct(plan, stored, cost, now)
                        .await
                        .map(|d| self.recorded(plan, d)),
                }
            }
            Step::Fallback { plan, cost } => {
                Ok(self.recorded(plan, self.decide_by_fallback(plan, stored, cost, now).await))
            }
            Step::Direct { plan, cost } => self
                .direct(plan, stored, cost, now)
                .await
                .map(|d| self.recorded(plan, d)),
            Step::Sparse { plan, cost, slot } => {
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
                self.leases()
                    .record_direct(&slot, spent, denied_for, failed);
                Ok(self.recorded(plan, decision))
            }
        }
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
        let id =
            (std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), key) >> 1) as i64;
        let give = GiveBack {
            id,
            key,
            bucket: *plan.bucket(),
            amount: cost,
            lease: None,
        };
        metrics::counter!(crate::metrics::DB_CALLS, "kind" => "return").increment(1);
        let credited = self.inner.store.give_back(&[give]).await.is_ok();
        if !credited {
            metrics::counter!(crate::metrics::DB_ERRORS, "kind" => "return").increment(1);
        }
        Ok(credited)
    }

    /// Counters of the lease table: tokens leased, returned, stranded and outstanding. `None`
    /// before the first call on a leased plan.
    pub fn lease_stats(&self) -> Option<LeaseStats> {
        self.inner.leases.get().map(|l| l.stats())
    }

    /// Gives every lease back to the store and stops the lease actor; waits until done. Later
    /// calls on leased plans are decided without leases (one store call each).
    pub async fn shutdown(&self) {
        if let Some(leases) = self.inner.leases.get() {
            leases.shutdown().await;
        }
    }

    /// Waits until the lease actor is idle: no statement in flight, no give-back to send again,
    /// no refill asked for and not yet sent. Returns at once when no actor runs. For tests
    /// (through `crate::__private::lease_actor_idle`), which await this instead of sleeping.
    pub(crate) async fn lease_actor_idle(&self) {
        if let Some(leases) = self.inner.leases.get() {
            leases.until_idle().await;
        }
    }

    fn leases(&self) -> &Arc<Leases> {
        self.inner.leases.get_or_init(|| {
            if let Some(coalescer) = &self.inner.coalescer {
                coalescer.share_with_leases();
            }
            Leases::start(
                Arc::clone(&self.inner.store),
                self.inner.table,
                Arc::clone(&self.inner.clock),
            )
        })
    }

    /// Direct mode: one store statement (shared with concurrent callers), answered by the call
    /// deadline (from `now`, the call's reading of the clock); the fallback decides whatever
    /// the store did not answer in time.
    async fn direct(
        &self,
        plan: &Plan,
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
                metrics::counter!(crate::metrics::DB_CALLS, "kind" => "take").increment(1);
                let call = self
                    .inner
                    .store
                    .acquire(AcquireRequest::take(key, bucket, cost));
                match tokio::time::timeout_at(deadline, call).await {
                    Ok(Ok(acquired)) => Ok(acquired),
                    Ok(Err(_)) | Err(_) => {
                        metrics::counter!(crate::metrics::DB_ERRORS, "kind" => "take").increment(1);
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
                let now = self.inner.clock.instant();
                Ok(self.decide_by_fallback(plan, key, cost, now).await)
            }
        }
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
    /// The rest of the call, when it started waiting, and the clock that said so.
    Waiting(
        Pin<Box<dyn Future<Output = Result<Decision, Error>> + Send + 'a>>,
        Instant,
        &'a SharedClock,
    ),
    /// Decided, and handed over on the next poll (the task yielded for tokio's budget). Boxed:
    /// rare, and a `Decision` inline would make every `Acquire` as large as one.
    Decided(Box<Decision>),
    Done,
}

/// Where [`Limiter::start`] left a call.
enum Step<'a> {
    /// Decided.
    Done(Decision),
    /// A shadow plan's call: the rest runs on the plan's own key ([`Plan::store_key`]), made
    /// in [`Limiter::finish`] (`start` borrows the caller's key and cannot hold a new one).
    Shadow { plan: &'a Plan, cost: Tokens },
    /// Wait for the slot's refill for at most `max_wait` (from the call's reading of the clock,
    /// taken when it leaves [`Limiter::start`]).
    Wait {
        plan: &'a Plan,
        cost: Tokens,
        slot: crate::lease::SlotRef,
        max_wait: Duration,
    },
    /// The fallback decides.
    Fallback { plan: &'a Plan, cost: Tokens },
    /// One store call decides (direct mode, or no room in the lease table).
    Direct { plan: &'a Plan, cost: Tokens },
    /// One store call decides a sparse key's call (`Fast::Sparse`), and the lease table hears
    /// of it.
    Sparse {
        plan: &'a Plan,
        cost: Tokens,
        slot: crate::lease::SlotRef,
    },
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
        // store-to-load forwarding (DESIGN.md §8, "The fast path").
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
                Ok(k) => Ok(lease_allowed(k.plan, k.left, k.store_remaining)),
                Err(e) => Err(e),
            });
        }
        let (mut waiting, since, clock) = match std::mem::replace(&mut self.state, State::Done) {
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
                    let clock = &limiter.inner.clock;
                    let now = clock.instant();
                    (
                        Box::pin(limiter.finish(step, now, plan, key, cost, true))
                            as Pin<Box<dyn Future<Output = _> + Send + '_>>,
                        now,
                        clock,
                    )
                }
            },
            State::Decided(decision) => return Poll::Ready(Ok(*decision)),
            State::Waiting(waiting, since, clock) => (waiting, since, clock),
            State::Done => panic!("`Acquire` polled after it completed"),
        };
        match waiting.as_mut().poll(cx) {
            Poll::Ready(out) => {
                if let Ok(decision) = &out {
                    let took = clock.instant().saturating_duration_since(since);
                    crate::metrics::record_latency(decision.decided_by, took);
                }
                Poll::Ready(out)
            }
            Poll::Pending => {
                self.state = State::Waiting(waiting, since, clock);
                Poll::Pending
            }
        }
    }
}

/// A shadow plan's denial becomes an admission marked [`Decision::would_deny`]; every other
/// decision is returned as it is. Nothing else changes: no token was taken for it.
#[inline]
fn shadowed(plan: &Plan, mut decision: Decision) -> Decision {
    if plan.shadow() && !decision.allowed {
        decision.allowed = true;
        decision.would_deny = true;
    }
    decision
}

/// A cost in whole nanotokens, the lease word's unit (rounded up).
/// Checks a call's cost and its key's length and first byte (the one reserved for shadow
/// plans' keys), leaving the key's scan for NUL bytes to the caller: a key the lease table holds was scanned when it went in (`Leases::try_take` refuses
/// one with a NUL), so a call answered from a lease needs no scan, and every other answer runs
/// [`validate_key`] in full before it is given. Errors come in [`validate_key`]'s order, key
/// before cost.
#[inline]
fn check_leased_call(plan: &Plan, key: &str, cost: f64) -> Result<Tokens, Error> {
    if key.is_empty()
        || key.len() > crate::error::MAX_KEY_BYTES
        || key.as_bytes()[0] == crate::error::RESERVED_KEY_PREFIX as u8
    {
        validate_key(key)?;
    }
    match validate_cost(plan, cost) {
        Ok(tokens) => Ok(tokens),
        Err(bad_cost) => {
            validate_key(key)?;
            Err(bad_cost)
        }
    }
}

/// `cost` in nanotokens, rounded up: what a lease word spends.
#[inline]
fn lease_cost(cost: Tokens) -> u64 {
    let atto = cost.as_atto();
    // Costs up to 18 tokens fit in a u64 of attotokens, where a division by a constant is a
    // multiply; a u128 division is a library call (about a tenth of the 1-key fast path).
    match u64::try_from(atto) {
        Ok(atto) => atto.div_ceil(1_000_000_000),
        Err(_) => u64::try_from(atto.div_ceil(1_000_000_000)).unwrap_or(u64::MAX),
    }
}

/// The store's answer as a decision.
fn from_store(plan: &Plan, acquired: &Acquired) -> Decision {
    Decision {
        allowed: !acquired.granted.is_zero(),
        would_deny: false,
        remaining: Some(std::cmp::min(acquired.remaining, plan.capacity())),
        limit: plan.capacity(),
        retry_after: acquired.retry_after,
        reset_after: Some(acquired.reset_after),
        decided_by: DecidedBy::Store,
        store_time: Some(acquired.store_now),
    }
}

fn lease_allowed(plan: &Plan, left: u64, store_remaining: u64) -> Decision {
    Decision {
        allowed: true,
        would_deny: false,
        // The lease's tokens were taken from the bucket: beside what the bucket held then,
        // they can add up to more than it ever holds.
        remaining: Some(std::cmp::min(
            Tokens::from_nanos(u128::from(left) + u128::from(store_remaining)),
            plan.capacity(),
        )),
        limit: plan.capacity(),
        retry_after: Duration::ZERO,
        // The lease spends tokens granted earlier: the bucket's fill is not known here.
        reset_after: None,
        decided_by: DecidedBy::Lease,
        store_time: None,
    }
}

fn lease_denied(plan: &Plan, retry_after: u64) -> Decision {
    Decision {
        allowed: false,
        would_deny: false,
        remaining: Some(Tokens::ZERO),
        limit: plan.capacity(),
        retry_after: Duration::from_nanos(retry_after),
        // The store's last word says when the cost is back, not when the bucket is full.
        reset_after: None,
        decided_by: DecidedBy::Lease,
        store_time: None,
    }
}

/// Converts a cost to tokens, refusing what can never be allowed. A whole cost within the
/// capacity (the common case) is answered inline; the rest, errors included, out of line.
#[inline]
fn validate_cost(plan: &Plan, cost: f64) -> Result<Tokens, Error> {
    if (1.0..=9_007_199_254_740_992.0).contains(&cost) && cost == (cost as u64) as f64 {
        let tokens = Tokens::whole(cost as u64);
        if tokens <= plan.capacity() {
            return Ok(tokens);
        }
    }
    validate_cost_slow(plan, cost)
}

/// [`validate_cost`] for a fractional, invalid or too large cost.
#[cold]
#[inline(never)]
fn validate_cost_slow(plan: &Plan, cost: f64) -> Result<Tokens, Error> {
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
    // Every store counts in whole nanotokens (10⁻⁹ token; PostgreSQL's bigint columns): a
    // finer cost is rounded up to the next one, so it is never charged less than asked.
    let tokens = Tokens::from_nanos(tokens.as_atto().div_ceil(1_000_000_000));
    if tokens.is_zero() {
        return Err(invalid("the cost is below one nanotoken (10⁻⁹ token)"));
    }
    if tokens > plan.capacity() {
        return Err(invalid("the cost is larger than the plan's capacity"));
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The u64 path and the u128 path round up alike, on both sides of the boundary between them.
    #[test]
    fn lease_cost_rounds_up_to_whole_nanotokens() {
        let atto = |n: u128| lease_cost(Tokens::from_atto(n));
        assert_eq!(atto(1), 1);
        assert_eq!(atto(1_000_000_000), 1);
        assert_eq!(atto(1_000_000_001), 2);
        assert_eq!(lease_cost(Tokens::whole(1)), 1_000_000_000);
        let edge = u128::from(u64::MAX);
        for n in [edge - 1, edge, edge + 1, edge + 1_000_000_000] {
            assert_eq!(u128::from(atto(n)), n.div_ceil(1_000_000_000), "{n}");
        }
        assert_eq!(
            lease_cost(Tokens::whole(1_000_000)),
            1_000_000 * 1_000_000_000
        );
    }

    /// A lease's estimate of what is left (its own tokens plus the bucket's count at its last
    /// refill) never says more than the capacity.
    #[test]
    fn a_lease_decision_never_reports_more_than_the_capacity() {
        let plan = Plan::new(
            "p",
            crate::bucket::BucketConfig::new(
                Tokens::whole(200),
                crate::bucket::Rate::per_second(100).expect("rate"),
            )
            .expect("bucket"),
        );
        let nanos = |n: u64| n * 1_000_000_000;
        let d = lease_allowed(&plan, nanos(28), nanos(180));
        assert_eq!(d.remaining, Some(Tokens::whole(200)), "{d:?}");
        assert_eq!(d.limit, Tokens::whole(200));
        let d = lease_allowed(&plan, nanos(8), nanos(180));
        assert_eq!(d.remaining, Some(Tokens::whole(188)), "{d:?}");
    }

    /// A decision states only what its decider knows: the store says when the bucket is full
    /// again, a lease (which spends tokens granted earlier without reading the bucket) does
    /// not, and says so with `None` rather than a zero that would claim a full bucket.
    #[test]
    fn lease_decisions_do_not_claim_a_time_to_full() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let policies = Policies::from_json_str(
                r#"{"plans": {
                        "leased": {"capacity": 1000, "refill_per_second": 10, "lease": {}},
                        "direct": {"capacity": 1000, "refill_per_second": 10}},
                    "keys": [{"prefix": "d:", "plan": "direct"}],
                    "default_plan": "leased"}"#,
                None,
            )
            .expect("policy");
            let limiter = Limiter::builder(crate::store::MemoryStore::new())
                .policies(policies)
                .build();
            let d = limiter.try_acquire("d:1", 1.0).await.expect("valid");
            assert_eq!(d.decided_by, DecidedBy::Store);
            assert_eq!(d.remaining, Some(Tokens::whole(999)));
            // One token short of 1000 at 10 per second: 100 ms to full.
            assert_eq!(d.reset_after, Some(Duration::from_millis(100)));
            let mut leased = 0;
            for _ in 0..50 {
                let d = limiter.try_acquire("k", 1.0).await.expect("valid");
                assert!(d.allowed);
                if d.decided_by == DecidedBy::Lease {
                    leased += 1;
                    assert_eq!(d.reset_after, None, "{d:?}");
                    assert!(d.remaining.is_some(), "{d:?}");
                }
                // The key's first calls are store calls until the actor has seen its demand,
                // which takes time to pass (the clock is paused: this advances it).
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            assert!(leased > 0, "no decision came from a lease");
        });
    }

    /// A key first spent from through its plan by name (`try_acquire_now_with`) and then
    /// through `try_acquire` gets its policy index in the lease table's record on that call,
    /// so later `try_acquire` calls find the plan there instead of matching the key's prefixes.
    #[test]
    fn try_acquire_records_the_plan_of_a_key_first_seen_by_name() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let policies = Policies::from_json_str(
                r#"{"plans": {"p": {"capacity": 1000, "refill_per_second": 1000, "lease": {}}},
                    "default_plan": "p"}"#,
                None,
            )
            .expect("policy");
            let plan = policies.default_plan().expect("plan").clone();
            let limiter = Limiter::builder(crate::store::MemoryStore::new())
                .policies(policies)
                .build();
            let d = limiter
                .try_acquire_with(&plan, "k", 1.0)
                .await
                .expect("valid");
            assert!(d.allowed);
            let leases = limiter.inner.leases.get().expect("leased");
            assert_eq!(leases.plan_index("k"), Some(crate::lease::NO_PLAN));
            let d = limiter.try_acquire("k", 1.0).await.expect("valid");
            assert!(d.allowed);
            assert_eq!(leases.plan_index("k"), Some(0));
        });
    }

    /// The limiter's outage-debt switch, on by default: the ledger's own tests are in
    /// `debt/tests.rs`, whose failing store this shares.
    #[tokio::test(start_paused = true)]
    async fn the_builder_switch() {
        use std::sync::atomic::Ordering;

        use crate::debt::tests::{Switch, plan, whole};
        use crate::policy::FallbackMode;

        let p = Arc::new(plan("p", 10, 1.0, FallbackMode::Allow));
        for on in [true, false] {
            let store = Switch::default();
            store.failing.store(true, Ordering::SeqCst);
            let mut builder = Limiter::builder(store);
            if !on {
                builder = builder.outage_debt(false);
            }
            let limiter = builder.build();
            let d = limiter.try_acquire_with(&p, "k", 2.0).await.unwrap();
            assert!(d.allowed);
            let expect = if on { whole(2) } else { Tokens::ZERO };
            assert_eq!(limiter.outage_debt().outstanding, expect, "switch {on}");
        }
    }
}
