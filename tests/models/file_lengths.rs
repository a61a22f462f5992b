//! L3: each source file of the library says what role it holds, and none has grown past a
//! generous safety net (docs/design/repository.md, "Files: one role each").
//!
//! Files are split by role, not by length: a file holds what is read, changed and reviewed
//! together (the lease actor's loop apart from its refills and expiry, the limiter's builder
//! apart from its call path), and a file that holds one role stays whole however long it is, as
//! a file that mixes two is split however short. No count can tell which is which, and a cap
//! low enough to matter moves code by its count rather than by what belongs with it. So the
//! check asks what can be read from the file itself: that it opens with a module doc (`//!`,
//! its first line of text), which says what the file holds and why it is apart, the statement a
//! review of its cohesion starts from. And, as a net for a file nobody ever split by role,
//! that it has at most [`SAFETY_NET`] lines (the longest file of the library has under 800):
//! one over is named with its count, to be looked at, not cut at a line.
//!
//! It reads every `.rs` file under the library's `src/` (the binary and the test kit are
//! crates of their own). Test files do not count: a file named `tests.rs`, or any file under a
//! directory named `tests`.
//!
//! The last test runs the check over made-up files, to show it finds what it is for.

use std::path::Path;

use super::clock_reads::rust_files;

/// The most lines a source file of the library may have: a net for a file that holds several
/// roles and was never split, far above what one role needs.
const SAFETY_NET: usize = 2_000;

/// Whether the file at `rel` (relative to `src/`, `/`-separated) is a test file.
fn is_test_file(rel: &str) -> bool {
    let mut parts: Vec<&str> = rel.split('/').collect();
    let name = parts.pop().unwrap_or_default();
    name == "tests.rs" || parts.contains(&"tests")
}

/// Whether `text` opens with a module doc that says something: its first non-blank line is a
/// `//!` comment with text after the marker.
fn states_its_role(text: &str) -> bool {
    text.lines()
        .map(str::trim)
        .find(|line| !line.is_empty())
        .and_then(|line| line.strip_prefix("//!"))
        .is_some_and(|doc| !doc.trim().is_empty())
}

/// What the check finds in each non-test file of `files` (path relative to `src/`, text), in
/// the order given: a file without a module doc, and a file over [`SAFETY_NET`] lines with its
/// count.
fn findings<'a>(files: impl IntoIterator<Item = (&'a str, &'a str)>) -> Vec<String> {
    let mut found = Vec::new();
    for (rel, text) in files.into_iter().filter(|(rel, _)| !is_test_file(rel)) {
        if !states_its_role(text) {
            found.push(format!(
                "src/{rel}: no module doc (`//!`) saying what the file holds"
            ));
        }
        let lines = text.lines().count();
        if lines > SAFETY_NET {
            found.push(format!(
                "src/{rel}: {lines} lines, over the net of {SAFETY_NET}"
            ));
        }
    }
    found
}

/// The check over the library's `src/`.
#[test]
fn l3_every_library_source_file_states_its_role_and_none_is_past_the_net() {
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
    let found = findings(
        files
            .iter()
            .map(|(rel, text)| (rel.as_str(), text.as_str())),
    );
    assert!(
        found.is_empty(),
        "library source files (each says in its module doc what role it holds; one that holds \
         several is split by role, into files named after their roles, not cut at a count of \
         lines; docs/design/repository.md):\n{}",
        found.join("\n")
    );
}

/// The check names each non-test file without a module doc, and each over the net with its
/// count; it passes a file at the net, a long file that states its role under the net, and
/// test files of any kind.
#[test]
fn l3_the_check_finds_files_without_a_role_and_past_the_net() {
    let doc = |n: usize| format!("//! The role.\n{}", "x\n".repeat(n - 1));
    let (at, over, long) = (doc(2_000), doc(2_001), doc(1_500));
    let bare = "x\n".repeat(10);
    let found = findings([
        ("lib.rs", at.as_str()),
        ("lease/actor.rs", long.as_str()),
        ("limiter/mod.rs", over.as_str()),
        // Blank lines before the doc are fine; a doc marker with nothing after it is not a doc.
        ("clock.rs", "\n\n//! The clocks.\n"),
        ("key.rs", "//!\nuse std::fmt;\n"),
        ("error.rs", "// A plain comment.\nuse std::fmt;\n"),
        ("bare.rs", bare.as_str()),
        ("lease/tests.rs", bare.as_str()),
        (
            "store/tests/big.rs",
            over.trim_start_matches("//! The role.\n"),
        ),
        ("contests.rs", bare.as_str()),
        // Without a final newline, the last line still counts.
        ("last.rs", over.trim_end()),
    ]);
    assert_eq!(
        found,
        vec![
            "src/limiter/mod.rs: 2001 lines, over the net of 2000".to_owned(),
            "src/key.rs: no module doc (`//!`) saying what the file holds".to_owned(),
            "src/error.rs: no module doc (`//!`) saying what the file holds".to_owned(),
            "src/bare.rs: no module doc (`//!`) saying what the file holds".to_owned(),
            "src/contests.rs: no module doc (`//!`) saying what the file holds".to_owned(),
            "src/last.rs: 2001 lines, over the net of 2000".to_owned(),
        ]
    );
}
