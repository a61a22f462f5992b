//! D2, a slow server: 2 s of latency on every reply against a 50 ms call timeout, then a
//! session holding the bucket row `FOR UPDATE` for 2 s, in each fallback mode (direct mode).
//! Every delayed call gives up at its timeout, no statement stays behind on the server, and
//! what the store admitted keeps within the bucket's envelope.

use crate::rig::{
    C, DIRECT_WAIT, Event, KEY, Mode, R, Rig, assert_windows, calls_in, direct_plan, drive,
    in_window, ms, per_mode, percentile, recovered_at, waits,
};

use std::time::{Duration, Instant};

use tokenlease::DecidedBy;

per_mode! {
    /// D2: 2 s of latency on every reply against a 50 ms call timeout, then a session holding
    /// the bucket row `FOR UPDATE` for 2 s.
    d2_latency => d2;
}

async fn d2(mode: Mode) {
    let rig = Rig::start().await;
    let instance = rig.instance(&rig.proxied(), 4).await;
    let instances = [instance.clone()];
    let plan = direct_plan(mode, C, R);
    let origin = Instant::now();
    let run = drive(&instances, &plan, 4, origin, Duration::from_millis(7_500));
    let admin = rig.admin().await;

    // Phase A: every reply 2 s late, from 0.5 s to 2.5 s.
    // sleep: the fault timeline, the replies delayed from 0.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(500)).into()).await;
    rig.proxy.delay(Duration::ZERO, Duration::from_secs(2));
    let a_start = origin.elapsed();
    // sleep: the fault timeline, every reply 2 s late until 2.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(2_500)).into()).await;
    rig.proxy.pass();
    let a_end = origin.elapsed();
    // Replies already in the pipe still arrive 2 s late.
    // sleep: the fault timeline, 0.5 s into the 2 s delay of the replies in the pipe.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stuck_a = old_limiter_statements(&admin).await;
    // sleep: the fault timeline, phase B at 4.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(4_500)).into()).await;
    let a_recovered = recovered_at(&instances, origin, a_end);

    // Phase B: a session holds the row lock for 2 s, from 4.5 s to 6.5 s.
    let b_start = origin.elapsed();
    let mut locker = rig.admin().await;
    let tx = locker.transaction().await.expect("begin");
    tx.execute(
        "SELECT 1 FROM tokenlease_buckets WHERE key = $1 FOR UPDATE",
        &[&KEY],
    )
    .await
    .expect("lock the row");
    // sleep: the fault timeline, the row's lock held 1 s before the count.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let stuck_b = old_limiter_statements(&admin).await;
    // sleep: the fault timeline, the row's lock held until 6.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(6_500)).into()).await;
    tx.rollback().await.expect("release the row");
    let b_end = origin.elapsed();
    let events = run.await.expect("the run");
    let b_recovered = recovered_at(&instances, origin, b_end);

    let (a_calls, a_failed, a_slowest) = calls_in(&instances, origin, a_start, a_end);
    let a_timeouts: Vec<Duration> = instance
        .log
        .calls()
        .iter()
        .filter(|c| {
            let t = c.start - origin;
            t >= a_start && t < a_end && c.error.is_some()
        })
        .map(|c| c.took)
        .collect();
    let (b_calls, b_failed, b_slowest) = calls_in(&instances, origin, b_start, b_end);
    let (_, p99, max) = waits(&events);
    let phase = |from, to| {
        let e: Vec<Event> = events
            .iter()
            .filter(|e| in_window(e, from, to))
            .copied()
            .collect();
        let admitted = e.iter().filter(|e| e.allowed).count();
        (e.len(), admitted, waits(&e).2)
    };
    let (a_n, a_admitted, a_max) = phase(a_start, a_end);
    let (b_n, b_admitted, b_max) = phase(b_start, b_end);
    eprintln!(
        "D2 {}: waits p99 {:.3} ms max {:.1} ms. Delay phase: {a_n} decisions ({a_admitted} admitted), \
         caller max {:.1} ms; {a_calls} db calls, {a_failed} failed, p99 {:.1} ms, slowest {:.1} ms; \
         stuck statements {stuck_a}; recovered {:?} ms after. Lock phase: {b_n} decisions \
         ({b_admitted} admitted), caller max {:.1} ms; {b_calls} db calls, {b_failed} failed, slowest \
         {:.1} ms; stuck statements {stuck_b}; recovered {:?} ms after",
        mode.label(),
        ms(p99),
        ms(max),
        ms(a_max),
        ms(percentile(a_timeouts.clone(), 0.99)),
        ms(a_slowest),
        a_recovered.map(|t| ms(t.saturating_sub(a_end))),
        ms(b_max),
        ms(b_slowest),
        b_recovered.map(|t| ms(t.saturating_sub(b_end))),
    );
    assert!(max <= DIRECT_WAIT, "a caller waited {max:?}");
    assert!(
        a_failed > 0 && a_failed == a_calls,
        "every delayed call times out"
    );
    assert!(
        percentile(a_timeouts, 0.99) <= Duration::from_millis(70),
        "delayed calls give up within 70 ms"
    );
    assert!(
        a_slowest <= Duration::from_millis(100),
        "a call took {a_slowest:?}"
    );
    assert!(
        b_slowest <= Duration::from_millis(100),
        "a call took {b_slowest:?}"
    );
    assert!(b_failed > 0, "the locked row makes calls fail");
    assert_eq!(
        stuck_a, 0,
        "limiter statements older than 500 ms (delay phase)"
    );
    assert_eq!(
        stuck_b, 0,
        "limiter statements older than 500 ms (lock phase)"
    );
    if mode == Mode::Deny {
        let fallback_admitted = events
            .iter()
            .filter(|e| e.allowed && matches!(e.by, DecidedBy::Fallback(_)))
            .count();
        assert_eq!(fallback_admitted, 0, "the deny fallback admits nothing");
    }
    // The bound: whatever the store admitted plus what the fallback admitted in allow mode.
    let store_admitted: Vec<Event> = events
        .iter()
        .filter(|e| e.allowed && e.by == DecidedBy::Store)
        .copied()
        .collect();
    assert_windows(
        &store_admitted,
        Duration::ZERO,
        Duration::from_secs(8),
        1.0,
        "store",
    );
    assert!(
        a_recovered.is_some() && b_recovered.is_some(),
        "recovered after each phase"
    );
}

/// Limiter statements running for more than 500 ms.
async fn old_limiter_statements(admin: &tokio_postgres::Client) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'tokenlease' \
             AND state = 'active' AND now() - query_start > interval '500 milliseconds'",
            &[],
        )
        .await
        .map(|row| row.get(0))
        .unwrap_or(-1)
}
