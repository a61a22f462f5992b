//! The CPU time of a PostgreSQL cluster running on this machine, read from Linux's `/proc`, for
//! `tokenlease loadtest`'s `server_cpu_s` and `server_cpu_us_per_decision`.
//!
//! # What is counted
//!
//! Everything the cluster runs: the postmaster, every backend, every background process
//! (checkpointer, background writer, WAL writer, autovacuum launcher and workers, parallel
//! workers, the logger when there is one), and the processes that already exited. All of them
//! are children of the postmaster, so a cluster's CPU time is
//!
//! ```text
//! postmaster's (utime + stime + cutime + cstime)
//!   + Σ over its live children of (utime + stime + cutime + cstime)
//! ```
//!
//! from `/proc/<pid>/stat`. `cutime` and `cstime` hold the time of the children a process has
//! waited for (reaped): for the postmaster, every backend that has disconnected; for a child,
//! whatever it ran and waited for itself (an `archive_command`, say). A child that exits
//! between two samples moves its time from "live child" to the postmaster's `cutime` when the
//! postmaster reaps it (an exited child that is not reaped yet is a zombie, still listed with
//! its times), so the sum runs on without a jump. The client's own CPU is not in it: only the
//! server's processes are.
//!
//! # Finding the postmaster
//!
//! [`locate`] asks the server over a connection for its backend's pid (`pg_backend_pid()`)
//! and for when that backend started (`pg_stat_activity.backend_start`), then reads
//! `/proc/<pid>/stat`. The server is taken to be on this machine when that pid is there, was
//! started within [`START_SLACK_S`] of the time the server gives (so another machine's pid
//! that happens to be taken here, or a server in another pid namespace, is not mistaken for
//! it), and its parent is a `postgres` process: the postmaster. Otherwise nothing is measured
//! and the reason says why; no figure is made up.
//!
//! # Its error
//!
//! A sample reads the postmaster, then scans `/proc` for its children, then reads the
//! postmaster again. A child reaped during the scan could be counted twice (once as a live
//! child, once in the `cutime` read after) or, read the other way round, missed; so when the
//! postmaster's `cutime + cstime` changed between its two reads, the sample is taken again (up
//! to [`SAMPLE_ATTEMPTS`] times, the last one kept whatever happened: its error is at most the
//! CPU time of the children reaped during one scan of a few milliseconds). A child forked
//! during the scan may be missed; it has run for less than the scan. What remains is the
//! kernel's rounding: `/proc` gives each time truncated to a clock tick (10 ms at the usual 100
//! ticks a second), so the difference of two samples is off by less than one tick for every
//! process that ran between them (the postmaster and the live children; the time of reaped
//! children is added up exactly before it is rounded), and these errors are as likely to go
//! one way as the other. Over a run of a few seconds that spends a CPU second or more in the
//! server, that is a few per cent at worst.
//!
//! Linux only: elsewhere [`locate`] says the figure is not measured.

use std::fs;

/// Attempts at a sample whose postmaster reaped no child during the scan of `/proc`.
pub(crate) const SAMPLE_ATTEMPTS: usize = 5;

/// How far apart, in seconds, the start of the backend process as `/proc` gives it and its
/// `backend_start` as the server gives it may be: `/proc/stat`'s boot time is whole seconds,
/// and the server takes its time a little after the fork.
pub(crate) const START_SLACK_S: f64 = 3.0;

/// The fields of a `/proc/<pid>/stat` line this module reads (proc(5): fields 1 to 4, 14 to
/// 17 and 22).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ProcStat {
    /// Field 1, the process id.
    pub(crate) pid: u32,
    /// Field 2, the command name, without its parentheses (it may hold spaces and `)`).
    pub(crate) comm: String,
    /// Field 3, the state: `R` running, `S` sleeping, … `Z` exited but not yet reaped (a
    /// zombie keeps its times until its parent waits for it).
    pub(crate) state: char,
    /// Field 4, the parent's pid.
    pub(crate) ppid: u32,
    /// Field 14, user-mode CPU time, in clock ticks.
    pub(crate) utime: u64,
    /// Field 15, kernel-mode CPU time, in clock ticks.
    pub(crate) stime: u64,
    /// Field 16, user-mode CPU time of the children waited for, in clock ticks.
    pub(crate) cutime: u64,
    /// Field 17, kernel-mode CPU time of the children waited for, in clock ticks.
    pub(crate) cstime: u64,
    /// Field 22, when the process started, in clock ticks after boot: with the pid, what tells
    /// one process from a later one given the same pid.
    pub(crate) starttime: u64,
}

impl ProcStat {
    /// Parses one `/proc/<pid>/stat` line: `pid (comm) state ppid …`. The command name can
    /// hold anything, spaces and parentheses included, so it runs from the first `(` to the
    /// last `)`; the other fields are counted after that. `None` when a field is missing or
    /// not a number.
    pub(crate) fn parse(line: &str) -> Option<ProcStat> {
        let open = line.find('(')?;
        let close = line.rfind(')')?;
        if close < open {
            return None;
        }
        let pid = line[..open].trim().parse().ok()?;
        let comm = line[open + 1..close].to_owned();
        // Fields 3 (state) onwards: index i here is field i + 3.
        let rest: Vec<&str> = line[close + 1..].split_whitespace().collect();
        let field = |n: usize| rest.get(n - 3)?.parse::<u64>().ok();
        let mut state = rest.first()?.chars();
        Some(ProcStat {
            pid,
            comm,
            state: state.next().filter(|_| state.next().is_none())?,
            ppid: u32::try_from(field(4)?).ok()?,
            utime: field(14)?,
            stime: field(15)?,
            cutime: field(16)?,
            cstime: field(17)?,
            starttime: field(22)?,
        })
    }

    /// `/proc/<pid>/stat`, parsed; `None` when the process is not there (or not visible).
    pub(crate) fn read(pid: u32) -> Option<ProcStat> {
        ProcStat::parse(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
    }

    /// The process's own CPU time (`utime + stime`) and that of the children it reaped
    /// (`cutime + cstime`), in clock ticks.
    pub(crate) fn ticks(&self) -> u64 {
        self.utime + self.stime + self.cutime + self.cstime
    }

    /// The CPU time of the children it reaped (`cutime + cstime`), in clock ticks.
    pub(crate) fn reaped_ticks(&self) -> u64 {
        self.cutime + self.cstime
    }

    /// Whether the process has exited: a zombie (`Z`, waiting for its parent to reap it) or
    /// dead (`X`).
    pub(crate) fn exited(&self) -> bool {
        matches!(self.state, 'Z' | 'X')
    }
}

/// A PostgreSQL cluster on this machine: its postmaster, as [`locate`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cluster {
    /// The postmaster's pid.
    pub(crate) postmaster: u32,
    /// The postmaster's start time (`/proc` field 22): a sample refuses a postmaster that has
    /// been replaced since (a restarted server, or the pid taken by another process).
    started: u64,
}

/// One reading of a cluster's CPU time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sample {
    /// The cluster's CPU time so far, in clock ticks (module docs).
    pub(crate) ticks: u64,
}

/// Finds the cluster the connection `client` is served by, when it runs on this machine:
/// `Err` with the reason (for the report) when it does not, or cannot be read.
pub(crate) async fn locate(client: &tokio_postgres::Client) -> Result<Cluster, String> {
    if !cfg!(target_os = "linux") {
        return Err("reading a server's CPU time needs Linux's /proc".into());
    }
    let row = client
        .query_one(
            "SELECT pg_backend_pid(), extract(epoch FROM backend_start)::float8 \
             FROM pg_stat_activity WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .map_err(|e| format!("could not ask the server for its backend's pid: {e}"))?;
    let pid: i32 = row.get(0);
    let backend_start: Option<f64> = row.get(1);
    let pid = u32::try_from(pid).map_err(|_| format!("the backend pid {pid} is not a pid"))?;
    Cluster::of_backend(pid, backend_start)
}

impl Cluster {
    /// The cluster whose backend `pid` started at `backend_start` (seconds since the epoch, as
    /// the server gives it), when that backend is a process of this machine (module docs).
    pub(crate) fn of_backend(pid: u32, backend_start: Option<f64>) -> Result<Cluster, String> {
        let elsewhere = |why: &str| {
            format!("the server is not on this machine (its backend, pid {pid}, {why})")
        };
        let backend = ProcStat::read(pid).ok_or_else(|| elsewhere("is not in /proc"))?;
        if let (Some(at), Some(here)) = (backend_start, started_at(&backend))
            && (at - here).abs() > START_SLACK_S
        {
            return Err(elsewhere(&format!(
                "started {:.0} s away from the local process of that pid",
                at - here
            )));
        }
        let postmaster = ProcStat::read(backend.ppid)
            .filter(|s| !s.exited() && is_postgres(s))
            .ok_or_else(|| elsewhere("has no postgres parent here"))?;
        Ok(Cluster {
            postmaster: postmaster.pid,
            started: postmaster.starttime,
        })
    }

    /// Reads the cluster's CPU time so far (module docs): `Err` when the postmaster is gone or
    /// was replaced since it was located (the server stopped or restarted).
    pub(crate) fn sample(&self) -> Result<Sample, String> {
        let mut attempt = 1;
        loop {
            let before = self.postmaster()?;
            let children: u64 = children(self.postmaster).iter().map(ProcStat::ticks).sum();
            let after = self.postmaster()?;
            if after.reaped_ticks() == before.reaped_ticks() || attempt == SAMPLE_ATTEMPTS {
                return Ok(Sample {
                    ticks: after.ticks() + children,
                });
            }
            attempt += 1;
        }
    }

    /// The postmaster's `/proc` line, if it is still the process [`locate`] found and has not
    /// exited. A stopped server's postmaster can stay listed for a while as a zombie, with its
    /// times, until its parent (often the machine's init) reaps it: it is gone all the same,
    /// and its backends with it.
    fn postmaster(&self) -> Result<ProcStat, String> {
        ProcStat::read(self.postmaster)
            .filter(|s| s.starttime == self.started && !s.exited())
            .ok_or_else(|| {
                format!(
                    "the server's postmaster (pid {}) stopped or was replaced during the run",
                    self.postmaster
                )
            })
    }
}

/// Seconds of CPU time between two samples of one cluster.
pub(crate) fn seconds_between(start: Sample, end: Sample) -> f64 {
    end.ticks.saturating_sub(start.ticks) as f64 / ticks_per_second() as f64
}

/// Every process whose parent is `ppid`, from a scan of `/proc` (those that exit during the
/// scan may be left out).
fn children(ppid: u32) -> Vec<ProcStat> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(ProcStat::read)
        .filter(|s| s.ppid == ppid)
        .collect()
}

/// Whether the process runs PostgreSQL's server program: its command name is `postgres` (or
/// `postmaster`, the name older packagings link it under), or the program in its command line
/// is.
fn is_postgres(stat: &ProcStat) -> bool {
    let named = |name: &str| name == "postgres" || name == "postmaster";
    if named(&stat.comm) {
        return true;
    }
    let Ok(cmdline) = fs::read(format!("/proc/{}/cmdline", stat.pid)) else {
        return false;
    };
    let program = cmdline.split(|&b| b == 0).next().unwrap_or_default();
    let program = String::from_utf8_lossy(program);
    named(program.rsplit('/').next().unwrap_or_default())
}

/// When the process started, in seconds since the epoch: the boot time from `/proc/stat`
/// (whole seconds) plus its start in ticks after boot. `None` when `/proc/stat` has no boot
/// time.
fn started_at(stat: &ProcStat) -> Option<f64> {
    let boot: u64 = fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())?;
    Some(boot as f64 + stat.starttime as f64 / ticks_per_second() as f64)
}

/// Linux's `USER_HZ`, the unit of `/proc`'s times where the C library cannot be asked: it is
/// part of the kernel's interface to programs, 100 on x86, ARM, RISC-V, POWER and s390 alike.
const USER_HZ: u64 = 100;

/// Clock ticks per second, the unit of `/proc`'s times: `sysconf(_SC_CLK_TCK)`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn ticks_per_second() -> u64 {
    // SAFETY: sysconf takes no pointer and only reads a constant of the C library and kernel.
    let n = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(n).ok().filter(|&n| n > 0).unwrap_or(USER_HZ)
}

/// Clock ticks per second, the unit of `/proc`'s times: without glibc (and so without the
/// `libc` crate in this build), Linux's fixed `USER_HZ`.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn ticks_per_second() -> u64 {
    USER_HZ
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend's line as the kernel writes it (52 fields), with `comm` replaced.
    fn line(pid: u32, comm: &str, ppid: u32, times: [u64; 4], start: u64) -> String {
        let [u, s, cu, cs] = times;
        format!(
            "{pid} ({comm}) S {ppid} {ppid} {ppid} 0 -1 4194368 1521 0 0 0 {u} {s} {cu} {cs} \
             20 0 1 0 {start} 226930688 6950 18446744073709551615 1 1 0 0 0 0 4194304 19935232 \
             1536 0 0 0 17 1 0 0 0 0 0 0 0 0 0 0 0 0 0"
        )
    }

    #[test]
    fn parses_a_stat_line() {
        let s = ProcStat::parse(&line(4242, "postgres", 17, [120, 30, 7, 2], 98765))
            .expect("a stat line");
        assert_eq!(
            s,
            ProcStat {
                pid: 4242,
                comm: "postgres".into(),
                state: 'S',
                ppid: 17,
                utime: 120,
                stime: 30,
                cutime: 7,
                cstime: 2,
                starttime: 98765,
            }
        );
        assert_eq!(s.ticks(), 159);
        assert_eq!(s.reaped_ticks(), 9);
        assert!(!s.exited());
        let zombie = line(4242, "postgres", 1, [1, 2, 3, 4], 5).replacen(") S ", ") Z ", 1);
        assert!(ProcStat::parse(&zombie).expect("a zombie's line").exited());
    }

    #[test]
    fn a_command_name_may_hold_spaces_and_parentheses() {
        let s = ProcStat::parse(&line(7, "postgres: x) y", 1, [5, 6, 7, 8], 9)).expect("parsed");
        assert_eq!(s.comm, "postgres: x) y");
        assert_eq!((s.pid, s.state, s.ppid), (7, 'S', 1));
        assert_eq!((s.utime, s.stime, s.cutime, s.cstime), (5, 6, 7, 8));
        assert_eq!(s.starttime, 9);
        // A name that looks like the fields that follow it does not shift them.
        let s = ProcStat::parse(&line(8, ") S 1 2 3 (", 2, [1, 2, 3, 4], 5)).expect("parsed");
        assert_eq!(s.comm, ") S 1 2 3 (");
        assert_eq!(
            (s.state, s.ppid, s.utime, s.cstime, s.starttime),
            ('S', 2, 1, 4, 5)
        );
    }

    #[test]
    fn a_truncated_or_garbled_line_is_refused() {
        assert_eq!(ProcStat::parse(""), None);
        assert_eq!(ProcStat::parse("12 (postgres) S 1 1 1"), None);
        assert_eq!(ProcStat::parse("12 postgres S 1"), None);
        let garbled = line(12, "postgres", 1, [1, 2, 3, 4], 5).replace(" 1 2 3 4 ", " 1 x 3 4 ");
        assert_eq!(ProcStat::parse(&garbled), None);
        assert_eq!(
            ProcStat::parse(&line(12, "p", 1, [1, 2, 3, 4], 5)[..2]),
            None
        );
    }

    /// This very process, read back from `/proc`: its own pid, and a parent that is not a
    /// postmaster, so it is not taken for a cluster.
    #[cfg(target_os = "linux")]
    #[test]
    fn reads_this_process() {
        let me = ProcStat::read(std::process::id()).expect("/proc/self");
        assert_eq!(me.pid, std::process::id());
        assert!(me.starttime > 0);
        assert!(ticks_per_second() > 0);
        let err = Cluster::of_backend(std::process::id(), None).expect_err("not a backend");
        assert!(err.contains("postgres parent"), "{err}");
        let err = Cluster::of_backend(u32::MAX, None).expect_err("no such process");
        assert!(err.contains("not in /proc"), "{err}");
    }
}
