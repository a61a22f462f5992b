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
//! directory. The end of a path (`lease/word.rs`, a path under `src/` written from a module's
//! directory) must be the end of some file's path, and a file name alone (`lean.rs`) some file's
//! name, but for the records of past runs and changes (`CHANGELOG.md`, `docs/results.md` and
//! `benches/README.md`), which may name the files of their time. A trailing `:line`, `::item` or
//! `#anchor` is not part of the path. Glob-like and
//! placeholder paths (followed by `*`, `<`, `{` or `$`, or containing `NAME`) are skipped. A
//! path cited in a file of the `cli` or `testkit` crate may also be relative to that crate.
//! Markdown links, `[text](target)`, are resolved relative to the file they are in. And
//! DESIGN.md, the index of the design, links every document under `docs/design/`.
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

/// How a citation names its file, and so how it is looked up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// From the repository's root: a top directory first, or an upper-case root Markdown file.
    Rooted,
    /// The end of a path (`lease/words_tests.rs`, `store/postgres/sql/inspect.sql`): some file
    /// of the repository ends so.
    Tail,
    /// A file name alone (`lean.rs`): some file of the repository has that name.
    Bare,
}

/// File name endings that make a word with a `/` the end of a path.
const EXTENSIONS: &[&str] = &[".rs", ".sql", ".sh", ".md", ".toml", ".json"];

/// File name endings that make a word alone a file of the repository (a `.json` or `.toml`
/// named alone is the reader's own file, `policies.json`).
const BARE_EXTENSIONS: &[&str] = &[".rs", ".sql", ".sh", ".md"];

/// Words that look like file names and are not.
const NOT_FILES: &[&str] = &["docs.rs"];

/// The repository paths `text` cites, as written (without `:line` or `#anchor`), each with how
/// it names its file.
fn cited_paths(text: &str) -> Vec<(Kind, String)> {
    let mut found = Vec::new();
    let mut previous: Option<char> = None;
    for (i, c) in text.char_indices() {
        let at_boundary = !previous.is_some_and(is_path_char);
        previous = Some(c);
        if !at_boundary || !(c.is_ascii_alphanumeric() || c == '.') {
            continue;
        }
        let rest = &text[i..];
        let end = rest.find(|c: char| !is_path_char(c)).unwrap_or(rest.len());
        let next = rest[end..].chars().next();
        let run = rest[..end].trim_end_matches(['.', '-']);
        if is_placeholder(run, next) || is_placeholder(&rest[..end], next) {
            continue;
        }
        let kind = if TOP_DIRS.iter().any(|dir| run.starts_with(dir)) {
            Kind::Rooted
        } else if !EXTENSIONS.iter().any(|ext| run.ends_with(ext)) {
            continue;
        } else if let Some((first, _)) = run.split_once('/') {
            // A tail starts with a plain directory name: not `docs.rs/...`, not `../`.
            if first.is_empty()
                || !first
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                continue;
            }
            Kind::Tail
        } else {
            let stem = run.rsplit_once('.').map_or("", |(stem, _)| stem);
            if stem.is_empty()
                || stem.contains('.')
                || NOT_FILES.contains(&run)
                || !BARE_EXTENSIONS.iter().any(|ext| run.ends_with(ext))
            {
                continue;
            }
            let root_file = run.ends_with(".md")
                && stem.len() > 1
                && stem
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            if root_file { Kind::Rooted } else { Kind::Bare }
        };
        found.push((kind, run.to_owned()));
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

/// `text` with the targets of its Markdown links left out (they are checked as links).
fn without_links(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("](") {
        out.push_str(&rest[..at + 2]);
        rest = &rest[at + 2..];
        match rest.find(')') {
            Some(end) => rest = &rest[end..],
            None => break,
        }
    }
    out.push_str(rest);
    out
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

/// Every file under `dir`, skipping [`SKIPPED_DIRS`].
fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !SKIPPED_DIRS.contains(&name.as_str()) {
                files(&path, out);
            }
        } else {
            out.push(path);
        }
    }
}

/// Files whose bare file names may name files that are gone: the records of past runs and
/// changes, which name the files of their time.
const HISTORY: &[&str] = &["CHANGELOG.md", "docs/results.md", "benches/README.md"];

/// Every file of the repository, as a `/`-separated path relative to the root.
fn repository_files(root: &Path) -> Vec<String> {
    let mut paths = Vec::new();
    files(root, &mut paths);
    paths
        .iter()
        .map(|p| {
            let rel = p.strip_prefix(root).unwrap_or(p);
            let parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            parts.join("/")
        })
        .collect()
}

/// Whether `cited`, cited in the file at `rel` (relative to the root), names a file or
/// directory of the repository, whose files are `all`.
fn exists(root: &Path, all: &[String], rel: &str, kind: Kind, cited: &str) -> bool {
    match kind {
        Kind::Rooted => {
            let cited = cited.trim_end_matches('/');
            root.join(cited).exists()
                || rel.split_once('/').is_some_and(|(first, _)| {
                    CRATE_DIRS.contains(&first) && root.join(first).join(cited).exists()
                })
        }
        Kind::Tail => {
            let tail = format!("/{cited}");
            all.iter().any(|f| f == cited || f.ends_with(&tail))
        }
        Kind::Bare => {
            HISTORY.contains(&rel)
                || all
                    .iter()
                    .any(|f| f.rsplit('/').next().is_some_and(|name| name == cited))
        }
    }
}

/// Each dead path or link, as `file:line: path`, over the whole repository.
fn dead_paths(root: &Path) -> (usize, Vec<String>) {
    let all = repository_files(root);
    let mut checked = 0;
    let mut dead = Vec::new();
    let pages = all.iter().filter(|f| f.ends_with(".md"));
    let sources = all.iter().filter(|f| {
        f.ends_with(".rs")
            && f.split_once('/')
                .is_some_and(|(first, _)| COMMENT_DIRS.contains(&first))
    });
    for (rel, markdown) in pages.map(|p| (p, true)).chain(sources.map(|p| (p, false))) {
        let path = root.join(rel);
        let text = std::fs::read_to_string(&path).expect("read a file");
        let text = if markdown { text } else { comments(&text) };
        for (n, line) in text.lines().enumerate() {
            let scanned = if markdown {
                without_links(line)
            } else {
                line.to_owned()
            };
            for (kind, cited) in cited_paths(&scanned) {
                checked += 1;
                if !exists(root, &all, rel, kind, &cited) {
                    dead.push(format!("{rel}:{}: {cited}", n + 1));
                }
            }
            if markdown {
                let dir = path.parent().unwrap_or(root);
                for link in relative_links(line) {
                    checked += 1;
                    if !dir.join(&link).exists() {
                        dead.push(format!("{rel}:{}: link ({link})", n + 1));
                    }
                }
            }
        }
    }
    dead.sort();
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

/// DESIGN.md is the index of the design documents: it links every file under `docs/design/`.
#[test]
fn l5_design_md_links_every_design_document() {
    let root = Path::new(ROOT);
    let design = std::fs::read_to_string(root.join("DESIGN.md")).expect("DESIGN.md");
    let links = relative_links(&design);
    let mut documents: Vec<String> = std::fs::read_dir(root.join("docs/design"))
        .expect("docs/design/")
        .flatten()
        .map(|entry| format!("docs/design/{}", entry.file_name().to_string_lossy()))
        .collect();
    documents.sort();
    assert!(
        documents.len() > 10,
        "only {documents:?} under docs/design/"
    );
    let unlinked: Vec<&String> = documents.iter().filter(|d| !links.contains(d)).collect();
    assert!(
        unlinked.is_empty(),
        "design documents DESIGN.md does not link: {unlinked:?}"
    );
}

/// The extraction finds paths with their line or anchor cut off, skips globs and
/// placeholders, and the whole check fails on a dead path.
#[test]
fn l5_the_check_finds_a_dead_path() {
    let paths: Vec<(Kind, String)> = cited_paths(
        "see `src/lib.rs:12`, docs/results.md#figures and DESIGN.md. Not tests/*/main.rs, \
         tests/<bin>/main.rs, src/{a,b}.rs, docs/NAME.md, scripts/update-*.sql, nor \
         https://h/src/a.rs or docs.rs/x/y.rs; but cli/src/x.rs's own, \
         lease/word.rs::take, lean.rs and .ci/run.",
    );
    assert_eq!(
        paths,
        [
            (Kind::Rooted, "src/lib.rs".to_owned()),
            (Kind::Rooted, "docs/results.md".to_owned()),
            (Kind::Rooted, "DESIGN.md".to_owned()),
            (Kind::Rooted, "cli/src/x.rs".to_owned()),
            (Kind::Tail, "lease/word.rs".to_owned()),
            (Kind::Bare, "lean.rs".to_owned()),
            (Kind::Rooted, ".ci/run".to_owned()),
        ]
    );
    assert_eq!(
        relative_links("[a](docs/failure.md#x) [b](https://x.org/y) [c](../README.md \"t\")"),
        ["docs/failure.md", "../README.md"]
    );
    assert_eq!(
        without_links("[a](x/gone.rs) and [b](y.md)."),
        "[a]() and [b]()."
    );
    assert_eq!(
        comments("let a = 1; \x2F\x2F tests/x.rs\n\x2F\x2F\x2F src/y.rs\nlet s = \"src/z.rs\";"),
        "\x2F\x2F tests/x.rs\n\x2F\x2F\x2F src/y.rs\n\n"
    );

    // A made-up repository with one live and one dead path of each kind.
    let root = std::env::temp_dir().join(format!("tokenlease-doc-paths-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(root.join("src")).expect("a scratch directory");
    std::fs::create_dir_all(root.join("docs")).expect("a scratch directory");
    std::fs::write(
        root.join("src/lib.rs"),
        "//! See docs/a.md and src/gone.rs, a.md, gone.rs, src/lib.rs and x/lib.rs.\n",
    )
    .expect("a file");
    std::fs::write(
        root.join("docs/a.md"),
        "[lib](../src/lib.rs), [gone](b.md), src/lib.rs:3\n",
    )
    .expect("a file");
    let (checked, dead) = dead_paths(&root);
    let _ = std::fs::remove_dir_all(&root);
    assert_eq!(checked, 9);
    assert_eq!(
        dead,
        [
            "docs/a.md:1: link (b.md)",
            "src/lib.rs:1: gone.rs",
            "src/lib.rs:1: src/gone.rs",
            "src/lib.rs:1: x/lib.rs",
        ]
    );
}
