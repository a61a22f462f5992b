//! The store's SQL functions, defined in the files of `functions/` and applied by checksum.
//!
//! Migrations change the schema; the functions' current definitions live in one place each,
//! the files of `functions/` ([`FUNCTIONS`], in the order they are applied: each may call the
//! ones before it). After the migrations, [`apply`] reads `tokenlease_functions` (migration
//! 0008: a file's name and the SHA-256 of the SQL last applied for it) and runs every file whose
//! checksum differs, or that was never applied, then records it: in one transaction, under the
//! migration lock, so concurrent migrators apply each change once and a failure leaves every
//! function as it was. A new definition is an edit of its file; a database migrated by an older
//! build gets it at the next `migrate`. The function definitions in migrations 0001 to 0007 are
//! their history: on a new database the migrations create them and the files then replace them
//! with the same definitions (`src/store/postgres/migrate/db_tests.rs` checks that the files define exactly what the
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
    },
    FunctionFile {
        name: "held_leases",
        sql: include_str!("../../../functions/held_leases.sql"),
    },
    FunctionFile {
        name: "acquire_held",
        sql: include_str!("../../../functions/acquire_held.sql"),
    },
];

// language=SQL
const RECORDED: &str = "SELECT file, checksum FROM tokenlease_functions";

// language=SQL
const RECORD: &str = "\
INSERT INTO tokenlease_functions (file, checksum) VALUES ($1, $2)
ON CONFLICT (file) DO UPDATE SET checksum = excluded.checksum, applied_at = now()";

/// The files of `files` whose checksum differs from the one `rows` record for them.
fn stale<'a>(files: &'a [FunctionFile], recorded: &[(String, String)]) -> Vec<&'a FunctionFile> {
    files
        .iter()
        .filter(|f| {
            let checksum = f.checksum();
            !recorded
                .iter()
                .any(|(name, applied)| name == f.name && *applied == checksum)
        })
        .collect()
}

/// The checksums recorded in `tokenlease_functions`.
async fn recorded(
    client: &impl tokio_postgres::GenericClient,
) -> Result<Vec<(String, String)>, MigrateError> {
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
            ))
        })
        .collect()
}

/// Applies the files of `files` whose checksum the database does not have recorded, in order,
/// in one transaction under the migration lock (`lock`, the statement that takes it), and records them. Returns the names of the
/// files it applied: none when every checksum matched (then it only read the table, without the
/// lock), or when a concurrent migrator applied them first.
///
/// # Errors
///
/// [`MigrateError::Function`] naming the file whose SQL failed (the transaction is rolled back:
/// every function is as it was); [`MigrateError::Database`] when the bookkeeping fails.
pub(crate) async fn apply(
    client: &mut tokio_postgres::Client,
    files: &[FunctionFile],
    lock: &str,
) -> Result<Vec<&'static str>, MigrateError> {
    if stale(files, &recorded(&*client).await?).is_empty() {
        return Ok(Vec::new());
    }
    let tx = client.transaction().await.map_err(MigrateError::database(
        "begin the function files' transaction",
    ))?;
    tx.batch_execute(lock)
        .await
        .map_err(MigrateError::database("take the migration advisory lock"))?;
    let recorded = recorded(&tx).await?;
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
            &[(&file.name, Type::TEXT), (&checksum.as_str(), Type::TEXT)],
        )
        .await
        .map_err(MigrateError::database("record a function file"))?;
        applied.push(file.name);
    }
    tx.commit()
        .await
        .map_err(MigrateError::database("commit the function files"))?;
    Ok(applied)
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

    /// A file is stale unless its exact checksum is recorded under its name.
    #[test]
    fn stale_files_are_those_without_their_checksum() {
        let recorded = vec![
            ("bucket".to_owned(), FUNCTIONS[0].checksum()),
            ("held_leases".to_owned(), "0".repeat(64)),
        ];
        let names: Vec<&str> = stale(FUNCTIONS, &recorded).iter().map(|f| f.name).collect();
        assert_eq!(names, ["held_leases", "acquire_held"]);
        assert!(stale(&FUNCTIONS[..1], &recorded).is_empty());
    }
}
