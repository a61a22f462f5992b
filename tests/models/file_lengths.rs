//! L3: no source file of the library is over 800 lines (DESIGN.md, "The layers").
//!
//! A file that long holds more than one role, and the roles are read, changed and reviewed
//! together whether or not they belong together: such a file is split by role, each part in a
//! file named after it (as the lease actor's and the limiter's were). The check counts the
//! lines of every `.rs` file under the library's `src/` (the binary and the test kit are
//! crates of their own) and fails naming each file over [`MOST_LINES`], with its count. Test
//! files do not count: a file named `tests.rs`, or any file under a directory named `tests`.
//!
//! The last test runs the check over made-up files, to show it finds what it is for.

use std::path::Path;

use super::clock_reads::rust_files;

/// The most lines a source file of the library may have.
const MOST_LINES: usize = 800;

/// Whether the file at `rel` (relative to `src/`, `/`-separated) is a test file.
fn is_test_file(rel: &str) -> bool {
    let mut parts: Vec<&str> = rel.split('/').collect();
    let name = parts.pop().unwrap_or_default();
    name == "tests.rs" || parts.contains(&"tests")
}

/// Each non-test file of `files` (path relative to `src/`, text) over [`MOST_LINES`] lines,
/// with its count of lines, in the order given.
fn too_long<'a>(files: impl IntoIterator<Item = (&'a str, &'a str)>) -> Vec<(String, usize)> {
    files
        .into_iter()
        .filter(|(rel, _)| !is_test_file(rel))
        .map(|(rel, text)| (rel.to_owned(), text.lines().count()))
        .filter(|&(_, lines)| lines > MOST_LINES)
        .collect()
}

/// The check over the library's `src/`.
#[test]
fn l3_no_library_source_file_is_over_800_lines() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut paths = Vec::new();
    rust_files(&src, &mut paths);
    let files: Vec<(String, String)> = paths
        .iter()
        .map(|path| {
            let rel = path.strip_prefix(&src).unwrap_or(path);
            let rel: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            let text = std::fs::read_to_string(path).expect("read a source file");
            (rel.join("/"), text)
        })
        .collect();
    // The library's modules are all there (a wrong directory would check nothing).
    assert!(
        files.len() > 50,
        "only {} files under {}",
        files.len(),
        src.display()
    );
    let long = too_long(
        files
            .iter()
            .map(|(rel, text)| (rel.as_str(), text.as_str())),
    );
    let report: String = long
        .iter()
        .map(|(rel, lines)| format!("src/{rel}: {lines} lines\n"))
        .collect();
    assert!(
        report.is_empty(),
        "library source files over {MOST_LINES} lines (split each by role, into files named \
         after their roles; DESIGN.md, \"The layers\"):\n{report}"
    );
}

/// The check names each non-test file over the bound with its count, and passes a file at the
/// bound and test files of any length.
#[test]
fn l3_the_check_finds_long_files() {
    let lines = |n: usize| "x\n".repeat(n);
    let (at, over, far) = (lines(800), lines(801), lines(2000));
    let found = too_long([
        ("lib.rs", at.as_str()),
        ("lease/actor.rs", over.as_str()),
        ("limiter/mod.rs", far.as_str()),
        ("lease/tests.rs", far.as_str()),
        ("store/tests/big.rs", far.as_str()),
        ("contests.rs", over.as_str()),
        // Without a final newline, the last line still counts.
        ("last.rs", over.trim_end()),
    ]);
    assert_eq!(
        found,
        vec![
            ("lease/actor.rs".to_owned(), 801),
            ("limiter/mod.rs".to_owned(), 2000),
            ("contests.rs".to_owned(), 801),
            ("last.rs".to_owned(), 801),
        ]
    );
}
