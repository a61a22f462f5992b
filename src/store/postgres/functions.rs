//! The store's SQL functions, defined in the files of `functions/` and applied by generation
//! and checksum.
//!
//! Migrations change the schema; the functions' current definitions live in one place each,
//! the files of `functions/` ([`FUNCTIONS`], in the order they are applied: each may call the
//! ones before it). After the migrations, [`apply`] reads `tokenlease_functions` (migration
//! 0008: a file's name and the SHA-256 of the SQL last applied for it; migration 0009: the
//! file's generation) and runs every file the database lacks, records at an older generation,
//! or records at the same generation with another checksum (a definition edited by hand is
//! restored), then records it: in one transaction, under the migration lock, so concurrent
//! migrators apply each change once and a failure leaves every function as it was. A file
//! recorded at a newer generation was applied by a newer release and is left alone: during a
//! rolling deploy an older instance's `migrate` does not put its definitions back over the
//! newer ones (docs/design/deploys.md).
//!
//! A new definition is an edit of its file **and** a higher [`FunctionFile::generation`]; the
//! unit test `released_files_are_pinned` holds each generation's checksum, so an edit without a
//! new generation fails it. Only compatible changes may be made in place (the same signature and
//! result, and what the previous release's statements expect of it); anything else is a new
//! function beside the old one, which a later release may drop. The function definitions in
//! migrations 0001 to 0007 are their history: on a new database the migrations create them and
//! the files then replace them with the same definitions
//! (`src/store/postgres/migrate/db_tests.rs` checks that the files define exactly what the
//! migrations leave, and that a changed file is applied again).

use std::fmt;

use sha2::{Digest, Sha256};
use tokio_postgres::types::Type;

use crate::store::error::{MigrateError, describe};

/// One file of `functions/`: the current definitions of some of the store's SQL functions, as
/// `CREATE OR REPLACE` statements (and their `ALTER`s and comments), run as one batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FunctionFile {
    /// The file's name without `.sql`.
    pub(crate) name: &'static str,
    /// Its contents.
    pub(crate) sql: &'static str,
    /// Raised by every release that changes the file: a database recording a higher one was
    /// migrated by a newer release, whose definitions stay.
    pub(crate) generation: i32,
}

impl FunctionFile {
    /// SHA-256 of the SQL, lower-case hex, line endings normalised (as a migration's).
    pub(crate) fn checksum(&self) -> String {
        sha256_hex(self.sql)
    }
}

/// Every function file of this version of the library, in the order they are applied.
pub(crate) const FUNCTIONS: &[FunctionFile] = &[
    FunctionFile {
        name: "bucket",
        sql: include_str!("../../../functions/bucket.sql"),
        generation: 1,
    },
    FunctionFile {
        name: "held_leases",
        sql: include_str!("../../../functions/held_leases.sql"),
        generation: 1,
    },
    FunctionFile {
        name: "acquire_held",
        sql: include_str!("../../../functions/acquire_held.sql"),
        generation: 1,
    },
];

/// The function records' statements (files of `sql/`).
const RECORDED: &str = super::sql::FUNCTIONS_RECORDED.text;
const RECORD: &str = super::sql::FUNCTIONS_RECORD.text;

/// What `tokenlease_functions` records for a file: its name, checksum and generation.
type Recorded = (String, String, i32);

/// The files of `files` to apply: those `recorded` lacks, records at an older generation, or
/// records at their own generation with another checksum.
fn stale<'a>(files: &'a [FunctionFile], recorded: &[Recorded]) -> Vec<&'a FunctionFile> {
    files
        .iter()
        .filter(
            |f| match recorded.iter().find(|(name, _, _)| name == f.name) {
                None => true,
                Some((_, checksum, generation)) => {
                    *generation < f.generation
                        || (*generation == f.generation && *checksum != f.checksum())
                }
            },
        )
        .collect()
}

/// The files of `files` that `recorded` holds at a newer generation: a newer release's
/// definitions, left as they are.
pub(super) fn newer(files: &[FunctionFile], recorded: &[Recorded]) -> Vec<&'static str> {
    files
        .iter()
        .filter(|f| {
            recorded
                .iter()
                .any(|(name, _, generation)| name == f.name && *generation > f.generation)
        })
        .map(|f| f.name)
        .collect()
}

/// `recorded` with the checksum of every file named in `edited` cleared: no file's checksum.
fn mark_edited(mut recorded: Vec<Recorded>, edited: &[&str]) -> Vec<Recorded> {
    for (name, checksum, _) in &mut recorded {
        if edited.contains(&name.as_str()) {
            checksum.clear();
        }
    }
    recorded
}

/// The files, checksums and generations recorded in `tokenlease_functions`.
async fn recorded(
    client: &impl tokio_postgres::GenericClient,
) -> Result<Vec<Recorded>, MigrateError> {
    let rows = client
        .query_typed(RECORDED, &[])
        .await
        .map_err(MigrateError::database("read tokenlease_functions"))?;
    rows.iter()
        .map(|row| {
            Ok((
                row.try_get(0)
                    .map_err(MigrateError::database("read tokenlease_functions.file"))?,
                row.try_get(1)
                    .map_err(MigrateError::database("read tokenlease_functions.checksum"))?,
                row.try_get(2).map_err(MigrateError::database(
                    "read tokenlease_functions.generation",
                ))?,
            ))
        })
        .collect()
}

/// Applies the files of `files` that are stale (see [`stale`]: missing, an older generation, or
/// another checksum at the same one), in order, in one transaction under the migration lock
/// (`lock`, the statement that takes it), and records them. Returns the names of the files it
/// applied (none when nothing was stale: then it only read the table, without the lock; or when
/// a concurrent migrator applied them first) and of those a newer release applied, left alone.
///
/// # Errors
///
/// [`MigrateError::Function`] naming the file whose SQL failed (the transaction is rolled back:
/// every function is as it was); [`MigrateError::Database`] when the bookkeeping fails.
pub(crate) async fn apply(
    client: &mut tokio_postgres::Client,
    files: &[FunctionFile],
    lock: &str,
) -> Result<(Vec<&'static str>, Vec<&'static str>), MigrateError> {
    apply_with(client, files, lock, &[]).await
}

/// [`apply`], with the files named in `edited` counted as recorded with another checksum: their
/// definitions in the database are not the ones their record says (the Citus step checks them
/// on every node), so at their own generation they are applied again, while a newer
/// generation still stays.
///
/// # Errors
///
/// As [`apply`].
pub(crate) async fn apply_with(
    client: &mut tokio_postgres::Client,
    files: &[FunctionFile],
    lock: &str,
    edited: &[&str],
) -> Result<(Vec<&'static str>, Vec<&'static str>), MigrateError> {
    let before = mark_edited(recorded(&*client).await?, edited);
    if stale(files, &before).is_empty() {
        return Ok((Vec::new(), newer(files, &before)));
    }
    let tx = client.transaction().await.map_err(MigrateError::database(
        "begin the function files' transaction",
    ))?;
    tx.batch_execute(lock)
        .await
        .map_err(MigrateError::database("take the migration advisory lock"))?;
    let recorded = mark_edited(recorded(&tx).await?, edited);
    let mut applied = Vec::new();
    for file in stale(files, &recorded) {
        tx.batch_execute(file.sql)
            .await
            .map_err(|error| MigrateError::Function {
                file: file.name,
                detail: describe(&error),
                error,
            })?;
        let checksum = file.checksum();
        tx.execute_typed(
            RECORD,
            &[
                (&file.name, Type::TEXT),
                (&checksum.as_str(), Type::TEXT),
                (&file.generation, Type::INT4),
            ],
        )
        .await
        .map_err(MigrateError::database("record a function file"))?;
        applied.push(file.name);
    }
    tx.commit()
        .await
        .map_err(MigrateError::database("commit the function files"))?;
    Ok((applied, newer(files, &recorded)))
}

/// SHA-256 of `sql`, lower-case hex: the checksum `tokenlease_migrations` and
/// `tokenlease_functions` record. Line endings are normalised to `\n` first, so a checkout
/// that converted them (Git on Windows) does not count as an edit.
pub(super) fn sha256_hex(sql: &str) -> String {
    let normalised = sql.replace("\r\n", "\n");
    Sha256::digest(normalised.as_bytes())
        .iter()
        .fold(String::with_capacity(64), |mut hex, byte| {
            use fmt::Write;
            let _ = write!(hex, "{byte:02x}");
            hex
        })
}

/// Each generation of each file that a release shipped, by checksum (the files of `functions/`
/// and `citus`, the Citus node functions): a file whose SQL changed must carry a new generation
/// (add its line here), or an older release's `migrate` would not know to leave it alone, and
/// this release's would not replace the old one.
#[cfg(test)]
const RELEASED: &[(&str, i32, &str)] = &[
    (
        "bucket",
        1,
        "cb3bd6d7c702e94436e84bb84a1cffe6b8b513cd14d4575ed1903614de773183",
    ),
    (
        "held_leases",
        1,
        "bb2774bba9c72ac00d1c9689cf991d955158d85b96210ba73b155a8dd16e4836",
    ),
    (
        "acquire_held",
        1,
        "6900d5f4011d7c4e10afd98d16b381e67dc706a2692eb1faae51a5d44653acb8",
    ),
    (
        "citus",
        1,
        "ca943c01d6a981335351347f761220b336ec1d76d6d954ea04bd70ab218abc11",
    ),
];

/// Panics naming the first of `files` whose checksum is not the one [`RELEASED`] pins for its
/// generation, or whose generation it does not pin.
#[cfg(test)]
pub(super) fn check_pinned(files: &[FunctionFile]) {
    for f in files {
        let pinned = RELEASED
            .iter()
            .find(|(name, generation, _)| *name == f.name && *generation == f.generation);
        match pinned {
            Some((_, _, checksum)) => assert_eq!(
                *checksum,
                f.checksum(),
                "function file {} changed but its generation is still {}: raise its \
                 generation (`FUNCTIONS`, or `NODE_FUNCTIONS_GENERATION` for `citus`) and \
                 pin the new checksum in RELEASED",
                f.name,
                f.generation
            ),
            None => panic!(
                "function file {} generation {} is not pinned in RELEASED: add \
                 (\"{}\", {}, \"{}\")",
                f.name,
                f.generation,
                f.name,
                f.generation,
                f.checksum()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The list and the directory agree: every file of `functions/` is applied, once.
    #[test]
    fn list_matches_the_functions_directory() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("functions");
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .expect("functions/")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".sql"))
            .collect();
        files.sort();
        let mut listed: Vec<String> = FUNCTIONS
            .iter()
            .map(|f| format!("{}.sql", f.name))
            .collect();
        listed.sort();
        assert_eq!(files, listed);
        for f in FUNCTIONS {
            let on_disk =
                std::fs::read_to_string(dir.join(format!("{}.sql", f.name))).expect("read");
            assert_eq!(on_disk, f.sql, "{}", f.name);
        }
    }

    /// A file is stale when it is not recorded, recorded at an older generation (0: by a build
    /// from before generations), or at its own generation with another checksum; a newer
    /// generation is a newer release's, left alone whatever its checksum.
    #[test]
    fn stale_files_are_missing_older_or_edited_and_newer_ones_stay() {
        let [bucket, held, acquire] = [&FUNCTIONS[0], &FUNCTIONS[1], &FUNCTIONS[2]];
        let recorded = vec![
            (bucket.name.to_owned(), bucket.checksum(), bucket.generation),
            (held.name.to_owned(), "0".repeat(64), held.generation),
        ];
        let names: Vec<&str> = stale(FUNCTIONS, &recorded).iter().map(|f| f.name).collect();
        assert_eq!(names, ["held_leases", "acquire_held"]);
        assert!(stale(&FUNCTIONS[..1], &recorded).is_empty());
        assert!(newer(FUNCTIONS, &recorded).is_empty());

        // A build from before generations recorded the same checksum: applied again, once.
        let old = vec![(acquire.name.to_owned(), acquire.checksum(), 0)];
        assert_eq!(stale(&FUNCTIONS[2..], &old).len(), 1);
        // A newer release's definition, whatever its checksum: left alone, and reported.
        let newer_rows = vec![(
            acquire.name.to_owned(),
            "f".repeat(64),
            acquire.generation + 1,
        )];
        assert!(stale(&FUNCTIONS[2..], &newer_rows).is_empty());
        assert_eq!(newer(FUNCTIONS, &newer_rows), ["acquire_held"]);
    }

    #[test]
    fn released_files_are_pinned() {
        check_pinned(FUNCTIONS);
    }
}
