//! [`TestDatabase`]: a fresh, migrated database for one test or one command.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio_postgres::NoTls;

use super::cluster::TempPostgres;
use super::error::{EmbeddedError, EmbeddedErrorKind};
use tokenlease::store::migrate;

/// The environment variable naming an existing server to use instead of a [`TempPostgres`].
pub const DATABASE_URL_ENV: &str = "DATABASE_URL";

/// How long `Drop` may spend dropping a database on a `DATABASE_URL` server.
const DROP_TIMEOUT: Duration = Duration::from_secs(5);

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A database for one test or one command: on `DATABASE_URL`'s server when that variable is
/// set, else on a new [`TempPostgres`] owned by this value. Either way it is a fresh database
/// (`CREATE DATABASE` with a unique name, `tokenlease_test_<pid>_<seq>_<time>`) with the
/// migrations applied.
///
/// Dropping it drops the database: with `DATABASE_URL`, by a best-effort
/// `DROP DATABASE … WITH (FORCE)` (bounded to a few seconds, on a helper thread, so it is safe
/// inside a tokio runtime); otherwise by removing the whole throwaway cluster.
///
/// Only plain TCP without TLS is supported (`NoTls`): point `DATABASE_URL` at a local or
/// trusted server.
#[derive(Debug)]
pub struct TestDatabase {
    /// The throwaway cluster, when `DATABASE_URL` was not set. Stopped and removed when this
    /// value is dropped.
    server: Option<TempPostgres>,
    /// `DATABASE_URL`, when it was used; the database is dropped through it.
    admin: Option<String>,
    /// Name of the fresh database.
    name: String,
    /// Connection string to the fresh database.
    connection_string: String,
}

impl TestDatabase {
    /// Creates the database and applies the migrations. Starting a [`TempPostgres`] blocks, so
    /// that part runs on [`tokio::task::spawn_blocking`]: call this inside a tokio runtime
    /// (`#[tokio::test]` will do, current-thread or not).
    ///
    /// # Errors
    ///
    /// When the cluster cannot start (see [`TempPostgres::start`]), the server cannot be
    /// reached, or `CREATE DATABASE` or a migration fails.
    pub async fn create() -> Result<TestDatabase, EmbeddedError> {
        let name = unique_name();
        let url = std::env::var(DATABASE_URL_ENV)
            .ok()
            .filter(|u| !u.trim().is_empty());
        let (server, admin, admin_conn, connection_string) = match url {
            Some(url) => {
                let conn = with_dbname(&url, &name)?;
                (None, Some(url.clone()), url, conn)
            }
            None => {
                let server = tokio::task::spawn_blocking(TempPostgres::start)
                    .await
                    .map_err(|err| {
                        EmbeddedError::new(
                            EmbeddedErrorKind::Io,
                            format!("the task starting PostgreSQL failed: {err}"),
                        )
                    })??;
                let admin_conn = server.connection_string("postgres");
                let conn = server.connection_string(&name);
                (Some(server), None, admin_conn, conn)
            }
        };
        let db = TestDatabase {
            server,
            admin,
            name,
            connection_string,
        };
        // From here on, dropping `db` on error cleans up.
        let admin_client = connect(&admin_conn, "connect to create a test database").await?;
        admin_client
            .batch_execute(&format!("CREATE DATABASE {}", quote_ident(&db.name)))
            .await
            .map_err(|err| {
                EmbeddedError::database(format_args!("CREATE DATABASE {}", db.name), &err)
            })?;
        drop(admin_client);
        let mut client = db.client().await?;
        migrate(&mut client).await.map_err(|err| {
            EmbeddedError::new(
                EmbeddedErrorKind::Database,
                format!("could not migrate test database {}: {err}", db.name),
            )
        })?;
        Ok(db)
    }

    /// A connection string to the fresh database that `tokio_postgres::Config::from_str`
    /// reads: key=value form on a [`TempPostgres`], `DATABASE_URL` with the database name
    /// replaced otherwise.
    pub fn connection_string(&self) -> String {
        self.connection_string.clone()
    }

    /// The throwaway cluster, or `None` when `DATABASE_URL` was used. Fault tests that stop the
    /// server need one of their own then: [`TempPostgres::start`].
    pub fn server(&self) -> Option<&TempPostgres> {
        self.server.as_ref()
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Connects to the database without TLS and spawns the connection task with
    /// [`tokio::spawn`] (so call it inside a tokio runtime). The task ends when the client is
    /// dropped.
    ///
    /// # Errors
    ///
    /// When the server cannot be reached.
    pub async fn client(&self) -> Result<tokio_postgres::Client, EmbeddedError> {
        connect(
            &self.connection_string,
            &format!("connect to test database {}", self.name),
        )
        .await
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let Some(admin) = self.admin.clone() else {
            return; // the TempPostgres goes with its data directory
        };
        let sql = format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            quote_ident(&self.name)
        );
        // A runtime of its own on a thread of its own: Drop may run inside a runtime, where
        // blocking on another runtime would panic.
        let handle = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let _ = tokio::time::timeout(DROP_TIMEOUT, async {
                    if let Ok(client) = connect(&admin, "drop a test database").await {
                        let _ = client.batch_execute(&sql).await;
                    }
                })
                .await;
            });
        });
        let _ = handle.join();
    }
}

async fn connect(conn: &str, what: &str) -> Result<tokio_postgres::Client, EmbeddedError> {
    let (client, connection) = tokio_postgres::connect(conn, NoTls)
        .await
        .map_err(|err| EmbeddedError::database(format_args!("could not {what}"), &err))?;
    tokio::spawn(async move {
        // The connection ends with an error when the server goes away (fault tests do that on
        // purpose); the client reports it on its next call.
        let _ = connection.await;
    });
    Ok(client)
}

fn unique_name() -> String {
    let micros = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() % 1_000_000_000)
        .unwrap_or(0);
    format!(
        "tokenlease_test_{}_{}_{micros}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// `"name"` with `"` doubled.
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `conn` (a URL or key=value string) pointing at database `dbname` instead.
fn with_dbname(conn: &str, dbname: &str) -> Result<String, EmbeddedError> {
    let invalid = |why: &str| {
        EmbeddedError::new(
            EmbeddedErrorKind::InvalidInput,
            format!("{DATABASE_URL_ENV} is not a usable connection string: {why}"),
        )
    };
    if conn.parse::<tokio_postgres::Config>().is_err() {
        return Err(invalid("tokio-postgres cannot parse it"));
    }
    let Some((scheme, rest)) = conn.split_once("://") else {
        // key=value: a later key overrides an earlier one.
        let value = format!("'{}'", dbname.replace('\\', "\\\\").replace('\'', "\\'"));
        return Ok(format!("{conn} dbname={value}"));
    };
    if scheme != "postgres" && scheme != "postgresql" {
        return Err(invalid(
            "the URL scheme must be postgres:// or postgresql://",
        ));
    }
    // rest = authority [ "/" dbname ] [ "?" params ]
    let (before_query, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let authority = before_query.split('/').next().unwrap_or(before_query);
    let mut out = format!("{scheme}://{authority}/{}", percent_encode(dbname));
    if let Some(query) = query {
        // A `dbname=` parameter would override the path: drop it.
        let kept: Vec<&str> = query
            .split('&')
            .filter(|kv| !kv.starts_with("dbname="))
            .collect();
        if !kept.is_empty() {
            out.push('?');
            out.push_str(&kept.join("&"));
        }
    }
    Ok(out)
}

fn percent_encode(text: &str) -> String {
    let mut out = String::new();
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dbname_replaced_in_urls() {
        assert_eq!(
            with_dbname("postgres://u:p@h:5432/app?sslmode=disable", "t_1").unwrap(),
            "postgres://u:p@h:5432/t_1?sslmode=disable"
        );
        assert_eq!(
            with_dbname("postgresql://u@h", "t_1").unwrap(),
            "postgresql://u@h/t_1"
        );
        assert_eq!(
            with_dbname("postgres://u@h/app?dbname=x&application_name=a", "t").unwrap(),
            "postgres://u@h/t?application_name=a"
        );
    }

    #[test]
    fn dbname_replaced_in_key_value_strings() {
        let conn = with_dbname("host=127.0.0.1 user=postgres dbname=app", "t_1").unwrap();
        let config: tokio_postgres::Config = conn.parse().unwrap();
        assert_eq!(config.get_dbname(), Some("t_1"));
        assert_eq!(config.get_user(), Some("postgres"));
    }

    #[test]
    fn unique_names_differ() {
        assert_ne!(unique_name(), unique_name());
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    }
}
