//! The operating-system side: finding the server binaries, running them as the right OS user,
//! and small process helpers (liveness, kill) that need no `unsafe`.
//!
//! PostgreSQL refuses to run as root (`initdb`, `pg_ctl` and `postgres` all check). When this
//! process runs as root (CI does), every server program is started through
//! `runuser -u postgres --`, which needs no password and no sudo, and the files the server must
//! write are chowned to that user.

use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::error::{EmbeddedError, EmbeddedErrorKind};

/// The OS user the server runs as when this process is root.
pub(crate) const SERVER_OS_USER: &str = "postgres";

/// The PostgreSQL server installation in use.
#[derive(Debug)]
pub(crate) struct Binaries {
    /// The directory holding `initdb`, `pg_ctl`, `postgres` (and usually `pgbench`), with
    /// symlinks resolved.
    pub(crate) dir: PathBuf,
    /// The server version, e.g. `15.14`, as `pg_ctl --version` prints it.
    pub(crate) version: String,
}

impl Binaries {
    pub(crate) fn program(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The major version (15 for `15.14`), 0 when unknown.
    pub(crate) fn major(&self) -> u32 {
        self.version
            .split('.')
            .next()
            .and_then(|m| m.parse().ok())
            .unwrap_or(0)
    }
}

/// Finds the server binaries once per process: `initdb` and `pg_ctl` on `PATH`, then
/// `pg_config --bindir`, then the highest version under `/usr/lib/postgresql/*/bin`.
pub(crate) fn binaries() -> Result<&'static Binaries, EmbeddedError> {
    static FOUND: OnceLock<Result<Binaries, String>> = OnceLock::new();
    FOUND
        .get_or_init(find_binaries)
        .as_ref()
        .map_err(|message| EmbeddedError::new(EmbeddedErrorKind::BinariesNotFound, message.clone()))
}

fn has_server_programs(dir: &Path) -> bool {
    dir.join("initdb").is_file() && dir.join("pg_ctl").is_file()
}

fn find_binaries() -> Result<Binaries, String> {
    let dir = bin_dir_on_path()
        .or_else(bin_dir_from_pg_config)
        .or_else(bin_dir_from_debian_layout)
        .ok_or_else(|| {
            "no PostgreSQL server binaries found: looked for `initdb` and `pg_ctl` on PATH, in \
             `pg_config --bindir` and in /usr/lib/postgresql/*/bin. Install them (Debian/Ubuntu: \
             `apt-get install postgresql`; Fedora: `dnf install postgresql-server`; macOS: \
             `brew install postgresql`), or set DATABASE_URL to use an existing server"
                .to_string()
        })?;
    let pg_ctl = dir.join("pg_ctl");
    let output = Command::new(&pg_ctl)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|err| format!("could not run `{} --version`: {err}", pg_ctl.display()))?;
    let text = String::from_utf8_lossy(&output.stdout);
    // "pg_ctl (PostgreSQL) 15.14 (Debian 15.14-1.pgdg120+1)"
    let version = text
        .split_whitespace()
        .skip_while(|word| *word != "(PostgreSQL)")
        .nth(1)
        .map(|v| {
            v.chars()
                .filter(|c| c.is_ascii_alphanumeric() || *c == '.')
                .collect::<String>()
        })
        .filter(|v| !v.is_empty())
        .ok_or_else(|| {
            format!(
                "`{} --version` printed {:?}, not a PostgreSQL version",
                pg_ctl.display(),
                text.trim()
            )
        })?;
    Ok(Binaries { dir, version })
}

/// `pg_ctl` and `initdb` on PATH; the directory their symlinks resolve to, when that holds both
/// (so `bin_dir()` also finds `postgres` and `pgbench`, which Debian does not put on PATH).
fn bin_dir_on_path() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).find_map(|dir| {
        if !has_server_programs(&dir) {
            return None;
        }
        let resolved = fs::canonicalize(dir.join("pg_ctl"))
            .ok()
            .and_then(|p| p.parent().map(Path::to_path_buf));
        match resolved {
            Some(real) if has_server_programs(&real) => Some(real),
            _ => Some(dir),
        }
    })
}

fn bin_dir_from_pg_config() -> Option<PathBuf> {
    let output = Command::new("pg_config")
        .arg("--bindir")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    has_server_programs(&dir).then_some(dir)
}

fn bin_dir_from_debian_layout() -> Option<PathBuf> {
    let mut best: Option<(Vec<u32>, PathBuf)> = None;
    for entry in fs::read_dir("/usr/lib/postgresql").ok()?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(version) = name
            .split('.')
            .map(|part| part.parse::<u32>().ok())
            .collect::<Option<Vec<u32>>>()
        else {
            continue;
        };
        let dir = entry.path().join("bin");
        if !has_server_programs(&dir) {
            continue;
        }
        if best.as_ref().is_none_or(|(v, _)| version > *v) {
            best = Some((version, dir));
        }
    }
    best.map(|(_, dir)| dir)
}

/// Who runs the server programs.
#[derive(Debug)]
pub(crate) enum RunAs {
    /// This process is not root: run them directly.
    CurrentUser {
        /// Effective uid of this process.
        uid: u32,
    },
    /// This process is root: run them as [`SERVER_OS_USER`] through `runuser`.
    ServerUser {
        /// That user's uid.
        uid: u32,
        /// That user's primary gid.
        gid: u32,
        /// The `runuser` program.
        runuser: PathBuf,
    },
}

impl RunAs {
    /// The effective uid of this process (0 when root).
    pub(crate) fn own_uid(&self) -> u32 {
        match self {
            RunAs::CurrentUser { uid } => *uid,
            RunAs::ServerUser { .. } => 0,
        }
    }

    /// A command that runs `program` as the server's OS user.
    pub(crate) fn command(&self, program: &Path) -> Command {
        let mut cmd = match self {
            RunAs::CurrentUser { .. } => Command::new(program),
            RunAs::ServerUser { runuser, .. } => {
                let mut cmd = Command::new(runuser);
                cmd.args(["-u", SERVER_OS_USER, "--"]).arg(program);
                cmd
            }
        };
        cmd.stdin(Stdio::null());
        cmd
    }

    /// Gives `path` (not recursively) to the server's OS user; a no-op unless root.
    pub(crate) fn give(&self, path: &Path) -> Result<(), EmbeddedError> {
        match self {
            RunAs::CurrentUser { .. } => Ok(()),
            RunAs::ServerUser { uid, gid, .. } => {
                std::os::unix::fs::lchown(path, Some(*uid), Some(*gid)).map_err(|err| {
                    EmbeddedError::io(
                        format_args!(
                            "could not chown {} to the `{SERVER_OS_USER}` user",
                            path.display()
                        ),
                        &err,
                    )
                })
            }
        }
    }

    /// Checks that the server's OS user can reach `dir` (every ancestor must be searchable by
    /// it). Always true when not root.
    pub(crate) fn can_traverse(&self, dir: &Path) -> bool {
        let RunAs::ServerUser { uid, gid, .. } = self else {
            return true;
        };
        let Ok(dir) = fs::canonicalize(dir) else {
            return false;
        };
        dir.ancestors().all(|a| match fs::metadata(a) {
            Ok(meta) => {
                let mode = meta.mode();
                (meta.uid() == *uid && mode & 0o100 != 0)
                    || (meta.gid() == *gid && mode & 0o010 != 0)
                    || mode & 0o001 != 0
            }
            Err(_) => false,
        })
    }
}

/// Decides once per process whether server programs need `runuser`.
pub(crate) fn run_as() -> Result<&'static RunAs, EmbeddedError> {
    static RUN_AS: OnceLock<Result<RunAs, String>> = OnceLock::new();
    RUN_AS
        .get_or_init(find_run_as)
        .as_ref()
        .map_err(|message| EmbeddedError::new(EmbeddedErrorKind::NoServerUser, message.clone()))
}

fn find_run_as() -> Result<RunAs, String> {
    let uid = effective_uid()
        .ok_or("could not tell this process's user id (read /proc/self/status, ran `id -u`)")?;
    if uid != 0 {
        return Ok(RunAs::CurrentUser { uid });
    }
    let (server_uid, gid) = lookup_user(SERVER_OS_USER).ok_or_else(|| {
        format!(
            "running as root, and PostgreSQL refuses to run as root, but there is no \
             `{SERVER_OS_USER}` OS user to run it as: install the server package \
             (`apt-get install postgresql` creates it) or `useradd --system {SERVER_OS_USER}`"
        )
    })?;
    let runuser = find_program(
        "runuser",
        &["/usr/sbin/runuser", "/sbin/runuser", "/usr/bin/runuser"],
    )
    .ok_or_else(|| {
        format!(
            "running as root, so the server must run as `{SERVER_OS_USER}`, but `runuser` \
                 (util-linux) was not found"
        )
    })?;
    Ok(RunAs::ServerUser {
        uid: server_uid,
        gid,
        runuser,
    })
}

/// The effective uid, from `/proc/self/status` (no `unsafe` needed), else `id -u`.
fn effective_uid() -> Option<u32> {
    if let Ok(status) = fs::read_to_string("/proc/self/status") {
        // "Uid:\treal\teffective\tsaved\tfs"
        let euid = status
            .lines()
            .find_map(|line| line.strip_prefix("Uid:"))
            .and_then(|rest| rest.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok());
        if euid.is_some() {
            return euid;
        }
    }
    command_u32(Command::new("id").arg("-u"))
}

/// uid and primary gid of `user`, from `/etc/passwd`, else `id`.
fn lookup_user(user: &str) -> Option<(u32, u32)> {
    if let Ok(passwd) = fs::read_to_string("/etc/passwd") {
        for line in passwd.lines() {
            let fields: Vec<&str> = line.split(':').collect();
            if fields.len() >= 4
                && fields[0] == user
                && let (Ok(uid), Ok(gid)) = (fields[2].parse(), fields[3].parse())
            {
                return Some((uid, gid));
            }
        }
    }
    let uid = command_u32(Command::new("id").args(["-u", user]))?;
    let gid = command_u32(Command::new("id").args(["-g", user]))?;
    Some((uid, gid))
}

fn command_u32(cmd: &mut Command) -> Option<u32> {
    let output = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    String::from_utf8_lossy(&output.stdout).trim().parse().ok()
}

fn find_program(name: &str, fallbacks: &[&str]) -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    });
    on_path.or_else(|| fallbacks.iter().map(PathBuf::from).find(|p| p.is_file()))
}

/// Runs `cmd` and returns its output, or an error naming `what` and the program's own words.
pub(crate) fn run(cmd: &mut Command, what: &str) -> Result<Output, EmbeddedError> {
    let output = cmd.output().map_err(|err| {
        EmbeddedError::io(
            format_args!("{what}: could not run {}", describe(cmd)),
            &err,
        )
    })?;
    if output.status.success() {
        Ok(output)
    } else {
        Err(EmbeddedError::new(
            EmbeddedErrorKind::Command,
            format!(
                "{what}: {} failed ({}): {}",
                describe(cmd),
                output.status,
                program_output(&output)
            ),
        ))
    }
}

/// The program's stderr and stdout, trimmed, for error messages.
pub(crate) fn program_output(output: &Output) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let text = format!("{}\n{}", stderr.trim(), stdout.trim());
    let text = text.trim();
    if text.is_empty() {
        "no output".to_string()
    } else {
        text.to_string()
    }
}

fn describe(cmd: &Command) -> String {
    let mut words = vec![cmd.get_program().to_string_lossy().into_owned()];
    words.extend(
        cmd.get_args()
            .map(|a: &OsStr| a.to_string_lossy().into_owned()),
    );
    format!("`{}`", words.join(" "))
}

/// Whether process `pid` exists, or `None` where `/proc` is not available.
pub(crate) fn process_alive(pid: u32) -> Option<bool> {
    if !Path::new("/proc/self").exists() {
        return None;
    }
    // A zombie still has a /proc entry but is gone for our purposes.
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => Some(
            stat.rsplit_once(')')
                .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
                .unwrap_or(true),
        ),
        Err(_) => Some(false),
    }
}

/// Whether `pid` is a postmaster serving `data_dir` (guards against a reused pid).
pub(crate) fn is_postmaster_of(pid: u32, data_dir: &Path) -> bool {
    let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let data = data_dir.as_os_str().as_encoded_bytes();
    cmdline.split(|b| *b == 0).any(|arg| arg == data)
}

/// Sends SIGKILL to `pid` with `kill(1)` (this crate forbids `unsafe`, so no libc call) and
/// waits up to `wait` for it to be gone.
pub(crate) fn kill_hard(pid: u32, wait: Duration) {
    signal("KILL", &[pid]);
    wait_gone(pid, wait);
}

/// Waits up to `wait` until process `pid` has exited (a zombie counts as exited).
pub(crate) fn wait_gone(pid: u32, wait: Duration) {
    let deadline = Instant::now() + wait;
    while process_alive(pid) == Some(true) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Sends SIGCONT to `pid` and its direct children, so that a shutdown can proceed even if a
/// fault test stopped them with SIGSTOP. Unconditionally: a SIGSTOP still pending (the target
/// not yet scheduled on a busy machine) does not show in `/proc` yet, and SIGCONT discards it.
/// Harmless to running processes. Linux only; a no-op elsewhere.
pub(crate) fn resume_stopped(pid: u32) {
    let mut targets = vec![pid];
    targets.extend(children(pid));
    signal("CONT", &targets);
}

/// The direct children of `pid`, read from `/proc/*/stat` (empty where there is no `/proc`).
pub(crate) fn children(pid: u32) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let Some(p) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ..."; comm may contain spaces, so split after the last ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u32>().ok());
        if ppid == Some(pid) {
            found.push(p);
        }
    }
    found
}

/// `kill -<name> <pids>` with `kill(1)` (no libc call: this crate forbids `unsafe`). A pid that
/// has exited since it was listed is skipped by kill(1), which does not matter here. Returns
/// whether kill(1) ran and reported success.
pub(crate) fn signal(name: &str, pids: &[u32]) -> bool {
    if pids.is_empty() {
        return true;
    }
    Command::new("kill")
        .arg(format!("-{name}"))
        .args(pids.iter().map(u32::to_string))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|status| status.success())
        .unwrap_or(false)
}
