//! A flood of distinct entity ids through `tokenlease demo`, with its database down and then up:
//! the demo's memory stays within a bound and shrinks back after the flood.
//!
//! The demo runs as its own process (its RSS read from `/proc/<pid>/status`) against a
//! throwaway PostgreSQL that this test stops and starts. The policy's global plan admits
//! everything, so every request reaches the entity layer and makes a bucket of its own: the
//! worst case for memory (with the shipped policy, the global bucket denies most of a flood
//! before any entity bucket is made). While the database is down the entity plan's `local`
//! fallback decides, with at most 100,000 local buckets per limiter; once it is up again the
//! store decides and the buckets live in PostgreSQL.
//!
//! `TOKENLEASE_FLOOD_KEYS` sets the number of ids sent while the database is down (120,000 by
//! default, a fifth more than the fallback's bound; `scripts/flood-rss.sh` sends 1,000,000 to a
//! release build), and a tenth of that once it is up. The entity plan refills its 150 tokens
//! every `TOKENLEASE_FLOOD_PERIOD_S` seconds, 2,250 by default: a flood's local bucket, one
//! token short of its share of 75, is full again (and may go) 30 s after its call, later than
//! the flood takes to fill the fallback's 100,000 buckets (about 21 s in a debug build here), so
//! the flood meets the bound with no full bucket to delete. The test then watches the demo settle
//! for at least `TOKENLEASE_FLOOD_WATCH_S` seconds (0 by default: until the buckets are gone and
//! RSS is back). `scripts/flood-rss.sh` sets an hour (one token takes 48 s) and a minute's watch.
//! Runs in the nextest `serial` group.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tokenlease_testkit::{StopMode, TempPostgres};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The demo's policy for the flood: the global plan lets everything through. `PERIOD_MS` is
/// replaced by the entity plan's refill period.
const POLICY: &str = r#"{
  "plans": {
    "open": { "capacity": 1000000000, "refill_per_second": 1000000000, "lease": {},
              "fallback": { "mode": "allow" } },
    "booking-read": { "capacity": 150, "refill": { "tokens": 150, "period_ms": PERIOD_MS },
                      "fallback": { "mode": "local", "instances": 2 } }
  },
  "default_plan": "open",
  "keys": [ { "prefix": "ratelimit:entity:", "plan": "booking-read" } ],
  "routes": [
    { "method": "GET", "path": "/bookings/{bookingId}", "global": "open",
      "entity": { "path_param": "bookingId", "type": "booking", "plan": "booking-read" } }
  ]
}"#;

/// How far above its start the demo's RSS may stay once the flood's buckets are gone.
const BACK_NEAR_START: f64 = 10.0;

/// Keep-alive connections to the demo, each with this many requests in flight (pipelined).
const CONNECTIONS: usize = 8;
const DEPTH: usize = 32;

/// The demo's resident set in MiB.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb / 1024.0
}

struct Demo {
    child: Child,
    addr: String,
}

impl Demo {
    fn start(database_url: &str, policy: &std::path::Path) -> Demo {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tokenlease"))
            .args(["demo", "--listen", "127.0.0.1:0", "--db-timeout-ms", "50"])
            .arg("--policy")
            .arg(policy)
            .env("DATABASE_URL", database_url)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start tokenlease demo");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let addr = loop {
            let line = rx
                .recv_timeout(Duration::from_secs(60))
                .expect("the demo prints where it listens within 60 s");
            if let Some(url) = line.strip_prefix("tokenlease demo listening on http://") {
                break url.trim().to_owned();
            }
        };
        Demo { child, addr }
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Status counts of a flood.
#[derive(Debug, Default)]
struct Statuses {
    ok: AtomicU64,
    limited: AtomicU64,
    other: AtomicU64,
}

/// Reads one HTTP/1.1 response from `buf`/`conn` and returns its status code.
async fn read_response(conn: &mut TcpStream, buf: &mut Vec<u8>) -> u16 {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = std::str::from_utf8(&buf[..end]).expect("ASCII head");
            let status: u16 = head[9..12].parse().expect("status code");
            let length: usize = head
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse().ok())?
                })
                .unwrap_or(0);
            let total = end + 4 + length;
            while buf.len() < total {
                read_more(conn, buf).await;
            }
            buf.drain(..total);
            return status;
        }
        read_more(conn, buf).await;
    }
}

async fn read_more(conn: &mut TcpStream, buf: &mut Vec<u8>) {
    let mut chunk = [0u8; 16 * 1024];
    let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut chunk))
        .await
        .expect("the demo answers within 10 s")
        .expect("read");
    assert!(n > 0, "the demo closed the connection");
    buf.extend_from_slice(&chunk[..n]);
}

/// Sends `count` requests for the distinct ids `first..first + count`, over keep-alive
/// connections, `DEPTH` in flight on each; samples the demo's RSS as it goes.
async fn flood(addr: &str, pid: u32, first: u64, count: u64, peak: &mut f64) -> Arc<Statuses> {
    let next = Arc::new(AtomicU64::new(first));
    let end = first + count;
    let statuses = Arc::new(Statuses::default());
    let mut tasks = Vec::new();
    for _ in 0..CONNECTIONS {
        let (addr, next, statuses) = (addr.to_owned(), Arc::clone(&next), Arc::clone(&statuses));
        tasks.push(tokio::spawn(async move {
            let mut conn = TcpStream::connect(&addr)
                .await
                .expect("connect to the demo");
            conn.set_nodelay(true).expect("nodelay");
            let mut buf = Vec::new();
            loop {
                let from = next.fetch_add(DEPTH as u64, Ordering::Relaxed);
                if from >= end {
                    return;
                }
                let to = (from + DEPTH as u64).min(end);
                let mut out = String::new();
                for id in from..to {
                    out.push_str(&format!(
                        "GET /bookings/b{id} HTTP/1.1\r\nHost: demo\r\n\r\n"
                    ));
                }
                conn.write_all(out.as_bytes()).await.expect("write");
                for _ in from..to {
                    let counter = match read_response(&mut conn, &mut buf).await {
                        200 => &statuses.ok,
                        429 => &statuses.limited,
                        _ => &statuses.other,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let all = async {
        for task in tasks {
            task.await.expect("flood connection");
        }
    };
    tokio::pin!(all);
    loop {
        tokio::select! {
            () = &mut all => break,
            // sleep: pacing, the RSS sampled every 100 ms while the flood runs.
            () = tokio::time::sleep(Duration::from_millis(100)) => *peak = peak.max(rss_mib(pid)),
        }
    }
    *peak = peak.max(rss_mib(pid));
    statuses
}

/// `tokenlease_fallback_local_buckets` from the demo's `/metrics`, when it is there.
async fn local_buckets(addr: &str) -> Option<u64> {
    metric(addr, "tokenlease_fallback_local_buckets ")
        .await
        .map(|v| v as u64)
}

/// Fallback decisions so far (every mode and outcome together), from the demo's `/metrics`.
async fn fallback_decisions(addr: &str) -> f64 {
    metric(addr, "tokenlease_fallback_decisions_total{")
        .await
        .unwrap_or(0.0)
}

/// The sum of the series of `/metrics` whose line starts with `prefix`.
async fn metric(addr: &str, prefix: &str) -> Option<f64> {
    let mut conn = TcpStream::connect(addr).await.expect("connect to the demo");
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: demo\r\nConnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut body = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut body))
        .await
        .expect("metrics within 10 s")
        .expect("read metrics");
    let values: Vec<f64> = String::from_utf8_lossy(&body)
        .lines()
        .filter(|line| line.starts_with(prefix))
        .filter_map(|line| line.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_ids_with_the_database_down_then_up_stays_bounded_and_shrinks_back() {
    let keys: u64 = std::env::var("TOKENLEASE_FLOOD_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(120_000);
    let env_secs = |name: &str, default: u64| -> u64 {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let period_s = env_secs("TOKENLEASE_FLOOD_PERIOD_S", 2_250);
    let watch_s = env_secs("TOKENLEASE_FLOOD_WATCH_S", 0) as f64;
    let pg = TempPostgres::start().expect("throwaway PostgreSQL");
    let dir = tempfile::tempdir().expect("temp dir");
    let policy = dir.path().join("flood.json");
    std::fs::write(
        &policy,
        POLICY.replace("PERIOD_MS", &(period_s * 1000).to_string()),
    )
    .expect("policy file");
    let demo = Demo::start(&pg.url(), &policy);
    let pid = demo.child.id();

    // Warm: connections, the global lease, the allocator's first arenas.
    let mut peak = 0.0;
    flood(&demo.addr, pid, 0, 2_000, &mut peak).await;
    let start = rss_mib(pid);

    let began = Instant::now();
    pg.stop(StopMode::Fast).expect("stop the database");
    let mut peak_down = start;
    let down = flood(&demo.addr, pid, 1_000_000_000, keys, &mut peak_down).await;
    let down_s = began.elapsed().as_secs_f64();
    pg.start_again().expect("start the database again");
    let up_from = Instant::now();
    let mut peak_up = start;
    let up = flood(&demo.addr, pid, 2_000_000_000, keys / 10, &mut peak_up).await;
    let up_s = up_from.elapsed().as_secs_f64();
    // After the flood: a request now and then (each store answer lets the fallback delete the
    // local buckets that have refilled to full: one token of a share of 75 takes 30 s with the
    // default period), and the demo gives the freed pages back to the system (`malloc_trim` every 5 s):
    // RSS comes back within `BACK_NEAR_START` of the start. Watched for `watch_s` at least, and
    // waited for until 90 s after the flood at most (150 s when watching a minute or more).
    let settle = Instant::now();
    let fallback_before = fallback_decisions(&demo.addr).await;
    let mut id = 3_000_000_000u64;
    let mut held = local_buckets(&demo.addr).await;
    let (mut none_held_s, mut back_s, mut at_watch_end) = (None, None, None);
    let deadline = Duration::from_secs_f64(90.0 + watch_s);
    let mut after = rss_mib(pid);
    // A settling request that the fallback decided (its store call timed out on a busy
    // machine) made a bucket of its own, which refills only after the wait: those may remain.
    let mut settle_fallbacks = 0;
    // Until, at one reading, the buckets are gone and RSS is back (both now: deleting the
    // buckets allocates, and RSS that was back may rise until the next trim) and the watch is
    // over.
    while settle.elapsed() < deadline
        && (after - start > BACK_NEAR_START
            || at_watch_end.is_none()
            || held.is_none_or(|held| held > settle_fallbacks))
    {
        let mut ignored = 0.0;
        flood(&demo.addr, pid, id, 10, &mut ignored).await;
        id += 10;
        // sleep: pacing, a round of 10 requests every 500 ms while the demo settles.
        tokio::time::sleep(Duration::from_millis(500)).await;
        held = local_buckets(&demo.addr).await;
        settle_fallbacks = (fallback_decisions(&demo.addr).await - fallback_before) as u64;
        after = rss_mib(pid);
        let elapsed = settle.elapsed().as_secs_f64();
        if held.is_some_and(|held| held <= settle_fallbacks) {
            none_held_s.get_or_insert(elapsed);
        }
        if after - start <= BACK_NEAR_START {
            back_s.get_or_insert(elapsed);
        }
        if elapsed >= watch_s {
            at_watch_end.get_or_insert(after);
        }
    }
    let settled_s = settle.elapsed().as_secs_f64();
    let debt = metric(&demo.addr, "tokenlease_outage_debt_tokens{").await;
    let charged = metric(&demo.addr, "tokenlease_outage_debt_charged_tokens_total{").await;
    println!("outage debt at the end: {debt:?} tokens owed, {charged:?} charged");
    println!(
        "flood of {keys} ids with the database down in {down_s:.1} s ({} 200, {} 429, {} other), \
         {} ids with it up in {up_s:.1} s ({} 200, {} 429, {} other); RSS {start:.1} MiB at the \
         start, peak {peak_down:.1} down, {peak_up:.1} up; the flood's local buckets gone \
         {none_held_s:.1?} s after, RSS within {BACK_NEAR_START} MiB of the start {back_s:.1?} s after, \
         {at_watch_end:.1?} MiB {watch_s:.0} s after; {held:?} local buckets and RSS {after:.1} MiB \
         {settled_s:.1} s after (the entity plan refilling every {period_s} s)",
        down.ok.load(Ordering::Relaxed),
        down.limited.load(Ordering::Relaxed),
        down.other.load(Ordering::Relaxed),
        keys / 10,
        up.ok.load(Ordering::Relaxed),
        up.limited.load(Ordering::Relaxed),
        up.other.load(Ordering::Relaxed),
    );
    assert!(
        peak_down.max(peak_up) - start <= 64.0,
        "RSS grew by more than 64 MiB"
    );
    assert!(
        held.is_some_and(|held| held <= settle_fallbacks),
        "the fallback still holds {held:?} local buckets ({settle_fallbacks} made after the flood)"
    );
    assert!(
        after - start <= BACK_NEAR_START,
        "RSS {after:.1} MiB {settled_s:.1} s after the flood, {start:.1} MiB at its start: not \
         back within {BACK_NEAR_START} MiB"
    );
}
