//! D7, a hung server, two ways, in each fallback mode: the proxy black-holes every byte for
//! 2 s; and the postmaster and every server process stopped with SIGSTOP for 2 s, with
//! statements in flight, new connections during the stop, and a store built while it lasts.
//! Calls end at their timeouts, callers wait no longer than a direct call may, and the store
//! answers again within a second.

use crate::rig::{
    C, Call, DIRECT_WAIT, Instance, Mode, R, Rig, calls_in, direct_plan, drive, error_classes, ms,
    per_mode, recovered_at, waits,
};

use std::time::{Duration, Instant};

per_mode! {
    /// D7: a hung database: the proxy black-holes every byte for 2 s.
    d7_hung_database => d7;
    /// D7: a hung database: the postmaster and its backends stopped with SIGSTOP for 2 s.
    d7_hung_database_sigstop => d7_sigstop;
}

async fn d7(mode: Mode) {
    let rig = Rig::start().await;
    let instance = rig.instance(&rig.proxied(), 4).await;
    let instances = [instance.clone()];
    let plan = direct_plan(mode, C, R);
    let origin = Instant::now();
    let run = drive(&instances, &plan, 4, origin, Duration::from_millis(4_000));
    // sleep: the fault timeline, the black hole from 0.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(500)).into()).await;
    rig.proxy.black_hole(true);
    let hole_start = origin.elapsed();
    // sleep: the fault timeline, every byte black-holed until 2.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(2_500)).into()).await;
    rig.proxy.black_hole(false);
    let hole_end = origin.elapsed();
    let events = run.await.expect("the run");

    let (calls, failed, slowest) = calls_in(&instances, origin, hole_start, hole_end);
    let classes = error_classes(&instances, origin, hole_start, hole_end);
    let recovered = recovered_at(&instances, origin, hole_end).expect("recovered");
    let recovery = recovered.saturating_sub(hole_end);
    let (_, p99, max) = waits(&events);
    eprintln!(
        "D7 {}: waits p99 {:.3} ms max {:.1} ms; black hole 2 s: {calls} db calls, {failed} failed \
         {classes:?}, slowest {:.1} ms; recovery {:.0} ms after unblocking; proxy connections {}",
        mode.label(),
        ms(p99),
        ms(max),
        ms(slowest),
        ms(recovery),
        rig.proxy.active(),
    );
    assert!(max <= DIRECT_WAIT, "a caller waited {max:?}");
    assert_eq!(failed, calls, "no call succeeds through the black hole");
    assert!(
        slowest <= Duration::from_millis(100),
        "a call took {slowest:?}"
    );
    assert!(
        recovery <= Duration::from_secs(1),
        "recovery took {recovery:?}"
    );
}

/// D7, SIGSTOP variant: the postmaster (from `postmaster.pid`) and every process it forked
/// (`TempPostgres::suspend`, by pid, never by name) stopped for 2 s, then continued. One instance is
/// busy when the server stops (its statements are in flight); a second instance, built before
/// the stop with an empty pool, calls only during it, so each of its calls needs a new
/// connection; and a store built during the stop must give up at its 250 ms connect timeout.
async fn d7_sigstop(mode: Mode) {
    let rig = Rig::start().await;
    let busy = rig.instance(&rig.direct(), 4).await;
    let fresh = rig.instance(&rig.direct(), 4).await;
    let plan = direct_plan(mode, C, R);
    let origin = Instant::now();
    let run = drive(
        std::slice::from_ref(&busy),
        &plan,
        4,
        origin,
        Duration::from_millis(4_000),
    );

    // sleep: the fault timeline, the server stopped (SIGSTOP) at 0.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(500)).into()).await;
    let stopped = rig.pg.suspend().expect("SIGSTOP the server");
    let processes = stopped.processes();
    let stop_at = origin.elapsed();

    // New connections while stopped: the fresh instance's callers, and a bare connect.
    // sleep: the fault timeline, new connections from 0.7 s, while the server is stopped.
    tokio::time::sleep_until((origin + Duration::from_millis(700)).into()).await;
    let fresh_run = drive(
        std::slice::from_ref(&fresh),
        &plan,
        1,
        origin,
        Duration::from_millis(4_000),
    );
    // A store built while the server is stopped: its first connection (TCP accepted by the
    // stopped postmaster's kernel, then no startup answer) must end at the connect timeout.
    let direct = rig.direct();
    let bare = tokio::spawn(async move {
        let start = Instant::now();
        let built = tokenlease::store::PostgresStore::builder(&direct)
            .expect("connection string")
            .connect_timeout(Duration::from_millis(250))
            .migrate(false)
            .build()
            .await;
        let outcome = match built {
            Ok(_) => "connected".to_owned(),
            Err(e) => format!("error: {e}"),
        };
        (start.elapsed(), outcome)
    });

    // sleep: the fault timeline, the server stopped until 2.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(2_500)).into()).await;
    stopped.resume();
    let cont_at = origin.elapsed();
    let events = run.await.expect("the run");
    let fresh_events = fresh_run.await.expect("the fresh run");
    let (bare_took, bare_outcome) = bare.await.expect("the bare connect");

    // Statements in flight when the server stopped: they end at the call timeout.
    let in_flight: Vec<Call> = busy
        .log
        .calls()
        .into_iter()
        .filter(|c| c.start - origin < stop_at && c.start + c.took - origin > stop_at)
        .collect();
    let in_flight_slowest = in_flight.iter().map(|c| c.took).max().unwrap_or_default();
    let (calls, failed, slowest) = calls_in(std::slice::from_ref(&busy), origin, stop_at, cont_at);
    let classes = error_classes(std::slice::from_ref(&busy), origin, stop_at, cont_at);
    let (f_calls, f_failed, f_slowest) =
        calls_in(std::slice::from_ref(&fresh), origin, stop_at, cont_at);
    let f_classes = error_classes(std::slice::from_ref(&fresh), origin, stop_at, cont_at);
    let first_fresh = fresh.log.calls().first().cloned().expect("a fresh call");
    let recovery = |i: &Instance| {
        recovered_at(std::slice::from_ref(i), origin, cont_at).map(|t| t.saturating_sub(cont_at))
    };
    let (busy_recovery, fresh_recovery) = (recovery(&busy), recovery(&fresh));
    let (_, p99, max) = waits(&events);
    let (_, f_p99, f_max) = waits(&fresh_events);
    eprintln!(
        "D7 SIGSTOP {}: {processes} processes stopped 2 s. Busy instance: {} statements in \
         flight at the stop, ended after at most {:.1} ms; {calls} db calls in the stop, {failed} \
         failed {classes:?}, slowest {:.1} ms; waits p99 {:.3} ms max {:.1} ms; recovery \
         {:?} ms after SIGCONT. Fresh instance (new connections): first call {:?} after {:.1} ms; \
         {f_calls} db calls, {f_failed} failed {f_classes:?}, slowest {:.1} ms; waits p99 {:.3} \
         ms max {:.1} ms; recovery {:?} ms. A store built during the stop (connect_timeout \
         250 ms): {bare_outcome} after {:.0} ms",
        mode.label(),
        in_flight.len(),
        ms(in_flight_slowest),
        ms(slowest),
        ms(p99),
        ms(max),
        busy_recovery.map(ms),
        first_fresh.error,
        ms(first_fresh.took),
        ms(f_slowest),
        ms(f_p99),
        ms(f_max),
        fresh_recovery.map(ms),
        ms(bare_took),
    );
    assert!(max <= DIRECT_WAIT, "a busy caller waited {max:?}");
    assert!(f_max <= DIRECT_WAIT, "a fresh caller waited {f_max:?}");
    assert!(
        bare_outcome.contains("connecting to the database"),
        "new connections time out at the connect timeout: {bare_outcome}"
    );
    assert!(
        bare_took <= Duration::from_millis(400),
        "new connections end at the 250 ms connect timeout, took {bare_took:?}"
    );
    // Often one statement is in flight at the stop, sometimes none (the callers pause 1 ms
    // between calls); the calls sent during the stop meet the same stopped backends.
    assert!(
        in_flight_slowest <= Duration::from_millis(100),
        "an in-flight statement ended after {in_flight_slowest:?}"
    );
    assert_eq!(
        failed, calls,
        "no call succeeds while the server is stopped"
    );
    assert_eq!(
        f_failed, f_calls,
        "no new connection while the server is stopped"
    );
    assert!(
        slowest <= Duration::from_millis(100) && f_slowest <= Duration::from_millis(100),
        "a call took {slowest:?} (busy), {f_slowest:?} (fresh)"
    );
    assert!(
        first_fresh
            .error
            .as_deref()
            .is_some_and(|e| e.starts_with("timeout")),
        "the first new connection times out: {:?}",
        first_fresh.error
    );
    for (class, _) in classes.iter().chain(&f_classes) {
        assert!(
            class.starts_with("timeout") || class == "circuit-open",
            "unexpected error class {class}"
        );
    }
    for (what, recovery) in [("busy", busy_recovery), ("fresh", fresh_recovery)] {
        let recovery = recovery.unwrap_or_else(|| panic!("the {what} instance recovers"));
        assert!(
            recovery <= Duration::from_secs(1),
            "{what}: recovery took {recovery:?}"
        );
    }
}
