//! F1: the two roles of docs/roles.md on a real PostgreSQL. An owner role (not a superuser)
//! migrates; the service runs under a role with exactly the grants the page gives (its SQL
//! blocks, run as written), with `PUBLIC`'s default right to execute functions revoked so that
//! the page's grants are all it has. Direct and leased takes, strict leases and returns, the
//! idle-row cleanup and `inspect` work; `migrate` under the service role fails with
//! `MigrateError::Privilege`, naming what it lacks and the option to skip migrating.

use std::time::Duration;

use tokenlease::bucket::Tokens;
use tokenlease::policy::{Accounting, LeaseSettings, Plan};
use tokenlease::store::{
    AcquireRequest, GiveBack, Hold, LeaseRef, MigrateError, PostgresStore, Store as _, StoreError,
};
use tokenlease::{DecidedBy, Limiter};
use tokenlease_testkit::TempPostgres;

use crate::common;
use crate::subject::client;

/// The page whose SQL this test runs.
const ROLES_MD: &str = include_str!("../../docs/roles.md");

/// The page's ```sql blocks, in order.
fn sql_blocks() -> Vec<&'static str> {
    ROLES_MD
        .split("```sql\n")
        .skip(1)
        .map(|rest| rest.split("```").next().expect("a closed block"))
        .collect()
}

/// `server`'s database `app` as `role` (the throwaway cluster trusts loopback logins).
fn as_role(server: &TempPostgres, role: &str) -> String {
    server
        .connection_string("app")
        .replace("user=postgres", &format!("user={role}"))
}

#[tokio::test]
async fn f1_owner_migrates_and_the_service_runs_with_the_documented_grants() {
    let server = tokio::task::spawn_blocking(TempPostgres::start)
        .await
        .expect("join")
        .expect("a throwaway PostgreSQL");
    let blocks = sql_blocks();
    assert_eq!(blocks.len(), 3, "docs/roles.md's SQL blocks: {blocks:?}");

    // 1. As the superuser: the roles and the database, one statement at a time (CREATE
    // DATABASE runs alone).
    let admin = client(&server.connection_string("postgres")).await;
    for statement in blocks[0].split(";\n").filter(|s| !s.trim().is_empty()) {
        admin.batch_execute(statement).await.expect(statement);
    }

    // 2. The owner migrates (a plain role, not a superuser).
    let owner_url = as_role(&server, "tokenlease_owner");
    let mut owner = client(&owner_url).await;
    let report = tokenlease::store::migrate(&mut owner)
        .await
        .expect("the owner migrates");
    assert!(!report.applied.is_empty(), "{report}");
    // Nothing beyond the page's grants: no executing functions by default either.
    owner
        .batch_execute("REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA public FROM PUBLIC")
        .await
        .expect("revoke PUBLIC's EXECUTE");

    // 3. The service's grants, as the page writes them.
    owner.batch_execute(blocks[1]).await.expect("table grants");
    owner
        .batch_execute(blocks[2])
        .await
        .expect("function grants");

    // The service role: no migration, every call decided by the store.
    let app_url = as_role(&server, "tokenlease_app");
    let store = PostgresStore::builder(&app_url)
        .expect("connection string")
        .migrate(false)
        .call_timeout(Duration::from_secs(5))
        .pool_wait_timeout(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(5))
        .statement_timeout(Duration::from_secs(5))
        .lock_timeout(Duration::from_secs(5))
        .build()
        .await
        .expect("the service's store, not migrating");

    // Direct and leased takes through a limiter, and the leases' return at shutdown.
    let direct = Plan::new("direct", common::bucket(10, 1.0));
    let leased = Plan::new("leased", common::bucket(1000, 100.0))
        .with_lease(LeaseSettings::default().with_max_wait(Duration::from_secs(5)));
    let strict = Plan::new("strict", common::bucket(1000, 100.0)).with_lease(
        LeaseSettings::default()
            .with_max_wait(Duration::from_secs(5))
            .with_accounting(Accounting::Strict),
    );
    let limiter = Limiter::builder(store.clone()).build();
    for (plan, key) in [
        (&direct, "f1:direct"),
        (&leased, "f1:leased"),
        (&strict, "f1:strict"),
    ] {
        for _ in 0..3 {
            let d = limiter
                .try_acquire_with(plan, key, 1.0)
                .await
                .expect("a decision");
            assert!(
                d.allowed && !matches!(d.decided_by, DecidedBy::Fallback(_)),
                "{key}: {d:?}"
            );
        }
    }
    let stats = limiter.lease_stats().expect("lease stats");
    limiter.shutdown().await;
    assert_eq!(stats.failed_refills, 0, "{stats:?}");

    // The store's own calls: a strict lease, its settling return, a plain return, `inspect`.
    let shape = common::bucket(10, 1.0);
    let hold = Hold {
        holder: 11,
        lease_id: 1,
        kept: Tokens::ZERO,
        lifetime: Duration::from_secs(30),
    };
    let granted = store
        .acquire(
            AcquireRequest::lease("f1:held", shape, Tokens::whole(1), Tokens::whole(2)).held(hold),
        )
        .await
        .expect("a strict lease")
        .granted;
    assert!(!granted.is_zero());
    let row = store
        .inspect("f1:held")
        .await
        .expect("inspect")
        .expect("a row");
    assert_eq!(row.leases.len(), 1, "{row:?}");
    let returns = [
        GiveBack {
            id: 1,
            key: "f1:held",
            amount: granted,
            bucket: shape,
            lease: Some(LeaseRef {
                holder: 11,
                lease_id: 1,
            }),
        },
        GiveBack {
            id: 2,
            key: "f1:direct",
            amount: Tokens::whole(1),
            bucket: shape,
            lease: None,
        },
    ];
    assert_eq!(store.give_back(&returns).await.expect("returns"), 2);
    // A retried return credits nothing: its id is recorded.
    assert_eq!(store.give_back(&returns[1..]).await.expect("a retry"), 0);

    // Idle cleanup: a bucket that refills at once is full, so deleted.
    let fast = common::bucket(1, 1_000_000.0);
    store
        .acquire(AcquireRequest::take("f1:idle", fast, Tokens::whole(1)))
        .await
        .expect("a take");
    let mut deleted = 0;
    for _ in 0..10 {
        deleted += store.delete_idle(1000).await.expect("idle cleanup");
        if store.inspect("f1:idle").await.expect("inspect").is_none() {
            break;
        }
    }
    assert!(deleted >= 1, "deleted {deleted}");

    // What the service role cannot do: change the schema.
    let app = client(&app_url).await;
    let drop = app.batch_execute("DROP TABLE tokenlease_buckets").await;
    assert!(drop.is_err(), "the service role dropped a table");

    // Nor migrate: a typed error naming the role, what it lacks and the way out.
    let mut app = app;
    let err = tokenlease::store::migrate(&mut app)
        .await
        .expect_err("the service role cannot migrate");
    let text = err.to_string();
    let MigrateError::Privilege { role, missing, .. } = &err else {
        panic!("not a privilege error: {err:?}");
    };
    assert_eq!(role, "tokenlease_app");
    assert_eq!(missing, "CREATE on schema \"public\"", "{text}");
    assert!(
        text.contains("PostgresStoreBuilder::migrate(false)"),
        "{text}"
    );
    assert!(text.contains("42501"), "{text}");
    // A store built with migration on (the default) says the same.
    let built = PostgresStore::builder(&app_url)
        .expect("connection string")
        .connect_timeout(Duration::from_secs(5))
        .build()
        .await;
    match built {
        Err(StoreError::Migrate(e)) => {
            assert!(matches!(*e, MigrateError::Privilege { .. }), "{e:?}");
        }
        other => panic!("expected a migrate error, got {other:?}"),
    }
}
