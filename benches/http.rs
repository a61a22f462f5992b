//! The HTTP layer per request, beside `tower_governor`: an axum 0.8 route driven in process
//! (`Router::oneshot` on a current-thread runtime), with
//!
//! - `bare`: the route alone;
//! - `governor_1_limit`: `tower_governor`'s `GovernorLayer`, one limit keyed by the booking id
//!   (the path's last segment), on a quota too large to deny;
//! - `tokenlease_2_limits`: `RateLimitLayer` from a policy file, two limits (the route, the
//!   booking by path parameter), leased plans with the default lease settings, over a
//!   `MemoryStore`, on buckets too large to deny;
//!
//! each at 1 booking id and at 10,000 ids round-robin. What a layer costs is its figure less
//! `bare`'s, at the same id count, from the same run.
//!
//! `cargo bench --bench http` (about a minute once built).

use std::hint::black_box;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::get;
use criterion::Criterion;
use tokenlease::Limiter;
use tokenlease::http::RateLimitLayer;
use tokenlease::policy::Policies;
use tokenlease::store::MemoryStore;
use tower::ServiceExt;
use tower_governor::GovernorLayer;
use tower_governor::errors::GovernorError;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::KeyExtractor;

/// Two leased limits with the default lease settings, on buckets that never run dry here.
const POLICY: &str = r#"{
  "plans": {
    "route": { "capacity": 8000000000, "refill_per_second": 1000000000, "lease": {} },
    "booking": { "capacity": 8000000000, "refill_per_second": 1000000000, "lease": {} }
  },
  "routes": [ { "method": "GET", "path": "/bookings/{bookingId}", "limits": [
    { "name": "route", "plan": "route" },
    { "name": "booking", "path_param": "bookingId", "plan": "booking" } ] } ]
}"#;

/// `tower_governor`'s key: the booking id, the path's last segment.
#[derive(Clone, Copy, Debug)]
struct BookingId;

impl KeyExtractor for BookingId {
    type Key = String;

    fn extract<T>(&self, req: &Request<T>) -> Result<String, GovernorError> {
        req.uri()
            .path()
            .rsplit('/')
            .next()
            .map(str::to_owned)
            .ok_or(GovernorError::UnableToExtractKey)
    }
}

fn route() -> Router {
    Router::new().route("/bookings/{bookingId}", get(|| async { "booking" }))
}

fn governor() -> Router {
    let config = GovernorConfigBuilder::default()
        .per_nanosecond(1)
        .burst_size(u32::MAX)
        .key_extractor(BookingId)
        .finish()
        .expect("a governor config");
    route().route_layer(GovernorLayer::new(config))
}

fn tokenlease() -> (Router, Limiter) {
    let policies = Policies::from_json_str(POLICY, None).expect("the bench policy");
    let limiter = Limiter::builder(MemoryStore::new())
        .policies(policies.clone())
        .build();
    let layer = RateLimitLayer::from_policies(&policies, limiter.clone()).expect("the layer");
    (route().route_layer(layer), limiter)
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let (ours, _limiter) = runtime.block_on(async { tokenlease() });
    let apps = [("bare", route()), ("governor_1_limit", governor()), ("tokenlease_2_limits", ours)];
    let mut group = c.benchmark_group("http");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for ids in [1usize, 10_000] {
        let paths: Vec<String> = (0..ids).map(|i| format!("/bookings/{i}")).collect();
        for (name, app) in &apps {
            // Every id once before timing: the keys exist, their leases are live.
            runtime.block_on(async {
                for _ in 0..3 {
                    for p in &paths {
                        let r = app
                            .clone()
                            .oneshot(Request::get(p.as_str()).body(Body::empty()).unwrap())
                            .await
                            .unwrap();
                        assert_eq!(r.status(), StatusCode::OK, "{name} {p}");
                    }
                }
            });
            let mut i = 0usize;
            group.bench_function(format!("{name}/{ids}_ids"), |b| {
                b.iter(|| {
                    i = (i + 1) % ids;
                    let req = Request::get(paths[i].as_str()).body(Body::empty()).unwrap();
                    let r = runtime.block_on(app.clone().oneshot(req)).unwrap();
                    black_box(r.status())
                });
            });
        }
    }
    group.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
