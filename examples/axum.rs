//! A booking service behind both HTTP limits: a global bucket per endpoint and an entity
//! bucket per booking, from the routes of `examples/policies/demo.json`.
//!
//! ```text
//! cargo run --example axum --features http            # serves 127.0.0.1:3000
//! cargo run --example axum --features http -- --check # sends itself requests, exits
//! ```
//!
//! With `DATABASE_URL` set it uses that server; otherwise it starts a throwaway PostgreSQL
//! cluster (the `tokenlease-testkit` crate) and removes it on exit. Try
//! `curl -i -X POST 127.0.0.1:3000/bookings/7/automate/internal` six times: the sixth is
//! refused by the entity layer (booking 7 has used its 5 a minute), while booking 8 still gets
//! through.

use std::net::SocketAddr;

use axum::Router;
use axum::extract::Path;
use axum::routing::{get, post};
use tokenlease::Limiter;
use tokenlease::http::RateLimitLayer;
use tokenlease::policy::Policies;
use tokenlease::store::PostgresStore;
use tokenlease_testkit::TempPostgres;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

async fn get_booking(Path(id): Path<String>) -> String {
    format!("booking {id}\n")
}

async fn list_bookings() -> &'static str {
    "bookings\n"
}

async fn automate(Path(id): Path<String>) -> String {
    format!("automation started for booking {id}\n")
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let check = std::env::args().any(|a| a == "--check");
    // Keep the cluster (if any) alive until the end of main: dropping it removes it.
    let (_cluster, url) = match std::env::var("DATABASE_URL") {
        Ok(url) if !url.trim().is_empty() => {
            println!("using DATABASE_URL");
            (None, url)
        }
        _ => {
            println!("DATABASE_URL is not set: starting a throwaway PostgreSQL cluster");
            let cluster = tokio::task::spawn_blocking(TempPostgres::start).await??;
            let url = cluster.url();
            (Some(cluster), url)
        }
    };

    let policies = Policies::from_json_str(
        include_str!("policies/demo.json"),
        Some(std::path::Path::new("examples/policies/demo.json")),
    )?;
    let store = PostgresStore::connect(&url).await?;
    let limiter = Limiter::builder(store).policies(policies.clone()).build();
    // One layer for every route the policy file lists: global and entity limits by method and
    // route pattern. `route_layer`, so that the matched pattern is known when it runs.
    let limits = RateLimitLayer::from_policies(&policies, limiter.clone())?;
    let app = Router::new()
        .route("/bookings", get(list_bookings))
        .route("/bookings/{bookingId}", get(get_booking))
        .route("/bookings/{bookingId}/automate/internal", post(automate))
        .route_layer(limits);

    let listener = TcpListener::bind(if check {
        "127.0.0.1:0"
    } else {
        "127.0.0.1:3000"
    })
    .await?;
    let addr = listener.local_addr()?;
    // With the peer address, so that entity keys by client IP would work too.
    let server = axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    );

    if check {
        tokio::spawn(async move { server.await });
        for booking in [7, 7, 7, 7, 7, 7, 8] {
            let path = format!("/bookings/{booking}/automate/internal");
            println!("POST {path}: {}", post_status(addr, &path).await?);
        }
    } else {
        println!("listening on http://{addr} (Ctrl-C to stop)");
        server
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await?;
    }
    limiter.shutdown().await;
    Ok(())
}

/// Sends `POST path` over a plain HTTP/1.1 connection and returns the status line.
async fn post_status(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(addr).await?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let response = String::from_utf8_lossy(&response);
    Ok(response.lines().next().unwrap_or_default().to_owned())
}
