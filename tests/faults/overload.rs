//! Overload with a healthy database: 200 concurrent clients, every request for a new entity id
//! (a new key), through a limiter built as the documented set-up (the store's default timeouts,
//! a circuit breaker, a direct-mode entity plan with the `local` fallback).
//!
//! What must hold: the store decides most requests (a statement that times out must not leave
//! its connection busy for the next caller, so load alone never turns into fallback decisions:
//! before that was fixed, 99.8% fell back at 200 callers). On a quiet machine it decides 99%,
//! with two test suites at once 88%, and with the suite beside four other builds on the 2 cores
//! 57%: a debug build's caller that the runtime polls after its 50 ms deadline falls back
//! however healthy the database is, and so does one whose statement the starved server answers
//! late. The test asks for 40%, two hundred times what the bug it guards against left (0.2%). And no statement runs on after its caller gave up: once
//! the clients stop, no limiter statement is still running, and the tokens the database took
//! are the ones the store's answers admitted, plus at most one per call that timed out after
//! committing.
//! Runs in the nextest `serial` group.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokenlease::bucket::{BucketConfig, Rate, Tokens};
use tokenlease::policy::{FallbackMode, FallbackSettings, Plan};
use tokenlease::store::{CircuitBreaker, PostgresStore};
use tokenlease::{DecidedBy, Limiter};

const CLIENTS: usize = 200;
const RUN: Duration = Duration::from_secs(3);
const CAPACITY: u64 = 150;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_clients_on_distinct_ids_are_decided_by_the_store() {
    let db = common::database().await;
    // The library's defaults: 50 ms call timeout, 40 ms pool wait, a pool of 4.
    let store = PostgresStore::builder(&db.connection_string())
        .expect("connection string")
        .build()
        .await
        .expect("store");
    let limiter = Limiter::builder(CircuitBreaker::new(store)).build();
    // One booking's bucket: 150 tokens, refilled over an hour (so that what was taken is still
    // visible in its row at the end).
    let bucket = BucketConfig::new(
        Tokens::whole(CAPACITY),
        Rate::from_f64(CAPACITY as f64 / 3600.0).expect("rate"),
    )
    .expect("bucket");
    let plan = Arc::new(
        Plan::new("booking-read", bucket).with_fallback(FallbackSettings::new(
            FallbackMode::Local {
                instances: std::num::NonZeroU32::new(2).expect("2"),
            },
        )),
    );

    let next_id = Arc::new(AtomicU64::new(0));
    let (store_decided, lease, fallback) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let store_admitted = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + RUN;
    let mut clients = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        let (limiter, plan, next_id) = (limiter.clone(), Arc::clone(&plan), Arc::clone(&next_id));
        let (store_decided, lease, fallback, store_admitted) = (
            Arc::clone(&store_decided),
            Arc::clone(&lease),
            Arc::clone(&fallback),
            Arc::clone(&store_admitted),
        );
        clients.push(tokio::spawn(async move {
            while Instant::now() < end {
                let id = next_id.fetch_add(1, Ordering::Relaxed);
                let key = format!("ratelimit:entity:GET:/bookings/{{bookingId}}:booking:{id}");
                let decision = limiter
                    .try_acquire_with(&plan, &key, 1.0)
                    .await
                    .expect("a valid request");
                match decision.decided_by {
                    DecidedBy::Store => {
                        store_decided.fetch_add(1, Ordering::Relaxed);
                        if decision.allowed {
                            store_admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    DecidedBy::Fallback(_) => {
                        fallback.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {
                        lease.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    for client in clients {
        client.await.expect("client");
    }
    let stopped = Instant::now();

    // Nothing of the limiter's is still running on the server once the clients have stopped.
    let admin = db.client().await.expect("admin connection");
    let running = loop {
        let rows = admin
            .query(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE application_name = 'tokenlease' AND state = 'active'",
                &[],
            )
            .await
            .expect("pg_stat_activity");
        let running: i64 = rows[0].get(0);
        if running == 0 || stopped.elapsed() > Duration::from_millis(200) {
            break running;
        }
        tokio::task::yield_now().await;
    };

    let (decided, leased, fell_back) = (
        store_decided.load(Ordering::Relaxed),
        lease.load(Ordering::Relaxed),
        fallback.load(Ordering::Relaxed),
    );
    let total = decided + leased + fell_back;
    let admitted = store_admitted.load(Ordering::Relaxed);
    let rows = admin
        .query(
            "SELECT count(*), coalesce(sum(capacity - tokens), 0)::float8 / 1e9 \
             FROM tokenlease_buckets WHERE key LIKE 'ratelimit:entity:%'",
            &[],
        )
        .await
        .expect("bucket rows");
    let (keys, taken): (i64, f64) = (rows[0].get(0), rows[0].get(1));
    println!(
        "{CLIENTS} clients, {:.1} s: {total} requests ({:.0}/s), store {decided} ({:.2}%), \
         fallback {fell_back}; {keys} rows, {taken:.2} tokens taken against {admitted} admitted \
         by the store's answers; {running} statements still running",
        RUN.as_secs_f64(),
        total as f64 / RUN.as_secs_f64(),
        100.0 * decided as f64 / total.max(1) as f64,
    );
    assert!(total > 2 * CLIENTS as u64, "only {total} requests");
    assert!(
        decided as f64 >= 0.40 * total as f64,
        "the store decided {decided} of {total}; the fallback {fell_back}"
    );
    assert_eq!(
        running, 0,
        "limiter statements still running after the clients stopped"
    );
    // Each row lost what the store's answers admitted; a call that timed out after its take
    // committed adds at most its one token (the refill over the run is under 0.2 per row).
    assert!(
        taken >= admitted as f64 - 0.01
            && taken <= (admitted + fell_back) as f64 + 0.5 + keys as f64 * 0.2,
        "taken {taken} against {admitted} admitted by the store and {fell_back} fallbacks"
    );
}
