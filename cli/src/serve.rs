//! The demo's HTTP server: the router on hyper's HTTP/1 connections, with a bound on how long a
//! client may take over a request's headers.
//!
//! `axum::serve` sets no timer on its connections, so a client that opens a connection and sends
//! half a request line (or nothing) holds its socket and task for as long as it likes: a
//! thousand such clients held a thousand sockets of the demo for the whole minute they were
//! watched. Here each connection's header read is bounded by [`HEADER_READ_TIMEOUT`]: hyper
//! starts the clock when it waits for a request's head, whether the connection is new or idle
//! between two requests on a kept-alive connection, so the same bound closes idle connections
//! too. A request whose head arrived in time is served however long its handler takes.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tower_service::Service as _;

/// How long a connection may take to send a request's headers, and how long it may stay idle
/// between requests, before the demo closes it.
pub(crate) const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves `app` on `listener` (the remote address reaches handlers as `ConnectInfo<SocketAddr>`)
/// until `shutdown` resolves; then stops accepting, lets each connection finish the request it
/// is serving, and returns when every connection has closed. A connection that does not send a
/// request's head within `header_timeout` of the server waiting for one is closed.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    header_timeout: Duration,
    shutdown: impl Future<Output = ()>,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    let graceful = GracefulShutdown::new();
    let mut make = app.into_make_service_with_connect_info::<SocketAddr>();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, remote) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, or a connection reset before it was accepted:
                    // try again shortly rather than spin or stop serving.
                    eprintln!("tokenlease demo: accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let service = match make.call(remote).await {
            Ok(service) => service,
            Err(never) => match never {},
        };
        let connection =
            http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            // A client that goes away, or is timed out, ends its connection with an error: that
            // is the connection's business, not the server's.
            let _ = connection.await;
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use axum::Router;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpStream;
    use tokio::time::Instant;

    /// How many half-open connections the test opens.
    const CONNECTIONS: usize = 200;

    /// Reads until the server closes the connection (EOF or a reset); what it read.
    async fn until_closed(stream: &mut TcpStream) -> Vec<u8> {
        let mut seen = Vec::new();
        let mut buf = [0u8; 1024];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return seen,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
    }

    /// F3: connections that send half a request line, or a whole request and then nothing, are
    /// closed once the header-read timeout has passed, and not before; a request sent in time
    /// is answered. Under tokio's paused clock the 5 s pass at once (the server's timer is
    /// tokio's), and without the timeout the reads would wait forever: the 60 s bound on them
    /// would fail the test.
    #[tokio::test(start_paused = true)]
    async fn f3_half_open_and_idle_connections_are_closed_after_the_header_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route("/", get(|| async { "ok" }));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(super::serve(
            listener,
            app,
            super::HEADER_READ_TIMEOUT,
            async {
                let _ = stopped.await;
            },
        ));

        let started = Instant::now();
        let mut half_open = Vec::with_capacity(CONNECTIONS);
        for _ in 0..CONNECTIONS {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            stream.write_all(b"GET /bookings/12").await.unwrap();
            half_open.push(stream);
        }
        // A whole request is answered, then its kept-alive connection idles.
        let mut idle = TcpStream::connect(addr).await.unwrap();
        idle.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 1024];
        let n = idle.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);

        let closed = tokio::time::timeout(Duration::from_secs(60), async {
            for stream in &mut half_open {
                until_closed(stream).await;
            }
            until_closed(&mut idle).await;
        })
        .await;
        let waited = started.elapsed();
        assert!(closed.is_ok(), "connections still open after {waited:?}");
        assert!(
            waited >= super::HEADER_READ_TIMEOUT && waited < super::HEADER_READ_TIMEOUT * 2,
            "closed after {waited:?}"
        );

        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the server stops")
            .unwrap();
    }
}
