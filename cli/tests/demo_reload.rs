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
