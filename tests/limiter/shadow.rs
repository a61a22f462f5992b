//! Shadow mode (S1–S4): a shadow plan decides and counts exactly as an enforcing one, and lets
//! its denials through, marked `would_deny`; against a real server, in direct and leased mode,
//! and with the server stopped (the fallback's denials too).

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use tokenlease::bucket::Tokens;
use tokenlease::policy::{FallbackMode, FallbackSettings, LeaseSettings, Plan, Policies};
use tokenlease::store::{PostgresStore, Store};
use tokenlease::{DecidedBy, Limiter};
use tokenlease_testkit::{StopMode, TempPostgres};

/// Calls made on each key.
const CALLS: usize = 200;
/// The bucket: 50 tokens refilling so slowly (one token in 1,000 s) that the run never sees a
/// refill, so both sequences meet exactly the same bucket.
const CAPACITY: u64 = 50;
const RATE: f64 = 0.001;

#[derive(Debug, Default, PartialEq, Eq)]
struct Counts {
    /// Admitted with the cost taken.
    taken: usize,
    /// Denied (enforcing) or let through as `would_deny` (shadow).
    refused: usize,
}

async fn counts(limiter: &Limiter, plan: &Plan, key: &str, shadow: bool) -> Counts {
    let mut c = Counts::default();
    for _ in 0..CALLS {
        let d = limiter
            .try_acquire_with(plan, key, 1.0)
            .await
            .expect("decision");
        assert_ne!(
            d.decided_by,
            DecidedBy::Fallback(FallbackMode::Deny),
            "the store answers throughout"
        );
        if shadow {
            assert!(d.allowed, "a shadow plan lets every call through: {d:?}");
        } else {
            assert!(
                !d.would_deny,
                "an enforcing plan never says would_deny: {d:?}"
            );
        }
        match (d.allowed, d.would_deny) {
            (true, false) => c.taken += 1,
            (false, _) | (true, true) => {
                assert!(d.retry_after > Duration::ZERO, "a denial says when: {d:?}");
                c.refused += 1;
            }
        }
    }
    c
}

/// S1: direct mode. The same calls on two keys, one under an enforcing plan and one under its
/// shadow twin, give the same counts, and leave the two buckets holding the same tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_and_enforcing_plans_give_the_same_counts_in_direct_mode() {
    let db = common::database().await;
    let store = common::store(&db, 4).await;
    let limiter = Limiter::builder(store.clone()).build();
    let enforcing = Plan::new("enforcing", common::bucket(CAPACITY, RATE));
    let shadow = Plan::new("shadowed", common::bucket(CAPACITY, RATE)).with_shadow(true);
    let e = counts(&limiter, &enforcing, "s1:enforcing", false).await;
    let s = counts(&limiter, &shadow, "s1:shadow", true).await;
    assert_eq!(
        e,
        Counts {
            taken: CAPACITY as usize,
            refused: CALLS - CAPACITY as usize
        }
    );
    assert_eq!(s, e, "shadow counts equal enforcing counts");
    // Both buckets were emptied: what is left is the refill since (a thousandth of a token a
    // second), under one token. The shadow plan's bucket is under its own key.
    for key in [
        enforcing.store_key("s1:enforcing"),
        shadow.store_key("s1:shadow"),
    ] {
        let row = store.inspect(&key).await.expect("inspect").expect("a row");
        assert!(row.tokens < Tokens::whole(1), "{key}: {row:?}");
    }
}

/// S2: leased mode, several tasks at once: whatever the leases' timing, each plan takes exactly
/// the bucket's 50 tokens, and the shadow plan lets every other call through as would-deny.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_and_enforcing_plans_give_the_same_counts_in_leased_mode() {
    let db = common::database().await;
    let limiter = Limiter::builder(common::store(&db, 4).await).build();
    // A first refill on a fresh database can outlast the default 50 ms wait on a busy machine.
    let lease = LeaseSettings::default()
        .with_max_fraction(0.2)
        .with_max_wait(Duration::from_secs(1));
    let fallback = FallbackSettings::new(FallbackMode::Deny);
    let enforcing = Arc::new(
        Plan::new("enforcing", common::bucket(CAPACITY, RATE))
            .with_lease(lease)
            .with_fallback(fallback),
    );
    let shadow = Arc::new(
        Plan::new("shadowed", common::bucket(CAPACITY, RATE))
            .with_lease(lease)
            .with_fallback(fallback)
            .with_shadow(true),
    );
    let mut totals = Vec::new();
    for (plan, key, is_shadow) in [(&enforcing, "s2:e", false), (&shadow, "s2:s", true)] {
        let mut tasks = Vec::new();
        for _ in 0..4 {
            let (limiter, plan) = (limiter.clone(), Arc::clone(plan));
            tasks.push(tokio::spawn(async move {
                counts(&limiter, &plan, key, is_shadow).await
            }));
        }
        let mut total = Counts::default();
        for t in tasks {
            let c = t.await.expect("task");
            total.taken += c.taken;
            total.refused += c.refused;
        }
        totals.push(total);
    }
    let expected = Counts {
        taken: CAPACITY as usize,
        refused: 4 * CALLS - CAPACITY as usize,
    };
    assert_eq!(totals[0], expected, "enforcing");
    assert_eq!(
        totals[1], expected,
        "shadow: the same counts, every call let through"
    );
    limiter.shutdown().await;
}

/// S3: with the server stopped, a shadow plan's `deny` fallback lets the call through, marked
/// would-deny and decided by the fallback; an enforcing twin denies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_plans_fallback_denial_lets_the_call_through() {
    let pg = Arc::new(
        tokio::task::spawn_blocking(TempPostgres::start)
            .await
            .expect("join")
            .expect("a throwaway cluster"),
    );
    let store = PostgresStore::builder(&pg.url())
        .expect("url")
        .call_timeout(Duration::from_millis(200))
        .pool_wait_timeout(Duration::from_millis(200))
        .connect_timeout(Duration::from_millis(200))
        .build()
        .await
        .expect("store");
    let limiter = Limiter::builder(store).build();
    let deny = FallbackSettings::new(FallbackMode::Deny);
    let enforcing = Plan::new("enforcing", common::bucket(10, 1.0)).with_fallback(deny);
    let shadow = Plan::new("shadowed", common::bucket(10, 1.0))
        .with_fallback(deny)
        .with_shadow(true);
    let up = limiter
        .try_acquire_with(&shadow, "s3", 1.0)
        .await
        .expect("decision");
    assert_eq!(up.decided_by, DecidedBy::Store);
    let stopping = Arc::clone(&pg);
    tokio::task::spawn_blocking(move || stopping.stop(StopMode::Fast).expect("stop"))
        .await
        .expect("join");
    let e = limiter
        .try_acquire_with(&enforcing, "s3", 1.0)
        .await
        .expect("decision");
    assert_eq!(e.decided_by, DecidedBy::Fallback(FallbackMode::Deny));
    assert!(!e.allowed && !e.would_deny, "{e:?}");
    let s = limiter
        .try_acquire_with(&shadow, "s3", 1.0)
        .await
        .expect("decision");
    assert_eq!(s.decided_by, DecidedBy::Fallback(FallbackMode::Deny));
    assert!(s.allowed && s.would_deny, "{s:?}");
}

/// S4: the policy file's `shadow` fields: on a plan, and on a route (`true`, `"api"`,
/// `"entity"`); anything else is refused naming the field.
#[test]
fn the_policy_file_marks_plans_and_route_layers_shadow() {
    let file = |shadow_plan: &str, shadow_route: &str| {
        format!(
            r#"{{
              "plans": {{
                "g": {{ "capacity": 10, "refill_per_second": 1 {shadow_plan} }},
                "e": {{ "capacity": 5, "refill_per_second": 1 }}
              }},
              "routes": [
                {{ "method": "GET", "path": "/items/{{id}}", "global": "g",
                   "entity": {{ "path_param": "id", "plan": "e" }} {shadow_route} }}
              ]
            }}"#
        )
    };
    let p = Policies::from_json_str(&file(r#", "shadow": true"#, ""), None).expect("valid");
    assert!(p.plan("g").unwrap().shadow());
    assert!(!p.plan("e").unwrap().shadow());
    let route = |shadow: &str| {
        let p = Policies::from_json_str(&file("", shadow), None).expect("valid");
        let s = p.routes()[0].shadow;
        (s.api, s.entity)
    };
    assert_eq!(route(""), (false, false));
    assert_eq!(route(r#", "shadow": true"#), (true, true));
    assert_eq!(route(r#", "shadow": false"#), (false, false));
    assert_eq!(route(r#", "shadow": "api""#), (true, false));
    assert_eq!(route(r#", "shadow": "entity""#), (false, true));
    for bad in [r#", "shadow": "global""#, r#", "shadow": 1"#] {
        let err = Policies::from_json_str(&file("", bad), None).expect_err(bad);
        assert_eq!(err.field(), Some("routes[0].shadow"), "{err}");
        assert!(
            err.message()
                .contains(r#"expected true, false, "api" or "entity""#),
            "{err}"
        );
    }
    let err = Policies::from_json_str(&file(r#", "shadow": "yes""#, ""), None)
        .expect_err("a plan's shadow is a boolean");
    assert_eq!(err.plan(), Some("g"), "{err}");
}

/// S7: a shadow plan on the same key as an enforcing plan keeps its bucket under a key of its
/// own, so it takes nothing from the enforcing plan: checked first on every request, a shadow
/// candidate of capacity 5 and the enforcing plan's own shadow twin (the README's
/// `plan.clone().with_shadow(true)`) leave the enforcing plan of capacity 20 admitting 20 of
/// 30, as it does alone. In direct mode and in leased mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_a_shadow_plan_on_the_same_key_takes_nothing_from_the_enforcing_plan() {
    let db = common::database().await;
    let store = common::store(&db, 4).await;
    let limiter = Limiter::builder(store.clone()).build();
    let lease = LeaseSettings::default()
        .with_max_fraction(0.2)
        .with_max_wait(Duration::from_secs(1));
    let deny = FallbackSettings::new(FallbackMode::Deny);
    for (key, leased) in [("s7:direct", false), ("s7:leased", true)] {
        let with_mode = |plan: Plan| {
            let plan = plan.with_fallback(deny);
            if leased { plan.with_lease(lease) } else { plan }
        };
        let enforcing = with_mode(Plan::new("enforcing", common::bucket(20, RATE)));
        let candidate =
            with_mode(Plan::new("candidate", common::bucket(5, RATE))).with_shadow(true);
        let twin = enforcing.clone().with_shadow(true);
        let (mut admitted, mut candidate_would_deny, mut twin_would_deny) = (0, 0, 0);
        for _ in 0..30 {
            let c = limiter
                .try_acquire_with(&candidate, key, 1.0)
                .await
                .expect("decision");
            assert!(c.allowed, "{key}: {c:?}");
            candidate_would_deny += usize::from(c.would_deny);
            let t = limiter
                .try_acquire_with(&twin, key, 1.0)
                .await
                .expect("decision");
            assert!(t.allowed, "{key}: {t:?}");
            twin_would_deny += usize::from(t.would_deny);
            let e = limiter
                .try_acquire_with(&enforcing, key, 1.0)
                .await
                .expect("decision");
            assert_ne!(
                e.decided_by,
                DecidedBy::Fallback(FallbackMode::Deny),
                "{key}"
            );
            admitted += usize::from(e.allowed);
        }
        assert_eq!(
            admitted, 20,
            "{key}: the enforcing plan admitted {admitted} of 30"
        );
        assert_eq!(
            candidate_would_deny, 25,
            "{key}: the candidate's own bucket of 5"
        );
        assert_eq!(twin_would_deny, 10, "{key}: the twin's own bucket of 20");
        if !leased {
            // The caller's key holds the enforcing plan's bucket alone; each shadow plan's is
            // under a key of its own, which no caller can use.
            let row = |key: String| {
                let store = store.clone();
                async move { store.inspect(&key).await.expect("inspect").expect("a row") }
            };
            assert_eq!(enforcing.store_key(key), key);
            assert_eq!(row(key.to_owned()).await.capacity, Tokens::whole(20));
            let own = candidate.store_key(key).into_owned();
            assert_eq!(own, "\u{1}shadow:candidate:s7:direct");
            assert_eq!(row(own.clone()).await.capacity, Tokens::whole(5));
            assert_ne!(twin.store_key(key), own);
            assert_eq!(
                row(twin.store_key(key).into_owned()).await.capacity,
                Tokens::whole(20)
            );
            let refused = limiter.try_acquire_with(&enforcing, &own, 1.0).await;
            assert!(
                matches!(
                    refused,
                    Err(tokenlease::Error::InvalidKey(
                        tokenlease::error::KeyError::Reserved
                    ))
                ),
                "{refused:?}"
            );
        }
    }
    limiter.shutdown().await;
}
