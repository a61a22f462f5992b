//! The statements the store sends, each written in a `.sql` file and included at build time:
//! the files of `sql/` (the plain store's statements, and the calls the store sends to a Citus
//! node), and of `citus/sql/` (the statements a Citus node runs on one shard, and the node
//! functions that run them). docs/design/statements.md, "The SQL files", lists them.
//!
//! What varies at run time is a named placeholder, `{name}` (lower-case letters and `_`): the
//! table a statement reads (`{buckets}`, `{returns}`: the plain tables, or a Citus shard's),
//! and in a node function the quoted text of the shard statement it runs. [`SqlFile::new`]
//! refuses, at compile time, a file with a placeholder it is not given a name for, or a name
//! the file does not use; [`SqlFile::render`] takes exactly one value per name (its array's
//! length is the file's count of names), so no placeholder is left unfilled.
//!
//! Most statements are sent as one line, as they always were: the file is written over several
//! lines for its reader, and [`Form::OneLine`] joins them (each line break and the indentation
//! after it one space; the break that ends a `--` comment line kept). So a file's text differs
//! from what PostgreSQL receives only in line breaks and indentation, which PostgreSQL's parser
//! does not see; the plans are those of the one-line text. The unit tests
//! (`statement_tests.rs`, `citus/tests.rs`) pin each statement's text and check that what the
//! store prepares is its file, rendered.

/// How a file's text becomes its statement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Form {
    /// The file's text as it is: its line breaks, comments and final line break included.
    AsWritten,
    /// The file's lines joined into one: each line's indentation dropped, the line break after
    /// a `--` comment line kept (it ends the comment), every other line break one space; blank
    /// lines and the final line break dropped. A `--` in such a file starts a line.
    OneLine,
}

/// A statement file: its text, its placeholders' names, and how its text becomes the
/// statement.
#[derive(Clone, Copy, Debug)]
pub(super) struct SqlFile<const N: usize> {
    /// The file's path under `src/store/postgres/` (read by the tests, which compare the file on
    /// the disk with what the store sends).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(super) path: &'static str,
    /// The file's text.
    pub(super) text: &'static str,
    names: [&'static str; N],
    /// How its text becomes the statement.
    pub(super) form: Form,
}

impl<const N: usize> SqlFile<N> {
    /// The file at `path` with `text`, whose placeholders are exactly `names`. Evaluated at
    /// compile time for the constants below: a placeholder of the file not in `names`, or a name
    /// the file does not use, fails the build.
    pub(super) const fn new(
        path: &'static str,
        text: &'static str,
        names: [&'static str; N],
        form: Form,
    ) -> Self {
        let bytes = text.as_bytes();
        let mut used = [false; N];
        let mut i = 0;
        while i < bytes.len() {
            let end = placeholder_end(bytes, i);
            if end > 0 {
                let mut k = 0;
                let mut known = false;
                while k < N {
                    if same(bytes, i + 1, end - 1, names[k].as_bytes()) {
                        used[k] = true;
                        known = true;
                    }
                    k += 1;
                }
                if !known {
                    panic!("a statement file has a placeholder it is not given a name for");
                }
                i = end;
            } else {
                i += 1;
            }
        }
        let mut k = 0;
        while k < N {
            if !used[k] {
                panic!("a statement file does not use a placeholder it is given a name for");
            }
            k += 1;
        }
        SqlFile {
            path,
            text,
            names,
            form,
        }
    }

    /// The statement: the file's text in its [`Form`], each placeholder replaced by the value
    /// at its name's index.
    pub(super) fn render(&self, values: [&str; N]) -> String {
        self.render_escaped(values, str::to_owned)
    }

    /// As [`render`](Self::render), with the file's own text (not the values) passed through
    /// `escape`: a shard statement becomes a template for PL/pgSQL's `format()` with its `%`
    /// doubled and its tables the values `%1$s` and `%2$s`.
    pub(super) fn render_escaped(&self, values: [&str; N], escape: fn(&str) -> String) -> String {
        let formed = match self.form {
            Form::AsWritten => self.text.to_owned(),
            Form::OneLine => one_line(self.text),
        };
        let bytes = formed.as_bytes();
        let mut out = String::with_capacity(formed.len());
        let (mut from, mut i) = (0, 0);
        while i < bytes.len() {
            let end = placeholder_end(bytes, i);
            if end == 0 {
                i += 1;
                continue;
            }
            out.push_str(&escape(&formed[from..i]));
            let name = &formed[i + 1..end - 1];
            if let Some(k) = self.names.iter().position(|n| *n == name) {
                out.push_str(values[k]);
            }
            from = end;
            i = end;
        }
        out.push_str(&escape(&formed[from..]));
        out
    }
}

/// If a placeholder `{name}` starts at `i` of `bytes`, the index just after its `}`; else 0.
const fn placeholder_end(bytes: &[u8], i: usize) -> usize {
    if bytes[i] != b'{' {
        return 0;
    }
    let mut j = i + 1;
    while j < bytes.len() && (bytes[j].is_ascii_lowercase() || bytes[j] == b'_') {
        j += 1;
    }
    if j > i + 1 && j < bytes.len() && bytes[j] == b'}' {
        j + 1
    } else {
        0
    }
}

/// Whether `bytes[from..to]` is `name`.
const fn same(bytes: &[u8], from: usize, to: usize, name: &[u8]) -> bool {
    if to - from != name.len() {
        return false;
    }
    let mut k = 0;
    while k < name.len() {
        if bytes[from + k] != name[k] {
            return false;
        }
        k += 1;
    }
    true
}

/// `text` as [`Form::OneLine`] joins it.
pub(super) fn one_line(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut after_comment = None;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        match after_comment {
            Some(true) => out.push('\n'),
            Some(false) => out.push(' '),
            None => {}
        }
        out.push_str(line);
        after_comment = Some(line.starts_with("--"));
    }
    out
}

/// A file of `sql/`, by its name without `.sql`.
macro_rules! sql_file {
    ($name:literal, $form:ident, [$($placeholder:literal),*]) => {
        SqlFile::new(
            concat!("sql/", $name, ".sql"),
            include_str!(concat!("sql/", $name, ".sql")),
            [$($placeholder),*],
            Form::$form,
        )
    };
}

/// A file of `citus/sql/`, by its name without `.sql`.
macro_rules! citus_file {
    ($name:literal, $form:ident, [$($placeholder:literal),*]) => {
        SqlFile::new(
            concat!("citus/sql/", $name, ".sql"),
            include_str!(concat!("citus/sql/", $name, ".sql")),
            [$($placeholder),*],
            Form::$form,
        )
    };
}

/// Refill and take, one key (`lean::ACQUIRE_ONE`).
pub(super) const ACQUIRE_ONE: SqlFile<0> = sql_file!("acquire_one", OneLine, []);
/// Refill and take, many keys, on the table `{buckets}` (`lean::ACQUIRE_MANY`, and on a Citus
/// node each shard's part of `citus::sql::node_take`).
pub(super) const ACQUIRE_MANY: SqlFile<1> = sql_file!("acquire_many", OneLine, ["buckets"]);
/// Returns of unused lease tokens (`lean::GIVE_BACK`).
pub(super) const GIVE_BACK: SqlFile<0> = sql_file!("give_back", OneLine, []);
/// Refill and take through `tokenlease_acquire_held` (`lean::ACQUIRE_HELD`).
pub(super) const ACQUIRE_HELD: SqlFile<0> = sql_file!("acquire_held", OneLine, []);
/// Refill and take, several limits (`limits::ACQUIRE_LIMITS`).
pub(super) const ACQUIRE_LIMITS: SqlFile<0> = sql_file!("acquire_limits", OneLine, []);
/// Returns, several limits (`limits::GIVE_BACK_LIMITS`).
pub(super) const GIVE_BACK_LIMITS: SqlFile<0> = sql_file!("give_back_limits", OneLine, []);
/// The call of a Citus node's `tokenlease_citus_take_limits` (`limits::CITUS_TAKE_LIMITS`).
pub(super) const CITUS_TAKE_LIMITS: SqlFile<0> = sql_file!("citus_take_limits", OneLine, []);
/// The call of a Citus node's `tokenlease_citus_give_back_limits`
/// (`limits::CITUS_GIVE_BACK_LIMITS`).
pub(super) const CITUS_GIVE_BACK_LIMITS: SqlFile<0> =
    sql_file!("citus_give_back_limits", OneLine, []);
/// Idle cleanup on the tables `{buckets}` and `{returns}` (the plain tables, or a Citus
/// shard's in `tokenlease_citus_delete_idle`).
pub(super) const DELETE_IDLE: SqlFile<2> =
    sql_file!("delete_idle", AsWritten, ["buckets", "returns"]);
/// The inspection of one key on the table `{buckets}` (the plain table, or a Citus shard's).
pub(super) const INSPECT: SqlFile<1> = sql_file!("inspect", AsWritten, ["buckets"]);

/// The migrator's first statement: its lock, and its bookkeeping table if missing.
pub(super) const MIGRATIONS_BOOTSTRAP: SqlFile<0> =
    sql_file!("migrations_bootstrap", AsWritten, []);
/// The migrator's transaction-level advisory lock (`MIGRATION_LOCK_ID`).
pub(super) const MIGRATION_LOCK: SqlFile<0> = sql_file!("migration_lock", AsWritten, []);
/// The migrations a database records, with their checksums.
pub(super) const MIGRATIONS_APPLIED: SqlFile<0> = sql_file!("migrations_applied", AsWritten, []);
/// The checksum a database records for one migration.
pub(super) const MIGRATION_CHECKSUM: SqlFile<0> = sql_file!("migration_checksum", AsWritten, []);
/// The settings of a migration's transaction.
pub(super) const MIGRATION_SETTINGS: SqlFile<0> = sql_file!("migration_settings", AsWritten, []);
/// The record of an applied migration.
pub(super) const MIGRATION_RECORD: SqlFile<0> = sql_file!("migration_record", AsWritten, []);
/// The function files a database records, with their checksums and generations.
pub(super) const FUNCTIONS_RECORDED: SqlFile<0> = sql_file!("functions_recorded", AsWritten, []);
/// The record of an applied function file.
pub(super) const FUNCTIONS_RECORD: SqlFile<0> = sql_file!("functions_record", AsWritten, []);
/// The newest schema version a database records up to the oldest the statements read.
pub(super) const SCHEMA_VERSION: SqlFile<0> = sql_file!("schema_version", AsWritten, []);
/// The server's encoding, read when the store is built.
pub(super) const SERVER_ENCODING: SqlFile<0> = sql_file!("server_encoding", AsWritten, []);
/// What a migrating role lacks, read after the server refused it for a privilege.
pub(super) const PRIVILEGE_PROBE: SqlFile<0> = sql_file!("privilege_probe", AsWritten, []);

/// Strict leases on one shard, step 1 (inside `tokenlease_citus_take_held`).
pub(super) const HELD_INSERT_SHARD: SqlFile<1> =
    citus_file!("held_insert_shard", OneLine, ["buckets"]);
/// Strict leases on one shard, step 2 (inside `tokenlease_citus_take_held`).
pub(super) const HELD_UPDATE_SHARD: SqlFile<1> =
    citus_file!("held_update_shard", OneLine, ["buckets"]);
/// Returns on one shard (inside `tokenlease_citus_give_back`).
pub(super) const GIVE_BACK_SHARD: SqlFile<2> =
    citus_file!("give_back_shard", OneLine, ["buckets", "returns"]);
/// Refill and take, several limits, on one shard (inside `tokenlease_citus_take_limits`).
pub(super) const TAKE_LIMITS_SHARD: SqlFile<1> =
    citus_file!("take_limits_shard", OneLine, ["buckets"]);
/// Returns, several limits, on one shard (inside `tokenlease_citus_give_back_limits`).
pub(super) const GIVE_BACK_LIMITS_SHARD: SqlFile<2> =
    citus_file!("give_back_limits_shard", OneLine, ["buckets", "returns"]);
/// The call of a Citus node's `tokenlease_citus_take_held`.
pub(super) const CITUS_TAKE_HELD: SqlFile<0> = citus_file!("take_held", AsWritten, []);
/// The call of a Citus node's `tokenlease_citus_give_back`.
pub(super) const CITUS_GIVE_BACK: SqlFile<0> = citus_file!("give_back", AsWritten, []);
/// The call of a Citus node's `tokenlease_citus_delete_idle`.
pub(super) const CITUS_DELETE_IDLE: SqlFile<0> = citus_file!("delete_idle", AsWritten, []);

/// Whether the database has Citus (`citus::map::shard_map`).
pub(super) const CITUS_IS_CITUS: SqlFile<0> = citus_file!("is_citus", AsWritten, []);
/// Whether `tokenlease_buckets` is distributed.
pub(super) const CITUS_IS_DISTRIBUTED: SqlFile<0> = citus_file!("is_distributed", AsWritten, []);
/// The shards of `tokenlease_buckets` with their nodes and tables: the shard map.
pub(super) const CITUS_SHARD_MAP: SqlFile<0> = citus_file!("shard_map", AsWritten, []);
/// The server's hash of sample keys, checked against the client's.
pub(super) const CITUS_WORKER_HASH: SqlFile<0> = citus_file!("worker_hash", AsWritten, []);
/// The shards of `tokenlease_buckets` with their tables' names (`citus::distribute`).
pub(super) const CITUS_SHARDS: SqlFile<0> = citus_file!("shards", AsWritten, []);
/// Whether `citus.shard_count` was set, and the primary nodes that hold shards.
pub(super) const CITUS_SHARD_COUNT: SqlFile<0> = citus_file!("shard_count", AsWritten, []);
/// The shard count of the tables about to be distributed.
pub(super) const CITUS_SET_SHARD_COUNT: SqlFile<1> =
    citus_file!("set_shard_count", AsWritten, ["count"]);
/// The installed Citus version.
pub(super) const CITUS_CITUS_VERSION: SqlFile<0> = citus_file!("citus_version", AsWritten, []);
/// Whether each of the two tables is distributed.
pub(super) const CITUS_DISTRIBUTED_TABLES: SqlFile<0> =
    citus_file!("distributed_tables", AsWritten, []);
/// One connection per node for the rest of the transaction.
pub(super) const CITUS_SEQUENTIAL: SqlFile<0> = citus_file!("sequential", AsWritten, []);
/// Distributes `tokenlease_buckets` by key.
pub(super) const CITUS_DISTRIBUTE_BUCKETS: SqlFile<0> =
    citus_file!("distribute_buckets", AsWritten, []);
/// Keys `tokenlease_returns` by `(key, id)` and distributes it with the buckets.
pub(super) const CITUS_DISTRIBUTE_RETURNS: SqlFile<0> =
    citus_file!("distribute_returns", AsWritten, []);
/// The schema the functions are created in.
pub(super) const CITUS_CURRENT_SCHEMA: SqlFile<0> = citus_file!("current_schema", AsWritten, []);
/// What a node's definitions of some functions read as (`name:sha256(body)`), by `{schema}` and `{names}` (quoted literals).
pub(super) const CITUS_FUNCTION_DIGESTS: SqlFile<2> =
    citus_file!("function_digests", AsWritten, ["schema", "names"]);
/// A command run on every node, each node's answer.
pub(super) const CITUS_ON_ALL_NODES: SqlFile<0> = citus_file!("on_all_nodes", AsWritten, []);

/// The shard guard, `tokenlease_citus_hold` (`citus::sql::functions` says what it locks and
/// checks).
pub(super) const FN_HOLD: SqlFile<0> = citus_file!("tokenlease_citus_hold", AsWritten, []);
/// The shards of a call's keys on a node.
pub(super) const FN_PARTS: SqlFile<0> = citus_file!("tokenlease_citus_parts", AsWritten, []);
/// Strict leases on a node, running [`HELD_INSERT_SHARD`] and [`HELD_UPDATE_SHARD`].
pub(super) const FN_TAKE_HELD: SqlFile<2> = citus_file!(
    "tokenlease_citus_take_held",
    AsWritten,
    ["held_insert_shard", "held_update_shard"]
);
/// Returns on a node, running [`GIVE_BACK_SHARD`].
pub(super) const FN_GIVE_BACK: SqlFile<1> =
    citus_file!("tokenlease_citus_give_back", AsWritten, ["give_back_shard"]);
/// Idle cleanup on a node, running [`DELETE_IDLE`] on each shard.
pub(super) const FN_DELETE_IDLE: SqlFile<1> = citus_file!(
    "tokenlease_citus_delete_idle",
    AsWritten,
    ["delete_idle_shard"]
);
/// Several limits on a node, running [`TAKE_LIMITS_SHARD`].
pub(super) const FN_TAKE_LIMITS: SqlFile<1> = citus_file!(
    "tokenlease_citus_take_limits",
    AsWritten,
    ["take_limits_shard"]
);
/// Returns of several limits on a node, running [`GIVE_BACK_LIMITS_SHARD`].
pub(super) const FN_GIVE_BACK_LIMITS: SqlFile<1> = citus_file!(
    "tokenlease_citus_give_back_limits",
    AsWritten,
    ["give_back_limits_shard"]
);

#[cfg(test)]
mod tests;

/// Panics unless `sent` is what `file` says with `values` in its placeholders, checked without
/// [`SqlFile::render`]: the file is read from the disk (and must be the text the build
/// included), `escape` applied to it and each `{name}` replaced; then a file sent as written
/// must be that text exactly, and a file sent as one line must give the same words (its text
/// split at whitespace) in the same order, with a line break only where a `--` comment line
/// ends and no string literal across lines.
#[cfg(test)]
pub(super) fn assert_is_the_file<const N: usize>(
    sent: &str,
    file: &SqlFile<N>,
    values: [&str; N],
    escape: fn(&str) -> String,
) {
    let path = format!(
        "{}/src/store/postgres/{}",
        env!("CARGO_MANIFEST_DIR"),
        file.path
    );
    let on_disk = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert_eq!(on_disk, file.text, "{path} is the text the build included");
    let mut filled = escape(&on_disk);
    for (name, value) in file.names.iter().zip(values) {
        assert!(
            filled.contains(&format!("{{{name}}}")),
            "{path} uses {{{name}}}"
        );
        filled = filled.replace(&format!("{{{name}}}"), value);
    }
    match file.form {
        Form::AsWritten => assert_eq!(sent, filled, "{path}"),
        Form::OneLine => {
            let words = |s: &str| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
            assert_eq!(words(sent), words(&filled), "{path}: the same words");
            for line in sent.lines().rev().skip(1) {
                assert!(
                    line.starts_with("--"),
                    "{path}: a line break after {line:?}"
                );
            }
            assert_eq!(sent.trim(), sent, "{path}");
            for line in on_disk.lines() {
                assert_eq!(
                    line.matches('\'').count() % 2,
                    0,
                    "{path}: a literal across lines"
                );
                assert!(
                    !line.contains("--") || line.trim_start().starts_with("--"),
                    "{path}: a comment after SQL on a line it joins to the next"
                );
            }
        }
    }
}
