//! The store contract (see `tokenlease::store::Store`), run against both stores.
//!
//! Time is moved by hand. The memory store reads tokio's clock, which its tests (they talk to no
//! database) pause and advance. For PostgreSQL, which decides with its own `now()`, "advance by
//! d" shifts every stored refill time back by d, which is the same thing to the arithmetic
//! (strict lease expiries shift with it); its tests run in real time, since a paused runtime
//! would jump its clock while a statement is on the wire. Rates are low (1 token/s) so the few
//! milliseconds of real time that pass between statements cannot change a whole-token outcome.

use crate::common;

use std::time::Duration;

use tokenlease::bucket::{BucketConfig, Tokens};
use tokenlease::store::{
    AcquireRequest, GiveBack, Hold, LeaseRef, MemoryStore, PostgresStore, Store,
};
use tokenlease_testkit::TestDatabase;

/// A store under test and a way to move its time.
#[async_trait::async_trait]
trait Harness: Send + Sync {
    fn store(&self) -> &dyn Store;
    async fn advance(&self, by: Duration);
}

/// The memory store, on tokio's clock: its tests run on a paused runtime.
struct Memory {
    store: MemoryStore,
}

#[async_trait::async_trait]
impl Harness for Memory {
    fn store(&self) -> &dyn Store {
        &self.store
    }
    async fn advance(&self, by: Duration) {
        tokio::time::advance(by).await;
    }
}

struct Postgres {
    db: TestDatabase,
    store: PostgresStore,
}

#[async_trait::async_trait]
impl Harness for Postgres {
    fn store(&self) -> &dyn Store {
        &self.store
    }
    async fn advance(&self, by: Duration) {
        // A session of its own: the statement touches the table, not the store's sessions.
        let conn = self.db.client().await.expect("connection");
        conn.batch_execute(&format!(
            "UPDATE tokenlease_buckets SET updated_us = updated_us - {us},
                 leases = (SELECT coalesce(array_agg(ROW(l.holder, l.lease_id, l.amount,
                                   l.expires_at - interval '{us} microseconds')::tokenlease_lease),
                                   '{{}}')
                           FROM unnest(leases) AS l)",
            us = by.as_micros()
        ))
        .await
        .expect("shift updated_us");
    }
}

fn memory() -> Memory {
    Memory {
        store: MemoryStore::new(),
    }
}

async fn postgres() -> Postgres {
    let db = common::database().await;
    let store = common::store(&db, 4).await;
    Postgres { db, store }
}

const C: u64 = 10;

fn cfg() -> BucketConfig {
    common::bucket(C, 1.0)
}

fn t(n: u64) -> Tokens {
    Tokens::whole(n)
}

async fn take(h: &dyn Harness, key: &str, cost: Tokens) -> tokenlease::store::Acquired {
    h.store()
        .acquire(AcquireRequest::take(key, cfg(), cost))
        .await
        .expect("acquire")
}

async fn absent_key_is_a_full_bucket(h: &dyn Harness) {
    let a = take(h, "new", t(1)).await;
    assert_eq!(a.granted, t(1));
    assert_eq!(a.remaining.floor(), C - 1);
    assert!(
        h.store()
            .inspect("never-touched")
            .await
            .expect("inspect")
            .is_none()
    );
}

async fn bursts_to_capacity_then_denies_with_retry_after(h: &dyn Harness) {
    for i in 0..C {
        let a = take(h, "burst", t(1)).await;
        assert_eq!(a.granted, t(1), "take {i} of a full bucket");
    }
    let a = take(h, "burst", t(1)).await;
    assert!(a.granted.is_zero(), "the bucket is empty");
    // One token at 1 token/s: about a second, less the real time that passed.
    assert!(
        a.retry_after <= Duration::from_secs(1),
        "{:?}",
        a.retry_after
    );
    assert!(
        a.retry_after >= Duration::from_millis(500),
        "{:?}",
        a.retry_after
    );
    // A denial takes nothing.
    assert!(a.remaining < t(1));
}

async fn refills_by_elapsed_time_and_never_above_capacity(h: &dyn Harness) {
    take(h, "refill", t(C)).await;
    h.advance(Duration::from_secs(3)).await;
    let a = take(h, "refill", t(1)).await;
    assert_eq!(a.granted, t(1));
    assert_eq!(a.remaining.floor(), 2, "3 s at 1/s refilled 3, one taken");
    h.advance(Duration::from_secs(3600)).await;
    let row = h
        .store()
        .inspect("refill")
        .await
        .expect("inspect")
        .expect("row");
    assert_eq!(row.tokens_now, t(C), "capped at capacity");
    let a = take(h, "refill", t(C)).await;
    assert_eq!(a.granted, t(C));
}

async fn a_lease_takes_what_is_there_between_min_and_want(h: &dyn Harness) {
    take(h, "lease", t(7)).await; // 3 left
    let a = h
        .store()
        .acquire(AcquireRequest::lease("lease", cfg(), t(1), t(5)))
        .await
        .expect("acquire");
    assert_eq!(a.granted.floor(), 3);
    let a = h
        .store()
        .acquire(AcquireRequest::lease("lease", cfg(), t(1), t(5)))
        .await
        .expect("acquire");
    assert!(a.granted.is_zero(), "below min: nothing");
}

async fn grants_come_in_whole_steps(h: &dyn Harness) {
    take(h, "steps", t(3)).await; // 7 left
    let request = AcquireRequest {
        key: "steps",
        bucket: cfg(),
        min: t(2),
        want: t(20),
        step: t(2),
        hold: None,
    };
    let a = h.store().acquire(request).await.expect("acquire");
    assert_eq!(a.granted, t(6), "three whole steps of 2 from 7 tokens");
    assert_eq!(a.remaining.floor(), 1);
}

async fn fractional_costs_are_exact(h: &dyn Harness) {
    let half = Tokens::from_f64(0.5).expect("half");
    for _ in 0..(2 * C) {
        assert_eq!(take(h, "half", half).await.granted, half);
    }
    assert!(take(h, "half", half).await.granted.is_zero());
}

async fn many_keys_in_one_call(h: &dyn Harness) {
    take(h, "m2", t(C)).await;
    let requests = [
        AcquireRequest::take("m1", cfg(), t(4)),
        AcquireRequest::take("m2", cfg(), t(1)),
        AcquireRequest::take("m3", cfg(), t(C)),
    ];
    let out = h
        .store()
        .acquire_many(&requests)
        .await
        .expect("acquire_many");
    assert_eq!(out.len(), 3);
    assert_eq!(out[0].granted, t(4));
    assert!(out[1].granted.is_zero(), "m2 was emptied");
    assert_eq!(out[2].granted, t(C));
}

/// K1: requests naming one key in one call are decided as consecutive calls, in request
/// order; so are returns to one key.
async fn a_key_named_twice_is_two_calls(h: &dyn Harness) {
    let requests = vec![AcquireRequest::take("twice", cfg(), t(3)); 4];
    let out = h
        .store()
        .acquire_many(&requests)
        .await
        .expect("acquire_many");
    let seen: Vec<(u64, u64)> = out
        .iter()
        .map(|a| (a.granted.floor(), a.remaining.floor()))
        .collect();
    assert_eq!(seen, [(3, 7), (3, 4), (3, 1), (0, 1)]);
    let each = h.store().acquire_each(&requests[..2]).await;
    assert!(
        each.iter()
            .all(|a| a.as_ref().is_ok_and(|a| a.granted.is_zero()))
    );
    let give = |id| GiveBack {
        id,
        key: "twice",
        bucket: cfg(),
        amount: t(4),
        lease: None,
    };
    let credited = h
        .store()
        .give_back(&[give(30), give(31), give(30), give(32)])
        .await
        .expect("give_back");
    assert_eq!(credited, 3, "the repeated id credits once");
    let row = h
        .store()
        .inspect("twice")
        .await
        .expect("inspect")
        .expect("row");
    assert_eq!(
        row.tokens_now,
        t(C),
        "1 + 4 + 4 + 4, capped at the capacity"
    );
}

async fn idle_buckets_are_deleted_without_changing_decisions(h: &dyn Harness) {
    take(h, "idle-full", t(1)).await;
    take(h, "idle-busy", t(C)).await;
    h.advance(Duration::from_secs(2)).await; // idle-full is full again; idle-busy holds 2
    let deleted = h.store().delete_idle(100).await.expect("delete_idle");
    assert_eq!(deleted, 1);
    assert!(
        h.store()
            .inspect("idle-full")
            .await
            .expect("inspect")
            .is_none()
    );
    let busy = h
        .store()
        .inspect("idle-busy")
        .await
        .expect("inspect")
        .expect("row");
    assert_eq!(busy.tokens_now.floor(), 2);
    // The deleted bucket still decides as a full one.
    assert_eq!(take(h, "idle-full", t(C)).await.granted, t(C));
    assert_eq!(h.store().delete_idle(100).await.expect("delete_idle"), 0);
}

async fn a_new_shape_takes_effect_on_the_next_call(h: &dyn Harness) {
    take(h, "shape", t(1)).await; // 9 of 10
    let smaller = common::bucket(5, 1.0);
    let a = h
        .store()
        .acquire(AcquireRequest::take("shape", smaller, t(1)))
        .await
        .expect("acquire");
    assert_eq!(a.granted, t(1));
    assert_eq!(
        a.remaining.floor(),
        4,
        "cut to the new capacity of 5, one taken"
    );
}

/// B3: a return carries an id; replaying it credits once, and the credit is capped at the
/// capacity.
async fn returns_are_idempotent_and_capped(h: &dyn Harness) {
    take(h, "ret", t(C)).await; // empty
    let give = |id, amount| GiveBack {
        id,
        key: "ret",
        bucket: cfg(),
        amount: t(amount),
        lease: None,
    };
    for attempt in 0..3 {
        let credited = h.store().give_back(&[give(7, 4)]).await.expect("give_back");
        assert_eq!(credited, u64::from(attempt == 0), "attempt {attempt}");
    }
    let row = h
        .store()
        .inspect("ret")
        .await
        .expect("inspect")
        .expect("row");
    assert_eq!(row.tokens_now.floor(), 4, "credited once");
    h.advance(Duration::from_secs(3600)).await; // refilled to C
    assert_eq!(
        h.store().give_back(&[give(8, 5)]).await.expect("give_back"),
        1
    );
    let row = h
        .store()
        .inspect("ret")
        .await
        .expect("inspect")
        .expect("row");
    assert_eq!(
        row.tokens_now,
        t(C),
        "a return into a full bucket leaves it full"
    );
    // A return for a bucket with no row (a full one) leaves a full bucket.
    let other = GiveBack {
        key: "ret-absent",
        ..give(9, 3)
    };
    h.store().give_back(&[other]).await.expect("give_back");
    assert_eq!(take(h, "ret-absent", t(C)).await.granted, t(C));
}

/// A strict lease request of holder 7: up to `want` (at least 1), keeping `kept`, counted for
/// `lifetime`.
fn held(key: &str, id: i64, kept: u64, want: u64, lifetime: Duration) -> AcquireRequest<'_> {
    AcquireRequest::lease(key, cfg(), t(1), t(want)).held(Hold {
        holder: 7,
        lease_id: id,
        kept: t(kept),
        lifetime,
    })
}

async fn row(h: &dyn Harness, key: &str) -> tokenlease::store::BucketRow {
    h.store().inspect(key).await.expect("inspect").expect("row")
}

const HOUR: Duration = Duration::from_secs(3600);

async fn strict_leases_count_against_capacity_until_settled(h: &dyn Harness) {
    let store = h.store();
    let a = store
        .acquire(held("s", 1, 0, 4, HOUR))
        .await
        .expect("lease");
    assert_eq!(a.granted, t(4));
    let r = row(h, "s").await;
    assert_eq!(r.leases.len(), 1);
    assert_eq!((r.leases[0].holder, r.leases[0].lease_id), (7, 1));
    assert_eq!(r.leases[0].amount, t(4));
    h.advance(Duration::from_secs(60)).await;
    assert_eq!(
        row(h, "s").await.tokens_now.floor(),
        C - 4,
        "the bucket refills to capacity less the tokens out on lease"
    );
    assert_eq!(store.delete_idle(100).await.expect("delete_idle"), 0);

    // A renewal: the holder spent 3 and keeps 1; it gets 3 more, its entry holds 4 again, and
    // the 3 it spent no longer count.
    let a = store
        .acquire(held("s", 2, 1, 3, HOUR))
        .await
        .expect("renew");
    assert_eq!(a.granted, t(3));
    let r = row(h, "s").await;
    assert_eq!(r.leases.len(), 1, "one entry per holder");
    assert_eq!((r.leases[0].lease_id, r.leases[0].amount), (2, t(4)));
    h.advance(Duration::from_secs(60)).await;
    assert_eq!(row(h, "s").await.tokens_now.floor(), C - 4);
    assert!(take(h, "s", t(C - 3)).await.granted.is_zero());
    assert_eq!(take(h, "s", t(C - 4)).await.granted, t(C - 4));

    // A give-back naming the replaced lease credits nothing and leaves the entry.
    let give = |id, lease_id, amount| GiveBack {
        id,
        key: "s",
        bucket: cfg(),
        amount: t(amount),
        lease: Some(LeaseRef {
            holder: 7,
            lease_id,
        }),
    };
    store.give_back(&[give(10, 1, 2)]).await.expect("give_back");
    let r = row(h, "s").await;
    assert_eq!(r.tokens_now.floor(), 0, "a stale lease id credits nothing");
    assert_eq!(r.leases.len(), 1);
    // Settling the live lease credits at most what it holds and removes it; a retry does not.
    store.give_back(&[give(11, 2, 9)]).await.expect("give_back");
    let r = row(h, "s").await;
    assert_eq!(r.tokens_now.floor(), 4, "credit capped at the entry's 4");
    assert!(r.leases.is_empty());
    assert_eq!(store.give_back(&[give(11, 2, 9)]).await.expect("retry"), 0);
    assert_eq!(row(h, "s").await.tokens_now.floor(), 4);
    h.advance(Duration::from_secs(60)).await;
    assert_eq!(
        row(h, "s").await.tokens_now,
        t(C),
        "no lease out: full again"
    );
}

async fn a_strict_lease_stops_counting_at_its_expiry(h: &dyn Harness) {
    let store = h.store();
    let lifetime = Duration::from_secs(10);
    assert_eq!(
        store
            .acquire(held("e", 1, 0, 5, lifetime))
            .await
            .unwrap()
            .granted,
        t(5)
    );
    assert_eq!(take(h, "e", t(5)).await.granted, t(5)); // empty, 5 out on lease
    h.advance(Duration::from_secs(5)).await;
    assert_eq!(row(h, "e").await.tokens_now.floor(), 5, "capped at 10 - 5");
    // 11 s after the grant, 1 s after the expiry: the cap (5) held until then, then 1 s of
    // refill. Nobody had to settle the lease.
    h.advance(Duration::from_secs(6)).await;
    let r = row(h, "e").await;
    assert!(r.leases.is_empty(), "the expired lease is not counted");
    assert_eq!(r.tokens_now.floor(), 6);
    // Its holder's late give-back credits nothing: those tokens came back through the refill.
    let give = GiveBack {
        id: 20,
        key: "e",
        bucket: cfg(),
        amount: t(5),
        lease: Some(LeaseRef {
            holder: 7,
            lease_id: 1,
        }),
    };
    store.give_back(&[give]).await.expect("give_back");
    assert_eq!(row(h, "e").await.tokens_now.floor(), 6);
}

async fn kept_tokens_beyond_the_entry_come_out_of_the_bucket(h: &dyn Harness) {
    // A holder without an entry says it keeps 3: they are counted, so they come out of the
    // bucket before the grant.
    let a = h
        .store()
        .acquire(held("k", 1, 3, 2, HOUR))
        .await
        .expect("lease");
    assert_eq!(a.granted, t(2));
    let r = row(h, "k").await;
    assert_eq!(r.tokens_now.floor(), C - 5);
    assert_eq!(r.leases[0].amount, t(5));
}

macro_rules! contract {
    ($($case:ident),* $(,)?) => {
        mod memory_store {
            $(
                #[tokio::test(start_paused = true)]
                async fn $case() {
                    super::$case(&super::memory()).await;
                }
            )*
        }
        mod postgres_store {
            $(
                #[tokio::test]
                async fn $case() {
                    super::$case(&super::postgres().await).await;
                }
            )*
        }
    };
}

contract!(
    absent_key_is_a_full_bucket,
    bursts_to_capacity_then_denies_with_retry_after,
    refills_by_elapsed_time_and_never_above_capacity,
    a_lease_takes_what_is_there_between_min_and_want,
    grants_come_in_whole_steps,
    fractional_costs_are_exact,
    many_keys_in_one_call,
    a_key_named_twice_is_two_calls,
    idle_buckets_are_deleted_without_changing_decisions,
    a_new_shape_takes_effect_on_the_next_call,
    returns_are_idempotent_and_capped,
    strict_leases_count_against_capacity_until_settled,
    a_strict_lease_stops_counting_at_its_expiry,
    kept_tokens_beyond_the_entry_come_out_of_the_bucket,
);
