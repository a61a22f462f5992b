//! Rolling deploys (K6, K7 in docs/testing.md; docs/design/deploys.md).
//!
//! K6: instances of the previous release and of this one decide on one key while this release's
//! `migrate` runs, and after: the previous release's statements (kept as text in
//! `tests/fixtures/previous-release/`, sent as its store sent them: prepared, with the same
//! parameters) never fail, this release's instances, started before the migration, never fall
//! back, and every window of the key's admissions, from all of them, stays within the ideal
//! bucket's envelope.
//!
//! K7: an instance whose database is behind what its statements need says so once in its log
//! and counts every refused call, its calls are decided by the fallback meanwhile, and once the
//! database is migrated the same instance decides through the store again, without a restart.

use crate::common;
use crate::subject::client;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use tokenlease::policy::{FallbackMode, FallbackSettings, LeaseSettings, Plan};
use tokenlease::store::{MIGRATIONS, PostgresStore, migrate};
use tokenlease::{DecidedBy, Limiter};
use tokenlease_testkit::TestDatabase;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, Statement};

/// The previous release's SQL: its statements and its function files.
const PREVIOUS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/previous-release"
);
/// The migrations the previous release shipped (0001 to 0008; released files never change).
const PREVIOUS_MIGRATIONS: usize = 8;
/// Its function files, in the order it applied them.
const PREVIOUS_FUNCTIONS: [&str; 3] = ["bucket", "held_leases", "acquire_held"];

const C: f64 = 100.0;
const R: f64 = 50.0;
const SLACK: f64 = 0.02;
const WINDOWS: [f64; 5] = [0.1, 0.5, 1.0, 2.0, 4.0];
const NANO: i64 = 1_000_000_000;
const KEY: &str = "deploy:hot";
const OTHER: &str = "deploy:other";

fn previous(name: &str) -> String {
    std::fs::read_to_string(format!("{PREVIOUS}/{name}.sql"))
        .unwrap_or_else(|e| panic!("{PREVIOUS}/{name}.sql: {e}"))
}

/// A new, empty database on `db`'s server: its connection string and a client.
async fn empty_database(db: &TestDatabase, suffix: &str) -> (String, Client) {
    let name = format!("{}_{suffix}", db.name());
    db.client()
        .await
        .expect("connect")
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create database");
    let cs = db.connection_string();
    let url = if cs.contains("://") {
        let (base, query) = cs
            .split_once('?')
            .map_or((cs.as_str(), None), |(b, q)| (b, Some(q)));
        let base = &base[..base.rfind('/').expect("a URL path")];
        match query {
            Some(q) => format!("{base}/{name}?{q}"),
            None => format!("{base}/{name}"),
        }
    } else {
        format!("{cs} dbname={name}")
    };
    (url.clone(), client(&url).await)
}

/// The schema as `upto` of the released migrations leave it, recorded as `migrate` records
/// them; with the previous release's function files when `functions` (it applied them after its
/// migrations, recording each file's checksum, as its `migrate` did).
async fn migrate_as_released(client: &mut Client, upto: usize, functions: bool) {
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS tokenlease_migrations (
                 version bigint PRIMARY KEY, description text NOT NULL, checksum text NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .await
        .expect("bookkeeping table");
    for m in &MIGRATIONS[..upto] {
        let tx = client.transaction().await.expect("begin");
        tx.batch_execute(m.sql).await.expect("a released migration");
        tx.execute(
            "INSERT INTO tokenlease_migrations (version, description, checksum) VALUES ($1, $2, $3)",
            &[&m.version, &m.description, &m.checksum()],
        )
        .await
        .expect("record");
        tx.commit().await.expect("commit");
    }
    if functions {
        for name in PREVIOUS_FUNCTIONS {
            let sql = previous(&format!("functions/{name}"));
            client.batch_execute(&sql).await.expect("a function file");
            client
                .execute(
                    "INSERT INTO tokenlease_functions (file, checksum)
                     VALUES ($1, encode(sha256(convert_to($2, 'UTF8')), 'hex'))
                     ON CONFLICT (file) DO UPDATE SET checksum = excluded.checksum",
                    &[&name, &sql],
                )
                .await
                .expect("record a function file");
        }
    }
}

/// An instance of the previous release, as its store talked to the database: its statements,
/// prepared once on its session, parameters in nanotokens.
struct OldInstance {
    client: Client,
    one: Statement,
    many: Statement,
    held: Statement,
    give_back: Statement,
}

/// What an old instance saw: admissions on [`KEY`] (database time, tokens) and failures.
#[derive(Default)]
struct OldRun {
    admitted: Vec<(SystemTime, f64)>,
    failures: Vec<String>,
    statements: u64,
}

impl OldInstance {
    async fn connect(url: &str) -> OldInstance {
        let client = client(url).await;
        let int8 = Type::INT8;
        let int8s = Type::INT8_ARRAY;
        let one = client
            .prepare_typed(
                &previous("acquire_one"),
                &[
                    Type::TEXT,
                    int8.clone(),
                    int8.clone(),
                    int8.clone(),
                    int8.clone(),
                    int8,
                ],
            )
            .await
            .expect("the previous release prepares its one-key take");
        let many_types = [
            Type::TEXT_ARRAY,
            int8s.clone(),
            int8s.clone(),
            int8s.clone(),
            int8s.clone(),
            int8s.clone(),
        ];
        let many = client
            .prepare_typed(&previous("acquire_many"), &many_types)
            .await
            .expect("the previous release prepares its many-key take");
        let mut held_types = many_types.to_vec();
        held_types.extend(std::iter::repeat_n(int8s.clone(), 4));
        let held = client
            .prepare_typed(&previous("acquire_held"), &held_types)
            .await
            .expect("the previous release prepares its take through tokenlease_acquire_held");
        let mut give_back_types = vec![int8s.clone(), Type::TEXT_ARRAY];
        give_back_types.extend(std::iter::repeat_n(int8s, 5));
        let give_back = client
            .prepare_typed(&previous("give_back"), &give_back_types)
            .await
            .expect("the previous release prepares its return");
        OldInstance {
            client,
            one,
            many,
            held,
            give_back,
        }
    }

    /// A plain take of one token of [`KEY`] with the one-key statement.
    async fn take_one(&self, run: &mut OldRun) {
        let (cap, rate, one) = ((C as i64) * NANO, (R as i64) * NANO, NANO);
        run.statements += 1;
        match self
            .client
            .query(&self.one, &[&KEY, &cap, &rate, &one, &one, &one])
            .await
        {
            Ok(rows) => match rows.first() {
                Some(row) => record(run, row.get(3), row.get(5)),
                None => run.failures.push("the one-key take returned no row".into()),
            },
            Err(e) => run.failures.push(format!("one-key take: {e:?}")),
        }
    }

    /// A lease as the previous release took one: up to 4 tokens of [`KEY`] and of [`OTHER`] in
    /// one many-key statement (a key the statement left without a row goes through
    /// `tokenlease_acquire_held`, as the old store sent it), one token of each spent at once,
    /// the rest given back in one return statement with fresh ids.
    async fn lease(&self, run: &mut OldRun, ids: &AtomicI64) {
        let keys = vec![KEY.to_owned(), OTHER.to_owned()];
        let (caps, rates) = (vec![(C as i64) * NANO; 2], vec![(R as i64) * NANO; 2]);
        let (mins, wants, steps) = (vec![NANO; 2], vec![4 * NANO; 2], vec![1i64; 2]);
        run.statements += 1;
        let rows = match self
            .client
            .query(&self.many, &[&keys, &caps, &rates, &mins, &wants, &steps])
            .await
        {
            Ok(rows) => rows,
            Err(e) => return run.failures.push(format!("many-key take: {e:?}")),
        };
        let mut grants: Vec<(String, i64, i64)> = rows
            .iter()
            .map(|row| (row.get(0), row.get(3), row.get(5)))
            .collect();
        let missing: Vec<String> = keys
            .iter()
            .filter(|k| !grants.iter().any(|(g, _, _)| g == *k))
            .cloned()
            .collect();
        if !missing.is_empty() {
            let n = missing.len();
            let none: Vec<Option<i64>> = vec![None; n];
            run.statements += 1;
            match self
                .client
                .query(
                    &self.held,
                    &[
                        &missing,
                        &caps[..n].to_vec(),
                        &rates[..n].to_vec(),
                        &mins[..n].to_vec(),
                        &wants[..n].to_vec(),
                        &steps[..n].to_vec(),
                        &none,
                        &none,
                        &none,
                        &none,
                    ],
                )
                .await
            {
                Ok(rows) => grants.extend(rows.iter().map(|r| (r.get(0), r.get(3), r.get(5)))),
                Err(e) => return run.failures.push(format!("held take: {e:?}")),
            }
        }
        let mut returns = (Vec::new(), Vec::new(), Vec::new());
        for (key, granted, now_us) in grants {
            if granted >= NANO {
                if key == KEY {
                    record(run, NANO, now_us);
                }
                if granted > NANO {
                    returns.0.push(ids.fetch_add(1, Ordering::Relaxed));
                    returns.1.push(key);
                    returns.2.push(granted - NANO);
                }
            }
        }
        if returns.0.is_empty() {
            return;
        }
        let n = returns.0.len();
        let none: Vec<Option<i64>> = vec![None; n];
        run.statements += 1;
        if let Err(e) = self
            .client
            .query(
                &self.give_back,
                &[
                    &returns.0,
                    &returns.1,
                    &returns.2,
                    &caps[..n].to_vec(),
                    &rates[..n].to_vec(),
                    &none,
                    &none,
                ],
            )
            .await
        {
            run.failures.push(format!("return: {e:?}"));
        }
    }
}

/// Files a grant of `granted` nanotokens at database time `now_us` as admissions of one token.
fn record(run: &mut OldRun, granted: i64, now_us: i64) {
    if granted >= NANO {
        let at = SystemTime::UNIX_EPOCH + Duration::from_micros(now_us as u64);
        run.admitted.push((at, 1.0));
    }
}

/// The largest excess of any window over `C + R·(w + SLACK)`, and the window's admissions.
fn assert_envelope(admissions: &mut [(SystemTime, f64)], extra: f64) {
    admissions.sort_by_key(|a| a.0);
    let t0 = admissions[0].0;
    let points: Vec<(f64, f64)> = admissions
        .iter()
        .map(|&(t, cost)| (common::secs_between(t0, t), cost))
        .collect();
    for w in WINDOWS {
        let (excess, count) = common::worst_window(&points, w, C, R, SLACK);
        assert!(
            excess <= extra + 1e-6,
            "window {w} s admitted {count}, more than {C} + {R}·({w} + {SLACK}) + {extra}"
        );
    }
}

/// A store of this release on `url`, not migrating (the deploy's own step does), with
/// generous timeouts: this test is about the schema, not about failure behaviour (on a busy
/// machine a statement on the one hot key can wait for its row lock, or run, past the default
/// 100 ms, migration or not).
async fn this_release(url: &str, fallback: FallbackMode) -> (PostgresStore, Arc<Plan>) {
    let store = PostgresStore::builder(url)
        .expect("connection string")
        .pool_size(2)
        .migrate(false)
        .statement_timeout(Duration::from_secs(5))
        .lock_timeout(Duration::from_secs(5))
        .call_timeout(Duration::from_secs(5))
        .pool_wait_timeout(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(5))
        .build()
        .await
        .expect("this release's store builds on the previous release's schema");
    let plan = common::plan(C as u64, R).with_fallback(FallbackSettings::new(fallback));
    (store, Arc::new(plan))
}

/// A limiter of this release for probing a migration's table locks: the default `lock_timeout`
/// (100 ms), a generous statement timeout, one connection, and a plan that denies when the
/// store fails; with the plan.
async fn probe_limiter(url: &str) -> (Limiter, Plan) {
    let store = PostgresStore::builder(url)
        .expect("connection string")
        .pool_size(1)
        .migrate(false)
        .statement_timeout(Duration::from_secs(5))
        .call_timeout(Duration::from_secs(5))
        .pool_wait_timeout(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(5))
        .build()
        .await
        .expect("the probe's store");
    let plan = common::plan(C as u64, R).with_fallback(FallbackSettings::new(FallbackMode::Deny));
    (Limiter::builder(store).build(), plan)
}

/// Takes a hundredth of a token from `key` every 2 ms until `run_for` after `start`: how many
/// takes, and when each one the fallback decided was made (a lock past its `lock_timeout`).
fn probe_takes(
    (limiter, plan): (Limiter, Plan),
    key: &'static str,
    start: Instant,
    run_for: Duration,
) -> tokio::task::JoinHandle<(u64, Vec<Duration>)> {
    tokio::spawn(async move {
        let (mut calls, mut fallback) = (0, Vec::new());
        while start.elapsed() < run_for {
            let d = limiter
                .try_acquire_with(&plan, key, 0.01)
                .await
                .expect("a valid call");
            calls += 1;
            if let DecidedBy::Fallback(_) = d.decided_by {
                fallback.push(start.elapsed());
            }
            // sleep: pacing, a take every 2 ms.
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        (calls, fallback)
    })
}

/// K6: the previous release's statements and this release's instances (one direct, one
/// leased), on one key for 4 s, across this release's `migrate` at 1.5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k6_the_previous_release_and_this_one_keep_the_envelope_across_migrate() {
    let _serial = common::serial().await;
    let db = common::database().await;
    let (url, mut admin) = empty_database(&db, "deploy").await;
    migrate_as_released(&mut admin, PREVIOUS_MIGRATIONS, true).await;

    let run_for = Duration::from_secs(4);
    let start = Instant::now();
    let ids = Arc::new(AtomicI64::new(
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .expect("after 1970")
            .as_nanos() as i64,
    ));

    // The previous release: one instance, a task of one-key takes and a task of leases.
    let mut old_tasks = Vec::new();
    for leases in [false, true] {
        let (url, ids) = (url.clone(), Arc::clone(&ids));
        old_tasks.push(tokio::spawn(async move {
            let old = OldInstance::connect(&url).await;
            let mut run = OldRun::default();
            while start.elapsed() < run_for {
                if leases {
                    old.lease(&mut run, &ids).await;
                } else {
                    old.take_one(&mut run).await;
                }
                // sleep: pacing. A real caller does some work between requests.
                tokio::time::sleep(Duration::from_micros(500)).await;
            }
            run
        }));
    }

    // This release: a direct instance and a leased one, each with its own pool, built on the
    // previous release's schema before anything migrated it.
    let leased_b = C * 0.1;
    let mut new_tasks = Vec::new();
    for leased in [false, true] {
        let (store, plan) = this_release(&url, FallbackMode::Deny).await;
        let plan = if leased {
            Arc::new((*plan).clone().with_lease(LeaseSettings::default()))
        } else {
            plan
        };
        let limiter = Limiter::builder(store).build();
        for _ in 0..4 {
            let (limiter, plan) = (limiter.clone(), Arc::clone(&plan));
            new_tasks.push(tokio::spawn(async move {
                let (mut admitted, mut fallback) = (Vec::new(), Vec::new());
                while start.elapsed() < run_for {
                    let d = limiter
                        .try_acquire_with(&plan, KEY, 1.0)
                        .await
                        .expect("a valid call");
                    if let DecidedBy::Fallback(_) = d.decided_by {
                        fallback.push(format!("{d:?}"));
                    } else if d.allowed {
                        admitted.push((d.store_time.unwrap_or_else(SystemTime::now), 1.0));
                    }
                    // sleep: pacing. A real caller does some work between requests.
                    tokio::time::sleep(Duration::from_micros(500)).await;
                }
                (admitted, fallback)
            }));
        }
    }

    // A probe of the migration's table locks: this release's default `lock_timeout` (100 ms)
    // on a key of its own, so that only a lock on the table, not a row lock, can hold it up.
    let probe = probe_takes(probe_limiter(&url).await, "deploy:probe", start, run_for);

    // The deploy's migrate step, while every instance is deciding.
    // sleep: the migration starts 1.5 s into the run, with both releases deciding.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let report = migrate(&mut admin).await.expect("this release's migrate");
    assert_eq!(
        report.applied.iter().map(|m| m.version).collect::<Vec<_>>(),
        (PREVIOUS_MIGRATIONS as i64 + 1..=MIGRATIONS.len() as i64).collect::<Vec<_>>(),
        "{report}"
    );
    assert!(
        start.elapsed() < run_for,
        "the run ended before the migration did"
    );

    let (probes, probe_fallback) = probe.await.expect("the probe");
    assert!(probes > 100, "{probes} probes");
    assert!(
        probe_fallback.is_empty(),
        "a take on a quiet key waited past its 100 ms lock_timeout (or failed) {} times, at {:?}",
        probe_fallback.len(),
        probe_fallback
    );

    let mut admissions = Vec::new();
    let mut old_statements = 0;
    for task in old_tasks {
        let run = task.await.expect("old instance");
        for failure in &run.failures {
            eprintln!("the previous release's instance failed: {failure}");
        }
        assert!(
            run.failures.is_empty(),
            "the previous release's statements failed {} times in {}: first {:?}",
            run.failures.len(),
            run.statements,
            run.failures.first()
        );
        old_statements += run.statements;
        admissions.extend(run.admitted);
    }
    assert!(old_statements > 100, "{old_statements} old statements");
    let old_admitted = admissions.len();
    for task in new_tasks {
        let (admitted, fallback) = task.await.expect("new instance");
        assert!(
            fallback.is_empty(),
            "this release fell back {} times: first {:?}",
            fallback.len(),
            fallback.first()
        );
        admissions.extend(admitted);
    }
    assert!(old_admitted > 0, "the previous release admitted nothing");
    assert!(
        admissions.len() > old_admitted,
        "this release admitted nothing"
    );
    // One instance holds leases: its lease, at most B, on top of one token for the windows'
    // edges (as C1 in direct mode).
    assert_envelope(&mut admissions, leased_b + 1.0);
    let ideal = C + R * run_for.as_secs_f64();
    assert!(
        admissions.len() as f64 >= 0.7 * ideal,
        "admitted {} of an ideal {ideal}",
        admissions.len()
    );
}

/// K11: a migration waiting for a table lock does not hold up the takes behind it. A session
/// reads the buckets table in a transaction it keeps open for 600 ms (a report, a backup);
/// `migrate` of this release's pending migrations (one of them an `ALTER TABLE` of that table)
/// starts meanwhile, beside a take on a key every 2 ms with the default 100 ms `lock_timeout`.
/// The migration gives up its lock request every 20 ms and tries again, so no take waits past
/// its `lock_timeout`, and it is applied once the reader has gone. A lock request left waiting
/// for the reader would queue every take behind it for the 600 ms (fails so without the
/// short lock wait and its retries).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k11_a_migration_waiting_for_a_lock_holds_no_take_up() {
    let _serial = common::serial().await;
    let db = common::database().await;
    let (url, mut admin) = empty_database(&db, "lockwait").await;
    migrate_as_released(&mut admin, PREVIOUS_MIGRATIONS, true).await;
    let (limiter, plan) = probe_limiter(&url).await;
    let first = limiter
        .try_acquire_with(&plan, "deploy:quiet", 0.01)
        .await
        .expect("a valid call");
    assert!(first.allowed, "{first:?}");

    // The reader: a transaction holding ACCESS SHARE on the table for 600 ms.
    let mut reader = client(&url).await;
    let (held, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let reading = {
        let (held, release) = (Arc::clone(&held), Arc::clone(&release));
        tokio::spawn(async move {
            let tx = reader.transaction().await.expect("begin");
            tx.query("SELECT count(*) FROM tokenlease_buckets", &[])
                .await
                .expect("read");
            held.notify_one();
            release.notified().await;
            tx.commit().await.expect("commit");
        })
    };
    held.notified().await;

    let start = Instant::now();
    let run_for = Duration::from_millis(1500);
    let takes = probe_takes((limiter, plan), "deploy:quiet", start, run_for);
    let migrating = tokio::spawn(async move { migrate(&mut admin).await });
    // sleep: the reader keeps its transaction open 600 ms, the migration waiting meanwhile.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(
        !migrating.is_finished(),
        "migrated while the reader held the table"
    );
    release.notify_one();
    reading.await.expect("the reader");
    let report = migrating
        .await
        .expect("the migrating task")
        .expect("this release's migrate, once the reader has gone");
    assert_eq!(
        report.applied.iter().map(|m| m.version).collect::<Vec<_>>(),
        (PREVIOUS_MIGRATIONS as i64 + 1..=MIGRATIONS.len() as i64).collect::<Vec<_>>(),
        "{report}"
    );
    let (calls, fallback) = takes.await.expect("the takes");
    assert!(calls > 100, "{calls} takes");
    assert!(
        fallback.is_empty(),
        "a take waited past its lock_timeout behind the migration {} times, at {:?}",
        fallback.len(),
        fallback
    );
}

/// Log events the store says, by level, caught by a subscriber of this test's thread.
#[derive(Default, Clone)]
struct Said(Arc<parking_lot::Mutex<Vec<(tracing::Level, String)>>>);

impl Said {
    fn at(&self, level: tracing::Level) -> Vec<String> {
        self.0
            .lock()
            .iter()
            .filter(|(l, _)| *l == level)
            .map(|(_, m)| m.clone())
            .collect()
    }
}

impl tracing::Subscriber for Said {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let mut message = Message(String::new());
        event.record(&mut message);
        self.0.lock().push((*event.metadata().level(), message.0));
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// The schema-error counter's total so far, from the test binary's recorder.
fn schema_errors(seen: &mut u64) -> u64 {
    for (key, _, _, value) in common::metrics().snapshot().into_vec() {
        if key.key().name() == tokenlease::metrics::STORE_SCHEMA_ERRORS
            && let metrics_util::debugging::DebugValue::Counter(n) = value
        {
            *seen += n;
        }
    }
    *seen
}

/// K7: this release on a database the previous migrations left at 0006 (before the schema its
/// statements read), built without migrating: one log event at `ERROR` (when built), every call
/// decided by the `deny` fallback and counted; after `migrate`, the same limiter decides
/// through the store again, and says so once at `INFO`.
#[tokio::test]
async fn k7_a_schema_behind_the_statements_is_said_once_counted_and_outlived() {
    let _serial = common::serial().await;
    let said = Said::default();
    let _subscriber = tracing::subscriber::set_default(said.clone());
    let mut counted = 0;
    schema_errors(&mut counted);

    let db = common::database().await;
    let (url, mut admin) = empty_database(&db, "behind").await;
    migrate_as_released(&mut admin, 6, false).await;
    let (store, plan) = this_release(&url, FallbackMode::Deny).await;
    let errors = said.at(tracing::Level::ERROR);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains("migrated to version 6") && errors[0].contains("0007"),
        "{}",
        errors[0]
    );

    let limiter = Limiter::builder(store).build();
    for _ in 0..5 {
        let d = limiter
            .try_acquire_with(&plan, KEY, 1.0)
            .await
            .expect("a valid call");
        assert_eq!(d.decided_by, DecidedBy::Fallback(FallbackMode::Deny));
        assert!(!d.allowed);
    }
    assert!(
        schema_errors(&mut counted) >= 1,
        "no refused call was counted"
    );
    assert_eq!(
        said.at(tracing::Level::ERROR).len(),
        1,
        "said more than once"
    );

    let report = migrate(&mut admin).await.expect("migrate");
    assert!(!report.applied.is_empty(), "{report}");
    let decided = common::poll_until(
        Duration::from_millis(50),
        Duration::from_secs(20),
        async || {
            let d = limiter
                .try_acquire_with(&plan, KEY, 1.0)
                .await
                .expect("a valid call");
            if d.decided_by == DecidedBy::Store {
                Ok(d)
            } else {
                Err(d)
            }
        },
    )
    .await
    .expect("the store decides again once the database is migrated");
    assert!(decided.allowed);
    let infos = said.at(tracing::Level::INFO);
    assert_eq!(infos.len(), 1, "{infos:?}");
    assert!(infos[0].contains("fits this build again"), "{}", infos[0]);
    assert_eq!(said.at(tracing::Level::ERROR).len(), 1);
}
