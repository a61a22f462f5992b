//! R6, end to end: `tokenlease demo --policy FILE` reloads the file when it changes and on
//! SIGHUP, while serving; a file that fails `tokenlease check` is refused with its error and
//! the policies in force stay. Real HTTP over TCP to the built binary on its throwaway
//! PostgreSQL.

use crate::live_demo;

use std::path::PathBuf;

use live_demo::{Demo, must};

const DEMO_POLICY: &str = include_str!("../../examples/policies/demo.json");

/// `GET path`: (status, the `ratelimit-policy` field).
fn get(addr: &str, path: &str) -> (u16, Option<String>) {
    let r = must(addr, "GET", path);
    (r.status, r.header("ratelimit-policy").map(str::to_owned))
}

/// Writes `contents` to `path` whole: into a file beside it, then renamed over it, as editors
/// and deploy tools do, so the demo never reads half a file.
fn replace(path: &PathBuf, contents: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

#[test]
fn r6_the_demo_reloads_its_policy_file_on_change_and_sighup_and_refuses_a_bad_one() {
    let dir = std::env::temp_dir().join(format!("tokenlease-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("policy.json");
    std::fs::write(&path, DEMO_POLICY).expect("write the policy");
    let demo = Demo::start_with(&[PathBuf::from("--policy"), path.clone()], true);
    let entity_q = |q: u32| format!("\"entity\";q={q};w=60");
    let (status, policy) = get(&demo.addr, "/bookings/a1");
    assert_eq!(status, 200);
    assert!(
        policy.as_deref().unwrap().contains(&entity_q(20)),
        "{policy:?}"
    );

    // A changed file: the booking's plan now holds 30 tokens, from the next request on.
    let thirty = DEMO_POLICY.replacen(
        "\"capacity\": 20,\n      \"refill\": { \"tokens\": 20",
        "\"capacity\": 30,\n      \"refill\": { \"tokens\": 30",
        1,
    );
    assert_ne!(thirty, DEMO_POLICY, "the edit applies");
    replace(&path, &thirty);
    demo.expect_stderr(&["reloaded", "(the file changed)"]);
    let (status, policy) = get(&demo.addr, "/bookings/a2");
    assert_eq!(status, 200);
    assert!(
        policy.as_deref().unwrap().contains(&entity_q(30)),
        "{policy:?}"
    );

    // A file that fails the check: refused with its error, and the 30-token plan stays.
    replace(
        &path,
        &thirty.replacen("\"capacity\": 30", "\"capacity\": 0", 1),
    );
    let line = demo.expect_stderr(&["refused", "(the file changed)"]);
    assert!(
        line.contains("capacity"),
        "the error names the field: {line}"
    );
    assert!(line.contains("the policies in force stay"), "{line}");
    let (_, policy) = get(&demo.addr, "/bookings/a3");
    assert!(
        policy.as_deref().unwrap().contains(&entity_q(30)),
        "{policy:?}"
    );

    // SIGHUP reloads whatever the file holds now (valid again, 40 tokens).
    let forty = DEMO_POLICY.replacen(
        "\"capacity\": 20,\n      \"refill\": { \"tokens\": 20",
        "\"capacity\": 40,\n      \"refill\": { \"tokens\": 40",
        1,
    );
    replace(&path, &forty);
    demo.expect_stderr(&["reloaded"]);
    demo.signal("HUP");
    demo.expect_stderr(&["reloaded", "(SIGHUP)"]);
    let (status, policy) = get(&demo.addr, "/bookings/a4");
    assert_eq!(status, 200);
    assert!(
        policy.as_deref().unwrap().contains(&entity_q(40)),
        "{policy:?}"
    );
    assert!(demo.stop().success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A policy of `n` plans: `only`, the default plan, and `extra-1` … `extra-{n-1}`; no routes.
fn plans(n: usize) -> String {
    let mut json = String::from(
        r#"{ "plans": { "only": { "capacity": 10, "refill_per_second": 1, "fallback": { "mode": "deny" } }"#,
    );
    for i in 1..n {
        json.push_str(&format!(
            r#", "extra-{i}": {{ "capacity": 10, "refill_per_second": 1, "fallback": {{ "mode": "deny" }} }}"#
        ));
    }
    json.push_str(r#" }, "default_plan": "only" }"#);
    json
}

/// The demo's resident memory, in KiB (`VmRSS` of /proc).
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// The samples of `/metrics` with a `plan` label: (of `only`, of any other plan), and with a
/// `route` label.
fn plan_series(addr: &str) -> (usize, usize, usize) {
    let body = must(addr, "GET", "/metrics").body;
    let samples = || body.lines().filter(|l| !l.starts_with('#'));
    let routes = samples().filter(|l| l.contains("route=\"")).count();
    let (only, other) =
        samples()
            .filter(|l| l.contains("plan=\""))
            .fold((0, 0), |(only, other), l| {
                if l.contains("plan=\"only\"") {
                    (only + 1, other)
                } else {
                    (only, other + 1)
                }
            });
    (only, other, routes)
}

/// K9: reloads of the demo alternating 65,000 plans and one (through its policy file and
/// SIGHUP), three round trips (six reloads: each of the debug build's 65,000-plan reloads takes
/// about 10 s), from the shipped demo policy (its 7 plans and 3 routes). After each return to
/// one plan, `/metrics` has no series of the removed plans (they had 11 each while in force) nor
/// of the removed routes, and the 11 of the plan in force; and the demo's resident memory is
/// back within 20% of what it was at start: the limiter lets go of the removed plans' entries,
/// counters and series, and the demo keeps glibc's `mmap` threshold and trims its heap
/// (`cli/src/trim.rs`). Before, the registry kept every plan and the demo stayed near 70 MB
/// after each return, from 9 MB at start (release build; 412 MB before the series were
/// released). Memory is read once the
/// demo's periodic `malloc_trim` (every 5 s) could give freed pages back: polled, not slept.
#[cfg(target_os = "linux")]
#[test]
fn k9_reloads_between_65000_plans_and_one_keep_no_series_of_removed_plans() {
    let dir = std::env::temp_dir().join(format!("tokenlease-k9-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("policy.json");
    let (one, many) = (plans(1), plans(65_000));
    std::fs::write(&path, DEMO_POLICY).expect("write the policy");
    let demo = Demo::start_with(&[PathBuf::from("--policy"), path.clone()], true);
    let pid = demo.pid();
    let settled = |what: &str, bound: u64| {
        crate::common::eventually_blocking(
            std::time::Duration::from_millis(250),
            std::time::Duration::from_secs(30),
            what,
            || {
                let rss = rss_kib(pid);
                if rss <= bound { Ok(rss) } else { Err(rss) }
            },
        )
    };
    let cold = rss_kib(pid);
    let (_, demo_plans, demo_routes) = plan_series(&demo.addr);
    assert!(
        demo_plans > 0 && demo_routes > 0,
        "{demo_plans} {demo_routes}"
    );

    let mut after = Vec::new();
    for round in 0..3 {
        for (policy, count) in [(&many, ": 65000 plans,"), (&one, ": 1 plan,")] {
            replace(&path, policy);
            demo.signal("HUP");
            // A big file is read, checked and interned in a few seconds even in a debug
            // build; the limit allows a busy machine.
            demo.expect_stderr_within(
                &["reloaded", "(SIGHUP)", count],
                std::time::Duration::from_secs(60),
            );
        }
        assert_eq!(
            plan_series(&demo.addr),
            (11, 0, 0),
            "after round trip {round}"
        );
        after.push(settled(
            "the demo's memory within 20% of its start",
            cold + cold / 5,
        ));
    }
    eprintln!("K9: RSS at start {cold} KiB, after each round trip {after:?} KiB");
    assert!(demo.stop().success());
    let _ = std::fs::remove_dir_all(&dir);
}
