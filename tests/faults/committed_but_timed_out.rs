//! D3, a write that commits after its call gave up: the statement commits but its reply comes
//! after the call timed out, so the fallback decides and the row shows the take; a return
//! whose reply is late is retried with the same id and credits once. In each fallback mode.

use crate::common;
use crate::rig::{ByStore, C, KEY, Mode, Rig, TokensF64, ms, per_mode};

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokenlease::DecidedBy;
use tokenlease::policy::FallbackSettings;
use tokenlease::store::{GiveBack, Store, StoreError};

per_mode! {
    /// D3: the statement commits but its reply comes after the call timed out; a retried
    /// return credits once.
    d3_committed_but_timed_out => d3;
}

async fn d3(mode: Mode) {
    let rig = Rig::start().await;
    let instance = rig.instance(&rig.proxied(), 4).await;
    // A slow refill, so the row's tokens can be compared exactly. Without outage debt: the
    // timed-out take committed and the fallback then admitted the call as well, so with debt
    // on its charge would take the cost from the row a second time (under-admission,
    // docs/design/outage-debt.md), and the row would not show the take and the return alone.
    let plan = Arc::new(
        common::plan(C, 0.001)
            .with_fallback(FallbackSettings::new(mode.fallback()).with_outage_debt(false)),
    );
    // The first take waits for the pool's first connection, which a busy machine can make
    // later than the 50 ms call (then the fallback decides): three attempts at most.
    for attempt in 1.. {
        let d = instance
            .limiter
            .try_acquire_with(&plan, KEY, 10.0)
            .await
            .expect("decision");
        if d.by_store() {
            break;
        }
        assert!(attempt < 3, "first take decided by the store: {d:?}");
    }
    let before = rig.row(KEY).await.expect("row").tokens_now.to_f64();

    // Replies 200 ms late: the take commits, the client gives up at 50 ms.
    rig.proxy.delay(Duration::ZERO, Duration::from_millis(200));
    let started = Instant::now();
    let d = instance
        .limiter
        .try_acquire_with(&plan, KEY, 10.0)
        .await
        .expect("decision");
    let waited = started.elapsed();
    let last = instance.log.calls().last().cloned().expect("a call");
    assert_eq!(
        last.error.as_deref(),
        Some("timeout-call"),
        "the client reports a timeout"
    );
    assert_eq!(
        d.decided_by,
        DecidedBy::Fallback(mode.fallback()),
        "the fallback decided"
    );
    // The statement committed on the server before its reply was late (the proxy delays
    // replies only): wait for the row to show it, 5 s at most.
    let after = rig
        .row_until(KEY, |tokens| before - tokens > 5.0)
        .await
        .unwrap_or_else(|tokens| panic!("the timed-out take never reached the row: {tokens}"));
    assert!(
        (before - after - 10.0).abs() < 0.01,
        "the timed-out take is in the row: {before} → {after}"
    );

    // A return whose reply is late: the client retries with the same id; it credits once. The
    // timed-out take's connection was closed (its statement abandoned), so first put a pooled
    // connection back while the proxy passes: the return must reach the server at once, not
    // wait for a new connection through the delaying proxy.
    // (The timed-out take's connection may still be in its cancel: then the pool opens another,
    // which a busy machine can make later than one 50 ms call. 5 s at most.)
    rig.proxy.pass();
    common::eventually(
        Duration::from_millis(20),
        Duration::from_secs(5),
        "a pooled connection",
        async || {
            instance
                .breaker
                .inspect(KEY)
                .await
                .map_err(|e| e.to_string())
        },
    )
    .await;
    rig.proxy.delay(Duration::ZERO, Duration::from_millis(200));
    let key_bucket = *plan.bucket();
    let give = [GiveBack {
        id: 4242,
        key: KEY,
        bucket: key_bucket,
        amount: tokenlease::bucket::Tokens::whole(5),
        lease: None,
    }];
    let first = instance.breaker.give_back(&give).await;
    assert!(
        matches!(first, Err(StoreError::Timeout { .. })),
        "the first return times out: {first:?}"
    );
    // The return committed on the server; only its reply is late.
    rig.row_until(KEY, |tokens| tokens - after > 2.5)
        .await
        .unwrap_or_else(|tokens| panic!("the timed-out return never reached the row: {tokens}"));
    rig.proxy.pass();
    let retried = instance.breaker.give_back(&give).await.expect("the retry");
    let credited = rig.row(KEY).await.expect("row").tokens_now.to_f64();
    eprintln!(
        "D3 {}: timed-out take waited {:.1} ms, decided by {:?} (allowed {}); row {before:.3} → {after:.3} \
         (taken though timed out); return of 5 timed out then retried: retry credited {retried}, row {credited:.3}",
        mode.label(),
        ms(waited),
        d.decided_by,
        d.allowed,
    );
    assert!(
        waited <= Duration::from_millis(100),
        "the caller waited {waited:?}"
    );
    assert_eq!(retried, 0, "the retry finds the return already credited");
    assert!(
        (credited - after - 5.0).abs() < 0.01,
        "credited once: {after} → {credited}"
    );
}
