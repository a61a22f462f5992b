//! Embedded PostgreSQL.
