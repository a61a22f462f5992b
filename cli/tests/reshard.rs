//! `tokenlease reshard` end to end (H7, docs/testing.md): two shards become three; the command
//! copies the moved keys' buckets to the new shard, so a drained key that moved admits nothing
//! beyond its refill after the switch; a second run changes nothing; no output shows a
//! password. Runs the binary against three throwaway clusters (nextest `serial` group).

use crate::common;

use std::process::{Command, Output};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokenlease::bucket::Tokens;
use tokenlease::store::{AcquireRequest, ShardedStore, Store, shard_of};
use tokenlease_testkit::TempPostgres;

const NAMES: [&str; 3] = ["pg-a", "pg-b", "pg-c"];
const C: f64 = 100.0;
/// Slow, so that the drained key is still far from full when the switch comes, seconds later.
const R: f64 = 5.0;
/// Trust authentication ignores it; the command must never print it.
const SECRET: &str = "s3cret-Pa55";

/// The URL of `pg` with a password in it.
fn url(pg: &TempPostgres) -> String {
    format!(
        "postgres://postgres:{SECRET}@127.0.0.1:{}/postgres",
        pg.port()
    )
}

fn reshard(clusters: &[Arc<TempPostgres>], extra: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tokenlease"));
    cmd.arg("reshard");
    for (name, pg) in NAMES.iter().zip(clusters).take(2) {
        cmd.arg("--from").arg(format!("{name}={}", url(pg)));
    }
    for (name, pg) in NAMES.iter().zip(clusters) {
        cmd.arg("--to").arg(format!("{name}={}", url(pg)));
    }
    cmd.args(extra);
    let out = cmd.output().expect("run tokenlease reshard");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "reshard failed:\n{stdout}\n{stderr}");
    assert!(
        !stdout.contains(SECRET) && !stderr.contains(SECRET),
        "{stdout}\n{stderr}"
    );
    eprintln!("{stdout}");
    out
}

async fn store(list: &[(&str, String)]) -> ShardedStore {
    ShardedStore::connect_with(list, |b| {
        b.call_timeout(Duration::from_secs(5))
            .pool_wait_timeout(Duration::from_secs(5))
            .connect_timeout(Duration::from_secs(5))
            .statement_timeout(Duration::from_secs(5))
            .lock_timeout(Duration::from_secs(5))
    })
    .await
    .expect("sharded store")
}

/// H7: 300 keys on two shards (one drained, the others with 1 to 99 tokens taken), then
/// `tokenlease reshard --batch-size 50` to three: every key the third shard now holds has its
/// bucket there with no more tokens than it had, the drained moved key admits only its refill
/// after the switch (against `C` more without the command, H6), keys that stay are untouched,
/// and a second run writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reshard_copies_moved_buckets_so_a_moved_key_admits_nothing_extra() {
    let clusters = common::clusters(3).await;
    let all: Vec<(&str, String)> = NAMES
        .iter()
        .copied()
        .zip(clusters.iter().map(|pg| url(pg)))
        .collect();
    let two = &all[..2];
    let old = store(two).await;
    let bucket = common::bucket(100, R);
    let keys: Vec<String> = (0..300).map(|i| format!("h7:user:{i}")).collect();
    let moved: Vec<&String> = keys
        .iter()
        .filter(|k| shard_of(&NAMES, k) == Some(2))
        .collect();
    assert!(
        moved.len() > 50 && moved.len() < 150,
        "{} of 300 keys move to the third shard",
        moved.len()
    );
    let drained = moved[0].clone();
    let mut drained_at = SystemTime::UNIX_EPOCH;
    for (i, key) in keys.iter().enumerate() {
        let cost = if *key == drained {
            100
        } else {
            1 + i as u64 % 99
        };
        let a = old
            .acquire(AcquireRequest::take(key, bucket, Tokens::whole(cost)))
            .await
            .expect("take");
        assert_eq!(a.granted, Tokens::whole(cost));
        if *key == drained {
            drained_at = a.store_now;
        }
    }
    // Before the command the new shard holds nothing.
    let pg_c = store(&all[2..]).await;
    assert!(pg_c.inspect(&drained).await.expect("inspect").is_none());

    let out = reshard(&clusters, &["--batch-size", "50"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("{} moving, {} written", moved.len(), moved.len())),
        "{stdout}"
    );
    // Every moved key has its row on the new shard, with at most the tokens the old one had
    // (refilled since) and never more than the capacity.
    for key in &moved {
        let new = pg_c.inspect(key).await.expect("inspect").expect("copied");
        let was = old.inspect(key).await.expect("inspect").expect("old row");
        assert!(
            new.tokens_now.as_f64() <= was.tokens_now.as_f64() + 1e-6,
            "{key}: {} on the new shard, {} on the old",
            new.tokens_now.as_f64(),
            was.tokens_now.as_f64()
        );
    }
    // A second run is harmless: it moves the same keys and leaves no copy with more tokens
    // than the old row (a copy is replaced only by one holding fewer tokens).
    let again = reshard(&clusters, &[]);
    let again = String::from_utf8_lossy(&again.stdout);
    assert!(
        again.contains(&format!("{} moving", moved.len())),
        "{again}"
    );
    for key in &moved {
        let new = pg_c.inspect(key).await.expect("inspect").expect("copied");
        let was = old.inspect(key).await.expect("inspect").expect("old row");
        assert!(
            new.tokens_now.as_f64() <= was.tokens_now.as_f64() + 1e-6,
            "{key}"
        );
    }

    // The switch: the drained key that moved admits its refill only.
    let new = store(&all).await;
    assert_eq!(new.shard_name(&drained), NAMES[2]);
    let (granted, last) = common::take_for_a_second(&new, &drained, common::bucket(100, R)).await;
    let refill = R * common::secs_between(drained_at, last);
    eprintln!(
        "H7 {drained}: granted {granted} after the switch, refill since the drain {refill:.1}"
    );
    assert!(
        granted <= refill + 1.0,
        "{drained}: {granted} granted, more than the refill {refill:.1}: the copy was not used"
    );
    assert!(granted < C, "{drained}: {granted}");
}
