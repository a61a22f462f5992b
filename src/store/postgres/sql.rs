//! The statements the store sends, each written in a file of `sql/` (and of `citus/sql/` for
//! the Citus nodes) and included at build time.

// language=SQL
pub(super) const DELETE_IDLE: &str = include_str!("sql/delete_idle.sql");
// language=SQL
pub(super) const INSPECT: &str = include_str!("sql/inspect.sql");

#[cfg(test)]
mod tests;
