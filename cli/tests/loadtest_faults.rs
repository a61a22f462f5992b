//! `tokenlease loadtest --fault`: the fault is really injected into the loadtest's own throwaway
//! PostgreSQL, the run reports it, and every call is still answered. The latency figures of
//! `scripts/fault-latency.sh` (512 tasks, release build) are in docs/failure.md; here, in a
//! debug build beside other tests, the checks are that the fault happened and decided calls,
//! and that no call waited anywhere near a second. Runs in the nextest `serial` group.

use std::process::Command;

use serde_json::Value;

/// Runs the loadtest on its own throwaway cluster (`DATABASE_URL` removed) with `args`.
fn loadtest(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_tokenlease"))
        .env_remove("DATABASE_URL")
        .args(["loadtest", "--json", "--instances", "1", "--tasks", "64"])
        .args(["--rate", "2000", "--duration", "2.5"])
        .args(["--fault-at", "0.5", "--fault-for", "1"])
        .args(args)
        .output()
        .expect("run tokenlease loadtest");
    assert!(
        out.status.success(),
        "loadtest {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

fn checked(report: &Value, kind: &str, outcome_has: &str) {
    let fault = &report["fault"];
    assert_eq!(fault["kind"], kind, "{report}");
    let outcome = fault["outcome"].as_str().expect("outcome");
    assert!(outcome.contains(outcome_has), "{kind}: {outcome}");
    let requests = report["requests"].as_u64().expect("requests");
    assert!(
        requests > 1_000,
        "{kind}: only {requests} requests: {report}"
    );
    let fallback = report["fallback_decisions"].as_u64().expect("fallback");
    assert!(fallback > 0, "{kind}: the fault decided nothing: {report}");
    let max_ms = report["max_us"].as_f64().expect("max_us") / 1000.0;
    assert!(
        max_ms < 1_000.0,
        "{kind}: a call waited {max_ms} ms: {report}"
    );
    println!(
        "{kind} {}: {requests} requests, {fallback} by the fallback, max {max_ms:.1} ms, {outcome}",
        report["mode"]
    );
}

#[test]
fn sigstop_hangs_the_server_and_calls_are_still_answered() {
    for mode in ["direct", "leased"] {
        let report = loadtest(&["--mode", mode, "--fault", "sigstop"]);
        checked(&report, "sigstop", "processes stopped");
    }
}

#[test]
fn slow_replies_go_through_a_proxy() {
    // 80 ms late replies against a 50 ms call timeout: every store call in the fault times out.
    let report = loadtest(&[
        "--mode",
        "direct",
        "--fault",
        "slow",
        "--fault-delay-ms",
        "80",
    ]);
    checked(&report, "slow", "delayed");
    assert_eq!(report["fault"]["delay_ms"], 80);
}

#[test]
fn a_crashed_server_is_started_again_and_used() {
    let report = loadtest(&["--mode", "leased", "--fault", "down", "--keys", "1000"]);
    checked(&report, "down", "started again");
}

#[test]
fn a_fault_needs_the_throwaway_server() {
    let out = Command::new(env!("CARGO_BIN_EXE_tokenlease"))
        .args(["loadtest", "--fault", "sigstop", "--database-url"])
        .arg("postgres://nobody@127.0.0.1:1/none")
        .output()
        .expect("run tokenlease loadtest");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--fault needs the throwaway PostgreSQL"),
        "{stderr}"
    );
}

/// The table's overshoot row names the bound that applies and what it covers: with the `allow`
/// fallback deciding under the fault, the bound is the store's and the leases' alone, and the
/// row says it excludes what the fallback admitted; with the `deny` fallback (which admits
/// nothing) the bound covers every admission.
#[test]
fn the_overshoot_row_says_what_its_bound_covers() {
    let row = |fallback: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_tokenlease"))
            .env_remove("DATABASE_URL")
            .args([
                "loadtest",
                "--instances",
                "1",
                "--tasks",
                "32",
                "--mode",
                "direct",
            ])
            .args(["--rate", "1000", "--duration", "2", "--capacity", "20"])
            .args([
                "--fault",
                "sigstop",
                "--fault-at",
                "0.5",
                "--fault-for",
                "0.8",
            ])
            .args(["--fallback", fallback])
            .output()
            .expect("run tokenlease loadtest");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
            .lines()
            .find(|l| l.starts_with("overshoot"))
            .unwrap_or_else(|| panic!("no overshoot row: {stdout}"))
            .to_owned()
    };
    let allow = row("allow");
    assert!(
        allow.contains("bound 1.00: one request's cost")
            && allow.contains("holds for the store's and the leases' admissions only")
            && allow.contains("excludes what the allow fallback admitted")
            && allow.contains("under the fault"),
        "{allow}"
    );
    let deny = row("deny");
    assert!(
        deny.contains("covers every admission (the deny fallback admits none)"),
        "{deny}"
    );
}
