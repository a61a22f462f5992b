//! Migrations: the SQL files in `migrations/`, embedded in the library and applied by
//! [`migrate`].
//!
//! Each file `migrations/<VERSION>_<DESCRIPTION>.sql` is one [`Migration`] in [`MIGRATIONS`].
//! Applied versions are recorded in `tokenlease_migrations(version, description, checksum,
//! applied_at)`, so a second run applies nothing and a file edited after it was applied is an
//! error ([`MigrateError::ChecksumMismatch`]) rather than a silent drift.
//!
//! # Concurrency and connection poolers
//!
//! Any number of processes may run [`migrate`] at once: each migration runs in its own
//! transaction that first takes `pg_advisory_xact_lock(`[`MIGRATION_LOCK_ID`]`)`, then checks
//! again whether the version is already recorded. A transaction-level advisory lock is released
//! by the commit or rollback, so it also works behind PgBouncer in transaction pooling mode,
//! where a session-level lock could stay behind on a server connection another client gets next.
//! Only the simple query protocol and unnamed statements (`batch_execute`, `query_typed`) are
//! used: no named prepared statements, which PgBouncer's transaction mode breaks.
//!
//! # Writing a migration
//!
//! Add `migrations/<next version, 4 digits>_<description>.sql`, open it with a comment saying
//! why, and add it to [`MIGRATIONS`] (a unit test checks that the list and the directory agree).
//! A migration changes the schema only (tables, types, domains, constraints, and the `DROP` of a
//! function no longer used): the store's SQL functions are defined in the files of `functions/`,
//! which [`migrate`] applies after the migrations when the database records an older generation
//! of a file, or another checksum at the same one (`functions.rs`). A new version of a function
//! is an edit of its file and a new generation. The whole file runs as one transaction, so
//! statements that refuse to run inside a transaction (`CREATE INDEX CONCURRENTLY`,
//! `ALTER TYPE … ADD VALUE` on older servers) cannot be used. Never edit a file that has been
//! released: add a new one.
//!
//! # Rolling deploys
//!
//! Instances of the previous release keep running while a new one migrates, and after it, until
//! they are replaced. So a migration only adds: a new column has a default the previous
//! release's statements do without, a new function sits beside the one they call, a changed
//! function keeps its signature and what they expect of it. What the previous release needs and
//! this one does not (a column, a function) is dropped by a later release, whose CHANGELOG says
//! which releases must be gone first. And a release's statements work on the schema the
//! previous release left (`schema.rs`: `OLDEST_SCHEMA` is the oldest they read), so its
//! instances may start before the `migrate` step has run. K6 (`tests/store/deploy.rs`) holds
//! this release to both rules: the previous release's statements (kept in
//! `tests/fixtures/previous-release/`) and this release's decide on one key across
//! [`migrate`] within the ideal bucket's envelope.
//! A schema an instance cannot use is said once in its log and counted
//! (`tokenlease_store_schema_errors_total`); its calls are decided by the fallback meanwhile.

use std::fmt;

use tokio_postgres::types::Type;

use super::functions::sha256_hex;
use crate::store::error::{MigrateError, describe};

/// The key of the transaction-level advisory lock that serialises migrators: the ASCII bytes
/// of `"tokenlea"` as a big-endian `i64`.
///
/// A deploy tool that applies [`MIGRATIONS`] itself (instead of calling [`migrate`]) can take
/// the same lock (`pg_advisory_xact_lock`) so that it never runs beside a store's own
/// migration; a check for a migration stuck behind a lock can look for it in `pg_locks`.
pub const MIGRATION_LOCK_ID: i64 = 0x746f_6b65_6e6c_6561;

/// One migration: a SQL file from `migrations/`, embedded at compile time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Migration {
    /// The number before the first `_` in the file name; strictly increasing along the list.
    pub version: i64,
    /// The rest of the file name without `.sql`, e.g. `create_buckets`.
    pub description: &'static str,
    /// The file's contents, run as one transaction.
    pub sql: &'static str,
}

impl Migration {
    /// SHA-256 of the SQL, lower-case hex. Line endings are normalised to `\n` first, so a
    /// checkout that converted them (Git on Windows) does not count as an edit.
    pub fn checksum(&self) -> String {
        sha256_hex(self.sql)
    }
}

impl fmt::Display for Migration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04}_{}", self.version, self.description)
    }
}

/// Every migration of this version of the library, oldest first: what [`migrate`] applies.
///
/// Public for deploy steps that review or apply the schema with a tool of their own; the
/// functions of `functions/` are applied by [`migrate`] after these and are not in the list.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "create_buckets",
        sql: include_str!("../../../migrations/0001_create_buckets.sql"),
    },
    Migration {
        version: 2,
        description: "create_returns",
        sql: include_str!("../../../migrations/0002_create_returns.sql"),
    },
    Migration {
        version: 3,
        description: "add_held_leases",
        sql: include_str!("../../../migrations/0003_add_held_leases.sql"),
    },
    Migration {
        version: 4,
        description: "acquire_function",
        sql: include_str!("../../../migrations/0004_acquire_function.sql"),
    },
    Migration {
        version: 5,
        description: "grantable_plpgsql",
        sql: include_str!("../../../migrations/0005_grantable_plpgsql.sql"),
    },
    Migration {
        version: 6,
        description: "acquire_one_key",
        sql: include_str!("../../../migrations/0006_acquire_one_key.sql"),
    },
    Migration {
        version: 7,
        description: "lean_buckets",
        sql: include_str!("../../../migrations/0007_lean_buckets.sql"),
    },
    Migration {
        version: 8,
        description: "functions_table",
        sql: include_str!("../../../migrations/0008_functions_table.sql"),
    },
    Migration {
        version: 9,
        description: "function_generations",
        sql: include_str!("../../../migrations/0009_function_generations.sql"),
    },
    Migration {
        version: 10,
        description: "several_limits",
        sql: include_str!("../../../migrations/0010_several_limits.sql"),
    },
];

/// What [`migrate`] found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationReport {
    /// Migrations this call applied, in order.
    pub applied: Vec<Migration>,
    /// Migrations that were already applied (by an earlier run or a concurrent migrator), with
    /// matching checksums.
    pub already_present: Vec<Migration>,
    /// Versions recorded in the database that this library does not know: applied by a newer
    /// version of it. Not an error: a release's migrations keep the previous release's
    /// statements and functions working, so an older instance keeps deciding during a rolling
    /// deploy (docs/design/deploys.md; tested against the previous release's statements).
    pub unknown_versions: Vec<i64>,
    /// The Citus version, when the database is a Citus coordinator: the tables are then
    /// distributed by key and the Citus functions are in place. `None` on plain PostgreSQL.
    pub citus: Option<String>,
    /// On Citus: how many shards `tokenlease_buckets` has (and `tokenlease_returns`, co-located
    /// with it). `None` on plain PostgreSQL.
    pub citus_shards: Option<u32>,
    /// On Citus: whether this call distributed the tables with a shard count it chose itself
    /// (one per node that holds shards), as it does when `citus.shard_count` is left at Citus's
    /// default; `false` when the setting was set (in the server's configuration, for the
    /// database or role, or in the migrating session), which is then used as it is, or when the
    /// tables were distributed before.
    pub citus_shard_count_chosen: bool,
    /// The function files (`functions/<name>.sql`) this call applied because the database had
    /// none recorded for them, an older generation, or another checksum at the same generation;
    /// on a Citus coordinator also `citus`, the node functions, applied by the same rule and
    /// also when a node's definitions are not the recorded ones.
    pub functions_applied: Vec<&'static str>,
    /// The function files a newer release applied (the database records a newer generation):
    /// left as they are, since that release's definitions keep this one's statements working.
    pub functions_newer: Vec<&'static str>,
}

impl MigrationReport {
    /// Whether this call changed nothing.
    pub fn is_noop(&self) -> bool {
        self.applied.is_empty() && self.functions_applied.is_empty()
    }
}

impl fmt::Display for MigrationReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.applied.is_empty() {
            write!(
                f,
                "no migrations applied; {} already present",
                self.already_present.len()
            )?;
        } else {
            let names: Vec<String> = self.applied.iter().map(ToString::to_string).collect();
            write!(
                f,
                "applied {} migration(s): {}; {} already present",
                self.applied.len(),
                names.join(", "),
                self.already_present.len()
            )?;
        }
        if !self.functions_applied.is_empty() {
            write!(
                f,
                "; function file(s) applied: {}",
                self.functions_applied.join(", ")
            )?;
        }
        if let Some(citus) = &self.citus {
            write!(f, "; Citus {citus}: tables distributed by key")?;
            if let Some(n) = self.citus_shards {
                write!(f, ", {n} shards")?;
            }
            if self.citus_shard_count_chosen {
                write!(
                    f,
                    " (chosen by migrate: {} per node holding shards; set citus.shard_count to \
                     choose another count)",
                    super::citus::SHARDS_PER_NODE
                )?;
            }
        }
        if !self.functions_newer.is_empty() {
            write!(
                f,
                "; function file(s) left as a newer release applied them: {}",
                self.functions_newer.join(", ")
            )?;
        }
        if !self.unknown_versions.is_empty() {
            write!(
                f,
                "; the database also has versions {:?}, unknown to this build (newer)",
                self.unknown_versions
            )?;
        }
        Ok(())
    }
}

/// The migrator's statements (files of `sql/`).
const BOOTSTRAP: &str = super::sql::MIGRATIONS_BOOTSTRAP.text;
pub(super) const LOCK: &str = super::sql::MIGRATION_LOCK.text;
const SELECT_APPLIED: &str = super::sql::MIGRATIONS_APPLIED.text;
const SELECT_ONE: &str = super::sql::MIGRATION_CHECKSUM.text;
const SETTINGS: &str = super::sql::MIGRATION_SETTINGS.text;
const RECORD: &str = super::sql::MIGRATION_RECORD.text;

/// Applies the pending migrations of this version of the library (the SQL files in
/// `migrations/`, embedded at compile time) on `client`'s database, then the function files
/// (`functions/`) whose checksum the database does not have recorded.
///
/// [`PostgresStoreBuilder::build`](crate::store::PostgresStoreBuilder::build) calls it unless
/// told not to; call it yourself to migrate from a deploy step instead.
///
/// Safe to run from many processes at once and idempotent: a second run applies nothing and
/// reports every migration as already present. Applied versions are recorded in the table
/// `tokenlease_migrations` (version, description, checksum, applied_at), so a file edited after
/// it was applied is an error ([`MigrateError::ChecksumMismatch`]) rather than a silent drift.
/// Each migration runs in its own transaction, which first takes a transaction-level advisory
/// lock and checks again whether its version is recorded: that works behind PgBouncer in
/// transaction pooling mode too. Only the simple query protocol and unnamed statements are
/// used.
///
/// A migration waits at most 20 ms for a lock on a table, then gives up and tries again (up
/// to 60 times, about 12 s in all), so that its lock request never queues the limiter's takes
/// behind it for longer; once it has its locks it holds them for one round trip (the commit,
/// asynchronous: a crash before the WAL is flushed loses the migration and its record together).
///
/// # Errors
///
/// [`MigrateError::ChecksumMismatch`] naming the version when an applied migration's SQL
/// changed; [`MigrateError::Privilege`] when the role lacks a privilege migrating needs
/// (`CREATE` on the schema, ownership of the tables: docs/roles.md); [`MigrateError::Apply`] when a migration fails (it is rolled back, the ones before
/// it stay applied; also when a table stayed locked by others through every try, the server's
/// "lock timeout" as its detail); [`MigrateError::Database`] when the connection or the bookkeeping fails.
///
/// # Cancel safety
///
/// Dropping the future mid-way leaves each migration either applied and recorded, or not at
/// all (one transaction each), but may leave the client inside a transaction that its
/// `Transaction` guard is rolling back; use a fresh connection after cancelling.
pub async fn migrate(client: &mut tokio_postgres::Client) -> Result<MigrationReport, MigrateError> {
    match migrate_all(client).await {
        Ok(report) => Ok(report),
        Err(error) => Err(privilege::explain(client, error).await),
    }
}

/// [`migrate`] before a refused privilege is explained.
async fn migrate_all(client: &mut tokio_postgres::Client) -> Result<MigrationReport, MigrateError> {
    let mut report = migrate_with(client, MIGRATIONS).await?;
    (report.functions_applied, report.functions_newer) =
        super::functions::apply(client, super::functions::FUNCTIONS, LOCK).await?;
    // On a Citus coordinator: distribute the tables and create the routed functions
    // (src/store/postgres/citus/). On plain PostgreSQL: one read of pg_extension.
    if let Some(citus) = super::citus::distribute(client, LOCK).await? {
        record_citus(&mut report, citus);
    }
    Ok(report)
}

/// What the Citus step did, in `report`: the node functions count as a function file.
pub(super) fn record_citus(report: &mut MigrationReport, citus: super::citus::Distributed) {
    report.citus = Some(citus.version);
    report.citus_shards = Some(citus.shards);
    report.citus_shard_count_chosen = citus.chosen;
    report.functions_applied.extend(citus.applied);
    report.functions_newer.extend(citus.newer);
}

/// [`migrate`] with a list other than [`MIGRATIONS`], for tests of the migrator itself.
///
/// # Errors
///
/// As [`migrate`], plus [`MigrateError::InvalidList`] when the versions are not positive and
/// strictly increasing.
pub(crate) async fn migrate_with(
    client: &mut tokio_postgres::Client,
    migrations: &[Migration],
) -> Result<MigrationReport, MigrateError> {
    validate(migrations)?;

    let tx = client
        .transaction()
        .await
        .map_err(MigrateError::database("begin the bookkeeping transaction"))?;
    tx.batch_execute(BOOTSTRAP)
        .await
        .map_err(MigrateError::database(
            "create the tokenlease_migrations table",
        ))?;
    tx.commit()
        .await
        .map_err(MigrateError::database("commit the bookkeeping transaction"))?;

    let rows = client
        .query_typed(SELECT_APPLIED, &[])
        .await
        .map_err(MigrateError::database("read tokenlease_migrations"))?;
    let mut applied_before = Vec::with_capacity(rows.len());
    for row in rows {
        let version: i64 = row
            .try_get(0)
            .map_err(MigrateError::database("read tokenlease_migrations.version"))?;
        let checksum: String = row.try_get(1).map_err(MigrateError::database(
            "read tokenlease_migrations.checksum",
        ))?;
        applied_before.push((version, checksum));
    }

    let mut report = MigrationReport {
        unknown_versions: applied_before
            .iter()
            .map(|(v, _)| *v)
            .filter(|v| !migrations.iter().any(|m| m.version == *v))
            .collect(),
        ..MigrationReport::default()
    };

    for migration in migrations {
        let expected = migration.checksum();
        if let Some((_, applied)) = applied_before.iter().find(|(v, _)| *v == migration.version) {
            check_checksum(migration, applied, &expected)?;
            report.already_present.push(*migration);
            continue;
        }
        if apply_patiently(client, migration, &expected).await? {
            report.applied.push(*migration);
        } else {
            report.already_present.push(*migration);
        }
    }
    Ok(report)
}

/// How many times a migration is tried when it could not get a table's lock in time, and the
/// pause before the first retry (doubled each time, at most [`MAX_PAUSE`]): about 10 s in all.
const LOCK_TRIES: u32 = 60;
const FIRST_PAUSE: std::time::Duration = std::time::Duration::from_millis(5);
const MAX_PAUSE: std::time::Duration = std::time::Duration::from_millis(200);

/// [`apply_one`], tried again when the migration could not get a lock on a live table within
/// its 20 ms `lock_timeout` ([`SETTINGS`]). A lock request that waits (an `ALTER TABLE`'s ACCESS EXCLUSIVE behind a
/// running statement) holds up every take that comes after it, past their 100 ms
/// `lock_timeout` when the statements before it are slow; a short wait given up and tried
/// again holds them up for 20 ms at a time instead.
async fn apply_patiently(
    client: &mut tokio_postgres::Client,
    migration: &Migration,
    expected: &str,
) -> Result<bool, MigrateError> {
    let mut pause = FIRST_PAUSE;
    let mut tries = 1;
    loop {
        match apply_one(client, migration, expected).await {
            Err(MigrateError::Apply { error, .. })
                if tries < LOCK_TRIES
                    && error.code()
                        == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) =>
            {
                tries += 1;
                // sleep: a pause between tries; each try is bounded by its lock wait.
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_PAUSE);
            }
            other => return other,
        }
    }
}

/// Applies one migration under the lock; `false` when a concurrent migrator already had.
async fn apply_one(
    client: &mut tokio_postgres::Client,
    migration: &Migration,
    expected: &str,
) -> Result<bool, MigrateError> {
    let tx = client
        .transaction()
        .await
        .map_err(MigrateError::database("begin a migration transaction"))?;
    tx.batch_execute(LOCK)
        .await
        .map_err(MigrateError::database("take the migration advisory lock"))?;
    let existing = tx
        .query_typed(SELECT_ONE, &[(&migration.version, Type::INT8)])
        .await
        .map_err(MigrateError::database("read tokenlease_migrations"))?;
    if let Some(row) = existing.first() {
        let applied: String = row.try_get(0).map_err(MigrateError::database(
            "read tokenlease_migrations.checksum",
        ))?;
        check_checksum(migration, &applied, expected)?;
        return Ok(false); // the transaction rolls back on drop; it changed nothing
    }
    // The record first, the migration last: the locks the migration takes on the live tables
    // (an `ALTER TABLE`'s ACCESS EXCLUSIVE, which every take queues behind) are held from its
    // statement to the commit, one round trip, and the commit does not wait for its WAL to
    // reach the disk while holding them. A crash before the WAL is flushed loses the migration
    // and its record together (the commit is atomic either way), and the next `migrate`
    // applies it again. Before, the record and a durable commit came after the migration: under
    // load a take waited past its 100 ms `lock_timeout` (K6).
    tx.execute_typed(
        RECORD,
        &[
            (&migration.version, Type::INT8),
            (&migration.description, Type::TEXT),
            (&expected, Type::TEXT),
        ],
    )
    .await
    .map_err(MigrateError::database(
        "record the migration in tokenlease_migrations",
    ))?;
    tx.batch_execute(SETTINGS)
        .await
        .map_err(MigrateError::database(
            "set the migration's commit and lock wait",
        ))?;
    tx.batch_execute(migration.sql)
        .await
        .map_err(|error| MigrateError::Apply {
            version: migration.version,
            description: migration.description,
            detail: describe(&error),
            error,
        })?;
    tx.commit()
        .await
        .map_err(MigrateError::database("commit a migration"))?;
    Ok(true)
}

fn check_checksum(
    migration: &Migration,
    applied: &str,
    expected: &str,
) -> Result<(), MigrateError> {
    if applied == expected {
        Ok(())
    } else {
        Err(MigrateError::ChecksumMismatch {
            version: migration.version,
            description: migration.description,
            applied: applied.to_string(),
            expected: expected.to_string(),
        })
    }
}

fn validate(migrations: &[Migration]) -> Result<(), MigrateError> {
    let mut previous = 0;
    for m in migrations {
        if m.version <= previous {
            return Err(MigrateError::InvalidList(format!(
                "version {} ({}) must be positive and greater than the one before it ({previous})",
                m.version, m.description
            )));
        }
        previous = m.version;
    }
    Ok(())
}

mod privilege;

#[cfg(test)]
mod citus_tests;
#[cfg(test)]
mod db_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_id_is_tokenlea_and_matches_the_sql() {
        assert_eq!(MIGRATION_LOCK_ID.to_be_bytes(), *b"tokenlea");
        let literal = MIGRATION_LOCK_ID.to_string();
        assert!(BOOTSTRAP.contains(&format!("pg_advisory_xact_lock({literal})")));
        assert!(LOCK.contains(&format!("pg_advisory_xact_lock({literal})")));
    }

    /// The const list and `migrations/` must agree: same files, versions, descriptions, SQL.
    #[test]
    fn list_matches_the_migrations_directory() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        let mut files: Vec<(i64, String, String)> = std::fs::read_dir(&dir)
            .expect("migrations/ exists")
            .map(|e| e.expect("readable entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "sql"))
            .map(|p| {
                let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
                let (version, description) = stem
                    .split_once('_')
                    .unwrap_or_else(|| panic!("{stem}.sql is not <VERSION>_<DESCRIPTION>.sql"));
                let version: i64 = version
                    .parse()
                    .unwrap_or_else(|_| panic!("{stem}.sql: version {version:?} is not a number"));
                let sql = std::fs::read_to_string(&p).unwrap();
                (version, description.to_string(), sql)
            })
            .collect();
        files.sort();
        let listed: Vec<(i64, String, String)> = MIGRATIONS
            .iter()
            .map(|m| (m.version, m.description.to_string(), m.sql.to_string()))
            .collect();
        assert_eq!(
            listed
                .iter()
                .map(|(v, d, _)| (*v, d.clone()))
                .collect::<Vec<_>>(),
            files
                .iter()
                .map(|(v, d, _)| (*v, d.clone()))
                .collect::<Vec<_>>(),
            "MIGRATIONS must list exactly the files in migrations/"
        );
        assert_eq!(listed, files, "embedded SQL differs from the file");
        validate(MIGRATIONS).expect("versions strictly increasing");
    }

    /// The checksums of the migrations released in 0.1.0, as every database it migrated
    /// records them: `migrate` refuses a recorded migration whose file has another checksum,
    /// and deploy tools that apply [`MIGRATIONS`] themselves may compare them too.
    const RELEASED: [(i64, &str); 8] = [
        (
            1,
            "03061939d5ba12d2142663012376342fd7d306b72f0e0540bfc8d84f1dad3fca",
        ),
        (
            2,
            "546dbc5604687c286f35af98594275fb9fc6d8d485db2fd7bc664c3787f1a992",
        ),
        (
            3,
            "92dc82749a6e9410c858b3eb62bab68b213b837c73bea812010b0c02debe3a65",
        ),
        (
            4,
            "108889483158a02a166e7daa408dc96886a26d388236db86c6a67daeee788e7a",
        ),
        (
            5,
            "a6b4530e425650e87212dc9f2498f5387438a873d82760a16d1e296e486502e7",
        ),
        (
            6,
            "e30a83b149c3f2fee6038b2312917cd34d928fe5b6d8a6246d0f96a712d5ef6e",
        ),
        (
            7,
            "0cc41995d2cc04baf68aa86e92155a4e7e301b3f70e6b35adce1807a05050035",
        ),
        (
            8,
            "c147727b43d5c35211ba83c0931f21e4ebd02dcb601e5174363eefe36b0ecf24",
        ),
    ];

    /// B16: a released migration never changes. Migrations 0003 and 0007 keep their copies of
    /// the functions that `functions/held_leases.sql` and `functions/acquire_held.sql` now
    /// define (docs/design/statements.md, "Function bodies: the migrations keep theirs"): an
    /// edit of either, to drop its copy, fails here.
    #[test]
    fn released_migrations_keep_their_checksums() {
        for (version, checksum) in RELEASED {
            let migration = MIGRATIONS
                .iter()
                .find(|m| m.version == version)
                .expect("a released migration is listed");
            assert_eq!(
                migration.checksum(),
                checksum,
                "migration {migration} was released and changed: add a new migration instead"
            );
        }
    }

    #[test]
    fn checksum_is_sha256_hex_and_ignores_crlf() {
        let m = Migration {
            version: 1,
            description: "x",
            sql: "abc",
        };
        assert_eq!(
            m.checksum(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let lf = Migration {
            sql: "a;\nb;\n",
            ..m
        };
        let crlf = Migration {
            sql: "a;\r\nb;\r\n",
            ..m
        };
        assert_eq!(lf.checksum(), crlf.checksum());
    }

    #[test]
    fn invalid_lists_are_rejected() {
        let a = Migration {
            version: 2,
            description: "a",
            sql: "",
        };
        let b = Migration { version: 2, ..a };
        assert!(matches!(
            validate(&[a, b]),
            Err(MigrateError::InvalidList(_))
        ));
        let zero = Migration { version: 0, ..a };
        assert!(matches!(
            validate(&[zero]),
            Err(MigrateError::InvalidList(_))
        ));
    }

    #[test]
    fn report_says_what_happened() {
        let mut report = MigrationReport {
            already_present: MIGRATIONS.to_vec(),
            ..MigrationReport::default()
        };
        assert!(report.is_noop());
        assert!(report.to_string().starts_with("no migrations applied"));
        report.applied = report.already_present.drain(..).collect();
        assert!(report.to_string().contains("0001_create_buckets"));
    }
}
