//! Fresh data directories: a copy of a cached, initdb'ed template cluster, or `initdb` itself.
//!
//! `initdb` takes about a second; copying its result takes a few tens of milliseconds. The
//! template lives at `<temp dir>/tokenlease-pg-template-<version>-<uid>` and is never started:
//! it is only copied. It is built under a temporary name and renamed into place, so it either
//! exists whole or not at all, and a lock file (created with `O_EXCL`) keeps parallel test
//! processes from building it at the same time. A lock left by a process that died is broken.
//! Any failure along the way falls back to running `initdb` for the new cluster.

use std::fs;
use std::io::{ErrorKind, Write};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use super::error::EmbeddedError;
use super::os::{self, Binaries, RunAs, SERVER_OS_USER};

/// How long to wait for another process to finish building the template before giving up on
/// the cache (and running `initdb` directly).
const TEMPLATE_LOCK_WAIT: Duration = Duration::from_secs(60);

/// A lock file older than this is assumed abandoned even if its pid is alive (pid reuse).
const TEMPLATE_LOCK_STALE: Duration = Duration::from_secs(120);

/// Prefix of the template directory's name; see the module docs.
pub(crate) const TEMPLATE_PREFIX: &str = "tokenlease-pg-template-";

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A name no other directory of this process uses: `<prefix><pid>-<seq>`.
pub(crate) fn unique_suffix() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// Makes `dest` (which must not exist) a fresh, never-started data directory owned by the
/// server's OS user: a copy of the template when `use_cache`, else (or when that fails) `initdb`.
pub(crate) fn fresh_data_dir(
    bins: &Binaries,
    run_as: &RunAs,
    temp_root: &Path,
    dest: &Path,
    use_cache: bool,
) -> Result<(), EmbeddedError> {
    if use_cache && let Ok(template) = ensure_template(bins, run_as, temp_root) {
        if copy_dir(&template, dest).is_ok() && dest.join("PG_VERSION").is_file() {
            return Ok(());
        }
        let _ = fs::remove_dir_all(dest);
    }
    initdb(bins, run_as, dest)
}

/// Runs `initdb` into `dest`, which is created (mode 0700, owned by the server's OS user).
pub(crate) fn initdb(bins: &Binaries, run_as: &RunAs, dest: &Path) -> Result<(), EmbeddedError> {
    fs::DirBuilder::new()
        .mode(0o700)
        .create(dest)
        .map_err(|err| {
            EmbeddedError::io(
                format_args!("could not create data directory {}", dest.display()),
                &err,
            )
        })?;
    run_as.give(dest)?;
    let mut cmd = run_as.command(&bins.program("initdb"));
    cmd.arg("-D")
        .arg(dest)
        .args([
            "--username",
            "postgres",
            "--auth",
            "trust",
            "--encoding",
            "UTF8",
            "--locale",
            "C",
            // The data only has to survive a server crash, not an OS crash: skip the fsyncs.
            "--no-sync",
            // 1 MB WAL segments instead of 16 MB: a 3× smaller directory to copy per cluster.
            "--wal-segsize=1",
        ])
        .current_dir(dest.parent().unwrap_or(Path::new("/")));
    os::run(
        &mut cmd,
        &format!(
            "could not initialise a PostgreSQL cluster in {}",
            dest.display()
        ),
    )?;
    Ok(())
}

/// `cp -a src dest`: keeps modes and, when root, the server user's ownership.
fn copy_dir(src: &Path, dest: &Path) -> Result<(), EmbeddedError> {
    let mut cmd = Command::new("cp");
    cmd.arg("-a")
        .arg(src)
        .arg(dest)
        .stdin(std::process::Stdio::null());
    os::run(&mut cmd, "could not copy the template cluster").map(|_| ())
}

/// The template directory for this server version and user, building it if needed.
pub(crate) fn ensure_template(
    bins: &Binaries,
    run_as: &RunAs,
    temp_root: &Path,
) -> Result<PathBuf, EmbeddedError> {
    let template = temp_root.join(format!(
        "{TEMPLATE_PREFIX}{}-{}",
        bins.version,
        run_as.own_uid()
    ));
    if template.join("PG_VERSION").is_file() {
        return Ok(template);
    }
    let lock_path = temp_root.join(format!(
        "{TEMPLATE_PREFIX}{}-{}.lock",
        bins.version,
        run_as.own_uid()
    ));
    let deadline = Instant::now() + TEMPLATE_LOCK_WAIT;
    let _lock = loop {
        if template.join("PG_VERSION").is_file() {
            return Ok(template);
        }
        match LockFile::try_create(&lock_path) {
            Ok(Some(lock)) => break lock,
            Ok(None) => {
                if Instant::now() >= deadline {
                    return Err(EmbeddedError::new(
                        super::EmbeddedErrorKind::Timeout,
                        format!(
                            "gave up waiting for {} (another process is building the template)",
                            lock_path.display()
                        ),
                    ));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(err) => return Err(err),
        }
    };
    // We hold the lock: nobody else is building. Check again, then build and publish.
    if template.join("PG_VERSION").is_file() {
        return Ok(template);
    }
    if template.exists() {
        // Half a template (someone removed files from it): rebuild it.
        let _ = fs::remove_dir_all(&template);
    }
    let building = temp_root.join(format!(
        "{TEMPLATE_PREFIX}{}-{}.tmp-{}",
        bins.version,
        run_as.own_uid(),
        unique_suffix()
    ));
    if let Err(err) = initdb(bins, run_as, &building) {
        let _ = fs::remove_dir_all(&building);
        return Err(err);
    }
    if let Err(err) = fs::rename(&building, &template) {
        let _ = fs::remove_dir_all(&building);
        if template.join("PG_VERSION").is_file() {
            return Ok(template);
        }
        return Err(EmbeddedError::io(
            format_args!("could not publish the template {}", template.display()),
            &err,
        ));
    }
    Ok(template)
}

/// An exclusive lock file holding the owner's pid; removed on drop.
#[derive(Debug)]
struct LockFile {
    path: PathBuf,
}

impl LockFile {
    /// `Ok(None)` when another live process holds the lock.
    fn try_create(path: &Path) -> Result<Option<LockFile>, EmbeddedError> {
        match fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
        {
            Ok(mut file) => {
                let _ = writeln!(file, "{}", std::process::id());
                Ok(Some(LockFile {
                    path: path.to_path_buf(),
                }))
            }
            Err(err) if err.kind() == ErrorKind::AlreadyExists => {
                if Self::is_abandoned(path) {
                    let _ = fs::remove_file(path);
                }
                Ok(None)
            }
            Err(err) => Err(EmbeddedError::io(
                format_args!("could not create lock file {}", path.display()),
                &err,
            )),
        }
    }

    fn is_abandoned(path: &Path) -> bool {
        let old = fs::metadata(path)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .is_some_and(|age| age > TEMPLATE_LOCK_STALE);
        let owner_dead = fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .and_then(os::process_alive)
            == Some(false);
        old || owner_dead
    }
}

impl Drop for LockFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// The directory new clusters go in: [`std::env::temp_dir`], or `/tmp` when running as root and
/// the `postgres` user cannot reach the former (e.g. `TMPDIR=/root/tmp`).
pub(crate) fn temp_root(run_as: &RunAs) -> Result<PathBuf, EmbeddedError> {
    let preferred = std::env::temp_dir();
    if run_as.can_traverse(&preferred) {
        return Ok(preferred);
    }
    let fallback = PathBuf::from("/tmp");
    if run_as.can_traverse(&fallback) {
        return Ok(fallback);
    }
    Err(EmbeddedError::new(
        super::EmbeddedErrorKind::NoServerUser,
        format!(
            "the `{SERVER_OS_USER}` OS user cannot reach the temp dir {} (nor /tmp): a parent \
             directory lacks search permission; set TMPDIR to a directory it can reach",
            preferred.display()
        ),
    ))
}
