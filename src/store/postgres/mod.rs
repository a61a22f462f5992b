//! PostgreSQL store.
pub mod migrate;
