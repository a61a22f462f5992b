//! [`TempPostgres`]: one throwaway cluster in a temp dir, and its builder.

use std::collections::hash_map::RandomState;
use std::fmt::Write as _;
use std::fs;
use std::hash::{BuildHasher, Hasher};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::error::{EmbeddedError, EmbeddedErrorKind};
use super::os::{self, Binaries, RunAs};
use super::template;

/// Prefix of each cluster's directory name in the temp dir: `tokenlease-pg-<pid>-<seq>`.
pub(crate) const CLUSTER_PREFIX: &str = "tokenlease-pg-";

/// The address the server listens on (loopback only).
const HOST: &str = "127.0.0.1";

/// How many free ports to try when the chosen one turns out to be taken.
const START_ATTEMPTS: usize = 5;

/// Default for [`TempPostgresBuilder::start_timeout`].
const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(10);

/// How long `Drop` lets `pg_ctl stop -m immediate` take before killing the postmaster.
const DROP_STOP_TIMEOUT_SECS: u32 = 5;

/// How a server is stopped; the `pg_ctl stop -m` modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StopMode {
    /// `-m fast`: roll back open transactions, disconnect clients, write a checkpoint, exit.
    Fast,
    /// `-m immediate`: quit at once, like a crash; the next start runs WAL recovery. Committed
    /// transactions survive (the cluster runs with `fsync` and `synchronous_commit` on).
    Immediate,
}

impl StopMode {
    fn as_arg(self) -> &'static str {
        match self {
            StopMode::Fast => "fast",
            StopMode::Immediate => "immediate",
        }
    }
}

/// Builds a [`TempPostgres`] with extra settings. See the [module docs](super).
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `start` is called"]
pub struct TempPostgresBuilder {
    settings: Vec<(String, String)>,
    template_cache: bool,
    start_timeout: Duration,
}

impl Default for TempPostgresBuilder {
    fn default() -> Self {
        TempPostgresBuilder {
            settings: Vec::new(),
            template_cache: true,
            start_timeout: DEFAULT_START_TIMEOUT,
        }
    }
}

impl TempPostgresBuilder {
    /// Adds a `postgresql.conf` line `name = 'value'`, after (so overriding) the defaults listed
    /// in the [module docs](super). The value is written quoted, as PostgreSQL accepts for every
    /// setting: pass it unquoted, e.g. `.setting("max_connections", "50")` or
    /// `.setting("statement_timeout", "100ms")`.
    ///
    /// A name other than letters, digits, `_` and `.`, or a value with a line break, makes
    /// [`start`](Self::start) fail with [`EmbeddedErrorKind::InvalidInput`].
    pub fn setting(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.push((name.into(), value.into()));
        self
    }

    /// Whether to copy a cached, initdb'ed template instead of running `initdb` (about 1 s).
    /// Defaults to `true`; a failing copy falls back to `initdb` anyway.
    pub fn template_cache(mut self, enabled: bool) -> Self {
        self.template_cache = enabled;
        self
    }

    /// How long to wait for the server to accept connections, per start attempt (also used by
    /// [`TempPostgres::start_again`] and [`TempPostgres::stop`]). Defaults to 10 s; whole seconds
    /// (rounded up), as `pg_ctl -t` takes them.
    pub fn start_timeout(mut self, timeout: Duration) -> Self {
        self.start_timeout = timeout;
        self
    }

    /// Creates and starts the cluster. Blocking; see [`TempPostgres::start`].
    ///
    /// # Errors
    ///
    /// See [`TempPostgres::start`]; also [`EmbeddedErrorKind::InvalidInput`] for a malformed
    /// [`setting`](Self::setting).
    pub fn start(self) -> Result<TempPostgres, EmbeddedError> {
        for (name, value) in &self.settings {
            validate_setting(name, value)?;
        }
        let bins = os::binaries()?;
        let run_as = os::run_as()?;
        let temp_root = template::temp_root(run_as)?;
        remove_leftovers(&temp_root);

        let root = temp_root.join(format!("{CLUSTER_PREFIX}{}", template::unique_suffix()));
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&root)
            .map_err(|err| {
                EmbeddedError::io(
                    format_args!("could not create temp dir {}", root.display()),
                    &err,
                )
            })?;
        // From here on, dropping `pg` (on any error below) removes the directory.
        let mut pg = TempPostgres {
            data_dir: root.join("data"),
            root,
            port: 0,
            bin_dir: bins.dir.clone(),
            timeout_secs: u32::try_from(self.start_timeout.as_millis().div_ceil(1000))
                .unwrap_or(u32::MAX)
                .max(1),
            run_as,
            bins,
        };
        run_as.give(&pg.root)?;
        template::fresh_data_dir(bins, run_as, &temp_root, &pg.data_dir, self.template_cache)?;
        pg.write_hba()?;
        append_file(
            &pg.data_dir.join("postgresql.conf"),
            "\n# Added by tokenlease_testkit: the settings of this throwaway cluster.\ninclude = 'tokenlease.conf'\n",
        )?;

        let mut last_error = None;
        for _ in 0..START_ATTEMPTS {
            pg.port = free_port()
                .map_err(|err| EmbeddedError::io("could not find a free loopback port", &err))?;
            pg.write_settings(&self.settings)?;
            match pg.pg_ctl_start() {
                Ok(()) => return Ok(pg),
                Err(StartFailure::PortTaken(err)) => last_error = Some(err),
                Err(StartFailure::Other(err)) => return Err(err),
            }
        }
        Err(last_error.unwrap_or_else(|| {
            EmbeddedError::new(EmbeddedErrorKind::Command, "could not start PostgreSQL")
        }))
    }
}

fn validate_setting(name: &str, value: &str) -> Result<(), EmbeddedError> {
    let name_ok = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    if !name_ok {
        return Err(EmbeddedError::new(
            EmbeddedErrorKind::InvalidInput,
            format!("invalid PostgreSQL setting name {name:?}"),
        ));
    }
    if value.contains(['\n', '\r', '\0']) {
        return Err(EmbeddedError::new(
            EmbeddedErrorKind::InvalidInput,
            format!("the value of PostgreSQL setting {name} contains a line break or NUL"),
        ));
    }
    Ok(())
}

/// `'value'` with `'` doubled, as postgresql.conf quotes strings.
fn conf_quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

fn append_file(path: &Path, text: &str) -> Result<(), EmbeddedError> {
    use std::io::Write;
    fs::OpenOptions::new()
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|err| EmbeddedError::io(format_args!("could not write {}", path.display()), &err))
}

/// A loopback port that was free a moment ago.
///
/// Tries random ports below the kernel's ephemeral range first: an ephemeral port can be taken
/// by some client socket's local end while the server is stopped, and then
/// [`TempPostgres::start_again`] could not bind it again. Falls back to `bind(127.0.0.1:0)`.
fn free_port() -> std::io::Result<u16> {
    let ephemeral_low = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .next()
                .and_then(|v| v.parse::<u16>().ok())
        })
        .unwrap_or(32768);
    const LOW: u16 = 15000;
    if ephemeral_low > LOW + 1000 {
        let span = u64::from(ephemeral_low - LOW);
        for _ in 0..20 {
            let mut hasher = RandomState::new().build_hasher();
            hasher.write_u32(std::process::id());
            hasher.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0),
            );
            let port = LOW + u16::try_from(hasher.finish() % span).unwrap_or(0);
            if TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)).is_ok() {
                return Ok(port);
            }
        }
    }
    let listener = TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0))?;
    Ok(listener.local_addr()?.port())
}

/// Removes what dead processes left behind in `temp_root`: clusters (`tokenlease-pg-<pid>-…`,
/// whose postmaster is killed first) and half-built templates (`….tmp-<pid>-…`). A directory is
/// left alone unless the pid in its name is certainly gone. Best effort: errors are ignored.
fn remove_leftovers(temp_root: &Path) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = fs::read_dir(temp_root) else {
        return;
    };
    let me = std::process::id();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let owner = if let Some(rest) = name.strip_prefix(template::TEMPLATE_PREFIX) {
            rest.split_once(".tmp-")
                .and_then(|(_, tail)| tail.split('-').next())
        } else if let Some(rest) = name.strip_prefix(CLUSTER_PREFIX) {
            rest.split('-').next()
        } else {
            continue;
        };
        let Some(pid) = owner.and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me || os::process_alive(pid) != Some(false) {
            continue;
        }
        let dir = entry.path();
        let data = dir.join("data");
        if let Some(pm) = read_postmaster_pid(&data)
            && os::is_postmaster_of(pm, &data)
        {
            os::kill_hard(pm, Duration::from_secs(2));
        }
        let _ = fs::remove_dir_all(&dir);
    }
}

/// Reads the postmaster's pid from `data_dir/postmaster.pid`.
pub(crate) fn read_postmaster_pid(data_dir: &Path) -> Option<u32> {
    fs::read_to_string(data_dir.join("postmaster.pid"))
        .ok()?
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()
}

enum StartFailure {
    /// The port was taken between choosing it and the server binding it: try another.
    PortTaken(EmbeddedError),
    Other(EmbeddedError),
}

/// A throwaway PostgreSQL cluster: its own data directory in a temp dir, its own loopback port,
/// stopped and deleted on drop. See the [module docs](super) for the settings it runs with.
///
/// Every method blocks (it runs `pg_ctl` and waits). Async code may call them directly in tests,
/// or through [`tokio::task::spawn_blocking`].
#[derive(Debug)]
pub struct TempPostgres {
    /// The temp dir holding everything: `data/`, `server.log`, the Unix socket. Removed on drop.
    root: PathBuf,
    /// `root/data`, the cluster's data directory.
    data_dir: PathBuf,
    /// The loopback TCP port, fixed for the life of the cluster (kept across restarts).
    port: u16,
    /// Where `pg_ctl`, `postgres`, `pgbench` are.
    bin_dir: PathBuf,
    /// `pg_ctl -t`: seconds to wait for start or stop.
    timeout_secs: u32,
    /// Who runs the server programs (the `postgres` OS user when this process is root).
    run_as: &'static RunAs,
    bins: &'static Binaries,
}

/// # Creating
impl TempPostgres {
    /// Creates a cluster with the default settings and starts it. Blocking: about 0.3 s with
    /// the template cache warm, about 1.5 s the first time on a machine.
    ///
    /// # Errors
    ///
    /// [`EmbeddedErrorKind::BinariesNotFound`] when no server binaries are installed (the
    /// message says how to install them); [`EmbeddedErrorKind::NoServerUser`] when running as
    /// root without a `postgres` OS user; otherwise the failing step, with the tail of the
    /// server log when the server itself failed.
    pub fn start() -> Result<TempPostgres, EmbeddedError> {
        TempPostgres::builder().start()
    }

    /// A builder for a cluster with extra `postgresql.conf` settings.
    pub fn builder() -> TempPostgresBuilder {
        TempPostgresBuilder::default()
    }
}

/// # Connecting
impl TempPostgres {
    /// The address the server listens on: always `127.0.0.1`.
    pub fn host(&self) -> &str {
        HOST
    }

    /// The TCP port; the same after [`stop`](Self::stop) and [`start_again`](Self::start_again).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A key=value connection string for database `dbname` as the superuser `postgres` (trust
    /// authentication, no password), e.g. `host=127.0.0.1 port=15432 user=postgres
    /// dbname=postgres`. `tokio_postgres::Config::from_str` and libpq both read it.
    pub fn connection_string(&self, dbname: &str) -> String {
        format!(
            "host={HOST} port={} user=postgres dbname={}",
            self.port,
            quote_conn_value(dbname)
        )
    }

    /// A URL for the `postgres` database, e.g. `postgres://postgres@127.0.0.1:15432/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@{HOST}:{}/postgres", self.port)
    }

    /// The directory holding the Unix socket, when the server has one (its path must be short
    /// enough for `sun_path`), for `psql -h` or `pgbench -h`.
    pub fn socket_dir(&self) -> Option<&Path> {
        socket_dir_fits(&self.root).then_some(self.root.as_path())
    }
}

/// # Stopping and starting
impl TempPostgres {
    /// Stops the server with `pg_ctl stop -m <mode>` and waits until it has exited. The data
    /// directory stays; [`start_again`](Self::start_again) brings the same cluster back.
    ///
    /// # Errors
    ///
    /// When `pg_ctl` fails, e.g. because the server is not running.
    pub fn stop(&self, mode: StopMode) -> Result<(), EmbeddedError> {
        let mut cmd = self.pg_ctl();
        cmd.args(["stop", "-D"])
            .arg(&self.data_dir)
            .args(["-m", mode.as_arg(), "-w", "-t"])
            .arg(self.timeout_secs.to_string());
        os::run(
            &mut cmd,
            &format!("could not stop PostgreSQL on port {}", self.port),
        )
        .map(|_| ())
    }

    /// Starts the stopped server again: same data, same port. After an immediate stop this
    /// runs crash recovery first; it returns once the server accepts connections.
    ///
    /// # Errors
    ///
    /// When the server does not start (e.g. it is already running, or the port was taken
    /// meanwhile), with the tail of the server log.
    pub fn start_again(&self) -> Result<(), EmbeddedError> {
        self.pg_ctl_start().map_err(|failure| match failure {
            StartFailure::PortTaken(err) | StartFailure::Other(err) => err,
        })
    }

    /// [`stop`](Self::stop) with `mode`, then [`start_again`](Self::start_again).
    ///
    /// # Errors
    ///
    /// As those two.
    pub fn restart(&self, mode: StopMode) -> Result<(), EmbeddedError> {
        self.stop(mode)?;
        self.start_again()
    }

    /// The postmaster's pid from `postmaster.pid`, or `None` when the server is not running.
    /// Fault tests can signal it (`kill -STOP`); never find server processes by name.
    pub fn postmaster_pid(&self) -> Option<u32> {
        let pid = read_postmaster_pid(&self.data_dir)?;
        match os::process_alive(pid) {
            Some(false) => None,
            _ => Some(pid),
        }
    }
}

/// # Hanging the server
impl TempPostgres {
    /// Stops the whole server with SIGSTOP: the postmaster first (so it forks nothing new),
    /// then every process it has forked (backends, checkpointer, WAL writer, ...). The kernel
    /// still accepts TCP connections and acknowledges bytes, but nothing answers: a hung
    /// server, not a dead one. The processes continue with SIGCONT when the returned
    /// [`Suspended`] is resumed or dropped (and when this cluster is dropped). Linux only
    /// (children are found through `/proc`).
    ///
    /// # Errors
    ///
    /// [`EmbeddedErrorKind::Command`] when the server is not running or `kill(1)` fails.
    pub fn suspend(&self) -> Result<Suspended, EmbeddedError> {
        let Some(postmaster) = self.postmaster_pid() else {
            return Err(EmbeddedError::new(
                EmbeddedErrorKind::Command,
                format!(
                    "cannot suspend PostgreSQL on port {}: it is not running",
                    self.port
                ),
            ));
        };
        if !os::signal("STOP", &[postmaster]) {
            return Err(EmbeddedError::new(
                EmbeddedErrorKind::Command,
                format!(
                    "kill -STOP {postmaster} (the postmaster on port {}) failed",
                    self.port
                ),
            ));
        }
        let mut pids = vec![postmaster];
        let children = os::children(postmaster);
        os::signal("STOP", &children);
        pids.extend(children);
        Ok(Suspended { pids })
    }
}

/// Server processes stopped by [`TempPostgres::suspend`]; they get SIGCONT on
/// [`resume`](Self::resume) or drop, so a failing test never leaves a hung server behind.
#[derive(Debug)]
#[must_use = "the server continues as soon as this is dropped"]
pub struct Suspended {
    pids: Vec<u32>,
}

impl Suspended {
    /// How many processes were stopped (the postmaster included).
    pub fn processes(&self) -> usize {
        self.pids.len()
    }

    /// Lets every stopped process continue (SIGCONT).
    pub fn resume(mut self) {
        os::signal("CONT", &std::mem::take(&mut self.pids));
    }
}

impl Drop for Suspended {
    fn drop(&mut self) {
        os::signal("CONT", &self.pids);
    }
}

/// # Files
impl TempPostgres {
    /// The cluster's data directory.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The directory of the server binaries in use: `pg_ctl`, `postgres`, `pgbench`, `psql`
    /// (where the installation has them).
    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// The server log (`pg_ctl -l`): everything the server wrote, including errors with their
    /// SQLSTATE (`log_line_prefix` contains `%e`).
    pub fn log_path(&self) -> PathBuf {
        self.root.join("server.log")
    }

    /// The server log so far; empty when it cannot be read.
    pub fn log_contents(&self) -> String {
        fs::read(self.log_path())
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_default()
    }

    /// The PostgreSQL version, e.g. `15.14`.
    pub fn version(&self) -> &str {
        &self.bins.version
    }
}

impl TempPostgres {
    fn pg_ctl(&self) -> std::process::Command {
        let mut cmd = self.run_as.command(&self.bins.program("pg_ctl"));
        cmd.current_dir(&self.root);
        cmd
    }

    fn write_hba(&self) -> Result<(), EmbeddedError> {
        let path = self.data_dir.join("pg_hba.conf");
        let text = "# Written by tokenlease_testkit: a throwaway cluster reachable only from this \
                    machine, no passwords.\n\
                    local all         all              trust\n\
                    local replication all              trust\n\
                    host  all         all 127.0.0.1/32 trust\n\
                    host  replication all 127.0.0.1/32 trust\n";
        fs::write(&path, text).map_err(|err| {
            EmbeddedError::io(format_args!("could not write {}", path.display()), &err)
        })
    }

    /// Writes `tokenlease.conf` (included from postgresql.conf): defaults, port, then `extra`.
    fn write_settings(&self, extra: &[(String, String)]) -> Result<(), EmbeddedError> {
        let socket_dir = if socket_dir_fits(&self.root) {
            self.root.to_string_lossy().into_owned()
        } else {
            String::new()
        };
        let mut text = String::from(
            "# Written by tokenlease_testkit for a throwaway cluster.\n\
             # Durable on purpose: crash tests (pg_ctl stop -m immediate) must keep committed rows.\n\
             fsync = on\n\
             synchronous_commit = on\n\
             full_page_writes = on\n\
             max_connections = 200\n\
             listen_addresses = '127.0.0.1'\n\
             logging_collector = off\n\
             log_min_messages = warning\n\
             log_min_error_statement = error\n\
             log_line_prefix = '%m [%p] %q%a %e '\n\
             log_timezone = 'UTC'\n\
             timezone = 'UTC'\n\
             lc_messages = 'C'\n",
        );
        if self.bins.major() >= 14 {
            // Crash recovery first fsyncs every file of the data directory, and a fresh copy of
            // the template is all dirty pages: one syncfs() instead of ~1,000 fsync()s turns a
            // multi-second restart after `-m immediate` into a fraction of a second on a busy
            // disk. Just as durable.
            text.push_str("recovery_init_sync_method = syncfs\n");
        }
        let _ = writeln!(text, "port = {}", self.port);
        let _ = writeln!(
            text,
            "unix_socket_directories = {}",
            conf_quote(&socket_dir)
        );
        if !extra.is_empty() {
            text.push_str("# From TempPostgresBuilder::setting.\n");
        }
        for (name, value) in extra {
            let _ = writeln!(text, "{name} = {}", conf_quote(value));
        }
        let path = self.data_dir.join("tokenlease.conf");
        fs::write(&path, text).map_err(|err| {
            EmbeddedError::io(format_args!("could not write {}", path.display()), &err)
        })?;
        self.run_as.give(&path)
    }

    fn pg_ctl_start(&self) -> Result<(), StartFailure> {
        let log_path = self.log_path();
        let log_offset = fs::metadata(&log_path).map(|m| m.len()).unwrap_or(0);
        let mut cmd = self.pg_ctl();
        cmd.args(["start", "-D"])
            .arg(&self.data_dir)
            .arg("-l")
            .arg(&log_path)
            .args(["-w", "-t"])
            .arg(self.timeout_secs.to_string());
        let output = cmd.output().map_err(|err| {
            StartFailure::Other(EmbeddedError::io(
                format_args!("could not run {}", self.bins.program("pg_ctl").display()),
                &err,
            ))
        })?;
        if output.status.success() {
            return Ok(());
        }
        let log = fs::read(&log_path).unwrap_or_default();
        let this_attempt =
            String::from_utf8_lossy(log.get(log_offset as usize..).unwrap_or_default())
                .into_owned();
        let timed_out = String::from_utf8_lossy(&output.stdout).contains("did not start in time")
            || String::from_utf8_lossy(&output.stderr).contains("did not start in time");
        if timed_out {
            // Do not leave a server starting behind us.
            let _ = self.stop(StopMode::Immediate);
        }
        let kind = if timed_out {
            EmbeddedErrorKind::Timeout
        } else {
            EmbeddedErrorKind::Command
        };
        let err = EmbeddedError::new(
            kind,
            format!(
                "could not start PostgreSQL {} in {} on port {}: {}\n--- server log (last lines) ---\n{}",
                self.bins.version,
                self.data_dir.display(),
                self.port,
                os::program_output(&output),
                tail_lines(&this_attempt, 20)
            ),
        );
        if this_attempt.contains("Address already in use") {
            Err(StartFailure::PortTaken(err))
        } else {
            Err(StartFailure::Other(err))
        }
    }
}

impl Drop for TempPostgres {
    /// Stops the server at once (SIGCONT first if a test stopped it with SIGSTOP, then
    /// `pg_ctl stop -m immediate`; if that fails, SIGKILL to the postmaster) and removes the
    /// temp dir. Never panics; errors are ignored.
    fn drop(&mut self) {
        if let Some(pid) = read_postmaster_pid(&self.data_dir)
            && os::process_alive(pid) != Some(false)
        {
            // A fault test may have SIGSTOPped the server; a stopped server cannot stop.
            if os::is_postmaster_of(pid, &self.data_dir) {
                os::resume_stopped(pid);
            }
            let mut cmd = self.pg_ctl();
            cmd.args(["stop", "-D"])
                .arg(&self.data_dir)
                .args(["-m", "immediate", "-w", "-t"])
                .arg(DROP_STOP_TIMEOUT_SECS.to_string())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null());
            let stopped = cmd.status().map(|s| s.success()).unwrap_or(false);
            if !stopped && os::is_postmaster_of(pid, &self.data_dir) {
                os::kill_hard(pid, Duration::from_secs(2));
            }
            // pg_ctl returns once postmaster.pid is gone, a moment before the process is.
            os::wait_gone(pid, Duration::from_secs(2));
        }
        if fs::remove_dir_all(&self.root).is_err() {
            // A backend may still have been writing a file while the tree was removed.
            std::thread::sleep(Duration::from_millis(100));
            let _ = fs::remove_dir_all(&self.root);
        }
    }
}

/// Whether `dir/.s.PGSQL.NNNNN` fits in `sockaddr_un.sun_path` (108 bytes with the NUL).
fn socket_dir_fits(dir: &Path) -> bool {
    dir.as_os_str().len() + "/.s.PGSQL.65535".len() < 107
}

/// Quotes a connection-string value when it needs it (libpq key=value syntax).
fn quote_conn_value(value: &str) -> String {
    if !value.is_empty()
        && value
            .chars()
            .all(|c| !c.is_whitespace() && c != '\'' && c != '\\')
    {
        value.to_string()
    } else {
        format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
    }
}

fn tail_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(n);
    let tail = lines[start..].join("\n");
    if tail.trim().is_empty() {
        "(empty)".to_string()
    } else {
        tail
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conn_values_are_quoted_only_when_needed() {
        assert_eq!(quote_conn_value("tokenlease_test_1"), "tokenlease_test_1");
        assert_eq!(quote_conn_value("a b"), "'a b'");
        assert_eq!(quote_conn_value("it's"), "'it\\'s'");
        assert_eq!(quote_conn_value(""), "''");
    }

    #[test]
    fn settings_are_validated_and_quoted() {
        assert!(validate_setting("max_connections", "200").is_ok());
        assert!(validate_setting("auto_explain.log_min_duration", "0").is_ok());
        assert!(validate_setting("bad name", "1").is_err());
        assert!(validate_setting("x", "1\nfsync = off").is_err());
        assert_eq!(conf_quote("it's"), "'it''s'");
    }

    #[test]
    fn handles_can_be_shared_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<TempPostgres>();
        assert_send_sync::<TempPostgresBuilder>();
    }

    #[test]
    fn free_port_is_bindable() {
        let port = free_port().expect("a free port");
        assert_ne!(port, 0);
        TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)).expect("still free");
    }
}
