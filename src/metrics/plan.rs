//! One plan's metric handles ([`PlanCounters`]), held while the plan is in force and released
//! when a reload removes it, and the recording of a decision on them.
//!
//! The `metrics` facade cannot unregister a series: a recorder keeps each series it was asked
//! for until it decides to forget it. What the library can do is hold no handle to a series it
//! will not update: when a reload removes a plan, its counters let go of their handles (the
//! shell stays, so a call still holding it counts nothing instead of failing), and a recorder
//! that forgets series nobody holds (the demo's, `cli/src/series.rs`) forgets them. A plan that
//! comes back takes new handles from the recorder installed then, at the values it has.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use metrics::{Counter, Gauge};
use parking_lot::RwLock;

use super::{
    DB_CALLS_SAVED, DECISIONS, FALLBACK_ACTIVE_SECONDS, FALLBACK_DECISIONS, OUTAGE_DEBT,
    OUTAGE_DEBT_CHARGED, OUTAGE_DEBT_DROPPED, mode_label, outcome,
};
use crate::bucket::Tokens;
use crate::decision::{DecidedBy, Decision};
use crate::policy::{FallbackMode, Plan};

/// The `decided_by` values, in the order of [`PlanCounters`]' columns.
pub(super) const DECIDED_BY: [&str; 3] = ["store", "lease", "fallback"];

pub(super) fn by_index(decided_by: DecidedBy) -> usize {
    match decided_by {
        DecidedBy::Store => 0,
        DecidedBy::Lease => 1,
        DecidedBy::Fallback(_) => 2,
    }
}

/// A handle while it is held; `None` once released. Read under a shared lock, taken off the
/// fast path only (a decision that waited, or a batch of 256 lease decisions).
struct Held<T>(RwLock<Option<T>>);

impl<T> Held<T> {
    fn new(handle: T) -> Held<T> {
        Held(RwLock::new(Some(handle)))
    }

    /// Runs `f` on the handle, if held.
    fn with(&self, f: impl FnOnce(&T)) {
        if let Some(h) = &*self.0.read() {
            f(h);
        }
    }

    fn is_held(&self) -> bool {
        self.0.read().is_some()
    }
}

/// The decision counters of one plan: `tokenlease_decisions_total` for each outcome and
/// decider and `tokenlease_fallback_decisions_total` for each outcome under the plan's fallback
/// mode, with the plan's name, `tokenlease_db_calls_saved_total`, and the plan's outage-debt
/// series. Registered once per plan (at zero, so every series exists from the start), so that
/// recording a decision is an increment on a handle: no label strings, no lookup in the
/// recorder's registry. A limiter's plan registry (`plans.rs`) holds them: by the plan's index
/// for the plans of its policies, by these labels for plans its callers name.
///
/// The counters of a policy's plan (and of its shadow twin) are [released](Self::release) when
/// a reload leaves no plan of their name and fallback mode in force, and
/// [held](Self::hold) again when one comes back.
pub(crate) struct PlanCounters {
    /// The plan's name, the `plan` label.
    name: Box<str>,
    /// The plan's fallback mode, as its label.
    mode: &'static str,
    /// Whether the plan is in shadow mode (`would_deny` registered).
    shadow: bool,
    /// Whether a limiter's policies (or an HTTP layer's shadow twin of one of their plans)
    /// hold these, so that a reload releases them once their plan is gone.
    policy: AtomicBool,
    /// The decision handles, boxed so that released counters keep only their few words.
    decisions: Held<Box<DecisionHandles>>,
    /// The plan's outage debt: the outstanding gauge, and the charged and dropped counters.
    pub(crate) debt: DebtMetrics,
}

/// The handles of [`PlanCounters`] but the debt's.
struct DecisionHandles {
    /// `[allowed, denied][store, lease, fallback]`.
    decisions: [[Counter; 3]; 2],
    /// `outcome="would_deny"`, `[store, lease, fallback]`: registered (at zero) for a shadow
    /// plan only.
    would_deny: Option<[Counter; 3]>,
    /// `tokenlease_fallback_decisions_total{plan, mode, outcome}`: `[allowed, denied]`.
    fallback: [Counter; 2],
    /// Decisions answered from a lease (no label: one series for every plan).
    saved: Counter,
}

impl DecisionHandles {
    fn register(name: &str, mode: &'static str, shadow: bool) -> DecisionHandles {
        let one = |outcome: &'static str, by: &'static str| {
            let c = metrics::counter!(DECISIONS, "plan" => name.to_owned(),
                "outcome" => outcome, "decided_by" => by);
            c.increment(0);
            c
        };
        let row = |outcome| DECIDED_BY.map(|by| one(outcome, by));
        let fallback = |outcome: &'static str| {
            let c = metrics::counter!(FALLBACK_DECISIONS, "plan" => name.to_owned(),
                "mode" => mode, "outcome" => outcome);
            c.increment(0);
            c
        };
        let saved = metrics::counter!(DB_CALLS_SAVED);
        saved.increment(0);
        // The time in fallback of the plan's mode, at zero (an increment of 0 leaves a total
        // another plan of the same mode has already published as it is).
        metrics::gauge!(FALLBACK_ACTIVE_SECONDS, "mode" => mode).increment(0.0);
        DecisionHandles {
            decisions: [row("allowed"), row("denied")],
            would_deny: shadow.then(|| row("would_deny")),
            fallback: [fallback("allowed"), fallback("denied")],
            saved,
        }
    }
}

/// One plan's outage-debt series (`tokenlease_outage_debt_*{plan}`). The counters count whole
/// tokens; the fractions below one token are carried in nanotokens until they add up to one.
pub(crate) struct DebtMetrics {
    /// `tokenlease_outage_debt_tokens{plan}`: changed by increments, so that several limiters
    /// with the plan add up.
    pub(crate) outstanding: Outstanding,
    /// `tokenlease_outage_debt_charged_tokens_total{plan}`, `..._dropped_...`.
    counters: Held<[Counter; 2]>,
    /// Nanotokens charged and dropped that are not yet a whole token on their counters.
    carry: [AtomicU64; 2],
}

/// The outstanding-debt gauge of one plan, while held.
pub(crate) struct Outstanding(Held<Gauge>);

impl Outstanding {
    /// Adds `value` to the gauge.
    pub(crate) fn increment(&self, value: f64) {
        self.0.with(|g| g.increment(value));
    }

    /// Takes `value` from the gauge.
    pub(crate) fn decrement(&self, value: f64) {
        self.0.with(|g| g.decrement(value));
    }
}

fn debt_gauge(name: &str) -> Gauge {
    let g = metrics::gauge!(OUTAGE_DEBT, "plan" => name.to_owned());
    g.increment(0.0);
    g
}

fn debt_counters(name: &str) -> [Counter; 2] {
    [OUTAGE_DEBT_CHARGED, OUTAGE_DEBT_DROPPED].map(|metric| {
        let c = metrics::counter!(metric, "plan" => name.to_owned());
        c.increment(0);
        c
    })
}

impl DebtMetrics {
    fn register(name: &str) -> DebtMetrics {
        let debt = DebtMetrics::unheld();
        *debt.outstanding.0.0.write() = Some(debt_gauge(name));
        *debt.counters.0.write() = Some(debt_counters(name));
        debt
    }

    fn unheld() -> DebtMetrics {
        DebtMetrics {
            outstanding: Outstanding(Held(RwLock::new(None))),
            counters: Held(RwLock::new(None)),
            carry: [AtomicU64::new(0), AtomicU64::new(0)],
        }
    }

    /// Adds `tokens` charged to the shared bucket.
    pub(crate) fn charged(&self, tokens: Tokens) {
        self.add(0, tokens);
    }

    /// Adds `tokens` of debt given up.
    pub(crate) fn dropped(&self, tokens: Tokens) {
        self.add(1, tokens);
    }

    /// Adds `tokens` to counter `which` in whole tokens, carrying the fraction.
    fn add(&self, which: usize, tokens: Tokens) {
        const ONE: u128 = 1_000_000_000;
        let carry = &self.carry[which];
        let nanos = tokens.as_nanos();
        let mut whole = u64::try_from(nanos / ONE).unwrap_or(u64::MAX);
        let fraction = (nanos % ONE) as u64;
        let before = carry
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
                Some((c + fraction) % ONE as u64)
            })
            .unwrap_or(0);
        whole = whole.saturating_add((before + fraction) / ONE as u64);
        if whole > 0 {
            self.counters.with(|c| c[which].increment(whole));
        }
    }
}

impl fmt::Debug for PlanCounters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlanCounters")
            .field("name", &self.name)
            .field("mode", &self.mode)
            .field("shadow", &self.shadow)
            .field("held", &self.is_held())
            .finish_non_exhaustive()
    }
}

impl PlanCounters {
    /// Registers the counters of `plan` with the recorder installed now.
    pub(crate) fn of(plan: &Plan) -> PlanCounters {
        PlanCounters::register(plan.name(), plan.fallback().mode, plan.shadow())
    }

    /// Registers the counters of the plan `name`, whose fallback decides with `mode`, with the
    /// recorder installed now.
    pub(crate) fn register(name: &str, mode: FallbackMode, shadow: bool) -> PlanCounters {
        let mode = mode_label(mode);
        PlanCounters {
            name: name.into(),
            mode,
            shadow,
            policy: AtomicBool::new(false),
            decisions: Held::new(Box::new(DecisionHandles::register(name, mode, shadow))),
            debt: DebtMetrics::register(name),
        }
    }

    /// The counters of `plan` without their handles: registered by [`hold`](Self::hold). For
    /// the plan registry's entries, which a reload holds in a pass of its own once every new
    /// plan is interned, so that what a reload allocates for good (the entries) and what goes
    /// when the plans do (the handles and the recorder's series) lie apart in the heap, and
    /// the allocator can give the latter's pages back whole.
    pub(crate) fn unheld(plan: &Plan) -> PlanCounters {
        PlanCounters {
            name: plan.name().into(),
            mode: mode_label(plan.fallback().mode),
            shadow: plan.shadow(),
            policy: AtomicBool::new(false),
            decisions: Held(RwLock::new(None)),
            debt: DebtMetrics::unheld(),
        }
    }

    /// The plan's name and its fallback mode's label.
    pub(crate) fn labels(&self) -> (&str, &'static str) {
        (&self.name, self.mode)
    }

    /// Whether these hold their handles (the plan is in force, or was named by a caller).
    pub(crate) fn is_held(&self) -> bool {
        self.decisions.is_held()
    }

    /// Whether a limiter's policies hold these (see [`hold`](Self::hold)).
    pub(crate) fn is_policy(&self) -> bool {
        self.policy.load(Ordering::Acquire)
    }

    /// Takes the handles again, at the values the recorder installed now has for them, if a
    /// reload had released them; with `policy`, marks these as the counters of a plan in force
    /// in a limiter's policies (or of the shadow twin of one), which a reload releases once no
    /// plan of their name and fallback mode is in force.
    pub(crate) fn hold(&self, policy: bool) {
        if policy {
            self.policy.store(true, Ordering::Release);
        }
        let mut decisions = self.decisions.0.write();
        if decisions.is_none() {
            *decisions = Some(Box::new(DecisionHandles::register(
                &self.name,
                self.mode,
                self.shadow,
            )));
            *self.debt.outstanding.0.0.write() = Some(debt_gauge(&self.name));
            *self.debt.counters.0.write() = Some(debt_counters(&self.name));
        }
    }

    /// Lets go of every handle: the plan left the policies in force. What is recorded on these
    /// counters afterwards (by a call that found the plan before the reload) is not counted.
    pub(crate) fn release(&self) {
        let mut decisions = self.decisions.0.write();
        *decisions = None;
        *self.debt.outstanding.0.0.write() = None;
        *self.debt.counters.0.write() = None;
    }

    /// Adds `n` decisions allowed from a lease (store calls saved).
    pub(super) fn add_from_lease(&self, n: u64) {
        self.decisions.with(|h| {
            h.decisions[0][1].increment(n);
            h.saved.increment(n);
        });
    }
}

/// Records one decision made off the fast path on a plan's `counters`.
///
/// A shadow plan's denial let through ([`Decision::would_deny`]) counts as `would_deny` in
/// `tokenlease_decisions_total`, and as the denial it is in
/// `tokenlease_fallback_decisions_total`.
pub(crate) fn record(counters: &PlanCounters, decision: &Decision) {
    counters
        .decisions
        .with(|h| record_on(counters, h, decision));
}

fn record_on(counters: &PlanCounters, h: &DecisionHandles, decision: &Decision) {
    let row = usize::from(!decision.allowed || decision.would_deny);
    if let DecidedBy::Fallback(mode) = decision.decided_by {
        let mode = mode_label(mode);
        if mode == counters.mode {
            h.fallback[row].increment(1);
        } else {
            // The plan's fallback decides with the plan's mode; this is only for a decision
            // that names another one, counted by its own labels rather than misfiled.
            metrics::counter!(FALLBACK_DECISIONS, "plan" => counters.name.to_string(),
                "mode" => mode, "outcome" => outcome(row == 0))
            .increment(1);
        }
    }
    let by = by_index(decision.decided_by);
    match &h.would_deny {
        Some(would_deny) if decision.would_deny => would_deny[by].increment(1),
        // A would-deny decision on the counters of a plan without shadow mode (not possible:
        // a plan's counters are registered with its shadow mode; kept total): by the macro.
        None if decision.would_deny => metrics::counter!(DECISIONS,
            "plan" => counters.name.to_string(), "outcome" => "would_deny",
            "decided_by" => DECIDED_BY[by])
        .increment(1),
        _ => h.decisions[row][by].increment(1),
    }
}
