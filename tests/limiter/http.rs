//! The HTTP layer in process (E1, E2, E3): `tower::ServiceExt::oneshot` on an axum
//! `Router`, the peer address from `MockConnectInfo`.
//!
//! Most tests run on a `MemoryStore` on tokio's paused clock, so every figure is exact; E1 also
//! runs on the real PostgreSQL in real time. A counting wrapper around the store measures what
//! each key really spent: tokens granted minus tokens given back.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use axum::Router;
use axum::body::Body;
use axum::extract::connect_info::MockConnectInfo;
use axum::http::{HeaderMap, HeaderName, Request, Response, StatusCode};
use axum::routing::{get, post};
use parking_lot::Mutex;
use tower::ServiceExt;

use tokenlease::Limiter;
use tokenlease::bucket::{BucketConfig, Rate, Tokens};
use tokenlease::http::{
    EntityKey, RateLimitLayer, RouteConfigError, RouteLimitLayer, TrustedProxies, client_ip,
};
use tokenlease::policy::{FallbackMode, FallbackSettings, FieldsOn, LeaseSettings, Plan, Policies};
use tokenlease::store::{
    AcquireRequest, Acquired, BucketRow, GiveBack, MemoryStore, PostgresStore, Store, StoreError,
};
use tokenlease_testkit::TestDatabase;

const BOOKING: &str = "/bookings/{bookingId}";
const GLOBAL_KEY: &str = "ratelimit:api:GET:/bookings/{bookingId}";

/// What a [`Counting`] store saw, per key.
#[derive(Debug, Default)]
struct Tally {
    granted: Mutex<HashMap<String, Tokens>>,
    returned: Mutex<HashMap<String, Tokens>>,
    /// Give-backs the store failed (a row lock waited past `lock_timeout`, say): the limiter
    /// drops them, and their tokens count as spent (it under-admits, never over-admits).
    refused: Mutex<HashMap<String, Tokens>>,
    calls: Mutex<Vec<String>>,
}

impl Tally {
    /// Tokens `key` spent: granted minus given back.
    fn spent(&self, key: &str) -> f64 {
        let g = self
            .granted
            .lock()
            .get(key)
            .copied()
            .unwrap_or(Tokens::ZERO);
        let r = self
            .returned
            .lock()
            .get(key)
            .copied()
            .unwrap_or(Tokens::ZERO);
        g.as_f64() - r.as_f64()
    }

    /// Tokens of `key`'s give-backs that the store failed.
    fn refused(&self, key: &str) -> f64 {
        self.refused
            .lock()
            .get(key)
            .copied()
            .unwrap_or(Tokens::ZERO)
            .as_f64()
    }

    fn calls_to(&self, key: &str) -> usize {
        self.calls.lock().iter().filter(|k| *k == key).count()
    }

    fn granted(&self, key: &str, amount: Tokens) {
        self.calls.lock().push(key.to_owned());
        let mut g = self.granted.lock();
        let e = g.entry(key.to_owned()).or_insert(Tokens::ZERO);
        *e = e.saturating_add(amount);
    }
}

/// Wraps a store and counts, per key, tokens granted and tokens credited back.
#[derive(Debug)]
struct Counting<S> {
    inner: S,
    tally: Arc<Tally>,
}

fn counting<S: Store>(inner: S) -> (Counting<S>, Arc<Tally>) {
    let tally = Arc::new(Tally::default());
    (
        Counting {
            inner,
            tally: Arc::clone(&tally),
        },
        tally,
    )
}

#[async_trait]
impl<S: Store> Store for Counting<S> {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        let out = self.inner.acquire(request).await?;
        self.tally.granted(request.key, out.granted);
        Ok(out)
    }

    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        let out = self.inner.acquire_many(requests).await?;
        for (req, acq) in requests.iter().zip(&out) {
            self.tally.granted(req.key, acq.granted);
        }
        Ok(out)
    }

    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        // The layer sends what queued up while its last statement ran as one: a batch is
        // counted returned only when every one of it was credited.
        let n = match self.inner.give_back(returns).await {
            Ok(n) => n,
            Err(e) => {
                let mut r = self.tally.refused.lock();
                for give in returns {
                    let t = r.entry(give.key.to_owned()).or_insert(Tokens::ZERO);
                    *t = t.saturating_add(give.amount);
                }
                return Err(e);
            }
        };
        if n == returns.len() as u64 {
            let mut r = self.tally.returned.lock();
            for give in returns {
                let e = r.entry(give.key.to_owned()).or_insert(Tokens::ZERO);
                *e = e.saturating_add(give.amount);
            }
        }
        Ok(n)
    }

    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        self.inner.delete_idle(limit).await
    }

    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        self.inner.inspect(key).await
    }
}

/// A store that is always down.
#[derive(Debug)]
struct Down;

#[async_trait]
impl Store for Down {
    async fn acquire(&self, _: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        Err(StoreError::Protocol("down".into()))
    }
    async fn give_back(&self, _: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        Err(StoreError::Protocol("down".into()))
    }
    async fn delete_idle(&self, _: u32) -> Result<u64, StoreError> {
        Err(StoreError::Protocol("down".into()))
    }
    async fn inspect(&self, _: &str) -> Result<Option<BucketRow>, StoreError> {
        Err(StoreError::Protocol("down".into()))
    }
}

fn plan(name: &str, capacity: u64, per_second: f64) -> Arc<Plan> {
    Arc::new(Plan::new(
        name,
        BucketConfig::new(Tokens::whole(capacity), Rate::from_f64(per_second).unwrap()).unwrap(),
    ))
}

fn peer(s: &str) -> SocketAddr {
    SocketAddr::new(s.parse().unwrap(), 40000)
}

/// `GET /bookings/{bookingId}` with a global and an entity (path parameter) limit, and
/// `GET /bookings` with only the global limit of its own.
fn booking_app(limiter: &Limiter, global: Arc<Plan>, entity: Arc<Plan>) -> Router {
    Router::new()
        .route(
            BOOKING,
            get(|| async { "booking" }).route_layer(
                RouteLimitLayer::new(limiter.clone())
                    .global(global.clone())
                    .entity(EntityKey::path_param("bookingId"), entity)
                    .x_ratelimit_remaining(true),
            ),
        )
        .route(
            "/bookings",
            get(|| async { "list" }).route_layer(
                RouteLimitLayer::new(limiter.clone())
                    .global(global)
                    .x_ratelimit_remaining(true),
            ),
        )
        .layer(MockConnectInfo(peer("127.0.0.1")))
}

async fn send(app: &Router, req: Request<Body>) -> Response<Body> {
    app.clone().oneshot(req).await.expect("infallible")
}

async fn get_path(app: &Router, path: &str) -> Response<Body> {
    send(app, Request::get(path).body(Body::empty()).unwrap()).await
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).map(|v| v.to_str().unwrap())
}

async fn body_json(resp: Response<Body>) -> serde_json::Value {
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 16)
        .await
        .unwrap();
    serde_json::from_slice(&bytes).expect("a JSON body")
}

/// E1 on one entity flooding, with time moved by hand: X's 1,000 requests over 1 s get at
/// most 10 + 5·1 OK, the global bucket pays only for those, and other entities then pass.
#[tokio::test(start_paused = true)]
async fn e1_entity_flood_spends_no_global_tokens_beyond_its_own_successes_memory() {
    let (store, store_tally) = counting(MemoryStore::new());
    let limiter = Limiter::builder(store).build();
    let app = booking_app(&limiter, plan("g", 100, 50.0), plan("e", 10, 5.0));

    let mut ok = 0;
    for _ in 0..1000 {
        let r = get_path(&app, "/bookings/X").await;
        match r.status() {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("unexpected status {other}"),
        }
        tokio::time::advance(Duration::from_millis(1)).await; // 1,000 requests in 1 s
    }
    assert!((10..=15).contains(&ok), "X got {ok} OK");
    let spent = store_tally.spent(GLOBAL_KEY);
    assert!(spent <= 15.0, "X spent {spent} global tokens");
    assert_eq!(spent, ok as f64, "global pays exactly for X's successes");

    // The endpoint is untouched for everyone else: 50 other bookings in a row, no time passing.
    for i in 0..50 {
        let r = get_path(&app, &format!("/bookings/Y{i}")).await;
        assert_eq!(r.status(), StatusCode::OK, "booking Y{i}");
    }
    // And one other booking gets its whole burst.
    for i in 0..10 {
        let r = get_path(&app, "/bookings/Y").await;
        assert_eq!(r.status(), StatusCode::OK, "request {i} of booking Y");
    }
}

/// E1 on the real PostgreSQL in real time: the same figures, with the envelope stretched to the
/// time the flood really took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e1_entity_flood_spends_no_global_tokens_beyond_its_own_successes_postgres() {
    let db = TestDatabase::create().await.expect("a test database");
    let pg = PostgresStore::builder(&db.connection_string())
        .unwrap()
        .call_timeout(Duration::from_secs(5))
        .pool_wait_timeout(Duration::from_secs(5))
        // The hot endpoint row's lock: a starved machine made the default 100 ms wait fail
        // 100 of the flood's refunds once.
        .lock_timeout(Duration::from_secs(5))
        .synchronous_commit(false)
        .build()
        .await
        .unwrap();
    let (store, store_tally) = counting(pg);
    let limiter = Limiter::builder(store).build();
    let app = booking_app(&limiter, plan("g", 100, 50.0), plan("e", 10, 5.0));

    // 1,000 requests arriving 1 ms apart, each on its own task (arrivals do not wait for
    // answers, as with real clients).
    let start = Instant::now();
    let tick = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(1000);
    for i in 0..1000u64 {
        // sleep: pacing, the requests arrive 1 ms apart.
        tokio::time::sleep_until(tick + Duration::from_millis(i)).await;
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            get_path(&app, "/bookings/X").await.status()
        }));
    }
    let mut ok = 0;
    for t in tasks {
        match t.await.unwrap() {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("unexpected status {other}"),
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let envelope = 10.0 + 5.0 * elapsed;
    eprintln!("X: {ok} OK of 1000 in {elapsed:.2} s (envelope {envelope:.1})");
    assert!(
        ok as f64 <= envelope + 1.0,
        "X got {ok} OK in {elapsed:.2} s"
    );
    if elapsed <= 1.2 {
        assert!(ok <= 16, "X got {ok} OK in {elapsed:.2} s");
    }
    // Global pays exactly for X's successes, and for any refund the store failed (none with
    // these timeouts unless the machine stalls for seconds; the limiter's contract drops them).
    let (spent, refused) = (
        store_tally.spent(GLOBAL_KEY),
        store_tally.refused(GLOBAL_KEY),
    );
    assert_eq!(
        spent,
        ok as f64 + refused,
        "global pays for X's successes and the failed refunds ({refused})"
    );
    let row = limiter.store().inspect(GLOBAL_KEY).await.unwrap().unwrap();
    assert!(
        row.tokens_now.as_f64() >= 100.0 - envelope - 1.0,
        "global bucket holds {}",
        row.tokens_now
    );

    for i in 0..50 {
        let r = get_path(&app, &format!("/bookings/Y{i}")).await;
        assert_eq!(r.status(), StatusCode::OK, "booking Y{i}");
    }
}

/// E2: a denial is 429 with an integer Retry-After, at least 1, at most the time to the next
/// token rounded up, and a problem body of a fixed shape.
#[tokio::test(start_paused = true)]
async fn e2_denial_has_retry_after_rounded_up_and_a_stable_body() {
    // A refused key is answered from memory until its `retry_after`, counted on tokio's clock,
    // which the store's buckets refill by too.
    let limiter = Limiter::builder(MemoryStore::new()).build();
    // Entity: 2 tokens, one back every 30 s.
    let app = booking_app(&limiter, plan("g", 100, 50.0), plan("e", 2, 1.0 / 30.0));
    for _ in 0..2 {
        assert_eq!(get_path(&app, "/bookings/7").await.status(), StatusCode::OK);
    }
    let r = get_path(&app, "/bookings/7").await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    let h = r.headers().clone();
    assert_eq!(header(&h, "retry-after"), Some("30"));
    assert_eq!(header(&h, "content-type"), Some("application/problem+json"));
    assert_eq!(header(&h, "x-ratelimit-entity-remaining"), Some("0"));
    assert_eq!(
        header(&h, "ratelimit-policy"),
        Some("\"api\";q=100;w=2, \"entity\";q=2;w=60")
    );
    // The global token of the denied request went back: still 98 after 2 OK.
    assert_eq!(header(&h, "x-ratelimit-api-remaining"), Some("98"));
    assert_eq!(
        header(&h, "ratelimit"),
        Some("\"api\";r=98;t=1, \"entity\";r=0;t=30")
    );
    let body = body_json(r).await;
    assert_eq!(
        body,
        serde_json::json!({
            "type": "about:blank",
            "title": "Too Many Requests",
            "status": 429,
            "detail": "rate limit of the entity layer exceeded for GET:/bookings/{bookingId}",
            "layer": "entity",
            "limit": "entity",
            "endpoint": "GET:/bookings/{bookingId}",
            "retry_after": 30,
        })
    );

    // 29.5 s later the next token is 0.5 s away: Retry-After says 1, never 0.
    tokio::time::advance(Duration::from_millis(29_500)).await;
    let r = get_path(&app, "/bookings/7").await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(r.headers(), "retry-after"), Some("1"));
    // The rate is 0.033333333/s (stored to 10⁻⁹), so the token is due a hair after 30 s.
    tokio::time::advance(Duration::from_millis(501)).await;
    assert_eq!(get_path(&app, "/bookings/7").await.status(), StatusCode::OK);
}

/// E2 for the global layer: a global denial names the api layer, stops before the entity
/// bucket (no entity call, no entity header) and gives Retry-After for the global bucket.
#[tokio::test(start_paused = true)]
async fn e2_global_denial_stops_before_the_entity_check() {
    let store = MemoryStore::new();
    let (store, store_tally) = counting(store);
    let limiter = Limiter::builder(store).build();
    let app = booking_app(&limiter, plan("g", 3, 0.25), plan("e", 10, 5.0));
    for i in 0..3 {
        let r = get_path(&app, &format!("/bookings/{i}")).await;
        assert_eq!(r.status(), StatusCode::OK);
    }
    let r = get_path(&app, "/bookings/new").await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(r.headers(), "retry-after"), Some("4"));
    assert_eq!(header(r.headers(), "x-ratelimit-api-remaining"), Some("0"));
    assert_eq!(header(r.headers(), "x-ratelimit-entity-remaining"), None);
    assert_eq!(header(r.headers(), "ratelimit"), Some("\"api\";r=0;t=4"));
    assert_eq!(
        store_tally.calls_to("ratelimit:entity:GET:/bookings/{bookingId}:new"),
        0
    );
    let body = body_json(r).await;
    assert_eq!(body["layer"], "api");
    assert_eq!(body["status"], 429);
    assert_eq!(body["retry_after"], 4);
}

/// Allowed responses carry both layers' fields; a route without an entity carries the api
/// fields only.
#[tokio::test(start_paused = true)]
async fn allowed_responses_carry_both_layers_headers() {
    let store = MemoryStore::new();
    let limiter = Limiter::builder(store).build();
    let app = booking_app(&limiter, plan("g", 100, 50.0), plan("e", 150, 2.5));
    let r = get_path(&app, "/bookings/57765").await;
    assert_eq!(r.status(), StatusCode::OK);
    let h = r.headers();
    assert_eq!(
        header(h, "ratelimit-policy"),
        Some("\"api\";q=100;w=2, \"entity\";q=150;w=60")
    );
    assert_eq!(
        header(h, "ratelimit"),
        Some("\"api\";r=99;t=1, \"entity\";r=149;t=1")
    );
    assert_eq!(header(h, "x-ratelimit-api-remaining"), Some("99"));
    assert_eq!(header(h, "x-ratelimit-entity-remaining"), Some("149"));
    assert_eq!(header(h, "retry-after"), None);

    let r = get_path(&app, "/bookings").await;
    assert_eq!(r.status(), StatusCode::OK);
    // Another route pattern, so another global bucket.
    assert_eq!(header(r.headers(), "x-ratelimit-api-remaining"), Some("99"));
    assert_eq!(header(r.headers(), "x-ratelimit-entity-remaining"), None);
}

/// `/bookings/1` and `/bookings/2` share the route's global bucket: the key is the pattern.
#[tokio::test(start_paused = true)]
async fn global_key_is_the_route_pattern_not_the_path() {
    let store = MemoryStore::new();
    let limiter = Limiter::builder(store).build();
    let app = booking_app(&limiter, plan("g", 100, 50.0), plan("e", 10, 5.0));
    get_path(&app, "/bookings/1").await;
    get_path(&app, "/bookings/2").await;
    let row = limiter.store().inspect(GLOBAL_KEY).await.unwrap().unwrap();
    assert_eq!(row.tokens_now, Tokens::whole(98));
    for id in ["1", "2"] {
        let key = format!("ratelimit:entity:GET:/bookings/{{bookingId}}:{id}");
        let row = limiter.store().inspect(&key).await.unwrap().unwrap();
        assert_eq!(row.tokens_now, Tokens::whole(9), "{key}");
    }
}

/// An entity from a header (an API key): absent header, entity check skipped.
#[tokio::test(start_paused = true)]
async fn header_entity_is_skipped_when_the_header_is_absent() {
    let store = MemoryStore::new();
    let limiter = Limiter::builder(store).build();
    let app = Router::new().route(
        "/search",
        post(|| async { "found" }).route_layer(
            RouteLimitLayer::new(limiter.clone())
                .global(plan("g", 100, 50.0))
                .entity(
                    EntityKey::header(HeaderName::from_static("x-api-key")),
                    plan("e", 1, 0.001),
                )
                .x_ratelimit_remaining(true),
        ),
    );
    let req = |key: Option<&str>| {
        let mut b = Request::post("/search");
        if let Some(k) = key {
            b = b.header("x-api-key", k);
        }
        b.body(Body::empty()).unwrap()
    };
    assert_eq!(send(&app, req(Some("k1"))).await.status(), StatusCode::OK);
    assert_eq!(
        send(&app, req(Some("k1"))).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(send(&app, req(Some("k2"))).await.status(), StatusCode::OK);
    for _ in 0..5 {
        let r = send(&app, req(None)).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(header(r.headers(), "x-ratelimit-entity-remaining"), None);
    }
}

/// A closure picks the entity: here the tenant from a query string.
#[tokio::test(start_paused = true)]
async fn closure_entity_key() {
    let store = MemoryStore::new();
    let limiter = Limiter::builder(store).build();
    let tenant = EntityKey::from_fn(|parts| {
        parts
            .uri
            .query()?
            .split('&')
            .find_map(|kv| kv.strip_prefix("tenant="))
            .map(str::to_owned)
    });
    let app = Router::new().route(
        "/report",
        get(|| async { "report" })
            .route_layer(RouteLimitLayer::new(limiter.clone()).entity(tenant, plan("e", 2, 0.001))),
    );
    for _ in 0..2 {
        assert_eq!(
            get_path(&app, "/report?tenant=a").await.status(),
            StatusCode::OK
        );
    }
    assert_eq!(
        get_path(&app, "/report?tenant=a").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        get_path(&app, "/report?tenant=b").await.status(),
        StatusCode::OK
    );
    assert_eq!(get_path(&app, "/report").await.status(), StatusCode::OK);
}

/// E3, the pure function: the spoofing table.
#[test]
fn e3_client_ip_trusts_forwarded_for_only_from_trusted_proxies() {
    let trusted = TrustedProxies::parse(["10.0.0.0/8"]).unwrap();
    let ip = |peer: &str, xff: Option<&str>| {
        let mut h = HeaderMap::new();
        if let Some(x) = xff {
            h.insert("x-forwarded-for", x.parse().unwrap());
        }
        client_ip(peer.parse().unwrap(), &h, &trusted).to_string()
    };
    let big = "1.2.3.4, ".repeat(8 * 1024 / 9);
    let cases: &[(&str, Option<&str>, &str)] = &[
        // Untrusted peer: the header is ignored.
        ("203.0.113.5", Some("198.51.100.1"), "203.0.113.5"),
        ("203.0.113.5", None, "203.0.113.5"),
        // Trusted proxy: the rightmost untrusted address.
        ("10.0.0.1", Some("1.2.3.4, 198.51.100.7"), "198.51.100.7"),
        (
            "10.0.0.1",
            Some("1.2.3.4, 198.51.100.7, 10.0.0.2"),
            "198.51.100.7",
        ),
        ("10.0.0.1", Some("198.51.100.7:4711"), "198.51.100.7"),
        ("10.0.0.1", Some("[2001:db8::1]:443"), "2001:db8::1"),
        ("10.0.0.1", Some("::ffff:198.51.100.7"), "198.51.100.7"),
        // Only proxies in the chain: the leftmost (the first proxy's client).
        ("10.0.0.1", Some("10.0.0.3, 10.0.0.2"), "10.0.0.3"),
        // Empty, malformed, oversized: the peer.
        ("10.0.0.1", None, "10.0.0.1"),
        ("10.0.0.1", Some(""), "10.0.0.1"),
        ("10.0.0.1", Some(" , "), "10.0.0.1"),
        ("10.0.0.1", Some("not-an-ip"), "10.0.0.1"),
        ("10.0.0.1", Some("1.2.3.4, 999.1.1.1"), "10.0.0.1"),
        ("10.0.0.1", Some(big.as_str()), "10.0.0.1"),
        // A malformed entry left of the client does not matter.
        ("10.0.0.1", Some("garbage, 198.51.100.7"), "198.51.100.7"),
    ];
    for (peer, xff, want) in cases {
        assert_eq!(ip(peer, *xff), *want, "peer {peer}, XFF {xff:?}");
    }
    // Two header lines are one list, the last line nearest.
    let mut h = HeaderMap::new();
    h.append("x-forwarded-for", "198.51.100.9".parse().unwrap());
    h.append("x-forwarded-for", "10.0.0.7".parse().unwrap());
    assert_eq!(
        client_ip("10.0.0.1".parse().unwrap(), &h, &trusted).to_string(),
        "198.51.100.9"
    );
    // Non-ASCII bytes in the header: no panic, the peer.
    let mut h = HeaderMap::new();
    h.insert(
        "x-forwarded-for",
        axum::http::HeaderValue::from_bytes(b"1.2.3.4\xff").unwrap(),
    );
    assert_eq!(
        client_ip("10.0.0.1".parse().unwrap(), &h, &trusted).to_string(),
        "10.0.0.1"
    );
}

/// E3 through the layer: 1,000 rotated spoofed XFF values from an untrusted peer share one
/// bucket; a trusted proxy's client gets its own.
#[tokio::test(start_paused = true)]
async fn e3_spoofed_forwarded_for_shares_the_peers_bucket() {
    let store = MemoryStore::new();
    let limiter = Limiter::builder(store).build();
    let app_from = |from: &str| {
        Router::new()
            .route(
                "/ip",
                get(|| async { "ip" }).route_layer(
                    RouteLimitLayer::new(limiter.clone())
                        .entity(EntityKey::client_ip(), plan("e", 10, 5.0))
                        .trusted_proxies(TrustedProxies::parse(["10.0.0.1"]).unwrap()),
                ),
            )
            .layer(MockConnectInfo(peer(from)))
    };
    let spoofer = app_from("203.0.113.5");
    let mut ok = 0;
    for i in 0..1000 {
        let req = Request::get("/ip")
            .header("x-forwarded-for", format!("198.51.{}.{}", i / 256, i % 256))
            .body(Body::empty())
            .unwrap();
        if send(&spoofer, req).await.status() == StatusCode::OK {
            ok += 1;
        }
    }
    assert_eq!(ok, 10, "no time passes: exactly the one bucket's capacity");
    let row = limiter
        .store()
        .inspect("ratelimit:entity:GET:/ip:203.0.113.5")
        .await
        .unwrap();
    assert!(row.is_some());
    assert!(
        limiter
            .store()
            .inspect("ratelimit:entity:GET:/ip:198.51.0.1")
            .await
            .unwrap()
            .is_none()
    );

    let proxy = app_from("10.0.0.1");
    let req = Request::get("/ip")
        .header("x-forwarded-for", "1.2.3.4, 198.51.100.7")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&proxy, req).await.status(), StatusCode::OK);
    let row = limiter
        .store()
        .inspect("ratelimit:entity:GET:/ip:198.51.100.7")
        .await
        .unwrap()
        .expect("the forwarded client's bucket");
    assert_eq!(row.tokens_now, Tokens::whole(9));

    for xff in ["", "garbage", &"9".repeat(8192)] {
        let req = Request::get("/ip")
            .header("x-forwarded-for", xff)
            .body(Body::empty())
            .unwrap();
        assert_eq!(send(&proxy, req).await.status(), StatusCode::OK);
    }
    let row = limiter
        .store()
        .inspect("ratelimit:entity:GET:/ip:10.0.0.1")
        .await
        .unwrap()
        .expect("the proxy's own bucket");
    assert_eq!(row.tokens_now, Tokens::whole(7));
}

/// The layer from the demo policy file: its routes are limited by method and pattern, other
/// routes and methods pass untouched.
#[tokio::test(start_paused = true)]
async fn layer_from_the_policy_file() {
    let policies = Policies::from_json_str(include_str!("../../examples/policies/demo.json"), None)
        .expect("demo policy");
    let store = MemoryStore::new();
    let limiter = Limiter::builder(store).policies(policies.clone()).build();
    let layer = RateLimitLayer::from_policies(&policies, limiter).unwrap();
    let app = Router::new()
        .route(BOOKING, get(|| async { "booking" }).put(|| async { "put" }))
        .route(
            "/bookings/{bookingId}/automate/internal",
            post(|| async { "automated" }),
        )
        .route("/health", get(|| async { "ok" }))
        .route_layer(layer)
        .layer(MockConnectInfo(peer("127.0.0.1")));

    let r = get_path(&app, "/bookings/1").await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        header(r.headers(), "x-ratelimit-entity-remaining"),
        Some("19")
    );
    assert!(header(r.headers(), "x-ratelimit-api-remaining").is_some());

    let automate = |id: &str| {
        Request::post(format!("/bookings/{id}/automate/internal"))
            .body(Body::empty())
            .unwrap()
    };
    for _ in 0..5 {
        assert_eq!(send(&app, automate("9")).await.status(), StatusCode::OK);
    }
    let r = send(&app, automate("9")).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    // 5 per minute: the next token is 12 s away.
    assert_eq!(header(r.headers(), "retry-after"), Some("12"));
    assert_eq!(header(r.headers(), "x-ratelimit-api-remaining"), Some("15"));
    assert_eq!(send(&app, automate("10")).await.status(), StatusCode::OK);

    let r = get_path(&app, "/health").await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(header(r.headers(), "ratelimit-policy"), None);
    let r = send(
        &app,
        Request::put("/bookings/1").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(header(r.headers(), "ratelimit-policy"), None);
}

/// The store is down: the fallback decides, never a 500. `deny` answers 503 with Retry-After,
/// `allow` lets the request through. Neither knows what the buckets hold, so neither reports a
/// count: `RateLimit-Policy` names the limits, and `RateLimit` and the `X-RateLimit-*-Remaining`
/// fields are left out (the allow fallback once reported the full capacity).
#[tokio::test(start_paused = true)]
async fn store_down_is_decided_by_the_fallback_never_500() {
    let limiter = Limiter::builder(Down).build();
    let with = |mode| {
        let p = Plan::new(
            "g",
            BucketConfig::new(Tokens::whole(10), Rate::per_second(1).unwrap()).unwrap(),
        )
        .with_fallback(FallbackSettings::new(mode));
        Arc::new(p)
    };
    let app = booking_app(&limiter, with(FallbackMode::Deny), plan("e", 10, 5.0));
    let r = get_path(&app, "/bookings/1").await;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        header(r.headers(), "retry-after")
            .unwrap()
            .parse::<u64>()
            .unwrap()
            >= 1
    );
    assert!(header(r.headers(), "ratelimit-policy").is_some());
    for name in [
        "ratelimit",
        "x-ratelimit-api-remaining",
        "x-ratelimit-entity-remaining",
    ] {
        assert_eq!(header(r.headers(), name), None, "deny fallback: {name}");
    }
    assert_eq!(body_json(r).await["layer"], "api");

    let app = booking_app(
        &limiter,
        with(FallbackMode::Allow),
        with(FallbackMode::Allow),
    );
    for _ in 0..20 {
        let r = get_path(&app, "/bookings/1").await;
        assert_eq!(r.status(), StatusCode::OK);
        assert!(header(r.headers(), "ratelimit-policy").is_some());
        for name in [
            "ratelimit",
            "x-ratelimit-api-remaining",
            "x-ratelimit-entity-remaining",
        ] {
            assert_eq!(header(r.headers(), name), None, "allow fallback: {name}");
        }
    }
}

/// Hostile entity ids never fail the request: a 5,000-byte id and one with a NUL get buckets
/// of their own (hashed), no 500.
#[tokio::test(start_paused = true)]
async fn hostile_entity_ids_are_hashed_not_refused() {
    let store = MemoryStore::new();
    let limiter = Limiter::builder(store).build();
    let app = booking_app(&limiter, plan("g", 100, 50.0), plan("e", 1, 0.001));
    let long = format!("/bookings/{}", "x".repeat(5000));
    assert_eq!(get_path(&app, &long).await.status(), StatusCode::OK);
    assert_eq!(
        get_path(&app, &long).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        get_path(&app, "/bookings/a%00b").await.status(),
        StatusCode::OK
    );
    assert_eq!(
        get_path(&app, "/bookings/a%00b").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// A small policy file: `GET /bookings/{bookingId}` with a global bucket of 5 and an entity
/// bucket of 100, nothing refilling within the test.
const HEAD_POLICY: &str = r#"{
  "x_ratelimit_remaining": true,
  "plans": {
    "g": { "capacity": 5, "refill": { "tokens": 1, "period_ms": 3600000 } },
    "e": { "capacity": 100, "refill": { "tokens": 1, "period_ms": 3600000 } }
  },
  "routes": [ { "method": "GET", "path": "/bookings/{bookingId}", "global": "g",
                "entity": { "path_param": "bookingId", "plan": "e" } } ]
}"#;

fn head(path: &str) -> Request<Body> {
    Request::head(path).body(Body::empty()).unwrap()
}

/// HEAD runs the GET handler (axum answers HEAD with it), so it is limited as that GET: the
/// same global and entity buckets, keyed `GET:...`, shared with GET. Here with a layer made
/// from a policy file that lists only GET.
#[tokio::test(start_paused = true)]
async fn head_is_limited_as_the_get_it_runs_policy_file() {
    let policies = Policies::from_json_str(HEAD_POLICY, None).unwrap();
    let store = MemoryStore::new();
    let (store, tally) = counting(store);
    let limiter = Limiter::builder(store).policies(policies.clone()).build();
    let app = Router::new()
        .route(BOOKING, get(|| async { "booking" }))
        .route_layer(RateLimitLayer::from_policies(&policies, limiter.clone()).unwrap())
        .layer(MockConnectInfo(peer("127.0.0.1")));

    let mut statuses = Vec::new();
    for _ in 0..300 {
        statuses.push(send(&app, head("/bookings/1")).await.status());
    }
    let ok = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    assert_eq!(
        ok, 5,
        "HEAD got {ok} OK of 300 against a global bucket of 5"
    );
    assert!(
        statuses[5..]
            .iter()
            .all(|s| *s == StatusCode::TOO_MANY_REQUESTS)
    );
    // The GET buckets paid, and GET now finds them empty.
    assert_eq!(tally.spent(GLOBAL_KEY), 5.0);
    let entity = "ratelimit:entity:GET:/bookings/{bookingId}:1";
    assert_eq!(tally.spent(entity), 5.0);
    assert_eq!(
        tally.calls_to("ratelimit:api:HEAD:/bookings/{bookingId}"),
        0
    );
    assert_eq!(
        get_path(&app, "/bookings/2").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let r = send(&app, head("/bookings/3")).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(r.headers(), "x-ratelimit-api-remaining"), Some("0"));
}

/// A file that lists HEAD on its own gives HEAD that route's limits instead.
#[tokio::test(start_paused = true)]
async fn head_listed_in_the_policy_file_has_its_own_limits() {
    let json = HEAD_POLICY.replace(
        r#""routes": ["#,
        r#""routes": [ { "method": "HEAD", "path": "/bookings/{bookingId}", "global": "e" },"#,
    );
    let policies = Policies::from_json_str(&json, None).unwrap();
    let store = MemoryStore::new();
    let limiter = Limiter::builder(store).policies(policies.clone()).build();
    let app = Router::new()
        .route(BOOKING, get(|| async { "booking" }))
        .route_layer(RateLimitLayer::from_policies(&policies, limiter.clone()).unwrap());
    for _ in 0..20 {
        assert_eq!(
            send(&app, head("/bookings/1")).await.status(),
            StatusCode::OK
        );
    }
    let row = limiter
        .store()
        .inspect("ratelimit:api:HEAD:/bookings/{bookingId}")
        .await
        .unwrap()
        .expect("HEAD's own bucket");
    assert_eq!(row.tokens_now, Tokens::whole(80));
    assert!(limiter.store().inspect(GLOBAL_KEY).await.unwrap().is_none());
}

/// The same with a layer on the route's method router: HEAD and GET share one limit.
#[tokio::test(start_paused = true)]
async fn head_is_limited_as_the_get_it_runs_route_layer() {
    let store = MemoryStore::new();
    let limiter = Limiter::builder(store).build();
    let app = booking_app(&limiter, plan("g", 5, 0.001), plan("e", 100, 0.001));
    for i in 0..5 {
        let r = if i % 2 == 0 {
            send(&app, head("/bookings/1")).await
        } else {
            get_path(&app, "/bookings/1").await
        };
        assert_eq!(r.status(), StatusCode::OK, "request {i}");
    }
    assert_eq!(
        send(&app, head("/bookings/1")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        get_path(&app, "/bookings/1").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let row = limiter.store().inspect(GLOBAL_KEY).await.unwrap().unwrap();
    assert_eq!(row.tokens_now, Tokens::ZERO);
    let head_key = "ratelimit:api:HEAD:/bookings/{bookingId}";
    assert!(limiter.store().inspect(head_key).await.unwrap().is_none());
}

/// Path ids that are not UTF-8 once percent-decoded (`%FF`, `%FE`) used to decode lossily to
/// the same U+FFFD and share a bucket; they are refused with 400 before any bucket is touched.
#[tokio::test(start_paused = true)]
async fn undecodable_path_ids_are_refused_before_any_bucket() {
    let store = MemoryStore::new();
    let (store, tally) = counting(store);
    let limiter = Limiter::builder(store).build();
    let app = booking_app(&limiter, plan("g", 100, 0.001), plan("e", 1, 0.001));
    for id in ["%FF", "%FE", "a%FFb", "%C3"] {
        let r = get_path(&app, &format!("/bookings/{id}")).await;
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{id}");
        assert_eq!(
            header(r.headers(), "content-type"),
            Some("application/problem+json")
        );
        assert_eq!(header(r.headers(), "x-ratelimit-api-remaining"), None);
        let body = body_json(r).await;
        assert_eq!(body["status"], 400);
        assert_eq!(body["layer"], "entity");
        assert_eq!(body["endpoint"], "GET:/bookings/{bookingId}");
    }
    assert!(tally.calls.lock().is_empty(), "{:?}", tally.calls.lock());
    assert!(limiter.store().inspect(GLOBAL_KEY).await.unwrap().is_none());

    // Valid UTF-8 ids are decoded and kept apart: é and è have buckets of their own.
    for id in ["%C3%A9", "%C3%A8", "%EF%BF%BD"] {
        let path = format!("/bookings/{id}");
        assert_eq!(get_path(&app, &path).await.status(), StatusCode::OK, "{id}");
        assert_eq!(
            get_path(&app, &path).await.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "{id}"
        );
    }
    let row = limiter.store().inspect(GLOBAL_KEY).await.unwrap().unwrap();
    assert_eq!(row.tokens_now, Tokens::whole(97));
}

/// axum gives no path parameter at all when one of them is not UTF-8; the entity's own
/// parameter is then read from the path, so a bad other parameter neither hides nor merges it.
#[tokio::test(start_paused = true)]
async fn entity_param_is_found_when_another_param_is_undecodable() {
    let store = MemoryStore::new();
    let limiter = Limiter::builder(store).build();
    let app = Router::new().route(
        "/vendors/{vendor}/bookings/{bookingId}",
        get(|| async { "booking" }).route_layer(
            RouteLimitLayer::new(limiter.clone())
                .entity(EntityKey::path_param("bookingId"), plan("e", 1, 0.001)),
        ),
    );
    assert_eq!(
        get_path(&app, "/vendors/%FF/bookings/7").await.status(),
        StatusCode::OK
    );
    assert_eq!(
        get_path(&app, "/vendors/%FE/bookings/7").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        get_path(&app, "/vendors/x/bookings/%FF").await.status(),
        StatusCode::BAD_REQUEST
    );
}

/// Header ids are kept exactly: never trimmed into another id, never decoded lossily. A value
/// with surrounding whitespace, one that is not UTF-8 or a header sent twice is refused with
/// 400 and takes no token from either bucket.
#[tokio::test(start_paused = true)]
async fn header_ids_are_kept_exactly_or_refused() {
    use axum::http::HeaderValue;

    let store = MemoryStore::new();
    let (store, tally) = counting(store);
    let limiter = Limiter::builder(store).build();
    let app = Router::new().route(
        "/search",
        post(|| async { "found" }).route_layer(
            RouteLimitLayer::new(limiter.clone())
                .global(plan("g", 100, 0.001))
                .entity(
                    EntityKey::header(HeaderName::from_static("x-api-key")),
                    plan("e", 1, 0.001),
                ),
        ),
    );
    let req = |values: &[&[u8]]| {
        let mut r = Request::post("/search").body(Body::empty()).unwrap();
        for v in values {
            r.headers_mut()
                .append("x-api-key", HeaderValue::from_bytes(v).unwrap());
        }
        r
    };
    let global = "ratelimit:api:POST:/search";
    for bad in [
        &[&b" k"[..]][..],
        &[&b"k "[..]],
        &[&b"\tk"[..]],
        &[&b"  "[..]],
        &[&b"\xff"[..]],
        &[&b"\xfe"[..]],
        &[&b"k"[..], &b"k2"[..]],
    ] {
        let r = send(&app, req(bad)).await;
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{bad:?}");
        assert_eq!(body_json(r).await["layer"], "entity");
    }
    assert!(tally.calls.lock().is_empty(), "{:?}", tally.calls.lock());

    // Ids that differ get buckets of their own, case and inner spaces included.
    for id in [&b"k"[..], b"K", b"k k", b"k  k", "k\u{a0}".as_bytes()] {
        assert_eq!(send(&app, req(&[id])).await.status(), StatusCode::OK);
        assert_eq!(
            send(&app, req(&[id])).await.status(),
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    // Five OK; the five entity denials gave their global tokens back.
    assert_eq!(tally.spent(global), 5.0);
}

/// An id written as the digest the layer stores for a long id gets a bucket of its own.
#[tokio::test(start_paused = true)]
async fn an_id_cannot_pose_as_a_hashed_id() {
    use sha2::{Digest, Sha256};

    let store = MemoryStore::new();
    let limiter = Limiter::builder(store).build();
    let app = booking_app(&limiter, plan("g", 100, 50.0), plan("e", 1, 0.001));
    let long = "x".repeat(5000);
    assert_eq!(
        get_path(&app, &format!("/bookings/{long}")).await.status(),
        StatusCode::OK
    );
    let hex: String = Sha256::digest(long.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let posing = format!("/bookings/sha256:{hex}");
    assert_eq!(get_path(&app, &posing).await.status(), StatusCode::OK);
    assert_eq!(
        get_path(&app, &posing).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// `GET /bookings/{bookingId}` from a policy file whose route puts `shadow` on the layers named
/// (`""` for none).
fn shadow_app(limiter: &Limiter, shadow: &str) -> Router {
    let file = format!(
        r#"{{
          "plans": {{
            "g": {{ "capacity": 1000, "refill_per_second": 1000 }},
            "e": {{ "capacity": 10, "refill_per_second": 5 }}
          }},
          "routes": [
            {{ "method": "GET", "path": "/bookings/{{bookingId}}", "global": "g",
               "entity": {{ "path_param": "bookingId", "plan": "e" }} {shadow} }}
          ]
        }}"#
    );
    let policies = Policies::from_json_str(&file, None).expect("valid policy");
    Router::new()
        .route(BOOKING, get(|| async { "booking" }))
        .route_layer(RateLimitLayer::from_policies(&policies, limiter.clone()).expect("layer"))
        .layer(MockConnectInfo(peer("127.0.0.1")))
}

/// S5: a route's entity layer in shadow mode. The same 1,000 requests for one booking, 1 ms
/// apart, against the enforcing route and the shadow route (each on its own store):
/// the shadow route answers every one with 200 and carries the entity layer's `RateLimit` item
/// and the `RateLimit-Policy` of the enforcing route's answer, 429 or not (without
/// `Retry-After`);
/// the endpoint's global bucket pays for every request the shadow route let through.
#[tokio::test(start_paused = true)]
async fn s5_a_shadow_entity_layer_never_answers_429_and_carries_the_denials_fields() {
    let (shadow_store, tally) = counting(MemoryStore::new());
    // The enforcing route answers a refused key from memory until its `retry_after`, counted
    // on tokio's clock, which the stores' buckets refill by too.
    let enforcing = shadow_app(&Limiter::builder(MemoryStore::new()).build(), "");
    let shadow = shadow_app(
        &Limiter::builder(shadow_store).build(),
        r#", "shadow": "entity""#,
    );
    let (mut ok, mut would_deny) = (0, 0);
    for i in 0..1000 {
        let e = get_path(&enforcing, "/bookings/X").await;
        let s = get_path(&shadow, "/bookings/X").await;
        assert_eq!(s.status(), StatusCode::OK, "request {i}");
        assert_eq!(
            header(e.headers(), "ratelimit-policy"),
            header(s.headers(), "ratelimit-policy"),
            "request {i}"
        );
        // The entity layer's item is the denial's. The api item differs by one token once
        // the entity would deny: the enforcing route gives the endpoint's token back, the
        // shadow route lets the request through, which spends it.
        let entity_item = |h: &HeaderMap| {
            header(h, "ratelimit")
                .and_then(|v| v.split(", ").find(|i| i.starts_with("\"entity\"")))
                .map(str::to_owned)
        };
        assert_eq!(
            entity_item(e.headers()),
            entity_item(s.headers()),
            "request {i}"
        );
        assert!(entity_item(s.headers()).is_some(), "request {i}");
        assert_eq!(header(s.headers(), "retry-after"), None, "request {i}");
        match e.status() {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => would_deny += 1,
            other => panic!("unexpected status {other}"),
        }
        tokio::time::advance(Duration::from_millis(1)).await;
    }
    assert!(
        (10..=15).contains(&ok),
        "the enforcing route let {ok} through"
    );
    assert_eq!(ok + would_deny, 1000);
    assert_eq!(
        tally.spent(GLOBAL_KEY),
        1000.0,
        "the global bucket paid for every request the shadow route let through"
    );
}

/// S5, the other layer: a route whose global layer is in shadow mode lets its denials through
/// to the entity layer, which still enforces.
#[tokio::test(start_paused = true)]
async fn s5_a_shadow_global_layer_lets_its_denials_reach_the_entity_layer() {
    let limiter = Limiter::builder(MemoryStore::new()).build();
    let file = r#"{
      "plans": {
        "g": { "capacity": 5, "refill_per_second": 1 },
        "e": { "capacity": 3, "refill_per_second": 1 }
      },
      "routes": [
        { "method": "GET", "path": "/bookings/{bookingId}", "global": "g",
          "entity": { "path_param": "bookingId", "plan": "e" }, "shadow": "api" }
      ]
    }"#;
    let policies = Policies::from_json_str(file, None).expect("valid policy");
    let app = Router::new()
        .route(BOOKING, get(|| async { "booking" }))
        .route_layer(RateLimitLayer::from_policies(&policies, limiter).expect("layer"))
        .layer(MockConnectInfo(peer("127.0.0.1")));
    // Twenty bookings, one request each: the global bucket (5) would deny fifteen, and lets
    // them through; no entity bucket is short.
    for i in 0..20 {
        let r = get_path(&app, &format!("/bookings/B{i}")).await;
        assert_eq!(r.status(), StatusCode::OK, "booking B{i}");
    }
    // One booking, four more requests: its entity bucket (3, one spent above) still enforces.
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(get_path(&app, "/bookings/B0").await.status());
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
}

/// R5: `RateLimitLayer::reload` swaps the routes and plans of a layer already serving: a
/// route's changed plan decides the next request, a route added by the reload is limited from
/// then on, and one it removes passes unlimited.
#[tokio::test(start_paused = true)]
async fn r5_a_reloaded_layer_applies_the_new_routes_to_the_next_request() {
    let store = MemoryStore::new();
    let limiter = Limiter::builder(store).build();
    let file = |entity_capacity: u64, list_route: bool| {
        let list = if list_route {
            r#", { "method": "GET", "path": "/bookings", "global": "list" }"#
        } else {
            ""
        };
        Policies::from_json_str(
            &format!(
                r#"{{
                  "plans": {{
                    "g": {{ "capacity": 1000, "refill_per_second": 1 }},
                    "e": {{ "capacity": {entity_capacity}, "refill_per_second": 0.001 }},
                    "list": {{ "capacity": 1, "refill_per_second": 0.001 }}
                  }},
                  "routes": [
                    {{ "method": "GET", "path": "/bookings/{{bookingId}}", "global": "g",
                       "entity": {{ "path_param": "bookingId", "plan": "e" }} }} {list}
                  ]
                }}"#
            ),
            None,
        )
        .expect("valid policy")
    };
    let layer = RateLimitLayer::from_policies(&file(3, false), limiter.clone()).expect("layer");
    let app = Router::new()
        .route(BOOKING, get(|| async { "booking" }))
        .route("/bookings", get(|| async { "list" }))
        .route_layer(layer.clone())
        .layer(MockConnectInfo(peer("127.0.0.1")));
    let statuses = async |path: &str, n: usize| {
        let mut ok = 0;
        for _ in 0..n {
            if get_path(&app, path).await.status() == StatusCode::OK {
                ok += 1;
            }
        }
        ok
    };
    assert_eq!(statuses("/bookings/A", 5).await, 3, "entity capacity 3");
    assert_eq!(statuses("/bookings", 5).await, 5, "no route: unlimited");

    layer.reload(file(10, true)).expect("reload");
    assert_eq!(statuses("/bookings/B", 12).await, 10, "entity capacity 10");
    assert_eq!(statuses("/bookings", 5).await, 1, "the new route's plan");

    layer.reload(file(10, false)).expect("reload");
    assert_eq!(
        statuses("/bookings", 5).await,
        5,
        "route removed: unlimited again"
    );
    assert_eq!(
        limiter.policies().expect("policies").routes().len(),
        1,
        "the limiter holds what the layer reloaded"
    );
}

/// E6: a client chooses its method, so the method in a code-built layer's key comes from a bounded
/// set: the standard methods as themselves (`HEAD` as `GET`), every other method string folded
/// into one `OTHER` bucket. On an `any()` route of capacity 10, 200 requests with the methods
/// `X0` … `X199` get 10 OK between them, and lowercase `get` (not `GET`) meets the same empty
/// bucket; `GET` and `HEAD` share their own.
#[tokio::test(start_paused = true)]
async fn e6_method_rotation_on_an_any_route_shares_one_bucket() {
    let store = MemoryStore::new();
    let (store, tally) = counting(store);
    let limiter = Limiter::builder(store).build();
    let app = Router::new()
        .route("/x", axum::routing::any(|| async { "x" }))
        .route_layer(RouteLimitLayer::new(limiter.clone()).global(plan("g", 10, 0.001)));
    let with_method = |method: &str| {
        Request::builder()
            .method(method)
            .uri("/x")
            .body(Body::empty())
            .unwrap()
    };
    let mut ok = 0;
    for i in 0..200 {
        if send(&app, with_method(&format!("X{i}"))).await.status() == StatusCode::OK {
            ok += 1;
        }
    }
    assert_eq!(
        ok, 10,
        "200 invented methods got {ok} OK from a bucket of 10"
    );
    assert_eq!(
        send(&app, with_method("get")).await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "lowercase get is not GET: it is another invented method"
    );
    for i in 0..10 {
        let method = if i % 2 == 0 { "GET" } else { "HEAD" };
        let r = send(&app, with_method(method)).await;
        assert_eq!(r.status(), StatusCode::OK, "{method} {i}");
    }
    assert_eq!(
        send(&app, with_method("GET")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let mut keys: Vec<String> = tally.calls.lock().clone();
    keys.sort();
    keys.dedup();
    assert_eq!(keys, ["ratelimit:api:GET:/x", "ratelimit:api:OTHER:/x"]);
}

/// `GET /bookings`, `GET` and `POST` on [`BOOKING`], and `GET /invoices`, behind `layer`: three
/// router patterns and two methods, for a budget the routes share.
fn three_routes(layer: RouteLimitLayer) -> Router {
    Router::new()
        .route("/bookings", get(|| async { "list" }))
        .route(
            BOOKING,
            get(|| async { "one" }).post(|| async { "changed" }),
        )
        .route("/invoices", get(|| async { "invoices" }))
        .route_layer(layer)
}

/// E7: a code-built layer keeps a copy of its limits per method and router pattern, and every
/// copy shares each limit's memory of refused keys: once customer A's budget is refused on one
/// route, its requests on the others (other patterns, another method) are refused from that
/// memory, without a store call, until the refusal's `retry_after`.
#[tokio::test(start_paused = true)]
async fn e7_a_budget_refused_on_one_route_is_refused_from_memory_on_the_others() {
    let (store, tally) = counting(MemoryStore::new());
    let limiter = Limiter::builder(store).build();
    let layer = RouteLimitLayer::new(limiter.clone())
        .entity_budget(
            "customer",
            EntityKey::header(HeaderName::from_static("x-api-key")),
            plan("per-customer", 3, 0.001),
        )
        .expect("a valid budget name");
    let app = three_routes(layer);
    let call = |method: &str, path: &str| {
        Request::builder()
            .method(method)
            .uri(path)
            .header("x-api-key", "A")
            .body(Body::empty())
            .unwrap()
    };
    for _ in 0..3 {
        assert_eq!(
            send(&app, call("GET", "/bookings")).await.status(),
            StatusCode::OK
        );
    }
    assert_eq!(
        send(&app, call("GET", "/bookings")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let calls = tally.calls.lock().len();
    for (method, path) in [
        ("GET", "/invoices"),
        ("GET", "/bookings/1"),
        ("POST", "/bookings/2"),
        ("GET", "/bookings"),
    ] {
        for _ in 0..5 {
            let r = send(&app, call(method, path)).await;
            assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS, "{method} {path}");
            assert_eq!(body_json(r).await["limit"], "customer");
        }
    }
    assert_eq!(
        tally.calls.lock().len(),
        calls,
        "refusals on the other routes were answered from the budget's memory"
    );
}

/// E7: one budget per customer across all endpoints (`RouteLimitLayer::entity_budget`): five
/// requests of customer A spread over three routes and two methods spend one bucket of 5, the
/// sixth is refused on whichever route it comes, with the budget's fields, named by the budget
/// (`customer`); customer B
/// still has its own 5; the store sees one key per customer, without method or route. A bad
/// budget name is a typed error.
#[tokio::test(start_paused = true)]
async fn e7_one_budget_per_customer_across_all_endpoints() {
    let store = MemoryStore::new();
    let (store, tally) = counting(store);
    let limiter = Limiter::builder(store).build();
    let api_key = || EntityKey::header(HeaderName::from_static("x-api-key"));
    let layer = RouteLimitLayer::new(limiter.clone())
        .entity_budget("customer", api_key(), plan("per-customer", 5, 0.001))
        .expect("a valid budget name")
        .x_ratelimit_remaining(true);
    let app = three_routes(layer);
    let call = |method: &str, path: &str, customer: &str| {
        Request::builder()
            .method(method)
            .uri(path)
            .header("x-api-key", customer)
            .body(Body::empty())
            .unwrap()
    };
    let spread = [
        ("GET", "/bookings"),
        ("GET", "/bookings/1"),
        ("POST", "/bookings/2"),
        ("GET", "/invoices"),
        ("GET", "/bookings/3"),
    ];
    for (i, (method, path)) in spread.iter().enumerate() {
        let r = send(&app, call(method, path, "A")).await;
        assert_eq!(r.status(), StatusCode::OK, "{method} {path}");
        assert_eq!(
            header(r.headers(), "x-ratelimit-customer-remaining"),
            Some((4 - i).to_string().as_str()),
            "{method} {path}"
        );
    }
    for (method, path) in [("GET", "/invoices"), ("POST", "/bookings/9")] {
        let r = send(&app, call(method, path, "A")).await;
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS, "{method} {path}");
        let h = r.headers().clone();
        assert_eq!(
            header(&h, "ratelimit-policy"),
            Some("\"customer\";q=5;w=5000")
        );
        assert_eq!(header(&h, "x-ratelimit-customer-remaining"), Some("0"));
        assert!(header(&h, "retry-after").is_some());
        let body = body_json(r).await;
        assert_eq!(body["limit"], "customer");
        assert_eq!(body["layer"], "customer");
    }
    for _ in 0..5 {
        let r = send(&app, call("GET", "/invoices", "B")).await;
        assert_eq!(
            r.status(),
            StatusCode::OK,
            "customer B has a budget of its own"
        );
    }
    let mut keys: Vec<String> = tally.calls.lock().clone();
    keys.sort();
    keys.dedup();
    assert_eq!(
        keys,
        ["ratelimit:budget:customer:A", "ratelimit:budget:customer:B"]
    );
    for bad in ["", "a:b", "tenant id", &"n".repeat(65)] {
        let err = RouteLimitLayer::new(limiter.clone())
            .entity_budget(bad, api_key(), plan("p", 5, 1.0))
            .expect_err(bad);
        assert!(
            matches!(&err, RouteConfigError::InvalidBudget { budget } if budget == bad),
            "{err}"
        );
        assert!(err.to_string().contains("A-Z a-z 0-9 _ . -"), "{err}");
    }
}

/// E16: the header fields on refusals only, when asked for. With the policy file's `"fields_on":
/// "refusals"` (or the builder's `fields_on(FieldsOn::Refusals)` over a file that says
/// nothing) an admitted response carries no `RateLimit-Policy`, `RateLimit` or
/// `X-RateLimit-*-Remaining` field, and the refusal still carries them all with `Retry-After`;
/// the builder's `FieldsOn::EveryResponse` overrides the file's `"refusals"`. A layer built in
/// code takes the option too.
#[tokio::test(start_paused = true)]
async fn e16_fields_on_refusals_only_leave_admitted_responses_alone() {
    let refusals = HEAD_POLICY.replace(
        "\"x_ratelimit_remaining\": true,",
        "\"x_ratelimit_remaining\": true, \"fields_on\": \"refusals\",",
    );
    assert_eq!(
        Policies::from_json_str(&refusals, None)
            .unwrap()
            .fields_on(),
        FieldsOn::Refusals
    );
    assert_eq!(
        Policies::from_json_str(HEAD_POLICY, None)
            .unwrap()
            .fields_on(),
        FieldsOn::EveryResponse
    );
    let app = |json: &str, builder: Option<FieldsOn>| {
        let policies = Policies::from_json_str(json, None).unwrap();
        let limiter = Limiter::builder(MemoryStore::new())
            .policies(policies.clone())
            .build();
        let mut layer = RateLimitLayer::from_policies(&policies, limiter).unwrap();
        if let Some(on) = builder {
            layer = layer.fields_on(on);
        }
        Router::new()
            .route(BOOKING, get(|| async { "booking" }))
            .route_layer(layer)
    };
    let names = [
        "ratelimit-policy",
        "ratelimit",
        "x-ratelimit-api-remaining",
        "x-ratelimit-entity-remaining",
    ];
    for (json, builder, on_admitted) in [
        (refusals.as_str(), None, false),
        (HEAD_POLICY, Some(FieldsOn::Refusals), false),
        (refusals.as_str(), Some(FieldsOn::EveryResponse), true),
    ] {
        let app = app(json, builder);
        for _ in 0..5 {
            let r = get_path(&app, "/bookings/1").await;
            assert_eq!(r.status(), StatusCode::OK);
            for name in names {
                assert_eq!(
                    header(r.headers(), name).is_some(),
                    on_admitted,
                    "{name} on an admitted response ({builder:?})"
                );
            }
        }
        let r = get_path(&app, "/bookings/1").await;
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        let h = r.headers();
        assert!(header(h, "retry-after").is_some());
        assert_eq!(
            header(h, "ratelimit-policy"),
            Some("\"api\";q=5;w=18000, \"entity\";q=100;w=360000")
        );
        assert!(header(h, "ratelimit").is_some_and(|v| v.starts_with("\"api\";r=0;")));
        assert_eq!(header(h, "x-ratelimit-api-remaining"), Some("0"));
    }
    // A layer built in code.
    let limiter = Limiter::builder(MemoryStore::new()).build();
    let app = Router::new().route(
        BOOKING,
        get(|| async { "booking" }).route_layer(
            RouteLimitLayer::new(limiter)
                .global(plan("g", 1, 0.001))
                .fields_on(FieldsOn::Refusals),
        ),
    );
    let r = get_path(&app, "/bookings/1").await;
    assert_eq!(r.status(), StatusCode::OK);
    assert!(header(r.headers(), "ratelimit").is_none());
    let r = get_path(&app, "/bookings/2").await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(header(r.headers(), "ratelimit").is_some());
    assert!(header(r.headers(), "retry-after").is_some());
}

/// E14: `X-RateLimit-{Name}-Remaining` only when asked for. Without the policy file's
/// `x_ratelimit_remaining` or the builder's option an allowed response and a denial carry
/// `RateLimit-Policy` and `RateLimit` (with each limit's `r`) and no such field; with either,
/// each limit's field carries its `r`.
#[tokio::test(start_paused = true)]
async fn e14_x_ratelimit_remaining_fields_are_written_only_when_asked_for() {
    let quiet = HEAD_POLICY.replace("\"x_ratelimit_remaining\": true,", "");
    let app = |json: &str, builder: bool| {
        let policies = Policies::from_json_str(json, None).unwrap();
        let store = MemoryStore::new();
        let limiter = Limiter::builder(store).policies(policies.clone()).build();
        let layer = RateLimitLayer::from_policies(&policies, limiter).unwrap();
        let layer = if builder {
            layer.x_ratelimit_remaining(true)
        } else {
            layer
        };
        Router::new()
            .route(BOOKING, get(|| async { "booking" }))
            .route_layer(layer)
    };
    assert!(
        !Policies::from_json_str(&quiet, None)
            .unwrap()
            .x_ratelimit_remaining()
    );
    assert!(
        Policies::from_json_str(HEAD_POLICY, None)
            .unwrap()
            .x_ratelimit_remaining()
    );
    for (json, builder, written) in [
        (quiet.as_str(), false, false),
        (quiet.as_str(), true, true),
        (HEAD_POLICY, false, true),
    ] {
        let app = app(json, builder);
        let r = get_path(&app, "/bookings/1").await;
        assert_eq!(r.status(), StatusCode::OK);
        let h = r.headers();
        assert_eq!(
            header(h, "ratelimit-policy"),
            Some("\"api\";q=5;w=18000, \"entity\";q=100;w=360000")
        );
        assert_eq!(
            header(h, "ratelimit"),
            Some("\"api\";r=4;t=3600, \"entity\";r=99;t=3600")
        );
        let fields = |h: &HeaderMap| {
            (
                header(h, "x-ratelimit-api-remaining").map(str::to_owned),
                header(h, "x-ratelimit-entity-remaining").map(str::to_owned),
            )
        };
        let expected = if written {
            (Some("4".to_owned()), Some("99".to_owned()))
        } else {
            (None, None)
        };
        assert_eq!(fields(h), expected, "{builder} {written}");
        for _ in 0..4 {
            assert_eq!(get_path(&app, "/bookings/1").await.status(), StatusCode::OK);
        }
        let r = get_path(&app, "/bookings/1").await;
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        let h = r.headers();
        assert!(header(h, "retry-after").is_some());
        assert!(header(h, "ratelimit").is_some_and(|v| v.starts_with("\"api\";r=0;")));
        let expected = if written {
            (Some("0".to_owned()), None)
        } else {
            (None, None)
        };
        assert_eq!(fields(h), expected, "{builder} {written}");
    }
    // A layer built in code: none by default, both with the option.
    let store = MemoryStore::new();
    let limiter = Limiter::builder(store).build();
    for on in [false, true] {
        let app = Router::new().route(
            BOOKING,
            get(|| async { "booking" }).route_layer(
                RouteLimitLayer::new(limiter.clone())
                    .global(plan("g", 10, 0.001))
                    .entity(EntityKey::path_param("bookingId"), plan("e", 10, 0.001))
                    .x_ratelimit_remaining(on),
            ),
        );
        let r = get_path(&app, &format!("/bookings/{on}")).await;
        assert!(header(r.headers(), "ratelimit").is_some());
        assert_eq!(
            header(r.headers(), "x-ratelimit-api-remaining").is_some(),
            on
        );
        assert_eq!(
            header(r.headers(), "x-ratelimit-entity-remaining").is_some(),
            on
        );
    }
}

/// A route whose key the store would refuse (its pattern makes the route-wide key longer than a
/// key may be) is let through by that limit as its error says, on a leased plan too: the lease
/// table's path does not take the key in, so no lease is asked for it and no request is ever
/// refused by a bucket the store could not hold.
#[tokio::test(start_paused = true)]
async fn e17_a_route_key_too_long_for_the_store_is_an_error_not_a_lease() {
    let limiter = Limiter::builder(MemoryStore::new()).build();
    let leased = Arc::new(
        (*plan("g", 2, 0.001))
            .clone()
            .with_lease(LeaseSettings::default()),
    );
    let layer = RouteLimitLayer::new(limiter.clone()).global(leased);
    // `ratelimit:api:GET:` and the pattern: over the 1,024 bytes a caller's key may have, within
    // what the lease table admits for the limiter's own keys.
    let pattern = format!("/{}", "a".repeat(1_030));
    let app = Router::new().route(&pattern, get(|| async { "long" }).route_layer(layer));
    for i in 0..5 {
        let r = get_path(&app, &pattern).await;
        assert_eq!(r.status(), StatusCode::OK, "request {i}");
    }
    // The table is made by the first call that reaches it: here none did.
    let keys = limiter.lease_stats().map_or(0, |stats| stats.keys);
    assert_eq!(keys, 0, "no lease for a key the store refuses");
}

/// A layer built in code finds each limit's key as the first request of its method and pattern
/// made it: a path parameter that fills a segment of the router's pattern is read from the path
/// (percent-decoded), in a nested router too (the pattern is the whole path's, and the id may
/// be in the part the outer router matched); a layer given
/// its pattern reads the parameter from axum's; `HEAD` shares `GET`'s buckets and `POST` has its
/// own. Each request takes one token from each of its two buckets.
#[tokio::test(start_paused = true)]
async fn a_code_built_layer_keys_each_method_and_pattern_as_it_first_made_them() {
    let store = MemoryStore::new();
    let limiter = Limiter::builder(store).build();
    let layer = || {
        RouteLimitLayer::new(limiter.clone())
            .global(plan("g", 100, 0.001))
            .entity(EntityKey::path_param("id"), plan("e", 5, 0.001))
    };
    let given = layer().route_pattern("/given/{id}").unwrap();
    let app = Router::new()
        .route(
            "/a/{id}",
            get(|| async { "a" })
                .post(|| async { "a" })
                .route_layer(layer()),
        )
        .nest(
            "/n",
            Router::new().route("/c/{id}", get(|| async { "c" }).route_layer(layer())),
        )
        // Nested at the id: the nested router's own path is `/`, and the id is only in the
        // path the outer router matched.
        .nest(
            "/m/{id}",
            Router::new().route("/", get(|| async { "m" }).route_layer(layer())),
        )
        .route("/given/{id}", get(|| async { "g" }).route_layer(given));
    let cases = [
        ("GET", "/a/x%20y", "GET:/a/{id}", "x y"),
        ("HEAD", "/a/x%20y", "GET:/a/{id}", "x y"),
        ("POST", "/a/x%20y", "POST:/a/{id}", "x y"),
        ("GET", "/n/c/7", "GET:/n/c/{id}", "7"),
        ("GET", "/m/8", "GET:/m/{id}", "8"),
        ("GET", "/given/%C3%A9", "GET:/given/{id}", "é"),
    ];
    for (method, path, endpoint, id) in cases {
        let statuses = {
            let mut s = Vec::new();
            for _ in 0..2 {
                let req = Request::builder()
                    .method(method)
                    .uri(path)
                    .body(Body::empty())
                    .unwrap();
                s.push(send(&app, req).await.status());
            }
            s
        };
        assert!(
            statuses.iter().all(|s| s.is_success()),
            "{method} {path}: {statuses:?}"
        );
        let entity = format!("ratelimit:entity:{endpoint}:{id}");
        let route = format!("ratelimit:api:{endpoint}");
        for key in [&entity, &route] {
            assert!(
                limiter.store().inspect(key).await.unwrap().is_some(),
                "{method} {path}: {key}"
            );
        }
    }
    // `GET` and `HEAD` took four of the five tokens of `x y`'s bucket: one more is admitted,
    // the next refused.
    for want in [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS] {
        let req = Request::get("/a/x%20y").body(Body::empty()).unwrap();
        assert_eq!(send(&app, req).await.status(), want);
    }
    let row = limiter
        .store()
        .inspect("ratelimit:entity:GET:/n/c/{id}:7")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.tokens_now, Tokens::whole(3));
}
