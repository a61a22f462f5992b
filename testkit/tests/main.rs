//! The test kit: the throwaway PostgreSQL of `tokenlease_testkit` (start, connect, migrate,
//! stop, start again, crash-restart, drop; test databases; what a killed test process leaves).
//! Its own binary, as it will be its own crate. One module per former test binary.

mod embedded;
