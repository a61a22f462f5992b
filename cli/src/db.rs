//! What the subcommands share about the database and the network: connection strings shown
//! with the password hidden, errors that name the address and keep their cause.

use std::error::Error;
use std::fmt;

pub(crate) use tokenlease::error::{chain, redact};

/// A database the command could not reach or use, with the address (password hidden) and the
/// whole cause.
#[derive(Debug)]
pub(crate) struct DatabaseError {
    /// What the command was doing: `connect to`, `migrate`, ...
    pub(crate) doing: &'static str,
    /// The connection string, redacted.
    pub(crate) address: String,
    /// The error and its causes.
    pub(crate) cause: String,
}

impl DatabaseError {
    /// `doing` the database at `conn` failed with `err`.
    pub(crate) fn new(doing: &'static str, conn: &str, err: &(dyn Error + 'static)) -> Self {
        DatabaseError {
            doing,
            address: redact(conn),
            cause: chain(err),
        }
    }
}

impl fmt::Display for DatabaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "could not {} the database at {}: {}",
            self.doing, self.address, self.cause
        )
    }
}

impl Error for DatabaseError {}

/// An address the command could not listen on.
#[derive(Debug)]
pub(crate) struct BindError {
    /// The address asked for.
    pub(crate) address: std::net::SocketAddr,
    /// The operating system's reason.
    pub(crate) cause: std::io::Error,
}

impl fmt::Display for BindError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "could not listen on {}: {}", self.address, self.cause)?;
        if self.cause.kind() == std::io::ErrorKind::AddrInUse {
            write!(
                f,
                " (another process holds the port; pick another with --listen, or port 0 for \
                 any free one)"
            )?;
        }
        Ok(())
    }
}

impl Error for BindError {}

/// A throwaway PostgreSQL, when no database was named; the command's connection string either
/// way. The cluster (if any) is stopped and removed when the first value is dropped.
pub(crate) type Database = (Option<tokenlease_testkit::TempPostgres>, String);

/// `url` when it is set and not blank; otherwise a throwaway PostgreSQL (saying so on stderr).
pub(crate) fn given_or_throwaway(url: Option<&str>) -> Result<Database, Box<dyn Error>> {
    match url.filter(|u| !u.trim().is_empty()) {
        Some(url) => Ok((None, url.to_owned())),
        None => {
            eprintln!("DATABASE_URL is not set: starting a throwaway PostgreSQL");
            let server = tokenlease_testkit::TempPostgres::start()?;
            let url = server.url();
            Ok((Some(server), url))
        }
    }
}
