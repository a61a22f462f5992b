//! [`EmbeddedError`]: why a throwaway cluster could not be made, started, stopped or used.

use std::fmt;

/// What kind of step failed; see [`EmbeddedError::kind`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EmbeddedErrorKind {
    /// No PostgreSQL server binaries (`initdb`, `pg_ctl`, `postgres`) were found. The message
    /// says how to install them.
    BinariesNotFound,
    /// Running as root, but the `postgres` OS user (or `runuser`) that the server must run as is
    /// missing. PostgreSQL refuses to run as root.
    NoServerUser,
    /// A file system step failed (temp dir, template copy, config file, removal).
    Io,
    /// A server program (`initdb`, `pg_ctl`) ran and reported failure.
    Command,
    /// The server did not become ready, or did not stop, in time.
    Timeout,
    /// Connecting to the server, creating a database or applying migrations failed.
    Database,
    /// A caller-supplied value cannot be used (a malformed setting name or value, a malformed
    /// `DATABASE_URL`).
    InvalidInput,
}

/// A throwaway PostgreSQL could not be created, started, stopped or used.
///
/// The message is complete on its own: it names the step, the program or path involved, the
/// underlying cause and, where the server wrote one, the tail of the server log. When no server
/// binaries exist it says how to install them.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct EmbeddedError {
    kind: EmbeddedErrorKind,
    message: String,
}

impl EmbeddedError {
    pub(crate) fn new(kind: EmbeddedErrorKind, message: impl Into<String>) -> Self {
        EmbeddedError {
            kind,
            message: message.into(),
        }
    }

    /// An I/O failure while doing `what`.
    pub(crate) fn io(what: impl fmt::Display, err: &std::io::Error) -> Self {
        EmbeddedError::new(EmbeddedErrorKind::Io, format!("{what}: {err}"))
    }

    /// A database failure while doing `what`; prints the server's own message when there is one.
    pub(crate) fn database(what: impl fmt::Display, err: &tokio_postgres::Error) -> Self {
        let detail = match (err.as_db_error(), std::error::Error::source(err)) {
            (Some(db), _) => format!("{db} (SQLSTATE {})", db.code().code()),
            (None, Some(source)) => format!("{err}: {source}"),
            (None, None) => err.to_string(),
        };
        EmbeddedError::new(EmbeddedErrorKind::Database, format!("{what}: {detail}"))
    }

    /// What kind of step failed.
    pub fn kind(&self) -> EmbeddedErrorKind {
        self.kind
    }
}
