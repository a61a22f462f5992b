//! The statement files and what the store sends from them.
//!
//! B14 pins every statement: each rendered for a representative set of inputs (one limit and
//! several, each Citus statement for sample shards) and compared with the SHA-256 of its text
//! as it was when the pin was taken. A statement is changed on purpose: its pin changes with it,
//! in the same commit. B15 checks that each is its file (here for the plain store, in
//! `citus/tests.rs` for the Citus path, and on a real session).

use super::functions::sha256_hex;
use super::{citus, lean, limits, sql};

/// Every statement the store prepares or creates, by name.
fn rendered() -> Vec<(&'static str, String)> {
    let mut out = vec![
        ("acquire_one", lean::ACQUIRE_ONE.clone()),
        ("acquire_many", lean::ACQUIRE_MANY.clone()),
        ("give_back", lean::GIVE_BACK.clone()),
        ("acquire_held", lean::ACQUIRE_HELD.clone()),
        ("acquire_limits", limits::ACQUIRE_LIMITS.clone()),
        ("give_back_limits", limits::GIVE_BACK_LIMITS.clone()),
        ("citus_take_limits", limits::CITUS_TAKE_LIMITS.to_string()),
        (
            "citus_give_back_limits",
            limits::CITUS_GIVE_BACK_LIMITS.to_string(),
        ),
        ("delete_idle", super::DELETE_IDLE.to_string()),
        ("inspect", super::INSPECT.to_string()),
    ];
    out.extend(citus::statements_for_tests());
    out.extend(
        BOOKKEEPING
            .iter()
            .chain(&CITUS_CATALOG)
            .map(|(name, file)| (*name, file.text.to_owned())),
    );
    out.push((
        "citus/set_shard_count",
        sql::CITUS_SET_SHARD_COUNT.render(["8"]),
    ));
    out.push((
        "citus/function_digests",
        sql::CITUS_FUNCTION_DIGESTS.render(["'public'", "'tokenlease_citus_hold'"]),
    ));
    out
}

/// The Citus path's reads of the catalog and its distribution of the tables, each sent as its
/// file is written (with no placeholder).
const CITUS_CATALOG: [(&str, sql::SqlFile<0>); 13] = [
    ("citus/is_citus", sql::CITUS_IS_CITUS),
    ("citus/is_distributed", sql::CITUS_IS_DISTRIBUTED),
    ("citus/shard_map", sql::CITUS_SHARD_MAP),
    ("citus/worker_hash", sql::CITUS_WORKER_HASH),
    ("citus/shards", sql::CITUS_SHARDS),
    ("citus/shard_count", sql::CITUS_SHARD_COUNT),
    ("citus/citus_version", sql::CITUS_CITUS_VERSION),
    ("citus/distributed_tables", sql::CITUS_DISTRIBUTED_TABLES),
    ("citus/sequential", sql::CITUS_SEQUENTIAL),
    ("citus/distribute_buckets", sql::CITUS_DISTRIBUTE_BUCKETS),
    ("citus/distribute_returns", sql::CITUS_DISTRIBUTE_RETURNS),
    ("citus/current_schema", sql::CITUS_CURRENT_SCHEMA),
    ("citus/on_all_nodes", sql::CITUS_ON_ALL_NODES),
];

/// The statements of the migrator, the function records, the schema check, the encoding read
/// and the privilege probe: each sent as its file is written.
const BOOKKEEPING: [(&str, sql::SqlFile<0>); 11] = [
    ("migrations_bootstrap", sql::MIGRATIONS_BOOTSTRAP),
    ("migration_lock", sql::MIGRATION_LOCK),
    ("migrations_applied", sql::MIGRATIONS_APPLIED),
    ("migration_checksum", sql::MIGRATION_CHECKSUM),
    ("migration_settings", sql::MIGRATION_SETTINGS),
    ("migration_record", sql::MIGRATION_RECORD),
    ("functions_recorded", sql::FUNCTIONS_RECORDED),
    ("functions_record", sql::FUNCTIONS_RECORD),
    ("schema_version", sql::SCHEMA_VERSION),
    ("server_encoding", sql::SERVER_ENCODING),
    ("privilege_probe", sql::PRIVILEGE_PROBE),
];

/// The SHA-256 of each statement's text, by name, as [`rendered`] lists them.
const PINNED: &[(&str, &str)] = &[
    (
        "acquire_one",
        "41c91aef557633d0fee8a6c76074a830e092e3c73cc20a9247353d58e8bca386",
    ),
    (
        "acquire_many",
        "927b8d141d994170652ef84af2c7f3d94cf41f942bfa97c760509fe41c883147",
    ),
    (
        "give_back",
        "e87f1f9682cf567ce22ed3cb4ee6fc45c30f27ff5e3d66ad25daa9cc53771345",
    ),
    (
        "acquire_held",
        "70395757d182853d969fe5146a56276fa3f63a221a2febfcf2c01bf38962f80d",
    ),
    (
        "acquire_limits",
        "7275761cd42305ee25900e1e7e87acdd9b1cd8b4dc2d7789cf5abd34e9d50b7a",
    ),
    (
        "give_back_limits",
        "b7246abc714e14ea625a5184c35504d3c0d3f0f4cc0c92f5c2769b9816e49cbd",
    ),
    (
        "citus_take_limits",
        "dead90154591a99111d122056754ee3502d4b6cd1eb9f9815c59a2719ffda8af",
    ),
    (
        "citus_give_back_limits",
        "6edbfb2e842ddd7fb7638df11c84593f1a41fc093cb967bdfa6415612479f36b",
    ),
    (
        "delete_idle",
        "7cea72f9b8a9d89ec4314ddf4fa6a19233b196ebf9391a4568ab44039de9aae1",
    ),
    (
        "inspect",
        "e851e1a29f37f569e99e254e51655fb7218fd7a8b57310ed6bf9b86641509647",
    ),
    (
        "citus/take_shard",
        "4f08368fc162c98fa4c90b61902771157ee0c0448866d586c452db4107d6f3c7",
    ),
    (
        "citus/held_insert_shard",
        "f84e4f7e88c5d62570cceca867c0392439509dbabd13e692c646668b3de80bfe",
    ),
    (
        "citus/held_update_shard",
        "af677a6994f6bc41c61444c4a4732ab12b1e06e82ee3a3d52d7e434bcba9371b",
    ),
    (
        "citus/give_back_shard",
        "dee328d5a1fd99d85befb80f6782f34ac3946d4dc7dc2eadf0e15b0bb9ade879",
    ),
    (
        "citus/delete_idle_shard",
        "c6b39e1379f072a7f376a12b709c9a5e7afd2a28eae7e6fa7e28818f3cc862a9",
    ),
    (
        "citus/node_take, one shard",
        "ac98e054c43dc34d9ebb711cb6855239a725e056d07f7d8ecdf531cd9f373e69",
    ),
    (
        "citus/node_take, three shards",
        "c9bc263c7dad82497b2862c2dc5367bfadcd22245fcca548e4f4849d6608c781",
    ),
    (
        "citus/inspect_shard",
        "6cd6c51374dddc86ce22ce133481d56b18c3e840635cb32d7017eb66bb52abec",
    ),
    (
        "citus/take_held",
        "54acefd8634730f7db9e02c20098215398229f331723193306158e6c5aa8afcc",
    ),
    (
        "citus/give_back",
        "4fbb9f587b7d8354200296ce150709be55da03644d83b33f626d67286ba7ec28",
    ),
    (
        "citus/delete_idle",
        "a4100a888670f7a9b8403f7b62d50c4493438ebc52f721d9cf782bdfd5d8100c",
    ),
    (
        "citus/node_functions",
        "ca943c01d6a981335351347f761220b336ec1d76d6d954ea04bd70ab218abc11",
    ),
    (
        "migrations_bootstrap",
        "8aa70b129444d33f9652b988b1e4d9f4e8d05ae41e8e81c93e39646f5b966499",
    ),
    (
        "migration_lock",
        "e499950452bec90464dfbe3c4a6ed399f7a85403f0e517e90a587087f5fcab89",
    ),
    (
        "migrations_applied",
        "011b1fa6027bf7c42b1e2e65c7339a3f2bebf22312e993e79a1d949ecc2e54a7",
    ),
    (
        "migration_checksum",
        "7bb7b479af4e53a641a8a285878c6a7f56491585e1ac55d937fa7d8496ecf30f",
    ),
    (
        "migration_settings",
        "5851cffe0df456a3584aab8adb42d349193ef7bcfec418f8231b0dd23510af04",
    ),
    (
        "migration_record",
        "d462e5a2642a2b03f4ac9d8632fba7c0c8ab0abce5a29116b5489eec33a56d6a",
    ),
    (
        "functions_recorded",
        "a9cbce85727ee48cd05870883feae2ca27c0af3e55945c06eb002530d34d6ee1",
    ),
    (
        "functions_record",
        "b4b4f69d92ce56666cfda701d7a69b5dc4216d168ce3a74365399a43205377da",
    ),
    (
        "schema_version",
        "ecefbca451a334e9e6de2bb7f40dae824fb59509928e04f54d85e24ad03b74bd",
    ),
    (
        "server_encoding",
        "c9c87a8bac3ab3d8a5b0a77211f9671979f1fec89d6acc151c1aeaef7228beb8",
    ),
    (
        "privilege_probe",
        "95b8f0ae9ccd6f02d5b535cf125f4abc57b43dce1c1ab1bb648100d6725b9e37",
    ),
    (
        "citus/is_citus",
        "e4298f41dad62441e81f0a6125d51a90b16847dd34989139df4653770c995534",
    ),
    (
        "citus/is_distributed",
        "7aef296d77b589ea91aee45dc4c0da847c37631e6141c387baedf98cb31a9b09",
    ),
    (
        "citus/shard_map",
        "96be4627e4b4a0d14fde24bc14a4f5cec0eddf1983d7221461bc13395ea4c85e",
    ),
    (
        "citus/worker_hash",
        "b4507e19a3d3c1888a295ed0a488fe16748e876b5d3674560f64706aa9ba76ab",
    ),
    (
        "citus/shards",
        "ec4de95fdcac08c09f37376cae9ec77cc5bd7a8b36b03b5f0fe631c93a074fb1",
    ),
    (
        "citus/shard_count",
        "4a18575a1a2ee13f7d3f752cf55a7a3e8285e4e1ab13180bde9d8c9bae57e516",
    ),
    (
        "citus/citus_version",
        "835ec3c0404331adde22ac12d8648d0ac9f2789d25d4837f0181691d096a98c2",
    ),
    (
        "citus/distributed_tables",
        "e03f372a1a777fb5eff5365bb84f9944757e0be30b6f6aaa8917a8f185634e04",
    ),
    (
        "citus/sequential",
        "d59293d8a1e03de52701d5b351e7c02021f0485916728b1a76a6a725d6dcc6ce",
    ),
    (
        "citus/distribute_buckets",
        "d161b8f92872ce606c5bbc41e0982805e1afe0f28923e5d9a40e7d6f1921b4fb",
    ),
    (
        "citus/distribute_returns",
        "8f693752d1667b3cf25d64c28c288ca2477d12804873fa9bad728bdd07142fbb",
    ),
    (
        "citus/current_schema",
        "3f7e9f492a8ed010ed7bd2fe1279ff43b54c25c56e3602055cbd3534b2e69a68",
    ),
    (
        "citus/on_all_nodes",
        "fb5f9e9c3e8fb9c3ac970b7b01b88eaaaac1eba9f2a4df5888ccf86694fd6689",
    ),
    (
        "citus/set_shard_count",
        "61f8b73028d50f8ead7812acf2b8843f360126055cc3530540f1410d1ce40099",
    ),
    (
        "citus/function_digests",
        "d9f85bdaa8b986a68aae2d980524c129129847050006b2873d2cf6d5dd7381a3",
    ),
];

/// B14: every statement the store sends is byte for byte the text pinned for it.
#[test]
fn every_statement_is_the_text_pinned_for_it() {
    let rendered = rendered();
    let mut changed = Vec::new();
    for (name, text) in &rendered {
        let pinned = PINNED.iter().find(|(n, _)| n == name).map(|(_, h)| *h);
        let now = sha256_hex(text);
        if pinned != Some(now.as_str()) {
            changed.push(format!("(\"{name}\", \"{now}\"),\n--- {name}:\n{text}\n"));
        }
    }
    assert!(
        changed.is_empty(),
        "statements changed:\n{}",
        changed.join("\n")
    );
    assert_eq!(rendered.len(), PINNED.len(), "every statement pinned once");
}

/// No escaping: the file's text as it is.
fn as_is(s: &str) -> String {
    s.to_owned()
}

/// B15: what the plain store sends is what its files say: each statement is its file's text,
/// with the store's tables in its placeholders, joined into one line where the file is sent as
/// one (`assert_is_the_file`); the statements every session prepares are those.
#[test]
fn every_plain_statement_is_its_file() {
    let tables = ["tokenlease_buckets", "tokenlease_returns"];
    sql::assert_is_the_file(&lean::ACQUIRE_ONE, &sql::ACQUIRE_ONE, [], as_is);
    sql::assert_is_the_file(&lean::ACQUIRE_MANY, &sql::ACQUIRE_MANY, [tables[0]], as_is);
    sql::assert_is_the_file(&lean::GIVE_BACK, &sql::GIVE_BACK, [], as_is);
    sql::assert_is_the_file(&lean::ACQUIRE_HELD, &sql::ACQUIRE_HELD, [], as_is);
    sql::assert_is_the_file(&limits::ACQUIRE_LIMITS, &sql::ACQUIRE_LIMITS, [], as_is);
    sql::assert_is_the_file(&limits::GIVE_BACK_LIMITS, &sql::GIVE_BACK_LIMITS, [], as_is);
    sql::assert_is_the_file(
        &limits::CITUS_TAKE_LIMITS,
        &sql::CITUS_TAKE_LIMITS,
        [],
        as_is,
    );
    sql::assert_is_the_file(
        &limits::CITUS_GIVE_BACK_LIMITS,
        &sql::CITUS_GIVE_BACK_LIMITS,
        [],
        as_is,
    );
    sql::assert_is_the_file(&super::DELETE_IDLE, &sql::DELETE_IDLE, tables, as_is);
    sql::assert_is_the_file(&super::INSPECT, &sql::INSPECT, [tables[0]], as_is);
    sql::assert_is_the_file(super::migrate::LOCK, &sql::MIGRATION_LOCK, [], as_is);
    for (_, file) in BOOKKEEPING.iter().chain(&CITUS_CATALOG) {
        sql::assert_is_the_file(file.text, file, [], as_is);
    }
    let count = sql::CITUS_SET_SHARD_COUNT.render(["8"]);
    sql::assert_is_the_file(&count, &sql::CITUS_SET_SHARD_COUNT, ["8"], as_is);
    let values = ["'public'", "'tokenlease_citus_hold'"];
    let digests = sql::CITUS_FUNCTION_DIGESTS.render(values);
    sql::assert_is_the_file(&digests, &sql::CITUS_FUNCTION_DIGESTS, values, as_is);
    let warm: Vec<&str> = lean::warm_statements()
        .iter()
        .map(|(sql, _)| *sql)
        .collect();
    assert_eq!(
        warm,
        [
            lean::ACQUIRE_ONE.as_str(),
            lean::ACQUIRE_MANY.as_str(),
            lean::GIVE_BACK.as_str()
        ]
    );
}

/// B15: what PostgreSQL holds for a session of the store is what the files say: a store's
/// pooled session, on a throwaway PostgreSQL, has prepared the statements of every decision
/// (`pg_prepared_statements`), and each is its file (`sql/acquire_one.sql`,
/// `sql/acquire_many.sql`, `sql/give_back.sql`), read from the disk and filled.
#[tokio::test]
async fn a_session_prepares_what_the_files_say() {
    let db = tokenlease_testkit::TestDatabase::create()
        .await
        .expect("a test database (install PostgreSQL server binaries or set DATABASE_URL)");
    let store = super::PostgresStore::builder(&db.connection_string())
        .expect("connection string")
        .pool_size(1)
        .migrate(false)
        .build()
        .await
        .expect("store");
    let conn = store.pool().get().await.expect("connection");
    let rows = conn
        .query_typed(
            "SELECT statement FROM pg_prepared_statements ORDER BY statement",
            &[],
        )
        .await
        .expect("pg_prepared_statements");
    let held: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(held.len(), 3, "{held:?}");
    let head = |s: &str| s.lines().next().unwrap_or_default().to_owned();
    for text in &held {
        if head(text) == head(sql::ACQUIRE_ONE.text) {
            sql::assert_is_the_file(text, &sql::ACQUIRE_ONE, [], as_is);
        } else if head(text) == head(sql::ACQUIRE_MANY.text) {
            sql::assert_is_the_file(text, &sql::ACQUIRE_MANY, ["tokenlease_buckets"], as_is);
        } else {
            sql::assert_is_the_file(text, &sql::GIVE_BACK, [], as_is);
        }
    }
}
