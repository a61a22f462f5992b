//! A role that lacks a privilege [`migrate`](super::migrate) needs gets an error naming the role
//! and what it lacks, and the way out, instead of the server's bare "permission denied".
//!
//! `migrate` creates and changes tables, types and functions: it needs `CREATE` on the schema
//! and, once the tables exist, to own them. A service that runs as a least-privilege role
//! (docs/roles.md) cannot migrate; it builds its store with
//! [`PostgresStoreBuilder::migrate(false)`](crate::store::PostgresStoreBuilder::migrate) and
//! leaves migrating to a deploy step that runs as the owner.

use tokio_postgres::error::SqlState;

use crate::store::error::MigrateError;

/// The role, its schema (the first of the search path that exists), whether it may create in
/// it, and who owns the bookkeeping table there (`NULL` before the first migration).
const PROBE: &str = super::super::sql::PRIVILEGE_PROBE.text;

/// `error` as [`MigrateError::Privilege`] when the server refused it for a privilege
/// (SQLSTATE 42501), with what the role lacks read from the catalog on `client`; any other
/// error unchanged. The failed transaction has been rolled back (its guard was dropped), so the
/// probe runs on a clean session; if the probe itself fails, the server's message alone says
/// what is missing.
pub(super) async fn explain(client: &tokio_postgres::Client, error: MigrateError) -> MigrateError {
    if error.db_error().and_then(tokio_postgres::Error::code)
        != Some(&SqlState::INSUFFICIENT_PRIVILEGE)
    {
        return error;
    }
    let (detail, error) = match error {
        MigrateError::Apply { detail, error, .. }
        | MigrateError::Database { detail, error, .. }
        | MigrateError::Function { detail, error, .. } => (detail, error),
        other => return other,
    };
    let probe = client.query_typed(PROBE, &[]).await.ok();
    let row = probe.as_ref().and_then(|rows| rows.first());
    let text = |i: usize| row.and_then(|r| r.try_get::<_, Option<String>>(i).ok().flatten());
    let role = text(0).unwrap_or_else(|| "(unknown)".to_owned());
    let can_create = row
        .and_then(|r| r.try_get::<_, bool>(2).ok())
        .unwrap_or(false);
    let missing = match (text(1), text(3)) {
        (None, _) if row.is_some() => {
            "a schema to create its tables in (no schema on the search_path exists)".to_owned()
        }
        (Some(schema), _) if !can_create => format!("CREATE on schema {schema:?}"),
        (_, Some(owner)) if owner != role => {
            format!("ownership of the tokenlease tables (they belong to {owner:?})")
        }
        _ => "a privilege on the tokenlease tables or functions".to_owned(),
    };
    MigrateError::Privilege {
        role,
        missing,
        detail,
        error,
    }
}
