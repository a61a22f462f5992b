//! The lease actor is supervised: when its task ends early, the next leased call starts it
//! again, and no lease is lost or counted twice.
//!
//! Before, a limiter whose actor ran on a runtime that was then dropped decided every later
//! leased call by the fallback after `max_wait`, silently and for ever, `store_calls` frozen and
//! `shutdown()` a no-op; and the first leased call outside a tokio runtime panicked.

use crate::common;

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokenlease::policy::{FallbackMode, FallbackSettings, LeaseSettings, Plan};
use tokenlease::store::MemoryStore;
use tokenlease::{DecidedBy, Limiter};

fn plan() -> Plan {
    common::plan(1_000, 1_000.0)
        .with_lease(LeaseSettings::default())
        .with_fallback(FallbackSettings::new(FallbackMode::Deny))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime")
}

/// A limiter whose actor ran on a runtime that is gone: the next leased call, from another
/// runtime, starts a new actor there, is decided from a lease, and shutdown gives every lease
/// back (conservation exact).
#[test]
fn an_actor_whose_runtime_was_dropped_is_started_again() {
    let plan = plan();
    let limiter = Limiter::builder(MemoryStore::new()).build();
    let mut admitted = 0.0;
    let first = runtime();
    first.block_on(async {
        for i in 0..200 {
            let d = limiter
                .try_acquire_with(&plan, &format!("k{}", i % 10), 1.0)
                .await
                .expect("decision");
            assert!(d.allowed, "{d:?}");
            // Conservation counts what leases paid; each key's first calls are store calls.
            admitted += f64::from(u8::from(d.decided_by == DecidedBy::Lease));
        }
    });
    let before = limiter.lease_stats().expect("leased");
    assert!(before.outstanding > 0.0, "{before:?}");
    // The actor's task goes with its runtime.
    drop(first);

    let second = runtime();
    second.block_on(async {
        // A key with no lease yet needs a refill (or, while the actor is busy, one store
        // call); either way the actor starts again here.
        let d = limiter
            .try_acquire_with(&plan, "new", 1.0)
            .await
            .expect("decision");
        assert!(d.allowed, "{d:?}");
        assert!(
            matches!(d.decided_by, DecidedBy::Lease | DecidedBy::Store),
            "{d:?}"
        );
        admitted += f64::from(u8::from(d.decided_by == DecidedBy::Lease));
        for i in 0..200 {
            let d = limiter
                .try_acquire_with(&plan, &format!("k{}", i % 10), 1.0)
                .await
                .expect("decision");
            assert!(d.allowed, "{d:?}");
            assert_ne!(d.decided_by, DecidedBy::Fallback(FallbackMode::Deny));
            admitted += f64::from(u8::from(d.decided_by == DecidedBy::Lease));
        }
        // A lease asked for without waiting: the restarted actor's statement brings it.
        let asked = limiter
            .try_acquire_now_with(&plan, "asked", 1.0)
            .expect("valid");
        assert!(asked.is_none(), "{asked:?}");
        common::eventually(
            Duration::from_millis(1),
            Duration::from_secs(5),
            "a refill from the new actor",
            async || limiter.lease_stats().expect("leased").store_calls != before.store_calls,
        )
        .await;
        let stats = limiter.lease_stats().expect("leased");
        assert_eq!(stats.actor_restarts, 1, "{stats:?}");
        limiter.shutdown().await;
        let stats = limiter.lease_stats().expect("leased");
        assert_eq!(stats.outstanding, 0.0, "{stats:?}");
        assert_eq!(stats.keys, 0, "{stats:?}");
        common::assert_conserved("restarted", admitted, &stats);
    });
}

/// Shutdown on a runtime other than the dead actor's still gives every lease back.
#[test]
fn shutdown_after_the_actor_died_gives_the_leases_back() {
    let plan = plan();
    let limiter = Limiter::builder(MemoryStore::new()).build();
    let first = runtime();
    let mut admitted = 0.0;
    first.block_on(async {
        for i in 0..100 {
            let d = limiter
                .try_acquire_with(&plan, &format!("k{}", i % 5), 1.0)
                .await
                .expect("decision");
            assert!(d.allowed);
            // Conservation counts what leases paid; each key's first calls are store calls.
            admitted += f64::from(u8::from(d.decided_by == DecidedBy::Lease));
        }
        // Let the refills the last calls asked for land (bounded wait for an idle actor).
        common::actor_idle(&limiter, Duration::from_secs(5)).await;
    });
    assert!(limiter.lease_stats().expect("leased").outstanding > 0.0);
    drop(first);
    runtime().block_on(async {
        limiter.shutdown().await;
        let stats = limiter.lease_stats().expect("leased");
        assert_eq!(stats.outstanding, 0.0, "{stats:?}");
        assert!(stats.returned > 0.0, "{stats:?}");
        common::assert_conserved("shut down elsewhere", admitted, &stats);
    });
}

/// Outside any tokio runtime, a leased call does not panic: with no actor able to run, the
/// fallback decides (counted), and `try_acquire_now_with` says it would have to wait.
#[test]
fn a_leased_call_outside_a_runtime_is_decided_by_the_fallback() {
    let plan = plan();
    let limiter = Limiter::builder(MemoryStore::new()).build();
    assert!(matches!(
        limiter.try_acquire_now_with(&plan, "k", 1.0),
        Ok(None)
    ));
    let mut call = pin!(limiter.try_acquire_with(&plan, "k", 1.0));
    let mut cx = Context::from_waker(Waker::noop());
    let Poll::Ready(decision) = call.as_mut().poll(&mut cx) else {
        panic!("a call with no actor to wait for must not wait");
    };
    let d = decision.expect("decision");
    assert_eq!(
        d.decided_by,
        DecidedBy::Fallback(FallbackMode::Deny),
        "{d:?}"
    );
}
