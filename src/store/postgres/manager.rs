//! The pool's connection manager: connections opened within a bound, their driver tasks watched,
//! and connections whose statement was abandoned kept out of the pool.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::task::AbortHandle;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, NoTls, Statement};

use crate::store::{StoreError, TimeoutKind};

/// Makes the pool's connections, each within the store's connect timeout.
///
/// tokio-postgres's own `connect_timeout` bounds only the TCP connect. A hung server (a stopped
/// postmaster, D7) still has its kernel accept the connection and then never answers
/// the startup and login exchange, so without a bound on the whole setup a connection attempt
/// would hold a pool slot until the server resumed.
#[derive(Debug)]
pub(crate) struct ConnectionManager {
    config: tokio_postgres::Config,
    connect_timeout: Duration,
    /// The store's switch for prepared statements: while on, a new session prepares the
    /// statements of every decision before it joins the pool.
    prepare: Arc<AtomicBool>,
    /// Whether the store found a Citus coordinator: a session on it then prepares nothing (no
    /// decision goes through the coordinator).
    citus: Arc<AtomicBool>,
    /// On a Citus node's pool: the statements a new session prepares instead of the plain ones
    /// (that node's takes, which change with the shard map).
    node: Option<NodeStatements>,
}

/// The statements a new session on a Citus node prepares, and whether it runs each once with
/// empty arrays (its takes), shared with the store, which replaces them when the shard map
/// changes.
pub(super) type NodeStatements =
    Arc<parking_lot::RwLock<Vec<(&'static str, &'static [Type], bool)>>>;

impl ConnectionManager {
    /// Shares the store's Citus switch (set once the store has read the shard map).
    pub(super) fn citus(mut self, on: Arc<AtomicBool>) -> Self {
        self.citus = on;
        self
    }

    /// A manager for a Citus node's pool: a new session prepares `statements`.
    pub(super) fn node(mut self, statements: NodeStatements) -> Self {
        self.node = Some(statements);
        self
    }

    pub(super) fn new(
        config: tokio_postgres::Config,
        connect_timeout: Duration,
        prepare: Arc<AtomicBool>,
    ) -> Self {
        ConnectionManager {
            config,
            connect_timeout,
            prepare,
            citus: Arc::new(AtomicBool::new(false)),
            node: None,
        }
    }
}

/// A pooled connection: a [`Client`] (it derefs to one) and the task that drives its socket.
///
/// The driver task counts a connection that ends in an error
/// (`tokenlease_store_connection_errors_total`) instead of dropping the error. A connection
/// whose statement the store abandoned (its call timed out or was dropped) is marked discarded
/// and never goes back to the pool: the next caller must not queue behind that statement, nor
/// receive the cancel that was sent for it.
pub(crate) struct PgConnection {
    client: Client,
    driver: AbortHandle,
    discard: bool,
    /// The store's statements this session has prepared, by their text (a handful at most:
    /// one per file of `sql/`), when the store prepares them
    /// ([`PostgresStoreBuilder::prepared_statements`](super::PostgresStoreBuilder::prepared_statements)).
    prepared: parking_lot::Mutex<Vec<(&'static str, Statement)>>,
}

impl PgConnection {
    /// This session's prepared `statement`, if it prepared it.
    pub(super) fn prepared(&self, statement: &'static str) -> Option<Statement> {
        self.prepared
            .lock()
            .iter()
            .find(|(sql, _)| std::ptr::eq(*sql, statement))
            .map(|(_, prepared)| prepared.clone())
    }

    /// Keeps `prepared` as this session's `statement` (one call at a time uses a session, so
    /// it prepared `statement` only after finding it missing).
    pub(super) fn remember(&self, statement: &'static str, prepared: Statement) {
        self.prepared.lock().push((statement, prepared));
    }

    /// Forgets this session's prepared statements (the server refused one).
    pub(super) fn forget_prepared(&self) {
        self.prepared.lock().clear();
    }

    /// Whether the session has ended (the server closed it, or the link broke): known from the
    /// driver task, without a round trip.
    pub(super) fn is_closed(&self) -> bool {
        self.client.is_closed()
    }

    /// Keeps this connection out of the pool: it is closed when its pooled handle is dropped.
    pub(super) fn discard(&mut self) {
        self.discard = true;
    }

    /// Undoes [`discard`](Self::discard): the abandoned statement finished and nothing was sent
    /// to the session since, so it may go back to the pool.
    pub(super) fn keep(&mut self) {
        self.discard = false;
    }

    /// Stops the driver task, closing the socket at once (used when the server does not
    /// answer).
    pub(super) fn abort_driver(&self) {
        self.driver.abort();
    }
}

impl fmt::Debug for PgConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgConnection")
            .field("closed", &self.client.is_closed())
            .field("discard", &self.discard)
            .finish_non_exhaustive()
    }
}

impl Deref for PgConnection {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}

impl DerefMut for PgConnection {
    fn deref_mut(&mut self) -> &mut Client {
        &mut self.client
    }
}

/// Runs `connect` (TCP, startup, login) within `timeout`.
pub(super) async fn bounded<T>(
    timeout: Duration,
    connect: impl Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(timeout, connect).await {
        Ok(result) => result.map_err(StoreError::from),
        Err(_) => Err(StoreError::Timeout {
            kind: TimeoutKind::Connect,
            after: timeout,
        }),
    }
}

impl bb8::ManageConnection for ConnectionManager {
    type Connection = PgConnection;
    type Error = StoreError;

    async fn connect(&self) -> Result<PgConnection, StoreError> {
        let (client, connection) =
            bounded(self.connect_timeout, self.config.connect(NoTls)).await?;
        let driver = tokio::spawn(async move {
            if connection.await.is_err() {
                metrics::counter!(crate::metrics::STORE_CONNECTION_ERRORS).increment(1);
            }
        })
        .abort_handle();
        let conn = PgConnection {
            client,
            driver,
            discard: false,
            prepared: parking_lot::Mutex::new(Vec::new()),
        };
        if self.prepare.load(Ordering::Relaxed) {
            // Prepared before the session serves a call, so that no call pays for a prepare's
            // round trip (over a slow link that alone can exceed a call's timeout). The
            // statements go out together: one round trip in all. A failure here is no failure
            // of the connection: a call prepares (or sends unprepared) what is missing.
            let bound = self.connect_timeout;
            let (statements, runs): (Vec<(&'static str, &'static [Type])>, Vec<&'static str>) =
                match &self.node {
                    Some(node) => {
                        let node = node.read();
                        (
                            node.iter().map(|(sql, types, _)| (*sql, *types)).collect(),
                            node.iter().filter(|s| s.2).map(|s| s.0).collect(),
                        )
                    }
                    None if self.citus.load(Ordering::Relaxed) => (Vec::new(), Vec::new()),
                    None => (super::lean::warm_statements().to_vec(), Vec::new()),
                };
            let prepares = statements
                .iter()
                .map(|(sql, types)| conn.client.prepare_typed(sql, types));
            if let Ok(prepared) = tokio::time::timeout(bound, join_all(prepares)).await {
                for ((sql, _), result) in statements.iter().zip(prepared) {
                    if let Ok(statement) = result {
                        conn.remember(sql, statement);
                    }
                }
            }
            if !runs.is_empty() {
                // A Citus node's takes run once with no keys: the session plans each (its
                // generic plan, the only one it makes), compiles the shard guard and loads
                // Citus's metadata for the shards, before a call waits on any of it.
                let runs = runs.iter().filter_map(|sql| conn.prepared(sql));
                let no_text: Vec<&str> = Vec::new();
                let no_int: Vec<i64> = Vec::new();
                let runs = runs.map(|statement| {
                    let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = statement
                        .params()
                        .iter()
                        .map(|t| -> &(dyn tokio_postgres::types::ToSql + Sync) {
                            if *t == Type::TEXT_ARRAY {
                                &no_text
                            } else {
                                &no_int
                            }
                        })
                        .collect();
                    let client = &conn.client;
                    async move { client.query(&statement, &params).await }
                });
                let _ = tokio::time::timeout(bound, join_all(runs)).await;
            }
        }
        Ok(conn)
    }

    async fn is_valid(&self, conn: &mut PgConnection) -> Result<(), StoreError> {
        conn.client
            .simple_query("")
            .await
            .map(|_| ())
            .map_err(StoreError::from)
    }

    fn has_broken(&self, conn: &mut PgConnection) -> bool {
        conn.discard || conn.client.is_closed()
    }
}

/// Counts the connection errors the pool meets in the background (opening a connection no
/// caller waits for any more) in `tokenlease_store_connection_errors_total`, instead of bb8's
/// default of dropping them.
#[derive(Debug, Clone, Copy)]
pub(super) struct CountErrors;

impl bb8::ErrorSink<StoreError> for CountErrors {
    fn sink(&self, _error: StoreError) {
        metrics::counter!(crate::metrics::STORE_CONNECTION_ERRORS).increment(1);
    }

    fn boxed_clone(&self) -> Box<dyn bb8::ErrorSink<StoreError>> {
        Box::new(*self)
    }
}

pub(super) use crate::store::join_all;
