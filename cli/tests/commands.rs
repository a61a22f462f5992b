//! `tokenlease check` and `tokenlease migrate` as a user runs them: `check` reports a valid file
//! on stdout and every refusal on stderr, with the library's own message and exit code 1;
//! `migrate` takes `DATABASE_URL`, starts a throwaway server without one, and names an
//! unreachable database.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common;

use tokenlease::policy::{MAX_PLANS, MAX_POLICY_BYTES, Policies};
use tokenlease_testkit::TestDatabase;

fn tokenlease() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tokenlease"))
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn check(file: &Path) -> Output {
    tokenlease().arg("check").arg(file).output().unwrap()
}

/// `check` refuses `path` exactly as the library does: exit code 1, the library's message on
/// stderr, nothing on stdout.
fn assert_check_refuses_as_the_library(path: &Path) {
    let err = Policies::from_file(path).unwrap_err();
    let out = check(path);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
    assert_eq!(String::from_utf8(out.stderr).unwrap(), format!("{err}\n"));
}

#[test]
fn check_command_accepts_a_valid_file() {
    let path = repo().join("examples/policies/demo.json");
    let out = check(&path);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("{}: 7 plans, 3 routes, 2 key rules\n", path.display())
    );
    assert!(out.stderr.is_empty(), "{out:?}");
}

#[test]
fn check_command_refuses_an_invalid_file() {
    let path = repo().join("tests/fixtures/policy/invalid/capacity_string.json");
    let out = check(&path);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
    assert_eq!(
        String::from_utf8(out.stderr).unwrap(),
        format!(
            "{}:3:35: plans.standard.capacity: invalid type: string \"100\", expected u64\n",
            path.display()
        )
    );
}

#[test]
fn check_command_refuses_a_missing_file() {
    let out = check(Path::new("/nonexistent/policy.json"));
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.starts_with("/nonexistent/policy.json: cannot read the file: "),
        "{stderr}"
    );
}

/// A file over the size limit is refused from its size (the library's test is A6's
/// `a_policy_over_the_size_limit_is_refused`), and `check` says so.
#[test]
fn check_command_refuses_a_file_over_the_size_limit() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge.json");
    // Sparse: no 16 MiB written to disk.
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(MAX_POLICY_BYTES + 1).unwrap();
    drop(file);
    assert_check_refuses_as_the_library(&path);
}

/// A8 through the command: a file with more plans than a limiter can hold.
#[test]
fn check_command_refuses_more_plans_than_a_limiter_holds() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("many.json");
    std::fs::write(&path, common::many_plans(MAX_PLANS + 1)).unwrap();
    assert_check_refuses_as_the_library(&path);
}

#[tokio::test]
async fn migrate_uses_database_url() {
    let db = TestDatabase::create().await.expect("create");
    let output = tokenlease()
        .arg("migrate")
        .env("DATABASE_URL", db.connection_string())
        .output()
        .expect("run tokenlease");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stdout.contains("already present 0001_create_buckets"),
        "{stdout}"
    );
    assert!(stdout.contains("no migrations applied"), "{stdout}");
    assert!(!stderr.contains("throwaway"), "{stderr}");
}

#[test]
fn migrate_without_database_url_starts_a_throwaway_server() {
    let output = tokenlease()
        .arg("migrate")
        .env_remove("DATABASE_URL")
        .output()
        .expect("run tokenlease");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stderr.contains("throwaway PostgreSQL"), "{stderr}");
    assert!(stdout.contains("applied 0001_create_buckets"), "{stdout}");
}

#[test]
fn migrate_reports_an_unreachable_database() {
    let output = tokenlease()
        .args([
            "migrate",
            "--database-url",
            "host=127.0.0.1 port=1 user=x connect_timeout=2",
        ])
        .output()
        .expect("run tokenlease");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("could not connect to the database"),
        "{stderr}"
    );
}
