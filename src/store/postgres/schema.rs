//! Which schema the store's statements need, and what the store does when the database has
//! another one: it says so once, loudly, and lets the fallback decide until the schema fits.
//!
//! The statements of this build read the tables as migration 0007 left them (integer columns,
//! `tokenlease_acquire_held`): [`OLDEST_SCHEMA`]. A database migrated further by a newer
//! release keeps what they need: every migration keeps the previous release's statements and
//! functions working, and removing something one of them uses waits for a later release
//! (docs/design/deploys.md). So the store never refuses to start over the schema: a database
//! behind [`OLDEST_SCHEMA`] (a deploy whose `migrate` step has not run yet) or one a much newer
//! release changed past what this build reads makes its statements fail with an error of the
//! SQL's names and types (SQLSTATE class 42: an undefined table, column, function or type, a
//! type mismatch). Those calls are decided by the plan's fallback like any other failed call,
//! and [`SchemaWatch`] tells the operator: one log event (`tracing`, level `ERROR`) when the
//! first such error is met, naming the schema the database has and the one this build needs,
//! one more (`INFO`) when a call succeeds again, and the counter
//! `tokenlease_store_schema_errors_total` for every call refused so. Once the schema fits (the
//! deploy's `migrate` ran), the next call is decided by the store again: no restart.

use std::sync::atomic::{AtomicBool, Ordering};

use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;

/// The oldest schema this build's statements work with: migration 0007 (integer columns,
/// `tokenlease_acquire_held`). Migration 0008 and later add nothing the statements read.
pub(crate) const OLDEST_SCHEMA: i64 = 7;

/// Whether the server refused a statement because a name or a type it uses is not what this
/// build expects: the schema is older or newer than the statements. Errors of a request's
/// values (class 22, 23) or of the connection are not: they are the key's or the server's.
pub(crate) fn is_schema_mismatch(error: &tokio_postgres::Error) -> bool {
    error.code().is_some_and(|code| {
        [
            SqlState::UNDEFINED_TABLE,
            SqlState::UNDEFINED_COLUMN,
            SqlState::UNDEFINED_FUNCTION,
            SqlState::UNDEFINED_OBJECT,
            SqlState::DATATYPE_MISMATCH,
            SqlState::CANNOT_COERCE,
            SqlState::INVALID_COLUMN_REFERENCE,
        ]
        .contains(code)
    })
}

/// Says once that the database's schema does not fit this build's statements, counts every
/// call refused for it, and says when it fits again. One per store, shared by its clones.
#[derive(Debug, Default)]
pub(crate) struct SchemaWatch {
    /// Set from the first refusal until a call succeeds: the log event is said once per spell.
    said: AtomicBool,
}

impl SchemaWatch {
    /// A call was refused for the schema (`error`, one [`is_schema_mismatch`] accepts):
    /// counted, and logged when it is the first since the store last answered.
    pub(crate) fn refused(&self, error: &tokio_postgres::Error) {
        metrics::counter!(crate::metrics::STORE_SCHEMA_ERRORS).increment(1);
        if !self.said.swap(true, Ordering::Relaxed) {
            let detail = super::super::error::describe(error);
            tracing::error!(
                oldest_schema = OLDEST_SCHEMA,
                "tokenlease: the database's schema is not one this build can use ({detail}); \
                 this build needs migration {OLDEST_SCHEMA:04} or later, with nothing removed \
                 that it reads. Until that is fixed every call is decided by the plan's \
                 fallback. Run this release's `tokenlease migrate` (or build the store with \
                 migrate(true)); if a newer release migrated the database, replace this \
                 instance. Counted in tokenlease_store_schema_errors_total"
            );
        }
    }

    /// A call succeeded: if the schema had been refused, say that it fits again.
    #[inline]
    pub(crate) fn answered(&self) {
        if self.said.load(Ordering::Relaxed) && self.said.swap(false, Ordering::Relaxed) {
            tracing::info!("tokenlease: the database's schema fits this build again");
        }
    }

    /// Checks the schema version recorded in `tokenlease_migrations` when the store was built
    /// without migrating: a database behind [`OLDEST_SCHEMA`] is logged at once (its calls will
    /// be refused and counted when they come), rather than at the first call. Reads nothing
    /// else; any error reading it is left to the calls to meet.
    pub(crate) async fn check(&self, client: &tokio_postgres::Client) {
        let version = match client
            .query_typed(
                super::sql::SCHEMA_VERSION.text,
                &[(&OLDEST_SCHEMA, Type::INT8)],
            )
            .await
        {
            Ok(rows) => rows
                .first()
                .and_then(|row| row.try_get::<_, Option<i64>>(0).ok().flatten())
                .unwrap_or(0),
            Err(e) if is_schema_mismatch(&e) => 0,
            Err(_) => return,
        };
        if version < OLDEST_SCHEMA && !self.said.swap(true, Ordering::Relaxed) {
            tracing::error!(
                schema = version,
                oldest_schema = OLDEST_SCHEMA,
                "tokenlease: the database is migrated to version {version} (0: not at all); this \
                 build needs migration {OLDEST_SCHEMA:04} or later. Until `tokenlease migrate` \
                 (or a store built with migrate(true)) brings it there, every call is decided \
                 by the plan's fallback; the store decides again once it has, without a restart"
            );
        }
    }
}
