//! Metric names and the helpers that record them, through the [`metrics`] facade.
//!
//! Install any `metrics` recorder (the demo uses the Prometheus exporter) and call [`describe`]
//! once to attach units and help texts. Every name starts with `tokenlease_`. `docs/metrics.md`
//! says what each one means for an operator.
//!
//! The fast path records nothing shared: a decision answered from a lease is counted in its
//! thread's own count of its plan, which the lease actor adds to the counters at most every
//! 250 ms while decisions come (so they reach the recorder within a quarter of a second, on a
//! quiet service as on a busy one).

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};

use crate::decision::DecidedBy;
use crate::policy::{FallbackMode, Plan};

mod plan;

use plan::{DECIDED_BY, by_index};
pub(crate) use plan::{PlanCounters, record};

/// Decisions, by `plan` (the plan's name), `outcome` (`allowed`, `denied`, and for a shadow
/// plan `would_deny`: a denial let through) and `decided_by` (`store`, `lease`, `fallback`).
pub const DECISIONS: &str = "tokenlease_decisions_total";
/// Store calls, by `kind` (`take`: direct mode, `lease`: lease refills, `return`: give-backs,
/// `debt`: outage-debt charges).
pub const DB_CALLS: &str = "tokenlease_db_calls_total";
/// Store calls that failed or timed out, by `kind`.
pub const DB_ERRORS: &str = "tokenlease_db_errors_total";
/// Direct mode's limit on statements in flight, chosen from the callers that arrive while a
/// statement runs so that each statement carries about 16 keys when callers wait (gauge; only
/// while `LimiterBuilder::statements_in_flight` is not set).
pub const STATEMENTS_IN_FLIGHT_LIMIT: &str = "tokenlease_statements_in_flight_limit";
/// Decisions answered from a lease without a store call.
pub const DB_CALLS_SAVED: &str = "tokenlease_db_calls_saved_total";
/// Tokens granted to this process's leases.
pub const TOKENS_LEASED: &str = "tokenlease_lease_tokens_leased_total";
/// Tokens given back to the store.
pub const TOKENS_RETURNED: &str = "tokenlease_lease_tokens_returned_total";
/// Tokens of relaxed leases closed unspent on a bucket that had refilled to its capacity since
/// their grant: not sent back, since the store would cap the return away.
pub const TOKENS_WAIVED: &str = "tokenlease_lease_tokens_waived_total";
/// Lease tokens whose give-back failed for good.
pub const TOKENS_STRANDED: &str = "tokenlease_lease_tokens_stranded_total";
/// Tokens held in live leases now: how far this process can run ahead of the shared bucket.
pub const OUTSTANDING: &str = "tokenlease_lease_outstanding_tokens";
/// Gauge: the most the keys in the lease table may hold in leases at once (each key's plan's
/// largest lease, summed): the ceiling of [`OUTSTANDING`], and this process's term in the
/// overshoot bound.
pub const OUTSTANDING_BOUND: &str = "tokenlease_lease_outstanding_bound_tokens";
/// Keys in the lease table now.
pub const TABLE_KEYS: &str = "tokenlease_lease_table_keys";
/// Lease refill statements that timed out while the store was answering and were asked for
/// again instead of failing (`docs/design/leases.md`). Failed ones are in [`DB_ERRORS`] (`kind="lease"`),
/// which counts these too.
pub const LATE_REFILLS: &str = "tokenlease_lease_late_refills_total";
/// Calls of leased keys that the lease table sent to the fallback, by `cause`: `failing` (the
/// key's last refill failed within 100 ms), `unanswered` (waited out `max_wait`; no refill
/// answered lately), `returning` (waited; a key the table had removed gets no credit),
/// `at_bound` (waited; the key's credit reached its largest lease), `other` (`LeaseStats` has
/// each). They are among [`FALLBACK_DECISIONS`], which counts every fallback decision.
pub const LEASE_FALLBACK: &str = "tokenlease_lease_fallback_total";
/// Time of one lease refill statement, in seconds.
pub const REFILL_SECONDS: &str = "tokenlease_lease_refill_seconds";
/// Time from a call's first poll to its decision, in seconds, by `decided_by` (`store`,
/// `lease`, `fallback`), for every call that had to wait (for a refill, the store or the
/// fallback). Calls a live lease answers on their first poll are not timed: they take tens of
/// nanoseconds, and reading the clock would double that; they are counted in
/// `tokenlease_decisions_total`.
pub const DECISION_SECONDS: &str = "tokenlease_decision_seconds";
/// Lease actors started again after the previous one ended early (its tokio runtime was
/// dropped, or it panicked).
pub const ACTOR_RESTARTS: &str = "tokenlease_lease_actor_restarts_total";
/// Leased calls decided by the fallback because no lease actor could run (called outside a
/// tokio runtime while none was running).
pub const ACTOR_UNAVAILABLE: &str = "tokenlease_lease_actor_unavailable_total";
/// Decisions made by the fallback, by `plan`, `mode` (`allow`, `deny`, `local`: the plan's
/// fallback) and `outcome`; each plan's two series are registered at zero with its other
/// counters.
pub const FALLBACK_DECISIONS: &str = "tokenlease_fallback_decisions_total";
/// Gauge: tokens the `allow` and `local` fallbacks admitted while the store could not answer
/// and that are not yet charged to the shared bucket, by `plan`, every limiter of the process
/// together (`docs/design/outage-debt.md`). Registered at zero with each plan's other counters.
pub const OUTAGE_DEBT: &str = "tokenlease_outage_debt_tokens";
/// Outage debt charged to the shared bucket once the store answered again, in whole tokens, by
/// `plan`. Registered at zero with each plan's other counters.
pub const OUTAGE_DEBT_CHARGED: &str = "tokenlease_outage_debt_charged_tokens_total";
/// Outage debt given up, in whole tokens, by `plan`: debt of a key beyond the ledger's bound
/// (100,000 keys per limiter), debt unpaid for 5 minutes after it was last added to, and debt
/// left when the limiter was dropped. Registered at zero with each plan's other counters.
pub const OUTAGE_DEBT_DROPPED: &str = "tokenlease_outage_debt_dropped_tokens_total";
/// Gauge: the local buckets the `local` fallbacks hold, every limiter of the process together
/// (at most 100,000 per limiter; full ones are deleted, also once the store answers again).
pub const FALLBACK_LOCAL_BUCKETS: &str = "tokenlease_fallback_local_buckets";
/// Idle bucket rows deleted.
pub const IDLE_ROWS_DELETED: &str = "tokenlease_idle_rows_deleted_total";
/// Idle-row cleanup rounds that failed.
pub const IDLE_CLEANUP_ERRORS: &str = "tokenlease_idle_cleanup_errors_total";
/// Server-side cancels of statements whose store call timed out or was dropped, by `result`
/// (`sent`, `failed`).
pub const STORE_CANCELS: &str = "tokenlease_store_cancels_total";
/// Times a store that prepares its statements turned that off because the server refused one as
/// only a transaction pooler makes it (`PostgresStoreBuilder::prepared_statements`).
pub const STORE_UNPREPARED: &str = "tokenlease_store_unprepared_total";
/// Store calls the database refused because its schema does not fit this build's statements
/// (an undefined table, column, function or type: a database not yet migrated, or changed by a
/// much newer release). The first of a spell is also logged (`tracing`, `ERROR`).
pub const STORE_SCHEMA_ERRORS: &str = "tokenlease_store_schema_errors_total";
/// Store connections that ended in an error noticed in the background (a broken socket, a
/// terminated session, a driver that did not finish).
pub const STORE_CONNECTION_ERRORS: &str = "tokenlease_store_connection_errors_total";
/// Seconds spent in fallback, by `mode`: a gauge that only grows (see `fallback.rs`).
pub const FALLBACK_ACTIVE_SECONDS: &str = "tokenlease_fallback_active_seconds";
/// Circuit breaker state by `store`: 0 closed, 1 open, 2 half-open (a gauge).
pub const CIRCUIT_STATE: &str = "tokenlease_circuit_state";
/// Circuit breaker state changes, by `store` and `to` (`closed`, `open`, `half_open`).
pub const CIRCUIT_TRANSITIONS: &str = "tokenlease_circuit_transitions_total";
/// The store's clock minus the local wall clock, in seconds, by `store` (a gauge).
pub const STORE_CLOCK_SKEW: &str = "tokenlease_store_clock_skew_seconds";
/// Requests the HTTP layer denied, by `layer` (`api`, `entity`), `method` and `route` (the
/// route pattern, never the request path).
pub const HTTP_DENIED: &str = "tokenlease_http_denied_total";
/// Requests the HTTP layer could not check (the limiter refused the key or cost), by `layer`,
/// `method` and `route`; they pass unlimited by that layer.
pub const HTTP_ERRORS: &str = "tokenlease_http_errors_total";
/// Requests a policy file's route limited (checked by at least one layer), by `method` and
/// `route`; every route's series exists from start-up, so a route that stays at zero is one
/// that no request reaches.
pub const HTTP_CHECKED: &str = "tokenlease_http_checked_total";
/// Requests whose path fits a policy file's route of their method but which the layer could
/// not match to it (the router matched another pattern, or gave none), so they passed
/// unlimited; by that route's `method` and `route`.
pub const HTTP_UNMATCHED: &str = "tokenlease_http_unmatched_total";
/// Requests a layer in shadow mode (or a shadow plan) would have denied and let through, by
/// `layer`, `method` and `route`, as [`HTTP_DENIED`].
pub const HTTP_WOULD_DENY: &str = "tokenlease_http_would_deny_total";
/// Policy reloads, by `result`: `applied` ([`Limiter::reload`](crate::Limiter::reload)), or
/// `refused` (the limiter or the HTTP layer could not use them, or, in the demo, the file
/// failed its check); registered at zero with the first limiter.
pub const POLICY_RELOADS: &str = "tokenlease_policy_reloads_total";
/// Global tokens given back on entity denial, by `result` (`credited`, `failed`, `skipped`).
pub const HTTP_REFUNDS: &str = "tokenlease_http_refunds_total";

/// Attaches units and help texts to every metric.
pub fn describe() {
    describe_counter!(DECISIONS, Unit::Count, "decisions by outcome and decider");
    describe_counter!(DB_CALLS, Unit::Count, "store calls by kind");
    describe_counter!(
        DB_ERRORS,
        Unit::Count,
        "store calls that failed or timed out, by kind"
    );
    describe_gauge!(
        STATEMENTS_IN_FLIGHT_LIMIT,
        Unit::Count,
        "direct mode's limit on statements in flight, about 16 keys a statement when callers wait"
    );
    describe_counter!(
        DB_CALLS_SAVED,
        Unit::Count,
        "decisions answered from a lease"
    );
    describe_counter!(TOKENS_LEASED, Unit::Count, "tokens granted to leases");
    describe_counter!(TOKENS_RETURNED, Unit::Count, "lease tokens given back");
    describe_counter!(
        TOKENS_WAIVED,
        Unit::Count,
        "lease tokens not given back to a bucket that had refilled to capacity"
    );
    describe_counter!(
        TOKENS_STRANDED,
        Unit::Count,
        "lease tokens whose give-back failed"
    );
    describe_gauge!(
        OUTSTANDING,
        Unit::Count,
        "tokens held in live leases (overshoot bound)"
    );
    describe_gauge!(
        OUTSTANDING_BOUND,
        Unit::Count,
        "the most the lease table's keys may hold in leases at once"
    );
    describe_gauge!(TABLE_KEYS, Unit::Count, "keys in the lease table");
    describe_counter!(
        LATE_REFILLS,
        Unit::Count,
        "lease refills that timed out while the store answered, asked for again"
    );
    describe_counter!(
        LEASE_FALLBACK,
        Unit::Count,
        "calls of leased keys sent to the fallback, by cause"
    );
    describe_gauge!(
        OUTAGE_DEBT,
        Unit::Count,
        "fallback admissions not yet charged to the shared bucket, by plan"
    );
    describe_counter!(
        OUTAGE_DEBT_CHARGED,
        Unit::Count,
        "outage debt charged to the shared bucket after recovery, by plan"
    );
    describe_counter!(
        OUTAGE_DEBT_DROPPED,
        Unit::Count,
        "outage debt given up (key bound, age, limiter dropped), by plan"
    );
    describe_gauge!(
        FALLBACK_LOCAL_BUCKETS,
        Unit::Count,
        "local buckets held by the local fallbacks"
    );
    describe_histogram!(
        REFILL_SECONDS,
        Unit::Seconds,
        "lease refill statement latency"
    );
    describe_histogram!(
        DECISION_SECONDS,
        Unit::Seconds,
        "latency of decisions that waited, by decider"
    );
    describe_counter!(
        ACTOR_RESTARTS,
        Unit::Count,
        "lease actors restarted after ending early"
    );
    describe_counter!(
        ACTOR_UNAVAILABLE,
        Unit::Count,
        "leased calls decided by the fallback because no lease actor could run"
    );
    describe_counter!(
        FALLBACK_DECISIONS,
        Unit::Count,
        "fallback decisions by plan, mode and outcome"
    );
    describe_counter!(IDLE_ROWS_DELETED, Unit::Count, "idle bucket rows deleted");
    describe_counter!(
        IDLE_CLEANUP_ERRORS,
        Unit::Count,
        "idle-row cleanup rounds that failed"
    );
    describe_counter!(
        STORE_CANCELS,
        Unit::Count,
        "server-side cancels of abandoned statements, by result"
    );
    describe_counter!(
        STORE_UNPREPARED,
        Unit::Count,
        "times the store stopped preparing statements after a pooler refused one"
    );
    describe_counter!(
        STORE_SCHEMA_ERRORS,
        Unit::Count,
        "store calls refused because the database's schema does not fit this build"
    );
    describe_counter!(
        STORE_CONNECTION_ERRORS,
        Unit::Count,
        "store connections that ended in an error in the background"
    );
    describe_gauge!(
        FALLBACK_ACTIVE_SECONDS,
        Unit::Seconds,
        "seconds spent in fallback by mode (only grows)"
    );
    describe_gauge!(
        CIRCUIT_STATE,
        "circuit breaker state by store: 0 closed, 1 open, 2 half-open"
    );
    describe_counter!(
        CIRCUIT_TRANSITIONS,
        Unit::Count,
        "circuit breaker state changes by store and new state"
    );
    describe_gauge!(
        STORE_CLOCK_SKEW,
        Unit::Seconds,
        "store clock minus local wall clock (informational)"
    );
    describe_counter!(
        HTTP_DENIED,
        Unit::Count,
        "requests the HTTP layer denied, by layer, method and route pattern"
    );
    describe_counter!(
        POLICY_RELOADS,
        Unit::Count,
        "policy reloads by result (applied, refused)"
    );
    describe_counter!(
        HTTP_WOULD_DENY,
        Unit::Count,
        "requests a shadow layer or plan would have denied and let through, by layer, method and route pattern"
    );
    describe_counter!(
        HTTP_ERRORS,
        Unit::Count,
        "requests the HTTP layer could not check, by layer, method and route pattern"
    );
    describe_counter!(
        HTTP_CHECKED,
        Unit::Count,
        "requests a policy route limited, by method and route pattern"
    );
    describe_counter!(
        HTTP_UNMATCHED,
        Unit::Count,
        "requests that fit a policy route but passed unlimited, by method and route pattern"
    );
    describe_counter!(
        HTTP_REFUNDS,
        Unit::Count,
        "global tokens given back on entity denial, by result"
    );
}

fn outcome(allowed: bool) -> &'static str {
    if allowed { "allowed" } else { "denied" }
}

/// The label value of a fallback mode.
pub(crate) fn mode_label(mode: FallbackMode) -> &'static str {
    match mode {
        FallbackMode::Allow => "allow",
        FallbackMode::Deny => "deny",
        FallbackMode::Local { .. } => "local",
    }
}

/// The `kind` values of [`DB_CALLS`] and [`DB_ERRORS`].
const CALL_KINDS: [&str; 3] = ["take", "lease", "return"];

/// Registers the store-call counters of every `kind` (`tokenlease_db_calls_total` and
/// `tokenlease_db_errors_total`) at zero with the recorder installed now, so that a `rate()` of
/// either, by kind, has a series before the first call or the first error.
pub(crate) fn register_store_calls() {
    for kind in CALL_KINDS {
        metrics::counter!(DB_CALLS, "kind" => kind).increment(0);
        metrics::counter!(DB_ERRORS, "kind" => kind).increment(0);
    }
}

/// Counts one policy reload by its result (`applied`, `refused`).
pub(crate) fn record_reload(applied: bool) {
    let result = if applied { "applied" } else { "refused" };
    metrics::counter!(POLICY_RELOADS, "result" => result).increment(1);
}

/// Registers both reload series at zero.
pub(crate) fn register_reloads() {
    for result in ["applied", "refused"] {
        metrics::counter!(POLICY_RELOADS, "result" => result).increment(0);
    }
}

/// Records how long a decision that waited took, by who decided.
pub(crate) fn record_latency(decided_by: DecidedBy, took: std::time::Duration) {
    let by = DECIDED_BY[by_index(decided_by)];
    metrics::histogram!(DECISION_SECONDS, "decided_by" => by).record(took);
}

/// How often, at most, the lease actor adds the lease decisions the threads counted to the
/// counters, while decisions keep coming (and once more after the last).
pub(crate) const FLUSH_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// The plans a thread counts lease decisions for at once. Any plan may take any slot: a
/// request checked against a route's limits alternates between their plans, and those must not
/// evict each other (they did one time in four when each plan had one slot, by its address:
/// every decision then changed the slot's plan, about 100 ns each).
const BATCH_SLOTS: usize = 8;

/// One thread's lease decisions, per slot (a plan each), where any thread can add them to the
/// counters: the thread itself when a slot changes plan or the thread ends, and the lease actor
/// every [`FLUSH_EVERY`] while decisions come ([`flush_all`]).
#[derive(Default)]
struct Counts {
    /// Decisions since each slot took its plan. Written by the owning thread alone, with a load
    /// and a store (no read-modify-write, so no locked instruction on the fast path); read by
    /// whoever flushes. Relaxed: a count that only grows, and the flusher adds the difference
    /// from what it added before, so a stale read only leaves some for the next flush.
    made: [AtomicU64; BATCH_SLOTS],
    /// Where each slot's decisions go and how many were added. Locked by the owner only to
    /// change a slot's plan, and by a flush.
    book: Mutex<[Target; BATCH_SLOTS]>,
}

/// Where one slot's decisions go.
#[derive(Default)]
struct Target {
    /// The counters.
    held: Option<Arc<PlanCounters>>,
    /// The name of the plan `held` counts for, whose address is the slot's tag: held, so that
    /// no other name takes that address meanwhile.
    _name: Option<Arc<str>>,
    /// Of the slot's `made`, those added to `held`.
    added: u64,
}

impl Counts {
    /// Adds what the slots made since the last flush to their counters; whether there was any.
    fn flush(&self) -> bool {
        let mut book = self.book.lock();
        let mut any = false;
        for (made, target) in self.made.iter().zip(book.iter_mut()) {
            let made = made.load(Ordering::Relaxed);
            if made > target.added {
                if let Some(c) = &target.held {
                    c.add_from_lease(made - target.added);
                }
                target.added = made;
                any = true;
            }
        }
        any
    }
}

/// The counts of every thread that made a lease decision and has not ended.
static THREADS: Mutex<Vec<Arc<Counts>>> = Mutex::new(Vec::new());

/// A thread's side: what each slot counts for (`tag`: 0 for nothing, or the address of a plan's
/// name with the low bit set), read by the thread alone, the slot its last decision went to, the
/// slot a new plan takes next, and its [`Counts`].
struct Local {
    tags: [Cell<usize>; BATCH_SLOTS],
    last: Cell<usize>,
    next: Cell<usize>,
    counts: Arc<Counts>,
}

impl Local {
    fn new() -> Local {
        let counts = Arc::new(Counts::default());
        THREADS.lock().push(Arc::clone(&counts));
        Local {
            tags: std::array::from_fn(|_| Cell::new(0)),
            last: Cell::new(0),
            next: Cell::new(0),
            counts,
        }
    }

    /// The slot counting for `tag`, if one does: the last one used first, then the others in
    /// order (one cache line of tags).
    #[inline]
    fn slot_of(&self, tag: usize) -> Option<usize> {
        let last = self.last.get() % BATCH_SLOTS;
        if self.tags[last].get() == tag {
            return Some(last);
        }
        let i = self.tags.iter().position(|t| t.get() == tag)?;
        self.last.set(i);
        Some(i)
    }

    /// The slot a plan no slot counts for takes: the next in turn.
    fn take_slot(&self) -> usize {
        let i = self.next.get() % BATCH_SLOTS;
        self.next.set(i + 1);
        self.last.set(i);
        i
    }

    /// One more decision on slot `i`.
    #[inline]
    fn add_one(&self, i: usize) {
        let made = &self.counts.made[i];
        made.store(made.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }

    /// Adds what slot `i` holds and gives it to `counters` (of the plan called `name`), with
    /// one decision made.
    #[cold]
    fn switch(&self, i: usize, counters: Arc<PlanCounters>, name: Arc<str>, tag: usize) {
        let mut book = self.counts.book.lock();
        let target = &mut book[i];
        let made = self.counts.made[i].load(Ordering::Relaxed);
        if made > target.added
            && let Some(c) = &target.held
        {
            c.add_from_lease(made - target.added);
        }
        *target = Target {
            held: Some(counters),
            _name: Some(name),
            added: 0,
        };
        self.counts.made[i].store(1, Ordering::Relaxed);
        drop(book);
        self.tags[i].set(tag);
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        // A thread that ends adds what it counted, and leaves the list.
        self.counts.flush();
        THREADS.lock().retain(|c| !Arc::ptr_eq(c, &self.counts));
    }
}

thread_local! {
    static FROM_LEASE: Local = Local::new();
}

/// Counts one decision allowed from a lease (a store call saved) under `plan`: an increment of
/// the thread's own count, which the lease actor adds to the plan's counters within
/// [`FLUSH_EVERY`] ([`flush_all`]); the caller tells the actor that counts wait
/// (`Leases::counted`). Counted by the address of the plan's name, which the slot holds a clone
/// of, so that no other name takes that address meanwhile; `counters` gives the plan's counters
/// when the slot changes to it (a lookup by the plan's labels, off the fast path).
///
/// Clones of a plan share its name (`Plan::shared_name`), whatever else of them differs: enough,
/// since the two series a lease decision adds to,
/// `tokenlease_decisions_total{plan, outcome="allowed", decided_by="lease"}` and
/// `tokenlease_db_calls_saved_total`, depend on nothing else of the plan.
#[inline]
pub(crate) fn record_lease_allowed_named(
    plan: &Plan,
    counters: impl FnOnce() -> Arc<PlanCounters>,
) {
    let name = plan.shared_name();
    // With the low bit set, a tag is never 0 (nothing).
    let tag = Arc::as_ptr(name).cast::<u8>() as usize | 1;
    let _ = FROM_LEASE.try_with(|local| match local.slot_of(tag) {
        Some(i) => local.add_one(i),
        None => local.switch(local.take_slot(), counters(), Arc::clone(name), tag),
    });
}

/// Adds the lease decisions every thread counted to the counters now; whether there were any.
/// The lease actor's flush (every [`FLUSH_EVERY`] while decisions come, and at shutdown).
pub(crate) fn flush_all() -> bool {
    THREADS
        .lock()
        .iter()
        .fold(false, |any, counts| counts.flush() | any)
}

/// Adds this thread's lease decisions to the counters now, without waiting for the lease
/// actor's next flush (tests).
pub fn flush_thread() {
    let _ = FROM_LEASE.try_with(|local| local.counts.flush());
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use metrics::{
        Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
    };
    use parking_lot::Mutex;

    /// A recorder that only remembers which names were described.
    #[derive(Debug, Default)]
    struct Described(Mutex<BTreeSet<String>>);

    impl Described {
        fn add(&self, key: KeyName) {
            self.0.lock().insert(key.as_str().to_owned());
        }
    }

    impl Recorder for Described {
        fn describe_counter(&self, key: KeyName, _: Option<Unit>, _: SharedString) {
            self.add(key);
        }
        fn describe_gauge(&self, key: KeyName, _: Option<Unit>, _: SharedString) {
            self.add(key);
        }
        fn describe_histogram(&self, key: KeyName, _: Option<Unit>, _: SharedString) {
            self.add(key);
        }
        fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
            Counter::noop()
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    /// `describe` covers every metric name defined in this file (its quoted `tokenlease_`
    /// literals above the tests), and nothing else.
    #[test]
    fn describe_covers_every_name() {
        let source = include_str!("metrics.rs");
        let body = &source[..source.find("#[cfg(test)]").expect("the tests")];
        let names: BTreeSet<String> = quoted_names(body).collect();
        assert!(names.len() >= 20, "names found: {names:?}");
        let recorder = Described::default();
        metrics::with_local_recorder(&recorder, super::describe);
        let described = recorder.0.lock().clone();
        assert_eq!(described, names, "described vs defined");
    }

    /// `tokenlease_decisions_total{outcome="allowed", decided_by="lease"}` by plan.
    fn lease_counts(
        snapshotter: &metrics_util::debugging::Snapshotter,
    ) -> std::collections::BTreeMap<String, u64> {
        use metrics_util::debugging::DebugValue;

        let mut counted = std::collections::BTreeMap::new();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let key = key.key();
            let label = |k: &str| key.labels().find(|l| l.key() == k).map(|l| l.value());
            if key.name() == super::DECISIONS
                && label("outcome") == Some("allowed")
                && label("decided_by") == Some("lease")
                && let DebugValue::Counter(n) = value
            {
                counted.insert(label("plan").unwrap().to_owned(), n);
            }
        }
        counted
    }

    /// Lease decisions on plans their callers name count under each plan's name, also when a
    /// plan is dropped and the next one, of another name, is made in its place (the same stack
    /// slot, its name of the same length, likely in the same heap chunk).
    #[test]
    fn named_plans_count_under_their_own_names() {
        use std::sync::Arc;

        use metrics_util::debugging::DebuggingRecorder;

        use crate::bucket::{BucketConfig, Rate, Tokens};
        use crate::policy::Plan;

        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        // A thread of its own: the batches are per thread.
        std::thread::spawn(move || {
            metrics::with_local_recorder(&recorder, || {
                let bucket =
                    BucketConfig::new(Tokens::whole(10), Rate::per_second(1).unwrap()).unwrap();
                for (name, calls) in [("p1", 3), ("p2", 5), ("p3", 7)] {
                    let plan = Plan::new(name, bucket);
                    let counters = Arc::new(super::PlanCounters::of(&plan));
                    for _ in 0..calls {
                        super::record_lease_allowed_named(&plan, || Arc::clone(&counters));
                    }
                }
                super::flush_thread();
            });
        })
        .join()
        .unwrap();
        let counted = lease_counts(&snapshotter);
        let expected = [("p1", 3), ("p2", 5), ("p3", 7)].map(|(n, c)| (n.to_owned(), c));
        assert_eq!(counted, expected.into_iter().collect());
    }

    /// Decisions alternating between as many plans as a thread has slots never change a slot's
    /// plan (whatever the plans' addresses: each takes a slot of its own), and one plan more
    /// evicts the oldest; every decision is counted under its plan.
    #[test]
    fn alternating_plans_keep_their_slots() {
        use std::sync::Arc;

        use metrics_util::debugging::DebuggingRecorder;

        use crate::bucket::{BucketConfig, Rate, Tokens};
        use crate::policy::Plan;

        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let switches = std::thread::spawn(move || {
            metrics::with_local_recorder(&recorder, || {
                let bucket =
                    BucketConfig::new(Tokens::whole(10), Rate::per_second(1).unwrap()).unwrap();
                let plans: Vec<(Plan, Arc<super::PlanCounters>)> = (0..=super::BATCH_SLOTS)
                    .map(|i| {
                        let plan = Plan::new(format!("q{i}"), bucket);
                        let counters = Arc::new(super::PlanCounters::of(&plan));
                        (plan, counters)
                    })
                    .collect();
                let switches = std::cell::Cell::new(0);
                let round = |plans: &[(Plan, Arc<super::PlanCounters>)]| {
                    for (plan, counters) in plans {
                        super::record_lease_allowed_named(plan, || {
                            switches.set(switches.get() + 1);
                            Arc::clone(counters)
                        });
                    }
                };
                let fitting = &plans[..super::BATCH_SLOTS];
                for _ in 0..100 {
                    round(fitting);
                }
                let within = switches.get();
                round(&plans[super::BATCH_SLOTS..]);
                round(&plans[..1]);
                super::flush_thread();
                (within, switches.get())
            })
        })
        .join()
        .unwrap();
        assert_eq!(switches, (super::BATCH_SLOTS, super::BATCH_SLOTS + 2));
        let counted = lease_counts(&snapshotter);
        let mut expected: std::collections::BTreeMap<String, u64> = (0..super::BATCH_SLOTS)
            .map(|i| (format!("q{i}"), 100))
            .collect();
        expected.insert("q0".to_owned(), 101);
        expected.insert(format!("q{}", super::BATCH_SLOTS), 1);
        assert_eq!(counted, expected);
    }

    /// The `"tokenlease_..."` literals in `text`.
    fn quoted_names(text: &str) -> impl Iterator<Item = String> + '_ {
        text.split("\"tokenlease_").skip(1).map(|rest| {
            let end = rest.find('"').unwrap_or(rest.len());
            format!("tokenlease_{}", &rest[..end])
        })
    }
}
