//! L1: the library's module dependency arrows point one way (DESIGN.md, "The layers").
//!
//! The check reads the crate's source (from `src/lib.rs`, following every `mod name;` to its
//! file, inline `mod name { … }` blocks included), finds every path that names something of the
//! crate, and builds a graph of which module depends on which. It fails, naming each cycle and
//! the line behind each of its arrows, if the graph has one. No compiler is involved: comments,
//! doc comments, string and character literals are skipped, and what is left is read as tokens.
//!
//! What counts as a reference from a module `M` (the file's module, or an inline module in it):
//!
//! - every `use` (private, `pub`, `pub(crate)` alike, so a re-export is an arrow too), each leaf
//!   of a use tree on its own, globs (`use super::*`) included;
//! - every other path of two segments or more in the code (`crate::x::Y`, `super::Y`,
//!   `self::y::Z`, `child::Z`, and `alias::Z` where `alias` is something `M` imported):
//!   signatures, bodies, attributes, `#[cfg(test)]` code and test files all count.
//!
//! Each path is made absolute (`crate`, `self`, `super` resolved where they stand; a first
//! segment that is neither a child module nor an import of `M`, such as `std` or `tokio`, is
//! another crate and is left out) and then resolved to the module that *defines* what it
//! names: the longest prefix that is a module, and, when the next segment is a name that
//! module only imports (`pub use layer::RateLimitLayer`, or a private `use` a child reaches
//! through `super::`), the import's own target, followed to its end. So `super::RateLimit` in
//! `http/layer.rs` is an arrow to `http::service` when `http/mod.rs` re-exports it from there,
//! and an arrow to `http` only for what `http/mod.rs` defines itself.
//!
//! Which arrows count: for a reference from a file `S` to the file `T` that defines the target
//! (inline modules belong to their file), let `P` be the deepest module containing both.
//!
//! - `S` is `T`, or `S` is `P` (a parent, at any depth, naming something of its descendants): no
//!   arrow. A parent owns its children; `lib.rs` and `mod.rs` re-export and assemble them.
//! - Otherwise the arrow goes from `S'`, the child of `P` on the way to `S`, to `T'`, the child
//!   of `P` on the way to `T`, or to `P` itself when `T` is `P` (a child naming what its parent
//!   defines). `src/lease/slot.rs` naming `crate::store::LeaseRef` is the arrow
//!   `lease → store`; `src/http/layer.rs` naming `super::service::RateLimit` is
//!   `http::layer → http::service`; `src/store/postgres/citus/map.rs` naming
//!   `crate::store::StoreError` is `store::postgres → store`.
//!
//! Every arrow is thus between two children of one module, or from a child to its parent, so a
//! cycle is always among the top-level modules of the crate or among the sibling files of one
//! module directory (with, possibly, their parent's own file). The check runs the same rules over
//! the `tokenlease` binary (`cli/src/main.rs`), a crate of its own.
//!
//! Not arrows: intra-doc links and other comments, a macro called by its bare name (`macro_rules!`
//! scope is textual), and a path starting at a local name that is not an import (a type's
//! associated item, an enum's variant: the `use` that brought the name in is the arrow). `#[cfg]`
//! is not evaluated: every feature's code counts.
//!
//! The last tests run the check over small made-up crates, to show it finds what it is for.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// A module path from the crate root: `[]` is the root, `["http", "layer"]` is `http::layer`.
type ModPath = Vec<String>;

fn show(path: &[String]) -> String {
    if path.is_empty() {
        "crate".to_owned()
    } else {
        path.join("::")
    }
}

// ---------------------------------------------------------------------------------------------
// Tokens

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    /// `::`
    PathSep,
    Punct(char),
}

#[derive(Debug, Clone)]
struct Token {
    tok: Tok,
    line: usize,
}

fn is_ident_start(c: char) -> bool {
    c == '_' || c.is_alphabetic()
}

fn is_ident_char(c: char) -> bool {
    c == '_' || c.is_alphanumeric()
}

/// Rust source as identifiers, `::` and single punctuation, without comments and literals.
fn lex(text: &str) -> Vec<Token> {
    let s: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let mut line = 1;
    let at = |i: usize| s.get(i).copied().unwrap_or('\0');
    // Skips a string body from the opening quote at `i`; `hashes` is the count of a raw
    // string's `#`s, or `None` for a string with escapes. Returns the index after the end.
    let skip_string = |mut i: usize, hashes: Option<usize>, line: &mut usize| -> usize {
        i += 1;
        while i < s.len() {
            let c = s[i];
            if c == '\n' {
                *line += 1;
            }
            match hashes {
                None if c == '\\' => {
                    if at(i + 1) == '\n' {
                        *line += 1;
                    }
                    i += 2;
                    continue;
                }
                None if c == '"' => return i + 1,
                Some(n) if c == '"' && (1..=n).all(|k| at(i + k) == '#') => return i + 1 + n,
                _ => {}
            }
            i += 1;
        }
        i
    };
    while i < s.len() {
        let c = s[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < s.len() && s[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < s.len() {
                if s[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if s[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if s[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if c == '"' {
            i = skip_string(i, None, &mut line);
        } else if c == '\'' {
            if at(i + 1) == '\\' {
                // An escaped character literal: '\n', '\'', '\u{…}'.
                i += 2;
                while i < s.len() && s[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3; // 'a'
            } else {
                // A lifetime or a label.
                i += 1;
                while i < s.len() && is_ident_char(s[i]) {
                    i += 1;
                }
            }
        } else if is_ident_start(c) {
            let start = i;
            while i < s.len() && is_ident_char(s[i]) {
                i += 1;
            }
            let word: String = s[start..i].iter().collect();
            let raw_prefix = matches!(word.as_str(), "r" | "br" | "cr");
            if raw_prefix && (at(i) == '"' || at(i) == '#') {
                let mut hashes = 0;
                while at(i + hashes) == '#' {
                    hashes += 1;
                }
                if at(i + hashes) == '"' {
                    i = skip_string(i + hashes, Some(hashes), &mut line);
                    continue;
                }
                if word == "r" && hashes == 1 && is_ident_start(at(i + 1)) {
                    // A raw identifier, r#type.
                    i += 1;
                    let start = i;
                    while i < s.len() && is_ident_char(s[i]) {
                        i += 1;
                    }
                    let word = s[start..i].iter().collect();
                    out.push(Token {
                        tok: Tok::Ident(word),
                        line,
                    });
                    continue;
                }
            }
            if matches!(word.as_str(), "b" | "c") && at(i) == '"' {
                i = skip_string(i, None, &mut line);
                continue;
            }
            if word == "b" && at(i) == '\'' {
                // b'x', b'\n': a byte literal.
                i += 1;
                if at(i + 1) == '\\' {
                    i += 2;
                }
                while i < s.len() && s[i] != '\'' {
                    i += 1;
                }
                i += 1;
                continue;
            }
            out.push(Token {
                tok: Tok::Ident(word),
                line,
            });
        } else if c.is_ascii_digit() {
            while i < s.len() && is_ident_char(s[i]) {
                i += 1;
            }
        } else if c == ':' && at(i + 1) == ':' {
            out.push(Token {
                tok: Tok::PathSep,
                line,
            });
            i += 2;
        } else {
            out.push(Token {
                tok: Tok::Punct(c),
                line,
            });
            i += 1;
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The crate's modules, imports and references

/// What one module (a file's, or an inline one) declares.
#[derive(Debug, Default)]
struct Module {
    /// The module of the file it is written in.
    file_module: ModPath,
    /// Its child modules, from files and inline blocks.
    children: BTreeSet<String>,
    /// Items it defines at its own level (functions, types, constants, statics, macros).
    defines: BTreeSet<String>,
    /// `use` leaves: the name they bind → the path as written.
    imports: BTreeMap<String, Vec<String>>,
    /// `use …::*` targets, as written.
    globs: Vec<Vec<String>>,
}

/// A path in the code, as written, and where.
#[derive(Debug)]
struct Reference {
    module: ModPath,
    path: Vec<String>,
    file: String,
    line: usize,
}

#[derive(Debug, Default)]
struct Crate {
    modules: BTreeMap<ModPath, Module>,
    /// Every file module → its file, relative to the source root given.
    files: BTreeMap<ModPath, String>,
    references: Vec<Reference>,
}

/// Where a file module's children live: `<dir>/<name>.rs` or `<dir>/<name>/mod.rs`.
fn child_dir(file: &str) -> String {
    let p = Path::new(file);
    let parent = p
        .parent()
        .map(|d| d.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
    let base = if matches!(stem.as_str(), "lib" | "main" | "mod") {
        parent
    } else if parent.is_empty() {
        stem
    } else {
        format!("{parent}/{stem}")
    };
    if base.is_empty() {
        String::new()
    } else {
        format!("{base}/")
    }
}

const ITEM_KEYWORDS: &[&str] = &[
    "fn", "struct", "enum", "trait", "type", "const", "static", "union",
];

impl Crate {
    /// Reads the crate whose root is `root` (relative to the source tree `read` serves).
    fn read(root: &str, read: &dyn Fn(&str) -> Option<String>) -> Crate {
        let mut krate = Crate::default();
        let mut queue = vec![(Vec::new(), root.to_owned())];
        while let Some((module, file)) = queue.pop() {
            let text = read(&file).unwrap_or_else(|| panic!("cannot read {file}"));
            let declared = krate.parse_file(&module, &file, &text);
            let dir = child_dir(&file);
            for name in declared {
                let flat = format!("{dir}{name}.rs");
                let nested = format!("{dir}{name}/mod.rs");
                let child_file = if read(&flat).is_some() {
                    flat
                } else if read(&nested).is_some() {
                    nested
                } else {
                    panic!("{file} declares `mod {name};` but neither {flat} nor {nested} exists")
                };
                let mut child = module.clone();
                child.push(name);
                queue.push((child, child_file));
            }
        }
        krate
    }

    /// Records one file's modules, imports and paths; returns the `mod name;` it declares.
    fn parse_file(&mut self, file_module: &ModPath, file: &str, text: &str) -> Vec<String> {
        let toks = lex(text);
        self.files.insert(file_module.clone(), file.to_owned());
        self.modules
            .entry(file_module.clone())
            .or_default()
            .file_module = file_module.clone();
        let ident = |i: usize| match toks.get(i).map(|t| &t.tok) {
            Some(Tok::Ident(s)) => Some(s.as_str()),
            _ => None,
        };
        let is = |i: usize, tok: Tok| toks.get(i).map(|t| &t.tok) == Some(&tok);
        let mut declared = Vec::new();
        // The inline modules open at this point, with the brace depth inside each.
        let mut stack: Vec<(ModPath, usize)> = vec![(file_module.clone(), 0)];
        let mut depth = 0;
        let mut i = 0;
        while i < toks.len() {
            let (current, base) = stack.last().cloned().unwrap();
            match &toks[i].tok {
                Tok::Punct('{') => depth += 1,
                Tok::Punct('}') => {
                    if stack.len() > 1 && depth == base {
                        stack.pop();
                    }
                    depth -= 1;
                }
                Tok::Ident(kw) if kw == "mod" && ident(i + 1).is_some() => {
                    let name = ident(i + 1).unwrap().to_owned();
                    self.modules
                        .get_mut(&current)
                        .unwrap()
                        .children
                        .insert(name.clone());
                    if is(i + 2, Tok::Punct(';')) {
                        assert!(
                            stack.len() == 1,
                            "{file}: `mod {name};` inside an inline module is not supported"
                        );
                        declared.push(name);
                    } else if is(i + 2, Tok::Punct('{')) {
                        let mut child = current.clone();
                        child.push(name);
                        self.modules.entry(child.clone()).or_default().file_module =
                            file_module.clone();
                        depth += 1;
                        stack.push((child, depth));
                        i += 3;
                        continue;
                    }
                    i += 2;
                    continue;
                }
                Tok::Ident(kw) if kw == "use" => {
                    let line = toks[i].line;
                    i += 1;
                    if is(i, Tok::PathSep) {
                        // `use ::name`: another crate.
                        while i < toks.len() && !is(i, Tok::Punct(';')) {
                            i += 1;
                        }
                        continue;
                    }
                    let mut leaves = Vec::new();
                    parse_use_tree(&toks, &mut i, Vec::new(), &mut leaves);
                    let module = self.modules.get_mut(&current).unwrap();
                    for leaf in leaves {
                        match leaf {
                            UseLeaf::Glob(path) => {
                                module.globs.push(path.clone());
                                self.references.push(Reference {
                                    module: current.clone(),
                                    path,
                                    file: file.to_owned(),
                                    line,
                                });
                            }
                            UseLeaf::Named { path, alias } => {
                                if alias != "_" {
                                    module.imports.insert(alias, path.clone());
                                }
                                self.references.push(Reference {
                                    module: current.clone(),
                                    path,
                                    file: file.to_owned(),
                                    line,
                                });
                            }
                        }
                    }
                    continue;
                }
                Tok::Ident(kw)
                    if depth == base
                        && ITEM_KEYWORDS.contains(&kw.as_str())
                        && ident(i + 1).is_some() =>
                {
                    let name = ident(i + 1).unwrap().to_owned();
                    self.modules.get_mut(&current).unwrap().defines.insert(name);
                }
                Tok::Ident(kw)
                    if depth == base && kw == "macro_rules" && is(i + 1, Tok::Punct('!')) =>
                {
                    if let Some(name) = ident(i + 2) {
                        self.modules
                            .get_mut(&current)
                            .unwrap()
                            .defines
                            .insert(name.to_owned());
                    }
                }
                Tok::Ident(first)
                    if is(i + 1, Tok::PathSep) && !(i > 0 && is(i - 1, Tok::PathSep)) =>
                {
                    let line = toks[i].line;
                    let mut path = vec![first.clone()];
                    let mut j = i + 1;
                    while is(j, Tok::PathSep) && ident(j + 1).is_some() {
                        path.push(ident(j + 1).unwrap().to_owned());
                        j += 2;
                    }
                    self.references.push(Reference {
                        module: current.clone(),
                        path,
                        file: file.to_owned(),
                        line,
                    });
                    i = j;
                    continue;
                }
                _ => {}
            }
            i += 1;
        }
        declared
    }
}

#[derive(Debug)]
enum UseLeaf {
    Named { path: Vec<String>, alias: String },
    Glob(Vec<String>),
}

/// One use tree from `toks[*i]`, under `prefix`; leaves `*i` after it (at `,`, `}` or `;`).
fn parse_use_tree(toks: &[Token], i: &mut usize, prefix: Vec<String>, out: &mut Vec<UseLeaf>) {
    let mut path = prefix;
    loop {
        match toks.get(*i).map(|t| &t.tok) {
            Some(Tok::Punct('{')) => {
                *i += 1;
                loop {
                    match toks.get(*i).map(|t| &t.tok) {
                        Some(Tok::Punct('}')) => {
                            *i += 1;
                            return;
                        }
                        Some(Tok::Punct(',')) => *i += 1,
                        None => return,
                        _ => parse_use_tree(toks, i, path.clone(), out),
                    }
                }
            }
            Some(Tok::Punct('*')) => {
                *i += 1;
                out.push(UseLeaf::Glob(path));
                return;
            }
            Some(Tok::Ident(name)) => {
                let name = name.clone();
                *i += 1;
                if toks.get(*i).map(|t| &t.tok) == Some(&Tok::PathSep) {
                    *i += 1;
                    path.push(name);
                    continue;
                }
                let mut alias = None;
                if let Some(Tok::Ident(kw)) = toks.get(*i).map(|t| &t.tok)
                    && kw == "as"
                {
                    if let Some(Tok::Ident(a)) = toks.get(*i + 1).map(|t| &t.tok) {
                        alias = Some(a.clone());
                    }
                    *i += 2;
                }
                if name == "self" {
                    let last = path.last().cloned().unwrap_or_default();
                    out.push(UseLeaf::Named {
                        alias: alias.unwrap_or(last),
                        path,
                    });
                } else {
                    path.push(name.clone());
                    out.push(UseLeaf::Named {
                        alias: alias.unwrap_or(name),
                        path,
                    });
                }
                return;
            }
            _ => return,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Resolution

/// How deep a chain of imports and re-exports is followed before giving up on it.
const MAX_HOPS: usize = 32;

impl Crate {
    /// `path` as written in `module`, made absolute; `None` for another crate's path or a
    /// path starting at a local item (`Self::`, a type's associated item).
    fn absolute(&self, module: &ModPath, path: &[String], hops: usize) -> Option<Vec<String>> {
        if hops > MAX_HOPS || path.is_empty() {
            return None;
        }
        let first = path[0].as_str();
        match first {
            "crate" => Some(path[1..].to_vec()),
            "self" | "super" => {
                let mut base = module.clone();
                let mut k = 0;
                if first == "self" {
                    k = 1;
                }
                while path.get(k).map(String::as_str) == Some("super") {
                    base.pop()?;
                    k += 1;
                }
                base.extend_from_slice(&path[k..]);
                Some(base)
            }
            _ => {
                let here = self.modules.get(module)?;
                if here.children.contains(first) {
                    let mut p = module.clone();
                    p.extend_from_slice(path);
                    return Some(p);
                }
                if let Some(target) = here.imports.get(first) {
                    let mut p = self.absolute(module, target, hops + 1)?;
                    p.extend_from_slice(&path[1..]);
                    return Some(p);
                }
                // A name a glob import brought: a child module or an import of the glob's
                // module (what it defines is the glob's module itself, the glob's own arrow).
                for glob in &here.globs {
                    let Some(g) = self.absolute(module, glob, hops + 1) else {
                        continue;
                    };
                    let Some(gm) = self.modules.get(&g) else {
                        continue;
                    };
                    if gm.children.contains(first) || gm.imports.contains_key(first) {
                        let p = self.absolute(&g, path, hops + 1)?;
                        return Some(p);
                    }
                }
                None
            }
        }
    }

    /// The module that defines what the absolute `path` names, following imports.
    fn defining_module(&self, path: &[String], hops: usize) -> ModPath {
        let mut k = 0;
        while k < path.len() && self.modules.contains_key(&path[..=k]) {
            k += 1;
        }
        let module = path[..k].to_vec();
        if k == path.len() || hops > MAX_HOPS {
            return module;
        }
        let name = path[k].as_str();
        let here = &self.modules[&module];
        if here.defines.contains(name) {
            return module;
        }
        if let Some(target) = here.imports.get(name)
            && let Some(mut p) = self.absolute(&module, target, hops + 1)
        {
            p.extend_from_slice(&path[k + 1..]);
            return self.defining_module(&p, hops + 1);
        }
        for glob in &here.globs {
            let Some(g) = self.absolute(&module, glob, hops + 1) else {
                continue;
            };
            let Some(gm) = self.modules.get(&g) else {
                continue;
            };
            if gm.defines.contains(name) || gm.imports.contains_key(name) {
                let mut p = g;
                p.extend_from_slice(&path[k..]);
                return self.defining_module(&p, hops + 1);
            }
        }
        module
    }

    fn file_module_of(&self, module: &ModPath) -> ModPath {
        self.modules[module].file_module.clone()
    }
}

// ---------------------------------------------------------------------------------------------
// The graph

/// Why an arrow is there: the first reference behind it.
#[derive(Debug, Clone)]
struct Evidence {
    file: String,
    line: usize,
    written: String,
    resolved: String,
}

type Graph = BTreeMap<ModPath, BTreeMap<ModPath, Evidence>>;

fn graph(krate: &Crate) -> Graph {
    let mut g = Graph::new();
    for r in &krate.references {
        let Some(abs) = krate.absolute(&r.module, &r.path, 0) else {
            continue;
        };
        let target = krate.defining_module(&abs, 0);
        let s = krate.file_module_of(&r.module);
        let t = krate.file_module_of(&target);
        let common = s.iter().zip(&t).take_while(|(a, b)| a == b).count();
        if common == s.len() {
            continue; // the same file, or a parent naming its descendant
        }
        let from = s[..=common].to_vec();
        let to = if common == t.len() {
            t.clone()
        } else {
            t[..=common].to_vec()
        };
        g.entry(from)
            .or_default()
            .entry(to)
            .or_insert_with(|| Evidence {
                file: r.file.clone(),
                line: r.line,
                written: r.path.join("::"),
                resolved: show(&target),
            });
    }
    g
}

/// Every set of modules that depend on each other (a strongly connected component of more than
/// one module), sorted, each with one shortest cycle through its first module, as a closed walk.
fn cycles(g: &Graph) -> Vec<(Vec<ModPath>, Vec<ModPath>)> {
    // Tarjan's algorithm; the graph is small enough to recurse.
    struct State<'a> {
        g: &'a Graph,
        index: BTreeMap<ModPath, usize>,
        low: BTreeMap<ModPath, usize>,
        stack: Vec<ModPath>,
        on_stack: BTreeSet<ModPath>,
        next: usize,
        components: Vec<Vec<ModPath>>,
    }
    fn visit(st: &mut State<'_>, v: &ModPath) {
        st.index.insert(v.clone(), st.next);
        st.low.insert(v.clone(), st.next);
        st.next += 1;
        st.stack.push(v.clone());
        st.on_stack.insert(v.clone());
        let succ: Vec<ModPath> =
            st.g.get(v)
                .map(|m| m.keys().cloned().collect())
                .unwrap_or_default();
        for w in succ {
            if !st.index.contains_key(&w) {
                visit(st, &w);
                let lw = st.low[&w];
                let lv = st.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if st.on_stack.contains(&w) {
                let iw = st.index[&w];
                let lv = st.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if st.low[v] == st.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = st.stack.pop().unwrap();
                st.on_stack.remove(&w);
                let done = &w == v;
                comp.push(w);
                if done {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                st.components.push(comp);
            }
        }
    }
    let mut st = State {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        components: Vec::new(),
    };
    let nodes: BTreeSet<ModPath> = g
        .iter()
        .flat_map(|(k, v)| std::iter::once(k.clone()).chain(v.keys().cloned()))
        .collect();
    for v in &nodes {
        if !st.index.contains_key(v) {
            visit(&mut st, v);
        }
    }
    // One shortest cycle through each component's first module.
    let mut out = Vec::new();
    for comp in st.components {
        let members: BTreeSet<&ModPath> = comp.iter().collect();
        let start = &comp[0];
        let mut prev: BTreeMap<ModPath, ModPath> = BTreeMap::new();
        let mut frontier = vec![start.clone()];
        let mut end = None;
        'bfs: while !frontier.is_empty() {
            let mut next = Vec::new();
            for v in &frontier {
                for w in g.get(v).into_iter().flat_map(|m| m.keys()) {
                    if !members.contains(w) {
                        continue;
                    }
                    if w == start {
                        end = Some(v.clone());
                        break 'bfs;
                    }
                    if !prev.contains_key(w) {
                        prev.insert(w.clone(), v.clone());
                        next.push(w.clone());
                    }
                }
            }
            frontier = next;
        }
        let mut back = Vec::new();
        let mut v = end.expect("a component of two or more modules has a cycle");
        while &v != start {
            back.push(v.clone());
            v = prev[&v].clone();
        }
        let mut walk = vec![start.clone()];
        walk.extend(back.into_iter().rev());
        walk.push(start.clone());
        out.push((comp, walk));
    }
    out
}

/// The check: `Err` with a readable report of every cycle.
fn check(krate: &Crate) -> Result<(), String> {
    let g = graph(krate);
    let found = cycles(&g);
    if found.is_empty() {
        return Ok(());
    }
    let mut msg = format!("{} module dependency cycle(s):\n", found.len());
    for (comp, walk) in &found {
        let names: Vec<String> = walk.iter().map(|m| show(m)).collect();
        writeln!(msg, "\n  {}", names.join(" → ")).unwrap();
        if comp.len() + 1 > walk.len() {
            let all: Vec<String> = comp.iter().map(|m| show(m)).collect();
            writeln!(msg, "    (one cycle of several among {})", all.join(", ")).unwrap();
        }
        for pair in walk.windows(2) {
            let e = &g[&pair[0]][&pair[1]];
            writeln!(
                msg,
                "    {} → {}: {}:{} names `{}` (defined in {})",
                show(&pair[0]),
                show(&pair[1]),
                e.file,
                e.line,
                e.written,
                e.resolved
            )
            .unwrap();
        }
    }
    msg.push_str(
        "\nEach arrow must point down the layering of DESIGN.md, \"The layers\"; \
         tests/models/arrows.rs says which references count.",
    );
    Err(msg)
}

// ---------------------------------------------------------------------------------------------
// The checks

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn read_src(rel: &str) -> Option<String> {
    std::fs::read_to_string(src().join(rel)).ok()
}

/// Every `.rs` file under `dir` (relative to `src/`), sorted.
fn rust_files(dir: &Path, rel: &str, out: &mut Vec<String>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name().to_string_lossy().into_owned();
        let rel = if rel.is_empty() {
            name.clone()
        } else {
            format!("{rel}/{name}")
        };
        if e.file_type().unwrap().is_dir() {
            rust_files(&e.path(), &rel, out);
        } else if name.ends_with(".rs") {
            out.push(rel);
        }
    }
}

#[test]
fn l1_the_library_modules_depend_one_way() {
    let krate = Crate::read("lib.rs", &read_src);
    // Every file under src/ is a module the check read.
    let mut all = Vec::new();
    rust_files(&src(), "", &mut all);
    let read: BTreeSet<&String> = krate.files.values().collect();
    let missed: Vec<&String> = all.iter().filter(|f| !read.contains(f)).collect();
    assert!(
        missed.is_empty(),
        "files under src/ that no `mod` declaration reaches: {missed:?}"
    );
    // The graph is not empty: the reading found the crate's own paths.
    assert!(
        graph(&krate).len() > 5,
        "too few arrows: the reading is broken"
    );
    if let Err(msg) = check(&krate) {
        panic!("{msg}");
    }
}

/// The sources of another crate of the workspace (`cli`, `testkit`), relative to its `src/`.
fn read_crate_src(krate: &str, rel: &str) -> Option<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(krate)
        .join("src");
    std::fs::read_to_string(dir.join(rel)).ok()
}

#[test]
fn l1_the_binary_modules_depend_one_way() {
    let krate = Crate::read("main.rs", &|rel: &str| read_crate_src("cli", rel));
    if let Err(msg) = check(&krate) {
        panic!("{msg}");
    }
}

#[test]
fn l1_the_test_kit_modules_depend_one_way() {
    let krate = Crate::read("lib.rs", &|rel: &str| read_crate_src("testkit", rel));
    if let Err(msg) = check(&krate) {
        panic!("{msg}");
    }
}

/// Reads a made-up crate from `(file, text)` pairs, `lib.rs` its root.
fn made_up(files: &[(&str, &str)]) -> Crate {
    let files: BTreeMap<String, String> = files
        .iter()
        .map(|(f, t)| ((*f).to_owned(), (*t).to_owned()))
        .collect();
    Crate::read("lib.rs", &|f: &str| files.get(f).cloned())
}

#[test]
fn l1_finds_a_cycle_between_top_level_modules() {
    let krate = made_up(&[
        ("lib.rs", "mod a;\npub mod b;\npub use a::A;"),
        ("a.rs", "pub struct A(crate::b::B);"),
        // Through the root's re-export, and in a test module: both count.
        (
            "b.rs",
            "pub struct B;\n#[cfg(test)]\nmod tests {\n    fn f(_: crate::A) {}\n}",
        ),
    ]);
    let msg = check(&krate).unwrap_err();
    assert!(msg.contains("a → b → a"), "{msg}");
    assert!(
        msg.contains("b.rs:4 names `crate::A` (defined in a)"),
        "{msg}"
    );
}

#[test]
fn l1_finds_a_cycle_between_siblings_through_their_parent() {
    let krate = made_up(&[
        ("lib.rs", "pub mod h;"),
        (
            "h/mod.rs",
            "mod x;\nmod y;\npub use x::X;\nuse y::Y;\npub struct Own;",
        ),
        // x names Y through the parent's private import; y names X through its re-export.
        ("h/x.rs", "use super::{Y, Own};\npub struct X;"),
        ("h/y.rs", "pub struct Y;\nfn f() { let _ = super::X; }"),
    ]);
    let msg = check(&krate).unwrap_err();
    assert!(msg.contains("h::x → h::y → h::x"), "{msg}");
    // x → h (for `Own`) is an arrow to the parent; h → x is not one.
    let g = graph(&krate);
    assert!(g[&vec!["h".to_owned(), "x".to_owned()]].contains_key(&vec!["h".to_owned()]));
    assert!(!g.contains_key(&vec!["h".to_owned()]));
}

#[test]
fn l1_allows_arrows_down_and_ignores_comments_strings_and_other_crates() {
    let krate = made_up(&[
        ("lib.rs", "pub mod low;\npub mod high;\npub use high::H;"),
        (
            "low.rs",
            "// crate::high::H\n/// [`crate::high::H`]\nconst Q: &str = \"crate::high::H\";\nconst R: &str = r#\"super::high::H\"#;\nuse std::fmt;\nfn f(_: &dyn fmt::Debug, _: char) { let _ = '\\''; let _ = 'x'; }",
        ),
        (
            "high.rs",
            "use crate::low;\npub struct H;\nfn g() { low::f(&1, 'a'); }\nmod inner {\n    fn h() { super::super::low::f(&2, 'b'); }\n}",
        ),
    ]);
    check(&krate).unwrap();
    let g = graph(&krate);
    assert_eq!(g.len(), 1, "{g:?}");
    assert_eq!(
        g[&vec!["high".to_owned()]].keys().collect::<Vec<_>>(),
        [&vec!["low".to_owned()]]
    );
}
