//! The policies a limiter holds: which plan a key gets, [`Limiter::reload`] swapping them
//! while calls run (and [`ReloadError`] when it refuses), and the plan registry that holds
//! the plans in force.
//!
//! Apart because it changes at its own pace, by reloads, and what it must keep true (no call
//! fails or waits because of a reload; a stale lease is retired) is not the call path's.

use std::sync::Arc;

use super::Limiter;
use crate::error::Error;
use crate::metrics::mode_label;
use crate::plans::{self, PlanRegistry};
use crate::policy::{Plan, Policies};

/// Policies as the limiter holds them: their plans interned in [`Inner::plans`](super::Inner::plans).
#[derive(Debug)]
pub(super) struct Loaded {
    policies: Arc<Policies>,
    /// The registry index of each of `policies`' plans, in their order.
    index: Box<[u32]>,
}

impl Loaded {
    /// The policies' plan equal to `plan` (by name, then in full) and its registry index.
    #[cfg(feature = "http")]
    pub(super) fn find(&self, plan: &Plan) -> Option<(&Arc<Plan>, u32)> {
        let i = self
            .policies
            .plans()
            .position(|p| p.name() == plan.name())?;
        let shared = self.policies.plans().nth(i)?;
        (**shared == *plan).then(|| (shared, self.index[i]))
    }

    /// Interns `policies`' plans into `registry`, all or none: [`plans::Full`] when they would
    /// take it past its bound, and then the registry is as it was.
    pub(super) fn new(
        mut policies: Policies,
        registry: &PlanRegistry,
    ) -> Result<Loaded, plans::Full> {
        let given: Vec<Arc<Plan>> = policies.plans().cloned().collect();
        let entries = registry.intern_all(&given)?;
        for plan in &given {
            registry.counters_of(plan).hold(true);
        }
        let index = entries.iter().map(|&(i, _)| i).collect();
        let mut shared = entries.into_iter().map(|(_, plan)| plan);
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
    /// The limiter holds the distinct plans in force, up to `max`
    /// ([`policy::MAX_PLANS`](crate::policy::MAX_PLANS), 65,528), and a reload takes in its
    /// new plans before it lets go of those it replaces: this reload's new plans do not fit
    /// beside those in force. A refused reload adds none. A reload to a policy that keeps
    /// more of the plans in force (or fewer plans) first, then this one, fits.
    #[error(
        "too many distinct plans: this reload adds {adding} to the {held} the limiter holds, \
         more than the {max} it can hold at once (a reload takes in its new plans before it \
         lets go of those it replaces); reload a policy that changes fewer plans first"
    )]
    #[non_exhaustive]
    TooManyPlans {
        /// The bound.
        max: usize,
        /// The distinct plans the limiter holds (those in force).
        held: usize,
        /// The plans of the refused policies that it does not hold.
        adding: usize,
    },
    /// The HTTP layer cannot use the policies' routes.
    #[cfg(feature = "http")]
    #[error(transparent)]
    Route(#[from] crate::policy::error::RouteConfigError),
}

impl Limiter {
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
    ///   same bound a lease always has (`docs/design/reload-and-shadow.md`).
    /// - A key whose rule is gone falls to the new default plan, or is refused with
    ///   [`Error::NoPlanForKey`] when there is none.
    ///
    /// Unchanged plans keep their leases and counters. Check a policy file before reloading it
    /// (`tokenlease check`, [`Policies::from_file`]).
    ///
    /// # Errors
    ///
    /// [`ReloadError::TooManyPlans`] when the new policies' plans that the limiter does not
    /// hold yet, beside those in force, would pass the distinct plans it holds at once
    /// ([`policy::MAX_PLANS`](crate::policy::MAX_PLANS)); nothing changes then. Once the new
    /// policies are in force the limiter lets go of every plan they do not hold (its entry,
    /// its counters, its metric handles), so reloads cost nothing over time.
    pub fn reload(&self, policies: Policies) -> Result<Arc<Policies>, ReloadError> {
        let _one = self.inner.plans.reloading();
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
        let keep = loaded.index.clone();
        // Plans the registry held until now, the removed ones with the rest, by name (not a
        // reference to the limiter: the actor holds this until its next round), so that each
        // lease costs a look-up, not a scan.
        let leases = self.inner.leases.get();
        let mut given: std::collections::HashMap<String, Vec<Arc<Plan>>> =
            std::collections::HashMap::new();
        if leases.is_some() {
            self.inner.plans.each_plan(|plan| {
                let versions = given.entry(plan.name().to_owned()).or_default();
                versions.push(Arc::clone(plan));
            });
        }
        *self.inner.policies.write() = Some(loaded);
        self.release_removed_plans();
        // The entries of plans no policy holds now go; a key's record that names one finds
        // its slot empty, or another plan's entry it can tell apart (`plans.rs`).
        self.inner.plans.release_all_but(&keep);
        self.inner.plans.forget_released_counters();
        if let Some(leases) = leases {
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

    /// Registers `plan`'s decision counters now (at zero, with the recorder installed now), for
    /// a plan that callers will name ([`try_acquire_with`](Self::try_acquire_with)): the HTTP
    /// layer's shadow twins, whose series exist from the layer's build. The twin of a plan in
    /// force has its counters released with that plan's by a reload that removes it.
    #[cfg(feature = "http")]
    pub(crate) fn register_plan(&self, plan: &Plan) {
        let policy = self.policies().is_some_and(|p| {
            p.plan(plan.name())
                .is_some_and(|p| mode_label(p.fallback().mode) == mode_label(plan.fallback().mode))
        });
        self.inner.plans.counters_of(plan).hold(policy);
    }

    /// Lets go of the metric handles of every plan of earlier policies (and of its shadow twin)
    /// that no plan of the policies in force has the name and fallback mode of, so that a
    /// recorder which forgets the series nobody holds forgets theirs (docs/metrics.md), and
    /// holds those of the plans in force. Reloads that race settle on the policies in force
    /// when the last of them gets here.
    fn release_removed_plans(&self) {
        static ONE_AT_A_TIME: parking_lot::Mutex<()> = parking_lot::Mutex::new(());
        let _one = ONE_AT_A_TIME.lock();
        let Some(policies) = self.policies() else {
            return;
        };
        let mut in_force = std::collections::HashSet::new();
        for plan in policies.plans() {
            self.inner.plans.counters_of(plan).hold(true);
            in_force.insert((plan.name(), mode_label(plan.fallback().mode)));
        }
        self.inner.plans.each_counters(|counters| {
            if counters.is_policy() && counters.is_held() && !in_force.contains(&counters.labels())
            {
                counters.release();
            }
        });
    }

    /// How many distinct plans this limiter holds: those of the policies in force, each once
    /// (a reload lets go of the plans it replaced before it returns).
    ///
    /// A limiter holds at most [`policy::MAX_PLANS`](crate::policy::MAX_PLANS), and
    /// [`reload`](Limiter::reload) refuses policies whose new plans would pass that bound
    /// beside those in force ([`ReloadError::TooManyPlans`]).
    #[must_use]
    pub fn plans_held(&self) -> usize {
        self.inner.plans.len()
    }

    /// The plan the policies give `key` (the registry's shared `Arc`, which the call holds:
    /// a reload may release the registry's entry while the call runs), and its index in the
    /// registry.
    pub(super) fn plan_for_key(&self, key: &str) -> Result<(Arc<Plan>, u32), Error> {
        let no_plan = || Error::NoPlanForKey {
            key: key.chars().take(64).collect(),
        };
        let loaded = self.inner.policies.read();
        loaded
            .as_ref()
            .and_then(|l| {
                let i = l.policies.plan_index_for_key(key)?;
                let plan = l.policies.plans().nth(i)?;
                Some((Arc::clone(plan), l.index[i]))
            })
            .ok_or_else(no_plan)
    }
}
