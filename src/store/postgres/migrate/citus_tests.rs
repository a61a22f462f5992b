//! Tests of the Citus step of [`migrate`] on a real cluster: the node functions by generation
//! on every node (Z14), and the plan of the shard return (Z15). Here rather than in
//! `citus/tests.rs` because they run the whole migration, which calls the Citus step.

use super::super::citus::tests::{cluster, cluster_with_shards};
use super::super::citus::{
    GIVE_BACK_SHARD, NODE_FUNCTIONS_GENERATION, bodies, distribute_with, node_functions,
};
use super::super::functions::{FunctionFile, check_pinned};
use super::{LOCK, migrate};

/// The Citus node functions' SQL is pinned by generation with the files of `functions/`
/// (`functions.rs`'s `RELEASED`): their text is built from the plain statements, so a change
/// there that reaches them needs a new generation.
#[test]
fn the_node_functions_are_pinned() {
    check_pinned(&[node_functions()]);
}

/// The body of `name` (`pg_proc.prosrc`) on every worker of `citus`.
async fn bodies_on_workers(citus: &tokenlease_testkit::TempCitus, name: &str) -> Vec<String> {
    let mut out = Vec::new();
    for worker in citus.workers() {
        let (c, connection) =
            tokio_postgres::connect(&worker.connection_string("postgres"), tokio_postgres::NoTls)
                .await
                .expect("connect");
        tokio::spawn(connection);
        let body: String = c
            .query_one("SELECT prosrc FROM pg_proc WHERE proname = $1", &[&name])
            .await
            .expect("the function on a worker")
            .get(0);
        out.push(body);
    }
    out
}

/// The node functions as another build's: `file`'s SQL with a line added to the guard's body,
/// at `generation`.
fn another_build(generation: i32, line: &str) -> FunctionFile {
    let current = node_functions();
    let sql = current.sql.replacen(
        "DECLARE\n    placed bigint;",
        &format!("DECLARE\n    placed bigint;\n    {line}"),
        1,
    );
    assert_ne!(sql, current.sql, "the guard's body changed");
    FunctionFile {
        sql: Box::leak(sql.into_boxed_str()),
        generation,
        ..current
    }
}

/// Z14: the node functions are applied by generation and checksum, checked on every node. A
/// newer build's definitions (a higher generation) stay on every node when this build migrates
/// after it, and an older build's `migrate` (a lower generation, another body) leaves this
/// build's; a guard edited by hand on one worker, at this build's generation, is restored by the
/// next `migrate`, which then changes nothing more. The guard's body is read on each worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_functions_follow_their_generation_on_every_node() {
    let (citus, mut c) = cluster().await;
    let lock = LOCK;
    let ours = bodies(node_functions().sql);
    let guard = |bodies: &[(String, String)]| -> String {
        bodies
            .iter()
            .find(|(name, _)| name == "tokenlease_citus_hold")
            .expect("the guard")
            .1
            .clone()
    };
    let report = migrate(&mut c).await.expect("migrate");
    assert!(report.functions_applied.contains(&"citus"), "{report}");
    assert_eq!(
        bodies_on_workers(&citus, "tokenlease_citus_hold").await,
        [guard(&ours), guard(&ours)]
    );
    let again = migrate(&mut c).await.expect("migrate");
    assert!(again.is_noop(), "a second migrate changes nothing: {again}");

    // An older build (generation 0, another guard) migrates: this build's guard stays.
    let older = another_build(NODE_FUNCTIONS_GENERATION - 1, "-- an older build");
    let done = distribute_with(&mut c, lock, &older)
        .await
        .expect("an older build's migrate")
        .expect("Citus");
    assert!(done.applied.is_empty(), "{done:?}");
    assert_eq!(done.newer, ["citus"]);
    assert_eq!(
        bodies_on_workers(&citus, "tokenlease_citus_hold").await,
        [guard(&ours), guard(&ours)],
        "the older build's guard reached a node"
    );

    // A hand edit on one worker, at this build's generation: restored by the next migrate.
    let edited = another_build(NODE_FUNCTIONS_GENERATION, "-- edited by hand");
    let edited_guard = guard(&bodies(edited.sql));
    let at = edited
        .sql
        .find("CREATE OR REPLACE FUNCTION tokenlease_citus_hold")
        .expect("the guard's CREATE");
    let create = &edited.sql[at..];
    let open = create.find("$fn$").expect("its body") + 4;
    let close = open + create[open..].find("$fn$").expect("its end") + 4;
    let hold_sql = &create[..close];
    let worker = &citus.workers()[0];
    let (w, connection) =
        tokio_postgres::connect(&worker.connection_string("postgres"), tokio_postgres::NoTls)
            .await
            .expect("connect");
    tokio::spawn(connection);
    w.batch_execute(&format!(
        "SET citus.enable_ddl_propagation TO off; {hold_sql}"
    ))
    .await
    .expect("edit the guard on one worker");
    assert_eq!(
        bodies_on_workers(&citus, "tokenlease_citus_hold").await,
        [edited_guard.clone(), guard(&ours)]
    );
    let restored = migrate(&mut c).await.expect("migrate");
    assert_eq!(restored.functions_applied, ["citus"], "{restored}");
    assert_eq!(
        bodies_on_workers(&citus, "tokenlease_citus_hold").await,
        [guard(&ours), guard(&ours)]
    );
    assert!(migrate(&mut c).await.expect("migrate").is_noop());

    // A newer build (the next generation) migrates, then this one: the newer guard stays on
    // every node, and this build's report says so.
    let newer = another_build(NODE_FUNCTIONS_GENERATION + 1, "-- a newer build");
    let newer_guard = guard(&bodies(newer.sql));
    let done = distribute_with(&mut c, lock, &newer)
        .await
        .expect("a newer build's migrate")
        .expect("Citus");
    assert_eq!(done.applied, ["citus"]);
    let report = migrate(&mut c).await.expect("migrate");
    assert!(report.functions_applied.is_empty(), "{report}");
    assert_eq!(report.functions_newer, ["citus"]);
    assert_eq!(
        bodies_on_workers(&citus, "tokenlease_citus_hold").await,
        [newer_guard.clone(), newer_guard]
    );
}

/// Z15: the shard return reads each input once, whatever the number of keys. On a worker
/// whose shards hold 6,000 rows each, `EXPLAIN (ANALYZE)` of the statement
/// `tokenlease_citus_give_back` runs on one shard (with its `enable_seqscan = off`), for a call
/// of 1,500 keys of the worker's two shards: no node filters rows by testing them against an
/// array (`= ANY`, once per row: quadratic in the keys), every scan of a CTE or an unnested
/// array runs once (not once per row of another input), and the shard's rows are reached by
/// its index, never scanned whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shard_return_reads_each_input_once() {
    // Two shards a worker (`migrate` would choose one): a call over both of them.
    let (citus, mut c) = cluster_with_shards(4).await;
    migrate(&mut c).await.expect("migrate");
    c.batch_execute(
        "INSERT INTO tokenlease_buckets \
             (key, tokens, frac, capacity, refill_per_second, updated_us, refilled) \
         SELECT 'z15-' || i, 0, 0, 100000000000, 1000, 0, 0 FROM generate_series(1, 24000) AS i; \
         ANALYZE tokenlease_buckets",
    )
    .await
    .expect("rows on every shard");
    // The first worker's keys, and one of its shards.
    let port = i32::from(citus.workers()[0].port());
    let rows = c
        .query(
            "SELECT u.k, s.shardid, shard_name('tokenlease_buckets'::regclass, s.shardid), \
                    shard_name('tokenlease_returns'::regclass, \
                               get_shard_id_for_distribution_column('tokenlease_returns', u.k)) \
             FROM unnest(ARRAY(SELECT 'z15-' || i FROM generate_series(1, 24000) AS i)) \
                  WITH ORDINALITY AS u(k, n) \
             JOIN pg_dist_shard AS s \
               ON s.shardid = get_shard_id_for_distribution_column('tokenlease_buckets', u.k) \
             JOIN pg_dist_placement AS p ON p.shardid = s.shardid \
             JOIN pg_dist_node AS d ON d.groupid = p.groupid \
             WHERE d.nodeport = $1 ORDER BY u.n LIMIT 1500",
            &[&port],
        )
        .await
        .expect("the worker's keys");
    assert_eq!(rows.len(), 1500);
    let keys: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    let shard: i64 = rows[0].get(1);
    let (buckets, returns): (String, String) = (rows[0].get(2), rows[0].get(3));
    let members: Vec<i32> = (1..)
        .zip(&rows)
        .filter(|(_, r)| r.get::<_, i64>(1) == shard)
        .map(|(n, _)| n)
        .collect();
    assert!(
        members.len() > 300 && members.len() < 1500,
        "{}",
        members.len()
    );
    let n = keys.len();
    let ids: Vec<i64> = (0..n as i64).collect();
    let amounts = vec![1_000_000_000i64; n];
    let capacities = vec![100_000_000_000i64; n];
    let rates = vec![1_000i64; n];
    let none: Vec<Option<i64>> = vec![None; n];
    let statement = GIVE_BACK_SHARD
        .replace("%1$s", &buckets)
        .replace("%2$s", &returns)
        .replace("%%", "%");
    let (w, connection) = tokio_postgres::connect(
        &citus.workers()[0].connection_string("postgres"),
        tokio_postgres::NoTls,
    )
    .await
    .expect("connect to the worker");
    tokio::spawn(connection);
    w.batch_execute("SET enable_seqscan = off")
        .await
        .expect("as the function runs it");
    let explained = w
        .query(
            &format!("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) {statement}"),
            &[
                &ids,
                &keys,
                &amounts,
                &capacities,
                &rates,
                &none,
                &none,
                &members,
            ],
        )
        .await
        .expect("explain the shard return");
    let plan: Vec<String> = explained.iter().map(|r| r.get(0)).collect();
    let text = plan.join("\n");
    assert!(
        plan[0].starts_with("Update on")
            && plan[0].contains(&format!("actual rows={} loops=1", members.len())),
        "every member credited:\n{text}"
    );
    for line in &plan {
        assert!(
            !(line.contains("Filter:") && line.contains("ANY")),
            "rows tested against an array:\n{text}"
        );
        if line.contains("CTE Scan") || line.contains("Function Scan") {
            assert!(line.contains(" loops=1)"), "read again: {line}\n{text}");
        }
        assert!(
            !line.contains(&format!("Seq Scan on {buckets}")),
            "the shard read whole:\n{text}"
        );
    }
}
