//! Tests of the assembled crate that need its internals: a limiter over a `PostgresStore`
//! whose pool the test reads. They sit at the crate's root, above both the store and the
//! limiter, so that no module below depends on another through its tests (L1). Against a real
//! throwaway PostgreSQL (`tokenlease_testkit`, which links its own copy of this crate: only
//! connection strings cross over).

use std::time::Duration;

use crate::bucket::{BucketConfig, Rate, Tokens};
use crate::policy::Plan;
use crate::store::PostgresStore;
use crate::{DecidedBy, Limiter};

/// A plan of `capacity` whole tokens refilling at `per_second` tokens a second.
fn plan(capacity: u64, per_second: f64) -> Plan {
    let bucket = BucketConfig::new(
        Tokens::whole(capacity),
        Rate::from_f64(per_second).expect("rate"),
    )
    .expect("bucket");
    Plan::new("assembled", bucket)
}

/// B11, the cold start: a store built with the defaults against a server that asks for a
/// password (SCRAM, whose key derivation is slow in a debug build) has opened every connection
/// of its pool, each with the statements of every decision prepared, before `build` returns; so
/// a fresh limiter's first calls (direct, and leased) are decided by the store or a lease, not
/// by a fallback while a connection is opened and a login computed inside the call.
///
/// Before the store warmed its pool, `build` opened one connection for the migrations and
/// closed it: the pool was empty, and the README's snippet in a debug build decided its first
/// call by the fallback in 3 runs of 3. A cluster of its own: its `pg_hba.conf` is rewritten.
#[tokio::test]
async fn a_built_store_has_its_pool_open_and_prepared_with_scram() {
    use crate::policy::LeaseSettings;
    use tokenlease_testkit::TempPostgres;
    let pg = tokio::task::spawn_blocking(TempPostgres::start)
        .await
        .expect("join")
        .expect("a throwaway cluster");
    let admin = pg.connection_string("postgres");
    let (client, connection) = tokio_postgres::connect(&admin, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(connection);
    client
        .batch_execute(
            "SET password_encryption = 'scram-sha-256';
             CREATE ROLE app LOGIN PASSWORD 's3cret-pw';
             GRANT ALL ON SCHEMA public TO app;",
        )
        .await
        .expect("a role with a password");
    // The role logs in with SCRAM over TCP; everything else stays as the cluster has it.
    let hba = pg.data_dir().join("pg_hba.conf");
    let rules = std::fs::read_to_string(&hba).expect("pg_hba.conf");
    std::fs::write(
        &hba,
        format!(
            "host all app 127.0.0.1/32 scram-sha-256\nhost all app ::1/128 scram-sha-256\n{rules}"
        ),
    )
    .expect("write pg_hba.conf");
    client
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .expect("reload");
    let url = format!(
        "postgres://app:s3cret-pw@{}:{}/postgres",
        pg.host(),
        pg.port()
    );
    // The login really asks for the password.
    let wrong = url.replace("s3cret-pw", "wrong");
    assert!(
        tokio_postgres::connect(&wrong, tokio_postgres::NoTls)
            .await
            .is_err(),
        "a wrong password is refused: SCRAM is on"
    );

    // The defaults, but a connect timeout that a debug build's SCRAM login on a busy machine
    // meets (the default 250 ms is for a release build), and a call timeout that a busy machine
    // does not miss: what is checked is where the first call's time goes, not how fast it is.
    let store = PostgresStore::builder(&url)
        .expect("connection string")
        .connect_timeout(Duration::from_secs(5))
        .call_timeout(Duration::from_secs(2))
        .build()
        .await
        .expect("store");
    let state = store.pool().state();
    assert_eq!(
        state.connections, 4,
        "every connection of the pool is open: {state:?}"
    );
    assert_eq!(state.idle_connections, 4, "{state:?}");
    {
        let conn = store.pool().get().await.expect("a pooled connection");
        let prepared: i64 = conn
            .query_typed_one("SELECT count(*) FROM pg_prepared_statements", &[])
            .await
            .expect("pg_prepared_statements")
            .get(0);
        assert_eq!(prepared, 3, "the statements of every decision are prepared");
    }

    let limiter = Limiter::builder(store).build();
    let direct = plan(100, 50.0);
    let lease = LeaseSettings::default().with_max_wait(Duration::from_secs(2));
    let leased = plan(100, 50.0).with_lease(lease);
    let first = limiter
        .try_acquire_with(&direct, "cold:direct", 1.0)
        .await
        .expect("decision");
    assert_eq!(first.decided_by, DecidedBy::Store, "{first:?}");
    let first = limiter
        .try_acquire_with(&leased, "cold:leased", 1.0)
        .await
        .expect("decision");
    assert!(
        matches!(first.decided_by, DecidedBy::Store | DecidedBy::Lease),
        "{first:?}"
    );
    limiter.shutdown().await;
}
