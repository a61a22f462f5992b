//! L2: the library reads time only through its clock (docs/design/time.md).
//!
//! The check reads every `.rs` file under the library's `src/` except `src/clock.rs` (the clocks
//! themselves; the binary and the test kit are other crates of the workspace), and fails, naming
//! each file and line, where the code reads a clock directly: `Instant::now` or
//! `SystemTime::now` (std's or tokio's, called or passed as a function) or `.elapsed()` (which
//! reads the clock too). Comments, doc comments, string and character literals are skipped;
//! `#[cfg(test)]` code counts, so a unit test reads time through `src/clock.rs` as the code does.
//!
//! The last test runs the check over small made-up sources, to show it finds what it is for.

use std::path::{Path, PathBuf};

/// The reads of a clock that only `src/clock.rs` may make.
const FORBIDDEN: [&str; 3] = ["Instant::now", "SystemTime::now", ".elapsed()"];

/// `source` with comments and string and character literals blanked (newlines kept, so line
/// numbers stay). L4 reads the tests with it too.
pub(super) fn code_only(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0usize;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && !ident_before(&chars, i) {
            // A raw string: r"…", r#"…"#, …
            let mut j = i + 1;
            let mut hashes = 0;
            while chars.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if chars.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                match chars.get(j) {
                    None => break,
                    Some('"') if (1..=hashes).all(|k| chars.get(j + k) == Some(&'#')) => {
                        j += 1 + hashes;
                        break;
                    }
                    Some(_) => j += 1,
                }
            }
            for &skipped in &chars[i..j.min(chars.len())] {
                out.push(blank(skipped));
            }
            i = j;
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < chars.len() {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' {
            // A character literal ('x', '\n', '\u{1F600}'), not a lifetime ('a).
            let end = if next == Some('\\') {
                (i + 3..chars.len()).find(|&k| chars[k] == '\'')
            } else if chars.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(end) => {
                    for _ in i..=end {
                        out.push(' ');
                    }
                    i = end + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Whether the character before `i` continues an identifier (`for` in `for"…"` is not, `bar`
/// in `bar"` is: then `r` is the end of a name, not a raw string's start).
fn ident_before(chars: &[char], i: usize) -> bool {
    i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_')
}

/// Each direct read of a clock in `source`: (line, what).
fn reads(source: &str) -> Vec<(usize, &'static str)> {
    let code = code_only(source);
    let mut found = Vec::new();
    for (n, line) in code.lines().enumerate() {
        let squeezed: String = line.chars().filter(|c| !c.is_whitespace()).collect();
        for what in FORBIDDEN {
            if squeezed.contains(what) {
                found.push((n + 1, what));
            }
        }
    }
    found
}

/// Every `.rs` file under `dir`, sorted (L3 and L4 read files with it too).
pub(super) fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// The check over the crate's `src/`.
#[test]
fn l2_the_library_reads_time_only_through_its_clock() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let exempt = [src.join("clock.rs")];
    let mut checked = 0;
    let mut report = String::new();
    for file in &files {
        if exempt.iter().any(|e| file.starts_with(e)) {
            continue;
        }
        checked += 1;
        let source = std::fs::read_to_string(file).expect("read a source file");
        for (line, what) in reads(&source) {
            let shown = file.strip_prefix(&src).unwrap_or(file).display();
            report.push_str(&format!("src/{shown}:{line}: {what}\n"));
        }
    }
    // The library's modules are all there (a wrong directory would check nothing).
    assert!(checked > 50, "only {checked} files under {}", src.display());
    assert!(
        report.is_empty(),
        "the library reads a clock outside src/clock.rs (read `clock::instant` or \
         `clock::now`, once per call, and pass it down):\n{report}"
    );
}

/// The check finds each kind of read, in code of every shape, and nothing in comments, strings
/// or character literals.
#[test]
fn l2_the_check_finds_direct_reads() {
    let found = reads(
        "use tokio::time::Instant;\n\
         fn a() { let t = Instant::now(); }\n\
         fn b() { let t = std::time::SystemTime :: now(); }\n\
         fn c(t: Instant) -> u64 { t.elapsed().as_nanos() as u64 }\n\
         fn d() -> fn() -> Instant { tokio::time::Instant::now }\n\
         fn e<'a>(s: &'a str) -> &'a str { s } fn f() { Instant::now(); }\n",
    );
    assert_eq!(
        found,
        vec![
            (2, "Instant::now"),
            (3, "SystemTime::now"),
            (4, ".elapsed()"),
            (5, "Instant::now"),
            (6, "Instant::now"),
        ]
    );
    let quiet = reads(
        "// Instant::now() in a comment\n\
         /// SystemTime::now() in a doc comment\n\
         /* a block: .elapsed() /* nested */ Instant::now() */\n\
         const S: &str = \"Instant::now()\";\n\
         const R: &str = r#\"SystemTime::now() \"quoted\"\"#;\n\
         const C: char = '\"'; const D: &str = \".elapsed()\";\n\
         fn g() -> Instant { crate::clock::instant() }\n",
    );
    assert_eq!(quiet, vec![]);
}
