//! [`PostgresStore`]: buckets shared through PostgreSQL, one atomic statement per call.
//!
//! A take is one plain SQL statement over the integer columns of migration 0007 (`lean.rs`: one
//! key, or many keys locked in key order), which refills by the database's clock, takes, and
//! inserts the keys that have no row yet; a return of lease tokens is one statement too, made
//! idempotent by its id. Strict leases go through the PL/pgSQL function
//! `tokenlease_acquire_held`. Each pooled session prepares the statements when it opens
//! ([`PostgresStoreBuilder::prepared_statements`], on by default), so a call is only bound and
//! run. Every call is bounded by a client-side timeout, and the server stops abandoned
//! statements itself with `statement_timeout` and `lock_timeout`, set on every connection.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bb8::{Pool, RunError};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{NoTls, Row};

use super::{
    AcquireRequest, Acquired, BucketRow, GiveBack, HeldLease, Store, StoreError, TimeoutKind,
    nanos as nanos_duration,
};
use crate::bucket::Tokens;
use crate::clock::timestamp_from_system_time;

mod citus;
mod lean;
mod manager;
pub(crate) mod migrate;

pub use self::citus::{SUPPORTED_CITUS, hashtext as citus_hashtext};
pub use self::manager::{ConnectionManager, PgConnection};

/// The statements kept as files: the background ones (idle cleanup, inspection). The statements
/// of every decision are built in [`lean`] from one definition of the refill.
mod sql {
    // language=SQL
    pub(super) const DELETE_IDLE: &str = include_str!("sql/delete_idle.sql");
    // language=SQL
    pub(super) const INSPECT: &str = include_str!("sql/inspect.sql");
}

/// The SQL text of the one-key take the store sends (`$1` text key, `$2` capacity, `$3` rate,
/// `$4` min, `$5` want, `$6` step, all bigint nanotokens), for benchmarks that run it
/// themselves (pgbench). Not part of the API: reached through `crate::__private`.
pub fn acquire_one_sql() -> &'static str {
    lean::ACQUIRE_ONE.as_str()
}

/// The SQL text of the many-key take (`$1` text[] keys, `$2`..`$6` bigint[] as
/// [`acquire_one_sql`]'s), for benchmarks. Not part of the API.
pub fn acquire_many_sql() -> &'static str {
    lean::ACQUIRE_MANY.as_str()
}

/// The SQL text of the take through `tokenlease_acquire_held` (strict leases; `$1`..`$6` as
/// [`acquire_many_sql`]'s, `$7` holders, `$8` lease ids, `$9` kept nanotokens, `$10` lifetimes
/// in microseconds), for tests of its commit. Not part of the API.
pub fn acquire_held_sql() -> &'static str {
    lean::ACQUIRE_HELD.as_str()
}

type Manager = ConnectionManager;

/// Buckets in PostgreSQL, shared by every instance that connects to the same database.
///
/// A take is one plain SQL statement over integer columns (nanotokens), prepared once per
/// session by default; a return of lease tokens is one statement, idempotent by its id; strict
/// leases go through the function `tokenlease_acquire_held`. Every call is bounded by a
/// client-side timeout, and the server stops abandoned statements itself with
/// `statement_timeout` and `lock_timeout`, set on every connection. DESIGN.md §5 has the
/// statements and what each costs the server.
///
/// Cheap to clone: clones share one pool.
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool<Manager>,
    pool_size: u32,
    call_timeout: Duration,
    pool_wait_timeout: Duration,
    /// Bounds each of the two steps of abandoning a statement (the cancel request, then the
    /// wait for the session to be idle): the connect timeout.
    cancel_timeout: Duration,
    /// Statements are prepared once per session
    /// ([`PostgresStoreBuilder::prepared_statements`]); cleared for good when the server
    /// refuses a prepared statement as only a transaction pooler makes it do.
    prepare: Arc<AtomicBool>,
    /// The shard map and a pool per worker when the database is a Citus coordinator with the
    /// tables distributed: every call then goes through the routed functions of [`citus`].
    citus: Option<Arc<citus::Citus>>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("pool", &self.pool.state())
            .field("call_timeout", &self.call_timeout)
            .finish_non_exhaustive()
    }
}

/// Settings for a [`PostgresStore`]; see each setter for its default.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is awaited"]
pub struct PostgresStoreBuilder {
    config: tokio_postgres::Config,
    pool_size: u32,
    call_timeout: Duration,
    pool_wait_timeout: Duration,
    connect_timeout: Duration,
    statement_timeout: Duration,
    lock_timeout: Duration,
    keepalive: Duration,
    synchronous_commit: bool,
    prepared_statements: bool,
    migrate: bool,
    migrate_timeout: Duration,
}

impl PostgresStoreBuilder {
    /// Connections in the pool. Defaults to 4: one statement per hot key in flight is enough,
    /// and a hot row gets slower with more concurrent writers.
    pub fn pool_size(mut self, n: u32) -> Self {
        self.pool_size = n.max(1);
        self
    }

    /// The bound on a whole call, from asking the pool to reading the reply. Defaults to 50 ms.
    pub fn call_timeout(mut self, d: Duration) -> Self {
        self.call_timeout = d;
        self
    }

    /// The bound on waiting for a pooled connection (including connecting a new one). Defaults
    /// to 40 ms, a little below the call timeout, so an exhausted pool reports itself as such.
    pub fn pool_wait_timeout(mut self, d: Duration) -> Self {
        self.pool_wait_timeout = d;
        self
    }

    /// The bound on opening a TCP connection and logging in. Defaults to 250 ms.
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// Server-side `statement_timeout`: the server cancels a limiter statement that runs longer,
    /// even after the client gave up on it. Defaults to 100 ms.
    pub fn statement_timeout(mut self, d: Duration) -> Self {
        self.statement_timeout = d;
        self
    }

    /// Server-side `lock_timeout` for the row lock. Defaults to 100 ms.
    pub fn lock_timeout(mut self, d: Duration) -> Self {
        self.lock_timeout = d;
        self
    }

    /// TCP keepalive idle time and `tcp_user_timeout`: how soon a dead peer is noticed on an
    /// idle or a stuck connection. Defaults to 5 s.
    pub fn keepalive(mut self, d: Duration) -> Self {
        self.keepalive = d;
        self
    }

    /// Whether the limiter's plain takes and returns wait for their commit record to reach disk
    /// (the server's own `synchronous_commit`) or commit asynchronously (`synchronous_commit =
    /// off` on the limiter's sessions only). Defaults to `false`: asynchronous.
    ///
    /// A durable commit is a WAL flush per statement, about a quarter of what a lone caller's
    /// take costs the server (DESIGN.md §5). Rate-limit state is soft: with asynchronous
    /// commits a crash of the server (not a clean stop) forgets at most the takes and returns of
    /// its last `3 × wal_writer_delay` (600 ms by default). Forgotten takes refill those buckets
    /// by what they took, once; a forgotten return leaves its tokens uncredited, and a retry of
    /// it credits them once. Nothing is corrupted, and a clean shutdown or a switchover loses
    /// nothing. Takes through strict leases ([`Accounting::Strict`](crate::policy::Accounting::Strict))
    /// always commit durably: a strict lease the server forgot would let its holder spend
    /// tokens the bucket no longer counts. Set `true` where one more admission per forgotten
    /// take after a crash is not acceptable. Never use an UNLOGGED table instead: a crash
    /// empties it, refilling every bucket.
    pub fn synchronous_commit(mut self, on: bool) -> Self {
        self.synchronous_commit = on;
        self
    }

    /// Whether each pooled session prepares the store's statements once (a named prepared
    /// statement each, made on the session's first call of it) and then only binds and runs
    /// them, instead of sending each call as an unnamed statement that the server parses and
    /// plans again. Defaults to `true`.
    ///
    /// Parse and plan are most of what a one-key take costs the server (DESIGN.md §5 has the
    /// measurements). Keep it on when the store connects to PostgreSQL directly, through a
    /// pooler in session mode, or through PgBouncer 1.21 or later with `max_prepared_statements`
    /// set (PgBouncer then prepares on each server session itself). Turn it off behind an older
    /// PgBouncer in transaction mode: a call may reach a server session that did not prepare
    /// its statement, or one where another client's statement has the same name. The store
    /// detects the refusals that follow (SQLSTATE 26000, 42P05 or 08P01: the server ran
    /// nothing), sends that call unprepared and turns preparing off for good; a statement of
    /// another client's that runs in place of one of ours must also take the same parameter
    /// types, and the only two of the store's statements that do (the many-key UPDATE and the
    /// INSERT of new keys) each return exact decisions for the rows they return, so a swap
    /// between them changes no decision.
    pub fn prepared_statements(mut self, on: bool) -> Self {
        self.prepared_statements = on;
        self
    }

    /// Whether [`build`](Self::build) applies pending migrations. Defaults to `true`.
    pub fn migrate(mut self, on: bool) -> Self {
        self.migrate = on;
        self
    }

    /// The bound on applying the migrations in [`build`](Self::build): the whole run on the
    /// client, and `statement_timeout` and `lock_timeout` of the migrating session on the
    /// server (which does not use the limiter's short [`statement_timeout`](Self::statement_timeout)
    /// and [`lock_timeout`](Self::lock_timeout)). Defaults to 30 s.
    pub fn migrate_timeout(mut self, d: Duration) -> Self {
        self.migrate_timeout = d;
        self
    }

    /// Opens the pool (one connection up front, to fail early) and applies migrations.
    ///
    /// The first connection is bounded by the [connect timeout](Self::connect_timeout); the
    /// migrations run on it under their own [`migrate_timeout`](Self::migrate_timeout), never
    /// under the limiter's statement timeout.
    ///
    /// # Errors
    ///
    /// - [`StoreError::Timeout`] with [`TimeoutKind::Connect`], or [`StoreError::Connection`],
    ///   when the first connection fails;
    /// - [`StoreError::Migrate`] naming the migration or bookkeeping step that failed;
    /// - [`StoreError::Timeout`] with [`TimeoutKind::Migrate`] when the migrations took longer
    ///   than the migrate timeout.
    pub async fn build(self) -> Result<PostgresStore, StoreError> {
        let mut config = self.config;
        config
            .connect_timeout(self.connect_timeout)
            .keepalives(true)
            .keepalives_idle(self.keepalive)
            .tcp_user_timeout(self.keepalive);
        if config.get_application_name().is_none() {
            config.application_name("tokenlease");
        }
        // The migrating session gets the migrate timeout on the server, set at startup like the
        // limiter's own settings (no `SET` that could outlive the session behind a pooler).
        let migrate_ms = self.migrate_timeout.as_millis().max(1);
        let mut setup_config = config.clone();
        setup_config.options(format!(
            "-c statement_timeout={migrate_ms} -c lock_timeout={migrate_ms}"
        ));
        // Durable: the server's own `synchronous_commit`, whatever it is (`on`, or a stronger
        // `remote_apply` on a cluster with synchronous standbys).
        config.options(format!(
            "-c statement_timeout={} -c lock_timeout={}{}",
            self.statement_timeout.as_millis().max(1),
            self.lock_timeout.as_millis().max(1),
            if self.synchronous_commit {
                ""
            } else {
                " -c synchronous_commit=off"
            },
        ));
        let prepare = Arc::new(AtomicBool::new(self.prepared_statements));
        let on_citus = Arc::new(AtomicBool::new(false));
        let manager = ConnectionManager::new(config.clone(), self.connect_timeout, prepare.clone())
            .citus(on_citus.clone());
        let warmer = ConnectionManager::new(config.clone(), self.connect_timeout, prepare.clone())
            .citus(on_citus.clone());
        let pool = new_pool(manager, self.pool_size, self.pool_wait_timeout);
        let mut store = PostgresStore {
            pool,
            pool_size: self.pool_size,
            call_timeout: self.call_timeout,
            pool_wait_timeout: self.pool_wait_timeout,
            cancel_timeout: self.connect_timeout,
            prepare,
            citus: None,
        };
        // The first connection is made outside the pool, bounded by the connect timeout rather
        // than the (shorter) pool wait, so a busy machine does not fail the build: it proves the
        // database is reachable and applies the migrations.
        let (mut client, connection) =
            manager::bounded(self.connect_timeout, setup_config.connect(NoTls)).await?;
        let driver = tokio::spawn(connection);
        if self.migrate {
            let migrated =
                tokio::time::timeout(self.migrate_timeout, migrate::migrate(&mut client)).await;
            match migrated {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(StoreError::Migrate(std::sync::Arc::new(e))),
                Err(_) => {
                    return Err(StoreError::Timeout {
                        kind: TimeoutKind::Migrate,
                        after: self.migrate_timeout,
                    });
                }
            }
        }
        // A Citus coordinator with the tables distributed: route every call (citus.rs), each
        // worker's calls through a pool of their own.
        if let Some(map) = citus::shard_map(&client).await? {
            on_citus.store(true, Ordering::Relaxed);
            let lanes = (0..map.nodes().len())
                .map(|_| PostgresStore {
                    pool: new_pool(
                        ConnectionManager::new(
                            config.clone(),
                            self.connect_timeout,
                            store.prepare.clone(),
                        )
                        .citus(on_citus.clone()),
                        self.pool_size,
                        self.pool_wait_timeout,
                    ),
                    citus: None,
                    ..store.clone()
                })
                .collect();
            store.citus = Some(Arc::new(citus::Citus { map, lanes }));
        }
        drop(client);
        // The session ends with the client: wait (bounded) for its driver to say goodbye, and
        // count a connection that ended in an error rather than dropping it silently.
        match tokio::time::timeout(self.connect_timeout, driver).await {
            Ok(Ok(Ok(()))) => {}
            _ => metrics::counter!(crate::metrics::STORE_CONNECTION_ERRORS).increment(1),
        }
        // Warm the pool: open its connections side by side (each preparing the statements of
        // every decision) and hand them to the pool before the first call, so that no early
        // call waits for a login or a prepare. Each is bounded by the connect timeout, not by
        // the pool's wait (40 ms by default, less than a password login can take); a connection
        // that does not come is opened by the first call that needs it, as before.
        use bb8::ManageConnection as _;
        let pools: Vec<&Pool<Manager>> = match &store.citus {
            Some(citus) => citus.lanes.iter().map(|lane| &lane.pool).collect(),
            None => vec![&store.pool],
        };
        for pool in pools {
            let warm = (0..self.pool_size).map(|_| warmer.connect());
            for conn in manager::join_all(warm).await.into_iter().flatten() {
                // Refused only when the pool is full already: the connection is dropped.
                let _ = pool.add(conn);
            }
        }
        Ok(store)
    }
}

/// The store's connection pool, for tests that run their own SQL on the store's sessions
/// (reached through `crate::__private`; never in the API, where bb8's version would become
/// part of ours).
pub fn pool(store: &PostgresStore) -> &Pool<ConnectionManager> {
    store.pool()
}

/// A pool of `size` connections made by `manager`, handing one out within `wait`.
fn new_pool(manager: ConnectionManager, size: u32, wait: Duration) -> Pool<Manager> {
    Pool::builder()
        .max_size(size)
        .min_idle(Some(0))
        .connection_timeout(wait)
        .test_on_check_out(false)
        .error_sink(Box::new(manager::CountErrors))
        .build_unchecked(manager)
}

fn pool_error(after: Duration) -> impl Fn(RunError<StoreError>) -> StoreError {
    move |e| match e {
        RunError::User(e) => e,
        RunError::TimedOut => StoreError::Timeout {
            kind: TimeoutKind::Pool,
            after,
        },
    }
}

impl PostgresStore {
    /// Settings for a store on `connection` (a `postgres://` URL or `key=value` string).
    ///
    /// # Errors
    ///
    /// [`StoreError::InvalidConnectionString`] when the connection string does not parse; the
    /// message quotes it with any password hidden.
    pub fn builder(connection: &str) -> Result<PostgresStoreBuilder, StoreError> {
        let config = tokio_postgres::Config::from_str(connection).map_err(|e| {
            StoreError::InvalidConnectionString(format!(
                "{}: {}",
                crate::report::redact(connection),
                crate::report::chain(&e)
            ))
        })?;
        Ok(PostgresStoreBuilder {
            config,
            pool_size: 4,
            call_timeout: Duration::from_millis(50),
            pool_wait_timeout: Duration::from_millis(40),
            connect_timeout: Duration::from_millis(250),
            statement_timeout: Duration::from_millis(100),
            lock_timeout: Duration::from_millis(100),
            keepalive: Duration::from_secs(5),
            synchronous_commit: false,
            prepared_statements: true,
            migrate: true,
            migrate_timeout: Duration::from_secs(30),
        })
    }

    /// A store on `connection` with default settings.
    ///
    /// # Errors
    ///
    /// As [`PostgresStoreBuilder::build`].
    pub async fn connect(connection: &str) -> Result<PostgresStore, StoreError> {
        Self::builder(connection)?.build().await
    }

    /// The connection pool: for tests, through `crate::__private::pool`, never in the API
    /// (bb8's version would become part of ours).
    pub(crate) fn pool(&self) -> &Pool<Manager> {
        &self.pool
    }

    /// Runs one statement with a pooled connection, inside the call timeout.
    ///
    /// A statement the call gives up on (the call timed out, or its future was dropped) is
    /// abandoned: see [`InFlight`].
    async fn query(
        &self,
        statement: &'static str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, StoreError> {
        let deadline = tokio::time::Instant::now() + self.call_timeout;
        self.query_by(deadline, statement, params).await
    }

    /// [`query`](Self::query) by `deadline`: the statements of one call share its timeout.
    async fn query_by(
        &self,
        deadline: tokio::time::Instant,
        statement: &'static str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, StoreError> {
        let timed_out = || StoreError::Timeout {
            kind: TimeoutKind::Call,
            after: self.call_timeout,
        };
        let conn = self.checkout(deadline, timed_out).await?;
        let in_flight = InFlight {
            conn: Some(conn),
            cancel_timeout: self.cancel_timeout,
        };
        let outcome =
            tokio::time::timeout_at(deadline, self.send(in_flight.conn(), statement, params)).await;
        match outcome {
            Ok(result) => {
                in_flight.done();
                result.map_err(StoreError::from)
            }
            // `in_flight` drops with the statement still running: it is abandoned.
            Err(_) => Err(timed_out()),
        }
    }

    /// A pooled connection for one call, by `deadline`.
    ///
    /// The pool does not test a connection when it hands it out (that would be a round trip a
    /// call). But a connection whose session the server ended while it sat idle in the pool (a
    /// terminated backend, a restart, a cut link) is already known to the client as closed,
    /// without a round trip: it is dropped here, which makes the pool discard it, and another is
    /// taken, so that a call does not fail on it long after the fault (test D4). At most one try
    /// more than the pool holds; the last connection is used even if closed, and then fails as
    /// it would have.
    async fn checkout(
        &self,
        deadline: tokio::time::Instant,
        timed_out: impl Fn() -> StoreError,
    ) -> Result<bb8::PooledConnection<'static, Manager>, StoreError> {
        let mut tries = 0u32;
        loop {
            let conn = match tokio::time::timeout_at(deadline, self.pool.get_owned()).await {
                Ok(conn) => conn.map_err(pool_error(self.pool_wait_timeout))?,
                Err(_) => return Err(timed_out()),
            };
            tries += 1;
            if !conn.is_closed() || tries > self.pool_size {
                return Ok(conn);
            }
            // Dropped: `has_broken` finds it closed, and the pool discards it.
        }
    }

    /// Sends `statement` on `conn`: bound to the session's prepared statement when the store
    /// prepares them (preparing it first on the session's first call of it), else as an
    /// unnamed statement.
    async fn send(
        &self,
        conn: &PgConnection,
        statement: &'static str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        if self.prepare.load(Ordering::Relaxed) {
            let prepared = match conn.prepared(statement) {
                Some(prepared) => Ok(prepared),
                None => {
                    let types: Vec<Type> = params.iter().map(|(_, t)| t.clone()).collect();
                    conn.prepare_typed(statement, &types)
                        .await
                        .inspect(|prepared| {
                            conn.remember(statement, prepared.clone());
                        })
                }
            };
            let result = match prepared {
                Ok(prepared) => {
                    let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
                    conn.query(&prepared, &values).await
                }
                Err(e) => Err(e),
            };
            match result {
                Err(e) if refused_by_pooler(&e) => {
                    // The session that prepared is not the one that ran (a transaction pooler):
                    // nothing ran; from now on every call goes unprepared.
                    self.prepare.store(false, Ordering::Relaxed);
                    conn.forget_prepared();
                    metrics::counter!(crate::metrics::STORE_UNPREPARED).increment(1);
                }
                Err(e) if stale_plan(&e) => {
                    // A migration changed what the statement returns: prepare it again next
                    // time, and send this call unprepared.
                    conn.forget_prepared();
                }
                other => return other,
            }
        }
        conn.query_typed(statement, params).await
    }
}

/// The refusals of a prepared statement that only a transaction pooler causes: the statement
/// is not in the session (26000), another client's of the same name is (42P05), or that one
/// takes other parameters (08P01). The server ran nothing.
fn refused_by_pooler(e: &tokio_postgres::Error) -> bool {
    e.code().is_some_and(|code| {
        [
            SqlState::INVALID_SQL_STATEMENT_NAME,
            SqlState::DUPLICATE_PSTATEMENT,
            SqlState::PROTOCOL_VIOLATION,
        ]
        .contains(code)
    })
}

/// "cached plan must not change result type": the statement's result changed since the session
/// prepared it. The server ran nothing.
fn stale_plan(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&SqlState::FEATURE_NOT_SUPPORTED)
        && e.as_db_error().is_some_and(|db| {
            db.message()
                .contains("cached plan must not change result type")
        })
}

/// How long an abandoned statement's connection waits for the statement to finish on its own
/// before it is cancelled: a reply that is merely late (a slow link) then costs no new
/// connection, while a statement stuck on a lock is cancelled after this.
const ABANDON_GRACE: Duration = Duration::from_millis(50);

/// A pooled connection with a statement in flight.
///
/// Dropped before [`done`](Self::done), as when the call timed out or the caller dropped the
/// call's future, the statement is *abandoned*: dropping a tokio-postgres future does not stop
/// the statement on the server, and returning the connection to the pool would queue the next
/// caller behind it. So a task (spawned, bounded) keeps the connection out of the pool and sends
/// it an empty query, whose reply comes after the abandoned statement's:
///
/// - when that reply comes within [`ABANDON_GRACE`], the statement finished by itself and the
///   session is idle with nothing sent to it: the connection goes back to the pool. Over a slow
///   link, where every reply is late, this is what keeps the pool's connections: closing each
///   one would make the next caller open a connection over the same slow link, whose start-up
///   and first statement together can take longer than a call, and so on;
/// - otherwise the server gets a cancel request for the statement, the task waits until the
///   session is idle, and then closes the connection instead of returning it: the cancel,
///   delivered late, could otherwise hit the next caller's statement.
///
/// The connection holds its pool slot until then, so the pool never has more sessions busy on
/// the server than its size. Each step is bounded by the connect timeout; a server that does not
/// answer gets its socket closed. Cancels are counted in `tokenlease_store_cancels_total{result}`
/// (`result="none"` for a statement that finished in the grace).
struct InFlight {
    conn: Option<bb8::PooledConnection<'static, Manager>>,
    cancel_timeout: Duration,
}

impl InFlight {
    fn conn(&self) -> &PgConnection {
        self.conn
            .as_deref()
            .expect("connection present until dropped")
    }

    /// The statement finished: the connection goes back to the pool.
    fn done(mut self) {
        drop(self.conn.take());
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        conn.discard();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(abandon(conn, self.cancel_timeout));
            }
            // No runtime to cancel from: close the socket; the server's statement_timeout ends
            // the statement.
            Err(_) => conn.abort_driver(),
        }
    }
}

/// Waits briefly for the statement running on `conn` to finish and returns the connection to the
/// pool, or cancels the statement, waits (bounded) until its session is idle, and closes it. See
/// [`InFlight`].
async fn abandon(mut conn: bb8::PooledConnection<'static, Manager>, bound: Duration) {
    // The reply to an empty query comes after the abandoned statement's: within the grace, the
    // statement finished by itself and no cancel was sent, so the session can be used again.
    let idle_query = conn.simple_query("");
    if let Ok(Ok(_)) = tokio::time::timeout(ABANDON_GRACE.min(bound), idle_query).await {
        metrics::counter!(crate::metrics::STORE_CANCELS, "result" => "none").increment(1);
        conn.keep();
        return;
    }
    let token = conn.cancel_token();
    let sent = matches!(
        tokio::time::timeout(bound, token.cancel_query(NoTls)).await,
        Ok(Ok(()))
    );
    metrics::counter!(
        crate::metrics::STORE_CANCELS,
        "result" => if sent { "sent" } else { "failed" }
    )
    .increment(1);
    // Ok(Err(_)) is fine too: the cancel hit the empty query, so the session is idle.
    let idle = tokio::time::timeout(bound, conn.simple_query(""))
        .await
        .is_ok();
    if !idle {
        conn.abort_driver();
    }
    // Marked discarded: dropping it closes the session rather than pooling it.
    drop(conn);
}

fn tokens(row: &Row, idx: usize) -> Result<Tokens, StoreError> {
    let text: &str = row.try_get(idx).map_err(StoreError::from)?;
    Tokens::from_str(text).map_err(|e| StoreError::Protocol(e.to_string()))
}

/// A column of microseconds since the Unix epoch, as a time.
fn micros(row: &Row, idx: usize) -> Result<SystemTime, StoreError> {
    let us: i64 = row.try_get(idx).map_err(StoreError::from)?;
    let us = u64::try_from(us)
        .map_err(|_| StoreError::Protocol(format!("a time before 1970: {us} µs")))?;
    Ok(SystemTime::UNIX_EPOCH + Duration::from_micros(us))
}

/// Nanotokens in one token, and attotokens in one nanotoken.
const NANO: u128 = 1_000_000_000;

/// The largest capacity the table holds: 8 × 10¹⁸ nanotokens (migration 0007).
const MAX_CAPACITY_NANOS: i64 = 8_000_000_000_000_000_000;

/// An amount in whole nanotokens, rounded down (a `want`: never more than asked for).
fn nanos_down(t: Tokens) -> i64 {
    i64::try_from(t.as_atto() / NANO).unwrap_or(i64::MAX)
}

/// An amount in whole nanotokens, rounded up (a `min`, a `step`: never less than asked for).
fn nanos_up(t: Tokens) -> i64 {
    i64::try_from(t.as_atto().div_ceil(NANO)).unwrap_or(i64::MAX)
}

/// The bucket's capacity and rate in nanotokens, or an error naming the key when the capacity is
/// beyond what the table holds.
fn shape(key: &str, bucket: &crate::bucket::BucketConfig) -> Result<(i64, i64), StoreError> {
    let capacity = nanos_down(bucket.capacity());
    if capacity > MAX_CAPACITY_NANOS {
        return Err(StoreError::Protocol(format!(
            "key {key:?}: capacity {} is above the 8000000000 tokens PostgresStore holds",
            bucket.capacity()
        )));
    }
    let rate = i64::try_from(bucket.rate().as_nanos_per_second()).unwrap_or(i64::MAX);
    Ok((capacity.max(1), rate))
}

/// The bigint arrays of a batch of takes, in the statements' parameter order.
struct Takes<'a> {
    keys: Vec<&'a str>,
    capacities: Vec<i64>,
    rates: Vec<i64>,
    mins: Vec<i64>,
    wants: Vec<i64>,
    steps: Vec<i64>,
}

impl<'a> Takes<'a> {
    /// The takes of `requests` at `which` indices. Amounts go to whole nanotokens: `min` and
    /// `step` rounded up, `want` down, so a grant is never more than
    /// asked for; the limiter's costs and leases are whole nanotokens already.
    fn new(requests: &[AcquireRequest<'a>], which: &[usize]) -> Result<Self, StoreError> {
        let mut t = Takes {
            keys: Vec::with_capacity(which.len()),
            capacities: Vec::with_capacity(which.len()),
            rates: Vec::with_capacity(which.len()),
            mins: Vec::with_capacity(which.len()),
            wants: Vec::with_capacity(which.len()),
            steps: Vec::with_capacity(which.len()),
        };
        for &i in which {
            let r = &requests[i];
            let (capacity, rate) = shape(r.key, &r.bucket)?;
            let min = nanos_up(r.min);
            t.keys.push(r.key);
            t.capacities.push(capacity);
            t.rates.push(rate);
            t.mins.push(min);
            t.wants.push(nanos_down(r.want));
            t.steps.push(nanos_up(r.step).max(1));
        }
        Ok(t)
    }

    fn params(&self) -> Vec<(&(dyn ToSql + Sync), Type)> {
        let values: [&(dyn ToSql + Sync); 6] = [
            &self.keys,
            &self.capacities,
            &self.rates,
            &self.mins,
            &self.wants,
            &self.steps,
        ];
        values.into_iter().zip(lean::MANY_TYPES).collect()
    }

    /// The parameters of the one-key take for the first (only) request.
    fn one_params(&self) -> Vec<(&(dyn ToSql + Sync), Type)> {
        let values: [&(dyn ToSql + Sync); 6] = [
            &self.keys[0],
            &self.capacities[0],
            &self.rates[0],
            &self.mins[0],
            &self.wants[0],
            &self.steps[0],
        ];
        values.into_iter().zip(lean::ONE_TYPES).collect()
    }
}

/// What the store did with `request`, from a row of the take statements: key, tokens left
/// (whole nanotokens), femtotokens, nanotokens granted, refill time and now (microseconds).
fn acquired(request: &AcquireRequest<'_>, row: &Row) -> Result<Acquired, StoreError> {
    let get =
        |idx: usize| -> Result<i64, StoreError> { row.try_get(idx).map_err(StoreError::from) };
    let nanos = |n: i64| u128::try_from(n).unwrap_or(0) * NANO;
    let frac: i32 = row.try_get(2).map_err(StoreError::from)?;
    let femto = u128::try_from(frac).unwrap_or(0) * 1_000;
    let remaining = Tokens::from_atto(nanos(get(1)?) + femto);
    let granted = Tokens::from_atto(nanos(get(3)?));
    let updated_at = timestamp_from_system_time(micros(row, 4)?);
    let store_now = micros(row, 5)?;
    let now = timestamp_from_system_time(store_now);
    let config = &request.bucket;
    // The refill time may be ahead of now() when another writer's clock ran ahead.
    let ahead = updated_at.saturating_since(now);
    let retry_after = if granted.is_zero() && !request.min.is_zero() {
        ahead.saturating_add(config.time_to_refill(request.min.saturating_sub(remaining)))
    } else {
        0
    };
    let reset =
        ahead.saturating_add(config.time_to_refill(config.capacity().saturating_sub(remaining)));
    Ok(Acquired {
        granted,
        remaining,
        retry_after: nanos_duration(retry_after),
        reset_after: nanos_duration(reset),
        store_now,
    })
}

/// The strict leases of `inspect.sql`'s JSON column.
fn held_leases(json: &str) -> Result<Vec<HeldLease>, StoreError> {
    #[derive(serde::Deserialize)]
    struct Raw {
        holder: i64,
        lease_id: i64,
        amount: String,
        expires_us: i64,
    }
    let raw: Vec<Raw> = serde_json::from_str(json)
        .map_err(|e| StoreError::Protocol(format!("leases column: {e}")))?;
    raw.into_iter()
        .map(|l| {
            let amount = Tokens::from_str(&l.amount)
                .map_err(|e| StoreError::Protocol(format!("lease amount {:?}: {e}", l.amount)))?;
            let micros = u64::try_from(l.expires_us).unwrap_or(0);
            Ok(HeldLease {
                holder: l.holder,
                lease_id: l.lease_id,
                amount,
                expires_at: SystemTime::UNIX_EPOCH + Duration::from_micros(micros),
            })
        })
        .collect()
}

impl PostgresStore {
    /// Sends the plain take for the requests at `pending` (the one-key statement for one, the
    /// many-key one for more) and files each row it returns under its request; `pending` keeps
    /// the requests that got no row.
    async fn take_round(
        &self,
        deadline: tokio::time::Instant,
        requests: &[AcquireRequest<'_>],
        pending: &mut Vec<usize>,
        out: &mut [Option<Acquired>],
    ) -> Result<(), StoreError> {
        let t = Takes::new(requests, pending)?;
        let rows = if pending.len() == 1 {
            let statement = lean::ACQUIRE_ONE.as_str();
            self.query_by(deadline, statement, &t.one_params()).await?
        } else {
            let statement = lean::ACQUIRE_MANY.as_str();
            self.query_by(deadline, statement, &t.params()).await?
        };
        file_rows(&rows, requests, pending, out)
    }

    /// Takes through `tokenlease_acquire_held`: strict leases, rows that hold them, and rows
    /// another caller inserted while a plain statement ran.
    async fn take_held(
        &self,
        deadline: tokio::time::Instant,
        requests: &[AcquireRequest<'_>],
        pending: &mut Vec<usize>,
        out: &mut [Option<Acquired>],
    ) -> Result<(), StoreError> {
        let t = Takes::new(requests, pending)?;
        let holds = Holds::new(requests, pending);
        let mut params = t.params();
        params.extend(holds.params());
        let rows = self
            .query_by(deadline, lean::ACQUIRE_HELD.as_str(), &params)
            .await?;
        file_rows(&rows, requests, pending, out)
    }
}

/// The strict-lease arrays of `tokenlease_acquire_held` beside a batch's [`Takes`]: each
/// request's holder and lease id (NULL for a plain take), the tokens it keeps and its lifetime.
struct Holds {
    holders: Vec<Option<i64>>,
    lease_ids: Vec<Option<i64>>,
    kept: Vec<i64>,
    lifetimes: Vec<i64>,
}

impl Holds {
    /// The holds of `requests` at `which` indices.
    fn new(requests: &[AcquireRequest<'_>], which: &[usize]) -> Self {
        let holds = which.iter().map(|&i| requests[i].hold);
        Holds {
            holders: holds.clone().map(|h| h.map(|h| h.holder)).collect(),
            lease_ids: holds.clone().map(|h| h.map(|h| h.lease_id)).collect(),
            kept: holds
                .clone()
                .map(|h| h.map_or(0, |h| nanos_up(h.kept)))
                .collect(),
            lifetimes: holds
                .map(|h| {
                    h.map_or(0, |h| {
                        i64::try_from(h.lifetime.as_micros()).unwrap_or(i64::MAX)
                    })
                })
                .collect(),
        }
    }

    fn params(&self) -> [(&(dyn ToSql + Sync), Type); 4] {
        [
            (&self.holders, Type::INT8_ARRAY),
            (&self.lease_ids, Type::INT8_ARRAY),
            (&self.kept, Type::INT8_ARRAY),
            (&self.lifetimes, Type::INT8_ARRAY),
        ]
    }
}

/// Files each row (key first) under its request among `pending`, and keeps in `pending`
/// the requests that got none.
fn file_rows(
    rows: &[Row],
    requests: &[AcquireRequest<'_>],
    pending: &mut Vec<usize>,
    out: &mut [Option<Acquired>],
) -> Result<(), StoreError> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut by_key: HashMap<&str, &Row> = HashMap::with_capacity(rows.len());
    for row in rows {
        let key: &str = row.try_get(0).map_err(StoreError::from)?;
        by_key.insert(key, row);
    }
    let mut left = Vec::new();
    for &i in pending.iter() {
        match by_key.get(requests[i].key) {
            Some(row) => out[i] = Some(acquired(&requests[i], row)?),
            None => left.push(i),
        }
    }
    *pending = left;
    Ok(())
}

#[async_trait]
impl Store for PostgresStore {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        let mut out = self.acquire_many(std::slice::from_ref(&request)).await?;
        out.pop()
            .ok_or_else(|| StoreError::Protocol("acquire returned no row".into()))
    }

    /// One statement for a plain batch, within the call timeout: the one-key take or
    /// the many-key take (`lean.rs`), which update the rows that exist and insert the keys that have
    /// none. What they leave (strict leases, rows holding strict leases, rows another caller
    /// inserted meanwhile) goes through `tokenlease_acquire_held`; a batch with a strict lease,
    /// and every batch when the store does not prepare its statements, goes there directly.
    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        if let Some(citus) = &self.citus {
            return citus.acquire_each(requests).await.into_iter().collect();
        }
        let deadline = tokio::time::Instant::now() + self.call_timeout;
        let mut out: Vec<Option<Acquired>> = vec![None; requests.len()];
        let mut pending: Vec<usize> = (0..requests.len()).collect();
        // Sent unnamed, the plain statements would be parsed and planned on every call, and
        // their written-out arithmetic makes that cost more than the function's call (whose
        // statements PL/pgSQL plans once per session): without prepared statements every take
        // goes through the function, which decides plain takes exactly as they do.
        let plain = self.prepare.load(Ordering::Relaxed);
        if plain && !requests.iter().any(|r| r.hold.is_some()) {
            self.take_round(deadline, requests, &mut pending, &mut out)
                .await?;
        }
        if !pending.is_empty() {
            self.take_held(deadline, requests, &mut pending, &mut out)
                .await?;
        }
        requests
            .iter()
            .zip(out)
            .map(|(request, got)| {
                got.ok_or_else(|| {
                    StoreError::Protocol(format!("no row returned for key {:?}", request.key))
                })
            })
            .collect()
    }

    /// On Citus each worker's part succeeds or fails alone; elsewhere as the trait's default.
    async fn acquire_each(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Vec<Result<Acquired, StoreError>> {
        if let Some(citus) = &self.citus {
            return citus.acquire_each(requests).await;
        }
        match self.acquire_many(requests).await {
            Ok(answers) => answers.into_iter().map(Ok).collect(),
            Err(err) => requests.iter().map(|_| Err(err.clone())).collect(),
        }
    }

    /// On Citus each worker's part succeeds or fails alone; elsewhere as the trait's default.
    async fn give_back_each(&self, returns: &[GiveBack<'_>]) -> Vec<Result<(), StoreError>> {
        if let Some(citus) = &self.citus {
            let answers = citus.give_back_each(returns).await;
            return answers.into_iter().map(|r| r.map(|_| ())).collect();
        }
        match self.give_back(returns).await {
            Ok(_) => returns.iter().map(|_| Ok(())).collect(),
            Err(err) => returns.iter().map(|_| Err(err.clone())).collect(),
        }
    }

    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        if returns.is_empty() {
            return Ok(0);
        }
        if let Some(citus) = &self.citus {
            let answers = citus.give_back_each(returns).await;
            return answers.into_iter().sum();
        }
        let ids: Vec<i64> = returns.iter().map(|r| r.id).collect();
        let keys: Vec<&str> = returns.iter().map(|r| r.key).collect();
        // An amount is what a lease did not spend: whole nanotokens; rounded down, a return
        // never credits more than it holds.
        let amounts: Vec<i64> = returns.iter().map(|r| nanos_down(r.amount)).collect();
        let mut capacities = Vec::with_capacity(returns.len());
        let mut rates = Vec::with_capacity(returns.len());
        for r in returns {
            let (capacity, rate) = shape(r.key, &r.bucket)?;
            capacities.push(capacity);
            rates.push(rate);
        }
        let holders: Vec<Option<i64>> = returns.iter().map(|r| r.lease.map(|l| l.holder)).collect();
        let lease_ids: Vec<Option<i64>> = returns
            .iter()
            .map(|r| r.lease.map(|l| l.lease_id))
            .collect();
        let rows = self
            .query(
                lean::GIVE_BACK.as_str(),
                &[
                    &ids as &(dyn ToSql + Sync),
                    &keys,
                    &amounts,
                    &capacities,
                    &rates,
                    &holders,
                    &lease_ids,
                ]
                .into_iter()
                .zip(lean::GIVE_BACK_TYPES)
                .collect::<Vec<_>>(),
            )
            .await?;
        Ok(rows.len() as u64)
    }

    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        if let Some(citus) = &self.citus {
            return citus.delete_idle(limit).await;
        }
        let limit = i64::from(limit);
        let rows = self
            .query(sql::DELETE_IDLE, &[(&limit, Type::INT8)])
            .await?;
        Ok(rows.len() as u64)
    }

    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        let rows = self.query(sql::INSPECT, &[(&key, Type::TEXT)]).await?;
        rows.first()
            .map(|row| {
                Ok(BucketRow {
                    key: row.try_get::<_, String>(0).map_err(StoreError::from)?,
                    tokens: tokens(row, 1)?,
                    capacity: tokens(row, 2)?,
                    refill_per_second: tokens(row, 3)?,
                    updated_at: micros(row, 4)?,
                    store_now: micros(row, 5)?,
                    tokens_now: tokens(row, 6)?,
                    leases: held_leases(row.try_get(7).map_err(StoreError::from)?)?,
                })
            })
            .transpose()
    }

    fn call_timeout(&self) -> Option<Duration> {
        Some(self.call_timeout)
    }

    /// The pool's size; on Citus, the sum of the workers' pools.
    fn max_concurrent_calls(&self) -> Option<usize> {
        let lanes = self.citus.as_ref().map_or(1, |citus| citus.lanes.len());
        Some(self.pool_size as usize * lanes)
    }

    /// On Citus, the worker holding the key's shard: a stalled worker then delays only its
    /// own keys' callers. `0` on plain PostgreSQL.
    fn partition(&self, key: &str) -> usize {
        self.citus
            .as_ref()
            .map_or(0, |citus| citus.map.node_of(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store that cannot connect says why, with every cause, and never the password.
    #[tokio::test]
    async fn a_refused_connection_names_its_cause_and_hides_the_password() {
        // Port 1 on the loopback: nothing listens there, so the connection is refused at once.
        let err = PostgresStore::builder("postgres://app:s3cret@127.0.0.1:1/app")
            .expect("a valid connection string")
            .connect_timeout(Duration::from_secs(5))
            .build()
            .await
            .expect_err("nothing listens on port 1");
        let text = err.to_string();
        assert!(matches!(err, StoreError::Connection(_)), "{err:?}");
        assert!(
            text.starts_with("connection to the store failed: "),
            "{text}"
        );
        assert!(text.to_lowercase().contains("refused"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
        // The driver's error stays reachable for inspection.
        assert!(std::error::Error::source(&err).is_some());
    }

    /// A connection string that does not parse is quoted with its password hidden.
    #[test]
    fn an_invalid_connection_string_is_quoted_without_its_password() {
        for bad in [
            "postgres://app:s3cret@db:notaport/app",
            "host=db user=app password=s3cret port=notaport",
        ] {
            let text = PostgresStore::builder(bad).expect_err(bad).to_string();
            assert!(text.starts_with("invalid connection string "), "{text}");
            assert!(text.contains("***"), "{text}");
            assert!(!text.contains("s3cret"), "{text}");
        }
    }
}
