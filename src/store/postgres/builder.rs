//! [`PostgresStoreBuilder`]: the store's settings, and `build`, which opens the pool, migrates
//! and warms the sessions.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bb8::{Pool, RunError};
use tokio_postgres::NoTls;

use super::contain::ServerEncoding;
use super::{ConnectionManager, Manager, PostgresStore, citus, manager, migrate};
use crate::store::{StoreError, TimeoutKind};

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
    /// Citus nodes reached at another address than `pg_dist_node` names: `(host:port as
    /// named, host, port)`.
    node_addresses: Vec<(String, String, u16)>,
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
    /// take costs the server (docs/design/statements.md). Rate-limit state is soft: with asynchronous
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
    /// Parse and plan are most of what a one-key take costs the server (docs/design/statements.md has the
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

    /// On Citus: reach the node `pg_dist_node` names `node` (`host:port`, as in its `nodename`
    /// and `nodeport`) at `host` and `port` instead, for a client that reaches the nodes
    /// differently from the way they reach each other (another network, a proxy, a port
    /// forward). Every other setting of a node's connections is the coordinator's: user,
    /// password, database, TLS mode, timeouts. A node not named here is reached at its own
    /// name. Set once per node; a later call for the same node replaces the earlier one.
    pub fn citus_node_address(
        mut self,
        node: impl Into<String>,
        host: impl Into<String>,
        port: u16,
    ) -> Self {
        let node = node.into();
        self.node_addresses.retain(|(n, _, _)| *n != node);
        self.node_addresses.push((node, host.into(), port));
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
        let pool = new_pool(manager, self.pool_size, self.pool_wait_timeout);
        let mut store = PostgresStore {
            pool,
            pool_size: self.pool_size,
            call_timeout: self.call_timeout,
            pool_wait_timeout: self.pool_wait_timeout,
            cancel_timeout: self.connect_timeout,
            prepare,
            citus: None,
            schema: Arc::default(),
            encoding: ServerEncoding::Unicode,
        };
        // At zero from the start, so that an alert on its increase has a series to watch.
        metrics::counter!(crate::metrics::STORE_SCHEMA_ERRORS).increment(0);
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
        } else {
            // Not migrating (a deploy step does): a database behind what the statements need
            // is said at once; the calls then go to the fallback until it is migrated.
            store.schema.check(&client).await;
        }
        // What the database's encoding holds: a key it cannot is refused before it is sent.
        let encoding = client
            .query_typed(super::sql::SERVER_ENCODING.text, &[])
            .await?;
        if let Some(row) = encoding.first() {
            store.encoding = ServerEncoding::from_name(row.try_get(0)?);
        }
        // A Citus coordinator with the tables distributed: every call goes straight to the
        // node holding its keys (citus/), through a pool of that node's own, opened and warmed
        // here before the first call.
        if let Some(map) = citus::shard_map(&client, true).await? {
            on_citus.store(true, Ordering::Relaxed);
            let template = config.clone();
            let addresses = self.node_addresses.clone();
            let (size, wait, connect_timeout) =
                (self.pool_size, self.pool_wait_timeout, self.connect_timeout);
            let base = store.clone();
            let open: citus::OpenNode = Box::new(move |node: &citus::Node| {
                let (host, port) = addresses
                    .iter()
                    .find(|(name, _, _)| *name == node.name())
                    .map_or((node.host.as_str(), node.port), |(_, h, p)| {
                        (h.as_str(), *p)
                    });
                let statements = manager::NodeStatements::default();
                let manager = ConnectionManager::new(
                    node_config(&template, host, port),
                    connect_timeout,
                    base.prepare.clone(),
                )
                .node(statements.clone());
                let lane = PostgresStore {
                    pool: new_pool(manager, size, wait),
                    citus: None,
                    ..base.clone()
                };
                (lane, statements)
            });
            let citus = citus::Citus::new(
                map,
                open,
                store.clone(),
                self.pool_size,
                self.connect_timeout,
            )
            .await;
            store.citus = Some(Arc::new(citus));
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
        // that does not come is opened by the first call that needs it, as before. (On Citus
        // the nodes' pools were warmed above; the coordinator's serves no decision.)
        if store.citus.is_none() {
            store.warm(self.pool_size).await;
        }
        Ok(store)
    }
}

/// The connection settings of a Citus node at `host`:`port`: the coordinator's (`template`)
/// but for the address.
fn node_config(template: &tokio_postgres::Config, host: &str, port: u16) -> tokio_postgres::Config {
    let mut c = tokio_postgres::Config::new();
    if let Some(user) = template.get_user() {
        c.user(user);
    }
    if let Some(password) = template.get_password() {
        c.password(password);
    }
    if let Some(dbname) = template.get_dbname() {
        c.dbname(dbname);
    }
    // One plan per session for every statement (its generic plan, made when the session warms
    // up), not five custom plans first: the node's takes read the shards only through their
    // inserts' conflict checks, so the plan does not depend on the keys.
    c.options(format!(
        "{} -c plan_cache_mode=force_generic_plan",
        template.get_options().unwrap_or_default()
    ));
    if let Some(name) = template.get_application_name() {
        c.application_name(name);
    }
    if let Some(t) = template.get_connect_timeout() {
        c.connect_timeout(*t);
    }
    if let Some(t) = template.get_tcp_user_timeout() {
        c.tcp_user_timeout(*t);
    }
    if let Some(t) = template.get_keepalives_interval() {
        c.keepalives_interval(t);
    }
    if let Some(n) = template.get_keepalives_retries() {
        c.keepalives_retries(n);
    }
    c.ssl_mode(template.get_ssl_mode())
        .ssl_negotiation(template.get_ssl_negotiation())
        .channel_binding(template.get_channel_binding())
        .keepalives(template.get_keepalives())
        .keepalives_idle(template.get_keepalives_idle())
        .host(host)
        .port(port);
    c
}

/// A pool of `size` connections made by `manager`, handing one out within `wait`.
pub(super) fn new_pool(manager: ConnectionManager, size: u32, wait: Duration) -> Pool<Manager> {
    Pool::builder()
        .max_size(size)
        .min_idle(Some(0))
        .connection_timeout(wait)
        .test_on_check_out(false)
        .error_sink(Box::new(manager::CountErrors))
        .build_unchecked(manager)
}

pub(super) fn pool_error(after: Duration) -> impl Fn(RunError<StoreError>) -> StoreError {
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
            node_addresses: Vec::new(),
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
}
