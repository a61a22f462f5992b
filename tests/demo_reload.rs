//! R6, end to end: `tokenlease demo --policy FILE` reloads the file when it changes and on
//! SIGHUP, while serving; a file that fails `tokenlease check` is refused with its error and
//! the policies in force stay. Real HTTP over TCP to the built binary on its throwaway
//! PostgreSQL.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const DEMO_POLICY: &str = include_str!("../examples/policies/demo.json");

/// `GET path`: (status, the `ratelimit-policy` field).
fn get(addr: &str, path: &str) -> (u16, Option<String>) {
    let mut stream = TcpStream::connect(addr).expect("connect to the demo");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).expect("read the reply");
    let status = raw
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let policy = raw
        .split("\r\n")
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.eq_ignore_ascii_case("ratelimit-policy"))
        .map(|(_, v)| v.trim().to_owned());
    (status, policy)
}

struct Demo {
    child: Child,
    addr: String,
    /// Lines the demo prints on stderr, as they come.
    stderr: mpsc::Receiver<String>,
}

impl Demo {
    fn start(policy: &PathBuf) -> Demo {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tokenlease"))
            .args(["demo", "--listen", "127.0.0.1:0", "--policy"])
            .arg(policy)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start tokenlease demo");
        let (out_tx, out_rx) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = out_tx.send(line);
            }
        });
        let (err_tx, stderr) = mpsc::channel();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("demo: {line}");
                let _ = err_tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        let addr = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = out_rx
                .recv_timeout(left)
                .expect("the demo prints where it listens within 60 s");
            if let Some(a) = line.strip_prefix("tokenlease demo listening on http://") {
                break a.trim().to_owned();
            }
        };
        Demo {
            child,
            addr,
            stderr,
        }
    }

    /// Waits (up to 20 s) for a stderr line containing every one of `parts`.
    fn expect_line(&self, parts: &[&str]) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .stderr
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no line with {parts:?} within 20 s"));
            if parts.iter().all(|p| line.contains(p)) {
                return line;
            }
        }
    }

    fn signal(&self, name: &str) {
        let sent = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status();
        assert!(sent.is_ok_and(|s| s.success()), "kill -{name}");
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.signal("TERM");
            let deadline = Instant::now() + Duration::from_secs(20);
            while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Writes `contents` to `path` whole: into a file beside it, then renamed over it, as editors
/// and deploy tools do, so the demo never reads half a file.
fn replace(path: &PathBuf, contents: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

#[test]
fn r6_the_demo_reloads_its_policy_file_on_change_and_sighup_and_refuses_a_bad_one() {
    let dir = std::env::temp_dir().join(format!("tokenlease-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("policy.json");
    std::fs::write(&path, DEMO_POLICY).expect("write the policy");
    let demo = Demo::start(&path);
    let entity_q = |q: u32| format!("\"entity\";q={q};w=60");
    let (status, policy) = get(&demo.addr, "/bookings/a1");
    assert_eq!(status, 200);
    assert!(
        policy.as_deref().unwrap().contains(&entity_q(20)),
        "{policy:?}"
    );

    // A changed file: the booking's plan now holds 30 tokens, from the next request on.
    let thirty = DEMO_POLICY.replacen(
        "\"capacity\": 20,\n      \"refill\": { \"tokens\": 20",
        "\"capacity\": 30,\n      \"refill\": { \"tokens\": 30",
        1,
    );
    assert_ne!(thirty, DEMO_POLICY, "the edit applies");
    replace(&path, &thirty);
    demo.expect_line(&["reloaded", "(the file changed)"]);
    let (status, policy) = get(&demo.addr, "/bookings/a2");
    assert_eq!(status, 200);
    assert!(
        policy.as_deref().unwrap().contains(&entity_q(30)),
        "{policy:?}"
    );

    // A file that fails the check: refused with its error, and the 30-token plan stays.
    replace(
        &path,
        &thirty.replacen("\"capacity\": 30", "\"capacity\": 0", 1),
    );
    let line = demo.expect_line(&["refused", "(the file changed)"]);
    assert!(
        line.contains("capacity"),
        "the error names the field: {line}"
    );
    assert!(line.contains("the policies in force stay"), "{line}");
    let (_, policy) = get(&demo.addr, "/bookings/a3");
    assert!(
        policy.as_deref().unwrap().contains(&entity_q(30)),
        "{policy:?}"
    );

    // SIGHUP reloads whatever the file holds now (valid again, 40 tokens).
    let forty = DEMO_POLICY.replacen(
        "\"capacity\": 20,\n      \"refill\": { \"tokens\": 20",
        "\"capacity\": 40,\n      \"refill\": { \"tokens\": 40",
        1,
    );
    replace(&path, &forty);
    demo.expect_line(&["reloaded"]);
    demo.signal("HUP");
    demo.expect_line(&["reloaded", "(SIGHUP)"]);
    let (status, policy) = get(&demo.addr, "/bookings/a4");
    assert_eq!(status, 200);
    assert!(
        policy.as_deref().unwrap().contains(&entity_q(40)),
        "{policy:?}"
    );
    drop(demo);
    let _ = std::fs::remove_dir_all(&dir);
}
