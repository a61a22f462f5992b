//! The `tokenlease` command explains itself: no `--help` shows a password from `DATABASE_URL`,
//! every connection or bind error names the address (password hidden) and the cause, `inspect`
//! says what to set when it has no database and what "no row" means for a key, and `check`
//! warns about entity limits larger than their route's global limit.

use crate::common;

use std::net::{SocketAddr, TcpListener};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const SECRET: &str = "s3cret-Pa55";

fn tokenlease() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tokenlease"))
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A loopback address nobody listens on: a port the kernel handed out and that was closed again.
fn refused_address() -> SocketAddr {
    let probe = TcpListener::bind("127.0.0.1:0").expect("bind a probe");
    let addr = probe.local_addr().unwrap();
    drop(probe);
    addr
}

#[test]
fn no_help_shows_the_database_password() {
    let url = format!("postgres://app:{SECRET}@db.internal:5432/app");
    for sub in [
        &[][..],
        &["check"][..],
        &["migrate"],
        &["inspect"],
        &["loadtest"],
        &["chart"],
        &["demo"],
        &["reshard"],
    ] {
        let out = tokenlease()
            .args(sub)
            .arg("--help")
            .env("DATABASE_URL", &url)
            .output()
            .expect("run --help");
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{sub:?} --help: {stderr}");
        assert!(stdout.contains("Usage"), "{sub:?} --help: {stdout}");
        for shown in [&stdout, &stderr] {
            assert!(!shown.contains(SECRET), "{sub:?} --help shows it:\n{shown}");
            assert!(!shown.contains("db.internal"), "{sub:?} --help:\n{shown}");
        }
    }
}

/// Each command that connects, pointed at a port where nothing listens: the error names the
/// address without its password, and the operating system's reason.
#[test]
fn a_refused_connection_names_the_address_and_the_cause() {
    let addr = refused_address();
    let url = format!("postgres://app:{SECRET}@{addr}/app");
    let runs: [&[&str]; 4] = [
        &["inspect", "ratelimit:api:GET:/x"],
        &["migrate"],
        &["loadtest", "--requests", "1"],
        &["demo", "--listen", "127.0.0.1:0"],
    ];
    for args in runs {
        let began = Instant::now();
        let out = tokenlease()
            .args(args)
            .env("DATABASE_URL", &url)
            .output()
            .expect("run");
        let (stdout, stderr) = text(&out);
        assert!(!out.status.success(), "{args:?} succeeded: {stdout}");
        assert!(
            stderr.contains(&format!("postgres://app:***@{addr}/app")),
            "{args:?} does not name the address: {stderr}"
        );
        assert!(
            stderr.to_ascii_lowercase().contains("refused"),
            "{args:?} drops the cause: {stderr}"
        );
        assert!(
            !stderr.contains(SECRET) && !stdout.contains(SECRET),
            "{stderr}"
        );
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "{args:?} took {:?}",
            began.elapsed()
        );
    }
}

/// The demo binds its address before anything else: a port in use is reported with the
/// address, and no PostgreSQL is started for nothing.
#[test]
fn the_demo_reports_a_port_in_use_before_starting_postgres() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().unwrap();
    let out = tokenlease()
        .args(["demo", "--listen", &addr.to_string()])
        .env_remove("DATABASE_URL")
        .output()
        .expect("run the demo");
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stderr.contains(&format!("could not listen on {addr}")),
        "{stderr}"
    );
    assert!(stderr.contains("in use"), "{stderr}");
    assert!(!stderr.contains("throwaway PostgreSQL"), "{stderr}");
    drop(taken);
}

#[test]
fn inspect_without_a_database_says_what_to_set() {
    let began = Instant::now();
    let out = tokenlease()
        .args(["inspect", "ratelimit:api:GET:/bookings/{bookingId}"])
        .env_remove("DATABASE_URL")
        .output()
        .expect("run inspect");
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(stderr.contains("set DATABASE_URL"), "{stderr}");
    assert!(stderr.contains("--database-url"), "{stderr}");
    assert!(!stderr.contains("starting a throwaway"), "{stderr}");
    // No cluster was started: well under the seconds initdb alone takes.
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "{:?}",
        began.elapsed()
    );
}

#[tokio::test]
async fn inspect_of_a_mistyped_key_says_it_has_no_row() {
    let db = common::database().await;
    let out = tokenlease()
        .args(["inspect", "ratelimit:api:GET:/bokings/{bookingId}"])
        .env("DATABASE_URL", db.connection_string())
        .output()
        .expect("run inspect");
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.starts_with("\"ratelimit:api:GET:/bokings/{bookingId}\": no row in "),
        "{stdout}"
    );
    assert!(stdout.contains("mistyped"), "{stdout}");
}

/// F2: `check`'s warnings as printed are wrapped to 100 columns, continuation lines indented by
/// two spaces; this joins each warning's lines again (and checks the widths).
fn unwrapped(stderr: &str) -> String {
    for line in stderr.lines() {
        assert!(
            line.chars().count() <= 100,
            "a line over 100 columns: {line}"
        );
    }
    stderr.replace("\n  ", " ")
}

fn check(json: &str) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.json");
    std::fs::write(&path, json).unwrap();
    tokenlease()
        .arg("check")
        .arg(&path)
        .output()
        .expect("run check")
}

/// An entity plan whose burst or rate is above its route's global plan can never be reached
/// by one entity alone: `check` says so, and still accepts the file.
#[test]
fn check_warns_about_entity_limits_above_the_global_limit() {
    let out = check(
        r#"{
          "plans": {
            "route": { "capacity": 100, "refill_per_second": 50 },
            "big-burst": { "capacity": 150, "refill": { "tokens": 150, "period_ms": 60000 } },
            "fast": { "capacity": 10, "refill_per_second": 80 },
            "small": { "capacity": 20, "refill_per_second": 1 }
          },
          "routes": [
            { "method": "GET", "path": "/a/{id}", "global": "route",
              "entity": { "path_param": "id", "plan": "big-burst" } },
            { "method": "GET", "path": "/b/{id}", "global": "route",
              "entity": { "path_param": "id", "plan": "fast" } },
            { "method": "GET", "path": "/c/{id}", "global": "route",
              "entity": { "path_param": "id", "plan": "small" } }
          ]
        }"#,
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "a warning is not a failure: {stderr}");
    let stderr = unwrapped(&stderr);
    assert!(stdout.contains("4 plans, 3 routes"), "{stdout}");
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("routes[")).collect();
    assert_eq!(warnings.len(), 2, "{stderr}");
    assert!(
        warnings[0].contains("routes[0]")
            && warnings[0].contains("GET /a/{id}")
            && warnings[0].contains("burst 150")
            && warnings[0].contains("100"),
        "{stderr}"
    );
    assert!(
        warnings[1].contains("routes[1]") && warnings[1].contains("rate 80"),
        "{stderr}"
    );
}

/// A plan whose fallback is a local bucket for one instance (what a plan without `fallback`
/// gets) lets every instance admit the whole limit while the database is down: `check` warns
/// once for each such plan, naming it and what to set, and still accepts the file. Plans with
/// `instances` above one, `deny` or `allow` are not warned about.
#[test]
fn check_warns_about_plans_whose_fallback_is_local_for_one_instance() {
    let out = check(
        r#"{
          "plans": {
            "unset": { "capacity": 100, "refill_per_second": 50 },
            "one": { "capacity": 10, "refill_per_second": 1,
                     "fallback": { "mode": "local", "instances": 1 } },
            "four": { "capacity": 10, "refill_per_second": 1,
                      "fallback": { "mode": "local", "instances": 4 } },
            "closed": { "capacity": 10, "refill_per_second": 1, "fallback": { "mode": "deny" } },
            "open": { "capacity": 10, "refill_per_second": 1, "fallback": { "mode": "allow" } }
          }
        }"#,
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "a warning is not a failure: {stderr}");
    let stderr = unwrapped(&stderr);
    assert!(stdout.contains("5 plans"), "{stdout}");
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(warnings.len(), 2, "{stderr}");
    assert!(
        warnings[0].contains("plans.unset.fallback: warning:")
            || warnings[0].contains(": warning: plans.unset.fallback:"),
        "{stderr}"
    );
    assert!(warnings[1].contains("plans.one.fallback"), "{stderr}");
    for w in &warnings {
        assert!(
            w.contains("local bucket for 1 instance")
                && w.contains("every instance admits the plan's whole limit")
                && w.contains(r#""instances""#)
                && w.contains(r#""deny""#),
            "{w}"
        );
    }
}

/// K5: a leased plan larger than a lease can hold (8 × 10⁹ tokens, the largest capacity, is
/// over a hundred times the lease word's 7.2 × 10⁷) is valid, and `check` says what happens to
/// it: leases held to that size, larger costs decided by a store statement each. A leased plan
/// within it, and a direct-mode plan of any capacity, are not warned about.
#[test]
fn check_warns_about_leased_plans_larger_than_a_lease() {
    let out = check(
        r#"{
          "plans": {
            "huge": { "capacity": 8000000000, "refill_per_second": 1,
                      "lease": { "max_fraction": 0.5 }, "fallback": { "mode": "deny" } },
            "wide": { "capacity": 100000000, "refill_per_second": 1,
                      "lease": { "max_fraction": 0.1 }, "fallback": { "mode": "deny" } },
            "fits": { "capacity": 72057594, "refill_per_second": 1,
                      "lease": { "max_fraction": 1 }, "fallback": { "mode": "deny" } },
            "direct": { "capacity": 8000000000, "refill_per_second": 1,
                        "fallback": { "mode": "deny" } }
          }
        }"#,
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "a warning is not a failure: {stderr}");
    let stderr = unwrapped(&stderr);
    assert!(stdout.contains("4 plans"), "{stdout}");
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(warnings.len(), 2, "{stderr}");
    assert!(warnings[0].contains("plans.huge.lease"), "{stderr}");
    assert!(warnings[1].contains("plans.wide.lease"), "{stderr}");
    for w in &warnings {
        assert!(
            w.contains("above the most one lease holds, 72057594.037927935 tokens")
                && w.contains("decided by a store statement of its own"),
            "{w}"
        );
    }
    // Only the plan whose largest lease is above it is told its leases are held to it.
    assert!(
        warnings[0].contains("4000000000 tokens) are held"),
        "{stderr}"
    );
    assert!(!warnings[1].contains("are held"), "{stderr}");
}

#[test]
fn the_shipped_demo_policy_checks_without_warnings() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/policies/demo.json"
    );
    let out = tokenlease()
        .args(["check", path])
        .output()
        .expect("run check");
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("7 plans, 3 routes"), "{stdout}");
    assert!(!stderr.contains("warning"), "{stderr}");
}

/// Numbers for people: `check` and `inspect` print amounts as they were written (`150`,
/// `0.333333333`), not with eighteen fraction digits.
#[tokio::test]
async fn check_and_inspect_print_amounts_without_trailing_zeros() {
    let out = check(
        r#"{
          "plans": {
            "route": { "capacity": 100, "refill_per_second": 50 },
            "big-burst": { "capacity": 150, "refill_per_second": 0.5 }
          },
          "routes": [
            { "method": "GET", "path": "/a/{id}", "global": "route",
              "entity": { "path_param": "id", "plan": "big-burst" } }
          ]
        }"#,
    );
    let (_, stderr) = text(&out);
    let stderr = unwrapped(&stderr);
    assert!(stderr.contains("(burst 150 > 100)"), "{stderr}");

    let db = common::database().await;
    let store = common::store(&db, 1).await;
    let plan = tokenlease::policy::Plan::new("p", common::bucket(50, 1.0 / 3.0));
    let limiter = tokenlease::Limiter::builder(store).build();
    let d = limiter
        .try_acquire_with(&plan, "cli:amounts", 0.5)
        .await
        .expect("decision");
    assert!(d.allowed);
    let out = tokenlease()
        .args(["inspect", "cli:amounts"])
        .env("DATABASE_URL", db.connection_string())
        .output()
        .expect("run inspect");
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains(" of 50\n"), "{stdout}");
    assert!(
        stdout.contains("tokens stored      49.5 (as of"),
        "{stdout}"
    );
    assert!(
        stdout.contains("refill             20 per minute (0.333 per second)\n"),
        "{stdout}"
    );
    assert!(!stdout.contains("000000000"), "{stdout}");
}

/// F2: `inspect` prints a bucket's figures as its plan reads: tokens to two decimals, the rate
/// of a plan written as 5 a minute as "5 per minute" (stored as 0.083333333 a second), the age
/// of the row in ms or s. It runs without migrating, so a service's own role can use it.
#[tokio::test]
async fn f2_inspect_prints_tokens_and_rates_at_a_readable_precision() {
    let db = common::database().await;
    let store = common::store(&db, 1).await;
    let per_minute = tokenlease::bucket::BucketConfig::new(
        tokenlease::bucket::Tokens::whole(5),
        tokenlease::bucket::Rate::from_nanos_per_second(5_000_000_000 / 60).expect("rate"),
    )
    .expect("bucket");
    let plan = tokenlease::policy::Plan::new("p", per_minute);
    let limiter = tokenlease::Limiter::builder(store).build();
    let d = limiter
        .try_acquire_with(&plan, "cli:per-minute", 1.4)
        .await
        .expect("decision");
    assert!(d.allowed);
    let out = tokenlease()
        .args(["inspect", "cli:per-minute"])
        .env("DATABASE_URL", db.connection_string())
        .output()
        .expect("run inspect");
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("refill             5 per minute (0.0833 per second)\n"),
        "{stdout}"
    );
    let now = stdout
        .lines()
        .find_map(|l| l.strip_prefix("tokens now         "))
        .expect("a tokens line");
    let (amount, capacity) = now.split_once(" of ").expect("N of C");
    assert_eq!(capacity, "5", "{stdout}");
    let decimals = amount.split_once('.').map_or(0, |(_, d)| d.len());
    assert!(decimals <= 2, "{stdout}");
    let amount: f64 = amount.parse().expect("a number");
    assert!((3.6..=3.7).contains(&amount), "{stdout}");
    let updated = stdout
        .lines()
        .find(|l| l.starts_with("updated_at"))
        .expect("an updated_at line");
    assert!(
        updated.ends_with(" ms ago") || updated.ends_with(" s ago"),
        "{stdout}"
    );
}

/// P7: a limit of a plan of several whose capacity and rate are both at least another's can
/// never refuse a take: `check` warns, naming the plan and both limits, and accepts the file;
/// limits that each bind at some time are not warned about.
#[test]
fn check_warns_about_a_limit_that_never_binds() {
    let out = check(
        r#"{
          "plans": {
            "dead": { "limits": [
              { "capacity": 10, "refill_per_second": 10 },
              { "capacity": 100, "refill_per_second": 20 }
            ] },
            "both": { "limits": [
              { "capacity": 10, "refill_per_second": 10 },
              { "capacity": 10000, "refill": { "tokens": 10000, "period_ms": 86400000 } }
            ] }
          }
        }"#,
    );
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "a warning is not a failure: {stderr}");
    let stderr = unwrapped(&stderr);
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains(".limits")).collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    assert!(
        warnings[0].contains("plans.dead.limits")
            && warnings[0].contains("capacity 100 refilling 20")
            && warnings[0].contains("capacity 10 refilling 10"),
        "{stderr}"
    );
}
