//! Store errors, classified so the limiter can tell a slow store from a broken one, and
//! `MigrateError`, why applying the migrations failed.

use std::fmt;
#[cfg(feature = "postgres")]
use std::sync::Arc;
use std::time::Duration;

/// Which wait ran out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TimeoutKind {
    /// Waiting for a pooled connection (the pool was exhausted or could not connect in time).
    Pool,
    /// The whole call, from asking the pool to reading the reply.
    Call,
    /// Opening a connection: TCP connect, startup and login together.
    Connect,
    /// Applying the migrations when the store was built (the builder's `migrate_timeout`).
    Migrate,
}

impl fmt::Display for TimeoutKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TimeoutKind::Pool => "waiting for a pooled connection",
            TimeoutKind::Call => "the store call",
            TimeoutKind::Connect => "connecting to the database",
            TimeoutKind::Migrate => "migrating the database",
        })
    }
}

/// A store call failed; the limiter's fallback decides what that means for the request.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A wait ran out. The statement may still have run on the server (its tokens then count
    /// as spent); the server's own `statement_timeout` stops it soon after.
    #[error("timed out after {after:?} {kind}")]
    Timeout {
        /// Which wait.
        kind: TimeoutKind,
        /// How long it waited.
        after: Duration,
    },
    /// The connection failed or was closed (server down, reset, terminated backend).
    ///
    /// The message carries every cause (`connection to the store failed: error connecting to
    /// server: Connection refused (os error 111)`), so it is whole when printed alone;
    /// [`source`](std::error::Error::source) gives the driver's error for inspection. Neither
    /// holds the connection string, so no password is printed.
    #[cfg(feature = "postgres")]
    #[error("connection to the store failed: {}", crate::report::chain(.0.as_ref()))]
    Connection(#[source] Arc<tokio_postgres::Error>),
    /// The database refused the statement.
    #[error("database error {code}: {message}")]
    Database {
        /// SQLSTATE, e.g. `57014` for a cancelled statement.
        code: String,
        /// The server's message.
        message: String,
    },
    /// The connection string given to
    /// [`PostgresStore::builder`](crate::store::PostgresStore::builder) does not parse. The
    /// message quotes it with any password hidden, and says what is wrong.
    #[cfg(feature = "postgres")]
    #[error("invalid connection string {0}")]
    InvalidConnectionString(String),
    /// The store answered with something this version cannot read (a schema mismatch).
    #[error("unexpected reply from the store: {0}")]
    Protocol(String),
    /// Applying the migrations failed while the store was built. The [`MigrateError`] names
    /// what failed: the migration (version and description) or the bookkeeping step.
    ///
    /// [`MigrateError`]: crate::store::MigrateError
    #[cfg(feature = "postgres")]
    #[error("migrating the database failed: {0}")]
    Migrate(#[source] Arc<MigrateError>),
    /// The store holds as many keys as it may ([`MemoryStore::max_keys`]), none of them idle:
    /// a request for a new key is refused rather than evicting a bucket that is not full
    /// (which would refill it and admit more than the limit). Transient: buckets refill and
    /// become evictable.
    ///
    /// [`MemoryStore::max_keys`]: crate::store::MemoryStore::max_keys
    #[error("the store holds its maximum of {max_keys} keys and none is idle")]
    TooManyKeys {
        /// The bound.
        max_keys: usize,
    },
    /// The store cannot hold this one request's values, so it was not sent: a key with a
    /// character the database's encoding lacks, or an amount, capacity or rate beyond what
    /// the table holds. Only this request fails; the others of the same call are decided
    /// (see "Per-key answers" on [`Store`](crate::store::Store)). Not transient: the same
    /// request fails the same way again.
    #[error("key {key:?} cannot be stored: {why}")]
    Unstorable {
        /// The request's key.
        key: String,
        /// What about it the store cannot hold.
        why: Unstorable,
    },
    /// A circuit breaker ([`CircuitBreaker`](crate::store::CircuitBreaker)) is open after
    /// repeated failures: the call was not sent to the store at all.
    #[error("circuit open after repeated store failures; next probe in {retry_in:?}")]
    CircuitOpen {
        /// How long until the breaker lets a probe call through.
        retry_in: Duration,
    },
}

impl StoreError {
    /// Whether retrying later may succeed: timeouts, connection failures, an open circuit
    /// breaker, a memory store at its key bound, and database errors of the classes that mean "not now" (connection exceptions,
    /// insufficient resources, operator intervention such as a shutdown or a cancelled
    /// statement, lock timeouts, serialisation failures and deadlocks).
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Timeout { .. }
            | StoreError::CircuitOpen { .. }
            | StoreError::TooManyKeys { .. } => true,
            #[cfg(feature = "postgres")]
            StoreError::Connection(_) => true,
            StoreError::Database { code, .. } => {
                let class = code.get(..2).unwrap_or("");
                matches!(class, "08" | "53" | "57" | "40") || code == "55P03"
            }
            StoreError::Protocol(_) | StoreError::Unstorable { .. } => false,
            #[cfg(feature = "postgres")]
            StoreError::InvalidConnectionString(_) => false,
            #[cfg(feature = "postgres")]
            StoreError::Migrate(_) => false,
        }
    }

    /// Whether the database refused the statement for the values it was sent rather than for
    /// the connection, the server or the time: SQLSTATE class 22 (data exception), 23
    /// (integrity constraint violation) and 54 (program limit exceeded). (A type mismatch,
    /// 42804, is not: the store binds every parameter with its type, so it means the schema
    /// changed under the statement, which every key meets alike; docs/design/deploys.md.) Such an error in a many-key statement belongs to one key or a few, so the
    /// store sends the keys again in smaller statements until only the bad ones fail (see
    /// "Per-key answers" on [`Store`](crate::store::Store)); a retry of the same statement
    /// would fail the same way.
    pub fn is_data_error(&self) -> bool {
        match self {
            StoreError::Database { code, .. } => {
                matches!(code.get(..2), Some("22" | "23" | "54"))
            }
            _ => false,
        }
    }

    /// The SQLSTATE, when the database refused the statement.
    pub fn code(&self) -> Option<&str> {
        match self {
            StoreError::Database { code, .. } => Some(code),
            _ => None,
        }
    }
}

/// What a store cannot hold of one request ([`StoreError::Unstorable`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unstorable {
    /// The key holds a character that the database's encoding has no code for (a key is
    /// sent as UTF-8 text and the server converts it to its own encoding).
    #[error("the character {ch:?} at byte {offset} is not in the database's encoding {encoding}")]
    Character {
        /// The character.
        ch: char,
        /// Its byte offset in the key.
        offset: usize,
        /// The database's `server_encoding`.
        encoding: String,
    },
    /// The key holds a NUL byte, which no PostgreSQL text value can hold.
    #[error("a NUL byte at byte {offset}")]
    Nul {
        /// Its byte offset in the key.
        offset: usize,
    },
    /// The bucket's capacity is above what the store holds.
    #[error("capacity {capacity} is above the {max} tokens the store holds")]
    Capacity {
        /// The request's capacity.
        capacity: crate::bucket::Tokens,
        /// The store's largest capacity.
        max: crate::bucket::Tokens,
    },
    /// The bucket's refill rate is above what the store holds.
    #[error("a refill rate of {rate} tokens a second is above the {max} the store holds")]
    Rate {
        /// The request's rate, in tokens per second.
        rate: crate::bucket::Tokens,
        /// The store's largest rate.
        max: crate::bucket::Tokens,
    },
    /// A return's amount is above what the store holds (no bucket holds more).
    #[error("a return of {amount} tokens is above the {max} tokens the store holds")]
    Amount {
        /// The return's amount.
        amount: crate::bucket::Tokens,
        /// The largest amount.
        max: crate::bucket::Tokens,
    },
}

#[cfg(feature = "postgres")]
impl From<tokio_postgres::Error> for StoreError {
    fn from(err: tokio_postgres::Error) -> Self {
        if let Some(db) = err.as_db_error() {
            return StoreError::Database {
                code: db.code().code().to_owned(),
                message: db.message().to_owned(),
            };
        }
        if err.is_closed() || std::error::Error::source(&err).is_some() {
            return StoreError::Connection(Arc::new(err));
        }
        StoreError::Protocol(err.to_string())
    }
}

#[cfg(feature = "postgres")]
/// Why [`migrate`](crate::store::migrate) failed. Messages include the server's own error text.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrateError {
    /// A migration was applied with different SQL than this build embeds: its file was edited
    /// after it was released.
    #[error(
        "migration {version} ({description}) was applied with checksum {applied}, but this build \
         has checksum {expected}: the file was changed after it was applied; restore it and put \
         the change in a new migration"
    )]
    ChecksumMismatch {
        /// The version whose checksums differ.
        version: i64,
        /// Its description.
        description: &'static str,
        /// The checksum recorded in the database.
        applied: String,
        /// The checksum of the embedded SQL.
        expected: String,
    },
    /// A migration's SQL failed; its transaction was rolled back.
    #[error("migration {version} ({description}) failed and was rolled back: {detail}")]
    Apply {
        /// The failing version.
        version: i64,
        /// Its description.
        description: &'static str,
        /// The server's error, with SQLSTATE.
        detail: String,
        /// The underlying error, for [`tokio_postgres::Error::code`]; also the error's
        /// [`source`](std::error::Error::source).
        #[source]
        error: tokio_postgres::Error,
    },
    /// Reading or writing the bookkeeping (`tokenlease_migrations`, the advisory lock, the
    /// transaction itself) failed, e.g. the connection broke.
    #[error("could not {step}: {detail}")]
    Database {
        /// What was being done.
        step: &'static str,
        /// The server's error, with SQLSTATE.
        detail: String,
        /// The underlying error; also the error's [`source`](std::error::Error::source).
        #[source]
        error: tokio_postgres::Error,
    },
    /// A function file's SQL failed; its transaction was rolled back, and the functions are as
    /// they were.
    #[error("function file {file} failed and was rolled back: {detail}")]
    Function {
        /// The file's name (`functions/<file>.sql`).
        file: &'static str,
        /// The server's error, with SQLSTATE.
        detail: String,
        /// The underlying error; also the error's [`source`](std::error::Error::source).
        #[source]
        error: tokio_postgres::Error,
    },
    /// The role lacks a privilege migrating needs: `CREATE` on the schema, or ownership of the
    /// tables once they exist (SQLSTATE 42501). A service that runs as a role without them
    /// leaves migrating to a role that has them (a deploy step, `tokenlease migrate`) and builds
    /// its stores with
    /// [`PostgresStoreBuilder::migrate(false)`](crate::store::PostgresStoreBuilder::migrate);
    /// docs/roles.md has both roles' grants.
    #[error(
        "the role {role:?} cannot migrate: it lacks {missing} ({detail}); migrate as the role \
         that owns the schema (e.g. `tokenlease migrate` with its DATABASE_URL), and build the \
         stores of a role without that privilege with PostgresStoreBuilder::migrate(false) \
         (docs/roles.md)"
    )]
    Privilege {
        /// The role that tried (`current_user`).
        role: String,
        /// What it lacks, e.g. `CREATE on schema "public"`.
        missing: String,
        /// The server's error, with SQLSTATE.
        detail: String,
        /// The underlying error; also the error's [`source`](std::error::Error::source).
        #[source]
        error: tokio_postgres::Error,
    },
    /// The migration list itself is malformed (versions not strictly increasing, or ≤ 0).
    #[error("invalid migration list: {0}")]
    InvalidList(String),
    /// The database is a Citus coordinator whose Citus version this build does not support:
    /// nothing was distributed. See `SUPPORTED_CITUS` in the Citus module.
    #[error(
        "the database runs Citus {version}, which tokenlease does not support (supported: Citus \
         {supported}); the tables were left as they are"
    )]
    UnsupportedCitus {
        /// The `citus` extension's version, as `pg_extension.extversion` gives it.
        version: String,
        /// The supported range, in words.
        supported: String,
    },
}

#[cfg(feature = "postgres")]
impl MigrateError {
    /// The underlying PostgreSQL error, when there is one.
    pub fn db_error(&self) -> Option<&tokio_postgres::Error> {
        match self {
            MigrateError::Apply { error, .. }
            | MigrateError::Database { error, .. }
            | MigrateError::Privilege { error, .. }
            | MigrateError::Function { error, .. } => Some(error),
            _ => None,
        }
    }

    pub(super) fn database(
        step: &'static str,
    ) -> impl FnOnce(tokio_postgres::Error) -> MigrateError {
        move |error| MigrateError::Database {
            step,
            detail: describe(&error),
            error,
        }
    }
}

#[cfg(feature = "postgres")]
/// The server's error with its SQLSTATE, or the driver's with its cause.
pub(super) fn describe(error: &tokio_postgres::Error) -> String {
    match (error.as_db_error(), std::error::Error::source(error)) {
        (Some(db), _) => format!("{db} (SQLSTATE {})", db.code().code()),
        (None, Some(source)) => format!("{error}: {source}"),
        (None, None) => error.to_string(),
    }
}
