//! D4, connections cut: the proxies reset connections, then the server terminates the
//! limiters' backends, under two instances on one key, in each fallback mode. The errors are
//! those of a lost connection or a timeout, calls succeed again a second after each phase, the
//! pools keep their size, and the store's and the fallback's admissions keep their bounds.

use crate::common;
use crate::rig::{
    C, DIRECT_WAIT, EPS, Mode, N, Proxy, R, Rig, calls_in, direct_plan, drive_until, error_classes,
    ms, per_mode, waits,
};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use tokenlease::DecidedBy;

per_mode! {
    /// D4: connections reset by the proxies, then backends terminated by the server; two
    /// instances on one key.
    d4_connection_resets => d4;
}

/// Limiter sessions on the server whose connection came through `proxy`: the sessions of the
/// one instance behind it.
async fn sessions_behind(admin: &tokio_postgres::Client, proxy: &Proxy) -> i64 {
    let ports: Vec<i32> = proxy.upstream_ports().into_iter().map(i32::from).collect();
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'tokenlease' \
             AND client_port = ANY($1)",
            &[&ports],
        )
        .await
        .map(|row| row.get(0))
        .unwrap_or(-1)
}

/// Connection samples: the most sessions seen per instance, and in all.
#[derive(Debug, Default)]
struct Sessions {
    per_instance: [i64; N],
    total: i64,
}

impl Sessions {
    async fn sample(&mut self, admin: &tokio_postgres::Client, proxies: &[Proxy; N]) {
        for (most, proxy) in self.per_instance.iter_mut().zip(proxies) {
            *most = (*most).max(sessions_behind(admin, proxy).await);
        }
        self.total = self.total.max(Rig::limiter_connections(admin).await);
    }
}

/// D4 with two limiter instances on one key, each with its own pool of 4 behind its own proxy
/// (so the server's sessions can be told apart by `client_port`).
async fn d4(mode: Mode) {
    let rig = Rig::start().await;
    let upstream = format!("127.0.0.1:{}", rig.pg.port())
        .parse()
        .expect("address");
    let proxies = [
        rig.proxy.clone(),
        Proxy::start(upstream).await.expect("proxy"),
    ];
    let mut instances = Vec::new();
    for proxy in &proxies {
        instances.push(rig.instance(&Rig::via(proxy), 4).await);
    }
    let plan = direct_plan(mode, C, R);
    let admin = rig.admin().await;
    let origin = Instant::now();
    // The callers run until the last phase's end, which moves with how late the faults end.
    let until = Arc::new(AtomicU64::new(60_000));
    let run = drive_until(&instances, &plan, 4, origin, &until);
    let mut sessions = Sessions::default();
    // Each phase is judged by the calls of the 1.5 s that start 1 s after its last fault,
    // measured from when its fault loop really ended: on a busy machine a loop's last round
    // can end hundreds of milliseconds late, which with fixed times left as few as no calls.
    let (settle, judged) = (Duration::from_secs(1), Duration::from_millis(1_500));

    // (a) 30% of each proxy's connections reset every 100 ms, from 0.5 s to 3.5 s.
    // sleep: the fault timeline, the resets start at 0.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(500)).into()).await;
    let a_start = origin.elapsed();
    while origin.elapsed() < Duration::from_millis(3_500) {
        for proxy in &proxies {
            proxy.reset_fraction(0.3);
        }
        sessions.sample(&admin, &proxies).await;
        // sleep: pacing, the resets' period (100 ms).
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let a_end = origin.elapsed();
    // (b) pg_terminate_backend on the limiters' sessions every 200 ms, for 2 s once (a)'s
    // judged calls are over.
    while origin.elapsed() < a_end + settle + judged {
        sessions.sample(&admin, &proxies).await;
        // sleep: pacing, the sessions sampled every 50 ms.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let b_start = origin.elapsed();
    let mut terminated = 0i64;
    while origin.elapsed() < b_start + Duration::from_secs(2) {
        let row = admin
            .query_one(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE application_name = 'tokenlease'",
                &[],
            )
            .await
            .expect("terminate");
        terminated += row.get::<_, i64>(0);
        sessions.sample(&admin, &proxies).await;
        // sleep: pacing, the terminations' period (200 ms).
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let b_end = origin.elapsed();
    let stop = b_end + settle + judged;
    until.store(stop.as_millis() as u64, Ordering::Relaxed);
    while origin.elapsed() < stop {
        sessions.sample(&admin, &proxies).await;
        // sleep: pacing, the sessions sampled every 50 ms.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let events = run.await.expect("the run");

    let a_classes = error_classes(
        &instances,
        origin,
        a_start,
        a_end + Duration::from_millis(200),
    );
    let b_classes = error_classes(
        &instances,
        origin,
        b_start,
        b_end + Duration::from_millis(200),
    );
    let after = |end: Duration| {
        let (from, to) = (end + settle, end + settle + judged);
        let (n, failed, _) = calls_in(&instances, origin, from, to);
        let ok = if n == 0 {
            0.0
        } else {
            1.0 - failed as f64 / n as f64
        };
        (n, ok, error_classes(&instances, origin, from, to))
    };
    let (a_n, a_ok, a_late) = after(a_end);
    let (b_n, b_ok, b_late) = after(b_end);
    let (_, p99, max) = waits(&events);
    let resets: u64 = proxies.iter().map(Proxy::resets).sum();
    // The store's admissions across both instances, by the store's own clock: any window of
    // length w holds at most C + r·w of them (+ 1 for the whole-token edge).
    let store_admitted: Vec<SystemTime> = events
        .iter()
        .filter(|e| e.allowed && e.by == DecidedBy::Store)
        .map(|e| {
            e.store_time
                .expect("a store decision carries the store's time")
        })
        .collect();
    let first = store_admitted
        .iter()
        .min()
        .copied()
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let mut points: Vec<(f64, f64)> = store_admitted
        .iter()
        .map(|t| (common::secs_between(first, *t), 1.0))
        .collect();
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    let worst: Vec<(f64, f64, f64)> = [0.1, 0.5, 1.0]
        .iter()
        .map(|&w| {
            let (excess, count) = common::worst_window(&points, w, C as f64, R, 0.0);
            (w, count, excess)
        })
        .collect();
    let per_instance: Vec<(usize, usize)> = (0..N)
        .map(|i| {
            let mine = events.iter().filter(|e| e.instance == i && e.allowed);
            let by_store = mine.clone().filter(|e| e.by == DecidedBy::Store).count();
            (by_store, mine.count() - by_store)
        })
        .collect();
    eprintln!(
        "D4 {} (2 instances): waits p99 {:.3} ms max {:.1} ms; resets by the proxies {resets}; \
         backends terminated {terminated}; most sessions per instance {:?} (all limiters {}); \
         errors (a) {a_classes:?}, (b) {b_classes:?}; success 1 s after (a) {:.1}% of {a_n} \
         (errors {a_late:?}), after (b) {:.1}% of {b_n} (errors {b_late:?}); phases ended at \
         {a_end:?} and {b_end:?}; admitted per instance (store, fallback) {per_instance:?}; \
         store windows by db time (w, admitted, excess over C + r·w) {worst:?}",
        mode.label(),
        ms(p99),
        ms(max),
        sessions.per_instance,
        sessions.total,
        a_ok * 100.0,
        b_ok * 100.0,
    );
    assert!(max <= DIRECT_WAIT, "a caller waited {max:?}");
    assert!(
        proxies.iter().all(|p| p.resets() > 0) && terminated > 0,
        "the faults happened"
    );
    for (class, _) in a_classes.iter().chain(&b_classes) {
        assert!(
            class == "connection"
                || class.starts_with("timeout")
                || class.starts_with("db-57P01")
                || class.starts_with("db-08"),
            "unexpected error class {class}"
        );
    }
    assert!(a_n > 0 && a_ok >= 0.95, "after resets: {a_ok}");
    assert!(b_n > 0 && b_ok >= 0.95, "after terminations: {b_ok}");
    for (i, most) in sessions.per_instance.iter().enumerate() {
        assert!(*most <= 4, "instance {i}: {most} sessions for a pool of 4");
    }
    assert!(
        sessions.total <= (N * 4) as i64,
        "{} limiter sessions for {N} pools of 4",
        sessions.total
    );
    for (w, count, excess) in &worst {
        assert!(
            *excess <= 1.0 + 1e-9,
            "the store admitted {count} in a {w} s window > {C} + {R}·{w} + 1"
        );
    }
    // The fallback's own terms: nothing under deny; under local at most C/N + (r/N)·w per
    // instance in any window (local time, + 1 for the edge).
    for i in 0..N {
        let fallback: Vec<(f64, f64)> = events
            .iter()
            .filter(|e| e.instance == i && e.allowed && matches!(e.by, DecidedBy::Fallback(_)))
            .map(|e| (e.at.as_secs_f64(), 1.0))
            .collect();
        match mode {
            Mode::Deny => assert!(fallback.is_empty(), "deny: the fallback admitted"),
            Mode::Local => {
                let (c, r) = (C as f64 / N as f64, R / N as f64);
                for w in [0.1, 0.5, 1.0] {
                    let (excess, count) = common::worst_window(&fallback, w, c, r, EPS);
                    assert!(
                        excess <= 1.0 + 1e-9,
                        "instance {i}: the local fallback admitted {count} in a {w} s window"
                    );
                }
            }
            Mode::Allow => {}
        }
    }
}
