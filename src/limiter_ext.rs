//! Two read-only views of a [`Limiter`]'s state, kept beside `limiter/` for now (that module is
//! being split; they belong with it afterwards).

use crate::Limiter;

impl Limiter {
    /// How many distinct plans this limiter has held over its life: every plan of every policy
    /// it was built with or reloaded with, counted once each.
    ///
    /// A limiter holds at most [`policy::MAX_PLANS`](crate::policy::MAX_PLANS) and
    /// [`reload`](Limiter::reload) refuses policies that would pass that bound
    /// ([`ReloadError::TooManyPlans`](crate::ReloadError::TooManyPlans)): watch this number to
    /// see how close frequent reloads bring it.
    #[must_use]
    pub fn plans_held(&self) -> usize {
        self.registered_plans()
    }

    /// Completes once the lease actor is idle: no statement in flight, no give-back waiting to
    /// be sent again, no refill asked for and not yet sent. Completes at once when no lease
    /// actor runs (no leased plan has been used).
    ///
    /// For tests that check the store or [`lease_stats`](Limiter::lease_stats) after leased
    /// calls, and for a graceful stop that wants the counters settled before reading them:
    /// await this instead of sleeping. New calls may make the actor busy again; under steady
    /// traffic it may not complete, so bound it with a timeout.
    pub async fn leases_idle(&self) {
        self.lease_actor_idle().await;
    }
}
