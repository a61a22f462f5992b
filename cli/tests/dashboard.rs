//! M2 (docs/testing.md): the demo's live dashboard in a real browser. `tokenlease demo` under
//! traffic, its `/dashboard` page loaded by headless Chromium, and the DOM the page's script
//! rendered read back: the figures are there, live, and not zero, for every limit of every
//! route (the customer budget too).
//!
//! Needs Debian's `chromium`; without it the test says so and passes, unless `CI` is set.
//! With `TOKENLEASE_DASHBOARD_SCREENSHOT=path.png` it also saves a screenshot of the page after
//! about a minute of traffic (docs/dashboard.png is made so).

use crate::live_demo;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use live_demo::{Demo, Traffic, exchange_with, outside_program, request, run_with_deadline, tail};

/// Chromium without anything that reaches outside this machine, in a fresh profile; the page
/// is given `budget_ms` of virtual time (the page asks the demo for a sample after each answer,
/// and the demo answers one second after the previous one, so that is about
/// `budget_ms / 200` samples, one a second of real time), in a window `height` pixels high.
fn chromium(binary: &Path, profile: &Path, budget_ms: u32, height: u32) -> Command {
    let mut c = Command::new(binary);
    c.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--hide-scrollbars",
    ])
    .arg(format!("--window-size=1280,{height}"))
    .arg(format!("--user-data-dir={}", profile.display()))
    .arg(format!("--virtual-time-budget={budget_ms}"));
    c
}

/// The number in `data-value` of the element with `id`; `None` when it is empty ("n/a").
fn figure(dom: &str, id: &str) -> Option<f64> {
    let at = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no element #{id} in the page"));
    let tag = &dom[at..at + dom[at..].find('>').expect("the tag's end")];
    let value = tag.split("data-value=\"").nth(1)?.split('"').next()?;
    value.parse().ok()
}

/// The figures of one row of the routes table: (route, layer, allowed, denied), per second.
fn route_rows(dom: &str) -> Vec<(String, String, Option<f64>, Option<f64>)> {
    let attr = |text: &str, name: &str| {
        text.split(&format!("{name}=\""))
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .map(str::to_owned)
    };
    let cell = |row: &str, figure: &str| {
        let at = row.find(&format!("data-figure=\"{figure}\""))?;
        attr(&row[at..], "data-value")?.parse().ok()
    };
    dom.split("<tr data-route=\"")
        .skip(1)
        .map(|chunk| {
            let row = &chunk[..chunk.find("</tr>").unwrap_or(chunk.len())];
            let route = row.split('"').next().unwrap_or_default().to_owned();
            let layer = attr(row, "data-layer").unwrap_or_default();
            (route, layer, cell(row, "allowed"), cell(row, "denied"))
        })
        .collect()
}

#[test]
fn m2_the_dashboard_shows_live_non_zero_figures_in_headless_chromium() {
    let started = Instant::now();
    let Some(binary) = outside_program(
        "chromium",
        &["/usr/bin/chromium"],
        "apt-get install -y chromium",
    ) else {
        return;
    };
    let demo = Demo::start();
    let addr = demo.addr.clone();
    assert!(
        demo.banner
            .iter()
            .any(|l| l == &format!("dashboard: http://{addr}/dashboard")),
        "the banner names the dashboard: {:?}",
        demo.banner
    );

    // The page is one file that loads nothing from elsewhere, and the demo's policy does not
    // limit it: more requests than any route's burst all succeed.
    let (status, page) = request(&addr, "GET", "/dashboard").expect("the page");
    assert_eq!(status, 200);
    for outside in ["http://", "https://", "src=", "href=", "@import", "url("] {
        assert!(!page.contains(outside), "the page refers to {outside:?}");
    }
    for i in 0..250 {
        let (status, _) = request(&addr, "GET", "/dashboard").expect("the page");
        assert_eq!(status, 200, "request {i} for the dashboard");
    }
    let (status, data) = request(&addr, "GET", "/dashboard/data").expect("the data");
    assert_eq!(status, 200);
    let data: serde_json::Value = serde_json::from_str(&data).expect("JSON");
    assert!(data["t"].as_f64().is_some(), "{data}");
    assert!(!data["samples"].as_array().expect("samples").is_empty());
    let (status, _) = request(&addr, "GET", "/dashboard/data?after=soon").expect("an answer");
    assert_eq!(status, 400, "a malformed `after` is refused");

    let traffic = Traffic::start(&addr);
    traffic.wait_for_both(20);
    // One customer reading a new booking every 20 ms: past its budget (30 a minute) the
    // `customer` limit, listed after `api` and `entity`, denies it (then from memory, before
    // the route's other limits). The page is loaded once it has.
    let customer = {
        let (stop, addr) = (Arc::new(AtomicBool::new(false)), addr.clone());
        let denied = Arc::new(AtomicU64::new(0));
        let (flag, count) = (Arc::clone(&stop), Arc::clone(&denied));
        let thread = std::thread::spawn(move || {
            let mut i = 0u32;
            while !flag.load(Ordering::Relaxed) {
                i += 1;
                let path = format!("/bookings/customer-{i}");
                let reply = exchange_with(&addr, "GET", &path, &[("X-Customer-Id", "dashboard")]);
                if reply
                    .is_some_and(|r| r.status == 429 && r.body.contains("\"limit\":\"customer\""))
                {
                    count.fetch_add(1, Ordering::Relaxed);
                }
                // sleep: pacing, a request every 20 ms.
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let waited = Instant::now();
        while denied.load(Ordering::Relaxed) == 0 {
            assert!(
                waited.elapsed() < Duration::from_secs(60),
                "the customer was never denied by its budget"
            );
            // sleep: polling the customer thread's count.
            std::thread::sleep(Duration::from_millis(50));
        }
        (stop, thread)
    };

    let dir = tempfile::tempdir().expect("a temp dir");
    // About 8 samples, 8 s of real time.
    let mut dump = chromium(&binary, &dir.path().join("profile"), 1600, 1000);
    dump.arg("--dump-dom")
        .arg(format!("http://{addr}/dashboard"));
    let took = Instant::now();
    let (status, dom) = run_with_deadline(dump, dir.path(), "chromium", Duration::from_secs(60));
    let stderr = || tail(&dir.path().join("chromium.err"), 20);
    assert!(
        status.is_some_and(|s| s.success()),
        "chromium --dump-dom: {status:?}\n{}",
        stderr()
    );
    println!(
        "chromium --dump-dom took {:.1} s",
        took.elapsed().as_secs_f64()
    );

    let polls: u32 = dom
        .split("data-polls=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no data-polls in the page:\n{dom}\n{}", stderr()));
    assert!(polls >= 3, "the page took {polls} samples:\n{dom}");
    let positive = |id: &str| {
        let v = figure(&dom, id);
        assert!(v.is_some_and(|v| v > 0.0), "#{id} = {v:?}");
    };
    positive("req-served");
    positive("req-denied");
    // The list's per-client limit is in shadow mode, and the traffic lists from one address.
    positive("req-would-deny");
    positive("db-statements");
    let share = figure(&dom, "db-saved-share").expect("a saved share");
    assert!((0.0..=100.0).contains(&share), "saved share {share} %");
    assert!(figure(&dom, "lease-outstanding").is_some_and(|v| v >= 0.0));
    assert!(figure(&dom, "lease-keys").is_some_and(|v| v >= 1.0));
    assert_eq!(figure(&dom, "circuit-state"), Some(0.0), "closed");
    assert!(dom.contains(">closed</span>"));
    assert!(figure(&dom, "fallback-rate").is_some());

    // Per route and layer: every route of the policy with its layers, the hammered booking's
    // entity denials, and something allowed.
    let rows = route_rows(&dom);
    let layers: Vec<(&str, &str)> = rows
        .iter()
        .map(|(r, l, ..)| (r.as_str(), l.as_str()))
        .collect();
    for expected in [
        ("GET /bookings", "api"),
        ("GET /bookings", "entity"),
        ("GET /bookings/{bookingId}", "api"),
        ("GET /bookings/{bookingId}", "entity"),
        ("POST /bookings/{bookingId}/automate/internal", "api"),
        ("POST /bookings/{bookingId}/automate/internal", "entity"),
        // The customer budget every route lists, from the layer's `layer` label.
        ("GET /bookings", "customer"),
        ("GET /bookings/{bookingId}", "customer"),
        ("POST /bookings/{bookingId}/automate/internal", "customer"),
    ] {
        assert!(layers.contains(&expected), "{expected:?} in {layers:?}");
    }
    let entity_denied = rows
        .iter()
        .find(|(r, l, ..)| r == "GET /bookings/{bookingId}" && l == "entity")
        .and_then(|row| row.3);
    assert!(
        entity_denied.is_some_and(|d| d > 0.0),
        "the hammered booking's denials: {rows:?}"
    );
    let customer_denied = rows
        .iter()
        .find(|(r, l, ..)| r == "GET /bookings/{bookingId}" && l == "customer")
        .and_then(|row| row.3);
    assert!(
        customer_denied.is_some_and(|d| d > 0.0),
        "the customer past its budget: {rows:?}"
    );
    assert!(
        rows.iter().any(|row| row.2.is_some_and(|a| a > 0.0)),
        "{rows:?}"
    );
    for plan in [
        "automate",
        "booking-automate",
        "booking-read",
        "bookings-list",
        "bookings-read",
        "list-per-client",
        "per-customer",
    ] {
        assert!(
            dom.contains(&format!("<tr data-plan=\"{plan}\"")),
            "plan {plan}"
        );
    }

    if let Some(path) = std::env::var_os("TOKENLEASE_DASHBOARD_SCREENSHOT") {
        // About a minute of samples, so the sparklines are full.
        let path = std::path::absolute(path).expect("the screenshot's path");
        let mut shot = chromium(&binary, &dir.path().join("profile-shot"), 12_000, 1320);
        shot.arg(format!("--screenshot={}", path.display()))
            .arg(format!("http://{addr}/dashboard"));
        let (status, _) =
            run_with_deadline(shot, dir.path(), "screenshot", Duration::from_secs(150));
        assert!(
            status.is_some_and(|s| s.success()),
            "{}",
            tail(&dir.path().join("screenshot.err"), 20)
        );
        println!("screenshot: {}", path.display());
    }

    customer.0.store(true, Ordering::Relaxed);
    let _ = customer.1.join();
    drop(traffic);
    let status = demo.stop();
    assert!(status.success(), "the demo exited with {status}");
    println!("test took {:.1} s", started.elapsed().as_secs_f64());
}
