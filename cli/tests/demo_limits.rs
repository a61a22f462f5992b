//! The demo's three limits on its booking routes, over real HTTP on its own PostgreSQL (E8,
//! E9): the route, the booking (20 a minute) and the customer's budget (`X-Customer-Id`, 30 a
//! minute across its booking routes), checked in that order, a refusal giving back what the
//! limits before it took.

use crate::live_demo;

use std::time::{SystemTime, UNIX_EPOCH};

use live_demo::{Demo, Reply, exchange_with};

/// Every limit of the demo's `GET /bookings/{bookingId}`, as `RateLimit-Policy` lists them.
const POLICY: &str = "\"api\";q=100;w=2, \"entity\";q=20;w=60, \"customer\";q=30;w=60";

fn get(addr: &str, path: &str, customer: &str) -> Reply {
    exchange_with(addr, "GET", path, &[("X-Customer-Id", customer)])
        .unwrap_or_else(|| panic!("GET {path}: no well-formed answer within 10 s"))
}

/// E8: customer A reads 40 different bookings: exactly 30 get through, each with the three
/// limits in `RateLimit-Policy`; the rest are refused by the customer limit, named in
/// `RateLimit`, the problem body and the metrics.
/// E9: customer B is refused by the booking limit on booking 7 (20 of 25 through), which takes
/// nothing from its budget: exactly 10 more of its requests get through, on other bookings.
#[test]
fn e8_e9_the_demo_limits_each_customer_beside_its_route_and_booking_limits() {
    let demo = Demo::start();
    let addr = demo.addr.clone();
    // Ids of their own, in case DATABASE_URL points at a database an earlier run used.
    let run = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let (a, b) = (format!("a{run}"), format!("b{run}"));

    // E8: 40 bookings, 30 through.
    let replies: Vec<Reply> = (0..40)
        .map(|i| get(&addr, &format!("/bookings/e8-{run}-{i}"), &a))
        .collect();
    let through: Vec<&Reply> = replies.iter().filter(|r| r.status == 200).collect();
    assert_eq!(through.len(), 30, "{replies:?}");
    for r in &through {
        assert_eq!(r.header("ratelimit-policy"), Some(POLICY), "{r:?}");
    }
    assert!(replies[..30].iter().all(|r| r.status == 200));
    let refused = &replies[30];
    assert_eq!(refused.status, 429, "{refused:?}");
    let ratelimit = refused.header("ratelimit").unwrap();
    assert!(ratelimit.contains("\"customer\";r=0;t="), "{ratelimit}");
    assert!(refused.number("retry-after") >= 1);
    assert_eq!(refused.number("x-ratelimit-customer-remaining"), 0);
    let body: serde_json::Value = serde_json::from_str(&refused.body).unwrap();
    assert_eq!(body["limit"], "customer");
    // The booking's token taken before the customer limit refused went back.
    assert_eq!(refused.number("x-ratelimit-entity-remaining"), 20);

    // E9: booking 7, 25 times: 20 through, 5 refused by the booking limit.
    let booking7 = format!("/bookings/e9-{run}-7");
    let replies: Vec<Reply> = (0..25).map(|_| get(&addr, &booking7, &b)).collect();
    assert_eq!(
        replies.iter().filter(|r| r.status == 200).count(),
        20,
        "{replies:?}"
    );
    for r in replies.iter().filter(|r| r.status == 429) {
        let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(body["limit"], "entity", "{r:?}");
    }
    // Then exactly 10 more of B's requests, whatever the booking.
    let replies: Vec<Reply> = (0..15)
        .map(|i| get(&addr, &format!("/bookings/e9-{run}-{i}-other"), &b))
        .collect();
    let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
    assert_eq!(
        statuses.iter().filter(|&&s| s == 200).count(),
        10,
        "{statuses:?}"
    );
    for r in replies.iter().filter(|r| r.status == 200) {
        assert_eq!(r.header("ratelimit-policy"), Some(POLICY), "{r:?}");
    }

    // The metrics name the customer limit: A's 10 refusals and B's 5.
    let metrics = live_demo::must(&addr, "GET", "/metrics");
    let denied = |layer: &str| {
        metrics
            .body
            .lines()
            .find(|l| {
                l.starts_with("tokenlease_http_denied_total{")
                    && l.contains(&format!("layer=\"{layer}\""))
                    && l.contains("route=\"/bookings/{bookingId}\"")
                    && l.contains("method=\"GET\"")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {layer} series in {}", metrics.body))
    };
    assert_eq!(denied("customer"), 15);
    assert_eq!(denied("entity"), 5);
}
