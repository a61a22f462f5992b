//! Unit tests of the Citus path: the hash, the shard map, the version check.

use super::distribute::{check_version, parse_version};
use super::map::{Shard, hashtext};
use super::sql::*;
use super::*;
use crate::store::MigrateError;

/// Values from `SELECT worker_hash(k::text)` on PostgreSQL 15 with Citus 13.2.
#[test]
fn hashtext_matches_postgres() {
    assert_eq!(hashtext(b"a"), 1_075_015_857);
    assert_eq!(hashtext(b"tokenlease"), 404_391_352);
    assert_eq!(hashtext(b""), -1_477_818_771);
    assert_eq!(hashtext(b"abcdefghijklmnopqrstuvwxyz"), 167_831_483);
}

/// A throwaway Citus cluster of two workers (`tokenlease_testkit::TempCitus`; needs the Citus
/// extension for the server binaries, which `.ci/run` builds when missing), and a client of its
/// coordinator.
pub(in crate::store::postgres) async fn cluster()
-> (tokenlease_testkit::TempCitus, tokio_postgres::Client) {
    connected(None).await
}

/// [`cluster`] with `citus.shard_count` set to `shards` on every node (so `migrate` keeps it):
/// for a worker holding several shards.
pub(in crate::store::postgres) async fn cluster_with_shards(
    shards: u32,
) -> (tokenlease_testkit::TempCitus, tokio_postgres::Client) {
    connected(Some(shards)).await
}

/// Two workers, `citus.shard_count` when given, and a client of the coordinator.
async fn connected(shards: Option<u32>) -> (tokenlease_testkit::TempCitus, tokio_postgres::Client) {
    let citus = tokio::task::spawn_blocking(move || {
        let builder = tokenlease_testkit::TempCitus::builder().workers(2);
        match shards {
            Some(n) => builder.setting("citus.shard_count", n.to_string()),
            None => builder,
        }
        .start()
    })
    .await
    .expect("start task")
    .expect("a Citus cluster (install the Citus extension; .ci/run builds it when missing)");
    let (c, connection) =
        tokio_postgres::connect(&citus.connection_string("postgres"), tokio_postgres::NoTls)
            .await
            .expect("connect");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    (citus, c)
}

/// Z1 (part): the client's hash of a key is Citus's (`worker_hash`) for 5,000 keys of every
/// shape, on a real cluster (`tokenlease_testkit::TempCitus`; needs the Citus extension for
/// the server binaries, which `.ci/run` builds when missing). It was part of
/// `tests/store/citus.rs`'s Z1 while the hash was reachable from outside the crate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hashtext_matches_worker_hash_on_a_cluster() {
    let (_citus, c) = cluster().await;
    let mut keys: Vec<String> = (0..4000).map(|i| format!("user:{i}")).collect();
    keys.extend((0..500).map(|i| "é".repeat(i % 40) + &i.to_string()));
    keys.extend((0..500).map(|i| "k".repeat(i)));
    keys.push(String::new());
    let rows = c
        .query(
            "SELECT k, worker_hash(k) FROM unnest($1::text[]) AS k",
            &[&keys],
        )
        .await
        .expect("worker_hash");
    assert_eq!(rows.len(), keys.len());
    for row in rows {
        let key: String = row.get(0);
        let server: i32 = row.get(1);
        assert_eq!(hashtext(key.as_bytes()), server, "key {key:?}");
    }
}

#[test]
fn unsupported_versions_are_refused_by_name() {
    assert!(check_version("13.2-1".into()).is_ok());
    assert!(check_version("12.1-1".into()).is_ok());
    for old in ["11.3-1", "10.2-4", "14.0-1", "garbage"] {
        let err = check_version(old.into()).expect_err(old);
        assert!(
            matches!(err, MigrateError::UnsupportedCitus { .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains(old), "{err}");
    }
}

#[test]
fn versions_parse() {
    assert_eq!(parse_version("13.2-1"), Some((13, 2)));
    assert_eq!(parse_version("12.1"), Some((12, 1)));
    assert_eq!(parse_version("x"), None);
}

#[test]
fn shard_statements_name_no_distributed_table() {
    for sql in [
        HELD_UPDATE_SHARD.as_str(),
        GIVE_BACK_SHARD.as_str(),
        DELETE_IDLE_SHARD.as_str(),
        HELD_INSERT_SHARD.as_str(),
    ] {
        assert!(!sql.contains("tokenlease_buckets"), "{sql}");
        assert!(!sql.contains("tokenlease_returns "), "{sql}");
        assert!(sql.contains("%1$s"), "{sql}");
    }
}

#[test]
fn a_map_finds_every_key_a_shard() {
    let step = (1i64 << 32) / 4;
    let shards: Vec<Shard> = (0..4)
        .map(|i| Shard {
            id: 100 + i,
            min: (i64::from(i32::MIN) + i * step) as i32,
            max: (i64::from(i32::MIN) + (i + 1) * step - 1) as i32,
            node: usize::try_from(i % 2).unwrap(),
            table: format!("tokenlease_buckets_{}", 100 + i),
        })
        .collect();
    let node = |id: i32| Node {
        id,
        host: "h".into(),
        port: 5432,
    };
    let map = ShardMap::new(shards, vec![node(1), node(2)]).expect("valid map");
    for k in ["a", "b", "tokenlease", ""] {
        let h = hashtext(k.as_bytes());
        let s = map.shard_of(k);
        assert!(s.min <= h && h <= s.max);
    }
    assert_eq!(map.node_of(map.probe(0)), 0);
    assert_eq!(map.node_of(map.probe(1)), 1);
}

/// A node's statement takes each shard's keys through the shard's guard (its metadata lock and
/// placement check) on that shard's table, with each shard's parameters numbered after the
/// previous shard's, and names no distributed table.
#[test]
fn a_node_statement_guards_each_shard_and_numbers_its_parameters() {
    let one = node_take(&[(102_008, "tokenlease_buckets_102008")]);
    assert!(
        one.contains("tokenlease_citus_hold(ARRAY[102008]::bigint[], $1::text[])"),
        "{one}"
    );
    assert!(one.contains("$6::bigint[]") && !one.contains("$7"), "{one}");
    let two = node_take(&[(7, "tokenlease_buckets_7"), (9, "tokenlease_buckets_9")]);
    assert!(
        two.contains("tokenlease_citus_hold(ARRAY[7, 9]::bigint[], $1::text[])"),
        "{two}"
    );
    assert_eq!(two.matches("tokenlease_citus_hold").count(), 1, "{two}");
    assert!(two.contains("unnest($7::text[]"), "{two}");
    assert!(
        two.contains("$12::bigint[]") && !two.contains("$13"),
        "{two}"
    );
    assert!(
        two.contains("INSERT INTO tokenlease_buckets_9 AS b"),
        "{two}"
    );
    assert!(two.find("FROM s0").unwrap() < two.find("FROM s1").unwrap());
    for sql in [&one, &two] {
        assert!(!sql.contains("tokenlease_buckets AS"), "{sql}");
        assert!(!sql.contains("%"), "{sql}");
    }
    let (a, types) = node_take_statement(&[(7, "tokenlease_buckets_7")]).expect("kept");
    let (b, _) = node_take_statement(&[(7, "tokenlease_buckets_7")]).expect("kept");
    assert!(std::ptr::eq(a, b), "made once");
    assert_eq!(types.len(), 6);
}

/// Inspection on a node reads the key's shard table, not the distributed table.
#[test]
fn inspection_reads_the_shard_table() {
    let sql = inspect_shard("tokenlease_buckets_7");
    assert!(sql.contains("FROM tokenlease_buckets_7\n"), "{sql}");
    assert!(!sql.contains("FROM tokenlease_buckets\n"), "{sql}");
    assert!(std::ptr::eq(sql, inspect_shard("tokenlease_buckets_7")));
}

/// B15: what a Citus node runs is what the files say: the shard statements (for `format()`:
/// `%` doubled, the tables `%1$s` and `%2$s`), the calls the store sends, each node function
/// (its file with the quoted shard statements in its placeholders), a node's take on one shard
/// (the plain many-key file on the shard's table, its keys through the shard guard) and the
/// inspection of a shard's key.
#[test]
fn every_citus_statement_is_its_file() {
    use super::super::sql as files;
    use files::assert_is_the_file as is_file;
    let shard = ["%1$s", "%2$s"];
    is_file(
        &HELD_INSERT_SHARD,
        &files::HELD_INSERT_SHARD,
        [shard[0]],
        for_format,
    );
    is_file(
        &HELD_UPDATE_SHARD,
        &files::HELD_UPDATE_SHARD,
        [shard[0]],
        for_format,
    );
    is_file(&GIVE_BACK_SHARD, &files::GIVE_BACK_SHARD, shard, for_format);
    is_file(&DELETE_IDLE_SHARD, &files::DELETE_IDLE, shard, for_format);
    let as_is = |s: &str| s.to_owned();
    is_file(&TAKE_HELD, &files::CITUS_TAKE_HELD, [], as_is);
    is_file(&GIVE_BACK, &files::CITUS_GIVE_BACK, [], as_is);
    is_file(&DELETE_IDLE, &files::CITUS_DELETE_IDLE, [], as_is);
    let made = functions();
    let take_limits = files::TAKE_LIMITS_SHARD.render_escaped(["%1$s"], for_format);
    is_file(
        &take_limits,
        &files::TAKE_LIMITS_SHARD,
        [shard[0]],
        for_format,
    );
    let give_back_limits = files::GIVE_BACK_LIMITS_SHARD.render_escaped(shard, for_format);
    is_file(
        &give_back_limits,
        &files::GIVE_BACK_LIMITS_SHARD,
        shard,
        for_format,
    );
    is_file(&made[0].1, &files::FN_HOLD, [], as_is);
    is_file(&made[1].1, &files::FN_PARTS, [], as_is);
    let (insert, update) = (literal(&HELD_INSERT_SHARD), literal(&HELD_UPDATE_SHARD));
    is_file(&made[2].1, &files::FN_TAKE_HELD, [&insert, &update], as_is);
    is_file(
        &made[3].1,
        &files::FN_GIVE_BACK,
        [&literal(&GIVE_BACK_SHARD)],
        as_is,
    );
    is_file(
        &made[4].1,
        &files::FN_DELETE_IDLE,
        [&literal(&DELETE_IDLE_SHARD)],
        as_is,
    );
    is_file(
        &made[5].1,
        &files::FN_TAKE_LIMITS,
        [&literal(&take_limits)],
        as_is,
    );
    is_file(
        &made[6].1,
        &files::FN_GIVE_BACK_LIMITS,
        [&literal(&give_back_limits)],
        as_is,
    );
    assert_eq!(made.len(), 7);
    for (_, body) in &made {
        assert!(node_functions().sql.contains(body.as_str()));
    }
    let table = "tokenlease_buckets_102008";
    let take = node_take(&[(102008, table)]);
    let unguarded = take.replacen(
        "unnest(tokenlease_citus_hold(ARRAY[102008]::bigint[], $1::text[])",
        "unnest($1::text[]",
        1,
    );
    let plain = files::ACQUIRE_MANY.render([table]);
    let (_, body) = plain.split_once('\n').expect("a header line");
    assert_eq!(unguarded, format!("{NODE_TAKE_HEAD}{body}"));
    is_file(&plain, &files::ACQUIRE_MANY, [table], as_is);
    is_file(inspect_shard(table), &files::INSPECT, [table], as_is);
}

/// `text` with each `(from, to)` of `swaps` replaced, each found exactly once.
fn swapped(mut text: String, swaps: &[(&str, &str)]) -> String {
    for (from, to) in swaps {
        assert_eq!(text.matches(from).count(), 1, "{from:?} once in {text}");
        text = text.replacen(from, to, 1);
    }
    text
}

/// B17: the shard statements a node runs for several limits and for returns are the plain
/// store's, written out twice (once per file) and kept equal: the take and the return of
/// several limits on a shard, with what makes them a shard's undone (the part's positions, the
/// returns keyed by `(key, id)`), are the plain statements byte for byte; and the values a
/// return sets on a shard's row are the plain return's, in the same order.
#[test]
fn the_shard_files_say_what_the_plain_files_say() {
    use super::super::sql as files;
    let tables = ["tokenlease_buckets", "tokenlease_returns"];
    let take = swapped(
        files::TAKE_LIMITS_SHARD.render([tables[0]]),
        &[
            (" WITH ORDINALITY AS u(", " AS u("),
            (", n) WHERE u.n = ANY ($11::integer[])", ")"),
        ],
    );
    assert_eq!(take, files::ACQUIRE_LIMITS.render([]));
    let give_back = swapped(
        files::GIVE_BACK_LIMITS_SHARD.render(tables),
        &[
            ("$3::bigint[]) WITH ORDINALITY AS f(", "$3::bigint[]) AS f("),
            (
                "AS f(id, key, amount, n) JOIN unnest($10::integer[]) AS fm(n) ON fm.n = f.n",
                "AS f(id, key, amount)",
            ),
            ("ORDER BY f.key, f.id", "ORDER BY f.id"),
            (
                "ON CONFLICT (key, id) DO NOTHING",
                "ON CONFLICT (id) DO NOTHING",
            ),
            ("RETURNING t.key, t.id)", "RETURNING t.id)"),
            (
                "$9::integer[]) WITH ORDINALITY AS u(",
                "$9::integer[]) AS u(",
            ),
            (
                ", count, n) JOIN unnest($10::integer[]) AS um(n) ON um.n = u.n \
                 JOIN fresh ON fresh.key = u.key AND fresh.id = u.id  ORDER BY u.key",
                ", count) WHERE u.id IN (SELECT fresh.id FROM fresh) ORDER BY u.key",
            ),
        ],
    );
    assert_eq!(give_back, files::GIVE_BACK_LIMITS.render([]));
    // The shard's return sets `tokens = v1, frac = v2, ...`; the plain one `(tokens, frac,
    // ...) = (SELECT v1, v2, ... FROM <the request at the key's position>)`.
    let shard = files::GIVE_BACK_SHARD.render(tables);
    let (_, set) = shard.split_once(" SET tokens = ").expect("the shard's SET");
    let (set, _) = set
        .split_once(" FROM todo AS r ")
        .expect("the end of its SET");
    let mut values = Vec::new();
    let mut rest = set;
    for column in [
        "frac",
        "capacity",
        "refill_per_second",
        "updated_us",
        "refilled",
        "leases",
    ] {
        let (value, after) = rest
            .split_once(&format!(", {column} = "))
            .expect("each column, in order");
        values.push(value);
        rest = after;
    }
    values.push(rest);
    let plain = files::GIVE_BACK.render([]);
    assert!(
        plain.contains(&format!(
            "SET (tokens, frac, capacity, refill_per_second, updated_us, refilled, leases) = ( \
             SELECT {} FROM (SELECT ($3::bigint[])[p.n] AS amount,",
            values.join(", ")
        )),
        "the plain return sets what the shard's does: {values:?}"
    );
}
