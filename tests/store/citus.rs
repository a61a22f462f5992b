//! The store on a real Citus cluster (Z1–Z12 in docs/testing.md): a coordinator and
//! two workers started by each test ([`TempCitus`]), the tables distributed by `migrate`, every
//! call routed to one worker, faults per worker, and the C1 envelope through the cluster.
//!
//! Needs the Citus extension for the server binaries (`.ci/run` builds it from Citus's source
//! release when it is missing).

use crate::common;
use crate::subject::client;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokenlease::policy::{Accounting, FallbackMode, FallbackSettings, LeaseSettings, Plan};
use tokenlease::store::{AcquireRequest, GiveBack, PostgresStore, Store as _};
use tokenlease::{DecidedBy, Limiter};
use tokenlease_testkit::{StopMode, TempCitus};

const C: f64 = 100.0;
const R: f64 = 50.0;
const B: f64 = 10.0;
const SLACK: f64 = 0.02;

/// A cluster of a coordinator and `workers` workers (started on a blocking thread).
async fn cluster(workers: usize) -> Arc<TempCitus> {
    let started = tokio::task::spawn_blocking(move || TempCitus::start(workers))
        .await
        .expect("start task")
        .expect("a Citus cluster (install the Citus extension; .ci/run builds it when missing)");
    Arc::new(started)
}

/// [`cluster`] with the tables distributed (`tokenlease::store::migrate`).
async fn migrated(workers: usize) -> Arc<TempCitus> {
    migrate_on(cluster(workers).await).await
}

/// [`cluster`] with `citus.shard_count` set to `shards` on every node (so `migrate` keeps it
/// rather than choosing one shard a worker).
pub(crate) async fn cluster_with_shards(workers: usize, shards: u32) -> Arc<TempCitus> {
    let started = tokio::task::spawn_blocking(move || {
        TempCitus::builder()
            .workers(workers)
            .setting("citus.shard_count", shards.to_string())
            .start()
    })
    .await
    .expect("start task")
    .expect("a Citus cluster (install the Citus extension; .ci/run builds it when missing)");
    Arc::new(started)
}

/// [`cluster_with_shards`] with the tables distributed.
async fn migrated_with_shards(workers: usize, shards: u32) -> Arc<TempCitus> {
    migrate_on(cluster_with_shards(workers, shards).await).await
}

/// `citus` with the tables distributed.
async fn migrate_on(citus: Arc<TempCitus>) -> Arc<TempCitus> {
    let mut c = client(&citus.connection_string("postgres")).await;
    tokenlease::store::migrate(&mut c).await.expect("migrate");
    citus
}

/// A store on the coordinator with generous timeouts (migrating: distributes the tables).
async fn store(citus: &TempCitus, pool: u32) -> PostgresStore {
    common::store_at(&citus.connection_string("postgres"), pool, true).await
}

/// A cluster whose nodes count statements (`pg_stat_statements`, nested ones too).
async fn counted_cluster(workers: usize) -> Arc<TempCitus> {
    let started = tokio::task::spawn_blocking(move || {
        TempCitus::builder()
            .workers(workers)
            .setting("shared_preload_libraries", "citus,pg_stat_statements")
            .setting("pg_stat_statements.track", "all")
            .start()
    })
    .await
    .expect("start task")
    .expect("a Citus cluster (install the Citus extension; .ci/run builds it when missing)");
    // Created on the coordinator, which creates it on every worker.
    client(&started.connection_string("postgres"))
        .await
        .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .await
        .expect("pg_stat_statements");
    Arc::new(started)
}

/// How many calls of the store's routed functions each worker has run (top-level statements
/// naming `tokenlease_citus_`), by port; and how many statements on a shard table the
/// coordinator ran (none: it holds no shards and only forwards the calls).
async fn routed_calls(citus: &TempCitus) -> (BTreeMap<u16, i64>, i64) {
    let mut out = BTreeMap::new();
    for w in citus.workers() {
        let c = client(&w.connection_string("postgres")).await;
        let row = c
            .query_one(
                "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements \
                 WHERE toplevel AND query LIKE '%tokenlease_citus_%' \
                   AND query NOT LIKE '%pg_stat_statements%'",
                &[],
            )
            .await
            .expect("pg_stat_statements");
        out.insert(w.port(), row.get(0));
    }
    let c = client(&citus.connection_string("postgres")).await;
    let on_shards: i64 = c
        .query_one(
            "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements \
             WHERE query ~ 'tokenlease_buckets_[0-9]+' AND query NOT LIKE '%pg_stat_statements%'",
            &[],
        )
        .await
        .expect("pg_stat_statements")
        .get(0);
    (out, on_shards)
}

/// Prepared (two-phase) transactions the coordinator has recorded, and those still open on any
/// node: both stay at zero when no call is a multi-node transaction.
async fn two_phase(citus: &TempCitus) -> (i64, i64) {
    let coordinator = client(&citus.connection_string("postgres")).await;
    let recorded: i64 = coordinator
        .query_one("SELECT count(*) FROM pg_dist_transaction", &[])
        .await
        .expect("pg_dist_transaction")
        .get(0);
    let mut open = 0;
    for node in std::iter::once(citus.coordinator()).chain(citus.workers()) {
        let c = client(&node.connection_string("postgres")).await;
        let n: i64 = c
            .query_one("SELECT count(*) FROM pg_prepared_xacts", &[])
            .await
            .expect("pg_prepared_xacts")
            .get(0);
        open += n;
    }
    (recorded, open)
}

/// `count` keys `prefix-0`, `prefix-1`, … whose shard is on the worker at `port`, as the
/// coordinator's shard map says.
async fn keys_on(citus: &TempCitus, port: u16, prefix: &str, count: usize) -> Vec<String> {
    let c = client(&citus.connection_string("postgres")).await;
    let candidates: Vec<String> = (0..count * 8).map(|i| format!("{prefix}-{i}")).collect();
    let rows = c
        .query(
            "SELECT k FROM unnest($1::text[]) WITH ORDINALITY AS u(k, n) \
             JOIN pg_dist_placement AS p \
               ON p.shardid = get_shard_id_for_distribution_column('tokenlease_buckets', u.k) \
             JOIN pg_dist_node AS d ON d.groupid = p.groupid \
             WHERE d.nodeport = $2 ORDER BY u.n LIMIT $3",
            &[&candidates, &i32::from(port), &(count as i64)],
        )
        .await
        .expect("keys on a worker");
    let keys: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(keys.len(), count, "not enough keys on port {port}");
    keys
}

fn req<'a>(key: &'a str, cost: u64) -> AcquireRequest<'a> {
    AcquireRequest::take(
        key,
        common::bucket(10, 1.0),
        tokenlease::bucket::Tokens::whole(cost),
    )
}

/// Z1: `migrate` on a Citus coordinator distributes both tables by key, co-located, with the
/// returns' key `(key, id)`, over a shard count it chooses itself (one per worker, said in its
/// report) when `citus.shard_count` is left at Citus's default, and makes the routed functions
/// distributed functions and the shard guard a function on every node; a second migrate
/// changes nothing. Every shard has a placement on a worker. (That the client's hash of a key
/// is Citus's `worker_hash` for 5,000 keys of every shape is a unit test of
/// `src/store/postgres/citus/tests.rs`, where the hash is reachable.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_distributes_the_tables_and_the_client_hashes_as_citus() {
    let citus = cluster(2).await;
    let conn = citus.connection_string("postgres");
    let mut c = client(&conn).await;
    let report = tokenlease::store::migrate(&mut c).await.expect("migrate");
    assert!(
        report
            .citus
            .as_deref()
            .is_some_and(|v| v.starts_with("13.")),
        "{report}"
    );
    assert!(
        report.to_string().contains("distributed by key"),
        "{report}"
    );
    let again = tokenlease::store::migrate(&mut c)
        .await
        .expect("migrate again");
    assert!(again.is_noop(), "{again}");

    let rows = c
        .query(
            "SELECT logicalrelid::text, partmethod::text, colocationid \
             FROM pg_dist_partition \
             WHERE logicalrelid::text IN ('tokenlease_buckets', 'tokenlease_returns') \
             ORDER BY 1",
            &[],
        )
        .await
        .expect("pg_dist_partition");
    assert_eq!(rows.len(), 2, "both tables distributed");
    assert!(rows.iter().all(|r| r.get::<_, String>(1) == "h"));
    assert_eq!(
        rows[0].get::<_, i32>(2),
        rows[1].get::<_, i32>(2),
        "co-located"
    );
    let pkey: String = c
        .query_one(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint \
             WHERE conname = 'tokenlease_returns_pkey'",
            &[],
        )
        .await
        .expect("returns key")
        .get(0);
    assert_eq!(pkey, "PRIMARY KEY (key, id)");
    let functions: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_dist_object AS o JOIN pg_proc AS p ON p.oid = o.objid \
             WHERE o.classid = 'pg_proc'::regclass AND p.proname LIKE 'tokenlease_citus_%' \
               AND o.distribution_argument_index = 0 AND o.colocationid IS NOT NULL",
            &[],
        )
        .await
        .expect("distributed functions")
        .get(0);
    assert_eq!(
        functions, 5,
        "take_held, give_back, delete_idle, take_limits, give_back_limits"
    );
    assert_eq!(report.citus_shards, Some(2), "{report}");
    assert!(report.citus_shard_count_chosen, "{report}");
    assert!(
        report.to_string().contains("2 shards (chosen by migrate"),
        "{report}"
    );
    assert_eq!(again.citus_shards, Some(2));
    assert!(!again.citus_shard_count_chosen);
    // The guard exists on every worker (a plain function, called where the statement runs).
    for w in citus.workers() {
        let on_worker: Option<String> = client(&w.connection_string("postgres"))
            .await
            .query_one(
                "SELECT to_regprocedure('tokenlease_citus_hold(bigint[], text[])')::text",
                &[],
            )
            .await
            .expect("the guard")
            .get(0);
        assert!(on_worker.is_some(), "no guard on worker {}", w.port());
    }

    let unplaced: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_dist_shard AS s \
             WHERE s.logicalrelid = 'tokenlease_buckets'::regclass \
               AND NOT EXISTS (SELECT FROM pg_dist_placement AS p \
                               JOIN pg_dist_node AS n ON n.groupid = p.groupid \
                               WHERE p.shardid = s.shardid AND n.shouldhaveshards)",
            &[],
        )
        .await
        .expect("placements")
        .get(0);
    assert_eq!(unplaced, 0);

    let store = store(&citus, 2).await;
    let first = store.acquire(req("a-key", 4)).await.expect("a take");
    assert_eq!(first.granted, tokenlease::bucket::Tokens::whole(4));
}

/// Z1: `citus.shard_count` set by the user (here in the server's configuration) is the shard
/// count `migrate` uses, and its report says it did not choose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_keeps_a_shard_count_the_user_set() {
    let started = cluster_with_shards(2, 6).await;
    let mut c = client(&started.connection_string("postgres")).await;
    let report = tokenlease::store::migrate(&mut c).await.expect("migrate");
    assert_eq!(report.citus_shards, Some(6), "{report}");
    assert!(!report.citus_shard_count_chosen, "{report}");
}

/// The shard guard as builds before 2026-12-06 created it (its lock in a `PERFORM`, the
/// placements counted by an aggregate), with such a build's fingerprint stamp; such builds
/// recorded no generation for the node functions.
const OLDER_GUARD: &str = "\
CREATE OR REPLACE FUNCTION tokenlease_citus_hold(shards bigint[], keys text[])
RETURNS text[]
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $fn$
BEGIN
    PERFORM pg_catalog.lock_shard_metadata(5, shards);
    IF (SELECT pg_catalog.count(*) FROM pg_catalog.pg_dist_placement AS p
        WHERE p.shardid OPERATOR(pg_catalog.=) ANY (shards)
          AND p.groupid OPERATOR(pg_catalog.=)
              (SELECT l.groupid FROM pg_catalog.pg_dist_local_group AS l))
       OPERATOR(pg_catalog.<) pg_catalog.cardinality(shards)
    THEN
        RAISE EXCEPTION 'tokenlease: shard of % has no placement on this node', shards
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    RETURN keys;
END
$fn$;
COMMENT ON FUNCTION tokenlease_citus_delete_idle(text, bigint) IS 'tokenlease citus 000000000000000000000000';
DELETE FROM tokenlease_functions WHERE file = 'citus'";

/// The guard's body on every worker.
async fn guard_bodies(citus: &TempCitus) -> Vec<String> {
    let mut bodies = Vec::new();
    for w in citus.workers() {
        let body: String = client(&w.connection_string("postgres"))
            .await
            .query_one(
                "SELECT prosrc FROM pg_proc \
                 WHERE oid = 'tokenlease_citus_hold(bigint[], text[])'::regprocedure \
                   AND prosecdef",
                &[],
            )
            .await
            .expect("the guard, SECURITY DEFINER")
            .get(0);
        bodies.push(body);
    }
    bodies
}

/// Z12: a cluster migrated by an older build (its guard body, its fingerprint stamp, no
/// generation recorded) gets this build's guard on every node at the next `migrate`, which
/// records the node functions' generation, passes each worker's own shards and refuses the
/// others, and the store decides through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_replaces_an_older_builds_guard_on_every_node() {
    let citus = migrated(2).await;
    let conn = citus.connection_string("postgres");
    let mut c = client(&conn).await;
    c.batch_execute(OLDER_GUARD).await.expect("the older guard");
    let older = guard_bodies(&citus).await;
    assert!(
        older.iter().all(|b| b.contains("PERFORM pg_catalog.lock")),
        "the older guard reached every worker: {older:?}"
    );
    let report = tokenlease::store::migrate(&mut c).await.expect("migrate");
    assert_eq!(report.functions_applied, ["citus"], "{report}");
    let now = guard_bodies(&citus).await;
    for body in &now {
        assert!(!body.contains("count(*)"), "still the older guard: {body}");
        assert!(body.contains("GET DIAGNOSTICS"), "{body}");
    }
    let generation: i32 = c
        .query_one(
            "SELECT generation FROM tokenlease_functions WHERE file = 'citus'",
            &[],
        )
        .await
        .expect("the node functions' record")
        .get(0);
    assert!(generation >= 1, "{generation}");
    // On each worker the guard passes the shards placed there and refuses any other
    // (SQLSTATE 55000, which the store reads as a stale map).
    let shards = c
        .query(
            "SELECT s.shardid, n.nodeport::integer FROM pg_dist_shard AS s \
             JOIN pg_dist_placement AS p ON p.shardid = s.shardid \
             JOIN pg_dist_node AS n ON n.groupid = p.groupid \
             WHERE s.logicalrelid = 'tokenlease_buckets'::regclass ORDER BY s.shardid",
            &[],
        )
        .await
        .expect("placements");
    for w in citus.workers() {
        let on = client(&w.connection_string("postgres")).await;
        for row in &shards {
            let (shard, port): (i64, i32) = (row.get(0), row.get(1));
            let called = on
                .query_one(
                    "SELECT tokenlease_citus_hold(ARRAY[$1::bigint], ARRAY['k'])",
                    &[&shard],
                )
                .await;
            if port == i32::from(w.port()) {
                let keys: Vec<String> = called.expect("its own shard passes").get(0);
                assert_eq!(keys, ["k"]);
            } else {
                let err = called.expect_err("a shard placed elsewhere is refused");
                assert_eq!(
                    err.code(),
                    Some(&tokio_postgres::error::SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE),
                    "{err}"
                );
            }
        }
    }
    let store = store(&citus, 2).await;
    let keys = keys_of_every_shard(&citus, "z12").await;
    let requests: Vec<AcquireRequest<'_>> = keys.iter().map(|(k, _)| req(k, 3)).collect();
    for answer in store.acquire_each(&requests).await {
        let got = answer.expect("a take through the new guard");
        assert_eq!(got.granted, tokenlease::bucket::Tokens::whole(3));
    }
}

/// Z2: every kind of call works through the cluster and runs on one worker, with no
/// distributed transaction: one-key and many-key takes (keys of every shard, both workers in one
/// batch), takes that insert and that update, strict leases and takes on rows holding them,
/// returns (a retried return credits once), inspection and idle cleanup. Each worker's keys of
/// a batch are one statement on that worker; the coordinator runs none of the store's
/// statements (`pg_stat_statements`), records no two-phase commit (`pg_dist_transaction`), and
/// no node holds a prepared transaction; each one-worker call commits on that worker and not on
/// the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_runs_on_one_worker_without_a_distributed_transaction() {
    let citus = counted_cluster(2).await;
    let store = store(&citus, 4).await;
    let (ports, other) = (citus.workers()[0].port(), citus.workers()[1].port());
    let on_first = keys_on(&citus, ports, "first", 40).await;
    let on_second = keys_on(&citus, other, "second", 40).await;
    let baseline = two_phase(&citus).await;
    assert_eq!(baseline.1, 0, "no prepared transaction left by the setup");
    let coordinator_calls = store_statements_on_coordinator(&citus).await;

    // One key on the first worker: the first worker commits, the second does not.
    let (before, coordinator_before) = routed_calls(&citus).await;
    let mut granted = 0;
    for _ in 0..20 {
        let got = store.acquire(req(&on_first[0], 1)).await.expect("one key");
        granted += u32::from(!got.granted.is_zero());
    }
    assert!(
        (10..20).contains(&granted),
        "granted {granted} of 20 on a bucket of 10"
    );
    let (after, _) = routed_calls(&citus).await;
    assert_eq!(after[&ports] - before[&ports], 20, "{before:?} → {after:?}");
    assert_eq!(
        after[&other], before[&other],
        "the other worker ran calls: {before:?} → {after:?}"
    );

    // Many keys of both workers in one batch: each part on its own worker.
    let keys: Vec<&str> = on_first[1..]
        .iter()
        .chain(&on_second)
        .map(String::as_str)
        .collect();
    let requests: Vec<AcquireRequest<'_>> = keys.iter().map(|k| req(k, 3)).collect();
    for round in 0..4 {
        let answers = store.acquire_many(&requests).await.expect("many keys");
        for (k, a) in keys.iter().zip(&answers) {
            let expected = if round < 3 { 3 } else { 0 };
            assert_eq!(
                a.granted,
                tokenlease::bucket::Tokens::whole(expected),
                "round {round}, key {k}"
            );
        }
    }
    let each = store.acquire_each(&requests).await;
    assert!(each.iter().all(Result::is_ok));
    // Five batches of both workers' keys: one call on each worker per batch.
    let (batched, _) = routed_calls(&citus).await;
    for port in [ports, other] {
        assert_eq!(batched[&port] - after[&port], 5, "{after:?} → {batched:?}");
    }

    // Returns: credited once, a retry credits nothing.
    let returns: Vec<GiveBack<'_>> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| GiveBack {
            id: 1000 + i as i64,
            key: k,
            amount: tokenlease::bucket::Tokens::whole(2),
            bucket: common::bucket(10, 1.0),
            lease: None,
        })
        .collect();
    assert_eq!(store.give_back(&returns).await.expect("give back"), 79);
    assert_eq!(store.give_back(&returns).await.expect("retry"), 0);
    let row = store
        .inspect(&on_second[3])
        .await
        .expect("inspect")
        .expect("a row");
    assert!(
        row.tokens >= tokenlease::bucket::Tokens::whole(2),
        "{row:?}"
    );

    // Strict leases: a held take, then a plain take on the row that holds it.
    let hold = tokenlease::store::Hold {
        holder: 7,
        lease_id: 1,
        kept: tokenlease::bucket::Tokens::ZERO,
        lifetime: Duration::from_secs(30),
    };
    let strict_key = &on_second[0];
    let leased = store
        .acquire(
            AcquireRequest::lease(
                strict_key,
                common::bucket(10, 1.0),
                tokenlease::bucket::Tokens::whole(1),
                tokenlease::bucket::Tokens::whole(2),
            )
            .held(hold),
        )
        .await
        .expect("strict lease");
    assert!(!leased.granted.is_zero(), "{leased:?}");
    let row = store
        .inspect(strict_key)
        .await
        .expect("inspect")
        .expect("row");
    assert_eq!(row.leases.len(), 1, "{row:?}");
    let plain = store
        .acquire(req(strict_key, 1))
        .await
        .expect("plain take on a row with a strict lease");
    let _ = plain;
    // The strict lease comes back settled.
    let settled = store
        .give_back(&[GiveBack {
            id: 99,
            key: strict_key,
            amount: leased.granted,
            bucket: common::bucket(10, 1.0),
            lease: Some(tokenlease::store::LeaseRef {
                holder: 7,
                lease_id: 1,
            }),
        }])
        .await
        .expect("strict return");
    assert_eq!(settled, 1);
    let row = store
        .inspect(strict_key)
        .await
        .expect("inspect")
        .expect("row");
    assert!(row.leases.is_empty(), "{row:?}");

    // Idle cleanup: fast-refilling buckets are full at once and deleted on both workers.
    let fast = common::bucket(1, 1_000_000.0);
    let idle: Vec<AcquireRequest<'_>> = keys
        .iter()
        .map(|k| AcquireRequest::take(k, fast, tokenlease::bucket::Tokens::whole(1)))
        .collect();
    store.acquire_many(&idle).await.expect("fast buckets");
    let mut deleted = 0;
    for _ in 0..10 {
        deleted += store.delete_idle(1000).await.expect("delete idle");
        if deleted >= keys.len() as u64 {
            break;
        }
    }
    assert!(deleted >= keys.len() as u64 - 1, "deleted {deleted}");

    let (_, coordinator_on_shards) = routed_calls(&citus).await;
    // (The migration's DDL names the shards: counted before the calls.)
    assert_eq!(
        coordinator_on_shards, coordinator_before,
        "the coordinator ran a statement on a shard"
    );
    let (recorded, open) = two_phase(&citus).await;
    assert_eq!(
        (recorded, open),
        (baseline.0, 0),
        "a call of the store opened a distributed (two-phase) transaction"
    );
    // The coordinator ran none of the store's statements: every decision, return, inspection
    // and cleanup went straight to a worker.
    assert_eq!(
        store_statements_on_coordinator(&citus).await,
        coordinator_calls,
        "the coordinator ran a statement of the store's"
    );
}

/// How many of the store's statements (their text names `tokenlease_citus_` or starts with
/// the `-- tokenlease` comment) the coordinator has run, nested ones included.
async fn store_statements_on_coordinator(citus: &TempCitus) -> i64 {
    client(&citus.connection_string("postgres"))
        .await
        .query_one(
            "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements \
             WHERE (query LIKE '%tokenlease_citus_%' OR query LIKE '%-- tokenlease%' \
                    OR query ~ 'tokenlease_buckets_[0-9]+') \
               AND query NOT LIKE '%pg_stat_statements%'",
            &[],
        )
        .await
        .expect("pg_stat_statements")
        .get(0)
}

/// A dropped cluster leaves no server and no directory behind (each node is a `TempPostgres`,
/// stopped and removed on drop), and the builder's settings reach every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_cluster_leaves_nothing_behind() {
    let started = tokio::task::spawn_blocking(|| {
        TempCitus::builder()
            .workers(1)
            .setting("citus.shard_count", "4")
            .start()
    })
    .await
    .expect("start task")
    .expect("a Citus cluster");
    for node in std::iter::once(started.coordinator()).chain(started.workers()) {
        let c = client(&node.connection_string("postgres")).await;
        let shards: String = c
            .query_one("SHOW citus.shard_count", &[])
            .await
            .expect("setting")
            .get(0);
        assert_eq!(shards, "4");
    }
    let nodes: Vec<(std::path::PathBuf, u32)> = std::iter::once(started.coordinator())
        .chain(started.workers())
        .map(|n| {
            (
                n.data_dir().to_path_buf(),
                n.postmaster_pid().expect("running"),
            )
        })
        .collect();
    tokio::task::spawn_blocking(move || drop(started))
        .await
        .expect("drop task");
    for (dir, pid) in nodes {
        assert!(!dir.exists(), "{} left behind", dir.display());
        // Gone, or a zombie waiting for its new parent (pid 1) to reap it.
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .and_then(|(_, rest)| rest.trim_start().chars().next())
            });
        assert!(
            matches!(state, None | Some('Z')),
            "postmaster {pid} still running ({state:?})"
        );
    }
}

/// One decision of [`drive`].
#[derive(Debug, Clone)]
struct Event {
    instance: usize,
    /// When the decision came back, since the run's origin.
    at: Duration,
    key: usize,
    allowed: bool,
    by: DecidedBy,
    /// How long the caller waited.
    took: Duration,
}

/// `limiters` × `tasks` tasks for `duration`, each cycling through `keys` from its own offset,
/// a 500 µs pause after each call.
fn drive(
    limiters: &[Limiter],
    plan: &Arc<Plan>,
    keys: &Arc<Vec<String>>,
    tasks: usize,
    origin: Instant,
    duration: Duration,
) -> tokio::task::JoinHandle<Vec<Event>> {
    let end = Arc::new(AtomicU64::new(duration.as_millis() as u64));
    drive_until(limiters, plan, keys, tasks, origin, end)
}

/// [`drive`] until `end` (milliseconds since `origin`, which the caller may move).
fn drive_until(
    limiters: &[Limiter],
    plan: &Arc<Plan>,
    keys: &Arc<Vec<String>>,
    tasks: usize,
    origin: Instant,
    end: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<Vec<Event>> {
    let mut handles = Vec::new();
    for (i, limiter) in limiters.iter().enumerate() {
        for t in 0..tasks {
            let (limiter, plan, keys) = (limiter.clone(), Arc::clone(plan), Arc::clone(keys));
            let end = Arc::clone(&end);
            handles.push(tokio::spawn(async move {
                let mut events = Vec::new();
                let mut n = t * 7 + i * 3;
                while origin.elapsed() < Duration::from_millis(end.load(Ordering::Relaxed)) {
                    n += 1;
                    let key = n % keys.len();
                    let started = Instant::now();
                    let d = limiter
                        .try_acquire_with(&plan, &keys[key], 1.0)
                        .await
                        .expect("decision");
                    events.push(Event {
                        instance: i,
                        at: origin.elapsed(),
                        key,
                        allowed: d.allowed,
                        by: d.decided_by,
                        took: started.elapsed(),
                    });
                    // sleep: pacing, calls 500 µs apart.
                    tokio::time::sleep(Duration::from_micros(500)).await;
                }
                events
            }));
        }
    }
    tokio::spawn(async move {
        let mut all = Vec::new();
        for h in handles {
            all.extend(h.await.expect("task"));
        }
        all
    })
}

/// A store with short, fault-test timeouts: 300 ms per call (a loaded 2-core machine running
/// three servers must not time out a healthy worker's call), a 250 ms pool wait and connect.
async fn fault_store(citus: &TempCitus) -> PostgresStore {
    PostgresStore::builder(&citus.connection_string("postgres"))
        .expect("connection string")
        .pool_size(4)
        .call_timeout(Duration::from_millis(300))
        .pool_wait_timeout(Duration::from_millis(250))
        .connect_timeout(Duration::from_millis(250))
        .statement_timeout(Duration::from_millis(500))
        .lock_timeout(Duration::from_millis(500))
        .migrate_timeout(Duration::from_secs(60))
        .build()
        .await
        .expect("store")
}

/// One key of every shard of `tokenlease_buckets`, in shard order, with the port of the worker
/// holding it.
async fn keys_of_every_shard(citus: &TempCitus, prefix: &str) -> Vec<(String, u16)> {
    let c = client(&citus.connection_string("postgres")).await;
    let candidates: Vec<String> = (0..2000).map(|i| format!("{prefix}-{i}")).collect();
    let rows = c
        .query(
            "SELECT DISTINCT ON (s.shard) s.k, d.nodeport \
             FROM (SELECT u.k, u.n, \
                          get_shard_id_for_distribution_column('tokenlease_buckets', u.k) \
                              AS shard \
                   FROM unnest($1::text[]) WITH ORDINALITY AS u(k, n)) AS s \
             JOIN pg_dist_placement AS p ON p.shardid = s.shard \
             JOIN pg_dist_node AS d ON d.groupid = p.groupid \
             ORDER BY s.shard, s.n",
            &[&candidates],
        )
        .await
        .expect("a key per shard");
    let shards = shard_count(&c).await;
    assert_eq!(rows.len() as i64, shards, "a key on every shard");
    rows.iter()
        .map(|r| (r.get(0), u16::try_from(r.get::<_, i32>(1)).expect("port")))
        .collect()
}

/// Z3 and Z4: one worker stopped (`pg_ctl stop -m immediate`) or hung (SIGSTOP) under load in
/// direct mode, fallback `allow`: while it is out, only its keys are decided by the fallback;
/// every call on the other worker's keys is still the store's, and none of them waits out the
/// call timeout. Afterwards both workers' keys are the store's again.
async fn one_worker_out(hang: bool) {
    let citus = migrated(2).await;
    let down_port = citus.workers()[1].port();
    // Four keys on each worker.
    let mut keys = keys_on(&citus, citus.workers()[0].port(), "fault-up", 4).await;
    keys.extend(keys_on(&citus, down_port, "fault-down", 4).await);
    let on_down: HashSet<usize> = (4..8).collect();
    let keys = Arc::new(keys);
    let mut limiters = Vec::new();
    for _ in 0..2 {
        limiters.push(Limiter::builder(fault_store(&citus).await).build());
    }
    // A bucket that never runs dry: every store decision is an admission.
    let plan = Arc::new(
        common::plan(1_000_000, 1_000_000.0)
            .with_fallback(FallbackSettings::new(FallbackMode::Allow)),
    );
    let origin = Instant::now();
    let run = drive(&limiters, &plan, &keys, 4, origin, Duration::from_secs(5));
    // sleep: the fault timeline, the worker out at 1.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(1500)).into()).await;
    let out_from = origin.elapsed();
    let worker = Arc::clone(&citus);
    let suspended = tokio::task::spawn_blocking(move || {
        let w = worker.worker_on_port(down_port).expect("worker");
        if hang {
            Some(w.suspend().expect("SIGSTOP"))
        } else {
            w.stop(StopMode::Immediate).expect("stop");
            None
        }
    })
    .await
    .expect("fault task");
    // sleep: the fault timeline, the worker out until 3 s.
    tokio::time::sleep_until((origin + Duration::from_millis(3000)).into()).await;
    let back_at = origin.elapsed();
    match suspended {
        Some(s) => s.resume(),
        None => {
            let worker = Arc::clone(&citus);
            tokio::task::spawn_blocking(move || {
                worker
                    .worker_on_port(down_port)
                    .expect("worker")
                    .start_again()
                    .expect("start again")
            })
            .await
            .expect("start task");
        }
    }
    let back = origin.elapsed();
    let events = run.await.expect("run");
    // After the fault, the worker's keys are the store's again: polled with a deadline (the
    // coordinator's connections to the restarted worker are opened again on first use).
    let recovered = common::poll_until(
        Duration::from_millis(50),
        Duration::from_secs(20),
        async || {
            let d = limiters[0]
                .try_acquire_with(&plan, &keys[4], 1.0)
                .await
                .expect("decision");
            d.decided_by == DecidedBy::Store
        },
    )
    .await
    .is_ok();
    for limiter in &limiters {
        limiter.shutdown().await;
    }
    let label = if hang { "SIGSTOP" } else { "stopped" };
    let healthy: Vec<&Event> = events
        .iter()
        .filter(|e| !on_down.contains(&e.key))
        .collect();
    // While the worker is out: from the fault until the restart begins (a restart's crash
    // recovery loads a 2-core machine, which slows every server alike).
    let healthy_in_fault: Vec<&Event> = healthy
        .iter()
        .copied()
        .filter(|e| e.at > out_from && e.at < back_at)
        .collect();
    // From 0.5 s in (the pools' first statements, each session's first plan of the shards'
    // statements) until the restart begins.
    let not_by_store: Vec<(u128, DecidedBy)> = healthy
        .iter()
        .filter(|e| e.at > Duration::from_millis(500) && e.at < back_at)
        .filter(|e| e.by != DecidedBy::Store)
        .map(|e| (e.at.as_millis(), e.by))
        .collect();
    let not_store = not_by_store.len();
    let slowest = healthy_in_fault
        .iter()
        .map(|e| e.took)
        .max()
        .unwrap_or_default();
    let mut took: Vec<u128> = healthy_in_fault
        .iter()
        .map(|e| e.took.as_micros())
        .collect();
    took.sort_unstable();
    let p99 = took.get(took.len() * 99 / 100).copied().unwrap_or(0);
    let mut before: Vec<u128> = healthy
        .iter()
        .filter(|e| e.at > Duration::from_millis(500) && e.at < out_from)
        .map(|e| e.took.as_micros())
        .collect();
    before.sort_unstable();
    eprintln!(
        "Z {}: healthy keys before the fault: {} calls, p99 {} µs; in the fault, slow ones: {:?}",
        if hang { "SIGSTOP" } else { "stopped" },
        before.len(),
        before.get(before.len() * 99 / 100).copied().unwrap_or(0),
        healthy_in_fault
            .iter()
            .filter(|e| e.took > Duration::from_millis(100))
            .map(|e| (e.at.as_millis(), e.took.as_millis(), e.by))
            .collect::<Vec<_>>()
    );
    let down_in_fault: Vec<&Event> = events
        .iter()
        .filter(|e| {
            on_down.contains(&e.key)
                && e.at > out_from + Duration::from_millis(400)
                && e.at < back_at
        })
        .collect();
    let down_fallback = down_in_fault
        .iter()
        .filter(|e| matches!(e.by, DecidedBy::Fallback(_)))
        .count();
    eprintln!(
        "Z {label}: {} decisions; healthy worker's keys: {} in the fault, {not_store} not by the \
         store, p99 {p99} µs, slowest {slowest:?}; stopped worker's keys: {} in the fault, \
         {down_fallback} by the fallback",
        events.len(),
        healthy_in_fault.len(),
        down_in_fault.len()
    );
    assert!(
        !healthy_in_fault.is_empty(),
        "calls on the healthy worker's keys"
    );
    assert_eq!(
        not_store, 0,
        "{label}: the healthy worker's keys went to the fallback (ms into the run, by): \
         {not_by_store:?}; the fault from {out_from:?} to {back_at:?}"
    );
    assert!(
        slowest < Duration::from_millis(300),
        "{label}: a healthy key's call waited {slowest:?}, the call timeout"
    );
    assert!(
        !down_in_fault.is_empty(),
        "calls on the stopped worker's keys"
    );
    assert_eq!(
        down_fallback,
        down_in_fault.len(),
        "{label}: a stopped worker's key decided by the store"
    );
    assert!(recovered, "{label}: the worker's keys never came back");
    let _ = back;
}

/// Z3: a worker stopped with `pg_ctl stop -m immediate`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_worker_sends_only_its_keys_to_the_fallback() {
    one_worker_out(false).await;
}

/// Z3: a worker hung with SIGSTOP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_worker_sends_only_its_keys_to_the_fallback() {
    one_worker_out(true).await;
}

/// Z10 (was Z4): the coordinator down (`pg_ctl stop -m immediate`) under direct-mode load:
/// the coordinator is on the path of no decision, so every call is still decided by the store,
/// on the workers, within the call timeout; and after the coordinator is back, too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_coordinator_down_the_workers_still_decide() {
    let citus = migrated(2).await;
    let keys = Arc::new(
        keys_of_every_shard(&citus, "coord")
            .await
            .into_iter()
            .map(|(k, _)| k)
            .collect::<Vec<_>>(),
    );
    let limiter = Limiter::builder(fault_store(&citus).await).build();
    let plan = Arc::new(
        common::plan(1_000_000, 1_000_000.0)
            .with_fallback(FallbackSettings::new(FallbackMode::Deny)),
    );
    let origin = Instant::now();
    let run = drive(
        std::slice::from_ref(&limiter),
        &plan,
        &keys,
        4,
        origin,
        Duration::from_secs(4),
    );
    // sleep: the fault timeline, the coordinator stopped at 1 s.
    tokio::time::sleep_until((origin + Duration::from_millis(1000)).into()).await;
    let c = Arc::clone(&citus);
    tokio::task::spawn_blocking(move || c.coordinator().stop(StopMode::Immediate).expect("stop"))
        .await
        .expect("stop task");
    let down = origin.elapsed();
    // sleep: the fault timeline, the coordinator down until 2.5 s.
    tokio::time::sleep_until((origin + Duration::from_millis(2500)).into()).await;
    let restarting = origin.elapsed();
    let c = Arc::clone(&citus);
    tokio::task::spawn_blocking(move || c.coordinator().start_again().expect("start"))
        .await
        .expect("start task");
    let events = run.await.expect("run");
    limiter.shutdown().await;
    let outage: Vec<&Event> = events
        .iter()
        .filter(|e| e.at.saturating_sub(e.took) > down && e.at < restarting)
        .collect();
    assert!(!outage.is_empty(), "calls while the coordinator was down");
    let slowest = outage.iter().map(|e| e.took).max().unwrap_or_default();
    let not_store: Vec<(u128, DecidedBy)> = events
        .iter()
        .filter(|e| e.at > Duration::from_millis(200) && e.by != DecidedBy::Store)
        .map(|e| (e.at.as_millis(), e.by))
        .collect();
    eprintln!(
        "Z10: {} calls with the coordinator down, slowest {slowest:?}; {} in all, {} not by \
         the store",
        outage.len(),
        events.len(),
        not_store.len()
    );
    assert!(
        not_store.is_empty(),
        "decisions not by the store (ms into the run, by), the coordinator down from {down:?} \
         to {restarting:?}: {not_store:?}"
    );
    assert!(outage.iter().all(|e| e.allowed));
    assert!(
        slowest < Duration::from_millis(300),
        "a call took {slowest:?} with the coordinator down (call timeout 300 ms)"
    );
}

/// The worst excess over `C + R·(w + SLACK) + extra` of every key's windows, admissions
/// stamped with the local clock.
fn assert_envelope(events: &[Event], keys: &[String], extra: f64, label: &str) {
    for (k, key) in keys.iter().enumerate() {
        let mut points: Vec<f64> = events
            .iter()
            .filter(|e| e.key == k && e.allowed)
            .map(|e| e.at.as_secs_f64())
            .collect();
        points.sort_by(f64::total_cmp);
        let points: Vec<(f64, f64)> = points.into_iter().map(|t| (t, 1.0)).collect();
        for w in [0.1, 0.5, 1.0, 2.0, 3.0] {
            let (excess, count) = common::worst_window(&points, w, C, R, SLACK);
            assert!(
                excess <= extra + 1e-9,
                "{label}, {key}: window {w} s admitted {count} > {C} + {R}·({w} + {SLACK}) + {extra}"
            );
        }
    }
}

/// A leased plan as C1's (docs/testing.md), fallback `deny`.
fn leased_plan(accounting: Accounting) -> Plan {
    common::plan(100, R)
        .with_lease(
            LeaseSettings::default()
                .with_ttl(Duration::from_secs(1))
                .with_max_fraction(B / C)
                .with_low_water(0.5)
                .with_refresh(Duration::from_millis(100))
                .with_max_wait(Duration::from_millis(50))
                .with_accounting(accounting),
        )
        .with_fallback(FallbackSettings::new(FallbackMode::Deny))
}

/// Z5: C1 through the cluster, two limiter instances (own pools and actors) × 8 tasks for 3 s
/// on one key of every shard (both workers): in direct mode every window of every key holds
/// `C + r·(w + ε)` within one token, leased (relaxed) within `N·B` more, strict with no lease
/// term at all; leased conservation is exact per instance.
async fn envelope(mode: Option<Accounting>) {
    let citus = migrated(2).await;
    let keys = Arc::new(
        keys_of_every_shard(&citus, "c1")
            .await
            .into_iter()
            .map(|(k, _)| k)
            .collect::<Vec<_>>(),
    );
    let mut limiters = Vec::new();
    for _ in 0..2 {
        limiters.push(Limiter::builder(store(&citus, 4).await).build());
    }
    let plan = Arc::new(match mode {
        None => common::plan(100, R).with_fallback(FallbackSettings::new(FallbackMode::Deny)),
        Some(accounting) => leased_plan(accounting),
    });
    let origin = Instant::now();
    let events = drive(&limiters, &plan, &keys, 8, origin, Duration::from_secs(3))
        .await
        .expect("run");
    let label = format!("Z5 {mode:?}");
    let fallback = events
        .iter()
        .filter(|e| matches!(e.by, DecidedBy::Fallback(_)))
        .count();
    for (i, limiter) in limiters.iter().enumerate() {
        limiter.shutdown().await;
        if mode.is_some() {
            let stats = limiter.lease_stats().expect("leased");
            let by_lease = events
                .iter()
                .filter(|e| e.instance == i && e.allowed && e.by == DecidedBy::Lease)
                .count();
            common::assert_conserved(&format!("{label}, instance {i}"), by_lease as f64, &stats);
            assert_eq!(stats.outstanding, 0.0, "shutdown gave everything back");
        }
    }
    let extra = match mode {
        None => 1.0,
        Some(Accounting::Relaxed) => 2.0 * B,
        Some(Accounting::Strict) => 0.0,
    };
    assert_envelope(&events, &keys, extra, &label);
    let admitted = events.iter().filter(|e| e.allowed).count();
    eprintln!(
        "{label}: {} decisions on {} keys, {admitted} admitted, {fallback} by the fallback",
        events.len(),
        keys.len()
    );
    assert!(admitted > 0);
    assert!(
        fallback * 10 <= events.len(),
        "{label}: {fallback} of {} decisions by the fallback",
        events.len()
    );
}

/// Z5 in direct mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_mode_holds_the_envelope_on_every_shard() {
    envelope(None).await;
}

/// Z5 in leased mode, relaxed accounting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_mode_holds_the_envelope_on_every_shard() {
    envelope(Some(Accounting::Relaxed)).await;
}

/// Z5 in leased mode, strict accounting: zero overshoot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_leases_hold_the_bucket_envelope_exactly_on_every_shard() {
    envelope(Some(Accounting::Strict)).await;
}

/// The store's view of a cluster whose shards change under load (Z7–Z9): direct mode, one
/// limiter (no restart) × 8 tasks on keys of every shard, fallback `deny`, a plan of C1's
/// bucket. `change` runs from 1.5 s in; the run goes on until 3 s after it returns. From 2 s
/// after it returns no decision is the fallback's, and every decision on `watched()` keys (the
/// keys the change moved, known once it ran) is the store's; every window of every key holds
/// `C + r·(w + ε)` within one token through the whole run.
async fn change_under_load<F, Fut>(label: &str, citus: &Arc<TempCitus>, change: F)
where
    F: FnOnce(Arc<TempCitus>, Vec<String>) -> Fut,
    Fut: std::future::Future<Output = Vec<String>> + Send + 'static,
{
    let mut all: Vec<String> = Vec::new();
    for prefix in ["a", "b", "c"] {
        all.extend(
            keys_of_every_shard(citus, &format!("{label}-{prefix}"))
                .await
                .into_iter()
                .map(|(k, _)| k),
        );
    }
    let keys = Arc::new(all);
    let limiter = Limiter::builder(fault_store(citus).await).build();
    let plan =
        Arc::new(common::plan(100, R).with_fallback(FallbackSettings::new(FallbackMode::Deny)));
    let origin = Instant::now();
    let end = Arc::new(AtomicU64::new(600_000));
    let run = drive_until(
        std::slice::from_ref(&limiter),
        &plan,
        &keys,
        8,
        origin,
        Arc::clone(&end),
    );
    // sleep: the timeline, the change from 1.5 s in.
    tokio::time::sleep_until((origin + Duration::from_millis(1500)).into()).await;
    let began = origin.elapsed();
    let watched = change(Arc::clone(citus), keys.to_vec()).await;
    let returned = origin.elapsed();
    end.store(
        (returned + Duration::from_secs(3)).as_millis() as u64,
        Ordering::Relaxed,
    );
    let events = run.await.expect("run");
    limiter.shutdown().await;
    let settled = returned + Duration::from_secs(2);
    let late: Vec<&Event> = events.iter().filter(|e| e.at > settled).collect();
    let late_fallback: Vec<(u128, usize)> = late
        .iter()
        .filter(|e| e.by != DecidedBy::Store)
        .map(|e| (e.at.as_millis(), e.key))
        .collect();
    let during = events
        .iter()
        .filter(|e| e.at > began && e.at < settled && e.by != DecidedBy::Store)
        .count();
    let watched_late = late
        .iter()
        .filter(|e| watched.contains(&keys[e.key]))
        .count();
    eprintln!(
        "{label}: the change from {began:?} to {returned:?}; {} decisions, {during} not by the \
         store until 2 s after it, {} after, of which {} not by the store; {watched_late} \
         after on the {} keys it moved",
        events.len(),
        late.len(),
        late_fallback.len(),
        watched.len()
    );
    assert!(!watched.is_empty(), "{label}: the change moved no key");
    assert!(
        watched_late > 0,
        "{label}: no decision on a moved key after the change"
    );
    assert!(
        late_fallback.is_empty(),
        "{label}: {} decisions not by the store from 2 s after the change, the first (ms, key): \
         {:?}",
        late_fallback.len(),
        &late_fallback[..late_fallback.len().min(20)]
    );
    assert_envelope(&events, &keys, 1.0, label);
}

/// The shard of `key`, and the (host, port, node id) of the node holding it.
async fn placement_of(c: &tokio_postgres::Client, key: &str) -> (i64, String, i32, i32) {
    let row = c
        .query_one(
            "SELECT p.shardid, n.nodename, n.nodeport, n.nodeid FROM pg_dist_placement AS p \
             JOIN pg_dist_node AS n ON n.groupid = p.groupid \
             WHERE p.shardid = get_shard_id_for_distribution_column('tokenlease_buckets', $1::text)",
            &[&key],
        )
        .await
        .expect("placement");
    (row.get(0), row.get(1), row.get(2), row.get(3))
}

/// The keys of `keys` whose shard is `shard` or is on the node `port`.
async fn keys_where(
    c: &tokio_postgres::Client,
    keys: &[String],
    port: Option<i32>,
    shard: Option<i64>,
) -> Vec<String> {
    let rows = c
        .query(
            "SELECT u.k FROM unnest($1::text[]) AS u(k) \
             JOIN pg_dist_placement AS p \
               ON p.shardid = get_shard_id_for_distribution_column('tokenlease_buckets', u.k) \
             JOIN pg_dist_node AS n ON n.groupid = p.groupid \
             WHERE ($2::integer IS NULL OR n.nodeport = $2) AND ($3::bigint IS NULL OR p.shardid = $3)",
            &[&keys, &port, &shard],
        )
        .await
        .expect("keys");
    rows.iter().map(|r| r.get(0)).collect()
}

/// Splits `shard` at the middle of its hash range (`citus_split_shard_by_split_points`,
/// `block_writes`), its first half on the node `first`, its second on `second` (node ids).
async fn split_in_two(c: &tokio_postgres::Client, shard: i64, first: i32, second: i32) {
    c.execute(
        "SELECT citus_split_shard_by_split_points($1::bigint, \
             ARRAY[((shardminvalue::bigint + shardmaxvalue::bigint) / 2)::text], \
             ARRAY[$2::integer, $3::integer], shard_transfer_mode := 'block_writes') \
         FROM pg_dist_shard WHERE shardid = $1::bigint",
        &[&shard, &first, &second],
    )
    .await
    .expect("split");
}

/// Z7: a shard moved to the other worker under direct-mode load (`citus_move_shard_placement`,
/// `block_writes`): the store notices the stale placement, reads the map again and sends the
/// moved keys to their new node, without a restart; see [`change_under_load`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_shard_is_followed_without_a_restart() {
    let citus = migrated(2).await;
    change_under_load("Z7", &citus, |citus, keys| async move {
        let c = client(&citus.connection_string("postgres")).await;
        let (shard, host, port, _) = placement_of(&c, &keys[0]).await;
        let other = citus
            .workers()
            .iter()
            .find(|w| i32::from(w.port()) != port)
            .expect("the other worker");
        c.execute(
            "SELECT citus_move_shard_placement($1, $2, $3, $4, $5, \
                                               shard_transfer_mode := 'block_writes')",
            &[
                &shard,
                &host,
                &port,
                &other.host(),
                &i32::from(other.port()),
            ],
        )
        .await
        .expect("move");
        let moved = keys_where(&c, &keys, None, Some(shard)).await;
        assert_eq!(
            placement_of(&c, &keys[0]).await.2,
            i32::from(other.port()),
            "moved"
        );
        moved
    })
    .await;
}

/// Z8: a shard split in two under direct-mode load (`citus_split_shard_by_split_points`,
/// `block_writes`), one half to the other worker: the store finds the new shards and nodes
/// without a restart; see [`change_under_load`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_shard_is_followed_without_a_restart() {
    let citus = migrated(2).await;
    change_under_load("Z8", &citus, |citus, keys| async move {
        let c = client(&citus.connection_string("postgres")).await;
        let (shard, _, port, node) = placement_of(&c, &keys[0]).await;
        let other = c
            .query_one(
                "SELECT nodeid FROM pg_dist_node WHERE nodeport <> $1 AND groupid <> 0",
                &[&port],
            )
            .await
            .expect("the other worker")
            .get::<_, i32>(0);
        let before = keys_where(&c, &keys, None, Some(shard)).await;
        split_in_two(&c, shard, node, other).await;
        let shards: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_dist_shard \
                 WHERE logicalrelid = 'tokenlease_buckets'::regclass",
                &[],
            )
            .await
            .expect("shards")
            .get(0);
        assert_eq!(shards, 3, "split in two");
        before
    })
    .await;
}

/// Z9: a worker added (`citus_add_node`) and the shards rebalanced onto it
/// (`citus_rebalance_start`, `block_writes`, awaited with `citus_rebalance_wait`) under
/// direct-mode load: the store opens a pool to the new node and sends its keys there without a
/// restart; see [`change_under_load`]. Four shards over two workers (a cluster sized for
/// growth: with `migrate`'s one shard a worker the rebalancer has no shard to move, and a new
/// node takes keys by a split, Z8).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_added_node_gets_its_keys_without_a_restart() {
    let citus = migrated_with_shards(2, 4).await;
    let extra = tokio::task::spawn_blocking({
        let citus = Arc::clone(&citus);
        move || citus.start_node()
    })
    .await
    .expect("start task")
    .expect("a new node");
    let (host, port) = (extra.host().to_string(), i32::from(extra.port()));
    change_under_load("Z9", &citus, move |citus, keys| async move {
        let c = client(&citus.connection_string("postgres")).await;
        c.execute("SELECT citus_add_node($1, $2)", &[&host, &port])
            .await
            .expect("add the node");
        c.execute(
            "SELECT citus_rebalance_start(shard_transfer_mode := 'block_writes')",
            &[],
        )
        .await
        .expect("rebalance");
        c.execute("SELECT citus_rebalance_wait()", &[])
            .await
            .expect("rebalance wait");
        keys_where(&c, &keys, Some(port), None).await
    })
    .await;
    drop(extra);
}

/// Z16: a worker added at `migrate`'s shard count (one a worker, so no whole shard to move) and
/// given keys the way docs/scale-out.md says: `citus_add_node`, then a split of a shard that
/// places its second half on the new node (`citus_split_shard_by_split_points`,
/// `block_writes`), under direct-mode load: the store opens a pool to the new node and sends
/// it its keys without a restart; see [`change_under_load`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_added_node_takes_half_a_shard_without_a_restart() {
    let citus = migrated(2).await;
    let extra = tokio::task::spawn_blocking({
        let citus = Arc::clone(&citus);
        move || citus.start_node()
    })
    .await
    .expect("start task")
    .expect("a new node");
    let (host, port) = (extra.host().to_string(), i32::from(extra.port()));
    change_under_load("Z16", &citus, move |citus, keys| async move {
        let c = client(&citus.connection_string("postgres")).await;
        assert_eq!(shard_count(&c).await, 2, "one shard a worker");
        let added: i32 = c
            .query_one("SELECT citus_add_node($1, $2)", &[&host, &port])
            .await
            .expect("add the node")
            .get(0);
        let (shard, _, _, node) = placement_of(&c, &keys[0]).await;
        split_in_two(&c, shard, node, added).await;
        assert_eq!(shard_count(&c).await, 3, "split in two");
        keys_where(&c, &keys, Some(port), None).await
    })
    .await;
    drop(extra);
}

/// Z11: a fresh store on a healthy cluster (two shards, one a worker) decides from its first call: `build`
/// opened every node's pool, prepared its statements and ran its takes once (plans, the shard
/// guard, Citus's metadata), so 16 tasks starting at once see no fallback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_store_decides_from_its_first_call() {
    let citus = migrated_with_shards(2, 2).await;
    let keys = Arc::new((0..64).map(|i| format!("cold-{i}")).collect::<Vec<_>>());
    // A call timeout a loaded 2-core machine running three servers keeps in the steady state,
    // and far below what a session's first call costs when it logs in, prepares, plans and
    // loads Citus's metadata then (the statements' text alone is some kilobytes to plan).
    let store = PostgresStore::builder(&citus.connection_string("postgres"))
        .expect("connection string")
        .call_timeout(Duration::from_millis(200))
        .pool_wait_timeout(Duration::from_millis(150))
        .statement_timeout(Duration::from_millis(400))
        .lock_timeout(Duration::from_millis(400))
        .build()
        .await
        .expect("store");
    let limiter = Limiter::builder(store).build();
    let plan = Arc::new(
        common::plan(1_000_000, 1_000_000.0)
            .with_fallback(FallbackSettings::new(FallbackMode::Deny)),
    );
    let origin = Instant::now();
    let events = drive(
        std::slice::from_ref(&limiter),
        &plan,
        &keys,
        16,
        origin,
        Duration::from_millis(1500),
    )
    .await
    .expect("run");
    limiter.shutdown().await;
    let not_store: Vec<(u128, DecidedBy)> = events
        .iter()
        .filter(|e| e.by != DecidedBy::Store)
        .map(|e| (e.at.as_millis(), e.by))
        .collect();
    eprintln!(
        "Z11: {} decisions, {} not by the store",
        events.len(),
        not_store.len()
    );
    assert!(events.len() > 100, "{} decisions", events.len());
    assert!(
        not_store.is_empty(),
        "a cold store sent decisions to the fallback (ms, by): {not_store:?}"
    );
}

/// How many shards `tokenlease_buckets` is distributed over, read on the coordinator `c`.
pub(crate) async fn shard_count(c: &tokio_postgres::Client) -> i64 {
    c.query_one(
        "SELECT count(*) FROM pg_dist_shard \
         WHERE logicalrelid = 'tokenlease_buckets'::regclass",
        &[],
    )
    .await
    .expect("shards")
    .get(0)
}
