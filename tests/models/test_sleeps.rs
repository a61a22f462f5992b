//! L4: no sleep in the tests stands for synchronisation (docs/testing.md, "Sleeps in tests").
//!
//! The check reads every `.rs` file of the tests (`tests/`, `cli/tests`, `testkit/tests`) and
//! the test code of the library's `src/` (a file whose name ends in `tests.rs` or that sits in
//! a `tests` directory, and in any other file its `mod tests {` block and what follows it), and
//! fails, naming each file and line, at a call of a `sleep(` or `sleep_until(` (std's,
//! tokio's, or any other) that is neither in the shared poll helpers of `tests/common/mod.rs`
//! (`poll_until` and `poll_until_blocking`: the one place where a test waits for a condition by
//! looking again) nor marked with its reason: a `// sleep: <reason>` comment on its line or in
//! the comment lines just above it. A sleep that waits for something to happen is replaced by
//! awaiting that thing (`common::actor_idle`, `common::eventually`, and in the library's tests
//! `crate::tests::eventually`, …); one that stands for time that must really pass, or for
//! pacing, says so. Comments and string literals are skipped, so a sleep named in prose or in a
//! made-up source is no call. A call of any function whose name ends in `sleep` counts (the
//! check's own functions are named otherwise).
//!
//! The last tests run the check over small made-up sources, to show it finds what it is for.

use std::path::Path;

use super::clock_reads::{code_only, rust_files};

/// The functions of `tests/common/mod.rs` that may sleep unmarked: the shared poll helpers.
const HELPERS: [&str; 2] = ["poll_until", "poll_until_blocking"];

/// The marker that gives a kept sleep its reason.
const MARKER: &str = "// sleep:";

/// The name of the innermost `fn` whose body holds line `line` (0-based) of `code` (comments
/// and strings blanked). `None` outside any function.
fn enclosing_fn(code: &str, line: usize) -> Option<String> {
    // Each `fn` seen and not closed: its name, the brace depth it was declared at, and whether
    // its body's brace has opened.
    let mut open: Vec<(String, i64, bool)> = Vec::new();
    let (mut braces, mut parens) = (0i64, 0i64);
    for (n, text) in code.lines().enumerate() {
        if n == line {
            return open
                .iter()
                .rev()
                .find(|(_, _, body)| *body)
                .map(|(name, _, _)| name.clone());
        }
        let chars: Vec<char> = text.chars().collect();
        for (k, &c) in chars.iter().enumerate() {
            let word_start = k == 0 || !(chars[k - 1].is_alphanumeric() || chars[k - 1] == '_');
            if word_start && chars[k..].starts_with(&['f', 'n', ' ']) {
                let name: String = chars[k + 3..]
                    .iter()
                    .skip_while(|c| c.is_whitespace())
                    .take_while(|c| c.is_alphanumeric() || **c == '_')
                    .collect();
                if !name.is_empty() {
                    open.push((name, braces, false));
                }
            }
            match c {
                '(' | '[' => parens += 1,
                ')' | ']' => parens -= 1,
                '{' => {
                    if let Some(last) = open.last_mut()
                        && !last.2
                        && last.1 == braces
                        && parens == 0
                    {
                        last.2 = true;
                    }
                    braces += 1;
                }
                '}' => {
                    braces -= 1;
                    if open
                        .last()
                        .is_some_and(|(_, d, body)| *body && *d == braces)
                    {
                        open.pop();
                    }
                }
                // A `fn` without a body (in a trait) ends at its `;`.
                ';' if parens == 0
                    && open
                        .last()
                        .is_some_and(|(_, d, body)| !*body && *d == braces) =>
                {
                    open.pop();
                }
                _ => {}
            }
        }
    }
    None
}

/// Whether the sleep on line `line` (0-based) of `source` carries its reason: the marker on
/// that line, or in the run of comment lines just above it.
fn marked(source: &str, line: usize) -> bool {
    let lines: Vec<&str> = source.lines().collect();
    if lines[line].contains(MARKER) {
        return true;
    }
    lines[..line]
        .iter()
        .rev()
        .map(|l| l.trim_start())
        .take_while(|l| l.starts_with("//"))
        .any(|l| l.starts_with(MARKER))
}

/// Whether a line of code (comments and strings blanked) calls a sleep.
fn calls_a_sleep_fn(line: &str) -> bool {
    let squeezed: String = line.chars().filter(|c| !c.is_whitespace()).collect();
    squeezed.contains("sleep(") || squeezed.contains("sleep_until(")
}

/// The first line (0-based) of the test code in the library file at `rel` (relative to `src/`,
/// `/`-separated): 0 for a test file (its name ends in `tests.rs`, or it sits in a `tests`
/// directory), else the line of its `mod tests {` at the start of a line; `None` without one.
fn tests_from(rel: &str, code: &str) -> Option<usize> {
    let mut parts: Vec<&str> = rel.split('/').collect();
    let name = parts.pop().unwrap_or_default();
    if name.ends_with("tests.rs") || parts.contains(&"tests") {
        return Some(0);
    }
    code.lines().position(|l| l.starts_with("mod tests {"))
}

/// Each sleep of `source` from line `from` (0-based) on that is neither marked nor (when
/// `helpers_here`) in a poll helper: its line, 1-based.
fn unexplained_from(source: &str, from: usize, helpers_here: bool) -> Vec<usize> {
    let code = code_only(source);
    let mut found = Vec::new();
    for (n, line) in code.lines().enumerate().skip(from) {
        if !calls_a_sleep_fn(line) {
            continue;
        }
        let in_helper = helpers_here
            && enclosing_fn(&code, n).is_some_and(|name| HELPERS.contains(&name.as_str()));
        if !in_helper && !marked(source, n) {
            found.push(n + 1);
        }
    }
    found
}

/// Each sleep of `source` that is neither marked nor (when `helpers_here`) in a poll helper:
/// its line, 1-based.
fn unexplained(source: &str, helpers_here: bool) -> Vec<usize> {
    unexplained_from(source, 0, helpers_here)
}

/// The check over the workspace's tests.
#[test]
fn l4_every_sleep_in_the_tests_is_a_poll_or_says_why() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["tests", "cli/tests", "testkit/tests"] {
        rust_files(&root.join(dir), &mut files);
    }
    let helpers = root.join("tests/common/mod.rs");
    let (mut sleeps, mut report) = (0, String::new());
    for file in &files {
        let source = std::fs::read_to_string(file).expect("read a source file");
        sleeps += code_only(&source)
            .lines()
            .filter(|l| calls_a_sleep_fn(l))
            .count();
        for line in unexplained(&source, *file == helpers) {
            let shown = file.strip_prefix(root).unwrap_or(file).display();
            report.push_str(&format!("{shown}:{line}\n"));
        }
    }
    // The library's unit tests.
    let src = root.join("src");
    let mut library = Vec::new();
    rust_files(&src, &mut library);
    let mut library_sleeps = 0;
    for file in &library {
        let source = std::fs::read_to_string(file).expect("read a source file");
        let rel: Vec<String> = file
            .strip_prefix(&src)
            .unwrap_or(file)
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        let code = code_only(&source);
        let Some(from) = tests_from(&rel.join("/"), &code) else {
            continue;
        };
        library_sleeps += code
            .lines()
            .skip(from)
            .filter(|l| calls_a_sleep_fn(l))
            .count();
        for line in unexplained_from(&source, from, false) {
            report.push_str(&format!("src/{}:{line}\n", rel.join("/")));
        }
    }
    assert!(
        library_sleeps > 5,
        "only {library_sleeps} sleeps in the library's tests"
    );
    // The tests are all there (a wrong directory would check nothing), and so are their sleeps.
    assert!(files.len() > 50, "only {} files", files.len());
    assert!(sleeps > 20, "only {sleeps} sleeps found");
    assert!(
        report.is_empty(),
        "a sleep in the tests neither in the shared poll helper nor marked `{MARKER} <reason>` \
         (await what it waits for: `common::actor_idle`, `common::eventually`, in the library \
         `crate::tests::eventually`; or say why time must pass, docs/testing.md \"Sleeps in \
         tests\"):\n{report}"
    );
}

/// The check finds an unmarked sleep of every kind, accepts a marked one and the helpers'
/// own, and ignores comments and strings.
#[test]
fn l4_the_check_finds_unexplained_sleeps() {
    let source = "async fn a() {\n\
                  \x20   tokio::time::sleep(Duration::from_millis(20)).await;\n\
                  }\n\
                  fn b() { std::thread::sleep(D); }\n\
                  async fn c() {\n\
                  \x20   // sleep: pacing, calls 5 ms apart.\n\
                  \x20   tokio::time::sleep(D).await;\n\
                  \x20   // sleep: the server's clock,\n\
                  \x20   // 20 ms of refill.\n\
                  \x20   tokio::time::sleep(D).await;\n\
                  \x20   thread::sleep(D); // sleep: pacing\n\
                  \x20   // A sleep(D) in a comment; \"sleep(D)\" in a string.\n\
                  \x20   let s = \"tokio::time::sleep(D)\";\n\
                  \x20   // sleep: a reason separated from its sleep by code\n\
                  \x20   let x = 1;\n\
                  \x20   tokio::time::sleep(D).await;\n\
                  }\n\
                  pub async fn poll_until() {\n\
                  \x20   loop { tokio::time::sleep(D).await; }\n\
                  }\n\
                  fn d() { let _ = '\"'; tokio::time::sleep(D); }\n";
    assert_eq!(unexplained(source, false), vec![2, 4, 16, 19, 21]);
    // In the helpers' own file, the poll helper's sleep is the allowed one; the others are not.
    assert_eq!(unexplained(source, true), vec![2, 4, 16, 21]);
    // `sleep_until` is a sleep too.
    let until = "async fn e() {\n\
                 \x20   tokio::time::sleep_until(at).await;\n\
                 \x20   // sleep: the timeline's next step.\n\
                 \x20   tokio::time::sleep_until(at).await;\n\
                 }\n";
    assert_eq!(unexplained(until, false), vec![2]);
}

/// In the library, test code is a test file or a file's `mod tests` block and what follows;
/// a sleep in the library's own code above it is not the check's.
#[test]
fn l4_library_test_code_is_found() {
    let source = "async fn run() {\n\
                  \x20   tokio::time::sleep(backoff).await;\n\
                  }\n\
                  #[cfg(test)]\n\
                  mod tests {\n\
                  \x20   async fn t() { tokio::time::sleep(D).await; }\n\
                  }\n";
    let code = code_only(source);
    let from = tests_from("lease/actor/mod.rs", &code).expect("a tests module");
    assert_eq!(unexplained_from(source, from, false), vec![6]);
    assert_eq!(tests_from("store/postgres/pool_tests.rs", &code), Some(0));
    assert_eq!(tests_from("store/breaker/tests.rs", &code), Some(0));
    assert_eq!(tests_from("policy/load/tests/cases.rs", &code), Some(0));
    assert_eq!(tests_from("clock.rs", "fn now() {}\n"), None);
}
