//! The README's first screen, as a new user meets it: the Rust blocks of README.md and the
//! pages of docs/ hide no lines (rustdoc's `# ` lines, which a reader pasting the block does not
//! see), so the doc tests that compile them (`ReadmeDoctests` and `RolesDoctests` in
//! src/lib.rs) compile what the reader sees; the first block is a whole program with its policy
//! inline, near the top, after the dependency line; and the README says how to put the
//! `tokenlease` command on the `PATH`.

use std::path::Path;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Each ```rust block of `text` (any `rust,…` info string), with the line it starts on.
fn rust_blocks(text: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        match &mut current {
            None if line.starts_with("```rust") => current = Some((i + 1, String::new())),
            None => {}
            Some(_) if line.starts_with("```") => blocks.extend(current.take()),
            Some((_, body)) => {
                body.push_str(line);
                body.push('\n');
            }
        }
    }
    blocks
}

/// The lines rustdoc would hide: `#` alone or `# ` and more (`#[…]` and `#!` are code).
fn hidden_lines(block: &str) -> Vec<&str> {
    block
        .lines()
        .filter(|l| {
            let t = l.trim_start();
            t == "#" || t.starts_with("# ")
        })
        .collect()
}

#[test]
fn readme_and_docs_rust_blocks_hide_no_lines() {
    let mut pages = vec![Path::new(ROOT).join("README.md")];
    for entry in std::fs::read_dir(Path::new(ROOT).join("docs")).expect("docs/") {
        let path = entry.expect("an entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    let mut found = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).expect("a page");
        for (line, block) in rust_blocks(&text) {
            for hidden in hidden_lines(&block) {
                found.push(format!("{}:{line}: {hidden}", page.display()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "hidden lines in Rust blocks:\n{}",
        found.join("\n")
    );
    // The check finds one.
    assert_eq!(
        hidden_lines("# async fn run() {\nlet x = 1;\n#[derive(Debug)]\n#"),
        ["# async fn run() {", "#"]
    );
}

#[test]
fn the_readme_starts_with_a_whole_program() {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).expect("README.md");
    let blocks = rust_blocks(&readme);
    let (line, first) = blocks.first().expect("a Rust block");
    assert!(*line <= 60, "the first Rust block starts on line {line}");
    for needed in [
        "#[tokio::main]",
        "async fn main()",
        "Policies::from_json_str(",
    ] {
        assert!(
            first.contains(needed),
            "the first block lacks {needed}:\n{first}"
        );
    }
    let dependency = readme.find("tokenlease = {").expect("a dependency line");
    let program = readme.find(first.as_str()).expect("the block");
    assert!(
        dependency < program,
        "the dependency line comes after the program"
    );
    assert!(
        readme.contains("cargo install --path cli"),
        "no word on installing the command"
    );
    // What compiles them, from the README's own text.
    let lib = std::fs::read_to_string(Path::new(ROOT).join("src/lib.rs")).expect("src/lib.rs");
    assert!(
        lib.contains("include_str!(\"../README.md\")"),
        "the README is not doc-tested"
    );
    assert!(
        lib.contains("include_str!(\"../docs/roles.md\")"),
        "docs/roles.md is not doc-tested"
    );
}
