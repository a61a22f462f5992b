//! The pool's connection manager: bb8-postgres's, with the whole connection setup bounded.

use std::time::Duration;

use bb8_postgres::PostgresConnectionManager;
use tokio_postgres::{Client, NoTls};

use crate::store::{StoreError, TimeoutKind};

/// Makes the pool's connections, each within the store's connect timeout.
///
/// tokio-postgres's own `connect_timeout` bounds only the TCP connect. A hung server (a stopped
/// postmaster, test plan D7) still has its kernel accept the connection and then never answers
/// the startup and login exchange, so without a bound on the whole setup a connection attempt
/// would hold a pool slot until the server resumed.
#[derive(Debug)]
pub struct ConnectionManager {
    inner: PostgresConnectionManager<NoTls>,
    connect_timeout: Duration,
}

impl ConnectionManager {
    pub(super) fn new(config: tokio_postgres::Config, connect_timeout: Duration) -> Self {
        ConnectionManager {
            inner: PostgresConnectionManager::new(config, NoTls),
            connect_timeout,
        }
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
    type Connection = Client;
    type Error = StoreError;

    async fn connect(&self) -> Result<Client, StoreError> {
        bounded(self.connect_timeout, self.inner.connect()).await
    }

    async fn is_valid(&self, conn: &mut Client) -> Result<(), StoreError> {
        self.inner.is_valid(conn).await.map_err(StoreError::from)
    }

    fn has_broken(&self, conn: &mut Client) -> bool {
        self.inner.has_broken(conn)
    }
}
