//! How the HTTP layer finds a request's policy route, and what it shows when it cannot: a
//! file route matches a router route of the same shape whatever its parameters are called; the
//! older `:id` syntax is refused when the policy loads; a request that fits a file route but
//! reached the layer under another pattern is counted and warned about once; every route's
//! series exists at zero from start-up. Through real axum routers, on a `MemoryStore` on tokio's
//! paused clock, which nothing here moves (the store plays no part in what is tested here).

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::connect_info::MockConnectInfo;
use axum::http::{Request, Response, StatusCode};
use axum::routing::get;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use parking_lot::Mutex;
use tower::ServiceExt;

use tokenlease::Limiter;
use tokenlease::http::{RateLimitLayer, RouteConfigError, RouteLimitLayer};
use tokenlease::metrics as m;
use tokenlease::policy::Policies;
use tokenlease::store::MemoryStore;

/// `GET /items/{id}`: 3 per endpoint, 1 per item.
const ITEMS: &str = r#"{
  "plans": {
    "items": { "capacity": 3, "refill_per_second": 1 },
    "item": { "capacity": 1, "refill_per_second": 0.01 }
  },
  "routes": [
    { "method": "GET", "path": "/items/{id}", "global": "items",
      "entity": { "path_param": "id", "plan": "item" } }
  ]
}"#;

fn limiter(policies: &Policies) -> Limiter {
    Limiter::builder(MemoryStore::new())
        .policies(policies.clone())
        .build()
}

async fn get_path(app: &Router, path: &str) -> Response<Body> {
    app.clone()
        .oneshot(Request::get(path).body(Body::empty()).unwrap())
        .await
        .expect("infallible")
}

fn header<'a>(r: &'a Response<Body>, name: &str) -> Option<&'a str> {
    r.headers().get(name).map(|v| v.to_str().unwrap())
}

/// A counter in a snapshot, by name and label pairs (in any order); `None` if it has no series.
fn counter(snapshotter: &Snapshotter, name: &str, labels: &[(&str, &str)]) -> Option<u64> {
    let mut want: Vec<(String, String)> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    want.sort();
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .find_map(|(key, _, _, value)| {
            let key = key.key();
            let mut have: Vec<(String, String)> = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            have.sort();
            match value {
                DebugValue::Counter(n) if key.name() == name && have == want => Some(n),
                _ => None,
            }
        })
}

/// Runs `body` on a current-thread runtime with a fresh debugging recorder and a subscriber
/// that keeps every `tracing` warning's message, both for this thread only.
fn observed<T>(body: impl AsyncFnOnce(&Snapshotter) -> T) -> (T, Vec<String>) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let warnings = Arc::new(Mutex::new(Vec::new()));
    let subscriber = Warnings(Arc::clone(&warnings));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let out = tracing::subscriber::with_default(subscriber, || {
        metrics::with_local_recorder(&recorder, || runtime.block_on(body(&snapshotter)))
    });
    let warnings = warnings.lock().clone();
    (out, warnings)
}

/// A `tracing` subscriber that keeps the message of every event at WARN or above.
struct Warnings(Arc<Mutex<Vec<String>>>);

impl tracing::Subscriber for Warnings {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        if *event.metadata().level() > tracing::Level::WARN {
            return;
        }
        struct Text(String);
        impl tracing::field::Visit for Text {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0.push_str(&format!("{}={value:?} ", field.name()));
            }
        }
        let mut text = Text(String::new());
        event.record(&mut text);
        self.0.lock().push(text.0);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// The file says `/items/{id}`, the router `/items/{itemId}`: same shape, so the file's limits
/// apply, keyed by the file's pattern, the entity found under the router's name by position.
#[tokio::test(start_paused = true)]
async fn a_file_route_limits_a_router_route_whose_parameters_are_named_otherwise() {
    let policies = Policies::from_json_str(ITEMS, None).unwrap();
    let limiter = limiter(&policies);
    let layer = RateLimitLayer::from_policies(&policies, limiter.clone())
        .unwrap()
        .x_ratelimit_remaining(true);
    let app = Router::new()
        .route("/items/{itemId}", get(|| async { "item" }))
        .route_layer(layer)
        .layer(MockConnectInfo(std::net::SocketAddr::from((
            [127, 0, 0, 1],
            1,
        ))));

    let r = get_path(&app, "/items/7").await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(header(&r, "x-ratelimit-entity-remaining"), Some("0"));
    assert_eq!(header(&r, "x-ratelimit-api-remaining"), Some("2"));
    // Item 7 again: its own limit denies (and its global token goes back).
    let r = get_path(&app, "/items/7").await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&r, "x-ratelimit-api-remaining"), Some("2"));
    // Another item is served.
    assert_eq!(get_path(&app, "/items/8").await.status(), StatusCode::OK);
    // HEAD is limited as the GET it runs: item 8 has spent its one token.
    let head = Request::head("/items/8").body(Body::empty()).unwrap();
    let r = app.clone().oneshot(head).await.unwrap();
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);

    // The buckets are the file's: its pattern, its endpoint.
    let store = limiter.store();
    for key in [
        "ratelimit:api:GET:/items/{id}",
        "ratelimit:entity:GET:/items/{id}:7",
        "ratelimit:entity:GET:/items/{id}:8",
    ] {
        assert!(store.inspect(key).await.unwrap().is_some(), "no row {key}");
    }
    assert!(
        store
            .inspect("ratelimit:api:GET:/items/{itemId}")
            .await
            .unwrap()
            .is_none()
    );
}

/// A file in axum 0.7's syntax would load, match nothing and limit nothing: it is refused,
/// naming the field and the spelling to use.
#[test]
fn the_older_colon_syntax_is_refused_when_the_policy_loads() {
    let json = ITEMS.replace("/items/{id}", "/items/:id");
    let err = Policies::from_json_str(&json, None).unwrap_err();
    let text = err.to_string();
    assert_eq!(err.field(), Some("routes[0].path"), "{text}");
    assert!(text.contains(r#"write it as "{id}""#), "{text}");
    let json = ITEMS.replace("/items/{id}", "/files/*rest");
    let text = Policies::from_json_str(&json, None)
        .unwrap_err()
        .to_string();
    assert!(text.contains(r#"write it as "{*rest}""#), "{text}");
}

/// The same for a layer built in code: a typed error naming the pattern, the segment and how
/// to write it, never a panic; an axum 0.8 pattern is taken.
#[test]
fn the_older_colon_syntax_is_refused_when_a_layer_is_built() {
    let policies = Policies::from_json_str(ITEMS, None).unwrap();
    let layer = || RouteLimitLayer::new(limiter(&policies));
    let err = layer().route_pattern("/items/:id").unwrap_err();
    let RouteConfigError::InvalidPattern { pattern, reason } = &err else {
        panic!("not an invalid pattern: {err:?}");
    };
    assert_eq!(pattern, "/items/:id");
    assert!(reason.contains(r#"write it as "{id}""#), "{reason}");
    let text = err.to_string();
    assert!(
        text.contains(r#""/items/:id" is not an axum 0.8 route pattern"#),
        "{text}"
    );
    let err = layer().route_pattern("/files/*rest").unwrap_err();
    assert!(
        err.to_string().contains(r#"write it as "{*rest}""#),
        "{err}"
    );
    assert!(layer().route_pattern("/items/{id}").is_ok());
}

/// The file names the inner router's pattern, but the layer sits on a router nested under
/// `/api`, where axum's matched pattern is the full `/api/items/{id}`: the route's limits do not
/// apply. Each such request is counted under the route; the first one is logged, once.
#[test]
fn requests_that_fit_a_route_but_miss_it_are_counted_and_warned_about_once() {
    let ((), warnings) =
        observed(async |snapshotter: &Snapshotter| {
            let policies = Policies::from_json_str(ITEMS, None).unwrap();
            let layer = RateLimitLayer::from_policies(&policies, limiter(&policies)).unwrap();
            let inner = Router::new()
                .route("/items/{id}", get(|| async { "item" }))
                .route("/health", get(|| async { "ok" }))
                .route_layer(layer);
            let app = Router::new().nest("/api", inner).layer(MockConnectInfo(
                std::net::SocketAddr::from(([127, 0, 0, 1], 1)),
            ));
            let labels = [("method", "GET"), ("route", "/items/{id}")];
            for _ in 0..5 {
                let r = get_path(&app, "/api/items/5").await;
                assert_eq!(r.status(), StatusCode::OK);
                assert_eq!(header(&r, "ratelimit-policy"), None);
            }
            assert_eq!(get_path(&app, "/api/health").await.status(), StatusCode::OK);
            assert_eq!(counter(snapshotter, m::HTTP_UNMATCHED, &labels), Some(5));
            assert_eq!(counter(snapshotter, m::HTTP_CHECKED, &labels), Some(0));
        });
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let w = &warnings[0];
    assert!(w.contains("/items/{id}"), "{w}");
    assert!(w.contains("/api/items/{id}"), "{w}");
    assert!(w.contains("passed unlimited"), "{w}");
}

/// Every series of a file's routes exists at zero once the layer is built, before any request;
/// a denial then counts under its layer, method and the route's pattern (never the path).
#[test]
fn every_route_series_exists_at_zero_from_the_start() {
    observed(async |snapshotter: &Snapshotter| {
        let policies = Policies::from_json_str(ITEMS, None).unwrap();
        let layer = RateLimitLayer::from_policies(&policies, limiter(&policies)).unwrap();
        let route = [("method", "GET"), ("route", "/items/{id}")];
        let with_layer = |layer: &'static str| {
            let mut l = route.to_vec();
            l.push(("layer", layer));
            l
        };
        // One snapshot: it takes every counter's value since the last.
        let snapshot = snapshotter.snapshot().into_vec();
        let names: Vec<String> = snapshot
            .iter()
            .map(|(k, _, _, _)| {
                let key = k.key();
                let mut labels: Vec<String> = key
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect();
                labels.sort();
                format!("{} {}", key.name(), labels.join(","))
            })
            .collect();
        for (name, layer) in [
            (m::HTTP_DENIED, Some("api")),
            (m::HTTP_DENIED, Some("entity")),
            (m::HTTP_ERRORS, Some("api")),
            (m::HTTP_ERRORS, Some("entity")),
            (m::HTTP_CHECKED, None),
            (m::HTTP_UNMATCHED, None),
        ] {
            let mut labels: Vec<String> = route.iter().map(|(k, v)| format!("{k}={v}")).collect();
            if let Some(layer) = layer {
                labels.push(format!("layer={layer}"));
            }
            labels.sort();
            let want = format!("{name} {}", labels.join(","));
            assert!(names.contains(&want), "{want} missing from {names:?}");
        }

        let app = Router::new()
            .route("/items/{id}", get(|| async { "item" }))
            .route_layer(layer)
            .layer(MockConnectInfo(std::net::SocketAddr::from((
                [127, 0, 0, 1],
                1,
            ))));
        assert_eq!(get_path(&app, "/items/1").await.status(), StatusCode::OK);
        let r = get_path(&app, "/items/1").await;
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        let seen = snapshotter.snapshot().into_vec();
        let value = |name: &str, labels: &[(&str, &str)]| {
            let mut want: Vec<(String, String)> = labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            want.sort();
            seen.iter().find_map(|(k, _, _, v)| {
                let key = k.key();
                let mut have: Vec<(String, String)> = key
                    .labels()
                    .map(|l| (l.key().to_owned(), l.value().to_owned()))
                    .collect();
                have.sort();
                match v {
                    DebugValue::Counter(n) if key.name() == name && have == want => Some(*n),
                    _ => None,
                }
            })
        };
        assert_eq!(value(m::HTTP_DENIED, &with_layer("entity")), Some(1));
        assert_eq!(value(m::HTTP_DENIED, &with_layer("api")), Some(0));
        assert_eq!(value(m::HTTP_CHECKED, &route), Some(2));
    });
}

/// S8: a route's layer in shadow mode (the demo's `GET /bookings`, `"shadow": "entity"`) refuses
/// nothing, so its plan's decisions count as `outcome="would_deny"`, never as `denied`: the
/// series exist at zero from the layer's build (the dashboard's "by plan" table and the
/// Grafana panel read them), and the requests it let through count there.
#[test]
fn s8_a_shadow_route_layers_refusals_count_as_would_deny_not_denied() {
    observed(async |snapshotter: &Snapshotter| {
        let file = ITEMS.replace(
            r#""plan": "item" } }"#,
            r#""plan": "item" }, "shadow": "entity" }"#,
        );
        let policies = Policies::from_json_str(&file, None).unwrap();
        assert!(policies.routes()[0].shadow.entity, "{file}");
        let layer = RateLimitLayer::from_policies(&policies, limiter(&policies)).unwrap();
        let decisions = |outcome: &str| {
            counter(
                snapshotter,
                m::DECISIONS,
                &[
                    ("plan", "item"),
                    ("outcome", outcome),
                    ("decided_by", "store"),
                ],
            )
        };
        assert_eq!(decisions("would_deny"), Some(0), "registered at zero");
        let app = Router::new()
            .route("/items/{id}", get(|| async { "item" }))
            .route_layer(layer);
        for i in 0..3 {
            let r = get_path(&app, "/items/1").await;
            assert_eq!(r.status(), StatusCode::OK, "request {i}");
        }
        let seen = |outcome: &str| {
            let mut want = vec![
                ("plan".to_owned(), "item".to_owned()),
                ("outcome".to_owned(), outcome.to_owned()),
                ("decided_by".to_owned(), "store".to_owned()),
            ];
            want.sort();
            want
        };
        let snapshot = snapshotter.snapshot().into_vec();
        let value = |outcome: &str| {
            snapshot.iter().find_map(|(k, _, _, v)| {
                let key = k.key();
                let mut have: Vec<(String, String)> = key
                    .labels()
                    .map(|l| (l.key().to_owned(), l.value().to_owned()))
                    .collect();
                have.sort();
                match v {
                    DebugValue::Counter(n)
                        if key.name() == m::DECISIONS && have == seen(outcome) =>
                    {
                        Some(*n)
                    }
                    _ => None,
                }
            })
        };
        assert_eq!(value("allowed"), Some(1));
        assert_eq!(value("would_deny"), Some(2), "the two it let through");
        assert_eq!(value("denied").unwrap_or(0), 0, "nothing was refused");
        assert_eq!(
            value("would_deny").unwrap_or(0) + value("allowed").unwrap_or(0),
            3
        );
    });
}
