//! Helpers of the tests that run `tokenlease demo` (the built binary) and look at it from
//! outside (plain HTTP, a browser, Prometheus): the demo process, a minimal HTTP client,
//! background traffic, and finding an outside program (skipped without it, unless `CI` is set).
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Whether this run is CI's (`CI` set to anything but empty, `0` or `false`): there a missing
/// outside program fails the test instead of skipping it.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
}

/// The program `name`: the first of `candidates` that exists, else `name` on `PATH`. Without
/// it: `None` after saying why (the caller returns: skipped), or a failure in CI.
pub fn outside_program(name: &str, candidates: &[&str], install: &str) -> Option<PathBuf> {
    let found = candidates
        .iter()
        .map(PathBuf::from)
        .chain(
            std::env::var_os("PATH")
                .iter()
                .flat_map(std::env::split_paths)
                .map(|dir| dir.join(name)),
        )
        .find(|p| p.is_file());
    if found.is_none() {
        let why = format!("{name} is not installed (install it with `{install}`)");
        assert!(!in_ci(), "{why}: CI=true requires it");
        eprintln!("skipped: {why}; CI=true makes this a failure");
    }
    found
}

/// Polls `done` every 100 ms until it returns `Some`, or fails after `limit` naming `what`.
pub fn wait_for<T>(what: &str, limit: Duration, done: impl FnMut() -> Option<T>) -> T {
    crate::common::eventually_blocking(Duration::from_millis(100), limit, what, done)
}

/// One HTTP response: status, header fields (lower-case names), body.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: HashMap<String, String>,
    pub body: String,
}

impl Reply {
    /// A header field's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    /// A header field that must be a whole number.
    pub fn number(&self, name: &str) -> u64 {
        self.header(name)
            .unwrap_or_else(|| panic!("no {name} in {self:?}"))
            .parse()
            .unwrap_or_else(|_| panic!("{name} is not a whole number in {self:?}"))
    }
}

/// One HTTP/1.1 request on its own connection, or `None` when the demo did not answer (within
/// 10 s) with a well-formed response.
pub fn exchange(addr: &str, method: &str, path: &str) -> Option<Reply> {
    exchange_with(addr, method, path, &[])
}

/// [`exchange`] with more header fields (`name`, `value`).
pub fn exchange_with(
    addr: &str,
    method: &str,
    path: &str,
    fields: &[(&str, &str)],
) -> Option<Reply> {
    let mut stream = TcpStream::connect(addr).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    let fields: String = fields
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{fields}Content-Length: 0\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Some(Reply {
        status,
        headers,
        body: body.to_owned(),
    })
}

/// [`exchange`], for a test that needs the answer: fails when there is none.
pub fn must(addr: &str, method: &str, path: &str) -> Reply {
    exchange(addr, method, path)
        .unwrap_or_else(|| panic!("{method} {path}: no well-formed answer within 10 s"))
}

/// [`exchange`]'s status and body.
pub fn request(addr: &str, method: &str, path: &str) -> Option<(u16, String)> {
    exchange(addr, method, path).map(|r| (r.status, r.body))
}

/// The running demo; SIGTERM (then SIGKILL) on drop.
pub struct Demo {
    child: Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// What it printed on stdout up to its `metrics:` line.
    pub banner: Vec<String>,
    /// Its stderr lines as they come, when started with [`Demo::start_with`] asking for them.
    stderr: Option<mpsc::Receiver<String>>,
}

impl Demo {
    /// Starts `tokenlease demo` on a free port and waits (60 s at most) for its banner.
    pub fn start() -> Demo {
        Demo::start_with::<&str>(&[], false)
    }

    /// [`start`](Self::start) with more arguments, and its stderr read line by line (echoed,
    /// and kept for [`expect_stderr`](Self::expect_stderr)) when `read_stderr`.
    pub fn start_with<S: AsRef<OsStr>>(args: &[S], read_stderr: bool) -> Demo {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tokenlease"))
            .args(["demo", "--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(if read_stderr {
                Stdio::piped()
            } else {
                Stdio::inherit()
            })
            .spawn()
            .expect("start tokenlease demo");
        let stderr = child.stderr.take().map(|err| {
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    eprintln!("demo: {line}");
                    let _ = tx.send(line);
                }
            });
            rx
        });
        let stdout = child.stdout.take().expect("the demo's stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                println!("demo: {line}");
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut banner = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx
                .recv_timeout(left)
                .expect("the demo prints where it listens within 60 s");
            let last = line.starts_with("metrics: ");
            banner.push(line);
            if last {
                break;
            }
        }
        let addr = banner
            .iter()
            .find_map(|l| l.strip_prefix("tokenlease demo listening on http://"))
            .expect("the listening line")
            .trim()
            .to_owned();
        Demo {
            child,
            addr,
            banner,
            stderr,
        }
    }

    /// Waits (20 s at most) for a stderr line containing every one of `parts`, and returns it.
    pub fn expect_stderr(&self, parts: &[&str]) -> String {
        self.expect_stderr_within(parts, Duration::from_secs(20))
    }

    /// [`expect_stderr`](Self::expect_stderr), waiting `limit` at most.
    pub fn expect_stderr_within(&self, parts: &[&str], limit: Duration) -> String {
        let lines = self.stderr.as_ref().expect("started with read_stderr");
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no stderr line with {parts:?} within {limit:?}"));
            if parts.iter().all(|p| line.contains(p)) {
                return line;
            }
        }
    }

    /// The demo's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends the demo a signal (`"HUP"`, `"TERM"`, ...).
    pub fn signal(&self, name: &str) {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill")
            .args([&format!("-{name}"), &pid])
            .status();
        assert!(sent.is_ok_and(|s| s.success()), "kill -{name} {pid}");
    }

    /// SIGTERM, then a clean exit within 20 s.
    pub fn stop(mut self) -> ExitStatus {
        self.signal("TERM");
        wait_for(
            "the demo's exit after SIGTERM",
            Duration::from_secs(20),
            || self.child.try_wait().expect("the demo's status"),
        )
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .status();
            let _ = crate::common::poll_until_blocking(
                Duration::from_millis(20),
                Duration::from_secs(2),
                || !matches!(self.child.try_wait(), Ok(None)),
            );
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Requests sent to the demo in the background until dropped: many bookings read once each
/// (allowed), one booking read over and over (denied by its entity limit after 20), one
/// booking's automation (denied after 5), and the booking list.
pub struct Traffic {
    stop: Arc<AtomicBool>,
    /// Answers 2xx, 429, anything else or none.
    counts: Arc<[AtomicU64; 3]>,
    threads: Vec<JoinHandle<()>>,
}

impl Traffic {
    /// Starts it against the demo at `addr`.
    pub fn start(addr: &str) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let counts: Arc<[AtomicU64; 3]> = Arc::new(Default::default());
        let run = std::process::id();
        let threads = (0..3)
            .map(|kind| {
                let (stop, counts, addr) =
                    (Arc::clone(&stop), Arc::clone(&counts), addr.to_owned());
                std::thread::spawn(move || {
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let (method, path) = match (kind, i % 4) {
                            (0, _) => ("GET", format!("/bookings/r{run}-{i}")),
                            (1, _) => ("GET", format!("/bookings/hot{run}")),
                            (_, 0) => ("GET", "/bookings".to_owned()),
                            _ => ("POST", format!("/bookings/hot{run}/automate/internal")),
                        };
                        let slot = match request(&addr, method, &path) {
                            Some((200..=299, _)) => 0,
                            Some((429, _)) => 1,
                            _ => 2,
                        };
                        counts[slot].fetch_add(1, Ordering::Relaxed);
                        // sleep: pacing, a request every 3 ms per thread.
                        std::thread::sleep(Duration::from_millis(3));
                    }
                })
            })
            .collect();
        Traffic {
            stop,
            counts,
            threads,
        }
    }

    /// Answers so far: (allowed, denied with 429, other or none).
    pub fn counts(&self) -> (u64, u64, u64) {
        let c = |i: usize| self.counts[i].load(Ordering::Relaxed);
        (c(0), c(1), c(2))
    }

    /// Waits (60 s at most) until at least `n` requests were allowed and `n` denied.
    pub fn wait_for_both(&self, n: u64) {
        wait_for(
            "traffic with allowed and denied requests",
            Duration::from_secs(60),
            || {
                let (allowed, denied, _) = self.counts();
                (allowed >= n && denied >= n).then_some(())
            },
        );
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Runs `command` with its output to files in `dir` (`{name}.out`, `{name}.err`), killing it
/// after `limit`; its exit status (`None`: killed at the deadline) and its stdout.
pub fn run_with_deadline(
    mut command: Command,
    dir: &Path,
    name: &str,
    limit: Duration,
) -> (Option<ExitStatus>, String) {
    let out = dir.join(format!("{name}.out"));
    let err = dir.join(format!("{name}.err"));
    let mut child = command
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("a file for stdout"))
        .stderr(std::fs::File::create(&err).expect("a file for stderr"))
        .spawn()
        .unwrap_or_else(|e| panic!("start {name}: {e}"));
    let status = crate::common::poll_until_blocking(Duration::from_millis(100), limit, || {
        child.try_wait().expect("the child's status")
    })
    .ok();
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    (status, std::fs::read_to_string(&out).unwrap_or_default())
}

/// The last `n` lines of the file at `path` (for a failure message).
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
