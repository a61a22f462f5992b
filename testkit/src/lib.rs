//! A real, throwaway PostgreSQL server for tests, the CLI demo and the load test.
//!
//! [`TempPostgres`] creates a cluster in a temp dir from the locally installed server binaries,
//! starts it on a free loopback port, and stops and deletes it on drop. [`TestDatabase`] gives
//! one test a fresh, migrated database: on the server named by `DATABASE_URL` when that is set,
//! else on a new `TempPostgres`.
//!
//! ```no_run
//! use tokenlease_testkit::TempPostgres;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pg = TempPostgres::builder().setting("statement_timeout", "100ms").start()?;
//! let config: tokio_postgres::Config = pg.connection_string("postgres").parse()?;
//! # let _ = config;
//! // ... connect, run the test; `pg` is stopped and removed when dropped.
//! # Ok(())
//! # }
//! ```
//!
//! # Finding the server binaries
//!
//! `initdb` and `pg_ctl` on `PATH` (symlinks resolved, so [`TempPostgres::bin_dir`] also holds
//! `postgres` and `pgbench`), then `pg_config --bindir`, then the highest version under
//! `/usr/lib/postgresql/*/bin` (Debian keeps them off `PATH`). Without any, starting fails with
//! [`EmbeddedErrorKind::BinariesNotFound`], whose message says how to install them
//! (`apt-get install postgresql` on Debian) or to set `DATABASE_URL`. Nothing is skipped
//! silently.
//!
//! # Running as root
//!
//! PostgreSQL refuses to run as root. When this process's effective uid is 0 (read from
//! `/proc/self/status`, else `id -u`; this crate forbids `unsafe`, so no `geteuid()`), `initdb`
//! and `pg_ctl` run as the `postgres` OS user through `runuser -u postgres --` (no password, no
//! sudo needed), and the cluster's directory is chowned to that user. The temp dir must be
//! reachable by that user: when [`std::env::temp_dir`] is not (say `TMPDIR=/root/tmp`), `/tmp`
//! is used instead.
//!
//! # The cluster
//!
//! Everything lives in `<temp dir>/tokenlease-pg-<pid>-<seq>/`: `data/` (the data directory),
//! `server.log` ([`TempPostgres::log_path`]) and the Unix socket. Settings, written to
//! `data/tokenlease.conf`:
//!
//! - `listen_addresses = '127.0.0.1'`, a free port chosen by binding a probe socket (retried
//!   with another port if the server finds it taken), `unix_socket_directories` = the temp dir
//!   (empty when that path is too long for a socket);
//! - durable: `fsync`, `synchronous_commit` and `full_page_writes` on, so committed rows
//!   survive [`StopMode::Immediate`] (a crash); `recovery_init_sync_method = syncfs`
//!   (PostgreSQL 14+) so the restart after such a crash takes a fraction of a second instead of
//!   fsyncing each of a fresh cluster's ~1,000 files;
//! - `max_connections = 200`; trust authentication for loopback and the socket, user
//!   `postgres`, no password;
//! - logging to `server.log` through `pg_ctl -l` (`logging_collector = off`), with
//!   `log_line_prefix = '%m [%p] %q%a %e '` so tests can grep errors by SQLSTATE;
//! - `timezone` and `log_timezone` UTC, `lc_messages` C;
//! - then every [`TempPostgresBuilder::setting`], which override the above.
//!
//! # Speed: the template cache
//!
//! `initdb` takes about a second. The first cluster on a machine runs it once into
//! `<temp dir>/tokenlease-pg-template-<version>-<uid>` (built under a temporary name and renamed
//! into place, with a lock file so parallel test processes do not race); every cluster after
//! that is a `cp -a` of it, and starting takes a few hundred milliseconds. If the copy fails,
//! `initdb` runs instead. Directories left behind by killed test processes (whose pid is gone)
//! are removed, and their servers killed, the next time a cluster starts.
//!
//! # Blocking
//!
//! Every [`TempPostgres`] method blocks (it runs `pg_ctl` and waits). Tests may call them
//! directly, even inside `#[tokio::test]`; async code that must not block its runtime calls them
//! through [`tokio::task::spawn_blocking`]. [`TestDatabase::create`] is async and does that
//! itself.
//!
//! # Citus
//!
//! [`TempCitus`] starts a coordinator and N workers with the Citus extension (each a
//! [`TempPostgres`]), for the Citus tests and the CLI's `--citus N`.
//!
//! # Faults
//!
//! [`TempPostgres::stop`], [`start_again`](TempPostgres::start_again) and
//! [`restart`](TempPostgres::restart) stop the real server (`pg_ctl stop -m fast|immediate`)
//! and bring it back on the same port with the same data. [`TempPostgres::postmaster_pid`]
//! gives the pid to signal (e.g. `SIGSTOP`); never find server processes by name.
//!
//! # Measuring
//!
//! [`rig`] holds what the fault tests measure with: a log of the store calls that reached the
//! database ([`rig::CallLog`]), callers driven at a steady pace until a deadline
//! ([`rig::drive`]), and the figures read from them (percentiles of waits, calls and error
//! classes in a window, the time of recovery).

mod citus;
mod cluster;
mod error;
mod os;
mod proxy;
pub mod rig;
mod template;
mod test_database;

pub use self::citus::{TempCitus, TempCitusBuilder};
pub use self::cluster::{StopMode, Suspended, TempPostgres, TempPostgresBuilder};
pub use self::error::{EmbeddedError, EmbeddedErrorKind};
pub use self::proxy::FaultProxy;
pub use self::test_database::{DATABASE_URL_ENV, TestDatabase};
