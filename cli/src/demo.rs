//! `tokenlease demo`: a small booking service protected by both HTTP layers.
//!
//! Routes (limits from the policy file's `routes`, the shipped `examples/policies/demo.json` by
//! default, built into the binary so it runs from any directory):
//!
//! - `GET /bookings/{bookingId}`: global `bookings-read`, entity `booking-read` per booking;
//! - `POST /bookings/{bookingId}/automate/internal`: global `automate`, entity
//!   `booking-automate` per booking;
//! - `GET /bookings`: global `bookings-list`, and entity `list-per-client` per client address in
//!   shadow mode (a limit being tried: it counts what it would deny and refuses nothing);
//! - `GET /metrics`: Prometheus text format, not limited; the series of plans and routes a
//!   reload removed are forgotten (`series.rs`);
//! - `GET /dashboard`: a live page over those metrics (decision rates per route and layer,
//!   database statements and those leases saved, lease tokens outstanding, the fallback, the
//!   outage debt), polling `GET /dashboard/data` (see `dashboard.rs`); neither is limited.
//!
//! An idle-row cleanup (`store::IdleCleanup`) deletes refilled buckets every 30 s, as a
//! service would run it.
//!
//! With `--policy FILE`, the demo reloads the file on SIGHUP and when it changes, after the
//! checks of `tokenlease check`; a file that fails them is refused and the old policies stay
//! (`reload.rs`).
//!
//! Buckets live in PostgreSQL: `DATABASE_URL`, or a throwaway cluster that is removed on exit.
//! Ctrl-C (SIGINT) and SIGTERM stop it cleanly: in-flight requests finish, leases go back, the
//! throwaway cluster is stopped and deleted.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::Path as UrlPath;
use axum::routing::{get, post};
use tokenlease::Limiter;
use tokenlease::http::RateLimitLayer;
use tokenlease::policy::Policies;
use tokenlease::store::{CircuitBreaker, IdleCleanup, PostgresStore, Store};

use super::db::{BindError, DatabaseError, given_or_throwaway, redact};

/// The shipped demo policy, built in.
const DEMO_POLICY: &str = include_str!("../../examples/policies/demo.json");

/// How often the idle-row cleanup runs.
const CLEANUP_EVERY: Duration = Duration::from_secs(30);
/// The rows the idle-row cleanup deletes per statement.
const CLEANUP_BATCH: u32 = 1000;

/// Arguments of `tokenlease demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Address to listen on (port 0 picks a free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Policy file with the routes' plans [default: the built-in examples/policies/demo.json].
    /// Reloaded on SIGHUP and when it changes, if it passes `tokenlease check`.
    #[arg(long)]
    policy: Option<PathBuf>,
    /// The database; without it a throwaway PostgreSQL is started and removed on exit.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// Longest wait for one database call, in milliseconds, before the plan's fallback decides
    /// (the library's default is 50; the demo allows more for busy laptops).
    #[arg(long, default_value_t = 500)]
    db_timeout_ms: u64,
    /// Serve from a throwaway Citus cluster of a coordinator and N workers instead of one
    /// PostgreSQL (the extension must be installed): the store distributes its tables and
    /// routes each worker's keys to it. Not with `DATABASE_URL`.
    #[arg(long, value_name = "N", default_value_t = 0)]
    citus: usize,
}

/// Runs the demo until Ctrl-C or SIGTERM.
pub(crate) fn run(args: Args) -> super::CmdResult {
    let policies = match &args.policy {
        Some(path) => Policies::from_file(path)?,
        None => {
            Policies::from_json_str(DEMO_POLICY, Some(Path::new("examples/policies/demo.json")))?
        }
    };
    // The exporter's recorder, but for the series of plans and routes, which the demo forgets
    // once a reload has removed their plan or route (series.rs).
    let prometheus = super::series::install()?;
    tokenlease::metrics::describe();

    // The address first: a port in use is reported at once, before any PostgreSQL starts.
    let listener = std::net::TcpListener::bind(args.listen).map_err(|cause| BindError {
        address: args.listen,
        cause,
    })?;
    listener.set_nonblocking(true)?;
    let mut citus = None;
    let (server, url) = if args.citus > 0 {
        if args.database_url.is_some() {
            return Err(
                "--citus starts its own throwaway Citus cluster: unset DATABASE_URL \
                        and drop --database-url"
                    .into(),
            );
        }
        let cluster = tokenlease_testkit::TempCitus::start(args.citus)?;
        eprintln!(
            "tokenlease demo: Citus cluster, coordinator {} and {} worker(s)",
            cluster.url(),
            cluster.workers().len()
        );
        let url = cluster.url();
        citus = Some(cluster);
        (None, url)
    } else {
        given_or_throwaway(args.database_url.as_deref())?
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let timeout = Duration::from_millis(args.db_timeout_ms.max(1));
    let throwaway = server.is_some() || citus.is_some();
    let result = runtime.block_on(serve(
        listener,
        policies,
        args.policy,
        &url,
        throwaway,
        timeout,
        prometheus,
    ));
    drop(runtime);
    // Stops and deletes the throwaway cluster, also after an error.
    drop(server);
    drop(citus);
    result?;
    eprintln!("tokenlease demo: stopped");
    Ok(ExitCode::SUCCESS)
}

async fn serve(
    listener: std::net::TcpListener,
    policies: Policies,
    policy_file: Option<PathBuf>,
    url: &str,
    throwaway: bool,
    timeout: Duration,
    prometheus: super::series::Handle,
) -> Result<(), Box<dyn std::error::Error>> {
    let store = PostgresStore::builder(url)
        .map_err(|e| DatabaseError::new("use", url, &e))?
        .call_timeout(timeout)
        .pool_wait_timeout(timeout)
        .statement_timeout(timeout)
        .lock_timeout(timeout)
        .build()
        .await
        .map_err(|e| DatabaseError::new("connect to", url, &e))?;
    // As the documented set-up: a failing database is left alone for a back-off, and the plan's
    // fallback decides at once instead of each request waiting for its timeout.
    let store: Arc<dyn Store> = Arc::new(CircuitBreaker::new(store).name("demo"));
    let limiter = Limiter::builder_shared(Arc::clone(&store))
        .policies(policies.clone())
        .build();
    let limits = RateLimitLayer::from_policies(&policies, limiter.clone())?;
    if let Some(path) = policy_file {
        super::reload::spawn(path, limits.clone(), prometheus.clone());
    }
    // Refilled buckets leave the table, as the documented set-up runs it (stopped on drop).
    let cleanup = IdleCleanup::spawn(store, CLEANUP_EVERY, CLEANUP_BATCH);
    let started = tokio::time::Instant::now();
    let data = prometheus.clone();

    let app = Router::new()
        .route("/bookings", get(list_bookings))
        .route("/bookings/{bookingId}", get(get_booking))
        .route(
            "/bookings/{bookingId}/automate/internal",
            post(automate_booking),
        )
        .route_layer(limits)
        .route(
            "/metrics",
            get(move || std::future::ready(prometheus.render())),
        )
        .route("/dashboard", get(super::dashboard::page))
        .route(
            "/dashboard/data",
            get(move |query| super::dashboard::data(data.clone(), started, query)),
        );

    let listener = tokio::net::TcpListener::from_std(listener)?;
    let addr = listener.local_addr()?;
    // What a flood of ids made and the library freed goes back to the system (trim.rs).
    super::trim::spawn_periodic();
    let shown = redact(url);
    let mut out = std::io::stdout().lock();
    writeln!(out, "tokenlease demo listening on http://{addr}")?;
    if throwaway {
        writeln!(
            out,
            "database: {shown} (a throwaway PostgreSQL, removed when the demo stops)"
        )?;
    } else {
        writeln!(out, "database: {shown}")?;
    }
    let password_note = if shown == url {
        ""
    } else {
        "   (put the password back in)"
    };
    writeln!(out, "inspect a bucket while the demo runs:")?;
    writeln!(
        out,
        "  DATABASE_URL='{shown}' tokenlease inspect 'ratelimit:entity:GET:/bookings/{{bookingId}}:123'{password_note}"
    )?;
    writeln!(
        out,
        "  DATABASE_URL='{shown}' tokenlease inspect 'ratelimit:api:GET:/bookings/{{bookingId}}'"
    )?;
    writeln!(out, "try:")?;
    writeln!(out, "  curl -i http://{addr}/bookings/123")?;
    writeln!(
        out,
        "  for i in 1 2 3 4 5 6; do curl -s -o /dev/null -w '%{{http_code}}\\n' -X POST http://{addr}/bookings/123/automate/internal; done"
    )?;
    writeln!(out, "dashboard: http://{addr}/dashboard")?;
    writeln!(out, "metrics: http://{addr}/metrics")?;
    out.flush()?;
    drop(out);

    // Each connection has HEADER_READ_TIMEOUT to send a request's head, new or kept alive
    // (serve.rs): half-open and idle connections do not hold the demo's sockets.
    super::serve::serve(
        listener,
        app,
        super::serve::HEADER_READ_TIMEOUT,
        shutdown_signal(),
    )
    .await;
    drop(cleanup);
    // Give every lease back before the database goes away.
    limiter.shutdown().await;
    Ok(())
}

/// Resolves on Ctrl-C (SIGINT) or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => eprintln!("tokenlease demo: SIGINT, shutting down"),
        () = term => eprintln!("tokenlease demo: SIGTERM, shutting down"),
    }
}

async fn list_bookings() -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({ "bookings": ["123", "456", "57765"] }))
}

async fn get_booking(UrlPath(id): UrlPath<String>) -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({ "bookingId": id, "status": "confirmed" }))
}

async fn automate_booking(UrlPath(id): UrlPath<String>) -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({ "bookingId": id, "automation": "queued" }))
}
