//! [`LimiterBuilder`]: a limiter's settings and their defaults, and the [`Limiter`] it builds.
//!
//! Apart because it runs once, before any call: what it chooses (the direct-mode deadline
//! and statements in flight, the lease table's bounds, the fallback with or without outage
//! debt) is read by the other files as the limiter's settings.

use std::sync::Arc;
use std::sync::OnceLock;
use std::time::Duration;

use parking_lot::RwLock;

use super::coalesce::{self, Coalescer};
use super::policies::Loaded;
use super::wait::{DEFAULT_MAX_WAITERS, Waiters};
use super::{Inner, Limiter};
use crate::debt::Debt;
use crate::fallback::Fallback;
use crate::lease::TableSettings;
use crate::plans::PlanRegistry;
use crate::policy::Policies;
use crate::store::Store;

/// The direct-mode deadline when the store does not say what its call timeout is.
const DEFAULT_CALL_DEADLINE: Duration = Duration::from_secs(1);
/// Direct-mode statements in flight when the store does not say how many calls it runs at once.
const DEFAULT_STATEMENTS_IN_FLIGHT: usize = 4;
/// Keys in one direct-mode statement; `docs/design/direct-mode.md` explains the figure.
const DEFAULT_BATCH_KEYS: usize = 256;

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
    max_waiters: usize,
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
    /// the database less per decision (docs/design/direct-mode.md); the choice is the gauge
    /// `tokenlease_statements_in_flight_limit`. Set, it is the fixed number. With
    /// [`sparse_keys_direct`](Self::sparse_keys_direct) on, one less (at least one) once a
    /// leased call has started the lease actor, since these statements then also carry sparse
    /// keys' calls, and the actor's refills must always find a connection.
    pub fn statements_in_flight(mut self, n: usize) -> Self {
        self.statements_in_flight = Some(n.max(1));
        self
    }

    /// The most keys one direct-mode statement carries. Defaults to 256 (`docs/design/direct-mode.md`).
    pub fn batch_keys(mut self, n: usize) -> Self {
        self.batch_keys = n.max(1);
        self
    }

    /// The most keys the lease table holds. Beyond it, new keys are decided without a lease (one
    /// store call each) while the actor evicts idle keys, so memory stays bounded however many
    /// distinct keys arrive. Defaults to 1,000,000: a service with a limit per customer or per
    /// booking has that many active keys, and the table costs nothing for keys it does not
    /// hold (its memory per held key is in `docs/design/leases.md`).
    pub fn max_lease_keys(mut self, n: usize) -> Self {
        self.table.max_entries = n.max(1);
        self
    }

    /// Whether a sparse key's call (a key called less than once per lease lifetime, or one not
    /// seen yet) that its lease cannot pay goes to the direct-mode coalescer while the lease
    /// actor has a statement in flight, instead of waiting for the actor's next refill.
    /// Defaults to `false`.
    ///
    /// Measured on 2 cores (docs/design/leases.md, "Sparse keys"): with 16 callers on 100,000 quiet keys
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
    /// (`docs/design/outage-debt.md`), for plans whose fallback keeps it on (`fallback.outage_debt`, on by
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

    /// The most calls of [`Limiter::acquire_until`] that may wait on one key at once in this
    /// limiter (at least 1); one more is refused at once with
    /// [`WaitError::TooManyWaiters`](super::WaitError::TooManyWaiters). Defaults to 1,000. A
    /// waiting call holds a few hundred bytes and no connection, so the bound is there to turn
    /// a queue that only grows (callers arriving faster than the key's rate, for ever) into an
    /// error the caller sees, not to save memory.
    pub fn max_waiters_per_key(mut self, n: usize) -> Self {
        self.max_waiters = n.max(1);
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
            Fallback::with_debt(Debt::new(Arc::clone(&self.store), settings))
        } else {
            Fallback::new()
        };
        Limiter {
            inner: Arc::new(Inner {
                store: self.store,
                plans,
                policies: RwLock::new(loaded),
                coalescer: self.coalesce.then(|| Coalescer::new(settings)),
                call_deadline,
                fallback,
                leases: OnceLock::new(),
                table: self.table,
                waiters: Waiters::new(self.max_waiters),
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
            max_waiters: DEFAULT_MAX_WAITERS,
        }
    }
}
