//! A route's limits in one layer, and what they cost (E10, E11, P8): two stacked layers add their
//! header fields to each other's and the outer one gives back what it took when the inner one
//! refuses; a refused key hammered for 5 s on the real PostgreSQL costs the database next to
//! nothing and admits no more than its bucket; a plan of several limits shows each limit with
//! its window; a route of five limits reports each and gives back on the last one's refusal.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use axum::Router;
use axum::body::Body;
use axum::http::{HeaderName, Request, Response, StatusCode};
use axum::routing::get;
use tower::ServiceExt;

use tokenlease::Limiter;
use tokenlease::bucket::{BucketConfig, Rate, Tokens};
use tokenlease::http::{EntityKey, RateLimitLayer, RouteLimitLayer};
use tokenlease::policy::{LeaseSettings, Plan, Policies};
use tokenlease::store::{
    AcquireRequest, Acquired, BucketRow, GiveBack, MemoryStore, Store, StoreError,
};

const BOOKING: &str = "/bookings/{bookingId}";

fn plan(name: &str, capacity: u64, per_second: f64) -> Arc<Plan> {
    Arc::new(Plan::new(
        name,
        BucketConfig::new(Tokens::whole(capacity), Rate::from_f64(per_second).unwrap()).unwrap(),
    ))
}

fn call(path: &str, customer: &str) -> Request<Body> {
    Request::get(path)
        .header("x-customer-id", customer)
        .body(Body::empty())
        .unwrap()
}

async fn send(app: &Router, req: Request<Body>) -> Response<Body> {
    app.clone().oneshot(req).await.expect("infallible")
}

fn header<'a>(r: &'a Response<Body>, name: &str) -> Option<&'a str> {
    r.headers().get(name).map(|v| v.to_str().unwrap())
}

async fn body_json(r: Response<Body>) -> serde_json::Value {
    let bytes = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

/// E10: a layer per booking (route 100, booking 2) inside a layer per customer (a budget of
/// 5, leased): every answer carries the three limits in `RateLimit-Policy` (the inner layer's
/// first), the inner layer's refusal keeps its `Retry-After` and names the booking limit, and
/// the customer's token taken for it goes back, so the customer still gets exactly 3 more.
#[tokio::test(start_paused = true)]
async fn e10_stacked_layers_add_their_fields_and_give_back_on_an_inner_refusal() {
    let limiter = Limiter::builder(MemoryStore::new()).build();
    let per_booking = RouteLimitLayer::new(limiter.clone())
        .global(plan("route", 100, 50.0))
        .entity(
            EntityKey::path_param("bookingId"),
            plan("booking", 2, 1.0 / 30.0),
        );
    let customer_plan = Arc::new(
        (*plan("customer", 5, 0.001))
            .clone()
            .with_lease(LeaseSettings::default()),
    );
    let per_customer = RouteLimitLayer::new(limiter.clone())
        .entity_budget(
            "customer",
            EntityKey::header(HeaderName::from_static("x-customer-id")),
            customer_plan,
        )
        .unwrap();
    let app = Router::new()
        .route(
            BOOKING,
            get(|| async { "booking" }).route_layer(per_booking),
        )
        .route_layer(per_customer);

    let policy = "\"api\";q=100;w=2, \"entity\";q=2;w=60, \"customer\";q=5;w=5000";
    for i in 0..2 {
        let r = send(&app, call("/bookings/7", "B")).await;
        assert_eq!(r.status(), StatusCode::OK, "request {i}");
        assert_eq!(header(&r, "ratelimit-policy"), Some(policy));
        let ratelimit = header(&r, "ratelimit").unwrap();
        for name in ["api", "entity", "customer"] {
            assert!(ratelimit.contains(&format!("\"{name}\";r=")), "{ratelimit}");
        }
    }
    // Booking 7 is spent: the inner layer refuses, with its own Retry-After and fields.
    let r = send(&app, call("/bookings/7", "B")).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&r, "retry-after"), Some("30"));
    assert_eq!(header(&r, "ratelimit-policy"), Some(policy));
    let ratelimit = header(&r, "ratelimit").unwrap().to_owned();
    assert!(ratelimit.contains("\"entity\";r=0;t=30"), "{ratelimit}");
    assert!(ratelimit.contains("\"customer\";r="), "{ratelimit}");
    assert_eq!(body_json(r).await["limit"], "entity");
    // The customer's token for the refused request went back: 3 more, then the budget refuses.
    for i in 0..3 {
        let r = send(&app, call(&format!("/bookings/{}", 10 + i), "B")).await;
        assert_eq!(r.status(), StatusCode::OK, "booking {}", 10 + i);
    }
    let r = send(&app, call("/bookings/20", "B")).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        header(&r, "ratelimit-policy"),
        Some("\"customer\";q=5;w=5000")
    );
    assert_eq!(body_json(r).await["limit"], "customer");
}

/// Counts every call to the store (each is one statement).
#[derive(Debug)]
struct Calls<S> {
    inner: S,
    calls: Arc<AtomicU64>,
}

#[async_trait]
impl<S: Store> Store for Calls<S> {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.acquire(request).await
    }
    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.acquire_many(requests).await
    }
    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.give_back(returns).await
    }
    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.delete_idle(limit).await
    }
    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        self.inner.inspect(key).await
    }
    fn call_timeout(&self) -> Option<Duration> {
        self.inner.call_timeout()
    }
    fn partition(&self, key: &str) -> usize {
        self.inner.partition(key)
    }
    fn max_concurrent_calls(&self) -> Option<usize> {
        self.inner.max_concurrent_calls()
    }
}

/// The demo's booking route: the route (leased), the booking (20 a minute, leased or direct),
/// the customer's budget (30 a minute).
fn booking_policy(booking_lease: bool) -> Policies {
    let lease = if booking_lease {
        r#", "lease": {}"#
    } else {
        ""
    };
    Policies::from_json_str(
        &format!(
            r#"{{
  "plans": {{
    "bookings-read": {{ "capacity": 100, "refill_per_second": 50, "lease": {{}} }},
    "booking-read": {{ "capacity": 20, "refill": {{ "tokens": 20, "period_ms": 60000 }}{lease} }},
    "per-customer": {{ "capacity": 30, "refill": {{ "tokens": 30, "period_ms": 60000 }} }}
  }},
  "budgets": {{ "customer": {{ "header": "X-Customer-Id", "plan": "per-customer" }} }},
  "routes": [ {{ "method": "GET", "path": "/bookings/{{bookingId}}", "limits": [
    {{ "name": "api", "plan": "bookings-read" }},
    {{ "name": "entity", "path_param": "bookingId", "plan": "booking-read" }},
    {{ "budget": "customer" }} ] }} ]
}}"#
        ),
        None,
    )
    .unwrap()
}

/// E11: one booking refused, then hammered for 5 s through the layer on the real PostgreSQL:
/// at most 0.01 statements per refused request (the refused key is answered from memory until
/// its `retry_after`, the route's token goes back into its lease), and the booking admits no
/// more than its bucket's envelope. Direct-mode and leased booking plans alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e11_a_refused_key_hammered_for_five_seconds_costs_the_database_nothing() {
    let db = crate::common::database().await;
    for booking_lease in [false, true] {
        let calls = Arc::new(AtomicU64::new(0));
        let store = Calls {
            inner: crate::common::store(&db, 4).await,
            calls: Arc::clone(&calls),
        };
        let policies = booking_policy(booking_lease);
        let limiter = Limiter::builder(store).policies(policies.clone()).build();
        let app = Router::new()
            .route(BOOKING, get(|| async { "booking" }))
            .route_layer(RateLimitLayer::from_policies(&policies, limiter.clone()).unwrap());
        let booking = format!("/bookings/hammered-{booking_lease}");
        let start = Instant::now();
        // Spend the booking's burst until it refuses (a lease may refuse a little early: its
        // refill is not waited for past its `max_wait`).
        let mut admitted = 0u64;
        loop {
            let r = send(&app, call(&booking, "C")).await;
            match r.status() {
                StatusCode::OK => admitted += 1,
                StatusCode::TOO_MANY_REQUESTS => break,
                other => panic!("unexpected {other}"),
            }
            assert!(admitted <= 21, "the booking admitted {admitted} at once");
        }
        assert!(admitted >= 10, "the booking refused after {admitted}");
        let before = calls.load(Ordering::Relaxed);
        let hammer = Instant::now();
        let (mut refused, mut ok) = (0u64, 0u64);
        while hammer.elapsed() < Duration::from_secs(5) {
            match send(&app, call(&booking, "C")).await.status() {
                StatusCode::OK => ok += 1,
                StatusCode::TOO_MANY_REQUESTS => refused += 1,
                other => panic!("unexpected {other}"),
            }
        }
        let statements = calls.load(Ordering::Relaxed) - before;
        let elapsed = start.elapsed().as_secs_f64();
        let per_refused = statements as f64 / refused as f64;
        eprintln!(
            "booking lease {booking_lease}: {refused} refused, {ok} admitted in 5 s, \
             {statements} statements ({per_refused:.5} per refused request)"
        );
        assert!(
            per_refused <= 0.01,
            "{statements} statements for {refused} refused requests"
        );
        // The envelope: 20 at once, then 20 a minute, over the whole run.
        let envelope = 20.0 + 20.0 / 60.0 * elapsed;
        assert!(
            (admitted + ok) as f64 <= envelope + 1e-9,
            "booking admitted {} in {elapsed:.2} s, envelope {envelope:.2}",
            admitted + ok
        );
        limiter.shutdown().await;
    }
}

/// A limiter over a `MemoryStore` with the policies of file `json`, and its layer.
fn from_file(json: &str) -> (Limiter, RateLimitLayer) {
    let policies = Policies::from_json_str(json, None).unwrap();
    let limiter = Limiter::builder(MemoryStore::new())
        .policies(policies.clone())
        .build();
    let layer = RateLimitLayer::from_policies(&policies, limiter.clone()).unwrap();
    (limiter, layer)
}

/// A route whose global limit is a plan of several limits, beside an entity limit of one.
const SEVERAL: &str = r#"{
  "plans": {
    "search": { "limits": [
      { "capacity": 20, "refill": { "tokens": 20, "period_ms": 3600000 } },
      { "capacity": 5, "refill_per_second": 5 }
    ] },
    "query": { "capacity": 100, "refill_per_second": 100 }
  },
  "routes": [
    { "method": "GET", "path": "/search/{q}", "global": "search",
      "entity": { "path_param": "q", "plan": "query" } }
  ]
}"#;

/// P8: over HTTP, a route whose global plan is 5 a second (burst 5) and 20 an hour (the policy
/// file's `limits`, the hour written first): every answer's `RateLimit-Policy` lists each limit
/// with its own window (`"api";q=5;w=1, "api-2";q=20;w=3600`, then the entity's), allowed or
/// refused; a refusal's `Retry-After` and `RateLimit` `t` are the binding limit's: 1 s while
/// the second's binds, about 180 s once the hour's 20 are spent; the admission that spent them
/// reports `t` as the time until every limit is full again (about 3,600 s).
#[tokio::test(start_paused = true)]
async fn p8_ratelimit_policy_lists_each_limit_of_a_plan_with_its_window() {
    let (limiter, layer) = from_file(SEVERAL);
    let app = Router::new()
        .route("/search/{q}", get(|| async { "found" }))
        .route_layer(layer);
    let policy = "\"api\";q=5;w=1, \"api-2\";q=20;w=3600, \"entity\";q=100;w=1";
    let get_one = |i: u32| {
        Request::get(format!("/search/{i}"))
            .body(Body::empty())
            .unwrap()
    };

    for i in 0..5 {
        let r = send(&app, get_one(i)).await;
        assert_eq!(r.status(), StatusCode::OK, "request {i}");
        assert_eq!(header(&r, "ratelimit-policy"), Some(policy));
    }
    // The second's burst is spent: refused for a second, the policy unchanged.
    let r = send(&app, get_one(5)).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&r, "ratelimit-policy"), Some(policy));
    assert_eq!(header(&r, "retry-after"), Some("1"));
    let ratelimit = header(&r, "ratelimit").unwrap().to_owned();
    assert!(ratelimit.contains("\"api\";r=0;t=1"), "{ratelimit}");
    assert_eq!(body_json(r).await["limit"], "api");
    // Three more seconds give 15 more: the hour's 20 are spent.
    let mut admitted = 5;
    let mut last_allowed = String::new();
    for second in 0..3 {
        tokio::time::advance(Duration::from_secs(1)).await;
        for i in 0..6 {
            let r = send(&app, get_one(100 * second + i)).await;
            assert_eq!(header(&r, "ratelimit-policy"), Some(policy));
            if r.status() == StatusCode::OK {
                admitted += 1;
                last_allowed = header(&r, "ratelimit").unwrap().to_owned();
            }
        }
    }
    assert_eq!(admitted, 20);
    // The last admission spent the hour's 20: its `t` is the time until every limit is full
    // again (3,600 s less the 3 s gone), not the second's limit's one second.
    let t: u64 = last_allowed
        .split("\"api\";r=0;t=")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("the api item of {last_allowed}"));
    assert!((3_590..=3_600).contains(&t), "{last_allowed}");
    tokio::time::advance(Duration::from_secs(1)).await;
    let r = send(&app, get_one(999)).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&r, "ratelimit-policy"), Some(policy));
    // A token of 20 an hour every 180 s, 4 s of it gone.
    let retry: u64 = header(&r, "retry-after").unwrap().parse().unwrap();
    assert!((170..=180).contains(&retry), "Retry-After {retry}");
    let ratelimit = header(&r, "ratelimit").unwrap().to_owned();
    assert!(
        ratelimit.contains(&format!("\"api\";r=0;t={retry}")),
        "{ratelimit}"
    );
    limiter.shutdown().await;
}

/// A route of five limits, more than a request keeps inline (three): the route, the booking,
/// the customer's budget, the region's (header) and the client's (address), all leased but the
/// last, which allows 2.
const FIVE: &str = r#"{
  "plans": {
    "route": { "capacity": 100, "refill_per_second": 50, "lease": {} },
    "booking": { "capacity": 100, "refill_per_second": 50, "lease": {} },
    "customer": { "capacity": 100, "refill_per_second": 50, "lease": {} },
    "region": { "capacity": 100, "refill_per_second": 50, "lease": {} },
    "client": { "capacity": 2, "refill": { "tokens": 2, "period_ms": 60000 } }
  },
  "budgets": { "customer": { "header": "X-Customer-Id", "plan": "customer" } },
  "routes": [ { "method": "GET", "path": "/bookings/{bookingId}", "limits": [
    { "name": "api", "plan": "route" },
    { "name": "entity", "path_param": "bookingId", "plan": "booking" },
    { "budget": "customer" },
    { "name": "region", "header": "X-Region", "plan": "region" },
    { "name": "client", "client_ip": true, "plan": "client" } ] } ]
}"#;

/// A route of more limits than a request keeps inline: every answer lists all five in
/// `RateLimit-Policy` and `RateLimit`, in the file's order, and when the fifth refuses, the four
/// before it give their tokens back, so each of their buckets is charged only the admitted
/// requests.
#[tokio::test(start_paused = true)]
async fn a_route_of_five_limits_reports_each_and_gives_back_on_the_last_ones_refusal() {
    let (limiter, layer) = from_file(FIVE);
    let app = Router::new()
        .route(BOOKING, get(|| async { "booking" }))
        .route_layer(layer)
        .into_service::<Body>();
    let names = ["api", "entity", "customer", "region", "client"];
    let request = || {
        let mut req = Request::get("/bookings/7")
            .header("x-customer-id", "C")
            .header("x-region", "eu")
            .body(Body::empty())
            .unwrap();
        req.extensions_mut()
            .insert(axum::extract::ConnectInfo(std::net::SocketAddr::from((
                [192, 0, 2, 1],
                4000,
            ))));
        req
    };
    let send = |req| {
        let app = app.clone();
        async move { app.oneshot(req).await.expect("infallible") }
    };
    for i in 0..2 {
        let r = send(request()).await;
        assert_eq!(r.status(), StatusCode::OK, "request {i}");
        let policy = header(&r, "ratelimit-policy").unwrap();
        let ratelimit = header(&r, "ratelimit").unwrap();
        let (mut in_policy, mut in_ratelimit) = (0, 0);
        for name in names {
            let at = policy.find(&format!("\"{name}\";q=")).expect(policy);
            assert!(at >= in_policy, "{policy}: in order");
            in_policy = at;
            let at = ratelimit.find(&format!("\"{name}\";r=")).expect(ratelimit);
            assert!(at >= in_ratelimit, "{ratelimit}: in order");
            in_ratelimit = at;
        }
    }
    // The client's 2 are spent: three refusals, each by the fifth limit, each giving back the
    // four tokens the limits before it took.
    for i in 0..3 {
        let r = send(request()).await;
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS, "refusal {i}");
        assert_eq!(body_json(r).await["limit"], "client");
    }
    // Each of the four leased limits was charged the two admissions only: its `RateLimit`
    // item on the next admitted request (a new client) reports 97 of 100 left (the two, and
    // this one), where the refusals' tokens kept would leave 94.
    let mut req = request();
    req.extensions_mut()
        .insert(axum::extract::ConnectInfo(std::net::SocketAddr::from((
            [192, 0, 2, 2],
            4000,
        ))));
    let r = send(req).await;
    assert_eq!(r.status(), StatusCode::OK);
    let ratelimit = header(&r, "ratelimit").unwrap();
    for name in ["api", "entity", "customer", "region"] {
        assert!(
            ratelimit.contains(&format!("\"{name}\";r=97;")),
            "{name}: {ratelimit}"
        );
    }
    limiter.shutdown().await;
}
