//! The demo's live policy reload: on SIGHUP, and when the policy file changes (its size or
//! modification time, looked at every second), the file is read and checked as
//! `tokenlease check` checks it, then swapped in with `RateLimitLayer::reload` while requests
//! are in flight. A file that fails the check is refused with its error, and the policies in
//! force stay. Each outcome is one line on stderr and one count in
//! `tokenlease_policy_reloads_total{result}`. The check and the swap run on tokio's blocking
//! threads (`spawn_blocking`), so a large file never holds a worker that answers requests.
//! After a reload it applied, the demo's recorder forgets the series of the plans and routes
//! the reload removed (`series.rs`); a route's series still held by a request in flight then
//! goes at the next reload.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use tokenlease::http::RateLimitLayer;
use tokenlease::metrics::POLICY_RELOADS;
use tokenlease::policy::Policies;

use super::series::Handle;

/// How often the file's size and modification time are compared with the last seen.
const POLL: Duration = Duration::from_secs(1);

/// Starts watching `path` on the current runtime for the demo's lifetime.
pub(crate) fn spawn(path: PathBuf, layer: RateLimitLayer, series: Handle) {
    tokio::spawn(watch(path, layer, series));
}

/// What identifies a version of the file without reading it.
fn stamp(path: &Path) -> Option<(u64, SystemTime)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.len(), meta.modified().ok()?))
}

async fn watch(path: PathBuf, layer: RateLimitLayer, series: Handle) {
    #[cfg(unix)]
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    let mut seen = stamp(&path);
    // The bytes in force, so that a touch that changes nothing reloads nothing.
    let mut applied = std::fs::read(&path).ok();
    let mut every = tokio::time::interval(POLL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        #[cfg(unix)]
        let signalled = async {
            match &mut hangup {
                Some(h) => h.recv().await,
                None => std::future::pending().await,
            }
        };
        #[cfg(not(unix))]
        let signalled = std::future::pending::<Option<()>>();
        let why = tokio::select! {
            Some(()) = signalled => "SIGHUP",
            _ = every.tick() => {
                let now = stamp(&path);
                if now == seen {
                    continue;
                }
                seen = now;
                "the file changed"
            }
        };
        let bytes = match tokio::fs::read(&path).await {
            Ok(bytes) => bytes,
            Err(e) => {
                refused(&path, why, &format!("cannot read the file: {e}"));
                continue;
            }
        };
        if why != "SIGHUP" && applied.as_deref() == Some(bytes.as_slice()) {
            continue;
        }
        // Reading, checking and interning a large file takes a while: off the runtime's
        // workers, which keep answering requests meanwhile.
        let outcome = {
            let (path, layer, series) = (path.clone(), layer.clone(), series.clone());
            tokio::task::spawn_blocking(move || {
                let outcome = reload(&path, &layer);
                if outcome.is_ok() {
                    series.forget_unheld();
                }
                outcome
            })
            .await
        };
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(e) => Err(Refused::Reload(format!("the reload failed: {e}"))),
        };
        match outcome {
            Ok(summary) => {
                applied = Some(bytes);
                // The summary names the file.
                eprintln!("tokenlease demo: reloaded the policy ({why}): {summary}");
            }
            Err(Refused::Check(message)) => refused(&path, why, &message),
            // Counted by the layer or the limiter.
            Err(Refused::Reload(message)) => report(&path, why, &message),
        }
    }
}

/// Why a reload did not happen.
enum Refused {
    /// The file failed its check.
    Check(String),
    /// The layer or the limiter refused the policies.
    Reload(String),
}

/// Counts and reports a file that failed its check.
fn refused(path: &Path, why: &str, message: &str) {
    metrics::counter!(POLICY_RELOADS, "result" => "refused").increment(1);
    report(path, why, message);
}

fn report(path: &Path, why: &str, message: &str) {
    // A check error names the file; a read error or a refusal by the layer does not.
    let named = if message.contains(&*path.to_string_lossy()) {
        String::new()
    } else {
        format!("{}: ", path.display())
    };
    eprintln!(
        "tokenlease demo: refused the policy ({why}): {named}{message}; the policies in force stay"
    );
}

/// Checks the file as `tokenlease check` does (its warnings printed, as there) and swaps it in.
fn reload(path: &Path, layer: &RateLimitLayer) -> Result<String, Refused> {
    let policies = Policies::from_file(path).map_err(|e| Refused::Check(e.to_string()))?;
    for warning in super::check::warnings(&policies) {
        eprintln!("{}", super::check::printed(path, &warning));
    }
    let summary = policies.summary();
    layer
        .reload(policies)
        .map_err(|e| Refused::Reload(e.to_string()))?;
    Ok(summary)
}
