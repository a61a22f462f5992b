//! End to end: start `tokenlease demo` (the built binary, on its throwaway PostgreSQL or
//! `DATABASE_URL`), talk real HTTP/1.1 to it over TCP, and stop it with SIGTERM.

use crate::live_demo;

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use live_demo::{Demo, Reply, must as request};

#[test]
fn demo_serves_both_layers_over_real_http_and_stops_on_sigterm() {
    let demo = Demo::start();
    let addr = demo.addr.clone();
    // Ids of their own, in case DATABASE_URL points at a database an earlier run used.
    let run = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let (a, b) = (format!("a{run}"), format!("b{run}"));

    // An allowed response carries both layers' fields.
    let r = request(&addr, "GET", &format!("/bookings/{a}"));
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"api\";q=100;w=2, \"entity\";q=20;w=60, \"customer\";q=30;w=60")
    );
    assert_eq!(r.number("x-ratelimit-entity-remaining"), 19);
    assert!(r.number("x-ratelimit-api-remaining") <= 100);
    assert!(
        r.header("ratelimit")
            .unwrap()
            .contains("\"entity\";r=19;t=")
    );
    assert!(r.body.contains(&a));

    // The list's per-client limit is in shadow mode: 10 a burst, then it would deny, and lets
    // every request through with the fields a denial would carry (no Retry-After).
    let lists: Vec<Reply> = (0..14)
        .map(|_| request(&addr, "GET", "/bookings"))
        .collect();
    for (i, r) in lists.iter().enumerate() {
        assert_eq!(r.status, 200, "list {i}: {r:?}");
        assert_eq!(r.header("retry-after"), None, "list {i}");
    }
    // The list's api plan is leased with the `allow` fallback: a refill slower than its 50 ms
    // wait (a loaded machine) is decided by the fallback, which knows no remaining count, so
    // not every answer carries the field.
    assert!(
        lists
            .iter()
            .any(|r| r.header("x-ratelimit-api-remaining").is_some()),
        "{lists:?}"
    );
    assert_eq!(
        lists.last().unwrap().number("x-ratelimit-entity-remaining"),
        0,
        "the shadow layer's bucket is empty, and the request went through"
    );

    // Booking a: 5 automations a minute, then 429 with Retry-After.
    let automate = |id: &str| request(&addr, "POST", &format!("/bookings/{id}/automate/internal"));
    for i in 0..5 {
        let r = automate(&a);
        assert_eq!(r.status, 200, "automation {i}: {r:?}");
        assert_eq!(r.number("x-ratelimit-entity-remaining"), 4 - i);
    }
    let r = automate(&a);
    assert_eq!(r.status, 429, "{r:?}");
    let retry = r.number("retry-after");
    assert!((1..=12).contains(&retry), "Retry-After {retry}");
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(r.number("x-ratelimit-entity-remaining"), 0);
    let body: serde_json::Value = serde_json::from_str(&r.body).expect("a JSON problem body");
    assert_eq!(body["layer"], "entity");
    assert_eq!(body["status"], 429);
    assert_eq!(body["retry_after"], retry);

    // Booking a keeps hammering: 40 more denials, more than the endpoint's global capacity
    // (20). Each denied request's global token goes back, so the endpoint stays open...
    for _ in 0..40 {
        assert_eq!(automate(&a).status, 429);
    }
    // ...for booking b, whose own bucket is untouched, and the global budget with it.
    let r = automate(&b);
    assert_eq!(r.status, 200, "another booking after a's 429s: {r:?}");
    assert_eq!(r.number("x-ratelimit-entity-remaining"), 4);
    let api_left = r.number("x-ratelimit-api-remaining");
    assert!(
        api_left >= 13,
        "global budget after a's 45 requests: {api_left} of 20 (a took 5, b took 1)"
    );

    let metrics = request(&addr, "GET", "/metrics");
    assert_eq!(metrics.status, 200);
    // By layer, method and route pattern; every route's series is there, at zero or more.
    let denied = |layer: &str, method: &str, route: &str| {
        metrics
            .body
            .lines()
            .find(|l| {
                l.starts_with("tokenlease_http_denied_total{")
                    && l.contains(&format!("layer=\"{layer}\""))
                    && l.contains(&format!("method=\"{method}\""))
                    && l.contains(&format!("route=\"{route}\""))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {layer} {method} {route} in {}", metrics.body))
    };
    let automate_route = "/bookings/{bookingId}/automate/internal";
    assert_eq!(denied("entity", "POST", automate_route), 41);
    assert_eq!(denied("api", "POST", automate_route), 0);
    assert_eq!(denied("entity", "GET", "/bookings/{bookingId}"), 0);
    assert_eq!(denied("api", "GET", "/bookings"), 0);
    // GET /bookings's entity layer is in shadow mode: it never denied, and counted the 4
    // lists past its burst of 10 as would-deny.
    assert_eq!(denied("entity", "GET", "/bookings"), 0);
    let would_deny = metrics
        .body
        .lines()
        .find(|l| {
            l.starts_with("tokenlease_http_would_deny_total{")
                && l.contains("layer=\"entity\"")
                && l.contains("route=\"/bookings\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok());
    assert_eq!(would_deny, Some(4), "{}", metrics.body);
    // And its plan counts those four as would-deny decisions, none as denied.
    let decisions = |outcome: &str| -> u64 {
        metrics
            .body
            .lines()
            .filter(|l| {
                l.starts_with("tokenlease_decisions_total{")
                    && l.contains("plan=\"list-per-client\"")
                    && l.contains(&format!("outcome=\"{outcome}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    assert_eq!(decisions("would_deny"), 4, "{}", metrics.body);
    assert_eq!(decisions("denied"), 0, "{}", metrics.body);
    assert!(metrics.body.contains("tokenlease_http_refunds_total"));

    let status = demo.stop();
    assert!(status.success(), "the demo exited with {status}");
}

/// The entity layer keeps one booking from draining its endpoint: a burst of 200 requests for
/// one booking is cut off by that booking's own limit (20), never by the endpoint's (100), and
/// another booking is served meanwhile. The demo prints its database and how to inspect a key;
/// the printed command, run while the demo serves, shows the hammered booking's bucket empty.
#[test]
fn one_booking_in_a_burst_meets_its_entity_limit_while_others_are_served() {
    let demo = Demo::start();
    let addr = demo.addr.clone();
    let run = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let (a, b) = (format!("a{run}"), format!("b{run}"));

    let (mut allowed, mut by_entity) = (0, 0);
    for i in 0..200 {
        let r = request(&addr, "GET", &format!("/bookings/{a}"));
        match r.status {
            200 => allowed += 1,
            429 => {
                let body: serde_json::Value = serde_json::from_str(&r.body).expect("JSON");
                assert_eq!(body["layer"], "entity", "request {i} denied by: {r:?}");
                by_entity += 1;
            }
            other => panic!("request {i}: status {other}: {r:?}"),
        }
    }
    // 20 in the burst, plus what 20 tokens a minute refill while it lasts.
    assert!((20..=25).contains(&allowed), "{allowed} allowed");
    assert_eq!(allowed + by_entity, 200);
    let r = request(&addr, "GET", &format!("/bookings/{b}"));
    assert_eq!(r.status, 200, "another booking during a's burst: {r:?}");
    assert_eq!(r.number("x-ratelimit-entity-remaining"), 19);

    // The banner names the database and how to inspect a key.
    let database = demo
        .banner
        .iter()
        .find_map(|l| l.strip_prefix("database: "))
        .unwrap_or_else(|| panic!("no database line in {:?}", demo.banner));
    assert!(
        demo.banner.iter().any(|l| l.contains("tokenlease inspect")),
        "{:?}",
        demo.banner
    );
    let url = database.split(" (").next().unwrap().trim();
    // A password would be shown as *** (only DATABASE_URL can carry one): nothing to run then.
    if !url.contains("***") {
        let key = format!("ratelimit:entity:GET:/bookings/{{bookingId}}:{a}");
        let out = Command::new(env!("CARGO_BIN_EXE_tokenlease"))
            .args(["inspect", "--json", &key])
            .env("DATABASE_URL", url)
            .output()
            .expect("run tokenlease inspect");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let row: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        let now: f64 = row["tokens_now"].as_str().unwrap().parse().unwrap();
        assert!(now < 5.0, "the hammered booking's bucket: {row}");
        let capacity: f64 = row["capacity"].as_str().unwrap().parse().unwrap();
        assert_eq!(capacity, 20.0, "{row}");
    }

    let status = demo.stop();
    assert!(status.success(), "the demo exited with {status}");
}

/// The `tokenlease_decisions_total` samples of a `/metrics` page, summed by plan.
fn decisions_by_plan(metrics: &str) -> std::collections::BTreeMap<String, f64> {
    let mut by_plan = std::collections::BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("tokenlease_decisions_total{") else {
            continue;
        };
        let (labels, value) = rest.split_once("} ").expect("a sample");
        let plan = labels
            .split("plan=\"")
            .nth(1)
            .and_then(|p| p.split('"').next())
            .expect("a plan label");
        *by_plan.entry(plan.to_owned()).or_insert(0.0) += value.trim().parse::<f64>().unwrap();
    }
    by_plan
}

/// M3: every decision reaches the recorder once, within a second, whatever decided it. 60 GETs
/// of 60 bookings through the demo (its shipped policy: each GET of a booking is decided by the
/// endpoint's leased plan `bookings-read` and the booking's own `booking-read`), then
/// `/metrics` a second later: `tokenlease_decisions_total` sums to 60 for each of the two
/// plans, the lease decisions included, and `tokenlease_db_calls_saved_total` counts the lease
/// decisions of `bookings-read`.
#[test]
fn m3_every_decision_of_60_gets_is_counted_within_a_second() {
    let demo = Demo::start();
    let addr = demo.addr.clone();
    let run = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    for i in 0..60 {
        let r = request(&addr, "GET", &format!("/bookings/m3-{run}-{i}"));
        assert_eq!(r.status, 200, "{r:?}");
    }
    // sleep: the demo runs on the machine's clock; its counts are due within a second.
    std::thread::sleep(std::time::Duration::from_secs(1));
    let metrics = request(&addr, "GET", "/metrics").body;
    let by_plan = decisions_by_plan(&metrics);
    assert_eq!(by_plan.get("bookings-read"), Some(&60.0), "{by_plan:?}");
    assert_eq!(by_plan.get("booking-read"), Some(&60.0), "{by_plan:?}");
    let lease = metrics
        .lines()
        .filter(|l| {
            l.starts_with("tokenlease_decisions_total{")
                && l.contains("plan=\"bookings-read\"")
                && l.contains("decided_by=\"lease\"")
        })
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum::<f64>();
    let saved = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tokenlease_db_calls_saved_total "))
        .map(|v| v.trim().parse::<f64>().unwrap());
    assert!(
        lease > 0.0,
        "some of the endpoint's decisions came from its lease"
    );
    assert_eq!(
        saved,
        Some(lease),
        "every lease decision saved a store call"
    );
    demo.stop();
}
