//! Outage debt against a real PostgreSQL stopped with `pg_ctl stop` mid-run (D10, D11).
//!
//! D10: two leased instances (separate pools, breakers and lease actors) with the `local`
//! fallback hammer one key; the server is stopped for 3 s and started again. Over the window
//! from the stop to a few seconds after the restart, the fleet's admissions are held against
//! `C + r·(T + ε) + N·B + U + X`, where `U` is the debt still unpaid at the window's end and `X`
//! the debt dropped (`docs/design/outage-debt.md` derives it). With outage debt on they stay within it; with
//! it off (same scenario, `U = X = 0`) they exceed it, by about what the fallback admitted
//! beyond the bucket's refill in the outage.
//!
//! D11: one direct-mode instance with the `allow` fallback: everything admitted while the
//! server is down is charged to the bucket's row once it is back.
//!
//! Timing-dependent: runs in the nextest `serial` group, and the tests of this file take a lock
//! so `cargo test` runs them one at a time too. Each prints its figures (`--nocapture`).

use crate::common;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokenlease::bucket::{BucketConfig, Rate, Tokens};
use tokenlease::policy::{FallbackMode, FallbackSettings, LeaseSettings, Plan};
use tokenlease::store::CircuitBreaker;
use tokenlease::{DecidedBy, Limiter};
use tokenlease_testkit::{StopMode, TempPostgres};

const KEY: &str = "debt:hot";

/// D10's bucket: capacity 300, 100 tokens a second, so that the 3 s outage refills it exactly
/// (`r·t = C`): what the bucket gains in the outage, and so what the fleet admits again at
/// recovery without debt, is as large as it can be. Leases of at most `B` = 0.033 × 300 = 9.9.
const C: u64 = 300;
const R: f64 = 100.0;
const MAX_FRACTION: f64 = 0.033;
const B: f64 = 9.9;
/// Limiter instances, and the local fallback's `instances`.
const N: usize = 2;
/// Slack on the window's length for the store's clock against the test's (as in C1 and D1).
const EPS: f64 = 0.02;

fn bucket(capacity: u64, per_second: f64) -> BucketConfig {
    BucketConfig::new(
        Tokens::whole(capacity),
        Rate::from_f64(per_second).expect("rate"),
    )
    .expect("bucket")
}

async fn start_cluster() -> Arc<TempPostgres> {
    let pg = tokio::task::spawn_blocking(TempPostgres::start)
        .await
        .expect("join")
        .expect("a throwaway PostgreSQL (install the server binaries: apt-get install postgresql)");
    Arc::new(pg)
}

/// A limiter instance with its own pool of 4 and circuit breaker, with the fault tests'
/// settings (50 ms call timeout, 250 ms connect timeout, 100 ms statement timeout).
async fn instance(pg: &TempPostgres, debt: bool) -> Limiter {
    let store = common::fault_store(&pg.connection_string("postgres"), 4).await;
    Limiter::builder(CircuitBreaker::new(store))
        .outage_debt(debt)
        .build()
}

/// Runs a blocking server operation off the runtime's workers.
async fn server(pg: &Arc<TempPostgres>, op: impl FnOnce(&TempPostgres) + Send + 'static) {
    let pg = Arc::clone(pg);
    tokio::task::spawn_blocking(move || op(&pg))
        .await
        .expect("server operation");
}

/// One decision.
#[derive(Debug, Clone, Copy)]
struct Event {
    /// When the call started, since the run's origin.
    at: Duration,
    allowed: bool,
    by: DecidedBy,
}

/// Runs `tasks` callers per instance on [`KEY`] until `stop` is set, each pausing `pace`
/// between calls.
fn drive(
    instances: &[Limiter],
    plan: &Arc<Plan>,
    tasks: usize,
    pace: Duration,
    origin: Instant,
    stop: &Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<Event>> {
    let mut handles = Vec::new();
    for limiter in instances {
        for _ in 0..tasks {
            let limiter = limiter.clone();
            let plan = Arc::clone(plan);
            let stop = Arc::clone(stop);
            handles.push(tokio::spawn(async move {
                let mut events = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let at = origin.elapsed();
                    let d = limiter
                        .try_acquire_with(&plan, KEY, 1.0)
                        .await
                        .expect("a decision, never an error");
                    events.push(Event {
                        at,
                        allowed: d.allowed,
                        by: d.decided_by,
                    });
                    // sleep: pacing, the offered load's period.
                    tokio::time::sleep(pace).await;
                }
                events
            }));
        }
    }
    tokio::spawn(async move {
        let mut all = Vec::new();
        for h in handles {
            all.extend(h.await.expect("no caller panicked"));
        }
        all.sort_by_key(|e| e.at);
        all
    })
}

/// The instances' outage debt summed: (outstanding, charged, dropped) in tokens.
fn debt_of(instances: &[Limiter]) -> (f64, f64, f64) {
    instances.iter().fold((0.0, 0.0, 0.0), |(u, k, x), l| {
        let d = l.outage_debt();
        (
            u + d.outstanding.as_f64(),
            k + d.charged.as_f64(),
            x + d.dropped.as_f64(),
        )
    })
}

/// Polls `done` every 20 ms until it holds or `limit` has passed; whether it held.
async fn poll(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    common::poll_until(Duration::from_millis(20), limit, async || done())
        .await
        .is_ok()
}

// ---------------------------------------------------------------------------------------------
// D10

mod d10_outage_debt {
    use super::*;

    /// D10 with outage debt on (the default): the fleet stays within the bound.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn on() {
        let _serial = common::serial().await;
        d10(true).await;
    }

    /// D10 with outage debt off: the same scenario exceeds the same bound.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn off() {
        let _serial = common::serial().await;
        d10(false).await;
    }
}

/// Warm-up before the stop, the outage (from the stop's start to the start again), and how
/// long the load runs after the server is up again.
const WARM: Duration = Duration::from_secs(2);
const OUTAGE: Duration = Duration::from_secs(3);
const AFTER: Duration = Duration::from_secs(4);

async fn d10(debt: bool) {
    let pg = start_cluster().await;
    let mut instances = Vec::new();
    for _ in 0..N {
        instances.push(instance(&pg, debt).await);
    }
    let plan = Arc::new(
        Plan::new("d10", bucket(C, R))
            .with_lease(LeaseSettings::default().with_max_fraction(MAX_FRACTION))
            .with_fallback(FallbackSettings::new(FallbackMode::Local {
                instances: NonZeroU32::new(N as u32).expect("N > 0"),
            })),
    );
    let origin = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let run = drive(
        &instances,
        &plan,
        4,
        Duration::from_millis(1),
        origin,
        &stop,
    );

    // sleep: the fault timeline, 2 s of warm-up before the stop.
    tokio::time::sleep_until((origin + WARM).into()).await;
    let (u_start, k_start, x_start) = debt_of(&instances);
    let from = origin.elapsed();
    server(&pg, |pg| pg.stop(StopMode::Fast).expect("stop")).await;
    // sleep: the fault timeline, the server down until 3 s after the stop began.
    tokio::time::sleep_until((origin + WARM + OUTAGE).into()).await;
    let starting = origin.elapsed();
    server(&pg, |pg| pg.start_again().expect("start again")).await;
    let up = origin.elapsed();
    // sleep: the fault timeline, 4 s of load after the server is up again.
    tokio::time::sleep_until((origin + up + AFTER).into()).await;
    // The window ends here: the debt now, then the load stops.
    let (u_end, k_end, x_end) = debt_of(&instances);
    let to = origin.elapsed();
    stop.store(true, Ordering::Relaxed);
    let events = run.await.expect("the run");

    let in_window = |e: &&Event| e.at >= from && e.at < to;
    let admitted = events
        .iter()
        .filter(in_window)
        .filter(|e| e.allowed)
        .count() as f64;
    let by_fallback = events
        .iter()
        .filter(in_window)
        .filter(|e| e.allowed && matches!(e.by, DecidedBy::Fallback(_)))
        .count() as f64;
    let t = (to - from).as_secs_f64();
    let envelope = C as f64 + R * (t + EPS) + N as f64 * B;
    // The stated fallback share: what the fallback admitted that is not charged by the
    // window's end (unpaid, or dropped during the window). Zero with debt off (no ledger).
    let share = u_end + (x_end - x_start);
    let bound = envelope + share;
    let charged = k_end - k_start;
    eprintln!(
        "D10 outage debt {}: window {t:.2} s (stop at {:.2} s, start again {:.2}–{:.2} s, end \
         {:.2} s): admitted {admitted:.0}, of which the local fallback {by_fallback:.0}; \
         envelope C + r·(T + ε) + N·B = {envelope:.0}; debt charged in the window {charged:.0}, \
         unpaid at its end {u_end:.1} (at its start {u_start:.1}), dropped {:.0}; bound \
         {bound:.0}; admitted − envelope = {:+.0}",
        if debt { "on" } else { "off" },
        from.as_secs_f64(),
        starting.as_secs_f64(),
        up.as_secs_f64(),
        to.as_secs_f64(),
        x_end - x_start,
        admitted - envelope,
    );
    assert!(by_fallback > 0.0, "the local fallback admitted nothing");
    if debt {
        assert!(
            admitted <= bound,
            "with outage debt: {admitted} admitted > C + r·(T + ε) + N·B + unpaid + dropped = \
             {bound:.1}"
        );
        assert!(charged > 0.0, "no debt was charged");
        assert_eq!(x_end, 0.0, "no debt dropped");
        // After the load, the refill pays the rest: the ledger empties.
        let paid = poll(Duration::from_secs(30), || debt_of(&instances).0 == 0.0).await;
        let (u, k, x) = debt_of(&instances);
        eprintln!(
            "D10 outage debt on: after the load, {} (unpaid {u:.1}, charged in all {k:.0}, \
             dropped {x:.0})",
            if paid {
                "paid off"
            } else {
                "not paid off in 30 s"
            }
        );
        assert!(
            paid,
            "the debt was not paid off 30 s after the load stopped"
        );
    } else {
        assert_eq!(share, 0.0, "no ledger with debt off");
        assert!(
            admitted > bound,
            "without outage debt the bound held ({admitted} ≤ {bound:.1}): the scenario does \
             not show what the debt changes"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// D11

/// D11: the `allow` fallback's admissions in an outage are charged to the row after it: one
/// direct-mode instance, a bucket of 1,000 refilling at 1 a second, a call every 10 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d11_allow_debt_is_charged_after_recovery() {
    let _serial = common::serial().await;
    let pg = start_cluster().await;
    let limiter = instance(&pg, true).await;
    let plan = Arc::new(
        Plan::new("d11", bucket(1_000, 1.0))
            .with_fallback(FallbackSettings::new(FallbackMode::Allow)),
    );
    let origin = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let run = drive(
        std::slice::from_ref(&limiter),
        &plan,
        1,
        Duration::from_millis(10),
        origin,
        &stop,
    );
    // sleep: the fault timeline on the real server, 1 s of traffic before the stop.
    tokio::time::sleep(Duration::from_secs(1)).await;
    server(&pg, |pg| pg.stop(StopMode::Fast).expect("stop")).await;
    // sleep: the fault timeline, the server stopped for 2 s.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let owed_in_outage = limiter.outage_debt().outstanding.as_f64();
    server(&pg, |pg| pg.start_again().expect("start again")).await;
    // sleep: the fault timeline, 1 s of traffic after the restart.
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let events = run.await.expect("the run");
    let paid = poll(Duration::from_secs(10), || {
        limiter.outage_debt().outstanding.is_zero()
    })
    .await;
    let elapsed = origin.elapsed().as_secs_f64();
    let debt = limiter.outage_debt();
    let by_store = events
        .iter()
        .filter(|e| e.allowed && e.by == DecidedBy::Store)
        .count() as f64;
    let by_fallback = events
        .iter()
        .filter(|e| e.allowed && e.by == DecidedBy::Fallback(FallbackMode::Allow))
        .count() as f64;
    let row = limiter
        .store()
        .inspect(KEY)
        .await
        .expect("inspect")
        .expect("a row");
    let tokens = row.tokens_now.as_f64();
    let expected = 1_000.0 - by_store - by_fallback;
    eprintln!(
        "D11 allow: {} calls, {by_store:.0} admitted by the store, {by_fallback:.0} by the \
         allow fallback ({owed_in_outage:.0} owed during the outage); charged {:.0}, dropped \
         {:.0}, unpaid {:.1}; the row holds {tokens:.1}, 1000 − store − fallback = {expected:.0} \
         (plus at most {elapsed:.1} of refill)",
        events.len(),
        debt.charged.as_f64(),
        debt.dropped.as_f64(),
        debt.outstanding.as_f64(),
    );
    assert!(
        by_fallback >= 50.0,
        "the outage was not seen: {by_fallback}"
    );
    assert!(owed_in_outage > 0.0, "no debt recorded in the outage");
    assert!(paid, "the debt was not charged 10 s after recovery");
    assert_eq!(
        debt.charged.as_f64(),
        by_fallback,
        "every admission charged"
    );
    assert!(debt.dropped.is_zero());
    // The row lost the store's admissions and the charged debt; refill (1 a second) adds a
    // little. A charge committed whose reply timed out would take more: never less.
    assert!(
        tokens <= expected + elapsed + 1.0,
        "the row holds {tokens}: the debt did not reach it ({expected} expected)"
    );
    assert!(
        tokens >= expected - 1.0 - by_fallback,
        "the row holds {tokens}, far below {expected}"
    );
}
