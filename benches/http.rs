//! The HTTP layer per request, beside `tower_governor`: an axum 0.8 route driven in process
//! (`Router::oneshot` on a current-thread runtime), with
//!
//! - `bare`: the route alone;
//! - `passthrough` (the interleaved table only): the route behind a tower layer that does
//!   nothing (`MapRequestLayer` with the identity): what axum's `route_layer` costs any layer
//!   (the per-request clone of the layered service, its call, its future boxed and polled),
//!   the floor under every other set-up's figure;
//! - `governor_1_limit`: `tower_governor`'s `GovernorLayer`, one limit keyed by the booking id
//!   (the path's last segment), on a quota too large to deny;
//! - `governor_1_limit_headers` (the interleaved table only): the same with its header fields
//!   (`use_headers`: `x-ratelimit-limit`, `x-ratelimit-remaining`), as ours always writes its
//!   own;
//! - `tokenlease_1_limit` (the interleaved table only): `RateLimitLayer` from a policy file
//!   with the booking's limit alone, otherwise as below: what the second limit adds;
//! - `tokenlease_2_limits`: `RateLimitLayer` from a policy file, two limits (the route, the
//!   booking by path parameter), leased plans with the default lease settings, over a
//!   `MemoryStore`, on buckets too large to deny, writing its default fields on every response:
//!   `RateLimit-Policy` and `RateLimit` with both limits' items (the older
//!   `X-RateLimit-*-Remaining` fields are written only when asked for, and are not here);
//! - `tokenlease_2_limits_on_refusals` (the interleaved table only): the same with the policy
//!   file's `"fields_on": "refusals"`, no fields on an admitted response: what
//!   `governor_1_limit` writes (nothing), for a like-for-like comparison;
//! - `tokenlease_code_2_limits_on_refusals` (the interleaved table only): the same two limits
//!   and fields built in code, `RouteLimitLayer` on the route (its pattern from axum's
//!   `MatchedPath`), the plans taken from the same policy file;
//!
//! each at 1 booking id and at 10,000 ids round-robin. What a layer costs is its figure less
//! `bare`'s, at the same id count, from the same run.
//!
//! Each router is prepared as `axum::serve` prepares it (`into_make_service` calls
//! `with_state(())`, which turns every handler into a route once): without that, axum would
//! apply each route layer again on every request, a cost no served application pays.
//!
//! `cargo bench --bench http` (about a minute once built). With
//! `TOKENLEASE_BENCH_INTERLEAVED=1` it prints instead a table of the eight set-ups measured in
//! turn, round after round (the figures `benches/README.md` quotes): on a shared machine whose
//! load drifts, set-ups measured side by side compare better than criterion's, minutes apart.
//! `TOKENLEASE_BENCH_ONLY=<set-up>` with it times that set-up alone (for a profiler), and
//! `TOKENLEASE_BENCH_IDS=1` (or `10000`) that id count alone, and `TOKENLEASE_BENCH_ROUNDS=<n>`
//! times `n` rounds instead of 31 (`scripts/http-instructions.sh` counts the instructions of a
//! request as the difference between two round counts).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::get;
use criterion::Criterion;
use tokenlease::Limiter;
use tokenlease::http::{EntityKey, RateLimitLayer, RouteLimitLayer};
use tokenlease::policy::FieldsOn;
use tokenlease::policy::Policies;
use tokenlease::store::MemoryStore;
use tower::ServiceExt;
use tower::util::MapRequestLayer;
use tower_governor::GovernorLayer;
use tower_governor::errors::GovernorError;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::KeyExtractor;

/// Two leased limits with the default lease settings, on buckets that never run dry here:
/// the route's (`api`) and the booking's (`entity`), written as `global` and `entity`, which
/// every version of the layer reads (so the same bench measures an older one).
const POLICY: &str = r#"{
  "plans": {
    "route": { "capacity": 8000000000, "refill_per_second": 1000000000, "lease": {} },
    "booking": { "capacity": 8000000000, "refill_per_second": 1000000000, "lease": {} }
  },
  "routes": [ { "method": "GET", "path": "/bookings/{bookingId}", "global": "route",
    "entity": { "path_param": "bookingId", "plan": "booking" } } ]
}"#;

/// [`POLICY`] with the booking's limit alone.
const POLICY_1_LIMIT: &str = r#"{
  "plans": {
    "booking": { "capacity": 8000000000, "refill_per_second": 1000000000, "lease": {} }
  },
  "routes": [ { "method": "GET", "path": "/bookings/{bookingId}",
    "entity": { "path_param": "bookingId", "plan": "booking" } } ]
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

/// `router` as `axum::serve` runs it: its handlers turned into routes, with their layers,
/// once (what `Router::into_make_service` does), not on every request.
fn served(router: Router) -> Router {
    router.with_state(())
}

/// The route behind a layer that does nothing: what any layer's service costs a request on an
/// axum route (cloned, called, its future boxed and polled), beside what its checks cost.
fn passthrough() -> Router {
    route().route_layer(MapRequestLayer::new(|req: Request<Body>| req))
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

/// [`governor`] with its header fields (`x-ratelimit-limit`, `x-ratelimit-remaining`).
fn governor_with_headers() -> Router {
    let config = GovernorConfigBuilder::default()
        .per_nanosecond(1)
        .burst_size(u32::MAX)
        .key_extractor(BookingId)
        .use_headers()
        .finish()
        .expect("a governor config");
    route().route_layer(GovernorLayer::new(config))
}

fn tokenlease() -> (Router, Limiter) {
    tokenlease_with(POLICY)
}

/// The route behind `RateLimitLayer` from `policy`, over a `MemoryStore`.
fn tokenlease_with(policy: &str) -> (Router, Limiter) {
    let policies = Policies::from_json_str(policy, None).expect("the bench policy");
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
    let apps = [
        ("bare", route()),
        ("governor_1_limit", governor()),
        ("tokenlease_2_limits", ours),
    ]
    .map(|(name, app)| (name, served(app)));
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

/// The same set-ups interleaved: 31 rounds (or `TOKENLEASE_BENCH_ROUNDS`), each timing `PER_ROUND` requests of every
/// set-up in turn, and each set-up's median round, in this thread's CPU time where the system gives
/// it (else wall time). On a shared machine whose load drifts over a criterion run, set-ups
/// measured side by side compare better than set-ups measured minutes apart, and CPU time
/// leaves out the time other processes held the core.
fn interleaved(runtime: &tokio::runtime::Runtime, apps: &[(&str, Router)], threads: usize) {
    const PER_ROUND: usize = 20_000;
    let rounds_wanted: usize = std::env::var("TOKENLEASE_BENCH_ROUNDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(31);
    // One thread: its own CPU time. Several: the process's (every worker's, and the lease
    // actor's, which runs among them), since a request's cost includes the cache lines the
    // workers pass to each other.
    let cpu_nanos = if threads > 1 {
        process_cpu_nanos
    } else {
        thread_cpu_nanos
    };
    let clock = match (cpu_nanos().is_some(), threads > 1) {
        (true, false) => "this thread's CPU time",
        (true, true) => "the process's CPU time",
        (false, _) => "wall time",
    };
    let on = if threads > 1 {
        format!(", {threads} worker threads each sending its share")
    } else {
        String::new()
    };
    println!(
        "\ninterleaved, median of {rounds_wanted} rounds of {PER_ROUND} requests{on} (ns per request, {clock}):"
    );
    println!(
        "| ids | {} |",
        apps.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(" | ")
    );
    let only_ids: Option<usize> = std::env::var("TOKENLEASE_BENCH_IDS")
        .ok()
        .and_then(|n| n.parse().ok());
    for ids in [1usize, 10_000] {
        if only_ids.is_some_and(|n| n != ids) {
            continue;
        }
        let paths: Arc<Vec<String>> =
            Arc::new((0..ids).map(|i| format!("/bookings/{i}")).collect());
        // Every id of this count before timing, and no other: the keys exist and their leases
        // are live, and no lease of ids this count never asks for expires during its rounds.
        runtime.block_on(async {
            for (_, app) in apps {
                for p in paths.iter() {
                    let req = Request::get(p.as_str()).body(Body::empty()).unwrap();
                    black_box(app.clone().oneshot(req).await.unwrap().status());
                }
            }
        });
        let mut rounds: Vec<Vec<f64>> = vec![Vec::new(); apps.len()];
        for _ in 0..rounds_wanted {
            for (k, (_, app)) in apps.iter().enumerate() {
                let start = std::time::Instant::now();
                let cpu_start = cpu_nanos();
                runtime.block_on(async {
                    if threads == 1 {
                        send(app, &paths, 0..PER_ROUND).await;
                        return;
                    }
                    // Each worker its share, from its own place in the ids (at 1 id, the same).
                    let share = PER_ROUND / threads;
                    let senders: Vec<_> = (0..threads)
                        .map(|t| {
                            let (app, paths) = (app.clone(), Arc::clone(&paths));
                            let from = t * ids / threads;
                            tokio::spawn(async move {
                                send(&app, &paths, from..from + share).await;
                            })
                        })
                        .collect();
                    for sender in senders {
                        sender.await.expect("a sender");
                    }
                });
                let spent = match (cpu_start, cpu_nanos()) {
                    (Some(a), Some(b)) => b.saturating_sub(a) as f64,
                    _ => start.elapsed().as_nanos() as f64,
                };
                rounds[k].push(spent / PER_ROUND as f64);
            }
        }
        let medians: Vec<String> = rounds
            .iter_mut()
            .map(|r| {
                r.sort_by(f64::total_cmp);
                format!("{:.0}", r[r.len() / 2])
            })
            .collect();
        println!("| {ids} | {} |", medians.join(" | "));
    }
}

/// Sends the requests numbered `range` to `app`, request `i` to `paths[i % paths.len()]`.
async fn send(app: &Router, paths: &[String], range: std::ops::Range<usize>) {
    for i in range {
        let req = Request::get(paths[i % paths.len()].as_str())
            .body(Body::empty())
            .unwrap();
        black_box(app.clone().oneshot(req).await.unwrap().status());
    }
}

/// The worker threads of `TOKENLEASE_BENCH_THREADS` (1 when unset: a current-thread runtime).
fn bench_threads() -> usize {
    std::env::var("TOKENLEASE_BENCH_THREADS")
        .ok()
        .and_then(|n| n.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or(1)
}

/// The CPU time every thread of this process has run, in nanoseconds
/// (`CLOCK_PROCESS_CPUTIME_ID`), or `None` where the clock is missing.
fn process_cpu_nanos() -> Option<u64> {
    clock_nanos(libc::CLOCK_PROCESS_CPUTIME_ID)
}

/// The CPU time this thread has run, in nanoseconds (`CLOCK_THREAD_CPUTIME_ID`), or `None`
/// where the clock is missing: on a shared machine, the time other processes hold the core is
/// left out, which wall time counts. (Linux's `/proc/thread-self/schedstat` gives the same
/// count, but only as of the last scheduler tick: 4 ms steps, 200 ns per request in a round.)
fn thread_cpu_nanos() -> Option<u64> {
    clock_nanos(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// `clock`'s time in nanoseconds, or `None` where it is missing.
#[allow(unsafe_code)] // One libc call, on a local it owns.
fn clock_nanos(clock: libc::clockid_t) -> Option<u64> {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid, writable `timespec` for the call's duration.
    let r = unsafe { libc::clock_gettime(clock, &mut t) };
    if r != 0 {
        return None;
    }
    Some(u64::try_from(t.tv_sec).ok()? * 1_000_000_000 + u64::try_from(t.tv_nsec).ok()?)
}

/// The two limits of [`POLICY`] built in code: `RouteLimitLayer` with the route's and the
/// booking's plans from the file, fields on refusals only.
fn tokenlease_code() -> (Router, Limiter) {
    let policies = Policies::from_json_str(POLICY, None).expect("the bench policy");
    let limiter = Limiter::builder(MemoryStore::new())
        .policies(policies.clone())
        .build();
    let plan = |name: &str| policies.plan(name).expect("the bench plan").clone();
    let layer = RouteLimitLayer::new(limiter.clone())
        .global(plan("route"))
        .entity(EntityKey::path_param("bookingId"), plan("booking"))
        .fields_on(FieldsOn::Refusals);
    (route().route_layer(layer), limiter)
}

/// Builds a set-up's router, and its limiter when it has one (kept alive while it is timed).
type MakeApp<'a> = dyn Fn() -> (Router, Option<Limiter>) + 'a;

fn main() {
    if std::env::var_os("TOKENLEASE_BENCH_INTERLEAVED").is_some() {
        let threads = bench_threads();
        let runtime = if threads > 1 {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads)
                .enable_all()
                .build()
        } else {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
        }
        .expect("a runtime");
        let only = std::env::var("TOKENLEASE_BENCH_ONLY").ok();
        // Only the set-ups timed are built: a limiter not timed would still run its lease
        // actor's periodic work beside the rounds.
        let on_refusals = POLICY.replacen('{', r#"{ "fields_on": "refusals","#, 1);
        let with = |(app, limiter): (Router, Limiter)| (app, Some(limiter));
        let setups: [(&str, &MakeApp); 8] = [
            ("bare", &|| (route(), None)),
            ("passthrough", &|| (passthrough(), None)),
            ("governor_1_limit", &|| (governor(), None)),
            ("governor_1_limit_headers", &|| {
                (governor_with_headers(), None)
            }),
            ("tokenlease_1_limit", &|| {
                with(tokenlease_with(POLICY_1_LIMIT))
            }),
            ("tokenlease_2_limits", &|| with(tokenlease())),
            ("tokenlease_2_limits_on_refusals", &|| {
                with(tokenlease_with(&on_refusals))
            }),
            ("tokenlease_code_2_limits_on_refusals", &|| {
                with(tokenlease_code())
            }),
        ];
        let mut limiters = Vec::new();
        let apps: Vec<_> = setups
            .into_iter()
            .filter(|(name, _)| only.as_deref().is_none_or(|o| o == *name))
            .map(|(name, make)| {
                // Built in the runtime: a limiter starts its lease actor on it.
                let (app, limiter) = runtime.block_on(async { make() });
                limiters.extend(limiter);
                (name, served(app))
            })
            .collect();
        interleaved(&runtime, &apps, threads);
        drop(limiters);
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
