//! D9, the wall clock stepped: +1 h and −1 h mid-run change no count, in direct and leased
//! mode and each fallback mode; the skew gauge shows each step.

use crate::common;
use crate::rig::{
    Event, Instance, KEY, Mode, N, Rig, direct_plan, in_window, ms, per_mode, snapshot, waits,
};

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use metrics_util::debugging::DebugValue;
use tokenlease::bucket::Timestamp;
use tokenlease::clock::{WallClock, timestamp_from_system_time};
use tokenlease::policy::{FallbackSettings, LeaseSettings, Plan};
use tokenlease::{DecidedBy, Limiter};

per_mode! {
    /// D9: the wall clock stepped +1 h and −1 h mid-run changes no count; the skew gauge shows
    /// the step.
    d9_wall_clock_steps => d9;
}

/// A wall clock for one limiter instance: the host's, plus an offset the test steps, as an
/// administrator or NTP setting the clock would. Clones share the offset.
#[derive(Debug, Clone, Default)]
struct SteppedClock {
    offset_nanos: Arc<AtomicI64>,
}

impl SteppedClock {
    fn step(&self, by_secs: i64) {
        self.offset_nanos
            .fetch_add(by_secs * 1_000_000_000, Ordering::SeqCst);
    }
}

impl WallClock for SteppedClock {
    fn now(&self) -> Timestamp {
        let real = timestamp_from_system_time(SystemTime::now()).as_nanos();
        Timestamp::from_nanos(real.saturating_add_signed(self.offset_nanos.load(Ordering::SeqCst)))
    }
}

const HOUR: i64 = 3_600;
/// D9's bucket: small, so that a mis-timed lease or refill would show in the count.
const D9_C: u64 = 20;
const D9_R: f64 = 10.0;
/// One call every 20 ms (50/s, five times the refill rate) for 3 s.
const D9_EVERY: Duration = Duration::from_millis(20);
const D9_CALLS: u32 = 150;
/// The wall clocks step at 1 s; the store becomes unreachable at 2 s.
const D9_STEP_AT: Duration = Duration::from_secs(1);
const D9_OUTAGE_AT: Duration = Duration::from_secs(2);

/// Calls `limiter` on `key` once every [`D9_EVERY`] from `origin`, one call at a time,
/// [`D9_CALLS`] times: a fixed schedule, so two runs make the same calls at the same moments.
fn paced(
    limiter: Limiter,
    plan: Arc<Plan>,
    key: String,
    run: usize,
    origin: Instant,
) -> tokio::task::JoinHandle<Vec<Event>> {
    tokio::spawn(async move {
        let mut events = Vec::new();
        for k in 0..D9_CALLS {
            // sleep: pacing, a call every 20 ms on a fixed schedule from `origin`.
            tokio::time::sleep_until((origin + D9_EVERY * k).into()).await;
            let start = Instant::now();
            let d = limiter
                .try_acquire_with(&plan, &key, 1.0)
                .await
                .expect("a decision, never an error");
            events.push(Event {
                at: start - origin,
                instance: run,
                allowed: d.allowed,
                by: d.decided_by,
                took: start.elapsed(),
                store_time: d.store_time,
            });
        }
        events
    })
}

/// One D9 run: a limiter instance with its own wall clock, pool and key.
struct ClockRun {
    leased: bool,
    /// The wall clock's step at [`D9_STEP_AT`], in seconds.
    step: i64,
    clock: SteppedClock,
    instance: Instance,
    name: String,
}

/// D9: three runs of one workload at once for each of direct and leased mode, with the wall
/// clock left alone, stepped +1 h and stepped −1 h mid-run. Each run has its own limiter
/// instance (pool, breaker, wall clock) and its own key with the same plan, so the three see
/// the same machine load and the same outage at the same moments. For 2 s the store decides
/// (the step comes at 1 s), then the proxy resets and refuses every connection, and the
/// fallback (and any lease) decides for the last second. Every stepped run admits the
/// undisturbed run's count ± 1, widened by one for each call the machine's load sent to the
/// fallback (counted, not guessed); a leased run's outage keeps its mode's own bound; and the
/// skew gauge shows each step.
async fn d9(mode: Mode) {
    let rig = Rig::start().await;
    let direct = direct_plan(mode, D9_C, D9_R);
    let leased = Arc::new(
        common::plan(D9_C, D9_R)
            .with_lease(LeaseSettings::default())
            .with_fallback(FallbackSettings::new(mode.fallback())),
    );
    let mut runs = Vec::new();
    for leased in [false, true] {
        for step in [0, HOUR, -HOUR] {
            let name = format!(
                "d9-{}-{}",
                if leased { "leased" } else { "direct" },
                match step {
                    0 => "none",
                    HOUR => "plus1h",
                    _ => "minus1h",
                }
            );
            let clock = SteppedClock::default();
            let instance = rig
                .instance_with(&rig.proxied(), 4, &name, clock.clone())
                .await;
            runs.push(ClockRun {
                leased,
                step,
                clock,
                instance,
                name,
            });
        }
    }
    let _ = snapshot();
    let origin = Instant::now() + Duration::from_millis(50);
    let handles: Vec<_> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let plan = Arc::clone(if r.leased { &leased } else { &direct });
            paced(
                r.instance.limiter.clone(),
                plan,
                format!("{KEY}:{}", r.name),
                i,
                origin,
            )
        })
        .collect();

    // sleep: the fault timeline, the wall clocks step at 1 s.
    tokio::time::sleep_until((origin + D9_STEP_AT).into()).await;
    for r in &runs {
        r.clock.step(r.step);
    }
    // Just before the outage: the skew each breaker measured after the step.
    // sleep: the fault timeline, 0.9 s after the step, in which each breaker measures the skew.
    tokio::time::sleep_until((origin + D9_OUTAGE_AT - Duration::from_millis(100)).into()).await;
    let skews: Vec<Option<f64>> = runs
        .iter()
        .map(|r| r.instance.breaker.clock_skew())
        .collect();
    let snap = snapshot();
    let gauges: Vec<Option<f64>> = runs
        .iter()
        .map(|r| {
            snap.iter()
                .find(|(n, l, _)| {
                    n == "tokenlease_store_clock_skew_seconds"
                        && l.iter().any(|(k, v)| k == "store" && *v == r.name)
                })
                .and_then(|(.., v)| match v {
                    DebugValue::Gauge(g) => Some(g.into_inner()),
                    _ => None,
                })
        })
        .collect();
    // sleep: the fault timeline, the store unreachable from 2 s.
    tokio::time::sleep_until((origin + D9_OUTAGE_AT).into()).await;
    rig.proxy.refuse(true);
    rig.proxy.reset_all();
    let outage = origin.elapsed();
    let mut events = Vec::new();
    for h in handles {
        events.push(h.await.expect("no caller panicked"));
    }

    let admitted = |events: &[Event], from: Duration, to: Duration| {
        events
            .iter()
            .filter(|e| e.allowed && in_window(e, from, to))
            .count()
    };
    let mut lines = Vec::new();
    let mut counts = Vec::new();
    for (r, ev) in runs.iter().zip(&events) {
        let store = admitted(ev, Duration::ZERO, outage);
        let after = admitted(ev, outage, Duration::MAX);
        let by_fallback = ev
            .iter()
            .filter(|e| e.at < outage && matches!(e.by, DecidedBy::Fallback(_)))
            .count();
        let (_, _, max) = waits(ev);
        counts.push(store + after);
        lines.push(format!(
            "{}: admitted {} ({store} before the outage, {after} in it), {by_fallback} fallback \
             decisions before the outage, caller max {:.1} ms",
            r.name,
            store + after,
            ms(max),
        ));
    }
    let i = |leased: bool, step: i64| {
        runs.iter()
            .position(|r| r.leased == leased && r.step == step)
            .expect("run")
    };
    eprintln!(
        "D9 {}: {}; skews measured (s) {:?}, gauges {:?}",
        mode.label(),
        lines.join("; "),
        skews,
        gauges,
    );
    for (r, (skew, gauge)) in runs.iter().zip(skews.iter().zip(&gauges)) {
        // The store's clock minus a local clock stepped by `step`: −step, to within a round
        // trip (same host).
        let expected = -r.step as f64;
        let skew = skew.expect("a skew measured");
        assert!(
            (skew - expected).abs() < 0.05,
            "{}: skew {skew} s, expected {expected}",
            r.name
        );
        let gauge = gauge.expect("the skew gauge is exported");
        assert!(
            (gauge - expected).abs() < 0.05,
            "{}: gauge {gauge} s, expected {expected}",
            r.name
        );
    }
    // What a loaded machine changes, counted per run: a call that waited longer than its bound
    // for the store (the direct call timeout, or a refill slower than the lease's `max_wait`)
    // is decided by the fallback. In direct mode each such call moves the store's admissions by
    // one at most (the call it did not decide, or a take that committed after its caller gave
    // up). In leased mode by two at most: the call, and the token its refill still brings into
    // the lease (a waiter that gives up leaves its cost in the refill it asked for), which can
    // sit there unspent when the outage begins. Under `local` the local bucket's count in the
    // outage moves by one more. So stepped and undisturbed runs are compared within 1 + those
    // calls of both (twice them for leased runs; ± 1 on an idle machine, where there are none),
    // and a wall clock that reached a refill or a lease would move a count by up to C (a +1 h
    // step refills the bucket) or R per second (a −1 h step stops it).
    let b = (D9_C as f64 * LeaseSettings::default().max_fraction).floor() as usize;
    let dry_window_calls = (4.0 * b as f64 / D9_R / D9_EVERY.as_secs_f64()).ceil() as usize + 1;
    let fallback_before = |run: usize| {
        events[run]
            .iter()
            .filter(|e| e.at < outage && matches!(e.by, DecidedBy::Fallback(_)))
            .count()
    };
    let decided_before = |run: usize| {
        events[run]
            .iter()
            .filter(|e| e.allowed && e.at < outage && !matches!(e.by, DecidedBy::Fallback(_)))
            .count()
    };
    // And on its own, whatever the load: what the store and the leases admitted before the
    // outage came out of one bucket in that time, at most C + R·t (to the end of the last call
    // that started before it), as a +1 h step that refilled the bucket would break.
    let envelope = D9_C as f64 + D9_R * (outage + Duration::from_millis(50)).as_secs_f64();
    for (run, r) in runs.iter().enumerate() {
        let decided = decided_before(run);
        assert!(
            decided as f64 <= envelope + 1.0,
            "{}: the store and leases admitted {decided} before the outage, the bucket held \
             {envelope:.1}",
            r.name
        );
    }
    for leased in [false, true] {
        let none = i(leased, 0);
        for step in [HOUR, -HOUR] {
            let stepped = i(leased, step);
            let load = fallback_before(none) + fallback_before(stepped);
            let per_call = if leased { 2 } else { 1 };
            let (d_none, d_stepped) = (decided_before(none), decided_before(stepped));
            assert!(
                d_stepped.abs_diff(d_none) <= 1 + per_call * load,
                "{}: the store and leases admitted {d_stepped} before the outage, undisturbed \
                 {d_none} ({load} fallback decisions before it in the two runs)",
                runs[stepped].name
            );
            if !leased {
                // Direct: in the outage the fallback decides every call the same way in each
                // run; whole runs compared.
                let (c_none, c_stepped) = (counts[none], counts[stepped]);
                assert!(
                    c_stepped.abs_diff(c_none) <= 1 + 2 * load,
                    "{}: admitted {c_stepped}, undisturbed {c_none} ({load} fallback decisions \
                     before the outage in the two runs)",
                    runs[stepped].name
                );
            }
        }
    }
    // Leased, in the outage: whether a run's last refill before it answered (and with what:
    // some tokens, or "empty") or failed at the cut is a race of milliseconds, not of the wall
    // clock, so each run is checked against its mode's own bound. The lease admits what it
    // held, at most B; in `allow` a dry lease keeps denying until the store's last "empty" runs
    // out (docs/design/leases.md), at most one stretched dry window (4 × B / r of calls), and the
    // fallback admits the rest; in `deny` the fallback denies; under `local` it admits at most
    // its share of the bucket (C / N, refilling at R / N) over the outage.
    for step in [0, HOUR, -HOUR] {
        let run = i(true, step);
        let name = &runs[run].name;
        let in_outage: Vec<_> = events[run].iter().filter(|e| e.at >= outage).collect();
        let outage_len = in_outage
            .iter()
            .map(|e| (e.at + e.took).saturating_sub(outage))
            .max()
            .unwrap_or_default()
            .as_secs_f64();
        let local_share = (D9_C as f64 / N as f64 + D9_R / N as f64 * outage_len).floor() as usize;
        let count = |allowed: bool, lease: bool| {
            in_outage
                .iter()
                .filter(|e| e.allowed == allowed && (e.by == DecidedBy::Lease) == lease)
                .count()
        };
        let (lease_admitted, lease_denied) = (count(true, true), count(false, true));
        let (fallback_admitted, fallback_denied) = (count(true, false), count(false, false));
        assert!(
            lease_admitted <= b,
            "{name}: the lease admitted {lease_admitted} in the outage, more than B = {b}"
        );
        match mode {
            Mode::Allow => {
                assert_eq!(fallback_denied, 0, "{name}: denied in the outage");
                assert!(
                    lease_denied <= dry_window_calls,
                    "{name}: {lease_denied} lease denials in the outage, one dry window holds \
                     {dry_window_calls} calls"
                );
            }
            Mode::Deny => {
                assert_eq!(fallback_admitted, 0, "{name}: admitted by the fallback");
            }
            Mode::Local => {
                assert!(
                    fallback_admitted <= local_share,
                    "{name}: the local fallback admitted {fallback_admitted} in the outage, \
                     its share is {local_share}"
                );
            }
        }
    }
}
