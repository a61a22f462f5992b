//! `tokenlease loadtest --fault`: one fault injected into the throwaway PostgreSQL while the
//! load runs, so that the decision latency under it (`max_us`) is measured as a user's service
//! would see it.
//!
//! The fault starts `--fault-at` seconds into the run and lasts `--fault-for` seconds:
//!
//! - `sigstop`: the postmaster and every server process stopped with SIGSTOP, then SIGCONT (a
//!   hung server: its kernel still accepts connections and acknowledges bytes);
//! - `slow`: every reply from the server `--fault-delay-ms` late, through a proxy between the
//!   limiters and the server (the proxy passes everything before and after);
//! - `down`: `pg_ctl stop -m immediate` (a crash), then started again (crash recovery);
//! - `restart`: `pg_ctl restart -m fast` at `--fault-at` (`--fault-for` does not apply): the
//!   server closes every session and comes back as fast as it can.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokenlease_testkit::{FaultProxy, StopMode, TempPostgres};

/// Which fault `--fault` injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Kind {
    Sigstop,
    Slow,
    Down,
    Restart,
}

/// The fault of one run, as the report prints it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Fault {
    pub(crate) kind: Kind,
    pub(crate) at_s: f64,
    pub(crate) for_s: f64,
    /// The reply delay of `slow`, in milliseconds.
    pub(crate) delay_ms: Option<u64>,
    /// What happened, e.g. "8 processes stopped" or an error: a fault that could not be
    /// injected is reported, never silently skipped.
    pub(crate) outcome: String,
}

/// A fault ready to run against `server`. For `slow` the limiters must connect through
/// [`Injector::url`].
pub(crate) struct Injector {
    fault: Fault,
    server: Arc<TempPostgres>,
    proxy: Option<FaultProxy>,
}

impl Injector {
    /// Prepares `kind` against `server` (starting the proxy for `slow`).
    pub(crate) async fn new(
        kind: Kind,
        at: f64,
        duration: f64,
        delay_ms: u64,
        server: Arc<TempPostgres>,
    ) -> std::io::Result<Injector> {
        let proxy = match kind {
            Kind::Slow => {
                let upstream = SocketAddr::from(([127, 0, 0, 1], server.port()));
                Some(FaultProxy::start(upstream).await?)
            }
            _ => None,
        };
        Ok(Injector {
            fault: Fault {
                kind,
                at_s: at,
                for_s: if kind == Kind::Restart { 0.0 } else { duration },
                delay_ms: (kind == Kind::Slow).then_some(delay_ms),
                outcome: String::new(),
            },
            server,
            proxy,
        })
    }

    /// The URL the limiters use: the proxy's for `slow`, else the server's own.
    pub(crate) fn url(&self) -> String {
        match &self.proxy {
            Some(proxy) => format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port()),
            None => self.server.url(),
        }
    }

    /// Runs the fault on its own task, timed from `start`; the handle yields the report.
    pub(crate) fn spawn(self, start: Instant) -> tokio::task::JoinHandle<Fault> {
        tokio::spawn(self.run(start))
    }

    async fn run(mut self, start: Instant) -> Fault {
        let begin = start + Duration::from_secs_f64(self.fault.at_s);
        let end = begin + Duration::from_secs_f64(self.fault.for_s);
        tokio::time::sleep_until(begin.into()).await;
        let outcome = match self.fault.kind {
            Kind::Sigstop => match self.server.suspend() {
                Ok(stopped) => {
                    let n = stopped.processes();
                    tokio::time::sleep_until(end.into()).await;
                    stopped.resume();
                    format!("{n} server processes stopped, then continued")
                }
                Err(e) => format!("could not suspend the server: {e}"),
            },
            Kind::Slow => match &self.proxy {
                Some(proxy) => {
                    let delay = Duration::from_millis(self.fault.delay_ms.unwrap_or(0));
                    proxy.delay(Duration::ZERO, delay);
                    tokio::time::sleep_until(end.into()).await;
                    proxy.pass();
                    "replies delayed, then passed at once".to_owned()
                }
                None => "no proxy in front of the server: nothing delayed".to_owned(),
            },
            Kind::Down => {
                let server = Arc::clone(&self.server);
                let stopped = blocking(move || server.stop(StopMode::Immediate)).await;
                tokio::time::sleep_until(end.into()).await;
                let server = Arc::clone(&self.server);
                let started = blocking(move || server.start_again()).await;
                match (stopped, started) {
                    (Ok(()), Ok(())) => format!(
                        "stopped (immediate), started again {:.2} s into the run",
                        start.elapsed().as_secs_f64()
                    ),
                    (stop, start) => format!("stop: {stop:?}, start: {start:?}"),
                }
            }
            Kind::Restart => {
                let server = Arc::clone(&self.server);
                match blocking(move || server.restart(StopMode::Fast)).await {
                    Ok(()) => format!(
                        "restarted (fast), back {:.2} s into the run",
                        start.elapsed().as_secs_f64()
                    ),
                    Err(e) => format!("restart failed: {e}"),
                }
            }
        };
        self.fault.outcome = outcome;
        self.fault
    }
}

/// Runs a blocking server command (`pg_ctl`) off the runtime's worker threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, tokenlease_testkit::EmbeddedError> + Send + 'static,
) -> Result<T, String> {
    match tokio::task::spawn_blocking(f).await {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(e) => Err(format!("the server command's thread failed: {e}")),
    }
}
