//! M1 (docs/testing.md): the Grafana dashboard against a real Prometheus. `tokenlease demo`
//! under traffic, scraped every second by Debian's `prometheus` (2.42), and every query of
//! `docs/grafana-dashboard.json` evaluated through Prometheus' HTTP API; each must return at
//! least one series, so no panel of the dashboard shows "No data" for a running service.
//!
//! Needs `prometheus`; without it the test says so and passes, unless `CI` is set.

use crate::live_demo;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use live_demo::{Demo, Traffic, outside_program, tail, wait_for};

/// Grafana's variables, as the test gives them: every instance, and a rate window that holds
/// several of the 1 s scrapes.
const VARIABLES: [(&str, &str); 5] = [
    ("$__rate_interval", "15s"),
    ("$__interval", "1s"),
    ("$__range", "1m"),
    ("${instance}", ".*"),
    ("$instance", ".*"),
];

/// A running Prometheus; killed on drop.
struct Prometheus {
    child: Child,
    addr: String,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port nobody listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Starts `binary` scraping `target` every second, with its data and log in `dir`.
fn start_prometheus(binary: &Path, dir: &Path, target: &str) -> Prometheus {
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: tokenlease-demo\n    static_configs:\n      \
             - targets: ['{target}']\n"
        ),
    )
    .expect("write prometheus.yml");
    let addr = format!("127.0.0.1:{}", free_port());
    let log = std::fs::File::create(dir.join("prometheus.log")).expect("a log file");
    let child = Command::new(binary)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={addr}"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("the log file"))
        .stderr(log)
        .spawn()
        .expect("start prometheus");
    Prometheus { child, addr }
}

/// `s` percent-encoded for a query string.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// An instant query; the answer's `data.result`, or why there is none.
fn query(prometheus: &str, promql: &str) -> Result<Vec<serde_json::Value>, String> {
    let path = format!("/api/v1/query?query={}", encode(promql));
    let (status, body) = live_demo::request(prometheus, "GET", &path)
        .ok_or_else(|| "no answer from prometheus".to_owned())?;
    let body = dechunk(&body);
    let answer: serde_json::Value = serde_json::from_str(&body)
        .map_err(|e| format!("HTTP {status}, not JSON ({e}): {body}"))?;
    if answer["status"] != "success" {
        return Err(format!("HTTP {status}: {answer}"));
    }
    answer["data"]["result"]
        .as_array()
        .cloned()
        .ok_or_else(|| format!("no result in {answer}"))
}

/// The body of a `Transfer-Encoding: chunked` answer (Prometheus chunks large ones); a body
/// that is not chunked is given back as it is.
fn dechunk(body: &str) -> String {
    if body.trim_start().starts_with('{') {
        return body.to_owned();
    }
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}

/// Every `expr` in the dashboard's JSON, in order.
fn expressions(dashboard: &serde_json::Value, out: &mut Vec<String>) {
    match dashboard {
        serde_json::Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                    _ => expressions(value, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| expressions(v, out)),
        _ => {}
    }
}

#[test]
fn m1_every_query_of_the_grafana_dashboard_returns_series_from_a_real_prometheus() {
    let started = Instant::now();
    let Some(binary) = outside_program(
        "prometheus",
        &["/usr/bin/prometheus"],
        "apt-get install -y prometheus",
    ) else {
        return;
    };
    let dashboard: serde_json::Value =
        serde_json::from_str(include_str!("../../docs/grafana-dashboard.json"))
            .expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    expressions(&dashboard, &mut exprs);
    assert!(exprs.len() >= 20, "queries found: {exprs:?}");

    let demo = Demo::start();
    let traffic = Traffic::start(&demo.addr);
    let dir = tempfile::tempdir().expect("a temp dir");
    let mut prometheus = start_prometheus(&binary, dir.path(), &demo.addr);
    let log = || tail(&dir.path().join("prometheus.log"), 30);

    // Up (or failed at once, its port taken say), then scraped at least five times (a 15 s
    // rate() wants two samples or more).
    wait_for(
        "prometheus answering queries",
        Duration::from_secs(60),
        || {
            if let Ok(Some(status)) = prometheus.child.try_wait() {
                panic!("prometheus exited with {status}:\n{}", log());
            }
            query(&prometheus.addr, "vector(1)").ok()
        },
    );
    let scrapes = wait_for("five scrapes of the demo", Duration::from_secs(60), || {
        let result = query(
            &prometheus.addr,
            "count_over_time(up{job=\"tokenlease-demo\"}[1m]) >= 5 and up == 1",
        )
        .ok()?;
        let n = result.first()?["value"][1].as_str()?.to_owned();
        Some(n)
    });
    println!("scrapes of the demo: {scrapes}");
    traffic.wait_for_both(20);
    // Scraped since: denials and store calls show in a rate over the dashboard's window.
    wait_for(
        "denials and store calls in prometheus",
        Duration::from_secs(60),
        || {
            let moved = |q: &str| query(&prometheus.addr, q).is_ok_and(|r| !r.is_empty());
            (moved("sum(rate(tokenlease_http_denied_total[15s])) > 0")
                && moved("sum(rate(tokenlease_db_calls_total[15s])) > 0"))
            .then_some(())
        },
    );

    let mut empty = Vec::new();
    for expr in &exprs {
        let mut promql = expr.clone();
        for (variable, value) in VARIABLES {
            promql = promql.replace(variable, value);
        }
        assert!(!promql.contains('$'), "a variable left in {promql}");
        match query(&prometheus.addr, &promql) {
            Ok(result) if !result.is_empty() => {
                println!("{} series: {promql}", result.len());
            }
            Ok(_) => empty.push(format!("no series: {promql}")),
            Err(why) => empty.push(format!("{why}: {promql}")),
        }
    }
    assert!(
        empty.is_empty(),
        "{} of {} queries of docs/grafana-dashboard.json:\n{}\nprometheus log:\n{}",
        empty.len(),
        exprs.len(),
        empty.join("\n"),
        log()
    );

    drop(prometheus);
    drop(traffic);
    let status = demo.stop();
    assert!(status.success(), "the demo exited with {status}");
    println!(
        "{} queries, test took {:.1} s",
        exprs.len(),
        started.elapsed().as_secs_f64()
    );
}
