//! L5: every repository path that the Markdown files and the code comments cite exists, and
//! every relative link of the Markdown resolves.
//!
//! A path written in a document or a comment is a promise to the reader that the file is there;
//! files move and the text that names them stays behind. The check reads every `*.md` of the
//! repository (not under `target/`) and every `//`, `///` and `//!` comment of the Rust files
//! under `src/`, `tests/`, `benches/`, `cli/` and `testkit/`, takes what looks like a
//! repository path (a run of path characters that starts with a top directory of the
//! repository, `src/`, `docs/`, `.ci/` and the rest of [`TOP_DIRS`], or an upper-case root
//! Markdown file such as `DESIGN.md`), and fails naming each one that is neither a file nor a
//! directory. A trailing `:line`, `::item` or `#anchor` is not part of the path. Glob-like and
//! placeholder paths (followed by `*`, `<`, `{` or `$`, or containing `NAME`) are skipped. A
//! path cited in a file of the `cli` or `testkit` crate may also be relative to that crate.
//! Markdown links, `[text](target)`, are resolved relative to the file they are in.
//!
//! The last test runs the extraction over made-up text, to show it finds a dead path.

use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The repository's top directories: a cited path starts with one of them.
const TOP_DIRS: &[&str] = &[
    "src/",
    "tests/",
    "benches/",
    "docs/",
    "cli/",
    "testkit/",
    "scripts/",
    "migrations/",
    "functions/",
    "examples/",
    ".ci/",
    ".config/",
];

/// The directories whose Rust comments are checked.
const COMMENT_DIRS: &[&str] = &["src", "tests", "benches", "cli", "testkit"];

/// Crates of the workspace below the root: a path cited in one of their files may be relative
/// to the crate.
const CRATE_DIRS: &[&str] = &["cli", "testkit", "fuzz"];

/// Directories never read.
const SKIPPED_DIRS: &[&str] = &["target", ".git", "node_modules"];

fn is_path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/')
}

/// A placeholder or glob rather than a path.
fn is_placeholder(path: &str, next: Option<char>) -> bool {
    matches!(next, Some('*' | '<' | '{' | '$')) || path.contains("NAME") || path.contains("...")
}

/// The repository paths `text` cites, as written (without `:line` or `#anchor`).
fn cited_paths(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut previous: Option<char> = None;
    for (i, c) in text.char_indices() {
        let at_boundary = !previous.is_some_and(is_path_char);
        previous = Some(c);
        if !at_boundary {
            continue;
        }
        let rest = &text[i..];
        let top = TOP_DIRS.iter().any(|dir| rest.starts_with(dir));
        let upper = c.is_ascii_uppercase();
        if !top && !upper {
            continue;
        }
        let end = rest.find(|c: char| !is_path_char(c)).unwrap_or(rest.len());
        let run = rest[..end].trim_end_matches(['.', '-']);
        if upper {
            // A root file: upper-case letters, digits, `_` or `-`, then `.md`.
            let Some(stem) = run.strip_suffix(".md") else {
                continue;
            };
            if stem.len() < 2
                || !stem
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
            {
                continue;
            }
        }
        let next = rest[run.len()..].chars().next();
        if is_placeholder(run, next) {
            continue;
        }
        found.push(run.to_owned());
    }
    found
}

/// The targets of the relative links of Markdown `text` (`[text](target)`), without anchor.
fn relative_links(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("](") {
        rest = &rest[at + 2..];
        let Some(end) = rest.find(')') else { break };
        let target = rest[..end].split_whitespace().next().unwrap_or("");
        let target = target.split('#').next().unwrap_or("");
        if target.is_empty()
            || target.contains("://")
            || target.starts_with("mailto:")
            || is_placeholder(target, None)
        {
            continue;
        }
        found.push(target.to_owned());
    }
    found
}

/// The comment text of Rust source `text`: what follows `//` on each line that has one.
fn comments(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        let comment = if trimmed.starts_with("//") {
            Some(trimmed)
        } else {
            line.find(" // ").map(|at| &line[at + 1..])
        };
        if let Some(comment) = comment {
            out.push_str(comment);
        }
        out.push('\n');
    }
    out
}

/// Every file under `dir` whose name ends with `suffix`, skipping [`SKIPPED_DIRS`].
fn files(dir: &Path, suffix: &str, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !SKIPPED_DIRS.contains(&name.as_str()) {
                files(&path, suffix, out);
            }
        } else if name.ends_with(suffix) {
            out.push(path);
        }
    }
}

/// Whether `cited`, cited in the file at `rel` (relative to the root), names a file or
/// directory of the repository.
fn exists(root: &Path, rel: &Path, cited: &str) -> bool {
    let cited = cited.trim_end_matches('/');
    if root.join(cited).exists() {
        return true;
    }
    rel.components()
        .next()
        .and_then(|first| first.as_os_str().to_str())
        .is_some_and(|first| CRATE_DIRS.contains(&first) && root.join(first).join(cited).exists())
}

/// Each dead path or link, as `file:line: path`, over the whole repository.
fn dead_paths(root: &Path) -> (usize, Vec<String>) {
    let mut checked = 0;
    let mut dead = Vec::new();
    let mut pages = Vec::new();
    files(root, ".md", &mut pages);
    let mut sources = Vec::new();
    for dir in COMMENT_DIRS {
        files(&root.join(dir), ".rs", &mut sources);
    }
    for (path, markdown) in pages
        .iter()
        .map(|p| (p, true))
        .chain(sources.iter().map(|p| (p, false)))
    {
        let text = std::fs::read_to_string(path).expect("read a file");
        let rel = path.strip_prefix(root).unwrap_or(path);
        let text = if markdown { text } else { comments(&text) };
        for (n, line) in text.lines().enumerate() {
            for cited in cited_paths(line) {
                checked += 1;
                if !exists(root, rel, &cited) {
                    dead.push(format!("{}:{}: {cited}", rel.display(), n + 1));
                }
            }
            if markdown {
                let dir = path.parent().unwrap_or(root);
                for link in relative_links(line) {
                    checked += 1;
                    if !dir.join(&link).exists() {
                        dead.push(format!("{}:{}: link ({link})", rel.display(), n + 1));
                    }
                }
            }
        }
    }
    (checked, dead)
}

#[test]
fn l5_every_cited_repository_path_exists() {
    let (checked, dead) = dead_paths(Path::new(ROOT));
    // The repository's documents cite hundreds of paths (a wrong root would check nothing).
    assert!(checked > 500, "only {checked} paths checked under {ROOT}");
    assert!(
        dead.is_empty(),
        "paths cited in Markdown or code comments that do not exist (fix the path, or say it \
         in words if the file is gone):\n{}",
        dead.join("\n")
    );
}

/// The extraction finds paths with their line or anchor cut off, skips globs and
/// placeholders, and the whole check fails on a dead path.
#[test]
fn l5_the_check_finds_a_dead_path() {
    assert_eq!(
        cited_paths(
            "see `src/lib.rs:12`, docs/results.md#figures and DESIGN.md. Not \
             tests/*/main.rs, tests/<bin>/main.rs, src/{a,b}.rs, docs/NAME.md, \
             cli/src/x.rs's own, nor mysrc/x.rs or https://h/src/a.rs; also .ci/run."
        ),
        [
            "src/lib.rs",
            "docs/results.md",
            "DESIGN.md",
            "cli/src/x.rs",
            ".ci/run"
        ]
    );
    assert_eq!(
        relative_links("[a](docs/failure.md#x) [b](https://x.org/y) [c](../README.md \"t\")"),
        ["docs/failure.md", "../README.md"]
    );
    assert_eq!(
        comments("let a = 1; // tests/x.rs\n/// src/y.rs\nlet s = \"src/z.rs\";"),
        "// tests/x.rs\n/// src/y.rs\n\n"
    );

    // A made-up repository with one live and one dead path of each kind.
    let root = std::env::temp_dir().join(format!("tokenlease-doc-paths-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(root.join("src")).expect("a scratch directory");
    std::fs::create_dir_all(root.join("docs")).expect("a scratch directory");
    std::fs::write(root.join("src/lib.rs"), "//! See docs/a.md and src/gone.rs.\n")
        .expect("a file");
    std::fs::write(
        root.join("docs/a.md"),
        "[lib](../src/lib.rs), [gone](b.md), src/lib.rs:3\n",
    )
    .expect("a file");
    let (checked, dead) = dead_paths(&root);
    let _ = std::fs::remove_dir_all(&root);
    assert_eq!(checked, 5);
    assert_eq!(
        dead,
        ["docs/a.md:1: link (b.md)", "src/lib.rs:1: src/gone.rs"]
    );
}
