//! D6, the pool exhausted by someone else, in each fallback mode (deny, allow, local): a limiter
//! over a `PostgresStore` with a pool of 2, four callers on one key for 3 s, and the test
//! holding both pooled connections from 0.5 s to 2.0 s. While they are held the fallback
//! decides every call, no caller waits longer than a direct call may, every call that reaches
//! the store fails as a timeout (the pool wait's or the call's, within 70 ms), and the coalescer
//! keeps one statement in flight on the key (two with the outage debt's charging task beside
//! it); after the release the store answers again within the breaker's cap plus 200 ms.
//!
//! It lives in the crate because it takes the store's connections through its bb8 pool
//! (`PostgresStore::pool`), which is not public API; it was a fault test of the `faults`
//! binary that reached the pool through a hidden module. It sits at the
//! crate's root, as `assembled_tests` does, because it uses the store and the limiter
//! together: a module below the root naming both would make an arrow between them (L1). The
//! fault tests' settings: call and pool-wait timeouts 50 ms, connect timeout 250 ms, statement
//! and lock timeouts 100 ms, and a [`CircuitBreaker`] with its defaults, under which a
//! recording wrapper logs every call that reached the database, so that store calls and caller
//! waits are measured apart. Against a throwaway cluster of its own (`tokenlease_testkit`);
//! time is read through the crate's clock (L2). The call log, the recording wrapper (expanded
//! here over the crate's own store types), the driven callers and the figures read from them
//! are the fault tests' own (`tokenlease_testkit::rig`).
//!
//! Timing-dependent: nextest runs it in its `serial` group (`.config/nextest.toml`), and the
//! three modes take a lock so that `cargo test` runs them one at a time too. Each prints its
//! figures (`--nocapture`).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use tokenlease_testkit::TempPostgres;
use tokenlease_testkit::rig::{self as kit, ms};
use tokio::time::Instant;

use crate::clock::instant;
use crate::debt::tests::{local, plan};
use crate::policy::{FallbackMode, Plan};
use crate::store::CircuitBreaker;
use crate::{DecidedBy, Limiter};

const C: u64 = 100;
const R: f64 = 50.0;
const KEY: &str = "faults:hot";
/// The longest a direct-mode caller may wait: a caller that arrives while its key's statement
/// is in flight waits for it (up to the 50 ms call timeout), then for its own round (another
/// 50 ms); plus scheduling slack.
const DIRECT_WAIT: Duration = Duration::from_millis(120);

mod d6_pool_exhausted {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deny() {
        d6(FallbackMode::Deny).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn allow() {
        d6(FallbackMode::Allow).await;
    }

    /// Each instance's local bucket holds C/2 and r/2 (N = 2 instances, as in the fault tests).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn local() {
        d6(super::local(2)).await;
    }
}

async fn d6(mode: FallbackMode) {
    // One mode at a time under `cargo test`, which runs a binary's tests on parallel threads.
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _serial = SERIAL.lock().await;
    let pg = tokio::task::spawn_blocking(TempPostgres::start)
        .await
        .expect("join")
        .expect("a throwaway PostgreSQL (install the server binaries: apt-get install postgresql)");
    let store = fault_store(&pg.connection_string("postgres"), 2).await;
    // The store's own pool: a bb8 pool's clones share its connections.
    let pool = store.pool().clone();
    let log = Log::new(instant, class);
    let recording = Recording {
        inner: store,
        log: log.clone(),
    };
    let limiter = Limiter::builder(CircuitBreaker::new(recording)).build();
    let plan = Arc::new(plan("test", C, R, mode));
    let origin = instant();
    let run = drive(&limiter, &plan, 4, origin, Duration::from_millis(3_000));
    // sleep: the timeline: the callers have the pool to themselves for the first 0.5 s.
    tokio::time::sleep_until(origin + Duration::from_millis(500)).await;
    // Hold both pooled connections for 1.5 s. The callers compete for them, and each `get`
    // gives up after the pool's 50 ms wait: try again until the test holds both.
    let get = || async {
        for _ in 0..100 {
            if let Ok(conn) = pool.get().await {
                return conn;
            }
        }
        panic!("no pooled connection in 100 tries");
    };
    let held = (get().await, get().await);
    let hold_start = instant() - origin;
    log.reset_max_in_flight();
    // sleep: the timeline: the test holds the pool until 2.0 s.
    tokio::time::sleep_until(origin + Duration::from_millis(2_000)).await;
    let in_flight = log.max_in_flight();
    drop(held);
    let release = instant() - origin;
    let events = run.await.expect("the run");

    let held_calls = log.calls_in(origin, hold_start, release);
    let classes = kit::error_classes(&held_calls);
    let (calls, failed, slowest) = kit::outcome(&held_calls);
    let recovered = log.recovered_at(origin, release).expect("recovered");
    let recovery = recovered.saturating_sub(release);
    let hold: Vec<Event> = events
        .iter()
        .filter(|e| e.at >= hold_start && e.at < release)
        .copied()
        .collect();
    let by_fallback = hold
        .iter()
        .filter(|e| matches!(e.by, DecidedBy::Fallback(_)))
        .count();
    let (_, p99, max) = kit::waits(events.iter().map(|e| e.took));
    eprintln!(
        "D6 {}: waits p99 {:.3} ms max {:.1} ms; held 1.5 s: {calls} db calls, {failed} failed \
         {classes:?}, slowest {:.1} ms, at most {in_flight} in flight; {by_fallback} of {} decisions by the \
         fallback; recovery {:.0} ms after release",
        label(mode),
        ms(p99),
        ms(max),
        ms(slowest),
        hold.len(),
        ms(recovery),
    );
    assert!(max <= DIRECT_WAIT, "a caller waited {max:?}");
    assert!(
        slowest <= Duration::from_millis(70),
        "a pool wait took {slowest:?}"
    );
    // The pool wait and the call timeout are both 50 ms: either may fire first.
    assert!(
        classes.iter().all(|(c, _)| c.starts_with("timeout")),
        "{classes:?}"
    );
    assert_eq!(failed, calls);
    // The coalescer sends one statement for the key at a time. With the `allow` and `local`
    // fallbacks the outage debt's charging task may have one of its own in flight beside it
    // (one round at a time, each with the call timeout): it starts when a call finds the store
    // answering, which happens while the test is still taking the connections.
    let bound = if mode == FallbackMode::Deny { 1 } else { 2 };
    assert!(
        in_flight <= bound,
        "{in_flight} statements in flight on one key (at most {bound})"
    );
    assert_eq!(
        by_fallback,
        hold.len(),
        "the fallback decides while the pool is held"
    );
    // The breaker may be open for up to its 500 ms cap when the pool comes back.
    assert!(
        recovery <= Duration::from_millis(700),
        "recovery took {recovery:?}"
    );
}

fn label(mode: FallbackMode) -> &'static str {
    match mode {
        FallbackMode::Deny => "deny",
        FallbackMode::Allow => "allow",
        FallbackMode::Local { .. } => "local",
    }
}

// `fault_store(connection, pool)`: a store with the fault tests' settings, as `tests/common`'s,
// from the same definition in the test kit; built again through the crate's poll helper.
tokenlease_testkit::fault_store!(crate::store, crate::tests::eventually);

// ---------------------------------------------------------------------------------------------
// A store wrapper that logs every call reaching the database (`Recording`, `Log`, `class`), over
// the crate's own store types, its calls timed in tokio's `Instant` (the crate's clock)

tokenlease_testkit::recording_store!(crate::store, Instant);

// ---------------------------------------------------------------------------------------------
// Load and measurements

/// One decision.
#[derive(Debug, Clone, Copy)]
struct Event {
    /// When the call started, since the run's origin.
    at: Duration,
    by: DecidedBy,
    /// How long the caller waited.
    took: Duration,
}

/// Runs `tasks` callers on [`KEY`] from now until `origin + until`, each pausing 1 ms between
/// calls (demand well above the refill rate); their decisions, in order of start.
fn drive(
    limiter: &Limiter,
    plan: &Arc<Plan>,
    tasks: usize,
    origin: Instant,
    until: Duration,
) -> tokio::task::JoinHandle<Vec<Event>> {
    let callers: Vec<_> = (0..tasks)
        .map(|_| {
            let limiter = limiter.clone();
            let plan = Arc::clone(plan);
            move || {
                let (limiter, plan) = (limiter.clone(), Arc::clone(&plan));
                async move {
                    let start = instant();
                    let d = limiter
                        .try_acquire_with(&plan, KEY, 1.0)
                        .await
                        .expect("a decision, never an error");
                    Event {
                        at: start - origin,
                        by: d.decided_by,
                        took: instant() - start,
                    }
                }
            }
        })
        .collect();
    let until = Arc::new(AtomicU64::new(until.as_millis() as u64));
    kit::drive(callers, instant, origin, &until, |e: &Event| e.at)
}
