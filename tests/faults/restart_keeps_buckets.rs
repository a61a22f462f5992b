//! D5, a restart: a fast and an immediate restart of the server (the immediate one once the
//! WAL of the takes is flushed) keep the buckets' rows, and the limiter finds the server again
//! within a second. In each fallback mode.

use crate::common;
use crate::rig::{ByStore, C, KEY, Mode, R, Rig, TokensF64, direct_plan, ms, per_mode};

use std::time::{Duration, Instant};

use tokenlease_testkit::StopMode;

per_mode! {
    /// D5: a restart, fast and immediate, keeps the buckets.
    d5_restart_keeps_buckets => d5;
}

async fn d5(mode: Mode) {
    let rig = Rig::start().await;
    let instance = rig.instance(&rig.direct(), 4).await;
    let plan = direct_plan(mode, C, R);
    let mut report = Vec::new();
    for stop in [StopMode::Fast, StopMode::Immediate] {
        // Drain the bucket.
        for _ in 0..200 {
            let d = instance
                .limiter
                .try_acquire_with(&plan, KEY, 1.0)
                .await
                .expect("decision");
            if !d.allowed && d.by_store() {
                break;
            }
        }
        let before = rig.row(KEY).await.expect("row");
        if stop == StopMode::Immediate {
            // The store commits takes asynchronously by default: a crash forgets those whose
            // commit record the WAL writer has not yet flushed (at most 3 × wal_writer_delay
            // old). Await the flush of everything written so far, as the server reports it.
            await_wal_flush(&rig.admin().await).await;
        }
        let down = Instant::now();
        rig.server(move |pg| pg.restart(stop).expect("restart"))
            .await;
        let downtime = down.elapsed();
        let after = rig.row(KEY).await.expect("row after the restart");
        let elapsed = common::secs_between(before.store_now, after.store_now);
        let expected = (before.tokens_now.to_f64() + R * elapsed).min(C as f64);
        let got = after.tokens_now.to_f64();
        // The limiter finds the server again.
        let back = Instant::now();
        let recovered = common::poll_until(
            Duration::from_millis(5),
            Duration::from_secs(2),
            async || {
                let d = instance
                    .limiter
                    .try_acquire_with(&plan, KEY, 1.0)
                    .await
                    .expect("decision");
                if d.by_store() {
                    Ok(back.elapsed())
                } else {
                    Err(d)
                }
            },
        )
        .await
        .ok();
        report.push(format!(
            "{stop:?}: T0 {:.2}, down {:.0} ms, {elapsed:.3} s of db time → expected {expected:.2}, \
             row {got:.2}; limiter back after {:?} ms",
            before.tokens_now.to_f64(),
            ms(downtime),
            recovered.map(ms),
        ));
        assert!(
            (got - expected).abs() <= 1.0,
            "{stop:?}: row {got}, expected {expected}"
        );
        let recovered = recovered.expect("the limiter recovers");
        assert!(
            recovered <= Duration::from_secs(1),
            "recovery took {recovered:?}"
        );
    }
    eprintln!("D5 {}: {}", mode.label(), report.join("; "));
}

/// Waits until the server has flushed the WAL written so far (`pg_current_wal_flush_lsn()` at
/// or past the insert position read first): then a crash forgets no commit made before. The
/// WAL writer flushes within 3 × `wal_writer_delay` (600 ms by default); 5 s at most here.
async fn await_wal_flush(admin: &tokio_postgres::Client) {
    let written: String = admin
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .expect("insert lsn")
        .get(0);
    common::eventually(
        Duration::from_millis(10),
        Duration::from_secs(5),
        &format!("the WAL flushed past {written}"),
        async || -> bool {
            admin
                .query_one(
                    "SELECT pg_current_wal_flush_lsn() >= $1::text::pg_lsn",
                    &[&written],
                )
                .await
                .expect("flush lsn")
                .get(0)
        },
    )
    .await;
}
